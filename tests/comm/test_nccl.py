"""The NCCL transport between two GPUs: random messages received by their specs in send order,
large messages both ways without head-of-line deadlock, receive buffers reused across steps.
Needs two CUDA GPUs."""

import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagmoe.comm.base import TensorSpec
from disagmoe.wire import Direction, MessageKey

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORLD = 2
DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.bool]
KEYS = [
    MessageKey(step, mb, layer, d)
    for step in range(2) for mb in range(3) for layer in range(2) for d in Direction
]
BIG_ROWS = 16384  # x 4096 fp32 = 256 MiB per message, far beyond NCCL's buffers
SPEC_BIG = TensorSpec((BIG_ROWS, 4096), torch.float32)


def _message(src: int, dst: int, key: MessageKey) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * src + 100 * dst + 10 * key.step + key.micro_batch
                                        + 7919 * key.layer + 104729 * int(key.direction))
    tensors = []
    for _ in range(int(torch.randint(1, 5, (), generator=gen))):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (), generator=gen))]
        rows = int(torch.randint(0, 3, (), generator=gen)) * int(torch.randint(0, 40, (), generator=gen))
        trailing = torch.randint(1, 6, (int(torch.randint(0, 3, (), generator=gen)),), generator=gen)
        tensors.append((torch.randn((rows, *trailing.tolist()), generator=gen) * 50).to(dtype))
    return tensors


def _exchange(rank, transport) -> list[str]:
    peer = 1 - rank
    device = transport.device
    handles = [transport.send(peer, key, [t.to(device) for t in _message(rank, peer, key)]) for key in KEYS]
    wrong = []
    for key in KEYS:  # in send order: NCCL pairs are FIFO (the schedule receives in send order)
        want = _message(peer, rank, key)
        got = [t.cpu() for t in transport.recv(peer, key, [TensorSpec.of(t) for t in want])]
        same = all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))
        if len(got) != len(want) or not same:
            wrong.append(str(key))
    for handle in handles:
        handle.wait()
    return wrong


def _ping_pong(rank, transport) -> float:
    """Rank 0 sends two big messages before it receives the first reply: per-direction
    communicators keep rank 1's reply from queueing behind rank 0's second message."""
    device = transport.device
    keys = [MessageKey(9, mb, 0, Direction.FORWARD) for mb in range(2)]
    start = time.monotonic()
    if rank == 0:
        payloads = [torch.full((BIG_ROWS, 4096), float(mb), device=device) for mb in range(2)]
        handles = [transport.send(1, key, [x]) for key, x in zip(keys, payloads)]
        replies = [transport.recv(1, key, [SPEC_BIG])[0].clone() for key in keys]
        for handle in handles:
            handle.wait(timeout_s=60)
        assert [float(r[-1, -1]) for r in replies] == [2.0, 3.0]
    else:
        handles = []
        for key in keys:
            (x,) = transport.recv(0, key, [SPEC_BIG])
            handles.append(transport.send(0, key, [x + 2]))
        for handle in handles:
            handle.wait(timeout_s=60)
    return time.monotonic() - start


def _buffers_are_reused(rank, transport) -> bool:
    """The same slot in the next step receives into the same memory (no allocation)."""
    peer, spec = 1 - rank, TensorSpec((1000, 64), torch.bfloat16)
    pointers = []
    for step in range(2):
        key = MessageKey(20 + step, 0, 0, Direction.FORWARD)
        handle = transport.send(peer, key, [torch.full((1000, 64), float(step), device=transport.device,
                                                       dtype=torch.bfloat16)])
        (got,) = transport.recv(peer, key, [spec])
        handle.wait()
        pointers.append((got.data_ptr(), float(got[-1, -1])))
    return pointers[0][0] == pointers[1][0] and [v for _, v in pointers] == [0.0, 1.0]


def _rank_main(rank: int, port: int, reports, done) -> None:
    report: dict = {}
    try:
        from disagmoe.comm.nccl import NcclTransport

        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        transport = NcclTransport(default_timeout_s=30)
        report["exchange"] = _exchange(rank, transport)
        report["ping_pong_s"] = _ping_pong(rank, transport)
        report["reused"] = _buffers_are_reused(rank, transport)
    except BaseException:
        report["error"] = traceback.format_exc()
    reports.put((rank, report))
    done.wait()
    import os

    os._exit(0)  # skip NCCL teardown


@pytest.fixture(scope="module")
def reports(ranks):
    port, done = ranks.free_port(), ranks.ctx.Barrier(WORLD)
    got, _ = ranks.run(_rank_main, lambda rank, results: (rank, port, results, done), WORLD, timeout_s=180)
    return got


def test_both_ranks_finished(reports):
    assert sorted(reports) == [0, 1]
    for rank in range(WORLD):
        assert "error" not in reports[rank], reports[rank]["error"]


def test_random_messages_arrive_intact_in_send_order(reports):
    for rank in range(WORLD):
        assert reports[rank]["exchange"] == []


def test_large_messages_both_ways_do_not_deadlock(reports):
    for rank in range(WORLD):
        assert reports[rank]["ping_pong_s"] < 60


def test_receive_buffers_are_reused_step_after_step(reports):
    for rank in range(WORLD):
        assert reports[rank]["reused"] is True
