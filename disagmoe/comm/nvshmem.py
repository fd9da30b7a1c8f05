"""`nvshmem` transport: one-sided puts into the receiver's symmetric arena, arrival flags waited
on the GPU stream (DESIGN section 3b's contract; `comm.symmetric` for the arena, `kernels.signal`
for the flags).

- Set-up: NVSHMEM starts inside each rank's process (a Ray actor): rank 0 creates the unique id,
  the job's process group relays its bytes to every rank (the driver made that rendezvous), and
  every rank joins with its own GPU. Every rank then allocates the same arena, collectively: the
  largest any rank needs (`comm.symmetric.symmetric_layouts`, from every rank's program), so any
  rank can address any other's segments by offset. Nothing is allocated after set-up. The
  symmetric heap is sized for the arena (`NVSHMEM_SYMMETRIC_SIZE`, unless the config's `env`
  sets it: NVSHMEM's default heap of 1 GiB holds no real model's arena).
- Message counts belong to the transport, not to the step (`comm.counts`): the n-th message of a
  slot (the keys (source, payload, layer, micro-batch) of a pool share one ring of N segments,
  `comm.symmetric`) lands in segment (n - 1) mod N. Sender and receiver run the same sends and
  receives of every slot in the same order (training steps and evaluation batches alike;
  `reuse_order.one_sided_slots` checks the order and gives a key a ring of its own where it
  differs), so their counts agree without any exchange. The counts pick segments (addresses)
  only: no flag value comes from them.
- Flags count arrivals (`kernels.signal`): every sender adds 1 to the segment's flag after the
  data (NVSHMEM's SIGNAL_ADD of 1; the Triton senders' atomic add), and the receiver's wait
  compares the flag against its own consumed word of that flag (`_consumed_W`, on its GPU, the
  flags' indexing) and advances that word on the device. So a step captured in a CUDA graph waits
  for the next message on every replay; it stays valid while the phase (every count mod its
  ring, `phase`) is the one it was captured in, and the caller counts a replay's messages with
  `advance` (`comm.counts`).
- send(dst, key): the message's tensors go straight from the sender's memory into dst's segment:
  a put per tensor on the current stream, a quiet (the earlier puts have landed), then
  put-with-signal of the last tensor, which adds 1 to the segment's flag after its data. The
  host does not wait. A message that cannot be sent (it does not fit its segment, or is not on
  this GPU) is not written: the flag is set to `signal.FAILED`, so the receiver's wait ends
  and records an overflow, and the sender raises with the fix.
- recv(src, key): a wait on the current stream (acquire loads at system scope until the flag
  counts one more message than the consumed word, giving up after the receive's timeout), then
  views of the segment: work queued afterwards reads the data in place. Flags are never reset.
  The ring is sized so that no later message lands there before this rank is done reading
  (module docstring of `comm.symmetric`): no slot-free acknowledgement.
- The status words (`kernels.signal`: overflow, time-out and the flag that timed out) join the
  step's one host read (`Transport.status_word`); a message that did not fit, or never came,
  stops the run there naming the peer and the fix (never silent corruption, never a silent hang).
- Pair-row messages (hop mode `pair_rows`, `comm.symmetric.PairRegion`): nothing is sent. A
  source's `pair_target` gives views of the receiver's rows [P, H] and flag block [Q, S] in its
  arena, through the peer tensor of that arena (`nvshmem.core.get_peer_tensor`, taken once at
  set-up for every peer this rank writes pair rows to; never of this rank's own PE: a colocated
  source writes its own arena); the source's kernel stores its rows there and adds 1 to its row
  of the flags per segment (`kernels.fused_return.down_to_destination`), and `pair_send` has
  nothing left to do. The receiver's `pair_landing` gives the same region's local views and the
  block's consumed words, without waiting: its combine (`fused_return.combine_landed`) waits per segment
  and reports a flag that never came into this transport's status words; `check_status` names it
  from its index in the arena's flag region, flag_base + q S + s (the landing's flag_base: the
  combine must add it to the block index q S + s). Counted per slot, as segments' messages are.
  A message's extras (`PairSpec.extras`, small whole tensors such as an expert load) sit after
  its rows in the region; every source passes them to `pair_target`, and the first source's
  (sources[0]) are written there and then, on the current stream: a put per extra into the
  receiver's arena and one quiet (into its own arena, a colocated first source: a copy), so they
  have landed before any kernel queued afterwards raises that source's flags. The caller calls
  `pair_target` on the stream before the kernel that stores the rows, as it must anyway.

- Sparse dispatch (`dispatch: sparse`): `send_sparse` is the DISPATCH to every remote rank of the
  set in one Triton launch (`kernels.sparse_dispatch`): each token's row, ids, weights and index
  stored through the peer view of each serving rank's arena into its segment at the token's
  prefix-sum offset, the count beside, 1 added to the segment's flag; the load put before
  (a put and a quiet). `send_counted` is its backward, one launch for every source (the first
  count rows of d x and d w back to each; with pair rows d x alone). With pair rows `send_sparse`
  also carries COMBINE_GRAD, the rows alone (dy of the tokens each expert rank served). Only
  routed rows cross the link; `recv` is the same as for `send`. The peer views are taken at
  set-up (`map_peers`).

- all_sum(values): the all-ranks sum of a few float64 words on the current stream, without
  the process group (the arena's `SumRegion`, when the layouts have one): the n-th sum puts
  this rank's values into its share of copy (n - 1) mod 2 in every peer's arena, each put adding
  1 to the share's flag (a copy into its own arena), waits for every peer's flag, and
  sums the shares in rank order, the same bits on every rank. For ranks that share a GPU, whose
  process group is gloo (NCCL refuses them): the step's gradient norm then makes no host wait.
  A share that never came is named by `check_status` as a message is.

- CUDA graphs (issue 20 item 1; the worker's capture: `runtime.rank_graphs`): no
  launch or put takes a message number, so a captured send or receive replays correctly while
  `phase()` is the one it was captured in; the runtime keeps a graph per phase and calls
  `advance(step)` before each replay, `step` being `comm.counts.counts_between` of the counts
  around the capture, and after an evaluation skips the counts on to the phase the next training
  step would have met without it (`realign`, `comm.counts.realigned`). What the capture of a rank's
  step still needs, from this module: no `event.query()` while capturing (`_keep_in_flight`
  prunes with it, and the worker drops completed send handles with `is_completed`; global-mode
  capture forbids the query); every address table (`_table`: a pinned host copy the first time
  an address set is seen) and launch scratch (`_scratch`) made in the eager steps before capture;
  the kernels compiled and loaded before capture (`sparse_dispatch.warm_up`, the eager steps).
  `_keep_in_flight` queries no event while a graph is captured (the tensors it keeps then stay
  for the transport's life); the worker captures a phase only after an eager step in it
  (`runtime.training.graphed_step.PhasedGraphs`), so its address tables exist.
  NVSHMEM's host puts on the stream (put, put_signal, signal_op, quiet) are captured as they are:
  tests/comm/test_nvshmem.py's graph test is the check that they replay. Ring sizes that do not
  divide a step's messages of their pool make the phase period long (two layers, two micro-batches,
  rings of 3 and 5 taking 4 messages a step: 15 phases), so a captured run rounds them up to
  divisors of twice a step's messages (`reuse_order.step_ring`: at most two phases); an evaluation
  pass moves the forward rings' phase, and `realign` moves it back before the next training step.

The messages and `all_sum` use NVSHMEM; the other collectives stay on the process group, in the
schedule's order (DESIGN 3c): a GPU flag wait must never sit behind a peer's collective, and
none does, because every collective is an op of the schedule the same on every rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from disagmoe.comm.base import (
    PairLanding,
    PairSpec,
    PairTarget,
    SendHandle,
    TensorSpec,
    Transport,
    TransportTimeout,
    check_specs,
)
from disagmoe.wire import MessageKey, ArenaOverflow, message_key
from disagmoe.comm.counts import CountKey, RingCounts
from disagmoe.comm.symmetric import ArenaLayout, PairRegion, PairSlot, Slot, SumRegion, check_fits

HEAP_MARGIN_BYTES = 256 * 2**20  # symmetric heap beyond the arena (NVSHMEM's own allocations, alignment)


def _nvshmem() -> Any:
    """`nvshmem.core`, or a user error naming what to install."""
    try:
        import nvshmem.core as nv
    except ImportError as err:
        raise ValueError(
            "transport 'nvshmem' needs nvshmem4py (pip install nvshmem4py-cu12 or nvshmem4py-cu13, matching "
            f"your CUDA) and NVIDIA GPUs; use transport: nccl meanwhile ({err})"
        ) from None
    return nv


class EventSendHandle(SendHandle):
    """A send queued on a stream: complete when the stream passed the event recorded after it."""

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self._event = event
        self._tensors = tensors  # alive until the puts have read them

    def wait(self, timeout_s: float | None = None) -> None:
        """Order the current stream after the puts (the host does not wait)."""
        torch.cuda.current_stream().wait_event(self._event)
        self._tensors = []

    def is_completed(self) -> bool:
        return self._event.query()


def _key_of(slot: Slot) -> tuple[int, int, int, int]:
    """(source rank, micro-batch, key layer field, direction) of a slot's messages."""
    src, payload, layer, mb = slot
    key = message_key(0, payload, layer, mb)
    return src, key.micro_batch, key.layer, int(key.direction)


