"""Token permutation around the experts: group (token, k) pairs by expert, and the weighted combine.

Legend: T tokens, K experts per token (top-k), N = T*K rows grouped by expert, H hidden size,
E experts; `topk_idx_TK` the router's expert ids, `weights_TK` its combine weights,
`dest_TK[t, k]` the grouped row that holds pair (t, k), `offsets_E` int32 cumulative rows per
expert.

permute: rows_NH[dest_TK[t, k]] = x_TH[t]; pairs keep their (t, k) order inside an expert (the same
order as a stable sort of the flattened expert ids), so the result is deterministic.
quantize_then_permute: the FP8 experts' input, e4m3 rows and 1 x 128 scales (`kernels.fp8`) of the
pairs from each token quantised once (K x less quantising than the pairs' rows), then copied as rows.
combine: y_TH[t] = sum_k weights_TK[t, k] * rows_NH[dest_TK[t, k]] (fp32 accumulation).
Three launches for permute (per-block expert histograms; each pair's destination row; the row
copy over a (pair block, hidden block) grid; a few tiny torch prefix sums between), one for combine; the backward
passes are a combine without weights (permute's) and one scatter + partial row-dot launch plus a
sum over hidden blocks (combine's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagmoe.kernels import fp8
from disagmoe.kernels import fp8_rounding as fr

PAIRS_PER_BLOCK = 64
TOKENS_PER_BLOCK = 16


@triton.jit
def _block_histogram_kernel(ids_ptr, hist_ptr, n_pairs, n_blocks, E,
                            BLOCK: tl.constexpr, E_POW2: tl.constexpr):
    # hist[e, b] = number of pairs of block b routed to expert e (expert-major: the prefix sum over
    # blocks that follows runs along the contiguous dimension).
    pid = tl.program_id(0)
    pairs = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < n_pairs, other=E_POW2)  # padding: a spare bin
    counts = tl.histogram(ids, 2 * E_POW2)
    bins = tl.arange(0, 2 * E_POW2)
    tl.store(hist_ptr + bins * n_blocks + pid, counts, mask=bins < E)


@triton.jit
def _permute_dest_kernel(ids_ptr, block_base_ptr, dest_ptr, n_pairs, n_blocks,
                         BLOCK: tl.constexpr, E_POW2: tl.constexpr):
    # dest[p] = block_base[e_p, b] + (rank of p among block b's pairs of expert e_p), one program
    # per pair block. (The rank scan once lived in the row-copy kernel, in the [pairs, hidden]
    # tile's layout, where Triton 3.6 on sm_90 miscompiled it at 64-wide hidden tiles.)
    pid = tl.program_id(0)
    pairs = pid * BLOCK + tl.arange(0, BLOCK)
    pair_ok = pairs < n_pairs
    ids = tl.load(ids_ptr + pairs, mask=pair_ok, other=0)
    experts = tl.arange(0, E_POW2)
    one_hot = ((ids[:, None] == experts[None, :]) & pair_ok[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
    base = tl.load(block_base_ptr + ids * n_blocks + pid, mask=pair_ok, other=0)
    tl.store(dest_ptr + pairs, base + rank, mask=pair_ok)


@triton.jit
def _permute_copy_kernel(x_ptr, dest_ptr, rows_ptr, weights_ptr, limit_ptr, n_pairs, H, K, stride_xt, stride_rn,
                         HAS_WEIGHTS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    # Program (b, h): rows[dest[p], h-block] = x[p // K, h-block] for block b's pairs: a scatter.
    # HAS_WEIGHTS: each row times its pair's weight, the fp32 product rounded to the rows' dtype;
    # HAS_LIMIT: a row at or after *limit_ptr gets weight 0 (a spare bucket's row: +-0, NaN stays).
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pair_ok = pairs < n_pairs
    dest = tl.load(dest_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    tokens = (pairs // K).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = pair_ok[:, None] & (hs < H)[None, :]
    vals = tl.load(x_ptr + tokens[:, None] * stride_xt + hs[None, :], mask=ok)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            w = tl.where(dest < tl.load(limit_ptr), w, 0.0)
        vals = (vals.to(tl.float32) * w[:, None]).to(rows_ptr.dtype.element_ty)
    tl.store(rows_ptr + dest[:, None] * stride_rn + hs[None, :], vals, mask=ok)


@triton.jit
def _combine_kernel(rows_ptr, dest_ptr, weights_ptr, y_ptr, limit_ptr, residual_ptr, n_tokens, H,
                    stride_rn, stride_yt, stride_residual, K: tl.constexpr,
                    HAS_WEIGHTS: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    # y[t, hs] = sum_k w[t, k] * rows[dest[t, k], hs] (w = 1 without weights), fp32 accumulation in k order;
    # HAS_LIMIT: rows at or after *limit_ptr (a spare bucket nothing wrote) count as zero;
    # HAS_RESIDUAL: residual[t, hs] added to the fp32 sum before its one rounding.
    # K is a constexpr and the loop unrolled (`combine_forward`: why): no store between the loads, so every
    # destination and weight is loaded before the first sum and the row gathers are free to overlap (ptxas
    # interleaves them with the sums as its registers allow).
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tokens < n_tokens
    ok = tok_ok[:, None] & (hs < H)[None, :]
    limit = tl.load(limit_ptr) if HAS_LIMIT else 0
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(K):
        dest = tl.load(dest_ptr + tokens * K + k, mask=tok_ok, other=0).to(tl.int64)
        row_ok = ok & (dest < limit)[:, None] if HAS_LIMIT else ok
        vals = tl.load(rows_ptr + dest[:, None] * stride_rn + hs[None, :], mask=row_ok, other=0.0)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + tokens * K + k, mask=tok_ok, other=0.0).to(tl.float32)
            acc += vals.to(tl.float32) * w[:, None]
        else:
            acc += vals.to(tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + tokens.to(tl.int64)[:, None] * stride_residual + hs[None, :], mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * stride_yt + hs[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_backward_kernel(dy_ptr, rows_ptr, dest_ptr, weights_ptr, d_rows_ptr, partial_ptr, limit_ptr, q_ptr, s_ptr,
                             n_tokens, H, K, stride_dyt, stride_rn, stride_drn, stride_qn, stride_sn,
                             HAS_LIMIT: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_H: tl.constexpr):
    # Program (t-block, h-block): d_rows[dest[t, k], hs] = w[t, k] * dy[t, hs] and the partial
    # dot partial[h-block, t, k] = <dy[t, hs], rows[dest[t, k], hs]> (summed over h-blocks after).
    # QUANTIZE (BLOCK_H 128: one scale group a program): each d row's group also quantised 1 x 128 into
    # q [N, H] e4m3 and s [N, H / 128], as `fp8.quantize_rows` quantises d_rows read back (its values as
    # rounded to d_rows' dtype, columns past H zeros).
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tokens < n_tokens
    ok = tok_ok[:, None] & (hs < H)[None, :]
    dy = tl.load(dy_ptr + tokens.to(tl.int64)[:, None] * stride_dyt + hs[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    partial_row = partial_ptr + tl.program_id(1).to(tl.int64) * n_tokens * K
    limit = tl.load(limit_ptr) if HAS_LIMIT else 0
    for k in range(0, K):
        dest = tl.load(dest_ptr + tokens * K + k, mask=tok_ok, other=0).to(tl.int64)
        w = tl.load(weights_ptr + tokens * K + k, mask=tok_ok, other=0.0).to(tl.float32)
        row_ok = ok & (dest < limit)[:, None] if HAS_LIMIT else ok
        vals = tl.load(rows_ptr + dest[:, None] * stride_rn + hs[None, :], mask=row_ok, other=0.0)
        d_rows = (dy * w[:, None]).to(d_rows_ptr.dtype.element_ty)
        tl.store(d_rows_ptr + dest[:, None] * stride_drn + hs[None, :], d_rows, mask=ok)
        if QUANTIZE:
            fr._quantize_group_store(tl.where(ok, d_rows.to(tl.float32), 0.0), ok, tok_ok, dest, hs,
                                     tl.program_id(1), q_ptr, s_ptr, stride_qn, 1, stride_sn, 1)
        tl.store(partial_row + tokens * K + k, tl.sum(dy * vals.to(tl.float32), axis=1),
                 mask=tok_ok)


def _row_block(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), 256)


def pair_destinations(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets_E, dest_TK) of the pairs grouped by expert in stable (t, k) order (two launches)."""
    tokens, top_k = topk_idx_TK.shape
    n_pairs, device = tokens * top_k, topk_idx_TK.device
    ids_N = topk_idx_TK.reshape(-1).to(torch.int32)
    blocks = triton.cdiv(n_pairs, PAIRS_PER_BLOCK)
    e_pow2 = triton.next_power_of_2(num_experts)
    hist_EB = torch.empty((num_experts, blocks), dtype=torch.int32, device=device)
    dest_TK = torch.empty((tokens, top_k), dtype=torch.int32, device=device)
    if n_pairs == 0:
        return torch.zeros(num_experts, dtype=torch.int32, device=device), dest_TK
    _block_histogram_kernel[(blocks,)](ids_N, hist_EB, n_pairs, blocks, num_experts,
                                       BLOCK=PAIRS_PER_BLOCK, E_POW2=e_pow2)
    upto_EB = hist_EB.cumsum(1, dtype=torch.int32)  # along blocks, the contiguous dimension (fast scan)
    counts_E = upto_EB[:, -1]
    offsets_E = counts_E.cumsum(0, dtype=torch.int32)
    # first grouped row of (expert e, block b): expert start + pairs of e in blocks before b
    block_base_EB = (offsets_E - counts_E)[:, None] + upto_EB - hist_EB
    _permute_dest_kernel[(blocks,)](ids_N, block_base_EB, dest_TK, n_pairs, blocks,
                                    BLOCK=PAIRS_PER_BLOCK, E_POW2=e_pow2)
    return offsets_E, dest_TK


