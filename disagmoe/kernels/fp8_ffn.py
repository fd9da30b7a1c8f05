"""The expert FFN (SwiGLU) with every GEMM in FP8 (`kernels.fp8`), forward and backward: the
recipe end to end at one layer, before it moves into the megakernel (issue 21 item 2).

Legend: N rows (token-expert pairs grouped by expert), E experts, H hidden size, F expert FFN size;
`offsets_E` int32 cumulative row counts (or G = bands x E row groups, group g using expert g mod E);
`w13_EH2F` gate in [..., :F], up in [..., F:]; `w2_EFH` the down projection (grouped_gemm's layout).

Forward: x rows quantised 1 x 128 (or given so: `permute.quantize_then_permute`); gate/up GEMM
whose epilogue applies SwiGLU and quantises its output for the down GEMM; down GEMM, bf16 out.
Backward: dy quantised 1 x 128 and 128 x 1 along tokens (`_quantize_both_ways`; its 1 x 128 rows
written by the combine's backward instead where it hands them over, `permute.Fp8RowGradSlot`); the
down GEMM's data gradient against w2^T with the SwiGLU derivative in its epilogue (also recomputing
silu(gate) * up); dh13 quantised both ways (its 1 x 128 rows written by the split SwiGLU-gradient pass
instead where it runs), its rows for the gate/up data gradient against w13^T; act and x quantised 128 x 1
along tokens; the two weight gradients (fp32, or added into fp32 main gradients). Launch order
and the e4m3 copies alive at each launch: `fp8_ffn_backward`.
Passes still separate from the kernel that produces their input (each reads a bf16 tensor once
more): the token-group copies of dy, dh13, act and x, and the 1 x 128 rows of dy and dh13 where no
kernel before them writes those (a step that counts its numerics, a GPU without the split pass).
`stats` (`fp8_stats.Fp8Stats`, optional everywhere): every quantisation adds its counters, by kind
(x and act: activations; dy and dh13: gradients; the weight copies: weights).

What the forward keeps: x's grouped rows (the w13 gradient quantises them along tokens: the
forward's 1 x 128 e4m3 rows cannot give those bits) and the pre-activations h13; never the SwiGLU
output, which the backward's dgrad epilogue recomputes from h13 in every run. Selective
recomputation (`TrainConfig.recompute`, `kernels.recompute.FP8_RECOMPUTABLE`): `expert_input`
keeps the tokens x [T, H] the rows were gathered from and each row's token (`RowSource`, K times
smaller) instead of the rows. The all-FP8 backward's token-group quantiser reads each row from its
token in place (`fp8.quantize_token_groups`' rows_M): the same bits as quantising the kept rows,
no [N, H] copy written, and each quantisation still counted once (the backward quantises x along
tokens in the plain run too; nothing the forward quantised is quantised again). The bf16-wgrad
(default) and bf16 backwards gather the rows again into an [N, H] copy (`RowSource.rows`) for
their bf16 w13 gradient: bf16-wgrad right before that GEMM, alive beside d h13 until it returns;
bf16 before its whole backward (`roofline.memory.fp8_expert_row_grad_bytes` counts both). Given
x's e4m3 rows too (`x_fp8`, a gate/up GEMM in FP8), nothing reads the grouped bf16 rows at all:
the caller need not write them (`UnwrittenRows`, `bf16_rows_reader`), and the FFN sums their
gradient per token. `expert_swiglu` drops nothing more (the SwiGLU output is never kept).
`expert_output` is not built: there is no fused FP8 combine (`recompute.FP8_NO_EXPERT_OUTPUT`).

`emulate` (`TrainConfig.fp8_emulate`, a numerics check, backward "bf16" only): the forward's FP8
GEMMs as their operands' quantise-dequantise images in the bf16 experts' GEMMs (`_emulated_forward`:
the same quantisers, scales and counters, no FP8 kernel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch

from disagmoe.config import (DEFAULT_FP8_EXPERT_BACKWARD, DEFAULT_FP8_EXPERT_FORWARD, FP8_EXPERT_BACKWARDS,
                              FP8_EXPERT_FORWARDS, FP8_WEIGHT_COPIES, fp8_weight_copies)
from disagmoe.kernels import fp8
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels import permute as pm
from disagmoe.kernels.fp8_stats import ACTIVATIONS, GRADIENTS, WEIGHTS, Fp8Stats
from disagmoe.kernels.moe_ffn import FFNTiles, main_grad_of, moe_ffn_backward
from disagmoe.kernels.recompute import (EXPERT_INPUT, EXPERT_OUTPUT, FP8_NO_EXPERT_OUTPUT, FP8_RECOMPUTABLE, RowSource,
                                        UnwrittenRows)
from disagmoe.kernels.tile_configs import TileConfig, device_architecture, tuned
from disagmoe.kernels.wgrad_pairs import fp8_weight_grad_into, weight_grad_into


# The routed experts' backward GEMMs: "fp8" (all four in e4m3: the data gradients 1 x 128, the weight
# gradients over 128 x 1 token groups, `fp8.fp8_weight_grad`), "bf16-wgrad" (the weight gradients
# the bf16 experts' GEMM on the bf16 rows, torchao's "high-precision weight gradient" recipes: the
# input rows gathered again from their tokens under expert_input; the data gradients FP8) or "bf16"
# (the whole backward the bf16 experts' `moe_ffn.moe_ffn_backward` from the FP8 forward's
# pre-activations: only the forward in FP8).
BACKWARD_PRECISIONS = FP8_EXPERT_BACKWARDS
# The default, "bf16-wgrad": on an H200 (session 19) it gave the expert block 1.09x / 1.12x our bf16
# fwd+bwd on the mixtral-8x7b / deepseek-v3-ep8 rows of `bench experts` where "fp8" gave 0.96x /
# 0.89x (the token-group quantisations and the FP8 weight-gradient kernel cost more than the e4m3
# GEMM saves), and 200 steps of the Qwen3 config ended at the same loss as "fp8" (2.272 against
# 2.263) and as "bf16" (2.268): the loss FP8 gives up against bf16 comes from the FP8 forward.
DEFAULT_BACKWARD = DEFAULT_FP8_EXPERT_BACKWARD
# The forward's GEMMs in e4m3: "both" (the recipe), or one of them, "gate-up" (x quantised 1 x 128 into
# the FP8 gate/up GEMM, its pre-activations h13 written bf16, silu(gate) * up and the down GEMM in bf16)
# or "down" (the bf16 gate/up GEMM with its SwiGLU epilogue, its output quantised 1 x 128 into the FP8
# down GEMM). Any backward takes any of them: each quantises the bf16 rows it holds (dy, d h13) and
# reads the forward's h13 however it was made. They split the loss FP8 costs by GEMM: 200 steps of the
# Qwen3 config (backward bf16, dense projections bf16) ended at bf16's loss with "down" and 5% above it
# with "both" and "gate-up"; "down" with the default backward and FP8 dense projections ended 5.8%
# above it (session 20, docs/benchmarks.md). Every one of those runs had the Gluon row GEMM on: with the
# Triton one (a run's default from session 28 to 34: `_GluonChoices`), "gate-up" ends at bf16's loss
# (session 28; session 29 put the gap inside the spread between runs).
FORWARD_GEMMS = FP8_EXPERT_FORWARDS
DEFAULT_FORWARD = DEFAULT_FP8_EXPERT_FORWARD


def check_backward(backward: str) -> None:
    """ValueError naming the choices unless `backward` is one of `BACKWARD_PRECISIONS`."""
    if backward not in BACKWARD_PRECISIONS:
        raise ValueError(f"FP8 experts' backward {backward!r}: choose one of {', '.join(BACKWARD_PRECISIONS)}")


def check_forward(forward: str) -> None:
    """ValueError naming the choices unless `forward` is one of `FORWARD_GEMMS`."""
    if forward not in FORWARD_GEMMS:
        raise ValueError(f"FP8 experts' forward GEMMs {forward!r}: choose one of {', '.join(FORWARD_GEMMS)}")


def check_emulate(emulate: bool, backward: str) -> None:
    """ValueError, with the fix, for an emulated forward (`TrainConfig.fp8_emulate`) under an FP8
    backward: only the forward's GEMMs are emulated (`_emulated_forward`), so its backward must be
    the bf16 one, or the check would still run the FP8 backward kernels."""
    if emulate and backward != "bf16":
        raise ValueError(f"the emulated FP8 experts (fp8_emulate) emulate the forward's GEMMs only; their FP8 "
                         f"backward kernels (backward {backward}) are not emulated: set fp8_expert_backward: bf16")


def bf16_rows_reader(forward: str, quantized: bool, rows_from_source: bool) -> str | None:
    """What reads x's bf16 rows in a call of forward `forward` (`FORWARD_GEMMS`), `quantized` with
    its rows given in e4m3 (`x_fp8`), `rows_from_source` with expert_input recomputed from a
    `RowSource` (any backward then reads the rows from the tokens); None where nothing does: the
    rows need not be written (`UnwrittenRows`)."""
    if forward == "down":
        return "the bf16 gate/up GEMM (forward down)"
    if not quantized:
        return "the forward's quantiser (no x_fp8 given)"
    if not rows_from_source:
        return "the backward, which keeps them (expert_input not recomputed from a RowSource)"
    return None


def _row(stats: Fp8Stats | None, kind: int) -> torch.Tensor | None:
    return None if stats is None else stats.row(kind)


@dataclasses.dataclass
class _GluonChoices:
    """Which Gluon paths the FFN's forwards from now on take; a forward's backward keeps the choices
    made at its forward. `rows`: the plain row GEMMs (down, gate/up data gradient, the gate/up GEMM
    of forward "gate-up") in `fp8_gluon.gluon_fp8_rows_gemm` (1.17-1.40x `fp8.fp8_rows_gemm` at its
    tuned tiles, the same bits on every operand tried outside training). `swiglu`: the two SwiGLU
    GEMMs split as a plain Gluon row GEMM and a pass of their own (`_gate_up_forward`,
    `_down_data_gradient`): the expert block 1.04-1.09x fwd+bwd over the fused Triton SwiGLU GEMMs on
    three shapes (`bench experts`, 2026-12-04, session 19). Both off here, the kernels' default; a
    run sets them (`TrainConfig.fp8_gluon`, `set_gluon`), on unless it says false since session 34
    (`config.RUN_FP8_GLUON`). Session 28's 200 steps of the Qwen3 config put the Gluon
    gate/up GEMM 6.6% above bf16's loss and the Triton one 0.5% below, but session 29 found two bf16
    runs of one command 7.9% apart, and its `test_gpu_training_*` tests (tests/kernels/test_fp8_gluon.py)
    found every Gluon launch of a captured training run equal to the Triton kernel's: the spread,
    not the kernel. After the consumer reorder (session 33) the default recipe's step with them took
    554.5 ms against 580.0 (one H100), and session 34's seeded 300-step run with them (and blockwise
    dense projections) ended 2.80% below bf16's loss. `wgrad` (off here; a run's with the others,
    `set_gluon`): the all-FP8 backward's weight gradients in `fp8_gluon.gluon_fp8_weight_grad`, slower
    than `fp8.fp8_weight_grad` until session 37 (the block 0.91-0.98x, session 19), which carried its
    scales in the ring and wrote its sums by TMA: the block with it 0.92x / 0.98x / 0.59x our bf16
    (Mixtral / DeepSeek-V3-EP8 / Qwen3 shapes) against 0.76x / 0.79x / 0.49x with the Triton one (one
    H100, same run), and 1.10x / 1.28x / 0.70x once the gradients it returns were written in the
    weights' bf16 (the default recipe 1.13x / 1.22x / 0.85x in that run; docs/benchmarks.md)."""

    rows: bool = False
    wgrad: bool = False
    swiglu: bool = False
    # the Gluon row GEMM's rows per tile: 128, or 256 (each consumer warpgroup two 64-row waves on one B
    # tile: half the L2 traffic of B; `bench experts --backend triton-fp8:gluon-256`); the same sums
    block_m: int = 128
    # the Gluon row GEMM's epilogue through shared memory and TMA (`fp8_gluon.gluon_fp8_rows_gemm(tma_store=True)`:
    # each 64-row wave inside its group stored by TMA under the next item's K loop, the rest masked as
    # without it; 128-row tiles only, `fp8_gluon.TMA_STORE_TILES`; `bench experts --backend
    # triton-fp8:gluon-tma-store`); the same sums, the same bits; a run's `TrainConfig.fp8_gluon_store` (`set_gluon`)
    tma_store: bool = False
    # not a Gluon path, an A/B of the same kind: the down-only forward's act quantised by the bf16 gate/up GEMM's
    # SwiGLU epilogue (`grouped_gemm.ragged_rows_gemm(quantized_out=)`, session 38: the same bytes), or written
    # in bf16 and quantised in a pass as before it (False; `bench experts --backend triton-fp8:down-forward-pass`,
    # `triton-fp8:run-act-pass` under a run's kernels). On: session 40 measured it (H100, its FMA division) even with
    # its pass on Mixtral's shape and 5% faster on Qwen3's alone (`bench quantise --epilogues`), and the run's block
    # 1.0% / 0.3% faster fwd+bwd with it (docs/benchmarks.md)
    act_epilogue: bool = True


