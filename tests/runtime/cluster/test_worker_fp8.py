"""precision fp8 on the ranks of a distributed run (disagmoe/runtime/cluster/worker.py), on CPU: which
ranks set FP8 on their experts and own counters (`setup_fp8`), and the step's one all-ranks sum
carrying every rank's counters beside the gradient norm (`TrainWorker._global_sums`), run by one
thread per rank over a stand-in for the nvshmem arena's on-stream sum. The GPU runs of these
paths are the `gpu` tests in test_driver.py (SHARED_FP8_CASES)."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from disagmoe.config import TrainConfig
from disagmoe.kernels.fp8_stats import AMAX, GRADIENTS, NONFINITE, TOTAL, WEIGHTS, Fp8Stats, reduced_nonfinite_flag
from disagmoe.model.experts import RoutedExperts
from disagmoe.model_ref import load_model
from disagmoe.runtime.cluster.worker import REPLICATED, TrainWorker, setup_fp8
from disagmoe.runtime.rank_model import rank_model
from disagmoe.runtime.topology import Topology

CPU = torch.device("cpu")


def topology_of(mode: str, **fields) -> Topology:
    cfg = TrainConfig(model="tiny", mode=mode, batch_size=8, seq_len=16, **fields)
    return Topology.from_config(cfg, load_model("tiny"))


def experts_of(model) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


@pytest.mark.slow  # the first import of the triton kernels (RoutedExperts' triton backend): 2-6 s on 2 busy cores
@pytest.mark.parametrize("mode, fields", [("disaggregated", dict(attention_ranks=1, expert_ranks=2)),
                                          ("colocated", dict(colocated_ranks=2))])
def test_fp8_is_set_on_the_expert_ranks_only_each_with_its_own_counters(mode, fields):
    """Attention ranks hold no experts and get no counters (their model is left as it was); every
    rank holding experts runs all of them in FP8, counting into its own `Fp8Stats`."""
    topology = topology_of(mode, **fields)
    model_cfg = load_model("tiny")
    owned = []
    for rank in range(topology.world_size):
        model = rank_model(model_cfg, "triton", topology, rank).materialise(CPU, 0)
        stats = setup_fp8(model, topology, rank, "fp8", CPU)
        if topology.expert_role(rank) is None:
            assert stats is None and model.fp8_stats is None and not experts_of(model)
            continue
        assert isinstance(stats, Fp8Stats) and model.fp8_stats is stats
        assert experts_of(model) and all(e.precision == "fp8" and e.fp8_stats is stats for e in experts_of(model))
        owned.append(stats)
        assert setup_fp8(rank_model(model_cfg, "triton", topology, rank).materialise(CPU, 0), topology, rank,
                         "bf16", CPU) is None
    assert len({id(s) for s in owned}) == len(owned) == sum(topology.expert_role(r) is not None
                                                           for r in range(topology.world_size))


def test_the_fp8_backward_recipe_reaches_every_expert_rank():
    """`setup_fp8(..., backward)` (the worker passes `TrainConfig.expert_backward_precision`): each
    expert module of an expert rank runs that backward; None leaves the default (bf16-wgrad); an
    unknown recipe is refused with the choices."""
    from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD

    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=1)
    for backward, expected in (("bf16", "bf16"), ("fp8", "fp8"), (None, DEFAULT_FP8_EXPERT_BACKWARD)):
        model = rank_model(load_model("tiny"), "triton", topology, 1).materialise(CPU, 0)
        setup_fp8(model, topology, 1, "fp8", CPU, backward=backward)
        assert experts_of(model) and all(e.fp8_backward == expected for e in experts_of(model))
    model = rank_model(load_model("tiny"), "triton", topology, 1).materialise(CPU, 0)
    with pytest.raises(ValueError, match="choose one of fp8, bf16-wgrad, bf16"):
        setup_fp8(model, topology, 1, "fp8", CPU, backward="fp16")


def test_the_fp8_forward_gemms_reach_every_expert_rank():
    """`setup_fp8(..., forward=)` (the worker passes `TrainConfig.expert_forward_precision`): each
    expert module runs that forward; an unknown one is refused with the choices."""
    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=1)
    for forward, expected in (("gate-up", "gate-up"), ("down", "down"), (None, "both")):
        model = rank_model(load_model("tiny"), "triton", topology, 1).materialise(CPU, 0)
        setup_fp8(model, topology, 1, "fp8", CPU, backward="bf16", forward=forward)
        assert experts_of(model) and all(e.fp8_forward == expected for e in experts_of(model))
    model = rank_model(load_model("tiny"), "triton", topology, 1).materialise(CPU, 0)
    with pytest.raises(ValueError, match="choose one of both, gate-up, down"):
        setup_fp8(model, topology, 1, "fp8", CPU, backward="fp8", forward="up")


@pytest.mark.parametrize("mode, fields", [("disaggregated", dict(attention_ranks=1, expert_ranks=1)),
                                          ("colocated", dict(colocated_ranks=1))])
def test_fp8_emulate_reaches_every_ranks_experts_and_projections(mode, fields):
    """`setup_fp8(..., emulate=True)` (the worker passes `TrainConfig.fp8_emulate`): every expert module
    and every dense projection held by a rank runs its FP8 GEMMs emulated; without it none does."""
    from disagmoe.model.layers import DeferrableLinear

    topology = topology_of(mode, **fields)
    for emulate in (True, False):
        for rank in range(topology.world_size):
            model = rank_model(load_model("tiny"), "triton", topology, rank).materialise(CPU, 0)
            setup_fp8(model, topology, rank, "fp8", CPU, "fp8", backward="bf16", forward="gate-up", emulate=emulate,
                      dense_scaling="rowwise")  # tiny's linears are off the blockwise grid
            experts = experts_of(model)
            linears = [m for m in model.modules() if isinstance(m, DeferrableLinear)]
            assert all(e.fp8_emulate == emulate for e in experts) and all(m.fp8_emulate == emulate for m in linears)
            assert experts or linears


def test_fp8_gluon_sets_the_kernels_choice_on_expert_ranks_only():
    """`setup_fp8(..., gluon=)` (the worker passes `TrainConfig.fp8_gluon`): an expert rank sets the
    FFN's Gluon row, SwiGLU and weight-gradient paths as asked (`fp8_ffn.set_gluon`, process-wide); an
    attention rank without FP8 experts leaves them alone."""
    from disagmoe.kernels import fp8_ffn

    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=1)
    saved = dataclasses.replace(fp8_ffn._gluon)
    try:
        for gluon in (True, False):
            model = rank_model(load_model("tiny"), "triton", topology, 1).materialise(CPU, 0)
            setup_fp8(model, topology, 1, "fp8", CPU, gluon=gluon)
            assert (fp8_ffn._gluon.rows, fp8_ffn._gluon.swiglu, fp8_ffn._gluon.wgrad) == (gluon, gluon, gluon)
        attention = rank_model(load_model("tiny"), "triton", topology, 0).materialise(CPU, 0)
        assert setup_fp8(attention, topology, 0, "fp8", CPU, gluon=True) is None
        assert not fp8_ffn._gluon.rows
    finally:
        for field in dataclasses.fields(saved):
            setattr(fp8_ffn._gluon, field.name, getattr(saved, field.name))


def test_fp8_refuses_expert_ranks_of_another_backend():
    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=1)
    model = rank_model(load_model("tiny"), "loop", topology, 1).materialise(CPU, 0)
    with pytest.raises(ValueError, match="experts_backend: triton"):
        setup_fp8(model, topology, 1, "fp8", CPU)


class StreamSum:
    """The arena's all-ranks sum (`NvshmemTransport.all_sum`) for threads: every rank's share,
    then their sum in rank order, as each rank computes it."""

    def __init__(self, world: int) -> None:
        self.shares: dict[int, torch.Tensor] = {}
        self.barrier = threading.Barrier(world)

    def for_rank(self, rank: int):
        def all_sum(values: torch.Tensor) -> torch.Tensor:
            assert values.dtype == torch.float64 and values.dim() == 1
            self.shares[rank] = values.clone()
            self.barrier.wait()
            return torch.stack([self.shares[r] for r in sorted(self.shares)]).sum(0)
        return SimpleNamespace(all_sum=all_sum)

    def all_reduce(self, tensor: torch.Tensor, group=None) -> None:
        """`dist.all_reduce` (sum, in place) over the world group, for threads named rank-<r>."""
        rank = int(threading.current_thread().name.rsplit("-", 1)[1])
        tensor.copy_(self.for_rank(rank).all_sum(tensor))


def bare_worker(topology: Topology, rank: int, stats: Fp8Stats | None, squares: float, arena: StreamSum,
                on_stream: bool = True):
    """A TrainWorker with just what `_global_sums` reads: one replicated bucket whose gradient's
    squares are `squares` (counted on data-parallel index 0), no experts' buckets."""
    worker = object.__new__(TrainWorker)
    grad = torch.tensor([squares ** 0.5])
    bucket = SimpleNamespace(name=f"{REPLICATED}.0.decay", shard=None, params=[], step_grad=lambda: grad)
    worker.topology, worker.rank, worker.device = topology, rank, CPU
    worker.optimizer = SimpleNamespace(buckets=[bucket] if topology.attention_role(rank) is not None else [])
    worker.replicas = SimpleNamespace(squares=lambda p: torch.zeros((), dtype=torch.float64))
    worker.fp8, worker.fp8_stats = True, stats
    worker.sums_on_stream, worker.transport = on_stream, arena.for_rank(rank)
    worker.world_group = None
    return worker


