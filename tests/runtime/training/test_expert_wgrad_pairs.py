"""`expert_wgrad_pairs`: the single trainer's expert weight gradients over pairs of micro-batches
(`kernels.wgrad_pairs`, `single_memory.resolve_wgrad_pairs`, the memory model's waiting rows)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from disagmoe.config import OptimConfig, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.roofline import memory as mem
from disagmoe.runtime.activation_memory import single_activation_bytes
from disagmoe.runtime.training.micro_batches import MEMORY_HEADROOM
from disagmoe.runtime.training.trainer import resolve_wgrad_pairs, single_peak_bytes


def _cfg(**overrides) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="single", experts_backend="triton", batch_size=8, seq_len=32,
                micro_batches=4, steps=2, eval_every=0, cpu_threads=1, precision="bf16")
    return TrainConfig(**{**base, **overrides})


def test_pairs_apply_to_the_single_trainers_triton_experts_with_main_gradients_only():
    assert _cfg().pairs_expert_wgrads and _cfg().expert_wgrad_pairs_unavailable is None
    assert not _cfg(micro_batches=1).pairs_expert_wgrads  # nothing to pair
    assert not _cfg(expert_wgrad_pairs="off").pairs_expert_wgrads
    assert not _cfg(experts_backend="grouped_mm").pairs_expert_wgrads
    fp32 = _cfg(precision="fp32")  # fp32 moments too: torch's AdamW on autograd's gradients
    assert "torch's AdamW" in fp32.expert_wgrad_pairs_unavailable and not fp32.pairs_expert_wgrads
    assert _cfg(precision="fp32", optim=OptimConfig(state_dtype="bf16")).pairs_expert_wgrads  # the flat path
    assert _cfg(precision="fp8", device="cuda").pairs_expert_wgrads  # bf16-wgrad: the bf16 weight-gradient kernel
    # the all-FP8 backward pairs its token-group copies (`wgrad_pairs.fp8_weight_grad_into`)
    assert _cfg(precision="fp8", device="cuda", fp8_expert_backward="fp8").pairs_expert_wgrads
    assert _cfg(expert_wgrad_pairs=True).expert_wgrad_pairs == "on"  # YAML's bare on


def test_on_is_refused_with_the_fix_where_pairs_cannot_apply():
    with pytest.raises(ValidationError, match="expert_wgrad_pairs: on does not apply here: experts_backend loop"
                                              ".*set expert_wgrad_pairs: auto"):
        _cfg(experts_backend="loop", expert_wgrad_pairs="on")
    # the distributed modes pair too: each expert rank its own launches (`runtime.cluster.worker`)
    assert _cfg(mode="colocated", colocated_ranks=2, expert_wgrad_pairs="on").pairs_expert_wgrads


def test_the_memory_model_holds_one_micro_batchs_expert_rows_beside_the_next():
    """The waiting rows: every MoE layer's K rows of x, dy (H each), act (F) and d h13 (2F) per token of a
    micro-batch, in the compute dtype, on top of one micro-batch's activations."""
    cfg = _cfg()
    m = load_model(cfg.model) if isinstance(cfg.model, str) else cfg.model
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    waiting = (single_activation_bytes(cfg, m)
               - single_activation_bytes(cfg.model_copy(update={"expert_wgrad_pairs": "off"}), m))
    per_token = m.num_moe_layers * m.top_k * (2 * m.hidden_size + 3 * m.expert_ffn_size) * 2  # bf16
    assert waiting == tokens * per_token == m.num_moe_layers * mem.paired_wgrad_waiting_bytes(
        m, tokens * m.top_k, m.num_experts, 2) > 0


