"""The nvshmem transport (disagmoe/comm/nvshmem.py).

On a CPU: every receive slot of every layout is found again from its messages' transport keys;
pair-row messages (hop mode pair_rows) through transports whose arenas and peer views are CPU
tensors (the bookkeeping, views and message counts are the real code's; a fake `nv` records
its calls and copies a put's bytes between the CPU arenas): every source's rows land in the
receiver's region, the first source's extras too (one put per extra into the receiver's arena,
then one quiet, on the current stream; a copy into its own arena; nothing from the other
sources), copies alternate, a wrong source, spec, extra or key is refused naming the fix, and a
timed-out pair flag is named by layer, micro-batch, source and segment.
On CPU also, segments shared by the keys of a pool (rings, `reuse_order.one_sided_slots`): every
rank's passes co-simulated with each sender running ahead as far as the schedule lets it, every
message intact until its reader is done; a reader does not pass on an earlier key's flag; fewer
symmetric bytes.
On GPUs (`gpu`, with nvshmem4py): two processes run a disaggregated schedule's programs for
three steps (both copies of every segment, then the first again) and an evaluation pass numbered
like step 0, every message arriving intact and in place (and again through shared rings); a message over its segment's capacity makes the sender raise and the receiver's
status word report it; pair-row messages written through `pair_target`'s views (the expert
rank's fused down GEMM into the peer's arena, or colocated plain stores into both arenas) are
summed by the receiver's `combine_landed` over `pair_landing`, which also gives the int64 extra
the first source put (the other sources pass a decoy). Two GPUs if there are two; on
one, both PEs share it (NVSHMEM supports several processes per GPU), which tests the protocol
but not NVLink.
"""

import ctypes
import dataclasses
import functools
import re
import sys
import traceback
from datetime import timedelta
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from disagmoe.comm.base import PairSpec, TensorSpec, Transport, TransportTimeout
from disagmoe.comm.counts import counts_between
from disagmoe.comm.nvshmem import NvshmemTransport, SlotIndex, available, pair_destinations
from disagmoe.comm.symmetric import symmetric_layouts
from disagmoe.wire import ArenaOverflow, message_key, Payload, Recv, Send
from disagmoe.kernels.signal import OVERFLOW, TIMED_OUT
from disagmoe.runtime.stages.messages import MessageShapes
from disagmoe.runtime.schedule.reuse_order import live_ends, one_sided_slots, pass_program
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import OptimizerStep
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


def _run_programs(rank: int, transport, shared: bool = False) -> list[str]:
    """Three training steps of the rank's program in order (sends, then waits on the GPU), then an
    evaluation pass (forward messages only) numbered step 0 again, as the worker numbers its
    evaluation batches: the transport's own counts (and the receiver's consumed words) keep it
    from passing on step 0's flags. Every message checked."""
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
        if shared and not forward_only:  # the step's all-reduce, which the rings are sized with
            torch.cuda.synchronize()
            dist.barrier()
    torch.cuda.synchronize()
    for slot, seen in pointers.items():  # in place: copies alternate, the third message reuses the first's
        if not shared and not (seen[0] == seen[2] != seen[1]):
            wrong.append(f"{slot}: received at {seen}")
    held: dict[int, set] = {}  # address -> the keys received there
    for slot, seen in pointers.items():
        for ptr in seen:
            held.setdefault(ptr, set()).add(slot)
    if shared and not any(len(keys) > 1 for keys in held.values()):  # rings: a segment serves several keys
        wrong.append(f"{len(pointers)} keys received at {len(held)} addresses, none at another key's: nothing shared")
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
    wait_flag(transport._flags_W, transport._consumed_W, seg.flag, transport.status_2)  # the sender set FAILED
    try:
        transport.check_status(transport.status_word().tolist())
    except ArenaOverflow as err:
        return f"receiver: {err}"
    return "receiver's status is clear"


