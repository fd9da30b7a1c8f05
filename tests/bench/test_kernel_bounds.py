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
                seq_len=4096, micro_batches=2, hardware="h200-sxm-calibrated", expert_wgrad_pairs="off")
    return TrainConfig(**{**base, **fields})


def _families(cfg, m, kernels) -> dict[str, dict]:
    """`kernel_bounds`' rows by family name."""
    return {row["family"]: row for row in kernel_bounds(cfg, m, kernels)}


BF16_WGRAD, FP8_WGRAD = "expert weight gradients (bf16)", "expert weight gradients (FP8)"
TOKEN_GROUPS, WEIGHT_COPIES, ADAMW = "FP8 token-group quantiser", "FP8 weight copies", "AdamW update"


def test_the_expert_weight_gradients_are_set_against_the_planners_own_stage():
    cfg = _cfg()
    m = load_model("qwen3-30b-a3b")
    rows = 16 // 2 * 4096 * m.top_k  # a micro-batch's routed rows on the one GPU
    step = expert_weight_grads(m, rows, m.num_experts, stored_share=0.5).scale(2 * m.num_moe_layers)
    times = Ceilings.of(load_hardware("h200-sxm-calibrated")).times(step)
    bound_ms = max(float(times["compute"]), float(times["hbm"])) * 1e3
    kernels = {"_ragged_weight_grad_kernel": 0.75 * bound_ms, "_ragged_weight_grad_kernel_2": 0.5 * bound_ms,
               "_ragged_rows_gemm_kernel": 99.0}
    by_family = _families(cfg, m, kernels)
    row, fp8_row, groups_row, copies_row = (by_family[f] for f in (BF16_WGRAD, FP8_WGRAD, TOKEN_GROUPS,
                                                                   WEIGHT_COPIES))
    assert "no all-FP8 backward here" in fp8_row["note"] and "no token-group copies" in groups_row["note"]
    assert "no block-quantised FP8 weight copies" in copies_row["note"]
    assert row["ms_per_step"] == pytest.approx(1.25 * bound_ms)  # both of the family's kernels, not the rows one
    assert row["bound_ms_per_step"] == pytest.approx(bound_ms) and row["ratio"] == pytest.approx(1.25)
    assert row["bound"] == max(("compute", "hbm"), key=lambda k: float(times[k]))
    assert row["tflop"] == pytest.approx(step.flops / 1e12) and row["gb"] == pytest.approx(step.hbm_bytes / 1e9)
    # more micro-batches: the same FLOPs, more main-gradient traffic (read and written once per launch)
    more = _families(_cfg(micro_batches=8), m, kernels)[BF16_WGRAD]
    assert more["tflop"] == pytest.approx(row["tflop"]) and more["gb"] > row["gb"]
    table = bounds_table([row])
    assert table.row_count == 1 and "h200-sxm-calibrated" in table.title


@pytest.mark.parametrize("fields, says", [
    (dict(experts_backend="grouped_mm"), "runs no Triton weight-gradient kernel"),
    (dict(precision="fp8", fp8_expert_backward="fp8"), "FP8 weight-gradient kernels"),
    (dict(hardware=None), "no hardware preset: set hardware="),
])
def test_a_family_this_run_does_not_price_says_why(fields, says):
    row = _families(_cfg(**fields), load_model("qwen3-30b-a3b"), {"_ragged_weight_grad_kernel": 3.0})[BF16_WGRAD]
    assert says in row["note"] and "ratio" not in row
    assert bounds_table([row]).row_count == 1


