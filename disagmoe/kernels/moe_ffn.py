"""The expert FFN (SwiGLU) over rows grouped by expert: persistent Triton launches, torch reference.

Legend: N rows (token-expert pairs grouped by expert), E experts, H hidden size, F expert FFN size;
`offsets_E` int32 cumulative row counts (expert e owns rows offsets[e-1]:offsets[e]; or G = bands x E
row groups in segment-major order, `fused_return.segment_major_order`, group g using expert
g mod E's weights: `moe_ffn_forward` and `moe_ffn_backward` take either);
`w13_EH2F` gate in [..., :F], up in [..., F:]; `w2_EFH` the down projection.

Forward: gate/up GEMM with SwiGLU fused in its epilogue (also saving the pre-activations for the
backward), then the down GEMM whose epilogue writes row r to out[dst_rows_N[r]].
Backward: the down GEMM's dgrad with the SwiGLU derivative fused in its epilogue, the gate/up dgrad,
and the two weight gradients, each one persistent launch.

Selective recomputation (`TrainConfig.recompute`, `kernels.recompute`): `expert_swiglu` keeps only the
pre-activations h13 [N, 2F]; the SwiGLU output act [N, F] (which the down weight's gradient reads)
is recomputed from them in the dgrad's epilogue, which loads h13 anyway (no extra launch, 2 of
the 3 F-wide values per row kept). `expert_input` keeps the tokens x [T, H] the rows were
gathered from and each row's token, instead of the rows [N = T K, H] (K times smaller); the
backward gathers them again for the gate/up weight's gradient. The recomputed act rounds from the
bf16 h13, where the forward's rounds from the fp32 accumulators: the down weight's gradient moves
by bf16 rounding, nothing else changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.tile_configs import TileConfig, device_architecture, lookup, tma_store_fits
from disagmoe.kernels.autocast import autocast_operands
from disagmoe.kernels.deferral import hold_back
from disagmoe.kernels.recompute import EXPERT_INPUT, EXPERT_SWIGLU, RECOMPUTABLE, RowSource
from disagmoe.kernels.wgrad_pairs import weight_grad_into



@dataclasses.dataclass(frozen=True)
class FFNTiles:
    """One tile config per launch of the expert FFN (forward and backward)."""

    gate_up: TileConfig
    down: TileConfig
    down_dgrad: TileConfig
    gate_up_dgrad: TileConfig
    wgrad_w2: TileConfig
    wgrad_w13: TileConfig

    @classmethod
    def uniform(cls, config: TileConfig) -> FFNTiles:
        return cls(*(config,) * len(dataclasses.fields(cls)))

    def on_gluon(self, tma_store: bool = True) -> FFNTiles:
        """These tiles with every launch our Gluon kernels can run sent there (`TileConfig.gluon` at its default
        tile, 128 x 128 with 4 ring stages; `tma_store`: results stored, and main gradients reduce-added, by TMA):
        gate/up, down, the gate/up data gradient, down dgrad's plain GEMM under a split epilogue, and both weight
        gradients (`kernels.gluon_wgrad`, with `atomic_accumulate`, which its TMA reduce-add needs: a weight gradient
        falling back to the Triton kernel adds by fp32 reductions too); never the library's. Launches they cannot
        take (`grouped_gemm.gluon_takes`, `gluon_wgrad_takes`) keep these tiles' other Triton fields."""
        gluon = dict(gluon=True, library=False, gluon_tma_store=tma_store)
        wgrad = dict(gluon, gluon_block_n=128, gluon_stages=4, atomic_accumulate=True)
        return dataclasses.replace(
            self, gate_up=dataclasses.replace(self.gate_up, **gluon), down=dataclasses.replace(self.down, **gluon),
            gate_up_dgrad=dataclasses.replace(self.gate_up_dgrad, **gluon),
            down_dgrad=dataclasses.replace(self.down_dgrad, split_epilogue=True, **gluon),
            wgrad_w2=dataclasses.replace(self.wgrad_w2, **wgrad),
            wgrad_w13=dataclasses.replace(self.wgrad_w13, **wgrad))

    def on_tma_store(self) -> FFNTiles:
        """These tiles with every launch our Triton kernel writing its results by TMA (`TileConfig.tma_store`, with
        TMA loads): gate/up, down, the gate/up data gradient and down dgrad's plain GEMM under a split epilogue at
        their own tiles; both weight gradients reduce-adding atomically by TMA. Never the library's or the Gluon
        kernels. A tile whose store buffer does not fit beside its ring (`tile_configs.tma_store_fits`) loses a ring
        stage at a time until it does (at two, it keeps its pointer stores): what the tuner would time nearest."""
        def stored(tile: TileConfig, role: str, **fields: bool) -> TileConfig:
            tile = dataclasses.replace(tile, library=False, gluon=False, flatten=False, tma=True, tma_store=True,
                                       **fields)
            while not tma_store_fits(tile, role) and tile.num_stages > 2:
                tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
            return tile if tma_store_fits(tile, role) else dataclasses.replace(tile, tma_store=False)

        return FFNTiles(gate_up=stored(self.gate_up, "gate_up"), down=stored(self.down, "down"),
                        down_dgrad=stored(self.down_dgrad, "down", split_epilogue=True),
                        gate_up_dgrad=stored(self.gate_up_dgrad, "gate_up_dgrad"),
                        wgrad_w2=stored(self.wgrad_w2, "wgrad_w2", atomic_accumulate=True),
                        wgrad_w13=stored(self.wgrad_w13, "wgrad_w13", atomic_accumulate=True))

    @staticmethod
    def gemm_dims(hidden: int, ffn: int) -> dict[str, tuple[int, int]]:
        """Role -> (K, output columns) of that launch (weight gradients: the weight's dims)."""
        return {"gate_up": (hidden, ffn), "down": (ffn, hidden), "down_dgrad": (hidden, ffn),
                "gate_up_dgrad": (2 * ffn, hidden), "wgrad_w2": (ffn, hidden),
                "wgrad_w13": (hidden, 2 * ffn)}

    @classmethod
    def for_shape(cls, rows: int, experts: int, hidden: int, ffn: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16) -> FFNTiles:
        """Tuned tiles for this shape class on this GPU (or, untuned here, on a GPU of its
        architecture: `tile_configs`; heuristic defaults when untuned), adjusted to the operands'
        element size and the GPU's shared memory per block."""
        cuda = device.type == "cuda"
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin if cuda else None
        itemsize = torch.empty((), dtype=dtype).element_size()
        arch = device_architecture(device)
        return cls(**{role: lookup(role, k, c, rows, experts, name, itemsize, smem, arch)
                      for role, (k, c) in cls.gemm_dims(hidden, ffn).items()})