def permute_forward(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows_NH, offsets_E, dest_TK): the pairs grouped by expert, in stable (t, k) order."""
    offsets_E, dest_TK = pair_destinations(topk_idx_TK, num_experts)
    return copy_rows(x_TH, dest_TK), offsets_E, dest_TK


def copy_rows(x_TH: torch.Tensor, dest_TK: torch.Tensor, weights_TK: torch.Tensor | None = None,
              limit: torch.Tensor | None = None) -> torch.Tensor:
    """rows_NH[dest_TK[t, k]] = x_TH[t]: the permute's row copy (one launch). With `weights_TK`
    each row is weighted, rows_NH[dest_TK[t, k]] = weights_TK[t, k] * x_TH[t] (the fp32 product
    rounded to x's dtype: `(x.float() * w.float()).to(x.dtype)` bit for bit), rows at or after
    `limit` (a one-element int32 device tensor) weighted 0: the combine's row gradient without its
    weight-gradient dots (`kernels.fused_moe`)."""
    if limit is not None and weights_TK is None:
        raise ValueError("copy_rows: a limit weights the rows past it 0; it needs weights_TK")
    tokens, top_k = dest_TK.shape
    n_pairs, hidden = tokens * top_k, x_TH.shape[1]
    rows_NH = x_TH.new_empty((n_pairs, hidden))
    if n_pairs == 0 or hidden == 0:
        return rows_NH
    blocks = triton.cdiv(n_pairs, PAIRS_PER_BLOCK)
    block_h = _row_block(hidden)
    weighted = weights_TK is not None
    _permute_copy_kernel[(blocks, triton.cdiv(hidden, block_h))](
        x_TH, dest_TK, rows_NH, weights_TK.contiguous() if weighted else dest_TK,
        limit if weighted and limit is not None else dest_TK, n_pairs, hidden, top_k, x_TH.stride(0),
        rows_NH.stride(0), HAS_WEIGHTS=weighted, HAS_LIMIT=weighted and limit is not None,
        BLOCK=PAIRS_PER_BLOCK, BLOCK_H=block_h)
    return rows_NH


def quantises_tokens_once(top_k: int) -> bool:
    """Whether `quantize_then_permute` moves fewer HBM bytes than the FFN quantising each of a token's
    `top_k` pair rows itself: per token and 128 values, the quantiser's 256 read and 132 written (e4m3
    and an fp32 scale) and the copy's 132 read (the token's row once: its K pairs are neighbours in a
    block) and 132 K written, against K x (256 + 132). From top-k 3 up (Qwen3's 8, DeepSeek's 6 and 8),
    not at Mixtral's 2 (by a hair). `roofline.stages.fp8_expert_input_bytes` prices the same bytes."""
    row = fp8.SCALE_BLOCK + 4
    quantise = 2 * fp8.SCALE_BLOCK + row
    return quantise + (1 + top_k) * row < top_k * quantise


