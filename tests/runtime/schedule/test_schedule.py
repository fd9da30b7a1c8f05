import itertools
from collections import Counter

import pytest

from disagmoe.runtime.schedule.roles import ColocatedLayout, Layout
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertForward,
    build_schedule,
)
from disagmoe.wire import Payload, Recv, Send, message_key
from disagmoe.runtime.schedule.schedule_sim import simulate
from disagmoe.runtime.topology import Topology

GRID = [
    (a_per_group * p, e, p, layers, m, dense)
    for a_per_group, p, m in itertools.product(range(1, 4), range(1, 4), range(1, 5))
    for e in range(p, p + 3)  # includes uneven expert splits over groups
    for layers in (p, 2 * p + 1)
    for dense in (0, 1)
]
COLOCATED_GRID = [  # (ranks, p, layers, m, dense): 1-3 ranks a group
    (per_group * p, p, layers, m, dense)
    for per_group, p, m in itertools.product(range(1, 4), range(1, 4), range(1, 5))
    for layers in (p, 2 * p + 1)
    for dense in (0, 1)
]


@pytest.mark.parametrize("attention, experts, p, layers, m, dense", GRID)
def test_schedule_replays_without_deadlock_and_matches_every_message(attention, experts, p, layers, m, dense):
    _replays_in_order(Layout(attention, experts, p, layers, num_dense_layers=dense), m)


@pytest.mark.parametrize("ranks, p, layers, m, dense", COLOCATED_GRID)
def test_colocated_schedule_replays_without_deadlock_and_matches_every_message(ranks, p, layers, m, dense):
    _replays_in_order(ColocatedLayout(ranks, p, layers, num_dense_layers=dense), m)


def _replays_in_order(layout, m):
    schedule = build_schedule(layout, m)
    result = simulate(schedule)  # raises ScheduleError on any unsound schedule
    sends = [(r, op) for r, prog in enumerate(schedule.programs) for op in prog if isinstance(op, Send)]
    assert result.messages == sum(len(op.peers) for _, op in sends)
    assert result.out_of_order_recvs == 0  # an in-order (FIFO per rank pair and lane) transport suffices


def _messages(schedule, kind):
    """Counter of (src, dst, transport key) over all Send (or Recv) ops, seen from the sender."""
    out = Counter()
    for rank, program in enumerate(schedule.programs):
        for op in program:
            if isinstance(op, kind):
                for peer in op.peers:
                    src, dst = (rank, peer) if kind is Send else (peer, rank)
                    out[(src, dst, message_key(7, op.payload, op.layer, op.micro_batch), op.payload)] += 1
    return out


@pytest.mark.parametrize("layout, m", [(Layout(2, 3, 1, 3), 2), (Layout(4, 3, 2, 5), 3), (Layout(3, 5, 3, 7), 2),
                                       (ColocatedLayout(3, 1, 3), 2), (ColocatedLayout(4, 2, 5), 3),
                                       (ColocatedLayout(6, 3, 7), 2), (ColocatedLayout(2, 2, 2), 1)])
def test_keys_are_unique_per_rank_pair_and_each_send_has_one_recv(layout, m):
    """Colocated p > 1 included: A_g,d sends COMBINE and RESIDUAL of one layer to A_(g+1),d."""
    schedule = build_schedule(layout, m)
    sends, recvs = _messages(schedule, Send), _messages(schedule, Recv)
    assert sends == recvs
    assert set(sends.values()) == {1}
    transport_keys = Counter((src, dst, key) for src, dst, key, _ in sends)
    assert set(transport_keys.values()) == {1}, "two payloads share one transport key"


def test_dispatch_is_all_to_all_and_combine_keeps_the_data_parallel_index():
    layout = Layout(attention_ranks=4, expert_ranks=3, pipeline_groups=2, num_layers=4)
    schedule = build_schedule(layout, micro_batches=2)
    for rank, program in enumerate(schedule.programs):
        role = layout.role(rank)
        for op in program:
            if not isinstance(op, Send):
                continue
            nxt = layout.next_group(role.group)
            if op.payload is Payload.DISPATCH:
                assert op.peers == layout.expert_group(role.group)
            elif op.payload is Payload.COMBINE:
                assert op.peers == layout.attention_group(nxt)
            elif op.payload is Payload.RESIDUAL:
                assert op.peers == (layout.attention_rank(nxt, role.index),)
            elif op.payload is Payload.RESIDUAL_GRAD:
                assert op.peers == (layout.attention_rank(layout.prev_group(role.group), role.index),)


