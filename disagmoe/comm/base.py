"""The transport contract (DESIGN section 3b): point-to-point messages of tensors, named by key.

    send(dst_rank, key, tensors) -> SendHandle              (non-blocking; keep going, wait later)
    recv(src_rank, key, specs, timeout_s) -> list[Tensor]   (the shapes and dtypes: `specs`)

A message is matched by (source rank, destination rank, key), with key = (step, micro_batch,
layer, direction); the pipeline schedule guarantees that key is unique per ordered rank pair
within a step. Every message has a shape fixed by the plan (`runtime.stages.messages`: tokens per
micro-batch, hidden size, top-k): the receiver names the specs it expects, so no header travels
and nothing waits on the host for one; the sender must send exactly those (a transport may check
what it can). On a GPU a receive is stream-ordered: `recv` returns tensors that work queued on
the current stream afterwards sees filled, without blocking the host. Where a transport matches
by tag (`local`), keys may be asked for in any order; an in-order one (`nccl`) relies on the
schedule receiving each rank pair's messages in the order they were sent (`schedule_sim` proves
it for every layout).

A peer that does not deliver in time raises `TransportTimeout`; a peer whose connection breaks
(it died) raises `PeerFailure`. Both name the peer rank and the key, so the driver can report
which rank failed at which point of the schedule.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagmoe.wire import MessageKey


@dataclass(frozen=True)
class TensorSpec:
    """The shape and dtype of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


class TransportError(RuntimeError):
    """A message could not be exchanged with `peer` for `key`."""

    def __init__(self, message: str, peer: int, key: MessageKey | None) -> None:
        super().__init__(message)
        self.peer = peer
        self.key = key

    def __reduce__(self):
        # Subclasses take other constructor arguments; rebuild from message and fields instead,
        # so the error survives pickling (Ray ships a worker's exception to the driver).
        return _restore_error, (type(self), self.args, self.__dict__)


def _restore_error(cls: type[TransportError], args: tuple, state: dict) -> TransportError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class TransportTimeout(TransportError):
    """The peer did not deliver (or accept) the message within the timeout."""

    def __init__(self, peer: int, key: MessageKey | None, timeout_s: float, what: str) -> None:
        super().__init__(
            f"timed out after {timeout_s:g} s waiting to {what} rank {peer} for key {key}; "
            f"rank {peer} is hung, slow or never sends this key (raise recv_timeout_s if it is slow)",
            peer,
            key,
        )
        self.timeout_s = timeout_s


class PeerFailure(TransportError):
    """The connection to the peer broke (the peer process died or closed its transport)."""

    def __init__(self, peer: int, key: MessageKey | None, cause: str) -> None:
        super().__init__(f"rank {peer} failed while exchanging key {key}: {cause}", peer, key)


class SendHandle(abc.ABC):
    """An in-flight send. The tensors passed to `send` must not be modified until `wait` returns."""

    @abc.abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the receiver has the data; raises TransportTimeout / PeerFailure."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the data has left this rank's hands (no further wait needed)."""


WaitFn = Callable[["dist.Work", int, "MessageKey | None", float, float, str], None]
"""wait(work, peer, key, deadline, timeout_s, what): block until `work` completes or raise."""


class WorkSendHandle(SendHandle):
    """A send made of torch.distributed works, waited with the transport's own wait function."""

    def __init__(self, works: list[dist.Work], tensors: list[torch.Tensor], peer: int, key: MessageKey,
                 default_timeout_s: float, wait_fn: WaitFn) -> None:
        self._works = works
        self._tensors = tensors  # kept alive until the sends complete
        self._peer = peer
        self._key = key
        self._default_timeout_s = default_timeout_s
        self._wait_fn = wait_fn

    def wait(self, timeout_s: float | None = None) -> None:
        timeout_s = self._default_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        for work in self._works:
            self._wait_fn(work, self._peer, self._key, deadline, timeout_s, "deliver to")
        self._tensors = []

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


