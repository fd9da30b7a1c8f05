"""The one-sided sparse dispatch kernel (disagmoe/kernels/sparse_dispatch.py) against torch: each
destination's buffers hold exactly its picked tokens' rows, ids, weights and token index, in token
order, with the count and the flag raised; rows past the count untouched. Interpreter (fp32, CPU
tensors standing for the peers' symmetric buffers) and GPU (the same, plus a flag wait launched
on another stream before the dispatch, so it really waits)."""

from __future__ import annotations

import pytest
import torch

# (tokens, hidden, top_k, destinations, chunks, skew): ragged everything
CASES = [
    (37, 40, 2, 3, 2, False),
    (64, 16, 4, 2, 4, False),
    (5, 24, 3, 4, 3, False),  # fewer tokens than a block, more chunks than blocks
    (100, 8, 2, 3, 4, True),  # skewed: every token to destination 0, destination 2 empty
    (0, 16, 2, 2, 2, False),  # no tokens at all: counts 0, flags raised
    (70, 33, 1, 1, 1, False),  # one destination, one chunk
]


def _routing(tokens, top_k, dests, skew, gen):
    """(picked_QT bool, ids_QTK int32: each pair's local id on q or L = 4 (elsewhere))."""
    if skew:
        owner_TK = torch.zeros(tokens, top_k, dtype=torch.long)
        owner_TK[: tokens // 2, 1:] = 1
    else:
        owner_TK = torch.randint(0, dests, (tokens, top_k), generator=gen)
    local_TK = torch.randint(0, 4, (tokens, top_k), generator=gen)
    ids_QTK = torch.stack([torch.where(owner_TK == q, local_TK, 4) for q in range(dests)]).to(torch.int32)
    return (ids_QTK < 4).any(2), ids_QTK


def _buffers(dests, tokens, hidden, top_k, device, dtype):
    """Stand-ins for each destination's symmetric receive buffers, NaN / -1 filled (to see what is written)."""
    make = lambda shape, d, fill: [torch.full(shape, fill, dtype=d, device=device) for _ in range(dests)]  # noqa: E731
    return {"rows": make((tokens, hidden), dtype, float("nan")), "ids": make((tokens, top_k), torch.int32, -1),
            "w": make((tokens, top_k), dtype, float("nan")), "index": make((tokens,), torch.int32, -1),
            "counts": make((1,), torch.int32, -1), "flags": make((1,), torch.int64, 0)}


def _dispatch(sd, case, messages, device, dtype, seed):
    tokens, hidden, top_k, dests, chunks, skew = case
    gen = torch.Generator().manual_seed(seed)
    bufs = _buffers(dests, tokens, hidden, top_k, device, dtype)
    tables = {name: sd.address_table(ts, device) for name, ts in bufs.items()}
    counters = torch.zeros(dests, dtype=torch.int32, device=device)
    for n in range(1, messages + 1):
        picked, ids = _routing(tokens, top_k, dests, skew, gen)
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        w = torch.rand(tokens, top_k, generator=gen).to(device, dtype)
        sd.dispatch_rows(x, picked.to(device), ids_QTK=ids.to(device), w_TK=w, counters_Q=counters,
                         chunks=chunks, **tables)
        yield n, bufs, sd.dispatch_reference(x.cpu(), picked, ids, w.cpu()), counters


@pytest.fixture
def sd(interpreted):
    return interpreted("disagmoe.kernels.sparse_dispatch")


def _check(messages, bufs, want, counters):
    """Every destination's buffers hold the reference's message and its flag counts `messages`."""
    for q, msg in enumerate(want):
        n = int(msg["count"])
        assert bufs["counts"][q].cpu().tolist() == [n]
        assert bufs["flags"][q].cpu().tolist() == [messages]
        assert torch.equal(bufs["rows"][q][:n].cpu(), msg["rows"])
        assert torch.equal(bufs["ids"][q][:n].cpu(), msg["ids"])
        assert torch.equal(bufs["w"][q][:n].cpu(), msg["w"])
        assert torch.equal(bufs["index"][q][:n].cpu(), msg["index"])
    assert (counters == 0).all(), "the counters are zero again after the launch"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_destination_gets_exactly_its_tokens(sd, case):
    for messages, bufs, want, counters in _dispatch(sd, CASES[case], 1, "cpu", torch.float32, seed=case):
        _check(messages, bufs, want, counters)
        for q, msg in enumerate(want):  # rows past the count are never written: only routed rows move
            n = int(msg["count"])
            assert torch.isnan(bufs["rows"][q][n:]).all() and (bufs["index"][q][n:] == -1).all()


def test_skewed_routing_leaves_a_destination_empty_but_raised(sd):
    for messages, bufs, want, _ in _dispatch(sd, CASES[3], 1, "cpu", torch.float32, seed=3):
        assert [int(m["count"]) for m in want] == [100, 50, 0]
        assert bufs["counts"][2].tolist() == [0] and bufs["flags"][2].tolist() == [messages]


def test_a_second_message_overwrites_the_first_and_is_counted(sd):
    """Message 2 of the slot (fresh routing) lands over message 1: counts are message 2's, the
    flags count two messages."""
    results = list(_dispatch(sd, CASES[0], 2, "cpu", torch.float32, seed=7))
    messages, bufs, want, counters = results[-1]
    assert messages == 2
    _check(messages, bufs, want, counters)


# (sources, tokens, hidden, top_k, blocks, chunks): ragged counts, empty sources, a colocated rank's block left out
RETURN_CASES = [
    (1, 45, 24, 3, None, 3),
    (3, 37, 40, 2, None, 2),
    (4, 5, 16, 4, [0, 2, 3], 4),  # fewer tokens than a block; block 1 (this rank's own) not returned
    (2, 64, 8, 1, [1], 1),
    (3, 0, 16, 2, None, 2),  # no tokens at all: counts 0, flags raised
]


def _counted_grids(sd, monkeypatch) -> list:
    """The grid of every launch of the interpreted kernel `sd._dispatch_rows_kernel` from now on."""
    launches = []
    real = sd._dispatch_rows_kernel

    class Counting:  # the launches of the kernel, by grid
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(sd, "_dispatch_rows_kernel", Counting())
    return launches


def _ragged_counts(S: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [S, 1] random counts of up to T rows, block 1 empty and block 2 full where there are."""
    count_S1 = torch.randint(0, T + 1, (S, 1), generator=gen, dtype=torch.int32)
    if S > 1:
        count_S1[1] = 0  # an empty source
    if S > 2:
        count_S1[2] = T  # a full one
    return count_S1


@pytest.mark.parametrize("case", range(len(RETURN_CASES)))
def test_the_backward_returns_each_sources_first_count_rows_in_one_launch(sd, monkeypatch, case):
    """d x and d w of the rows each source sent go back to it in received order, only count rows,
    every source in one launch (against `return_reference`); a second message is counted too."""
    S, T, H, K, blocks, chunks = RETURN_CASES[case]
    gen = torch.Generator().manual_seed(20 + case)
    Q = S if blocks is None else len(blocks)
    rows = [torch.full((T, H), float("nan")) for _ in range(Q)]
    weights = [torch.full((T, K), float("nan")) for _ in range(Q)]
    counts = [torch.full((1,), -1, dtype=torch.int32) for _ in range(Q)]
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(Q)]
    tables = dict(rows=sd.address_table(rows, "cpu"), w=sd.address_table(weights, "cpu"),
                  counts=sd.address_table(counts, "cpu"), flags=sd.address_table(flags, "cpu"))
    counters = torch.zeros(Q, dtype=torch.int32)
    launches = _counted_grids(sd, monkeypatch)
    for messages in (1, 2):
        dx, dw = torch.randn(S, T, H, generator=gen), torch.randn(S, T, K, generator=gen)
        count_S1 = _ragged_counts(S, T, gen)
        sd.return_rows(dx, count_S1, dw_STK=dw, counters_Q=counters, blocks=blocks, chunks=chunks, **tables)
        for q, msg in enumerate(sd.return_reference(dx, count_S1, dw, blocks)):
            n = int(msg["count"])
            assert counts[q].tolist() == [n] and flags[q].tolist() == [messages]
            assert torch.equal(rows[q][:n], msg["rows"]) and torch.equal(weights[q][:n], msg["w"])
            if messages == 1:  # rows past the count are never written
                assert torch.isnan(rows[q][n:]).all() and torch.isnan(weights[q][n:]).all()
        assert (counters == 0).all(), "the counters are zero again after the launch"
    assert len(launches) == 2 and all(grid[0] == Q for grid in launches), "one launch per message, every source"


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rows_alone_land_as_the_reference(sd, case):
    """A sparse pair-row layer's COMBINE_GRAD (no ids, weights or index: `NvshmemTransport.send_sparse`
    without them) and its DISPATCH_GRAD (`return_rows` without d w): only the picked / first count
    rows are written, with the count and the flag; ragged, empty and skewed destinations."""
    tokens, hidden, top_k, dests, chunks, skew = CASES[case]
    gen = torch.Generator().manual_seed(40 + case)
    picked, _ = _routing(tokens, top_k, dests, skew, gen)
    dy = torch.randn(tokens, hidden, generator=gen)
    bufs = _buffers(dests, tokens, hidden, top_k, "cpu", torch.float32)
    landing = {name: sd.address_table(bufs[name], "cpu") for name in ("rows", "counts", "flags")}
    counters = torch.zeros(dests, dtype=torch.int32)
    sd.dispatch_rows(dy, picked, counters_Q=counters, chunks=chunks, **landing)
    for q, msg in enumerate(sd.dispatch_reference(dy, picked)):
        n = int(msg["count"])
        assert bufs["counts"][q].tolist() == [n] and bufs["flags"][q].tolist() == [1]
        assert torch.equal(bufs["rows"][q][:n], msg["rows"]) and torch.isnan(bufs["rows"][q][n:]).all()
    assert (counters == 0).all()

    dx = torch.randn(dests, tokens, hidden, generator=gen)  # one block per source, the counts just delivered
    count_S1 = torch.cat([b for b in bufs["counts"]]).view(dests, 1)
    back = _buffers(dests, tokens, hidden, top_k, "cpu", torch.float32)
    sd.return_rows(dx, count_S1, counters_Q=counters, chunks=chunks,
                   **{name: sd.address_table(back[name], "cpu") for name in ("rows", "counts", "flags")})
    for q, msg in enumerate(sd.return_reference(dx, count_S1)):
        n = int(msg["count"])
        assert back["counts"][q].tolist() == [n] and back["flags"][q].tolist() == [1]
        assert torch.equal(back["rows"][q][:n], msg["rows"]) and torch.isnan(back["rows"][q][n:]).all()
    assert (counters == 0).all()


@pytest.mark.parametrize("case", range(len(RETURN_CASES)))
def test_partial_sums_return_with_their_token_index_in_one_launch(sd, monkeypatch, case):
    """Sparse dispatch's COMBINE with partial sums (`return_rows` with the token index): each
    destination gets the first count rows of its block's partial sums and of its int32 index, the
    count and the flag, every source in one launch; ragged, empty and full counts, nothing past the
    count written."""
    S, T, H, K, blocks, chunks = RETURN_CASES[case]
    gen = torch.Generator().manual_seed(60 + case)
    Q = S if blocks is None else len(blocks)
    rows = [torch.full((T, H), float("nan")) for _ in range(Q)]
    index = [torch.full((T,), -7, dtype=torch.int32) for _ in range(Q)]
    counts = [torch.full((1,), -1, dtype=torch.int32) for _ in range(Q)]
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(Q)]
    tables = dict(rows=sd.address_table(rows, "cpu"), index=sd.address_table(index, "cpu"),
                  counts=sd.address_table(counts, "cpu"), flags=sd.address_table(flags, "cpu"))
    counters = torch.zeros(Q, dtype=torch.int32)
    partial_STH = torch.randn(S, T, H, generator=gen)
    index_ST = torch.stack([torch.randperm(T, generator=gen) for _ in range(S)]).to(torch.int32)
    count_S1 = _ragged_counts(S, T, gen)
    launches = _counted_grids(sd, monkeypatch)
    sd.return_rows(partial_STH, count_S1, index_ST=index_ST, counters_Q=counters, blocks=blocks, chunks=chunks,
                   **tables)
    assert len(launches) == 1 and launches[0][0] == Q, "one launch for every destination"
    for q, msg in enumerate(sd.return_reference(partial_STH, count_S1, blocks=blocks, index_ST=index_ST)):
        n = int(msg["count"])
        assert counts[q].tolist() == [n] and flags[q].tolist() == [1]
        assert torch.equal(rows[q][:n], msg["rows"]) and torch.equal(index[q][:n], msg["index"])
        assert torch.isnan(rows[q][n:]).all() and (index[q][n:] == -7).all(), "nothing past the count"
    assert (counters == 0).all()


def test_user_errors_name_the_fix(sd):
    x = torch.zeros(4, 8)
    table = torch.zeros(2, dtype=torch.int64)
    counters = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="picked must be"):
        sd.dispatch_rows(x, torch.zeros(2, 5, dtype=torch.bool), rows=table, counts=table, flags=table,
                         counters_Q=counters)
    with pytest.raises(ValueError, match="address table"):
        sd.dispatch_rows(x, torch.zeros(2, 4, dtype=torch.bool), rows=table[:1], counts=table, flags=table,
                         counters_Q=counters)
    with pytest.raises(ValueError, match="one per source block"):
        sd.return_rows(torch.zeros(2, 4, 8), torch.zeros(3, 1, dtype=torch.int32), rows=table, counts=table,
                       flags=table, counters_Q=counters)
    with pytest.raises(ValueError, match="must index the 2 source blocks"):
        sd.return_rows(torch.zeros(2, 4, 8), torch.zeros(2, 1, dtype=torch.int32), rows=table, counts=table,
                       flags=table, counters_Q=counters, blocks=[0, 2])
    with pytest.raises(ValueError, match="token index must be int32"):
        sd.return_rows(torch.zeros(2, 4, 8), torch.zeros(2, 1, dtype=torch.int32), rows=table, counts=table,
                       flags=table, counters_Q=counters, index_ST=torch.zeros(2, 4), index=table)
    with pytest.raises(ValueError, match="come with their destination tables"):
        sd.return_rows(torch.zeros(2, 4, 8), torch.zeros(2, 1, dtype=torch.int32), rows=table, counts=table,
                       flags=table, counters_Q=counters, index_ST=torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="come with their destination tables"):
        sd.dispatch_rows(x, torch.zeros(2, 4, dtype=torch.bool), rows=table, counts=table, flags=table,
                         counters_Q=counters, w_TK=torch.zeros(4, 2))


def test_the_kernel_message_matches_the_send_recv_message(sd):
    """The kernel's destination q gets what `runtime.stages.sparse_dispatch.dispatch_messages` puts
    in the first `count` rows of q's send/recv message (the nccl/local path): the same bytes."""
    from disagmoe.runtime.stages.sparse_dispatch import dispatch_messages

    gen = torch.Generator().manual_seed(5)
    T, H, K, Q, L = 29, 12, 2, 3, 4
    picked, ids = _routing(T, K, Q, False, gen)
    x, w = torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen)
    messages, _, _ = dispatch_messages(x, ids, torch.full((Q,), L, dtype=torch.int32), w, torch.zeros(8))
    bufs = _buffers(Q, T, H, K, "cpu", torch.float32)
    sd.dispatch_rows(x, picked, ids_QTK=ids, w_TK=w, counters_Q=torch.zeros(Q, dtype=torch.int32),
                     **{name: sd.address_table(ts, "cpu") for name, ts in bufs.items()})
    for q, (rows, sent, w_q, index, count, _) in enumerate(messages):
        n = int(count)
        assert bufs["counts"][q].tolist() == [n]
        assert torch.equal(bufs["rows"][q][:n], rows[:n]) and torch.equal(bufs["ids"][q][:n], sent[:n])
        assert torch.equal(bufs["w"][q][:n], w_q[:n]) and torch.equal(bufs["index"][q][:n], index[:n])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_rows_land_and_a_waiting_reader_sees_them(case):
    """Compiled, bf16: a flag wait queued first on another stream ends when the dispatch raises
    the flag, and the buffers then hold the reference's rows."""
    from disagmoe.kernels import signal
    from disagmoe.kernels import sparse_dispatch as sd

    tokens, hidden, top_k, dests, chunks, skew = CASES[case]
    gen = torch.Generator().manual_seed(case)
    device = torch.device("cuda")
    bufs = _buffers(dests, tokens, hidden, top_k, device, torch.bfloat16)
    flags_Q = torch.zeros(dests, dtype=torch.int64, device=device)  # one arena-like flag region
    consumed_Q = torch.ones_like(flags_Q)  # the warm-up's message, taken without a wait
    bufs["flags"] = [flags_Q[q:q + 1] for q in range(dests)]
    tables = {name: sd.address_table(ts, device) for name, ts in bufs.items()}
    counters = torch.zeros(dests, dtype=torch.int32, device=device)

    def inputs():
        picked, ids = _routing(tokens, top_k, dests, skew, gen)
        x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
        w = torch.rand(tokens, top_k, generator=gen).to(device, torch.bfloat16)
        return x, picked.to(device), ids.to(device), w

    def dispatch(x, picked, ids, w):
        sd.dispatch_rows(x, picked, ids_QTK=ids, w_TK=w, counters_Q=counters, chunks=chunks, **tables)
        return sd.dispatch_reference(x.cpu(), picked.cpu(), ids.cpu(), w.cpu())

    dispatch(*inputs())  # compiled and loaded before any wait spins (a first launch would queue behind it)
    second = inputs()  # on the device before the waits: no host copy (pageable: it may block) while they spin
    torch.cuda.synchronize()
    status = signal.new_status(device)
    waiter = torch.cuda.Stream()
    with torch.cuda.stream(waiter):
        for q in range(dests):
            signal.wait_flag(flags_Q, consumed_Q, q, status, timeout_s=30.0)
    sd.dispatch_rows(second[0], second[1], ids_QTK=second[2], w_TK=second[3], counters_Q=counters, chunks=chunks,
                     **tables)
    waiter.synchronize()
    want = sd.dispatch_reference(*(t.cpu() for t in second))
    torch.cuda.synchronize()
    assert status.tolist() == [0, 0], "every wait saw its flag"
    assert (consumed_Q == 2).all()
    _check(2, bufs, want, counters)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("column", ["dw", "index"], ids=["d-x-d-w", "partial-sums-index"])
