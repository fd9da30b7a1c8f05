"""Parameter counts reproduce the published totals (within 2%)."""

import pytest

from disagmoe.model_ref import load_model
from disagmoe.roofline.params import count_params

PUBLISHED = {  # name: (total, active), from the model cards / technical reports
    "deepseek-v3": (671e9, 37e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    counts = count_params(load_model(name))
    total, active = PUBLISHED[name]
    assert abs(counts.total / total - 1) < 0.02
    assert abs(counts.active / active - 1) < 0.02


def test_split_adds_up():
    c = count_params(load_model("deepseek-v3"))
    assert c.total == c.non_expert + c.routed_experts
    assert c.active < c.total


@pytest.mark.parametrize("name", [*sorted(PUBLISHED), "tiny"])
def test_the_dense_linears_are_the_modules_the_model_builds_in_call_order(name):
    """`dense_linears` (torch-free, for the planner) against the `DeferrableLinear`s `model` builds
    (on the meta device): names, shapes and order (the attention module's registration order is its
    forward's; a SwiGLU's gate, up, down), the block-input readers `bench calibrate` feeds one x, and
    the weights `attention_params` / `swiglu_params` count less the norms."""
    import torch

    from disagmoe.bench.calibrate import BLOCK_INPUT_READERS
    from disagmoe.model.attention import build_attention
    from disagmoe.model.layers import DeferrableLinear, SwiGLU
    from disagmoe.roofline.params import attention_norm_params, attention_params, dense_linears, swiglu_params

    m = load_model(name)
    with torch.device("meta"):
        attention, ffn = build_attention(m), SwiGLU(m.hidden_size, m.dense_ffn_size or 64)
    built = [(n, lin.in_features, lin.out_features) for n, lin in attention.named_modules()
             if isinstance(lin, DeferrableLinear)]
    ours = dense_linears(m, "attention")
    assert [(lin.name, lin.in_features, lin.out_features) for lin in ours] == built
    assert {lin.name for lin in ours if lin.reads_block_input} == {n for n, *_ in built} & BLOCK_INPUT_READERS
    assert sum(lin.in_features * lin.out_features for lin in ours) == attention_params(m) - attention_norm_params(m)
    swiglu = dense_linears(m.model_copy(update={"dense_ffn_size": m.dense_ffn_size or 64}), "dense ffn")
    assert [(lin.name, lin.in_features, lin.out_features, lin.reads_block_input) for lin in swiglu] == [
        (n, lin.in_features, lin.out_features, n in ("w1", "w3")) for n, lin in ffn.named_modules()
        if isinstance(lin, DeferrableLinear)]
    assert sum(lin.in_features * lin.out_features for lin in swiglu) == swiglu_params(m.hidden_size,
                                                                                   m.dense_ffn_size or 64)
    with pytest.raises(ValueError, match="dense linears of part 'router': choose one of attention, shared experts"):
        dense_linears(m, "router")


def test_the_roofline_holds_the_dense_fp8_recipes_as_the_kernels_do():
    """The torch-free copies of `kernels.fp8_dense`'s recipe constants: its scalings (the configs'
    `Fp8DenseScaling`) and blockwise's grid (`roofline.stages.BLOCKWISE_MULTIPLE`)."""
    from typing import get_args

    from disagmoe.config import FP8_DENSE_SCALING, Fp8DenseScaling
    from disagmoe.kernels import fp8_dense
    from disagmoe.roofline import stages

    assert get_args(Fp8DenseScaling) == fp8_dense.SCALINGS and FP8_DENSE_SCALING in fp8_dense.SCALINGS
    assert stages.BLOCKWISE_MULTIPLE == fp8_dense.BLOCKWISE_MULTIPLE and stages.FP8_SCALE_GROUP == fp8_dense.BLOCK
    m = load_model("deepseek-v3")
    assert [lin.name for lin in stages.dense_fp8_linears(m, "attention", "blockwise")] == [
        lin.name for lin in stages.dense_linears(m, "attention") if fp8_dense.fits_blockwise(lin.in_features,
                                                                                          lin.out_features)]