@dataclass(frozen=True)
class PairSpec:
    """A pair-row message (`hop: pair_rows`): one row per (token, expert) pair, [P = T K, H], that
    every source of the set writes its own pairs of (each pair has exactly one source), landing
    in one buffer on the receiver with a [Q sources, S segments] flag block beside it
    (`kernels.fused_return`: segment s covers tokens [s ST, (s + 1) ST))."""

    rows: TensorSpec  # [P, H]
    segments: int  # S
    sources: tuple[int, ...]  # the Q writing ranks, in the order of the flag block's rows
    extras: tuple[TensorSpec, ...] = ()  # small whole tensors the message also carries (the first source's)


@dataclass(frozen=True)
class PairTarget:
    """Where a source writes its rows of one pair-row message: the receiver's rows [P, H] and
    flag block [Q, S] (peer views on a one-sided transport, else local staging) and this source's
    row of the flag block, whose words it adds 1 to per segment once its rows there are stored
    (flags count messages, `kernels.signal`)."""

    rows_PH: torch.Tensor
    flags_QS: torch.Tensor
    source: int
    extras: tuple[torch.Tensor, ...] = ()  # the spec's extras as given to `pair_target` (to send)


@dataclass(frozen=True)
class PairLanding:
    """The receiver's side of one pair-row message: rows [P, H], flags [Q, S] and the receiver's
    consumed words beside them [Q, S] (a segment's rows are all there once each of its Q flags
    counts one more message than its consumed word; the combine advances them, `kernels.signal`),
    the status words a combine's waits report into, and the index of the block's first flag in
    them (0 where the flags are not an arena's). Without status words (a transport's emulation)
    every row is there already and nothing waits: no consumed words."""

    rows_PH: torch.Tensor
    flags_QS: torch.Tensor
    consumed_QS: torch.Tensor | None
    status_2: torch.Tensor | None
    flag_base: int = 0
    extras: tuple[torch.Tensor, ...] = ()  # the spec's extras, landed before the first source's flags
    timeout_s: float = 120.0  # how long a wait on one of the flags may take (the receive's timeout)


