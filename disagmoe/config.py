"""Typed configuration: model, hardware, cluster, plan request, plan result and training run.

Every model rejects unknown keys (`extra="forbid"`) so a typo in a YAML file is an error, not a
silently ignored setting. Presets live as YAML data in `disagmoe/presets/`; `load_model` and
`load_hardware` accept a preset name, a YAML file or (for models) a Hugging Face `config.json`.

This module imports no torch, ray or matplotlib: `disagmoe plan` must answer fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PRESETS_DIR = Path(__file__).parent / "presets"

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


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
    original_max_position_embeddings: PositiveInt = Field(description="the pre-training context length")
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: NonNegFloat | None = None
    mscale_all_dim: NonNegFloat | None = None
    attention_factor: PositiveFloat | None = Field(
        None, description="cos/sin multiplier; by default from factor, mscale and mscale_all_dim")
    truncate: bool = Field(True, description="round the ramp's bounds to whole dimensions")


class MLAConfig(StrictModel):
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv, decoupled RoPE dims."""

    q_lora_rank: PositiveInt | None = Field(
        None, description="rank of the q down-projection; None projects q directly from hidden"
    )
    kv_lora_rank: PositiveInt = Field(description="rank of the compressed kv latent")
    qk_nope_head_dim: PositiveInt = Field(description="per-head q/k dims without RoPE")
    qk_rope_head_dim: PositiveInt = Field(description="per-head q/k dims carrying RoPE (k shared)")
    v_head_dim: PositiveInt = Field(description="per-head value dims")


class RouterConfig(StrictModel):
    """How tokens pick experts, and how the load is kept balanced."""

    score: Literal["softmax", "sigmoid"] = "softmax"
    normalize_topk: bool = Field(True, description="renormalise the k chosen weights to sum to 1")
    num_groups: PositiveInt = Field(1, description="expert groups for group-limited top-k")
    topk_groups: PositiveInt = Field(1, description="groups a token may route into")
    routed_scaling: PositiveFloat = Field(1.0, description="multiplier on the routed output")
    aux_loss_coef: NonNegFloat = Field(0.0, description="switch-style load-balancing loss weight")
    z_loss_coef: NonNegFloat = Field(0.0, description="router z-loss weight")
    bias_balancing: bool = Field(False, description="auxiliary-loss-free balancing via a bias")
    bias_update_rate: NonNegFloat = Field(1e-3, description="bias step per optimizer step")

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

    name: str = "custom"
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_dense_layers: NonNegInt = Field(0, description="leading layers with a dense FFN")
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    attention: Literal["gqa", "mla"] = "gqa"
    mla: MLAConfig | None = None
    qk_norm: bool = Field(False, description="RMSNorm on q and k per head (Qwen3)")
    dense_ffn_size: NonNegInt = Field(0, description="FFN width of the leading dense layers")
    num_experts: PositiveInt
    top_k: PositiveInt
    expert_ffn_size: PositiveInt
    num_shared_experts: NonNegInt = 0
    shared_expert_ffn_size: NonNegInt | None = Field(
        None, description="width of each shared expert; defaults to expert_ffn_size"
    )
    seq_len: PositiveInt = Field(4096, description="training sequence length")
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScalingConfig | None = Field(None, description="YaRN context extension (None: plain RoPE)")
    norm_eps: PositiveFloat = 1e-6
    tie_embeddings: bool = False
    router: RouterConfig = Field(default_factory=RouterConfig)

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


class HardwareConfig(StrictModel):
    """One GPU model and the fabric around it. Bandwidths are GB/s (1e9 B/s) per GPU."""

    name: str = "custom"
    bf16_tflops: PositiveFloat = Field(description="dense bf16 tensor-core peak, TFLOP/s")
    fp8_tflops: PositiveFloat = Field(description="dense fp8 tensor-core peak, TFLOP/s")
    hbm_gbps: PositiveFloat = Field(description="HBM bandwidth, GB/s")
    hbm_gib: PositiveFloat = Field(description="usable HBM capacity, GiB")
    nvlink_gbps: PositiveFloat = Field(description="NVLink bandwidth per GPU per direction, GB/s")
    nvlink_domain: PositiveInt = Field(description="GPUs sharing one NVLink domain (8 HGX, 72 NVL72)")
    scaleout_gbps: PositiveFloat = Field(description="scale-out (IB/RoCE) per GPU per direction, GB/s")
    nvlink_latency_us: NonNegFloat = Field(
        9.0, description="one-sided put over NVLink, fixed cost per message, us")
    scaleout_latency_us: NonNegFloat = Field(
        15.0, description="one-sided put over the scale-out network, fixed cost per message, us")
    collective_latency_us: NonNegFloat = Field(
        120.0, description="fixed cost of one NCCL collective call (all-to-all, all-reduce), us")
    efficiency: Efficiency = Field(default_factory=Efficiency)


