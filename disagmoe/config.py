"""Typed configuration: model, hardware, cluster, plan request, plan result and training run.

Every model rejects unknown keys (`extra="forbid"`) so a typo in a YAML file is an error, not a
silently ignored setting. Presets live as YAML data in `disagmoe/presets/`; `load_hardware` accepts a preset name or a
YAML file (`model_ref.load_model` also a Hugging Face `config.json`).

This module imports no torch, ray or matplotlib: `disagmoe plan` must answer fast.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from disagmoe.safe_io import MAX_CONFIG_BYTES, check_depth, read_input_text

PRESETS_DIR = Path(__file__).parent / "presets"

# Every size has an upper bound, checked when a config is read: a typo such as 10**30 ranks is
# refused in one line before anything is allocated or any actor starts (ranges of ranks, float
# arithmetic of the cost model). The bounds are far above any real job.
MAX_GPUS = 1 << 17  # GPUs (ranks) in one job; the planner needs seconds at this size
MAX_DIM = 1 << 24  # widths, vocabulary, experts, heads, layers, sequence length, sequences per step
MAX_COUNT = 1 << 40  # steps, tokens per step, intervals
# The expert modules selective recomputation drops under precision fp8 (`kernels.recompute.FP8_RECOMPUTABLE`:
# not expert_output, the FP8 layer has no fused combine); the planner prices these, `train --plan` sets them.
FP8_SELECTIVE_MODULES = ("expert_input", "expert_swiglu")
FP8_SELECTIVE = f"[{', '.join(FP8_SELECTIVE_MODULES)}]"

PositiveInt = Annotated[int, Field(gt=0, le=MAX_COUNT)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Dim = Annotated[int, Field(gt=0, le=MAX_DIM)]
NonNegDim = Annotated[int, Field(ge=0, le=MAX_DIM)]
GpuCount = Annotated[int, Field(gt=0, le=MAX_GPUS)]
NonNegGpuCount = Annotated[int, Field(ge=0, le=MAX_GPUS)]
# Inputs are finite: an infinite bandwidth or a NaN rate would price every layout as free.
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1)]
ResultFloat = Annotated[float, Field(ge=0)]  # a computed figure (a Plan's times may be inf)



def on_off_word(value: object) -> object:
    """A field's `on`/`off` from a boolean: YAML reads a bare `on`/`off` (and `true`/`false`) as one."""
    return {True: "on", False: "off"}[value] if isinstance(value, bool) else value



# Which of the routed FP8 experts' backward GEMMs run in FP8 (`TrainConfig.fp8_expert_backward`,
# `kernels.fp8_ffn`): all four, all but the weight gradients (the default), or none.
FP8_EXPERT_BACKWARDS = ("fp8", "bf16-wgrad", "bf16")
DEFAULT_FP8_EXPERT_BACKWARD = "bf16-wgrad"
# Which backward the FP8 expert curve (`Calibration.expert_gemm_fp8`) was measured with, by the probe
# version it first holds for: `bench calibrate` times `kernels.fp8_ffn.expert_ffn_fp8` at its default
# backward (`calibrate.fp8_ffn_passes` passes none), which was "fp8" (all four GEMMs) when version 5 measured
# it and "bf16-wgrad" since session 19 (version 6 measured under it). `placement.cost.fp8_stages` prices the
# requested backward from it (`Calibration.fp8_curve_backward`). The experts backends are outside the probe's
# fingerprint, so tests/bench/test_calibrate.py holds the last entry to the kernel's default: a new default asks
# for a new probe version and an entry here.
FP8_CURVE_BACKWARDS = {5: "fp8", 6: "bf16-wgrad"}
FP8_PROBE_BACKWARD = FP8_CURVE_BACKWARDS[max(FP8_CURVE_BACKWARDS)]  # what the current probe measures
# Which of the routed FP8 experts' two forward GEMMs run in FP8 (`TrainConfig.fp8_expert_forward`):
# both (the kernels' default), gate-up (the down projection in bf16) or down (the gate/up projection in bf16:
# a run's default, `RUN_FP8_EXPERT_FORWARD`),
# with any backward (each re-quantises the bf16 rows it holds); the loss split by GEMM: docs/benchmarks.md.
FP8_EXPERT_FORWARDS = ("both", "gate-up", "down")
DEFAULT_FP8_EXPERT_FORWARD = "both"  # the kernels' (and `bench calibrate`'s FP8 probe's): the all-FP8 forward
# A run's (`TrainConfig.fp8_expert_forward` unset; `plan`'s): the down GEMM alone in FP8. 300 learned steps of the
# Qwen3 config on one H100 (docs/benchmarks.md, session 32; fp8_dense false, seed 0): "both" ended 1.66% above
# bf16's loss, outside a bf16 control's 1.57% (torch's AdamW update: rounding alone), "down" 0.66% below it,
# inside; and "down" stepped faster there (the gate/up GEMM's FP8 ran slower than its bf16 on that shape). On the
# Mixtral config (session 41, one H100, 300 steps a seed) "both" stepped 1.11-1.12x bf16, but its loss ended 2.0%
# below bf16's at seed 0 and 4.2% above at seed 1: no parity either way without a control there. On one H200 (session
# 42, the data order pinned, two seeds, a bf16 control: torch's AdamW update) "both" stepped 1.12-1.13x bf16 and ended
# 1.70% below bf16's loss, 4-9x further than rounding alone moved it: its gate/up GEMM moves the trajectory beyond
# issue 21's 1% (in either direction, by data order), so "down" stays.
RUN_FP8_EXPERT_FORWARD = "down"
# Which forward GEMMs the FP8 expert curve was measured with, by the probe version it first holds for
# (`Calibration.fp8_curve_forward`): the kernels' default, both, up to version 8; the run's (`RUN_FP8_EXPERT_FORWARD`)
# from version 9, which also times the Gluon row GEMMs and their epilogue as a run takes them (`RUN_FP8_GLUON`,
# `RUN_FP8_GLUON_STORE`) where the GPU runs them. `placement.cost.fp8_stages` prices a run's forward from it.
FP8_CURVE_FORWARDS = {5: "both", 9: RUN_FP8_EXPERT_FORWARD}
FP8_PROBE_FORWARD = FP8_CURVE_FORWARDS[max(FP8_CURVE_FORWARDS)]  # what the current probe measures
# Every how many steps a precision-fp8 run in mode single counts its FP8 numerics (`TrainConfig.fp8_counters_every`
# unset): the counting quantisers took 1.5-3x the plain ones' time; every 10th step made the Qwen3 config's FP8 step
# 2-6% faster on an H100 (docs/benchmarks.md, session 32).
FP8_COUNTERS_EVERY = 10
# A precision-fp8 run's dense projections (`TrainConfig.fp8_dense` unset): in FP8, scaled blockwise
# (`fp8_dense_scaling` unset, `kernels.fp8_dense.SCALINGS`: torch._scaled_mm's 1 x 128 / 128 x 128 scaling, the
# experts' recipe). 300 learned steps of the Qwen3 config on one H100 (docs/benchmarks.md, session 34; forward
# down, with the Gluon row GEMMs, seed 0) ended 2.80% below bf16's loss (the last 50 steps' mean cross-entropy;
# the first 50 steps 1.59% below, where the rowwise dense recipe ran 1.49% above), saturating nothing; its step
# took 551.6 ms against bf16's 553.5.
# Where blockwise cannot run (`kernels.fp8_dense.blockwise_unavailable`: off Hopper, an old torch or CUDA) a run
# that set neither field keeps them in bf16 and says so (`trainer.resolve_dense_fp8`); rowwise only when asked.
RUN_FP8_DENSE = True
FP8_DENSE_SCALING = "blockwise"
# The dense projections' FP8 recipes (`kernels.fp8_dense.SCALINGS`, a test holds them equal): the trainer's
# `fp8_dense_scaling`, the planner's (`PlanConfig.fp8_dense_scaling`) and the measured curve's
# (`Calibration.projections_fp8_scaling`).
Fp8DenseScaling = Literal["rowwise", "blockwise"]
# Whether a precision-fp8 run's routed experts run their row GEMMs and split SwiGLU GEMMs in the Gluon kernels
# (`TrainConfig.fp8_gluon` unset; on Hopper and the 128 grid, else the Triton ones run): the Qwen3 config's FP8
# step took 554.5 ms with them against 580.0 without (one H100, session 33), and the 300-step run above trained
# with them (session 28's loss gap with them was the spread between runs: session 29).
RUN_FP8_GLUON = True
# How those Gluon row GEMMs store their output tiles (`TrainConfig.fp8_gluon_store` unset): "tma", through shared
# memory by the tensor memory accelerator under the next tile's K loop (the same bits), or "plain", masked stores
# from registers. The block measured 1.15x / 1.16x our bf16 fwd+bwd on Mixtral / DeepSeek shapes with "tma" against
# 1.06x / 1.10x with "plain", 0.93x either way on Qwen3's; the FP8 step 495.5 -> 478.4 ms (Qwen3 config, 8
# micro-batches) and 477.0 -> 467.1 ms (Mixtral config, 4), same call (one H100, session 35).
RUN_FP8_GLUON_STORE = "tma"
# The routed FP8 experts' e4m3 weight copies (`kernels.fp8_ffn.Fp8ExpertWeights`), each one byte a
# value of its weight: w13's and w2's forward B operands, and their transposes the data gradients read.
FP8_WEIGHT_COPIES = ("w13", "w13_t", "w2", "w2_t")


def fp8_weight_copies(forward: str, backward: str) -> tuple[str, ...]:
    """The `FP8_WEIGHT_COPIES` the FP8 experts' recipe reads (`FP8_EXPERT_FORWARDS` x
    `FP8_EXPERT_BACKWARDS`), so the only ones made: the forward's FP8 gate/up GEMM reads w13, its
    FP8 down GEMM w2 (emulated too: `fp8_emulate` dequantises the same copies); an FP8 data gradient
    ("fp8", "bf16-wgrad", whatever the forward) reads both transposes, w2_t for d act and w13_t for
    dx; the "bf16" backward (the bf16 experts') none."""
    if forward not in FP8_EXPERT_FORWARDS:
        raise ValueError(f"FP8 experts' forward GEMMs {forward!r}: choose one of {', '.join(FP8_EXPERT_FORWARDS)}")
    if backward not in FP8_EXPERT_BACKWARDS:
        raise ValueError(f"FP8 experts' backward {backward!r}: choose one of {', '.join(FP8_EXPERT_BACKWARDS)}")
    read = {"w13": forward in ("both", "gate-up"), "w2": forward in ("both", "down")}
    read["w13_t"] = read["w2_t"] = backward != "bf16"
    return tuple(name for name in FP8_WEIGHT_COPIES if read[name])


class StrictModel(BaseModel):
    """Base for every config: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def to_json(self, indent: int = 2) -> str:
        return self.model_dump_json(indent=indent)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


class RopeScalingConfig(StrictModel):
    """YaRN RoPE scaling (arXiv 2309.00071), as DeepSeek-V3 and Qwen3 checkpoints configure it:
    frequencies above beta_fast rotations over the original context are kept, those below
    beta_slow are divided by `factor`, a linear ramp in between; cos/sin are multiplied by the
    attention factor; MLA also scales its softmax by mscale(factor, mscale_all_dim)^2."""

    type: Literal["yarn"] = "yarn"
    factor: PositiveFloat = Field(description="context extension factor")
    original_max_position_embeddings: Dim = Field(description="the pre-training context length")
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: NonNegFloat | None = None
    mscale_all_dim: NonNegFloat | None = None
    attention_factor: PositiveFloat | None = Field(
        None, description="cos/sin multiplier; by default from factor, mscale and mscale_all_dim")
    truncate: bool = Field(True, description="round the ramp's bounds to whole dimensions")


class MLAConfig(StrictModel):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, decoupled RoPE dims."""

    q_lora_rank: Dim | None = Field(
        None, description="rank of the q down-projection; None projects q directly from hidden"
    )
    kv_lora_rank: Dim = Field(description="rank of the compressed kv latent")
    qk_nope_head_dim: Dim = Field(description="per-head q/k dims without RoPE")
    qk_rope_head_dim: Dim = Field(description="per-head q/k dims carrying RoPE (k shared)")
    v_head_dim: Dim = Field(description="per-head value dims")