def run_ranks(workers) -> list:
    out: list = [None] * len(workers)

    def run(i: int) -> None:
        out[i] = workers[i]._global_sums()

    threads = [threading.Thread(target=run, args=(i,), name=f"rank-{i}") for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(o is not None for o in out), "a rank did not finish its sum"
    return out


def _bits(x: float) -> int:
    return torch.tensor([x], dtype=torch.float32).view(torch.int32).item()


@pytest.mark.parametrize("bad_rank", [None, 1, 2])
@pytest.mark.parametrize("on_stream", [True, False], ids=["arena", "process-group"])
def test_the_step_sum_gives_every_rank_the_norm_and_all_ranks_counters_and_one_skip(monkeypatch, bad_rank,
                                                                                    on_stream):
    """1 A + 2 E: the attention rank adds its gradient's squares and zero counters, each expert
    rank its counters; every rank ends with the same norm, the counts summed, the largest amax,
    and the same skip flag, set on all three where one expert rank saw an inf. The same through
    the arena's on-stream sum (ranks sharing GPUs) and the world group's all-reduce."""
    import disagmoe.runtime.cluster.worker as worker_module

    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=2)
    arena = StreamSum(topology.world_size)
    monkeypatch.setattr(worker_module.dist, "all_reduce", arena.all_reduce)
    stats = {1: Fp8Stats(CPU), 2: Fp8Stats(CPU)}
    stats[1].buffer[WEIGHTS] = torch.tensor([_bits(448.0), 1, 2, 1000, 0])
    stats[2].buffer[WEIGHTS] = torch.tensor([_bits(447.5), 3, 4, 3000, 0])
    stats[2].buffer[GRADIENTS] = torch.tensor([_bits(470.0), 5, 6, 500, 0])
    if bad_rank is not None:
        stats[bad_rank].buffer[GRADIENTS, NONFINITE] = 1
    workers = [bare_worker(topology, r, stats.get(r), 25.0, arena, on_stream) for r in range(topology.world_size)]
    results = run_ranks(workers)
    norms = [norm.item() for norm, _ in results]
    assert norms == [5.0] * 3  # the attention rank's 25 counted once
    buffers = [buffer for _, buffer in results]
    assert all(torch.equal(b, buffers[0]) for b in buffers)
    want = torch.zeros_like(buffers[0])
    want[WEIGHTS] = torch.tensor([_bits(448.0), 4, 6, 4000, 0])
    want[GRADIENTS] = torch.tensor([_bits(470.0), 5, 6, 500, int(bad_rank is not None)])
    assert torch.equal(buffers[0], want)
    assert buffers[0][:, AMAX].max() == _bits(470.0) and buffers[0][:, TOTAL].sum() == 4500
    flags = [reduced_nonfinite_flag(b).item() for b in buffers]
    assert flags == [float(bad_rank is not None)] * 3
    fields = Fp8Stats.fields(buffers[0].flatten().tolist())
    assert fields["fp8_amax"] == 470.0 and fields["fp8_saturated_share"] == 9 / 4500
    assert fields["fp8_nonfinite"] == ([] if bad_rank is None else ["gradients"])


