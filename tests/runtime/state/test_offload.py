"""Optimizer state in host memory (disagmoe/runtime/state/offload.py, FlatAdamW's offloaded step):
the bucketed update equals the on-device one bit for bit (random shapes, slots that divide no
bucket, fp32 and bf16 moments, fp32 and bf16 compute, clipping, a schedule), checkpoints cross
offload on and off, the host-memory check refuses with the fix, and on a GPU (marked `gpu`) the
offloaded step equals the on-device step with about two slots of device memory for the state and
no host sync."""

import pytest
import torch
from torch import nn

from disagmoe.config import OptimConfig
from disagmoe.runtime.state.flat_adamw import FlatAdamW
from disagmoe.roofline.optimizer_state import slot_elements, staging_bytes
from disagmoe.runtime.state.offload import check_host_memory
from disagmoe.runtime.state.optim import lr_at

SCHEDULE = {"fp32": OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1),
            "bf16": OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1, state_dtype="bf16")}
STEPS = 5


def _model(seed: int, dtype: torch.dtype, device: str = "cpu") -> nn.Module:
    """Random widths (the same for a seed), so buckets have lengths no slot size divides."""
    g = torch.Generator().manual_seed(seed)
    h, f, o = (int(torch.randint(3, 17, (1,), generator=g)) for _ in range(3))
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(h, f), nn.LayerNorm(f), nn.Linear(f, o, bias=False)).to(device, dtype)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    first = next(model.parameters())
    x = torch.randn(4, first.shape[1], generator=torch.Generator().manual_seed(step))
    return model(x.to(first.device, first.dtype)).float().square().mean()


def _train(flat: FlatAdamW, model: nn.Module, optim: OptimConfig, steps: range, clip: float = 0.5) -> None:
    for step in steps:
        flat.zero_grad()
        _loss(model, step).backward()
        norm = flat.grad_squares().sqrt().float()
        flat.set_lr(lr_at(step, optim, STEPS))
        flat.step(clip_coef=torch.clamp(clip / (norm + 1e-6), max=1.0))


def _pair(seed: int, state_dtype: str, dtype: torch.dtype, bucket_bytes: int, device: str = "cpu"):
    optim = SCHEDULE[state_dtype]
    plain_model, off_model = _model(seed, dtype, device), _model(seed, dtype, device)
    plain = FlatAdamW(plain_model.named_parameters(), optim, dtype)
    off = FlatAdamW(off_model.named_parameters(), optim, dtype, offload_bucket_bytes=bucket_bytes)
    return optim, (plain, plain_model), (off, off_model)


def _assert_same(a: FlatAdamW, b: FlatAdamW, model_a: nn.Module, model_b: nn.Module) -> None:
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q), name
    masters_a, masters_b = a.masters_by_name(), b.masters_by_name()
    for name in masters_a:
        assert torch.equal(masters_a[name], masters_b[name]), name
    state_a, state_b = a.state_by_name(), b.state_by_name()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[name][k], state_b[name][k]), (name, k)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bucketed_offloaded_update_is_the_on_device_update_bit_for_bit(seed, state_dtype, dtype) -> None:
    bucket_bytes = [13, 97, 1 << 20][seed]  # one element per slot, slots dividing no bucket, one slot for all
    optim, (plain, plain_model), (off, off_model) = _pair(seed, state_dtype, dtype, bucket_bytes)
    assert off.staging is not None and plain.staging is None
    _train(plain, plain_model, optim, range(STEPS))
    _train(off, off_model, optim, range(STEPS))
    _assert_same(plain, off, plain_model, off_model)


def test_the_slots_hold_at_most_a_bucket_of_masters_and_moments() -> None:
    assert slot_elements(256 << 20, "fp32", "bf16", 10**12) == (256 << 20) // 12
    assert slot_elements(256 << 20, "bf16", "bf16", 10**12) == (256 << 20) // 8
    assert slot_elements(256 << 20, "fp32", "fp32", 10**12) == (256 << 20) // 8  # fp32 compute: masters stay put
    assert slot_elements(256 << 20, "fp32", "bf16", 1000) == 1000  # no larger than the largest bucket
    model = _model(0, torch.bfloat16)
    off = FlatAdamW(model.named_parameters(), SCHEDULE["bf16"], torch.bfloat16, offload_bucket_bytes=80)
    assert off.staging.elements == 10
    assert off.staging.nbytes == 2 * 10 * (4 + 2 + 2) + 2 * 10 * 4  # two slots and the fp32 scratch
    assert off.staging.nbytes == staging_bytes(80, "bf16", "bf16", max(b.master_S.numel() for b in off.buckets))
    assert all(not b.master_S.is_cuda for b in off.buckets)