class RouterConfig(StrictModel):
    """How tokens pick experts, and how the load is kept balanced."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    normalize_topk: bool = Field(True, description="renormalise the k chosen weights to sum to 1")
    num_groups: Dim = Field(1, description="expert groups for group-limited top-k")
    topk_groups: Dim = Field(1, description="groups a token may route into")
    routed_scaling: PositiveFloat = Field(1.0, description="multiplier on the routed output")
    aux_loss_coef: NonNegFloat = Field(0.0, description="switch-style load-balancing loss weight")
    z_loss_coef: NonNegFloat = Field(0.0, description="router z-loss weight")
    bias_balancing: bool = Field(False, description="auxiliary-loss-free balancing via a bias")
    bias_update_rate: NonNegFloat = Field(
        1e-3, description="bias step per optimizer step, in score units: 1e-3 suits sigmoid scores (about 0.5, "
        "DeepSeek-V3); softmax scores average 1/num_experts, where 1e-3 moves whole groups of tokens at once "
        "(docs/benchmarks.md: max/mean load 8 on the Qwen3-shaped config) and a far smaller step is needed")

    @property
    def needs_every_source_load(self) -> bool:
        """The auxiliary loss takes each micro-batch's expert load over all data-parallel ranks, which
        the distributed runtime returns from each expert rank: where replica sets or EP blocks serve
        their own sources, each expert rank adds the other blocks' loads to its own first
        (`runtime.topology.Topology.load_peers`, EXPERT_LOAD)."""
        return self.aux_loss_coef > 0

    @model_validator(mode="after")
    def _groups(self) -> RouterConfig:
        if self.topk_groups > self.num_groups:
            raise ValueError(
                f"router.topk_groups={self.topk_groups} exceeds router.num_groups="
                f"{self.num_groups}; set topk_groups <= num_groups"
            )
        return self


class ModelConfig(StrictModel):
    """A decoder-only MoE transformer. Sizes are in elements, not bytes."""

    name: str = Field("custom", description="what plans, checkpoints and reports call the model")
    source: str = Field("", description="where the figures come from (a config.json, a paper); documentation only")
    vocab_size: Dim = Field(description="tokens in the vocabulary")
    hidden_size: Dim = Field(description="width of the residual stream")
    num_layers: Dim = Field(description="transformer blocks, dense ones included")
    num_dense_layers: NonNegDim = Field(0, description="leading layers with a dense FFN")
    num_heads: Dim = Field(description="attention (query) heads")
    num_kv_heads: Dim = Field(description="key/value heads (GQA: divides num_heads)")
    head_dim: Dim = Field(description="width of one attention head")
    attention: Literal["gqa", "mla"] = Field("gqa", description="grouped-query or multi-head latent attention")
    mla: MLAConfig | None = Field(None, description="the latent ranks, with attention: mla")
    qk_norm: bool = Field(False, description="RMSNorm on q and k per head (Qwen3)")
    dense_ffn_size: NonNegDim = Field(0, description="FFN width of the leading dense layers")
    num_experts: Dim = Field(description="routed experts per MoE layer")
    top_k: Dim = Field(description="routed experts each token picks")
    expert_ffn_size: Dim = Field(description="FFN width of one routed expert")
    num_shared_experts: NonNegDim = Field(0, description="experts every token passes through (on attention ranks)")
    shared_expert_ffn_size: NonNegDim | None = Field(
        None, description="width of each shared expert; defaults to expert_ffn_size"
    )
    seq_len: Dim = Field(4096, description="training sequence length")
    rope_theta: PositiveFloat = Field(10000.0, description="RoPE base frequency")
    rope_scaling: RopeScalingConfig | None = Field(None, description="YaRN context extension (None: plain RoPE)")
    norm_eps: PositiveFloat = Field(1e-6, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(False, description="the LM head shares the embedding matrix")
    embedding_init_std: PositiveFloat | None = Field(
        None, description="std of an untied embedding's init (None: 0.02 like every weight); 1.0 keeps the token "
        "visible in the residual stream, which a MoE with many experts needs for its routing not to collapse")
    router: RouterConfig = Field(default_factory=RouterConfig, description="how tokens pick experts")

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is larger than num_experts={self.num_experts}; "
                "a token cannot pick more experts than exist"
            )
        if self.num_dense_layers > self.num_layers:
            raise ValueError(
                f"num_dense_layers={self.num_dense_layers} exceeds num_layers={self.num_layers}"
            )
        if self.num_dense_layers > 0 and self.dense_ffn_size == 0:
            raise ValueError("num_dense_layers > 0 needs dense_ffn_size > 0")
        if self.attention == "mla" and self.mla is None:
            raise ValueError("attention='mla' needs an 'mla:' section with the latent ranks")
        if self.attention == "gqa":
            if self.mla is not None:
                raise ValueError("an 'mla:' section only applies with attention='mla'")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} must be a multiple of "
                    f"num_kv_heads={self.num_kv_heads}"
                )
        if self.num_experts % self.router.num_groups:
            raise ValueError(
                f"num_experts={self.num_experts} must divide into "
                f"router.num_groups={self.router.num_groups}"
            )
        return self

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def shared_ffn_size(self) -> int:
        """Total width of the shared experts (they run as one dense SwiGLU)."""
        width = self.expert_ffn_size if self.shared_expert_ffn_size is None else self.shared_expert_ffn_size
        return self.num_shared_experts * width


# ----------------------------------------------------------------------------------------------
# Hardware and cluster
# ----------------------------------------------------------------------------------------------


class Efficiency(StrictModel):
    """Achievable fraction of each datasheet peak (1.0 = the peak; calibrate with measurements)."""

    matmul: Fraction = 0.75
    hbm: Fraction = 0.85
    nvlink: Fraction = 0.85
    scaleout: Fraction = 0.8


OP_KINDS = ("AttentionForward", "ExpertForward", "Loss", "ExpertBackward", "AttentionBackward", "OptimizerStep")
HbmStage = Literal["optimizer", "permute", "norms"]  # the memory-bound stages `bench calibrate` measures (`Calibration.hbm_fraction`)
OpKind = Literal["AttentionForward", "ExpertForward", "Loss", "ExpertBackward", "AttentionBackward", "OptimizerStep"]


class RatePoint(StrictModel):
    """One point of an efficiency curve: at `at` (rows per expert, or tokens per sequence) the
    kernel ran at `fwd` / `bwd` of the bf16 dense peak (the hardware's `bf16_tflops`)."""

    at: PositiveFloat = Field(description="rows per expert (expert GEMMs) or sequence length (attention)")
    fwd: Fraction = Field(description="forward rate as a fraction of the bf16 peak")
    bwd: Fraction = Field(description="backward rate as a fraction of the bf16 peak: the attention core's backward; "
                          "the expert GEMMs' data gradients (probe version 3 on; before it, data and weight gradients "
                          "together, which then price both expert backward stages)")
    wgrad: Fraction | None = Field(None, description="expert GEMMs only (probe version 3 on): the weight gradients' "
                                   "rate with their fp32 main-gradient read and write, as the `expert weight grads` "
                                   "stage counts their work (`roofline.stages.expert_passes`)")


class Fp8RatePoint(StrictModel):
    """One point of an FP8 curve: of the experts (`Calibration.expert_gemm_fp8`: at `at` rows per
    expert the FP8 expert FFN, `kernels.fp8_ffn`, quantisers included) or of the attention
    projections (`Calibration.projections_fp8`: at `at` tokens per micro-batch, as `fp8_dense` runs
    them, quantisers included); it ran at `fwd` / `bwd` of the bf16 dense peak (`bf16_tflops`),
    against the same stage FLOPs the bf16 curve counts: a rate above the bf16 curve's (or above 1)
    is FP8 beating bf16, one below it FP8 losing to it. Its backward is measured whole (data and
    weight gradients together: the FP8 experts' backward cannot hold its weight gradients back), so
    it has no `wgrad`; `HardwareConfig` bounds both by fp8_tflops / bf16_tflops."""

    at: PositiveFloat = Field(description="rows per expert (the experts' curve) or tokens per micro-batch (the "
                              "projections' curve)")
    fwd: PositiveFloat = Field(description="the FP8 forward's rate (x's quantiser included) as a fraction of the "
                               "bf16 peak, against the bf16 forward's FLOPs")
    bwd: PositiveFloat = Field(description="the FP8 backward's rate (data and weight gradients into the fp32 main "
                               "gradients, every quantiser included) as a fraction of the bf16 peak, against the "
                               "bf16 data and weight gradients' work together")


class LinkCost(StrictModel):
    """A transport as a fixed cost per call plus a bandwidth: time = latency + bytes / bandwidth."""

    latency_us: NonNegFloat = Field(description="fixed cost of one call (a message or a collective), us")
    gbps: PositiveFloat = Field(description="achieved bandwidth per GPU per direction, GB/s")


class Calibration(StrictModel):
    """Measured terms that replace the roofline's flat efficiencies (written by `disagmoe bench
    calibrate`). Every key is optional: an absent one leaves that part priced as without calibration.

    - `expert_gemm`: the routed experts' GEMM rates against rows per expert (log-interpolated, clamped
      at the ends): forward, data gradients and (`wgrad`) weight gradients into the fp32 main
      gradients; `attention`: the attention core's rate against sequence length (same rules), at the
      calibration model's shape; `projections`: the attention projections' GEMM rate against tokens per
      micro-batch; `attention_mla`, `projections_mla` (probe version 6 on): the same two at an MLA shape,
      which price MLA models' attention block (`roofline.calibration.attention_curves`).
      Each rate is the fraction of the bf16 peak at which the planner's stage work
      (`roofline.stages.expert_passes`, `attention_core_passes`) takes the probe's measured time
      (`roofline.calibration.fitted_fraction`).
    - `expert_gemm_fp8`: the FP8 expert FFN's forward and whole-backward rates against rows per expert,
      fitted against the same bf16 stage work (`Fp8RatePoint`); absent, FP8 experts are priced at the
      datasheet ratio fp8_tflops / bf16_tflops of the bf16 rate. `projections_fp8` (probe version 7
      on): the same for the attention projections as `fp8_dense` runs them, against tokens per
      micro-batch, quantisers inside, under the scaling `projections_fp8_scaling` records (rowwise up
      to version 7; from version 8 the run's default, blockwise, where the GPU runs it); absent, or
      measured under another scaling than the planned run's, the FP8 dense projections are priced at
      the datasheet ratio and their quantisers at HBM speed.
    - `hbm_fraction`: memory-bound stages' measured HBM rate, as a fraction of the hardware's.
    - `op_fixed_us`: the fixed cost of one schedule op of that kind (its kernel launches and the
      small kernels whose time does not scale with the work), added once per op.
    - `p2p`: the point-to-point transport (NCCL send/recv) that carries dispatch and combine;
      `all_reduce` / `all_to_all`: NCCL collectives (gradient reduction, colocated dispatch).
    """

    source: str = Field("", description="what produced these numbers (command, GPU, date)")
    probe_version: PositiveInt | None = Field(None, description="the version of `bench calibrate`'s probe that "
                                              "measured these terms (`bench.probe.PROBE_VERSION`); plan and roofline "
                                              "warn when it is not the current one (absent: older than versions)")
    probe_fingerprint: str = Field("", description="the hash of that probe's code (`bench.probe.PROBE_FINGERPRINT`); "
                                   "documentation only")
    expert_gemm: list[RatePoint] = Field(default_factory=list)
    attention: list[RatePoint] = Field(default_factory=list)
    attention_mla: list[RatePoint] = Field(default_factory=list, description=(
        "probe version 6 on: the attention core (causal SDPA) at an MLA shape (the calibration model's own when it "
        "is MLA, else the deepseek-v3 preset's heads: `bench.calibrate.MLA_MODEL`) against sequence length, fitted "
        "as `attention`; it prices MLA models' attention core, `attention` the others' (absent: `attention` "
        "prices every model)"))
    projections: list[RatePoint] = Field(default_factory=list, description=(
        "probe version 3 on: the attention block's projection GEMMs (the model's own nn.Linear shapes, forward; "
        "data and weight gradients) against tokens per micro-batch, fitted against "
        "`roofline.stages.attention_projection_passes`"))
    projections_mla: list[RatePoint] = Field(default_factory=list, description=(
        "probe version 6 on: the same at the MLA shape of `attention_mla` (its low-rank q and kv chains and output "
        "projection); it prices MLA models' attention projections, `projections` the others' (absent: "
        "`projections` prices every model)"))
    op_fixed_us: dict[OpKind, NonNegFloat] = Field(default_factory=dict)
    hbm_fraction: dict[HbmStage, Fraction] = Field(default_factory=dict, description=(
        "memory-bound stages measured as the step runs them (probe version 3 on): the fraction of the "
        "hardware's HBM rate (hbm_gbps x efficiency.hbm) at which the stage's own bytes take the measured "
        "time (`roofline.calibration.fitted_hbm_fraction`); optimizer: FlatAdamW's zero, norm, fused AdamW "
        "and masters-to-bf16 passes (`roofline.stages.optimizer_step`); permute: the Triton permute and "
        "weighted-combine kernels, forward and backward (`roofline.stages.permute`); norms: a layer's RMSNorms, "
        "qk-norm / RoPE / heads-first layout, attention-output copy and residual adds, forward and backward "
        "(`roofline.stages.norms_and_residuals`; GQA models)"))
    expert_gemm_fp8: list[Fp8RatePoint] = Field(default_factory=list, description=(
        "probe version 5 on, GPUs with FP8 tensor cores and the triton experts: the FP8 expert FFN "
        "(`kernels.fp8_ffn.expert_ffn_fp8`, its weights' e4m3 copies made once outside the timed calls) at the "
        "bf16 curve's rows per expert, forward and whole backward (the kernel's default backward: all-FP8 under "
        "version 5, bf16-wgrad from version 6, `fp8_curve_backward`; both forward GEMMs in FP8 up to version 8, the "
        "run's down GEMM alone from 9 with the run's Gluon row GEMMs where the GPU runs them, `fp8_curve_forward`), "
        "as fractions of the bf16 peak against the "
        "bf16 curve's stage work (`placement.cost.fp8_stages` prices `precision: fp8` experts from it; absent: at "
        "the datasheet ratio fp8_tflops / bf16_tflops, unmeasured)"))
    projections_fp8: list[Fp8RatePoint] = Field(default_factory=list, description=(
        "probe version 7 on, GPUs with FP8 tensor cores: the attention projections of `projections` as `fp8_dense` "
        "runs them (`model.layers.DeferrableLinear.set_fp8`: the forward and data gradient in e4m3 through "
        "torch._scaled_mm, scaled as `projections_fp8_scaling` says, the weight gradient bf16, q/k/v sharing one "
        "quantised input, the weights' e4m3 copies made once outside the timed calls, every quantiser and counter "
        "included) at the same tokens, as fractions of the bf16 peak against the same stage work "
        "(`placement.cost.fp8_dense_stages` prices `fp8_dense` under that scaling at this curve over `projections`, "
        "the quantisers inside; absent, or for a run of the other scaling: at the datasheet ratio, the quantisers "
        "at HBM speed)"))
    projections_fp8_scaling: Fp8DenseScaling = Field(
        "rowwise", description="the dense FP8 recipe `projections_fp8` was measured under (`kernels.fp8_dense."
        "SCALINGS`): probe version 8 on, the run's default (blockwise, `config.FP8_DENSE_SCALING`) where the GPU runs "
        "it (`kernels.fp8_dense.blockwise_unavailable`: Hopper, torch >= 2.9 with CUDA >= 12.9), else rowwise; a file "
        "without it (probe version 7, the only recipe then) reads as rowwise")
    p2p: LinkCost | None = None
    all_reduce: LinkCost | None = None
    all_to_all: LinkCost | None = None

    @property
    def fp8_curve_backward(self) -> str:
        """The FP8 experts' backward (`FP8_EXPERT_BACKWARDS`) `expert_gemm_fp8` was measured with
        (`FP8_CURVE_BACKWARDS` at `probe_version`): "fp8" up to version 5, "bf16-wgrad" from 6; a file
        without a probe version (written by hand: `bench calibrate` records one) as version 5's."""
        version = max(self.probe_version or 0, min(FP8_CURVE_BACKWARDS))
        return FP8_CURVE_BACKWARDS[max(v for v in FP8_CURVE_BACKWARDS if v <= version)]

    @property
    def fp8_curve_forward(self) -> str:
        """The FP8 experts' forward GEMMs (`FP8_EXPERT_FORWARDS`) `expert_gemm_fp8` was measured with
        (`FP8_CURVE_FORWARDS` at `probe_version`): "both" up to version 8, the run's "down" from 9; a file
        without a probe version as version 5's."""
        version = max(self.probe_version or 0, min(FP8_CURVE_FORWARDS))
        return FP8_CURVE_FORWARDS[max(v for v in FP8_CURVE_FORWARDS if v <= version)]

    @field_validator("expert_gemm", "attention", "attention_mla", "projections", "projections_mla", "expert_gemm_fp8",
                     "projections_fp8")
    @classmethod
    def _distinct_points(cls, points: list[RatePoint]) -> list[RatePoint]:
        ats = [p.at for p in points]
        if len(set(ats)) != len(ats):
            raise ValueError(f"curve points must have distinct `at` values; got {ats}: keep one point per size")
        return sorted(points, key=lambda p: p.at)


class HardwareConfig(StrictModel):
    """One GPU model and the fabric around it. Bandwidths are GB/s (1e9 B/s) per GPU."""

    name: str = "custom"
    source: str = Field("", description="where the figures come from (a datasheet, a measurement); documentation only")
    bf16_tflops: PositiveFloat = Field(description="dense bf16 tensor-core peak, TFLOP/s")
    fp8_tflops: PositiveFloat = Field(description="dense fp8 tensor-core peak, TFLOP/s")
    hbm_gbps: PositiveFloat = Field(description="HBM bandwidth, GB/s")
    hbm_gib: PositiveFloat = Field(description="usable HBM capacity, GiB")
    nvlink_gbps: PositiveFloat = Field(description="NVLink bandwidth per GPU per direction, GB/s")
    nvlink_domain: GpuCount = Field(description="GPUs sharing one NVLink domain (8 HGX, 72 NVL72)")
    scaleout_gbps: PositiveFloat = Field(description="scale-out (IB/RoCE) per GPU per direction, GB/s")
    host_link_gbps: PositiveFloat | None = Field(
        None, description="GPU <-> host memory per GPU per direction, GB/s (PCIe Gen5 x16: 64; NVLink-C2C: 450): "
        "what an offloaded optimizer's copies run at (`plan --offload-optimizer`); unset: not priced")
    host_memory_gib: PositiveFloat | None = Field(
        None, description="host (CPU) memory per GPU, GiB: the most fp32 masters and AdamW moments an offloaded "
        "optimizer may keep there (`plan --offload-optimizer` skips layouts that need more); unset: not limited")
    nvlink_latency_us: NonNegFloat = Field(
        9.0, description="one-sided put over NVLink, fixed cost per message, us")
    scaleout_latency_us: NonNegFloat = Field(
        15.0, description="one-sided put over the scale-out network, fixed cost per message, us")
    collective_latency_us: NonNegFloat = Field(
        120.0, description="fixed cost of one NCCL collective call (all-to-all, all-reduce), us")
    efficiency: Efficiency = Field(default_factory=Efficiency)
    calibration: Calibration | None = Field(
        None, description="measured efficiency curves and fixed costs (`disagmoe bench calibrate`); "
        "absent: the roofline with the flat `efficiency` fractions")

    @model_validator(mode="after")
    def _fp8_curve_within_the_fp8_peak(self) -> HardwareConfig:
        """An FP8 curve point faster than the FP8 datasheet peak is a misread measurement (the probe
        clips its fits there), not a rate to plan with."""
        most = self.fp8_tflops / self.bf16_tflops
        for curve, unit in (("expert_gemm_fp8", "rows per expert"), ("projections_fp8", "tokens")):
            fast = [p.at for p in (getattr(self.calibration, curve) if self.calibration else [])
                    if max(p.fwd, p.bwd) > most * (1 + 1e-9)]
            if fast:
                raise ValueError(f"calibration.{curve} at {unit} {fast}: a rate above fp8_tflops / "
                                 f"bf16_tflops = {most:.3g} of the bf16 peak, faster than the FP8 datasheet peak")
        return self


class ClusterConfig(StrictModel):
    """The GPUs a job gets: how many, of which kind."""

    hardware: HardwareConfig
    num_gpus: GpuCount


# ----------------------------------------------------------------------------------------------
# Placement request and result
# ----------------------------------------------------------------------------------------------


class PlanConfig(StrictModel):
    """What `disagmoe plan` is asked: place this model on this cluster for this batch."""

    model: ModelConfig
    cluster: ClusterConfig
    seq_len: Dim
    global_batch_tokens: PositiveInt = 4 * 1024 * 1024
    max_pipeline_groups: GpuCount = 8
    micro_batch_choices: list[Dim] = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_expert_replicas: NonNegGpuCount = Field(
        0, description="extra replicas allowed for hot experts (0 = none)"
    )
    load_histogram: list[list[float]] | None = Field(
        None, description="per MoE layer, per expert: observed load (any scale)"
    )
    memory_headroom: Fraction = Field(
        0.9, description="fraction of HBM the plan may fill (the rest is for allocator slack)"
    )
    shard_optimizer_states: bool = Field(
        False, description="price the attention side's AdamW moments split over each data-parallel group "
        "(ZeRO-1, train with optim.shard_states=true)")
    optimizer_state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="price AdamW's two moments in this dtype: 4 or 2 bytes each per parameter (train "
        "with optim.state_dtype set the same)")
    optimizer_update_kernel: Literal["torch", "triton"] = Field(
        "triton", description="price AdamW's update as this kernel runs it (train with optim.update_kernel set the "
        "same): triton reads and writes each parameter's master, gradient and moments in one pass that writes the "
        "bf16 parameter too; torch adds a pass for the bf16 parameters and, with bf16 moments, fp32 copies of them "
        "(`roofline.stages.adamw_update_bytes`). Offloaded (offload_optimizer), torch's whatever this says")
    clip_gradients: bool = Field(
        True, description="price a gradient-norm clip every step (train with optim.grad_clip > 0, its default): "
        "torch's update then writes the scaled gradient back")
    expert_precision: Literal["bf16", "fp8"] = Field(
        "bf16", description="price the routed experts' GEMMs in this precision: fp8 at the hardware's fp8_tflops "
        "(the bf16 rate, or a calibrated one, times fp8_tflops / bf16_tflops), plus the quantisation passes' HBM "
        "traffic and the FP8 weight copies' memory (train with precision: fp8; the plan records it and `train --plan` "
        "sets it)")
    fp8_dense: Literal["auto", "on", "off"] = Field(
        "on", description="with expert_precision fp8: on (the default, as precision fp8 trains: TrainConfig.fp8_dense "
        "unset) prices the dense projections' forward and data-gradient GEMMs (attention, shared experts, dense FFN "
        "layers) in FP8 too, as fp8_dense_scaling scales them, their weight gradients at the bf16 rate: from the "
        "calibration's measured FP8 projection curve where it measured that scaling, quantisers inside, or else at "
        "fp8_tflops plus their quantisation passes; off "
        "(train with fp8_dense: false) in bf16; auto plans both ways and keeps the faster plan that fits (ties: on; "
        "neither fitting: off, the leaner), a note says which (at the datasheet ratio usually on for large models, "
        "while their quantisation passes can make off faster at small shapes); the plan records the choice and "
        "`train --plan` sets it; true / false read as on / off; no effect under bf16; `plan --config` prices the "
        "run's own fp8_dense")
    fp8_dense_scaling: Fp8DenseScaling = Field(
        FP8_DENSE_SCALING, description="with the dense projections in FP8 (expert_precision fp8, fp8_dense on or "
        "auto): the recipe they are priced as (train with the same fp8_dense_scaling): blockwise (the default, as "
        "precision fp8 trains on a Hopper GPU: 1 x 128 activation groups, 128 x 128 weight blocks, the weights' two "
        "e4m3 copies written by one launch; a linear off the 512 grid, MLA's kv_a, in bf16) or rowwise (one scale "
        "per token or feature: the recipe off Hopper, where a run asks for it). The calibration's measured FP8 "
        "projection curve prices only the scaling it measured (`Calibration.projections_fp8_scaling`); the other "
        "is priced at the datasheet ratio, and the plan's note says so. The plan records it and `train --plan` "
        "sets it; no effect with the dense projections in bf16")
    fp8_expert_backward: Literal["fp8", "bf16-wgrad", "bf16"] = Field(
        "bf16-wgrad", description="with expert_precision fp8: which of the routed experts' backward GEMMs are priced "
        "in FP8 (train with the same fp8_expert_backward): bf16-wgrad (the default: the data gradients FP8, the "
        "weight gradients at the bf16 rate), fp8 (both) or bf16 (neither: the forward alone); no effect under bf16")
    fp8_expert_forward: Literal["both", "gate-up", "down"] = Field(
        RUN_FP8_EXPERT_FORWARD, description="with expert_precision fp8: which of the routed experts' two forward GEMMs "
        "are priced in FP8 (train with the same fp8_expert_forward): down (the default, as the trainer's), gate-up "
        "or both (the other at the bf16 rate); no effect under bf16")
    recompute: Literal["none", "selective", "full", "auto"] = Field(
        "auto", description="activation recomputation to price: none, selective (the expert FFN's input, "
        "output and SwiGLU rows dropped and recomputed in the backward: leaner expert GPUs, a few more HBM "
        "bytes), full (every block keeps its input and routing and runs again in the backward: the least "
        "memory on both sides for about one more forward of every block; any experts backend, not with "
        "expert_precision fp8) or auto (per layout, the least recomputation that fits: the expert modules where "
        "only they let the expert GPUs fit, attention where only it lets the attention GPUs fit; never full); "
        "the plan's `recompute` and `recompute_modules` say which, and `train --plan` sets them")
    recompute_modules: list[Literal["expert_input", "expert_output", "expert_swiglu", "attention"]] | None = Field(
        None, description="with recompute selective: the modules priced as dropped (None: the three expert "
        "modules, under expert_precision fp8 the two it drops); with auto: the modules it may choose from, the "
        "expert ones together and attention on its own "
        "(None: all four; the expert modules only where experts_backend is triton, and under expert_precision fp8 "
        "expert_input and expert_swiglu only: no fused FP8 combine drops expert_output)")
    experts_backend: Literal["loop", "grouped_mm", "triton"] = Field(
        "triton", description="the run's expert FFN (TrainConfig.experts_backend): selective recomputation "
        "needs triton, so for another the planner prices none")
    offload_optimizer: Literal["auto", "on", "off"] = Field(
        "off", description="price the fp32 masters and AdamW moments in host memory (train with "
        "offload_optimizer: true): two staging buckets on each GPU instead of that state, and the optimizer "
        "step at least as long as its copies over the hardware's host_link_gbps (in and out at once), within "
        "its host_memory_gib per GPU. on, off (the default), or auto: each layout priced both ways and the "
        "faster plan that fits kept (a note says which and why); true / false read as on / off")
    cuda_graphs: Literal["auto", "off", "on"] = Field(
        "auto", description="the run's cuda_graphs (train with the same): a distributed layout whose rank steps it "
        "captures (one attention GPU per pipeline group, no replicated experts, over nvshmem; under auto not in "
        "precision fp8 yet: runtime/rank_graphs.py) has its nvshmem receive rings priced rounded up to a step's messages, "
        "as the run allocates them; under on the plan is one of those layouts (train refuses the others); the plan's "
        "rank_steps_captured says which")
    fused_loss: bool = Field(
        True, description="the run's fused_loss (train with the same): the LM head's loss priced and its memory "
        "counted as the fused kernel runs it (about 12 bytes of HBM traffic a logit, chunks of the logits in "
        "their own dtype), else as torch's ops (about 50, beside an fp32 copy of each chunk)")

    expert_wgrad_pairs: Literal["auto", "on", "off"] = Field(
        "auto", description="the run's expert_wgrad_pairs (train with the same): with 2+ micro-batches (one GPU: a "
        "step's, a distributed rank: a round's) and the triton experts each expert weight gradient is priced once "
        "per two micro-batches (its fp32 main gradient read and written half as often) and the rows waiting for "
        "the next held as the run holds them (one GPU: one micro-batch's expert rows per MoE layer beside the next; "
        "an expert rank: its schedule's replay, placement/waiting_rows.py); auto: on for each split whose predicted "
        "peak with those rows is within 85% of the device (`roofline.memory.MEMORY_HEADROOM`), or, distributed, "
        "whose fullest GPU's peak they do not raise, as the trainer and the driver settle it, else off; off: a "
        "weight-gradient pass per micro-batch")

    _offload_bool = field_validator("offload_optimizer", mode="before")(on_off_word)
    _fp8_dense_on_off = field_validator("fp8_dense", mode="before")(on_off_word)
    _graphs_on_off = field_validator("cuda_graphs", mode="before")(on_off_word)
    _pairs_on_off = field_validator("expert_wgrad_pairs", mode="before")(on_off_word)

    @model_validator(mode="after")
    def _offload_link(self) -> PlanConfig:
        if self.offload_optimizer == "on" and self.cluster.hardware.host_link_gbps is None:
            raise ValueError(f"offload_optimizer prices the optimizer's copies over the host link, and hardware "
                             f"{self.cluster.hardware.name!r} has no host_link_gbps: add it (GB/s per direction, e.g. "
                             "64 for PCIe Gen5 x16) or plan without offload_optimizer")
        return self

    @model_validator(mode="after")
    def _captured_steps(self) -> PlanConfig:
        if self.cuda_graphs == "on" and self.experts_backend == "loop":
            raise ValueError("cuda_graphs: on with experts_backend: loop: the loop reads each expert's row count on "
                             "the host, which a captured step cannot; plan for experts_backend: triton (or "
                             "grouped_mm), or cuda_graphs: off")
        if self.cuda_graphs == "on" and self.offload_optimizer != "off":
            raise ValueError(f"offload_optimizer {self.offload_optimizer} with cuda_graphs: on: the offloaded step's "
                             "copy streams have not been captured in a graph yet; plan with offload_optimizer: off "
                             "(or cuda_graphs: off)")
        return self

    @model_validator(mode="after")
    def _recompute_backend(self) -> PlanConfig:
        asked = {"expert_input", "expert_output", "expert_swiglu"} if self.recompute_modules is None else set(
            self.recompute_modules)
        if self.recompute == "selective" and not asked:
            raise ValueError("recompute: selective with recompute_modules: [] drops nothing; name what to drop "
                             "or plan with recompute: none")
        if self.recompute == "selective" and asked - {"attention"} and self.experts_backend != "triton":
            raise ValueError(f"recompute: selective needs experts_backend: triton (the {self.experts_backend} "
                             "backend keeps what torch autograd saves); plan with recompute none or auto, or for "
                             "experts_backend: triton")
        if self.recompute == "full" and self.expert_precision == "fp8":
            raise ValueError("recompute: full is not built with FP8 experts (the recomputed forward would quantise "
                             "every block again); plan with expert_precision: bf16, or recompute none or auto")
        if (self.recompute == "selective" and self.expert_precision == "fp8" and self.recompute_modules is not None
                and "expert_output" in self.recompute_modules):
            raise ValueError("recompute_modules names expert_output, which the FP8 experts do not recompute (no fused "
                             f"FP8 combine: the combine keeps their output rows); plan with {FP8_SELECTIVE} (the "
                             "default under expert_precision fp8) or expert_precision: bf16")
        return self

    @field_validator("load_histogram")
    @classmethod
    def _finite_loads(cls, histogram: list[list[float]] | None) -> list[list[float]] | None:
        for j, row in enumerate(histogram or []):
            for e, load in enumerate(row):
                if not (math.isfinite(load) and load >= 0):
                    raise ValueError(f"MoE layer {j}, expert {e} has load {load}: loads must be finite and "
                                     "non-negative (from --load-histogram: is that metrics file damaged?)")
        return histogram


