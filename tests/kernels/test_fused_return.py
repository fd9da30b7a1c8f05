"""The tile-level fused return (disagmoe/kernels/fused_return.py) against torch: the down GEMM's
epilogue stores every pair row at its place in the receiver's buffer and counts one more message
in each source's segment flags; the combine waits for them against its consumed words, advances
those, and sums in pair order. Interpreter (fp32, CPU tensors
standing for the peer's buffer; sources run before the combine) and GPU (bf16, the combine
launched first on its own stream, so it really waits for the flags)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)

# (tokens, top_k, experts, sources, hidden, ffn, segment_tokens): experts split evenly over sources
CASES = [
    (37, 2, 6, 1, 40, 24, 8),  # ragged everything, one source
    (64, 4, 8, 2, 32, 16, 16),  # two sources share every segment
    (21, 3, 9, 3, 24, 40, 64),  # one segment larger than the tokens
    (40, 2, 8, 2, 16, 16, 4),  # skewed below: some experts and some sources get no rows
]


def _routing(tokens, top_k, experts, skew, gen):
    if skew:  # every pair goes to the first two experts: empty experts and an empty source
        return torch.stack([torch.randperm(2, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])


def _source_rows(topk_TK, experts, sources, source):
    """This source's pairs grouped by its experts: (offsets over its experts, destination pair rows)."""
    per = experts // sources
    ids_P = topk_TK.flatten()
    mine = torch.nonzero((ids_P // per) == source).flatten()
    order = torch.argsort(ids_P[mine], stable=True)
    pairs = mine[order]
    local_ids = ids_P[pairs] - source * per
    counts = torch.bincount(local_ids, minlength=per)
    return counts.cumsum(0).to(torch.int32), pairs.to(torch.int32)


def _run(fr, case, steps, device, dtype, skew=False, seed=0):
    tokens, top_k, experts, sources, hidden, ffn, seg_tokens = case
    gen = torch.Generator().manual_seed(seed)
    per = experts // sources
    w2 = (torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5).to(device, dtype)
    segments = fr.num_segments(tokens, seg_tokens)
    counters = [torch.zeros(segments, dtype=torch.int32, device=device) for _ in range(sources)]
    flags = torch.zeros(sources, segments, dtype=torch.int64, device=device)
    consumed = torch.zeros_like(flags)
    results = []
    for step in range(steps):
        topk = _routing(tokens, top_k, experts, skew and step == 0, gen)
        weights = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
        act = torch.randn(tokens * top_k, ffn, generator=gen).to(device, dtype)  # per pair, in pair order
        dst = torch.full((tokens * top_k, hidden), float("nan"), device=device, dtype=dtype)
        for q in range(sources):
            offsets, pairs = _source_rows(topk, experts, sources, q)
            fr.down_to_destination(act[pairs.long()].contiguous(), offsets.to(device), w2[q * per:(q + 1) * per],
                                   SMALL_TILES, dst_PH=dst, dst_rows_N=pairs.to(device), tokens=tokens, top_k=top_k,
                                   segment_tokens=seg_tokens, counters_S=counters[q], flags_QS=flags, source=q,
                                   num_programs=3)
        status = torch.zeros(2, dtype=torch.int32, device=device)
        y = fr.combine_landed(dst, weights, flags, consumed, seg_tokens, top_k, status, num_programs=2)
        assert status.tolist() == [0, 0]
        rows_want = torch.einsum("pf,pfh->ph", act.float(), w2.float()[topk.flatten().to(device)])
        want = fr.combine_reference(rows_want, weights, top_k)
        results.append((dst, rows_want, y, want, flags.clone(), consumed.clone(), [c.clone() for c in counters]))
    return results


@pytest.fixture
def fused(interpreted):
    _, _, fr = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fused_return")
    return fr


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rows_land_in_place_and_the_combine_matches_torch(fused, case):
    results = _run(fused, CASES[case], 2, "cpu", torch.float32, skew=case == 3, seed=case)
    for messages, (dst, rows_want, y, want, flags, consumed, counters) in enumerate(results, start=1):
        assert torch.allclose(dst, rows_want, rtol=1e-4, atol=1e-5)  # every pair row written, no NaN left
        assert torch.allclose(y, want, rtol=1e-4, atol=1e-5)
        assert (flags == messages).all(), "every source's every segment counts the message, empty ones included"
        assert (consumed == messages).all(), "the combine took each message once"
        assert all((c == 0).all() for c in counters), "the counters are zero again after each launch"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_segment_major_rows_run_the_whole_ffn_and_land_in_place(fused, case):
    """The gate/up and down GEMMs over (segment, expert) groups, weights cycling per group, store
    the same pair rows as expert order does; the combine matches torch."""
    from disagmoe.kernels import moe_ffn

    tokens, top_k, experts, _, hidden, ffn, seg_tokens = CASES[case]
    gen = torch.Generator().manual_seed(10 + case)
    topk = _routing(tokens, top_k, experts, case == 3, gen)
    offsets, pairs = _source_rows(topk, experts, 1, 0)
    x = torch.randn(tokens * top_k, hidden, generator=gen)[pairs.long()]  # expert-grouped rows
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    segments = fused.num_segments(tokens, seg_tokens)
    bands = min(2, segments)
    order, offsets_G = fused.segment_major_order(offsets, pairs, top_k, seg_tokens, segments, bands=2)
    assert sorted(order.tolist()) == list(range(len(pairs))) and offsets_G.shape == (bands * experts,)
    band_of_row = (pairs[order].long() // (seg_tokens * top_k)) * bands // segments
    assert (band_of_row[1:] >= band_of_row[:-1]).all(), "the first band's rows come first"
    act = fused.gg.ragged_rows_gemm(x[order], offsets_G, w13, SMALL_TILES, epilogue=fused.gg.EPILOGUE_SWIGLU,
                                    num_programs=3)
    dst = torch.full((tokens * top_k, hidden), float("nan"))
    flags = torch.zeros(1, segments, dtype=torch.int64)
    counters = torch.zeros(segments, dtype=torch.int32)
    fused.down_to_destination(act, offsets_G, w2, SMALL_TILES, dst_PH=dst, dst_rows_N=pairs[order], tokens=tokens,
                              top_k=top_k, segment_tokens=seg_tokens, counters_S=counters, flags_QS=flags, source=0,
                              num_programs=3)
    want_rows = torch.empty_like(dst)
    want_rows[pairs.long()] = moe_ffn.expert_ffn_reference(x, offsets, w13, w2)
    assert torch.allclose(dst, want_rows, rtol=1e-4, atol=1e-5)
    assert (flags == 1).all() and (counters == 0).all()


def test_segment_plan_counts_rows_per_segment_on_the_device(fused):
    dst_rows = torch.tensor([0, 5, 6, 7, 15, 16], dtype=torch.int32)
    seg, expected = fused.segment_plan(dst_rows, tokens=9, top_k=2, segment_tokens=4, column_tiles=3)
    assert seg.tolist() == [0, 0, 0, 0, 1, 2] and expected.tolist() == [12, 3, 3]
    with pytest.raises(ValueError, match="segment_tokens"):
        fused.segment_plan(dst_rows, tokens=9, top_k=2, segment_tokens=0, column_tiles=3)


def test_segment_plan_leaves_the_spare_rows_out(fused):
    """Rows at index >= served_1[0] (a spare bucket) keep their segment but count in no segment's stores."""
    dst_rows = torch.tensor([0, 5, 6, 7, 15, 16], dtype=torch.int32)
    served = torch.tensor([3], dtype=torch.int32)
    seg, expected = fused.segment_plan(dst_rows, tokens=9, top_k=2, segment_tokens=4, column_tiles=3, served_1=served)
    assert seg.tolist() == [0, 0, 0, 0, 1, 2] and expected.tolist() == [9, 0, 0]
    everything = torch.tensor([6], dtype=torch.int32)
    assert fused.segment_plan(dst_rows, 9, 2, 4, 3, served_1=everything)[1].tolist() == [12, 3, 3]
    with pytest.raises(ValueError, match="served_1 must be one int32 element"):
        fused.segment_plan(dst_rows, 9, 2, 4, 3, served_1=served.long())


# (tokens, top_k, segment_tokens, experts, hidden, ffn, real rows, spare rows)
SPARE_CASES = [
    (24, 2, 4, 3, 24, 16, 30, 7),
    (19, 3, 5, 4, 40, 24, 25, 10),  # a short last segment, three column tiles
]


def _spare_tail_case(gen, pairs, last_pairs, experts, real, spare):
    """(offsets_E, expert_R, dst_rows_N): `real` rows grouped by expert (expert 1 gets none) going
    to random pairs below the last segment's first pair `last_pairs`, then a spare tail of `spare`
    rows going to other pairs, half of them below it, the rest into the last segment (which no real
    row goes to)."""
    below = torch.randperm(last_pairs, generator=gen)
    last = last_pairs + torch.randperm(pairs - last_pairs, generator=gen)
    dst_rows = torch.cat([below[:real + spare // 2], last[:spare - spare // 2]])
    expert_R = torch.sort(torch.randint(experts - 1, (real,), generator=gen)).values
    expert_R += (expert_R >= 1).long()  # skip expert 1: an empty group
    offsets = torch.bincount(expert_R, minlength=experts).cumsum(0).to(torch.int32)
    return offsets, expert_R, dst_rows.to(torch.int32)


@pytest.mark.parametrize("case", range(len(SPARE_CASES)))
def test_spare_rows_are_neither_stored_nor_waited_for(fused, case):
    """A launch whose rows end in a spare bucket (past offsets[-1], served_1[0] real rows): every real
    row stored, the spare rows' destinations untouched (still NaN), every flag raised, the last
    segment's (spare rows only) at the launch's start, and the counters back to zero. Without
    served_1 the spare rows' segments would wait for stores that never come."""
    tokens, top_k, seg_tokens, experts, hidden, ffn, real, spare = SPARE_CASES[case]
    gen = torch.Generator().manual_seed(5 + case)
    segments = fused.num_segments(tokens, seg_tokens)
    offsets, expert_R, dst_rows = _spare_tail_case(gen, tokens * top_k, (segments - 1) * seg_tokens * top_k, experts,
                                                   real, spare)
    act = torch.randn(real + spare, ffn, generator=gen)
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    served = torch.tensor([real], dtype=torch.int32)

    def launch(served_1):
        dst = torch.full((tokens * top_k, hidden), float("nan"))
        flags = torch.zeros(1, segments, dtype=torch.int64)
        counters = torch.zeros(segments, dtype=torch.int32)
        fused.down_to_destination(act, offsets, w2, SMALL_TILES, dst_PH=dst, dst_rows_N=dst_rows, tokens=tokens,
                                  top_k=top_k, segment_tokens=seg_tokens, counters_S=counters, flags_QS=flags,
                                  source=0, served_1=served_1, num_programs=3)
        return dst, flags, counters

    dst, flags, counters = launch(served)
    want = torch.stack([act[r] @ w2[expert_R[r]] for r in range(real)])
    assert torch.allclose(dst[dst_rows[:real].long()], want, rtol=1e-4, atol=1e-5)
    assert torch.isnan(dst[dst_rows[real:].long()]).all(), "no spare row stored"
    assert (flags == 1).all() and (counters == 0).all()
    _, flags, _ = launch(None)  # the spare rows counted: their segments never complete
    assert flags[0, -1] == 0 and (flags == 0).sum() >= 2


def _combine_once(fused, rows, flags, consumed, seg_tokens, top_k, status=None, base=0):
    """One combine (unweighted); a status given as timed out makes every wait look once (the
    interpreter has no clock: `signal.remaining_timeout`)."""
    status = torch.zeros(2, dtype=torch.int32) if status is None else status
    y = fused.combine_landed(rows, None, flags, consumed, seg_tokens, top_k, status, num_programs=2, flag_base=base)
    return y, status.tolist()


def test_a_wait_that_gives_up_reports_the_flags_arena_index(fused):
    """Status word 1 names a flag that did not come as flag_base + q * S + s."""
    from disagmoe.kernels.signal import TIMED_OUT

    tokens, top_k, seg_tokens, hidden = 12, 2, 4, 8
    rows = torch.randn(tokens * top_k, hidden)
    flags = torch.ones(2, 3, dtype=torch.int64)
    flags[1, 2] = 0  # source 1's rows of segment 2 have not landed
    for base, index in ((0, 5), (1000, 1005)):
        status = torch.tensor([TIMED_OUT, -1], dtype=torch.int32)  # an earlier wait gave up: one look each
        y, got = _combine_once(fused, rows, flags, torch.zeros_like(flags), seg_tokens, top_k, status, base)
        assert got == [TIMED_OUT, index]
        assert torch.allclose(y, fused.combine_reference(rows, None, top_k))
    with pytest.raises(ValueError, match="flag_base=-1"):
        _combine_once(fused, rows, flags, torch.zeros_like(flags), seg_tokens, top_k, base=-1)


def test_a_replayed_combine_waits_for_the_next_message_of_every_word(fused):
    """The same combine launched again with the same host arguments (a graph replay): its column
    blocks of one segment (hidden 300: two blocks) all claim the same message and advance each
    consumed word once; it passes once every source counted one more, and not before."""
    from disagmoe.kernels.signal import TIMED_OUT

    tokens, top_k, seg_tokens, hidden = 8, 2, 4, 300
    gen = torch.Generator().manual_seed(4)
    flags, consumed = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)
    for message in (1, 2):
        rows = torch.randn(tokens * top_k, hidden, generator=gen)
        flags += 1  # both sources' rows of both segments landed
        y, status = _combine_once(fused, rows, flags, consumed, seg_tokens, top_k)
        assert status == [0, 0] and (consumed == message).all()
        assert torch.allclose(y, fused.combine_reference(rows, None, top_k))
    flags[0] += 1  # only source 0's next rows landed
    probe = consumed.clone()
    _, status = _combine_once(fused, rows, flags, probe, seg_tokens, top_k, torch.tensor([TIMED_OUT, -1]).int())
    assert status == [TIMED_OUT, 3] and (probe == 3).all(), "source 1's segments are one message short"


def test_bad_buffers_are_refused_with_the_shape_expected(fused):
    w2 = torch.zeros(2, 8, 16)
    args = dict(dst_rows_N=torch.zeros(0, dtype=torch.int32), tokens=4, top_k=2, segment_tokens=2, source=0)
    with pytest.raises(ValueError, match=r"one row per pair, \[8, 16\]"):
        fused.down_to_destination(torch.zeros(0, 8), torch.zeros(2, dtype=torch.int32), w2, SMALL_TILES,
                                  dst_PH=torch.zeros(4, 16), counters_S=torch.zeros(2, dtype=torch.int32),
                                  flags_QS=torch.zeros(1, 2, dtype=torch.int64), **args)
    flags = torch.zeros(1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"consumed words must be int64 \(1, 2\)"):
        fused.combine_landed(torch.zeros(8, 16), None, flags, torch.zeros(2, dtype=torch.int64), 2, 2,
                             torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "one-expert-takes-all"])
def test_gpu_the_combine_waits_for_rows_stored_by_a_concurrent_launch(skew):
    """The combine is queued first on its own stream and spins on the flags; the expert launch on
    another stream stores the rows and raises them. bf16, the Qwen3-30B expert shape, 4k tokens.
    (CUDA runs the two streams' kernels concurrently here but does not promise to: if it
    serialised them, the combine would give up after its timeout and the test says so. A kernel's
    first launch loads its module, which waited for the spinning combine on the H200: each of its
    waits timed out, so both kernels are loaded first.)"""
    from disagmoe.kernels import fused_return as fr
    from disagmoe.kernels.moe_ffn import FFNTiles

    device, dtype = torch.device("cuda"), torch.bfloat16
    tokens, top_k, experts, hidden, ffn, seg_tokens = 4096, 8, 128, 2048, 768, 256
    gen = torch.Generator().manual_seed(7)
    topk = (torch.zeros(tokens, 1, dtype=torch.int64) + torch.arange(top_k)[None, :] if skew
            else torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]))
    offsets, pairs = _source_rows(topk, experts, 1, 0)
    act = torch.randn(tokens * top_k, ffn, generator=gen).to(device, dtype)
    w2 = (torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5).to(device, dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
    segments = fr.num_segments(tokens, seg_tokens)
    flags = torch.zeros(1, segments, dtype=torch.int64, device=device)
    consumed = torch.zeros_like(flags)
    counters = torch.zeros(segments, dtype=torch.int32, device=device)
    dst = torch.zeros(tokens * top_k, hidden, device=device, dtype=dtype)
    pairs_d, offsets_d = pairs.to(device), offsets.to(device)
    tiles = FFNTiles.for_shape(tokens * top_k, experts, hidden, ffn, device)
    status = torch.zeros(2, dtype=torch.int32, device=device)
    # Load both kernels first, one after the other (message 1).
    act_grouped = torch.zeros(tokens * top_k, ffn, device=device, dtype=dtype)
    fr.down_to_destination(act_grouped, offsets_d, w2, tiles.down, dst_PH=dst, dst_rows_N=pairs_d, tokens=tokens,
                           top_k=top_k, segment_tokens=seg_tokens, counters_S=counters, flags_QS=flags, source=0,
                           num_programs=100)
    fr.combine_landed(dst, weights, flags, consumed, seg_tokens, top_k, status, num_programs=8, timeout_s=10)
    consumer, producer = torch.cuda.Stream(), torch.cuda.Stream()
    expert_P = topk.flatten().to(device)
    for message in (2, 3):  # later steps reuse the flags (messages 2, 3) and the counters (back to zero)
        act = torch.randn(tokens * top_k, ffn, generator=gen).to(device, dtype)  # new rows each step
        act_grouped = act[pairs.long().to(device)].contiguous()
        dst.fill_(float("nan"))  # a combine that did not wait would read these
        torch.cuda.synchronize()
        with torch.cuda.stream(consumer):  # queued first: it waits on the flags, for at most 10 s
            y = fr.combine_landed(dst, weights, flags, consumed, seg_tokens, top_k, status, num_programs=8,
                                  timeout_s=10)
        with torch.cuda.stream(producer):
            fr.down_to_destination(act_grouped, offsets_d, w2, tiles.down, dst_PH=dst, dst_rows_N=pairs_d,
                                   tokens=tokens, top_k=top_k, segment_tokens=seg_tokens, counters_S=counters,
                                   flags_QS=flags, source=0, num_programs=100)
        torch.cuda.synchronize()
        rows_want = torch.empty(tokens * top_k, hidden, device=device)
        for e in expert_P.unique().tolist():  # one expert at a time ([P, F, H] would not fit)
            sel = (expert_P == e).nonzero().squeeze(1)
            rows_want[sel] = act[sel].float() @ w2[e].float()
        want = fr.combine_reference(rows_want, weights.float(), top_k)
        assert status.tolist() == [0, 0], "the combine gave up waiting (were the kernels serialised?)"
        err = ((y.float() - want).norm() / want.norm()).item()
        assert err < 1e-2, (message, err)
        assert (flags == message).all() and (consumed == message).all() and (counters == 0).all()