@pytest.mark.parametrize("saved_offloaded", [True, False])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_the_optimizer_state_crosses_offload_on_and_off(saved_offloaded, state_dtype) -> None:
    optim, (plain, plain_model), (off, off_model) = _pair(3, state_dtype, torch.bfloat16, 97)
    _train(plain, plain_model, optim, range(2))
    _train(off, off_model, optim, range(2))
    saved, saved_model = (off, off_model) if saved_offloaded else (plain, plain_model)
    masters, state = saved.masters_by_name(), saved.state_by_name()
    # the restored run with the other setting: offload flipped
    fresh_model = _model(3, torch.bfloat16)
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.add_(1.0)  # not the saved weights until it loads them
    fresh = FlatAdamW(fresh_model.named_parameters(), optim, torch.bfloat16,
                      offload_bucket_bytes=None if saved_offloaded else 97)
    fresh.load_state(masters, state)
    _assert_same(saved, fresh, saved_model, fresh_model)
    _train(saved, saved_model, optim, range(2, STEPS))
    _train(fresh, fresh_model, optim, range(2, STEPS))
    _assert_same(saved, fresh, saved_model, fresh_model)


def test_the_host_memory_check_names_the_fixes() -> None:
    check_host_memory(2**30, "the model", available=2**31)
    with pytest.raises(ValueError, match=r"offload_optimizer keeps 4\.0 GiB .* 2\.0 GiB available .*"
                                         r"offload_optimizer: false.*optim.state_dtype: bf16"):
        check_host_memory(4 * 2**30, "the model", available=2**31)


def _qwen_cfg(**fields):
    from disagmoe.config import TrainConfig
    base = dict(model="qwen3-30b-a3b", mode="single", device="cuda", precision="bf16", batch_size=8, seq_len=4096,
                micro_batches=8, steps=1)
    return TrainConfig(**{**base, **fields})


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_the_memory_model_counts_offloaded_state_as_host_bytes_and_two_slots_on_the_device(state_dtype) -> None:
    from disagmoe.model_ref import load_model
    from disagmoe.roofline.params import count_params
    from disagmoe.runtime.training.trainer import check_single_memory, single_host_bytes, single_peak_bytes
    optim = OptimConfig(state_dtype=state_dtype)
    plain, off = _qwen_cfg(optim=optim), _qwen_cfg(optim=optim, offload_optimizer=True)
    model = load_model(plain.model)
    params = count_params(model).total
    (plain_state, plain_acts), (off_state, off_acts) = single_peak_bytes(plain, model), single_peak_bytes(off, model)
    moments = 8 if state_dtype == "fp32" else 4
    assert plain_acts == off_acts
    assert plain_state == params * (2 + 4 + 4 + moments)
    slot_state = 2 * (4 + moments) + (8 if state_dtype == "bf16" else 0)  # two slots (+ the fp32 scratch)
    assert off_state == params * (2 + 4) + (256 << 20) // (4 + moments) * slot_state
    assert single_host_bytes(off, model) == params * (4 + moments) and single_host_bytes(plain, model) == 0
    # the refusal names offload as a fix where it is off, and says where the state went where it is on
    with pytest.raises(ValueError, match="offload_optimizer: true"):
        check_single_memory(plain, model, capacity_bytes=plain_state)
    with pytest.raises(ValueError, match="AdamW moments are in host memory"):
        check_single_memory(off, model, capacity_bytes=off_state)
    cpu = _qwen_cfg(optim=optim, offload_optimizer=True, device="cpu")  # nothing leaves the device's memory
    assert single_host_bytes(cpu, model) == 0 and single_peak_bytes(cpu, model)[0] > plain_state


