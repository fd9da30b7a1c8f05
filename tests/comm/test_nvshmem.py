"""The nvshmem transport (disagmoe/comm/nvshmem.py).

On a CPU: every receive slot of every layout is found again from its messages' transport keys.
On GPUs (`gpu`, with nvshmem4py): two processes run a disaggregated schedule's programs for
three steps (both copies of every segment, then the first again) and an evaluation pass numbered
like step 0, every message arriving intact and in place; a message over its segment's capacity makes the sender raise and the receiver's
status word report it. Two GPUs if there are two; on one, both PEs share it (NVSHMEM supports
several processes per GPU), which tests the protocol but not NVLink.
"""

import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagmoe.comm.base import TensorSpec
from disagmoe.comm.nvshmem import SlotIndex, available
from disagmoe.comm.symmetric import ArenaOverflow, symmetric_layouts
from disagmoe.runtime.messages import MessageShapes, message_key
from disagmoe.runtime.roles import Layout
from disagmoe.runtime.schedule import Recv, Send
from disagmoe.runtime.topology import Topology

WORLD, STEPS, MICRO_BATCHES = 2, 3, 2
TOPOLOGY = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
SHAPES = MessageShapes(rows=2, seq_len=64, hidden=96, top_k=2, num_experts=8, dtype=torch.bfloat16,
                       shared_experts=False)


def _specs(payload, layer):
    return SHAPES.specs(payload, TOPOLOGY.is_moe(layer))


@pytest.mark.parametrize("topology", [TOPOLOGY, Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8),
                                      Topology.colocated_ranks(3, 2, 0, 8)], ids=["A1-E1", "A2-E2-p2", "colocated3"])
def test_every_slot_is_found_from_its_messages_keys(topology):
    programs = topology.programs(MICRO_BATCHES)
    layouts = symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, topology.is_moe(l)))
    for rank, (program, layout) in enumerate(zip(programs, layouts, strict=True)):
        index = SlotIndex(layout)
        for op in program:
            if isinstance(op, Recv):
                for peer in op.peers:
                    if peer != rank:
                        key = message_key(5, op.payload, op.layer, op.micro_batch)
                        assert index.slot(peer, key, rank) == (peer, op.payload, op.layer, op.micro_batch)
    recv = next(op for op in programs[0] if isinstance(op, Recv))
    with pytest.raises(ValueError, match="not in its program"):
        SlotIndex(layouts[0]).slot(recv.peers[0], message_key(0, recv.payload, recv.layer, 99), 0)


def _message(src: int, key, specs: list[TensorSpec]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(hash((src, tuple(key))) % (1 << 31))
    return [(torch.randn(spec.shape, generator=gen) * 30).to(spec.dtype) for spec in specs]


def _run_programs(rank: int, transport) -> list[str]:
    """Three training steps of the rank's program in order (sends, then waits on the GPU), then an
    evaluation pass (forward messages only) numbered step 0 again, as the worker numbers its
    evaluation batches: the transport's own sequence numbers keep it from passing on step 0's
    flags. Every message checked."""
    program = TOPOLOGY.programs(MICRO_BATCHES)[rank]
    wrong, pointers = [], {}
    passes = [(step, False) for step in range(STEPS)] + [(0, True)]
    for round_, (step, forward_only) in enumerate(passes):
        handles = []
        for op in program:
            if forward_only and isinstance(op, (Send, Recv)) and op.payload.backward:
                continue
            for peer in getattr(op, "peers", ()):
                if peer == rank:
                    continue
                key = message_key(step, op.payload, op.layer, op.micro_batch)
                specs = _specs(op.payload, op.layer)
                salt = message_key(round_, op.payload, op.layer, op.micro_batch)  # new contents every pass
                if isinstance(op, Send):
                    handles.append(transport.send(peer, key, [t.to(transport.device) for t in _message(rank, salt, specs)]))
                elif isinstance(op, Recv):
                    got = transport.recv(peer, key, specs)
                    want = _message(peer, salt, specs)
                    if not all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)):
                        wrong.append(f"pass {round_} {op.payload.value} L{op.layer} mb{op.micro_batch}")
                    pointers.setdefault((op.payload, op.layer, op.micro_batch), []).append(got[0].data_ptr())
        for handle in handles:
            handle.wait()
    torch.cuda.synchronize()
    for slot, seen in pointers.items():  # in place: copies alternate, the third message reuses the first's
        if not (seen[0] == seen[2] != seen[1]):
            wrong.append(f"{slot}: received at {seen}")
    if transport.status_word().tolist() != [0, 0]:
        wrong.append(f"status set without a failure: {transport.status_word().tolist()}")
    return wrong