def _sum_rounds(rank: int, transport) -> list[str]:
    """Five all-ranks sums (both copies, then again) queued without a host wait (the sync check
    raises on one), each read back afterwards: every rank gets the exact sum."""
    wrong, sums = [], []
    values = [torch.tensor([(r + 1) * 0.25 + i, 2.0 ** -(r + i)], dtype=torch.float64, device=transport.device)
              for i in range(5) for r in range(WORLD)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(5):
            sums.append(transport.all_sum(values[i * WORLD + rank]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i, got in enumerate(sums):
        want = sum(values[i * WORLD + r].cpu() for r in range(WORLD))
        if not torch.equal(got.cpu(), want):
            wrong.append(f"sum {i}: {got.tolist()} != {want.tolist()}")
    if transport.status_word().tolist() != [0, 0]:
        wrong.append(f"status set without a failure: {transport.status_word().tolist()}")
    return wrong


GRAPH_PAYLOAD = Payload.DISPATCH
GRAPH_KEY = message_key(0, GRAPH_PAYLOAD, 0, 0)  # the captured message: rank 0 -> rank 1, one slot
GRAPH_WARM, GRAPH_ROUNDS = 2, 9  # eager rounds first (every launch compiled and loaded), then the graphs


def _graphed_exchange(rank: int, transport) -> list[str]:
    """Rank 0 sends rank 1 one message per round and rank 1 copies it out, the same host calls
    every round: eagerly for GRAPH_WARM rounds, then from a CUDA graph per phase of the slot's
    count (`comm.counts`: its two copies, so two graphs), captured the first time a phase comes
    up (capture runs nothing: the graph is then replayed once) and replayed after `advance` in
    later rounds, new data in the sender's static inputs each time; the last round eager again
    (the host counts and the device's flags and consumed words still agree). Rank 1 checks
    every round's message."""
    specs, sender = _specs(GRAPH_PAYLOAD, 0), rank == 0
    static = [spec.empty(transport.device) for spec in specs]  # the sender's inputs, the receiver's outputs

    def body():
        if sender:
            transport.send(1, GRAPH_KEY, static)  # the handle is dropped: `static` outlives every replay
        else:
            for out, got in zip(static, transport.recv(0, GRAPH_KEY, specs), strict=True):
                out.copy_(got)

    wrong, graphs, replays = [], {}, 0
    for round_ in range(GRAPH_ROUNDS):
        want = _message(0, message_key(round_, GRAPH_PAYLOAD, 0, 0), specs)
        if sender:
            for tensor, value in zip(static, want, strict=True):
                tensor.copy_(value)
        phase, eager = transport.phase(), round_ < GRAPH_WARM or round_ == GRAPH_ROUNDS - 1
        if eager:
            body()
        elif phase in graphs:
            graph, step = graphs[phase]
            transport.advance(step)
            graph.replay()
            replays += 1
        else:
            torch.cuda.synchronize()
            before, graph = transport.message_counts(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graphs[phase] = graph, counts_between(before, transport.message_counts())
            graph.replay()
        torch.cuda.synchronize()
        if not sender and not all(torch.equal(g.cpu(), w) for g, w in zip(static, want, strict=True)):
            wrong.append(f"round {round_} ({'eager' if eager else 'graph'}): the message arrived wrong")
        dist.barrier()  # the receiver is done with the message before the sender writes the next
    if len(graphs) != 2 or replays != GRAPH_ROUNDS - GRAPH_WARM - 1 - len(graphs):
        wrong.append(f"{len(graphs)} graphs, {replays} replays after their captures")
    if transport.status_word().tolist() != [0, 0]:
        wrong.append(f"status set without a failure: {transport.status_word().tolist()}")
    return wrong


def _rank_main(rank: int, port: int, mode: str, reports) -> None:
    import os

    os.environ.update({"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
                       "NVSHMEM_DISABLE_NVLS": "1"})  # one host, loopback bootstrap, no multicast
    report: dict = {}
    try:
        from disagmoe.comm.nvshmem import NvshmemTransport

        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=120))
        if mode == "sums":
            layouts = symmetric_layouts(TOPOLOGY.programs(MICRO_BATCHES), _specs, sum_width=2)
            transport = NvshmemTransport(layouts, default_timeout_s=30)
            report["said"] = _sum_rounds(rank, transport)
        elif mode == "graphs":
            transport = NvshmemTransport(symmetric_layouts(TOPOLOGY.programs(MICRO_BATCHES), _specs),
                                         default_timeout_s=30)
            report["said"] = _graphed_exchange(rank, transport)
        elif mode in PAIR_MODES:
            topology, kernel = PAIR_MODES[mode]
            layouts = symmetric_layouts(topology.programs(MICRO_BATCHES), _specs_of(topology), pair_of=_pair_of)
            transport = NvshmemTransport(layouts, default_timeout_s=30)
            report["said"] = _exchange_pairs(rank, transport, topology, kernel)
        elif mode == "programs-shared":  # the rings the runtime builds (`receive_layouts`)
            programs = TOPOLOGY.programs(MICRO_BATCHES)
            rings = one_sided_slots(programs, TOPOLOGY.is_moe, TOPOLOGY.num_layers)
            transport = NvshmemTransport(symmetric_layouts(programs, _specs, shared=rings), default_timeout_s=30)
            report["said"] = _run_programs(rank, transport, shared=True)
        else:
            capacity_factor = 0.5 if mode == "overflow" else None
            layouts = symmetric_layouts(TOPOLOGY.programs(MICRO_BATCHES), _specs, capacity_factor=capacity_factor)
            transport = NvshmemTransport(layouts, default_timeout_s=30)
            report["said"] = _run_programs(rank, transport) if mode == "programs" else _overflow(rank, transport)
        transport.close()
    except BaseException:
        report["error"] = traceback.format_exc()
    reports.put((rank, report))


def _spawn(ranks, mode: str, timeout_s: float = 180) -> dict[int, dict]:
    port = ranks.free_port()
    got, _ = ranks.run(_rank_main, lambda rank, results: (rank, port, mode, results), WORLD,
                       timeout_s=timeout_s, join_s=20)
    for rank in range(WORLD):
        assert rank in got, f"rank {rank} reported nothing (hung?): {got}"
        assert "error" not in got[rank], got[rank]["error"]
    return got


needs_nvshmem = pytest.mark.skipif(not torch.cuda.is_available() or not available(),
                                   reason="needs a CUDA GPU and nvshmem4py")


@pytest.mark.gpu
@needs_nvshmem
def test_programs_exchange_every_message_intact_in_place(ranks):
    reports = _spawn(ranks, "programs")
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


@pytest.mark.gpu
@needs_nvshmem
def test_programs_exchange_every_message_intact_through_shared_rings(ranks):
    """The same passes with the keys of a pool sharing a ring (`reuse_order.one_sided_slots`):
    flags carry the ring's count, waits pass on >= it, every message intact."""
    reports = _spawn(ranks, "programs-shared")
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


@pytest.mark.gpu
@needs_nvshmem
def test_all_ranks_sums_run_on_the_stream_and_agree(ranks):
    reports = _spawn(ranks, "sums")
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


@pytest.mark.gpu
@needs_nvshmem
def test_a_send_and_its_receive_captured_in_cuda_graphs_replay_with_new_data(ranks):
    """The one-sided protocol under CUDA graphs (`_graphed_exchange`): a graph per phase of the
    slot's count, each replayed with new data, every message intact, eager messages before and
    after still agreeing with the graphs' counts."""
    reports = _spawn(ranks, "graphs")
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


@pytest.mark.gpu
@needs_nvshmem
def test_a_message_over_its_capacity_is_reported_on_both_sides(ranks):
    said = [r["said"] for r in _spawn(ranks, "overflow").values()]
    receiver, sender = sorted(said)
    tokens = SHAPES.tokens
    assert sender.startswith("sender: ") and f"has {tokens} rows but its receive segment holds {tokens // 2}" in sender
    assert receiver.startswith("receiver: ") and "transport_capacity_factor" in receiver, said


# --- pair-row messages (hop mode pair_rows) ---------------------------------------------------------

SEG_TOKENS = 32  # tokens per segment of a pair-row message
SEGMENTS = -(-SHAPES.tokens // SEG_TOKENS)
FFN = 64  # the experts' FFN size in the fused-kernel exchange
WARM_ROUNDS, ROUNDS = 3, 5  # messages per slot written before any combine starts, and in all
COLOCATED = Topology.colocated_ranks(2, 2, 0, 8)  # COMBINE from both ranks to both: Q = 2, self included


def _specs_of(topology):
    return lambda payload, layer: SHAPES.specs(payload, topology.is_moe(layer))


EXTRAS = (TensorSpec((SHAPES.num_experts,), torch.int64),)  # the first source's expert load [E]


def _pair_of(payload, layer):
    """COMBINE travels as pair rows [T K, H] in SEGMENTS segments with EXTRAS, everything else as
    segments."""
    if payload is not Payload.COMBINE:
        return None
    return TensorSpec((SHAPES.tokens * SHAPES.top_k, SHAPES.hidden), SHAPES.dtype), SEGMENTS, EXTRAS


def _combine_ops(topology, rank: int, kind) -> list:
    """The rank's COMBINE ops of `kind` (Send or Recv), in program order."""
    return [op for op in topology.programs(MICRO_BATCHES)[rank] if isinstance(op, kind)
            and op.payload is Payload.COMBINE]


def _pair_spec(topology, dst: int, layer: int, mb: int, pair_of=_pair_of) -> PairSpec:
    """The message's spec as both ends name it: its sources are the receiver's Recv peers."""
    recv = next(op for op in topology.programs(MICRO_BATCHES)[dst] if isinstance(op, Recv)
                and (op.payload, op.layer, op.micro_batch) == (Payload.COMBINE, layer, mb))
    rows, segments, *extras = pair_of(Payload.COMBINE, layer)
    return PairSpec(rows, segments, recv.peers, *extras)


@functools.cache
def _pair_data(round_: int, layer: int, mb: int, dst: int) -> SimpleNamespace:
    """One message's contents, the same on every rank (fp32, CPU): each pair's expert [P], the
    routing weights [T, K], plain rows [P, H] (stores), per-pair activations [P, F] and expert
    weights [E, F, H] (the fused down GEMM), the rows each way should land as (`plain`: the
    stored rows in the message's dtype, `fused`: the down GEMM's in fp32) and the extra, int64 [E]
    (the expert load, its high bits set per round: every byte of the words counts)."""
    tokens, top_k, hidden, experts = SHAPES.tokens, SHAPES.top_k, SHAPES.hidden, SHAPES.num_experts
    gen = torch.Generator().manual_seed(((round_ * 31 + layer) * 31 + mb) * 31 + dst)
    topk = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    data = SimpleNamespace(expert_P=topk.flatten(), weights=torch.rand(tokens, top_k, generator=gen),
                           rows=torch.randn(tokens * top_k, hidden, generator=gen) * 3,
                           act=torch.randn(tokens * top_k, FFN, generator=gen),
                           w2=torch.randn(experts, FFN, hidden, generator=gen) / FFN**0.5)
    act, w2 = data.act.to(SHAPES.dtype).float(), data.w2.to(SHAPES.dtype).float()
    data.fused = torch.bmm(act[:, None, :], w2[data.expert_P]).squeeze(1)
    data.plain = data.rows.to(SHAPES.dtype).float()
    data.load_E = torch.bincount(data.expert_P, minlength=experts) + ((round_ + 1) << 40)
    return data


def _write_pairs(rank: int, transport, topology, round_: int, kernel: bool, raise_flag, tiles=None,
                 counters_S=None) -> list[str]:
    """Every COMBINE message of the rank's program, written through `pair_target`'s views: source q
    writes the pairs whose expert is among its experts (e Q / E == q; each pair has one source),
    with the fused down GEMM (`kernel`) or plain stores and a flag raise per segment."""
    wrong = []
    device, experts = transport.device, SHAPES.num_experts
    for op in _combine_ops(topology, rank, Send):
        for dst in op.peers:
            key = message_key(round_, op.payload, op.layer, op.micro_batch)
            spec = _pair_spec(topology, dst, op.layer, op.micro_batch)
            data = _pair_data(round_, op.layer, op.micro_batch, dst)
            # every source passes the extras; only the first's are delivered (the others: a decoy)
            first = spec.sources.index(rank) == 0
            load_E = (data.load_E if first else torch.full_like(data.load_E, -1)).to(device)
            target = transport.pair_target(dst, key, spec, (load_E,))
            q, sources = target.source, len(spec.sources)
            if q != spec.sources.index(rank):
                wrong.append(f"pass {round_} L{op.layer} mb{op.micro_batch} to {dst}: source {q}")
            if len(target.extras) != 1 or target.extras[0].data_ptr() != load_E.data_ptr():  # kept, not copied
                wrong.append(f"pass {round_} L{op.layer} mb{op.micro_batch} to {dst}: target extras {target.extras}")
            mine = (data.expert_P * sources // experts == q).nonzero().squeeze(1)
            if kernel:
                from disagmoe.kernels import fused_return as fr

                local = [e for e in range(experts) if e * sources // experts == q]
                pairs = mine[torch.argsort(data.expert_P[mine], stable=True)]
                counts = torch.bincount(data.expert_P[pairs] - local[0], minlength=len(local))
                fr.down_to_destination(
                    data.act[pairs].to(device, SHAPES.dtype), counts.cumsum(0).to(torch.int32).to(device),
                    data.w2[local[0]:local[-1] + 1].to(device, SHAPES.dtype), tiles, dst_PH=target.rows_PH,
                    dst_rows_N=pairs.to(torch.int32).to(device), tokens=SHAPES.tokens, top_k=SHAPES.top_k,
                    segment_tokens=SEG_TOKENS, counters_S=counters_S, flags_QS=target.flags_QS, source=q)
            else:
                target.rows_PH[mine.to(device)] = data.rows[mine].to(device, SHAPES.dtype)
                for s in range(SEGMENTS):
                    raise_flag(target.flags_QS[q], s)
            if transport.pair_send(dst, key, target) is not None:
                wrong.append("pair_send returned a handle: the writes are the delivery")
    return wrong


def _land_pairs(rank: int, transport, topology, round_: int, combine) -> list:
    """(op, landing, y) for every COMBINE the rank receives: `pair_landing`, then `combine`. The
    weights go to the device first: a copy from pageable memory queued behind a combine that
    spins could hold the host until that combine ends, and with it the peer that writes its rows."""
    ops = _combine_ops(topology, rank, Recv)
    weights = [_pair_data(round_, op.layer, op.micro_batch, rank).weights.to(transport.device, SHAPES.dtype)
               for op in ops]
    landed = []
    for op, weights_TK in zip(ops, weights, strict=True):
        key = message_key(round_, op.payload, op.layer, op.micro_batch)
        landing = transport.pair_landing(key, _pair_spec(topology, rank, op.layer, op.micro_batch))
        landed.append((op, landing, combine(landing, weights_TK)))
    return landed


def _check_pairs(rank: int, landed: list, round_: int, kernel: bool, pointers: dict, combined: bool = True,
                 copies: int = 2) -> list[str]:
    """Every landed message: rows as written, its copy's flags counting its messages so far (and,
    `combined` by the kernel, its consumed words as many), the combine's sums."""
    from disagmoe.kernels.fused_return import combine_reference

    wrong = []
    for op, landing, y in landed:
        what = f"pass {round_} L{op.layer} mb{op.micro_batch} on rank {rank}"
        data = _pair_data(round_, op.layer, op.micro_batch, rank)
        want = data.fused if kernel else data.plain
        rows = landing.rows_PH.float().cpu()
        messages = round_ // copies + 1  # the copy's messages so far (copies alternate)
        if not (landing.flags_QS.cpu() == messages).all():
            wrong.append(f"{what}: flags {landing.flags_QS.tolist()}, not all {messages}")
        if combined and not (landing.consumed_QS.cpu() == messages).all():
            wrong.append(f"{what}: consumed {landing.consumed_QS.tolist()}, not all {messages}")
        extras = [extra.cpu() for extra in landing.extras]
        if len(extras) != 1 or not torch.equal(extras[0], data.load_E):
            wrong.append(f"{what}: extras {extras}, not the first source's {data.load_E}")
        if kernel and ((rows - want).norm() / want.norm()).item() > 1e-2 or not kernel and not torch.equal(rows, want):
            wrong.append(f"{what}: rows differ from what the sources wrote")
        y_want = combine_reference(want, data.weights.to(SHAPES.dtype).float(), SHAPES.top_k)
        if ((y.float().cpu() - y_want).norm() / y_want.norm()).item() > 1e-2:
            wrong.append(f"{what}: the combine's sums differ")
        pointers.setdefault((rank, op.layer, op.micro_batch), []).append(landing.rows_PH.data_ptr())
    return wrong


def _check_copies(pointers: dict) -> list[str]:
    """In place, copies alternating: messages 1, 3, 5 of a slot in one buffer, 2 and 4 in the other."""
    return [f"{slot}: landed at {seen}" for slot, seen in pointers.items()
            if not (seen[0::2] == [seen[0]] * len(seen[0::2]) and seen[1::2] == [seen[1]] * len(seen[1::2])
                    and seen[0] != seen[1])]


def _exchange_pairs(rank: int, transport, topology, kernel: bool) -> list[str]:
    """ROUNDS messages of every COMBINE slot as pair rows. The first WARM_ROUNDS rounds write every
    row before any combine starts (every kernel variant compiles and loads with no wait running:
    a first launch waits for a spinning kernel of its process); later, a rank that only receives
    queues its combines first, so they wait on the GPU for rows the peer is still writing. Every
    round starts once every receiver checked the last (nothing is overwritten while read)."""
    from disagmoe.kernels import fused_return as fr
    from disagmoe.kernels.moe_ffn import FFNTiles
    from disagmoe.kernels.signal import raise_flag

    device, top_k = transport.device, SHAPES.top_k
    tiles = FFNTiles.for_shape(SHAPES.tokens * top_k, SHAPES.num_experts, SHAPES.hidden, FFN, device).down
    counters_S = torch.zeros(SEGMENTS, dtype=torch.int32, device=device)

    def combine(landing, weights):
        return fr.combine_landed(landing.rows_PH, weights, landing.flags_QS, landing.consumed_QS, SEG_TOKENS, top_k,
                                 landing.status_2, timeout_s=60)

    def write(round_):
        return _write_pairs(rank, transport, topology, round_, kernel, raise_flag, tiles, counters_S)

    wrong, pointers = [], {}
    receives_only = not _combine_ops(topology, rank, Send)
    for round_ in range(ROUNDS):
        warm = round_ < WARM_ROUNDS
        dist.barrier()  # every receiver is done with the message before last of each slot
        early = not warm and receives_only
        landed = _land_pairs(rank, transport, topology, round_, combine) if early else None
        if not warm:
            dist.barrier()  # the early combines are queued before a row is written
        wrong += write(round_)
        if warm:
            torch.cuda.synchronize()
            dist.barrier()  # every row and flag is in place
        if not early:
            landed = _land_pairs(rank, transport, topology, round_, combine)
        torch.cuda.synchronize()
        wrong += _check_pairs(rank, landed, round_, kernel, pointers)
        del landed
    if kernel and not (counters_S == 0).all():
        wrong.append(f"the fused launches left their counters at {counters_S.tolist()}")
    wrong += _check_copies(pointers)
    status = transport.status_word().tolist()
    if status != [0, 0]:
        try:
            transport.check_status(status)
            wrong.append(f"status {status} set, check_status raised nothing")
        except Exception as err:  # what it names is the report
            wrong.append(f"status {status}: {type(err).__name__}: {err}")
    return wrong


PAIR_MODES = {"pairs-fused": (TOPOLOGY, True), "pairs-colocated": (COLOCATED, False)}


SYMMETRIC_BASE = 1 << 44  # the fake symmetric address of the arena, the same on every PE
STREAM = "the current stream"  # what the fake torch.cuda.current_stream returns


class _Buffer(NamedTuple):
    """Stands for cuda.core's Buffer: an address and a size."""

    ptr: int
    size: int

    @classmethod
    def from_handle(cls, ptr: int, size: int) -> "_Buffer":
        return cls(int(ptr), int(size))


class _FakeNv:
    """Stands for nvshmem.core in the CPU transports: records the calls it gets into `log`; a put
    copies its bytes into the destination PE's arena (CPU memory), checking they fit it."""

    def __init__(self, rank: int, arenas: list[torch.Tensor], log: list) -> None:
        self.rank, self.arenas, self.log = rank, arenas, log

    def put(self, dst: _Buffer, src: _Buffer, remote_pe: int, stream) -> None:
        offset, arena = dst.ptr - SYMMETRIC_BASE, self.arenas[remote_pe]
        self.log.append(("put", self.rank, remote_pe, offset, dst.size, src.ptr, stream))
        assert remote_pe != self.rank and dst.size == src.size and 0 <= offset <= arena.numel() - dst.size
        ctypes.memmove(arena.data_ptr() + offset, src.ptr, dst.size)

    def quiet(self, stream) -> None:
        self.log.append(("quiet", self.rank, stream))

    SignalOp = SimpleNamespace(SIGNAL_SET="set", SIGNAL_ADD="add")

    def put_signal(self, dst: _Buffer, src: _Buffer, flag: _Buffer, value: int, op, remote_pe: int, stream) -> None:
        """The put, then `value` set into or added to the flag word in the destination PE's arena."""
        self.put(dst, src, remote_pe, stream)
        self.log[-1] = ("put_signal", *self.log[-1][1:], flag.ptr - SYMMETRIC_BASE, value, op)
        self._signal(flag, value, op, remote_pe)

    def signal_op(self, flag: _Buffer, value: int, op, remote_pe: int, stream) -> None:
        self.log.append(("signal_op", self.rank, remote_pe, flag.ptr - SYMMETRIC_BASE, value, op, stream))
        self._signal(flag, value, op, remote_pe)

    def _signal(self, flag: _Buffer, value: int, op, remote_pe: int) -> None:
        assert remote_pe != self.rank and flag.size == 8 and op in ("set", "add")
        offset = flag.ptr - SYMMETRIC_BASE  # `.data`: a remote store bumps no version counter of the peer's views
        word = self.arenas[remote_pe].data[offset:offset + 8].view(torch.int64)
        word.fill_(value if op == "set" else int(word) + value)


@pytest.fixture
def fake_cuda(monkeypatch):
    """cuda.core's Buffer, torch.cuda.current_stream and torch.cuda.Event stood in for on a CPU:
    `log` gets the fake nv's calls and the events' records, in order; `events` every Event made
    (`done` is what its query answers)."""
    core = ModuleType("cuda.core")
    core.Buffer = _Buffer
    cuda = ModuleType("cuda")
    cuda.core = core
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.core", core)
    fake = SimpleNamespace(log=[], events=[])

    class Event:
        def __init__(self) -> None:
            self.done = False
            fake.events.append(self)

        def record(self, stream) -> None:
            fake.log.append(("record", stream))

        def query(self) -> bool:
            return self.done

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: STREAM)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return fake


def _cpu_transports(topology, pair_of=_pair_of, log=None, sum_width=0, shared=False) -> list[NvshmemTransport]:
    """One NvshmemTransport per rank of `topology`, with CPU tensors for the arenas and for the
    peer views (each peer's own arena tensor) and a fake nv (`_FakeNv`, its calls into `log`):
    nothing of NVSHMEM runs, the rest is the real code (the `fake_cuda` fixture for the puts).
    `shared`: segments shared as `receive_layouts` shares them (`reuse_order.one_sided_slots`)."""
    programs = topology.programs(MICRO_BATCHES)
    rings = one_sided_slots(programs, topology.is_moe, topology.num_layers) if shared else None
    layouts = symmetric_layouts(programs, _specs_of(topology), pair_of=pair_of, sum_width=sum_width, shared=rings)
    arenas = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in layouts]
    log = [] if log is None else log
    transports = []
    for rank in range(len(layouts)):
        transport = object.__new__(NvshmemTransport)
        Transport.__init__(transport, rank, len(layouts), 30.0)
        transport._plan(layouts)
        transport.nv = _FakeNv(rank, arenas, log)
        transport.device = torch.device("cpu")
        transport._attach(arenas[rank])
        transport._base = SYMMETRIC_BASE
        transport._peer_arenas = {dst: arenas[dst] for dst in pair_destinations(layouts, rank)}
        transports.append(transport)
    return transports


def _add_flag(flags_S, s):
    flags_S[s] += 1


PAIR_TOPOLOGIES = [TOPOLOGY, Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8), COLOCATED,
                   Topology.colocated_ranks(3, 2, 0, 8)]
PAIR_IDS = ["A1-E1", "A2-E2-p2", "colocated2", "colocated3"]


@pytest.mark.parametrize("topology", PAIR_TOPOLOGIES, ids=PAIR_IDS)
def test_pair_rows_from_every_source_land_in_the_receivers_region(topology, fake_cuda):
    """The GPU exchange's own writing and checking, ranks one after another on CPU tensors: rows
    through the targets' views (a peer's arena or the rank's own), the first source's extras
    through the fake nv's puts (or a copy into its own arena), the landings see them all."""
    from disagmoe.kernels.fused_return import combine_reference

    transports = _cpu_transports(topology, log=fake_cuda.log)
    wrong, pointers = [], {}
    for round_ in range(ROUNDS):
        for transport in transports:
            wrong += _write_pairs(transport.rank, transport, topology, round_, False, _add_flag)
        for transport in transports:
            landed = _land_pairs(transport.rank, transport, topology, round_,
                                 lambda landing, w: combine_reference(landing.rows_PH, w, SHAPES.top_k))
            for _, landing, _ in landed:
                assert landing.status_2 is transport.status_2
                assert landing.rows_PH.data_ptr() - transport.arena_B.data_ptr() in {
                    r.offset for r in transport.layout.pairs}
                assert landing.flag_base in {r.flag for r in transport.layout.pairs}
            wrong += _check_pairs(transport.rank, landed, round_, False, pointers, combined=False)
    wrong += _check_copies(pointers)
    assert pointers and wrong == []
    for transport in transports:  # no segment used: only pair slots counted, ROUNDS messages each
        counts = transport.message_counts()
        assert counts and {kind for kind, _, _ in counts} <= {"pair_sent", "pair_received"}
        assert set(counts.values()) == {ROUNDS}
    # each remote first source's message: its one extra's put, then one quiet, then the event
    calls = [call[0] for call in fake_cuda.log]
    assert calls and calls == ["put", "quiet", "record"] * (len(calls) // 3)


def _pair_of_extras(payload, layer):
    """COMBINE with three extras: an int64 [E] load, a float32 [2, 3] and an empty int64 [0]."""
    got = _pair_of(payload, layer)
    return None if got is None else (*got[:2], (EXTRAS[0], TensorSpec((2, 3), torch.float32),
                                                TensorSpec((0,), torch.int64)))


def test_the_first_source_puts_its_extras_into_the_receivers_region_then_one_quiet(fake_cuda):
    """The expert rank (the only source, so the first) to the attention rank: a put per non-empty
    extra, at the symmetric address of the extra in the region of the message's copy, from the
    tensor's own memory, on the current stream; then one quiet and an event that keeps them alive."""
    attention, expert = _cpu_transports(TOPOLOGY, pair_of=_pair_of_extras, log=fake_cuda.log)
    spec = _pair_spec(TOPOLOGY, 0, 0, 0, pair_of=_pair_of_extras)
    assert spec.sources == (1,) and len(spec.extras) == 3
    experts = SHAPES.num_experts
    sent = []
    for n in range(3):
        fake_cuda.log.clear()
        key = message_key(n, Payload.COMBINE, 0, 0)
        # message 2's load is a strided view: what is put is a contiguous copy, kept alive
        load = (torch.arange(2 * experts) + (n << 40))[::2] if n == 1 else torch.arange(experts) + (n << 40)
        extras = (load, torch.full((2, 3), n + 0.5), torch.zeros(0, dtype=torch.int64))
        target = expert.pair_target(0, key, spec, extras)
        region = attention.layout.pair_region((Payload.COMBINE, 0, 0), n)
        (load_at, _), (other_at, _), _ = region.extras
        assert target.source == 0 and target.rows_PH.data_ptr() == attention.arena_B.data_ptr() + region.offset
        assert [TensorSpec.of(t) for t in target.extras] == list(spec.extras)
        assert all(t.is_contiguous() for t in target.extras) and load.is_contiguous() == (n != 1)
        assert (target.extras[0].data_ptr() == load.data_ptr()) == (n != 1)  # copied only when strided
        assert [torch.equal(t, e) for t, e in zip(target.extras, extras, strict=True)] == [True] * 3
        assert fake_cuda.log == [
            ("put", 1, 0, load_at, 8 * experts, target.extras[0].data_ptr(), STREAM),
            ("put", 1, 0, other_at, 4 * 6, target.extras[1].data_ptr(), STREAM),
            ("quiet", 1, STREAM),
            ("record", STREAM),
        ]
        sent.append(target.extras)
        if n == 1:
            # the events of messages 1 and 2 have not passed: both kept; once passed, dropped
            assert [kept for _, kept in expert._extras_in_flight] == sent
            for event in fake_cuda.events:
                event.done = True
    assert [kept for _, kept in expert._extras_in_flight] == sent[2:]
    assert len(fake_cuda.events) == 3
    # the receiver sees them at its region's offsets; copies alternate (message 3 over message 1's)
    fake_cuda.log.clear()
    for n in range(3):
        landing = attention.pair_landing(message_key(n, Payload.COMBINE, 0, 0), spec)
        region = attention.layout.pair_region((Payload.COMBINE, 0, 0), n)
        assert [TensorSpec.of(t) for t in landing.extras] == list(spec.extras)
        assert [t.data_ptr() - attention.arena_B.data_ptr() for t in landing.extras[:2]] == [
            offset for offset, _ in region.extras[:2]]
        want = sent[2] if n == 0 else sent[n]
        assert torch.equal(landing.extras[0], want[0]) and torch.equal(landing.extras[1], want[1])
    assert fake_cuda.log == []  # the landing puts and waits for nothing


def test_only_the_first_source_writes_the_extras_a_colocated_one_by_a_copy(fake_cuda):
    """Colocated, both ranks source every COMBINE: rank 0 (the first) copies its extras into its
    own arena (no nv call) and puts them into rank 1's; rank 1 writes none, to either."""
    transports = _cpu_transports(COLOCATED, log=fake_cuda.log)
    key = message_key(3, Payload.COMBINE, 1, 1)
    specs = [_pair_spec(COLOCATED, dst, 1, 1) for dst in range(WORLD)]
    assert [spec.sources for spec in specs] == [(0, 1), (0, 1)]
    first = [torch.arange(SHAPES.num_experts) + 10 * dst for dst in range(WORLD)]
    decoy = torch.full((SHAPES.num_experts,), -1)
    for dst in range(WORLD):  # rank 1 first: nothing it passes may land
        target = transports[1].pair_target(dst, key, specs[dst], (decoy,))
        assert target.source == 1 and torch.equal(target.extras[0], decoy)
    assert fake_cuda.log == [] and transports[1]._extras_in_flight == []
    own = transports[0].pair_target(0, key, specs[0], (first[0],))
    assert fake_cuda.log == [] and transports[0]._extras_in_flight == []  # a copy, on the stream
    assert own.source == 0 and torch.equal(own.extras[0], first[0])
    transports[0].pair_target(1, key, specs[1], (first[1],))
    region = transports[1].layout.pair_region((Payload.COMBINE, 1, 1), 0)
    assert [call[:4] for call in fake_cuda.log] == [("put", 0, 1, region.extras[0][0]), ("quiet", 0, STREAM),
                                                   ("record", STREAM)]
    for dst, transport in enumerate(transports):
        landing = transport.pair_landing(key, specs[dst])
        assert torch.equal(landing.extras[0], first[dst])


def test_a_layout_without_extras_lands_none_and_puts_nothing(fake_cuda):
    rows_only = lambda p, l: None if _pair_of(p, l) is None else _pair_of(p, l)[:2]  # noqa: E731
    attention, expert = _cpu_transports(TOPOLOGY, pair_of=rows_only, log=fake_cuda.log)
    spec = _pair_spec(TOPOLOGY, 0, 0, 0, pair_of=rows_only)
    key = message_key(0, Payload.COMBINE, 0, 0)
    assert spec.extras == () and expert.pair_target(0, key, spec).extras == ()
    assert attention.pair_landing(key, spec).extras == () and fake_cuda.log == []
    with pytest.raises(ValueError, match=r"the extras of pair-row message .* tensors \[\(\(8,\), 'torch.int64'\)\] "
                                         r"do not match the expected \[\]"):
        expert.pair_target(0, message_key(1, Payload.COMBINE, 0, 0), spec, (torch.zeros(8, dtype=torch.int64),))


def test_a_source_writes_into_the_receivers_arena_and_a_colocated_one_into_its_own(fake_cuda):
    transports = _cpu_transports(COLOCATED, log=fake_cuda.log)
    for rank, transport in enumerate(transports):
        for dst in range(WORLD):
            key = message_key(7, Payload.COMBINE, 1, 0)
            extras = (torch.zeros(SHAPES.num_experts, dtype=torch.int64),)
            target = transport.pair_target(dst, key, _pair_spec(COLOCATED, dst, 1, 0), extras)
            region = transports[dst].layout.pair_region((Payload.COMBINE, 1, 0), 0)
            arena = transports[dst].arena_B  # the peer view's memory (its own for dst == rank)
            assert target.rows_PH.data_ptr() == arena.data_ptr() + region.offset
            assert target.flags_QS.data_ptr() == arena.data_ptr() + 8 * region.flag
            assert target.source == rank
        assert list(transport._peer_arenas) == [1 - rank]  # never this rank's own PE
    disaggregated = _cpu_transports(TOPOLOGY)
    assert [list(t._peer_arenas) for t in disaggregated] == [[], [0]]  # only the expert rank writes pair rows


def test_pair_messages_are_refused_with_the_fix(fake_cuda):
    topology = Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8)
    transports = _cpu_transports(topology, log=fake_cuda.log)
    recv = _combine_ops(topology, 1, Recv)[0]  # rank 1's COMBINE, from rank 2 alone
    key = message_key(0, recv.payload, recv.layer, recv.micro_batch)
    spec = _pair_spec(topology, 1, recv.layer, recv.micro_batch)
    assert spec.sources == (2,)
    with pytest.raises(ValueError, match=r"rank 3 is not a source of the pair-row message .* \(its sources: \(2,\)"):
        transports[3].pair_target(1, key, spec)
    load = torch.arange(SHAPES.num_experts, dtype=torch.int64)
    wrong = PairSpec(spec.rows, spec.segments + 1, spec.sources, spec.extras)
    with pytest.raises(ValueError, match="build the layouts with the same pair_of"):
        transports[2].pair_target(1, key, wrong, (load,))
    with pytest.raises(ValueError, match="build the layouts with the same pair_of"):
        transports[1].pair_landing(key, PairSpec(TensorSpec((4, 4), torch.float32), spec.segments, spec.sources))
    dispatch = message_key(0, Payload.DISPATCH, recv.layer, recv.micro_batch)
    with pytest.raises(ValueError, match="no pair-row region for key .* not a pair-row receive"):
        transports[1].pair_target(3, dispatch, spec)
    with pytest.raises(ValueError, match="not a rank of this 4-rank job"):
        transports[2].pair_target(4, key, spec)
    # the extras: the spec's, as tensors of the spec's, on the transport's device
    expected = r"do not match the expected \[\(\(8,\), 'torch.int64'\)\]"
    for extras in [(), (load.int(),), (load[:4],), (load, load)]:
        with pytest.raises(ValueError, match=rf"rank 2: the extras of pair-row message {re.escape(str(key))} to rank 1: "
                                             rf"tensors .* {expected}"):
            transports[2].pair_target(1, key, spec, extras)
    with pytest.raises(ValueError, match="the nvshmem transport sends tensors on cpu, got one on meta"):
        transports[2].pair_target(1, key, spec, (load.to("meta"),))
    bare = PairSpec(spec.rows, spec.segments, spec.sources)  # a spec without the region's extras
    fix = r"sources \(2,\) and extras \[\]; its region holds .* extras \[\(\(8,\), 'torch.int64'\)\]: build the layouts"
    with pytest.raises(ValueError, match=fix):
        transports[2].pair_target(1, key, bare)
    with pytest.raises(ValueError, match=fix):
        transports[1].pair_landing(key, bare)
    assert fake_cuda.log == []  # a refused message put nothing
    # the refusals counted nothing: both ends still agree on message 1, copy 0
    copy0 = transports[1].arena_B.data_ptr() + transports[1].layout.pair_region((recv.payload, recv.layer,
                                                                                   recv.micro_batch), 0).offset
    assert transports[2].pair_target(1, key, spec, (load,)).rows_PH.data_ptr() == copy0
    assert transports[1].pair_landing(key, spec).rows_PH.data_ptr() == copy0
    # send, recv and reserve do not carry pair rows
    rows = [torch.zeros(SHAPES.tokens, SHAPES.hidden, dtype=SHAPES.dtype)]
    fix = "is a pair-row message .* pair_target and pair_send, rank 1 reads it with pair_landing"
    with pytest.raises(ValueError, match=fix):
        transports[1].reserve(2, key, [TensorSpec.of(rows[0])])
    with pytest.raises(ValueError, match=fix):
        transports[1].recv(2, key, [TensorSpec.of(rows[0])])
    with pytest.raises(ValueError, match=fix):
        transports[2].send(1, key, rows)


@pytest.mark.parametrize("topology", PAIR_TOPOLOGIES, ids=PAIR_IDS)
def test_every_pair_region_is_found_from_its_messages_keys(topology):
    programs = topology.programs(MICRO_BATCHES)
    layouts = symmetric_layouts(programs, _specs_of(topology), pair_of=_pair_of)
    for rank, (program, layout) in enumerate(zip(programs, layouts, strict=True)):
        index = SlotIndex(layout)
        for op in program:
            if isinstance(op, Recv):
                key = message_key(5, op.payload, op.layer, op.micro_batch)
                if op.payload is Payload.COMBINE:
                    region = index.pair_region(key, rank)
                    assert (region.slot, region.copy, region.sources) == (
                        (op.payload, op.layer, op.micro_batch), 0, op.peers)
                else:
                    for peer in op.peers:
                        if peer != rank:
                            assert index.slot(peer, key, rank) == (peer, op.payload, op.layer, op.micro_batch)


@pytest.mark.parametrize("topology", [TOPOLOGY, Topology.colocated_ranks(3, 2, 0, 8),
                                      Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8)], ids=["A1-E1", "colocated3", "A2-E2-p2"])
def test_every_rank_sums_the_same_bits_and_copies_alternate(topology, fake_cuda, interpreted):
    """The all-ranks sum, ranks one after another on CPU arenas: every rank puts its share with its
    flag into every peer's arena (a copy into its own), then waits for the peers' flags and sums
    the shares in rank order: the same bits everywhere, sums that depend on the order included."""
    interpreted("disagmoe.kernels.signal")
    transports = _cpu_transports(topology, log=fake_cuda.log, sum_width=4)
    world, region = len(transports), transports[0].layout.sums
    for round_ in range(3):  # copies 0, 1, 0
        values = [torch.tensor([1e16 if r == 0 else 1.0, r + round_, -(r % 2) * 1e16, 0.5], dtype=torch.float64)[:3 - round_ % 2]
                  for r in range(world)]
        fake_cuda.log.clear()
        pending = [t._put_share(v) for t, v in zip(transports, values, strict=True)]
        assert [p[0] for p in pending] == [round_ % 2] * world
        puts = [entry for entry in fake_cuda.log if entry[0] == "put_signal"]
        assert sorted((e[1], e[2]) for e in puts) == [(r, d) for r in range(world) for d in range(world) if d != r]
        for entry in puts:  # (op, rank, dst, offset, size, ptr, stream, flag byte, value, op)
            rank = entry[1]
            assert entry[3] == region.share_offset(round_ % 2, rank) and entry[4] == 8 * values[rank].numel()
            assert entry[7] == 8 * region.flag_of(round_ % 2, rank) and entry[8:] == (1, "add")
            assert entry[6] == STREAM
        sums = [t._summed(*p, timeout_s=30) for t, p in zip(transports, pending, strict=True)]
        want = torch.stack(values).sum(dim=0)
        assert all(torch.equal(got, want) for got in sums), (sums, want)
        assert all(t.status_word().tolist() == [0, 0] for t in transports)
    assert all(len(t._extras_in_flight) == 3 for t in transports)  # the shares kept until the stream passed them


def test_a_sum_is_refused_where_it_cannot_run_and_a_missing_share_is_named(fake_cuda):
    transports = _cpu_transports(TOPOLOGY, log=fake_cuda.log, sum_width=2)
    with pytest.raises(ValueError, match=r"all_sum takes float64 \[N\] with 1 <= N <= 2 .* got torch.float32"):
        transports[0].all_sum(torch.zeros(1))
    with pytest.raises(ValueError, match=r"got torch.float64 \(3,\)"):
        transports[0].all_sum(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="sums tensors on cpu, got one on meta"):
        transports[0].all_sum(torch.zeros(1, dtype=torch.float64, device="meta"))
    with pytest.raises(ValueError, match=r"no all-ranks sum region: build the layouts with symmetric_layouts\(\.\.\., "
                                         r"sum_width=N\)"):
        _cpu_transports(TOPOLOGY, log=fake_cuda.log)[0].all_sum(torch.zeros(1, dtype=torch.float64))
    assert fake_cuda.log == [] and transports[0].message_counts() == {}  # nothing put, nothing counted
    region = transports[1].layout.sums
    with pytest.raises(TransportTimeout) as err:
        transports[1].check_status([TIMED_OUT, region.flag_of(1, 0)])
    assert err.value.peer == 0
    assert ("waiting to receive the share of the all-ranks sum (the step's gradient norm; copy 1, "
            f"flag {region.flag_of(1, 0)}) from rank 0") in str(err.value)


def test_check_status_names_a_timed_out_pair_flag():
    transports = _cpu_transports(Topology.colocated_ranks(3, 2, 0, 8))
    transport = transports[2]
    region = transport.layout.pair_region((Payload.COMBINE, 1, 1), 1)  # the slot's second copy
    assert region.sources == (0, 1, 2)
    q, s = 1, SEGMENTS - 1
    with pytest.raises(TransportTimeout) as err:
        transport.check_status([TIMED_OUT, region.flag + q * SEGMENTS + s])  # flag_base + q S + s
    assert err.value.peer == 1
    assert (f"waiting to receive segment {s} of {SEGMENTS} of the combine pair rows of layer 1, micro-batch 1 "
            f"(copy 1, flag {region.flag + q * SEGMENTS + s}) from rank 1") in str(err.value)
    seg = transport.layout.segments[3]
    with pytest.raises(TransportTimeout, match=f"receive the {seg.slot[1].value} message of layer {seg.slot[2]}, "
                                               f"micro-batch {seg.slot[3]} from rank {seg.slot[0]}"):
        transport.check_status([TIMED_OUT, seg.flag])
    with pytest.raises(TimeoutError, match="the wait for flag 99999 timed out"):
        transport.check_status([TIMED_OUT, 99999])
    with pytest.raises(ArenaOverflow, match="transport_capacity_factor"):
        transport.check_status([OVERFLOW, 0])
    transport.check_status([0, 0])


@pytest.mark.gpu
@needs_nvshmem
@pytest.mark.parametrize("mode", list(PAIR_MODES))
def test_pair_rows_written_through_peer_views_are_combined_by_the_receiver(ranks, mode):
    """pairs-fused: the expert rank's `down_to_destination` stores into the attention rank's arena
    through its peer view; pairs-colocated: both ranks store plain rows into both arenas (their
    own too) and raise their flags. The receivers' `combine_landed` over `pair_landing` sums them."""
    reports = _spawn(ranks, mode, timeout_s=420)
    assert [reports[rank]["said"] for rank in range(WORLD)] == [[], []]


def test_a_colocated_first_source_s_extras_do_not_break_a_saved_combine(fake_cuda):
    """A colocated rank that is the first source writes its extras into its own arena while a
    combine of another slot still holds a view of it for its backward: autograd's version check
    (shared by every view of the arena) must not fire (the review found it did)."""
    import dataclasses

    from disagmoe.runtime.stages.pair_return import combine_pairs

    transports = _cpu_transports(COLOCATED, log=fake_cuda.log)
    t0 = transports[0]
    landing = t0.pair_landing(message_key(0, Payload.COMBINE, 1, 0), _pair_spec(COLOCATED, 0, 1, 0))
    landing = dataclasses.replace(landing, status_2=None)  # the torch combine: a saved view of the arena
    w = torch.rand(SHAPES.tokens, SHAPES.top_k, dtype=torch.bfloat16, requires_grad=True)
    y = combine_pairs(landing, w, 8)
    t0.pair_target(0, message_key(0, Payload.COMBINE, 1, 1), _pair_spec(COLOCATED, 0, 1, 1),
                   (torch.arange(SHAPES.num_experts),))
    y.float().sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_a_pair_landing_carries_the_receive_timeout(fake_cuda):
    """The combine's waits give up after the transport's receive timeout (or the one asked for)."""
    transports = _cpu_transports(COLOCATED, log=fake_cuda.log)
    t0 = transports[0]
    spec = _pair_spec(COLOCATED, 0, 1, 0)
    assert t0.pair_landing(message_key(0, Payload.COMBINE, 1, 0), spec).timeout_s == t0.default_timeout_s
    assert t0.pair_landing(message_key(1, Payload.COMBINE, 1, 0), spec, timeout_s=3.0).timeout_s == 3.0


# --- sparse dispatch by peer stores (`NvshmemTransport.send_sparse` / `send_counted`) -----------

SPARSE_SHAPES = MessageShapes(rows=1, seq_len=40, hidden=24, top_k=2, num_experts=8, dtype=torch.float32,
                              shared_experts=False, sparse=True)


def _sparse_transports(topology, shapes=None, micro_batches: int = MICRO_BATCHES) -> list[NvshmemTransport]:
    """`_cpu_transports` with sparse-dispatch specs (`shapes`, fp32 `SPARSE_SHAPES` by default; the
    interpreter runs the kernel), pair-row regions where `shapes` has pair rows."""
    shapes = SPARSE_SHAPES if shapes is None else shapes
    specs_of = lambda payload, layer: shapes.specs(payload, topology.is_moe(layer))  # noqa: E731
    pair_of = lambda payload, layer: shapes.pair_layout(payload, topology.is_moe(layer))  # noqa: E731
    layouts = symmetric_layouts(topology.programs(micro_batches), specs_of, pair_of=pair_of)
    arenas = [torch.zeros(layouts[0].nbytes, dtype=torch.uint8) for _ in layouts]
    transports = []
    for rank in range(len(layouts)):
        transport = object.__new__(NvshmemTransport)
        Transport.__init__(transport, rank, len(layouts), 30.0)
        transport._plan(layouts)
        transport.nv = _FakeNv(rank, arenas, [])
        transport.device = torch.device("cpu")
        transport._attach(arenas[rank])
        transport._base = SYMMETRIC_BASE
        # a peer view is a tensor of its own (as get_peer_tensor's): a write through it leaves the version
        # counter of the peer's views alone (one in autograd's saved tensors, a received residual stream)
        transport._peer_arenas = {dst: arenas[dst].data for dst in range(len(layouts)) if dst != rank}
        transports.append(transport)
    return transports


def _counted_launches(sd, monkeypatch) -> list[int]:
    """The destinations of every `dispatch_rows` launch of the interpreted kernels `sd` from now on."""
    launches = []
    real = sd.dispatch_rows
    monkeypatch.setattr(sd, "dispatch_rows", lambda x, picked, *a, **kw: (launches.append(picked.shape[0]),
                                                                          real(x, picked, *a, **kw))[1])
    return launches


@pytest.mark.parametrize("sources,experts", [(1, 2), (1, 3), (2, 2)], ids=["A1-E2", "A1-E3", "A2-E2"])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_sparse_dispatch_by_peer_stores_delivers_the_send_recv_message(interpreted, fake_cuda, monkeypatch, sources,
                                                                       experts, skew):
    """1 or 2 attention ranks and 2 or 3 expert ranks, CPU arenas: `send_sparse` (one launch for
    every destination) lands at each expert rank, through its unchanged `recv`, what
    `dispatch_messages` builds for it (the first `count` rows, the count, the load); rows past the
    count are never written (only routed rows move); the backward `send_counted` returns d x and d w
    of the rows received to every source in one launch per expert rank, and again only those. Two
    messages of the slot (both copies), skewed routing leaves expert ranks empty."""
    sd = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch")[1]
    from disagmoe.runtime.stages.sparse_dispatch import dispatch_messages

    launches = _counted_launches(sd, monkeypatch)
    topology = Topology.disaggregated(Layout(sources, experts, 1, 2, 0), SPARSE_SHAPES.num_experts)
    transports = _sparse_transports(topology)
    attention, ranks = list(topology.attention_groups[0]), list(topology.expert_groups[0])
    T, H, K, E = SPARSE_SHAPES.tokens, SPARSE_SHAPES.hidden, SPARSE_SHAPES.top_k, SPARSE_SHAPES.num_experts
    gen = torch.Generator().manual_seed(experts + 10 * skew + 100 * sources)
    per = -(-E // len(ranks))
    dispatch = SPARSE_SHAPES.specs(Payload.DISPATCH, True)
    grad = SPARSE_SHAPES.specs(Payload.DISPATCH_GRAD, True)
    for step in range(2):
        key = message_key(step, Payload.DISPATCH, 0, 0)
        counts = {}  # (source, expert rank) -> rows sent
        received = {rank: [] for rank in ranks}
        for src in attention:
            topk = torch.stack([torch.randperm(2 if skew else E, generator=gen)[:K] for _ in range(T)])
            owner = topk // per
            local_QTK = torch.stack([torch.where(owner == q, topk % per, per)
                                     for q in range(len(ranks))]).to(torch.int32)
            x, w = torch.randn(T, H, generator=gen), torch.rand(T, K, generator=gen)
            load = torch.bincount(topk.flatten(), minlength=E)
            messages, _, count_Q1 = dispatch_messages(x, local_QTK, torch.full((len(ranks),), per, dtype=torch.int32),
                                                      w, load)
            launches.clear()
            transports[src].send_sparse(ranks, key, x, (local_QTK < per).any(2), local_QTK, w, [load])
            assert launches == [len(ranks)], "one launch for every destination"
            for q, rank in enumerate(ranks):
                got = transports[rank].recv(src, key, dispatch)
                n = counts[(src, rank)] = int(count_Q1[q])
                assert got[4].tolist() == [n] and torch.equal(got[5], load)
                for mine, want in zip(got[:4], messages[q][:4], strict=True):
                    assert torch.equal(mine[:n], want[:n])
                if step == 0:  # copy 0 of the segment, zero before: the rows past the count were not written
                    assert (got[0][n:] == 0).all() and (got[3][n:] == 0).all()
                received[rank].append(got[4].clone())
            if skew:
                assert int(count_Q1[-1]) == 0, "skewed routing leaves the last expert rank empty"
        grad_key = message_key(step, Payload.DISPATCH_GRAD, 0, 0)
        for rank in ranks:  # every source's d x and d w in one launch, blocks in source order
            dx, dw = torch.randn(len(attention), T, H, generator=gen), torch.randn(len(attention), T, K, generator=gen)
            load = torch.arange(E) + rank
            launches.clear()
            transports[rank].send_counted(attention, grad_key, dx, dw, torch.stack(received[rank]), [load])
            assert launches == [len(attention)], "one launch for every source"
            for d, src in enumerate(attention):
                back = transports[src].recv(rank, grad_key, grad)
                n = counts[(src, rank)]
                assert torch.equal(back[0][:n], dx[d, :n]) and torch.equal(back[1][:n], dw[d, :n])
                assert torch.equal(back[2], load)
                if step == 0:
                    assert (back[0][n:] == 0).all()
    assert all(t.status_2.tolist() == [0, 0] for t in transports)


SPARSE_PAIR_SHAPES = dataclasses.replace(SPARSE_SHAPES, pair_rows=True)


@pytest.mark.parametrize("sources,experts", [(1, 2), (1, 3), (2, 2)], ids=["A1-E2", "A1-E3", "A2-E2"])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_a_sparse_pair_row_layer_s_gradients_go_by_peer_stores(interpreted, fake_cuda, monkeypatch, sources, experts,
                                                              skew):
    """Sparse dispatch with pair rows: COMBINE_GRAD is `send_sparse` of the rows alone (dy of the
    tokens each expert rank served, in token order: its dispatch order), DISPATCH_GRAD
    `send_counted` of d x alone with the load; one launch for every destination each, only the
    first count rows written, both copies of the slot; skewed routing leaves an expert rank empty."""
    sd = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch")[1]
    launches = _counted_launches(sd, monkeypatch)
    shapes = SPARSE_PAIR_SHAPES
    topology = Topology.disaggregated(Layout(sources, experts, 1, 2, 0), shapes.num_experts)
    transports = _sparse_transports(topology, shapes)
    attention, ranks = list(topology.attention_groups[0]), list(topology.expert_groups[0])
    T, H, E = shapes.tokens, shapes.hidden, shapes.num_experts
    combine_grad, grad = shapes.specs(Payload.COMBINE_GRAD, True), shapes.specs(Payload.DISPATCH_GRAD, True)
    assert [spec.shape for spec in grad] == [(T, H), (E,)], "d x and the load: no d w with pair rows"
    gen = torch.Generator().manual_seed(experts + 10 * skew + 100 * sources)
    for step in range(2):
        key = message_key(step, Payload.COMBINE_GRAD, 0, 0)
        counts = {}  # (source, expert rank) -> rows
        for src in attention:
            picked_QT = torch.rand(len(ranks), T, generator=gen) < 0.5
            if skew:
                picked_QT[-1] = False
            dy = torch.randn(T, H, generator=gen)
            launches.clear()
            transports[src].send_sparse(ranks, key, dy, picked_QT)
            assert launches == [len(ranks)], "one launch for every expert rank"
            for q, (rank, want) in enumerate(zip(ranks, sd.dispatch_reference(dy, picked_QT), strict=True)):
                got, = transports[rank].recv(src, key, combine_grad)
                n = counts[(src, rank)] = int(want["count"])
                assert torch.equal(got[:n], want["rows"])
                if step == 0:  # copy 0 of the segment, zero before: the rows past the count were not written
                    assert (got[n:] == 0).all()
        grad_key = message_key(step, Payload.DISPATCH_GRAD, 0, 0)
        for rank in ranks:
            dx = torch.randn(len(attention), T, H, generator=gen)
            count_S1 = torch.tensor([[counts[(src, rank)]] for src in attention], dtype=torch.int32)
            launches.clear()
            transports[rank].send_counted(attention, grad_key, dx, None, count_S1, [torch.arange(E) + rank])
            assert launches == [len(attention)], "one launch for every source"
            for d, src in enumerate(attention):
                back, load = transports[src].recv(rank, grad_key, grad)
                n = counts[(src, rank)]
                assert torch.equal(back[:n], dx[d, :n]) and torch.equal(load, torch.arange(E) + rank)
                if step == 0:
                    assert (back[n:] == 0).all()
    assert all(t.status_2.tolist() == [0, 0] for t in transports)
    with pytest.raises(ValueError, match="ids and weights together"):
        transports[attention[0]].send_sparse(ranks, key, dy, picked_QT, torch.zeros(len(ranks), T, 2, dtype=torch.int32))


@pytest.mark.parametrize("sources,experts", [(1, 2), (1, 3), (2, 2)], ids=["A1-E2", "A1-E3", "A2-E2"])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_a_sparse_partial_sum_layer_s_combine_and_its_gradient_go_by_peer_stores(interpreted, fake_cuda, monkeypatch,
                                                                                sources, experts, skew):
    """Sparse dispatch with partial sums: COMBINE is `send_counted` with the token index (the first
    count rows of each source's block of partial sums and of its index, the count written into the
    message), COMBINE_GRAD `send_sparse` of the rows alone (dy of the tokens each expert rank
    served, in its dispatch order); one launch for every destination each, nothing past the count
    written, both copies of the slot; skewed routing leaves an expert rank empty."""
    sd = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch")[1]
    from disagmoe.runtime.stages.sparse_dispatch import pick_rows

    launches = _counted_launches(sd, monkeypatch)
    topology = Topology.disaggregated(Layout(sources, experts, 1, 2, 0), SPARSE_SHAPES.num_experts)
    transports = _sparse_transports(topology)
    attention, ranks = list(topology.attention_groups[0]), list(topology.expert_groups[0])
    T, H = SPARSE_SHAPES.tokens, SPARSE_SHAPES.hidden
    combine, combine_grad = (SPARSE_SHAPES.specs(p, True) for p in (Payload.COMBINE, Payload.COMBINE_GRAD))
    gen = torch.Generator().manual_seed(experts + 10 * skew + 100 * sources)
    for step in range(2):
        picked = {src: torch.rand(len(ranks), T, generator=gen) < 0.5 for src in attention}  # the dispatch's
        if skew:
            for picked_QT in picked.values():
                picked_QT[-1] = False
        order = {src: pick_rows(picked_QT) for src, picked_QT in picked.items()}  # (index_QT, count_Q1)
        key = message_key(step, Payload.COMBINE, 0, 0)
        for q, rank in enumerate(ranks):  # every source's partial sums in one launch, blocks in source order
            partial_STH = torch.randn(len(attention), T, H, generator=gen)
            index_ST = torch.stack([order[src][0][q] for src in attention]).to(torch.int32)
            count_S1 = torch.stack([order[src][1][q] for src in attention]).to(torch.int32)
            launches.clear()
            transports[rank].send_counted(attention, key, partial_STH, None, count_S1, [], index_ST=index_ST)
            assert launches == [len(attention)], "one launch for every source"
            for d, src in enumerate(attention):
                rows, index, count = transports[src].recv(rank, key, combine)
                n = int(count_S1[d])
                assert count.tolist() == [n] and torch.equal(rows[:n], partial_STH[d, :n])
                assert torch.equal(index[:n], index_ST[d, :n])
                if step == 0:  # copy 0 of the segment, zero before: nothing past the count was written
                    assert (rows[n:] == 0).all() and (index[n:] == 0).all()
        grad_key = message_key(step, Payload.COMBINE_GRAD, 0, 0)
        for src in attention:
            dy = torch.randn(T, H, generator=gen)
            launches.clear()
            transports[src].send_sparse(ranks, grad_key, dy, picked[src])
            assert launches == [len(ranks)], "one launch for every expert rank"
            for q, rank in enumerate(ranks):
                got, = transports[rank].recv(src, grad_key, combine_grad)
                index_T, n = order[src][0][q], int(order[src][1][q])
                assert torch.equal(got[:n], dy[index_T[:n]]), "dy in the dispatch's order"
                if step == 0:
                    assert (got[n:] == 0).all()
    assert all(t.status_2.tolist() == [0, 0] for t in transports)
    with pytest.raises(ValueError, match="no d w and no extras"):
        transports[ranks[0]].send_counted(attention, key, partial_STH, None, count_S1, [torch.zeros(3)],
                                          index_ST=index_ST)
    with pytest.raises(ValueError, match="do not match the segment's torch.float32"):  # stored by address as they are
        transports[ranks[0]].send_counted(attention, key, partial_STH.double(), None, count_S1, [], index_ST=index_ST)


def test_send_counted_returns_a_subset_of_the_blocks(interpreted, fake_cuda):
    """A colocated expert rank returns the other sources' blocks only (its own goes through the
    mailbox): `blocks` picks them, destination by destination."""
    interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch")
    topology = Topology.disaggregated(Layout(2, 1, 1, 2, 0), SPARSE_SHAPES.num_experts)
    transports = _sparse_transports(topology)
    T, H, K, E = SPARSE_SHAPES.tokens, SPARSE_SHAPES.hidden, SPARSE_SHAPES.top_k, SPARSE_SHAPES.num_experts
    gen = torch.Generator().manual_seed(3)
    dx, dw = torch.randn(3, T, H, generator=gen), torch.randn(3, T, K, generator=gen)
    count_S1 = torch.tensor([[5], [T], [11]], dtype=torch.int32)
    key = message_key(0, Payload.DISPATCH_GRAD, 0, 0)
    transports[2].send_counted([1, 0], key, dx, dw, count_S1, [torch.arange(E)], blocks=[2, 0])
    grad = SPARSE_SHAPES.specs(Payload.DISPATCH_GRAD, True)
    for src, block in ((1, 2), (0, 0)):
        back = transports[src].recv(2, key, grad)
        n = int(count_S1[block])
        assert torch.equal(back[0][:n], dx[block, :n]) and torch.equal(back[1][:n], dw[block, :n])
        assert (back[0][n:] == 0).all() and torch.equal(back[2], torch.arange(E))
    with pytest.raises(ValueError, match="one block per source"):
        transports[2].send_counted([1, 0], key, dx, dw, count_S1, [torch.arange(E)], blocks=[2])


# --- segments shared by several keys (rings, `reuse_order.one_sided_slots`) -------------------------

SHARED_TOPOLOGIES = [TOPOLOGY, Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8), Topology.colocated_ranks(3, 2, 0, 8)]
SHARED_IDS = ["A1-E1", "A2-E2-p2", "colocated3"]
SHARED_RUNS = [TOPOLOGY, Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8),
               pytest.param(Topology.colocated_ranks(3, 2, 0, 8), marks=pytest.mark.slow)]  # 5 s interpreted


