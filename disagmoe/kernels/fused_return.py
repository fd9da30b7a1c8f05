"""The tile-level fused return (issue 11): the expert kernel's down-GEMM epilogue stores each
finished row tile straight into the receiving GPU's buffer and counts it per segment; the
receiving side waits per segment and combines as segments land.

The receiver's buffer holds one row per (token, expert) pair, pair p = t * K + j at row p, the
regime of large expert-parallel groups, where a token's experts sit on different GPUs and every
pair crosses the link. Segment s covers tokens [s * ST, (s + 1) * ST), i.e. rows [s * ST * K,
(s + 1) * ST * K), ST = `segment_tokens`. Each source (expert rank) has its own flag per segment
in the receiver's flag block [Q sources, S segments]; the source's launch adds 1 to its flag of
segment s once every row it sends into s is stored (`grouped_gemm.SegmentSignal`; a segment it
sends nothing to is raised at the launch's start). The receiver's combine program for segment s
waits for the Q flags of s (acquire loads at system scope), each against its word of the
receiver's consumed block [Q, S] (`kernels.signal`: the combine claims the next message there and
advances it on the device), then sums that segment's tokens' rows in pair order: the same bits
run to run, whatever order the tiles landed in.

Flags count messages and the combine's consumed words count what it took, so nothing is reset
between steps and no launch takes a message number from the host (a CUDA graph replays them); the
per-segment counters return to zero at the end of each launch (the program completing a segment
resets it).
The segment plan (segment per row, expected stores per segment) is computed on the device from
the destination rows, with no host sync. A combine whose flags never come gives up after its
timeout and records it in its status words (`kernels.signal`), read at the step's end.

In the runtime with `hop: pair_rows` (`runtime.stages.pair_return`): two copies of every destination and
its flags (message n of a slot writes copy (n - 1) mod 2, so a producer a step ahead cannot
overwrite rows being combined); a source on the receiver's own GPU (colocated) runs before the
combine in stream order.

Shape legend: N rows (pairs this expert rank holds, grouped by expert), T tokens, K top-k,
P = T * K pair rows, H hidden, F expert FFN, E experts, S segments, Q sources.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.signal import DEFAULT_TIMEOUT_S, check_consumed, check_status_words, timed, wait_claimed
from disagmoe.kernels.tile_configs import TileConfig

INT32_MAX = 2**31 - 1  # the status words are int32 (`kernels.signal`)
COMBINE_PROGRAMS = 16  # the receiver's default: SMs spent waiting and combining, the rest stay free


def num_segments(tokens: int, segment_tokens: int) -> int:
    return triton.cdiv(tokens, segment_tokens)


def segment_plan(dst_rows_N: torch.Tensor, tokens: int, top_k: int, segment_tokens: int,
                 column_tiles: int, served_1: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seg_N int32, expected_S int32) for rows going to pair rows `dst_rows_N` of the receiver:
    each row's segment, and each segment's expected stores (its real rows x the launch's column
    tiles). `served_1` (one-element int32 on the rows' device; None: every row is real) holds how
    many rows are real: rows at index >= served_1[0] (a spare bucket past offsets[-1], which the
    GEMM never computes; their dst_rows entries any valid pair rows) count in no segment.
    Device ops only (scatter_add, not bincount, which reads its maximum on the host)."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens={segment_tokens} must be >= 1")
    seg_N = torch.div(dst_rows_N, segment_tokens * top_k, rounding_mode="floor").to(torch.int32)
    stores_N = torch.full_like(seg_N, column_tiles)
    if served_1 is not None:
        _check_served(served_1, dst_rows_N)
        stores_N *= torch.arange(seg_N.shape[0], device=seg_N.device) < served_1
    expected_S = torch.zeros(num_segments(tokens, segment_tokens), dtype=torch.int32, device=dst_rows_N.device)
    expected_S.scatter_add_(0, seg_N.long(), stores_N)
    return seg_N, expected_S


def _check_served(served_1: torch.Tensor, dst_rows_N: torch.Tensor) -> None:
    """Metadata only (no read of the value: it lives on the device)."""
    if served_1.numel() != 1 or served_1.dtype != torch.int32 or served_1.device != dst_rows_N.device:
        raise ValueError(f"served_1 must be one int32 element on {dst_rows_N.device} (how many rows are real); "
                         f"got {served_1.dtype} {tuple(served_1.shape)} on {served_1.device}")


ORDER_BANDS = 4  # the bands `segment_major_order` groups rows into (row groups = bands x experts)


def segment_major_order(offsets_E: torch.Tensor, dst_rows_N: torch.Tensor, top_k: int, segment_tokens: int,
                        segments: int, bands: int = ORDER_BANDS) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, offsets_G) regrouping expert-grouped rows by (band of destination segments,
    expert): rows[order_N] hold the first band's rows of every expert (segments [0, S / bands)),
    then the second band's, ...; offsets_G int32 [bands x E] their cumulative counts, group
    g = b * E + e using expert e's weights (`grouped_gemm.ragged_rows_gemm` takes them as they
    are). The GEMMs then finish band by band, so the first segments' flags rise while later ones
    compute and the receiver combines as they land ("the destination that needs them first goes
    first"). Bands, not segments: the grouped GEMM keeps its group table in registers and each
    group's rows shrink with their number (128 experts x 128 segments would be 16k groups of a
    few rows). Device ops only, stable within a group."""
    if bands < 1:
        raise ValueError(f"bands={bands} must be >= 1")
    bands = min(bands, segments)
    experts, rows = offsets_E.shape[0], dst_rows_N.shape[0]
    expert_N = torch.searchsorted(offsets_E.long(), torch.arange(rows, device=offsets_E.device), right=True)
    seg_N = torch.div(dst_rows_N.long(), segment_tokens * top_k, rounding_mode="floor")
    group_N = torch.div(seg_N * bands, segments, rounding_mode="floor") * experts + expert_N
    order_N = torch.sort(group_N, stable=True).indices
    counts_G = torch.zeros(bands * experts, dtype=torch.int64, device=offsets_E.device)
    counts_G.scatter_add_(0, group_N, torch.ones_like(group_N))
    return order_N, counts_G.cumsum(0).to(torch.int32)


