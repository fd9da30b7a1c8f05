"""Persistent grouped GEMMs over experts with ragged row counts (the expert FFN's building blocks).

Legend: N rows (token-expert pairs, grouped by expert), E experts, K reduction size, C output
columns, H hidden size, F expert FFN size; `offsets_E` int32 cumulative row counts (expert e owns
rows offsets[e-1]:offsets[e]).

Two kernels, each launched with a fixed number of programs (about one per SM) that walk a work list
(with `flatten`, the compiler fuses the work-list loop with the reduction loop, so the next tile's
loads are issued under the current tile's epilogue):
- `ragged_rows_gemm`: out[rows_e] = a[rows_e] @ b[e] for every expert; work items are
  (expert, row tile, column tile). Epilogues: plain (optionally scattering each output row through
  `dst_rows_N`), SwiGLU forward (two accumulators, gate and up columns of b, writes silu(g)*u and
  optionally the pre-activations), SwiGLU backward (multiplies the incoming activation gradient by
  the SwiGLU derivative from the saved pre-activations, writes d gate and d up; a few columns at a
  time, `TileConfig.epilogue_chunk`).
- `ragged_weight_grad`: out[e] = a[rows_e]^T @ b[rows_e]; work items are (expert, K tile, column
  tile), each reducing over the expert's rows (over its row groups, in ascending order, when the
  rows come in a multiple of the experts' count of groups); experts with no rows get zeros.
With `TileConfig.tma` both load their operands through TensorDescriptors (the tensor memory
accelerator) where the operands allow (`tma_takes`, `rows_gemm_descriptors`), else through
pointers; the same products in the same order either way. On an H200 the weight gradient's
tuned tiles ran 1.10-1.13x faster with it (docs/benchmarks.md, session 21).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from disagmoe.kernels import fp8_rounding as fr
from disagmoe.kernels.tile_configs import TileConfig

EPILOGUE_PLAIN = 0
EPILOGUE_SWIGLU = 1
EPILOGUE_SWIGLU_GRAD = 2


@triton.jit
def _item_table(offsets_ptr, E, tiles_n, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Inclusive prefix sum of work items per expert (row tiles x column tiles), in registers."""
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offsets_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offsets_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    counts = tl.where(idx < E, ends - starts, 0)
    items = tl.cdiv(counts, BLOCK_M) * tiles_n
    return idx, tl.cumsum(items, axis=0)