class ClusterConfig(StrictModel):
    """The GPUs a job gets: how many, of which kind."""

    hardware: HardwareConfig
    num_gpus: PositiveInt


# ----------------------------------------------------------------------------------------------
# Placement request and result
# ----------------------------------------------------------------------------------------------


class PlanConfig(StrictModel):
    """What `disagmoe plan` is asked: place this model on this cluster for this batch."""

    model: ModelConfig
    cluster: ClusterConfig
    seq_len: PositiveInt
    global_batch_tokens: PositiveInt = 4 * 1024 * 1024
    max_pipeline_groups: PositiveInt = 8
    micro_batch_choices: list[PositiveInt] = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_expert_replicas: NonNegInt = Field(
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


class StageTime(StrictModel):
    """A stage's predicted time for one step on the GPUs that run it, and what binds it."""

    name: str
    time_s: NonNegFloat
    group: str = Field(description="who runs it: attention, expert or link")
    bound: str = Field(description="binding ceiling: compute, hbm, nvlink, scale-out or latency")


class MemoryEstimate(StrictModel):
    """Memory per GPU in GiB, split by what it holds."""

    weights_gib: NonNegFloat
    grads_gib: NonNegFloat
    optimizer_gib: NonNegFloat
    activations_gib: NonNegFloat
    total_gib: NonNegFloat
    capacity_gib: NonNegFloat


class Plan(StrictModel):
    """The placement result: what `plan --json` prints and `train` reads (DESIGN section 3b)."""

    model: str
    hardware: str
    gpus: PositiveInt
    seq_len: PositiveInt
    global_batch_tokens: PositiveInt
    layout: Literal["disaggregated", "colocated", "single"] | None = Field(
        description="the chosen layout (single: one GPU runs everything, no transfers); None when no layout "
        "fits (feasible is false)")
    attention_gpus: NonNegInt
    expert_gpus: NonNegInt
    pipeline_groups: PositiveInt
    micro_batches: PositiveInt
    idle_gpus: NonNegInt = Field(
        0, description="GPUs the plan leaves idle: gpus mod p, or all but a smaller layout that is faster")
    expert_replica_sets: NonNegInt = Field(
        description="per pipeline group: sets of expert GPUs each holding every expert once")
    sequences_per_micro_batch: NonNegInt = Field(description="sequences per micro-batch, all DP ranks")
    accumulation_rounds: NonNegInt = Field(description="rounds of m micro-batches per step")
    expert_map: list[list[list[int]]] = Field(
        description="per MoE layer, per expert: the expert ranks holding it (replica r serves "
        "data-parallel index d with d mod n == r; with fewer data-parallel ranks D than replicas n, "
        "d splits its rows over replicas d, d + D, ...)"
    )
    total_params: NonNegInt
    active_params: NonNegInt
    memory_per_gpu: dict[str, MemoryEstimate]
    stage_times: list[StageTime]
    step_time_s: NonNegFloat | None = Field(description="predicted; None when no layout was priced")
    colocated_step_time_s: NonNegFloat | None = Field(
        description="the best colocated layout's predicted step; None when it was not priced or does not fit")
    speedup_vs_colocated: NonNegFloat | None = Field(
        description="colocated_step_time_s / step_time_s; None without a colocated baseline")
    expert_imbalance: NonNegFloat = Field(description="max/mean expected load over expert GPUs")
    mfu: NonNegFloat | None = Field(description="model FLOPs utilisation over all `gpus`; None without a step time")
    feasible: bool
    reason: str
    notes: list[str] = Field(default_factory=list)
    min_gpus: PositiveInt | None = Field(None, description="when infeasible: fewest GPUs that fit")


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


class DataConfig(StrictModel):
    """Where training tokens come from."""

    kind: Literal["synthetic", "text", "tokens"] = "synthetic"
    path: str | None = Field(None, description="text file (byte-level) or .bin token file")
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    val_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.05

    @model_validator(mode="after")
    def _path(self) -> DataConfig:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind={self.kind!r} needs data.path")
        return self


class OptimConfig(StrictModel):
    lr: PositiveFloat = 3e-3
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    warmup_steps: NonNegInt = 10
    weight_decay: NonNegFloat = 0.0
    beta1: Fraction = 0.9
    beta2: Fraction = 0.95
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegFloat = Field(1.0, description="global grad-norm clip; 0 disables")
    shard_states: bool = Field(
        False, description="ZeRO-1: split AdamW's moments of the replicated (attention-side) parameters over "
        "each data-parallel group (distributed modes; the result is the same step)")


class TrainConfig(StrictModel):
    """A training run: model, data, optimisation, layout, and where outputs go."""

    model: str | ModelConfig = Field(description="preset name, YAML / config.json path, or inline")
    hardware: str | HardwareConfig | None = None
    mode: Literal["single", "disaggregated", "colocated"] = "disaggregated"
    transport: Literal["local", "nccl", "nvshmem"] = "local"
    device: Literal["cpu", "cuda"] = "cpu"
    experts_backend: Literal["loop", "grouped_mm", "triton"] = "loop"
    cpu_threads: PositiveInt | None = Field(
        None, description="torch intra-op threads for CPU training; None keeps torch's default"
    )
    seed: int = 0
    steps: PositiveInt = 100
    batch_size: PositiveInt = Field(8, description="sequences per step (global)")
    seq_len: PositiveInt = 128
    micro_batches: PositiveInt = 1
    attention_ranks: PositiveInt = 1
    expert_ranks: PositiveInt = 1
    pipeline_groups: PositiveInt = 1
    colocated_ranks: PositiveInt = 2
    plan: str | Plan | None = Field(
        None, description="a `disagmoe plan --out` file (or an inline plan): its layout and expert map "
        "replace mode, attention_ranks, expert_ranks, pipeline_groups, micro_batches, colocated_ranks"
    )
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval_every: NonNegInt = Field(25, description="validation every N steps; 0 disables")
    eval_batches: PositiveInt = 2
    out_dir: str = "runs/default"
    checkpoint_every: NonNegInt = Field(0, description="checkpoint every N steps (0: only by time and at the end)")
    checkpoint_minutes: NonNegFloat = Field(
        30.0, description="also checkpoint once this many minutes passed since the last one (0: never by time)")
    keep_checkpoints: NonNegInt = Field(
        3, description="complete checkpoints kept; older ones are deleted once a newer one is sealed (0: keep all)")
    resume: bool = Field(False, description="continue from out_dir's latest checkpoint")
    trace: bool = True
    recv_timeout_s: PositiveFloat = 120.0
    ray_address: str | None = Field(None, description="None starts an embedded local cluster")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables for every worker (per host)"
    )

    @model_validator(mode="after")
    def _batch(self) -> TrainConfig:
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"batch_size={self.batch_size} must be a multiple of micro_batches={self.micro_batches}"
            )
        return self


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