_gluon = _GluonChoices()
GLUON_BLOCK_MS = (128, 256)  # the Gluon row GEMM's tiles a run may ask for (`fp8_gluon.BLOCK_MS` has 64 too)
GLUON_TMA_STORE_BLOCK_M = 128  # the one of them (at the FFN's 128 columns) whose TMA-store epilogue compiles clean


def set_gluon(enabled: bool, tma_store: bool = False, block_m: int | None = None) -> None:
    """The row GEMMs, the split SwiGLU GEMMs and (under the all-FP8 backward) the weight gradients in
    the Gluon kernels where they take the operands (True), or in the Triton ones (False, the kernels'
    default: `_GluonChoices`); with `tma_store` the Gluon row GEMM's epilogue stores by TMA (128-row
    tiles: the row tile is set to them); `block_m` (one of `GLUON_BLOCK_MS`; None: as it is, or 128 with
    `tma_store`) the Gluon row GEMM's rows per tile. A run's `TrainConfig.expert_gluon` (on unless it sets
    fp8_gluon: false), `expert_gluon_tma_store` and `expert_gluon_block_m`, set by its trainer and workers
    before their first forward. ValueError for a tile the TMA store or the kernel does not take."""
    if block_m is not None and (block_m not in GLUON_BLOCK_MS
                                or (enabled and tma_store and block_m != GLUON_TMA_STORE_BLOCK_M)):
        raise ValueError(f"block_m={block_m}: the Gluon row GEMM takes {GLUON_BLOCK_MS} rows a tile, and its TMA "
                         f"store {GLUON_TMA_STORE_BLOCK_M}: pass tma_store=False for 256")
    set_gluon_rows(enabled)
    set_gluon_swiglu(enabled)
    set_gluon_wgrad(enabled)
    _gluon.tma_store = enabled and tma_store
    if _gluon.tma_store:
        _gluon.block_m = GLUON_TMA_STORE_BLOCK_M
    elif block_m is not None:
        _gluon.block_m = block_m


def set_gluon_rows(enabled: bool) -> bool:
    """Run the FFN's plain FP8 row GEMMs with `fp8_gluon` where `fp8_gluon.takes` their operands
    (True), or always with `fp8.fp8_rows_gemm` (False, the default). Returns the previous
    setting."""
    previous, _gluon.rows = _gluon.rows, enabled
    return previous


def set_gluon_wgrad(enabled: bool) -> bool:
    """Run the all-FP8 backward's weight gradients with the Gluon kernel where `fp8_gluon.wgrad_takes`
    their operands (True; a run's with its other Gluon paths, `set_gluon`), or with `fp8.fp8_weight_grad`
    (False, the FFN's own default). Returns the previous setting."""
    previous, _gluon.wgrad = _gluon.wgrad, enabled
    return previous


def set_gluon_swiglu(enabled: bool) -> bool:
    """Run the gate/up GEMM and the down data gradient as the Gluon row GEMM plus their SwiGLU
    epilogue as a pass of its own where `fp8_gluon.takes` the operands (True), or as the Triton
    kernels with the epilogue fused (False, the default). Returns the previous setting."""
    previous, _gluon.swiglu = _gluon.swiglu, enabled
    return previous


@contextlib.contextmanager
def gluon_paths(**changes: bool | int) -> Iterator[None]:
    """The FFN's forwards inside take these `_GluonChoices` fields (e.g. wgrad=True), the others as
    they are; every field restored on exit (an A/B in `bench experts`)."""
    unknown = set(changes) - {field.name for field in dataclasses.fields(_GluonChoices)}
    if unknown:
        raise ValueError(f"Gluon paths {sorted(unknown)}: choose from rows, wgrad, swiglu, block_m, tma_store, "
                         "act_epilogue")
    wrong = {name: value for name, value in changes.items()
             if (name == "block_m" and value not in GLUON_BLOCK_MS) or (name != "block_m" and not isinstance(value, bool))}
    if wrong:
        raise ValueError(f"Gluon paths {wrong}: rows, wgrad, swiglu, tma_store and act_epilogue take True or False, "
                         f"block_m one of {GLUON_BLOCK_MS}")
    chosen = dataclasses.replace(_gluon, **changes)
    if chosen.tma_store and chosen.block_m != GLUON_TMA_STORE_BLOCK_M:
        raise ValueError(f"Gluon paths: tma_store=True runs the row GEMM at block_m={GLUON_TMA_STORE_BLOCK_M} "
                         f"(at {chosen.block_m} x 128 its epilogue spills: fp8_gluon.TMA_STORE_TILES); ask for "
                         f"block_m={GLUON_TMA_STORE_BLOCK_M} or tma_store=False")
    saved = dataclasses.replace(_gluon)
    for name, value in changes.items():
        setattr(_gluon, name, value)
    try:
        yield
    finally:
        for field in dataclasses.fields(_GluonChoices):
            setattr(_gluon, field.name, getattr(saved, field.name))