@pytest.mark.parametrize("case", range(len(RETURN_CASES)))
def test_gpu_the_backward_returns_every_source_in_one_launch(case, column):
    """Compiled, bf16: flag waits queued first on another stream end when the one return launch
    raises every source's flag, and each source's buffers then hold its first count rows: d x
    and d w (DISPATCH_GRAD), or partial sums and their int32 token index (COMBINE)."""
    from disagmoe.kernels import signal
    from disagmoe.kernels import sparse_dispatch as sd

    S, T, H, K, blocks, chunks = RETURN_CASES[case]
    Q = S if blocks is None else len(blocks)
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(30 + case)
    index = column == "index"
    rows = [torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(Q)]
    cols = [torch.full((T,), -7, dtype=torch.int32, device=device) if index else
            torch.full((T, K), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(Q)]
    counts = torch.full((Q,), -1, dtype=torch.int32, device=device)
    flags_Q = torch.zeros(Q, dtype=torch.int64, device=device)
    consumed_Q = torch.ones_like(flags_Q)  # the warm-up's message, taken without a wait
    tables = {"rows": sd.address_table(rows, device), column if index else "w": sd.address_table(cols, device),
              "counts": sd.address_table([counts[q:q + 1] for q in range(Q)], device),
              "flags": sd.address_table([flags_Q[q:q + 1] for q in range(Q)], device)}
    counters = torch.zeros(Q, dtype=torch.int32, device=device)

    def inputs():
        dx = torch.randn(S, T, H, generator=gen).to(device, torch.bfloat16)
        col = (torch.stack([torch.randperm(T, generator=gen) for _ in range(S)]).to(device, torch.int32) if index
               else torch.randn(S, T, K, generator=gen).to(device, torch.bfloat16))
        return dx, torch.randint(0, T + 1, (S, 1), generator=gen, dtype=torch.int32).to(device), col

    def launch(dx, count_S1, col):
        sd.return_rows(dx, count_S1, counters_Q=counters, blocks=blocks, chunks=chunks,
                       **{"index_ST" if index else "dw_STK": col}, **tables)

    launch(*inputs())  # compiled and loaded before any wait spins
    second = inputs()  # on the device before the waits: no host copy (pageable: it may block) while they spin
    torch.cuda.synchronize()
    status = signal.new_status(device)
    waiter = torch.cuda.Stream()
    with torch.cuda.stream(waiter):
        for q in range(Q):
            signal.wait_flag(flags_Q, consumed_Q, q, status, timeout_s=30.0)
    launch(*second)
    waiter.synchronize()
    dx, count_S1, col = (t.cpu() for t in second)
    want = (sd.return_reference(dx, count_S1, blocks=blocks, index_ST=col) if index
            else sd.return_reference(dx, count_S1, col, blocks))
    torch.cuda.synchronize()
    assert status.tolist() == [0, 0], "every wait saw its flag"
    for q, msg in enumerate(want):
        n = int(msg["count"])
        assert int(counts[q]) == n and int(flags_Q[q]) == int(consumed_Q[q]) == 2
        assert torch.equal(rows[q][:n].cpu(), msg["rows"])
        assert torch.equal(cols[q][:n].cpu(), msg["index" if index else "w"])
    assert (counters == 0).all()


@pytest.mark.parametrize("pair_rows", [False, True], ids=["partial-sums", "pair-rows"])
def test_warm_up_runs_a_run_s_variants_on_scratch(sd, monkeypatch, pair_rows):
    """The set-up launch (the worker's, before any step) runs on scratch buffers: the dispatch, the
    rows-alone dispatch (COMBINE_GRAD), and the return with d w and the return of the partial sums
    with their int32 token index (COMBINE), or with pair rows the return of d x alone."""
    seen = []
    real = sd.dispatch_rows

    def launch(*a, **kw):  # (ids?, the one-column payload's dtype or None)
        seen.append((kw.get("ids") is not None, None if kw.get("w_TK") is None else kw["w_TK"].dtype))
        return real(*a, **kw)

    monkeypatch.setattr(sd, "dispatch_rows", launch)
    sd.warm_up(40, 24, 2, torch.float32, torch.float32, torch.float32, None if pair_rows else torch.float32, "cpu",
               sources=3)
    dispatch, rows_alone = (True, torch.float32), (False, None)
    assert seen == ([dispatch, rows_alone, rows_alone] if pair_rows
                    else [dispatch, rows_alone, (False, torch.float32), (False, torch.int32)])
