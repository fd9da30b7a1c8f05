"""An embedded Ray cluster with three CPU actors: process group, all-reduce, transport, failures.

Ray and three torch-importing actors take most of this module's time, so one cluster serves
every test (module fixture); the failure tests run last because they break the group.
"""

import ipaddress
import os
import socket
import sys
import time

import pytest
import ray
import torch

from disagmoe.comm.base import TensorSpec
from disagmoe.wire import Direction, MessageKey, Recv
from disagmoe.runtime.cluster.cluster import Worker, WorkerFailure, WorkerGroup, _is_loopback as loopback_address, worker_env
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import build_schedule
from disagmoe.runtime.schedule.schedule_sim import simulate

pytestmark = pytest.mark.slow  # starts processes (Ray, gloo) or compiles: the quick subset skips it

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors cannot import tests/

WORLD = 3
ENV = {"DISAGMOE_TEST_SETTING": "propagated"}


@pytest.fixture(scope="module")
def workers():
    # 0.5 CPU each leaves room on a 2-core machine for the failed-start test's extra actor
    group = WorkerGroup.start(
        world_size=WORLD, device="cpu", env=ENV, log_to_driver=False, cpus_per_worker=0.5
    )
    group.init_process_group(timeout_s=60)
    yield group
    group.shutdown()


def _environment(worker, name):
    return os.environ.get(name), os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")


def test_actors_have_ranks_env_and_roles(workers):
    layout = Layout(attention_ranks=2, expert_ranks=1, pipeline_groups=1, num_layers=2)
    workers.call("set_role", per_rank=[layout.role(r) for r in range(WORLD)], timeout_s=30)
    infos = workers.call("info", timeout_s=30)
    assert [i["rank"] for i in infos] == list(range(WORLD))
    assert [i["role"] for i in infos] == [layout.role(r) for r in range(WORLD)]
    assert len({i["pid"] for i in infos}) == WORLD
    assert workers.call("run", _environment, "DISAGMOE_TEST_SETTING") == [("propagated", "1")] * WORLD