def test_under_the_all_fp8_backward_the_waiting_rows_are_its_token_group_copies():
    """`fp8_expert_backward: fp8` pairs its e4m3 token-group copies of the four operands: one byte a value and
    an fp32 scale per 128 rows of a column, each expert group padded to 128 rows (`fp8.padded_capacity`), not
    the bf16 rows (the count before put the Mixtral config's measured all-FP8 peak 2.1 GiB under the predicted)."""
    cfg = _cfg(precision="fp8", device="cuda", fp8_expert_backward="fp8")
    m = load_model(cfg.model) if isinstance(cfg.model, str) else cfg.model
    rows = cfg.batch_size // cfg.micro_batches * cfg.seq_len * m.top_k
    waiting = (single_activation_bytes(cfg, m)
               - single_activation_bytes(cfg.model_copy(update={"expert_wgrad_pairs": "off"}), m))
    values = 2 * m.hidden_size + 3 * m.expert_ffn_size
    padded = -(-(rows + 127 * m.num_experts) // 128) * 128
    assert waiting == m.num_moe_layers * values * (padded + padded // 128 * 4) > 0
    bf16_rows = m.num_moe_layers * mem.paired_wgrad_waiting_bytes(m, rows, m.num_experts, 2)
    assert waiting == m.num_moe_layers * mem.paired_wgrad_waiting_bytes(m, rows, m.num_experts, 2, True) != bf16_rows
    # the default FP8 recipe (bf16 weight gradients) keeps its bf16 rows waiting
    default = _cfg(precision="fp8", device="cuda")
    assert (single_activation_bytes(default, m)
            - single_activation_bytes(default.model_copy(update={"expert_wgrad_pairs": "off"}), m)) == bf16_rows


def test_auto_turns_pairs_off_where_the_waiting_rows_do_not_fit_and_says_so():
    cfg = _cfg()
    m = cfg.model
    with_rows = sum(single_peak_bytes(cfg, m))
    without = sum(single_peak_bytes(cfg.model_copy(update={"expert_wgrad_pairs": "off"}), m))
    on, note = resolve_wgrad_pairs(cfg, m, capacity_bytes=with_rows / MEMORY_HEADROOM)
    assert on.expert_wgrad_pairs == "on" and on.pairs_expert_wgrads
    assert note.startswith("expert_wgrad_pairs: auto -> on: each expert weight gradient runs 2 times a step over "
                           "4 micro-batches' rows")
    off, note = resolve_wgrad_pairs(cfg, m, capacity_bytes=(with_rows + without) / 2 / MEMORY_HEADROOM)
    assert off.expert_wgrad_pairs == "off" and not off.pairs_expert_wgrads
    assert note.startswith("expert_wgrad_pairs: auto -> off: one micro-batch's waiting expert rows")
    asked, note = resolve_wgrad_pairs(cfg.model_copy(update={"expert_wgrad_pairs": "on"}), m, capacity_bytes=1)
    assert asked.pairs_expert_wgrads and note.startswith("expert_wgrad_pairs: on: each expert weight gradient runs 2")
    assert resolve_wgrad_pairs(_cfg(experts_backend="loop"), m, capacity_bytes=1) == (
        _cfg(experts_backend="loop", expert_wgrad_pairs="off"), None)  # does not apply: quietly off
    odd, note = resolve_wgrad_pairs(_cfg(micro_batches=8, batch_size=24, expert_wgrad_pairs="on")
                                    .model_copy(update={"micro_batches": 3}), m, capacity_bytes=with_rows * 10)
    assert "runs 2 times a step over 3 micro-batches' rows (its fp32 main gradient read and written 2 times, not 3)" in note


@pytest.mark.slow  # two runs of two steps of the Triton experts in the interpreter
def test_paired_steps_train_as_unpaired_ones_to_fp32_rounding(interpreted, tmp_path):
    """The fast path (fp32 parameters, bf16 moments: the interpreter runs fp32) with the triton experts on CPU,
    three micro-batches (a pair and one alone), two steps: losses, grad norms and parameters with
    expert_wgrad_pairs on equal off's to fp32 rounding, and the summary says which ran."""
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.wgrad_pairs", "disagmoe.kernels.moe_ffn")
    runs = {}
    for pairs in ("off", "on"):
        cfg = _cfg(steps=2, batch_size=6, micro_batches=3, seq_len=12, precision="fp32", expert_wgrad_pairs=pairs,
                   checkpoint_at_end=False, out_dir=str(tmp_path / pairs),
                   optim=OptimConfig(lr=3e-3, warmup_steps=1, grad_clip=0.5, state_dtype="bf16"))
        trainer = SingleProcessTrainer(cfg)
        assert trainer.cfg.pairs_expert_wgrads == (pairs == "on")
        records = [trainer._train_one_step() for _ in range(2)]
        facts = trainer.run_facts()
        assert facts["expert_wgrad_pairs"] == (pairs == "on")
        assert (facts["expert_wgrad_pairs_note"] or "").startswith("expert_wgrad_pairs: on" if pairs == "on" else "")
        runs[pairs] = ([(r["loss"], r["grad_norm"]) for r in records],
                       [b.master_S.clone() for b in trainer.optimizer.buckets])
    for (loss_off, norm_off), (loss_on, norm_on) in zip(runs["off"][0], runs["on"][0], strict=True):
        assert loss_on == pytest.approx(loss_off, rel=1e-6) and norm_on == pytest.approx(norm_off, rel=1e-5)
    for off, on in zip(runs["off"][1], runs["on"][1], strict=True):
        torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8"])
def test_a_run_counting_every_step_holds_no_fused_e4m3_copies(backward):
    """The single trainer's memory check counts d h13's e4m3 rows from the split SwiGLU-gradient pass
    (`memory.fp8_expert_row_grad_bytes`' fused_copies) only where some steps do not count their FP8 numerics
    (`fp8_counters_every` unset: every 10th counts); `fp8_counters_every: 1` quantises d h13 in a pass on every
    step, after the w2 gradient, so its peak is the model's without them (at Mixtral's shape and 8,192 tokens a
    micro-batch a MoE layer's backward is the peak, past the head's, its d h13 GEMM's half either way: exactly 2F
    e4m3 values a row less)."""
    m = load_model("mixtral-8x7b")
    cfgs = {every: _cfg(model=m, seq_len=4096, precision="fp8", device="cuda", fp8_expert_backward=backward,
                        fp8_counters_every=every, expert_wgrad_pairs="off") for every in (None, 1)}
    assert cfgs[None].counters_every > 1 and cfgs[1].counters_every == 1
    peaks = {every: single_activation_bytes(cfg, m) for every, cfg in cfgs.items()}
    tokens = cfgs[1].batch_size // cfgs[1].micro_batches * cfgs[1].seq_len
    rows = {fused: mem.fp8_expert_row_grad_bytes(m, 2, False, backward, fused) for fused in (True, False)}
    assert rows[True] > rows[False]
    assert peaks[None] - peaks[1] == tokens * m.top_k * (rows[True] - rows[False])