def down_to_destination(act_NF: torch.Tensor, offsets_E: torch.Tensor, w2_EFH: torch.Tensor, config: TileConfig,
                        *, dst_PH: torch.Tensor, dst_rows_N: torch.Tensor, tokens: int, top_k: int,
                        segment_tokens: int, counters_S: torch.Tensor, flags_QS: torch.Tensor, source: int,
                        served_1: torch.Tensor | None = None,
                        num_programs: int | None = None) -> torch.Tensor:
    """The expert FFN's down GEMM, row r stored at dst_PH[dst_rows_N[r]] (the receiver's pair rows,
    on a peer GPU through NVLink, or local), adding 1 to this source's flag of each segment once its
    rows are stored; returns dst_PH. `counters_S` int32 zeros of this rank (zero again after the
    launch); `flags_QS` int64 [Q, S] the receiver's flag block, of which row `source` is this rank's. `served_1` (one-element int32
    device tensor, `segment_plan`): rows from served_1[0] on are a spare bucket past offsets[-1],
    neither computed nor stored nor waited for; their destinations are left as they were."""
    segments = num_segments(tokens, segment_tokens)
    if dst_PH.shape != (tokens * top_k, w2_EFH.shape[2]):
        raise ValueError(f"the destination must hold one row per pair, [{tokens * top_k}, {w2_EFH.shape[2]}]; "
                         f"got {tuple(dst_PH.shape)}")
    if counters_S.shape != (segments,) or counters_S.dtype != torch.int32:
        raise ValueError(f"counters must be int32 [{segments}] (one per segment), got {counters_S.dtype} "
                         f"{tuple(counters_S.shape)}")
    if flags_QS.dim() != 2 or flags_QS.shape[1] != segments or flags_QS.dtype != torch.int64:
        raise ValueError(f"flags must be int64 [sources, {segments}], got {flags_QS.dtype} {tuple(flags_QS.shape)}")
    if not 0 <= source < flags_QS.shape[0]:
        raise ValueError(f"source {source} is not a row of the {flags_QS.shape[0]}-source flag block")
    seg_N, expected_S = segment_plan(dst_rows_N, tokens, top_k, segment_tokens,
                                     triton.cdiv(w2_EFH.shape[2], config.block_n), served_1)
    signal = gg.SegmentSignal(seg_N, expected_S, counters_S, flags_QS[source])
    return gg.ragged_rows_gemm(act_NF, offsets_E, w2_EFH, config, out=dst_PH, dst_rows_N=dst_rows_N,
                               signal=signal, num_programs=num_programs)


