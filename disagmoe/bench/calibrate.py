"""`disagmoe bench calibrate`: measure the cost model's terms on this machine, write a hardware YAML.

On top of `bench hardware`'s ceilings (bf16 matmul, HBM copy, GPU-to-GPU copy; `bench.hardware`
measures them, this module reuses it) it measures what `HardwareConfig.calibration` holds:

- `expert_gemm`: the SwiGLU expert FFN (the runtime's experts backend: torch._grouped_mm or our
  Triton kernels) at several rows per expert, forward and forward+backward, as fractions of peak;
- `attention`: SDPA (causal, bf16) at several sequence lengths, forward and forward+backward;
- `op_fixed_us`: the time of the smallest case of the expert FFN and of the model's attention
  block (one 16-token sequence): the cost an op pays whatever its size (launches, tiny kernels);
- `p2p`, `all_reduce`, `all_to_all`: NCCL send/recv, all-reduce and all-to-all between GPU 0 and 1
  at several sizes, fitted as latency + bytes / bandwidth (`fit_link`), when 2+ GPUs are visible.

The measured terms replace the preset's; terms this machine cannot measure (one GPU: no links)
keep what the preset (or the --out file being refreshed) already had (`merge_calibration`).
Everything above the `--- GPU ---` line is plain arithmetic and runs (and is tested) on a CPU.
Legend: N rows, E experts, H hidden, F expert FFN size, B batch, S sequence, n heads, D head dim.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import yaml

from disagmoe.bench import hardware
from disagmoe.config import Calibration, HardwareConfig, LinkCost, ModelConfig, RatePoint, write_text_file

ROWS_PER_EXPERT = (16, 64, 256, 1024, 4096)
SEQ_LENS = (512, 1024, 2048, 4096, 8192)
ATTENTION_TOKENS = 16 * 1024  # tokens per attention measurement (batch = tokens / sequence length)
MESSAGE_BYTES = (64 * 2**10, 2**20, 16 * 2**20, 128 * 2**20)
LOCAL_EXPERTS = 8  # experts in the GEMM measurement (rows per expert is what the curve is against)


@dataclass(frozen=True)
class Measurements:
    """One calibration run's results (`hardware`: the ceilings `bench hardware` measures)."""

    hardware: hardware.Measured
    calibration: Calibration


