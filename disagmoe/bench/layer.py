"""`disagmoe bench layer`: one MoE layer's returned rows crossing from the expert GPU to the
attention GPU, the baseline against the tile-level fused return (issue 11, item 3).

The regime of large expert-parallel groups: every (token, expert) pair's output row crosses the
link as its own row. GPU 0 is the attention side (tokens, router, combine), GPU 1 holds every
expert. Rank 0 makes the tokens, a seeded random top-k routing, the expert weights and the output
gradient, groups the pairs by expert (pair p = t K + j, ascending within an expert) and sends GPU 1
what it needs, once and untimed (the dispatch is not what is measured). Then, per pass, the same
kernels two ways:

- (a) baseline: GPU 1's persistent launches store every pair row at its pair row of a local
  buffer; after they finish, NCCL send/recv moves the buffer to GPU 0 (no host syncs), which
  combines it with the fused path's combine kernel, its flags raised beforehand.
- (b) fused: the last GEMM's epilogue stores each row straight into GPU 0's NVSHMEM symmetric
  buffer (a peer tensor, over NVLink) and raises per-segment flags
  (`kernels.fused_return.down_to_destination`); GPU 0's `combine_landed` waits per segment and
  combines as segments land.

Forward: gate/up GEMM with SwiGLU, down GEMM; y[t] = sum_j w[t, j] rows[t K + j]. Backward, the
input gradients returned the same way: GPU 1 holds d rows[p] = w[t, j] dy[t] (grouped, sent with
the inputs), runs the down GEMM's dgrad with the SwiGLU derivative, then the gate/up dgrad, a
plain-epilogue `ragged_rows_gemm` whose rows go to their pair rows (in (b) `down_to_destination`
with w13 transposed); GPU 0 sums each token's K rows, unweighted. The weight gradients are outside
the timed window (GPU 0 never waits for them); they are computed once, for the check.

Timing, per iteration: the hosts meet (an all-reduce, then a synchronize), each GPU sleeps while
its host queues the iteration, and a one-element all-reduce releases both GPUs together (within
a few microseconds); CUDA events from there. Medians over --iters after --warmup of:
- layer time: GPU 0's view, from the release to the combined output;
- expert compute alone: GPU 1's launches with no transfer, timed on their own;
- GPU 0's wait for returned rows: (a) the recv; (b) the combine's time minus the pure combine
  (the same kernel with every flag already raised);
- bytes returned (P H x 2 bytes) and achieved GB/s = bytes / layer time;
- the bound: max(expert compute alone, bytes / the NVLink one-way bandwidth that `bench
  hardware`'s probe measures in the same run).
A speedup is reported only when both variants' outputs and gradients match a single-GPU fp32
torch reference (a plain per-expert MoE layer, autograd) within bf16 tolerance.

Shape legend: T tokens, K top-k, P = T K pairs, N = P rows grouped by expert, E experts (all on
GPU 1), H hidden, F expert FFN size, S segments.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from disagmoe.comm.symmetric import align
from disagmoe.kernels import fused_return as fr, grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.signal import check_status, new_status
from disagmoe.kernels.tile_configs import launching_for
from disagmoe.runtime.stages.pair_return import combine_programs as combine_programs_of

PASSES = ("fwd", "bwd")
TOTAL = "fwd+bwd"
TOLERANCE = 2e-2  # relative L2 error of a bf16 result against the fp32 reference
SPEEDUP_TARGET = 1.2  # issue 11: (b) at least 1.2x (a) on the qwen3-30b-a3b shape
BOUND_SLACK = 0.15  # issue 11: (b) within 15% of the bound on every shape
DEFAULT_SEGMENT_TOKENS = 256
READY = 1 << 40  # a flag counting more messages than any run's combines take: their waits pass at once
SLEEP_CYCLES = 1_000_000  # about 0.5 ms at H200 clocks: the GPU waits while its host queues an iteration
RESULT_TIMEOUT_S = 1800.0  # both ranks' reports, whole run
FAILURE_GRACE_S = 10.0  # after one rank's failure, how long to wait for the other's report
# In both ranks: NVLink multicast off, NVSHMEM on one host (DESIGN section 5), eager CUDA module
# loading (a lazily loaded kernel can stall a pending NCCL send: runtime.cluster.cluster).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
CHILD_DEFAULT_ENV = {"CUDA_MODULE_LOADING": "EAGER"}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One benchmark layer: E experts, all on GPU 1, H -> F, top-K, T tokens on GPU 0."""

    name: str
    experts: int
    hidden: int
    ffn: int
    top_k: int
    tokens: int

    @classmethod
    def of_model(cls, name: str, model: str, expert_parallel: int, *, tokens: int | None = None,
                 pairs: int | None = None) -> LayerShape:
        """A model preset's experts on one rank of an `expert_parallel`-way group."""
        from disagmoe.model_ref import load_model

        m = load_model(model)
        return cls(name, m.num_experts // expert_parallel, m.hidden_size, m.expert_ffn_size, m.top_k,
                   tokens if tokens is not None else pairs // m.top_k)

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def bytes_returned(self) -> int:
        """One bf16 row of H per pair, each pass."""
        return self.pairs * self.hidden * 2

    @property
    def flops(self) -> float:
        """GEMM FLOPs of one timed pass: forward gate/up + down, backward the two dgrads (6 P H F)."""
        return 6.0 * self.pairs * self.hidden * self.ffn


SHAPES = {s.name: s for s in (
    LayerShape.of_model("qwen3-30b-a3b", "qwen3-30b-a3b", 1, tokens=32 * 1024),
    LayerShape.of_model("deepseek-v3-4k", "deepseek-v3", 8, pairs=4 * 1024),
    LayerShape.of_model("deepseek-v3-32k", "deepseek-v3", 8, pairs=32 * 1024),
)}


def layer_shapes(names: Sequence[str] | None) -> list[LayerShape]:
    """The named shapes (all when none are named)."""
    unknown = [n for n in names or [] if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    return [SHAPES[n] for n in names or SHAPES]


# --- inputs and the single-GPU reference (plain torch; CPU-testable) ------------------------------

@dataclasses.dataclass(frozen=True)
class LayerInputs:
    """GPU 0's side of the layer: bf16 tokens, weights and output gradient, fp32 routing weights."""

    x_TH: torch.Tensor
    topk_TK: torch.Tensor
    weights_TK: torch.Tensor
    w13_EH2F: torch.Tensor
    w2_EFH: torch.Tensor
    dy_TH: torch.Tensor


def make_inputs(shape: LayerShape, device: torch.device, seed: int = 0) -> LayerInputs:
    """Random (seeded) tokens and weights; K distinct experts per token, uniformly at random, with
    normalised random routing weights."""
    if not 1 <= shape.top_k <= shape.experts:
        raise ValueError(f"shape {shape.name}: top_k {shape.top_k} must lie in [1, {shape.experts} experts]")
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    E, H, Fs, T, K = shape.experts, shape.hidden, shape.ffn, shape.tokens, shape.top_k
    x = torch.randn(T, H, **bf16)
    scores, topk = torch.rand(T, E, device=device, generator=gen).topk(K, dim=1)
    w13 = torch.randn(E, H, 2 * Fs, **bf16) / H**0.5
    w2 = torch.randn(E, Fs, H, **bf16) / Fs**0.5
    dy = torch.randn(T, H, **bf16)
    return LayerInputs(x, topk, scores / scores.sum(1, keepdim=True), w13, w2, dy)


def group_pairs(topk_TK: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs_N, offsets_E): the pair p = t K + j of each row grouped by expert (ascending within
    an expert, as a stable sort), int32, and the int32 cumulative rows per expert."""
    flat_P = topk_TK.reshape(-1)
    pairs_N = torch.argsort(flat_P, stable=True)
    counts_E = torch.bincount(flat_P, minlength=experts)
    return pairs_N.to(torch.int32), counts_E.cumsum(0).to(torch.int32)


def expert_rows(inputs: LayerInputs, pairs_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_NH, dy_NH): each grouped row's token, and its output row's gradient w[t, j] dy[t]."""
    top_k = inputs.topk_TK.shape[1]
    pairs = pairs_N.long()
    tokens_N = pairs // top_k
    dy_NH = inputs.weights_TK.reshape(-1)[pairs, None].float() * inputs.dy_TH[tokens_N].float()
    return inputs.x_TH[tokens_N], dy_NH.to(inputs.dy_TH.dtype)


def moe_layer_reference(x_TH: torch.Tensor, topk_TK: torch.Tensor, weights_TK: torch.Tensor,
                        w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor) -> torch.Tensor:
    """Plain torch, one expert at a time: y[t] = sum_j w[t, j] SwiGLU_{e(t, j)}(x[t])."""
    ffn = w2_EFH.shape[1]
    tokens, outs = [], []
    for expert in range(w13_EH2F.shape[0]):
        t_idx, j_idx = torch.nonzero(topk_TK == expert, as_tuple=True)
        h13 = x_TH[t_idx] @ w13_EH2F[expert]
        outs.append((F.silu(h13[:, :ffn]) * h13[:, ffn:]) @ w2_EFH[expert] * weights_TK[t_idx, j_idx][:, None])
        tokens.append(t_idx)
    return torch.zeros_like(x_TH).index_add(0, torch.cat(tokens), torch.cat(outs))


GRADIENTS = ("dx", "d_weights", "dw13", "dw2")


def reference_results(inputs: LayerInputs) -> dict[str, torch.Tensor]:
    """y and the gradients of x, the routing weights, w13 and w2 for dy, in fp32 (autograd)."""
    leaves = [t.detach().float().requires_grad_() for t in
              (inputs.x_TH, inputs.weights_TK, inputs.w13_EH2F, inputs.w2_EFH)]
    y = moe_layer_reference(leaves[0], inputs.topk_TK, *leaves[1:])
    grads = torch.autograd.grad(y, leaves, inputs.dy_TH.float())
    return {"y": y.detach(), **dict(zip(GRADIENTS, grads, strict=True))}


def router_grad(dy_TH: torch.Tensor, rows_PH: torch.Tensor, top_k: int) -> torch.Tensor:
    """d w[t, j] = <dy[t], rows[t K + j]> (fp32): GPU 0's routing-weight gradient from returned rows."""
    tokens, hidden = dy_TH.shape
    return torch.einsum("tkh,th->tk", rows_PH.float().view(tokens, top_k, hidden), dy_TH.float())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (float64)."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


# --- GPU 1's launches (device-agnostic: the interpreter runs them on CPU tensors) -------------------

@dataclasses.dataclass(frozen=True)
class Signal:
    """Where a fused launch reports its rows landing (`fused_return.down_to_destination`)."""

    flags_QS: torch.Tensor  # the receiver's int64 flag block, row 0 this source's
    counters_S: torch.Tensor  # this rank's int32 zeros
    segment_tokens: int


class ExpertSide:
    """GPU 1's rows (grouped by expert), weights, tiles and work buffers; `launch` runs one pass."""

    def __init__(self, x_NH: torch.Tensor, dy_NH: torch.Tensor, pairs_N: torch.Tensor, offsets_E: torch.Tensor,
                 w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor, top_k: int, tiles: FFNTiles,
                 num_programs: int | None = None) -> None:
        self.x_NH, self.dy_NH, self.pairs_N, self.offsets_E = x_NH, dy_NH, pairs_N, offsets_E
        self.w13_EH2F, self.w2_EFH, self.top_k, self.tiles = w13_EH2F, w2_EFH, top_k, tiles
        self.num_programs = num_programs
        rows, ffn = x_NH.shape[0], w2_EFH.shape[1]
        self.act_NF = x_NH.new_empty((rows, ffn))
        self.h13_N2F = x_NH.new_empty((rows, 2 * ffn))
        self.dh13_N2F = x_NH.new_empty((rows, 2 * ffn))

    def launch(self, pass_name: str, out_PH: torch.Tensor, signal: Signal | None = None) -> None:
        """One pass, every pair row stored at its pair row of out_PH (the forward's output rows, or
        the backward's input-gradient rows); with `signal`, out_PH is the receiver's buffer and the
        last launch raises its flags per segment. The same kernels either way."""
        if pass_name == "fwd":
            gg.ragged_rows_gemm(self.x_NH, self.offsets_E, self.w13_EH2F, self.tiles.gate_up,
                                epilogue=gg.EPILOGUE_SWIGLU, out=self.act_NF, h13_N2C=self.h13_N2F,
                                num_programs=self.num_programs)
            a_NK, b_EKH, tile = self.act_NF, self.w2_EFH, self.tiles.down
        elif pass_name == "bwd":  # needs a forward's pre-activations (h13)
            gg.ragged_rows_gemm(self.dy_NH, self.offsets_E, self.w2_EFH.transpose(1, 2), self.tiles.down_dgrad,
                                epilogue=gg.EPILOGUE_SWIGLU_GRAD, out=self.dh13_N2F, h13_N2C=self.h13_N2F,
                                num_programs=self.num_programs)
            a_NK, b_EKH, tile = self.dh13_N2F, self.w13_EH2F.transpose(1, 2), self.tiles.gate_up_dgrad
        else:
            raise ValueError(f"unknown pass {pass_name!r}; choose from {PASSES}")
        if signal is None:
            gg.ragged_rows_gemm(a_NK, self.offsets_E, b_EKH, tile, out=out_PH, dst_rows_N=self.pairs_N,
                                num_programs=self.num_programs)
            return
        fr.down_to_destination(a_NK, self.offsets_E, b_EKH, tile, dst_PH=out_PH, dst_rows_N=self.pairs_N,
                               tokens=out_PH.shape[0] // self.top_k, top_k=self.top_k,
                               segment_tokens=signal.segment_tokens, counters_S=signal.counters_S,
                               flags_QS=signal.flags_QS, source=0, num_programs=self.num_programs)

    def in_segment_order(self, segment_tokens: int, segments: int) -> ExpertSide:
        """The same rows regrouped by (band of destination segments, expert) (`fused_return.segment_major_order`):
        the GEMMs finish segment by segment, so the receiver combines the first while later ones compute."""
        order_N, offsets_G = fr.segment_major_order(self.offsets_E, self.pairs_N, self.top_k, segment_tokens, segments)
        return ExpertSide(self.x_NH[order_N], self.dy_NH[order_N], self.pairs_N[order_N], offsets_G,
                          self.w13_EH2F, self.w2_EFH, self.top_k, self.tiles, self.num_programs)

    def weight_grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dw13_EH2F, dw2_EFH) after a forward and a backward (as `moe_ffn_backward`)."""
        dw2 = gg.ragged_weight_grad(self.act_NF, self.dy_NH, self.offsets_E, self.tiles.wgrad_w2,
                                    num_programs=self.num_programs)
        dw13 = gg.ragged_weight_grad(self.x_NH, self.dh13_N2F, self.offsets_E, self.tiles.wgrad_w13,
                                     num_programs=self.num_programs)
        return dw13, dw2


def combine(rows_PH: torch.Tensor, pass_name: str, weights_TK: torch.Tensor, flags_QS: torch.Tensor,
            consumed_QS: torch.Tensor, segment_tokens: int, top_k: int, programs: int,
            status_2: torch.Tensor) -> torch.Tensor:
    """GPU 0's combine of one pass: weighted (forward output) or a plain sum (input gradient), each
    segment once its flag counts one more message than `consumed_QS` (which it advances); a wait
    that gives up is recorded in `status_2` (read once, after the runs)."""
    return fr.combine_landed(rows_PH, weights_TK if pass_name == "fwd" else None, flags_QS, consumed_QS,
                             segment_tokens, top_k, status_2, num_programs=programs)


# --- the report (pure: tests inject measurements) -------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PassTimes:
    """One pass's medians, ms."""

    compute_ms: float  # GPU 1's launches alone, no transfer
    pure_combine_ms: float  # GPU 0's combine with every flag already raised
    baseline_layer_ms: float  # (a): GPU 0, release to combined output
    baseline_wait_ms: float  # (a): GPU 0, release to the end of the recv
    baseline_expert_ms: float  # (a): GPU 1, release to the end of its launches
    fused_layer_ms: float | None = None  # (b): GPU 0, release to combined output (None: not run)
    fused_expert_ms: float | None = None  # (b): GPU 1, release to the end of its fused launches

    def __add__(self, other: PassTimes) -> PassTimes:
        add = lambda a, b: None if a is None or b is None else a + b  # noqa: E731
        return PassTimes(*(add(getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)))


def failed_checks(errors: dict[str, dict[str, float]], tolerance: float = TOLERANCE) -> list[str]:
    """'variant quantity error' for every error over the tolerance (NaN included)."""
    return [f"{variant} {name} {err:.2e}" for variant, errs in errors.items() for name, err in errs.items()
            if not err <= tolerance]


def summarise(pass_name: str, nbytes: int, times: PassTimes, errors: dict[str, dict[str, float]],
              nvlink_gbps: float | None, bound_ms: float | None = None, tolerance: float = TOLERANCE) -> dict:
    """One row of the report: (a) and (b) layer time, wait, achieved GB/s; the bound
    max(expert compute alone, bytes / NVLink one-way bandwidth) (or `bound_ms` given); (b)'s speedup
    over (a) and its ratio to the bound, both None unless every check passed."""
    link_ms = nbytes / nvlink_gbps / 1e6 if nvlink_gbps else None
    if bound_ms is None and link_ms is not None:
        bound_ms = max(times.compute_ms, link_ms)
    failed = failed_checks(errors, tolerance)
    fused = times.fused_layer_ms
    fused_row = None if fused is None else {
        "layer_ms": fused, "wait_ms": max(0.0, fused - times.pure_combine_ms), "expert_ms": times.fused_expert_ms,
        "gbps": nbytes / fused / 1e6}
    trusted = fused is not None and not failed
    return {
        "pass": pass_name, "bytes": nbytes, "compute_ms": times.compute_ms, "pure_combine_ms": times.pure_combine_ms,
        "link_ms": link_ms, "bound_ms": bound_ms,
        "baseline": {"layer_ms": times.baseline_layer_ms, "wait_ms": times.baseline_wait_ms,
                     "expert_ms": times.baseline_expert_ms, "gbps": nbytes / times.baseline_layer_ms / 1e6},
        "fused": fused_row, "errors": errors, "check_failed": failed,
        "speedup": times.baseline_layer_ms / fused if trusted else None,
        "fused_vs_bound": fused / bound_ms if trusted and bound_ms else None,
    }


def pass_times(rank0: dict, rank1: dict, pass_name: str) -> PassTimes:
    """One pass's PassTimes from the two ranks' reports of a shape."""
    fused0, fused1 = rank0.get("fused"), rank1.get("fused")
    return PassTimes(
        compute_ms=rank1["compute"][pass_name], pure_combine_ms=rank0["pure_combine"][pass_name],
        baseline_layer_ms=rank0["baseline"][pass_name]["layer"], baseline_wait_ms=rank0["baseline"][pass_name]["wait"],
        baseline_expert_ms=rank1["baseline"][pass_name]["expert"],
        fused_layer_ms=fused0[pass_name]["layer"] if fused0 else None,
        fused_expert_ms=fused1[pass_name]["expert"] if fused1 else None)


def shape_record(shape: LayerShape, rank0: dict, rank1: dict, nvlink_gbps: float | None,
                 segment_tokens: int) -> dict:
    """A shape's rows: forward, backward, and their sum (bound: the sum of the passes' bounds)."""
    rows, times = [], []
    for pass_name in PASSES:
        times.append(pass_times(rank0, rank1, pass_name))
        rows.append(summarise(pass_name, shape.bytes_returned, times[-1], rank0["errors"][pass_name], nvlink_gbps))
    errors = {f"{p} {variant}": errs for p in PASSES for variant, errs in rank0["errors"][p].items()}
    bounds = [r["bound_ms"] for r in rows]
    total_bound = None if None in bounds else sum(bounds)
    rows.append(summarise(TOTAL, 2 * shape.bytes_returned, times[0] + times[1], errors, nvlink_gbps, total_bound))
    return {**dataclasses.asdict(shape), "pairs": shape.pairs, "bytes_returned": shape.bytes_returned,
            "segments": fr.num_segments(shape.tokens, segment_tokens), "tflop_per_pass": shape.flops / 1e12,
            "tiles": rank1.get("tiles"), "passes": rows}


def build_record(shapes: Sequence[LayerShape], reports: dict[int, dict], measured: dict | None, options: dict,
                 fused_skipped: str | None) -> dict:
    """The run's record from both ranks' reports and the same run's `bench hardware` probe."""
    nvlink = (measured or {}).get("nvlink_gbps")
    records = [shape_record(shape, r0, r1, nvlink, options["segment_tokens"])
               for shape, r0, r1 in zip(shapes, reports[0]["shapes"], reports[1]["shapes"], strict=True)]
    failed = [f"{s['name']} {row['pass']} {c}" for s in records for row in s["passes"][:len(PASSES)]
              for c in row["check_failed"]]
    return {"environment": reports[0].get("environment", {}), "options": options, "hardware": measured,
            "nvlink_gbps": nvlink, "fused": fused_skipped is None, "fused_skipped": fused_skipped,
            "tolerance": TOLERANCE, "targets": {"speedup_qwen3": SPEEDUP_TARGET, "bound_slack": BOUND_SLACK},
            "shapes": records, "check_failed": failed}


# --- the two ranks ---------------------------------------------------------------------------------

def arena_layout(shapes: Sequence[LayerShape], segment_tokens: int) -> tuple[int, int, int]:
    """(max segments S, rows bytes per direction, arena bytes) of GPU 0's symmetric receive arena:
    int64 flags [2 directions, S], then the forward's and the backward's pair rows, each sized for
    the largest shape of the run (every shape uses views of it)."""
    segments = max(fr.num_segments(s.tokens, segment_tokens) for s in shapes)
    rows_bytes = align(max(s.bytes_returned for s in shapes))
    return segments, rows_bytes, align(2 * segments * 8) + 2 * rows_bytes


class ReturnArena:
    """GPU 0's receive buffers in NVSHMEM symmetric memory (one collective allocation); rank 1 sees
    them through a peer tensor (never its own PE's: DESIGN section 5), rank 0 as its own memory."""

    def __init__(self, nv: Any, rank: int, shapes: Sequence[LayerShape], segment_tokens: int) -> None:
        self.nv = nv
        self.segments, self.rows_bytes, nbytes = arena_layout(shapes, segment_tokens)
        self.flags_bytes = nbytes - 2 * self.rows_bytes
        self.segment_tokens = segment_tokens
        self.local_B = nv.tensor((nbytes,), dtype=torch.uint8)  # collective
        self.local_B.zero_()  # flags start at 0: no step yet
        self._barrier()
        self.view_B = nv.get_peer_tensor(self.local_B, 0) if rank == 1 else self.local_B
        # GPU 0's consumed words beside the flags (`kernels.signal`): its combines advance them
        self.consumed_DS = torch.zeros(2, self.segments, dtype=torch.int64, device=self.local_B.device)

    def rows(self, direction: int, shape: LayerShape) -> torch.Tensor:
        """[P, H] bf16 of direction 0 (forward rows) or 1 (input-gradient rows)."""
        start = self.flags_bytes + direction * self.rows_bytes
        return self.view_B[start:start + shape.bytes_returned].view(torch.bfloat16).view(shape.pairs, shape.hidden)

    def flags(self, direction: int, shape: LayerShape) -> torch.Tensor:
        """[1 source, S] int64 of one direction."""
        segments = fr.num_segments(shape.tokens, self.segment_tokens)
        start = direction * self.segments * 8
        return self.view_B[start:start + segments * 8].view(torch.int64).view(1, segments)

    def consumed(self, direction: int, shape: LayerShape) -> torch.Tensor:
        """GPU 0's consumed words [1 source, S] of one direction's flags (every shape's flags are
        views of the same words, so their counts carry over from shape to shape)."""
        return self.consumed_DS[direction, :fr.num_segments(shape.tokens, self.segment_tokens)].view(1, -1)

    def _barrier(self) -> None:
        stream = torch.cuda.current_stream()
        stream.synchronize()
        self.nv.barrier_all(stream=stream)
        stream.synchronize()

    def close(self) -> None:
        """Free the arena and leave NVSHMEM (collective)."""
        self.view_B = None  # the peer view goes before the allocation it maps
        self._barrier()  # no peer writes into the arena any more
        self.nv.free_tensor(self.local_B)
        self.nv.finalize()


def _record() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _release_together(token: torch.Tensor) -> None:
    """The hosts meet, then both GPUs start the iteration together (module docstring)."""
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.all_reduce(token)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    dist.all_reduce(token)


def _aligned(fn: Callable[[Callable[[str], None]], Any], warmup: int, iters: int,
             token: torch.Tensor) -> tuple[dict[str, float], Any]:
    """fn(mark) warmup + iters times, both ranks released together each time: the medians, ms
    from the release to each `mark(name)`, and fn's last result. Both ranks call this the same
    number of times, so GPU 1's fused launches count as many messages as GPU 0's combines take."""
    samples: dict[str, list[float]] = {}
    result = None
    for i in range(warmup + iters):
        _release_together(token)
        start, marks = _record(), {}
        result = fn(lambda name: marks.__setitem__(name, _record()))
        torch.cuda.synchronize()
        if i >= warmup:
            for name, event in marks.items():
                samples.setdefault(name, []).append(start.elapsed_time(event))
    return {name: statistics.median(values) for name, values in samples.items()}, result


@dataclasses.dataclass(frozen=True)
class Options:
    iters: int
    warmup: int
    segment_tokens: int
    combine_programs: int
    fused: bool
    seed: int = 0
    order: str = "expert"  # the fused path's row order: "expert" (as training) or "segment" (segment-major groups)


def expert_tiles(shape: LayerShape, device: torch.device) -> FFNTiles:
    """GPU 1's tiles: the classes tuned on even loads (`tile_configs.LOADS`), since `make_inputs`' uniformly random
    top-k gives every expert close to the mean of rows, whatever the process's own loads."""
    with launching_for("even"):
        return FFNTiles.for_shape(shape.pairs, shape.experts, shape.hidden, shape.ffn, device)


def _expert_specs(shape: LayerShape) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What rank 0 sends rank 1 once: w13, w2, x rows, d rows, pairs, offsets."""
    E, H, Fs, P = shape.experts, shape.hidden, shape.ffn, shape.pairs
    bf16, i32 = torch.bfloat16, torch.int32
    return [((E, H, 2 * Fs), bf16), ((E, Fs, H), bf16), ((P, H), bf16), ((P, H), bf16), ((P,), i32), ((E,), i32)]


def _run_shape(rank: int, shape: LayerShape, opts: Options, arena: ReturnArena | None) -> dict:
    """Both ranks' side of one shape, in the same order of communication (read the branches side by side)."""
    import torch.distributed as dist

    from disagmoe.bench.timing import median_ms

    dev = torch.device("cuda", rank)
    K, seg = shape.top_k, opts.segment_tokens
    programs = opts.combine_programs or combine_programs_of(dev)
    token = torch.zeros(1, device=dev)
    report: dict = {}
    # 1. inputs: made on GPU 0, sent to GPU 1 once (untimed)
    if rank == 0:
        inputs = make_inputs(shape, dev, opts.seed)
        pairs_N, offsets_E = group_pairs(inputs.topk_TK, shape.experts)
        for tensor in (inputs.w13_EH2F, inputs.w2_EFH, *expert_rows(inputs, pairs_N), pairs_N, offsets_E):
            dist.send(tensor.contiguous(), 1)
        # flags counting more messages than any run consumes: every wait of these combines passes at once
        ready_QS = torch.full((1, fr.num_segments(shape.tokens, seg)), READY, dtype=torch.int64, device=dev)
        ready_consumed_QS = torch.zeros_like(ready_QS)
        status_2 = new_status(dev)
        recv_PH = torch.randn(shape.pairs, shape.hidden, device=dev, dtype=torch.bfloat16)
    else:
        received = [torch.empty(size, dtype=dtype, device=dev) for size, dtype in _expert_specs(shape)]
        for tensor in received:
            dist.recv(tensor, 0)
        w13, w2, x_NH, dy_NH, pairs_N, offsets_E = received
        tiles = expert_tiles(shape, dev)
        side = ExpertSide(x_NH, dy_NH, pairs_N, offsets_E, w13, w2, K, tiles)
        local_PH = x_NH.new_empty((shape.pairs, shape.hidden))
        counters_S = torch.zeros(fr.num_segments(shape.tokens, seg), dtype=torch.int32, device=dev)
        fused_side = (side.in_segment_order(seg, fr.num_segments(shape.tokens, seg)) if opts.order == "segment"
                      else side)  # (a) keeps one group per expert, the GEMMs' best
        report["tiles"] = dataclasses.asdict(tiles)
    # 2. each GPU on its own: GPU 1's launches with no transfer, GPU 0's combine with nothing to wait for
    if rank == 0:
        report["pure_combine"] = {p: median_ms(lambda _, p=p: combine(recv_PH, p, inputs.weights_TK, ready_QS,
                                                                       ready_consumed_QS, seg, K, programs, status_2),
                                               opts.warmup, opts.iters)
                                  for p in PASSES}
    else:
        report["compute"] = {p: median_ms(lambda _, p=p: side.launch(p, local_PH), opts.warmup, opts.iters)
                             for p in PASSES}  # fwd first: the backward reads its pre-activations
    # 3. per pass, (a) then (b), both GPUs released together each iteration
    results: dict[str, dict[str, torch.Tensor]] = {"baseline": {}, "fused": {}}
    report["baseline"], report["fused"] = {}, ({} if arena is not None else None)
    for direction, p in enumerate(PASSES):
        if rank == 0:
            def baseline(mark, p=p):
                dist.recv(recv_PH, 1)
                mark("wait")
                out = combine(recv_PH, p, inputs.weights_TK, ready_QS, ready_consumed_QS, seg, K, programs, status_2)
                mark("layer")
                return out
        else:
            def baseline(mark, p=p):
                side.launch(p, local_PH)
                mark("expert")
                dist.send(local_PH, 0)
        report["baseline"][p], out = _aligned(baseline, opts.warmup, opts.iters, token)
        if rank == 0:
            _keep(results["baseline"], p, out, recv_PH, inputs, K)
        if arena is None:
            continue
        rows_PH, flags_QS = arena.rows(direction, shape), arena.flags(direction, shape)
        if rank == 0:
            consumed_QS = arena.consumed(direction, shape)

            def fused(mark, p=p, rows_PH=rows_PH, flags_QS=flags_QS, consumed_QS=consumed_QS):
                out = combine(rows_PH, p, inputs.weights_TK, flags_QS, consumed_QS, seg, K, programs, status_2)
                mark("layer")
                return out
        else:
            def fused(mark, p=p, rows_PH=rows_PH, flags_QS=flags_QS):
                fused_side.launch(p, rows_PH, Signal(flags_QS, counters_S, seg))
                mark("expert")
        report["fused"][p], out = _aligned(fused, opts.warmup, opts.iters, token)
        if rank == 0:
            _keep(results["fused"], p, out, rows_PH, inputs, K)
    # 4. the check: GPU 1's weight gradients travel to GPU 0, which holds the fp32 reference
    if rank == 1:
        for tensor in side.weight_grads():
            dist.send(tensor.contiguous(), 0)
        torch.cuda.synchronize()
        return report
    dw = [torch.empty_like(inputs.w13_EH2F), torch.empty_like(inputs.w2_EFH)]
    for tensor in dw:
        dist.recv(tensor, 1)
    check_status(status_2.tolist(), "bench layer, GPU 0's combine")  # a wait that gave up: no figures
    want = reference_results(inputs)
    errors: dict[str, dict[str, dict[str, float]]] = {p: {} for p in PASSES}
    for variant, got in results.items():
        if got:
            errors["fwd"][variant] = {"y": relative_error(got["y"], want["y"])}
            errors["bwd"][variant] = {name: relative_error(got[name], want[name]) for name in ("dx", "d_weights")}
    errors["bwd"]["experts"] = {name: relative_error(t, want[name]) for name, t in zip(("dw13", "dw2"), dw, strict=True)}
    report["errors"] = errors
    return report


def _keep(into: dict, pass_name: str, out: torch.Tensor, rows_PH: torch.Tensor, inputs: LayerInputs,
          top_k: int) -> None:
    """A variant's results for the check: y (and the routing-weight gradient from the rows it
    returned) after the forward, dx after the backward."""
    if pass_name == "fwd":
        into["y"] = out
        into["d_weights"] = router_grad(inputs.dy_TH, rows_PH, top_k)
    else:
        into["dx"] = out


def _worker(rank: int, port: int, shapes: list[LayerShape], opts: Options, arena_bytes: int, results: Any) -> None:
    """One rank (spawned): NCCL process group, NVSHMEM (for (b)), every shape; reports to `results`."""
    report: dict = {"rank": rank}
    try:
        os.dup2(2, 1)  # libraries' prints go to stderr: stdout may be the parent's JSON
        os.environ.update(CHILD_ENV)
        for key, value in {**CHILD_DEFAULT_ENV, "NVSHMEM_SYMMETRIC_SIZE": str(arena_bytes + 2**28)}.items():
            os.environ.setdefault(key, value)
        import torch.distributed as dist

        from disagmoe.bench.timing import environment

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=600), device_id=device)
        arena = None
        if opts.fused:
            from disagmoe.comm.nvshmem import _join, _nvshmem

            nv = _nvshmem()
            _join(nv, rank, 2, device)
            arena = ReturnArena(nv, rank, shapes, opts.segment_tokens)
        report["shapes"] = []
        for shape in shapes:
            report["shapes"].append(_run_shape(rank, shape, opts, arena))
            torch.cuda.empty_cache()
        if arena is not None:
            arena.close()
        if rank == 0:
            report["environment"] = environment(device)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        report["error"] = traceback.format_exc()
    results.put(report)