def test_the_memory_check_counts_each_expert_ranks_fp8_weight_copies():
    """Per rank, precision fp8 adds its routed experts' FP8 copies (`fp8_weight_copy_bytes`, as mode
    single counts them: those the recipe reads, 2/3 byte a parameter under forward gate-up with
    backward bf16) to the device state; an attention rank holds none, but its FP8 dense projections'
    two copies (rowwise every linear, blockwise those on its grid)."""
    from disagmoe.kernels.fp8_dense import fits_blockwise
    from disagmoe.model.layers import DeferrableLinear
    from disagmoe.roofline.memory import fp8_weight_copy_bytes
    from disagmoe.runtime.cluster.driver import training_state_bytes

    fields = dict(model="tiny", mode="disaggregated", attention_ranks=1, expert_ranks=2, device="cuda",
                  transport="nvshmem", experts_backend="triton", hop="partial_sums", batch_size=8, seq_len=16)
    both = dict(precision="fp8", fp8_expert_forward="both")  # the all-FP8 forward: both copies
    bf16, fp8 = TrainConfig(**fields, precision="bf16"), TrainConfig(**fields, **both, fp8_dense=False)
    # and the dense projections' two e4m3 copies: rowwise of every linear, blockwise (the default) of those on its
    # grid (`fp8_dense.fits_blockwise`: none of the tiny model's)
    fp8_dense = TrainConfig(**fields, **both, fp8_dense=True, fp8_dense_scaling="rowwise")
    blockwise = TrainConfig(**fields, **both)
    gate_up = TrainConfig(**fields, precision="fp8", fp8_dense=False, fp8_expert_forward="gate-up",
                          fp8_expert_backward="bf16")  # w13's forward copy alone
    model_cfg = load_model("tiny")
    topology = Topology.from_config(fp8, model_cfg)
    for rank in range(topology.world_size):
        model = rank_model(model_cfg, "triton", topology, rank)
        experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
        dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, DeferrableLinear))
        (params, with_fp8), (_, without), (_, with_dense), (_, with_gate_up), (_, with_blockwise) = (
            training_state_bytes(c, model_cfg, topology, rank) for c in (fp8, bf16, fp8_dense, gate_up, blockwise))
        assert with_fp8 - without == int(fp8_weight_copy_bytes(experts))
        assert with_gate_up - without == int(fp8_weight_copy_bytes(experts, "gate-up", "bf16"))
        assert 3 * (with_gate_up - without) <= with_fp8 - without
        assert with_dense - with_fp8 == 2 * dense
        on_grid = sum(m.weight.numel() for m in model.modules()
                      if isinstance(m, DeferrableLinear) and fits_blockwise(m.in_features, m.out_features))
        assert with_blockwise - with_fp8 == 2 * on_grid == 0
        assert (experts > 0) == (topology.expert_role(rank) is not None)
        assert (dense > 0) == (topology.attention_role(rank) is not None)


