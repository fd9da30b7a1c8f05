"""`disagmoe bench calibrate`: measure the cost model's terms on this machine, write a hardware YAML.

On top of `bench hardware`'s ceilings (bf16 matmul, HBM copy, GPU-to-GPU copy; `bench.hardware`
measures them, this module reuses it) it measures what `HardwareConfig.calibration` holds:

- `op_fixed_us`: each op's fixed cost, defined below;
- `expert_gemm`: the SwiGLU expert FFN (the runtime's experts backend: torch._grouped_mm or our
  Triton kernels) at several rows per expert, in the three passes the step runs (`ExpertTimes`):
  the forward, the data gradients, and the weight gradients adding into fp32 main gradients (the
  Triton kernels' `_ragged_weight_grad_kernel` reads and writes each expert weight's fp32 main
  gradient once per call: 8 bytes per parameter per micro-batch in the step);
- `expert_gemm_fp8` (a GPU with FP8 tensor cores, sm_89 on, and the triton experts): the FP8 expert
  FFN (`kernels.fp8_ffn.expert_ffn_fp8`) at the same rows per expert, its weights' e4m3 copies made
  once outside the timed calls (as the trainer makes them once per optimizer step) and the weight
  gradients added into fp32 main gradients: the forward, and the whole backward, under a run's default
  recipe since probe version 9 (`fp8_probe_recipe`: the down GEMM alone in FP8 forward, bf16 weight
  gradients, the Gluon row GEMMs storing by TMA on Hopper; version 8 and before timed the kernels' defaults,
  both forward GEMMs in FP8 on the Triton kernels; bf16-wgrad since version 6, all-FP8 before:
  `config.FP8_CURVE_FORWARDS`, `FP8_CURVE_BACKWARDS`, which the planner reads; the FP8 backward cannot
  hold its weight gradients back, so data and
  weight gradients are timed together, every quantiser included), each as a fraction of the same
  bf16 peak against the same stage work as the
  bf16 curve (`fp8_expert_point`), so the planner prices FP8 experts at what they measure instead of
  the datasheet's fp8_tflops / bf16_tflops (`placement.cost.fp8_stages`);
- `attention`: SDPA (causal, bf16) at several sequence lengths, forward and forward+backward, on
  the model's own heads as its attention passes them (tokens-first tensors viewed heads-first);
- `projections`: the attention block's projection GEMMs (every nn.Linear of the model's own
  attention module, forward; data and weight gradients) at PROJECTION_TOKENS tokens, against
  `roofline.stages.attention_projection_passes` (v2 left them at `bench hardware`'s 8192^3 matmul rate);
- `projections_fp8` (a GPU with FP8 tensor cores, and projections `fp8_dense` takes): the same
  projections as `fp8_dense` runs them (`fp8_projection_passes`: e4m3 forward and data gradient
  under the run's default recipe where the GPU runs it, blockwise on Hopper, else rowwise,
  `fp8_projection_scaling`, recorded as `projections_fp8_scaling`; the bf16 weight gradient, q/k/v
  reading one quantised input, the weights' e4m3 copies made once outside the timed calls, every
  quantiser counting), fitted against the same bf16 stage work (`fp8_projection_point`): the
  planner prices `fp8_dense` of that recipe at this curve over `projections`, the quantisers inside
  (a profile of the Qwen3 step on an H100 measured their GEMMs 1.40x faster than bf16's and their
  rowwise quantiser costing more than that saved: docs/benchmarks.md, session 29);
- `attention_mla`, `projections_mla`: the same two curves at an MLA shape, which price MLA models'
  attention block: the model's own when it is MLA (then the timings above themselves), else
  MLA_MODEL's (DeepSeek-V3: 128 heads of q/k 192 and v 128, against GQA's head dim 128; its
  low-rank q and kv chains: the DeepSeek config's cuDNN attention took 141 ms of its step where
  the Qwen3 curve priced 111, docs/benchmarks.md). About 6 s of the run;
- `hbm_fraction["optimizer"]`: FlatAdamW's step as the trainer runs it (zero the main gradients,
  their norm, the clipped update with the bf16 parameters written from the masters) over
  OPTIMIZER_PARAMS parameters with OPTIMIZER_OPTIM's settings (the trainer's defaults, written out:
  the Triton update, fp32 moments), as a fraction of the HBM rate at which the planner's optimizer
  stage for those settings (`optimizer_probe_work`: `roofline.stages.optimizer_step`) takes that
  time (the update runs below the copy rate `bench hardware` measures; the one fraction then prices
  every update kernel and the offloaded step's device passes too); `hbm_fraction["permute"]`
  the same for the Triton permute and weighted-combine kernels (`kernels.permute`), forward and
  backward, over PERMUTE_TOKENS tokens of the model's hidden size and top-k, against `roofline.stages.permute`;
  `hbm_fraction["norms"]` the same for a layer's elementwise kernels as the model runs them (its
  RMSNorms, qk-norm + RoPE + heads-first layout, the attention output's copy back, the residual
  adds; the compiled fusions on a GPU), against `roofline.stages.norms_and_residuals` (GQA models:
  MLA's RoPE path is another, left unmeasured);
- `p2p`, `all_reduce`, `all_to_all`: NCCL send/recv, all-reduce and all-to-all between GPU 0 and 1
  at several sizes, fitted as latency + bytes / bandwidth (`fit_link`), when 2+ GPUs are visible.

What a fixed cost per op is. The cost model prices GPU time: an op takes its fixed cost plus its
stages' roofline times at the measured rates (`placement.cost.calibrated_stages`), and a step is
those times replayed through the schedule. In a steady-state step the host runs ahead of the GPU
(nothing in it waits on the host, DESIGN 3c), so the host's Python and launch overhead overlap the
GPU work already queued; what a small launch adds to the step is what it keeps the GPU busy: its
minimum duration on the device (launch latency, prologue, tail), which does not shrink with the
rows. So `op_fixed_us` is the op's GPU kernel time at next to no work, the sum of its kernels' own
durations as the profiler records them (`timing.kernel_ms`): the expert FFN on one expert with one
row, the model's attention block on one 16-token sequence. Weight traffic is not in it (one
expert's weights): the roofline's HBM term prices the weights an op reads. Every curve point is
timed the same way and net of the fixed cost of its own launches, and its rate is the fraction
of peak at which the planner's own stage work takes that net time (`expert_point`,
`attention_point`: `roofline.calibration.fitted_fraction` of `roofline.stages.expert_passes` and
`attention_core_passes`, the functions `placement.cost.evaluate` prices the stages with), so that
fixed + the stage's roofline time reproduces each measured point and nothing is counted twice or
left out (probe version 2 divided the FLOPs alone by a backward without the main-gradient
traffic, which the planner's stage then priced as if the kernel overlapped it: 64 ms where the
step's profile measured 137 ms, docs/benchmarks.md). The projection curve and the HBM fractions
are fitted on whole times, no fixed part subtracted: their launches are also inside the attention
block's fixed cost, so a few microseconds per op count twice, against milliseconds of work.

Not chosen: CUDA events around each call (the earlier probe: for a 16-token block that is the
host's time to launch it, 0.9 ms forward and 2.7 ms backward on an H200, which a step whose host
runs ahead never sees); many calls queued back to back (the time per call is then the larger of
the host's and the GPU's, still the host's for a tiny op); the intercept of a fit over sizes (the
rate itself changes with size, so the intercept takes up the curve's shape and can go negative).
Where the host does fall behind (kernels shorter than their launches: small models, the CPU
demo) the step shows GPU idle time (`bench profile`), which this calibration does not price.

The expert curve runs the model's own expert count, capped at ROWS_PER_OP rows in the op
(`curve_experts`): an op of 8 experts at 256 rows per expert is 2,048 rows, too few to fill the
GPU, and measured the launch size rather than the rows per expert. ROWS_PER_EXPERT holds the
rows per expert of one micro-batch of the one-GPU configs at 8, 4 and 2 micro-batches (512,
1,024, 2,048 for configs/h200x2-qwen3-30b.yaml), and the cap lets those ops hold all 128 of its
experts, as the step's launches do.

The measured terms replace the preset's; terms this machine cannot measure (one GPU: no links)
keep what the preset (or the --out file being refreshed) already had (`merge_calibration`), if
the same probe version measured them. The file records that version (`bench.probe`: PROBE_VERSION
and a hash of the code here that measures and does the arithmetic): change what is measured or
how and tests/bench/test_probe.py fails until the version is bumped.
Everything above the `--- GPU ---` line is plain arithmetic and runs (and is tested) on a CPU.
Legend: N rows, E experts, H hidden, F expert FFN size, B batch, S sequence, n heads, D head dim.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import yaml

from disagmoe.bench import hardware
from disagmoe.bench.probe import PROBE_FINGERPRINT, PROBE_VERSION
from disagmoe.config import (FP8_DENSE_SCALING, Calibration, Fp8RatePoint, HardwareConfig, LinkCost, ModelConfig,
                             OptimConfig, RatePoint, write_text_file)
from disagmoe.roofline import stages
from disagmoe.roofline.calibration import fitted_fraction, fitted_hbm_fraction, fitted_shared_fraction
from disagmoe.roofline.ceilings import Ceilings

ROWS_PER_EXPERT = (16, 64, 256, 512, 1024, 2048, 4096)
SEQ_LENS = (512, 1024, 2048, 4096, 8192)
ATTENTION_TOKENS = 16 * 1024  # tokens per attention measurement (batch = tokens / sequence length)
ROWS_PER_OP = 256 * 1024  # the most rows in one expert-curve measurement (`curve_experts`)
FIXED_TOKENS = 16  # the one sequence of the attention fixed-cost probes
MESSAGE_BYTES = (64 * 2**10, 2**20, 16 * 2**20, 128 * 2**20)
OPTIMIZER_PARAMS = 256 * 2**20  # parameters of the optimizer probe (4.5 GiB of state: far past the L2)
# the optimizer probe's FlatAdamW settings, priced as such: the trainer's defaults, written out so
# that a change of default changes the probe's fingerprint (bench.probe)
OPTIMIZER_OPTIM = OptimConfig(update_kernel="triton", state_dtype="fp32")
PERMUTE_TOKENS = 32 * 1024  # tokens of the permute probe (one micro-batch of 8 x 4,096)
PROJECTION_TOKENS = (4096, 8192, 32768)  # tokens per micro-batch of the projection curve
MLA_MODEL = "deepseek-v3"  # the model preset whose MLA attention block the MLA curves time (`mla_probe_model`)
# the attention projections that read the block's input (`model.attention`: GQA's, MLA's with or without q-LoRA)
BLOCK_INPUT_READERS = frozenset({"wq", "wk", "wv", "wq_a", "wkv_a"})


@dataclass(frozen=True)
class Measurements:
    """One calibration run's results (`hardware`: the ceilings `bench hardware` measures)."""

    hardware: hardware.Measured
    calibration: Calibration