def kernel_paths(hidden: int, ffn: int, device: torch.device, *, rows: bool | None = None, wgrad: bool | None = None,
                 swiglu: bool | None = None, backward: str = DEFAULT_BACKWARD, forward: str = DEFAULT_FORWARD,
                 block_m: int | None = None, tma_store: bool | None = None, act_epilogue: bool | None = None) -> str:
    """Which kernels an FFN of this shape runs on `device` per GEMM role, as `_rows_gemm`,
    `_gate_up_forward`, `_down_data_gradient` and `_weight_grad` choose them (the Gluon ones on a
    Hopper GPU where K and N are multiples of 128 and the settings ask for them; `rows` / `wgrad` /
    `swiglu`: the settings, None as `set_gluon_rows` / `set_gluon_wgrad` / `set_gluon_swiglu` say
    now; `backward` (`BACKWARD_PRECISIONS`): bf16 weight gradients (the default), or a bf16
    backward; `forward` (`FORWARD_GEMMS`): one forward GEMM in bf16; `block_m`, `tma_store`: the Gluon
    row GEMM's tile and epilogue, None as `_GluonChoices` says now, named in its kernel's name:
    'gluon', 'gluon-256', 'gluon-tma-store'; `act_epilogue`: the down-only forward's act quantised in a pass where
    False, named so), e.g. 'rows triton | swiglu triton | wgrad bf16 triton'."""
    hopper = (device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
              and os.environ.get("TRITON_INTERPRET") != "1")
    fits = hopper and hidden % fp8.SCALE_BLOCK == 0 and ffn % fp8.SCALE_BLOCK == 0
    rows = _gluon.rows if rows is None else rows
    wgrad = _gluon.wgrad if wgrad is None else wgrad
    swiglu = _gluon.swiglu if swiglu is None else swiglu
    paths = {"rows": rows and fits, "swiglu": swiglu and fits, "wgrad": wgrad and hopper}
    block_m = _gluon.block_m if block_m is None else block_m
    tma_store = _gluon.tma_store if tma_store is None else tma_store
    # the row GEMM's tile and epilogue (`_GluonChoices`)
    rows_kernel = ("gluon" if block_m == 128 else f"gluon-{block_m}") + ("-tma-store" if tma_store else "")
    names = {role: (rows_kernel if role != "wgrad" else "gluon") if gluon else "triton" for role, gluon in paths.items()}
    if backward != "fp8":
        names["wgrad"] = "bf16 triton"
    if backward == "bf16":
        names["backward"] = "bf16 triton"
    if forward != DEFAULT_FORWARD:
        names["forward " + ("down" if forward == "gate-up" else "gate/up")] = "bf16 triton"
    if forward == "down" and not (_gluon.act_epilogue if act_epilogue is None else act_epilogue):
        names["forward gate/up"] += ", act quantised in a pass"
    return " | ".join(f"{role} {name}" for role, name in names.items())


def _gluon_rows_take(a_MK: torch.Tensor, b_EKN: torch.Tensor, num_programs: int | None) -> bool:
    """Whether the Gluon row GEMM runs these operands: a CUDA launch without a forced program count
    (tests force one for the Triton kernels' stride loops) on operands `fp8_gluon.takes`."""
    if num_programs is not None or not a_MK.is_cuda:
        return False
    from disagmoe.kernels import fp8_gluon  # Gluon (triton.experimental) only where a GPU may run it

    return fp8_gluon.takes(a_MK, b_EKN)


def _gate_up_forward(qx, sx, offsets_E, w13, tile: TileConfig, h13_N2F: torch.Tensor | None, out_dtype, *,
                     served: torch.Tensor, num_programs: int | None, stats: torch.Tensor | None, split: bool,
                     block_m: int = 128, tma_store: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_act, s_act): the gate/up GEMM and silu(gate) * up quantised 1 x 128 for the down GEMM. Fused
    (`fp8.fp8_swiglu_gemm`: the epilogue from the fp32 sums), or with `split` where the Gluon row GEMM
    takes the operands: h13 written by it in `out_dtype` (into `h13_N2F` when the backward keeps it),
    then `fp8.quantize_swiglu_rows` of the rows before `served`."""
    if split and _gluon_rows_take(qx, w13[0], num_programs):
        from disagmoe.kernels import fp8_gluon

        h13 = h13_N2F if h13_N2F is not None else torch.empty(
            (qx.shape[0], w13[0].shape[2]), dtype=out_dtype, device=qx.device)
        fp8_gluon.gluon_fp8_rows_gemm(qx, sx, offsets_E, *w13, out=h13, block_m=block_m, tma_store=tma_store)
        return fp8.quantize_swiglu_rows(h13, stats, served)
    return fp8.fp8_swiglu_gemm(qx, sx, offsets_E, *w13, tile, h13_M2F=h13_N2F, num_programs=num_programs,
                               stats=stats)


def _down_data_gradient(q_dy, s_dy, offsets_E, w2_t, tile: TileConfig, h13_N2F: torch.Tensor, act_NF: torch.Tensor,
                        out_dtype, *, num_programs: int | None, split: bool, block_m: int = 128,
                        tma_store: bool = False, quantize: bool = False
                        ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(dh13 (d gate | d up), its 1 x 128 e4m3 rows or None) from dy against w2^T with the SwiGLU
    derivative, writing act recomputed from h13 into `act_NF`. Fused (`fp8.fp8_swiglu_grad_gemm`), or
    with `split` where the Gluon row GEMM takes the operands: d act written by it, then
    `grouped_gemm.swiglu_grad_rows` (the bf16 experts' split epilogue pass), which with `quantize`
    also quantises d h13 as `fp8.quantize_rows` would read it back (`fp8.swiglu_grad_rows_quantized`,
    where the FFN size is a multiple of 128); elsewhere None for those."""
    if split and _gluon_rows_take(q_dy, w2_t[0], num_programs):
        from disagmoe.kernels import fp8_gluon

        d_act_NF = fp8_gluon.gluon_fp8_rows_gemm(q_dy, s_dy, offsets_E, *w2_t, out_dtype=out_dtype,
                                                 block_m=block_m, tma_store=tma_store)
        if quantize and fp8.swiglu_grad_quantizes(d_act_NF):
            return fp8.swiglu_grad_rows_quantized(d_act_NF, h13_N2F, offsets_E, act_N_C=act_NF)
        return gg.swiglu_grad_rows(d_act_NF, h13_N2F, offsets_E, act_N_C=act_NF), None
    return fp8.fp8_swiglu_grad_gemm(q_dy, s_dy, offsets_E, *w2_t, h13_N2F, tile, act_MF=act_NF, out_dtype=out_dtype,
                                    num_programs=num_programs), None


def _weight_grad(a, b, padded_E, tile: TileConfig, *, weights: int, out: torch.Tensor | None, accumulate: bool,
                 num_programs: int | None, gluon: bool, second=None) -> torch.Tensor:
    """`fp8.fp8_weight_grad`, or with `gluon` the Gluon kernel of the same sums on a Hopper GPU
    where the operands fit it and no program count is forced; `second`: a second row set's sums too
    (`kernels.wgrad_pairs`)."""
    if gluon and num_programs is None and a[0].is_cuda:
        from disagmoe.kernels import fp8_gluon

        if fp8_gluon.wgrad_takes(a, b):
            return fp8_gluon.gluon_fp8_weight_grad(a, b, padded_E, weights=weights, out=out, accumulate=accumulate,
                                                   second=second)
    return fp8.fp8_weight_grad(a, b, padded_E, tile, weights=weights, out=out, accumulate=accumulate,
                               num_programs=num_programs, second=second)


@dataclasses.dataclass(frozen=True)
class _WeightGradKernel:
    """The FFN's FP8 weight-gradient launch as `kernels.wgrad_pairs` runs it (`fp8_weight_grad_into`):
    equal for two micro-batches' launches of one layer, so they pair."""

    tile: TileConfig
    weights: int
    num_programs: int | None
    gluon: bool

    def __call__(self, a, b, padded_E, *, out: torch.Tensor, accumulate: bool, second=None) -> torch.Tensor:
        return _weight_grad(a, b, padded_E, self.tile, weights=self.weights, out=out, accumulate=accumulate,
                            num_programs=self.num_programs, gluon=self.gluon, second=second)


def _weight_grad_into_main(a, b, padded_E, kernel: _WeightGradKernel, main: torch.Tensor | None,
                           dtype: torch.dtype) -> torch.Tensor | None:
    """The weight gradient into its fp32 main gradient (stored at the step's first write, else added;
    paired with the next micro-batch's inside `wgrad_pairs.paired_weight_grads`), None returned; without
    a main gradient a new [E, KA, C] tensor of `dtype` (its weights': the GEMM rounds its fp32 sums once),
    returned."""
    if main is None:
        out = torch.empty((kernel.weights, a[0].shape[0], b[0].shape[0]), dtype=dtype, device=a[0].device)
        return kernel(a, b, padded_E, out=out, accumulate=False)
    fp8_weight_grad_into(a, b, padded_E, kernel, main=main, weights=kernel.weights)
    return None


def _rows_gemm(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, tile: TileConfig, *, out_dtype: torch.dtype,
               num_programs: int | None, gluon: bool, out: torch.Tensor | None = None,
               block_m: int = 128, tma_store: bool = False) -> torch.Tensor:
    """`fp8.fp8_rows_gemm` (into `out` where given), or with `gluon` the Gluon kernel of the same
    sums where it takes the operands (`_gluon_rows_take`), at `block_m` rows a tile, its epilogue
    by TMA with `tma_store` (`_GluonChoices`)."""
    if gluon and _gluon_rows_take(a_MK, b_EKN, num_programs):
        from disagmoe.kernels import fp8_gluon

        return fp8_gluon.gluon_fp8_rows_gemm(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, out=out, out_dtype=out_dtype,
                                             block_m=block_m, tma_store=tma_store)
    return fp8.fp8_rows_gemm(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, tile, out=out, out_dtype=out_dtype,
                             num_programs=num_programs)