def test_the_qwen3_configs_bound_worked_by_hand():
    """configs/h200x2-qwen3-30b.yaml at 2 micro-batches (16 x 4,096 tokens a step, top-8, 6 MoE layers of
    128 experts, H 2,048, F 768): d w13 and d w2 are 2 x rows x 3HF FLOPs = 29.7 TFLOP a step, at the
    preset's matmul ceiling (its bf16 peak times its measured fraction); the fp32 main gradients' read
    and write (a store alone at each step's first launch) make it compute-bound at 2 micro-batches and
    HBM-bound at 8 on an H200."""
    from disagmoe.config import load_train_config

    def bound(mb: int, pairs: str = "off") -> dict:
        cfg = load_train_config("configs/h200x2-qwen3-30b.yaml", ["mode=single", f"micro_batches={mb}",
                                                                  "hardware=h200-sxm-calibrated",
                                                                  f"expert_wgrad_pairs={pairs}"])
        row = _families(cfg, load_model(cfg.model), {"_ragged_weight_grad_kernel": 50.0})[BF16_WGRAD]
        return row

    flops = 2 * (16 * 4096 * 8) * 3 * 2048 * 768 * 6
    hw = load_hardware("h200-sxm-calibrated")
    two, eight = bound(2), bound(8)
    assert two["tflop"] == pytest.approx(flops / 1e12) == pytest.approx(29.69, abs=0.01)
    assert two["bound"] == "compute" and eight["bound"] == "hbm"
    assert two["bound_ms_per_step"] == pytest.approx(flops / (hw.bf16_tflops * 1e12 * hw.efficiency.matmul) * 1e3)
    weights = 6 * 128 * 3 * 2048 * 768  # the main gradients: read and written by 7 of 8 launches, written by 1
    assert eight["gb"] - two["gb"] == pytest.approx(4 * weights * (2 * 8 - 1 - (2 * 2 - 1)) / 1e9)
    # paired (`expert_wgrad_pairs`): 4 launches of 8 micro-batches' rows, 3 reading and writing, 1 writing
    paired = bound(8, "on")
    assert paired["tflop"] == pytest.approx(eight["tflop"])
    assert eight["gb"] - paired["gb"] == pytest.approx(4 * weights * (2 * 8 - 1 - (2 * 4 - 1)) / 1e9)


def test_a_family_whose_kernels_did_not_run_says_so():
    row = _families(_cfg(), load_model("qwen3-30b-a3b"), {"_ragged_rows_gemm_kernel": 3.0})[BF16_WGRAD]
    assert row["ms_per_step"] == 0.0 and "none of its kernels ran" in row["note"]


def test_the_fp8_weight_gradients_are_set_against_the_fp8_ceiling_over_their_token_group_copies():
    """The all-FP8 backward: its weight-gradient kernels (Triton's and Gluon's, not the bf16 family's) against
    the same stage over e4m3 token-group copies (a byte a value and a scale per 128 tokens) at the bf16 compute
    ceiling times fp8_tflops / bf16_tflops; the bf16 family says why it prices nothing."""
    from disagmoe.roofline.stages import FP8_TOKEN_GROUP_BYTES

    cfg = _cfg(precision="fp8", fp8_expert_backward="fp8")
    m = load_model("qwen3-30b-a3b")
    rows = 16 // 2 * 4096 * m.top_k
    step = expert_weight_grads(m, rows, m.num_experts, stored_share=0.5,
                               operand_bytes=FP8_TOKEN_GROUP_BYTES).scale(2 * m.num_moe_layers)
    hw = load_hardware("h200-sxm-calibrated")
    ceilings = Ceilings.of(hw)
    compute_ms = step.flops / (ceilings.flops_per_s * hw.fp8_tflops / hw.bf16_tflops) * 1e3
    hbm_ms = step.hbm_bytes / ceilings.hbm_bytes_per_s * 1e3
    kernels = {"_gluon_fp8_weight_grad_kernel": 2.0, "_fp8_weight_grad_kernel": 1.0, "_ragged_weight_grad_kernel": 9.0}
    by_family = _families(cfg, m, kernels)
    bf16_row, row = by_family[BF16_WGRAD], by_family[FP8_WGRAD]
    assert "FP8 weight-gradient kernels" in bf16_row["note"]
    assert row["ms_per_step"] == pytest.approx(3.0)
    assert row["compute_ms"] == pytest.approx(compute_ms) and row["hbm_ms"] == pytest.approx(hbm_ms)
    assert row["gb"] == pytest.approx(step.hbm_bytes / 1e9)
    bf16_bytes = expert_weight_grads(m, rows, m.num_experts, stored_share=0.5).scale(2 * m.num_moe_layers).hbm_bytes
    assert row["gb"] < bf16_bytes / 1e9  # the copies' byte a value against bf16's two


