"""`micro_batches: auto` (disagmoe/runtime/training/micro_batches.py): the split the roofline prices
fastest among those the memory model fits, for single and distributed runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagmoe.config import TrainConfig, load_train_config
from disagmoe.model_ref import load_model
from disagmoe.runtime.cluster.driver import largest_device_need, rank_needs, resolve_distributed_micro_batches
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.training.micro_batches import MEMORY_HEADROOM, candidates, choose, predicted_step_s, resolved
from disagmoe.runtime.training.trainer import single_peak_bytes, train_single

REPO = Path(__file__).resolve().parents[3]
H200 = 139.8 * 2**30
GiB = 2**30


def qwen3(*overrides: str, pairs: str = "off") -> TrainConfig:
    """The Qwen3 config in mode single, micro_batches auto; the expert weight gradients a micro-batch at a time
    unless `pairs` (the measurements these tests cite ran before `expert_wgrad_pairs`)."""
    return load_train_config(REPO / "configs/h200x2-qwen3-30b.yaml",
                             ["mode=single", "micro_batches=auto", f"expert_wgrad_pairs={pairs}", *overrides])


def single_need(cfg: TrainConfig) -> int:
    return sum(single_peak_bytes(cfg, load_model(cfg.model)))


def test_the_candidates_are_the_splits_into_whole_sequences_per_data_parallel_rank():
    tiny = dict(model="tiny", batch_size=12, micro_batches="auto")
    assert candidates(TrainConfig(**tiny, mode="single")) == [1, 2, 3, 4, 6, 12]
    assert candidates(TrainConfig(**tiny, mode="colocated", colocated_ranks=2)) == [1, 2, 3, 6]
    assert candidates(TrainConfig(**tiny, mode="colocated", colocated_ranks=4, pipeline_groups=2)) == [1, 2, 3, 6]
    assert candidates(TrainConfig(**tiny, mode="disaggregated", attention_ranks=4, pipeline_groups=2)) == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="multiple of them"):
        candidates(TrainConfig(**tiny, mode="colocated", colocated_ranks=5))


def test_the_fastest_split_that_fits_wins_and_the_note_says_why():
    """Qwen3-30B's config on one H200: one micro-batch of 16 sequences does not fit the 85%
    budget; of those that do, the roofline prices 2 fastest (fewer passes of the fp32 main-gradient
    traffic than 4, 8 or 16): the split measured fastest on the H200 among those that ran."""
    cfg = qwen3()
    choice = choose(cfg, load_model(cfg.model), single_need, H200)
    assert choice.micro_batches == 2
    tried = {c.micro_batches: c for c in choice.tried}
    assert not tried[1].fits and tried[1].need_bytes > MEMORY_HEADROOM * H200 >= tried[2].need_bytes
    assert tried[2].predicted_step_s < tried[4].predicted_step_s < tried[8].predicted_step_s
    assert tried[2].predicted_step_s == pytest.approx(predicted_step_s(
        cfg.model_copy(update={"micro_batches": 2}), load_model(cfg.model)))
    note = choice.note()
    assert note.startswith("micro_batches: auto -> 2 (92.1 GiB of the 118.8 GiB it may use")
    assert "1 needs 121.2 GiB" in note and "4 predicted" in note


def test_recomputation_and_bf16_moments_let_auto_take_fewer_larger_micro_batches():
    model = load_model(qwen3().model)
    plain = choose(qwen3(), model, single_need, 100 * GiB).micro_batches
    lean = choose(qwen3("recompute=selective", "optim.state_dtype=bf16"), model, single_need, 100 * GiB).micro_batches
    assert lean < plain


def test_an_fp8_recipe_holding_fewer_weight_copies_takes_fewer_micro_batches():
    """The H100 A/B of docs/benchmarks.md (Qwen3 config, bf16 moments, 79.2 GiB reported): FP8 with
    every weight copy took 8 micro-batches against bf16's 4; the gate/up forward alone with the bf16
    backward holds w13's forward copy only (2/3 byte a routed parameter, not 2) and takes bf16's 4."""
    h100 = 79.2 * GiB
    ab = ("optim.state_dtype=bf16", "hardware=h100-sxm")
    fp8 = ("precision=fp8", "fp8_dense=false")
    split = {name: choose(cfg, load_model(cfg.model), single_need, h100).micro_batches for name, cfg in (
        ("bf16", qwen3(*ab)), ("every copy", qwen3(*ab, *fp8)),
        ("gate-up, bf16", qwen3(*ab, *fp8, "fp8_expert_forward=gate-up", "fp8_expert_backward=bf16")))}
    assert split == {"bf16": 4, "every copy": 8, "gate-up, bf16": 4}


def test_without_hardware_to_price_on_the_fewest_that_fit_win():
    cfg = TrainConfig(model="tiny", mode="single", batch_size=8, micro_batches="auto")
    need = {1: 90, 2: 50, 4: 30, 8: 20}
    choice = choose(cfg, load_model("tiny"), lambda split: need[split.micro_batches], 70 / MEMORY_HEADROOM)
    assert choice.micro_batches == 2 and "no hardware preset" in choice.note()


def test_nothing_fitting_is_refused_with_the_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"even 16 micro-batches .* need 66\.\d GiB.*recompute: selective"):
        choose(qwen3(), load_model(qwen3().model), single_need, 60 * GiB)
    lean = qwen3("recompute=full", "optim.state_dtype=bf16")  # only the knobs not in use are named
    with pytest.raises(ValueError, match=r"lower seq_len, offload_optimizer: true, or a layout") as err:
        choose(lean, load_model(lean.model), single_need, 40 * GiB)
    assert "recompute" not in str(err.value) and "state_dtype" not in str(err.value)


def test_the_refusal_names_expert_wgrad_pairs_off_where_the_run_asked_for_the_pairs():
    """`expert_wgrad_pairs: on` (the waiting rows counted in every split, `resolve_wgrad_pairs`): the knobs are
    those of the splits tried (micro_batches a number, where the pairs apply), so the refusal names turning
    them off; auto, which drops the pairs where they do not fit, and off do not."""
    from disagmoe.runtime.training.trainer import resolve_single_micro_batches

    for pairs, named in (("on", True), ("auto", False), ("off", False)):
        lean = qwen3("recompute=full", "optim.state_dtype=bf16", pairs=pairs)
        with pytest.raises(ValueError, match=r"lower seq_len, .*or a layout") as err:
            resolve_single_micro_batches(lean, load_model(lean.model), None, 40 * GiB)
        assert ("expert_wgrad_pairs: off, " in str(err.value)) == named, (pairs, str(err.value))


def test_each_split_takes_paired_weight_gradients_where_their_waiting_rows_fit():
    """`expert_wgrad_pairs: auto` through `resolve_single_micro_batches`: each split is measured and priced with
    the pairs where its peak with one micro-batch's waiting expert rows fits the budget, else without; on one
    H200 the Qwen3 config keeps 2 micro-batches with the pairs, and on a device that fits 2 only without them,
    2 without them."""
    from disagmoe.runtime.training.trainer import resolve_single_micro_batches

    cfg = qwen3(pairs="auto")
    model = load_model(cfg.model)
    chosen, choice = resolve_single_micro_batches(cfg, model, None, H200)
    assert (chosen.micro_batches, chosen.expert_wgrad_pairs, chosen.pairs_expert_wgrads) == (2, "auto", True)
    two = {c.micro_batches: c for c in choice.tried}[2]
    alone = sum(single_peak_bytes(qwen3("micro_batches=2"), model))
    assert two.need_bytes > alone  # the waiting rows counted
    tight = (alone + 1 * GiB) / MEMORY_HEADROOM
    _, choice = resolve_single_micro_batches(cfg, model, None, tight)
    two = {c.micro_batches: c for c in choice.tried}[2]
    assert choice.micro_batches == 2 and two.need_bytes == alone


def test_a_number_given_stays():
    cfg = qwen3("micro_batches=8")
    assert resolved(cfg, load_model(cfg.model), single_need, H200) == (cfg, None)


@pytest.mark.slow  # the first rank model on meta imports torch._dynamo: ~10 s on 2 cores
def test_a_distributed_split_is_checked_against_its_fullest_device():
    """Disaggregated 1A+1E on CPU (every rank on this host): the need is all ranks' together, and
    the chosen split's ranks fit what the driver's own check counts."""
    cfg = TrainConfig(model="tiny", mode="disaggregated", batch_size=8, seq_len=32, micro_batches="auto",
                      transport="local")
    model = load_model("tiny")
    split, choice = resolve_distributed_micro_batches(cfg, model)
    assert split.micro_batches == choice.micro_batches and split.micro_batches in candidates(cfg)
    needs = rank_needs(split, model, Topology.from_config(split, model))
    assert largest_device_need(split, model) == sum(n.total_bytes for n in needs)


def test_the_single_trainer_runs_the_split_auto_chose(tmp_path):
    summary = train_single(TrainConfig(model="tiny", mode="single", steps=2, batch_size=4, seq_len=32,
                                       micro_batches="auto", eval_every=0, cpu_threads=1,
                                       out_dir=str(tmp_path / "run")))
    assert summary.micro_batches == 1 and summary.micro_batches_note.startswith("micro_batches: auto -> 1")


def test_auto_in_the_config_is_refused_with_both_choices_named():
    with pytest.raises(ValueError, match=r"micro_batches: Input should be greater than 0 \(or 'auto'\)"):
        load_train_config(REPO / "configs/tiny-cpu.yaml", ["micro_batches=0"])