def _check_shapes(x_NH: torch.Tensor, offsets_E: torch.Tensor | None, w13_EH2F: torch.Tensor,
                  w2_EFH: torch.Tensor) -> None:
    """ValueError naming the fix for operands that do not fit together (`offsets_E` None: rows
    grouped by the caller later, e.g. `kernels.fused_moe`'s permute)."""
    experts, hidden, two_ffn = w13_EH2F.shape
    if x_NH.shape[1] != hidden or w2_EFH.shape != (experts, two_ffn // 2, hidden):
        raise ValueError(
            f"expert weights must be w13 [E, H, 2F] and w2 [E, F, H] matching x [N, H]; got "
            f"x {tuple(x_NH.shape)}, w13 {tuple(w13_EH2F.shape)}, w2 {tuple(w2_EFH.shape)}")
    if offsets_E is not None and (offsets_E.shape != (experts,) or offsets_E.dtype != torch.int32):
        raise ValueError(f"offsets_E must be int32 of shape ({experts},) (cumulative rows per "
                         f"expert); got {offsets_E.dtype} {tuple(offsets_E.shape)}")
    if not x_NH.dtype == w13_EH2F.dtype == w2_EFH.dtype:
        raise ValueError(f"x, w13 and w2 must share one dtype (got {x_NH.dtype}, {w13_EH2F.dtype}, "
                         f"{w2_EFH.dtype}); cast them, or run under torch.autocast")


def moe_ffn_forward(
    x_NH: torch.Tensor,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    w2_EFH: torch.Tensor,
    tiles: FFNTiles,
    *,
    out: torch.Tensor | None = None,
    dst_rows_N: torch.Tensor | None = None,
    save_for_backward: bool = False,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y, act_NF, h13_N2F or None): y = out with row r written at dst_rows_N[r] (default r).
    `offsets_E` may hold G = bands x E row groups (module docstring)."""
    n_rows, ffn = x_NH.shape[0], w2_EFH.shape[1]
    h13_N2F = x_NH.new_empty((n_rows, 2 * ffn)) if save_for_backward else None
    act_NF = gg.ragged_rows_gemm(x_NH, offsets_E, w13_EH2F, tiles.gate_up,
                                 epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_N2F,
                                 num_programs=num_programs)
    if out is None and dst_rows_N is not None:
        out = x_NH.new_empty((n_rows, w2_EFH.shape[2]))
    y = gg.ragged_rows_gemm(act_NF, offsets_E, w2_EFH, tiles.down, out=out,  # a new y: the library may run it
                            dst_rows_N=dst_rows_N, num_programs=num_programs)
    return y, act_NF, h13_N2F


def moe_ffn_backward(
    dy_NH: torch.Tensor,
    x_NH: torch.Tensor,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    w2_EFH: torch.Tensor,
    act_NF: torch.Tensor | None,
    h13_N2F: torch.Tensor,
    tiles: FFNTiles,
    *,
    num_programs: int | None = None,
    main_grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    input_grad: Callable[[torch.Tensor, torch.Tensor, TileConfig], torch.Tensor | None] | None = None,
    weighted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx_NH, dw13_EH2F, dw2_EFH) from the forward's saved activation and pre-activations
    (`act_NF` None: recomputed from `h13_N2F` in the dgrad's epilogue, `expert_swiglu`).
    `input_grad(dh13_N2F, w13_EH2F^T, tile config)`, if given, runs the gate/up dgrad instead of
    the default GEMM into a new [N, H] (e.g. storing each row into a peer's pair rows,
    `fused_return.down_to_destination`); its result is returned as dx.
    `offsets_E` may hold G = bands x E row groups (module docstring): the weight gradients are
    still [E, ...], each expert's summed over its groups in ascending order.
    `weighted_rows` = (dy_TH, token_N, scale_N, rowdot_BN): dy_NH is dy_TH[token_N] * scale_N (the
    combine's output gradient, rows weighted by their routing weights); the down dgrad reads the
    unscaled token rows and scales them itself, after writing into rowdot_BN each row's dot with
    the SwiGLU output (`grouped_gemm.ragged_rows_gemm`'s `row_scale`: the routing weights'
    gradient, `kernels.fused_moe`).
    `main_grads` (w13's, w2's; e.g. FlatAdamW's fp32 buffers): a weight gradient is added into
    its main gradient by the GEMM itself and None is returned for it (stored, not added, where the
    main gradient is untouched this step: `kernels.first_touch`); inside
    `kernels.deferral.deferred_weight_grads` (both main gradients given) those GEMMs wait in its list."""
    if act_NF is None:
        act_NF = h13_N2F.new_empty((h13_N2F.shape[0], h13_N2F.shape[1] // 2))
        act_out = act_NF
    else:
        act_out = None
    if weighted_rows is None:
        dh13_N2F = gg.ragged_rows_gemm(dy_NH, offsets_E, w2_EFH.transpose(1, 2), tiles.down_dgrad,
                                       epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13_N2F,
                                       num_programs=num_programs, act_N_C=act_out)
    else:
        dy_TH, token_N, scale_N, rowdot_BN = weighted_rows
        dh13_N2F = gg.ragged_rows_gemm(dy_TH, offsets_E, w2_EFH.transpose(1, 2), tiles.down_dgrad,
                                       epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13_N2F,
                                       num_programs=num_programs, act_N_C=act_out, a_rows_N=token_N,
                                       row_scale=(scale_N, rowdot_BN))
    if input_grad is not None:  # the input gradient first: the critical path
        dx_NH = input_grad(dh13_N2F, w13_EH2F.transpose(1, 2), tiles.gate_up_dgrad)
    else:
        dx_NH = gg.ragged_rows_gemm(dh13_N2F, offsets_E, w13_EH2F.transpose(1, 2), tiles.gate_up_dgrad,
                                    num_programs=num_programs)
    main13, main2 = main_grads
    experts = w13_EH2F.shape[0]

    def weight_grads() -> tuple[torch.Tensor, torch.Tensor]:
        # each launch writes every element of its output (zeros for an expert without rows), so the
        # step's first one into a main gradient stores instead of adding (`kernels.first_touch`),
        # decided when it runs (a held-back launch too)
        # (inside `kernels.wgrad_pairs.paired_weight_grads`, with the next micro-batch's launch into the same main)
        dw2_EFH = weight_grad_into(act_NF, dy_NH, offsets_E, tiles.wgrad_w2, main=main2,
                                   weights=experts, num_programs=num_programs)
        dw13_EH2F = weight_grad_into(x_NH, dh13_N2F, offsets_E, tiles.wgrad_w13, main=main13,
                                     weights=experts, num_programs=num_programs)
        return dw13_EH2F, dw2_EFH

    if main13 is not None and main2 is not None and hold_back(weight_grads):
        return dx_NH, None, None  # into the main gradients later (`kernels.deferral.deferred_weight_grads`)
    dw13_EH2F, dw2_EFH = weight_grads()
    return dx_NH, None if main13 is not None else dw13_EH2F, None if main2 is not None else dw2_EFH


class ExpertFFNFunction(torch.autograd.Function):
    """Autograd wrapper: forward and backward as persistent grouped launches."""

    @staticmethod
    def forward(ctx, x_NH, offsets_E, w13_EH2F, w2_EFH, tiles, num_programs, recompute=frozenset(), source=None):
        y_NH, act_NF, h13_N2F = moe_ffn_forward(
            x_NH, offsets_E, w13_EH2F, w2_EFH, tiles,
            save_for_backward=any(ctx.needs_input_grad), num_programs=num_programs)
        # what `recompute` drops is not saved (module docstring); the source's tokens are another
        # node's input, kept as an attribute (autograd's saved-tensor checks apply to this node's own)
        ctx.source = source if EXPERT_INPUT in recompute and source is not None else None
        ctx.x_dtype = x_NH.dtype
        ctx.save_for_backward(None if ctx.source is not None else x_NH, offsets_E, w13_EH2F, w2_EFH,
                              None if EXPERT_SWIGLU in recompute else act_NF, h13_N2F)
        ctx.tiles, ctx.num_programs = tiles, num_programs
        ctx.main_grads = (main_grad_of(w13_EH2F), main_grad_of(w2_EFH))
        return y_NH

    @staticmethod
    def backward(ctx, dy_NH):
        x_NH, offsets_E, w13_EH2F, w2_EFH, act_NF, h13_N2F = ctx.saved_tensors
        if x_NH is None:
            x_NH = ctx.source.rows(ctx.x_dtype)
        dx, dw13, dw2 = moe_ffn_backward(dy_NH.contiguous(), x_NH, offsets_E, w13_EH2F, w2_EFH,
                                         act_NF, h13_N2F, ctx.tiles,
                                         num_programs=ctx.num_programs, main_grads=ctx.main_grads)
        ctx.source = None
        return dx, None, dw13, dw2, None, None, None, None


def main_grad_of(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 main gradient a mixed-precision optimizer attached to `weight` (FlatAdamW sets
    `param.main_grad`), if the weight is such a parameter itself (not a cast copy)."""
    main = getattr(weight, "main_grad", None)
    return main if isinstance(weight, torch.nn.Parameter) and main is not None and weight.requires_grad else None


def expert_ffn_triton(
    x_NH: torch.Tensor,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    w2_EFH: torch.Tensor,
    *,
    tiles: FFNTiles | None = None,
    num_programs: int | None = None,
    recompute: frozenset[str] = frozenset(),
    source: RowSource | None = None,
) -> torch.Tensor:
    """Experts backend `expert_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH) -> y_NH`, differentiable.

    Under CUDA autocast (fp32 master weights, bf16 compute) the operands are cast to the autocast
    dtype first, as autocast does for a matmul; the casts' backward returns fp32 weight grads.
    `recompute` (a subset of `RECOMPUTABLE`) and `source` (where x's rows came from, for
    `expert_input`): module docstring.
    """
    unknown = set(recompute) - set(RECOMPUTABLE)
    if unknown:
        raise ValueError(f"the triton experts recompute {', '.join(RECOMPUTABLE)}; got {sorted(unknown)}")
    if x_NH.is_cuda:
        x_NH, w13_EH2F, w2_EFH = autocast_operands(x_NH, w13_EH2F, w2_EFH)
    _check_shapes(x_NH, offsets_E, w13_EH2F, w2_EFH)
    if tiles is None:
        experts, hidden, two_ffn = w13_EH2F.shape
        tiles = FFNTiles.for_shape(x_NH.shape[0], experts, hidden, two_ffn // 2, x_NH.device,
                                   x_NH.dtype)
    return ExpertFFNFunction.apply(x_NH.contiguous(), offsets_E, w13_EH2F, w2_EFH, tiles,
                                   num_programs, frozenset(recompute), source)


def expert_ffn_reference(
    x_NH: torch.Tensor,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    w2_EFH: torch.Tensor,
) -> torch.Tensor:
    """Plain torch, one expert at a time: y[rows_e] = (silu(x w_gate) * (x w_up)) @ w2[e]."""
    ffn = w2_EFH.shape[1]
    ends = offsets_E.tolist()
    outputs = []
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        h13 = x_NH[start:end] @ w13_EH2F[expert]
        outputs.append((F.silu(h13[:, :ffn]) * h13[:, ffn:]) @ w2_EFH[expert])
    return torch.cat(outputs) if outputs else x_NH.new_empty((0, w2_EFH.shape[2]))