@triton.jit
def _swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile coordinates of item `local` of one expert, GROUP_M row tiles sharing column tiles."""
    per_group = GROUP_M * tiles_n
    first_m = (local // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local % per_group) % group_rows
    pid_n = (local % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _raise_empty_segments(expected_ptr, flags_ptr, n_segments, BLOCK: tl.constexpr):
    """Segments no row lands in are complete from the start: their flags count the message at once."""
    for s0 in range(0, n_segments, BLOCK):
        segs = s0 + tl.arange(0, BLOCK)
        seg_ok = segs < n_segments
        empty = seg_ok & (tl.load(expected_ptr + segs, mask=seg_ok, other=1) == 0)
        tl.atomic_add(flags_ptr + segs, tl.full((BLOCK,), 1, tl.int64), mask=empty, sem="release", scope="sys")


@triton.jit
def _signal_rows_landed(rows, row_ok, seg_ptr, expected_ptr, counters_ptr, flags_ptr):
    """After a tile's rows are stored (to a peer GPU's memory, say): count them per destination
    segment; the program whose rows complete a segment (its count reaches the segment's expected
    rows x column tiles) resets the count and adds 1 to the segment's flag (`kernels.signal`: a
    flag counts messages), with a release at system scope that covers every program's stores
    (they released into the same counter)."""
    tl.debug_barrier()  # every thread's stores of this tile precede the counting
    seg = tl.load(seg_ptr + rows, mask=row_ok, other=0)
    old = tl.atomic_add(counters_ptr + seg, 1, mask=row_ok, sem="acq_rel", scope="sys")
    expected = tl.load(expected_ptr + seg, mask=row_ok, other=-1)
    last = row_ok & (old + 1 == expected)
    tl.atomic_xchg(counters_ptr + seg, tl.zeros_like(old), mask=last, sem="relaxed", scope="gpu")
    tl.atomic_add(flags_ptr + seg, tl.zeros_like(seg).to(tl.int64) + 1, mask=last, sem="release", scope="sys")


@triton.jit
def _ragged_rows_gemm_kernel(
    a_ptr, b_ptr, out_ptr, h13_ptr, dst_rows_ptr, offsets_ptr, act_ptr,
    a_rows_ptr, scale_ptr, rowdot_ptr, a_desc, b_desc, out_desc, h13_desc,
    seg_ptr, expected_ptr, counters_ptr, flags_ptr, n_segments,
    E, E_W, K, C, F_UP, num_programs, n_rows, B_ROWS,
    stride_am, stride_ak, stride_be, stride_bk, stride_bc,
    stride_om, stride_oc, stride_hm, stride_hc, stride_xm, stride_xc,
    EPILOGUE: tl.constexpr, SCATTER: tl.constexpr, SAVE_H13: tl.constexpr, SIGNAL: tl.constexpr,
    SAVE_ACT: tl.constexpr, GATHER_A: tl.constexpr, ROW_SCALE: tl.constexpr, QUANT_OUT: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FLATTEN: tl.constexpr, EPI_CHUNK: tl.constexpr,
    TMA: tl.constexpr, B_T: tl.constexpr, TMA_STORE: tl.constexpr,
):
    # EPILOGUE: 0 plain, 1 SwiGLU, 2 SwiGLU gradient (the EPILOGUE_* constants below the imports).
    # Contract: a [N, K] rows grouped by expert; b [E, K, C(+F_UP)] any strides; out [*, C] (or
    # [N, 2C] for EPILOGUE_SWIGLU_GRAD: d gate in [:, :C], d up in [:, C:]); h13 [N, 2C] the saved
    # pre-activations (gate | up), written when SAVE_H13, read by EPILOGUE_SWIGLU_GRAD; act [N, C]
    # receives silu(gate) * up recomputed from them when SAVE_ACT (EPILOGUE_SWIGLU_GRAD only).
    # QUANT_OUT (EPILOGUE_SWIGLU, BLOCK_N = 128: one 1 x 128 group a tile row): out [N, C] receives silu(gate) * up
    # as e4m3 values and act [N, C / 128] their scales, the FP8 down GEMM's A operand (`fp8_rounding`'s
    # `_quantize_group_store` of the values rounded to a's dtype first: `fp8.quantize_rows` of the act this
    # epilogue would store, bit for bit), no act written in a's dtype.
    # SIGNAL (plain epilogue): row r belongs to segment seg[r] of `out`; `_signal_rows_landed`.
    # GATHER_A: row r of a is a[a_rows[r]] (a [T, K] rows of tokens). ROW_SCALE (EPILOGUE_SWIGLU_GRAD):
    # rowdot[pid_n, r] = sum over this tile's columns of acc * silu(gate) * up (unscaled), and the
    # SwiGLU derivative's products are scaled by scale[r] (fp32). EPI_CHUNK: the SwiGLU gradient's
    # columns per step (`_swiglu_grad_epilogue`).
    # E row groups over E_W weights: group g multiplies by b[g mod E_W] (E == E_W: one group per
    # expert; segment-major order, `fused_return.segment_major_order`: E = segments x E_W).
    # TMA (`TileConfig.tma`; not GATHER_A, EVEN_K): a_desc [N, K] and b_desc load the operands' boxes: b_desc
    # is the weights as [E_W x B_ROWS, width] rows (B_ROWS = K, boxes [BLOCK_K, BLOCK_N]), or with B_T
    # (b a transposed view) as [E_W x B_ROWS, K] (B_ROWS = the weight's columns, boxes [BLOCK_N, BLOCK_K],
    # transposed in shared memory). A box's rows past the group's last row (the next group's, or zeros
    # past N) and columns past C (the up columns, the next weight's, or zeros) reach only output rows
    # and columns the stores mask: each output element reads its own row of a and column of b.
    # TMA_STORE (`TileConfig.tma_store`; plain or SwiGLU epilogue, neither scattered, signalled nor quantised, C a
    # multiple of BLOCK_N): a tile whose rows lie wholly inside its group is written through shared memory by TMA
    # (out_desc [N, C], h13_desc [N, 2C], boxes [BLOCK_M, BLOCK_N]), the copy of the tile's last box draining under
    # the next item's main loop (Triton waits for a box's shared-memory read only before the buffer's next write);
    # a group's last, partial tile keeps the masked stores (a box would write the next group's rows).
    tl.static_assert(not (TMA_STORE and (SCATTER or SIGNAL or EPILOGUE == 2)),
                     "TMA stores write the plain or SwiGLU result's own rows: not scattered or signalled")
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(C, BLOCK_N)
    idx, item_ends = _item_table(offsets_ptr, E, tiles_n, BLOCK_M, E_POW2)
    total = tl.max(item_ends, axis=0)
    if SIGNAL:
        if pid == 0:
            _raise_empty_segments(expected_ptr, flags_ptr, n_segments, 128)
    for item in tl.range(pid, total, num_programs, flatten=FLATTEN):
        expert = tl.sum((item_ends <= item).to(tl.int32), axis=0)
        item_start = tl.max(tl.where(item_ends <= item, item_ends, 0), axis=0)
        row_start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
        row_end = tl.load(offsets_ptr + expert)
        pid_m, pid_n = _swizzle(item - item_start, tl.cdiv(row_end - row_start, BLOCK_M), tiles_n,
                                GROUP_M)
        rows = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        ks = tl.arange(0, BLOCK_K)
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = (b_ptr + (expert % E_W).to(tl.int64) * stride_be + ks[:, None] * stride_bk
                  + cols[None, :] * stride_bc)
        ok = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        if EPILOGUE == 2:  # issue the epilogue's loads now, so they complete under the main loop
            h13 = _load_gate_up(h13_ptr, rows64, row_ok, pid_n * BLOCK_N, C, stride_hm, stride_hc, BLOCK_N,
                                EPI_CHUNK)
            if ROW_SCALE:
                scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
            else:
                scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_row = (expert % E_W) * B_ROWS
        for k0 in range(0, K, BLOCK_K):
            if TMA:
                a = a_desc.load([row_start + pid_m * BLOCK_M, k0])
                if B_T:
                    b = b_desc.load([b_row + pid_n * BLOCK_N, k0]).T
                else:
                    b = b_desc.load([b_row + k0, pid_n * BLOCK_N])
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            if EPILOGUE == 1:
                if TMA:
                    if B_T:
                        b_up = b_desc.load([b_row + F_UP + pid_n * BLOCK_N, k0]).T
                    else:
                        b_up = b_desc.load([b_row + k0, F_UP + pid_n * BLOCK_N])
                elif EVEN_K:
                    b_up = tl.load(b_ptrs + F_UP * stride_bc, mask=col_ok[None, :], other=0.0)
                else:
                    b_up = tl.load(b_ptrs + F_UP * stride_bc, mask=k_ok[:, None] & col_ok[None, :],
                                   other=0.0)
                acc_up = tl.dot(a, b_up, acc_up)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        tile_row = row_start + pid_m * BLOCK_M
        if EPILOGUE == 0:
            if SCATTER:
                out_rows = tl.load(dst_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            else:
                out_rows = rows64
            out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols[None, :] * stride_oc
            if TMA_STORE:
                if tile_row + BLOCK_M <= row_end:
                    out_desc.store([tile_row, pid_n * BLOCK_N], acc.to(out_ptr.dtype.element_ty))
                else:
                    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
            else:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)
            if SIGNAL:
                _signal_rows_landed(rows, row_ok, seg_ptr, expected_ptr, counters_ptr, flags_ptr)
        elif EPILOGUE == 1:
            if QUANT_OUT:  # h13 first: the two accumulators die before the quantisation (at the tuned gate/up
                # tiles it spilled 48-164 bytes with them alive; the plain order below spills less as it is); under
                # TMA_STORE the pre-activations alone go by TMA (the e4m3 act and its scales keep their stores)
                act = acc * tl.sigmoid(acc) * acc_up
                if SAVE_H13:
                    if TMA_STORE:
                        if tile_row + BLOCK_M <= row_end:
                            _store_gate_up_boxes(acc, acc_up, h13_desc, h13_ptr, tile_row, pid_n * BLOCK_N, C)
                        else:
                            _store_gate_up(acc, acc_up, h13_ptr, rows64, cols, ok, C, stride_hm, stride_hc)
                    else:
                        _store_gate_up(acc, acc_up, h13_ptr, rows64, cols, ok, C, stride_hm, stride_hc)
                rounded = act.to(a_ptr.dtype.element_ty).to(tl.float32)
                fr._quantize_group_store(tl.where(ok, rounded, 0.0), ok, row_ok, rows64, cols, pid_n, out_ptr,
                                         act_ptr, stride_om, stride_oc, stride_xm, stride_xc)
            elif TMA_STORE:
                if tile_row + BLOCK_M <= row_end:
                    act = acc * tl.sigmoid(acc) * acc_up
                    out_desc.store([tile_row, pid_n * BLOCK_N], act.to(out_ptr.dtype.element_ty))
                    if SAVE_H13:
                        _store_gate_up_boxes(acc, acc_up, h13_desc, h13_ptr, tile_row, pid_n * BLOCK_N, C)
                else:
                    _store_swiglu(acc, acc_up, out_ptr, h13_ptr, rows64, cols, ok, C, stride_om, stride_oc,
                                  stride_hm, stride_hc, SAVE_H13)
            else:
                _store_swiglu(acc, acc_up, out_ptr, h13_ptr, rows64, cols, ok, C, stride_om, stride_oc,
                              stride_hm, stride_hc, SAVE_H13)
        else:
            rowdot = _swiglu_grad_epilogue(acc, h13, scale, rows64, row_ok, pid_n * BLOCK_N, C, out_ptr, act_ptr,
                                           stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT, ROW_SCALE,
                                           BLOCK_N, EPI_CHUNK)
            if ROW_SCALE:
                tl.store(rowdot_ptr + pid_n.to(tl.int64) * n_rows + rows64, rowdot, mask=row_ok)


@triton.jit
def _store_swiglu(gate, up, out_ptr, h13_ptr, rows64, cols, ok, C, stride_om, stride_oc, stride_hm, stride_hc,
                  SAVE_H13: tl.constexpr):
    """The SwiGLU epilogue's masked stores: act = silu(gate) * up into out, and where asked the pre-activations."""
    act = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oc
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=ok)
    if SAVE_H13:
        _store_gate_up(gate, up, h13_ptr, rows64, cols, ok, C, stride_hm, stride_hc)


