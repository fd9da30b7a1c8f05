"""The pair-row return (`hop: pair_rows`): expert outputs go back to the attention rank as one row
per (token, expert) pair, stored by the expert kernel into the receiver's buffer as tiles finish,
and combined there as segments land.

Expert side, per source (attention rank d of the set) of one layer and micro-batch:
`expert_pair_rows` groups the source's pairs this rank serves by (band of landing segments, local
expert) with the spare bucket (pairs served elsewhere) last (`kernels.permute`), runs the gate/up
GEMM with SwiGLU and the down GEMM whose epilogue stores pair (t, j) at row token(t) K + j of the
receiver's buffer (token(t) = t, or with sparse dispatch the received row's token on the source,
`token_T`) and raises this rank's flag of each segment once its rows are stored
(`kernels.fused_return.down_to_destination`; the first band's segments complete first, so the
receiver combines them while later bands compute). `expert_pair_rows_backward` takes dy [T, H]
from the receiver, forms each pair's output gradient w dy itself, runs the two dgrad GEMMs (the
weight gradients held back inside `kernels.deferral.deferred_weight_grads`) and returns each pair's
d x the same way, the gate/up dgrad's epilogue storing it into the source's pair-row buffer,
which the source sums per token as segments land (`sum_pairs`).

Attention side: `combine_pairs` waits per segment for every expert rank's flag and sums each
token's rows weighted by its routing weights, in pair order (deterministic;
`kernels.fused_return.combine_landed`); differentiable in the weights: d w[t, j] = rows[t K + j] . dy[t]
(the rows stay valid until their buffer copy is reused, two messages of the slot later).

Off the GPU kernels (CPU ranks, other backends, over a transport's emulation of pair-row
messages) the same contract runs in plain torch: rows by local expert, the experts module, the
rows written where served.

`recompute: full` (`kernels.recompute.BLOCK` in the experts' `recompute`): the forward keeps the
received rows and the routing (each row's pair and destination), nothing of the FFN; the fused
backward runs the gate/up GEMM again for the pre-activations and the SwiGLU output (the rows
gathered again from the received ones); the torch path recomputes the experts' call under a
checkpoint. The stores into the receiver's buffer are never run again.

Shape legend: T tokens of the source (rows received from it), K top-k, P = T K pairs, N = P grouped
rows (the spare bucket last), H hidden, F expert FFN width, L local experts, G = bands x L row
groups, S segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from disagmoe.comm.base import PairLanding, PairTarget
from disagmoe.model.dispatch import expert_counts
from disagmoe.model.experts import RoutedExperts
from disagmoe.kernels.autocast import autocast_operands
from disagmoe.kernels.first_touch import touch
from disagmoe.kernels.recompute import BLOCK, EXPERT_INPUT, EXPERT_SWIGLU, RowSource, pair_of_rows, recomputed

# Bands of landing segments the fused path orders rows by (first band's segments complete first,
# `fused_return.segment_major_order`). One band by default: on an H200 at the Qwen3-30B expert
# shape (8k tokens, top-8, 128 experts) 4 bands cost the expert side 2.2 ms of its 6.6 ms (smaller
# row groups; the banded weight gradients run unpipelined), more than the combine could overlap.
BANDS = 1
# The attention rank's persistent programs waiting and combining, per SM: nothing else runs on its
# GPU meanwhile (its stream waits in the combine; a colocated rank's own experts ran before), and
# at 16 programs the two combines of a layer took 2.3 ms where 4 per SM take 0.1 ms (H200, as above).
COMBINE_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class PairHop:
    """A run's pair-row settings (`TrainConfig.pair_*`)."""

    segment_tokens: int
    bands: int = BANDS
    combine_programs_per_sm: int = COMBINE_PROGRAMS_PER_SM

    @classmethod
    def of(cls, cfg) -> PairHop:
        return cls(cfg.pair_segment_tokens, cfg.pair_bands, cfg.pair_combine_programs_per_sm)

    def combine_programs(self, device: torch.device) -> int:
        return combine_programs(device, self.combine_programs_per_sm)


