"""Per-rank activation peaks from the schedule (disagmoe/runtime/activation_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.roofline import memory as mem
from disagmoe.runtime.activation_memory import RankActivations, rank_activations, replay_peak
from disagmoe.runtime.schedule.schedule import AttentionBackward, AttentionForward, Loss
from disagmoe.runtime.topology import Topology


def config(**fields) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="disaggregated", batch_size=8, seq_len=16, micro_batches=4,
                attention_ranks=1, expert_ranks=1, out_dir="unused")
    return TrainConfig(**{**base, **fields})


def test_a_forward_holds_until_its_backward_and_compute_ops_hold_their_own_span():
    program = (AttentionForward(0, 0), AttentionForward(0, 1), Loss(0), AttentionBackward(0, 0),
               AttentionBackward(0, 1), AttentionForward(1, 0))
    kept = {AttentionForward(0, 0): 10, AttentionForward(0, 1): 20, AttentionForward(1, 0): 25}
    held = {Loss(0): 5, AttentionBackward(0, 0): 7, AttentionBackward(0, 1): 1}
    peak = replay_peak(program, lambda op: kept.get(op, 0), lambda op: held.get(op, 0))
    assert peak == RankActivations(37, 2, "AttentionBackward L0 mb0")  # 10 + 20 + 7; the last forward: 25


@pytest.mark.parametrize("fields", [dict(), dict(expert_ranks=2), dict(attention_ranks=2, expert_ranks=2),
                                    dict(mode="colocated", colocated_ranks=2),
                                    dict(mode="colocated", colocated_ranks=4, pipeline_groups=2),
                                    dict(mode="colocated", colocated_ranks=3, pipeline_groups=3),
                                    dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2)])
def test_every_forward_of_a_step_runs_before_the_first_backward_so_all_micro_batches_are_in_flight(fields):
    cfg = config(**fields)
    topology = Topology.from_config(cfg, cfg.model)
    for peak in rank_activations(cfg, cfg.model, topology):
        assert peak.micro_batches_in_flight == cfg.micro_batches
        assert peak.peak_bytes > 0


def test_an_attention_ranks_peak_is_all_its_layers_and_micro_batches_plus_the_larger_transient():
    cfg = config()
    m = cfg.model
    topology = Topology.from_config(cfg, m)
    attention, expert = rank_activations(cfg, m, topology)
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    kept = cfg.micro_batches * tokens * sum(mem.attention_bytes(m, topology.is_moe(l), 4) for l in range(m.num_layers))
    grads = tokens * max(mem.attention_grad_bytes(m, topology.is_moe(l), 4) for l in range(m.num_layers))
    assert attention.peak_bytes == kept + max(mem.head_bytes(m, tokens, 4), grads)
    # the expert rank keeps every pair's row and the combine's (compact hop), whatever its share
    rows = cfg.micro_batches * m.num_moe_layers * tokens * m.top_k * (mem.expert_row_bytes(m, 4)
                                                                      + mem.combine_bytes(m, 4) // m.top_k)
    assert expert.peak_bytes == rows + tokens * m.top_k * mem.expert_row_grad_bytes(m, 4)


def test_more_micro_batches_of_the_same_step_keep_the_same_activations_in_flight():
    """The disaggregated schedule keeps the whole step's activations: splitting it finer does
    not lower the peak (one process's gradient accumulation does)."""
    m = load_model("tiny")
    peaks = [max(p.peak_bytes for p in rank_activations(config(micro_batches=mb), m,
                                                        Topology.from_config(config(micro_batches=mb), m)))
             for mb in (1, 2, 4)]
    assert peaks[0] >= peaks[1] >= peaks[2] > 0.8 * peaks[0]


def test_pair_rows_drop_the_expert_ranks_combine_and_keep_the_attention_ranks_combined_output():
    cfg = config(micro_batches=1)
    topology = Topology.from_config(cfg, cfg.model)
    compact = rank_activations(cfg, cfg.model, topology)
    pairs = rank_activations(cfg, cfg.model, topology, pair_rows=True)
    assert pairs[1].peak_bytes < compact[1].peak_bytes
    assert pairs[0].peak_bytes > compact[0].peak_bytes


def test_the_runs_recomputation_reaches_the_replay_and_the_single_process_count():
    """`recompute: selective` (triton experts) lowers every rank's peak and one process's."""
    from disagmoe.runtime.activation_memory import single_activation_bytes

    model = load_model("tiny")
    base = dict(model=model, experts_backend="triton", batch_size=8, seq_len=64, micro_batches=2)
    plain, lean = TrainConfig(**base), TrainConfig(**base, recompute="selective")
    topology = Topology.from_config(plain, model)
    for a, b in zip(rank_activations(lean, model, topology), rank_activations(plain, model, topology), strict=True):
        assert a.peak_bytes <= b.peak_bytes
    assert sum(a.peak_bytes for a in rank_activations(lean, model, topology)) < sum(
        b.peak_bytes for b in rank_activations(plain, model, topology))
    assert single_activation_bytes(lean.model_copy(update={"mode": "single"}), model) < single_activation_bytes(
        plain.model_copy(update={"mode": "single"}), model)


def test_attention_recomputation_lowers_the_attention_ranks_peak_on_any_backend():
    """`recompute_modules: [attention]` (loop experts) lowers every attention rank's peak and one
    process's; the expert ranks keep what they kept."""
    from disagmoe.runtime.activation_memory import single_activation_bytes

    model = load_model("tiny")
    base = dict(model=model, batch_size=8, seq_len=64, micro_batches=2)
    plain, lean = TrainConfig(**base), TrainConfig(**base, recompute="selective", recompute_modules=["attention"])
    topology = Topology.from_config(plain, model)
    for rank, (a, b) in enumerate(zip(rank_activations(lean, model, topology),
                                      rank_activations(plain, model, topology), strict=True)):
        if topology.attention_role(rank) is not None:
            assert a.peak_bytes < b.peak_bytes, rank
        else:
            assert a.peak_bytes == b.peak_bytes, rank
    assert single_activation_bytes(lean.model_copy(update={"mode": "single"}), model) < single_activation_bytes(
        plain.model_copy(update={"mode": "single"}), model)


@pytest.mark.parametrize("name, seq_len, layout", [
    ("qwen3-30b-a3b", 1024, dict(attn=4, expert=2, p=1, m=4, seqs=2)),
    ("qwen3-30b-a3b", 1024, dict(attn=4, expert=4, p=1, m=2, seqs=1, sets=2)),  # a token goes to its set's GPUs
    ("qwen3-30b-a3b", 1024, dict(attn=4, expert=4, p=2, m=4, seqs=1)),
    ("deepseek-v3", 1024, dict(attn=2, expert=8, p=1, m=2, seqs=1)),  # leading dense layers
    ("qwen3-235b-a22b", 16384, dict(attn=48, expert=24, p=3, m=8, seqs=1)),  # test_solver's 16K split
])
@pytest.mark.parametrize("recompute, modules", [("none", None), ("selective", None), ("selective", ["attention"]),
                                               ("selective", ["expert_input", "expert_output", "expert_swiglu",
                                                              "attention"]), ("full", None)])
@pytest.mark.parametrize("pairs", ["auto", "off"])
def test_the_planner_prices_the_activations_the_runtimes_memory_check_counts(name, seq_len, layout, recompute,
                                                                              modules, pairs):
    """A disaggregated plan applied to a run: the planner's activation bytes per attention GPU and per
    expert GPU equal the largest peak the runtime's check (`rank_activations`, as `check_fits`
    counts it) finds among that side's ranks, with each recomputation the plan records and the expert
    weight gradients paired or not as planner and driver settle `expert_wgrad_pairs` (auto: on here, the
    expert ranks' waiting rows replayed, `placement.waiting_rows`). The expert GPU holds every (token, k)
    pair of every attention GPU of its group, not its experts' share (`placement.cost.activations` says why);
    the 16K split shows the terabytes test_solver's memory-to-spare test steps around are the runtime's own
    count."""
    from disagmoe.config import ClusterConfig, PlanConfig, load_hardware
    from disagmoe.placement.cost import Candidates
    from disagmoe.placement.solver import price
    from disagmoe.runtime.plan_layout import apply_plan

    model = load_model(name)
    roomy = load_hardware("h200-sxm").model_copy(update={"hbm_gib": 1e6})  # the count, not the fit, is tested
    request = PlanConfig(model=model, cluster=ClusterConfig(hardware=roomy, num_gpus=72), seq_len=seq_len,
                         global_batch_tokens=1 << 22, recompute=recompute, recompute_modules=modules,
                         expert_wgrad_pairs=pairs)
    choice = price(request, Candidates.one(**layout))
    plan, cost = choice.plan, choice.cost
    assert plan.layout == "disaggregated" and plan.recompute == recompute
    assert plan.expert_wgrad_pairs == ("on" if pairs == "auto" else "off")
    if modules is not None:
        assert plan.recompute_modules == modules
    dp = layout["attn"] // layout["p"]
    cfg = TrainConfig(model=model, plan=plan, experts_backend="triton", precision="bf16", seq_len=seq_len,
                      batch_size=layout["m"] * dp * layout["seqs"], device="cuda", out_dir="unused")
    run = apply_plan(cfg, model)  # the plan's on as auto, which pairs wherever it applies and the rows fit
    assert run.recompute == recompute and run.micro_batches == layout["m"]
    assert run.pairs_expert_wgrads == (plan.expert_wgrad_pairs == "on")
    assert run.recompute_set == (mem.FULL if recompute == "full" else frozenset(plan.recompute_modules))
    topology = Topology.from_config(cfg, model)
    peaks = rank_activations(run, model, topology)
    attention = [p.peak_bytes for r, p in enumerate(peaks) if topology.attention_role(r) is not None]
    expert = [p.peak_bytes for r, p in enumerate(peaks) if topology.expert_role(r) is not None]
    assert (len(attention), len(expert)) == (layout["attn"], layout["expert"])
    assert cost.attn_act_bytes[0] == max(attention)
    assert cost.expert_act_bytes[0] == max(expert)


@pytest.mark.parametrize("name, layout", [
    ("qwen3-30b-a3b", dict(attn=4, expert=2, p=1, m=4, seqs=2)),
    ("deepseek-v3", dict(attn=2, expert=8, p=1, m=2, seqs=1)),  # leading dense layers
    ("mixtral-8x7b", dict(attn=4, expert=2, p=1, m=3, seqs=1)),  # the all-FP8 first backward of a pair holds more
])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("backward", [None, "fp8", "bf16"])
def test_the_planner_prices_the_fp8_experts_activations_the_runtimes_memory_check_counts(name, layout, recompute,
                                                                                      backward):
    """The same agreement with FP8 experts (`expert_precision: fp8`, the run's `precision: fp8`): the
    rows' FP8 terms on both sides, the backward's by the run's recipe (`fp8_expert_backward`, None:
    the default on both), and selective's modules those the FP8 experts drop; the expert ranks' weight
    gradients paired as planner and driver settle auto (on: the all-FP8 backward pairs its token-group copies,
    counted as those copies on both sides, its first backward of a pair holding its w2 copies through its span
    where that passes its own peak: `memory.paired_first_held_bytes` without the fused e4m3 copies, which a
    distributed rank does not write: 12,352 bytes a row at Mixtral's shape under the all-FP8 backward, none at
    Qwen3's)."""
    from disagmoe.config import ClusterConfig, PlanConfig, load_hardware
    from disagmoe.placement.cost import Candidates
    from disagmoe.placement.solver import price
    from disagmoe.runtime.plan_layout import apply_plan

    model = load_model(name)
    roomy = load_hardware("h200-sxm").model_copy(update={"hbm_gib": 1e6})
    request = PlanConfig(model=model, cluster=ClusterConfig(hardware=roomy, num_gpus=72), seq_len=1024,
                         global_batch_tokens=1 << 22, recompute=recompute, expert_precision="fp8",
                         **({} if backward is None else {"fp8_expert_backward": backward}))
    choice = price(request, Candidates.one(**layout))
    plan, cost = choice.plan, choice.cost
    assert plan.recompute_modules == (["expert_input", "expert_swiglu"] if recompute == "selective" else [])
    dp = layout["attn"] // layout["p"]
    assert plan.expert_wgrad_pairs == "on"
    cfg = TrainConfig(model=model, plan=plan, experts_backend="triton", precision="fp8", device="cuda",
                      transport="nvshmem", seq_len=1024, batch_size=layout["m"] * dp * layout["seqs"], out_dir="unused",
                      fp8_expert_backward=backward)
    run = apply_plan(cfg, model)
    assert run.pairs_expert_wgrads == (plan.expert_wgrad_pairs == "on")
    assert run.expert_precision == "fp8" and run.recompute_set == frozenset(plan.recompute_modules)
    assert run.expert_backward_precision == (backward or DEFAULT_FP8_EXPERT_BACKWARD)
    topology = Topology.from_config(cfg, model)
    peaks = rank_activations(run, model, topology)
    assert cost.attn_act_bytes[0] == max(p.peak_bytes for r, p in enumerate(peaks)
                                         if topology.attention_role(r) is not None)
    assert cost.expert_act_bytes[0] == max(p.peak_bytes for r, p in enumerate(peaks)
                                           if topology.expert_role(r) is not None)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("micro_batches", [3, 4])
def test_the_planner_adds_a_colocated_ranks_waiting_rows_as_the_runtimes_memory_check_counts(recompute,
                                                                                             micro_batches):
    """A colocated plan of one pipeline group applied to a run: the planner prices a colocated GPU as one
    process's conservative count (`placement.cost.activations`), and what paired expert weight gradients add
    to it is what they add to the runtime's check of every rank (`rank_activations`, on against off)."""
    from disagmoe.config import ClusterConfig, PlanConfig, load_hardware
    from disagmoe.placement.cost import Candidates
    from disagmoe.placement.solver import price
    from disagmoe.runtime.plan_layout import apply_plan

    model = load_model("qwen3-30b-a3b")
    roomy = load_hardware("h200-sxm").model_copy(update={"hbm_gib": 1e6})
    layout = Candidates.one(0, 4, 1, micro_batches, 1, colocated=True)

    def planned(pairs: str) -> tuple:
        request = PlanConfig(model=model, cluster=ClusterConfig(hardware=roomy, num_gpus=4), seq_len=1024,
                             global_batch_tokens=1 << 22, recompute=recompute, expert_wgrad_pairs=pairs)
        choice = price(request, layout)
        cfg = TrainConfig(model=model, plan=choice.plan, experts_backend="triton", precision="bf16", seq_len=1024,
                          batch_size=micro_batches * 4, device="cuda", out_dir="unused")
        run = apply_plan(cfg, model)
        assert run.mode == "colocated" and run.pairs_expert_wgrads == (pairs == "auto")
        return choice.cost.attn_act_bytes[0], max(p.peak_bytes for p in rank_activations(
            run, model, Topology.from_config(run, model)))

    (planner_on, runtime_on), (planner_off, runtime_off) = planned("auto"), planned("off")
    assert planner_on - planner_off == runtime_on - runtime_off
    # the rows raise the peak where full recomputation keeps little and an odd count's last rows pile up
    assert (planner_on > planner_off) == (recompute == "full" and micro_batches % 2 == 1)
    assert planner_on >= runtime_on


def test_sparse_dispatch_holds_a_copy_of_the_rows_per_expert_rank_for_the_forwards_span(monkeypatch):
    """8 expert ranks: over send/recv the attention rank's forward of a MoE layer holds the staged
    messages' bytes (rows, ids, weights, token index) for its span; by peer stores none. (Its peak
    is in the backward, where it stages COMBINE_GRAD's dy: the next test.)"""
    import disagmoe.runtime.activation_memory as am

    m = load_model("tiny").model_copy(update={"vocab_size": 32})
    cfg = config(micro_batches=1, expert_ranks=8, model=m)
    topology = Topology.from_config(cfg, m)
    held = {False: [], True: []}  # what each rank's `held` gives the forward, in rank order (at its replay)
    real = am.replay_peak
    rank = topology.attention_rank(0, 0)
    forward = next(op for op in topology.programs(1)[rank] if isinstance(op, AttentionForward) and op.layer == 2)
    for stores in (False, True):
        monkeypatch.setattr(am, "replay_peak", lambda program, kept, hold, waits=None, first_holds=None, _s=stores: (
            held[_s].append(hold(forward)), real(program, kept, hold, waits, first_holds))[1])
        rank_activations(cfg, m, topology, sparse=True, peer_stores=stores)
    tokens, row = 8 * 16, 4 * m.hidden_size + m.top_k * 8 + 4  # fp32 on CPU: row, ids, weights, token index
    assert held[False][rank] == 8 * tokens * row and held[True][rank] == 0
    expert_dense, expert_sparse = (rank_activations(cfg, m, topology, sparse=s)[1] for s in (False, True))
    assert expert_dense == expert_sparse  # an expert rank keeps what it did


def test_sparse_partial_sums_keep_the_combined_output_and_stage_each_expert_ranks_dy():
    """With partial sums the combining attention rank keeps the sum of a MoE layer's received partial
    sums [T, H] and COMBINE's index per expert rank (int32 [Q, T]) until the backward, and the op
    posting COMBINE_GRAD (layer 2's backward, for layer 1) stages Q = 8 [T, H] dy messages over
    send/recv (by peer stores none: the kernel stores dy)."""
    m = load_model("tiny").model_copy(update={"vocab_size": 32})
    cfg = config(micro_batches=1, expert_ranks=8, model=m)
    topology = Topology.from_config(cfg, m)
    dense, staged, stored = (rank_activations(cfg, m, topology, sparse=s, peer_stores=p)[0]
                             for s, p in ((False, False), (True, False), (True, True)))
    tokens = 8 * 16
    assert staged.at_op == stored.at_op == dense.at_op == "AttentionBackward L2 mb0"
    assert stored.peak_bytes == dense.peak_bytes + tokens * (4 * m.hidden_size + 4 * 8)  # fp32 on CPU
    assert staged.peak_bytes == stored.peak_bytes + 8 * tokens * 4 * m.hidden_size


def test_sparse_dispatch_by_peer_stores_stages_only_a_colocated_ranks_own_message():
    """On nvshmem the dispatch kernel stores the rows into the peers' buffers: a disaggregated
    attention rank stages nothing (its peak is the dense one with the kept sum of the partial sums,
    where staging all 8 moved it); a
    colocated rank its own message only (its peak, an expert backward here, stays in between)."""
    m = load_model("tiny").model_copy(update={"vocab_size": 32})
    cfg = config(micro_batches=1, expert_ranks=8, model=m)
    topology = Topology.from_config(cfg, m)
    dense = rank_activations(cfg, m, topology)[0]
    combined = 8 * 16 * (4 * m.hidden_size + 4 * 8)  # the kept sum of a MoE layer's partial sums, its index
    stored = rank_activations(cfg, m, topology, sparse=True, peer_stores=True)[0]
    assert stored.peak_bytes == dense.peak_bytes + combined
    assert rank_activations(cfg, m, topology, sparse=True)[0].peak_bytes > dense.peak_bytes + combined
    cfg = config(micro_batches=1, mode="colocated", colocated_ranks=4, model=m)
    colocated = Topology.from_config(cfg, m)
    dense, staged, own = (rank_activations(cfg, m, colocated, sparse=s, peer_stores=p)[0].peak_bytes
                          for s, p in ((False, False), (True, False), (True, True)))
    assert dense <= own <= staged


def test_sparse_pair_rows_stage_each_expert_ranks_dy_in_the_op_posting_combine_grad():
    """With pair rows the combining attention rank routes dy to each expert rank in its dispatch
    order: over send/recv the op posting a MoE layer's COMBINE_GRAD (layer 2's backward, for layer
    1) holds Q = 8 [T, H] messages beside what it did; by peer stores none (the kernel stores dy)."""
    m = load_model("tiny").model_copy(update={"vocab_size": 32})
    cfg = config(micro_batches=1, expert_ranks=8, model=m)
    topology = Topology.from_config(cfg, m)
    dense, staged, stored = (rank_activations(cfg, m, topology, pair_rows=True, sparse=s, peer_stores=p)[0]
                             for s, p in ((False, False), (True, False), (True, True)))
    tokens = 8 * 16
    assert staged.at_op == dense.at_op == "AttentionBackward L2 mb0"
    assert staged.peak_bytes == dense.peak_bytes + 8 * tokens * 4 * m.hidden_size  # fp32 on CPU
    assert stored == dense


QWEN3_CONFIG = Path(__file__).parents[2] / "configs" / "h200x2-qwen3-30b.yaml"


@pytest.mark.parametrize("micro_batches", [2, 8])
def test_full_recomputation_keeps_the_least_on_the_qwen3_config_as_counted_by_hand(micro_batches):
    """configs/h200x2-qwen3-30b.yaml (bf16, 6 MoE layers, GQA with qk-norm, no shared experts, no
    z-loss): one process's peak under full < selective < none, every rank's under full below
    selective's with attention too, and one process's full peak counted here from the model's
    dimensions: each layer's input and routing, plus one layer recomputed whole with its gradients."""
    from disagmoe.config import load_train_config
    from disagmoe.runtime.activation_memory import single_activation_bytes

    cfg = load_train_config(str(QWEN3_CONFIG), ["mode=single", f"micro_batches={micro_batches}",
                                                "expert_wgrad_pairs=off"])  # (their rows: test_expert_wgrad_pairs.py)
    m = load_model(cfg.model)
    assert (cfg.compute_dtype_name, m.num_dense_layers, m.shared_ffn_size, m.router.z_loss_coef) == ("bf16", 0, 0, 0)
    none, selective, full = (single_activation_bytes(cfg.model_copy(update={"recompute": r}), m)
                             for r in ("none", "selective", "full"))
    assert full < selective < none
    H, K, F, E, L = m.hidden_size, m.top_k, m.expert_ffn_size, m.num_experts, m.num_layers
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    tokens = cfg.batch_size // micro_batches * cfg.seq_len
    kept = L * (2 * H + K * (8 + 8))  # per token: every layer's input (bf16) and routing (int64 ids and rows)
    # one layer whole, as the plain run keeps it: the two norms' inputs, the projections' input, q, k, v, the
    # core's output, q and k before qk-norm, the FFN-normed rows (bf16, which the router's gate reads too); the
    # log-sum-exp per head and the router's scores (fp32); the combine's K output rows; each pair's input row,
    # gate/up pre-activations and SwiGLU output
    layer = (2 * (3 * H + q + 2 * kv + q + (q + kv) + H) + 4 * (m.num_heads + E)
             + 2 * K * H + 2 * K * (H + 2 * F + F))
    grads = 2 * (q + 2 * kv + H) + 2 * K * (H + 2 * F)  # d y of q, k, v and the output; per pair d y and d h13
    assert tokens * (layer + grads) > mem.head_bytes(m, tokens, 2)  # the recomputed layer, not the head, on top
    assert full == tokens * (kept + layer + grads)
    disaggregated = cfg.model_copy(update={"mode": "disaggregated"})
    topology = Topology.from_config(disaggregated, m)
    everything = disaggregated.model_copy(update={"recompute": "selective", "recompute_modules": [
        "expert_input", "expert_output", "expert_swiglu", "attention"]})
    for lean, plain in zip(rank_activations(disaggregated.model_copy(update={"recompute": "full"}), m, topology),
                           rank_activations(everything, m, topology), strict=True):
        assert lean.peak_bytes < plain.peak_bytes