def _pair_key_of(slot: PairSlot) -> tuple[int, int, int]:
    """(micro-batch, key layer field, direction) of a pair slot's messages (every source's)."""
    payload, layer, mb = slot
    key = message_key(0, payload, layer, mb)
    return key.micro_batch, key.layer, int(key.direction)


class SlotIndex:
    """A rank's receive slots (segments' and pair regions') by the transport key of their messages."""

    def __init__(self, layout: ArenaLayout) -> None:
        self._slots = {_key_of(key): seg.slot for seg in layout.segments for key in seg.keys or (seg.slot,)}
        self._pairs: dict[tuple[int, int, int], PairRegion] = {}
        for region in layout.pairs:
            other = self._pairs.setdefault(_pair_key_of(region.slot), region)
            if other.slot != region.slot:
                raise ValueError(f"pair slots {other.slot} and {region.slot} share a transport key: "
                                 "at most one of them can travel as pair rows")

    def slot(self, src: int, key: MessageKey, rank: int) -> Slot:
        slot = self._slots.get((src, key.micro_batch, key.layer, int(key.direction)))
        if slot is None:
            region = self._pairs.get((key.micro_batch, key.layer, int(key.direction)))
            if region is not None and src in region.sources:
                raise ValueError(f"key {key} from rank {src} to rank {rank} is a pair-row message (hop mode "
                                 f"pair_rows): its sources write it through pair_target and pair_send, rank {rank} "
                                 "reads it with pair_landing; send, recv and reserve do not carry it")
            raise ValueError(f"rank {rank} has no receive segment for key {key} from rank {src}: the message is "
                             "not in its program (every rank must build the arenas from the same schedule)")
        return slot

    def pair_region(self, key: MessageKey, rank: int) -> PairRegion:
        """The pair region (copy 0) of pair-row message `key` to `rank`."""
        region = self._pairs.get((key.micro_batch, key.layer, int(key.direction)))
        if region is None:
            raise ValueError(f"rank {rank} has no pair-row region for key {key}: the message is not a pair-row "
                             "receive of its program (every rank must build the arenas from the same schedule "
                             "and the same pair_of, and send it with send/recv if it is not pair rows)")
        return region