T = TypeVar("T", bound=BaseModel)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `source: key.path: message`."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; `disagmoe config schema` lists the valid keys)"
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


def read_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a dict, with a clear error if it cannot be read."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of keys at the top level")
    return data


def preset_names(kind: Literal["models", "hardware"]) -> list[str]:
    return sorted(p.stem for p in (PRESETS_DIR / kind).glob("*.yaml"))


def _load_preset_or_file(ref: str, kind: Literal["models", "hardware"]) -> tuple[dict[str, Any], str]:
    preset = PRESETS_DIR / kind / f"{ref}.yaml"
    if preset.is_file():
        return read_mapping(preset), f"preset {ref!r}"
    path = Path(ref)
    if path.suffix in {".yaml", ".yml", ".json"} or path.exists():
        return read_mapping(path), str(path)
    noun = "model" if kind == "models" else "hardware"
    raise ValueError(
        f"unknown {noun} preset {ref!r}; valid names: {', '.join(preset_names(kind))} "
        f"(or pass a path to a YAML file{' or a Hugging Face config.json' if kind == 'models' else ''})"
    )


def load_model(ref: str | ModelConfig) -> ModelConfig:
    """A preset name, a YAML file, or a Hugging Face `config.json` (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    if isinstance(ref, ModelConfig):
        return ref
    data, source = _load_preset_or_file(ref, "models")
    if "model_type" in data or "architectures" in data:
        from disagmoe.hf_config import model_config_from_hf

        return model_config_from_hf(data, source)
    return validate(ModelConfig, data, source)


def load_hardware(ref: str | HardwareConfig) -> HardwareConfig:
    """A preset name or a YAML file."""
    if isinstance(ref, HardwareConfig):
        return ref
    data, source = _load_preset_or_file(ref, "hardware")
    return validate(HardwareConfig, data, source)


def load_train_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """A training YAML, with `key.sub=value` overrides (values parsed as YAML scalars)."""
    path = Path(path)
    data = read_mapping(path)
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
        node[parts[-1]] = yaml.safe_load(raw)
    return validate(TrainConfig, data, str(path))