@dataclasses.dataclass(frozen=True)
class Fp8ExpertWeights:
    """e4m3 copies of one layer's expert weights with their 128 x 128 block scales, (values, scales)
    each, as the B operands of the GEMMs that read them: `w13`/`w2` ([E, K, N], the forward's)
    and `w13_t`/`w2_t` ([E, N, K], the data gradients'). Every one is K-major (stride 1 along its
    K): Hopper's FP8 MMA reads B only so, and Triton loads an N-major FP8 B through registers
    outside the pipeline (0.15x our bf16 kernels, measured). So a weight both GEMMs read is held
    twice, once per layout, and the forward's operand is a transposed view of the data gradient's
    storage and the other way round. Only the copies the recipe (`forward`, `backward`) reads are
    made (`config.fp8_weight_copies`: e.g. forward gate-up with backward bf16 holds w13's forward
    copy alone, 2/3 byte a routed parameter instead of 2); reading another (the attribute) raises a
    ValueError naming the recipe. Made from the weights once per optimizer step (`quantize`), never
    per micro-batch, never checkpointed."""

    copies: dict[str, tuple[torch.Tensor, torch.Tensor]]  # by `FP8_WEIGHT_COPIES` name, the recipe's only
    shape_EHF: tuple[int, int, int]  # (experts, hidden, ffn) of the weights they were made from
    forward: str = DEFAULT_FORWARD  # the recipe they were made for (`FORWARD_GEMMS`, `BACKWARD_PRECISIONS`)
    backward: str = DEFAULT_BACKWARD

    @classmethod
    def quantize(cls, w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor, stats: Fp8Stats | None = None, *,
                 forward: str = DEFAULT_FORWARD, backward: str = DEFAULT_BACKWARD,
                 into: Fp8ExpertWeights | None = None) -> Fp8ExpertWeights:
        """The copies recipe (`forward`, `backward`) reads, each weight quantised by one launch
        (none for a weight it reads no copy of: nothing counted into `stats` for it either). The
        defaults (forward both, backward bf16-wgrad) make all four: any recipe can read those.
        `into`: copies of this very recipe, shape and device (`matches`), written in place by the
        launches and returned (a captured step reads their addresses), no new tensor made."""
        check_forward(forward)
        check_backward(backward)
        experts, hidden, two_ffn = w13_EH2F.shape
        shape = (experts, hidden, two_ffn // 2)
        if into is not None and not into.matches(forward, backward, shape, w13_EH2F.device):
            raise ValueError(f"into holds copies for forward {into.forward}, backward {into.backward}, shape "
                             f"{into.shape_EHF} on {into.device}; these weights need forward {forward}, backward "
                             f"{backward}, shape {shape} on {w13_EH2F.device}: quantise into new copies (into=None)")
        read = fp8_weight_copies(forward, backward)
        copies: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, w_EKN in (("w13", w13_EH2F), ("w2", w2_EFH)):
            made = _k_major_copies(w_EKN, _row(stats, WEIGHTS), forward=name in read,
                                   transposed=f"{name}_t" in read,
                                   into=None if into is None else (into.copies.get(name), into.copies.get(f"{name}_t")))
            copies.update({key: pair for key, pair in zip((name, f"{name}_t"), made) if pair is not None})
        return into if into is not None else cls(copies, shape, forward, backward)

    def matches(self, forward: str, backward: str, shape_EHF: tuple[int, int, int], device: torch.device) -> bool:
        """Whether these are the copies recipe (`forward`, `backward`) makes of weights of `shape_EHF` on
        `device` (`quantize(into=)` can write them in place)."""
        return (self.forward, self.backward, tuple(self.shape_EHF), self.device) == (forward, backward,
                                                                                    tuple(shape_EHF), device)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor these copies hold (the values and scales of those the recipe reads), in a fixed order; a
        weight's forward and transposed copies share one scale tensor, listed with each (as a view for the latter)."""
        return [t for name in FP8_WEIGHT_COPIES if name in self.copies for t in self.copies[name]]

    def _copy(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.copies.get(name)
        if pair is None:
            raise ValueError(f"these FP8 expert weight copies were made for forward {self.forward}, backward "
                             f"{self.backward}, which reads no {name} copy (these hold {', '.join(self.copies)}): "
                             f"make them for the recipe that runs (Fp8ExpertWeights.quantize(..., forward=, "
                             f"backward=); RoutedExperts.prepare_fp8 does after set_precision)")
        return pair

    @property
    def device(self) -> torch.device | None:
        """The device the copies are on (None without a copy: no recipe makes none)."""
        return next((q.device for q, _ in self.copies.values()), None)

    @property
    def w13(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._copy("w13")

    @property
    def w13_t(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._copy("w13_t")

    @property
    def w2(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._copy("w2")

    @property
    def w2_t(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._copy("w2_t")

    def check_serves(self, forward: str, backward: str) -> None:
        """ValueError, with the fix, unless these copies hold every one recipe (`forward`, `backward`)
        reads (a superset serves: the default recipe's four serve any)."""
        missing = [name for name in fp8_weight_copies(forward, backward) if name not in self.copies]
        if missing:
            raise ValueError(f"the FP8 experts' forward {forward}, backward {backward} read the {', '.join(missing)} "
                             f"weight copies, which these (made for forward {self.forward}, backward "
                             f"{self.backward}) lack: make them with Fp8ExpertWeights.quantize(..., "
                             f"forward={forward!r}, backward={backward!r})")


def _k_major_copies(w_EKN: torch.Tensor, stats: torch.Tensor | None, *, forward: bool, transposed: bool,
                    into: tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None]
                    | None = None):
    """((q_EKN, s_EGB) where `forward`, else None; (q_ENK, s_EBG) where `transposed`, else None),
    both values K-major, from one quantising launch (none where neither is asked for): the
    forward's [E, K, N] is a transposed view of a transposed copy the launch writes
    (`quantize_blocks(transposed_out=...)`); the data gradient's [E, N, K] a transposed view of the
    quantised [E, K, N] blocks as made (not allocated where only the forward's is asked for:
    `quantize_blocks(natural=False)`). `into`: the two pairs as an earlier call returned them (None where
    not asked for), written in place instead."""
    if not (forward or transposed):
        return None, None
    experts, k, n = w_EKN.shape
    if into is not None:
        forward_pair, transposed_pair = into
        q_ENK = forward_pair[0].transpose(1, 2) if forward else None
        s_EGB = forward_pair[1] if forward else transposed_pair[1].transpose(1, 2)
        out = (transposed_pair[0].transpose(1, 2) if transposed else None, s_EGB)
    else:
        q_ENK = torch.empty((experts, n, k), dtype=fp8.FP8, device=w_EKN.device) if forward else None
        out = None
    q_EKN, s_EGB = fp8.quantize_blocks(w_EKN, stats, transposed_out=q_ENK, natural=transposed, out=out)
    return ((q_ENK.transpose(1, 2), s_EGB) if forward else None,
            (q_EKN.transpose(1, 2), s_EGB.transpose(1, 2)) if transposed else None)


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """Tile configs of the FP8 launches: `rows` the plain row GEMMs (down, gate/up data gradient;
    block_k dividing 128), `swiglu` the two with a SwiGLU epilogue (block_n = 128), `wgrad` the
    weight gradients (block_m, the token step, dividing 128); each with its K loop's promotion
    (`TileConfig.promote`, `kernels.fp8.PROMOTE_VARIANTS`). The defaults are untuned, chosen so
    ptxas (sm_90a) reports no spills (`wgrad`: a few bytes at most, bounded by a test); `for_shape`
    reads the tuned ones."""

    rows: TileConfig = TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
    swiglu: TileConfig = TileConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    wgrad: TileConfig = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)

    @classmethod
    def for_shape(cls, rows: int, experts: int, hidden: int, ffn: int, device: torch.device) -> Fp8Tiles:
        """The tiles `disagmoe bench tune-experts --precision fp8` saved for this shape class on this
        GPU (`tile_configs.FP8_ROLES`; untuned here, on a GPU of its architecture), the defaults for a
        field none was saved for."""
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        defaults, arch = cls(), device_architecture(device)
        return cls(**{field.name: tuned(f"fp8_{field.name}", hidden, ffn, rows, experts, name, arch)
                      or getattr(defaults, field.name) for field in dataclasses.fields(cls)})

    def with_promote(self, promote: str) -> Fp8Tiles:
        """The same tiles with every K loop promoted as `promote` says (an A/B of the variants)."""
        return Fp8Tiles(**{field.name: dataclasses.replace(getattr(self, field.name), promote=promote)
                           for field in dataclasses.fields(self)})

    def describe(self) -> str:
        """'rows 128x128x128 w8 s3 p1 inline | swiglu ... | wgrad ...' (block_m x block_n x block_k,
        warps, stages, programs per SM, promotion)."""
        return " | ".join(f"{field.name} {_tile_text(getattr(self, field.name))}" for field in dataclasses.fields(self))


def _tile_text(c: TileConfig) -> str:
    return (f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} p{c.programs_per_sm} "
            f"{c.promote}")


def fp8_ffn_forward(
    x_NH: torch.Tensor | RowSource,
    offsets_E: torch.Tensor,
    weights: Fp8ExpertWeights,
    tiles: Fp8Tiles,
    *,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    save_for_backward: bool = False,
    num_programs: int | None = None,
    stats: Fp8Stats | None = None,
    gluon: _GluonChoices | None = None,
    forward: str = DEFAULT_FORWARD,
    bf16_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    emulate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y_NH in x's dtype, h13_N2F or None): `x_fp8` (rows and scales, e.g. from the FP8 permute)
    instead of quantising x here, x then read by nothing where the gate/up GEMM is FP8 (it may be
    the rows' `RowSource`: they need not be written); h13 (the pre-activations, x's dtype) kept for
    the backward. `gluon`: the Gluon paths taken (`_GluonChoices`; None: as the `set_gluon_*`
    functions say now). `forward` (`FORWARD_GEMMS`): one GEMM alone in FP8 (`_one_gemm_forward`),
    the other reading `bf16_weights` (w13_EH2F, w2_EFH). `emulate` (`TrainConfig.fp8_emulate`):
    the FP8 GEMMs as their operands' quantise-dequantise images in the bf16 experts' GEMMs
    (`_emulated_forward`)."""
    if isinstance(x_NH, RowSource):  # the forward's own readers (the backward's are its caller's)
        reader = bf16_rows_reader(forward, x_fp8 is not None, rows_from_source=True)
        if reader is not None:
            raise ValueError(f"fp8_ffn_forward: x's rows are given as their RowSource but {reader} reads them")
    gluon = gluon or _gluon
    rows, dtype, device = _rows_of(x_NH)
    ffn = weights.shape_EHF[2]
    served = offsets_E[-1:]  # rows past the last expert's end are a worst-case buffer's padding
    h13_N2F = torch.empty((rows, 2 * ffn), dtype=dtype, device=device) if save_for_backward else None
    if forward != DEFAULT_FORWARD and bf16_weights is None:
        raise ValueError(f"the FP8 experts' forward {forward} runs one GEMM in bf16: pass bf16_weights")
    if emulate:
        return _emulated_forward(x_NH, offsets_E, weights, bf16_weights, h13_N2F, forward, x_fp8=x_fp8,
                                 served=served, num_programs=num_programs, stats=stats), h13_N2F
    if forward != DEFAULT_FORWARD:
        return _one_gemm_forward(x_NH, offsets_E, weights, bf16_weights, tiles, h13_N2F, forward, x_fp8=x_fp8,
                                 served=served, num_programs=num_programs, stats=stats, gluon=gluon), h13_N2F
    qx, sx = x_fp8 if x_fp8 is not None else fp8.quantize_rows(x_NH, _row(stats, ACTIVATIONS), served)
    q_act, s_act = _gate_up_forward(qx, sx, offsets_E, weights.w13, tiles.swiglu, h13_N2F, dtype, served=served,
                                    num_programs=num_programs, stats=_row(stats, ACTIVATIONS),
                                    split=gluon.swiglu, block_m=gluon.block_m, tma_store=gluon.tma_store)
    y_NH = _rows_gemm(q_act, s_act, offsets_E, *weights.w2, tiles.rows, out_dtype=dtype,
                      num_programs=num_programs, gluon=gluon.rows, block_m=gluon.block_m, tma_store=gluon.tma_store)
    return y_NH, h13_N2F


def _rows_of(x_NH: torch.Tensor | RowSource) -> tuple[int, torch.dtype, torch.device]:
    """(N, dtype, device) of x's rows, written or given as their `RowSource`."""
    if isinstance(x_NH, RowSource):
        return x_NH.token_N.shape[0], x_NH.x_TH.dtype, x_NH.x_TH.device
    return x_NH.shape[0], x_NH.dtype, x_NH.device


def _one_gemm_forward(x_NH: torch.Tensor | RowSource, offsets_E, weights: Fp8ExpertWeights, bf16_weights,
                      tiles: Fp8Tiles, h13_N2F: torch.Tensor | None, forward: str, *, x_fp8, served: torch.Tensor,
                      num_programs: int | None, stats: Fp8Stats | None, gluon: _GluonChoices) -> torch.Tensor:
    """y_NH with one forward GEMM in FP8 (`FORWARD_GEMMS`), writing h13 into `h13_N2F` where given.
    "gate-up": x's rows 1 x 128 into the FP8 gate/up GEMM (h13 out in x's dtype), silu(gate) * up in
    fp32 rounded to x's dtype, the bf16 down GEMM (`grouped_gemm.ragged_rows_gemm`). "down": the bf16
    gate/up GEMM with its SwiGLU epilogue, its output quantised 1 x 128 into the FP8 down GEMM: by the
    epilogue itself (`quantized_out`, the bytes `fp8.quantize_rows` makes of its bf16 act, none written in
    bf16), or where a step counts its numerics by `fp8.quantize_rows` of the bf16 act.
    Each quantisation counts into `stats`' activations row, as in the recipe."""
    w13_EH2F, w2_EFH = bf16_weights
    experts, hidden, ffn = w13_EH2F.shape[0], w13_EH2F.shape[1], w2_EFH.shape[1]
    rows, dtype, device = _rows_of(x_NH)
    bf16_tiles = FFNTiles.for_shape(rows, experts, hidden, ffn, device, dtype)
    acts = _row(stats, ACTIVATIONS)
    if forward == "gate-up":
        qx, sx = x_fp8 if x_fp8 is not None else fp8.quantize_rows(x_NH, acts, served)
        h13 = _rows_gemm(qx, sx, offsets_E, *weights.w13, tiles.rows, out_dtype=dtype, num_programs=num_programs,
                         gluon=gluon.rows, out=h13_N2F, block_m=gluon.block_m, tma_store=gluon.tma_store)
        gate, up = h13.float().chunk(2, dim=1)
        act_NF = (torch.nn.functional.silu(gate) * up).to(dtype)
        return gg.ragged_rows_gemm(act_NF, offsets_E, w2_EFH, bf16_tiles.down, num_programs=num_programs)
    if acts is None and gluon.act_epilogue and gg.swiglu_quantizes(bf16_tiles.gate_up):  # the epilogue writes it
        q_act, s_act = fp8.empty_quantized_rows(rows, ffn, device)
        gg.ragged_rows_gemm(x_NH, offsets_E, w13_EH2F, bf16_tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU,
                            h13_N2C=h13_N2F, num_programs=num_programs, quantized_out=(q_act, s_act))
    else:  # a step that counts its numerics (or tiles off the 128-column grid, or the A/B's pass): act in bf16, then
        # its quantiser
        act_NF = gg.ragged_rows_gemm(x_NH, offsets_E, w13_EH2F, bf16_tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU,
                                     h13_N2C=h13_N2F, num_programs=num_programs)
        q_act, s_act = fp8.quantize_rows(act_NF, acts, served)
        del act_NF
    return _rows_gemm(q_act, s_act, offsets_E, *weights.w2, tiles.rows, out_dtype=dtype,
                      num_programs=num_programs, gluon=gluon.rows, block_m=gluon.block_m, tma_store=gluon.tma_store)


# Elements of one piece of a dequantisation (`_dequantized_rows`, `_dequantized_blocks`): its fp32
# temporaries (the e4m3 values widened, the scales expanded, their product) stay near 400 MiB
# however large the operand (a Mixtral expert's w13 is 117M values: pieces of its K rows).
DEQUANTIZE_PIECE = 1 << 25


def _dequantized_rows(q_NK: torch.Tensor, s_NG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8.dequantize_rows(q, s)` (fp32 values) rounded to `dtype`, over pieces of the rows so that
    one piece's fp32 temporaries are alive at a time; a new contiguous tensor. Rows past a
    worst-case buffer's `served` count dequantise whatever their unwritten values hold: no GEMM
    reads them."""
    out_NK = torch.empty(q_NK.shape, dtype=dtype, device=q_NK.device)
    step = max(1, DEQUANTIZE_PIECE // max(1, q_NK.shape[1]))
    for start in range(0, q_NK.shape[0], step):
        out_NK[start:start + step] = fp8.dequantize_rows(q_NK[start:start + step], s_NG[start:start + step])
    return out_NK


def _dequantized_blocks(q_EKN: torch.Tensor, s_EGB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`fp8.dequantize_blocks(q, s)` rounded to `dtype`, in pieces so that one piece's fp32
    temporaries are alive at a time: as many whole experts as fit a piece (Qwen3's: ten), or, for an
    expert larger than a piece (Mixtral's w13), whole 128-row block rows of its K with their scales;
    a new contiguous tensor."""
    experts, k, n = q_EKN.shape
    out_EKN = torch.empty((experts, k, n), dtype=dtype, device=q_EKN.device)
    per_expert = max(1, k * n)
    experts_per_piece = max(1, DEQUANTIZE_PIECE // per_expert)
    blocks_per_piece = s_EGB.shape[1] if per_expert <= DEQUANTIZE_PIECE else max(
        1, DEQUANTIZE_PIECE // max(1, fp8.SCALE_BLOCK * n))
    for e in range(0, experts, experts_per_piece):
        es = slice(e, e + experts_per_piece)
        for g in range(0, s_EGB.shape[1], blocks_per_piece):
            rows = slice(g * fp8.SCALE_BLOCK, (g + blocks_per_piece) * fp8.SCALE_BLOCK)
            out_EKN[es, rows] = fp8.dequantize_blocks(q_EKN[es, rows], s_EGB[es, g:g + blocks_per_piece])
    return out_EKN


def _emulated_forward(x_NH: torch.Tensor | RowSource, offsets_E, weights: Fp8ExpertWeights, bf16_weights,
                      h13_N2F: torch.Tensor | None, forward: str, *, x_fp8, served: torch.Tensor,
                      num_programs: int | None, stats: Fp8Stats | None) -> torch.Tensor:
    """y_NH of forward `forward` (`FORWARD_GEMMS`) with each FP8 GEMM replaced by the bf16 experts'
    GEMM (`grouped_gemm.ragged_rows_gemm`, the kernels a bf16 run uses) on its operands'
    quantise-dequantise images: a numerics check (`TrainConfig.fp8_emulate`) that keeps the FP8
    format (the same quantisers, scales and e4m3 values; each quantisation counts into `stats`'
    activations row as in the recipe) and drops the FP8 kernels. Where the gate/up GEMM is FP8, x's
    rows (`x_fp8`, else quantised 1 x 128 here) and w13's 128 x 128 blocks (`weights.w13`, the
    optimizer step's copy) dequantised to x's dtype, into the gate/up GEMM with its SwiGLU epilogue
    (h13 written into `h13_N2F` where given: the bf16 backward reads the emulated pre-activations);
    else that GEMM on x's rows and `bf16_weights`' w13, as `_one_gemm_forward`'s "down". Where the
    down GEMM is FP8, the SwiGLU output quantised 1 x 128 (counted) and dequantised with w2's blocks;
    else the bf16 down GEMM on `bf16_weights`' w2. Against the FP8 kernels the only differences are
    where the scales are applied and the summation order (in fp32 y agrees to about 1e-6), and in
    bf16 one rounding of each dequantised operand to bf16 (2^-9 relative, the representation a bf16
    run has anyway) and of the SwiGLU output before its quantisation (the fused FP8 epilogue
    quantises it from fp32). The dequantised weights are made per call, transient (one [E, H, 2F]
    and one [E, F, H] tensor in x's dtype beside the rows' [N, H]), and no faster than bf16: fine
    for a check, not for training."""
    rows, dtype, device = _rows_of(x_NH)
    experts, hidden, ffn = weights.shape_EHF
    tiles = FFNTiles.for_shape(rows, experts, hidden, ffn, device, dtype)
    acts = _row(stats, ACTIVATIONS)
    if forward == "down":  # the gate/up GEMM in bf16, as the FP8 path runs it
        x_rows, w13_EH2F = x_NH, bf16_weights[0]
    else:
        qx, sx = x_fp8 if x_fp8 is not None else fp8.quantize_rows(x_NH, acts, served)
        # `weights.w13` is a transposed view of the K-major copy (`_k_major_copies`): its values are
        # w13's [E, H, 2F] blocks as `fp8.dequantize_blocks` reads them, whatever the strides
        x_rows = _dequantized_rows(qx, sx, dtype)
        w13_EH2F = _dequantized_blocks(*weights.w13, dtype)
    act_NF = gg.ragged_rows_gemm(x_rows, offsets_E, w13_EH2F, tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU,
                                 h13_N2C=h13_N2F, num_programs=num_programs)
    del x_rows, w13_EH2F
    if forward == "gate-up":
        return gg.ragged_rows_gemm(act_NF, offsets_E, bf16_weights[1], tiles.down, num_programs=num_programs)
    q_act, s_act = fp8.quantize_rows(act_NF, acts, served)
    del act_NF
    act_NF = _dequantized_rows(q_act, s_act, dtype)
    w2_EFH = _dequantized_blocks(*weights.w2, dtype)
    return gg.ragged_rows_gemm(act_NF, offsets_E, w2_EFH, tiles.down, num_programs=num_programs)


def fp8_ffn_backward(
    dy_NH: torch.Tensor,
    x_NH: torch.Tensor | RowSource,
    offsets_E: torch.Tensor,
    weights: Fp8ExpertWeights,
    h13_N2F: torch.Tensor,
    tiles: Fp8Tiles,
    *,
    main_grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    num_programs: int | None = None,
    stats: Fp8Stats | None = None,
    gluon: _GluonChoices | None = None,
    backward: str = "fp8",
    grad_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    grad_slot: pm.Fp8RowGradSlot | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx_NH in dy's dtype, dw13_EH2F, dw2_EFH in `grad_dtypes`: their weights' dtypes, written so by the
    all-FP8 backward's GEMMs, which round their fp32 sums once, not into an fp32 tensor cast after; the
    bf16-wgrad recipe's in the rows' dtype); a weight gradient whose fp32 main
    gradient is given (w13's, w2's) is added into it by its GEMM (stored, if the gradient is
    untouched this step: `kernels.first_touch`) and None is returned for it.
    `x_NH` may be a `RowSource` (`expert_input`, module docstring): its rows are read from the
    tokens by the w13 gradient's quantiser, as they lie (the tokens' dtype); bf16-wgrad gathers
    them into a bf16 copy for its w13 gradient.
    dy and d h13 are each quantised both ways (1 x 128 rows for a data gradient, 128 x 1 token
    groups for a weight gradient, `_quantize_both_ways`, or their rows handed over by the kernel that
    wrote them, below), so both copies of each are alive from then on. Launch order, with the
    e4m3 copies alive at each GEMM (H, F: values a row), each dropped right after its last reader:
      d h13 GEMM   reads dy's rows                alive: dy's rows and token groups   2H
      w2 gradient  reads act's and dy's tokens    alive: those                        H + F
      dx GEMM      reads d h13's rows             alive: d h13's rows and tokens      4F
      w13 gradient reads x's and d h13's tokens   alive: those                        H + 2F
    so at most 2 max(H, 2F) e4m3 values a row with their scales (H + 2F when each copy had a pass
    of its own). The w2 gradient runs first, before d h13's token groups are made: dy's token-group
    copy is dropped before them, and act (bf16, read by its quantiser alone) is dropped with it
    (`roofline.memory.expert_row_grad_bytes`). Where the split SwiGLU-gradient pass quantises d h13's
    rows as it writes them (Hopper's Gluon path, a step not counting its numerics: `_down_data_gradient`'s
    quantize), that copy (2F) is made at the pass and is alive beside the d h13 GEMM's and the w2
    gradient's copies above (2H + 2F, then H + 3F: above 2 max(H, 2F) there): one read of d h13 fewer,
    the memory model counting it there. dx is no later for the rank
    either: every result leaves this function together (the FP8 experts hold no weight gradient
    back, `kernels.deferral`). `gluon`: the Gluon paths taken where they apply (`_GluonChoices`;
    None: as the `set_gluon_*` functions say now).
    `backward` "bf16-wgrad" (`BACKWARD_PRECISIONS`): the two weight gradients from the bf16 rows
    the backward holds anyway (x, act, dy, d h13) by the bf16 experts' GEMM
    (`grouped_gemm.ragged_weight_grad`, its tuned tiles), no token-group copy made; the data
    gradients stay FP8 (`_backward_bf16_weight_grads`). ("bf16", the whole backward in bf16, is
    `Fp8ExpertFFNFunction`'s: it needs the bf16 weights.)
    `grad_slot` (`permute.Fp8RowGradSlot`): where dy's 1 x 128 rows were left by whatever wrote dy (the combine's
    backward), uncounted, taken in place of quantising dy's rows here (where it holds a copy of this very dy)
    at the point of use, so that the copy is dropped after its last reader as a quantised one is; a step that
    counts its numerics passes none."""
    if backward not in ("fp8", "bf16-wgrad"):
        raise ValueError(f"fp8_ffn_backward runs backward fp8 or bf16-wgrad; got {backward!r}")
    if grad_slot is not None and stats is not None:
        raise ValueError("grad_slot holds an uncounted copy of dy: a backward that counts its numerics (stats given) "
                         "quantises dy itself; pass one or the other")
    if backward == "bf16-wgrad":
        return _backward_bf16_weight_grads(dy_NH, x_NH, offsets_E, weights, h13_N2F, tiles, main_grads=main_grads,
                                           num_programs=num_programs, stats=stats, gluon=gluon or _gluon,
                                           grad_slot=grad_slot)
    (experts, _, ffn), rows = weights.shape_EHF, h13_N2F.shape[0]
    gluon = gluon or _gluon
    acts, grads_row = _row(stats, ACTIVATIONS), _row(stats, GRADIENTS)
    served = offsets_E[-1:]  # rows past it are padding: dh13's are never written (garbage, maybe NaN)
    # each e4m3 copy is dropped right after its last reader (`roofline.memory.expert_row_grad_bytes`)
    dy_rows = grad_slot.take(dy_NH) if grad_slot is not None else None  # made where dy was written, or None
    (q_dy, s_dy), (qt_dy, st_dy, padded_E) = _both_ways_unless_given(dy_rows, dy_NH, offsets_E, grads_row, served)
    del dy_rows  # q_dy and s_dy the copy's only holders, dropped after the d h13 GEMM
    act_NF = h13_N2F.new_empty((rows, ffn))
    # a step that counts its numerics quantises d h13's rows on its own (the split pass has no counters)
    dh13_N2F, dh13_rows = _down_data_gradient(q_dy, s_dy, offsets_E, weights.w2_t, tiles.swiglu, h13_N2F, act_NF,
                                              dy_NH.dtype, num_programs=num_programs, split=gluon.swiglu,
                                              block_m=gluon.block_m, tma_store=gluon.tma_store,
                                              quantize=grads_row is None)
    del q_dy, s_dy
    qt_act, st_act, _ = fp8.quantize_token_groups(act_NF, offsets_E, acts)
    del act_NF
    # each weight-gradient launch writes every element (zeros for an expert without rows): the step's
    # first one into a main gradient stores instead of adding (`kernels.first_touch`)
    wgrad = _WeightGradKernel(tiles.wgrad, experts, num_programs, gluon.wgrad)
    dw2 = _weight_grad_into_main((qt_act, st_act), (qt_dy, st_dy), padded_E, wgrad, main_grads[1], grad_dtypes[1])
    del qt_act, st_act, qt_dy, st_dy  # before d h13's token groups are made
    # d h13's rows written by the split SwiGLU-gradient pass where it ran
    (q_dh, s_dh), (qt_dh, st_dh, _) = _both_ways_unless_given(dh13_rows, dh13_N2F, offsets_E, grads_row, served)
    del dh13_rows  # q_dh and s_dh the copy's only holders, dropped after the dx GEMM
    dx_NH = _rows_gemm(q_dh, s_dh, offsets_E, *weights.w13_t, tiles.rows, out_dtype=dy_NH.dtype,
                       num_programs=num_programs, gluon=gluon.rows, block_m=gluon.block_m, tma_store=gluon.tma_store)
    del q_dh, s_dh
    if isinstance(x_NH, RowSource):  # the grouped rows read from their tokens, in the quantiser
        qt_x, st_x, _ = fp8.quantize_token_groups(x_NH.x_TH, offsets_E, acts, rows_M=x_NH.token_N)
    else:
        qt_x, st_x, _ = fp8.quantize_token_groups(x_NH, offsets_E, acts)
    dw13 = _weight_grad_into_main((qt_x, st_x), (qt_dh, st_dh), padded_E, wgrad, main_grads[0], grad_dtypes[0])
    del qt_x, st_x, qt_dh, st_dh
    return dx_NH, dw13, dw2  # None for each added into its main gradient (`_weight_grad_into_main`)


def _quantize_both_ways(x_NK: torch.Tensor, offsets_E: torch.Tensor, stats: torch.Tensor | None,
                        served: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                       tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """((q_NK, s_NG), (q_KP, s_KC, padded_E)) of x: its 1 x 128 rows below `served` (a data gradient's A
    operand) and its 128 x 1 token groups (a weight gradient's), by the two quantisers one after the other.
    `fp8.quantize_rows_and_token_groups` makes both from one read of x, the same bytes and counts
    (tests/kernels/test_fp8_stats.py), but on an H100 it ran slower than the two together (`bench quantise`,
    one call, session 37: Mixtral's dy 0.290 ms against 0.073 + 0.150, Qwen3's 0.407 against 0.073 + 0.254;
    Mixtral's d h13 1.931 against 0.512 and a token-group pass about twice act's 0.482)."""
    return fp8.quantize_rows(x_NK, stats, served), fp8.quantize_token_groups(x_NK, offsets_E, stats)


def _both_ways_unless_given(rows: tuple[torch.Tensor, torch.Tensor] | None, x_NK: torch.Tensor,
                            offsets_E: torch.Tensor, stats: torch.Tensor | None, served: torch.Tensor):
    """`_quantize_both_ways` of x, or where a kernel already wrote its 1 x 128 `rows` (the combine's backward dy's,
    the split SwiGLU-gradient pass d h13's) those with its token groups alone."""
    if rows is None:
        return _quantize_both_ways(x_NK, offsets_E, stats, served)
    return rows, fp8.quantize_token_groups(x_NK, offsets_E, stats)


def _backward_bf16_weight_grads(dy_NH, x_NH, offsets_E, weights: Fp8ExpertWeights, h13_N2F, tiles: Fp8Tiles, *,
                                main_grads, num_programs: int | None, stats: Fp8Stats | None,
                                gluon: _GluonChoices, grad_slot: pm.Fp8RowGradSlot | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`fp8_ffn_backward` with backward "bf16-wgrad": dy and d h13 quantised 1 x 128 only (their data
    gradients' A operands), each weight gradient the bf16 experts' ragged GEMM over the rows as
    they are, added into its main gradient where one is given. Launch order: d h13 (writing act),
    w2's gradient, dx, w13's gradient; alive beside the bf16 rows: one e4m3 row copy at a time, but
    where the split SwiGLU pass quantises d h13 as it writes it (a step that does not count its
    numerics: `_down_data_gradient`'s quantize), whose copy joins d y's at that pass and lives
    through w2's gradient (`roofline.memory.fp8_expert_row_grad_bytes` counts both).
    x given as a `RowSource` (`expert_input`): its rows gathered again [N, H] (`RowSource.rows`)
    after dx, alive beside d h13 through the w13 gradient."""
    (experts, _, ffn), rows, hidden = weights.shape_EHF, h13_N2F.shape[0], dy_NH.shape[1]
    grads_row = _row(stats, GRADIENTS)
    served = offsets_E[-1:]
    bf16_tiles = FFNTiles.for_shape(rows, experts, hidden, ffn, dy_NH.device, dy_NH.dtype)
    dy_rows = grad_slot.take(dy_NH) if grad_slot is not None else None
    q_dy, s_dy = dy_rows if dy_rows is not None else fp8.quantize_rows(dy_NH, grads_row, served)
    del dy_rows  # q_dy and s_dy the copy's only holders
    act_NF = h13_N2F.new_empty((rows, ffn))
    # a step that counts its numerics quantises d h13 on its own (the split pass has no counters)
    dh13_N2F, dh13_fp8 = _down_data_gradient(q_dy, s_dy, offsets_E, weights.w2_t, tiles.swiglu, h13_N2F, act_NF,
                                             dy_NH.dtype, num_programs=num_programs, split=gluon.swiglu,
                                             block_m=gluon.block_m, tma_store=gluon.tma_store,
                                             quantize=grads_row is None)
    del q_dy, s_dy
    main13, main2 = main_grads
    dw2 = weight_grad_into(act_NF, dy_NH, offsets_E, bf16_tiles.wgrad_w2, main=main2, weights=experts,
                           num_programs=num_programs)  # paired with the next micro-batch's (`kernels.wgrad_pairs`)
    del act_NF
    q_dh, s_dh = dh13_fp8 if dh13_fp8 is not None else fp8.quantize_rows(dh13_N2F, grads_row, served)
    del dh13_fp8
    dx_NH = _rows_gemm(q_dh, s_dh, offsets_E, *weights.w13_t, tiles.rows, out_dtype=dy_NH.dtype,
                       num_programs=num_programs, gluon=gluon.rows, block_m=gluon.block_m, tma_store=gluon.tma_store)
    del q_dh, s_dh
    x_rows = x_NH.rows(dh13_N2F.dtype) if isinstance(x_NH, RowSource) else x_NH.to(dh13_N2F.dtype)
    dw13 = weight_grad_into(x_rows, dh13_N2F, offsets_E, bf16_tiles.wgrad_w13, main=main13, weights=experts,
                            num_programs=num_programs)
    return dx_NH, None if main13 is not None else dw13, None if main2 is not None else dw2


class Fp8ExpertFFNFunction(torch.autograd.Function):
    """Autograd wrapper: x, w13, w2 get gradients (the weights' in their own dtype). Under
    `expert_input` with a `source` the rows x are not saved (module docstring). With `dest_TK` the
    rows were never written (`UnwrittenRows`): x is their tokens x_TH, read by nothing (x_fp8 and
    the source serve), and its gradient is the rows' summed per token as the permute's backward
    sums them."""

    @staticmethod
    def forward(ctx, x, offsets_E, w13_EH2F, w2_EFH, weights, tiles, num_programs, stats,
                recompute=frozenset(), source=None, backward=DEFAULT_BACKWARD, forward=DEFAULT_FORWARD, x_fp8=None,
                dest_TK=None, emulate=False, grad_slot=None):
        if weights is None:  # the recipe's copies per call; a trainer makes them once per optimizer step
            weights = Fp8ExpertWeights.quantize(w13_EH2F, w2_EFH, stats, forward=forward, backward=backward)
        ctx.gluon = dataclasses.replace(_gluon)  # the backward keeps the forward's choices
        y_NH, h13_N2F = fp8_ffn_forward(x if dest_TK is None else source, offsets_E, weights, tiles, x_fp8=x_fp8,
                                        save_for_backward=True, num_programs=num_programs, stats=stats,
                                        gluon=ctx.gluon, forward=forward,
                                        bf16_weights=(w13_EH2F.detach(), w2_EFH.detach()), emulate=emulate)
        # the source's tokens are another node's input, kept as an attribute (autograd's saved-tensor
        # checks apply to this node's own), as `moe_ffn.ExpertFFNFunction` keeps them
        ctx.source = source if EXPERT_INPUT in recompute and source is not None else None
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(None if ctx.source is not None else x, offsets_E, h13_N2F, dest_TK)
        ctx.weights, ctx.tiles, ctx.num_programs, ctx.stats = weights, tiles, num_programs, stats
        ctx.backward = backward
        ctx.grad_slot = grad_slot  # dy's e4m3 rows, left there by the combine's backward (`permute.Fp8RowGradSlot`)
        ctx.bf16_weights = (w13_EH2F, w2_EFH) if backward == "bf16" else None
        ctx.weight_dtypes = (w13_EH2F.dtype, w2_EFH.dtype)
        # FlatAdamW's fp32 main gradients: the weight-gradient GEMMs add into them (no bf16 gradient,
        # no autograd accumulation, no hook's fp32 add: 110 ms of a Mixtral-shaped step, measured)
        ctx.main_grads = (main_grad_of(w13_EH2F), main_grad_of(w2_EFH))
        return y_NH

    @staticmethod
    def backward(ctx, dy_NH):
        x_NH, offsets_E, h13_N2F, dest_TK = ctx.saved_tensors
        grad_slot, ctx.grad_slot = ctx.grad_slot, None  # dy's copy taken where it is read (`fp8_ffn_backward`)
        if ctx.backward == "bf16":  # the bf16 experts' backward from the FP8 forward's pre-activations
            if x_NH is None:
                x_NH = ctx.source.rows(ctx.x_dtype)
            w13_EH2F, w2_EFH = ctx.bf16_weights
            tiles = FFNTiles.for_shape(x_NH.shape[0], w13_EH2F.shape[0], w13_EH2F.shape[1], w2_EFH.shape[1],
                                       x_NH.device, x_NH.dtype)
            dx, dw13, dw2 = moe_ffn_backward(dy_NH.contiguous(), x_NH, offsets_E, w13_EH2F.detach(), w2_EFH.detach(),
                                             None, h13_N2F, tiles, num_programs=ctx.num_programs,
                                             main_grads=ctx.main_grads)
            ctx.weights = ctx.stats = ctx.source = ctx.main_grads = ctx.bf16_weights = None
            return _input_gradient(dx, dest_TK, ctx.x_dtype), None, dw13, dw2, *(None,) * 12
        if x_NH is None:  # the tokens read in place where they hold the rows' dtype, else cast rows
            same = ctx.source.x_TH.dtype == ctx.x_dtype
            x_NH = ctx.source if same else ctx.source.rows(ctx.x_dtype)
        dx, dw13, dw2 = fp8_ffn_backward(dy_NH.contiguous(), x_NH, offsets_E, ctx.weights, h13_N2F, ctx.tiles,
                                         main_grads=ctx.main_grads, num_programs=ctx.num_programs, stats=ctx.stats,
                                         gluon=ctx.gluon, backward=ctx.backward, grad_dtypes=ctx.weight_dtypes,
                                         grad_slot=grad_slot)
        ctx.weights = ctx.stats = ctx.source = ctx.main_grads = None
        dw13, dw2 = (None if g is None else g.to(dtype) for g, dtype in zip((dw13, dw2), ctx.weight_dtypes))
        return _input_gradient(dx, dest_TK, ctx.x_dtype), None, dw13, dw2, *(None,) * 12


def _input_gradient(dx_NH: torch.Tensor, dest_TK: torch.Tensor | None, x_dtype: torch.dtype) -> torch.Tensor:
    """The gradient of `Fp8ExpertFFNFunction`'s x: the rows' dx_NH, or with `dest_TK` (the rows never
    written) their tokens', each token's K rows summed (`permute.PermuteFunction`'s backward, on the
    rows cast to x's dtype as autograd casts a gradient to its input's: the same bits)."""
    if dest_TK is None:
        return dx_NH
    return pm.combine_forward(dx_NH.to(x_dtype).contiguous(), dest_TK, None)


def expert_ffn_fp8(
    x_NH: torch.Tensor | UnwrittenRows,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    w2_EFH: torch.Tensor,
    *,
    weights: Fp8ExpertWeights | None = None,
    tiles: Fp8Tiles | None = None,
    num_programs: int | None = None,
    stats: Fp8Stats | None = None,
    recompute: frozenset[str] = frozenset(),
    source: RowSource | None = None,
    backward: str = DEFAULT_BACKWARD,
    forward: str = DEFAULT_FORWARD,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    emulate: bool = False,
    grad_slot: pm.Fp8RowGradSlot | None = None,
) -> torch.Tensor:
    """The experts backend contract `expert_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH) -> y_NH` with
    every GEMM in FP8, differentiable in x, w13 and w2. `weights`: the FP8 copies of exactly these
    w13 and w2 (`Fp8ExpertWeights.quantize`, once per optimizer step), holding those this recipe
    reads (else ValueError); made here when None, those alone.
    `stats`: every quantisation's counters, forward and backward (module docstring). `tiles`: the
    launches' tiles, by default the tuned ones of this shape class (`Fp8Tiles.for_shape`).
    `recompute` (a subset of `recompute.FP8_RECOMPUTABLE`) and `source` (where x's rows came from,
    for `expert_input`; without one the rows are kept): module docstring. `backward`: which backward
    GEMMs run in FP8 (`BACKWARD_PRECISIONS`); `forward` which forward GEMMs (`FORWARD_GEMMS`: one
    alone, the other in bf16). `x_fp8` (q_NH e4m3, s_NG fp32): x's rows already quantised 1 x 128
    (`permute.quantize_then_permute`, counted there), for a forward whose gate/up GEMM is FP8; x's bf16
    rows are still what the backward reads, unless they come from `source`: then nothing reads them
    and x may be `UnwrittenRows` (anywhere else refused, naming the reader: `bf16_rows_reader`), the
    gradient going to its tokens. `emulate` (`TrainConfig.fp8_emulate`, with backward "bf16" only:
    `check_emulate`): the forward's FP8 GEMMs as their operands' quantise-dequantise images in the
    bf16 experts' GEMMs (`_emulated_forward`), a numerics check of the format against the kernels.
    `grad_slot`: the slot the consumer of y's rows fills with dy's e4m3 rows in its backward
    (`permute.combine_rows(grad_slot=)`), which the backward then reads in place of quantising dy; for a
    step that counts nothing (`stats` None) and a backward with an FP8 data gradient."""
    check_backward(backward)
    check_forward(forward)
    check_emulate(emulate, backward)
    recompute = frozenset(recompute)
    if EXPERT_OUTPUT in recompute:
        raise ValueError(f"the FP8 experts cannot recompute expert_output: {FP8_NO_EXPERT_OUTPUT}; "
                         f"recompute {' and '.join(FP8_RECOMPUTABLE)} only")
    unknown = recompute - set(FP8_RECOMPUTABLE)
    if unknown:
        raise ValueError(f"the FP8 experts recompute {', '.join(FP8_RECOMPUTABLE)}; got {sorted(unknown)}")
    if isinstance(x_NH, UnwrittenRows):
        reader = bf16_rows_reader(forward, x_fp8 is not None, EXPERT_INPUT in recompute and source is not None)
        if reader is not None:
            raise ValueError(f"x's rows were not written (UnwrittenRows) but {reader} reads them; pass the grouped "
                             "rows (`permute.permute_tokens`)")
        x, dest_TK = x_NH.x_TH, x_NH.dest_TK
        rows_shape = (dest_TK.numel(), x.shape[1])
    else:
        x, dest_TK, rows_shape = x_NH, None, tuple(x_NH.shape)
    experts, hidden, two_ffn = w13_EH2F.shape
    if rows_shape[1] != hidden or w2_EFH.shape != (experts, two_ffn // 2, hidden):
        raise ValueError(f"expert weights must be w13 [E, H, 2F] and w2 [E, F, H] matching x [N, H]; got "
                         f"x {rows_shape}, w13 {tuple(w13_EH2F.shape)}, w2 {tuple(w2_EFH.shape)}")
    if source is not None and (source.token_N.shape != rows_shape[:1] or source.x_TH.shape[1:] != rows_shape[1:]):
        raise ValueError(f"source must name one token row of hidden {hidden} per row of x; got tokens "
                         f"{tuple(source.x_TH.shape)} and {tuple(source.token_N.shape)} ids for x {rows_shape}")
    groups = -(-hidden // fp8.SCALE_BLOCK)
    if x_fp8 is not None and (forward == "down" or any(
            tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != x.device
            for t, shape, dtype in zip(x_fp8, (rows_shape, (rows_shape[0], groups)), (fp8.FP8, torch.float32)))):
        raise ValueError(f"x_fp8 must be x's rows [{rows_shape[0]}, {hidden}] in e4m3 with their [{rows_shape[0]}, "
                         f"{groups}] fp32 scales, both contiguous on {x.device} (`permute.quantize_then_permute` "
                         f"makes them), for a forward whose gate/up GEMM is FP8 (forward {forward}); got "
                         + " and ".join(f"{t.dtype} {tuple(t.shape)} on {t.device}"
                                        f"{'' if t.is_contiguous() else ', strided'}" for t in x_fp8))
    if grad_slot is not None and (stats is not None or backward == "bf16"):
        raise ValueError(f"grad_slot hands the backward dy's uncounted e4m3 rows: for a step without counters "
                         f"(stats None) whose backward quantises dy (fp8 or bf16-wgrad); got stats "
                         f"{'given' if stats is not None else 'None'}, backward {backward!r}")
    if weights is not None:
        weights.check_serves(forward, backward)
    if tiles is None:  # from the host-known shapes: no sync, the same every step
        tiles = Fp8Tiles.for_shape(rows_shape[0], experts, hidden, two_ffn // 2, x.device)
    return Fp8ExpertFFNFunction.apply(x.contiguous(), offsets_E, w13_EH2F, w2_EFH, weights, tiles, num_programs,
                                      stats, recompute, source, backward, forward, x_fp8, dest_TK, emulate, grad_slot)