class Traffic:
    """Bytes this rank's messages carried to other ranks in one step, per payload, as device
    counters (no host read: they join the step's one read through `words`; `reset` at a step's
    start). The worker counts a MoE layer's DISPATCH, COMBINE, COMBINE_GRAD and DISPATCH_GRAD
    (`MessageShapes.is_counted`: not a pair-row message).

    `add` takes a message's live bytes (a device tensor where only the rows before a device-side
    count are live, `dispatch: sparse`) and beside it the bytes of the dense dispatch's message of
    the payload (the dense figure). What is counted is a message's content: nccl and local move the
    whole worst-case buffer either way; on nvshmem sparse dispatch's peer stores move only the live
    rows (`NvshmemTransport.send_sparse`, `send_counted`).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.names: list[str] = []  # each payload's name, then its `_dense` figure
        self._bytes: dict[str, torch.Tensor] = {}

    def add(self, name: str, live_bytes: torch.Tensor | int, dense_bytes: int) -> None:
        if name not in self._bytes:
            for counter in (name, f"{name}_dense"):
                self.names.append(counter)
                self._bytes[counter] = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bytes[name] += live_bytes
        self._bytes[f"{name}_dense"] += dense_bytes

    def words(self) -> torch.Tensor:
        """int64 [len(names)]: the counters in `names` order."""
        if not self.names:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat([self._bytes[name] for name in self.names])

    def reset(self) -> None:
        for counter in self._bytes.values():
            counter.zero_()


class Transport(abc.ABC):
    """Point-to-point tensor messages between the ranks of one job."""

    kind: str  # the `TrainConfig.transport` name of the implementation

    def __init__(self, rank: int, world_size: int, default_timeout_s: float) -> None:
        if default_timeout_s <= 0:
            raise ValueError(f"default_timeout_s={default_timeout_s} must be > 0 seconds")
        self.rank = rank
        self.world_size = world_size
        self.default_timeout_s = default_timeout_s
        self._own_pairs: dict[MessageKey, PairTarget] = {}  # pair-row emulation: this rank's own rows
        self._traffic: Traffic | None = None

    @property
    def traffic(self) -> Traffic:
        """The bytes of the rows this rank sent this step (`Traffic`), on the transport's device."""
        if self._traffic is None:
            self._traffic = Traffic(getattr(self, "device", "cpu"))
        return self._traffic

    @abc.abstractmethod
    def send(self, dst_rank: int, key: MessageKey, tensors: Sequence[torch.Tensor]) -> SendHandle:
        """Start sending `tensors` (the specs the receiver expects; zero rows allowed) to `dst_rank`."""

    @abc.abstractmethod
    def recv(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec],
             timeout_s: float | None = None) -> list[torch.Tensor]:
        """Receive the message `key` from `src_rank`, tensors shaped as `specs`; `timeout_s=None`
        uses the default."""

    def reserve(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec], slot: Hashable = None) -> None:
        """Allocate, before the first step, what receiving `key`'s slot (its step aside) from
        `src_rank` needs (a transport that keeps receive buffers); by default nothing. `slot`: a
        buffer that keys with no overlapping lifetimes share (`runtime.schedule.recv_slots`); None
        gives the key a buffer of its own."""

    # --- receive buffers kept by the transport (nccl; local once reserved) -----------------------

    def _slot_buffers(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec],
                      slot: Hashable = None, create: bool = True) -> list[torch.Tensor] | None:
        """The buffers `key` from `src_rank` lands in: those of its reserved slot (`reserve` with
        `slot` maps the key to it), made on first use; None if not reserved and not `create`."""
        if not hasattr(self, "_buffers"):
            self._buffers: dict[Hashable, list[torch.Tensor]] = {}
            self._slot_of: dict[tuple, Hashable] = {}
            self._slot_storages: set[int] = set()
        name = (src_rank, key.micro_batch, key.layer, int(key.direction))
        if slot is not None:
            self._slot_of[name] = (src_rank, slot)
        at = self._slot_of.get(name, name)
        buffers = self._buffers.get(at)
        if buffers is None and not create:
            return None
        if buffers is None or [TensorSpec.of(b) for b in buffers] != list(specs):
            device = getattr(self, "device", "cpu")
            buffers = self._buffers[at] = [spec.empty(device) for spec in specs]
            self._slot_storages.update(b.untyped_storage().data_ptr() for b in buffers if b.numel())
        return buffers

    def _detach_from_slots(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` detached and contiguous, each that shares memory with a receive buffer copied:
        a later message may land in that buffer while the send still reads it (`recv_slots`)."""
        storages = getattr(self, "_slot_storages", ())
        out = []
        for t in tensors:
            t = t.detach().contiguous()
            if storages and t.numel() and t.untyped_storage().data_ptr() in storages:
                t = t.clone()
            out.append(t)
        return out

    # --- pair-row messages (`hop: pair_rows`) ----------------------------------------------------
    # Every transport carries them; a one-sided one (nvshmem) overrides the three methods so that
    # sources write straight into the receiver's buffer and nothing is sent afterwards. Here the
    # emulation over `send`/`recv`: each source fills a zeroed staging buffer and sends it whole;
    # the receiver sums the Q buffers in source order (every pair row has one source, so the sum
    # is exact) and hands out flags already raised. Q x the bytes: for CPU runs and tests.

    def pair_target(self, dst_rank: int, key: MessageKey, spec: PairSpec,
                    extras: Sequence[torch.Tensor] = ()) -> PairTarget:
        """Where this rank writes its rows of pair-row message `key` to `dst_rank` (itself too).
        `extras`: the spec's extras (every source passes them; the first source's are delivered,
        before its flags rise: call this on the stream, before the writes)."""
        if self.rank not in spec.sources:
            raise ValueError(f"rank {self.rank} is not a source of the pair-row message {key} ({spec.sources})")
        check_specs(extras, spec.extras, f"rank {self.rank}: the extras of pair-row message {key}")
        device = getattr(self, "device", "cpu")
        rows_PH = torch.zeros(spec.rows.shape, dtype=spec.rows.dtype, device=device)
        flags_QS = torch.zeros((len(spec.sources), spec.segments), dtype=torch.int64, device=device)
        target = PairTarget(rows_PH, flags_QS, spec.sources.index(self.rank), tuple(extras))
        if dst_rank == self.rank:
            self._own_pairs[key] = target
        return target

    def pair_send(self, dst_rank: int, key: MessageKey, target: PairTarget) -> SendHandle | None:
        """After the source's writes (a compute op): deliver them to `dst_rank` (None: nothing to
        wait for, the writes were the delivery)."""
        return self.send(dst_rank, key, [target.rows_PH, *target.extras])

    def pair_landing(self, key: MessageKey, spec: PairSpec, timeout_s: float | None = None) -> PairLanding:
        """The receiver's view of pair-row message `key` from every source of `spec`."""
        rows_PH, extras = None, ()
        for src in spec.sources:
            if src == self.rank:
                own = self._own_pairs.pop(key)
                part, part_extras = own.rows_PH, own.extras
            else:
                part, *part_extras = self.recv(src, key, [spec.rows, *spec.extras], timeout_s)
            if rows_PH is None:
                rows_PH, extras = part, tuple(part_extras)
            else:
                rows_PH = rows_PH + part
        flags_QS = torch.ones((len(spec.sources), spec.segments), dtype=torch.int64, device=rows_PH.device)
        return PairLanding(rows_PH, flags_QS, None, None, extras=extras)

    # --- what a captured step needs (`comm.counts`) ---------------------------------------------
    # A transport whose launches take no host value that changes from step to step has one phase:
    # these defaults. The nvshmem transport picks ring segments from host counts and overrides them.

    def phase(self) -> Hashable:
        """What a step's host calls depend on (equal phases: a step captured in one replays in the
        other); one phase here."""
        return ()

    def message_counts(self) -> dict:
        """The host message counts a step moves on (`comm.counts.counts_between` of two of them
        is a step's); none here."""
        return {}

    def messages_since(self, before: dict) -> dict:
        """The host message counts moved since `before` (a `message_counts()`): a captured step's
        messages, what `advance` takes for each replay (`comm.counts.counts_between`)."""
        from disagmoe.comm.counts import counts_between

        return counts_between(before, self.message_counts())

    def advance(self, step: dict) -> None:
        """Move the host message counts on by `step` without sending (a replayed step's); none here."""
        if step:
            raise ValueError(f"the {getattr(self, 'kind', 'base')} transport counts no messages on the host; "
                             f"got a step of {len(step)} counts (from another transport?)")

    def realign(self, target_phase) -> dict:
        """Skip the host message counts on to `target_phase` without sending (`comm.counts.realigned`,
        after an evaluation); none here: one phase, nothing to skip."""
        if target_phase:
            raise ValueError(f"the {getattr(self, 'kind', 'base')} transport counts no messages on the host; "
                             f"got a phase of {len(target_phase)} counts (from another transport?)")
        return {}

    def status_word(self) -> torch.Tensor | None:
        """Device int32 words the step's one host read includes (nonzero word 0: a message failed
        on the GPU: did not fit its buffer, or never came), or None for a transport that fails
        on the host."""
        return None

    def check_status(self, status: list[int]) -> None:
        """Raise for the `status_word` values read at the step's end (the error names the fix)."""

    def close(self) -> None:
        """Release transport resources (the process group itself belongs to the caller)."""

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"rank {self.rank}: peer rank {peer} is not another rank of this "
                f"{self.world_size}-rank job"
            )


def check_specs(tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec] | None, what: str) -> None:
    """ValueError unless `tensors` match `specs` (None: nothing to check)."""
    if specs is None:
        return
    got = [TensorSpec.of(t) for t in tensors]
    if got != list(specs):
        raise ValueError(f"{what}: tensors {[(s.shape, str(s.dtype)) for s in got]} do not match the expected "
                         f"{[(s.shape, str(s.dtype)) for s in specs]}")
