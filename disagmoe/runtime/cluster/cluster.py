"""The control plane: a Ray cluster, one worker actor per GPU (or CPU slot), failure reporting.

    group = WorkerGroup.start(world_size=3, device="cpu", env=cfg.env)   # embedded Ray cluster
    group.init_process_group()                      # torch.distributed across the actors
    group.call("set_role", per_rank=roles)          # one argument per rank
    losses = group.call("train_step", step)         # raises WorkerFailure naming the rank
    group.shutdown()

`address=None` starts an embedded single-node cluster with every listener on loopback (Ray's
servers: see `_local_only_ray`; the rendezvous store: `rendezvous_store`; gloo: GLOO_SOCKET_IFNAME
in `worker_env`), no dashboard, and Ray's token authentication on (its default for a new local
cluster); "auto" or "HOST:PORT" joins a running one (README: what a joined cluster exposes; a
loopback HOST, a cluster of nodes on this host started with `--node-ip-address=127.0.0.1`, is
joined on loopback, see `_local_only_ray`). Actors sit in placement groups: one STRICT_PACK group per node
on GPUs (a bundle per GPU; with `ranks_per_gpu` = k, k actors share each bundle, rank r on GPU
r // k, and the process group uses gloo: `runtime.cluster.sharing`), a single group on the local
node for CPU slots (fractional CPUs, so several actors share a core). Every actor gets `env` (TrainConfig.env) through its runtime_env
and sees every GPU of its node (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, DESIGN section 5);
it selects the one Ray assigned to it. GPU actors also load every CUDA kernel when their CUDA
context starts (CUDA_MODULE_LOADING=EAGER, see `worker_env`) unless `env` says otherwise.
Tensors never travel through here: only control calls.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from disagmoe.comm.base import TransportError
from disagmoe.runtime.cluster.connect import embedded_temp_dir, remove_embedded_temp_dir, signals_deferred
from disagmoe.runtime.cluster.sharing import gpu_of, gpu_share, gpus_needed
from disagmoe.runtime.schedule.roles import Role

Device = Literal["cpu", "cuda"]
LOOPBACK = "127.0.0.1"
NOSET_CUDA = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
# Lazy kernel loading (CUDA's default) may synchronise the whole CUDA context the first time a
# kernel runs. A rank whose NCCL send is still waiting for the peer to post the receive then
# waits for that send, and the peer, doing the same, never posts it: both ranks hang inside an
# ordinary kernel launch. Seen on 2 x H200 (configs/h200x2-small.yaml, 33 MB dispatches; the
# watchdog showed one rank stuck in a combine einsum, the other in a grouped GEMM) and gone
# with eager loading, which costs about 3 s of start-up per actor.
GPU_DEFAULT_ENV = {"CUDA_MODULE_LOADING": "EAGER"}
FAILURE_GRACE_S = 5.0  # after a first failure, how long to wait for the other ranks' outcomes


def worker_env(device: Device, env: dict[str, str] | None, embedded: bool = False) -> dict[str, str]:
    """Every actor's environment variables: the GPU defaults (on cuda), gloo on the loopback
    interface (embedded cluster), then `env`, then NOSET_CUDA."""
    defaults = GPU_DEFAULT_ENV if device == "cuda" else {}
    if embedded:
        defaults = {**defaults, "GLOO_SOCKET_IFNAME": loopback_interface()}
    return {**defaults, **(env or {}), **NOSET_CUDA}


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 ('lo' on Linux, 'lo0' on macOS)."""
    import psutil  # a Ray dependency (importing ray puts its copy on the path)

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def rendezvous_store(host: str, port: int, is_master: bool, world_size: int,
                     timeout: timedelta) -> dist.TCPStore:
    """torch.distributed's key-value store for the rendezvous. Its server (rank 0) listens on
    `host` only: torch's own binds every interface, and the store has no authentication."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(world_size, 128))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())


class WorkerFailure(RuntimeError):
    """A worker actor died, raised, or did not answer in time; `rank` says which."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Worker:
    """Base of every actor: knows its rank and device, joins torch.distributed, holds a role.

    Role-specific training logic lives in subclasses; `WorkerGroup` wraps the class with
    `ray.remote` itself, so subclasses stay plain Python classes.
    """

    def __init__(self, rank: int, world_size: int, device: Device) -> None:
        self.rank = rank
        self.world_size = world_size
        self.role: Role | None = None
        if device == "cuda":
            self.device = torch.device("cuda", _assigned_gpu())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(host=self.node_ip())

    def init_process_group(self, master_addr: str, master_port: int, timeout_s: float,
                           backend: str | None = None) -> None:
        """Join the run's process group: `backend` nccl on a GPU, gloo on CPU by default (gloo on
        GPUs too where ranks share them: NCCL refuses two ranks on one device)."""
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend or ("nccl" if self.device.type == "cuda" else "gloo"),
            store=rendezvous_store(master_addr, master_port, self.rank == 0, self.world_size, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )

    def set_role(self, role: Role) -> None:
        self.role = role

    def info(self) -> dict[str, Any]:
        return dict(rank=self.rank, pid=os.getpid(), node_ip=self.node_ip(), device=str(self.device),
                    role=self.role)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(self, *args)` here: diagnostics and tests without a subclass per probe."""
        return fn(self, *args)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _assigned_gpu() -> int:
    """The local CUDA index of the GPU Ray assigned to this actor (all GPUs stay visible)."""
    ids = [str(i) for i in ray.get_gpu_ids()]
    if len(ids) != 1:
        raise RuntimeError(f"a GPU worker needs exactly one GPU from Ray, got {ids}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(ids[0]) if visible else int(ids[0])


class WorkerGroup:
    """The driver's handle on one actor per rank; every call reports failures by rank."""

    def __init__(self, actors: list[ray.actor.ActorHandle], groups: list[PlacementGroup],
                 owns_ray: bool, embedded: bool, ranks_per_gpu: int = 1) -> None:
        self.actors = actors
        self._groups = groups
        self._owns_ray = owns_ray
        self._embedded = embedded
        self.ranks_per_gpu = ranks_per_gpu

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @classmethod
    def start(
        cls,
        world_size: int,
        device: Device = "cpu",
        env: dict[str, str] | None = None,
        address: str | None = None,
        worker_cls: type[Worker] = Worker,
        cpus_per_worker: float | None = None,
        ready_timeout_s: float = 120.0,
        log_to_driver: bool = True,
        ranks_per_gpu: int = 1,
    ) -> WorkerGroup:
        """Connect to (or start) Ray and create `world_size` actors of `worker_cls`; on cuda,
        `ranks_per_gpu` of them share each GPU (`runtime.cluster.sharing`)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        if ranks_per_gpu < 1 or (ranks_per_gpu > 1 and device != "cuda"):
            raise ValueError(f"ranks_per_gpu={ranks_per_gpu}: GPUs are shared by 1 or more ranks, on cuda only")
        owns_ray = _connect(address, device, log_to_driver)
        embedded = owns_ray and address is None
        try:
            if cpus_per_worker is None:
                total = ray.cluster_resources().get("CPU", 1.0)
                cpus_per_worker = 1.0 if device == "cuda" else min(1.0, total / world_size)
            groups, slots = _placement_groups(world_size, device, cpus_per_worker, ready_timeout_s, ranks_per_gpu)
            remote_cls = ray.remote(worker_cls)
            actors = []
            for rank, (group, bundle) in enumerate(slots):
                options = dict(
                    num_cpus=cpus_per_worker,
                    num_gpus=gpu_share(ranks_per_gpu) if device == "cuda" else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=bundle
                    ),
                    runtime_env={"env_vars": worker_env(device, env, embedded)},
                    max_restarts=0,
                )
                actors.append(remote_cls.options(**options).remote(rank, world_size, device))
        except BaseException:
            if owns_ray:
                ray.shutdown()
            raise
        workers = cls(actors, groups, owns_ray, embedded=embedded, ranks_per_gpu=ranks_per_gpu)
        try:
            workers.call("info", timeout_s=ready_timeout_s)  # every actor constructed, or a clear failure
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def init_process_group(self, timeout_s: float = 120.0) -> tuple[str, int]:
        """Join every actor into one torch.distributed group; returns the rendezvous address."""
        if self._embedded:
            addr, port = LOOPBACK, free_port()
        else:
            addr, port = self.call_rank(0, "node_ip", timeout_s=timeout_s), self.call_rank(0, "free_port")
        backend = "gloo" if self.ranks_per_gpu > 1 else None  # NCCL refuses ranks sharing a GPU
        self.call("init_process_group", addr, port, timeout_s, backend, timeout_s=timeout_s)
        return addr, port

    def call(self, method: str, *args: Any, per_rank: Sequence[Any] | None = None,
             timeout_s: float | None = None, after_submit: Callable[[], None] | None = None) -> list[Any]:
        """Call `method(*args)` on every actor (`per_rank[r]` appended for rank r); results by rank.

        Returns once all finish; raises `WorkerFailure` naming a rank on the first failure (after
        a short grace period that finds the root cause: see `_root_cause`) or on the timeout.
        `after_submit` runs once every call is on its way (fault injection kills a rank there).
        """
        if per_rank is not None and len(per_rank) != self.world_size:
            raise ValueError(f"per_rank has {len(per_rank)} entries for {self.world_size} ranks")
        futures = [
            getattr(actor, method).remote(*args, *(() if per_rank is None else (per_rank[rank],)))
            for rank, actor in enumerate(self.actors)
        ]
        if after_submit is not None:
            after_submit()
        return self._gather(futures, method, timeout_s)

    def call_rank(self, rank: int, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self._gather([getattr(self.actors[rank], method).remote(*args)], method, timeout_s, [rank])[0]

    def _gather(self, futures: list[ray.ObjectRef], method: str, timeout_s: float | None,
                ranks: list[int] | None = None) -> list[Any]:
        ranks = ranks if ranks is not None else list(range(len(futures)))
        rank_of = {ref: rank for ref, rank in zip(futures, ranks)}
        results: dict[int, Any] = {}
        failures: dict[int, tuple[int, str]] = {}  # rank -> (severity, reason)
        pending = list(futures)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending and not failures:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = sorted(rank_of[ref] for ref in pending)
                raise WorkerFailure(late[0], f"{method} did not finish within {timeout_s:g} s "
                                             f"(ranks still running: {late})")
            self._collect(ready, rank_of, method, results, failures)
        if failures:
            # Peers of a rank that died or raised fail soon after with transport errors; wait
            # briefly for them so the report leads with the cause, not the symptoms.
            if pending:
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
                self._collect(ready, rank_of, method, results, failures)
            raise _root_cause(failures)
        return [results[rank] for rank in ranks]

    @staticmethod
    def _collect(ready: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int], method: str,
                 results: dict[int, Any], failures: dict[int, tuple[int, str]]) -> None:
        for ref in ready:
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref)
            except RayActorError as err:
                failures[rank] = (0, f"actor died during {method}: {_actor_death(err)}")
            except RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                severity = 2 if isinstance(cause, TransportError) else 1
                failures[rank] = (severity, f"{method} raised {type(cause).__name__}: {cause}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close process groups, stop the actors, free the placement groups (and Ray if ours)."""
        if not ray.is_initialized():
            return
        closing = [actor.close.remote() for actor in self.actors]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for group in self._groups:
            remove_placement_group(group)
        self.actors, self._groups = [], []
        if self._owns_ray:
            session = _session_dir()
            ray.shutdown()
            if session is not None:  # an embedded cluster's logs and sockets: gone with it
                shutil.rmtree(session, ignore_errors=True)
            remove_embedded_temp_dir()


def _session_dir() -> Path | None:
    """The running Ray node's session folder (under /tmp/ray), if Ray says where it is (a private
    attribute of Ray 2.60; None if that moves)."""
    node = getattr(getattr(ray._private.worker, "global_worker", None), "node", None)
    path = getattr(node, "get_session_dir_path", lambda: None)()
    return Path(path) if path else None


def _root_cause(failures: dict[int, tuple[int, str]]) -> WorkerFailure:
    """The most telling failure (a death, then an exception, then a transport error), others listed."""
    order = sorted(failures, key=lambda rank: (failures[rank][0], rank))
    first = order[0]
    reason = failures[first][1]
    if len(order) > 1:
        reason += "; then " + "; ".join(f"rank {rank}: {failures[rank][1]}" for rank in order[1:])
    return WorkerFailure(first, reason)


def _actor_death(err: RayActorError) -> str:
    """What killed the actor, in one line, with its process and host when Ray names them."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(err).__name__]
    pid, ip = re.search(r"pid[=:] ?(\d+)", text), re.search(r"\bip[=:] ?([\w.:-]+)", text)
    where = f" (pid {pid[1]} on {ip[1].rstrip(',')})" if pid and ip else ""
    if "creation task" in lines[0]:  # the constructor raised: the last line is the exception
        return f"its constructor raised {lines[-1]}{where}"
    return f"{lines[0]}{where}"


def _connect(address: str | None, device: Device, log_to_driver: bool) -> bool:
    """Start an embedded cluster (address None) or join one; True if this call started Ray."""
    if ray.is_initialized():
        return False
    if address is None:
        with signals_deferred(_shutdown_embedded), _local_only_ray():  # a signal mid-start orphans nothing
            ray.init(
                address="local",
                _node_ip_address=LOOPBACK,
                _temp_dir=embedded_temp_dir(),  # its own, removed at shutdown (runtime/cluster/connect.py)
                include_dashboard=False,
                log_to_driver=log_to_driver,
                num_gpus=None if device == "cuda" else 0,
            )
    else:  # a cluster whose GCS is on loopback: its nodes are on this host and on loopback too
        with signals_deferred(ray.shutdown), _local_only_ray() if _is_loopback(address) else nullcontext():
            ray.init(address=address, log_to_driver=log_to_driver)
    return True


def _shutdown_embedded() -> None:
    ray.shutdown()
    remove_embedded_temp_dir()


def _is_loopback(address: str) -> bool:
    """Whether `HOST:PORT` names a loopback host (ray.init would replace it with the host's
    address, and the driver would then not find its node among the cluster's loopback ones)."""
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def _local_only_ray() -> Iterator[None]:
    """Ray's switch for a local-only node, on for one `ray.init`, so every server of the embedded
    cluster listens on 127.0.0.1. ray.init turns a loopback `_node_ip_address` into the host's
    address unless Ray clusters are disabled (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on
    macOS and Windows); with that address its gRPC servers (GCS, raylet, every worker) listen on
    all interfaces and its runtime-env agent on the host's address. The variable reaches the
    processes Ray starts; `ray_constants` read it when ray was imported, so it is set there too.
    tests/runtime/cluster/test_cluster.py checks the listening sockets."""
    from ray._private import ray_constants

    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


def _placement_groups(world_size: int, device: Device, cpus_per_worker: float, timeout_s: float,
                      ranks_per_gpu: int = 1) -> tuple[list[PlacementGroup], list[tuple[PlacementGroup, int]]]:
    """Placement groups and, per rank, its (group, bundle index) slot: on cuda a bundle per GPU,
    shared by `ranks_per_gpu` consecutive ranks."""
    if device == "cuda":
        per_node = max((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["Alive"]), default=0)
        if per_node < 1:
            raise ValueError(
                "device='cuda' but the Ray cluster has no GPUs; use device='cpu' or add GPU nodes"
            )
        gpus = gpus_needed(world_size, ranks_per_gpu)
        per_node = int(min(per_node, gpus))
        sizes = [min(per_node, gpus - start) for start in range(0, gpus, per_node)]
        bundle = {"GPU": 1, "CPU": cpus_per_worker * ranks_per_gpu}
        bundles = [(group_index, index) for group_index, size in enumerate(sizes) for index in range(size)]
        slot_of = [bundles[gpu_of(rank, ranks_per_gpu)] for rank in range(world_size)]
    else:
        sizes = [world_size]
        bundle = {"CPU": cpus_per_worker}
        slot_of = [(0, rank) for rank in range(world_size)]
    groups = [placement_group([bundle] * size, strategy="STRICT_PACK") for size in sizes]
    try:
        ray.get([group.ready() for group in groups], timeout=timeout_s)
    except GetTimeoutError:
        for group in groups:
            remove_placement_group(group)
        raise ValueError(
            f"Ray could not place {world_size} workers ({sum(sizes)} bundles of {bundle}, STRICT_PACK per node) within "
            f"{timeout_s:g} s; the cluster has {ray.available_resources()}: lower the rank counts, "
            "set cpus_per_worker lower, or add nodes"
        ) from None
    return groups, [(groups[group_index], index) for group_index, index in slot_of]