class NvshmemTransport(Transport):
    """One-sided messages over NVSHMEM symmetric memory (module docstring).

    `layouts`: every rank's arena layout, from `comm.symmetric.symmetric_layouts` over the run's
    programs (the same list on every rank: allocation is collective).
    """

    kind = "nvshmem"

    def __init__(self, layouts: Sequence[ArenaLayout], default_timeout_s: float = 120.0) -> None:
        if not dist.is_initialized():
            raise ValueError("the nvshmem transport needs torch.distributed initialised (it relays NVSHMEM's unique id)")
        super().__init__(dist.get_rank(), dist.get_world_size(), default_timeout_s)
        self._plan(layouts)
        self.nv = _nvshmem()
        self.device = torch.device("cuda", torch.cuda.current_device())
        # The symmetric heap must hold the arena (NVSHMEM reads this at init; a cluster's env wins).
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(self.layout.nbytes + HEAP_MARGIN_BYTES))
        self._uid = _join(self.nv, self.rank, self.world_size, self.device)  # kept alive while NVSHMEM runs
        arena_B = self.nv.tensor((max(self.layout.nbytes, 8),), dtype=torch.uint8)  # collective
        arena_B.zero_()  # NVSHMEM memory is not zeroed; flags start at 0 (no message yet)
        self._attach(arena_B)
        self._base = int(self.nv.tensor_get_buffer(self.arena_B)[0].handle)
        stream = torch.cuda.current_stream()
        self.nv.barrier_all(stream=stream)  # every arena is zeroed before any peer writes to it
        stream.synchronize()
        self._peer_arenas = {dst: self._peer_arena(dst) for dst in pair_destinations(self.layouts, self.rank)}
        self._closed = False

    def _plan(self, layouts: Sequence[ArenaLayout]) -> None:
        """The bookkeeping of the arenas, nothing on the GPU: layouts, slot indexes, message counts."""
        if len(layouts) != self.world_size:
            raise ValueError(f"{len(layouts)} arena layouts for a {self.world_size}-rank job: pass one per rank")
        if len({(layout.nbytes, layout.flag_words) for layout in layouts}) != 1:
            raise ValueError("arena layouts differ in size across ranks: build them with symmetric_layouts")
        self.layouts = list(layouts)
        self.layout = self.layouts[self.rank]
        self._index = [SlotIndex(layout) for layout in self.layouts]
        self.counts = RingCounts(self._ring_of)  # every slot's messages so far, both ends alike (`comm.counts`)
        self._extras_in_flight: list[tuple[Any, tuple[torch.Tensor, ...]]] = []  # (event, tensors put before it)
        self._held_by_graphs: list[tuple[torch.Tensor, ...]] = []  # what captured puts read, for every replay
        self._launch_scratch: dict[int, torch.Tensor] = {}  # Q -> a peer-store launch's counters, count words
        self._address_tables: dict[tuple, torch.Tensor] = {}  # (device, addresses) -> the kernel's table

    def _attach(self, arena_B: torch.Tensor) -> None:
        """This rank's arena and the device words beside it: the flags (in the arena: peers raise
        them), the consumed words and the status (this GPU's own: only its waits touch them)."""
        from disagmoe.kernels.signal import new_consumed, new_status

        self.arena_B = arena_B
        self._flags_W = self.layout.flags(arena_B)
        self._consumed_W = new_consumed(self._flags_W)
        self.status_2 = new_status(arena_B.device)

    def _ring_of(self, key: CountKey) -> int:
        """How many segments (copies) the messages counted under `key` fill in turn."""
        kind, peer, slot = key
        if kind in ("sent", "received"):
            return self.layouts[peer if kind == "sent" else self.rank].ring(slot)
        if kind in ("pair_sent", "pair_received"):
            return self.layouts[peer].copies
        return self._sum_region().copies

    # --- a captured step (`comm.counts`) --------------------------------------------------------

    def phase(self) -> frozenset:
        """Every slot's message count mod its ring: a step captured in one phase replays in it."""
        return self.counts.phase()

    def message_counts(self) -> dict[CountKey, int]:
        return self.counts.snapshot()

    def advance(self, step: dict[CountKey, int]) -> None:
        """Count a replayed step's messages (`comm.counts.counts_between` of its capture)."""
        self.counts.advance(step)

    def realign(self, target_phase: frozenset) -> dict[CountKey, int]:
        """Skip every slot's count on to the smallest one >= it in `target_phase` (a `phase()` of
        these counts), sending nothing; returns the counts skipped. The runtime calls it on every
        rank alike before a captured training step that follows an evaluation (`comm.counts`: why
        it needs no message, and where it is safe)."""
        return self.counts.realign(target_phase)

    def _peer_arena(self, dst: int) -> torch.Tensor:
        """Rank `dst`'s arena as a tensor this GPU stores into (never this rank's own PE)."""
        try:
            view, cause = self.nv.get_peer_tensor(self.arena_B, dst), "it gave no address"
        except Exception as err:  # nvshmem4py's errors name no fix
            view, cause = None, str(err)
        if view is None or view.data_ptr() == 0:
            raise ValueError(f"rank {self.rank} cannot map rank {dst}'s arena (nvshmem get_peer_tensor: {cause}): "
                             "pair-row messages need every source and its receiver on GPUs of one host that reach "
                             "each other (NVLink or PCIe peer access); use hop mode partial_sums there")
        return view

    # --- addresses ------------------------------------------------------------------------------

    def _symmetric(self, offset: int, nbytes: int) -> Any:
        """The symmetric address `offset` of the arena (a peer's copy when given a remote PE)."""
        from cuda.core import Buffer

        return Buffer.from_handle(self._base + offset, nbytes)

    @staticmethod
    def _local(tensor: torch.Tensor) -> Any:
        from cuda.core import Buffer

        return Buffer.from_handle(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    # --- the contract ---------------------------------------------------------------------------

    def send(self, dst_rank: int, key: MessageKey, tensors: Sequence[torch.Tensor]) -> SendHandle:
        self._check_peer(dst_rank)
        slot = self._index[dst_rank].slot(self.rank, key, dst_rank)
        n = self.counts.next(("sent", dst_rank, slot))
        seg = self.layouts[dst_rank].segment(slot, n - 1)
        stream = torch.cuda.current_stream()
        flag = self._symmetric(8 * seg.flag, 8)
        try:
            for tensor in tensors:
                if tensor.device != self.device:
                    raise ValueError(f"the nvshmem transport sends tensors on {self.device}, got one on {tensor.device}")
            check_fits(seg, [TensorSpec.of(t) for t in tensors])
        except (ArenaOverflow, ValueError):
            from disagmoe.kernels.signal import FAILED

            self.nv.signal_op(flag, FAILED, self.nv.SignalOp.SIGNAL_SET, remote_pe=dst_rank, stream=stream)
            raise  # the receiver's wait ends on FAILED and its status says so
        payload = [t.detach().contiguous() for t in tensors]
        parts = [(offset, t) for offset, t in zip(seg.offsets, payload, strict=True) if t.numel()]
        for offset, tensor in parts[:-1]:
            self.nv.put(self._symmetric(offset, tensor.nbytes), self._local(tensor), remote_pe=dst_rank, stream=stream)
        if len(parts) > 1:
            self.nv.quiet(stream=stream)  # the earlier puts land before the signal's
        if parts:
            offset, tensor = parts[-1]
            self.nv.put_signal(self._symmetric(offset, tensor.nbytes), self._local(tensor), flag, 1,
                               self.nv.SignalOp.SIGNAL_ADD, remote_pe=dst_rank, stream=stream)
        else:
            self.nv.signal_op(flag, 1, self.nv.SignalOp.SIGNAL_ADD, remote_pe=dst_rank, stream=stream)
        event = torch.cuda.Event()
        event.record(stream)
        return EventSendHandle(event, payload)

    def reserve(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec], slot=None) -> None:
        """Nothing to allocate (the arena holds every slot's ring; `slot` is not used: the layouts
        share segments as `reuse_order.one_sided_slots` allows); checks that the slot fits its specs."""
        held = self._index[self.rank].slot(src_rank, key, self.rank)
        for copy in range(self.layout.ring(held)):
            check_fits(self.layout.segment(held, copy), specs)

    def recv(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec],
             timeout_s: float | None = None) -> list[torch.Tensor]:
        from disagmoe.kernels.signal import wait_flag

        self._check_peer(src_rank)
        slot = self._index[self.rank].slot(src_rank, key, self.rank)
        n = self.counts.next(("received", src_rank, slot))
        seg = self.layout.segment(slot, n - 1)
        check_fits(seg, specs)
        wait_flag(self._flags_W, self._consumed_W, seg.flag, self.status_2,
                  timeout_s=self.default_timeout_s if timeout_s is None else timeout_s)
        return self.layout.views(self.arena_B, slot, specs, n - 1)

    # --- sparse dispatch by peer stores (`kernels.sparse_dispatch`) ------------------------------

    def send_sparse(self, dst_ranks: Sequence[int], key: MessageKey, x_TH: torch.Tensor, picked_QT: torch.Tensor,
                    ids_QTK: torch.Tensor | None = None, w_TK: torch.Tensor | None = None,
                    extras: Sequence[torch.Tensor] = ()) -> SendHandle:
        """The sparse DISPATCH of `key` to every rank of `dst_ranks` in one launch: destination q's
        picked tokens' rows, local ids, weights and token index stored straight into its segment
        (a peer's arena through its peer view; this rank's own, colocated), the count beside them,
        then 1 added to its flag, so only routed rows cross the link; `extras`
        (the message's whole tensors after the count: the source's load) put first, then a quiet.
        The receiver's `recv` is unchanged: it sees the message `dispatch_messages` builds, with the
        rows past the count left as they were (never read). Without ids and weights the message is
        the rows alone (a sparse pair-row layer's COMBINE_GRAD: dy of the tokens each rank served,
        in its dispatch order; its receiver knows the count). The host does not wait."""
        from disagmoe.kernels.sparse_dispatch import dispatch_rows

        Q, T = picked_QT.shape
        if len(dst_ranks) != Q:
            raise ValueError(f"{len(dst_ranks)} destinations for a routing of {Q}: one row of picked per rank")
        if (ids_QTK is None) != (w_TK is None):
            raise ValueError("send_sparse takes ids and weights together (a DISPATCH) or neither (the rows alone)")
        routed = ids_QTK is not None
        messages, flags, kept = self._counted_segments(
            dst_ranks, key, 5 if routed else 1, extras, f"the sparse dispatch {key}",
            "rows, ids, weights, index, count and {n} extras (dispatch: sparse specs)" if routed else "rows alone")
        _check_rows(x_TH, messages, f"the sparse dispatch {key}")
        device = x_TH.device
        counters_Q, counts_Q = self._scratch(Q, device)

        def table(i: int) -> torch.Tensor:
            return self._table([message[i] for message in messages], device)

        payload = dict(ids_QTK=ids_QTK.to(torch.int32), ids=table(1), w_TK=w_TK.detach(), w=table(2), index=table(3),
                       counts=table(4)) if routed else dict(counts=self._table(counts_Q, device))
        dispatch_rows(x_TH.detach(), picked_QT, rows=table(0), flags=self._table(flags, device),
                      counters_Q=counters_Q, **payload)
        return self._launched(kept, [x_TH, picked_QT, *([ids_QTK, w_TK] if routed else [])])

    def send_counted(self, dst_ranks: Sequence[int], key: MessageKey, dx_STH: torch.Tensor,
                     dw_STK: torch.Tensor | None, count_S1: torch.Tensor, extras: Sequence[torch.Tensor],
                     blocks: Sequence[int] | None = None, index_ST: torch.Tensor | None = None) -> SendHandle:
        """The rows each source sent, back to every source of `dst_ranks` in one launch: source q
        gets the first count_S1[s] rows of block s = blocks[q] (default q; in their received order;
        int32 [S, 1] on the device, never read here) stored into its segment, `extras` (the load)
        put first, then its flag (`kernels.sparse_dispatch.return_rows`). The sparse DISPATCH_GRAD
        (the backward of `send_sparse`): d x and d w, `dw_STK` None d x alone (pair rows: the
        weights' gradient forms where they combine). With `index_ST` (int32 [S, T], no d w) the
        sparse COMBINE of partial sums: the partial sums, their token index and the count, the
        message's three tensors. `recv` is unchanged."""
        from disagmoe.kernels.sparse_dispatch import return_rows

        blocks = list(range(len(dst_ranks))) if blocks is None else list(blocks)
        if len(blocks) != len(dst_ranks):
            raise ValueError(f"{len(dst_ranks)} sources for {len(blocks)} blocks of d x: one block per source")
        if index_ST is not None and (dw_STK is not None or extras):
            raise ValueError("a COMBINE (rows with their token index) carries no d w and no extras")
        leading, expected = ((1, "d x, {n} extras") if dw_STK is None and index_ST is None else
                             (2, "d x, d w and {n} extras") if index_ST is None else
                             (3, "partial sums, token index and count (dispatch: sparse, hop: partial_sums)"))
        messages, flags, kept = self._counted_segments(dst_ranks, key, leading, extras,
                                                            f"the sparse return {key}", expected)
        _check_rows(dx_STH, messages, f"the sparse return {key}")
        device = dx_STH.device
        counters_Q, counts_Q = self._scratch(len(dst_ranks), device)
        column = dict(dw_STK=dw_STK.detach(), w=self._table([m[1] for m in messages], device)) if dw_STK is not None \
            else dict(index_ST=index_ST.to(torch.int32), index=self._table([m[1] for m in messages], device)) \
            if index_ST is not None else {}
        count_words = [m[2] for m in messages] if index_ST is not None else counts_Q
        return_rows(dx_STH.detach(), count_S1.to(torch.int32), rows=self._table([m[0] for m in messages], device),
                    counts=self._table(count_words, device), flags=self._table(flags, device), counters_Q=counters_Q,
                    blocks=blocks, **column)
        return self._launched(kept, [dx_STH, *(t for t in (dw_STK, index_ST) if t is not None), count_S1])

    def _scratch(self, Q: int, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(counters_Q, count words) of a peer-store launch to Q ranks: int32 zeros the launch leaves
        zero again (stream order: every launch's own), and the count words a message without a
        count tensor writes into (never read)."""
        scratch = self._launch_scratch.get(Q)
        if scratch is None:
            scratch = self._launch_scratch[Q] = torch.zeros(2 * Q, dtype=torch.int32, device=device)
        return scratch[:Q], [scratch[Q + q:Q + q + 1] for q in range(Q)]

    def _launched(self, kept: list[torch.Tensor], inputs: list[torch.Tensor]) -> SendHandle:
        """The handle of a peer-store launch queued on the stream: `kept` (the extras put before it)
        alive until the stream passed the puts, `inputs` until the launch read them."""
        return EventSendHandle(self._keep_in_flight(kept), [*inputs, *kept])

    def _keep_in_flight(self, tensors: Sequence[torch.Tensor]) -> Any:
        """An event recorded on the current stream now; `tensors` (read by puts queued before it)
        stay alive here until the stream passed it. While a CUDA graph is captured, no event is
        queried (capture forbids it) and the tensors stay alive as long as the transport: every
        replay of the graph reads them."""
        event = torch.cuda.Event()
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            event.record(torch.cuda.current_stream())  # a wait on it inside the capture orders as eagerly
            self._held_by_graphs.append(tuple(tensors))
            return event
        self._extras_in_flight = [(e, ts) for e, ts in self._extras_in_flight if not e.query()]
        event.record(torch.cuda.current_stream())
        self._extras_in_flight.append((event, tuple(tensors)))
        return event

    def _counted_segments(self, dst_ranks: Sequence[int], key: MessageKey, leading: int,
                          extras: Sequence[torch.Tensor], what: str,
                          expected: str) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list]:
        """(each destination's message views, flag words, the extras sent) of `key`'s next
        message to every rank of `dst_ranks`, for one Triton launch that writes the `leading`
        tensors and raises the flags (`_counted_segment` each, one quiet after the puts)."""
        stream = torch.cuda.current_stream()
        messages, flags, kept = [], [], []
        for dst in dst_ranks:
            message, flag = self._counted_segment(dst, key, leading, extras, kept, stream, what, expected)
            messages.append(message)
            flags.append(flag)
        if any(dst != self.rank for dst in dst_ranks) and extras:
            self.nv.quiet(stream=stream)  # the extras land before any flag the kernel raises
        return messages, flags, kept

    def _counted_segment(self, dst: int, key: MessageKey, leading: int, extras: Sequence[torch.Tensor],
                         kept: list, stream, what: str, expected: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(views of the message, its flag word) of `key`'s next message to `dst`, for a Triton
        launch that writes the `leading` tensors and raises the flag (`send_sparse`,
        `send_counted`); the `extras` after them are copied (own arena) or put now, and appended
        to `kept`. The caller quiets once, after every destination."""
        self._check_peer(dst)
        slot = self._index[dst].slot(self.rank, key, dst)
        n = self.counts.next(("sent", dst, slot))
        arena = self._dispatch_arena(dst)
        seg = self.layouts[dst].segment(slot, n - 1)
        message = self.layouts[dst].views(arena, slot, list(seg.specs), n - 1)
        if len(message) != leading + len(extras):
            raise ValueError(f"{what} to rank {dst} has {len(message)} tensors; expected "
                             + expected.format(n=len(extras)))
        for i, tensor in enumerate(extras):
            payload = tensor.detach().contiguous()
            kept.append(payload)
            if dst == self.rank:  # its own arena (`.data`, see `_put_extras`): a copy
                message[leading + i].copy_(payload)
            elif payload.numel():
                self.nv.put(self._symmetric(seg.offsets[leading + i], payload.nbytes), self._local(payload),
                            remote_pe=dst, stream=stream)
        return message, self.layouts[dst].flags(arena)[seg.flag:seg.flag + 1]

    def _table(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The kernel's address table of `tensors` (arena views: the same few addresses every step),
        made once per address set: a table made per message would copy from the host each time."""
        from disagmoe.kernels.sparse_dispatch import address_table

        key = (device, tuple(t.data_ptr() for t in tensors))
        table = self._address_tables.get(key)
        if table is None:
            table = self._address_tables[key] = address_table(tensors, device)
        return table

    def map_peers(self, ranks: Sequence[int]) -> None:
        """Take the peer views of `ranks`' arenas now (set-up), for `send_sparse` and `send_counted`."""
        for dst in ranks:
            self._dispatch_arena(dst)

    def _dispatch_arena(self, dst: int) -> torch.Tensor:
        """`dst`'s arena as a tensor this GPU stores into (its own, or a peer view taken once)."""
        if dst == self.rank:
            return self.arena_B.data
        if dst not in self._peer_arenas:
            self._peer_arenas[dst] = self._peer_arena(dst)
        return self._peer_arenas[dst]

    # --- pair-row messages (module docstring) ---------------------------------------------------

    def pair_target(self, dst_rank: int, key: MessageKey, spec: PairSpec,
                    extras: Sequence[torch.Tensor] = ()) -> PairTarget:
        """Views of `dst_rank`'s region for message `key` (this rank's own arena when it is the
        receiver: a colocated source) and this rank's flag row in it. `extras`: the
        spec's extras; the first source's are written into the region now, on the current stream
        (module docstring), and kept alive in the target's `extras` (and here, until the stream
        passed their puts)."""
        if not 0 <= dst_rank < self.world_size:
            raise ValueError(f"rank {self.rank}: rank {dst_rank} is not a rank of this {self.world_size}-rank job")
        region = self._index[dst_rank].pair_region(key, dst_rank)
        check_pair(region, spec, self.rank, key, dst_rank)
        what = f"rank {self.rank}: the extras of pair-row message {key} to rank {dst_rank}"
        check_specs(extras, spec.extras, what)
        for tensor in extras:
            if tensor.device != self.device:
                raise ValueError(f"{what}: the nvshmem transport sends tensors on {self.device}, got one on "
                                 f"{tensor.device}")
        n = self.counts.next(("pair_sent", dst_rank, region.slot))
        region = self.layouts[dst_rank].pair_region(region.slot, n - 1)
        arena = self.arena_B if dst_rank == self.rank else self._peer_arenas[dst_rank]
        source = region.sources.index(self.rank)
        kept = tuple(extras)
        if source == 0 and extras:
            kept = self._put_extras(dst_rank, region, extras)
        return PairTarget(region.rows(arena), region.flags(arena), source, kept)

    def _put_extras(self, dst_rank: int, region: PairRegion,
                    extras: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Write the first source's extras into `dst_rank`'s region on the current stream: a copy
        into this rank's own arena, else a put per extra and one quiet, so that they have landed
        before work queued afterwards (the kernel raising the flags) runs. Returns what was sent."""
        payload = tuple(t.detach().contiguous() for t in extras)
        if dst_rank == self.rank:  # through `.data`: an in-place write to an arena view would bump the
            # version counter every view shares and fail the backward of any op that saved one (a combine)
            for view, tensor in zip(region.extra_views(self.arena_B.data), payload, strict=True):
                view.copy_(tensor)
            return payload
        parts = [(offset, t) for (offset, _), t in zip(region.extras, payload, strict=True) if t.numel()]
        if not parts:
            return payload
        stream = torch.cuda.current_stream()
        for offset, tensor in parts:
            self.nv.put(self._symmetric(offset, tensor.nbytes), self._local(tensor), remote_pe=dst_rank, stream=stream)
        self.nv.quiet(stream=stream)  # landed before any flag raised after this
        self._keep_in_flight(payload)
        return payload

    def pair_send(self, dst_rank: int, key: MessageKey, target: PairTarget) -> SendHandle | None:
        """Nothing: the source's stores and flags into the receiver's arena were the delivery."""
        return None

    def pair_landing(self, key: MessageKey, spec: PairSpec, timeout_s: float | None = None) -> PairLanding:
        """This rank's region for message `key`, its consumed words, the status words and the
        block's first flag index; no wait here (the combine waits per segment, each wait at most
        `timeout_s`, the transport's receive timeout by default)."""
        region = self._index[self.rank].pair_region(key, self.rank)
        check_pair(region, spec, None, key, self.rank)
        n = self.counts.next(("pair_received", self.rank, region.slot))
        region = self.layout.pair_region(region.slot, n - 1)
        return PairLanding(region.rows(self.arena_B), region.flags(self.arena_B), region.block(self._consumed_W),
                           self.status_2, region.flag,
                           region.extra_views(self.arena_B),
                           timeout_s=self.default_timeout_s if timeout_s is None else timeout_s)

    # --- the all-ranks sum (module docstring) ---------------------------------------------------

    def all_sum(self, values_N: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """The sum over every rank of `values_N` (float64 [N], N at most the layouts' sum width),
        a new float64 [N] tensor on the current stream; the host does not wait. Every rank calls
        it in the same order (as any collective); each wait at most `timeout_s`, the transport's
        receive timeout by default."""
        copy, n = self._put_share(values_N)
        return self._summed(copy, n, self.default_timeout_s if timeout_s is None else timeout_s)

    def _put_share(self, values_N: torch.Tensor) -> tuple[int, int]:
        """This rank's values into its share of the next sum's copy in every arena: a put with
        one more message counted in the share's flag into each peer's, a copy into its own.
        Returns (copy, N)."""
        region = self._sum_region()
        if values_N.dim() != 1 or values_N.dtype != torch.float64 or not 1 <= values_N.numel() <= region.width:
            raise ValueError(f"all_sum takes float64 [N] with 1 <= N <= {region.width} (the arena's sum width), "
                             f"got {values_N.dtype} {tuple(values_N.shape)}; sum wider tensors over the process group")
        if values_N.device != self.device:
            raise ValueError(f"the nvshmem transport sums tensors on {self.device}, got one on {values_N.device}")
        copy, n = (self.counts.next(("sums", self.rank, None)) - 1) % region.copies, values_N.numel()
        share = values_N.detach().contiguous()
        offset = region.share_offset(copy, self.rank)
        self.arena_B.data[offset:offset + 8 * n].view(torch.float64).copy_(share)  # `.data`: see `_put_extras`
        stream = torch.cuda.current_stream()
        for dst in range(self.world_size):
            if dst != self.rank:
                self.nv.put_signal(self._symmetric(offset, 8 * n), self._local(share),
                                   self._symmetric(8 * region.flag_of(copy, self.rank), 8), 1,
                                   self.nv.SignalOp.SIGNAL_ADD, remote_pe=dst, stream=stream)
        self._keep_in_flight((share,))
        return copy, n

    def _summed(self, copy: int, n: int, timeout_s: float) -> torch.Tensor:
        """Wait on the stream for every peer's share in copy `copy`, then their sum in rank order."""
        from disagmoe.kernels.signal import wait_flag

        region = self._sum_region()
        for src in range(self.world_size):
            if src != self.rank:
                wait_flag(self._flags_W, self._consumed_W, region.flag_of(copy, src), self.status_2,
                          timeout_s=timeout_s)
        return region.shares(self.arena_B, copy)[:, :n].sum(dim=0)

    def _sum_region(self) -> SumRegion:
        region = self.layout.sums
        if region is None:
            raise ValueError("this transport's arenas have no all-ranks sum region: build the layouts with "
                             "symmetric_layouts(..., sum_width=N) to sum on the stream")
        return region

    def status_word(self) -> torch.Tensor | None:
        return self.status_2

    def check_status(self, status: list[int]) -> None:
        """Raise for what the step's waits recorded: a message over its segment, or one that
        never came (`TransportTimeout` naming the peer and the message, a pair flag's segment too)."""
        check_transport_status(self.layout, self.rank, status, self.default_timeout_s)

    def close(self) -> None:
        """Free the arena and leave NVSHMEM (collective: every rank closes). The views that
        `pair_target` handed out must be dropped first: they map peers' arenas."""
        if self._closed:
            return
        self._closed = True
        stream = torch.cuda.current_stream()
        stream.synchronize()
        self._peer_arenas = {}  # the peer views go before the allocation they map
        self._extras_in_flight = []  # the stream passed every put
        self.nv.barrier_all(stream=stream)  # no peer still writes into this arena
        stream.synchronize()
        self.nv.free_tensor(self.arena_B)
        self.nv.finalize()


def pair_destinations(layouts: Sequence[ArenaLayout], rank: int) -> list[int]:
    """The other ranks `rank` writes pair rows to (a source of one of their pair regions)."""
    return [dst for dst, layout in enumerate(layouts)
            if dst != rank and any(rank in region.sources for region in layout.pairs)]


def check_pair(region: PairRegion, spec: PairSpec, source: int | None, key: MessageKey, receiver: int) -> None:
    """ValueError, naming the fix, unless `spec` is the region's message and `source` (None: the
    receiver's side) one of its sources."""
    if source is not None and source not in region.sources:
        raise ValueError(f"rank {source} is not a source of the pair-row message {key} to rank {receiver} (its "
                         f"sources: {region.sources}, the receive's peers): only ranks serving that receiver's "
                         "experts write its rows")
    want = PairSpec(region.spec, region.segments, region.sources, region.extra_specs)
    if (spec.rows, spec.segments, tuple(spec.sources), tuple(spec.extras)) != (
            want.rows, want.segments, want.sources, want.extras):
        raise ValueError(f"the pair-row message {key} to rank {receiver} was given rows {spec.rows.shape} "
                         f"{spec.rows.dtype}, {spec.segments} segments, sources {spec.sources} and extras "
                         f"{_described(spec.extras)}; its region holds rows {want.rows.shape} {want.rows.dtype}, "
                         f"{want.segments} segments, sources {want.sources}, extras {_described(want.extras)}: "
                         "build the layouts with the same pair_of (and segment tokens) as the messages' specs")


def _described(specs: Sequence[TensorSpec]) -> list[tuple[tuple[int, ...], str]]:
    return [(s.shape, str(s.dtype)) for s in specs]


def check_transport_status(layout: ArenaLayout, rank: int, status: Sequence[int], timeout_s: float) -> None:
    """Raise for the status words of `rank` (whose arena is `layout`): `ArenaOverflow` with the fix
    for a message over its segment; `TransportTimeout` naming the peer and the message for a flag
    that never came, a segment's or a pair region's (word 1: its index in the flag region)."""
    from disagmoe.kernels.signal import OVERFLOW, TIMED_OUT, check_status

    if status[0] & OVERFLOW:
        check_status(list(status), f"rank {rank}")  # ArenaOverflow, with the fix
    if status[0] & TIMED_OUT:
        owner = layout.flag_owner(status[1])
        if owner is None:
            check_status(list(status), f"rank {rank}")  # a flag no message uses: TimeoutError naming it
        if isinstance(owner, tuple) and isinstance(owner[0], SumRegion):
            _, copy, src = owner
            raise TransportTimeout(src, None, timeout_s,
                                   f"receive the share of the all-ranks sum (the step's gradient norm; copy {copy}, "
                                   f"flag {status[1]}) from")
        if isinstance(owner, tuple):
            region, q, s = owner
            payload, layer, mb = region.slot
            raise TransportTimeout(region.sources[q], None, timeout_s,
                                   f"receive segment {s} of {region.segments} of the {payload.value} pair rows of "
                                   f"layer {layer}, micro-batch {mb} (copy {region.copy}, flag {status[1]}) from")
        src, payload, layer, mb = owner.slot
        ring = f" (or of another of the {len(owner.keys)} keys sharing its ring)" if len(owner.keys) > 1 else ""
        raise TransportTimeout(src, None, timeout_s,
                               f"receive the {payload.value} message of layer {layer}, micro-batch {mb}{ring} from")


def _join(nv: Any, rank: int, world_size: int, device: torch.device) -> Any:
    """NVSHMEM init over a unique id that rank 0 creates and the process group relays."""
    import numpy as np
    from cuda.core import Device

    torch.empty(1, device=device)  # the primary context exists before NVSHMEM starts
    uid = nv.get_unique_id() if rank == 0 else nv.get_unique_id(empty=True)  # rank 0's starts the bootstrap
    relayed = [uid._data.tobytes() if rank == 0 else None]
    dist.broadcast_object_list(relayed, src=0)
    if rank != 0:
        uid._data.view(np.int8)[:] = np.frombuffer(relayed[0], dtype=np.int8)
    cuda_device = Device(device.index)
    cuda_device.set_current()
    nv.init(device=cuda_device, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
    return uid


@functools.cache
def available() -> bool:
    """Whether nvshmem4py imports here (tests skip without it)."""
    try:
        _nvshmem()
    except ValueError:
        return False
    return True


def _check_rows(rows: torch.Tensor, messages: list[list[torch.Tensor]], what: str) -> None:
    """ValueError unless the rows a peer-store launch reads have the dtype and width of the rows
    of the segments it stores into (the kernel stores the values as they are, by address)."""
    for message in messages[:1]:
        want = message[0]
        if rows.dtype != want.dtype or rows.shape[-1] != want.shape[-1]:
            raise ValueError(f"{what}: rows {str(rows.dtype)} [..., {rows.shape[-1]}] do not match the segment's "
                             f"{str(want.dtype)} [..., {want.shape[-1]}]; send the run's compute dtype and hidden size")