@dataclass(frozen=True)
class PassTimes:
    """GPU kernel seconds of one call: the forward alone, and the forward and backward."""

    fwd_s: float
    fwd_bwd_s: float

    @property
    def bwd_s(self) -> float:
        return max(self.fwd_bwd_s - self.fwd_s, 0.0)


@dataclass(frozen=True)
class ExpertTimes:
    """GPU kernel seconds of the expert FFN's passes as the step runs them (`_ffn_times`): the
    forward, the data gradients (the backward with the weight gradients held back), and the
    weight gradients added into the weights' fp32 main gradients."""

    fwd_s: float
    dgrad_s: float
    wgrad_s: float


@dataclass(frozen=True)
class Timings:
    """What the GPU half measures, GPU kernel seconds per call (`timing.kernel_ms`);
    `calibration_from` turns them into the calibration's terms."""

    expert_gemm: dict[int, ExpertTimes]  # rows per expert -> the FFN on curve_experts(model, rows) experts
    expert_fixed: ExpertTimes  # the FFN on one expert with one row
    attention: dict[int, PassTimes]  # sequence length -> causal SDPA over ATTENTION_TOKENS tokens
    attention_fixed: PassTimes  # causal SDPA on one FIXED_TOKENS sequence
    block_fixed: PassTimes  # the model's attention block (norm, attention, residual) on the same
    optimizer_s: float | None = None  # FlatAdamW's step over OPTIMIZER_PARAMS parameters (None: not measured)
    permute: PassTimes | None = None  # permute + combine over PERMUTE_TOKENS tokens (None: not measured)
    projections: dict[int, PassTimes] | None = None  # tokens -> the attention projections (None: not measured)
    norms: PassTimes | None = None  # one layer's elementwise kernels over PERMUTE_TOKENS tokens (None: not measured)
    # rows per expert -> the FP8 FFN on curve_experts(model, rows) experts, forward and forward + whole
    # backward (None: not measured: no FP8 tensor cores, or not the triton experts)
    expert_gemm_fp8: dict[int, PassTimes] | None = None
    # sequence length -> causal SDPA on mla_probe_model(model)'s heads over ATTENTION_TOKENS tokens, and
    # at one FIXED_TOKENS sequence (None: not measured, an older probe's timings)
    attention_mla: dict[int, PassTimes] | None = None
    attention_mla_fixed: PassTimes | None = None
    projections_mla: dict[int, PassTimes] | None = None  # tokens -> mla_probe_model(model)'s attention projections
    projections_fp8: dict[int, PassTimes] | None = None  # tokens -> the projections in FP8 (None: not measured)
    projections_fp8_scaling: str = "rowwise"  # the recipe `projections_fp8` ran (`fp8_projection_scaling`)


