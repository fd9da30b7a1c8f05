"""One process's memory need (`mode: single`) and the setting it decides, torch-free: the single trainer
checks and resolves a run with them, and `roofline -c` settles a run as its trainer will before pricing it (the
planner applies `resolve_wgrad_pairs`' rule to each one-GPU candidate with its own memory model, the same bytes:
`placement.cost.evaluate`).

    single_peak_bytes(cfg, model_cfg) -> (training state, activations) bytes at the process's peak
    resolve_wgrad_pairs(cfg, model_cfg, capacity_bytes) -> (cfg with expert_wgrad_pairs on or off, its line)

`MEMORY_HEADROOM` (`roofline.memory`'s, which the planner reads too): the share of a device a setting
chosen for speed may plan for.
"""

from __future__ import annotations

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.roofline.memory import MEMORY_HEADROOM, fp8_weight_copy_bytes
from disagmoe.roofline.optimizer_state import staging_bytes, state_bytes
from disagmoe.roofline.params import count_params
from disagmoe.roofline.stages import dense_fp8_weights
from disagmoe.runtime.activation_memory import single_activation_bytes


def single_peak_bytes(cfg: TrainConfig, model_cfg: ModelConfig) -> tuple[int, int]:
    """(training state, activations) one process holds at its peak on its device: every parameter's
    state (`roofline.optimizer_state.state_bytes`; offloaded, the masters and moments are host bytes,
    `single_host_bytes`, and two staging slots are on the device; with `precision: fp8` the experts'
    FP8 weight copies too, those their recipe reads (`roofline.memory.fp8_weight_copy_bytes` of
    `fp8_expert_forward` and `fp8_expert_backward`), and the dense projections' two e4m3
    copies under `dense_precision` fp8, of those its `dense_fp8_scaling` runs in FP8) and one
    micro-batch's activations
    (`runtime.activation_memory`)."""
    params = count_params(model_cfg)
    state = params.total * state_bytes(cfg.optim.state_dtype, cfg.compute_dtype_name,
                                       offload=cfg.offloads_to_host).total
    if cfg.offload_optimizer:
        state += staging_bytes(cfg.offload_bucket_bytes, cfg.optim.state_dtype, cfg.compute_dtype_name, params.total)
    if cfg.expert_precision == "fp8":
        state += int(fp8_weight_copy_bytes(params.routed_experts, cfg.expert_forward_precision,
                                           cfg.expert_backward_precision))
    if cfg.dense_precision == "fp8":  # the FP8 dense projections' two e4m3 copies, priced as the planner does
        state += int(2 * dense_fp8_weights(model_cfg, model_cfg.num_moe_layers, model_cfg.num_dense_layers,
                                           cfg.dense_fp8_scaling))
    return state, single_activation_bytes(cfg, model_cfg)


def resolve_wgrad_pairs(cfg: TrainConfig, model_cfg: ModelConfig, capacity_bytes: float) -> tuple[TrainConfig, str | None]:
    """(`cfg` with `expert_wgrad_pairs: auto` resolved to on or off, a line saying what runs and why, or
    None where nothing pairs and nothing was asked). auto is on where it applies
    (`TrainConfig.pairs_expert_wgrads`) and the peak with one micro-batch's waiting expert rows
    (`single_peak_bytes`, `roofline.memory.paired_wgrad_held_bytes`) is within `MEMORY_HEADROOM` of
    `capacity_bytes` (the rows are optional: they take only room `micro_batches: auto` would leave);
    else off, saying why. on is the user's: the memory check holds it to the whole device."""
    if cfg.expert_wgrad_pairs == "off":
        return cfg, None
    on = cfg.model_copy(update={"expert_wgrad_pairs": "on"})
    if not on.pairs_expert_wgrads:  # where it does not apply (on is refused there by the config) or m = 1
        return cfg.model_copy(update={"expert_wgrad_pairs": "off"}), None
    with_rows = sum(single_peak_bytes(on, model_cfg))
    waiting = with_rows - sum(single_peak_bytes(cfg.model_copy(update={"expert_wgrad_pairs": "off"}), model_cfg))
    launches = (cfg.micro_batches + 1) // 2
    budget = capacity_bytes * MEMORY_HEADROOM
    if cfg.expert_wgrad_pairs == "auto" and with_rows > budget:
        return cfg.model_copy(update={"expert_wgrad_pairs": "off"}), (
            f"expert_wgrad_pairs: auto -> off: one micro-batch's waiting expert rows ({waiting / 2**30:.1f} GiB) "
            f"would take the predicted peak to {with_rows / 2**30:.1f} GiB, past the {budget / 2**30:.1f} GiB "
            f"({MEMORY_HEADROOM:.0%} of the device's {capacity_bytes / 2**30:.1f}) a run may plan for; each expert "
            "weight gradient runs once per micro-batch (expert_wgrad_pairs: on asks for them anyway)")
    return on, (f"expert_wgrad_pairs: {cfg.expert_wgrad_pairs}{' -> on' if cfg.expert_wgrad_pairs == 'auto' else ''}: "
                f"each expert weight gradient runs {launches} times a step over {cfg.micro_batches} micro-batches' "
                f"rows (its fp32 main gradient read and written {launches} times, not {cfg.micro_batches}); "
                f"{waiting / 2**30:.1f} GiB of waiting rows in the predicted peak")