def test_the_token_group_quantiser_is_set_against_its_copies_bytes_at_the_hbm_rate():
    """The all-FP8 backward's token-group quantiser (not the one-pass quantiser, which no step runs): per
    micro-batch and MoE layer, the weight gradients' operands (x, d y, act, d h13: 2H + 3F values a row) read in
    bf16 and written as e4m3 copies of each expert group padded to 128 rows, with a scale per 128 rows; bound by
    HBM. Worked by hand for Qwen3 at 2 micro-batches (32,768 rows over 128 experts each), and a run without the
    all-FP8 backward says why it prices none."""
    cfg = _cfg(precision="fp8", fp8_expert_backward="fp8")
    m = load_model("qwen3-30b-a3b")
    rows = 16 // 2 * 4096 * m.top_k
    padded = -(-(rows + 127 * m.num_experts) // 128) * 128
    values = 2 * 2048 + 3 * 768
    step_bytes = 2 * m.num_moe_layers * values * (2 * rows + (1 + 4 / 128) * padded)
    kernels = {"_quantize_token_groups_kernel": 4.0, "_quantize_rows_and_token_groups_kernel": 50.0}
    row = _families(cfg, m, kernels)[TOKEN_GROUPS]
    hbm_ms = step_bytes / Ceilings.of(load_hardware("h200-sxm-calibrated")).hbm_bytes_per_s * 1e3
    assert row["family"] == "FP8 token-group quantiser" and row["ms_per_step"] == pytest.approx(4.0)
    assert row["bound"] == "hbm" and row["tflop"] == 0.0 and row["gb"] == pytest.approx(step_bytes / 1e9)
    assert row["bound_ms_per_step"] == pytest.approx(hbm_ms) and row["ratio"] == pytest.approx(4.0 / hbm_ms)
    default_row = _families(_cfg(precision="fp8"), m, kernels)[TOKEN_GROUPS]
    assert "no token-group copies" in default_row["note"] and "ratio" not in default_row
    assert bounds_table([row, default_row]).row_count == 2


@pytest.mark.parametrize("fields, thirds", [
    (dict(precision="fp8"), 4),  # a run's default: w2's forward copy and both transposes
    (dict(precision="fp8", fp8_expert_forward="both", fp8_dense=False), 6),  # both forward copies, both transposes
    (dict(precision="fp8", fp8_expert_backward="bf16", fp8_dense=False), 1),  # w2's forward copy alone
])
def test_the_weight_copies_are_set_against_their_bytes_at_the_hbm_rate(fields, thirds):
    """`_quantize_blocks_kernel` once a step: the routed experts' bf16 weights read once (those with a copy)
    and the e4m3 copies the recipe reads written, each with an fp32 scale per 128 x 128 block (thirds: the
    copies' values in thirds of the expert parameters, w13 two thirds, w2 one), and under blockwise FP8
    dense projections their two copies; bf16 prices none."""
    from disagmoe.roofline.stages import dense_fp8_weight_copies, dense_fp8_weights

    m = load_model("qwen3-30b-a3b")
    cfg = _cfg(**fields)
    params = 3 * 2048 * 768 * 128 * m.num_moe_layers
    read = params if thirds != 1 else params / 3
    step_bytes = 2 * read + thirds / 3 * params * (1 + 4 / (128 * 128))
    if cfg.dense_fp8_scaling == "blockwise":
        step_bytes += dense_fp8_weight_copies(dense_fp8_weights(m, m.num_moe_layers, 0, "blockwise"),
                                              "blockwise").hbm_bytes
    row = _families(cfg, m, {"_quantize_blocks_kernel": 2.0})[WEIGHT_COPIES]
    assert row["family"] == "FP8 weight copies" and row["bound"] == "hbm"
    assert row["gb"] == pytest.approx(step_bytes / 1e9) and row["ratio"] > 0
    bf16_row = _families(_cfg(), m, {"_quantize_blocks_kernel": 2.0})[WEIGHT_COPIES]
    assert "no block-quantised FP8 weight copies" in bf16_row["note"]


def test_the_adamw_update_is_set_against_every_parameters_bytes_at_the_hbm_rate():
    """The Triton update kernel (`_adamw_kernel`): every parameter's master (4), main gradient (4) and moments
    (2 x 2 in bf16, 2 x 4 in fp32) read, master, moments and the bf16 compute copy (2) written, whatever the
    clip; torch's update says why it prices none."""
    from disagmoe.roofline.params import count_params

    m = load_model("qwen3-30b-a3b")
    params = count_params(m).total
    for state, per_param in (("bf16", (4 + 4 + 4) + (4 + 4 + 2)), ("fp32", (4 + 4 + 8) + (4 + 8 + 2))):
        row = _families(_cfg(optim={"state_dtype": state}), m, {"_adamw_kernel": 5.0})[ADAMW]
        assert row["family"] == "AdamW update" and row["bound"] == "hbm"
        assert row["gb"] == pytest.approx(params * per_param / 1e9)
    torch_row = _families(_cfg(optim={"update_kernel": "torch"}), m, {"_adamw_kernel": 5.0})[ADAMW]
    assert "torch's fused AdamW" in torch_row["note"]


@pytest.mark.parametrize("fields, fp8_thirds, bf16_thirds", [
    (dict(), 0, 6),  # bf16 experts: the forward (3 thirds) and the data gradients (3)
    (dict(recompute="full"), 0, 9),  # the forward again in the backward
    (dict(precision="fp8"), 4, 2),  # a run's default: the down GEMM's forward and the data gradients in FP8
    (dict(precision="fp8", fp8_expert_forward="both"), 6, 0),
    (dict(precision="fp8", fp8_expert_forward="gate-up", fp8_expert_backward="bf16"), 2, 4),
])
def test_the_expert_row_gemms_are_set_against_the_matmul_ceiling_of_their_precision(fields, fp8_thirds, bf16_thirds):
    """The routed experts' row GEMMs (forward and data gradients, in thirds of the forward's FLOPs: gate/up two,
    down one) by the precision each runs in, FLOPs alone at the matmul ceiling (FP8: times fp8 / bf16 tflops);
    a precision none of them runs in says so."""
    m = load_model("qwen3-30b-a3b")
    rows = 16 // 2 * 4096 * m.top_k
    third = 2 * rows * 3 * 2048 * 768 * m.num_moe_layers * 2 / 3  # both micro-batches
    kernels = {"_ragged_rows_gemm_kernel": 1.5, "_gluon_rows_gemm_kernel": 0.5, "_gluon_swiglu_gemm_kernel": 0.25,
               "_swiglu_grad_rows_kernel": 0.25, "_gluon_fp8_rows_gemm_kernel": 2.0, "_fp8_rows_gemm_kernel": 1.0,
               # torch._grouped_mm's (a library tile), and a dense projection's cuBLAS GEMM, no expert row GEMM
               "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
               "INS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE": 0.5,
               "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT": 7.0}  # bf16: ours, the Gluon ones, the library's
    rows_of = _families(_cfg(**fields), m, kernels)
    hw = load_hardware("h200-sxm-calibrated")
    ceiling = Ceilings.of(hw).flops_per_s
    # the split epilogue's SwiGLU-gradient pass (0.25) counts with the precision its data gradients run in
    bf16_backward = fields.get("precision") != "fp8" or fields.get("fp8_expert_backward") == "bf16"
    bf16_measured, fp8_measured = (3.0, 3.0) if bf16_backward else (2.75, 3.25)
    for name, thirds, scale, measured in (("expert row GEMMs (bf16)", bf16_thirds, 1.0, bf16_measured),
                                          ("expert row GEMMs (FP8)", fp8_thirds, hw.fp8_tflops / hw.bf16_tflops,
                                           fp8_measured)):
        row = rows_of[name]
        if thirds == 0:
            assert "ratio" not in row and row["note"]
            continue
        assert row["tflop"] == pytest.approx(thirds * third / 1e12) and row["bound"] == "compute" and row["gb"] == 0
        assert row["ms_per_step"] == measured
        assert row["bound_ms_per_step"] == pytest.approx(thirds * third / (ceiling * scale) * 1e3)


def test_the_permute_and_combine_are_set_against_the_bytes_their_kernels_move():
    """The Triton permute's row copy, the combine and its backward (the permute's backward is the combine kernel
    again), every MoE layer and micro-batch: 5 passes over the routed rows and 5 over the tokens (bf16, H values),
    the forward's 2 + 3 once more under `recompute: full`; at the HBM rate; the fused return's landed combine is
    not one of them; the library experts say why they price none."""
    m = load_model("qwen3-30b-a3b")
    kernels = {"_permute_copy_kernel": 1.0, "_combine_kernel": 2.0, "_combine_backward_kernel": 1.5,
               "_combine_landed_kernel": 9.0}
    tokens = 16 // 2 * 4096  # a micro-batch's
    rows = tokens * m.top_k
    for fields, row_passes, token_passes in ((dict(), 5, 5), (dict(recompute="full"), 7, 8)):
        row = _families(_cfg(**fields), m, kernels)["permute and combine"]
        assert row["ms_per_step"] == pytest.approx(4.5)
        assert row["bound"] == "hbm" and row["tflop"] == 0.0
        moved = (row_passes * rows + token_passes * tokens) * m.hidden_size * 2 * 2 * m.num_moe_layers
        assert row["gb"] == pytest.approx(moved / 1e9)
        hbm_bytes_per_s = Ceilings.of(load_hardware("h200-sxm-calibrated")).hbm_bytes_per_s
        assert row["bound_ms_per_step"] == pytest.approx(row["gb"] * 1e9 / hbm_bytes_per_s * 1e3)
    library = _families(_cfg(experts_backend="grouped_mm"), m, kernels)["permute and combine"]
    assert "runs no Triton permute" in library["note"]
    fp8 = _families(_cfg(precision="fp8"), m, kernels)["permute and combine"]
    assert "e4m3 rows" in fp8["note"] and "gb" not in fp8