def fit_link(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> LinkCost:
    """Least squares of time = latency + bytes / bandwidth over the measured sizes (at least two
    distinct). A negative intercept (noise at small sizes) is clipped to 0."""
    x, y = np.asarray(sizes_bytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(set(x.tolist())) < 2:
        raise ValueError("fitting a link needs messages of at least two sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise ValueError(f"the measured times do not grow with the message size ({list(y)}); measure larger messages")
    return LinkCost(latency_us=max(float(intercept), 0.0) * 1e6, gbps=1.0 / float(slope) / 1e9)


def rate_point(at: float, fwd_flops: float, fwd_s: float, fwd_bwd_s: float, peak_flops_per_s: float,
               bwd_flop_factor: float) -> RatePoint:
    """A curve point from a forward and a forward+backward timing: the backward is their
    difference and does `bwd_flop_factor` times the forward's FLOPs. Fractions are clipped to (0, 1]."""
    frac = lambda flops, s: min(1.0, max(1e-6, flops / max(s, 1e-12) / peak_flops_per_s))  # noqa: E731
    return RatePoint(at=at, fwd=frac(fwd_flops, fwd_s), bwd=frac(bwd_flop_factor * fwd_flops, fwd_bwd_s - fwd_s))


def merge_calibration(old: Calibration | None, new: Calibration) -> Calibration:
    """`new`, with every term it lacks (an empty curve, no link, an op kind not measured) taken from `old`."""
    if old is None:
        return new
    merged = {name: getattr(new, name) or getattr(old, name) for name in Calibration.model_fields}
    merged["op_fixed_us"] = {**old.op_fixed_us, **new.op_fixed_us}
    return Calibration.model_validate(merged)


def calibrated_hardware(preset: HardwareConfig, m: Measurements) -> HardwareConfig:
    """The preset with `bench hardware`'s measured fractions and the merged calibration section."""
    hw = hardware.calibrated(preset, m.hardware)
    return hw.model_copy(update={"name": f"{preset.name}-calibrated",
                                 "calibration": merge_calibration(preset.calibration, m.calibration)})


def preset_text(hw: HardwareConfig, m: Measurements, env: dict[str, str], command: str) -> str:
    """The calibrated hardware YAML, provenance on top (`bench.hardware.preset_yaml`'s header)."""
    return hardware.preset_yaml(hw, m.hardware, env, command)


def run(preset: HardwareConfig, model: ModelConfig, experts_backend: str, command: str,
        measure: Callable[[HardwareConfig, ModelConfig, str], Measurements] | None = None,
        env: Callable[[], dict[str, str]] | None = None) -> tuple[Measurements, HardwareConfig, str]:
    """Measure (default `measure_all`, on the GPU), merge into `preset`, render the YAML."""
    m = (measure or measure_all)(preset, model, experts_backend)
    hw = calibrated_hardware(preset, m)
    environment = env() if env is not None else hardware.environment(torch.device("cuda", 0))
    return m, hw, preset_text(hw, m, environment, command)


def write_preset(text: str, out) -> None:
    """Write the YAML next to `out` first, then rename (no half-written preset)."""
    HardwareConfig.model_validate(yaml.safe_load(text))  # what we write, plan can read
    write_text_file(out, text)


# --- GPU ------------------------------------------------------------------------------------------


def measure_all(preset: HardwareConfig, model: ModelConfig, experts_backend: str,
                warmup: int = 3, iters: int = 10) -> Measurements:
    """Every term on cuda:0 (links between cuda:0 and cuda:1 when both exist)."""
    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench calibrate` measures GPUs and needs a CUDA device; none is visible")
    dev = torch.device("cuda", 0)
    peak = preset.bf16_tflops * 1e12
    gemm = [expert_gemm_point(dev, model, experts_backend, rows, peak, warmup, iters) for rows in ROWS_PER_EXPERT]
    attention = [attention_point(dev, model, s, peak, warmup, iters) for s in SEQ_LENS]
    fixed = op_fixed_us(dev, model, experts_backend, warmup, iters)
    links = nccl_links() if torch.cuda.device_count() > 1 else {}
    source = f"disagmoe bench calibrate, {torch.cuda.get_device_name(dev)}, {time.strftime('%Y-%m-%d')}"
    cal = Calibration(source=source, expert_gemm=gemm, attention=attention, op_fixed_us=fixed, **links)
    return Measurements(hardware.measure(warmup, iters), cal)


def _ffn(experts_backend: str) -> Callable:
    if experts_backend == "triton":
        from disagmoe.kernels.moe_ffn import expert_ffn_triton
        return expert_ffn_triton
    if experts_backend == "grouped_mm":
        from disagmoe.bench.experts import grouped_mm_ffn
        return grouped_mm_ffn
    raise ValueError(f"--experts-backend {experts_backend!r}: choose grouped_mm or triton (the GPU backends)")


def _ffn_ms(dev, model: ModelConfig, experts_backend: str, rows_per_expert: int, warmup: int,
            iters: int) -> tuple[float, float, float]:
    """(forward ms, forward+backward ms, forward FLOPs) of the expert FFN, LOCAL_EXPERTS equal groups."""
    from disagmoe.bench.timing import median_ms

    H, F, E = model.hidden_size, model.expert_ffn_size, LOCAL_EXPERTS
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = dict(device=dev, dtype=torch.bfloat16, generator=gen)
    x_NH = torch.randn(E * rows_per_expert, H, **bf16)
    w13_EH2F = (torch.randn(E, H, 2 * F, **bf16) / H**0.5).requires_grad_()
    w2_EFH = (torch.randn(E, F, H, **bf16) / F**0.5).requires_grad_()
    offsets_E = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows_per_expert
    ffn = _ffn(experts_backend)
    x_leaf = x_NH.clone().requires_grad_()
    dy_NH = torch.randn(E * rows_per_expert, H, **bf16)
    with torch.no_grad():
        fwd = median_ms(lambda _: ffn(x_NH, offsets_E, w13_EH2F, w2_EFH), warmup, iters)
    both = median_ms(lambda _: torch.autograd.grad(ffn(x_leaf, offsets_E, w13_EH2F, w2_EFH),
                                                   [x_leaf, w13_EH2F, w2_EFH], dy_NH), warmup, iters)
    return fwd, both, 6.0 * E * rows_per_expert * H * F


def expert_gemm_point(dev, model, experts_backend, rows_per_expert, peak, warmup, iters) -> RatePoint:
    fwd, both, flops = _ffn_ms(dev, model, experts_backend, rows_per_expert, warmup, iters)
    return rate_point(rows_per_expert, flops, fwd / 1e3, both / 1e3, peak, bwd_flop_factor=2.0)


def _attention_ms(dev, model: ModelConfig, seq_len: int, batch: int, warmup: int, iters: int):
    """(forward ms, forward+backward ms) of causal SDPA on [B, n, S, D] bf16 (GQA heads expanded)."""
    import torch.nn.functional as F

    from disagmoe.bench.timing import median_ms

    shape = (batch, model.num_heads, seq_len, model.head_dim)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))
    dy = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with torch.no_grad():
        fwd = median_ms(lambda _: sdpa(), warmup, iters)
    both = median_ms(lambda _: torch.autograd.grad(sdpa(), [q, k, v], dy), warmup, iters)
    return fwd, both


def attention_point(dev, model: ModelConfig, seq_len: int, peak: float, warmup: int, iters: int) -> RatePoint:
    """The attention core's rate at `seq_len`, FLOPs counted as `roofline.stages.attention_core`."""
    from disagmoe.roofline.stages import ATTN_CORE_BWD, attention_core

    batch = max(1, ATTENTION_TOKENS // seq_len)
    fwd, both = _attention_ms(dev, model, seq_len, batch, warmup, iters)
    flops = float(attention_core(model, batch * seq_len, seq_len).flops)
    return rate_point(seq_len, flops, fwd / 1e3, both / 1e3, peak, bwd_flop_factor=ATTN_CORE_BWD)


def op_fixed_us(dev, model: ModelConfig, experts_backend: str, warmup: int, iters: int) -> dict[str, float]:
    """Fixed cost per op: the expert FFN with one row per expert, the model's attention block
    (norm + attention) on one 16-token sequence; forward, and forward+backward minus forward."""
    from disagmoe.bench.timing import median_ms
    from disagmoe.model.block import Block

    fwd, both, _ = _ffn_ms(dev, model, experts_backend, 1, warmup, iters)
    block = Block(model).to(dev, torch.bfloat16)
    x = torch.randn(1, 16, model.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        a_fwd = median_ms(lambda _: block.attention_part(x), warmup, iters)
    a_both = median_ms(lambda _: block.attention_part(x).sum().backward(), warmup, iters)
    return {"ExpertForward": fwd * 1e3, "ExpertBackward": max(both - fwd, 0.0) * 1e3,
            "AttentionForward": a_fwd * 1e3, "AttentionBackward": max(a_both - a_fwd, 0.0) * 1e3}


def nccl_links() -> dict[str, LinkCost]:
    """NCCL send/recv, all-reduce and all-to-all between cuda:0 and cuda:1, fitted per kind
    (two spawned processes, one per GPU; rank 0 reports)."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_nccl_worker, args=(queue,), nprocs=2, join=True)
    times = queue.get()
    return {kind: fit_link([MOVED[kind] * b for b in MESSAGE_BYTES], seconds) for kind, seconds in times.items()}


# Bytes each GPU sends per byte of buffer, on 2 ranks, as `roofline.stages` counts them: a send
# all of it, a ring all-reduce 2 (n - 1) / n of it, an all-to-all the half bound for the peer.
MOVED = {"p2p": 1.0, "all_reduce": 1.0, "all_to_all": 0.5}


def _nccl_worker(rank: int, queue) -> None:
    """One rank of `nccl_links`: event-timed medians of each collective at each MESSAGE_BYTES."""
    import os

    import torch.distributed as dist

    from disagmoe.bench.timing import median_ms

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    times: dict[str, list[float]] = {"p2p": [], "all_reduce": [], "all_to_all": []}
    for nbytes in MESSAGE_BYTES:
        buf = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(buf)
        p2p = (lambda _: dist.send(buf, 1)) if rank == 0 else (lambda _: dist.recv(buf, 0))
        ops = {"p2p": p2p, "all_reduce": lambda _: dist.all_reduce(buf),
               "all_to_all": lambda _: dist.all_to_all_single(out, buf)}
        for kind, fn in ops.items():
            dist.barrier()
            times[kind].append(median_ms(fn, 3, 10) / 1e3)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()