@triton.jit(do_not_specialize=["timeout_ns", "flag_base"])  # `signal.MESSAGE_VALUES`
def _combine_landed_kernel(rows_ptr, weights_ptr, y_ptr, flags_ptr, consumed_ptr, status_ptr, timeout_ns, flag_base,
                           n_tokens, H, K, Q, S, num_programs, stride_r, stride_y, SEG_TOKENS: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr,
                           TIMED: tl.constexpr):
    # Persistent: program i takes work items i, i + num_programs, ..., segment-major (the first
    # segments first, as they land first), so a few programs wait without holding the GPU.
    h_blocks = tl.cdiv(H, BLOCK_H)
    for item in range(tl.program_id(0), S * h_blocks, num_programs):
        seg = item // h_blocks
        cols = (item % h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        for q in range(Q):  # every source's rows of this segment have landed (or the wait gave up):
            # h_blocks items wait for each message of the segment (`signal.claim`)
            wait_claimed(flags_ptr, consumed_ptr, status_ptr, q * S + seg, h_blocks, timeout_ns,
                         flag_base + q * S + seg, TIMED)
        for t0 in range(seg * SEG_TOKENS, tl.minimum((seg + 1) * SEG_TOKENS, n_tokens), BLOCK_T):
            tokens = t0 + tl.arange(0, BLOCK_T)
            tok_ok = (tokens < n_tokens) & (tokens < (seg + 1) * SEG_TOKENS)
            acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for j in range(K):  # pair order: deterministic
                pair = tokens.to(tl.int64) * K + j
                row = tl.load(rows_ptr + pair[:, None] * stride_r + cols[None, :],
                              mask=tok_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                if WEIGHTED:
                    w = tl.load(weights_ptr + pair, mask=tok_ok, other=0.0).to(tl.float32)
                    row = row * w[:, None]
                acc += row
            tl.store(y_ptr + tokens.to(tl.int64)[:, None] * stride_y + cols[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])


def combine_landed(rows_PH: torch.Tensor, weights_TK: torch.Tensor | None, flags_QS: torch.Tensor,
                   consumed_QS: torch.Tensor, segment_tokens: int, top_k: int, status_2: torch.Tensor,
                   num_programs: int = COMBINE_PROGRAMS, timeout_s: float = DEFAULT_TIMEOUT_S,
                   flag_base: int = 0) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * rows[t * K + j] (unweighted without weights: the backward's input
    gradients), each segment combined once all Q sources' flags counted its next message:
    `consumed_QS` int64 [Q, S] on this GPU (`signal.new_consumed`; the transport's, beside its
    flags) says how many each word had, and the launch advances it by one. `num_programs`:
    the SMs the receiving side spends waiting and combining (a knob: the rest stay free).
    `status_2` (`kernels.signal.new_status`) records a flag that did not come in `timeout_s`:
    word 1 gets its index flag_base + q * S + s, `flag_base` the flag block's first word in its
    arena (0: the block's own index); read it once, at the step's end (`kernels.signal.check_status`)."""
    pairs, hidden = rows_PH.shape
    tokens = pairs // top_k
    segments = num_segments(tokens, segment_tokens)
    if pairs != tokens * top_k or flags_QS.shape[1:] != (segments,) or flags_QS.dtype != torch.int64:
        raise ValueError(f"rows [{pairs}, {hidden}] with top_k {top_k} and flags {tuple(flags_QS.shape)}: expected "
                         f"rows [tokens * top_k, H] and int64 flags [sources, {segments}]")
    if num_programs < 1:
        raise ValueError(f"num_programs={num_programs} must be >= 1")
    if flag_base < 0 or flag_base + flags_QS.numel() - 1 > INT32_MAX:
        raise ValueError(f"flag_base={flag_base}: the flag block's first word in its arena, >= 0 and leaving "
                         f"its {flags_QS.numel()} indices in the int32 status word")
    check_consumed(consumed_QS, flags_QS)
    check_status_words(status_2)
    y_TH = rows_PH.new_empty((tokens, hidden))
    if tokens == 0:
        return y_TH
    block_h = min(256, triton.next_power_of_2(hidden))
    block_t = min(32, triton.next_power_of_2(segment_tokens))
    weights = weights_TK.contiguous() if weights_TK is not None else rows_PH
    programs = min(num_programs, segments * triton.cdiv(hidden, block_h))
    _combine_landed_kernel[(programs,)](
        rows_PH, weights, y_TH, flags_QS, consumed_QS, status_2, int(timeout_s * 1e9), flag_base, tokens, hidden, top_k,
        flags_QS.shape[0], segments, programs, rows_PH.stride(0), y_TH.stride(0), SEG_TOKENS=segment_tokens,
        BLOCK_T=block_t, BLOCK_H=block_h, WEIGHTED=weights_TK is not None, TIMED=timed(rows_PH))
    return y_TH


def combine_reference(rows_PH: torch.Tensor, weights_TK: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """Plain torch: y[t] = sum_j w[t, j] * rows[t * K + j], in fp32."""
    rows_TKH = rows_PH.float().view(-1, top_k, rows_PH.shape[1])
    if weights_TK is not None:
        rows_TKH = rows_TKH * weights_TK.float()[:, :, None]
    return rows_TKH.sum(1).to(rows_PH.dtype)