def test_the_driver_writes_the_ranks_reduced_counters_as_mode_single_does():
    from disagmoe.runtime.cluster.driver import fp8_step_fields
    from disagmoe.runtime.training.trainer import fp8_record_fields

    stats = Fp8Stats(CPU)
    stats.buffer[GRADIENTS] = torch.tensor([_bits(448.0), 0, 10, 1000, 1])
    values = stats.buffer.flatten().tolist()
    results = [{"rank": r, "fp8": values} for r in range(3)]
    fields = fp8_step_fields(results, torch.device("cuda"))
    assert fields == fp8_record_fields(values, torch.device("cuda"))
    assert fields["fp8_nonfinite"] == ["gradients"] and fields["fp8_update_skipped"] is True
    assert fields["fp8_amax"] == 448.0 and fields["fp8_underflow_share"] == 0.01
    assert fp8_step_fields([{"rank": 0}, {"rank": 1}], CPU) == {}  # bf16: no fields
    with pytest.raises(AssertionError, match="reduced FP8 counters differ"):
        fp8_step_fields([{"fp8": values}, {"fp8": [0] * len(values)}], CPU)


def test_the_driver_records_the_dense_precision_its_attention_ranks_ran():
    """`dense_as_run`: where the attention ranks kept the default dense FP8 recipe in bf16 (their GPUs
    cannot scale blockwise: `trainer.resolve_dense_fp8`), the driver's config says fp8_dense: false,
    so its checkpoints record what trained; ranks that ran it, a bf16 run and pure expert ranks
    (no fact) change nothing; ranks that disagree are refused with the fix."""
    from disagmoe.runtime.cluster.driver import dense_as_run

    fields = dict(model="tiny", mode="disaggregated", attention_ranks=2, expert_ranks=1, device="cuda",
                  transport="nvshmem", experts_backend="triton", hop="partial_sums", batch_size=8, seq_len=16)
    unset = TrainConfig(**fields, precision="fp8")

    def ranks(*dense):
        return [{"rank": r, "dense_precision": d} for r, d in enumerate(dense)]

    kept = dense_as_run(unset, ranks("bf16", "bf16", None))
    assert (kept.fp8_dense, kept.dense_precision) == (False, "bf16")
    assert dense_as_run(unset, ranks("fp8", "fp8", None)) is unset
    bf16 = TrainConfig(**fields, precision="bf16")
    assert dense_as_run(bf16, ranks("bf16", "bf16", None)) is bf16
    with pytest.raises(ValueError, match="runs on some attention ranks' GPUs and not on others; set fp8_dense: false"):
        dense_as_run(unset, ranks("fp8", "bf16", None))


