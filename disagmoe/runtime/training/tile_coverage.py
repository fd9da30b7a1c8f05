"""Whether the expert GEMMs of a `mode: single` run read tuned tiles on its GPU (`kernels.tile_configs`).

A shape class no table has tuned launches the heuristic tiles, and nothing else says so: a config whose tokens
per micro-batch or expert shape differ from every tuned one (the DeepSeek config's 2,048 rows an expert on an
H200 in session 47: every launch) runs slower than `disagmoe bench tune-experts` would make it, silently.
`untuned_tiles_note` is the start line that says which classes, and the command that tunes exactly them.

Said for the Triton backend's expert GEMMs in bf16 or fp32 (one table serves both: `TileConfig.for_element_size`)
only: an FP8 run's recipe decides which of its launches are bf16 ones (`kernels.fp8_ffn`), and a distributed
expert rank's rows an expert depend on its layout.
"""

from __future__ import annotations

from disagmoe.config import ModelConfig, TrainConfig


def untuned_tiles_note(cfg: TrainConfig, model_cfg: ModelConfig, device_name: str, arch: str | None) -> str | None:
    """One start line where some of the expert GEMM classes `cfg` (settled: `micro_batches` a number) launches on
    `device_name` (`arch`: its `tile_configs.architecture`) were never tuned there or on its architecture; None
    where all were, or where the run launches none of the tuned kernels (module docstring)."""
    from disagmoe.kernels.moe_ffn import FFNTiles
    from disagmoe.kernels.tile_configs import loads_of_routing, untuned_classes

    if cfg.experts_backend != "triton" or cfg.expert_precision == "fp8":
        return None
    dims = FFNTiles.gemm_dims(model_cfg.hidden_size, model_cfg.expert_ffn_size)
    missing = untuned_classes(dims, launch_rows(cfg, model_cfg), model_cfg.num_experts, device_name, arch,
                              loads_of_routing(cfg.routing))
    if not missing:
        return None
    roles = "" if len(missing) == len(dims) else "".join(f" --role {key.split('/')[0]}" for key in missing)
    return (f"expert tiles: {len(missing)} of the {len(dims)} expert GEMM classes this run launches were never tuned "
            f"on {device_name} or a GPU of its architecture ({', '.join(missing)}): they launch the heuristic "
            f"tiles. `disagmoe bench tune-experts -c CONFIG{roles}` with this run's overrides (micro_batches="
            f"{cfg.micro_batches}{' routing=balanced' if cfg.routing == 'balanced' else ''}) tunes exactly them into "
            "this GPU's table (minutes)")


def launch_rows(cfg: TrainConfig, model_cfg: ModelConfig) -> int:
    """The routed rows of each expert GEMM launch of a `mode: single` run (settled: `micro_batches` a number): one
    micro-batch's tokens times top-k, every expert local (`bench.experts.shape_of_run`'s pairs)."""
    if not isinstance(cfg.micro_batches, int):
        raise ValueError(f"the rows of a launch follow a settled split: micro_batches is {cfg.micro_batches!r}")
    return cfg.batch_size // cfg.micro_batches * cfg.seq_len * model_cfg.top_k