class StageTime(StrictModel):
    """A stage's predicted time for one step on the GPUs that run it, and what binds it."""

    name: str
    time_s: ResultFloat
    group: str = Field(description="who runs it: attention, expert or link")
    bound: str = Field(description="binding ceiling: compute, hbm, nvlink, scale-out or latency")


class MemoryEstimate(StrictModel):
    """Memory per GPU in GiB, split by what it holds."""

    weights_gib: ResultFloat
    grads_gib: ResultFloat
    optimizer_gib: ResultFloat
    activations_gib: ResultFloat
    transport_gib: ResultFloat = Field(
        0.0, description="the transport's message buffers (nvshmem's symmetric arena: a ring of segments per "
        "receive pool, the largest rank's on every GPU), in total_gib")
    total_gib: ResultFloat
    capacity_gib: ResultFloat
    host_gib: ResultFloat = Field(
        0.0, description="offloaded optimizer state (fp32 masters and moments) in host memory, not in total_gib "
        "(optimizer_gib then holds the two staging buckets)")


class Plan(StrictModel):
    """The placement result: what `plan --json` prints and `train` reads (DESIGN section 3b)."""

    model: str
    hardware: str
    gpus: GpuCount
    seq_len: Dim
    global_batch_tokens: PositiveInt
    layout: Literal["disaggregated", "colocated", "single"] | None = Field(
        description="the chosen layout (single: one GPU runs everything, no transfers); None when no layout "
        "fits (feasible is false)")
    attention_gpus: NonNegGpuCount
    expert_gpus: NonNegGpuCount
    pipeline_groups: GpuCount
    micro_batches: Dim
    idle_gpus: NonNegGpuCount = Field(
        0, description="GPUs the plan leaves idle: gpus mod p, or all but a smaller layout that is faster")
    expert_replica_sets: NonNegGpuCount = Field(
        description="per pipeline group: sets of expert GPUs each holding every expert once")
    sequences_per_micro_batch: NonNegInt = Field(description="sequences per micro-batch, all DP ranks")
    accumulation_rounds: NonNegInt = Field(
        description="rounds of m micro-batches per step, priced one after another (the optimizer once a step). A "
        "single plan trains them as m x rounds micro-batches of one accumulation (`train --plan` sets micro_batches "
        "to that); the distributed runtime runs one round per optimizer step, so a plan of 2+ rounds there needs "
        "batch_size = m x sequences_per_micro_batch (`runtime.plan_layout.check_rounds`)")
    expert_map: list[list[list[int]]] = Field(
        description="per MoE layer, per expert: the expert ranks holding it (replica r serves "
        "data-parallel index d with d mod n == r; with fewer data-parallel ranks D than replicas n, "
        "d splits its rows over replicas d, d + D, ...)"
    )
    total_params: Annotated[int, Field(ge=0)]
    active_params: Annotated[int, Field(ge=0)]
    memory_per_gpu: dict[str, MemoryEstimate]
    stage_times: list[StageTime]
    step_time_s: NonNegFloat | None = Field(description="predicted; None when no layout was priced")
    colocated_step_time_s: NonNegFloat | None = Field(
        description="the best colocated layout's predicted step; None when it was not priced or does not fit")
    speedup_vs_colocated: NonNegFloat | None = Field(
        description="colocated_step_time_s / step_time_s; None without a colocated baseline")
    expert_imbalance: NonNegFloat = Field(description="max/mean expected load over expert GPUs")
    mfu: NonNegFloat | None = Field(description="model FLOPs utilisation over all `gpus`; None without a step time")
    tflops_per_gpu: NonNegFloat | None = Field(
        None, description="achieved model TFLOP/s per GPU of `gpus` (the step's model FLOPs / step time / gpus, "
        "as training reports quote it); None without a step time")
    feasible: bool
    reason: str
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="the activation recomputation the plan's memory and step time assume (`train --plan` "
        "sets TrainConfig.recompute to it; selective's expert modules need experts_backend: triton)")
    recompute_modules: list[Literal["expert_input", "expert_output", "expert_swiglu", "attention"]] = Field(
        default_factory=list, description="with recompute selective: the modules assumed dropped (`train --plan` "
        "sets TrainConfig.recompute_modules to them); a selective plan that names none (written before this "
        "field) means the three expert modules")
    offload_optimizer: bool = Field(
        False, description="the plan's memory and step time assume the optimizer state in host memory (`plan "
        "--offload-optimizer on`, or auto where it made the step faster; `train --plan` then sets "
        "offload_optimizer: true)")
    optimizer_state_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="AdamW's moments as the plan's memory and optimizer step price them (`train --plan` "
        "sets optim.state_dtype to it); None in a plan written before this field (the config's stays)")
    optimizer_update_kernel: Literal["torch", "triton"] | None = Field(
        None, description="the AdamW update kernel the plan's optimizer step prices (`train --plan` sets "
        "optim.update_kernel to it); None in a plan written before this field (the config's stays)")
    shard_optimizer_states: bool = Field(
        False, description="the plan's memory assumes the attention side's AdamW moments split over each "
        "data-parallel group (ZeRO-1; `train --plan` then sets optim.shard_states: true; a plan without it "
        "leaves the config's setting)")
    expert_precision: Literal["bf16", "fp8"] | None = Field(
        None, description="the routed experts' GEMMs as the plan's memory and step time price them (`plan "
        "--expert-precision`): fp8 (`train --plan` then sets precision: fp8) or bf16 (the config's precision "
        "stays); None in a plan written before this field (the config's stays)")
    fp8_dense: bool | None = Field(
        None, description="whether the plan priced the dense projections in FP8 too (with expert_precision fp8; "
        "`train --plan` then sets fp8_dense to it); None in a plan written before this field (the config's stays)")
    fp8_dense_scaling: Fp8DenseScaling | None = Field(
        None, description="with fp8_dense: the recipe the plan priced the dense projections' FP8 as (`train --plan` "
        "then sets fp8_dense_scaling to it where the config's differs); None otherwise and in a plan written before "
        "this field (the config's stays)")
    fp8_expert_backward: Literal["fp8", "bf16-wgrad", "bf16"] | None = Field(
        None, description="with expert_precision fp8: the experts' backward GEMMs the plan priced in FP8 (`train "
        "--plan` then sets fp8_expert_backward to it); None otherwise and in a plan written before this field")
    fp8_expert_forward: Literal["both", "gate-up", "down"] | None = Field(
        None, description="with expert_precision fp8: the experts' forward GEMMs the plan priced in FP8 (`train "
        "--plan` then sets fp8_expert_forward to it); None otherwise and in a plan written before this field")
    cuda_graphs: Literal["auto", "on", "off"] | None = Field(
        None, description="a distributed layout: the cuda_graphs its transport's rings were priced under "
        "(`train --plan` then sets cuda_graphs to it); None for one GPU and in a plan written before this field")
    fused_loss: bool | None = Field(
        None, description="the LM head's loss as the plan priced its time and memory: the fused kernel's or torch's "
        "ops (`train --plan` then sets fused_loss to it); None in a plan written before this field")
    expert_wgrad_pairs: Literal["auto", "on", "off"] | None = Field(
        None, description="the expert_wgrad_pairs the layout was priced under, the same on every GPU holding "
        "experts: on (its expert weight gradients priced over pairs of micro-batches) or off (a request's auto "
        "settled for its split, as the single trainer or the driver settles it; `train --plan` then sets "
        "expert_wgrad_pairs to it, a distributed plan's on as auto, which its driver settles alike: "
        "runtime/plan_layout.py); None in a plan written before this field, and for a distributed layout in one "
        "written before the planner priced its ranks' pairs")
    rank_steps_captured: bool | None = Field(
        None, description="a distributed layout: whether its rank steps are captured in CUDA graphs under the "
        "planned cuda_graphs, as train decides it (runtime/rank_graphs.py; their nvshmem rings are priced rounded up "
        "to a step's messages); None for one GPU and where no layout fits")
    rank_steps_note: str | None = Field(
        None, description="the one line train prints for it: captured or eager, and why (a layout cuda_graphs: on "
        "cannot capture: the refusal)")
    notes: list[str] = Field(default_factory=list)
    min_gpus: PositiveInt | None = Field(None, description="when infeasible: fewest GPUs that fit")

    @model_validator(mode="before")
    @classmethod
    def _legacy_recompute_modules(cls, data: Any) -> Any:
        """A selective plan naming no modules (written before `recompute_modules`): the three expert ones."""
        if isinstance(data, dict) and data.get("recompute") == "selective" and not data.get("recompute_modules"):
            return {**data, "recompute_modules": ["expert_input", "expert_output", "expert_swiglu"]}
        return data


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


