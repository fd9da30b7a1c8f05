import dataclasses

import pytest

from disagmoe.runtime.schedule.roles import ColocatedLayout, Layout
from disagmoe.runtime.schedule.schedule import (
    AttentionForward,
    ExpertForward,
    OptimizerStep,
    ReduceGradients,
    build_schedule,
)
from disagmoe.wire import Payload, Recv, Send
from disagmoe.runtime.schedule.schedule_sim import ScheduleError, render_timeline, simulate


def _schedule(a=1, e=1, p=1, layers=2, m=2):
    return build_schedule(Layout(a, e, p, layers), m)


def _edit(schedule, rank, edit):
    programs = list(schedule.programs)
    programs[rank] = tuple(edit(list(programs[rank])))
    return dataclasses.replace(schedule, programs=tuple(programs))


def test_swapped_recv_order_is_a_deadlock():
    schedule = _schedule(layers=2, m=1)
    expert = 1

    def swap_dispatch_recvs(ops):
        i, j = [k for k, op in enumerate(ops) if isinstance(op, Recv) and op.payload is Payload.DISPATCH]
        ops[i], ops[j] = ops[j], ops[i]
        return ops

    with pytest.raises(ScheduleError, match="deadlock.*rank 1 .*waiting for rank\\(s\\) \\[0\\]"):
        simulate(_edit(schedule, expert, swap_dispatch_recvs))


def test_compute_before_its_recv_is_caught():
    schedule = _schedule()

    def expert_before_recv(ops):
        i = next(k for k, op in enumerate(ops) if isinstance(op, ExpertForward))
        ops.insert(i - 1, ops.pop(i))
        return ops

    with pytest.raises(ScheduleError, match="before its input dispatch"):
        simulate(_edit(schedule, 1, expert_before_recv))


def test_send_without_recv_is_caught():
    schedule = _schedule()
    extra = Send(Payload.RESIDUAL, 0, 0, (1,))
    with pytest.raises(ScheduleError, match="never received"):
        simulate(_edit(schedule, 0, lambda ops: ops[:-1] + [extra, ops[-1]]))


def test_key_sent_twice_is_caught():
    schedule = _schedule()

    def duplicate_first_send(ops):
        i = next(k for k, op in enumerate(ops) if isinstance(op, Send))
        return ops[: i + 1] + [ops[i]] + ops[i + 1 :]

    with pytest.raises(ScheduleError, match="twice"):
        simulate(_edit(schedule, 0, duplicate_first_send))


def test_dropped_forward_is_caught():
    schedule = _schedule(layers=1, m=1)
    with pytest.raises(ScheduleError):
        simulate(_edit(schedule, 0, lambda ops: [op for op in ops if not isinstance(op, AttentionForward)]))


def test_mismatched_optimizer_peers_deadlock():
    schedule = _schedule(a=2)  # ranks 0 and 1 are data-parallel attention replicas
    wrong_peers = _edit(schedule, 1, lambda ops: ops[:-1] + [OptimizerStep((0, 1, 2))])
    with pytest.raises(ScheduleError, match="deadlock.*OptimizerStep"):
        simulate(wrong_peers)


def test_timeline_has_a_row_per_rank_showing_its_ops():
    schedule = _schedule(a=2, e=2, layers=2, m=2)
    result = simulate(schedule)
    rows = render_timeline(schedule, result).splitlines()
    assert len(rows) == schedule.layout.world_size
    assert rows[0].lstrip().startswith("A0.0") and rows[2].lstrip().startswith("E0.0")
    assert "a1:1" in rows[0] and "e1:1" in rows[2] and "e1:1" not in rows[0]
    for rank in range(schedule.layout.world_size):
        assert 0 < result.busy_fraction(rank) <= 1


def test_receives_that_overtake_older_messages_are_counted():
    schedule = _schedule(layers=1, m=2)
    assert simulate(schedule).out_of_order_recvs == 0

    def experts_take_micro_batch_1_first(ops):
        return ops[3:6] + ops[0:3] + ops[6:]  # [recv, expert forward, send] blocks of mb 0 and 1

    assert [type(op).__name__ for op in schedule.programs[1][:3]] == ["Recv", "ExpertForward", "Send"]
    result = simulate(_edit(schedule, 1, experts_take_micro_batch_1_first))
    assert result.out_of_order_recvs == 2  # expert takes dispatch 1 before 0, attention combine 0 before 1


def test_a_colocated_rank_runs_both_jobs_of_its_own_group_only():
    schedule = build_schedule(ColocatedLayout(ranks=2, pipeline_groups=2, num_layers=2), 1)
    assert simulate(schedule).out_of_order_recvs == 0  # rank 0 is A0.0 and E0.0, rank 1 A1.0 and E1.0

    def run_group_1s_experts(ops):
        return [ExpertForward(1, 0) if op == ExpertForward(0, 0) else op for op in ops]

    with pytest.raises(ScheduleError, match="rank 0 is A0.0 but ExpertForward.* expert rank of group 1"):
        simulate(_edit(schedule, 0, run_group_1s_experts))


def test_a_colocated_rank_may_sum_its_attention_gradients():
    schedule = build_schedule(ColocatedLayout(ranks=2, pipeline_groups=1, num_layers=2), 1)
    reduce = ReduceGradients(0, (0, 1))
    for rank in (0, 1):
        schedule = _edit(schedule, rank, lambda ops: ops[:-1] + [reduce, ops[-1]])
    simulate(schedule)
