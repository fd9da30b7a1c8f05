"""The whole single-GPU training step in one CUDA graph (`cuda_graphs: on`, or auto where it applies:
`resolve_cuda_graphs`; issue 20 item 1).

    step = GraphedStep(model, optimizer, batch_shape, micro_batches, grad_clip)
    totals, norm, load_LE = step(tokens_BS1, lr)   # device tensors, read once by the caller

The step's body (`trainer._flat_step_on_device`: every micro-batch's forward and backward, the
gradient norm, the clip, FlatAdamW's fused update, the router-bias update) makes no host wait and
allocates nothing whose size depends on the data (expert rows are sized for any routing), so it
can be captured once and replayed: one launch per step instead of thousands, which removes the
launch gaps between the small kernels (the profiled H200 step was 80.6% busy).

Capture protocol (torch's rules for graphs with autograd and optimizers):
- the first `WARMUP_STEPS` steps run eagerly on a side stream (real steps of the run: Triton's
  autotuning, lazily created optimizer state and cuBLAS workspaces happen there, outside capture;
  `captures_now`, which `first_captures` follows over a run's steps: the capture steps `bench train`
  and `bench profile` leave untimed, `bench.timing.capture_steps`);
- the eager allocator's cached blocks are released, then the next step's body is captured into a
  graph with its own memory pool; capture runs nothing, so that step is then replayed like every
  later one;
- inputs enter through static buffers: the batch is copied into `tokens_BS1` and the learning rate
  written into the optimizer's device scalar (`FlatAdamW.set_lr`) before each replay; the outputs
  are the graph's own tensors, overwritten by the next replay (the caller reads them first);
- kinds of step (the caller's `variant`: precision fp8 with `fp8_counters_every` > 1 runs steps
  with the FP8 counters' kernels and steps with the plain ones): each kind is captured the first
  time it comes after the warm-up, provided an eager step of that kind ran (its kernels compiled,
  its buffers made), into a graph sharing the first one's memory pool. torch's documented condition
  for sharing is replaying in capture order; these replay interleaved, which is safe because no graph
  reads what another wrote: each step's outputs are read right after its replay, and everything that
  outlives a step (parameters, optimizer state, FP8 counters and weight copies) was allocated in the
  eager warm-up, outside the pool (a step body must not keep anything it allocates under capture);
  a kind that did not run in
  the warm-up runs eagerly once first (the trainer's schedule makes the warm-up run both kinds,
  so that eager step, whose activations would sit beside the pool, does not come).
Checkpoint restores and evaluation write or read parameters in place and eagerly, outside the graph,
so a replay after them sees their values.

A distributed rank's step (`PhasedGraphs`) reuses the warm-up stream and the capture
(`run_on_warmup_stream`, `capture_graph`) but keeps a graph per phase of the one-sided
transport's message counts (`comm.counts`), counting each replay's messages (`advance`); after an
evaluation it skips the counts back into the phase the next step was captured in (`realign`), so
the step replays at once: no eager step, whose activations would sit beside the graphs' pool.
Its capture is thread-local (`RANK_CAPTURE_MODE`): a rank's process has threads of its own that may
touch the CUDA context (NVSHMEM's proxy, Ray's), and under torch's default global mode any unsafe
call of theirs during the capture would invalidate it; what is captured follows the stream either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from disagmoe.config import TrainConfig
from disagmoe.model import MoETransformer
from disagmoe.runtime.schedule.step_capture import StepSettings, one_gpu_blockers
from disagmoe.runtime.state.flat_adamw import FlatAdamW

WARMUP_STEPS = 3  # eager steps before capture (torch asks for a few on a side stream)


def resolve_cuda_graphs(cfg: TrainConfig) -> tuple[bool, str]:
    """(capture the step?, the one line that says so and why) for `cfg.cuda_graphs` (a distributed
    mode's rank steps: `runtime.rank_graphs.resolve_rank_graphs`, which refuses `on` where it cannot
    apply). auto captures
    where the captured step has been checked against the eager one on a GPU (tests/runtime/training/
    test_graphed_step.py, the FP8 counters' captured test): mode single on CUDA, the triton or grouped_mm experts,
    bf16 or fp8, any recomputation (but the FP8 experts' selective modules, whose captured test has not run on a GPU
    yet), fp32 or bf16 moments, the optimizer on the device; elsewhere it runs eagerly and names what is missing.
    `optim.update_kernel: triton` is captured too: its launch reads nothing on the host, and its captured steps
    equal its eager ones bit for bit on an H200 (tests/runtime/state/test_flat_adamw.py, 2026-12-03)."""
    if cfg.mode != "single":
        from disagmoe.model_ref import load_model
        from disagmoe.runtime.rank_graphs import resolve_rank_graphs
        from disagmoe.runtime.topology import Topology

        return resolve_rank_graphs(cfg, Topology.from_config(cfg, load_model(cfg.model)))
    if cfg.cuda_graphs != "auto":
        return cfg.cuda_graphs == "on", f"cuda_graphs: {cfg.cuda_graphs}"
    eager = next((why for why, _ in one_gpu_blockers(StepSettings.of_run(cfg))), None)
    if eager is None and cfg.expert_precision == "fp8" and cfg.recompute_set & {"expert_input", "expert_swiglu"}:
        eager = "the FP8 experts' selective recomputation has not been checked captured on a GPU yet"
    if eager is not None:
        return False, f"cuda_graphs: auto -> eager: {eager}"
    return True, (f"cuda_graphs: auto -> on: the whole step is captured after {WARMUP_STEPS} eager steps and "
                  "replayed (one launch per step)")


def captures_now(eager_steps: int, seen: bool, warmup_steps: int = WARMUP_STEPS) -> bool:
    """Whether a step of a kind (or phase) that has no graph yet is captured now, not run eagerly: once
    `warmup_steps` eager steps ran and one of them was of its kind (`GraphedStep`, `PhasedGraphs`;
    `first_captures` follows the rule over a run's steps)."""
    return eager_steps >= warmup_steps and seen


def first_captures(kinds: Iterable[Hashable], graphs: int | None = None,
                   warmup_steps: int = WARMUP_STEPS) -> list[int]:
    """The steps (1-based) that capture a graph in a run whose steps are of `kinds` in turn
    (`captures_now`), until `graphs` are captured (None: to the end of `kinds`)."""
    made: set[Hashable] = set()
    seen: set[Hashable] = set()
    eager, captured = 0, []
    for step, kind in enumerate(kinds, start=1):
        if graphs is not None and len(captured) >= graphs:
            break
        if kind in made:
            continue
        if captures_now(eager, kind in seen, warmup_steps):
            made.add(kind)
            captured.append(step)
        else:
            seen.add(kind)
            eager += 1
    return captured


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every warm-up step of the process runs on: one per device, not one per step
    or run: torch keys cuBLAS workspaces by stream and keeps them for the process's life, so a
    new stream per run left each run's workspaces allocated, counted in the next run's peak (a
    small run after a large one in one process, as `bench train`'s variants, reported the larger
    peak on an H200, 2026-12-03)."""
    return torch.cuda.Stream(device)


StepBody = Callable[[MoETransformer, FlatAdamW, torch.Tensor, int, float],
                    tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class GraphedStep:
    """`body` (the step on the device) run eagerly for `WARMUP_STEPS` steps, then captured once in a
    CUDA graph and replayed (module docstring); a run with two kinds of step (precision fp8 with
    `fp8_counters_every` > 1: steps with the FP8 counters and steps without) captures each kind once,
    in graphs sharing one memory pool (they never run together). `graph_factory` and `capture` are
    torch's `CUDAGraph` and `torch.cuda.graph` (tests substitute fakes to check the protocol on a CPU)."""

    def __init__(self, model: MoETransformer, optimizer: FlatAdamW, batch_shape: tuple[int, ...], micro_batches: int,
                 grad_clip: float, body: StepBody, device: torch.device,
                 graph_factory: Callable[[], object] | None = None,
                 capture: Callable[..., object] | None = None) -> None:
        self.model, self.optimizer, self.body = model, optimizer, body
        self.micro_batches, self.grad_clip, self.device = micro_batches, grad_clip, device
        self.tokens_BS1 = torch.zeros(batch_shape, dtype=torch.int64, device=device)  # the static input
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.capture = capture or torch.cuda.graph
        self.eager_steps = 0
        self.graphs: dict[Hashable, CapturedStep] = {}  # one per kind of step (`__call__`'s variant)
        self.seen: set[Hashable] = set()  # the kinds an eager step ran
        self.replays = 0

    def __call__(self, tokens_BS1: torch.Tensor, lr: float,
                 variant: Hashable = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step on `tokens_BS1` at `lr`: (summed loss parts, grad norm, expert loads), device
        tensors. `variant`: which kind of step the body runs now (the caller sets the model up for
        it first: the FP8 counters on or off, `TrainConfig.fp8_counters_every`); each kind has a
        graph of its own, captured once the warm-up is over and an eager step of that kind ran
        (module docstring)."""
        if tokens_BS1.shape != self.tokens_BS1.shape:
            raise ValueError(f"a captured step takes batches of {tuple(self.tokens_BS1.shape)}, got "
                             f"{tuple(tokens_BS1.shape)}: every step of a run has the same batch shape")
        self.tokens_BS1.copy_(tokens_BS1, non_blocking=True)
        self.optimizer.set_lr(lr)
        entry = self.graphs.get(variant)
        if entry is None:
            if not captures_now(self.eager_steps, variant in self.seen):
                self.seen.add(variant)
                self.eager_steps += 1
                return self._eager()
            entry = self.graphs[variant] = self._capture()
        entry.graph.replay()
        self.optimizer.steps_taken += 1  # a Python counter the captured step does not advance
        self.replays += 1
        return entry.outputs

    def _run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.body(self.model, self.optimizer, self.tokens_BS1, self.micro_batches, self.grad_clip)

    def _eager(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return run_on_warmup_stream(self.device, self._run)

    def _capture(self) -> CapturedStep:
        taken = self.optimizer.steps_taken
        first = next(iter(self.graphs.values()), None)
        pool = first.graph.pool() if first is not None and hasattr(first.graph, "pool") else None
        graph, outputs = capture_graph(self._run, self.device, self.graph_factory, self.capture, pool)
        self.optimizer.steps_taken = taken  # capture ran nothing: the replay that follows is the step
        return CapturedStep(graph, outputs)


@dataclass
class CapturedStep:
    graph: object
    # overwritten by the next replay of any graph of the pool (a later capture may have placed its
    # tensors in an earlier graph's scratch): read after each replay, before the next
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


T = TypeVar("T")


def run_on_warmup_stream(device: torch.device, body: Callable[[], T]) -> T:
    """An eager step before (or between) captures: on the process's warm-up stream (`warmup_stream`),
    ordered after and before the current stream's work; on a CPU just `body()`."""
    if device.type != "cuda":
        return body()
    side = warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out = body()
    torch.cuda.current_stream(device).wait_stream(side)
    return out


def capture_graph(body: Callable[[], T], device: torch.device, graph_factory: Callable[[], object],
                  capture: Callable[..., object], pool: object | None = None) -> tuple[object, T]:
    """(the graph, `body`'s outputs) of `body` captured into a new graph (`graph_factory`) under
    `capture` (torch's `CUDAGraph` and `torch.cuda.graph`, or a test's fakes): capture runs nothing,
    so the caller replays it once for the step it stands for. `pool`: another graph's memory pool to
    share (graphs replayed one at a time, never together). The eager steps' cached blocks are given
    back first, so the graph's pool is not a second peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    graph = graph_factory()
    with capture(graph, **({} if pool is None else {"pool": pool})):
        outputs = body()
    return graph, outputs


def is_capturing(device: torch.device) -> bool:
    """Whether the current stream of `device` is being captured (no event query, no timing event)."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


MAX_PHASE_GRAPHS = 2  # a training step alternates between two phases (evaluations realign, `PhasedGraphs`)
RANK_CAPTURE_MODE = "thread_local"  # `PhasedGraphs`' capture: only this thread's unsafe calls end it (module docstring)


@dataclass
class PhaseGraph:
    graph: object
    outputs: object  # the captured step's outputs: its replays overwrite them, the caller reads them after
    step_counts: dict  # the transport's `messages_since` the capture began: what a replay sends and receives


class PhasedGraphs:
    """A distributed rank's step under CUDA graphs (issue 20 item 1; `runtime.rank_graphs` says
    where): a graph per phase of the one-sided transport's message counts (`comm.counts`).

        out, replayed = graphs(body)   # body: the rank's step on the device, returning what the step's read needs

    - Every step starts in the phase the last one left (`expected`; the transport's phase at
      construction for the first): where anything sent between the two (an evaluation's forward
      messages) moved the counts, the transport first skips them on to it (`realign`, the same on
      every rank, no message: `comm.counts`). So a run's steps alternate between the (at most two,
      `reuse_order.step_ring`) phases of its training steps, evaluations or not.
    - The first `warmup_steps` steps run eagerly on the warm-up stream (`run_on_warmup_stream`).
    - After them, a step in a phase that has a graph replays it: the transport first counts the
      replay's messages (`advance`), as the captured step's own calls did.
    - A step in a phase without one captures it if an eager step already ran in that phase (its
      address tables and launch scratch exist: none is made during capture) and fewer than
      `max_graphs` exist, then replays it once: capture sends nothing, the replay is the step, and
      the counts the capture moved are that step's. Otherwise it runs eagerly (never, where the
      rings are rounded to a step's messages: both phases run in the warm-up).
    The graphs share one memory pool (they never run together). `graph_factory` and `capture` are
    torch's; tests pass fakes."""

    def __init__(self, transport: object, device: torch.device, warmup_steps: int = WARMUP_STEPS,
                 max_graphs: int = MAX_PHASE_GRAPHS, graph_factory: Callable[[], object] | None = None,
                 capture: Callable[..., object] | None = None) -> None:
        self.transport, self.device = transport, device
        self.warmup_steps, self.max_graphs = warmup_steps, max_graphs
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.capture = capture or functools.partial(torch.cuda.graph, capture_error_mode=RANK_CAPTURE_MODE)
        self.graphs: dict[frozenset, PhaseGraph] = {}
        self.seen: set[frozenset] = set()  # phases an eager step ran in
        self.expected = transport.phase()  # the phase the next step starts in: the last step's end
        self.eager_steps = self.replays = self.realignments = 0

    def __call__(self, body: Callable[[], T], on_capture: Callable[[], None] | None = None) -> tuple[T, bool]:
        """(the step's outputs, whether it was a replay). `on_capture`: called after a capture, before
        its replay (the caller undoes the host counters the captured body advanced)."""
        if self.transport.phase() != self.expected:  # messages outside training steps (an evaluation)
            self.transport.realign(self.expected)
            self.realignments += 1
        out, replayed = self._step(self.expected, body, on_capture)
        self.expected = self.transport.phase()
        return out, replayed

    def _step(self, phase: frozenset, body: Callable[[], T],
              on_capture: Callable[[], None] | None) -> tuple[T, bool]:
        entry = self.graphs.get(phase)
        if entry is not None:
            self.transport.advance(entry.step_counts)
        elif (captures_now(self.eager_steps, phase in self.seen, self.warmup_steps)
              and len(self.graphs) < self.max_graphs):
            entry = self.graphs[phase] = self._capture(body)
            if on_capture is not None:
                on_capture()
        else:
            self.seen.add(phase)
            self.eager_steps += 1
            return run_on_warmup_stream(self.device, body), False
        entry.graph.replay()
        self.replays += 1
        return entry.outputs, True

    def _capture(self, body: Callable[[], T]) -> PhaseGraph:
        before = self.transport.message_counts()
        first = next(iter(self.graphs.values()), None)
        pool = first.graph.pool() if first is not None and hasattr(first.graph, "pool") else None
        graph, outputs = capture_graph(body, self.device, self.graph_factory, self.capture, pool)
        return PhaseGraph(graph, outputs, self.transport.messages_since(before))
