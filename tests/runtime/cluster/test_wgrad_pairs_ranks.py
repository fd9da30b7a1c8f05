"""`expert_wgrad_pairs` on the ranks of a distributed run: each expert rank pairs its own expert weight-gradient
launches over its step (`runtime.cluster.worker`, `kernels.wgrad_pairs`), the driver resolves auto from the
ranks' memory (`driver.resolve_distributed_wgrad_pairs`), and the memory model holds the waiting rows
(`activation_memory.replay_peak`'s `waits`)."""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.roofline import memory as mem
from disagmoe.runtime.activation_memory import RankActivations, pairs_wgrads, rank_activations, replay_peak
from disagmoe.runtime.cluster import driver
from disagmoe.runtime.cluster.driver import resolve_distributed_wgrad_pairs
from disagmoe.runtime.cluster.worker import TrainWorker
from disagmoe.runtime.observe.trace import SpanRecorder
from disagmoe.runtime.schedule.schedule import ExpertBackward, ExpertForward, OptimizerStep
from disagmoe.runtime.topology import Topology
from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


def _cfg(**fields) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="disaggregated", attention_ranks=1, expert_ranks=1, batch_size=8,
                seq_len=16, micro_batches=4, experts_backend="triton", out_dir="unused")
    return TrainConfig(**{**base, **fields})


def test_the_distributed_modes_pair_where_the_experts_add_into_main_gradients():
    """Every rank's FlatAdamW gives its experts main gradients, whatever the precision (the single trainer's
    fp32 oracle path has none); the triton backend, 2+ micro-batches and bf16 weight gradients still apply."""
    assert _cfg().pairs_expert_wgrads and _cfg(mode="colocated", colocated_ranks=2).pairs_expert_wgrads
    assert _cfg(precision="fp32").pairs_expert_wgrads  # fp32 moments: still FlatAdamW on a rank
    assert not _cfg(micro_batches=1).pairs_expert_wgrads
    assert not _cfg(experts_backend="grouped_mm").pairs_expert_wgrads
    assert pairs_wgrads(_cfg(hop="pair_rows"), pair_rows=True)  # one band: one group per local expert
    assert not pairs_wgrads(_cfg(hop="pair_rows", pair_bands=2), pair_rows=True)  # banded groups run alone
    assert pairs_wgrads(_cfg(pair_bands=2), pair_rows=False)  # bands mean nothing without pair rows


def test_a_layers_expert_backward_leaves_its_rows_waiting_for_the_layers_next():
    """`waits`: the first, third, ... expert backward of a layer adds its rows after its span; the next one of
    the layer holds them through its span and frees both (its launch ran); an odd last one's stay."""
    program = (ExpertForward(0, 0), ExpertForward(1, 0), ExpertBackward(1, 0), ExpertBackward(0, 0),
               ExpertForward(0, 1), ExpertBackward(0, 1), ExpertForward(0, 2), ExpertBackward(0, 2))
    kept = lambda op: 10 if isinstance(op, ExpertForward) else 0  # noqa: E731
    held = lambda op: 1 if isinstance(op, ExpertBackward) else 0  # noqa: E731
    assert replay_peak(program, kept, held) == RankActivations(21, 1, "ExpertBackward L1 mb0")
    # with 5 waiting per backward: after L1 mb0 and L0 mb0 10 wait; mb1's forward 20, its backward 21 (pairs L0);
    # mb2's forward 10 + 5 (L1's rows, never paired) = 15, its backward 16
    assert replay_peak(program, kept, held, waits=lambda op: 5) == RankActivations(21, 1, "ExpertBackward L1 mb0")
    waits = {ExpertBackward(1, 0): 50, ExpertBackward(0, 0): 7}
    # L1 mb0's 50 wait for good: mb1's forward 7 + 50 + 10, its backward + 1 = 68
    assert replay_peak(program, kept, held, waits=lambda op: waits.get(op, 0)) == RankActivations(
        68, 1, "ExpertBackward L0 mb1")


@pytest.mark.parametrize("fields", [dict(), dict(expert_ranks=2), dict(mode="colocated", colocated_ranks=2),
                                    dict(mode="colocated", colocated_ranks=4, pipeline_groups=2)])
def test_the_waiting_rows_add_nothing_to_a_peak_at_the_first_backward(fields):
    """Every forward of a step runs before its first backward, so each rank's peak is at that backward, before
    any rows wait: pairs leave every rank's predicted peak as it is (the model counts them all the same)."""
    on, off = _cfg(**fields), _cfg(**fields, expert_wgrad_pairs="off")
    topology = Topology.from_config(on, on.model)
    assert rank_activations(on, on.model, topology) == rank_activations(off, off.model, topology)
    # and they are counted: the expert rank's rows on top of an otherwise empty program
    m, rows = on.model, on.batch_size // on.micro_batches * on.seq_len * on.model.top_k
    assert mem.paired_wgrad_waiting_bytes(m, rows, m.num_experts, 4) > 0