def test_fp8_dense_sets_the_attention_ranks_projections_with_their_own_counters():
    """dense_precision fp8 (`TrainConfig.fp8_dense`): a rank holding attention runs every dense
    projection in FP8 counting into its own `Fp8Stats` (row "dense"), even with bf16 experts; a
    pure expert rank gets none. Unscaled, the run's default blockwise scaling, refused on the CPU."""
    from disagmoe.kernels.fp8_stats import DENSE
    from disagmoe.model.layers import DeferrableLinear

    topology = topology_of("disaggregated", attention_ranks=1, expert_ranks=1)
    attention = rank_model(load_model("tiny"), "loop", topology, 0).materialise(CPU, 0)
    with pytest.raises(ValueError, match="fp8_dense_scaling: blockwise: .*Hopper"):
        setup_fp8(attention, topology, 0, "bf16", CPU, "fp8")
    for rank in range(topology.world_size):
        model = rank_model(load_model("tiny"), "loop", topology, rank).materialise(CPU, 0)
        stats = setup_fp8(model, topology, rank, "bf16", CPU, "fp8", dense_scaling="rowwise")
        linears = [m for m in model.modules() if isinstance(m, DeferrableLinear)]
        if topology.attention_role(rank) is None:
            assert stats is None and all(not m.fp8 for m in linears)
            continue
        assert isinstance(stats, Fp8Stats) and model.fp8_stats is stats and linears
        assert all(m.fp8 and m.fp8_stats_row.data_ptr() == stats.row(DENSE).data_ptr() for m in linears)