@pytest.mark.parametrize("per_group, p", [(1, 2), (2, 2), (3, 2), (2, 3), (3, 3)])
def test_colocated_groups_are_the_ring_whose_experts_are_the_attention_ranks(per_group, p):
    """DISPATCH stays in group g, COMBINE goes to group g+1, RESIDUAL to A_(g+1),d, and the
    gradients go back the same edges; the data-parallel sum stays in the optimizer step."""
    from disagmoe.runtime.schedule.schedule import OptimizerStep, ReduceGradients

    layout = ColocatedLayout(per_group * p, p, 2 * p + 1, num_dense_layers=1)
    for rank, program in enumerate(build_schedule(layout, 2).programs):
        group, d = layout.role(rank).group, layout.role(rank).index
        own, nxt, prev = (layout.attention_group(g) for g in (group, layout.next_group(group), layout.prev_group(group)))
        expected = {
            Payload.DISPATCH: own, Payload.DISPATCH_GRAD: own, Payload.COMBINE: nxt, Payload.COMBINE_GRAD: prev,
            Payload.RESIDUAL: (nxt[d],), Payload.RESIDUAL_GRAD: (prev[d],),
        }
        for op in program:
            if isinstance(op, Send):
                assert op.peers == expected[op.payload], (rank, op)
        assert not any(isinstance(op, ReduceGradients) for op in program)
        assert program[-1] == OptimizerStep(own)


def test_attention_order_is_layer_major_forward_and_reversed_backward():
    layout = Layout(attention_ranks=1, expert_ranks=1, pipeline_groups=1, num_layers=3)
    program = build_schedule(layout, micro_batches=3).programs[0]
    forward = [(op.layer, op.micro_batch) for op in program if isinstance(op, AttentionForward)]
    backward = [(op.layer, op.micro_batch) for op in program if isinstance(op, AttentionBackward)]
    assert forward == sorted(forward)
    assert backward == sorted(backward, key=lambda lm: (-lm[0], lm[1]))


def test_attention_computes_next_micro_batch_while_experts_compute_this_one():
    layout = Layout(attention_ranks=1, expert_ranks=1, pipeline_groups=1, num_layers=2)
    m = 3
    result = simulate(build_schedule(layout, m))
    start = {(e.rank, e.op): e.start for e in result.events}
    for layer, mb in itertools.product(range(2), range(m - 1)):
        assert start[(1, ExpertForward(layer, mb))] == start[(0, AttentionForward(layer, mb + 1))]


def test_micro_batches_must_be_positive():
    with pytest.raises(ValueError, match="micro_batches"):
        build_schedule(Layout(1, 1, 1, 1), 0)


def test_rank_pairs_are_exactly_the_ring_edges():
    layout = Layout(attention_ranks=2, expert_ranks=2, pipeline_groups=2, num_layers=2)
    pairs = set(build_schedule(layout, micro_batches=1).rank_pairs())
    a0, a1, e0, e1 = 0, 1, 2, 3  # one attention and one expert rank per group
    forward = {(a0, e0), (e0, a1), (a0, a1), (a1, e1), (e1, a0), (a1, a0)}
    assert pairs == forward | {(dst, src) for src, dst in forward}


def test_data_parallel_groups_start_each_layers_gradient_sum_after_its_last_backward():
    from disagmoe.runtime.schedule.schedule import AttentionBackward, Loss, ReduceGradients

    layout = Layout(attention_ranks=4, expert_ranks=2, pipeline_groups=2, num_layers=4)
    programs = build_schedule(layout, 3).programs
    for rank in range(layout.world_size):
        program = programs[rank]
        reduces = [i for i, op in enumerate(program) if isinstance(op, ReduceGradients)]
        role = layout.role(rank)
        if role.kind.value != "attention":
            assert not reduces
            continue
        layers = [program[i].layer for i in reduces]
        own = sorted(range(role.group, 4, 2), reverse=True)
        assert layers == ([4] if role.group == layout.head_group else []) + own
        for i in reduces:
            op = program[i]
            last = max(j for j, o in enumerate(program)
                       if (isinstance(o, AttentionBackward) and o.layer == op.layer) or (isinstance(o, Loss) and op.layer == 4))
            assert last < i and op.peers == layout.attention_group(role.group)
    single = build_schedule(Layout(attention_ranks=1, expert_ranks=1, pipeline_groups=1, num_layers=2), 2).programs
    assert not any(isinstance(op, ReduceGradients) for program in single for op in program)


def _channel_orders(programs):
    """Per (src, dst, lane): the keys in the order the sender sends them and the receiver asks."""
    from disagmoe.wire import lane_of

    sent, asked = {}, {}
    for rank, program in enumerate(programs):
        for op in program:
            if isinstance(op, (Send, Recv)):
                key = message_key(7, op.payload, op.layer, op.micro_batch)
                for peer in op.peers:
                    if peer == rank:
                        continue
                    src, dst, box = (rank, peer, sent) if isinstance(op, Send) else (peer, rank, asked)
                    box.setdefault((src, dst, lane_of(key)), []).append(key)
    return sent, asked


@pytest.mark.parametrize("colocated, ranks, m", [(c, n, m) for c in (0, 1, 2, 3) for n in (2, 3, 4) for m in (1, 2, 4)])
def test_every_channel_of_an_in_order_transport_receives_in_send_order(colocated, ranks, m):
    """The nccl transport is FIFO per (rank pair, lane): every layout must receive each
    channel's messages in the order they were sent (colocated too, whose pairs carry dispatch
    and combine messages interleaved: they travel on separate lanes; with `colocated` = p
    pipeline groups of `ranks` ranks each, p = 2 carries both ways on the same pairs)."""
    from disagmoe.runtime.schedule.colocated import build_colocated_schedule

    if colocated:
        programs = build_colocated_schedule(ranks * colocated, 4, 1, m, pipeline_groups=colocated)
    else:
        programs = build_schedule(Layout(ranks, ranks - 1 or 1, 1, 4, num_dense_layers=1), m).programs
    sent, asked = _channel_orders(programs)
    assert sent == asked