@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad"])
def test_an_fp8_expert_ranks_waiting_rows_are_its_recipes(monkeypatch, backward):
    """The replay's waits on an FP8 expert rank: the all-FP8 backward's e4m3 token-group copies of its received
    rows in its local experts (`memory.paired_wgrad_waiting_bytes(..., fp8_token_groups=True)`), the default
    recipe's bf16 rows."""
    from disagmoe.runtime import activation_memory

    cfg = _cfg(expert_ranks=2, precision="fp8", device="cuda", fp8_expert_backward=backward)
    m, topology = cfg.model, Topology.from_config(cfg, cfg.model)
    seen = {}
    real = activation_memory.replay_peak

    firsts = {}

    def recorded(program, kept, held, waits=None, first_holds=None):
        seen.update({op: waits(op) for op in program if isinstance(op, ExpertBackward)} if waits else {})
        firsts.update({op: first_holds(op) for op in program if isinstance(op, ExpertBackward)} if first_holds else {})
        return real(program, kept, held, waits, first_holds)

    monkeypatch.setattr(activation_memory, "replay_peak", recorded)
    rank_activations(cfg, m, topology)
    rows = cfg.batch_size // cfg.micro_batches * cfg.seq_len * m.top_k  # one attention rank's every row
    groups = m.num_experts // 2
    want = mem.paired_wgrad_waiting_bytes(m, rows, groups, 2, fp8_token_groups=backward == "fp8")
    assert seen and set(seen.values()) == {want}
    # and what the first backward of a pair holds more over its span, where its recipe holds any (a distributed
    # rank counts its FP8 numerics every step: no fused e4m3 copies)
    first = rows * mem.paired_first_held_bytes(m, 2, cfg.recompute_set, True, backward, fused_copies=False)
    assert set(firsts.values()) == ({first} if first else set())


def test_auto_pairs_the_ranks_and_says_so():
    cfg, line = resolve_distributed_wgrad_pairs(_cfg(), load_model("tiny"), 2**34)
    assert cfg.expert_wgrad_pairs == "on" and cfg.pairs_expert_wgrads
    assert line.startswith("expert_wgrad_pairs: auto -> on: each expert rank runs each expert weight gradient 2 "
                           "times a step over 4 micro-batches' rows")
    assert resolve_distributed_wgrad_pairs(_cfg(expert_wgrad_pairs="off"), load_model("tiny"), 2**34)[1] is None
    one, line = resolve_distributed_wgrad_pairs(_cfg(micro_batches=1), load_model("tiny"), 2**34)
    assert one.expert_wgrad_pairs == "off" and line is None  # nothing to pair, nothing asked


def test_auto_turns_pairs_off_where_the_waiting_rows_would_pass_the_headroom(monkeypatch):
    """Where the rows raise the fullest device's peak past 85% of its memory, auto runs a launch per micro-batch
    and says why; where they add nothing (a peak at the first backward), a tight device keeps them on."""
    tight = 1.0  # bytes: every run is past it
    cfg, _ = resolve_distributed_wgrad_pairs(_cfg(), load_model("tiny"), tight)
    assert cfg.expert_wgrad_pairs == "on"  # the rows add nothing: the memory check decides the run on its own
    need = driver.largest_device_need
    monkeypatch.setattr(driver, "largest_device_need",  # rows that raise the peak by 1 GiB
                        lambda run, model, states: need(run, model, states) + (2**30 if run.pairs_expert_wgrads else 0))
    off, line = resolve_distributed_wgrad_pairs(_cfg(), load_model("tiny"), 2**30)
    assert off.expert_wgrad_pairs == "off" and not off.pairs_expert_wgrads
    assert "auto -> off: a micro-batch's waiting expert rows would take the fullest device's predicted peak" in line
    on, line = resolve_distributed_wgrad_pairs(_cfg(expert_wgrad_pairs="on"), load_model("tiny"), 2**30)
    assert on.expert_wgrad_pairs == "on" and "+1.00 GiB for the waiting rows" in line  # on is the user's


def test_pair_rows_in_bands_cannot_pair():
    cfg, line = resolve_distributed_wgrad_pairs(_cfg(hop="pair_rows", pair_bands=2), load_model("tiny"), 2**34)
    assert cfg.expert_wgrad_pairs == "off" and "pair rows in 2 bands" in line
    with pytest.raises(ValueError, match="set pair_bands: 1, hop: partial_sums, or expert_wgrad_pairs: auto"):
        resolve_distributed_wgrad_pairs(_cfg(hop="pair_rows", pair_bands=2, expert_wgrad_pairs="on"),
                                        load_model("tiny"), 2**34)