def _spawn_ranks(shapes: list[LayerShape], opts: Options) -> dict[int, dict]:
    """Both ranks started together; their reports, or RuntimeError naming the rank that failed or hung."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    arena_bytes = arena_layout(shapes, opts.segment_tokens)[2]
    from disagmoe.runtime.cluster.cluster import free_port

    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, shapes, opts, arena_bytes, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    try:
        while len(reports) < 2:
            if any("error" in r for r in reports.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            try:
                report = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                reports[report["rank"]] = report
            except queue.Empty:
                died = [rank for rank, proc in enumerate(procs) if rank not in reports and proc.exitcode]
                if died or time.monotonic() > deadline:
                    break
    finally:
        for proc in procs:
            proc.join(timeout=FAILURE_GRACE_S)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {rank}: {reports[rank]['error']}" for rank in sorted(reports) if "error" in reports[rank]]
    failures += [f"rank {rank} reported nothing (hung, or killed: exit code {procs[rank].exitcode})"
                 for rank in range(2) if rank not in reports]
    if failures:
        raise RuntimeError("`disagmoe bench layer` failed:\n" + "\n".join(failures))
    return reports


def fused_unavailable() -> str | None:
    """Why the fused path (b) cannot run here, or None."""
    from disagmoe.comm.nvshmem import available

    if available():
        return None
    return ("nvshmem4py is not installed (pip install nvshmem4py-cu12 or nvshmem4py-cu13, matching your CUDA); "
            "ran the baseline (a) only")


ORDERS = ("segment", "expert")


def check_options(iters: int, warmup: int, segment_tokens: int, combine_programs: int, order: str = "expert") -> None:
    if order not in ORDERS:
        raise ValueError(f"--order {order!r}: choose segment (rows grouped by destination segment, then expert: "
                         "the first segments land first) or expert (one group per expert)")
    if iters < 1 or warmup < 1:
        raise ValueError(f"need --iters >= 1 and --warmup >= 1 (the first iteration of each variant compiles its "
                         f"kernels, and the fused one does so while GPU 0 waits); got {iters} and {warmup}")
    if segment_tokens < 1:
        raise ValueError(f"--segment-tokens {segment_tokens}: a segment holds at least 1 token (default "
                         f"{DEFAULT_SEGMENT_TOKENS})")
    if combine_programs < 0:
        raise ValueError(f"--combine-programs {combine_programs}: a count of programs, or 0 for 4 per SM "
                         "(the default)")


def check_gpus() -> None:
    """ValueError unless two CUDA GPUs are visible."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        seen = "none is visible" if count == 0 else "1 is visible"
        raise ValueError(f"`disagmoe bench layer` needs 2 CUDA GPUs (GPU 0 the attention side, GPU 1 the "
                         f"experts); {seen}. Run it on a machine with two NVLink-connected GPUs")