class DataConfig(StrictModel):
    """Where training tokens come from."""

    kind: Literal["synthetic", "text", "tokens"] = Field(
        "synthetic", description="synthetic (a seeded corpus), text (a byte-level text file) or tokens (a .bin file "
        "of token ids)")
    path: str | None = Field(None, description="text file (byte-level) or .bin token file")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="kind tokens: the .bin file's id width")
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        0.05, description="the corpus's tail held out for validation (0: none)")
    synthetic_alphabet: Annotated[int, Field(ge=3)] = Field(
        16, description="distinct tokens of the synthetic corpus: 16 gives the letters a-p (bytes), more "
        "the ids 0..N-1 (at most vocab_size); a MoE needs many, or its routing collapses")
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = Field(
        None, description="seed of the data order alone (None: the run's seed, which seeds the initialisation "
        "too); pin it to vary a run's initialisation on the same batches, as `bench train --seeds` does")

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind={self.kind!r} needs data.path")
        return self


class OptimConfig(StrictModel):
    # Bounds far above any working value: beyond them the update overflows fp32 (a traceback mid-step)
    # instead of diverging, which the run would stop with one line (runtime/training/loop.py).
    lr: Annotated[float, Field(gt=0, le=10)] = Field(3e-3, description="peak learning rate, reached after warm-up")
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = Field(
        0.1, description="the cosine decay ends at lr x this on the last step (1: constant after warm-up)")
    warmup_steps: NonNegInt = Field(10, description="steps of linear warm-up from lr / warmup_steps to lr")
    weight_decay: Annotated[float, Field(ge=0, le=1e3)] = Field(0.0, description="AdamW's decoupled weight decay")
    beta1: Fraction = Field(0.9, description="AdamW's first-moment decay")
    beta2: Fraction = Field(0.95, description="AdamW's second-moment decay")
    eps: Annotated[float, Field(gt=0, le=1)] = Field(1e-8, description="AdamW's epsilon")
    grad_clip: Annotated[float, Field(ge=0, le=1e9)] = Field(1.0, description="global grad-norm clip; 0 disables")
    shard_states: bool = Field(
        False, description="ZeRO-1: split AdamW's moments of the replicated (attention-side) parameters over "
        "each data-parallel group (distributed modes; the result is the same step)")
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype AdamW keeps its two moments in: bf16 saves 4 bytes per parameter (the "
        "update still runs in fp32 over fp32 masters and gradients; the moments are rounded to bf16 after it, as "
        "Megatron-Core's precision-aware optimizer does); checkpoints hold fp32 moments either way; single mode "
        "with precision fp32 then steps the flat optimizer instead of the plain torch AdamW oracle")
    update_kernel: Literal["torch", "triton"] = Field(
        "triton", description="what runs the AdamW update of each flat bucket on a GPU. torch: its fused AdamW, then a "
        "second pass writing the bf16 parameters from the fp32 masters (with bf16 moments, fp32 copies of them go "
        "through the same kernel and are rounded back). triton (kernels/adamw.py): one pass per bucket that reads the "
        "fp32 master and gradient and both moments and writes the master, the moments in their dtype and the bf16 "
        "parameters: 30 bytes per parameter with fp32 moments, 22 with bf16, against torch's 38 and 62 with a "
        "gradient clip; the same arithmetic as torch's fused kernel, in its order (on an H200 its results lie "
        "within a few ulps of their operands of torch's, tests/kernels/test_adamw.py; the Qwen3 step 483.4 -> "
        "471.9 ms, its loss within 0.04% after 50 steps; docs/benchmarks.md). "
        "CUDA buckets only: on the CPU, offloaded (offload_optimizer) and under precision fp32's reference AdamW, "
        "torch's path runs whatever this says")