@pytest.mark.parametrize("payload", list(Payload))
def test_a_schedule_ops_key_is_the_transports_key_with_its_lane(payload):
    """`Send.key` / `Recv.key` are `message_key`'s: COMBINE[_GRAD]'s lane bit too, so a colocated
    rank pair's DISPATCH and COMBINE of one layer never share a key."""
    for op in (Send(payload, 3, 1, (0,)), Recv(payload, 3, 1, (0,))):
        assert op.key(7) == message_key(7, payload, 3, 1)


BLOCKED = [  # (name, topology): colocated EP blocks and disaggregated replica sets, every source feeding one;
    # "-load": the router needs the global load, so the blocks swap theirs (EXPERT_LOAD)
    *((f"colocated{n * p}-p{p}-blocks{sets}-L{layers}{'-load' if load else ''}",
       Topology.colocated_ranks(n * p, layers, 1, 8, pipeline_groups=p, sets=sets, global_load=load))
      for n, p, sets in ((4, 1, 2), (4, 2, 2), (6, 1, 3), (6, 2, 2), (4, 3, 4)) for layers in (p + 1, 2 * p + 1)
      for load in (False, True)),
    *((f"A{a}-E{e}-p{p}-sets{sets}{'-load' if load else ''}",
       Topology.disaggregated(Layout(a, e, p, 2 * p + 1, 1), 8, sets=sets, global_load=load))
      for a, e, p, sets in ((2, 2, 1, 2), (4, 4, 2, 2), (3, 6, 1, 3), (1, 4, 1, 2)) for load in (False, True)),
]


def _layout_of(topology):
    if topology.layout is not None:
        return topology.layout
    return ColocatedLayout(topology.world_size, topology.pipeline_groups, topology.num_layers, topology.num_dense_layers)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("name,topology", BLOCKED, ids=[name for name, _ in BLOCKED])
def test_schedules_in_blocks_replay_without_deadlock_and_receive_in_send_order(name, topology, m):
    schedule = build_schedule(_layout_of(topology), m, topology.served, topology.load_peers)
    assert schedule.programs == topology.programs(m)
    result = simulate(schedule)
    assert result.messages == sum(len(op.peers) for p in schedule.programs for op in p if isinstance(op, Send))
    assert result.out_of_order_recvs == 0
    sent, asked = _channel_orders(schedule.programs)
    assert sent == asked


@pytest.mark.parametrize("global_load", [False, True])
@pytest.mark.parametrize("per_group, p, sets", [(4, 1, 2), (6, 1, 3), (4, 2, 2), (6, 3, 2)])
def test_a_colocated_ranks_expert_messages_reach_exactly_its_block(per_group, p, sets, global_load):
    """Every DISPATCH (and its gradient) of a rank goes to, and comes from, exactly the ranks of its
    own EP block (block c: the group's ranks c, c + sets, ...); every COMBINE (and its gradient) to
    and from exactly the same block of the neighbouring group (p = 1: its own). Under the global load
    (an aux loss) too, where its load goes to and comes from the rank at its position in each other
    block of its group, once per MoE layer and micro-batch, and to no one without it."""
    topology = Topology.colocated_ranks(per_group * p, 2 * p + 1, 1, 8, pipeline_groups=p, sets=sets,
                                        global_load=global_load)

    def block(group: int, rank: int) -> set[int]:
        index = rank % per_group
        return {group * per_group + index % sets + sets * j for j in range(per_group // sets)}

    for rank, program in enumerate(topology.programs(2)):
        group = rank // per_group
        peers: dict[Payload, set[int]] = {}
        for op in program:
            if isinstance(op, (Send, Recv)) and op.payload not in (Payload.RESIDUAL, Payload.RESIDUAL_GRAD):
                peers.setdefault(op.payload, set()).update(op.peers)
        neighbours = block((group + 1) % p, rank) | block((group - 1) % p, rank)  # sent to, received from
        assert peers[Payload.DISPATCH] == peers[Payload.DISPATCH_GRAD] == block(group, rank)
        for payload in (Payload.COMBINE, Payload.COMBINE_GRAD):
            assert peers[payload] == neighbours, (rank, payload)
        row = group * per_group + sets * ((rank % per_group) // sets)  # the blocks' ranks at this rank's position
        counterparts = {row + c for c in range(sets)} - {rank}
        swaps = [op for op in program if isinstance(op, (Send, Recv)) and op.payload is Payload.EXPERT_LOAD]
        moe_layers = sum(topology.is_moe(layer) for layer in topology.layers_of_group(group))
        assert len(swaps) == (2 * moe_layers * 2 if global_load and sets > 1 else 0)
        assert all(set(op.peers) == counterparts for op in swaps)