def _co_run(transports, topology, passes, first: int = 0) -> tuple[list[str], dict]:
    """Every rank's passes through the CPU transports, each rank run as far as it can before the
    next (a one-sided sender as far ahead of its receiver as the schedule lets it): a receive only
    once its flag is up, an `OptimizerStep` once every rank reached it (the all-reduce). Every
    received message is compared when it arrives and again once its receiver is past the op
    `live_ends` names (waits included: no later message of its ring landed over it); pass k's
    contents are salted with pass number `first` + k. Returns what was wrong and
    (rank, source, slot) -> the addresses its keys were received at."""
    programs = topology.programs(MICRO_BATCHES)
    runs = [[pass_program(p, kind) for kind in passes] for p in programs]
    ends = [[live_ends(ops, r, topology.num_layers) for ops in rank_runs] for r, rank_runs in enumerate(runs)]
    pos, held, at_step, wrong, addresses = [(0, 0)] * len(runs), [[] for _ in runs], set(), [], {}
    specs_of = _specs_of(topology)

    def salt(k, op):
        return message_key(first + k, op.payload, op.layer, op.micro_batch)

    def ready(r: int, k: int, op) -> bool:
        if isinstance(op, OptimizerStep):
            at_step.add((r, k))
            return all((q, k) in at_step or pos[q][0] > k for q in range(len(runs)))
        if not isinstance(op, Recv):
            return True
        t = transports[r]
        for peer in op.peers:
            if peer != r:
                slot = t._index[r].slot(peer, message_key(0, op.payload, op.layer, op.micro_batch), r)
                n = t.message_counts().get(("received", peer, slot), 0) + 1
                flag = t.layout.segment(slot, n - 1).flag
                if int(t._flags_W[flag]) < int(t._consumed_W[flag]) + 1:
                    return False
        return True

    def check(r: int, upto: int) -> None:
        for entry in [e for e in held[r] if e[0] < upto]:
            held[r].remove(entry)
            _, label, got, want = entry
            if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                wrong.append(f"rank {r}: {label} overwritten before its reader was done")

    progress = True
    while progress:
        progress = False
        for r, rank_runs in enumerate(runs):
            while pos[r][0] < len(passes):
                k, i = pos[r]
                op = rank_runs[k][i]
                check(r, i)
                if not ready(r, k, op):
                    break
                for peer in op.peers if isinstance(op, (Send, Recv)) else ():
                    if peer == r:
                        continue
                    specs, key = specs_of(op.payload, op.layer), message_key(k, op.payload, op.layer, op.micro_batch)
                    if isinstance(op, Send):
                        transports[r].send(peer, key, _message(r, salt(k, op), specs))
                    elif isinstance(op, Recv):
                        got, want = transports[r].recv(peer, key, specs), _message(peer, salt(k, op), specs)
                        label = f"pass {first + k} {op.payload.value} L{op.layer} mb{op.micro_batch} from {peer}"
                        if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                            wrong.append(f"rank {r}: {label} arrived wrong")
                        held[r].append((ends[r][k][(peer, op.payload, op.layer, op.micro_batch)], label, got, want))
                        slot = transports[r]._index[r].slot(peer, key, r)
                        addresses.setdefault((r, peer, slot), set()).add(((op.layer, op.micro_batch), got[0].data_ptr()))
                progress = True
                pos[r] = (k, i + 1) if i + 1 < len(rank_runs[k]) else (k + 1, 0)
                if pos[r][1] == 0:
                    check(r, len(rank_runs[k]) + 1)
    stuck = [r for r in range(len(runs)) if pos[r][0] < len(passes)]
    assert not stuck, f"ranks {stuck} never got their messages: {[pos[r] for r in stuck]}"
    return wrong, addresses


