"""The one-sided sparse dispatch (issue 25 item 2): one launch per (layer, micro-batch) stores each
token's row straight into the receive buffer of every destination that serves it, at its offset
there, then writes the destination's count and adds 1 to this source's flag (flags count messages,
`kernels.signal`: no launch takes a message number, so a CUDA graph replays it).
The way back (`return_rows`) is the same launch over every source of the expert rank: d x of the
rows each source sent back to it (DISPATCH_GRAD), or with partial sums the received rows' partial
sums and their token index (COMBINE), in the received order, only the first `count` rows.

Contract (`dispatch_rows`): destination q takes the tokens t with picked[q, t], in token order;
its row slot is the number of picked tokens of q before t (a prefix sum on the device, inside the
launch: no host read). Into q's buffers go rows[slot] = x[t], ids[slot] = ids_QTK[q, t] (its pairs'
local expert ids on q), w[slot] = w[t], index[slot] = t; rows at or past the count are left as they
were (never read: `runtime.stages.sparse_dispatch.valid_rows`). Then count[0] = the picked tokens,
and flag += 1 with a release at system scope: a receiver whose acquire wait sees the count
(`signal.wait_flag`) sees every row and the count. So only routed rows cross the link.

Destinations are addressed by tables of int64 addresses, one per payload ([Q] each): on the GPU the
peers' symmetric buffers (`nvshmem.core.get_peer_tensor`, the same offset in each peer's arena),
in the interpreter (CPU tests) local tensors standing for them. Grid: (Q, chunks); a chunk's
program counts the picked tokens before its chunk itself (Q T bytes read, no second launch), and
the chunk finishing last for q (a counter per destination, zero again after the launch) writes the
count and adds 1 to the flag.

Shape legend: Q destinations, T tokens of the source, H row width, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


DEFAULT_CHUNKS = 4  # programs per destination (the interpreter runs them one after another)


@triton.jit
def _dispatch_rows_kernel(x_ptr, ids_ptr, w_ptr, picked_ptr, rows_tab, ids_tab, w_tab, index_tab, count_tab,
                          flag_tab, counters_ptr, T, H, K, chunk_tokens, chunks, stride_x,
                          HAS_IDS: tl.constexpr, HAS_W: tl.constexpr, HAS_INDEX: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    q = tl.program_id(0)
    c = tl.program_id(1)
    start = c * chunk_tokens
    end = tl.minimum(start + chunk_tokens, T)
    rows_dst = tl.load(rows_tab + q).to(tl.pointer_type(x_ptr.dtype.element_ty))
    slot0 = tl.zeros((), dtype=tl.int32)  # picked tokens of q before this chunk: the prefix
    for t0 in range(0, start, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        slot0 += tl.sum(tl.load(picked_ptr + q * T + toks, mask=toks < start, other=0).to(tl.int32))
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    for t0 in range(start, end, BLOCK_T):
        toks = t0 + tl.arange(0, BLOCK_T)
        tok_ok = toks < end
        p_T = tl.load(picked_ptr + q * T + toks, mask=tok_ok, other=0).to(tl.int32)
        slot_T = (slot0 + tl.cumsum(p_T, 0) - 1).to(tl.int64)
        send_T = tok_ok & (p_T != 0)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = send_T[:, None] & (cols < H)[None, :]
            x_TH = tl.load(x_ptr + toks.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m)
            tl.store(rows_dst + slot_T[:, None] * H + cols[None, :], x_TH, mask=m)
        mk = send_T[:, None] & k_ok[None, :]
        if HAS_IDS:
            ids_dst = tl.load(ids_tab + q).to(tl.pointer_type(tl.int32))
            ids_TK = tl.load(ids_ptr + (q * T + toks.to(tl.int64))[:, None] * K + ks[None, :], mask=mk)
            tl.store(ids_dst + slot_T[:, None] * K + ks[None, :], ids_TK, mask=mk)
        if HAS_W:
            w_dst = tl.load(w_tab + q).to(tl.pointer_type(w_ptr.dtype.element_ty))
            w_TK = tl.load(w_ptr + toks.to(tl.int64)[:, None] * K + ks[None, :], mask=mk)
            tl.store(w_dst + slot_T[:, None] * K + ks[None, :], w_TK, mask=mk)
        if HAS_INDEX:
            index_dst = tl.load(index_tab + q).to(tl.pointer_type(tl.int32))
            tl.store(index_dst + slot_T, toks.to(tl.int32), mask=send_T)
        slot0 += tl.sum(p_T)
    tl.debug_barrier()  # every thread's stores of this chunk precede the counting
    done = tl.atomic_add(counters_ptr + q, 1, sem="acq_rel", scope="sys")
    if done == chunks - 1:  # the last chunk of q to finish: every row of q has been stored
        total = tl.zeros((), dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            toks = t0 + tl.arange(0, BLOCK_T)
            total += tl.sum(tl.load(picked_ptr + q * T + toks, mask=toks < T, other=0).to(tl.int32))
        count_dst = tl.load(count_tab + q).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(count_dst, total, sem="relaxed", scope="sys")
        tl.atomic_xchg(counters_ptr + q, 0, sem="relaxed", scope="gpu")
        flag_dst = tl.load(flag_tab + q).to(tl.pointer_type(tl.int64))
        tl.atomic_add(flag_dst, tl.full((), 1, tl.int64), sem="release", scope="sys")


def address_table(tensors: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """int64 [Q]: each tensor's address (a peer's symmetric buffer, or a local stand-in). Build it
    once per buffer set (at set-up: the arena's peer views do not move), not per message."""
    host = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # pinned: a copy on the stream, no host wait


def warm_up(tokens: int, hidden: int, top_k: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
            dx_dtype: torch.dtype, dw_dtype: torch.dtype | None, device: torch.device | str, sources: int = 1) -> None:
    """Compile and load a run's launch variants for its shapes at set-up, into scratch buffers: a
    variant's first launch loads its module, which waits for the GPU's running kernels, and
    mid-step one of them may be a flag wait of this process (`kernels.signal`). The dispatch, the
    dispatch of rows alone (COMBINE_GRAD) and the return over `sources` blocks (its integer
    arguments are specialised): `dw_dtype` None (pair rows) of d x alone, else of d x with d w and
    of the partial sums with their token index (COMBINE)."""
    kept = []  # every scratch buffer, alive until the launches are done

    def scratch(shape, dtype):
        kept.append(torch.zeros(shape, dtype=dtype, device=device))
        return kept[-1]

    def buffer(shape, dtype):  # a destination's buffer, by its address
        return address_table([scratch(shape, dtype)], device)

    def landing(dtype) -> dict[str, torch.Tensor]:
        return dict(rows=buffer((tokens, hidden), dtype), counts=buffer((1,), torch.int32),
                    flags=buffer((1,), torch.int64))

    picked = scratch((1, tokens), torch.bool)
    dispatch_rows(scratch((tokens, hidden), x_dtype), picked, ids_QTK=scratch((1, tokens, top_k), torch.int32),
                  w_TK=scratch((tokens, top_k), w_dtype), ids=buffer((tokens, top_k), torch.int32),
                  w=buffer((tokens, top_k), w_dtype), index=buffer((tokens,), torch.int32),
                  counters_Q=scratch((1,), torch.int32), **landing(x_dtype))
    dispatch_rows(scratch((tokens, hidden), dx_dtype), picked, counters_Q=scratch((1,), torch.int32),
                  **landing(dx_dtype))  # COMBINE_GRAD: the rows alone
    S = max(sources, 1)
    weights = {} if dw_dtype is None else dict(dw_STK=scratch((S, tokens, top_k), dw_dtype),
                                               w=buffer((tokens, top_k), dw_dtype))
    return_rows(scratch((S, tokens, hidden), dx_dtype), scratch((S, 1), torch.int32),
                counters_Q=scratch((1,), torch.int32), blocks=[0], **landing(dx_dtype), **weights)
    if dw_dtype is not None:  # partial sums' COMBINE: the rows with their token index
        return_rows(scratch((S, tokens, hidden), x_dtype), scratch((S, 1), torch.int32),
                    counters_Q=scratch((1,), torch.int32), blocks=[0], index_ST=scratch((S, tokens), torch.int32),
                    index=buffer((tokens,), torch.int32), **landing(x_dtype))
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # set-up, not a step: the scratch outlives the launches


def dispatch_rows(x_TH: torch.Tensor, picked_QT: torch.Tensor, *, rows: torch.Tensor,
                  counts: torch.Tensor, flags: torch.Tensor, counters_Q: torch.Tensor,
                  ids_QTK: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                  w_TK: torch.Tensor | None = None, w: torch.Tensor | None = None,
                  index: torch.Tensor | None = None, chunks: int = DEFAULT_CHUNKS) -> None:
    """Store each picked token's row into its destinations' buffers and raise their flags (module
    docstring). `rows`, `counts`, `flags` (and `ids`, `w`, `index` with their payloads) are int64
    [Q] address tables (`address_table`) of destination q's buffers: rows [T, H] of x's dtype, ids
    int32 [T, K], w [T, K] of w's dtype, index int32 [T], count int32 [1], flag int64 [1].
    `picked_QT` bool or int8 [Q, T]; `counters_Q` int32 zeros on x's device (zero again after).
    Queued on the current stream; the host does not wait."""
    T, H = x_TH.shape
    Q = picked_QT.shape[0]
    if picked_QT.shape != (Q, T):
        raise ValueError(f"picked must be [destinations, {T}], got {tuple(picked_QT.shape)}")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be >= 1")
    if counters_Q.shape != (Q,) or counters_Q.dtype != torch.int32:
        raise ValueError(f"counters must be int32 [{Q}], got {counters_Q.dtype} {tuple(counters_Q.shape)}")
    tables = {"rows": rows, "counts": counts, "flags": flags, "ids": ids, "w": w, "index": index}
    for name, table in tables.items():
        if table is not None and (table.shape != (Q,) or table.dtype != torch.int64):
            raise ValueError(f"the {name} address table must be int64 [{Q}], got {table.dtype} {tuple(table.shape)}")
    if (ids_QTK is None) != (ids is None) or (w_TK is None) != (w is None):
        raise ValueError("ids_QTK and w_TK come with their destination tables (ids, w), or neither does")
    K = ids_QTK.shape[2] if ids_QTK is not None else (w_TK.shape[1] if w_TK is not None else 1)
    if ids_QTK is not None and (ids_QTK.shape != (Q, T, K) or ids_QTK.dtype != torch.int32):
        raise ValueError(f"ids must be int32 [{Q}, {T}, {K}], got {ids_QTK.dtype} {tuple(ids_QTK.shape)}")
    if w_TK is not None and w_TK.shape != (T, K):
        raise ValueError(f"weights must be [{T}, {K}], got {tuple(w_TK.shape)}")
    if Q == 0:
        return
    x_TH = x_TH if x_TH.stride(1) == 1 else x_TH.contiguous()
    picked = picked_QT.to(torch.int8).contiguous()
    block_t = 32
    chunk_tokens = max(block_t, triton.cdiv(triton.cdiv(max(T, 1), chunks), block_t) * block_t)
    grid_chunks = max(1, triton.cdiv(T, chunk_tokens))
    dummy = counters_Q  # an unused pointer argument (its constexpr branch is compiled out)
    _dispatch_rows_kernel[(Q, grid_chunks)](
        x_TH, ids_QTK.contiguous() if ids_QTK is not None else dummy, w_TK.contiguous() if w_TK is not None else x_TH,
        picked, rows, ids if ids is not None else rows, w if w is not None else rows,
        index if index is not None else rows, counts, flags, counters_Q, T, H, K, chunk_tokens, grid_chunks,
        x_TH.stride(0), HAS_IDS=ids_QTK is not None, HAS_W=w_TK is not None, HAS_INDEX=index is not None,
        BLOCK_T=block_t, BLOCK_H=min(128, triton.next_power_of_2(max(H, 1))),
        BLOCK_K=triton.next_power_of_2(max(K, 1)))


def return_rows(dx_STH: torch.Tensor, count_S1: torch.Tensor, *, rows: torch.Tensor, counts: torch.Tensor,
                flags: torch.Tensor, counters_Q: torch.Tensor, dw_STK: torch.Tensor | None = None,
                w: torch.Tensor | None = None, index_ST: torch.Tensor | None = None,
                index: torch.Tensor | None = None, blocks: Sequence[int] | None = None,
                chunks: int = DEFAULT_CHUNKS) -> None:
    """Every source in one launch: destination q (of Q = len(blocks); `blocks[q]` the source block
    s it takes, default q) gets the first count_S1[s] rows of dx_STH[s] (and dw_STK[s], or the
    int32 token index index_ST[s]): the rows source s sent, in the received order (their d x, or
    with partial sums their partial sums: COMBINE), into its buffers (address tables of Q entries:
    `w` of d w [T, K], `index` of int32 [T]), then count and flag. The forward's launch over the
    S T rows viewed as one [S T, H] (no copy where the blocks are one buffer), q picking the first
    count rows of its block; the index rides as a one-column payload. `count_S1` int32 [S, 1] on
    the device (the forward's counts: never read on the host)."""
    S, T, H = dx_STH.shape
    blocks = list(range(S)) if blocks is None else list(blocks)
    if count_S1.shape != (S, 1):
        raise ValueError(f"counts must be [{S}, 1] (one per source block), got {tuple(count_S1.shape)}")
    if dw_STK is not None and dw_STK.shape[:2] != (S, T):
        raise ValueError(f"d w must be [{S}, {T}, K], got {tuple(dw_STK.shape)}")
    if (index_ST is None) != (index is None) or (dw_STK is None) != (w is None):
        raise ValueError("d w and the token index come with their destination tables (w, index), or neither does")
    if index_ST is not None and (dw_STK is not None or index_ST.shape != (S, T) or index_ST.dtype != torch.int32):
        raise ValueError(f"the token index must be int32 [{S}, {T}] and comes without d w, got "
                         f"{index_ST.dtype} {tuple(index_ST.shape)}")
    if any(not 0 <= s < S for s in blocks):
        raise ValueError(f"blocks {blocks} must index the {S} source blocks")
    device = dx_STH.device
    valid_ST = torch.arange(T, device=device) < count_S1.view(S, 1)
    eye_SS = torch.eye(S, dtype=torch.bool, device=device)
    picked_SN = (eye_SS[:, :, None] & valid_ST[None]).reshape(S, S * T)  # block s: its first count rows
    picked_QN = picked_SN if blocks == list(range(S)) else (
        torch.cat([picked_SN[s:s + 1] for s in blocks]) if blocks else picked_SN[:0])  # slices: no host index
    column_STK, column = (dw_STK, w) if index_ST is None else (index_ST[:, :, None], index)
    column_NK = column_STK.reshape(S * T, column_STK.shape[2]) if column_STK is not None else None
    dispatch_rows(dx_STH.reshape(S * T, H), picked_QN, rows=rows, counts=counts, flags=flags,
                  counters_Q=counters_Q, w_TK=column_NK, w=column, chunks=chunks * max(S, 1))


def dispatch_reference(x_TH: torch.Tensor, picked_QT: torch.Tensor, ids_QTK: torch.Tensor | None = None,
                       w_TK: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Plain torch: per destination q, its picked tokens' rows, ids, weights and token index, in
    token order, and their count (only the sent rows: the buffers' rows past the count are not
    part of the message)."""
    out = []
    for q in range(picked_QT.shape[0]):
        tok = torch.nonzero(picked_QT[q]).flatten()
        msg = {"rows": x_TH[tok], "index": tok.to(torch.int32),
               "count": torch.tensor([tok.numel()], dtype=torch.int32)}
        if ids_QTK is not None:
            msg["ids"] = ids_QTK[q, tok]
        if w_TK is not None:
            msg["w"] = w_TK[tok]
        out.append(msg)
    return out


def return_reference(dx_STH: torch.Tensor, count_S1: torch.Tensor, dw_STK: torch.Tensor | None = None,
                     blocks: Sequence[int] | None = None,
                     index_ST: torch.Tensor | None = None) -> list[dict[str, torch.Tensor]]:
    """Plain torch, `return_rows`: per destination q, the first count rows of its block's d x
    (and d w, or the token index), and the count."""
    out = []
    for s in range(dx_STH.shape[0]) if blocks is None else blocks:
        n = int(count_S1[s])
        msg = {"rows": dx_STH[s, :n], "count": torch.tensor([n], dtype=torch.int32)}
        if dw_STK is not None:
            msg["w"] = dw_STK[s, :n]
        if index_ST is not None:
            msg["index"] = index_ST[s, :n]
        out.append(msg)
    return out
