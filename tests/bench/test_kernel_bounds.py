"""`bench profile`'s kernel families against their roofline bound (disagmoe/bench/kernel_bounds.py),
on a CPU: the step's work is the planner's own stage summed over layers and micro-batches, the bound
the slower of compute and HBM under the config's hardware, and what is not priced says why."""

from __future__ import annotations

import pytest

from disagmoe.bench.kernel_bounds import kernel_bounds
from disagmoe.cli.bench_cmd import bounds_table
from disagmoe.config import TrainConfig, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import expert_weight_grads


def _cfg(**fields) -> TrainConfig:
    base = dict(model="qwen3-30b-a3b", mode="single", device="cuda", experts_backend="triton", batch_size=16,
                seq_len=4096, micro_batches=2, hardware="h200-sxm-calibrated")
    return TrainConfig(**{**base, **fields})


def test_the_expert_weight_gradients_are_set_against_the_planners_own_stage():
    cfg = _cfg()
    m = load_model("qwen3-30b-a3b")
    rows = 16 // 2 * 4096 * m.top_k  # a micro-batch's routed rows on the one GPU
    step = expert_weight_grads(m, rows, m.num_experts, stored_share=0.5).scale(2 * m.num_moe_layers)
    times = Ceilings.of(load_hardware("h200-sxm-calibrated")).times(step)
    bound_ms = max(float(times["compute"]), float(times["hbm"])) * 1e3
    kernels = {"_ragged_weight_grad_kernel": 0.75 * bound_ms, "_ragged_weight_grad_kernel_2": 0.5 * bound_ms,
               "_ragged_rows_gemm_kernel": 99.0}
    (row,) = kernel_bounds(cfg, m, kernels)
    assert row["ms_per_step"] == pytest.approx(1.25 * bound_ms)  # both of the family's kernels, not the rows one
    assert row["bound_ms_per_step"] == pytest.approx(bound_ms) and row["ratio"] == pytest.approx(1.25)
    assert row["bound"] == max(("compute", "hbm"), key=lambda k: float(times[k]))
    assert row["tflop"] == pytest.approx(step.flops / 1e12) and row["gb"] == pytest.approx(step.hbm_bytes / 1e9)
    # more micro-batches: the same FLOPs, more main-gradient traffic (read and written once per launch)
    (more,) = kernel_bounds(_cfg(micro_batches=8), m, kernels)
    assert more["tflop"] == pytest.approx(row["tflop"]) and more["gb"] > row["gb"]
    table = bounds_table([row])
    assert table.row_count == 1 and "h200-sxm-calibrated" in table.title


@pytest.mark.parametrize("fields, says", [
    (dict(experts_backend="grouped_mm"), "runs no Triton weight-gradient kernel"),
    (dict(precision="fp8", fp8_expert_backward="fp8"), "FP8 weight-gradient kernels"),
    (dict(hardware=None), "no hardware preset: set hardware="),
])
def test_a_family_this_run_does_not_price_says_why(fields, says):
    (row,) = kernel_bounds(_cfg(**fields), load_model("qwen3-30b-a3b"), {"_ragged_weight_grad_kernel": 3.0})
    assert says in row["note"] and "ratio" not in row
    assert bounds_table([row]).row_count == 1


def test_a_family_whose_kernels_did_not_run_says_so():
    (row,) = kernel_bounds(_cfg(), load_model("qwen3-30b-a3b"), {"_ragged_rows_gemm_kernel": 3.0})
    assert row["ms_per_step"] == 0.0 and "none of its kernels ran" in row["note"]
