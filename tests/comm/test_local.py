"""The gloo transport between real processes: random messages, out-of-order keys, failures.

Starting processes that import torch is the slow part, so one module fixture runs every
scenario in the same three ranks (in phases) and the tests check what each rank reported.
"""

import os
import random
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagmoe.comm.base import PeerFailure, TensorSpec, TransportError
from disagmoe.wire import Direction, MessageKey
from disagmoe.comm.local import LocalTransport

WORLD = 3
DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool]
KEYS = [
    MessageKey(step, mb, layer, direction)
    for step in range(2) for mb in range(3) for layer in range(2) for direction in Direction
]
TIMEOUT_S = 1.0
DEATH_EXIT_CODE = 3
TWO = TensorSpec((2,), torch.float32)


def _message(src: int, dst: int, key: MessageKey) -> list[torch.Tensor]:
    """The tensors `src` sends `dst` under `key`: seeded, so the receiver can rebuild them."""
    gen = torch.Generator().manual_seed(1000 * src + 100 * dst + 10 * key.step + key.micro_batch
                                        + 7919 * key.layer + 104729 * int(key.direction))
    tensors = []
    for _ in range(int(torch.randint(1, 5, (), generator=gen))):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (), generator=gen))]
        rows = int(torch.randint(0, 3, (), generator=gen)) * int(torch.randint(0, 40, (), generator=gen))
        trailing = torch.randint(1, 6, (int(torch.randint(0, 3, (), generator=gen)),), generator=gen)
        tensors.append((torch.randn((rows, *trailing.tolist()), generator=gen) * 50).to(dtype))
    return tensors


def _failure(err: TransportError, start: float) -> dict:
    return dict(type=type(err).__name__, peer=err.peer, key=err.key, text=str(err),
                elapsed=time.monotonic() - start)


def _exchange(rank: int, transport: LocalTransport) -> list[str]:
    """Send every key to every peer, receive in a shuffled order; return mismatches."""
    peers = [p for p in range(WORLD) if p != rank]
    handles = [transport.send(dst, key, _message(rank, dst, key)) for key in KEYS for dst in peers]
    order = list(KEYS)
    random.Random(rank).shuffle(order)
    wrong = []
    for key in order:
        for src in peers:
            want = _message(src, rank, key)
            got = transport.recv(src, key, [TensorSpec.of(t) for t in want])
            if len(got) != len(want) or not all(
                g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want)
            ):
                wrong.append(f"{src}->{rank} {key}")
    for handle in handles:
        handle.wait()
        if not handle.is_completed():
            wrong.append(f"send handle {rank} not completed after wait")
    return wrong


def _peer_death(rank: int, transport: LocalTransport, report: dict, reports) -> dict:
    """Rank 0 delivers one message to rank 2, then dies; rank 2 waits for a second one."""
    first, second = MessageKey(5, 0, 0, Direction.FORWARD), MessageKey(5, 1, 0, Direction.FORWARD)
    if rank == 0:
        transport.send(2, first, [torch.zeros(2)]).wait()
        reports.put((rank, report))
        reports.close()
        reports.join_thread()  # our report is out before we die
        os._exit(DEATH_EXIT_CODE)
    if rank == 2:
        transport.recv(0, first, [TWO])
        start = time.monotonic()
        try:
            transport.recv(0, second, [TWO], timeout_s=20.0)
        except TransportError as err:
            return _failure(err, start)
    return {}


def _timeout(rank: int, transport: LocalTransport) -> dict:
    """Rank 1 waits for a key that rank 2 (alive, idle) never sends.

    This runs last: a gloo timeout closes every connection of the rank that timed out.
    """
    start = time.monotonic()
    try:
        if rank == 1:
            transport.recv(2, MessageKey(0, 1, 2, Direction.FORWARD), [TWO], timeout_s=TIMEOUT_S)
    except TransportError as err:
        return _failure(err, start)
    return {}


def _rank_main(rank: int, port: int, reports, survivors) -> None:
    report: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=30))
        transport = LocalTransport(default_timeout_s=30)
        report["exchange"] = _exchange(rank, transport)
        dist.barrier()
        report["death"] = _peer_death(rank, transport, report, reports)
        survivors.wait()
        report["timeout"] = _timeout(rank, transport)
        survivors.wait()
    except BaseException:
        report["error"] = traceback.format_exc()
    reports.put((rank, report))


@pytest.fixture(scope="module")
def reports(ranks) -> dict[int, dict]:
    port, survivors = ranks.free_port(), ranks.ctx.Barrier(WORLD - 1)
    got, procs = ranks.run(_rank_main, lambda rank, results: (rank, port, results, survivors), WORLD,
                           timeout_s=90, join_s=5)
    got["exit_codes"] = [proc.exitcode for proc in procs]
    return got


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_all_ranks_ran_every_phase(reports):
    assert sorted(k for k in reports if isinstance(k, int)) == list(range(WORLD))
    for rank in range(WORLD):
        assert "error" not in reports[rank], reports[rank]["error"]
    assert reports["exit_codes"][0] == DEATH_EXIT_CODE


def test_random_messages_arrive_intact_in_any_key_order(reports):
    assert any(t.shape[0] == 0 for key in KEYS for t in _message(0, 1, key)), "want zero-row tensors"
    assert any(t.numel() == 0 for key in KEYS for t in _message(0, 1, key) if t.dim() == 1)
    for rank in range(WORLD):
        assert reports[rank]["exchange"] == []


def test_recv_of_a_message_never_sent_times_out_naming_the_peer(reports):
    failure = reports[1]["timeout"]
    assert failure["type"] == "TransportTimeout"
    assert failure["peer"] == 2 and failure["key"] == MessageKey(0, 1, 2, Direction.FORWARD)
    assert "rank 2" in failure["text"]
    assert TIMEOUT_S <= failure["elapsed"] < TIMEOUT_S + 2.0


def test_dead_peer_is_reported_well_before_the_timeout(reports):
    failure = reports[2]["death"]
    assert failure["type"] == PeerFailure.__name__ and failure["peer"] == 0
    assert "rank 0 failed" in failure["text"]
    assert failure["elapsed"] < 10.0


@pytest.mark.parametrize("left_s, want_ms", [(0.99995, 1000), (1.0, 1000), (0.0012, 2), (-0.5, 1)])
def test_gloo_gets_the_time_left_rounded_up_to_whole_milliseconds(monkeypatch, left_s, want_ms):
    """gloo truncates a wait's timeout to whole milliseconds: the time left to the deadline is rounded
    up (at least 1 ms), so a receive never times out before its deadline."""
    from disagmoe.comm import local

    asked = []

    class Work:
        def wait(self, timeout):
            asked.append(timeout)

    monkeypatch.setattr(local.time, "monotonic", lambda: 100.0)
    local._wait(Work(), 1, MessageKey(0, 1, 2, Direction.FORWARD), 100.0 + left_s, 1.0, "receive from")
    assert asked == [timedelta(milliseconds=want_ms)]