class KernelState(NamedTuple):
    """The fused path's forward state its backward reads."""

    offsets_G: torch.Tensor  # int32 cumulative rows per (band, local expert) group
    served_1: torch.Tensor  # int32 [1]: rows before the spare bucket
    row_pair_N: torch.Tensor  # int32: each grouped row's pair row on the receiver (the kernels' destinations)
    x_N: torch.Tensor | RowSource  # the grouped rows as the GEMMs read them, or their source (`expert_input`)
    act_NF: torch.Tensor | None  # None: recomputed in the backward (`expert_swiglu`, `recompute: full`)
    h13_N2F: torch.Tensor | None  # None: recomputed in the backward with act_NF (`recompute: full`)
    w13: torch.Tensor
    w2: torch.Tensor
    tiles: object  # kernels.moe_ffn.FFNTiles
    num_programs: int | None
    dest_TK: torch.Tensor | None = None  # the permute's destinations, where x_N is a RowSource


@dataclass
class PairRows:
    """What the backward of one source's pair rows needs."""

    x_leaf: torch.Tensor  # the source's xn [T, H] (a leaf: its grad is d xn)
    x_N: torch.Tensor | None  # grouped rows, from x_leaf through the grouping (autograd; None: not kept)
    row_pair_N: torch.Tensor  # int64: the pair each grouped row holds (t K + j of the rows received)
    dest_N: torch.Tensor  # int64: its pair row on the receiver (row_pair_N, or its token's with `token_T`)
    served_N: torch.Tensor  # bool [N]: rows this rank computes (the rest: the spare bucket)
    w_TK: torch.Tensor  # routing weights (detached)
    experts: RoutedExperts
    fused: KernelState | None = None  # the kernels' saved state (the fused path, with gradients)
    y_N: torch.Tensor | None = None  # the torch path's output rows (autograd)


def expert_pair_rows(x_leaf: torch.Tensor, local_TK: torch.Tensor, w_TK: torch.Tensor, experts: RoutedExperts,
                     target: PairTarget, counters_S: torch.Tensor, segment_tokens: int, *,
                     fused: bool | None = None, bands: int = BANDS, num_programs: int | None = None,
                     token_T: torch.Tensor | None = None) -> PairRows:
    """Compute the pairs of one source this rank serves (`local_TK` < L) and store their rows into
    `target` (module docstring); `counters_S` int32 zeros of at least S (zero again after).
    `fused`: the kernels (default: where the experts fuse their permute, the triton backend on a
    GPU; the interpreter tests ask for them on CPU). `token_T`: int64 [T], a permutation: the
    receiver's token of each row of x (sparse dispatch, `sparse_dispatch.received_order`), whose
    pair rows its pairs go to; None: row t is token t."""
    tokens, top_k = local_TK.shape
    if x_leaf.shape[0] != tokens or w_TK.shape != local_TK.shape:
        raise ValueError(f"x [T, H], local [T, K] and w [T, K] must agree; got {tuple(x_leaf.shape)}, "
                         f"{tuple(local_TK.shape)}, {tuple(w_TK.shape)}")
    if target.rows_PH.shape != (tokens * top_k, x_leaf.shape[1]):
        raise ValueError(f"the target must hold one row per pair, [{tokens * top_k}, {x_leaf.shape[1]}]; "
                         f"got {tuple(target.rows_PH.shape)}")
    if fused is None:
        fused = experts.fuses_permute(x_leaf)
    if token_T is None:
        token_T = torch.arange(tokens, device=x_leaf.device)
    if fused:
        return _fused_forward(x_leaf, local_TK, w_TK, experts, target, counters_S, segment_tokens, bands,
                              num_programs, token_T)
    return _torch_forward(x_leaf, local_TK, w_TK, experts, target, token_T)


