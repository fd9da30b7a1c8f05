"""Named kernels of a profiled step against their roofline bound (`bench profile`'s bounds table).

Issue 20 item 2 holds the expert weight gradients to 1.3x of max(FLOPs / matmul ceiling, bytes /
HBM) for their own traffic; this makes that ratio a product figure. A family is the kernels whose
names hold one of its keys; the work a step asks of it is the roofline's own stage
(`roofline.stages`, the definition the planner prices and `bench calibrate` fits), summed over the
step's MoE layers and micro-batches of `mode: single` on one GPU; its bound is that work's time under
the config's hardware preset (`Ceilings.of`: with a calibrated preset the measured matmul fraction
and HBM rate, with a datasheet one its efficiency factors, so there the ratio reads low). Pure
arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagmoe.config import ModelConfig, TrainConfig, load_hardware
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import Work, expert_weight_grads, main_grad_passes


@dataclass(frozen=True)
class KernelFamily:
    name: str
    keys: tuple[str, ...]  # kernel names holding any of these (lower case) belong to it
    # the work one step asks of it, or (a str) why this run prices none: its kernels are others
    work: Callable[[TrainConfig, ModelConfig], Work | str]


def _expert_weight_grads(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The bf16 Triton experts' weight gradients, each launch adding into the fp32 main gradient (the
    first of a step storing it: first touch), one launch per micro-batch or, paired
    (`TrainConfig.pairs_expert_wgrads`, `kernels.wgrad_pairs`), per two, as the planner prices them."""
    if cfg.experts_backend != "triton":
        return f"experts_backend: {cfg.experts_backend} runs no Triton weight-gradient kernel"
    if cfg.expert_precision == "fp8" and cfg.expert_backward_precision == "fp8":
        return "fp8_expert_backward: fp8 runs the FP8 weight-gradient kernels (an FP8 ceiling: not this family)"
    micro_batches = int(cfg.micro_batches)
    rows = cfg.batch_size // micro_batches * cfg.seq_len * m.top_k
    launch = expert_weight_grads(m, rows, m.num_experts, stored_share=1.0 / micro_batches,
                                 main_grad_passes=main_grad_passes(micro_batches, cfg.pairs_expert_wgrads))
    return launch.scale(micro_batches * m.num_moe_layers)


FAMILIES = (
    KernelFamily("expert weight gradients (bf16)", ("_ragged_weight_grad",), _expert_weight_grads),
)


def kernel_bounds(cfg: TrainConfig, m: ModelConfig, kernel_ms: dict[str, float]) -> list[dict]:
    """For each family (`FAMILIES`): its kernels' measured ms a step (`kernel_ms`: kernel name -> ms
    a step), the bound's ms (the slower of compute and HBM under `cfg.hardware`'s ceilings), which
    one binds, the work (TFLOP, GB) and measured / bound; a family this run does not run, or a run
    without a hardware preset, gets its reason in `note` and no figures."""
    rows = []
    for family in FAMILIES:
        measured = sum(ms for name, ms in kernel_ms.items() if any(k in name.lower() for k in family.keys))
        work = family.work(cfg, m)
        row: dict = {"family": family.name, "ms_per_step": measured}
        if isinstance(work, str) or cfg.hardware is None or measured == 0.0:
            row["note"] = (work if isinstance(work, str) else
                           "no hardware preset: set hardware= to price the bound" if cfg.hardware is None else
                           "none of its kernels ran in the profiled steps")
            rows.append(row)
            continue
        times = Ceilings.of(load_hardware(cfg.hardware)).times(work)
        bound = max(("compute", "hbm"), key=lambda k: float(times[k]))
        bound_ms = float(times[bound]) * 1e3
        row.update(bound_ms_per_step=bound_ms, bound=bound, tflop=float(work.flops) / 1e12,
                   gb=float(work.hbm_bytes) / 1e9, compute_ms=float(times["compute"]) * 1e3,
                   hbm_ms=float(times["hbm"]) * 1e3, ratio=measured / bound_ms, hardware=cfg.hardware)
        rows.append(row)
    return rows