@pytest.mark.parametrize("topology", SHARED_RUNS, ids=SHARED_IDS)
def test_keys_sharing_a_ring_deliver_their_own_messages_in_order(topology, fake_cuda, interpreted):
    """(a) Training and evaluation passes through transports whose segments the keys of a pool
    share: every message arrives intact and stays so until its reader is done, though each sender
    runs ahead as far as the schedule lets it; keys of one ring land at the same addresses."""
    interpreted("disagmoe.kernels.signal")
    transports = _cpu_transports(topology, pair_of=None, shared=True)
    wrong, addresses = _co_run(transports, topology, ("train", "eval", "train"))
    assert wrong == []
    assert all(t.status_2.tolist() == [0, 0] for t in transports)
    shared = [(place, keys) for place, keys in addresses.items() if len({k for k, _ in keys}) > len({a for _, a in keys})]
    assert shared, "no two keys were received at one address: nothing shared"


@pytest.mark.parametrize("topology", SHARED_RUNS, ids=SHARED_IDS)
def test_counts_realigned_after_an_evaluation_deliver_every_later_message_intact(topology, fake_cuda, interpreted):
    """(a') A training pass, an evaluation pass (its forward messages move the rings' phase), then
    every rank skips its counts back to the phase its training pass left (`realign`, each on its
    own, as the captured runtime does before its next step) and two more training passes run: every
    message arrives intact and stays so until its reader is done, no wait passes early or times
    out, and the ranks end in the phases of three training passes without the evaluation."""
    interpreted("disagmoe.kernels.signal")
    transports = _cpu_transports(topology, pair_of=None, shared=True)
    reference = _cpu_transports(topology, pair_of=None, shared=True)
    wrong, _ = _co_run(transports, topology, ("train",))
    expected = [t.phase() for t in transports]
    wrong += _co_run(transports, topology, ("eval",), first=1)[0]
    assert [t.phase() for t in transports] != expected, "the evaluation moved no ring: nothing to realign"
    skipped = [t.realign(phase) for t, phase in zip(transports, expected, strict=True)]
    assert any(skipped) and [t.phase() for t in transports] == expected
    for rank, t in enumerate(transports):  # a slot's two ends skip alike
        for (kind, peer, slot), n in skipped[rank].items():
            twin = {"sent": "received", "received": "sent"}[kind]
            assert skipped[peer].get((twin, rank, slot)) == n, (rank, kind, peer, slot)
    wrong += _co_run(transports, topology, ("train", "train"), first=2)[0]
    _co_run(reference, topology, ("train", "train", "train"))
    assert wrong == []
    assert all(t.status_2.tolist() == [0, 0] for t in transports)
    assert [t.phase() for t in transports] == [t.phase() for t in reference]


