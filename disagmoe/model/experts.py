"""Routed experts: stacked SwiGLU weights and the interchangeable expert-FFN backends.

Every backend implements the contract of DESIGN.md section 3b,
`expert_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH) -> y_NH`: rows of x grouped by expert, offsets_E
the int32 cumulative row counts, y_e = (silu(x_e @ W13[e][:, :F]) * (x_e @ W13[e][:, F:])) @ W2[e].
Rows after offsets[-1] (a spare bucket, e.g. pairs routed to another rank) are never read; their
output rows are undefined (the loop backend returns zeros) and get no gradient.

Backends: `loop` (one matmul pair per expert), `grouped_mm` (`torch._grouped_mm`, falling back to
`loop` where the device or the shapes do not support it), `triton` (disagmoe.kernels.moe_ffn; with
FlatAdamW's fp32 main gradients its weight-gradient GEMMs wait inside `kernels.deferral.deferred_weight_grads`).

Shape legend: N rows (token-expert pairs), H hidden, F expert FFN width, E experts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, DEFAULT_FP8_EXPERT_FORWARD
from disagmoe.kernels.autocast import autocast_operands
from disagmoe.kernels.recompute import (BLOCK, EXPERT_INPUT, FP8_NO_EXPERT_OUTPUT, FP8_RECOMPUTABLE, RECOMPUTABLE,
                                        UnwrittenRows)
from disagmoe.model.init import seeded_normal_

ExpertFFN = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
BACKENDS = ("loop", "grouped_mm", "triton")


def swiglu_rows(h_N2F: torch.Tensor) -> torch.Tensor:
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return F.silu(gate_NF) * up_NF


def expert_ffn_loop(
    x_NH: torch.Tensor, offsets_E: torch.Tensor, w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor
) -> torch.Tensor:
    """Reference backend: a pair of matmuls per expert (empty ones too, so every expert's weights
    get a gradient, zero when it received no rows); rows after offsets[-1] come back zero."""
    starts = [0, *offsets_E.tolist()]
    outputs = [
        swiglu_rows(x_NH[starts[e] : starts[e + 1]] @ w13_EH2F[e]) @ w2_EFH[e]
        for e in range(offsets_E.numel())
    ]
    rest = x_NH.shape[0] - starts[-1]
    if rest:
        outputs.append(x_NH.new_zeros((rest, w2_EFH.shape[2])))
    return torch.cat(outputs)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (`_grouped_mm`'s backward
    rejects stride-0 gradients such as the one `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_supported(x_NH: torch.Tensor, w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor) -> bool:
    """`torch._grouped_mm` takes fp32/bf16/fp16 with 16-byte aligned rows (CPU and CUDA sm80+)."""
    if not hasattr(torch, "_grouped_mm") or x_NH.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x_NH.is_cuda and torch.cuda.get_device_capability(x_NH.device) < (8, 0):
        return False
    row_bytes = [d * x_NH.element_size() for d in (x_NH.shape[1], w13_EH2F.shape[2], w2_EFH.shape[1])]
    return all(b % 16 == 0 for b in row_bytes)


def expert_ffn_grouped_mm(
    x_NH: torch.Tensor, offsets_E: torch.Tensor, w13_EH2F: torch.Tensor, w2_EFH: torch.Tensor
) -> torch.Tensor:
    """Two `torch._grouped_mm` calls (gate/up, down), in the autocast dtype under autocast; the
    loop where unsupported."""
    x_NH, w13_EH2F, w2_EFH = autocast_operands(x_NH, w13_EH2F, w2_EFH)
    if not grouped_mm_supported(x_NH, w13_EH2F, w2_EFH):
        return expert_ffn_loop(x_NH, offsets_E, w13_EH2F, w2_EFH)
    h_N2F = torch._grouped_mm(x_NH, w13_EH2F, offs=offsets_E)
    y_NH = torch._grouped_mm(swiglu_rows(h_N2F), w2_EFH, offs=offsets_E)
    return _ContiguousGrad.apply(y_NH)


def get_expert_ffn(backend: str) -> ExpertFFN:
    """The backend function by name; the Triton kernel is imported only when asked for."""
    if backend == "loop":
        return expert_ffn_loop
    if backend == "grouped_mm":
        return expert_ffn_grouped_mm
    if backend == "triton":
        try:
            from disagmoe.kernels.moe_ffn import expert_ffn_triton
        except ImportError as err:
            raise ValueError(
                f"experts backend 'triton' is unavailable ({err}); install the gpu extra "
                "(pip install -e '.[gpu]') or choose experts_backend='loop' or 'grouped_mm'"
            ) from None
        return expert_ffn_triton
    raise ValueError(f"unknown experts backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def check_backend_device(backend: str, device: str) -> None:
    """ValueError, with the fix, for a backend that cannot run on `device` ('cpu' or 'cuda'): the
    triton kernels need a CUDA GPU (or Triton's interpreter, TRITON_INTERPRET=1, which the kernel
    tests use on CPU); without this a CPU run would fail at its first launch with Triton's
    "0 active drivers"."""
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("experts_backend: triton runs its kernels on CUDA GPUs; on device: cpu use experts_backend: "
                         "loop or grouped_mm (or device: cuda)")


class RoutedExperts(nn.Module):
    """Some experts of one MoE layer (by default all of them), weights stacked in `expert_ids` order.

    `w13_EH2F` [E, H, 2F] (gate in [..., :F], up in [..., F:]) and `w2_EFH` [E, F, H]; local expert
    e is the layer's expert `expert_ids[e]` (ascending, any subset). An expert rank builds one holding
    only its experts with `from_indices` (or `from_slice` for a contiguous range).
    """

    def __init__(
        self, num_experts: int, hidden: int, ffn: int, backend: str = "loop",
        expert_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.expert_ids = tuple(range(num_experts)) if expert_ids is None else tuple(expert_ids)
        if len(self.expert_ids) != num_experts or list(self.expert_ids) != sorted(set(self.expert_ids)):
            raise ValueError(f"expert_ids {self.expert_ids} must be {num_experts} distinct ids in ascending order")
        self.backend = backend
        self.expert_ffn = get_expert_ffn(backend)
        self.recompute: frozenset[str] = frozenset()  # what the backward recomputes (`set_recompute`)
        self.precision = "bf16"  # "fp8": every GEMM in e4m3 (`set_precision`), from `fp8_weights`
        self.fp8_backward = DEFAULT_FP8_EXPERT_BACKWARD  # under fp8: which backward GEMMs run in FP8 (`set_precision`)
        self.fp8_forward = DEFAULT_FP8_EXPERT_FORWARD  # under fp8: which forward GEMMs run in FP8 (`set_precision`)
        self.fp8_emulate = False  # under fp8: those GEMMs quantise-dequantised into bf16 ones (`set_precision`)
        self.fp8_weights = None  # kernels.fp8_ffn.Fp8ExpertWeights, refreshed in place by `prepare_fp8`
        self.fp8_stats = None  # kernels.fp8_stats.Fp8Stats every FP8 quantisation adds into (`set_fp8_stats`)
        self.w13_EH2F = nn.Parameter(torch.empty(num_experts, hidden, 2 * ffn))
        self.w2_EFH = nn.Parameter(torch.empty(num_experts, ffn, hidden))

    @property
    def num_experts(self) -> int:
        return self.w13_EH2F.shape[0]

    @classmethod
    def from_indices(
        cls, full: RoutedExperts, expert_ids: Sequence[int], backend: str | None = None
    ) -> RoutedExperts:
        """A module holding copies of `full`'s experts `expert_ids` (layer-wide ids, held by `full`)."""
        ids = sorted(expert_ids)
        missing = [e for e in ids if e not in full.expert_ids]
        if not ids or missing:
            raise ValueError(f"experts {missing or ids} are not among the {full.num_experts} experts "
                             f"{full.expert_ids[0]}..{full.expert_ids[-1]} of the module they are taken from")
        local = torch.tensor([full.expert_ids.index(e) for e in ids], device=full.w13_EH2F.device)
        _, hidden, two_f = full.w13_EH2F.shape
        part = cls(len(ids), hidden, two_f // 2, backend or full.backend, ids)
        part.w13_EH2F = nn.Parameter(full.w13_EH2F.detach()[local].clone())
        part.w2_EFH = nn.Parameter(full.w2_EFH.detach()[local].clone())
        return part

    @classmethod
    def from_slice(cls, full: RoutedExperts, start: int, stop: int, backend: str | None = None) -> RoutedExperts:
        """A module holding copies of `full`'s experts start..stop-1 (indices local to `full`)."""
        if not 0 <= start < stop <= full.num_experts:
            raise ValueError(f"expert slice {start}:{stop} is outside 0:{full.num_experts}")
        return cls.from_indices(full, full.expert_ids[start:stop], backend)

    def fuses_permute(self, x: torch.Tensor) -> bool:
        """Whether a layer of these experts groups its rows with the Triton permute and weighted-
        combine kernels (`kernels.permute`): the triton backend on CUDA, at any hidden size. (The
        rank scan runs in its own launch: inside the row-copy tile Triton's sm_90 code wrote wrong
        rows at hidden 64; the GPU tests at hidden 16/40/64/300/2048/4096 pass on an H200.) With
        precision fp8 too: the FP8 FFN takes the grouped bf16 rows (unwritten where nothing reads
        them: `reads_rows`), and their e4m3 copies where the layer quantised each token once
        (`quantized_rows`, `model.block`); an expert rank's share quantises only the served rows
        itself (`kernels.fp8.quantize_rows`' valid_rows: a spare bucket's rows are not its)."""
        return self.backend == "triton" and x.is_cuda

    def set_precision(self, precision: str, backward: str | None = None, forward: str | None = None,
                      emulate: bool = False) -> None:
        """"fp8": the expert FFN runs its GEMMs in e4m3 (`kernels.fp8_ffn`; the backward's as
        `backward` says: `fp8_ffn.BACKWARD_PRECISIONS`, the forward's as `forward` says:
        `fp8_ffn.FORWARD_GEMMS`, None = their defaults), rows grouped by the Triton permute on a GPU
        (never the fused bf16 layer op: no expert_output); the triton backend only, recomputing at
        most `kernels.recompute.FP8_RECOMPUTABLE` (`_check_fp8`). `emulate` (`TrainConfig.fp8_emulate`,
        fp8 with backward "bf16" only): the forward's FP8 GEMMs as their operands' quantise-dequantise
        images in the bf16 experts' GEMMs (`fp8_ffn._emulated_forward`), a numerics check."""
        from disagmoe.kernels.fp8_ffn import check_backward, check_emulate, check_forward

        backward = backward or DEFAULT_FP8_EXPERT_BACKWARD
        forward = forward or DEFAULT_FP8_EXPERT_FORWARD
        if precision not in ("bf16", "fp32", "fp8"):
            raise ValueError(f"expert precision {precision!r}: choose bf16, fp32 or fp8")
        check_backward(backward)
        check_forward(forward)
        if emulate and precision != "fp8":
            raise ValueError(f"emulate runs the FP8 experts' GEMMs quantise-dequantised; these experts run in "
                             f"{precision}: set precision fp8 (or emulate off)")
        check_emulate(emulate, backward)
        if precision == "fp8":
            _check_fp8(self.backend, self.recompute)
        self.precision = precision
        self.fp8_backward = backward
        self.fp8_forward = forward
        self.fp8_emulate = emulate
        self.fp8_weights = None

    @torch.no_grad()
    def prepare_fp8(self) -> None:
        """Quantise the weights into the FP8 copies their recipe reads (`fp8_forward`, `fp8_backward`:
        `kernels.fp8_ffn.Fp8ExpertWeights.quantize`), in place (the same tensors every time, so a
        CUDA graph that captured a step reads the copies its own replay wrote; a new recipe, from
        `set_precision`, gets new ones): once per optimizer step, before the step's first forward
        (the trainer), and before an evaluation."""
        if self.precision != "fp8":
            return
        from disagmoe.kernels.fp8_ffn import Fp8ExpertWeights

        kept = self.fp8_weights
        experts, hidden, two_ffn = self.w13_EH2F.shape
        same = kept is not None and kept.matches(self.fp8_forward, self.fp8_backward, (experts, hidden, two_ffn // 2),
                                                 self.w13_EH2F.device)
        # first made, or for another recipe or device: new tensors; else the kept ones written in place (no
        # fresh copies made and copied over: a pass of their bytes, 3.3-3.9 ms a step, session 38's profiles)
        self.fp8_weights = Fp8ExpertWeights.quantize(self.w13_EH2F.detach(), self.w2_EFH.detach(), self.fp8_stats,
                                                     forward=self.fp8_forward, backward=self.fp8_backward,
                                                     into=kept if same else None)

    def set_fp8_stats(self, stats) -> None:
        """The `kernels.fp8_stats.Fp8Stats` whose buffer the FP8 quantisations (weights in
        `prepare_fp8`, rows forward and backward) add their counters into; None: no counting."""
        self.fp8_stats = stats

    def set_recompute(self, modules: frozenset[str]) -> None:
        """Drop `modules` (`kernels.recompute.RECOMPUTABLE`) from what the forward keeps, to be
        recomputed in the backward: the triton backend only (the others keep autograd's tensors).
        `kernels.recompute.BLOCK` (`recompute: full`), any backend: an expert rank runs its share
        of the layer again in the backward from the rows and routing it received
        (`model.local_experts`, `runtime.stages.pair_return`); where a whole block runs in one
        process the block recomputes itself (`model.block`)."""
        kernel_modules = frozenset(modules) & frozenset(RECOMPUTABLE)
        if kernel_modules and self.backend != "triton":
            raise ValueError(f"recompute {sorted(kernel_modules)} needs experts_backend: triton (the {self.backend} "
                             "backend keeps what torch autograd saves); set experts_backend: triton or recompute: none")
        if self.precision == "fp8":
            _check_fp8(self.backend, frozenset(modules))
        self.recompute = frozenset(modules)

    def first_touch_weights(self) -> tuple[nn.Parameter, ...]:
        """The weights whose fp32 main gradient this module's backward writes whole at its first
        weight-gradient launch of a step, so the optimizer may skip zeroing it (`kernels.first_touch`):
        the triton backend's FFN, bf16 or FP8, whose ragged weight-gradient GEMMs write every element
        (zeros for an expert without rows). None for the loop and grouped_mm backends, whose weight
        gradients reach the main gradient through autograd (FlatAdamW's hooks zero an opted-in one
        first, should the backend change after the optimizer is made)."""
        return (self.w13_EH2F, self.w2_EFH) if self.backend == "triton" else ()

    @property
    def kernel_recompute(self) -> frozenset[str]:
        """What the triton kernels themselves drop (`recompute` less `BLOCK`)."""
        return self.recompute & frozenset(RECOMPUTABLE)

    def fused_layer(self, x_TH: torch.Tensor, topk_TK: torch.Tensor, w_TK: torch.Tensor,
                    spare_last: bool = False) -> torch.Tensor:
        """The layer's routed term, sum_k w[t, k] expert_{topk[t, k]}(x[t]), as one op that keeps no
        output rows (`kernels.fused_moe`; `recompute` with expert_output, the triton backend)."""
        from disagmoe.kernels.fused_moe import fused_moe

        return fused_moe(x_TH, topk_TK, w_TK, self.w13_EH2F, self.w2_EFH, spare_last=spare_last,
                         recompute=self.kernel_recompute)

    def quantized_rows(self, x_TH: torch.Tensor, dest_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 forward's input rows (q_NH e4m3, s_NG fp32) of the pairs `dest_TK` groups, each token
        quantised once and copied to its pairs' rows (`kernels.permute.quantize_then_permute`, counted
        in `fp8_stats` per token), for `forward(..., x_fp8=...)`; None where the forward does not start
        with an FP8 GEMM (bf16 experts, or `fp8_forward: down`), and where quantising each pair's row
        moves fewer bytes (`kernels.permute.quantises_tokens_once`: K below 3, the FFN quantises the
        rows itself; the same bits either way). For a layer whose experts serve every pair of the tokens
        (`model.block`: K rows a token, K times the quantising per pair); where most pairs are served
        elsewhere (an expert rank's share) the rows are quantised as they come."""
        from disagmoe.kernels.permute import quantises_tokens_once, quantize_then_permute

        if self.precision != "fp8" or self.fp8_forward == "down" or not quantises_tokens_once(dest_TK.shape[1]):
            return None
        from disagmoe.kernels.fp8_stats import ACTIVATIONS

        return quantize_then_permute(x_TH, dest_TK, None if self.fp8_stats is None else self.fp8_stats.row(ACTIVATIONS))

    def row_grad_slot(self):
        """A `kernels.permute.Fp8RowGradSlot` for this call's output rows, through which the combine's
        backward (`combine_rows(grad_slot=)`) hands these experts their dy already quantised 1 x 128;
        None where nothing would take it: bf16 experts, an FP8 backward in bf16, and a step that counts
        its numerics (the copy has no counters; `set_fp8_stats`)."""
        if self.precision != "fp8" or self.fp8_backward == "bf16" or self.fp8_stats is not None:
            return None
        from disagmoe.kernels.permute import Fp8RowGradSlot

        return Fp8RowGradSlot()

    def reads_rows(self, x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        """Whether a call given `x_fp8` (`quantized_rows`) and, under expert_input, the rows' source
        reads the bf16 input rows, in its forward or its backward: always, but for FP8 experts given
        their e4m3 rows that recompute expert_input (`kernels.fp8_ffn.bf16_rows_reader`). Where it
        does not, the caller need not write them (`model.block`: `UnwrittenRows`)."""
        if self.precision != "fp8":
            return True
        from disagmoe.kernels.fp8_ffn import bf16_rows_reader

        return bf16_rows_reader(self.fp8_forward, x_fp8 is not None, EXPERT_INPUT in self.kernel_recompute) is not None

    def forward(self, x_NH: torch.Tensor | UnwrittenRows, offsets_E: torch.Tensor, source=None,
                x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None, grad_slot=None) -> torch.Tensor:
        """Rows grouped by (local) expert -> output rows in the same order. `source`
        (`kernels.recompute.RowSource`): where the rows came from, kept instead of them when
        `expert_input` is recomputed. `x_fp8`: the FP8 experts' input rows already quantised
        (`quantized_rows`). `x_NH` may be `UnwrittenRows` where the call reads no row
        (`reads_rows`); elsewhere they are refused, naming what reads them. `grad_slot`: from
        `row_grad_slot`, given to the combine of these rows too."""
        assert offsets_E.numel() == self.num_experts, "one cumulative count per local expert"
        if self.precision == "fp8":
            from disagmoe.kernels.fp8_ffn import expert_ffn_fp8

            # no prepared copies (a caller outside the trainer's step): quantised for this call
            return expert_ffn_fp8(x_NH, offsets_E, self.w13_EH2F, self.w2_EFH, weights=self.fp8_weights,
                                  stats=self.fp8_stats, recompute=self.kernel_recompute, source=source,
                                  backward=self.fp8_backward, forward=self.fp8_forward, x_fp8=x_fp8,
                                  emulate=self.fp8_emulate, grad_slot=grad_slot)
        if x_fp8 is not None or grad_slot is not None:
            raise ValueError("x_fp8 and grad_slot are the FP8 experts'; these experts run in bf16 (set_precision('fp8'))")
        if isinstance(x_NH, UnwrittenRows):
            raise ValueError(f"x's rows were not written (UnwrittenRows) but the {self.precision} experts' GEMMs read "
                             "them; pass the grouped rows (`kernels.permute.permute_tokens`)")
        if self.kernel_recompute:
            return self.expert_ffn(x_NH, offsets_E, self.w13_EH2F, self.w2_EFH, recompute=self.kernel_recompute,
                                   source=source)
        return self.expert_ffn(x_NH, offsets_E, self.w13_EH2F, self.w2_EFH)

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str, std: float = 0.02) -> None:
        """Each expert from its own stream keyed by its layer-wide id: any subset inits identically."""
        for e, g in enumerate(self.expert_ids):
            seeded_normal_(self.w13_EH2F[e], seed, f"{prefix}.w13_EH2F[{g}]", std)
            seeded_normal_(self.w2_EFH[e], seed, f"{prefix}.w2_EFH[{g}]", std)

    def extra_repr(self) -> str:
        return f"experts={list(self.expert_ids)}, backend={self.backend}" + (
            (", fp8 emulated" if self.fp8_emulate else ", fp8") if self.precision == "fp8" else "")


def _check_fp8(backend: str, recompute: frozenset[str]) -> None:
    """ValueError, with the fix, for FP8 experts on another backend or recomputing what the FP8
    kernels do not: expert_output (`kernels.recompute.FP8_NO_EXPERT_OUTPUT`) or the whole block
    (`recompute: full`: the recomputed forward would quantise again and count it twice)."""
    if backend != "triton":
        raise ValueError(f"precision: fp8 runs the triton backend's FP8 kernels; set experts_backend: triton (not "
                         f"{backend}) or precision: bf16")
    if BLOCK in recompute:
        raise ValueError("precision: fp8 does not recompute whole blocks (recompute: full): the recomputed forward "
                         "would quantise every operand again, counting it twice in the FP8 statistics; set "
                         f"recompute: none or selective with {', '.join(FP8_RECOMPUTABLE)} (or precision: bf16)")
    others = sorted(recompute & frozenset(RECOMPUTABLE) - frozenset(FP8_RECOMPUTABLE))
    if others:
        raise ValueError(f"precision: fp8 recomputes {' and '.join(FP8_RECOMPUTABLE)} only, not {', '.join(others)}: "
                         f"{FP8_NO_EXPERT_OUTPUT}; drop it from recompute_modules (or precision: bf16)")


def first_touch_params(model: nn.Module) -> list[nn.Parameter]:
    """Every `RoutedExperts.first_touch_weights` in `model`: FlatAdamW's `first_touch` for a trainer
    (after the experts' precision is set)."""
    return [p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.first_touch_weights()]
