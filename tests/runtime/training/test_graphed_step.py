"""The whole single-GPU step in one CUDA graph (disagmoe/runtime/training/graphed_step.py): the
capture protocol on a CPU with a fake graph, the config's refusals, and on a GPU the captured step
equal to the eager one bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch

from disagmoe.config import OptimConfig, TrainConfig
from disagmoe.model import MoETransformer
from disagmoe.model_ref import load_model
from disagmoe.runtime.observe.metrics import read_metrics
from disagmoe.runtime.state.flat_adamw import FlatAdamW
from disagmoe.runtime.training.graphed_step import WARMUP_STEPS, GraphedStep
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.runtime.training.trainer import _flat_step_on_device, train_single


class FakeGraph:
    """Records the body run under `capture`, and runs it again on each replay (as a graph would)."""

    def __init__(self) -> None:
        self.body = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def test_warm_up_eagerly_then_capture_once_then_replay_every_later_step():
    calls = []
    model = MoETransformer(load_model("tiny"))

    class Opt:
        steps_taken = 0
        lr = None

        def set_lr(self, lr):
            self.lr = lr

    optimizer = Opt()
    outputs = (torch.zeros(4), torch.zeros(()), torch.zeros(2, 8, dtype=torch.int64))

    def device_work(tokens_BS1, lr):
        calls.append((int(tokens_BS1[0, 0]), lr))
        outputs[0].fill_(float(tokens_BS1[0, 0]))

    def body(m, opt, tokens_BS1, micro_batches, grad_clip):
        device_work(tokens_BS1, opt.lr)
        opt.steps_taken += 1  # Python: runs in eager steps and once during capture, never in a replay
        return outputs

    graph = FakeGraph()

    @contextlib.contextmanager
    def capture(g):
        # capture records the body's launches but runs nothing: replay it as the graph would
        captured_before = len(calls)
        yield
        g.body = lambda: device_work(step.tokens_BS1, optimizer.lr)
        del calls[captured_before:]  # what ran inside capture did not happen on the device

    step = GraphedStep(model, optimizer, (2, 9), 2, 1.0, body, torch.device("cpu"),
                       graph_factory=lambda: graph, capture=capture)
    for t in range(WARMUP_STEPS + 3):
        out = step(torch.full((2, 9), t), lr=0.1 * t)
        assert float(out[0][0]) == t  # each step's own batch
    assert calls == [(t, 0.1 * t) for t in range(WARMUP_STEPS + 3)]  # every step once, at its lr
    assert graph.replays == 3 and step.replays == 3 and step.eager_steps == WARMUP_STEPS
    assert optimizer.steps_taken == WARMUP_STEPS + 3
    with pytest.raises(ValueError, match="same batch shape"):
        step(torch.zeros(3, 9, dtype=torch.int64), lr=0.1)


@pytest.mark.parametrize("fields, needs", [
    ({"mode": "colocated", "device": "cuda", "transport": "nccl"},
     "captures a colocated rank's step only over transport nvshmem .* set transport: nvshmem"),
    ({"mode": "single", "device": "cpu"}, "captures steps on a GPU; this run is mode single on cpu: set device: cuda"),
    ({"mode": "disaggregated", "device": "cpu"}, "captures steps on a GPU; this run is mode disaggregated on cpu")])
def test_cuda_graphs_are_refused_where_they_do_not_apply(fields, needs):
    with pytest.raises(ValueError, match=f"cuda_graphs: on {needs}"):
        TrainConfig(model="tiny", cuda_graphs="on", **fields)


def test_cuda_graphs_on_refuses_the_loop_backend_with_the_fix():
    with pytest.raises(ValueError, match="experts_backend: loop: the loop reads each expert's row count on the host.*"
                                         "set experts_backend: triton"):
        TrainConfig(model="tiny", mode="single", device="cuda", cuda_graphs="on", experts_backend="loop")


@pytest.mark.parametrize("fields, capture, says", [
    (dict(mode="single", device="cuda", experts_backend="triton"), True,
     "auto -> on: the whole step is captured after 3 eager steps"),
    (dict(mode="single", device="cuda", precision="fp8", experts_backend="triton"), True, "auto -> on"),
    (dict(mode="single", device="cpu"), False, "auto -> eager: a cpu run has no CUDA graphs"),
    (dict(mode="disaggregated", device="cuda"), False, "auto -> eager: transport local posts every message"),
    (dict(mode="single", device="cuda", experts_backend="loop"), False,
     "auto -> eager: experts_backend loop reads each expert's row count on the host"),
    (dict(mode="single", device="cuda", experts_backend="triton", precision="fp32"), False,
     "auto -> eager: precision fp32 steps torch's"),
    (dict(mode="single", device="cuda", experts_backend="triton", offload_optimizer=True), False,
     "auto -> eager: the offloaded optimizer's"),
    (dict(mode="single", device="cuda", experts_backend="triton", optim={"update_kernel": "triton"}), True,
     "auto -> on"),
    (dict(mode="single", device="cuda", recompute="selective", experts_backend="triton"), True, "auto -> on"),
    (dict(mode="single", device="cuda", recompute="full", experts_backend="triton"), True, "auto -> on"),
    (dict(mode="single", device="cuda", precision="fp8", experts_backend="triton", recompute="selective",
          recompute_modules=["expert_input", "expert_swiglu"]), False,
     "auto -> eager: the FP8 experts' selective recomputation has not been checked captured"),
    (dict(mode="single", device="cuda", precision="fp8", experts_backend="triton", recompute="selective",
          recompute_modules=["attention"]), True, "auto -> on"),
    (dict(mode="single", device="cuda", experts_backend="triton", optim={"state_dtype": "bf16"}), True, "auto -> on"),
])
def test_auto_captures_where_the_captured_step_was_checked_and_says_why_not_elsewhere(fields, capture, says):
    from disagmoe.runtime.training.graphed_step import resolve_cuda_graphs

    cfg = TrainConfig(model="tiny", **fields)
    assert cfg.cuda_graphs == "auto"  # the default
    got, note = resolve_cuda_graphs(cfg)
    assert got is capture and f"cuda_graphs: {says}" in note
    assert resolve_cuda_graphs(cfg.model_copy(update={"cuda_graphs": "off"})) == (False, "cuda_graphs: off")


def test_a_bare_yaml_on_or_off_is_read_as_the_word():
    """`cuda_graphs=on` on the command line or `cuda_graphs: on` in a file: YAML reads a bool."""
    from disagmoe.config import apply_overrides

    fields = apply_overrides({"model": "tiny", "mode": "single", "device": "cuda", "experts_backend": "triton"},
                             ["cuda_graphs=on"])
    assert TrainConfig(**fields).cuda_graphs == "on"
    assert TrainConfig(model="tiny", cuda_graphs=False).cuda_graphs == "off"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_cuda_captured_steps_equal_the_eager_steps_bit_for_bit(tmp_path, backend):
    """Eight steps (three eager, then one capture and its replays) against eight eager steps of the
    same run: the same losses, grad norms and final parameters, to the bit."""
    fields = dict(model="tiny", mode="single", device="cuda", steps=8, batch_size=8, seq_len=128, micro_batches=2,
                  eval_every=0, experts_backend=backend, checkpoint_at_end=False,
                  optim=OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=0.5))
    for name, graphs in (("eager", "off"), ("again", "off"), ("graph", "on")):
        train_single(TrainConfig(**fields, cuda_graphs=graphs, out_dir=str(tmp_path / name)))
    eager, again, graph = (read_metrics(tmp_path / d / METRICS_FILE) for d in ("eager", "again", "graph"))
    key = lambda r: (r["loss"], r["grad_norm"], r["expert_load"])  # noqa: E731
    if [key(r) for r in eager] != [key(r) for r in again]:  # a kernel with atomics: eager runs differ too
        pytest.fail(f"two eager runs differ ({[key(r) for r in eager]} vs {[key(r) for r in again]}): "
                    "bit-for-bit equality of the captured step cannot be judged with this backend")
    assert [key(r) for r in graph] == [key(r) for r in eager]
    assert [r["cuda_graph"] for r in graph] == [False] * WARMUP_STEPS + [True] * (8 - WARMUP_STEPS)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [dict(recompute="selective"),
                                     dict(recompute="selective", recompute_modules=["attention"]),
                                     dict(recompute="full"),
                                     dict(optim=OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=0.5,
                                                            state_dtype="bf16")),
                                     dict(precision="fp8", recompute="selective",
                                          recompute_modules=["expert_input", "expert_swiglu"])],
                         ids=["selective-experts", "selective-attention", "full", "bf16-moments", "fp8-selective"])
def test_cuda_captured_recomputing_and_bf16_moment_steps_equal_the_eager_steps(tmp_path, setting):
    """Recomputation (selective experts, selective attention, full) and bf16 moments, which auto
    captures since this passed on an H200 (2026-12-03): with `cuda_graphs: on` their steps equal the
    eager ones to the bit (the triton experts at hidden 256, where the model runs the Triton FFN and
    permute). fp8-selective (the FP8 experts' expert_input and expert_swiglu): not yet run on a GPU;
    auto runs it eagerly (`resolve_cuda_graphs`) until this passes."""
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    fields = dict(model=model, mode="single", device="cuda", steps=6, batch_size=8, seq_len=128, micro_batches=2,
                  eval_every=0, experts_backend="triton", checkpoint_at_end=False,
                  optim=OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=0.5))
    fields.update(setting)
    for name, graphs in (("eager", "off"), ("graph", "on")):
        train_single(TrainConfig(**fields, cuda_graphs=graphs, out_dir=str(tmp_path / name)))
    eager, graph = (read_metrics(tmp_path / d / METRICS_FILE) for d in ("eager", "graph"))
    key = lambda r: (r["loss"], r["grad_norm"], r["expert_load"])  # noqa: E731
    assert [key(r) for r in graph] == [key(r) for r in eager]
    assert [r["cuda_graph"] for r in graph] == [False] * WARMUP_STEPS + [True] * (6 - WARMUP_STEPS)


@pytest.mark.gpu
def test_cuda_a_captured_step_updates_the_parameters_the_model_reads():
    """After the replays the module's parameters (views of the flat compute buffer) hold the
    optimizer's latest masters: nothing in the graph writes into a copy the model does not see."""
    model = MoETransformer(load_model("tiny"), experts_backend="triton").to("cuda", torch.bfloat16)
    optimizer = FlatAdamW(model.named_parameters(), OptimConfig(lr=1e-2, warmup_steps=0), torch.bfloat16)
    step = GraphedStep(model, optimizer, (4, 65), 2, 1.0, _flat_step_on_device, torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    for _ in range(WARMUP_STEPS + 2):
        step(torch.randint(0, 256, (4, 65), generator=gen).cuda(), lr=1e-2)
    torch.cuda.synchronize()
    for b in optimizer.buckets:
        assert torch.equal(b.compute_N, b.master_S.to(torch.bfloat16)), b.name
    assert step.replays == 2


# --- a distributed rank's step: a graph per phase of the transport's counts (`PhasedGraphs`) --------


class FakeTransport:
    """The one-sided transport's host counts alone (`comm.counts.RingCounts`): two rings of 4
    segments taking 2 messages a step each (step-aligned: phases repeat every 2 steps), the forward
    one also 2 per evaluation batch."""

    RINGS = {("sent", 1, "forward"): 4, ("received", 1, "gradient"): 4}

    def __init__(self) -> None:
        from disagmoe.comm.counts import RingCounts

        self.counts = RingCounts(self.RINGS.__getitem__)

    def step(self) -> None:  # what the rank's step body sends and receives
        for key in self.RINGS:
            for _ in range(2):
                self.counts.next(key)

    def evaluate(self) -> None:  # an evaluation batch: the forward messages alone
        for _ in range(2):
            self.counts.next(("sent", 1, "forward"))

    def phase(self):
        return self.counts.phase()

    def message_counts(self):
        return self.counts.snapshot()

    def messages_since(self, before):
        from disagmoe.comm.counts import counts_between

        return counts_between(before, self.counts.snapshot())

    def advance(self, step):
        self.counts.advance(step)

    def realign(self, target_phase):
        return self.counts.realign(target_phase)


class FakeCapture:
    """`torch.cuda.graph` for `FakeGraph`: the body runs its Python (the host counts move) but its
    device work is recorded, not done; the graph's replay does it."""

    def __init__(self, work: list) -> None:
        self.work, self.pools = work, []

    @contextlib.contextmanager
    def __call__(self, graph, pool=None):
        self.pools.append(pool)
        done = len(self.work)
        yield
        recorded = self.work[done:]
        del self.work[done:]  # capture ran nothing on the device
        graph.body = lambda: self.work.extend(recorded)


class PooledGraph(FakeGraph):
    def pool(self):
        return id(self)


def _phased(transport, work, **kw):
    from disagmoe.runtime.training.graphed_step import PhasedGraphs

    capture = FakeCapture(work)
    return PhasedGraphs(transport, torch.device("cpu"), graph_factory=PooledGraph, capture=capture, **kw), capture


def test_a_rank_step_is_captured_once_per_phase_after_the_warm_up_and_replayed_with_its_counts():
    from disagmoe.runtime.training.graphed_step import WARMUP_STEPS

    transport, work, captured = FakeTransport(), [], []
    graphs, capture = _phased(transport, work)

    def body():
        transport.step()
        work.append(("step", transport.phase()))  # device work, tagged with the phase it was issued in
        return ("outputs", transport.phase())

    reference = FakeTransport()
    replayed = []
    for _ in range(WARMUP_STEPS + 5):
        out, was_replay = graphs(body, on_capture=lambda: captured.append(len(work)))
        reference.step()
        replayed.append(was_replay)
        assert transport.message_counts() == reference.message_counts()  # a replay counts what the step sent
        assert out[1] == reference.phase()  # the outputs of the graph of this step's phase
    assert replayed == [False] * WARMUP_STEPS + [True] * 5
    assert len(graphs.graphs) == 2 and graphs.replays == 5 and graphs.eager_steps == WARMUP_STEPS
    assert len(work) == WARMUP_STEPS + 5  # every step's device work once: eager or replayed
    assert [w[1] for w in work[::2]] == [work[0][1]] * ((WARMUP_STEPS + 6) // 2)  # each replay its own phase's
    assert capture.pools == [None, id(next(iter(graphs.graphs.values())).graph)]  # the second shares the first's
    assert len(captured) == 2


def test_after_an_evaluation_the_counts_are_realigned_and_the_next_step_replays():
    """An evaluation batch moves the forward ring by 2 of 4 (phases no training step met): the next
    step skips the counts back to the phase the last step left and replays that phase's graph: no
    eager step, no third graph, every step in the phase of a run without evaluations."""
    transport, work = FakeTransport(), []
    graphs, _ = _phased(transport, work, warmup_steps=2)
    reference = FakeTransport()

    def body():
        transport.step()
        work.append(transport.phase())
        return "outputs"

    kinds, moved = [], []
    for step in range(9):
        if step == 4:
            transport.evaluate()
        moved.append(transport.phase() != reference.phase())
        kinds.append(graphs(body)[1])
        reference.step()
        assert work[-1] == reference.phase(), step  # every step ends where one without the evaluation would
    assert moved == [False] * 4 + [True] + [False] * 4, "the evaluation moved the phase before step 4"
    assert kinds == [False, False] + [True] * 7
    assert len(graphs.graphs) == 2 and graphs.eager_steps == 2 and graphs.realignments == 1
    forward = ("sent", 1, "forward")
    assert transport.message_counts()[forward] == reference.message_counts()[forward] + 4  # 2 sent, 2 skipped


def test_evaluations_in_the_warm_up_and_back_to_back_still_give_two_graphs():
    """Evaluations during the warm-up and after it, one moving the ring by a whole turn (no skip):
    the warm-up still meets both phases, every later step replays one of the two graphs."""
    transport, work = FakeTransport(), []
    graphs, _ = _phased(transport, work, warmup_steps=3)
    reference = FakeTransport()

    def body():
        transport.step()
        work.append(transport.phase())

    kinds = []
    for step in range(10):
        for _ in range({1: 1, 5: 2, 6: 1}.get(step, 0)):  # evaluation batches before this step
            transport.evaluate()
        kinds.append(graphs(body)[1])
        reference.step()
        assert work[-1] == reference.phase(), step  # every step ends where one without evaluations would
    assert kinds == [False] * 3 + [True] * 7
    assert len(graphs.graphs) == 2 and graphs.realignments == 2  # step 5's 2 batches: 4 of 4 messages, no skip


def test_past_max_graphs_a_phase_runs_eagerly():
    transport, work = FakeTransport(), []
    graphs, _ = _phased(transport, work, warmup_steps=2, max_graphs=1)

    def body():
        transport.step()
        work.append("step")

    kinds = [graphs(body)[1] for _ in range(6)]
    assert kinds == [False, False, True, False, True, False] and len(graphs.graphs) == 1


def test_a_rank_step_is_captured_thread_local_so_its_processs_other_threads_cannot_end_it(monkeypatch):
    """A rank's process has threads that may touch the CUDA context (NVSHMEM's proxy, Ray's): under
    torch's default global capture mode an unsafe call of theirs would invalidate the capture."""
    from disagmoe.runtime.training.graphed_step import PhasedGraphs

    transport, work, modes = FakeTransport(), [], []
    fake = FakeCapture(work)

    @contextlib.contextmanager
    def torch_graph(graph, pool=None, capture_error_mode="global"):
        modes.append(capture_error_mode)
        with fake(graph, pool):
            yield

    monkeypatch.setattr(torch.cuda, "graph", torch_graph)
    graphs = PhasedGraphs(transport, torch.device("cpu"), warmup_steps=1, graph_factory=PooledGraph)

    def body():
        transport.step()
        work.append("step")

    assert [graphs(body)[1] for _ in range(4)] == [False, False, True, True]  # each phase: eager, then captured
    assert modes == ["thread_local", "thread_local"]  # a capture per phase, both thread-local


# --- two kinds of step (precision fp8 with fp8_counters_every > 1): a graph for each, one pool ----------


def test_each_kind_of_step_is_captured_once_after_the_warm_up_into_one_pool_and_replayed():
    """Steps of two kinds (the FP8 counters on or off, `GraphedStep`'s variant): the warm-up runs
    both eagerly; after it each kind is captured the first time it comes (the second capture in the
    first one's pool) and replayed from then on, each replay the device work of its own kind; a kind
    the warm-up did not run runs eagerly once first."""
    work: list = []
    capture = FakeCapture(work)

    class Opt:
        steps_taken = 0
        lr = None

        def set_lr(self, lr):
            self.lr = lr

    def body(m, opt, tokens_BS1, micro_batches, grad_clip):
        work.append((kind[0], int(tokens_BS1[0, 0])))
        opt.steps_taken += 1
        return (torch.zeros(4), torch.zeros(()), torch.zeros(2, 8, dtype=torch.int64))

    kind = [None]
    step = GraphedStep(MoETransformer(load_model("tiny")), Opt(), (2, 9), 2, 1.0, body, torch.device("cpu"),
                       graph_factory=PooledGraph, capture=capture)
    kinds = [True, False, False, False, True, False, True, "third", "third"]
    for t, k in enumerate(kinds):
        kind[0] = k
        step(torch.full((2, 9), t), lr=0.1, variant=k)
    # eager: the warm-up (t 0-2) and the third kind's first step (t 7); captured: False at t 3, True at t 4,
    # "third" at t 8; each replay did its kind's work on the batch its capture read (the static input)
    assert step.eager_steps == WARMUP_STEPS + 1 and step.replays == len(kinds) - WARMUP_STEPS - 1
    assert set(step.graphs) == {True, False, "third"}
    assert [k for k, _ in work] == kinds
    first = step.graphs[False].graph
    assert capture.pools == [None, first.pool(), first.pool()]
    assert step.optimizer.steps_taken == len(kinds)


def test_counted_fp8_steps_are_every_nth_the_first_this_process_runs_and_the_last():
    from disagmoe.runtime.training.trainer import counts_fp8

    def counted(every, first, last):
        return [s for s in range(first, last + 1) if counts_fp8(s, every, first, last)]

    assert counted(1, 1, 5) == [1, 2, 3, 4, 5]
    assert counted(10, 1, 25) == [1, 10, 20, 25]
    assert counted(10, 13, 25) == [13, 20, 25]  # resumed at step 12: its first step counts
    for every in (2, 3, 4, 50):  # the warm-up (the first three steps) runs both kinds, past every = 1
        warm_up = [counts_fp8(s, every, 7, 300) for s in range(7, 7 + WARMUP_STEPS)]
        assert set(warm_up) == {True, False}, every


# --- which steps capture (`bench.timing.capture_steps`: what `bench train` and `bench profile` leave untimed)


def test_first_captures_are_the_steps_graphed_step_captures_on():
    """`first_captures` follows `GraphedStep`'s own rule (`captures_now`): the step each kind's graph is
    captured on, over a run's kinds of step (a third kind the warm-up missed: eager once first; an fp8
    run's counted and uncounted steps, every 10th, of a 25-step and a 6-step run)."""
    from disagmoe.runtime.training.graphed_step import first_captures
    from disagmoe.runtime.training.trainer import counts_fp8

    class Opt:
        steps_taken = 0

        def set_lr(self, lr):
            pass

    def body(m, opt, tokens_BS1, micro_batches, grad_clip):
        return (torch.zeros(4), torch.zeros(()), torch.zeros(2, 8, dtype=torch.int64))

    model = MoETransformer(load_model("tiny"))
    runs = [[True, False, False, False, True, False, True, "third", "third"],
            [counts_fp8(s, 10, 1, 25) for s in range(1, 26)], [counts_fp8(s, 10, 1, 6) for s in range(1, 7)]]
    for kinds in runs:
        capture = FakeCapture([])
        step = GraphedStep(model, Opt(), (2, 9), 2, 1.0, body, torch.device("cpu"), graph_factory=PooledGraph,
                           capture=capture)
        captured_on = []
        for number, kind in enumerate(kinds, start=1):
            before = len(capture.pools)
            step(torch.zeros((2, 9), dtype=torch.int64), lr=0.1, variant=kind)
            captured_on += [number] * (len(capture.pools) - before)
        assert first_captures(kinds) == captured_on
    assert [first_captures(kinds) for kinds in runs] == [[4, 5, 9], [4, 10], [4, 6]]
    assert first_captures(runs[1], graphs=1) == [4]


def test_first_captures_are_the_steps_a_rank_captures_its_phases_on():
    """A rank whose transport's counts alternate between two phases (`FakeTransport`) captures on steps
    WARMUP_STEPS + 1 and + 2, as `first_captures` of alternating kinds gives (`bench.timing.capture_steps`'
    distributed case); one phase throughout: the first alone."""
    from disagmoe.runtime.training.graphed_step import MAX_PHASE_GRAPHS, first_captures

    transport, work, captured_on = FakeTransport(), [], []
    graphs, _ = _phased(transport, work)

    def body():
        transport.step()
        work.append("step")

    for number in range(1, WARMUP_STEPS + 5):
        graphs(body, on_capture=lambda n=number: captured_on.append(n))
    assert captured_on == first_captures((n % 2 for n in range(1, 100)), MAX_PHASE_GRAPHS) == [4, 5]
    assert first_captures([0] * 10, MAX_PHASE_GRAPHS) == [4]