def test_a_reader_does_not_pass_on_an_earlier_keys_flag(fake_cuda, interpreted):
    """(b) DISPATCH_GRAD from the expert rank: the attention rank's 4 keys (2 layers x 2
    micro-batches) share a ring of m + 1 = 3 segments, so the fourth message lands where the first
    did. With the first three sent and read, a wait for the fourth sees the first's flag (1) and
    does not pass (timed out, one look); once the fourth is sent it passes and reads its rows."""
    signal = interpreted("disagmoe.kernels.signal")
    attention, expert = _cpu_transports(TOPOLOGY, pair_of=None, shared=True)
    program = TOPOLOGY.programs(MICRO_BATCHES)[0]
    grads = [op for op in program if isinstance(op, Recv) and op.payload is Payload.DISPATCH_GRAD]
    keys = [message_key(0, op.payload, op.layer, op.micro_batch) for op in grads]
    slot = attention._index[0].slot(1, keys[0], 0)
    assert [attention._index[0].slot(1, key, 0) for key in keys] == [slot] * 4 and attention.layout.ring(slot) == 3
    specs = _specs(Payload.DISPATCH_GRAD, 1)
    messages = [_message(1, key, specs) for key in keys]
    for key, message in zip(keys[:3], messages, strict=False):
        expert.send(0, key, message)
        assert all(torch.equal(g, w) for g, w in zip(attention.recv(1, key, specs), message, strict=True))
    fourth = attention.layout.segment(slot, 3)
    assert fourth == attention.layout.segment(slot, 0)
    assert int(attention._flags_W[fourth.flag]) == int(attention._consumed_W[fourth.flag]) == 1
    status = signal.new_status("cpu")
    probe = attention._consumed_W.clone()  # a look of its own: the receive below claims the message
    signal._wait_flag_kernel[(1,)](attention._flags_W, probe, status, fourth.flag, 0, TIMED=False)
    assert status.tolist() == [TIMED_OUT, fourth.flag]
    expert.send(0, keys[3], messages[3])
    got = attention.recv(1, keys[3], specs)
    assert all(torch.equal(g, w) for g, w in zip(got, messages[3], strict=True)) and attention.status_2.tolist() == [0, 0]