class FaultInjection(StrictModel):
    """Tests: SIGKILL one rank's actor process while step `step` runs, once per run (the driver
    records in out_dir that it fired, so a restart or a resume does not fire it again)."""

    rank: NonNegGpuCount = Field(description="the rank whose actor process is killed")
    step: PositiveInt = Field(description="the step (1-based) during which it is killed")


class TrainConfig(StrictModel):
    """A training run: model, data, optimisation, layout, and where outputs go."""

    model: str | ModelConfig = Field(description="preset name, YAML / config.json path, or inline")
    hardware: str | HardwareConfig | None = Field(
        None, description="hardware preset name, YAML path or inline: its bf16 peak is what MFU is quoted against "
        "(unset: no MFU)")
    mode: Literal["single", "disaggregated", "colocated"] = Field(
        "disaggregated", description="single: the whole model in one process (the oracle); disaggregated: "
        "attention and expert ranks on disjoint GPUs; colocated: every rank runs attention and its share of experts")
    transport: Literal["local", "nccl", "nvshmem"] = Field(
        "local", description="how messages between ranks travel: local (CPU, gloo), nccl (GPU send/recv) or "
        "nvshmem (GPU, one-sided puts into NVSHMEM symmetric buffers, flags waited on the GPU; needs nvshmem4py)")
    transport_capacity_factor: float | None = Field(
        None, gt=0, description="nvshmem: receive buffers hold this fraction of each message's worst-case rows "
        "(a message over it stops the run, naming this knob); unset = the plan's worst case exactly")
    hop: Literal["auto", "partial_sums", "pair_rows"] = Field(
        "auto", description="how expert outputs return to the attention ranks: partial_sums (each expert rank "
        "sends one weighted partial sum per token) or pair_rows (every (token, expert) row lands in one buffer on "
        "the attention rank, stored there by the expert kernel's last GEMM as tiles finish, combined as segments "
        "land: fewer bytes once a token's experts span more expert ranks than top-k; transport nvshmem with the "
        "triton experts, or local on CPU); auto = pair_rows where it moves fewer bytes and the transport is "
        "nvshmem, partial sums under precision: fp8 (printed at start)")
    dispatch: Literal["auto", "dense", "sparse"] = Field(
        "auto", description="which tokens a MoE layer's attention rank sends to each expert rank of its set: dense "
        "(every token to every expert rank) or sparse (a token only to the expert ranks serving at least one of "
        "its top-k pairs, once per rank, with its token index; counts and offsets computed on the device, into "
        "receive buffers sized for the worst case; with either hop); auto = sparse on nvshmem when a set has more "
        "than one expert rank, else dense (printed at start)")
    pair_segment_tokens: Dim = Field(
        256, description="pair_rows: tokens per landing segment (each segment has its own arrival flag per "
        "expert rank; the attention rank combines a segment once every flag is up)")
    pair_bands: Dim = Field(
        1, description="pair_rows: the expert kernels compute rows in this many bands of landing segments, the "
        "first band first, so the attention rank combines it while later bands compute (smaller row groups: on "
        "an H200 at the Qwen3-30B shape 4 bands cost more than they overlapped)")
    pair_combine_programs_per_sm: Dim = Field(
        4, description="pair_rows: persistent programs per SM of the attention rank's combine (its stream waits "
        "there; nothing else of the rank runs meanwhile)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where ranks compute: cpu (gloo, tests and the demo) or cuda")
    ranks_per_gpu: Annotated[int, Field(ge=1, le=64)] = Field(
        1, description="distributed modes on cuda: ranks sharing one GPU, each its own process (fractional Ray "
        "GPUs), so a layout of N ranks runs on N / ranks_per_gpu GPUs with the real kernels and transport: a "
        "test of the layout, not a speed measurement (the processes time-slice the GPU; waits get ranks_per_gpu "
        "times recv_timeout_s). Needs transport: nvshmem (NCCL refuses two ranks on one GPU); the gradient norm "
        "(with precision fp8 also the ranks' FP8 counters) then sums on the GPU stream over NVSHMEM, the data-parallel and replicated experts' sums over gloo, "
        "staged through the host. mode single: no effect")
    experts_backend: Literal["loop", "grouped_mm", "triton"] = Field(
        "loop", description="the expert FFN: loop (a matmul pair per expert, the reference), grouped_mm "
        "(torch._grouped_mm) or triton (our persistent kernels: the fast one on GPUs)")
    precision: Literal["auto", "bf16", "fp32", "fp8"] = Field(
        "auto", description="parameters for compute: bf16 (fp32 master weights, gradients accumulated in fp32, "
        "fused AdamW: the fast path), fp32 (everything fp32; `mode: single` then runs the reference oracle), "
        "fp8 (bf16 as above, and the routed experts' GEMMs in e4m3 with 1x128 / 128x128 scaling, their FP8 "
        "weight copies made once per optimizer step, and the dense projections through torch._scaled_mm "
        "(fp8_dense): docs/architecture.md; every mode, each expert rank running "
        "the same kernels; triton experts, a GPU with FP8 tensor cores, and in the distributed modes hop: "
        "partial_sums, with dense or sparse dispatch); auto = bf16 on cuda, fp32 on cpu")
    fp8_dense: bool | None = Field(
        None, description="precision fp8: also run the dense projections' forward and data-gradient GEMMs "
        "(attention q/k/v/o and MLA's, shared experts, dense FFN layers) in e4m3 through torch._scaled_mm, scaled "
        "as fp8_dense_scaling says, their weight gradients in bf16 (kernels/fp8_dense.py says why); false keeps "
        "them in bf16. None = true (config.RUN_FP8_DENSE): over 300 learned steps of the Qwen3 config the blockwise "
        "recipe, with the Gluon row GEMMs, ended 2.80% below bf16's loss and stepped as fast as bf16 (one H100, "
        "docs/benchmarks.md, session 34); where blockwise cannot run (off Hopper, torch < 2.9 or CUDA < 12.9) a run "
        "that sets neither this nor fp8_dense_scaling keeps them in bf16 and says so. true is refused under another "
        "precision")
    fp8_dense_scaling: Fp8DenseScaling | None = Field(
        None, description="with fp8_dense: how the dense projections' e4m3 operands are scaled: rowwise (one scale "
        "per token or feature over the whole contraction) or blockwise (the routed experts' recipe, DeepSeek-V3's: "
        "1 x 128 activation groups and 128 x 128 weight blocks through torch._scaled_mm's block scaling, on a Hopper "
        "GPU: asked for elsewhere, refused unless emulated; a linear whose dimensions are not multiples of 512, such "
        "as MLA's kv_a, keeps its GEMMs in bf16 and the run says so); kernels/fp8_dense.py; None = blockwise "
        "(config.FP8_DENSE_SCALING: over the Qwen3 config's first 50 learned steps rowwise ran 1.49% above bf16's "
        "loss, blockwise 1.59% below, docs/benchmarks.md sessions 32 and 34); refused where the dense projections "
        "run in bf16")
    fp8_expert_backward: Literal["fp8", "bf16-wgrad", "bf16"] | None = Field(
        None, description="precision fp8: the routed experts' backward GEMMs: fp8 (all four in e4m3, the weight "
        "gradients over 128 x 1 token groups: DeepSeek-V3's recipe), bf16-wgrad (the weight gradients by the bf16 "
        "experts' GEMM on the bf16 rows, the input rows gathered again under expert_input recomputation, no "
        "token-group copies; the data gradients FP8) or bf16 (the whole backward in bf16 from the FP8 forward's "
        "pre-activations); kernels/fp8_ffn.py; None = bf16-wgrad (measured faster than fp8 at the same loss: docs/benchmarks.md, session 19); refused "
        "under another precision")
    fp8_expert_forward: Literal["both", "gate-up", "down"] | None = Field(
        None, description="precision fp8: which of the routed experts' two forward GEMMs run in e4m3: both, gate-up "
        "(the down projection in bf16) or down (the gate/up projection in bf16; None = down: over 300 learned steps of "
        "the Qwen3 config, fp8_dense false, down ended 0.66% below bf16's loss, inside a bf16 control's spread, and "
        "both 1.66% above, outside it; down also stepped faster, session 32; session 20's 200 steps found the same "
        "with the Gluon row GEMM: docs/benchmarks.md); with any fp8_expert_backward; refused under another precision")
    fp8_emulate: bool = Field(
        False, description="precision fp8, a numerics check: run each FP8 GEMM as its operands' "
        "quantise-dequantise images (the same e4m3 rounding and scales, from the same quantisers, so the FP8 "
        "counters still count) fed to a higher-precision GEMM: the routed experts' FP8 forward GEMMs (as "
        "fp8_expert_forward says) to the bf16 experts' kernels, on operands dequantised to the run's dtype, and "
        "with fp8_dense the dense projections' forward and data-gradient GEMMs to an fp64 matmul. A loss gap "
        "that stays with it is the FP8 format's; one that goes away is the FP8 kernels'. bf16's speed or slower "
        "(the dequantised weights are made per call, the dense GEMMs run in fp64), never faster; the planner prices "
        "the run as FP8 all the same, the memory check as FP8 plus the experts' dequantised operands of one layer's forward "
        "(the dense projections' fp64 ones are not counted). Needs fp8_expert_backward: bf16 (the experts' FP8 "
        "backward kernels are not emulated); refused under another precision")
    fp8_gluon: bool | None = Field(
        None, description="precision fp8 on a Hopper GPU: the routed experts' FP8 row GEMMs and split SwiGLU GEMMs "
        "(and under fp8_expert_backward: fp8 their weight gradients, bench experts --backend "
        "triton-fp8:gluon-tma-store-wgrad) "
        "in the warp-specialised Gluon kernels (bench experts --backend triton-fp8:gluon) instead of the Triton ones "
        "(elsewhere, or off the 128 grid, the Triton ones run); false: the Triton ones everywhere. None = true under "
        "precision fp8 (config.RUN_FP8_GLUON): with them the Qwen3 config's FP8 step took 554.5 ms against 580.0 "
        "without (one H100, session 33), and its 300-step run with them and blockwise dense projections ended 2.80% "
        "below bf16's loss (session 34; session 28's gap with them was the spread between runs, session 29); "
        "docs/benchmarks.md. true is refused under another precision")
    fp8_gluon_store: Literal["plain", "tma"] | None = Field(
        None, description="with the Gluon row GEMMs (fp8_gluon): how they store their output tiles: tma (through "
        "shared memory by the tensor memory accelerator, under the next tile's K loop; 128-row tiles) or plain (masked "
        "stores from registers); the same bits either way. None = tma (config.RUN_FP8_GLUON_STORE): the FP8 step took "
        "478.4 ms with it against 495.5 plain on the Qwen3 config, 467.1 against 477.0 on the Mixtral one (one H100, "
        "session 35, docs/benchmarks.md); plain where fp8_gluon_block_m is 256. Refused without the Gluon row GEMMs")
    fp8_gluon_block_m: Literal[128, 256] | None = Field(
        None, description="with the Gluon row GEMMs (fp8_gluon): their rows per tile: 128, or 256 (each consumer "
        "warpgroup two 64-row waves on one weight tile: the weights read once per 256 rows; bench experts --backend "
        "triton-fp8:run-256; the epilogue then stores plainly, fp8_gluon_store: tma is refused with it). None = 128. "
        "The planner prices the run's 128-row kernels either way (bench calibrate times those). Refused without the "
        "Gluon row GEMMs")
    fp8_counters_every: PositiveInt | None = Field(
        None, description="precision fp8: the FP8 quantisers count their numerics (amax, saturated, underflow and "
        "non-finite values: a step record's fp8_* fields) on every Nth step, the first step a process runs and "
        "the last; the other steps run the quantisers' plain kernels (the counting ones took 1.5-3x their time, "
        "bench quantise; every 10th step made the Qwen3 config's FP8 step 2-6% faster on an H100, session 32) "
        "and skip the optimizer's update on a non-finite gradient norm instead (records say fp8_counted). A "
        "captured run keeps a CUDA graph for each kind of step, in one memory pool. 1: every step counts (a "
        "parity run's per-step saturation share). None = 10 in mode single; the distributed modes count every step "
        "(set there, anything but 1 is refused); set under another precision: refused")
    routing: Literal["learned", "balanced"] = Field(
        "learned", description="balanced: every expert gets the same number of tokens whatever the router "
        "scores (a benchmark setting, as other trainers' performance recipes use; labelled in every output); "
        "the routing weights stay learned")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation memory: none keeps what the backward reads; selective drops "
        "recompute_modules from the forward's saved state and recomputes them in the backward (the expert_* "
        "modules need experts_backend: triton; attention runs on any backend); full keeps of each transformer "
        "block only its input (the residual stream entering it) and its routing (the router's top-k ids and "
        "the permutation and offsets derived from them) and runs the whole block (attention and MoE FFN) again "
        "in its backward, routing as the forward did: about one more forward per step, the least activation "
        "memory (in the distributed modes an attention rank recomputes its attention half from its input, an "
        "expert rank its experts from the rows and routing it received); any experts backend, not with "
        "precision: fp8")
    recompute_modules: list[Literal["expert_input", "expert_output", "expert_swiglu", "attention"]] = Field(
        ["expert_input", "expert_output", "expert_swiglu"], description="what recompute: selective drops "
        "(recompute: none and full ignore it: full recomputes every module of every block): "
        "expert_input (the experts' grouped input rows [tokens x top_k, hidden], gathered again from the "
        "tokens: the largest activation), expert_output (their output rows, which the combine keeps for the "
        "routing weights' gradient: that comes from the backward's first GEMM instead), expert_swiglu (the "
        "SwiGLU output, recomputed from the kept gate/up values inside that GEMM), attention (the attention "
        "block keeps only its input, the residual stream before the pre-attention norm, and the output "
        "projection's input with the core's log-sum-exp: the norm, the q/k/v projections (MLA's low-rank chains "
        "and norms), qk-norm and RoPE run again in the backward, not the attention core (its backward starts "
        "from the kept output where torch picks cuDNN or flash attention); the "
        "router and the FFN norm are not in it). Under precision: fp8 the experts drop expert_input (their "
        "backward's quantiser reads the rows from the tokens) and expert_swiglu (a no-op: the FP8 experts never "
        "keep the SwiGLU output), not expert_output (no fused FP8 combine): name [expert_input, expert_swiglu]")
    offload_optimizer: bool = Field(
        False, description="keep the fp32 masters and AdamW moments in pinned host memory: each step streams "
        "them through two GPU staging buckets of offload_bucket_mib (copy in bucket i+1 and copy out bucket i-1 "
        "while bucket i updates, on side streams), the same fused AdamW as on the GPU, the bf16 parameters "
        "refreshed on the GPU and the gradients kept there; GPU memory for that state is 2 buckets instead of "
        "the whole state, paid for by host memory and the host link (PCIe / NVLink-C2C) each step. On cpu the "
        "same bucketed update runs with nothing to move (a test path: it saves nothing)")
    offload_bucket_mib: Annotated[int, Field(ge=1, le=65536)] = Field(
        256, description="offload_optimizer: MiB of masters and moments per staging bucket (two are held on "
        "the GPU; bf16 moments add one bucket's elements of fp32 scratch for the update)")
    fuse_elementwise: bool = Field(
        True, description="on CUDA, compile the norms (the FFN norm with the attention's residual add), qk-norm and "
        "RoPE with torch.compile into fused kernels (forward and backward; a few seconds of compiling at the first "
        "step); CPU runs are never compiled")
    fused_loss: bool = Field(
        True, description="on CUDA, each chunk of the LM head's logits runs its softmax, loss and gradient as one "
        "Triton pass (kernels/cross_entropy.py: 6 bytes of HBM traffic a bf16 logit) and each chunk's weight "
        "gradient is summed in fp32 by its GEMM; false: torch's five passes over an fp32 copy (44 bytes), as CPU "
        "runs always do")
    cuda_graphs: Literal["auto", "off", "on"] = Field(
        "auto", description="on: mode single on CUDA captures the whole step (every micro-batch's forward and "
        "backward, the clip and the optimizer) in one CUDA graph after 3 eager steps and replays it, with no "
        "launch gaps between kernels; modes disaggregated and colocated capture every rank's step over transport "
        "nvshmem (a graph per phase of the transport's message counts; one attention rank per pipeline group, no "
        "replicated experts: runtime/rank_graphs.py), refused elsewhere with the fix. auto: on where the captured "
        "step has been checked on a GPU (mode single, the triton or grouped_mm experts, bf16 or fp8, any "
        "recomputation, fp32 or bf16 moments, no offload), else eager, saying why at start and in the summary")
    _yaml_on_off = field_validator("cuda_graphs", mode="before")(on_off_word)
    expert_wgrad_pairs: Literal["auto", "on", "off"] = Field(
        "auto", description="triton experts: each expert weight gradient runs once per two micro-batches, over "
        "both micro-batches' rows, so its fp32 main gradient is read and written half as often (8 bytes per expert "
        "parameter per micro-batch: the launches' bound at many micro-batches); one micro-batch's expert rows (x, dy, "
        "act, d h13) per MoE layer wait in memory meanwhile, counted by the memory check (kernels/wgrad_pairs.py). "
        "Every mode: in the distributed ones each expert rank pairs its own launches, the last ones running before "
        "its optimizer step. auto: on where it applies (experts_backend triton, 2+ micro-batches, fp32 master "
        "weights, weight gradients not in FP8) and the devices fit the waiting rows (the fullest one, distributed), "
        "else off, said at start; on: where it applies (refused elsewhere); off: a launch per micro-batch")
    _yaml_pairs_on_off = field_validator("expert_wgrad_pairs", mode="before")(on_off_word)

    forbid_host_syncs: bool = Field(
        False, description="debug: run each step's compute under torch.cuda.set_sync_debug_mode('error'), so "
        "any host wait on the GPU inside a step (a .item(), .tolist(), .cpu(), a transport's host poll) raises; "
        "the step's one read of its losses and metrics at the end is outside it (CUDA only)")
    cpu_threads: Dim | None = Field(
        None, description="torch intra-op threads for CPU training; None keeps torch's default"
    )
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] = Field(  # torch's range; numpy's SeedSequence takes no negative
        0, description="seed of the parameters' initialisation and, unless data.seed is set, of the data order (the "
        "same in every layout)")
    steps: PositiveInt = Field(100, description="optimizer steps of the run")
    batch_size: Dim = Field(8, description="sequences per step (global)")
    seq_len: Dim = Field(128, description="tokens per sequence")
    micro_batches: Dim | Literal["auto"] = Field(
        1, description="slices of each step's batch, each through the whole model (pipelined over the ranks); "
        "gradients accumulate over them. auto = the split the roofline prices fastest among those the memory "
        "model fits in 85% of the device (fewer, larger micro-batches cut the expert weight gradients' fp32 "
        "traffic), printed at start")
    attention_ranks: GpuCount = Field(
        1, description="disaggregated: attention ranks in all, split evenly over the pipeline groups")
    expert_ranks: GpuCount = Field(
        1, description="disaggregated: expert ranks in all, split evenly over the pipeline groups")
    pipeline_groups: GpuCount = Field(
        1, description="disaggregated and colocated: pipeline groups p; group g owns layers g, g + p, g + 2p, ...")
    colocated_ranks: GpuCount = Field(2, description="colocated: ranks in all, each with attention and its share of "
                                      "its group's experts, split evenly over the pipeline groups")
    expert_replica_sets: GpuCount = Field(
        1, description="disaggregated and colocated: per pipeline group, sets of its expert ranks (colocated: EP "
        "blocks of its ranks, the expert-parallel degree colocated_ranks / pipeline_groups / expert_replica_sets) each "
        "holding every expert once (set c: the group's ranks c, c + sets, ...); the attention rank of data-parallel "
        "index d sends its tokens to set d mod sets only (colocated: its own block) and the sets sum their experts' "
        "gradients (a plan's expert_replica_sets and expert map replace it). Under a router's auxiliary loss, whose "
        "load fraction is the micro-batch's over all data-parallel ranks, the sets also swap their loads "
        "(`RouterConfig.needs_every_source_load`)")
    plan: str | Plan | None = Field(
        None, description="a `disagmoe plan --out` file (or an inline plan): its layout and expert map "
        "replace mode, attention_ranks, expert_ranks, pipeline_groups, expert_replica_sets, micro_batches, "
        "colocated_ranks, and "
        "the settings it was priced with: recompute, recompute_modules, optim.state_dtype, optim.update_kernel, "
        "and where it priced them offload_optimizer, optim.shard_states, and precision: fp8 with fp8_dense and "
        "fp8_dense_scaling (`runtime.plan_layout.apply_plan`)"
    )
    data: DataConfig = Field(default_factory=DataConfig, description="where training tokens come from")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="AdamW and its learning-rate schedule")
    eval_every: NonNegInt = Field(25, description="validation every N steps; 0 disables")
    eval_batches: Dim = Field(2, description="validation batches per evaluation")
    out_dir: str = Field(
        "runs/default", description="metrics.jsonl, trace.json and checkpoints go here (one run at a time)")
    checkpoint_every: NonNegInt = Field(0, description="checkpoint every N steps (0: only by time and at the end)")
    checkpoint_minutes: NonNegFloat = Field(
        30.0, description="also checkpoint once this many minutes passed since the last one (0: never by time)")
    checkpoint_at_end: bool = Field(
        True, description="checkpoint after the last step (benchmarks turn it off: a big model's checkpoint "
        "takes tens of GB and minutes)")
    keep_checkpoints: NonNegInt = Field(
        3, description="complete checkpoints kept; older ones are deleted once a newer one is sealed (0: keep all)")
    resume: bool = Field(False, description="continue from out_dir's latest checkpoint")
    trace: bool = Field(
        True, description="distributed modes: write trace.json, every rank's op spans of the first 100 steps "
        "(open in Perfetto)")
    recv_timeout_s: Annotated[float, Field(gt=0, le=7 * 86400)] = Field(
        120.0, description="seconds a receive (or one op) may wait for a peer before that peer counts as hung")
    ray_address: str | None = Field(None, description="None starts an embedded local cluster")
    ray_connect_timeout_s: Annotated[float, Field(gt=0, le=3600)] = Field(
        10.0, description="joining a cluster (ray_address HOST:PORT): fail in one line if it does not answer this fast")
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = Field(
        0, description="distributed modes: when a rank dies or hangs, tear the actors down, start new ones and "
        "resume from the newest complete checkpoint (from the start without one), at most this many times per "
        "run (0: the first failure ends the run, like Ray Train's FailureConfig)")
    fault_injection: FaultInjection | None = Field(
        None, description="tests: kill a rank's actor process during a step, once per run (distributed modes)")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables for every worker (per host)"
    )

    @property
    def compute_dtype_name(self) -> str:
        """'bf16' or 'fp32': the parameters' dtype, `precision` with auto resolved by the device (fp8
        keeps bf16 parameters: only GEMMs run in FP8, `expert_precision` and `dense_precision`)."""
        if self.precision == "auto":
            return "bf16" if self.device == "cuda" else "fp32"
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def data_seed(self) -> int:
        """The data order's seed: `data.seed`, or the run's `seed` where it is not set."""
        return self.seed if self.data.seed is None else self.data.seed

    @property
    def expert_precision(self) -> str:
        """'fp8' where the routed experts' GEMMs run in FP8, else the parameters' dtype name."""
        return "fp8" if self.precision == "fp8" else self.compute_dtype_name

    @property
    def expert_backward_precision(self) -> str | None:
        """Under FP8 experts, which of their backward GEMMs run in FP8 (`fp8_expert_backward`, None =
        `DEFAULT_FP8_EXPERT_BACKWARD`); None where the experts are not FP8."""
        if self.expert_precision != "fp8":
            return None
        return self.fp8_expert_backward or DEFAULT_FP8_EXPERT_BACKWARD

    @property
    def expert_forward_precision(self) -> str | None:
        """Under FP8 experts, which of their two forward GEMMs run in FP8 (`fp8_expert_forward`, None =
        `RUN_FP8_EXPERT_FORWARD`); None where the experts are not FP8."""
        if self.expert_precision != "fp8":
            return None
        return self.fp8_expert_forward or RUN_FP8_EXPERT_FORWARD

    @property
    def counters_every(self) -> int:
        """Every how many steps the FP8 quantisers count (`fp8_counters_every`, None = `FP8_COUNTERS_EVERY`
        in mode single under precision fp8; the distributed modes count every step; 1 without FP8, where
        every step is of one kind: one captured graph)."""
        if self.mode != "single" or self.precision != "fp8":
            return 1
        return self.fp8_counters_every or FP8_COUNTERS_EVERY

    @property
    def dense_precision(self) -> str:
        """'fp8' where the dense projections' GEMMs run in FP8 (precision fp8 with `fp8_dense`, None =
        `RUN_FP8_DENSE`), else the parameters' dtype name."""
        dense = RUN_FP8_DENSE if self.fp8_dense is None else self.fp8_dense
        return "fp8" if self.precision == "fp8" and dense else self.compute_dtype_name

    @property
    def dense_fp8_scaling(self) -> str | None:
        """How the dense projections' FP8 GEMMs scale their operands (`fp8_dense_scaling`, unset:
        `FP8_DENSE_SCALING`); None where they run in bf16."""
        if self.dense_precision != "fp8":
            return None
        return self.fp8_dense_scaling or FP8_DENSE_SCALING

    @property
    def dense_recipe(self) -> str:
        """The dense projections' GEMMs in a word or two: 'fp8 blockwise' / 'fp8 rowwise'
        (`dense_fp8_scaling`), else their dtype (`dense_precision`), as a run's summary and bench
        rows name what ran."""
        scaling = self.dense_fp8_scaling
        return f"fp8 {scaling}" if scaling is not None else self.dense_precision

    @property
    def expert_gluon(self) -> bool:
        """Whether the FP8 experts ask for their row and split SwiGLU GEMMs in the Gluon kernels
        (`fp8_gluon`, None = `RUN_FP8_GLUON`; the Triton ones run where Gluon cannot); False where the
        experts are not FP8."""
        if self.expert_precision != "fp8":
            return False
        return RUN_FP8_GLUON if self.fp8_gluon is None else self.fp8_gluon

    @property
    def expert_gluon_tma_store(self) -> bool:
        """Whether the FP8 experts' Gluon row GEMMs store their tiles by TMA (`fp8_gluon_store`, None =
        `RUN_FP8_GLUON_STORE`, plain at 256-row tiles); False where they do not run (`expert_gluon`)."""
        default = "plain" if self.fp8_gluon_block_m == 256 else RUN_FP8_GLUON_STORE
        return self.expert_gluon and (self.fp8_gluon_store or default) == "tma"

    @property
    def expert_gluon_block_m(self) -> int | None:
        """The FP8 experts' Gluon row GEMMs' rows per tile (`fp8_gluon_block_m`, None = 128); None where they do
        not run (`expert_gluon`)."""
        return (self.fp8_gluon_block_m or 128) if self.expert_gluon else None

    @property
    def steps_reference_adamw(self) -> bool:
        """fp32 parameters with fp32 moments on the device: mode single steps torch's own AdamW (the
        oracle's optimizer), not the flat fused one."""
        return self.compute_dtype_name == "fp32" and self.optim.state_dtype == "fp32" and not self.offload_optimizer

    @property
    def expert_wgrad_pairs_unavailable(self) -> str | None:
        """Why the expert weight gradients cannot run over pairs of micro-batches here
        (`expert_wgrad_pairs`, `kernels.wgrad_pairs`), None where they can; the micro-batch count aside
        (one micro-batch leaves nothing to pair: `pairs_expert_wgrads`)."""
        if self.experts_backend != "triton":
            return f"experts_backend {self.experts_backend}: only the triton experts' GEMMs add into main gradients"
        if self.mode == "single" and self.steps_reference_adamw:  # a rank's FlatAdamW always has main gradients
            return "precision fp32 with fp32 moments steps torch's AdamW on autograd's gradients (no main gradients)"
        return None

    @property
    def runs_fused_loss(self) -> bool:
        """Whether the LM head's loss runs fused (`model.loss`: on CUDA unless `fused_loss: false`)."""
        return self.fused_loss and self.device == "cuda"

    @property
    def pairs_expert_wgrads(self) -> bool:
        """Whether this run's expert weight gradients run over pairs of micro-batches: `expert_wgrad_pairs`
        auto or on, where it applies, with 2+ micro-batches (auto is resolved against the device's memory
        by the single trainer, `runtime.training.single_memory.resolve_wgrad_pairs`, which writes on or off)."""
        return (self.expert_wgrad_pairs != "off" and self.expert_wgrad_pairs_unavailable is None
                and self.micro_batches != "auto" and self.micro_batches >= 2)

    @property
    def offloads_to_host(self) -> bool:
        """offload_optimizer on a GPU: the masters and moments live in host memory (the memory model
        counts them there). On cpu the bucketed update runs but nothing leaves the device's memory."""
        return self.offload_optimizer and self.device == "cuda"

    @property
    def offload_bucket_bytes(self) -> int:
        return self.offload_bucket_mib * 2**20

    @property
    def recompute_set(self) -> frozenset[str]:
        """The modules the backward recomputes (empty under recompute: none; under full the whole
        block, `kernels.recompute.BLOCK`, whatever recompute_modules says)."""
        if self.recompute == "full":
            return frozenset({"block"})
        return frozenset(self.recompute_modules) if self.recompute == "selective" else frozenset()

    @model_validator(mode="after")
    def _batch(self) -> TrainConfig:
        if self.micro_batches != "auto" and self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of micro_batches={self.micro_batches}"
            )
        if self.expert_wgrad_pairs == "on" and self.expert_wgrad_pairs_unavailable is not None:
            raise ValueError(f"expert_wgrad_pairs: on does not apply here: {self.expert_wgrad_pairs_unavailable}; "
                             "set expert_wgrad_pairs: auto (on where it applies) or off")
        if self.hop == "pair_rows" and self.transport == "nccl":
            raise ValueError("hop: pair_rows needs transport: nvshmem (the expert kernel stores rows straight into "
                             "the attention GPU's memory); over nccl use hop: partial_sums (or auto)")
        if self.hop == "pair_rows" and self.transport == "nvshmem" and self.experts_backend != "triton":
            raise ValueError("hop: pair_rows over nvshmem needs experts_backend: triton (its down GEMM stores the "
                             "rows); set experts_backend: triton or hop: partial_sums")
        if self.ranks_per_gpu > 1 and self.mode != "single":
            if self.device != "cuda":
                raise ValueError(f"ranks_per_gpu={self.ranks_per_gpu} shares GPUs between ranks: it needs device: cuda "
                                 "(CPU ranks share the host already; set ranks_per_gpu: 1)")
            if self.transport != "nvshmem":
                raise ValueError(f"ranks_per_gpu={self.ranks_per_gpu} with transport: {self.transport}: NCCL refuses two "
                                 "ranks on one GPU ('Duplicate GPU detected'); use transport: nvshmem (several "
                                 "processes per GPU), or ranks_per_gpu: 1 with one GPU per rank")
        experts_dropped = sorted(set(self.recompute_modules) - {"attention"})
        if self.recompute == "selective" and experts_dropped and self.experts_backend != "triton":
            raise ValueError(f"recompute: selective with {', '.join(experts_dropped)} drops the triton experts' saved "
                             f"rows; the {self.experts_backend} backend keeps what torch autograd saves: set "
                             "experts_backend: triton, recompute_modules: [attention] (any backend), or recompute: none")
        if len(set(self.recompute_modules)) != len(self.recompute_modules):
            raise ValueError(f"recompute_modules {self.recompute_modules} names a module twice; name each once")
        if self.recompute == "selective" and not self.recompute_modules:
            raise ValueError("recompute: selective with recompute_modules: [] drops nothing; name what to drop "
                             "(expert_input, expert_swiglu) or set recompute: none")
        if self.forbid_host_syncs and self.device == "cuda" and self.experts_backend == "loop":
            raise ValueError("forbid_host_syncs with experts_backend: loop: the loop backend (the reference) reads "
                             "each expert's row offsets on the host, a wait the sync check refuses in every step; "
                             "set experts_backend: grouped_mm or triton")
        if self.fp8_dense and self.precision != "fp8":
            raise ValueError(f"fp8_dense: true runs the dense projections in FP8 under precision: fp8; this run is "
                             f"precision: {self.precision}: set precision: fp8 or remove fp8_dense")
        if self.fp8_dense_scaling is not None and self.dense_precision != "fp8":
            raise ValueError(f"fp8_dense_scaling: {self.fp8_dense_scaling} scales the dense projections' FP8 GEMMs, "
                             "which this run keeps in bf16: set precision: fp8 (with fp8_dense unset or true), or "
                             "remove fp8_dense_scaling")
        if self.fp8_expert_backward is not None and self.precision != "fp8":
            raise ValueError(f"fp8_expert_backward chooses the FP8 experts' backward precision under "
                             f"precision: fp8; this run is precision: {self.precision}: set precision: fp8 or remove "
                             f"fp8_expert_backward")
        if self.fp8_expert_forward is not None and self.precision != "fp8":
            raise ValueError(f"fp8_expert_forward chooses the FP8 experts' forward GEMMs under precision: fp8; this run "
                             f"is precision: {self.precision}: set precision: fp8 or remove fp8_expert_forward")
        if self.fp8_gluon_store is not None and not self.expert_gluon:
            raise ValueError(f"fp8_gluon_store: {self.fp8_gluon_store} chooses how the FP8 experts' Gluon row GEMMs "
                             "store their tiles; this run has none (precision fp8 with fp8_gluon unset or true runs "
                             "them): remove fp8_gluon_store")
        if self.fp8_gluon_block_m is not None and not self.expert_gluon:
            raise ValueError(f"fp8_gluon_block_m: {self.fp8_gluon_block_m} sets the FP8 experts' Gluon row GEMMs' "
                             "tiles; this run has none (precision fp8 with fp8_gluon unset or true runs them): remove "
                             "fp8_gluon_block_m")
        if self.fp8_gluon_block_m == 256 and self.fp8_gluon_store == "tma":
            raise ValueError("fp8_gluon_block_m: 256 stores its tiles plainly (the TMA store takes 128-row tiles): "
                             "set fp8_gluon_store: plain, or fp8_gluon_block_m: 128")
        if self.fp8_gluon and self.precision != "fp8":
            raise ValueError(f"fp8_gluon: true runs the FP8 experts' GEMMs in the Gluon kernels; this run is "
                             f"precision: {self.precision}: set precision: fp8 or remove fp8_gluon")
        if self.fp8_counters_every is not None and self.precision != "fp8":
            raise ValueError(f"fp8_counters_every={self.fp8_counters_every} spaces out the FP8 quantisers' counters "
                             f"under precision: fp8; this run is precision: {self.precision}: set precision: fp8 or "
                             "remove fp8_counters_every")
        if (self.fp8_counters_every or 1) > 1 and self.mode != "single":
            raise ValueError(f"fp8_counters_every={self.fp8_counters_every} is built for mode: single so far; the "
                             f"{self.mode} ranks count on every step (their counters are summed over ranks with "
                             "the gradient norm; a plan or bench train's --mode may have chosen the mode): set "
                             "fp8_counters_every: 1 (or leave it unset), or mode: single")
        if self.fp8_emulate and self.precision != "fp8":
            raise ValueError(f"fp8_emulate: true emulates the FP8 GEMMs of precision: fp8; this run is precision: "
                             f"{self.precision}: set precision: fp8 or remove fp8_emulate")
        if self.fp8_emulate and self.expert_backward_precision != "bf16":
            backward = self.expert_backward_precision
            raise ValueError(f"fp8_emulate: true emulates the routed experts' forward GEMMs and the dense projections; "
                             f"the experts' FP8 backward kernels (fp8_expert_backward: {backward}) are not emulated: "
                             "set fp8_expert_backward: bf16 (or remove fp8_emulate)")
        if self.precision == "fp8":
            needs = [why for bad, why in (
                (self.device != "cuda", "device: cuda (FP8 tensor cores; the CPU runs the kernels only in their tests)"),
                (self.experts_backend != "triton", "experts_backend: triton (the FP8 expert kernels)"),
                (self.recompute == "selective" and "expert_output" in experts_dropped,
                 f"recompute_modules without expert_output, e.g. {FP8_SELECTIVE} (the FP8 experts have no fused "
                 "combine: the combine keeps their output rows for the routing weights' gradient)"),
                (self.recompute == "full",
                 f"recompute: none or selective with recompute_modules such as {FP8_SELECTIVE} (under full the "
                 "recomputed forward would quantise every block's operands again, counting them twice in the FP8 "
                 "statistics)"),
            ) if bad]
            if needs:
                raise ValueError(f"precision: fp8 needs {'; '.join(needs)}; or set precision: bf16")
            if self.mode != "single" and self.hop == "pair_rows":
                raise ValueError("precision: fp8 with hop: pair_rows is not built: the pair-row return's kernel fuses "
                                 "the down GEMM with the peer stores in bf16 (kernels/fused_return.py); use hop: "
                                 "partial_sums (or auto, which takes partial sums under fp8), or precision: bf16")
        if self.cuda_graphs == "on" and self.device != "cuda":
            raise ValueError(f"cuda_graphs: on captures steps on a GPU; this run is mode {self.mode} on {self.device}: "
                             "set device: cuda (or cuda_graphs: off)")
        if self.cuda_graphs == "on" and self.mode != "single" and self.transport != "nvshmem":
            raise ValueError(f"cuda_graphs: on captures a {self.mode} rank's step only over transport nvshmem (its "
                             f"puts and flag waits run on the stream); transport {self.transport} posts every message "
                             "from the host: set transport: nvshmem (or cuda_graphs: off)")
        if self.cuda_graphs == "on" and self.experts_backend == "loop":
            raise ValueError("cuda_graphs: on with experts_backend: loop: the loop reads each expert's row count on "
                             "the host, which a captured step cannot; set experts_backend: triton (or grouped_mm), "
                             "or cuda_graphs: off")
        if self.offload_optimizer and self.cuda_graphs == "on":
            raise ValueError("offload_optimizer with cuda_graphs: on: the offloaded step's copy streams have not been "
                             "captured in a graph yet; set cuda_graphs: off (or offload_optimizer: false)")
        if self.mode == "colocated" and self.colocated_ranks % self.pipeline_groups:
            raise ValueError(f"colocated_ranks={self.colocated_ranks} does not split evenly over pipeline_groups="
                             f"{self.pipeline_groups} (every group needs the same data-parallel width, at least one "
                             "rank); make colocated_ranks a multiple of pipeline_groups or lower pipeline_groups")
        self._check_replica_sets()
        if self.fault_injection is not None and self.mode == "single":
            raise ValueError("fault_injection kills a Ray actor: it needs mode disaggregated or colocated "
                             "(or remove fault_injection)")
        return self

    def _check_replica_sets(self) -> None:
        """ValueError where a pipeline group's expert ranks do not split into `expert_replica_sets`
        sets of equal size (the ranks of each group: colocated_ranks or expert_ranks over pipeline_groups)."""
        sets, p = self.expert_replica_sets, self.pipeline_groups
        if sets == 1 or self.mode == "single":
            return
        name, ranks = (("colocated_ranks", self.colocated_ranks) if self.mode == "colocated"
                       else ("expert_ranks", self.expert_ranks))
        if ranks % p or (ranks // p) % sets:
            raise ValueError(f"expert_replica_sets={sets} splits each pipeline group's expert ranks into {sets} sets of "
                             f"equal size, which {name}={ranks} over pipeline_groups={p} does not; make {name} a "
                             f"multiple of pipeline_groups x expert_replica_sets ({p * sets}) or lower "
                             "expert_replica_sets")


def priced_as_trained(cfg: TrainConfig) -> dict[str, Any]:
    """The `PlanConfig` fields that price `cfg` as it trains: its optimizer (ZeRO-1, the moments'
    dtype, the update kernel, the clip), its routed experts' precision (fp8, else bf16: the planner
    prices no fp32), `fp8_dense` (its dense projections in FP8: `dense_precision`) and their
    scaling (`dense_fp8_scaling`; the default where they run in bf16, where it prices nothing), its
    recomputation (selective: its modules), its experts backend, `cuda_graphs` (its rank steps'
    rings) and `fused_loss`. Every request made for a run (`bench.placement.plan_request`,
    `placement.trace_compare.run_request`) passes them; each decides the offload itself."""
    return {"shard_optimizer_states": cfg.optim.shard_states, "optimizer_state_dtype": cfg.optim.state_dtype,
            "optimizer_update_kernel": cfg.optim.update_kernel, "clip_gradients": cfg.optim.grad_clip > 0,
            "expert_precision": "fp8" if cfg.expert_precision == "fp8" else "bf16",
            "fp8_dense": cfg.dense_precision == "fp8", "fp8_dense_scaling": cfg.dense_fp8_scaling or FP8_DENSE_SCALING,
            "recompute": cfg.recompute,
            "fp8_expert_backward": cfg.fp8_expert_backward or DEFAULT_FP8_EXPERT_BACKWARD,
            "fp8_expert_forward": cfg.fp8_expert_forward or RUN_FP8_EXPERT_FORWARD,
            "recompute_modules": list(cfg.recompute_modules) if cfg.recompute == "selective" else None,
            "experts_backend": cfg.experts_backend, "cuda_graphs": cfg.cuda_graphs,
            "fused_loss": cfg.runs_fused_loss,
            "expert_wgrad_pairs": "off" if cfg.expert_wgrad_pairs_unavailable else cfg.expert_wgrad_pairs}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

T = TypeVar("T", bound=BaseModel)


def memory_knob_changes(cfg: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """(label, `cfg` with it) for each memory knob `cfg` does not use yet and its other settings
    accept (each change validated: full recomputation is refused with fp8 experts, selective's
    expert modules with experts other than triton): recompute selective (under precision fp8 with
    the modules the FP8 experts drop, `FP8_SELECTIVE`) and full, bf16 moments, the offloaded
    optimizer, the expert weight gradients a micro-batch at a time (`expert_wgrad_pairs: off`, where they
    pair). The memory refusals and the out-of-memory hint name these."""
    changes: list[tuple[str, dict[str, Any]]] = []
    if cfg.recompute == "none" and cfg.precision == "fp8":
        changes.append((f"recompute: selective with recompute_modules: {FP8_SELECTIVE}",
                        {"recompute": "selective", "recompute_modules": list(FP8_SELECTIVE_MODULES)}))
    elif cfg.recompute == "none":
        changes.append(("recompute: selective", {"recompute": "selective"}))
    if cfg.recompute != "full":
        changes.append(("recompute: full", {"recompute": "full"}))
    if cfg.optim.state_dtype == "fp32":
        changes.append(("optim.state_dtype: bf16", {"optim": {**cfg.optim.model_dump(), "state_dtype": "bf16"}}))
    if not cfg.offload_optimizer:
        changes.append(("offload_optimizer: true", {"offload_optimizer": True}))
    if cfg.pairs_expert_wgrads:
        changes.append(("expert_wgrad_pairs: off", {"expert_wgrad_pairs": "off"}))
    accepted = []
    for label, change in changes:
        try:
            accepted.append((label, TrainConfig.model_validate({**cfg.model_dump(exclude_unset=True), **change})))
        except ValueError:
            continue
    return accepted


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `source: key.path: message`."""
    lines = []
    errors = err.errors()
    # a number-or-word field (`micro_batches: 4 | auto`): pydantic reports each member of the union;
    # say the number's problem once, at the field, and that the word was the other choice
    words = {e["loc"][:-1]: e["ctx"]["expected"] for e in errors
             if e["loc"] and str(e["loc"][-1]).startswith("literal[") and e["type"] == "literal_error"}
    for e in errors:
        loc = e["loc"]
        if loc and str(loc[-1]).startswith("literal[") and loc[:-1] in words:
            continue
        if loc and loc[:-1] in words and loc[-1] in ("constrained-int", "int"):
            loc = loc[:-1]
            e = {**e, "msg": f"{e['msg']} (or {words[loc]})"}
        where = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `disagmoe config schema` lists the valid keys)"
        elif e["type"] in ("less_than_equal", "less_than"):
            limit = e.get("ctx", {}).get("le", e.get("ctx", {}).get("lt"))
            if isinstance(limit, (int, float)) and limit >= MAX_GPUS:  # a sanity bound (top of the file)
                bound = f"{int(limit):,}" if float(limit).is_integer() else str(limit)
                msg = f"{e['input']!r} is too large: at most {bound} (a bound far above any real job; check the value)"
                if loc != e["loc"]:
                    msg += f" (or {words[loc]})"
        lines.append(f"{source}: {where}: {msg}")
    return "; ".join(lines)


def validate(cls: type[T], data: Any, source: str) -> T:
    """Build a config, turning pydantic's error into a one-line ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of keys, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ValueError(format_validation_error(err, source)) from None


class DuplicateKey(Exception):
    """A mapping that names one key twice (YAML and JSON parsers keep the last one silently)."""

    def __init__(self, key: object, line: int | None, first_line: int | None = None) -> None:
        where = "" if line is None else f" at line {line}" + ("" if first_line is None else f" (first at line {first_line})")
        super().__init__(f"key {key!r} appears twice{where}; keep one")


class StrictYamlLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # SafeLoader's own error follows
            if key in seen:
                raise DuplicateKey(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook refusing duplicate keys."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key, None)
        out[key] = value
    return out


def load_yaml(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys (`DuplicateKey`)."""
    return yaml.load(text, Loader=StrictYamlLoader)  # noqa: S506 (a SafeLoader subclass)


def write_text_file(out: Path, text: str, flag: str = "--out") -> None:
    """Write `text` to `out` through a temporary file renamed into place (no half-written file
    is ever seen, none is left behind); a directory or an unwritable place is a ValueError naming
    `flag` and the fix."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if out.is_dir():
            raise ValueError(f"{flag} {out} is a directory; give a file name inside it")
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # e.g. a name too long: nothing was written
        raise ValueError(f"{flag} {out}: cannot write it ({err.strerror or err}); choose another file") from None


def read_mapping(path: Path, setting: str = "input", max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict, or a ValueError naming `setting` and the file: not a
    regular file, over `max_bytes`, not UTF-8, not valid, a key twice, nested past `MAX_DEPTH`
    (`safe_io`), or not a mapping at the top."""
    path = Path(path)
    text = read_input_text(path, setting, max_bytes)
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs) if kind == "JSON" else load_yaml(text)
    except DuplicateKey as err:
        raise ValueError(f"{path}: {err}") from None
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{path} is not valid {kind}: {err}") from None
    except RecursionError:
        raise ValueError(f"{setting} {path}: lists and mappings nested deeper than the {kind} parser can "
                         f"follow; no input of disagmoe nests so deep") from None
    check_depth(data, f"{setting} {path}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of keys at the top level")
    return data


def preset_names(kind: Literal["models", "hardware"]) -> list[str]:
    return sorted(p.stem for p in (PRESETS_DIR / kind).glob("*.yaml"))


def load_preset_or_file(ref: str, kind: Literal["models", "hardware"]) -> tuple[dict[str, Any], str]:
    preset = PRESETS_DIR / kind / f"{ref}.yaml"
    if "/" not in ref and preset.is_file():
        return read_mapping(preset), f"preset {ref!r}"
    path = Path(ref)
    setting = "model" if kind == "models" else "hardware"
    if path.suffix in {".yaml", ".yml", ".json"} or path.exists():
        return read_mapping(path, setting), str(path)
    noun = "model" if kind == "models" else "hardware"
    raise ValueError(
        f"unknown {noun} preset {ref!r}; valid names: {', '.join(preset_names(kind))} "
        f"(or pass a path to a YAML file{' or a Hugging Face config.json' if kind == 'models' else ''})"
    )


def load_hardware(ref: str | HardwareConfig) -> HardwareConfig:
    """A preset name or a YAML file."""
    if isinstance(ref, HardwareConfig):
        return ref
    data, source = load_preset_or_file(ref, "hardware")
    return validate(HardwareConfig, data, source)


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """A training YAML, with `key.sub=value` overrides (values parsed as YAML scalars)."""
    path = Path(path)
    data = apply_overrides(read_mapping(path, "--config"), overrides)
    return validate(TrainConfig, data, str(path))


def apply_overrides(data: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """`data` (a config's mapping) with `key.sub=value` overrides set in place (values parsed as
    YAML scalars); ValueError naming an override that is not key=value or not valid YAML."""
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-3)")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = load_yaml(raw)
        except (DuplicateKey, yaml.YAMLError, RecursionError) as err:
            raise ValueError(f"override {item!r}: the value is not valid YAML ({err or 'nested too deep'})") from None
        check_depth(node[parts[-1]], f"override {key}")
    return data