def _destinations(row_pair_N: torch.Tensor, token_T: torch.Tensor, top_k: int) -> torch.Tensor:
    """int64 [N]: the receiver's pair row of each grouped row, its token's row of the pair."""
    return token_T[row_pair_N // top_k] * top_k + row_pair_N % top_k


def expert_pair_rows_backward(saved: PairRows, dy_TH: torch.Tensor, target: PairTarget | None = None,
                              counters_S: torch.Tensor | None = None, segment_tokens: int | None = None) -> None:
    """From dy [T, H] (row t: the gradient of the rows received at t, as x): the input gradient and
    the experts' weight gradients (where the plain backward puts them: their fp32 main gradients,
    held back inside `deferred_weight_grads`). The input gradient returns as pair rows into
    `target` (d x of pair (t, j) at the forward's pair row on the receiver, summed over j there,
    `sum_pairs`; fused: the gate/up dgrad's epilogue stores them) with `counters_S` and
    `segment_tokens` as in the forward, or without a target into `saved.x_leaf.grad` (d xn,
    summed here: sparse dispatch returns it per source in the received order)."""
    top_k = saved.w_TK.shape[1]
    pair_N = saved.row_pair_N
    scale_N = torch.where(saved.served_N, saved.w_TK.reshape(-1)[pair_N], 0)
    d_rows_NH = (dy_TH[pair_N // top_k] * scale_N[:, None].to(dy_TH.dtype)).contiguous()
    if saved.fused is None:
        _torch_backward(saved, d_rows_NH, target)
        return
    from disagmoe.kernels import fused_return as fr
    from disagmoe.kernels.moe_ffn import main_grad_of, moe_ffn_backward

    k = saved.fused
    params = (saved.experts.w13_EH2F, saved.experts.w2_EFH)
    main = tuple(main_grad_of(p) if p is op else None for p, op in zip(params, (k.w13, k.w2), strict=True))
    input_grad = None
    if target is not None:
        tokens = saved.w_TK.shape[0]
        segments = fr.num_segments(tokens, segment_tokens)

        def input_grad(dh13_N2F, w13_T, config):
            return fr.down_to_destination(dh13_N2F, k.offsets_G, w13_T, config, dst_PH=target.rows_PH,
                                          dst_rows_N=k.row_pair_N, tokens=tokens, top_k=top_k,
                                          segment_tokens=segment_tokens, counters_S=counters_S[:segments],
                                          flags_QS=target.flags_QS, source=target.source,
                                          served_1=k.served_1, num_programs=k.num_programs)

    x_N = k.x_N.rows(k.w13.dtype) if isinstance(k.x_N, RowSource) else k.x_N
    act_NF, h13_N2F = (k.act_NF, k.h13_N2F) if k.h13_N2F is not None else _gate_up_again(x_N, k)
    dx_NH, dw13, dw2 = moe_ffn_backward(d_rows_NH.to(h13_N2F.dtype), x_N, k.offsets_G, k.w13, k.w2, act_NF,
                                        h13_N2F, k.tiles, num_programs=k.num_programs, main_grads=main,
                                        input_grad=input_grad)
    for param, grad in zip(params, (dw13, dw2), strict=True):
        if grad is not None:  # no main gradient (fp32 parameters, or cast operands): the autograd place
            _accumulate(param, grad)
    if target is None and saved.x_N is not None:
        torch.autograd.backward([saved.x_N], [dx_NH.to(saved.x_N.dtype)])
    elif target is None:  # the grouping's backward (`permute_tokens`'), the rows not kept: d xn directly
        from disagmoe.kernels.permute import combine_forward

        dx_TH = combine_forward(dx_NH.contiguous(), k.dest_TK, None, k.served_1)
        torch.autograd.backward([saved.x_leaf], [dx_TH.to(saved.x_leaf.dtype)])


def _gate_up_again(x_N: torch.Tensor, k: KernelState) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_NF, h13_N2F) of `recompute: full`: the forward's gate/up GEMM with its SwiGLU epilogue
    run again on the same rows (the same kernel on the same values: the forward's bits)."""
    from disagmoe.kernels import grouped_gemm as gg

    h13_N2F = x_N.new_empty((x_N.shape[0], 2 * k.w2.shape[1]))
    act_NF = gg.ragged_rows_gemm(x_N, k.offsets_G, k.w13, k.tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU,
                                 h13_N2C=h13_N2F, num_programs=k.num_programs)
    return act_NF, h13_N2F


def _torch_backward(saved: PairRows, d_rows_NH: torch.Tensor, target: PairTarget | None) -> None:
    if target is None:
        torch.autograd.backward([saved.y_N], [d_rows_NH.to(saved.y_N.dtype)])
        return
    saved.x_N.retain_grad()  # the grouped rows' gradient is what returns (the weights' lands as usual)
    torch.autograd.backward([saved.y_N], [d_rows_NH.to(saved.y_N.dtype)])
    _store_rows(target, saved.dest_N, saved.served_N, saved.x_N.grad)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """grad into param.grad as autograd would (in place where one is there: FlatAdamW's views; a
    first-touch main gradient still untouched this step zeroed first, as FlatAdamW's hook before
    autograd's accumulation: `kernels.first_touch`)."""
    touch(getattr(param, "main_grad", None))
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


@torch.no_grad()
def _store_rows(target: PairTarget, dest_N: torch.Tensor, served_N: torch.Tensor, rows_NH: torch.Tensor) -> None:
    """The torch path's store: grouped row r at pair row dest_N[r] (a permutation of the pair rows)
    where served (rows of pairs served elsewhere keep what their rank wrote), then this source's
    flags raised (one more message counted in each: `kernels.signal`; only this source writes its row).
    It writes every pair row, the other sources' back as it read them: safe where the sources run one
    after another (the local transport on CPU, or one source), not where two write one receiver's rows
    at once. Runs never meet that: hop pair_rows over nvshmem needs the triton experts, which on CUDA
    take the fused path (`fuses_permute`), whose kernel stores only the served rows."""
    rows = target.rows_PH
    kept = rows[dest_N]
    rows.index_copy_(0, dest_N, torch.where(served_N[:, None], rows_NH.to(rows.dtype), kept))
    target.flags_QS[target.source] += 1


def _fused_forward(x_leaf, local_TK, w_TK, experts, target, counters_S, segment_tokens, bands,
                   num_programs, token_T) -> PairRows:
    from disagmoe.kernels import fused_return as fr
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.moe_ffn import FFNTiles
    from disagmoe.kernels.permute import permute_tokens

    tokens, top_k = local_TK.shape
    num_local = experts.num_experts
    segments = fr.num_segments(tokens, segment_tokens)
    bands = max(1, min(bands, segments))
    device = x_leaf.device
    band_T = torch.div(token_T // segment_tokens * bands, segments, rounding_mode="floor")  # its landing segment's
    served_TK = local_TK < num_local
    groups = bands * num_local
    key_TK = torch.where(served_TK, band_T[:, None] * num_local + local_TK.long(), groups)
    x_N, offsets_G1, dest_TK = permute_tokens(x_leaf, key_TK, groups + 1, spare_last=True)
    offsets_G, served_1 = offsets_G1[:groups], offsets_G1[groups - 1:groups]
    pairs = tokens * top_k
    row_pair_N = pair_of_rows(dest_TK)
    dest_N = _destinations(row_pair_N, token_T, top_k)
    dest_32 = dest_N.to(torch.int32)  # the kernels' destination rows (forward and backward)
    served_N = torch.arange(pairs, device=device) < served_1
    x_op, w13, w2 = autocast_operands(x_N.detach(), experts.w13_EH2F, experts.w2_EFH) if x_N.is_cuda else (
        x_N.detach(), experts.w13_EH2F, experts.w2_EFH)
    ffn = w2.shape[1]
    tiles = FFNTiles.for_shape(pairs, num_local, x_op.shape[1], ffn, device, x_op.dtype)
    keep = torch.is_grad_enabled()
    whole = BLOCK in experts.recompute  # `recompute: full`: nothing of the FFN kept (module docstring)
    h13_N2F = x_op.new_empty((pairs, 2 * ffn)) if keep and not whole else None
    with torch.no_grad():
        act_NF = gg.ragged_rows_gemm(x_op, offsets_G, w13, tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU,
                                     h13_N2C=h13_N2F, num_programs=num_programs)
        fr.down_to_destination(act_NF, offsets_G, w2, tiles.down, dst_PH=target.rows_PH,
                               dst_rows_N=dest_32, tokens=tokens, top_k=top_k,
                               segment_tokens=segment_tokens, counters_S=counters_S[:segments],
                               flags_QS=target.flags_QS, source=target.source,
                               served_1=served_1, num_programs=num_programs)
    saved = None
    if keep:  # what `recompute` drops is not kept (`kernels.moe_ffn` docstring)
        drop_input = whole or EXPERT_INPUT in experts.recompute
        rows = RowSource(x_leaf.detach(), row_pair_N // top_k) if drop_input else x_op
        drop_swiglu = whole or EXPERT_SWIGLU in experts.recompute
        saved = KernelState(offsets_G, served_1, dest_32, rows, None if drop_swiglu else act_NF, h13_N2F, w13, w2,
                            tiles, num_programs, dest_TK if drop_input else None)
        if drop_input:
            x_N = None
    return PairRows(x_leaf, x_N, row_pair_N, dest_N, served_N, w_TK.detach(), experts, fused=saved)


def _torch_forward(x_leaf, local_TK, w_TK, experts, target, token_T) -> PairRows:
    tokens, top_k = local_TK.shape
    num_local = experts.num_experts
    flat_P = local_TK.reshape(-1).long()
    row_pair_N = torch.argsort(flat_P, stable=True)  # by local expert, the spare bucket last
    offsets_E = torch.cumsum(expert_counts(local_TK.long(), num_local + 1)[:num_local], 0).to(torch.int32)
    served_N = torch.arange(flat_P.numel(), device=flat_P.device) < offsets_E[-1]
    x_N = torch.where(served_N[:, None], x_leaf[row_pair_N // top_k], 0)
    if BLOCK in experts.recompute and torch.is_grad_enabled():  # `recompute: full`: keep the rows only
        y_N = recomputed(lambda rows_N, _routing: _served_rows(rows_N, served_N, offsets_E, experts), x_N)
    else:
        y_N = _served_rows(x_N, served_N, offsets_E, experts)
    dest_N = _destinations(row_pair_N, token_T, top_k)
    _store_rows(target, dest_N, served_N, y_N)
    return PairRows(x_leaf, x_N, row_pair_N, dest_N, served_N, w_TK.detach(), experts, y_N=y_N)


def _served_rows(x_N: torch.Tensor, served_N: torch.Tensor, offsets_E: torch.Tensor,
                 experts: RoutedExperts) -> torch.Tensor:
    """The experts' output rows where served, zero in the spare bucket."""
    return torch.where(served_N[:, None], experts(x_N, offsets_E), 0)


class _PairCombine(torch.autograd.Function):
    """y[t] = sum_j w[t, j] rows[t K + j], once the rows landed; differentiable in w."""

    @staticmethod
    def forward(ctx, w_TK, landing: PairLanding, top_k: int, segment_tokens: int, num_programs: int):
        rows_PH = landing.rows_PH
        if landing.status_2 is not None:  # an arena's landing: wait per segment on the GPU, combine
            from disagmoe.kernels import fused_return as fr

            y_TH = fr.combine_landed(rows_PH, w_TK, landing.flags_QS, landing.consumed_QS, segment_tokens, top_k,
                                     landing.status_2, num_programs=num_programs, flag_base=landing.flag_base,
                                     timeout_s=landing.timeout_s)
        else:  # everything is here already (a transport's emulation)
            tokens, hidden = rows_PH.shape[0] // top_k, rows_PH.shape[1]
            y_TH = torch.bmm(w_TK.to(rows_PH.dtype).view(tokens, 1, top_k),
                             rows_PH.view(tokens, top_k, hidden)).view(tokens, hidden)
        # kept as is, not saved: the rows are a view of the transport's buffers, valid until their copy
        # is reused two messages of the slot later (after this backward), and any in-place write to
        # another view of the arena would trip autograd's version check
        ctx.rows_PH, ctx.top_k, ctx.w_dtype = rows_PH, top_k, w_TK.dtype
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        rows_PH = ctx.rows_PH
        top_k, hidden = ctx.top_k, rows_PH.shape[1]
        tokens = rows_PH.shape[0] // top_k
        dw_TK = torch.bmm(rows_PH.view(tokens, top_k, hidden), dy_TH.to(rows_PH.dtype).reshape(tokens, hidden, 1))
        return dw_TK.view(tokens, top_k).to(ctx.w_dtype), None, None, None, None


def combine_programs(device: torch.device, per_sm: int = COMBINE_PROGRAMS_PER_SM) -> int:
    """The combine's persistent programs on `device` (`per_sm` per SM; the interpreter: 2)."""
    if device.type != "cuda":
        return 2
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def combine_pairs(landing: PairLanding, w_TK: torch.Tensor, segment_tokens: int,
                  num_programs: int | None = None) -> torch.Tensor:
    """The attention rank's combine of one pair-row message (module docstring), [T, H]."""
    tokens, top_k = w_TK.shape
    if landing.rows_PH.shape[0] != tokens * top_k:
        raise ValueError(f"{landing.rows_PH.shape[0]} pair rows for weights [{tokens}, {top_k}]")
    programs = num_programs or combine_programs(landing.rows_PH.device)
    return _PairCombine.apply(w_TK, landing, top_k, segment_tokens, programs)


def sum_pairs(landing: PairLanding, top_k: int, segment_tokens: int,
              num_programs: int | None = None) -> torch.Tensor:
    """d x [T, H] of the source from its pair-row input gradients (`expert_pair_rows_backward` with
    a target): each token's K rows summed in pair order once they landed."""
    rows_PH = landing.rows_PH
    if landing.status_2 is None:  # everything is here already (a transport's emulation)
        return rows_PH.view(-1, top_k, rows_PH.shape[1]).sum(1)
    from disagmoe.kernels import fused_return as fr

    return fr.combine_landed(rows_PH, None, landing.flags_QS, landing.consumed_QS, segment_tokens, top_k,
                             landing.status_2, num_programs=num_programs or combine_programs(rows_PH.device),
                             flag_base=landing.flag_base, timeout_s=landing.timeout_s)