@pytest.mark.parametrize("topology", SHARED_TOPOLOGIES, ids=SHARED_IDS)
def test_shared_segments_take_fewer_symmetric_bytes(topology):
    """(c) Every rank's segments are the rings `one_sided_slots` gives (one per pool, N segments),
    fewer than two per key, and the symmetric arena shrinks with them."""
    programs = topology.programs(MICRO_BATCHES)
    rings = one_sided_slots(programs, topology.is_moe, topology.num_layers)
    shared = symmetric_layouts(programs, _specs_of(topology), shared=rings)
    alone = symmetric_layouts(programs, _specs_of(topology))
    for rank, (layout, before) in enumerate(zip(shared, alone, strict=True)):
        want = {slot: n for slot, n in rings[rank].values()}
        assert len(layout.segments) == sum(want.values()) < len(before.segments)
        for key, (_, n) in rings[rank].items():
            peer, payload, layer, mb = key
            assert layout.ring(layout.held_by((peer, Payload(payload), layer, mb))) == n
    assert shared[0].nbytes < alone[0].nbytes and shared[0].flag_words < alone[0].flag_words


# --- the phase of a captured step (`comm.counts`) ---------------------------------------------------

@pytest.mark.parametrize("shared", [False, True], ids=["two-copies", "rings"])
def test_a_step_s_phase_comes_back_and_advanced_counts_keep_both_ends_agreeing(fake_cuda, interpreted, shared):
    """One training pass counted on every rank gives the step's counts; the phase comes back after
    the fewest steps that take every slot round its ring (what a graph per phase needs), and
    counts advanced by replayed steps (no message sent: the device did it) keep sender and
    receiver on the same segments: an eager pass afterwards delivers every message intact."""
    import math

    interpreted("disagmoe.kernels.signal")
    transports = _cpu_transports(TOPOLOGY, pair_of=None, shared=shared)
    start = [t.phase() for t in transports]
    before = [t.message_counts() for t in transports]
    wrong, _ = _co_run(transports, TOPOLOGY, ("train",))
    assert wrong == []
    steps = [counts_between(b, t.message_counts()) for b, t in zip(before, transports, strict=True)]
    period = math.lcm(*(t.counts._ring(key) // math.gcd(n, t.counts._ring(key))
                        for t, step in zip(transports, steps, strict=True) for key, n in step.items()))
    assert all(steps) and period == (15 if shared else 2)  # rings of 3 and 5 taking 4 and 2 (1, 3 ...) a step
    for advanced in range(1, 2 * period):  # the replays of the next steps
        if advanced % period:
            assert [t.phase() for t in transports] != start
        else:
            assert [t.phase() for t in transports] == start
        for t, step in zip(transports, steps, strict=True):
            t.advance(step)
    assert [t.phase() for t in transports] == start
    wrong, _ = _co_run(transports, TOPOLOGY, ("train", "eval"))
    assert wrong == [] and all(t.status_2.tolist() == [0, 0] for t in transports)