def test_worker_env_loads_kernels_eagerly_on_gpus_unless_told_otherwise():
    # lazy loading can synchronise the context mid-step and deadlock pending NCCL sends (cluster.py)
    assert worker_env("cuda", None)["CUDA_MODULE_LOADING"] == "EAGER"
    assert worker_env("cuda", {"CUDA_MODULE_LOADING": "LAZY"})["CUDA_MODULE_LOADING"] == "LAZY"
    assert "CUDA_MODULE_LOADING" not in worker_env("cpu", ENV)
    assert worker_env("cpu", ENV) == {**ENV, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def _seeded(rank):
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def _all_reduce(worker):
    import torch.distributed as dist

    x = _seeded(worker.rank)
    dist.all_reduce(x)
    return x


def test_all_reduce_sums_every_rank(workers):
    want = sum(_seeded(r) for r in range(WORLD))
    for got in workers.call("run", _all_reduce, timeout_s=60):
        torch.testing.assert_close(got, want)


def _rows(src, dst):
    return [torch.arange(src * 10 + dst, dtype=torch.float32).reshape(-1, 1), torch.empty(0, 3)]


def _p2p(worker):
    from disagmoe.comm.local import LocalTransport

    transport = LocalTransport(default_timeout_s=30)
    key = MessageKey(step=0, micro_batch=1, layer=0, direction=Direction.FORWARD)
    peers = [p for p in range(worker.world_size) if p != worker.rank]
    handles = [transport.send(dst, key, _rows(worker.rank, dst)) for dst in peers]
    got = {src: transport.recv(src, key, [TensorSpec.of(t) for t in _rows(src, worker.rank)]) for src in peers}
    for handle in handles:
        handle.wait()
    return got


def test_local_transport_between_actors(workers):
    results = workers.call("run", _p2p, timeout_s=60)
    for dst, got in enumerate(results):
        for src, tensors in got.items():
            want = _rows(src, dst)
            assert [t.shape for t in tensors] == [t.shape for t in want]
            torch.testing.assert_close(tensors[0], want[0])


def _replay(worker, schedule, steps):
    """Run this rank's ops with the local transport; every message names its sender and key."""
    from disagmoe.comm.local import LocalTransport
    from disagmoe.wire import Recv, Send

    transport = LocalTransport(default_timeout_s=30)
    received = 0
    for step in range(steps):
        handles = []
        for op in schedule.programs[worker.rank]:
            if isinstance(op, Send):
                for dst in op.peers:
                    stamp = torch.tensor([worker.rank, dst, step, op.layer, op.micro_batch])
                    handles.append(transport.send(dst, op.key(step), [stamp, torch.empty(0, 8)]))
            elif isinstance(op, Recv):
                for src in op.peers:
                    stamp, rows = transport.recv(src, op.key(step), [TensorSpec((5,), torch.int64),
                                                                     TensorSpec((0, 8), torch.float32)])
                    assert stamp.tolist() == [src, worker.rank, step, op.layer, op.micro_batch]
                    assert rows.shape == (0, 8)
                    received += 1
        for handle in handles:
            handle.wait()
    return received


def test_schedule_runs_over_the_local_transport(workers):
    schedule = build_schedule(Layout(attention_ranks=2, expert_ranks=1, pipeline_groups=1, num_layers=3), 2)
    steps = 2
    got = workers.call("run", _replay, schedule, steps, timeout_s=60)
    assert sum(got) == steps * simulate(schedule).messages
    for rank, count in enumerate(got):
        recvs = [op for op in schedule.programs[rank] if isinstance(op, Recv)]
        assert count == steps * sum(len(op.peers) for op in recvs)


def _listening(pids):
    """(address, port, process name) of every listening TCP socket and bound UDP socket of `pids`."""
    import psutil  # Ray's dependency (importing ray puts its copy on the path)

    found = []
    for conn in psutil.net_connections("inet"):
        if conn.pid in pids and (conn.status == psutil.CONN_LISTEN or conn.type == socket.SOCK_DGRAM):
            found.append((conn.laddr.ip, conn.laddr.port, psutil.Process(conn.pid).name()))
    return found


def _is_loopback(ip):
    address = ipaddress.ip_address(ip)
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _process_tree():
    import psutil

    me = psutil.Process()
    return {me.pid, *(child.pid for child in me.children(recursive=True))}


def test_the_embedded_cluster_listens_on_loopback_only_with_token_auth(workers):
    """Every server of the embedded cluster (GCS, raylet, workers, runtime-env agent), the
    rendezvous store and gloo's pairs, after the process group and the local transport have run,
    listens on loopback; Ray's token authentication is on (DESIGN: nothing open to the network)."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    workers.call("run", _all_reduce, timeout_s=60)
    workers.call("run", _p2p, timeout_s=60)
    pids = _process_tree()
    actors = {info["pid"] for info in workers.call("info", timeout_s=30)}
    assert actors <= pids  # the actors are this process's descendants: their sockets are seen
    listening = _listening(pids)
    assert listening
    exposed = [entry for entry in listening if not _is_loopback(entry[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    assert workers.call("run", _environment, "GLOO_SOCKET_IFNAME")[0][0] in ("lo", "lo0")


def _sleep_on(worker, rank, seconds):
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


def test_slow_rank_is_reported_by_the_step_timeout(workers):
    with pytest.raises(WorkerFailure, match=r"rank 1: run did not finish within 0.5 s") as info:
        workers.call("run", _sleep_on, 1, 2.0, timeout_s=0.5)
    assert info.value.rank == 1
    assert workers.call("run", _sleep_on, 1, 0.0, timeout_s=30) == list(range(WORLD))  # caught up


def _raise_on(worker, rank):
    if worker.rank == rank:
        raise ValueError("bad shard")
    return worker.rank


def test_exception_in_an_actor_names_its_rank(workers):
    with pytest.raises(WorkerFailure, match="rank 0: run raised ValueError: bad shard"):
        workers.call("run", _raise_on, 0, timeout_s=30)


class _BrokenWorker(Worker):
    def __init__(self, rank, world_size, device):
        raise RuntimeError("no such device")


def test_failed_start_is_reported_and_cleaned_up(workers):
    before = ray.available_resources().get("CPU")
    expected = r"rank 0: actor died during info: its constructor raised RuntimeError: no such device \(pid"
    with pytest.raises(WorkerFailure, match=expected):
        WorkerGroup.start(world_size=1, worker_cls=_BrokenWorker, cpus_per_worker=0.25, log_to_driver=False)
    assert ray.is_initialized(), "a cluster it did not start stays up"
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != before and time.monotonic() < deadline:
        time.sleep(0.2)  # placement group removal is asynchronous
    assert ray.available_resources().get("CPU") == before


def _die_or_wait(worker, dying_rank):
    """The dying rank exits; the others wait for a message from it (as in a step)."""
    from disagmoe.comm.local import LocalTransport

    if worker.rank == dying_rank:
        os._exit(7)
    LocalTransport(default_timeout_s=30).recv(dying_rank, MessageKey(0, 0, 0, Direction.FORWARD),
                                              [TensorSpec((1,), torch.float32)])


def test_dying_actor_is_reported_with_its_rank(workers):
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 2: actor died during run: .* \(pid \d+ on ") as info:
        workers.call("run", _die_or_wait, 2, timeout_s=60)
    assert info.value.rank == 2
    assert time.monotonic() - start < 30


def test_shutdown_stops_ray(workers):
    workers.shutdown()
    assert not ray.is_initialized()
    workers.shutdown()  # idempotent


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1:6379", True), ("127.0.0.2:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("10.0.0.5:6379", False), ("head.example:6379", False), ("auto", False),
])
def test_a_loopback_ray_address_is_joined_on_loopback(address, loopback):
    assert loopback_address(address) is loopback