def test_the_distributed_memory_model_counts_each_ranks_host_bytes() -> None:
    from disagmoe.config import TrainConfig
    from disagmoe.model_ref import load_model
    from disagmoe.runtime.cluster.driver import host_state_bytes, training_state_bytes
    from disagmoe.runtime.topology import Topology
    base = dict(model=load_model("tiny"), mode="disaggregated", device="cuda", transport="nccl", precision="bf16",
                attention_ranks=2, expert_ranks=2, batch_size=8, seq_len=16, micro_batches=1, steps=1)
    plain, off = TrainConfig(**base), TrainConfig(**base, offload_optimizer=True, offload_bucket_mib=1)
    topology = Topology.from_config(plain, plain.model)
    total = 0
    for rank in range(topology.world_size):
        params, device = training_state_bytes(plain, plain.model, topology, rank)
        _, off_device = training_state_bytes(off, off.model, topology, rank)
        _, host = training_state_bytes(off, off.model, topology, rank, host=True)
        assert device == params * 18 and host == params * 12
        assert off_device == params * 6 + staging_bytes(1 << 20, "fp32", "bf16", params)
        total += host
    assert host_state_bytes(off, off.model, topology) == total and host_state_bytes(plain, plain.model, topology) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_on_a_gpu_the_offloaded_step_is_the_on_device_step_in_two_slots_without_host_syncs(state_dtype) -> None:
    optim = SCHEDULE[state_dtype]
    torch.manual_seed(0)
    width = 1024
    shapes = [(width, width)] * 12 + [(width,)] * 4

    def build():
        torch.manual_seed(0)
        m = nn.ParameterList([nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]).to(torch.bfloat16)
        return m

    def run(flat, m):
        for step in range(STEPS):
            flat.zero_grad()
            for i, p in enumerate(m):
                g = torch.Generator(device="cuda").manual_seed(100 * step + i)
                p.main_grad.add_(torch.randn(p.shape, device="cuda", generator=g))
            flat.set_lr(lr_at(step, optim, STEPS))
            with torch.cuda.device(0):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    norm = flat.grad_squares().sqrt().float()
                    flat.step(clip_coef=torch.clamp(1.0 / (norm + 1e-6), max=1.0))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    plain_model = build()  # torch's update on the device: what the offloaded slots run (update_kernel aside)
    plain = FlatAdamW([(str(i), p) for i, p in enumerate(plain_model)],
                      optim.model_copy(update={"update_kernel": "torch"}), torch.bfloat16)
    run(plain, plain_model)
    bucket = 1 << 20  # bytes per slot: far below the state (12 M parameters)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    off_model = build()
    off = FlatAdamW([(str(i), p) for i, p in enumerate(off_model)], optim, torch.bfloat16, offload_bucket_bytes=bucket)
    torch.cuda.reset_peak_memory_stats()
    run(off, off_model)
    params = sum(p.numel() for p in off_model)
    compute_and_grads = params * (2 + 4)  # bf16 parameters and fp32 main gradients stay on the GPU
    state = torch.cuda.max_memory_allocated() - before - compute_and_grads
    assert off.staging.nbytes <= 3 * bucket
    assert state < off.staging.nbytes + 16 * 2**20, (state, off.staging.nbytes)  # not 8-12 bytes per parameter
    _assert_same(plain, off, plain_model, off_model)


def test_train_says_at_start_where_the_offloaded_state_goes() -> None:
    from disagmoe.cli.train_cmd import offload_note
    gpu = offload_note(_qwen_cfg(offload_optimizer=True))
    assert "GiB of fp32 masters and fp32 AdamW moments of the GPU in pinned host memory" in gpu
    assert "two 256 MiB staging buckets" in gpu
    assert "nothing moved" in offload_note(_qwen_cfg(offload_optimizer=True, device="cpu"))


def _sharded_offload_run(rank: int, state_dtype: str, dtype: torch.dtype) -> None:
    import torch.distributed as dist

    from disagmoe.runtime.state.flat_adamw import Shard
    group = dist.new_group([0, 1])
    optim, runs = SCHEDULE[state_dtype], []
    for bucket_bytes in (None, 97):  # on-device, then offloaded through slots dividing no slice
        model = _model(5, dtype)
        runs.append((model, FlatAdamW(model.named_parameters(), optim, dtype, shards={"params": Shard(group, rank, 2)},
                                      offload_bucket_bytes=bucket_bytes)))
    for step in range(STEPS):
        for model, flat in runs:
            flat.zero_grad()
            _loss(model, 10 * step + rank).backward()  # each rank its own micro-batch
            for b in flat.buckets:
                flat.reduce_scatter(b)
            squares = flat.grad_squares()
            dist.all_reduce(squares, group=group)
            flat.set_lr(lr_at(step, optim, STEPS))
            flat.step(clip_coef=torch.clamp(0.5 / (squares.sqrt().float() + 1e-6), max=1.0))
    (plain_model, plain), (off_model, off) = runs
    for b, c in zip(plain.buckets, off.buckets, strict=True):
        assert torch.equal(b.master_S, c.master_S), b.name  # this rank's slice
    _assert_same(plain, off, plain_model, off_model)  # gathered to rank 0 (rank 1: empty state)


ZERO1_DTYPES = {"dtype0": torch.float32, "dtype1": torch.bfloat16}


@pytest.fixture(scope="module")
def zero1_pair():
    """The four ZeRO-1 offload cases in one pair of gloo processes (tests/runtime/state/gloo_pair.py)."""
    from tests.runtime.state.gloo_pair import run_pair

    return run_pair([(f"{d}-{state_dtype}", _sharded_offload_run, (state_dtype, dtype))
                     for d, dtype in ZERO1_DTYPES.items() for state_dtype in ("fp32", "bf16")])


@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", list(ZERO1_DTYPES))
def test_zero1_slices_offloaded_take_the_on_device_step_bit_for_bit(zero1_pair, state_dtype, dtype) -> None:
    """ZeRO-1 with offload: each rank streams its slice and all-gathers the compute copy's fresh slice,
    bit for bit the on-device sharded step; the gathered checkpoint state is the same too (checked on
    both ranks by `_sharded_offload_run`)."""
    for rank in range(2):
        zero1_pair.of(f"{dtype}-{state_dtype}", rank)