def curve_experts(model: ModelConfig, rows_per_expert: int) -> int:
    """Experts in the expert-curve measurement at `rows_per_expert`: the model's, or fewer so that
    the op holds at most ROWS_PER_OP rows (at least one expert)."""
    return max(1, min(model.num_experts, ROWS_PER_OP // rows_per_expert))


def mla_probe_model(model: ModelConfig) -> ModelConfig:
    """The model whose attention block the MLA curves (`attention_mla`, `projections_mla`) are
    measured and fitted on: `model` itself when its attention is MLA, else the MLA_MODEL preset
    (its heads, widths and projections; the curves' sizes are SEQ_LENS and PROJECTION_TOKENS
    whatever its own)."""
    if model.attention == "mla":
        return model
    from disagmoe.model_ref import load_model

    return load_model(MLA_MODEL)


def attention_batch(seq_len: int) -> int:
    """Sequences in the attention-curve measurement at `seq_len`: ATTENTION_TOKENS tokens in all."""
    return max(1, ATTENTION_TOKENS // seq_len)


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


def expert_point(model: ModelConfig, rows_per_expert: int, times: ExpertTimes, fixed: ExpertTimes,
                 ceil: Ceilings) -> RatePoint:
    """The expert curve's point at `rows_per_expert`: each pass's rate is the fraction of peak at
    which the planner's stage work for the probe's shape (`stages.expert_passes` on
    curve_experts(model, rows_per_expert) experts: the weight gradients with their fp32
    main-gradient traffic) takes the pass's time net of its `fixed` part (`fitted_fraction`
    under `ceil`, the ceilings the calibrated file will be priced with)."""
    experts = curve_experts(model, rows_per_expert)
    passes = stages.expert_passes(model, rows_per_expert * experts, experts)
    fwd, dgrad = passes["routed experts"]
    wgrad = passes["expert weight grads"][1]
    return RatePoint(at=rows_per_expert, fwd=fitted_fraction(fwd, times.fwd_s - fixed.fwd_s, ceil),
                     bwd=fitted_fraction(dgrad, times.dgrad_s - fixed.dgrad_s, ceil),
                     wgrad=fitted_fraction(wgrad, times.wgrad_s - fixed.wgrad_s, ceil))


def fp8_expert_point(model: ModelConfig, rows_per_expert: int, times: PassTimes, fixed: ExpertTimes,
                     ceil: Ceilings, most: float) -> Fp8RatePoint:
    """The FP8 curve's point at `rows_per_expert`: the FP8 FFN's times fitted as `expert_point`
    fits the bf16 one's, against the same bf16 stage work (`stages.expert_passes`: the FLOPs of the
    bf16 GEMMs, so the rate says how fast FP8 gets through the same FFN), net of the same fixed
    part (the bf16 FFN's at one row, which the planner adds to every expert op whatever its
    precision: the FP8 launches' extra fixed cost, its quantisers', stays in the curve). Its
    backward ran whole, data and weight gradients together: one rate at which the planner's two
    backward stages, each priced on its own, take that time (`fitted_shared_fraction`). `most`:
    fp8_tflops / bf16_tflops, the fastest an FP8 rate can be."""
    experts = curve_experts(model, rows_per_expert)
    passes = stages.expert_passes(model, rows_per_expert * experts, experts)
    fwd, dgrad = passes["routed experts"]
    wgrad = passes["expert weight grads"][1]
    return Fp8RatePoint(at=rows_per_expert, fwd=fitted_fraction(fwd, times.fwd_s - fixed.fwd_s, ceil, most),
                        bwd=fitted_shared_fraction([dgrad, wgrad], times.bwd_s - fixed.dgrad_s - fixed.wgrad_s,
                                                   ceil, most))


def fp8_projection_point(model: ModelConfig, tokens: int, times: PassTimes, ceil: Ceilings,
                         most: float) -> Fp8RatePoint:
    """The FP8 projection curve's point at `tokens`: the projections' times under `fp8_dense`
    (quantisers included) fitted as `projection_point` fits the bf16 ones, against the same bf16
    stage work (`stages.attention_projection_passes`: so the rate says how fast FP8 gets through the
    same GEMMs), capped at `most` = fp8_tflops / bf16_tflops."""
    fwd, bwd = stages.attention_projection_passes(model, tokens)
    return Fp8RatePoint(at=tokens, fwd=fitted_fraction(fwd, times.fwd_s, ceil, most),
                        bwd=fitted_fraction(bwd, times.bwd_s, ceil, most))


def attention_point(model: ModelConfig, seq_len: int, times: PassTimes, fixed: PassTimes, ceil: Ceilings) -> RatePoint:
    """The attention curve's point at `seq_len`: the same fit against `stages.attention_core_passes`
    of the probe's attention_batch(seq_len) sequences."""
    fwd, bwd = stages.attention_core_passes(model, attention_batch(seq_len) * seq_len, seq_len)
    return RatePoint(at=seq_len, fwd=fitted_fraction(fwd, times.fwd_s - fixed.fwd_s, ceil),
                     bwd=fitted_fraction(bwd, times.bwd_s - fixed.bwd_s, ceil))


def projection_point(model: ModelConfig, tokens: int, times: PassTimes, ceil: Ceilings) -> RatePoint:
    """The projection curve's point at `tokens`: the same fit against the planner's
    `stages.attention_projection_passes` (no fixed part: its launches are in the
    attention block's fixed cost, and at these sizes they are small against the GEMMs)."""
    fwd, bwd = stages.attention_projection_passes(model, tokens)
    return RatePoint(at=tokens, fwd=fitted_fraction(fwd, times.fwd_s, ceil), bwd=fitted_fraction(bwd, times.bwd_s, ceil))


def optimizer_probe_work() -> stages.Work:
    """The work the optimizer probe's time is fitted against: the planner's optimizer stage
    (`stages.optimizer_step`) over OPTIMIZER_PARAMS parameters with the probe's own settings
    (OPTIMIZER_OPTIM's moments' dtype and update kernel; `optimizer_pass` clips every step)."""
    return stages.optimizer_step(OPTIMIZER_PARAMS, OPTIMIZER_OPTIM.state_dtype, OPTIMIZER_OPTIM.update_kernel,
                                 clipped=True)


def op_fixed_us(t: Timings) -> dict[str, float]:
    """Fixed GPU microseconds per op (module docstring): the expert FFN's launches at one row of
    one expert, the attention block's at one FIXED_TOKENS sequence; forward, and the backward
    (forward+backward minus forward; the experts' data and weight gradients together)."""
    return {"ExpertForward": t.expert_fixed.fwd_s * 1e6,
            "ExpertBackward": (t.expert_fixed.dgrad_s + t.expert_fixed.wgrad_s) * 1e6,
            "AttentionForward": t.block_fixed.fwd_s * 1e6, "AttentionBackward": t.block_fixed.bwd_s * 1e6}


def calibration_from(t: Timings, model: ModelConfig, ceil: Ceilings, source: str,
                     links: dict[str, LinkCost] | None = None, fp8_peak_ratio: float = 1.0) -> Calibration:
    """The calibration's terms from the GPU kernel timings: curves net of the fixed costs, fitted
    under `ceil` (`Ceilings.of` the calibrated hardware: its measured matmul and HBM rates);
    `fp8_peak_ratio` (fp8_tflops / bf16_tflops) caps the FP8 curve's rates."""
    gemm = [expert_point(model, rows, times, t.expert_fixed, ceil) for rows, times in sorted(t.expert_gemm.items())]
    gemm_fp8 = [fp8_expert_point(model, rows, times, t.expert_fixed, ceil, fp8_peak_ratio)
                for rows, times in sorted((t.expert_gemm_fp8 or {}).items())]
    attention = [attention_point(model, seq, times, t.attention_fixed, ceil) for seq, times in sorted(t.attention.items())]
    projections = [projection_point(model, tokens, times, ceil) for tokens, times in sorted((t.projections or {}).items())]
    projections_fp8 = [fp8_projection_point(model, tokens, times, ceil, fp8_peak_ratio)
                       for tokens, times in sorted((t.projections_fp8 or {}).items())]
    mla = mla_probe_model(model) if t.attention_mla or t.projections_mla else None
    attention_mla = [attention_point(mla, seq, times, t.attention_mla_fixed, ceil)
                     for seq, times in sorted((t.attention_mla or {}).items())]
    projections_mla = [projection_point(mla, tokens, times, ceil)
                       for tokens, times in sorted((t.projections_mla or {}).items())]
    hbm = {}
    if t.optimizer_s is not None:
        hbm["optimizer"] = fitted_hbm_fraction(optimizer_probe_work(), t.optimizer_s, ceil)
    if t.norms is not None:
        fwd, bwd = stages.norms_and_residuals(model, PERMUTE_TOKENS)
        hbm["norms"] = fitted_hbm_fraction(fwd + bwd, t.norms.fwd_bwd_s, ceil)
    if t.permute is not None:  # one rate for both passes (the stage prices each with the same bytes)
        pairs = stages.permute(model, PERMUTE_TOKENS * model.top_k)
        hbm["permute"] = fitted_hbm_fraction(pairs + pairs, t.permute.fwd_bwd_s, ceil)
    return Calibration(source=source, expert_gemm=gemm, attention=attention, attention_mla=attention_mla,
                       op_fixed_us=op_fixed_us(t), projections=projections, projections_mla=projections_mla,
                       hbm_fraction=hbm, expert_gemm_fp8=gemm_fp8, projections_fp8=projections_fp8,
                       projections_fp8_scaling=t.projections_fp8_scaling, **(links or {}))


def merge_calibration(old: Calibration | None, new: Calibration) -> Calibration:
    """`new`, with every term it lacks (an empty curve, no link, an op kind not measured) taken from `old`
    (the FP8 projection curve with the recipe it measured)."""
    if old is None:
        return new
    merged = {name: getattr(new, name) or getattr(old, name) for name in Calibration.model_fields}
    merged["projections_fp8_scaling"] = (new if new.projections_fp8 else old).projections_fp8_scaling
    merged["op_fixed_us"] = {**old.op_fixed_us, **new.op_fixed_us}
    merged["hbm_fraction"] = {**old.hbm_fraction, **new.hbm_fraction}
    return Calibration.model_validate(merged)


def calibrated_hardware(preset: HardwareConfig, m: Measurements) -> HardwareConfig:
    """The preset with `bench hardware`'s measured fractions and the merged calibration section,
    which records the current probe version: terms are kept only from a calibration that version
    measured (another's would be written as if this probe had measured them)."""
    hw = hardware.calibrated(preset, m.hardware)
    source = f"`disagmoe bench calibrate` {time.strftime('%Y-%m-%d')} (measured terms) over {preset.source or preset.name}"
    old = preset.calibration if preset.calibration and preset.calibration.probe_version == PROBE_VERSION else None
    calibration = merge_calibration(old, m.calibration).model_copy(
        update={"probe_version": PROBE_VERSION, "probe_fingerprint": PROBE_FINGERPRINT})
    return hw.model_copy(update={"name": f"{preset.name}-calibrated", "source": source, "calibration": calibration})


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
    ceilings = hardware.measure(warmup, iters)
    timings = measure_timings(dev, model, experts_backend, warmup, iters)
    links = nccl_links() if torch.cuda.device_count() > 1 else {}
    source = (f"disagmoe bench calibrate (GPU kernel time), {torch.cuda.get_device_name(dev)}, "
              f"{time.strftime('%Y-%m-%d')}")
    # fitted under the rates the written file is priced with (`calibrated_hardware`'s efficiencies)
    cal = calibration_from(timings, model, Ceilings.of(hardware.calibrated(preset, ceilings)), source, links,
                           fp8_peak_ratio=preset.fp8_tflops / preset.bf16_tflops)
    return Measurements(ceilings, cal)


def measure_timings(dev, model: ModelConfig, experts_backend: str, warmup: int, iters: int) -> Timings:
    """GPU kernel time of every probe `Timings` holds (the MLA curves: an MLA model's own attention
    and projection timings, measured once; the FP8 projections under `fp8_projection_scaling`)."""
    fp8_scaling = fp8_projection_scaling(dev)
    attention = {s: _sdpa_times(dev, model, s, attention_batch(s), warmup, iters) for s in SEQ_LENS}
    attention_fixed = _sdpa_times(dev, model, FIXED_TOKENS, 1, warmup, iters)
    projections = {n: _projection_times(dev, model, n, warmup, iters) for n in PROJECTION_TOKENS}
    if model.attention == "mla":
        attention_mla, attention_mla_fixed, projections_mla = attention, attention_fixed, projections
    else:
        mla = mla_probe_model(model)
        attention_mla = {s: _sdpa_times(dev, mla, s, attention_batch(s), warmup, iters) for s in SEQ_LENS}
        attention_mla_fixed = _sdpa_times(dev, mla, FIXED_TOKENS, 1, warmup, iters)
        projections_mla = {n: _projection_times(dev, mla, n, warmup, iters) for n in PROJECTION_TOKENS}
    return Timings(
        expert_gemm={r: _ffn_times(dev, model, experts_backend, r, curve_experts(model, r), warmup, iters)
                     for r in ROWS_PER_EXPERT},
        expert_fixed=_ffn_times(dev, model, experts_backend, 1, 1, warmup, iters),
        attention=attention,
        attention_fixed=attention_fixed,
        block_fixed=_block_times(dev, model, warmup, iters),
        optimizer_s=_optimizer_times(dev, OPTIMIZER_PARAMS, warmup, iters),
        permute=_permute_times(dev, model, PERMUTE_TOKENS, warmup, iters),
        projections=projections,
        norms=None if model.attention == "mla" else _norms_times(dev, model, PERMUTE_TOKENS, warmup, iters),
        expert_gemm_fp8={r: _fp8_ffn_times(dev, model, r, curve_experts(model, r), warmup, iters)
                         for r in ROWS_PER_EXPERT} if fp8_measured(dev, experts_backend) else None,
        projections_fp8={n: _fp8_projection_times(dev, model, n, fp8_scaling, warmup, iters) for n in PROJECTION_TOKENS}
        if fp8_projections_measured(torch.cuda.get_device_capability(dev), model) else None,
        projections_fp8_scaling=fp8_scaling,
        attention_mla=attention_mla, attention_mla_fixed=attention_mla_fixed, projections_mla=projections_mla)


def fp8_measured(dev, experts_backend: str) -> bool:
    """Whether the FP8 expert curve is measured: FP8 tensor cores (sm_89 on, as `precision: fp8`
    trains) under the triton experts, the backend whose kernels `precision: fp8` replaces (a
    grouped_mm run calibrates a step that has no FP8 experts)."""
    return experts_backend == "triton" and torch.cuda.get_device_capability(dev) >= (8, 9)


def fp8_projections_measured(capability: tuple[int, int], model: ModelConfig) -> bool:
    """Whether the FP8 projection curve is measured on a GPU of this compute `capability`: FP8
    tensor cores (sm_89 on) and the model's attention projections of shapes `fp8_dense` takes
    (`fp8_dense.check_shape`, as `precision: fp8` with `fp8_dense` refuses the others)."""
    from disagmoe.kernels import fp8_dense

    if tuple(capability) < (8, 9):
        return False
    try:
        for layer in attention_linears(model, "meta"):
            fp8_dense.check_shape(layer.in_features, layer.out_features)
    except ValueError:
        return False
    return True


def _ffn(experts_backend: str) -> Callable:
    if experts_backend == "triton":
        from disagmoe.kernels.moe_ffn import expert_ffn_triton
        return expert_ffn_triton
    if experts_backend == "grouped_mm":
        from disagmoe.bench.experts import grouped_mm_ffn
        return grouped_mm_ffn
    raise ValueError(f"--experts-backend {experts_backend!r}: choose grouped_mm or triton (the GPU backends)")


def _passes(forward: Callable[[], object], backward: Callable[[], object], warmup: int, iters: int) -> PassTimes:
    """GPU kernel seconds of `forward`, and of `backward` (a forward and its backward). The forward
    runs with autograd on, its inputs requiring gradients, as in a training step: it saves what its
    backward reads (the expert FFN's pre-activations, attention's logsumexp), which a no_grad
    forward (probe version 2) skips."""
    from disagmoe.bench.timing import kernel_ms

    fwd = kernel_ms(lambda _: forward(), warmup, iters)
    return PassTimes(fwd / 1e3, kernel_ms(lambda _: backward(), warmup, iters) / 1e3)


@dataclass(frozen=True)
class FFNPasses:
    """The expert FFN's passes as the step runs them, each a call to time (`ffn_passes`)."""

    forward: Callable[[], object]  # the forward alone, saving for the backward as the step's does
    data_grads: Callable[[], object]  # the forward and the data gradients, the weight gradients held back
    all_grads: Callable[[], object]  # the same, then the weight gradients added into `main_grads`
    main_grads: tuple[torch.Tensor, torch.Tensor]  # the fp32 main gradients of w13 and w2


def ffn_passes(ffn: Callable, x_NH: torch.Tensor, offsets_E: torch.Tensor, w13_EH2F: torch.nn.Parameter,
               w2_EFH: torch.nn.Parameter, dy_NH: torch.Tensor, fused: bool) -> FFNPasses:
    """The passes of the experts backend `ffn` on these inputs, the weights given fp32 main
    gradients as FlatAdamW gives them. `fused` (the Triton backend): each weight gradient is added
    into its main gradient by the GEMM itself (`_ragged_weight_grad_kernel`, accumulating: a read
    and a write of the fp32 main gradient per call), and inside `kernels.deferral.deferred_weight_grads`
    the backward holds those GEMMs back, so `data_grads` runs without them and `all_grads` runs
    them as the step does. Otherwise (grouped_mm) autograd returns bf16 weight gradients, which
    FlatAdamW's hook adds into the main gradients: `all_grads` is the backward for all three
    inputs plus those adds, `data_grads` the backward for x alone."""
    from disagmoe.kernels.deferral import deferred_weight_grads

    main13, main2 = (torch.zeros_like(w, dtype=torch.float32) for w in (w13_EH2F, w2_EFH))
    if fused:
        w13_EH2F.main_grad, w2_EFH.main_grad = main13, main2
    x_leaf = x_NH.detach().clone().requires_grad_()

    def data_grads() -> list[Callable[[], object]]:
        with deferred_weight_grads() as held:
            torch.autograd.grad(ffn(x_leaf, offsets_E, w13_EH2F, w2_EFH), [x_leaf], dy_NH)
        return held

    def all_grads() -> None:
        if fused:
            held = data_grads()
            if not held:
                raise RuntimeError("the experts backend held back no weight-gradient GEMM: it did not find the "
                                   "fp32 main gradients, so this probe would not time the step's accumulate path")
            for work in held:
                work()
            return
        _, dw13, dw2 = torch.autograd.grad(ffn(x_leaf, offsets_E, w13_EH2F, w2_EFH), [x_leaf, w13_EH2F, w2_EFH], dy_NH)
        main13.add_(dw13)
        main2.add_(dw2)

    return FFNPasses(lambda: ffn(x_leaf, offsets_E, w13_EH2F, w2_EFH), data_grads, all_grads, (main13, main2))


def _ffn_inputs(dev, model: ModelConfig, rows_per_expert: int, experts: int):
    """(x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH): the expert probes' bf16 inputs, `experts` equal
    groups of `rows_per_expert` rows, the weights as parameters (seeded: every probe the same)."""
    H, F, E = model.hidden_size, model.expert_ffn_size, experts
    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = dict(device=dev, dtype=torch.bfloat16, generator=gen)
    x_NH = torch.randn(E * rows_per_expert, H, **bf16)
    w13_EH2F = torch.nn.Parameter(torch.randn(E, H, 2 * F, **bf16) / H**0.5)
    w2_EFH = torch.nn.Parameter(torch.randn(E, F, H, **bf16) / F**0.5)
    offsets_E = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows_per_expert
    dy_NH = torch.randn(E * rows_per_expert, H, **bf16)
    return x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH


def _ffn_times(dev, model: ModelConfig, experts_backend: str, rows_per_expert: int, experts: int,
               warmup: int, iters: int) -> ExpertTimes:
    """The expert FFN over `experts` equal groups of `rows_per_expert` rows: the GPU kernel time
    of each of its passes as the step runs them (`ffn_passes`), the later passes less the earlier."""
    from disagmoe.bench.timing import kernel_ms

    x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH = _ffn_inputs(dev, model, rows_per_expert, experts)
    passes = ffn_passes(_ffn(experts_backend), x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH,
                        fused=experts_backend == "triton")
    fwd = kernel_ms(lambda _: passes.forward(), warmup, iters)
    dgrad = kernel_ms(lambda _: passes.data_grads(), warmup, iters)
    full = kernel_ms(lambda _: passes.all_grads(), warmup, iters)
    return ExpertTimes(fwd / 1e3, max(dgrad - fwd, 0.0) / 1e3, max(full - dgrad, 0.0) / 1e3)


@dataclass(frozen=True)
class Fp8FFNPasses:
    """The FP8 expert FFN's passes as the step runs them, each a call to time (`fp8_ffn_passes`)."""

    forward: Callable[[], object]  # the forward alone, saving for the backward as the step's does
    forward_backward: Callable[[], object]  # the forward and the whole backward, into `main_grads`
    main_grads: tuple[torch.Tensor, torch.Tensor]  # the fp32 main gradients of w13 and w2


def fp8_ffn_passes(ffn: Callable, x_NH: torch.Tensor, offsets_E: torch.Tensor, w13_EH2F: torch.nn.Parameter,
                   w2_EFH: torch.nn.Parameter, dy_NH: torch.Tensor) -> Fp8FFNPasses:
    """The passes of the FP8 experts `ffn` (`expert_ffn_fp8`'s contract) on these inputs as the
    trainer runs them: the weights' e4m3 copies made once here, outside every timed call (the
    trainer makes them once per optimizer step, `RoutedExperts.prepare_fp8`), and passed to each
    call; the weights given fp32 main gradients as FlatAdamW gives them, so that the backward's
    weight-gradient GEMMs add into them (every call accumulates: the probe's main gradients are
    never marked untouched, as the bf16 probe's). The backward is whole: the FP8 kernels hold no
    weight gradient back (`kernels.deferral`), and `forward_backward` asks autograd for x's
    gradient alone, the weights' arriving in their main gradients."""
    from disagmoe.kernels.fp8_ffn import Fp8ExpertWeights

    main13, main2 = (torch.zeros_like(w, dtype=torch.float32) for w in (w13_EH2F, w2_EFH))
    w13_EH2F.main_grad, w2_EFH.main_grad = main13, main2
    weights = Fp8ExpertWeights.quantize(w13_EH2F.detach(), w2_EFH.detach())
    x_leaf = x_NH.detach().clone().requires_grad_()

    def forward() -> torch.Tensor:
        return ffn(x_leaf, offsets_E, w13_EH2F, w2_EFH, weights=weights)

    def forward_backward() -> object:
        return torch.autograd.grad(forward(), [x_leaf], dy_NH)

    return Fp8FFNPasses(forward, forward_backward, (main13, main2))


def fp8_probe_recipe() -> tuple[dict[str, str], dict[str, bool | int]]:
    """(`expert_ffn_fp8`'s recipe arguments, `fp8_ffn.gluon_paths` settings) the FP8 expert probe runs: a run's
    defaults, as `config.FP8_CURVE_FORWARDS` / `FP8_CURVE_BACKWARDS` record them for the planner (the forward's
    down GEMM alone in FP8, bf16 weight gradients), and the Gluon row GEMMs with their epilogue as a run sets them
    (`RUN_FP8_GLUON`, `RUN_FP8_GLUON_STORE`; where the GPU cannot run them the Triton ones run, as in a run)."""
    from disagmoe.config import FP8_PROBE_BACKWARD, FP8_PROBE_FORWARD, RUN_FP8_GLUON, RUN_FP8_GLUON_STORE
    from disagmoe.kernels.fp8_ffn import GLUON_TMA_STORE_BLOCK_M

    tma = RUN_FP8_GLUON and RUN_FP8_GLUON_STORE == "tma"
    gluon: dict[str, bool | int] = {"rows": RUN_FP8_GLUON, "swiglu": RUN_FP8_GLUON, "tma_store": tma}
    if tma:
        gluon["block_m"] = GLUON_TMA_STORE_BLOCK_M  # the tile its epilogue compiles for, as `fp8_ffn.set_gluon` sets
    return {"forward": FP8_PROBE_FORWARD, "backward": FP8_PROBE_BACKWARD}, gluon


def _fp8_ffn_times(dev, model: ModelConfig, rows_per_expert: int, experts: int, warmup: int, iters: int) -> PassTimes:
    """The FP8 expert FFN (`expert_ffn_fp8`, its tuned tiles for the shape, under a run's default recipe,
    `fp8_probe_recipe`) over `experts` equal groups of `rows_per_expert` rows, on the bf16 probe's inputs
    (`_ffn_inputs`): GPU kernel time of the forward, and of the forward and whole backward (`fp8_ffn_passes`)."""
    from disagmoe.kernels.fp8_ffn import expert_ffn_fp8, gluon_paths

    recipe, gluon = fp8_probe_recipe()
    x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH = _ffn_inputs(dev, model, rows_per_expert, experts)
    passes = fp8_ffn_passes(functools.partial(expert_ffn_fp8, **recipe), x_NH, offsets_E, w13_EH2F, w2_EFH, dy_NH)
    with gluon_paths(**gluon):
        return _passes(passes.forward, passes.forward_backward, warmup, iters)


def sdpa_shapes(model: ModelConfig, batch: int, seq_len: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The [B, heads, S, head width] shapes of q, k and v as the model's attention hands them to
    SDPA, from the widths `roofline.stages.attention_io_per_token` counts: GQA with its own KV
    heads (`enable_gqa`, no expanded copies), MLA with q/k of the nope + rope width and v of its own."""
    q, k, v = stages.attention_io_per_token(model)
    qk_dim = q // model.num_heads
    kv_heads = k // qk_dim
    return ((batch, model.num_heads, seq_len, qk_dim), (batch, kv_heads, seq_len, qk_dim),
            (batch, kv_heads, seq_len, v // kv_heads))


def _sdpa_times(dev, model: ModelConfig, seq_len: int, batch: int, warmup: int, iters: int) -> PassTimes:
    """Causal SDPA (bf16) on `sdpa_shapes`, as `model.attention` calls it: q, k, v tokens-first in
    memory ([B, S, heads, width]) viewed heads-first (`rope_heads`, `mla_rope_heads`), MLA's v the
    value columns of the kv projection's heads (a strided view, as the step's), GQA's KV heads
    shared through `enable_gqa` (so the kernel the step gets, and its backward's reduction over the
    group), the output's gradient tokens-first too (it arrives through the output's reshape)."""
    import torch.nn.functional as F

    gen = torch.Generator(device=dev).manual_seed(0)
    bf16 = dict(device=dev, dtype=torch.bfloat16, generator=gen)

    def heads_first(shape: tuple[int, ...], offset: int = 0, width: int | None = None) -> torch.Tensor:
        """A [B, heads, S, D] leaf viewing columns offset.. of a tokens-first [B, S, heads, width] tensor."""
        b, n, s_, d = shape
        tokens = torch.randn(b, s_, n, width or d, **bf16)
        return tokens[..., offset:offset + d].transpose(1, 2).requires_grad_()

    q_shape, k_shape, v_shape = sdpa_shapes(model, batch, seq_len)
    q, k = heads_first(q_shape), heads_first(k_shape)
    if model.attention == "mla":  # [k_nope | v] per head, as the kv projection's output
        nope = model.mla.qk_nope_head_dim
        v = heads_first(v_shape, nope, nope + v_shape[3])
    else:
        v = heads_first(v_shape)
    gqa = k_shape[1] != q_shape[1]
    dy = torch.randn(q_shape[0], q_shape[2], q_shape[1], v_shape[3], **bf16).transpose(1, 2)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # noqa: E731
    return _passes(sdpa, lambda: torch.autograd.grad(sdpa(), [q, k, v], dy), warmup, iters)


def projection_passes(layers: Sequence[torch.nn.Linear], tokens: int, dev, dtype=torch.bfloat16,
                      ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward and backward) of every projection GEMM in `layers` over `tokens` rows:
    y = x W^T, then d x and d W (the weight's bf16 gradient, which FlatAdamW's hook adds into its
    main gradient: the planner's separate `main-grad adds` stage)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(tokens, layer.in_features, device=dev, dtype=dtype, generator=gen).requires_grad_()
          for layer in layers]
    dys = [torch.randn(tokens, layer.out_features, device=dev, dtype=dtype, generator=gen) for layer in layers]

    def forward() -> list[torch.Tensor]:
        return [layer(x) for layer, x in zip(layers, xs, strict=True)]

    def forward_backward() -> list[object]:
        return [torch.autograd.grad(layer(x), [x, layer.weight], dy) for layer, x, dy in zip(layers, xs, dys, strict=True)]

    return forward, forward_backward


def fp8_projection_scaling(dev) -> str:
    """The recipe the FP8 projection curve is measured under on `dev` (`Calibration.projections_fp8_scaling`):
    the run's default, `config.FP8_DENSE_SCALING` (blockwise), where `dev` runs it
    (`kernels.fp8_dense.blockwise_unavailable`: a Hopper GPU, torch >= 2.9 with CUDA >= 12.9), else
    rowwise (a run there keeps its dense projections in bf16 unless it asks for rowwise by name)."""
    from disagmoe.kernels.fp8_dense import blockwise_unavailable

    if FP8_DENSE_SCALING == "blockwise" and blockwise_unavailable(torch.device(dev)) is not None:
        return "rowwise"
    return FP8_DENSE_SCALING


def fp8_projection_passes(model: ModelConfig, tokens: int, dev, scaling: str, dtype=torch.bfloat16,
                          emulate: bool = False) -> tuple[Callable[[], object], Callable[[], object], object]:
    """(forward, forward and backward, their `Fp8Stats`) of the model's attention projections as
    `fp8_dense` runs them under `scaling` (`model.layers.set_linears_fp8`, as `set_dense_fp8` sets a
    run's: blockwise, the linears off its grid in bf16; counting into an `Fp8Stats` dense row) over
    `tokens` rows, in the model's order: their e4m3 weight copies made once here (`prepare_fp8`: once
    per optimizer step in training), the block-input readers (BLOCK_INPUT_READERS: GQA's q, k, v;
    MLA's first q and kv projections) fed one x, quantised once for FP8 readers that take it back to
    back as the model's are (`fp8_dense.quantize_input`; MLA's q chain runs between its two, so twice
    there, as in the step), each call starting as a step's micro-batch does, with no quantised input
    held (`forget_shared_inputs`); the others each their own input. Each reader's x is its own leaf on
    the same storage (the quantised copy is shared, no gradient is summed across readers: the bf16
    probe's projections each have their own input too). The backward:
    the data gradients in FP8 and the weight gradients in bf16 (`kernels.fp8_dense.RECIPE`), from
    one output gradient per projection. `emulate`: `fp8_dense`'s fp64 reference instead of
    torch._scaled_mm (the CPU tests run it)."""
    from disagmoe.kernels.fp8_dense import forget_shared_inputs
    from disagmoe.kernels.fp8_stats import DENSE, Fp8Stats
    from disagmoe.model.attention import build_attention
    from disagmoe.model.layers import set_linears_fp8

    with torch.device(dev):
        attention = build_attention(model).to(dtype)
    named = [(name, m) for name, m in attention.named_modules() if isinstance(m, torch.nn.Linear)]
    stats = Fp8Stats(dev)
    row = stats.row(DENSE)  # one row object for all, as `set_dense_fp8` gives (a shared input's key holds it)
    set_linears_fp8(attention, True, row, emulate, scaling)
    gen = torch.Generator(device=dev).manual_seed(0)
    shared = torch.randn(tokens, model.hidden_size, device=dev, dtype=dtype, generator=gen)
    inputs = []
    for name, layer in named:
        layer.prepare_fp8()
        inputs.append((shared.detach() if name in BLOCK_INPUT_READERS else torch.randn(
            tokens, layer.in_features, device=dev, dtype=dtype, generator=gen)).requires_grad_())
    layers = [layer for _, layer in named]
    dys = [torch.randn(tokens, layer.out_features, device=dev, dtype=dtype, generator=gen) for layer in layers]
    leaves = inputs + [layer.weight for layer in layers]

    def forward() -> list[torch.Tensor]:
        forget_shared_inputs()
        return [layer(x) for layer, x in zip(layers, inputs, strict=True)]

    def forward_backward() -> object:
        return torch.autograd.grad(forward(), leaves, dys)

    return forward, forward_backward, stats


def _fp8_projection_times(dev, model: ModelConfig, tokens: int, scaling: str, warmup: int, iters: int) -> PassTimes:
    """`fp8_projection_passes` of the model's attention projections over `tokens` tokens under
    `scaling` (the last quantised input dropped after: none held through the probes that follow)."""
    from disagmoe.kernels.fp8_dense import forget_shared_inputs

    forward, forward_backward, _ = fp8_projection_passes(model, tokens, dev, scaling)
    try:
        return _passes(forward, forward_backward, warmup, iters)
    finally:
        forget_shared_inputs()


def attention_linears(model: ModelConfig, dev, dtype=torch.bfloat16) -> list[torch.nn.Linear]:
    """Every nn.Linear of the model's own attention module (`model.attention.build_attention`): the
    projection GEMMs the step runs, with their shapes (GQA's q, k, v, o; MLA's low-rank chains)."""
    from disagmoe.model.attention import build_attention

    with torch.device(dev):  # built where it runs (no host copy of the weights)
        attention = build_attention(model).to(dtype)
    return [m for m in attention.modules() if isinstance(m, torch.nn.Linear)]


def _projection_times(dev, model: ModelConfig, tokens: int, warmup: int, iters: int) -> PassTimes:
    """`projection_passes` of the model's attention projections over `tokens` tokens."""
    forward, forward_backward = projection_passes(attention_linears(model, dev), tokens, dev)
    return _passes(forward, forward_backward, warmup, iters)


def norms_passes(model: ModelConfig, batch: int, seq_len: int, dev, dtype=torch.bfloat16,
                 ) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward and backward) of one layer's elementwise kernels around its GEMMs and
    attention, the model's own code for each (a GQA `model.block.Block`): the attention RMSNorm,
    qk-norm (where the model has it) + RoPE + q, k, v heads-first (`qk_norm_rope_heads` /
    `rope_heads`), attention's output copied back tokens-first, the residual add, the FFN
    RMSNorm, the second residual add; the GEMMs' and attention's outputs stand in as inputs. What
    `roofline.stages.norms_and_residuals` counts."""
    from disagmoe.model.attention import qk_norm_rope_heads, rope_heads
    from disagmoe.model.block import Block
    from disagmoe.model.layers import rope_cos_sin

    if model.attention == "mla":
        raise ValueError("the elementwise probe runs the GQA attention's RoPE path; MLA's is another")
    with torch.device(dev):
        block = Block(model).to(dtype)
    attn = block.attention
    B, S, H, n, g, D = batch, seq_len, model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    cos_SD, sin_SD = rope_cos_sin(S, D, attn.rope_theta, torch.device(dev), dtype, attn.rope_scaling)
    gen = torch.Generator(device=dev).manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=gen).requires_grad_()  # noqa: E731
    x, q, k, v = leaf(B, S, H), leaf(B, S, n, D), leaf(B, S, g, D), leaf(B, S, g, D)
    # the attention's output as the kernel leaves it: token-major, viewed heads-first (`model.attention`)
    o, attn_out, ffn_out = leaf(B, S, n, D).transpose(1, 2), leaf(B, S, H), leaf(B, S, H)
    leaves = [x, q, k, v, o, attn_out, ffn_out, *(p for p in block.parameters() if p.dim() == 1)]

    def forward() -> list[torch.Tensor]:
        xn = block.attention_norm(x)
        if attn.q_norm is not None:
            heads = qk_norm_rope_heads(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos_SD, sin_SD, attn.q_norm.eps)
        else:
            heads = rope_heads(q, k, v, cos_SD, sin_SD)
        tokens_first = o.transpose(1, 2).reshape(B, S, n * D)
        h = x + attn_out
        return [xn, *heads, tokens_first, block.ffn_norm(h), h + ffn_out]

    def forward_backward() -> object:
        outs = forward()
        grads = [torch.ones_like(t) for t in outs]
        return torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    return forward, forward_backward


def _norms_times(dev, model: ModelConfig, tokens: int, warmup: int, iters: int) -> PassTimes:
    """`norms_passes` over `tokens` tokens in sequences of the model's length (one, if shorter)."""
    seq_len = min(model.seq_len, tokens)
    forward, forward_backward = norms_passes(model, max(1, tokens // seq_len), seq_len, dev)
    return _passes(forward, forward_backward, warmup, iters)


def _block_times(dev, model: ModelConfig, warmup: int, iters: int) -> PassTimes:
    """The model's attention block (norm + attention + residual) on one FIXED_TOKENS sequence."""
    from disagmoe.model.block import Block

    block = Block(model).to(dev, torch.bfloat16)
    x = torch.randn(1, FIXED_TOKENS, model.hidden_size, device=dev, dtype=torch.bfloat16, requires_grad=True)
    return _passes(lambda: block.attention_part(x), lambda: block.attention_part(x).sum().backward(), warmup, iters)


def optimizer_pass(optimizer, grad_clip: float = 1.0) -> None:
    """One optimizer step as the trainer's flat step makes it (`runtime.training.trainer`): zero
    the main gradients, their norm, the clip coefficient, the fused AdamW and the masters into the
    compute parameters (`FlatAdamW.step`). The gradients' own arrival is the backward's."""
    optimizer.zero_grad()
    norm = optimizer.grad_squares().sqrt().float()
    optimizer.step(clip_coef=torch.clamp(grad_clip / (norm + 1e-6), max=1.0))


def _optimizer_times(dev, params: int, warmup: int, iters: int) -> float:
    """GPU kernel seconds of `optimizer_pass` over one bf16 matrix of `params` parameters (fp32
    masters and main gradients; the moments and update kernel OPTIMIZER_OPTIM's)."""
    from disagmoe.bench.timing import kernel_ms
    from disagmoe.runtime.state.flat_adamw import FlatAdamW

    cols = 4096
    weight = torch.nn.Parameter(torch.randn(params // cols, cols, device=dev, dtype=torch.bfloat16))
    optimizer = FlatAdamW([("weight", weight)], OPTIMIZER_OPTIM, torch.bfloat16)
    try:
        return kernel_ms(lambda _: optimizer_pass(optimizer), warmup, iters) / 1e3
    finally:
        optimizer.close()


def permute_passes(x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int,
                   dy_TH: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    """(forward, forward and backward) of the step's permute and weighted combine around the
    experts (`model.block`'s fused path: `permute_tokens`, then `combine_rows` of the rows), the
    experts left out: the backward is the combine's (row and routing-weight gradients) and the
    permute's (a combine without weights)."""
    from disagmoe.kernels.permute import combine_rows, permute_tokens

    x_leaf, w_leaf = x_TH.detach().clone().requires_grad_(), weights_TK.detach().clone().requires_grad_()

    def forward() -> torch.Tensor:
        rows_NH, _, dest_TK = permute_tokens(x_leaf, topk_idx_TK, num_experts)
        return combine_rows(rows_NH, dest_TK, w_leaf)

    def forward_backward() -> object:
        rows_NH, _, dest_TK = permute_tokens(x_leaf, topk_idx_TK, num_experts)
        return torch.autograd.grad(combine_rows(rows_NH, dest_TK, w_leaf), [x_leaf, w_leaf], dy_TH)

    return forward, forward_backward


def _permute_times(dev, model: ModelConfig, tokens: int, warmup: int, iters: int) -> PassTimes:
    """`permute_passes` over `tokens` tokens of the model's hidden size, each routed to top_k
    distinct experts drawn uniformly (balanced loads)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x_TH = torch.randn(tokens, model.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
    scores = torch.rand(tokens, model.num_experts, device=dev, generator=gen)
    topk_idx_TK = scores.topk(model.top_k, dim=-1).indices  # int64, as the router's
    weights_TK = torch.softmax(scores.gather(1, topk_idx_TK), dim=-1).to(torch.bfloat16)
    dy_TH = torch.randn_like(x_TH)
    forward, forward_backward = permute_passes(x_TH, topk_idx_TK, weights_TK, model.num_experts, dy_TH)
    return _passes(forward, forward_backward, warmup, iters)


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