def quantize_then_permute(x_TH: torch.Tensor, dest_TK: torch.Tensor, stats: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_NH float8_e4m3fn, s_NG fp32): the FP8 gate/up GEMM's A operand for the pairs `dest_TK` groups,
    each token's row quantised 1 x 128 once (`fp8.quantize_rows` of x_TH, `stats` counting tokens) and
    its e4m3 row and scales copied to its K pair rows (`copy_rows`, two launches). The same bits as
    `fp8.quantize_rows` of the grouped rows (a row's scales depend on that row alone), for 1/K of the
    quantising and counting of quantising each pair's row (in the copy or after it): where a layer's
    experts serve every pair of its tokens (`model.block`), K per token. Rows of pairs past a spare
    bucket's start are copied too (no GEMM reads them)."""
    q_TH, s_TG = fp8.quantize_rows(x_TH, stats)
    q_NH = copy_rows(q_TH.view(torch.uint8), dest_TK).view(fp8.FP8)  # moved as bytes: any Triton backend
    return q_NH, copy_rows(s_TG, dest_TK)


def combine_forward(rows_NH: torch.Tensor, dest_TK: torch.Tensor,
                    weights_TK: torch.Tensor | None, limit: torch.Tensor | None = None,
                    residual_TH: torch.Tensor | None = None) -> torch.Tensor:
    """y_TH[t] = sum_k weights_TK[t, k] * rows_NH[dest_TK[t, k]] (weights of 1 when None); with
    `limit` (a one-element int32 device tensor) rows at or after it count as zero; with `residual_TH`
    (rows of unit stride) y_TH[t] = residual_TH[t] + that sum, rounded once.

    The kernel is compiled per top-k, its k loop unrolled, at 128 columns a program, so that every destination
    and weight is loaded first and the row gathers overlap; with k a loop variable each program waited for a
    destination load and then for its gather, 2 x top-k round trips in sequence. What it was worth before: session
    45's profile of the Qwen3 config's 3-layer step (one H100) had this kernel at 5.88 ms a step over its 12
    launches (the combine and the permute's backward, a layer and micro-batch), about 2.6 TB/s for their bytes,
    some 78% of the H100's HBM rate (3.35 TB/s). On an H200 (session 47, the same outputs bit for bit) the unrolled
    form took 1.19-1.33x less time than that one on the Qwen3, Mixtral and a top-6 shape, 4.0-4.2 TB/s, and the
    permute's backward 1.15-1.24x less.
    ptxas (sm_90a): 68 registers a thread at 128 columns, 106 at 256, whose occupancy would hold fewer gathers in
    flight an SM.
    """
    tokens, top_k = dest_TK.shape
    hidden = rows_NH.shape[1]
    if residual_TH is not None and (residual_TH.shape != (tokens, hidden) or residual_TH.stride(1) != 1):
        raise ValueError(f"the combine's residual must be [tokens, hidden] = {(tokens, hidden)} with rows of unit "
                         f"stride; got {tuple(residual_TH.shape)} strides {residual_TH.stride()}")
    y_TH = rows_NH.new_empty((tokens, hidden))
    if tokens == 0 or hidden == 0:
        return y_TH
    block_h = min(_row_block(hidden), 128)
    grid = (triton.cdiv(tokens, TOKENS_PER_BLOCK), triton.cdiv(hidden, block_h))
    residual_stride = y_TH.stride(0) if residual_TH is None else residual_TH.stride(0)
    _combine_kernel[grid](rows_NH, dest_TK, weights_TK if weights_TK is not None else dest_TK,
                          y_TH, limit if limit is not None else dest_TK,
                          residual_TH if residual_TH is not None else y_TH, tokens, hidden,
                          rows_NH.stride(0), y_TH.stride(0), residual_stride, K=top_k,
                          HAS_WEIGHTS=weights_TK is not None, HAS_LIMIT=limit is not None,
                          HAS_RESIDUAL=residual_TH is not None, BLOCK_T=TOKENS_PER_BLOCK, BLOCK_H=block_h)
    return y_TH


def combine_backward(dy_TH: torch.Tensor, rows_NH: torch.Tensor, dest_TK: torch.Tensor,
                     weights_TK: torch.Tensor, limit: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_rows_NH, d_weights_TK) of combine_forward (pairs whose row is past `limit`: weight
    gradient zero)."""
    d_rows_NH, d_weights_TK, _ = _combine_backward(dy_TH, rows_NH, dest_TK, weights_TK, limit, quantize=False)
    return d_rows_NH, d_weights_TK


def combine_backward_quantized(dy_TH: torch.Tensor, rows_NH: torch.Tensor, dest_TK: torch.Tensor,
                               weights_TK: torch.Tensor, limit: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`combine_backward` and d_rows_NH's 1 x 128 e4m3 copy (q_NH, s_NG) from the same launch: the bytes
    `fp8.quantize_rows(d_rows_NH)` makes (every row the tokens' pairs write; no counters), without reading
    d rows back. The FP8 experts' data gradient takes it as their dy's rows (`Fp8RowGradSlot`)."""
    return _combine_backward(dy_TH, rows_NH, dest_TK, weights_TK, limit, quantize=True)


def _combine_backward(dy_TH, rows_NH, dest_TK, weights_TK, limit, *, quantize: bool):
    tokens, top_k = dest_TK.shape
    n_rows, hidden = rows_NH.shape
    d_rows_NH = torch.empty_like(rows_NH)
    q_NH, s_NG = fp8.empty_quantized_rows(n_rows, hidden, rows_NH.device) if quantize else (None, None)
    if tokens == 0:
        return d_rows_NH, torch.empty_like(weights_TK), (q_NH, s_NG) if quantize else None
    block_h = fp8.SCALE_BLOCK if quantize else _row_block(hidden)
    h_blocks = triton.cdiv(hidden, block_h)
    partial_BTK = torch.empty((h_blocks, tokens, top_k), dtype=torch.float32, device=dy_TH.device)
    _combine_backward_kernel[(triton.cdiv(tokens, TOKENS_PER_BLOCK), h_blocks)](
        dy_TH, rows_NH, dest_TK, weights_TK, d_rows_NH, partial_BTK, limit if limit is not None else dest_TK,
        q_NH if quantize else d_rows_NH, s_NG if quantize else partial_BTK,
        tokens, hidden, top_k, dy_TH.stride(0), rows_NH.stride(0), d_rows_NH.stride(0),
        q_NH.stride(0) if quantize else 0, s_NG.stride(0) if quantize else 0,
        HAS_LIMIT=limit is not None, QUANTIZE=quantize, BLOCK_T=TOKENS_PER_BLOCK, BLOCK_H=block_h)
    return d_rows_NH, partial_BTK.sum(0).to(weights_TK.dtype), (q_NH, s_NG) if quantize else None


class Fp8RowGradSlot:
    """Where the combine's backward leaves the e4m3 copy of the row gradient it writes, for the FP8
    experts' backward that reads that gradient next (`kernels.fp8_ffn.Fp8ExpertFFNFunction`): their dy's
    1 x 128 rows, made in the combine's launch (`combine_backward_quantized`) instead of a quantiser
    pass that reads dy back. One slot per layer call, handed to the experts and to `combine_rows`; the
    experts `take` the copy of exactly the dy autograd hands them (else None: they quantise dy
    themselves). A step that counts its numerics passes none (the copy has no counters). A copy put and never
    taken (a backward that stops at the experts' output) lives as long as the slot, i.e. the experts' node."""

    __slots__ = ("_d_rows_NH", "_copy")

    def __init__(self) -> None:
        self._d_rows_NH: torch.Tensor | None = None
        self._copy: tuple[torch.Tensor, torch.Tensor] | None = None

    def put(self, d_rows_NH: torch.Tensor, copy: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._d_rows_NH, self._copy = d_rows_NH, copy

    def take(self, dy_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q_NH, s_NG) of `dy_NH` if that is the gradient the copy was made of (the same memory, shape
        and strides), else None; the slot is empty afterwards either way."""
        rows, copy = self._d_rows_NH, self._copy
        self._d_rows_NH = self._copy = None
        if rows is None:  # nothing put (`put` sets both)
            return None
        same = (dy_NH.data_ptr() == rows.data_ptr() and dy_NH.shape == rows.shape
                and dy_NH.stride() == rows.stride() and dy_NH.dtype == rows.dtype)
        return copy if same else None


class PermuteFunction(torch.autograd.Function):
    """rows_NH = the permute's copy of x_TH by `dest_TK`; its backward sums each token's rows
    (rows at or after `limit`, a spare bucket's, dropped)."""

    @staticmethod
    def forward(ctx, x_TH, dest_TK, limit):
        ctx.save_for_backward(dest_TK, *(() if limit is None else (limit,)))
        return copy_rows(x_TH, dest_TK)

    @staticmethod
    def backward(ctx, d_rows_NH):
        dest_TK, *limit = ctx.saved_tensors
        return combine_forward(d_rows_NH.contiguous(), dest_TK, None, limit[0] if limit else None), None, None


class CombineFunction(torch.autograd.Function):
    """y_TH = the weighted combine of rows_NH (plus `residual_TH`); its backward also quantises the row
    gradient into `grad_slot` where one is given (`Fp8RowGradSlot`), and hands dy itself to the residual."""

    @staticmethod
    def forward(ctx, rows_NH, weights_TK, dest_TK, limit, grad_slot=None, residual_TH=None):
        ctx.save_for_backward(rows_NH, weights_TK, dest_TK, *(() if limit is None else (limit,)))
        ctx.grad_slot = grad_slot
        ctx.has_residual = residual_TH is not None
        return combine_forward(rows_NH, dest_TK, weights_TK, limit, residual_TH)

    @staticmethod
    def backward(ctx, dy_TH):
        rows_NH, weights_TK, dest_TK, *limit = ctx.saved_tensors
        limit = limit[0] if limit else None
        if ctx.grad_slot is None:
            d_rows, d_weights = combine_backward(dy_TH.contiguous(), rows_NH, dest_TK, weights_TK, limit)
        else:
            d_rows, d_weights, copy = combine_backward_quantized(dy_TH.contiguous(), rows_NH, dest_TK, weights_TK,
                                                                 limit)
            ctx.grad_slot.put(d_rows, copy)
            ctx.grad_slot = None
        return d_rows, d_weights, None, None, None, dy_TH if ctx.has_residual else None


def _check_routing(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor) -> None:
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"topk_idx must be [tokens, k] with tokens = x.shape[0] = {x_TH.shape[0]};"
                         f" got {tuple(topk_idx_TK.shape)}")
    if topk_idx_TK.dtype.is_floating_point:
        raise ValueError("topk_idx must hold integer expert ids (the router's top-k indices)")


def permute_tokens(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                   spare_last: bool = False, destinations: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, k) pairs by expert: (rows_NH, offsets_E, dest_TK), differentiable in x.

    Expert ids must lie in [0, num_experts) (not checked: that would cost a host sync).
    `spare_last`: the last expert is a spare bucket (pairs routed elsewhere) whose rows' gradients
    are dropped (nothing computes them). `destinations`: these ids' (offsets_E, dest_TK) from
    `pair_destinations`, kept from an earlier run (`recompute: full`'s recomputation): only the
    rows are copied."""
    _check_routing(x_TH, topk_idx_TK)
    if destinations is None:
        destinations = pair_destinations(topk_idx_TK.contiguous(), num_experts)
    offsets_E, dest_TK = destinations
    limit = offsets_E[num_experts - 2:num_experts - 1] if spare_last else None
    return PermuteFunction.apply(x_TH.contiguous(), dest_TK, limit), offsets_E, dest_TK


def combine_rows(rows_NH: torch.Tensor, dest_TK: torch.Tensor,
                 weights_TK: torch.Tensor, limit: torch.Tensor | None = None,
                 grad_slot: Fp8RowGradSlot | None = None, residual_TH: torch.Tensor | None = None) -> torch.Tensor:
    """y_TH = sum_k weights_TK[:, k] * rows_NH[dest_TK[:, k]]; differentiable in rows, weights.
    `limit` (one-element int32 device tensor): rows at or after it count as zero (a spare bucket).
    `grad_slot`: the backward also leaves the rows' gradient quantised 1 x 128 there, for FP8 experts
    that produced the rows (`Fp8RowGradSlot`). `residual_TH`: added to the sum in the same pass (the
    residual stream's h + FFN, rounded once), differentiable too (its gradient is dy)."""
    if weights_TK.shape != dest_TK.shape:
        raise ValueError(f"weights must match dest [tokens, k] {tuple(dest_TK.shape)}; "
                         f"got {tuple(weights_TK.shape)}")
    residual = None if residual_TH is None else residual_TH.contiguous()
    return CombineFunction.apply(rows_NH.contiguous(), weights_TK.contiguous(), dest_TK, limit, grad_slot, residual)


def permute_reference(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: a stable argsort of the flattened expert ids."""
    top_k = topk_idx_TK.shape[1]
    flat_N = topk_idx_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    offsets_E = torch.bincount(flat_N, minlength=num_experts).cumsum(0).to(torch.int32)
    dest_N = torch.empty_like(order_N)
    dest_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return x_TH[order_N // top_k], offsets_E, dest_N.view_as(topk_idx_TK).to(torch.int32)


def combine_reference(rows_NH: torch.Tensor, dest_TK: torch.Tensor,
                      weights_TK: torch.Tensor, residual_TH: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: gather, weight in fp32, sum over k (plus the residual, in fp32)."""
    gathered_TKH = rows_NH[dest_TK.long()].float()
    summed_TH = (gathered_TKH * weights_TK.float()[..., None]).sum(1)
    return (summed_TH if residual_TH is None else residual_TH.float() + summed_TH).to(rows_NH.dtype)