def _overflow(rank: int, transport) -> str:
    """Segments holding half the rows: the sender raises, the receiver's status says so."""
    op = next(op for op in TOPOLOGY.programs(MICRO_BATCHES)[rank] if isinstance(op, (Send, Recv))
              and (op.payload.value, op.layer, op.micro_batch) == ("dispatch", 0, 0))
    key, specs, peer = message_key(0, op.payload, 0, 0), _specs(op.payload, 0), 1 - rank
    if isinstance(op, Send):
        try:
            transport.send(peer, key, [t.to(transport.device) for t in _message(rank, key, specs)])
        except ArenaOverflow as err:
            return f"sender: {err}"
        return "sender did not raise"
    try:
        transport.recv(peer, key, specs)
        return "receiver accepted more rows than its segment holds"
    except ArenaOverflow:
        pass  # refused on the host; the GPU wait below still learns it from the flag
    from disagmoe.kernels.signal import wait_flag

    seg = transport.layout.segment((peer, op.payload, 0, 0), 0)
    wait_flag(transport._flags_W, seg.flag, 1, transport.status_2)  # the sender set it to -1
    try:
        transport.check_status(transport.status_word().tolist())
    except ArenaOverflow as err:
        return f"receiver: {err}"
    return "receiver's status is clear"


def _rank_main(rank: int, port: int, capacity_factor: float | None, reports) -> None:
    import os

    os.environ.update({"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
                       "NVSHMEM_DISABLE_NVLS": "1"})  # one host, loopback bootstrap, no multicast
    report: dict = {}
    try:
        from disagmoe.comm.nvshmem import NvshmemTransport

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        layouts = symmetric_layouts(TOPOLOGY.programs(MICRO_BATCHES), _specs, capacity_factor=capacity_factor)
        transport = NvshmemTransport(layouts, default_timeout_s=30)
        report["said"] = _run_programs(rank, transport) if capacity_factor is None else _overflow(rank, transport)
        transport.close()
    except BaseException:
        report["error"] = traceback.format_exc()
    reports.put((rank, report))


def _spawn(ranks, capacity_factor: float | None) -> dict[int, dict]:
    port = ranks.free_port()
    got, _ = ranks.run(_rank_main, lambda rank, results: (rank, port, capacity_factor, results), WORLD,
                       timeout_s=180, join_s=20)
    for rank in range(WORLD):
        assert rank in got, f"rank {rank} reported nothing (hung?): {got}"
        assert "error" not in got[rank], got[rank]["error"]
    return got


needs_nvshmem = pytest.mark.skipif(not torch.cuda.is_available() or not available(),
                                   reason="needs a CUDA GPU and nvshmem4py")


@pytest.mark.gpu
@needs_nvshmem
def test_programs_exchange_every_message_intact_in_place(ranks):
    reports = _spawn(ranks, None)
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


@pytest.mark.gpu
@needs_nvshmem
def test_a_message_over_its_capacity_is_reported_on_both_sides(ranks):
    said = [r["said"] for r in _spawn(ranks, 0.5).values()]
    receiver, sender = sorted(said)
    tokens = SHAPES.tokens
    assert sender.startswith("sender: ") and f"has {tokens} rows but its receive segment holds {tokens // 2}" in sender
    assert receiver.startswith("receiver: ") and "transport_capacity_factor" in receiver, said