def run(shapes: Sequence[LayerShape], iters: int = 20, warmup: int = 5,
        segment_tokens: int = DEFAULT_SEGMENT_TOKENS, combine_programs: int = 0,
        log: Callable[[str], None] = print, order: str = "expert") -> dict:
    """Every shape on GPUs 0 and 1, (a) and (b) in the same run, then `bench hardware`'s probe."""
    from dataclasses import asdict

    from disagmoe.bench import hardware

    check_options(iters, warmup, segment_tokens, combine_programs, order)
    if not shapes:
        raise ValueError("no shapes to run")
    check_gpus()
    skipped = fused_unavailable()
    if skipped:
        log(f"fused path (b) not run: {skipped}")
    opts = Options(iters, warmup, segment_tokens, combine_programs, fused=skipped is None, order=order)
    log(f"bench layer: {', '.join(s.name for s in shapes)} on GPUs 0 (attention) and 1 (experts), "
        f"{warmup} + {iters} iterations per variant")
    reports = _spawn_ranks(list(shapes), opts)
    log("bench hardware probe (NVLink one-way bandwidth, same run)")
    measured = asdict(hardware.measure())
    options = {"iters": iters, "warmup": warmup, "segment_tokens": segment_tokens,
               "combine_programs": combine_programs, "seed": opts.seed, "order": order}
    return build_record(shapes, reports, measured, options, skipped)