class _StepStub(TrainWorker):
    """The worker's step body (`TrainWorker._step_body`) over a stub rank: its program's ops are expert
    backwards that hold back a launch into one main gradient (the expert stage's held work) and the optimizer
    step, which checks what the main gradient holds when it runs."""

    def __init__(self, wgrad_pairs, rows, experts: int, pairs: bool) -> None:  # no Ray, no model: the stub's own
        self.wgrad_pairs, self.rows, self.experts_count, self.pairs_wgrads = wgrad_pairs, rows, experts, pairs
        self.program = tuple(ExpertBackward(0, mb) for mb in range(len(rows))) + (OptimizerStep(peers=(0,)),)
        self.main = torch.zeros(experts, rows[0][0].shape[1], rows[0][1].shape[1])
        self.rank, self.device, self.graphs, self.gpu_spans = 0, torch.device("cpu"), None, None
        self.attention = self.experts = None  # no stage to begin the step
        self.optimizer = SimpleNamespace(zero_grad=lambda: None)
        self.model = SimpleNamespace(prepare_fp8=lambda: None)
        self.recorder = SpanRecorder()
        self.watched: list[str] = []  # the watchdog's ops, in turn (they must not nest: it has one current op)
        self.watching: str | None = None
        self.watchdog = SimpleNamespace(op=self._watch)
        self.waiting_seen: list[int] = []  # launches waiting after each op
        self.at_optimizer: tuple[int, torch.Tensor] | None = None

    @contextlib.contextmanager
    def _watch(self, name: str):
        assert self.watching is None, f"{name} inside {self.watching}"
        self.watching = name
        self.watched.append(name.split(": ", 1)[1])
        try:
            yield
        finally:
            self.watching = None

    def _peer_stores(self) -> bool:
        return False

    def _run(self, op, step, mail, handles) -> None:
        a, b, offsets = self.rows[op.micro_batch]
        launch = functools.partial(self.wgrad_pairs.weight_grad_into, a, b, offsets, SMALL_TILES, main=self.main,
                                   weights=self.experts_count)
        self._held_back = (f"ExpertWeightGrad L0 mb{op.micro_batch}", [launch])
        self.waiting_seen.append(self.wgrad_pairs.launches_waiting())

    def _optimizer_step(self) -> dict:
        self.at_optimizer = (self.wgrad_pairs.launches_waiting(), self.main.clone())
        return {}


@pytest.mark.parametrize("micro_batches", [2, 3, 4])
@pytest.mark.parametrize("pairs", [True, False], ids=["paired", "unpaired"])
def test_a_ranks_step_pairs_its_held_launches_and_runs_the_odd_one_before_the_optimizer_step(interpreted, pairs,
                                                                                         micro_batches):
    """The step body opens the pairing block over the rank's program: each micro-batch's held launch waits for
    the next one's (1 waiting after the first, second's pairs them, ...), the odd last one runs alone before
    the optimizer step, which then finds nothing waiting and the main gradient holding every micro-batch's
    rows; unpaired, nothing ever waits. The same sums to fp32 rounding either way."""
    gg, wgrad_pairs = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.wgrad_pairs")
    gen = torch.Generator().manual_seed(5 + micro_batches)
    experts, k, c = 3, 8, 12
    rows = []
    for _ in range(micro_batches):
        counts = torch.randint(0, 9, (experts,), generator=gen)
        n = int(counts.sum())
        rows.append((torch.randn(n, k, generator=gen), torch.randn(n, c, generator=gen),
                     counts.cumsum(0).to(torch.int32)))
    stub = _StepStub(wgrad_pairs, rows, experts, pairs)
    stub._step_body(0)
    want = torch.zeros(experts, k, c, dtype=torch.float64)
    for a, b, offsets in rows:
        for e, (start, end) in enumerate(zip([0, *offsets.tolist()[:-1]], offsets.tolist())):
            want[e] += a[start:end].double().T @ b[start:end].double()
    waiting, main = stub.at_optimizer
    assert waiting == 0 and torch.allclose(main.double(), want, rtol=1e-5, atol=1e-5)
    # micro-batch i's held launch is issued before op i + 1 (`_run_held_back`): op i sees one waiting for i odd
    assert stub.waiting_seen == [mb % 2 if pairs else 0 for mb in range(micro_batches)]
    assert not wgrad_pairs.pairing()
    held = [f"ExpertWeightGrad L0 mb{mb}" for mb in range(micro_batches)]
    ops = [name for mb in range(micro_batches) for name in ([held[mb - 1]] if mb else []) + [f"ExpertBackward L0 mb{mb}"]]
    unpaired = ["ExpertWeightGrad (unpaired)"] if pairs and micro_batches % 2 else []
    assert stub.watched == [*ops, held[-1], *unpaired, "OptimizerStep"]  # each op watched alone, in turn