@triton.jit
def _store_gate_up_boxes(gate, up, h13_desc, h13_ptr, tile_row, c0, C):
    """`_store_gate_up` of a whole tile by TMA (`TMA_STORE`): gate's box at h13's columns c0, up's at C + c0."""
    h13_desc.store([tile_row, c0], gate.to(h13_ptr.dtype.element_ty))
    h13_desc.store([tile_row, C + c0], up.to(h13_ptr.dtype.element_ty))


@triton.jit
def _store_gate_up(gate, up, h13_ptr, rows64, cols, ok, C, stride_hm, stride_hc):
    """The SwiGLU epilogue's pre-activations saved for the backward: gate at h13's columns `cols`, up at C + cols."""
    h_ptrs = h13_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hc
    tl.store(h_ptrs, gate.to(h13_ptr.dtype.element_ty), mask=ok)
    tl.store(h_ptrs + C * stride_hc, up.to(h13_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _load_gate_up(h13_ptr, rows64, row_ok, c0, C, stride_hm, stride_hc, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
    """Columns [c0, c0 + WIDTH) of the saved gate and up pre-activations (bf16, as stored), loaded
    CHUNK columns at a time: (gate, up) for one chunk, else a pair of the two halves' results."""
    if WIDTH == CHUNK:
        cols = c0 + tl.arange(0, WIDTH)
        ok = row_ok[:, None] & (cols < C)[None, :]
        h_ptrs = h13_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hc
        return tl.load(h_ptrs, mask=ok, other=0.0), tl.load(h_ptrs + C * stride_hc, mask=ok, other=0.0)
    else:
        return (_load_gate_up(h13_ptr, rows64, row_ok, c0, C, stride_hm, stride_hc, WIDTH // 2, CHUNK),
                _load_gate_up(h13_ptr, rows64, row_ok, c0 + WIDTH // 2, C, stride_hm, stride_hc, WIDTH // 2, CHUNK))


@triton.jit
def _swiglu_grad_values(acc, gate, up, scale, ROW_SCALE: tl.constexpr):
    """(d gate, d up, sigmoid(gate), the row dots or `scale`) of some columns of d act (`acc`, fp32)
    from their fp32 gate and up: `_swiglu_grad_columns`' arithmetic, which `fp8`'s quantising pass
    (`fp8.swiglu_grad_rows_quantized`) shares. With ROW_SCALE the products are scaled per row by
    `scale` and the row dots are each row's dot of d act with the SwiGLU output (unscaled)."""
    sig = tl.sigmoid(gate)
    if ROW_SCALE:
        # d w of a row before its scale: (dy @ w2^T) . act = dy . (act @ w2) = dy . y, from the
        # unscaled d up; acc is 0 outside the rows and columns (masked operands), so no mask
        d_up = acc * sig * gate
        rowdot = tl.sum(d_up * up, axis=1)
        d_gate = acc * sig * up * (1.0 + gate * (1.0 - sig)) * scale[:, None]
        d_up = d_up * scale[:, None]
    else:
        rowdot = scale  # unused (the caller stores row dots only with ROW_SCALE)
        d_gate = acc * up * sig * (1.0 + gate * (1.0 - sig))
        d_up = acc * gate * sig
    return d_gate, d_up, sig, rowdot


@triton.jit
def _swiglu_grad_columns(acc, gate, up, scale, rows64, cols, ok, C, out_ptr, act_ptr,
                         stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT: tl.constexpr, ROW_SCALE: tl.constexpr):
    """The SwiGLU gradient of some columns of d act (`acc`, fp32, with the fp32 gate and up of those
    columns): d gate and d up stored into out's two halves, the SwiGLU output into act with
    SAVE_ACT; returns with ROW_SCALE each row's dot of d act with the SwiGLU output (unscaled, the
    products scaled by `scale`), else `scale`. The fused epilogue's chunks and the split pass's
    steps (`swiglu_grad_rows`) both end here."""
    d_gate, d_up, sig, rowdot = _swiglu_grad_values(acc, gate, up, scale, ROW_SCALE)
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oc
    tl.store(out_ptrs, d_gate.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptrs + C * stride_oc, d_up.to(out_ptr.dtype.element_ty), mask=ok)
    if SAVE_ACT:  # the forward's SwiGLU output, recomputed from the saved pre-activations
        act_ptrs = act_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xc
        tl.store(act_ptrs, (gate * sig * up).to(act_ptr.dtype.element_ty), mask=ok)
    return rowdot


@triton.jit
def _swiglu_grad_epilogue(acc, h13, scale, rows64, row_ok, c0, C, out_ptr, act_ptr,
                          stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT: tl.constexpr,
                          ROW_SCALE: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
    """The SwiGLU gradient of accumulator columns [c0, c0 + WIDTH) (h13 as `_load_gate_up` gave it),
    CHUNK columns at a time: each chunk's fp32 temporaries die before the next chunk's are made
    (the whole tile at once spilled at 255 registers). Returns with ROW_SCALE the chunks' row dots.

    The accumulator's halves are split off in registers (a reshape to [M, 2, W/2] and a split:
    no data moves); their layout is then a linear one, in which Triton keeps the whole epilogue and
    converts only the bf16 loads and stores (on the accumulator's own layout it computed the gate's
    terms twice and converted an fp32 tile)."""
    if WIDTH == CHUNK:
        gate, up = h13
        cols = c0 + tl.arange(0, WIDTH)
        ok = row_ok[:, None] & (cols < C)[None, :]
        return _swiglu_grad_columns(acc, gate.to(tl.float32), up.to(tl.float32), scale, rows64, cols, ok, C,
                                    out_ptr, act_ptr, stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT, ROW_SCALE)
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, WIDTH // 2)), (0, 2, 1)))
        rowdot = _swiglu_grad_epilogue(lo, h13[0], scale, rows64, row_ok, c0, C, out_ptr, act_ptr, stride_om,
                                       stride_oc, stride_xm, stride_xc, SAVE_ACT, ROW_SCALE, WIDTH // 2, CHUNK)
        return rowdot + _swiglu_grad_epilogue(hi, h13[1], scale, rows64, row_ok, c0 + WIDTH // 2, C, out_ptr,
                                              act_ptr, stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT,
                                              ROW_SCALE, WIDTH // 2, CHUNK)


@triton.jit
def _rows_dot(a_ptr, b_ptr, row_start, row_end, ks, k_ok, cols, col_ok, acc,
              stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M: tl.constexpr):
    """acc + a[rows]^T @ b[rows] over rows [row_start, row_end), BLOCK_M rows a step: the tile
    (ks of a's columns, cols of b's) of one row group's contribution to a weight gradient."""
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        a_t = tl.load(a_ptr + ks[:, None] * stride_ak + rows64[None, :] * stride_am,
                      mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rows64[:, None] * stride_bm + cols[None, :] * stride_bc,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a_t, b, acc)
    return acc


@triton.jit
def _rows_dot_tma(a_desc, b_desc, a_ptr, b_ptr, row_start, row_end, k0, c0, ks, k_ok, cols, col_ok, acc,
                  stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M: tl.constexpr):
    """`_rows_dot` with the whole BLOCK_M-row steps loaded by the tensor memory accelerator (TMA:
    `a_desc` [N, KA] and `b_desc` [N, C] descriptors, boxes [BLOCK_M, BLOCK_K] and [BLOCK_M,
    BLOCK_N] at the tile's first K index k0 and column c0), which writes them into shared memory
    without the registers' address arithmetic; the last partial step (rows up to row_end: the next
    row group's rows follow in the same tensors, and a TMA box cannot stop at them) with
    `_rows_dot`'s masked loads."""
    whole_end = row_start + (row_end - row_start) // BLOCK_M * BLOCK_M
    for r0 in range(row_start, whole_end, BLOCK_M):
        a_MK = a_desc.load([r0, k0])
        b_MC = b_desc.load([r0, c0])
        acc = tl.dot(a_MK.T, b_MC, acc)
    return _rows_dot(a_ptr, b_ptr, whole_end, row_end, ks, k_ok, cols, col_ok, acc,
                     stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M)


@triton.jit
def _group_rows_dot(a_desc, b_desc, a_ptr, b_ptr, offsets_ptr, group, k0, c0, ks, k_ok, cols, col_ok, acc,
                    stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M: tl.constexpr, TMA: tl.constexpr):
    """acc + row group `group`'s contribution (its rows offsets[group - 1]:offsets[group] of a and b) to
    the weight-gradient tile at K index k0 and column c0: through `_rows_dot_tma` under TMA, else `_rows_dot`."""
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offsets_ptr + group)
    if TMA:
        acc = _rows_dot_tma(a_desc, b_desc, a_ptr, b_ptr, start, end, k0, c0, ks, k_ok, cols, col_ok, acc,
                            stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M)
    else:
        acc = _rows_dot(a_ptr, b_ptr, start, end, ks, k_ok, cols, col_ok, acc,
                        stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M)
    return acc


@triton.jit
def _write_row_halves(out_desc, tile, tile_row, c0, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      REDUCE: tl.constexpr):
    """A weight-gradient tile [BLOCK_K, BLOCK_N] written by TMA in two halves of rows through one buffer (half the
    shared memory beside the ring): reduce-added (`REDUCE`: the atomic epilogue's add) or stored."""
    top, bottom = tl.split(tl.permute(tl.reshape(tile, (2, BLOCK_K // 2, BLOCK_N)), (1, 2, 0)))
    if REDUCE:
        out_desc.atomic_add([tile_row, c0], top)
        out_desc.atomic_add([tile_row + BLOCK_K // 2, c0], bottom)
    else:
        out_desc.store([tile_row, c0], top)
        out_desc.store([tile_row + BLOCK_K // 2, c0], bottom)


@triton.jit
def _ragged_weight_grad_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, a_desc, b_desc, a2_ptr, b2_ptr, offsets2_ptr, a2_desc, b2_desc, out_desc,
    E, E_W, KA, C, num_programs,
    stride_am, stride_ak, stride_bm, stride_bc, stride_oe, stride_ok, stride_oc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr, ACCUMULATE: tl.constexpr, BANDED: tl.constexpr, ATOMIC: tl.constexpr,
    TMA: tl.constexpr, PREFETCH: tl.constexpr, PAIRED: tl.constexpr, TMA_STORE: tl.constexpr,
):
    # Contract: a [N, KA], b [N, C] rows in E row groups over E_W weights; out [E_W, KA, C],
    # out[e] = sum over groups g = e mod E_W of a[rows_g]^T @ b[rows_g] (ACCUMULATE: out += it,
    # e.g. into an fp32 main-gradient buffer; ATOMIC, out fp32: added with relaxed fp32 atomics,
    # one writer per element, so the same sum). BANDED is E != E_W (segment-major order,
    # `fused_return.segment_major_order`): each work item reduces over its weight's groups in
    # ascending g; otherwise E == E_W and one group is one weight's rows.
    # BLOCK_K tiles KA (the output's rows), BLOCK_N tiles C, BLOCK_M steps the reduction over rows.
    # TMA: a_desc and b_desc (TensorDescriptors of a and b) load the whole row steps (`_rows_dot_tma`).
    # PREFETCH (ACCUMULATE, not ATOMIC): the tile's prior out values are loaded before its row loop, so
    # their HBM read runs under the tile's MMAs instead of after them (the same sum, added after the loop).
    # PAIRED (not BANDED): a second row set (a2 [N2, KA], b2 [N2, C], offsets2 over the same E groups, a's
    # and b's strides; a2_desc, b2_desc under TMA), e.g. the next micro-batch's rows (`kernels.wgrad_pairs`):
    # out[e] (+)= a[rows_e]^T @ b[rows_e] + a2[rows2_e]^T @ b2[rows2_e], one fp32 sum, one write of out.
    # TMA_STORE (`TileConfig.tma_store`; KA a multiple of BLOCK_K, so that no tile reaches the next weight's rows):
    # out_desc, out as [E_W x KA, C] rows in boxes [BLOCK_K / 2, BLOCK_N], writes each tile's two halves of rows in
    # turn through one shared-memory buffer by TMA: ATOMIC's add as the tensor memory accelerator's reduce-add
    # (cp.reduce.async.bulk .add, done at L2 as the relaxed atomics are: the same bits, denormals flushed alike),
    # else the stored sum; the second half's copy drains under the next tile's row loop.
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(KA, BLOCK_K)
    tiles_n = tl.cdiv(C, BLOCK_N)
    per_expert = tiles_k * tiles_n
    for item in tl.range(pid, E_W * per_expert, num_programs, flatten=FLATTEN):
        expert = item // per_expert
        pid_k, pid_n = _swizzle(item % per_expert, tiles_k, tiles_n, GROUP_M)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < KA
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        out_ptrs = (out_ptr + expert.to(tl.int64) * stride_oe + ks[:, None] * stride_ok
                    + cols[None, :] * stride_oc)
        if PREFETCH:
            prior = tl.load(out_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        if BANDED:
            for group in range(expert, E, E_W):  # ascending g: one summation order, run to run
                acc = _group_rows_dot(a_desc, b_desc, a_ptr, b_ptr, offsets_ptr, group, pid_k * BLOCK_K,
                                      pid_n * BLOCK_N, ks, k_ok, cols, col_ok, acc,
                                      stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M, TMA)
        else:
            acc = _group_rows_dot(a_desc, b_desc, a_ptr, b_ptr, offsets_ptr, expert, pid_k * BLOCK_K, pid_n * BLOCK_N,
                                  ks, k_ok, cols, col_ok, acc, stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M, TMA)
        if PAIRED:  # the second row set's group of this expert, summed after the first's
            acc = _group_rows_dot(a2_desc, b2_desc, a2_ptr, b2_ptr, offsets2_ptr, expert, pid_k * BLOCK_K,
                                  pid_n * BLOCK_N, ks, k_ok, cols, col_ok, acc,
                                  stride_am, stride_ak, stride_bm, stride_bc, BLOCK_M, TMA)
        tile_row = expert * KA + pid_k * BLOCK_K
        if ACCUMULATE and ATOMIC:
            if TMA_STORE:
                _write_row_halves(out_desc, acc, tile_row, pid_n * BLOCK_N, BLOCK_K, BLOCK_N, True)
            else:
                tl.atomic_add(out_ptrs, acc, mask=k_ok[:, None] & col_ok[None, :], sem="relaxed")
        else:
            if PREFETCH:
                acc += prior
            elif ACCUMULATE:
                acc += tl.load(out_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if TMA_STORE:
                _write_row_halves(out_desc, acc.to(out_ptr.dtype.element_ty), tile_row, pid_n * BLOCK_N, BLOCK_K,
                                  BLOCK_N, False)
            else:
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class SegmentSignal:
    """Where a scattering launch reports its rows landing: row r is in segment `seg_N[r]`, which
    expects `expected_S[s]` row stores (its rows x the launch's column tiles); `counters_S` int32
    (zero, and zero again after each launch) counts them; `flags_S` int64 (a peer GPU's, say)
    counts one more message per segment once complete (`kernels.signal`). A launch raises every
    segment's flag once, empty ones at its start, so no wait hangs on a segment no row of this
    launch goes to."""

    seg_N: torch.Tensor
    expected_S: torch.Tensor
    counters_S: torch.Tensor
    flags_S: torch.Tensor


def default_num_programs(device: torch.device) -> int:
    """Persistent programs at one per SM on a GPU; the interpreter (CPU) runs a handful."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def ragged_rows_gemm(
    a_NK: torch.Tensor,
    offsets_E: torch.Tensor,
    b_EKC: torch.Tensor,
    config: TileConfig,
    *,
    epilogue: int = EPILOGUE_PLAIN,
    out: torch.Tensor | None = None,
    h13_N2C: torch.Tensor | None = None,
    dst_rows_N: torch.Tensor | None = None,
    signal: SegmentSignal | None = None,
    num_programs: int | None = None,
    act_N_C: torch.Tensor | None = None,
    a_rows_N: torch.Tensor | None = None,
    row_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    quantized_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[rows_e] = epilogue(a[rows_e] @ b[e]) for every expert e, in one persistent launch.
    `offsets_E` may hold a multiple G of the experts' count: G row groups, group g using b[g mod E]
    (rows in segment-major order for the fused return, `fused_return.segment_major_order`).

    `b_EKC` may be any strided view (a transposed weight is passed as `.transpose(1, 2)`). With
    EPILOGUE_SWIGLU, b holds gate columns [:C] and up columns [C:2C] and `h13_N2C` (if given)
    receives the pre-activations; with EPILOGUE_SWIGLU_GRAD, `h13_N2C` is read and out is [N, 2C],
    and `act_N_C` (if given) receives silu(gate) * up recomputed from `h13_N2C` (the forward's
    output, for the down weight's gradient, where the forward did not keep it: `recompute`).
    `a_rows_N` (int32/64 [N]): row r of the product reads a_NK[a_rows_N[r]] (a holds tokens, not rows).
    `row_scale` = (scale_N fp32 [N], rowdot_BN fp32 [column tiles, N]), EPILOGUE_SWIGLU_GRAD only: each
    row's product is scaled by scale_N before the SwiGLU derivative, and rowdot_BN first receives,
    per column tile, the unscaled product's row dot with silu(gate) * up (summed over tiles: the
    routing weight's gradient dy . y without the rows y, `kernels.fused_moe`).
    `dst_rows_N` (plain epilogue only) sends row r of the result to out[dst_rows_N[r]]; `signal`
    (with it) raises each segment's flag once its rows are stored (`SegmentSignal`).
    `config.library`: the library's grouped GEMM runs the launch where it can (`library_takes`).
    `config.split_epilogue` (EPILOGUE_SWIGLU_GRAD): a plain launch, then `swiglu_grad_rows`.
    `quantized_out` = (q_NC float8_e4m3fn, s_NG fp32 [N, cdiv(C, 128)]), EPILOGUE_SWIGLU where
    `swiglu_quantizes(config)`: silu(gate) * up written as the FP8 down GEMM's A operand, 1 x 128 groups (the
    bytes `fp8.quantize_rows` makes of the act this epilogue would write in a's dtype; rows past the last
    offset unwritten), not in a's dtype; q_NC is returned.
    """
    n_rows, k = a_NK.shape if a_rows_N is None else (a_rows_N.shape[0], a_NK.shape[1])
    experts, k_b, width = b_EKC.shape
    groups = offsets_E.shape[0]  # row groups: a multiple of the experts, group g uses b[g mod experts]
    assert k_b == k and offsets_E.dim() == 1 and groups % experts == 0 and offsets_E.dtype == torch.int32
    cols = width // 2 if epilogue == EPILOGUE_SWIGLU else width
    if epilogue == EPILOGUE_SWIGLU_GRAD and config.split_epilogue and n_rows and cols:
        assert h13_N2C is not None and dst_rows_N is None and signal is None
        d_act_NC = ragged_rows_gemm(a_NK, offsets_E, b_EKC, dataclasses.replace(config, split_epilogue=False),
                                    num_programs=num_programs, a_rows_N=a_rows_N)  # plain (the library's where it can)
        return swiglu_grad_rows(d_act_NC, h13_N2C, offsets_E, out=out, act_N_C=act_N_C, row_scale=row_scale)
    if quantized_out is not None:
        q_NC, s_NG = quantized_out
        if epilogue != EPILOGUE_SWIGLU or not swiglu_quantizes(config) or out is not None or act_N_C is not None:
            raise ValueError(f"quantized_out is the SwiGLU epilogue's, at 128-column tiles (block_n "
                             f"{config.block_n}) and without `out` or `act_N_C`: quantise the act with "
                             "fp8.quantize_rows instead")
        if q_NC.shape != (n_rows, cols) or s_NG.shape != (n_rows, triton.cdiv(cols, fr.SCALE_BLOCK)) \
                or q_NC.dtype != fr.FP8 or s_NG.dtype != torch.float32:
            raise ValueError(f"quantized_out must be (q [N, C] = {(n_rows, cols)} float8_e4m3fn, s [N, cdiv(C, 128)] "
                             f"fp32); got {q_NC.dtype} {tuple(q_NC.shape)} and {s_NG.dtype} {tuple(s_NG.shape)}")
        out, act_N_C = q_NC, s_NG  # the kernel's out and act pointers (`_ragged_rows_gemm_kernel`'s QUANT_OUT)
    elif (config.library and n_rows and cols
            and library_takes(a_NK, offsets_E, b_EKC, epilogue, out is not None, dst_rows_N, signal, a_rows_N)):
        return torch._grouped_mm(a_NK, b_EKC, offs=offsets_E)  # its own output: none allocated here
    elif config.gluon and n_rows and cols and gluon_takes(a_NK, b_EKC, config, epilogue, out, h13_N2C, dst_rows_N,
                                                          signal, a_rows_N):
        from disagmoe.kernels import gluon_rows

        tile = dict(block_m=config.gluon_block_m, block_n=config.gluon_block_n, stages=config.gluon_stages,
                    group_m=config.group_m, num_programs=num_programs)
        if epilogue == EPILOGUE_SWIGLU:
            return gluon_rows.gluon_swiglu_gemm(a_NK, offsets_E, b_EKC, out=out, h13_N2F=h13_N2C,
                                                tma_store=config.gluon_tma_store, **tile)
        return gluon_rows.gluon_rows_gemm(a_NK, offsets_E, b_EKC, out=out, tma_store=config.gluon_tma_store, **tile)
    if out is None:
        out_cols = 2 * cols if epilogue == EPILOGUE_SWIGLU_GRAD else cols
        out = a_NK.new_empty((n_rows, out_cols))
    if row_scale is not None and (n_rows == 0 or cols == 0):
        row_scale[1].zero_()
    assert dst_rows_N is None or epilogue == EPILOGUE_PLAIN
    assert signal is None or dst_rows_N is not None
    assert epilogue != EPILOGUE_SWIGLU_GRAD or h13_N2C is not None
    assert act_N_C is None or quantized_out is not None or (epilogue == EPILOGUE_SWIGLU_GRAD
                                                             and act_N_C.shape == (n_rows, cols))
    assert row_scale is None or (epilogue == EPILOGUE_SWIGLU_GRAD and row_scale[1].shape[1] == n_rows
                                 and row_scale[1].shape[0] == triton.cdiv(cols, config.block_n))
    if signal is None and (n_rows == 0 or cols == 0):
        return out
    epi_chunk = min(config.epilogue_chunk, config.block_n) if epilogue == EPILOGUE_SWIGLU_GRAD else config.block_n
    if epi_chunk < 1 or epi_chunk & (epi_chunk - 1):
        raise ValueError(f"TileConfig.epilogue_chunk={config.epilogue_chunk}: give a power of two (columns)")
    h13 = h13_N2C if h13_N2C is not None else out
    dst = dst_rows_N if dst_rows_N is not None else offsets_E
    sig = signal or SegmentSignal(offsets_E, offsets_E, offsets_E, offsets_E)
    programs = num_programs or default_num_programs(a_NK.device) * config.programs_per_sm
    act = act_N_C if act_N_C is not None else out
    scale, rowdot = row_scale if row_scale is not None else (out, out)
    # TMA where a's rows are its own (no gather) and K is whole tiles; not with row_scale, whose row dots sum
    # the tile's columns (a box's columns past C would reach them)
    descs = (rows_gemm_descriptors(a_NK, b_EKC, config)
             if a_rows_N is None and row_scale is None and k % config.block_k == 0 else None)
    a_desc, b_desc, b_rows, b_t = descs or (None, None, 0, False)
    stores = (rows_store_descriptors(None if quantized_out is not None else out,
                                     h13_N2C if epilogue == EPILOGUE_SWIGLU else None, cols, config)
              if epilogue in (EPILOGUE_PLAIN, EPILOGUE_SWIGLU) and dst_rows_N is None and signal is None else None)
    out_desc, h13_desc = stores or (None, None)
    _ragged_rows_gemm_kernel[(programs,)](
        a_NK, b_EKC, out, h13, dst, offsets_E, act,
        a_rows_N if a_rows_N is not None else offsets_E, scale, rowdot, a_desc, b_desc, out_desc, h13_desc,
        sig.seg_N, sig.expected_S, sig.counters_S, sig.flags_S, sig.expected_S.numel(),
        groups, experts, k, cols, cols, programs, n_rows, b_rows,
        a_NK.stride(0), a_NK.stride(1), b_EKC.stride(0), b_EKC.stride(1), b_EKC.stride(2),
        out.stride(0), out.stride(1), h13.stride(0), h13.stride(1), act.stride(0), act.stride(1),
        EPILOGUE=epilogue, SCATTER=dst_rows_N is not None,
        SAVE_H13=epilogue == EPILOGUE_SWIGLU and h13_N2C is not None, SIGNAL=signal is not None,
        SAVE_ACT=act_N_C is not None and quantized_out is None, GATHER_A=a_rows_N is not None,
        ROW_SCALE=row_scale is not None, QUANT_OUT=quantized_out is not None,
        E_POW2=triton.next_power_of_2(groups), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, EVEN_K=k % config.block_k == 0,
        FLATTEN=config.flatten, EPI_CHUNK=epi_chunk, TMA=descs is not None, B_T=b_t, TMA_STORE=stores is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def rows_store_descriptors(out_NC: torch.Tensor | None, h13_N2C: torch.Tensor | None, cols: int, config: TileConfig,
                           ) -> tuple[TensorDescriptor | None, TensorDescriptor | None] | None:
    """(out's descriptor, h13's) for a plain or SwiGLU row GEMM's TMA-store epilogue (`TileConfig.tma_store`,
    `_ragged_rows_gemm_kernel`'s TMA_STORE), each None where not written by TMA: out None is a result the kernel
    quantises (its e4m3 act and scales keep their stores; the pre-activations alone go by TMA). None where the launch
    stores through pointers: no `tma_store` in the config, a flattened loop (its epilogue inside the fused loop), C
    not whole column tiles (a box of gate columns would reach the up ones), an output TMA cannot address
    (`tma_store_takes`), or nothing to write by TMA."""
    if not config.tma_store or config.flatten or cols % config.block_n or (out_NC is None and h13_N2C is None) \
            or not all(tma_store_takes(t) for t in (out_NC, h13_N2C) if t is not None):
        return None
    box = [config.block_m, config.block_n]
    return tuple(None if t is None else TensorDescriptor.from_tensor(t, box) for t in (out_NC, h13_N2C))


def swiglu_quantizes(config: TileConfig) -> bool:
    """Whether a SwiGLU launch at these tiles can write its act quantised 1 x 128 (`ragged_rows_gemm`'s
    `quantized_out`): 128-column tiles, one scale group a tile row (the tuned gate/up tiles and the heuristic's)."""
    return config.block_n == fr.SCALE_BLOCK


def rows_gemm_descriptors(a_NK: torch.Tensor, b_EKC: torch.Tensor, config: TileConfig,
                          ) -> tuple[TensorDescriptor, TensorDescriptor, int, bool] | None:
    """(a's descriptor, b's, b's rows per weight, whether b's is its transpose) for a row GEMM's TMA loads
    (`TileConfig.tma`, `_ragged_rows_gemm_kernel`), or None where the launch loads through pointers: no
    `tma` in the config, or an operand TMA cannot take (`tma_takes`: a, and the weights seen as the
    2-D rows of a [E, K, width] tensor with contiguous columns, or of its transpose's)."""
    if not config.tma or not tma_takes(a_NK):
        return None
    experts, k, width = b_EKC.shape
    a_desc = TensorDescriptor.from_tensor(a_NK, [config.block_m, config.block_k])
    if b_EKC.stride(2) == 1 and b_EKC.stride(0) == k * b_EKC.stride(1):  # [E, K, width] rows
        rows_KC = b_EKC.as_strided((experts * k, width), (b_EKC.stride(1), 1))
        if tma_takes(rows_KC):
            return a_desc, TensorDescriptor.from_tensor(rows_KC, [config.block_k, config.block_n]), k, False
    if b_EKC.stride(1) == 1 and b_EKC.stride(0) == width * b_EKC.stride(2):  # a transposed [E, width, K]
        rows_CK = b_EKC.as_strided((experts * width, k), (b_EKC.stride(2), 1))
        if tma_takes(rows_CK):
            return a_desc, TensorDescriptor.from_tensor(rows_CK, [config.block_n, config.block_k]), width, True
    return None


@triton.jit
def _swiglu_grad_inputs(da_ptr, h13_ptr, rows64, row_ok, cols, C, stride_dm, stride_dc, stride_hm, stride_hc):
    """(ok, d act, gate, up) of some rows and columns of the split SwiGLU-gradient pass, fp32, zeros
    outside ok (rows past the limit, columns past C): d act [N, C] and h13's gate [:C] and up [C:]
    halves read for `_swiglu_grad_rows_kernel` and `fp8`'s quantising pass alike."""
    ok = row_ok[:, None] & (cols < C)[None, :]
    h_ptrs = h13_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hc
    d_act = tl.load(da_ptr + rows64[:, None] * stride_dm + cols[None, :] * stride_dc, mask=ok, other=0.0)
    gate = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptrs + C * stride_hc, mask=ok, other=0.0).to(tl.float32)
    return ok, d_act.to(tl.float32), gate, up


@triton.jit
def _swiglu_grad_rows_kernel(da_ptr, h13_ptr, out_ptr, act_ptr, scale_ptr, rowdot_ptr, limit_ptr, N, C,
                             stride_dm, stride_dc, stride_hm, stride_hc, stride_om, stride_oc, stride_xm, stride_xc,
                             SAVE_ACT: tl.constexpr, ROW_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    """`swiglu_grad_rows` over BLOCK_R rows, BLOCK_C columns a step: the fused epilogue's columns
    (`_swiglu_grad_columns`) on d act read from memory (rows at or past the last offset: no group's,
    left unwritten as the fused launch leaves them)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.minimum(tl.load(limit_ptr), N)
    rows64 = rows.to(tl.int64)
    if ROW_SCALE:
        scale = tl.load(scale_ptr + rows64, mask=row_ok, other=0.0)
    else:
        scale = tl.zeros((BLOCK_R,), dtype=tl.float32)
    rowdot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ok, acc, gate, up = _swiglu_grad_inputs(da_ptr, h13_ptr, rows64, row_ok, cols, C,
                                                stride_dm, stride_dc, stride_hm, stride_hc)
        rowdot += _swiglu_grad_columns(acc, gate, up, scale, rows64, cols, ok, C, out_ptr, act_ptr,
                                       stride_om, stride_oc, stride_xm, stride_xc, SAVE_ACT, ROW_SCALE)
    if ROW_SCALE:
        tl.store(rowdot_ptr + rows64, rowdot, mask=row_ok)


SPLIT_ROWS, SPLIT_COLS = 16, 128  # `swiglu_grad_rows`' block: rows per program, columns per step


def swiglu_grad_rows(d_act_NC: torch.Tensor, h13_N2C: torch.Tensor, offsets_E: torch.Tensor, *,
                     out: torch.Tensor | None = None, act_N_C: torch.Tensor | None = None,
                     row_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The SwiGLU-gradient epilogue as its own pass (`TileConfig.split_epilogue`): out [N, 2C] =
    (d gate | d up) from d act [N, C] (the down data gradient's plain product) and the saved
    pre-activations h13 [N, 2C], for rows before the last offset (the others' d act is unwritten);
    `act_N_C` receives silu(gate) * up; `row_scale` = (scale_N, rowdot_BN) as `ragged_rows_gemm`
    takes it: the products scaled per row, each row's whole dot with the SwiGLU output written
    into rowdot_BN[0] and the other tiles' rows zeroed (the caller sums over them)."""
    n_rows, cols = d_act_NC.shape
    if out is None:
        out = d_act_NC.new_empty((n_rows, 2 * cols))
    act = act_N_C if act_N_C is not None else out
    scale, rowdot = row_scale if row_scale is not None else (out, out)
    if row_scale is not None:
        rowdot.zero_()
    _swiglu_grad_rows_kernel[(triton.cdiv(n_rows, SPLIT_ROWS),)](
        d_act_NC, h13_N2C, out, act, scale, rowdot, offsets_E[-1:], n_rows, cols,
        d_act_NC.stride(0), d_act_NC.stride(1), h13_N2C.stride(0), h13_N2C.stride(1), out.stride(0), out.stride(1),
        act.stride(0), act.stride(1), SAVE_ACT=act_N_C is not None, ROW_SCALE=row_scale is not None,
        BLOCK_R=SPLIT_ROWS, BLOCK_C=SPLIT_COLS, num_warps=4)
    return out


def gluon_takes(a_NK: torch.Tensor, b_EKC: torch.Tensor, config: TileConfig, epilogue: int,
                out: torch.Tensor | None, h13_N2C: torch.Tensor | None, dst_rows_N: torch.Tensor | None,
                signal: SegmentSignal | None, a_rows_N: torch.Tensor | None) -> bool:
    """Whether our Gluon kernels can run this `ragged_rows_gemm` launch (`TileConfig.gluon`): a plain
    product or the SwiGLU forward (into given outputs or new ones; not quantised), rows neither gathered nor
    scattered nor signalled, on a Hopper GPU, a launch they take at the config's Gluon tile (`gluon_rows.takes`,
    `gluon_rows.swiglu_takes`: the operands, the outputs, the ring's depth)."""
    if epilogue not in (EPILOGUE_PLAIN, EPILOGUE_SWIGLU) or dst_rows_N is not None or signal is not None \
            or a_rows_N is not None or not a_NK.is_cuda:
        return False
    from disagmoe.kernels import gluon_rows

    tile = (config.gluon_block_m, config.gluon_block_n)
    if epilogue == EPILOGUE_SWIGLU:
        return gluon_rows.swiglu_takes(a_NK, b_EKC, *tile, out=out, h13_N2F=h13_N2C, stages=config.gluon_stages,
                                       tma_store=config.gluon_tma_store)
    return gluon_rows.takes(a_NK, b_EKC, *tile, out=out, stages=config.gluon_stages,
                            tma_store=config.gluon_tma_store)


def library_takes(a_NK: torch.Tensor, offsets_E: torch.Tensor, b_EKC: torch.Tensor, epilogue: int, out_given: bool,
                  dst_rows_N: torch.Tensor | None, signal: SegmentSignal | None,
                  a_rows_N: torch.Tensor | None) -> bool:
    """Whether `torch._grouped_mm` can run this `ragged_rows_gemm` launch (`TileConfig.library`): a
    plain product into a new output, rows neither gathered nor scattered nor signalled, one row
    group per expert, and operands it takes (on a GPU bf16; every stride but the unit one, and each
    base address, a multiple of 16 bytes). Rows past the last offset (pairs served elsewhere) are
    left as the library leaves them, as our kernel leaves them unwritten: no reader reads them."""
    if (epilogue != EPILOGUE_PLAIN or out_given or dst_rows_N is not None or signal is not None
            or a_rows_N is not None or offsets_E.shape[0] != b_EKC.shape[0] or not hasattr(torch, "_grouped_mm")):
        return False
    if a_NK.is_cuda and a_NK.dtype != torch.bfloat16:
        return False
    for t in (a_NK, b_EKC):
        size = t.element_size()
        if t.data_ptr() % 16 or any(s != 1 and (s * size) % 16 for s in t.stride()):
            return False
    return a_NK.dtype == b_EKC.dtype


def ragged_weight_grad(
    a_NK: torch.Tensor,
    b_NC: torch.Tensor,
    offsets_E: torch.Tensor,
    config: TileConfig,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    weights: int | None = None,
    num_programs: int | None = None,
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[e] = a[rows_e]^T @ b[rows_e] for every expert e ([E, K, C]; zeros for empty experts);
    with `accumulate`, out[e] += it (`out` given, any float dtype: an fp32 main gradient; into fp32
    with fp32 atomics where the tile config says `atomic_accumulate`: the same sum, bit for bit but
    for denormals, which the GPU's reduction flushes to zero).

    `weights` (E_W; default offsets_E.shape[0]): `offsets_E` then holds a multiple G of E_W row
    groups, group g belonging to weight g mod E_W (segment-major order, as `ragged_rows_gemm`
    takes them; `fused_return.segment_major_order`), and out is [E_W, K, C]: out[e] sums the
    groups g = e mod E_W, in ascending g, each output tile written by one program. With G > E_W
    the tile config's `flatten` is not applied (the compiler flattens only a loop nest of two).

    `second` = (a2_NK, b2_NC, offsets2_E): a second row set over the same experts (one group each, not
    banded; a's and b's dtypes and strides), e.g. the next micro-batch's rows (`kernels.wgrad_pairs`):
    out[e] = a[rows_e]^T @ b[rows_e] + a2[rows2_e]^T @ b2[rows2_e], summed in one fp32 accumulator,
    the first set's rows first, and written (or added) once."""
    assert out is not None or not accumulate
    n_rows, k = a_NK.shape
    assert b_NC.shape[0] == n_rows and offsets_E.dim() == 1 and offsets_E.dtype == torch.int32
    groups, cols = offsets_E.shape[0], b_NC.shape[1]
    experts = groups if weights is None else weights
    assert experts >= 1 and groups % experts == 0, (groups, experts)
    if second is not None:
        a2_NK, b2_NC, offsets2_E = second
        assert groups == experts, "a second row set pairs one group per expert (not banded)"
        assert offsets2_E.shape == offsets_E.shape and offsets2_E.dtype == torch.int32
        assert a2_NK.shape[1:] == a_NK.shape[1:] and b2_NC.shape[1:] == b_NC.shape[1:], "the second rows' widths"
        assert a2_NK.shape[0] == b2_NC.shape[0] and a2_NK.dtype == a_NK.dtype and b2_NC.dtype == b_NC.dtype
        assert a2_NK.stride() == a_NK.stride() and b2_NC.stride() == b_NC.stride(), "the kernel takes a's strides"
    if out is None:
        out = a_NK.new_empty((experts, k, cols))
    assert out.shape == (experts, k, cols), (tuple(out.shape), (experts, k, cols))
    if out.numel() == 0:
        return out
    if config.gluon and gluon_wgrad_takes(a_NK, b_NC, offsets_E, config, out, accumulate, experts, second):
        from disagmoe.kernels import gluon_wgrad

        return gluon_wgrad.gluon_weight_grad(
            a_NK, b_NC, offsets_E, weights=experts, out=out, accumulate=accumulate, atomic=config.atomic_accumulate,
            tma_epilogue=config.gluon_tma_store, block_n=config.gluon_block_n, stages=config.gluon_stages,
            group_m=config.group_m, num_programs=num_programs, second=second)
    banded = groups != experts
    programs = num_programs or default_num_programs(a_NK.device) * config.programs_per_sm
    tma = (config.tma and tma_takes(a_NK) and tma_takes(b_NC)
           and (second is None or (tma_takes(second[0]) and tma_takes(second[1]))))
    atomic = config.atomic_accumulate and accumulate and out.dtype == torch.float32
    a_desc = TensorDescriptor.from_tensor(a_NK, [config.block_m, config.block_k]) if tma else None
    b_desc = TensorDescriptor.from_tensor(b_NC, [config.block_m, config.block_n]) if tma else None
    a2_NK, b2_NC, offsets2_E = second if second is not None else (a_NK, b_NC, offsets_E)
    paired_tma = tma and second is not None
    a2_desc = TensorDescriptor.from_tensor(a2_NK, [config.block_m, config.block_k]) if paired_tma else None
    b2_desc = TensorDescriptor.from_tensor(b2_NC, [config.block_m, config.block_n]) if paired_tma else None
    out_desc = weight_grad_store_descriptor(out, config, banded)
    _ragged_weight_grad_kernel[(programs,)](
        a_NK, b_NC, out, offsets_E, a_desc, b_desc, a2_NK, b2_NC, offsets2_E, a2_desc, b2_desc, out_desc,
        groups, experts, k, cols, programs,
        a_NK.stride(0), a_NK.stride(1), b_NC.stride(0), b_NC.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, FLATTEN=config.flatten and not banded, ACCUMULATE=accumulate,
        BANDED=banded, ATOMIC=atomic, TMA=tma, PREFETCH=accumulate and not atomic and config.prefetch_accumulator,
        PAIRED=second is not None, TMA_STORE=out_desc is not None, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def weight_grad_store_descriptor(out_EKC: torch.Tensor, config: TileConfig, banded: bool) -> TensorDescriptor | None:
    """out's descriptor as [E x K, C] rows for the weight gradient's TMA epilogue (`TileConfig.tma_store`,
    `_ragged_weight_grad_kernel`'s TMA_STORE: the reduce-add under `atomic_accumulate`, else the store), or None
    where its tiles are written through pointers: no `tma_store`, a flattened loop (the tile config's `flatten` where
    not banded), K not whole BLOCK_K tiles (a box would reach the next weight's rows), or rows TMA cannot address
    (`tma_store_takes`)."""
    experts, k, cols = out_EKC.shape
    if not config.tma_store or (config.flatten and not banded) or k % config.block_k or config.block_k < 16 \
            or out_EKC.stride(0) != k * out_EKC.stride(1):
        return None
    rows_KC = out_EKC.as_strided((experts * k, cols), (out_EKC.stride(1), out_EKC.stride(2)))
    box = [config.block_k // 2, config.block_n]  # a tile's rows in two halves (`_ragged_weight_grad_kernel`)
    return TensorDescriptor.from_tensor(rows_KC, box) if tma_store_takes(rows_KC) else None


def gluon_wgrad_takes(a_NK: torch.Tensor, b_NC: torch.Tensor, offsets_E: torch.Tensor, config: TileConfig,
                      out: torch.Tensor, accumulate: bool, experts: int,
                      second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether our Gluon weight gradient (`kernels.gluon_wgrad`) can run this `ragged_weight_grad` launch at the
    config's Gluon tile (`TileConfig.gluon`: gluon_block_n, gluon_stages, gluon_tma_store): a Hopper GPU, bf16
    or fp16 rows TMA can address (`gluon_wgrad.takes`). Where it cannot, our Triton kernel runs the config's
    own fields."""
    from disagmoe.kernels import gluon_wgrad

    return gluon_wgrad.takes(a_NK, b_NC, offsets_E, block_n=config.gluon_block_n, stages=config.gluon_stages,
                             out=out, accumulate=accumulate, tma_epilogue=config.gluon_tma_store, weights=experts,
                             second=second, atomic=config.atomic_accumulate, group_m=config.group_m)


def tma_store_takes(t_NC: torch.Tensor) -> bool:
    """Whether TMA can write `t_NC` (`TileConfig.tma_store`): `tma_takes`' layout (not empty, rows contiguous, base
    address and row stride 16-byte aligned), in bf16, fp16 or fp32 (the copy moves bytes: no MMA reads them) on a
    Hopper or newer GPU, or any float in the CPU interpreter."""
    return _tma_addressable(t_NC, (torch.bfloat16, torch.float16, torch.float32))


def tma_takes(t_NK: torch.Tensor) -> bool:
    """Whether TMA can load `t_NK` (`TileConfig.tma`): not empty, rows contiguous, base address and row
    stride 16-byte aligned, and 16-bit elements on a Hopper or newer GPU (the MMA reads the transposed A box
    from shared memory, which its tf32 form cannot) or any float in the CPU interpreter (which
    emulates the descriptors: its tests run fp32); otherwise a launch asking for TMA loads through
    pointers."""
    return _tma_addressable(t_NK, (torch.bfloat16, torch.float16))


def _tma_addressable(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether a descriptor can address `t`: 2-D, not empty (a descriptor needs every dimension positive), rows
    contiguous, base address and row stride 16-byte aligned; on a GPU, one of `dtypes` on a Hopper or newer (the CPU
    interpreter emulates descriptors of any float)."""
    if t.dim() != 2 or t.numel() == 0 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return False
    return t.device.type == "cpu" or (t.dtype in dtypes and torch.cuda.get_device_capability(t.device)[0] >= 9)
