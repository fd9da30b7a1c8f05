"""Roofline stages: FLOPs agree with the 6ND rule, times move the right way with hardware."""

import dataclasses

import numpy as np
import pytest

from disagmoe.config import load_hardware
from disagmoe.model_ref import load_model
from disagmoe.roofline import stages as st
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.flops import step_flops


def roofline_step_flops(m, tokens, seq_len):
    """Sum of the stage FLOPs over a step: forward + backward of every layer and the head."""
    fwd_moe = (st.attention_projections(m, tokens) + st.attention_core(m, tokens, seq_len)
               + st.router(m, tokens) + st.shared_experts(m, tokens)
               + st.routed_experts(m, tokens * m.top_k, m.num_experts))
    fwd_dense = st.attention_projections(m, tokens) + st.attention_core(m, tokens, seq_len) + st.dense_ffn(m, tokens)
    total = 0.0
    for w, layers in ((fwd_moe, m.num_moe_layers), (fwd_dense, m.num_dense_layers)):
        core = st.attention_core(m, tokens, seq_len).flops
        # backward: 2x for GEMMs, 2.5x for the attention core (FlashAttention recompute)
        total += layers * (3 * w.flops + (st.ATTN_CORE_BWD - st.GEMM_BWD) * core)
    total += 3 * st.lm_head(m, tokens).flops
    return total


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3", "qwen3-30b-a3b"])
def test_step_flops_match_six_n_d_plus_attention(name):
    m = load_model(name)
    tokens = 4096 * 8
    ours = roofline_step_flops(m, tokens, 4096)
    ref = step_flops(m, tokens, 4096)
    assert abs(ours / ref - 1) < 0.05


@pytest.mark.parametrize("field, stage", [
    ("bf16_tflops", lambda m: st.routed_experts(m, 65536, 8)),
    ("hbm_gbps", lambda m: st.permute(m, 65536)),
    ("nvlink_gbps", lambda m: st.transfer(2**30, 0.0)),
    ("scaleout_gbps", lambda m: st.transfer(2**30, 1.0)),
])
def test_times_fall_as_the_binding_resource_grows(field, stage):
    hw = load_hardware("h200-sxm")
    w = stage(load_model("mixtral-8x7b"))
    times = []
    for scale in (0.5, 1.0, 2.0, 4.0):
        faster = hw.model_copy(update={field: getattr(hw, field) * scale})
        times.append(float(Ceilings.of(faster).time(w)))
    assert all(a > b for a, b in zip(times, times[1:]))


def test_times_never_rise_with_any_resource():
    rng = np.random.default_rng(0)
    hw = load_hardware("h100-sxm")
    m = load_model("qwen3-30b-a3b")
    w = st.attention_core(m, 8192, 4096) + st.transfer(1e8, 0.3) + st.routed_experts(m, 3000, 16)
    base = float(Ceilings.of(hw).time(w))
    for field in ("bf16_tflops", "hbm_gbps", "nvlink_gbps", "scaleout_gbps"):
        faster = hw.model_copy(update={field: getattr(hw, field) * float(rng.uniform(1.1, 3))})
        assert float(Ceilings.of(faster).time(w)) <= base


def test_bound_names_the_largest_term():
    c = Ceilings.of(load_hardware("h200-sxm"))
    assert c.bound(st.Work(flops=1e15)) == "compute"
    assert c.bound(st.Work(hbm_bytes=1e12)) == "hbm"
    assert c.bound(st.transfer(1e10, 1.0)) == "scale-out"
    assert c.bound(st.Work()) == "none"


def test_vectorised_matches_scalar():
    m = load_model("deepseek-v3")
    tokens = np.array([1024.0, 4096.0, 16384.0])
    w = st.attention_projections(m, tokens)
    for i, t in enumerate(tokens):
        one = st.attention_projections(m, float(t))
        assert all(np.isclose(getattr(w, f.name)[i] if np.ndim(getattr(w, f.name)) else getattr(w, f.name),
                              getattr(one, f.name)) for f in dataclasses.fields(st.Work))


@pytest.mark.parametrize("experts, top_k, ranks", [(8, 2, 2), (8, 2, 4), (12, 3, 3), (12, 1, 4), (8, 8, 2), (6, 2, 1)])
def test_the_expected_ranks_a_token_reaches_is_the_mean_over_every_top_k_choice(experts, top_k, ranks):
    """Every k-subset of E experts equally likely (uniform routing without replacement), experts
    split evenly over the ranks: the mean number of distinct ranks a choice touches."""
    import itertools

    rank_of = [e * ranks // experts for e in range(experts)]
    choices = list(itertools.combinations(range(experts), top_k))
    mean = sum(len({rank_of[e] for e in choice}) for choice in choices) / len(choices)
    assert ranks * st.rank_reach(experts, top_k, 1 / ranks) == pytest.approx(mean, rel=1e-12)


@pytest.mark.parametrize("experts, top_k, groups, topk_groups, ranks", [
    (8, 2, 4, 2, 2), (8, 2, 4, 2, 4), (8, 2, 4, 2, 8), (12, 4, 4, 2, 2), (12, 3, 6, 3, 3), (16, 4, 8, 4, 4),
    (16, 2, 4, 1, 8), (16, 4, 4, 4, 4), (16, 4, 4, 2, 16)])
def test_group_limited_reach_is_the_mean_over_every_choice_of_groups_and_experts(experts, top_k, groups,
                                                                                 topk_groups, ranks):
    """Group-limited routing as the model takes it: every M-subset of the G groups alike, each
    chosen group giving k / M of its experts, every such choice alike; groups and ranks contiguous
    ranges. The mean number of distinct ranks a choice touches, enumerated, is ranks x rank_reach
    (ranks inside a group and over several, M = 1 and M = G)."""
    import itertools

    per_group, each = experts // groups, top_k // topk_groups
    rank_of = [e * ranks // experts for e in range(experts)]
    touched = []
    for chosen in itertools.combinations(range(groups), topk_groups):
        picks = [itertools.combinations(range(g * per_group, (g + 1) * per_group), each) for g in chosen]
        touched += [len({rank_of[e] for part in parts for e in part}) for parts in itertools.product(*picks)]
    mean = sum(touched) / len(touched)
    reach = st.rank_reach(experts, top_k, 1 / ranks, groups, topk_groups)
    assert ranks * reach == pytest.approx(mean, rel=1e-12)


def test_group_limited_reach_is_near_the_routers_group_mask_on_random_scores():
    """The router's own group limit (`model.router.group_limited_mask`: groups ranked by their two
    best scores) on i.i.d. scores: DeepSeek-V3's 256 experts in 8 groups, top-4 groups, top-8
    experts, over 4 to 64 ranks. The distinct ranks a token reaches are within 6% of the model's
    count everywhere, and nearer it than the uniform count (which ignores the groups)."""
    import torch

    from disagmoe.model.router import group_limited_mask

    gen = torch.Generator().manual_seed(0)
    scores_NE = torch.rand(20000, 256, generator=gen)
    allowed_NE = group_limited_mask(scores_NE, 8, 4)
    topk_NK = scores_NE.masked_fill(~allowed_NE, -1.0).topk(8, dim=-1).indices
    for ranks in (4, 8, 16, 32, 64):
        rank_NK = topk_NK // (256 // ranks)
        sampled = torch.zeros(len(topk_NK), ranks, dtype=torch.bool).scatter_(1, rank_NK, True).sum(1).double().mean()
        grouped = ranks * float(st.rank_reach(256, 8, 1 / ranks, 8, 4))
        uniform = ranks * float(st.rank_reach(256, 8, 1 / ranks))
        assert grouped == pytest.approx(float(sampled), rel=0.06), ranks
        assert abs(grouped - float(sampled)) < abs(uniform - float(sampled)), ranks


def test_a_larger_share_of_the_pairs_is_reached_more_often_up_to_certainty():
    shares = np.linspace(0, 1, 41)
    reach = st.rank_reach(256, 8, shares)
    rising = np.diff(reach) > 0
    assert reach[0] == 0 and reach[-1] == 1 and np.all(rising | (reach[1:] == 1))
    assert st.rank_reach(8, 2, 7 / 8) == 1  # only one expert elsewhere: every top-2 choice lands here


def test_dispatch_rows_are_dense_on_one_gpu_and_sparse_across_several():
    m = load_model("deepseek-v3")
    sent, busiest, index = st.dispatch_rows(m, np.array([1, 8, 64]), 1.0)
    assert sent[0] == 1 and busiest[0] == 1 and index[0] == 0  # one GPU: every token, no index
    assert 1 < sent[1] < m.top_k and sent[2] < m.top_k and np.all(index[1:] == st.SPARSE_INDEX)
    np.testing.assert_allclose(busiest[1:] * np.array([8, 64]), sent[1:])  # balanced: the busiest is the mean
    _, hot, _ = st.dispatch_rows(m, 8, 2.0)  # a load histogram's peak twice the mean
    assert float(hot) == pytest.approx(float(st.rank_reach(m.num_experts, m.top_k, 2 / 8, 8, 4)))  # its groups
    assert hot > busiest[1]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_attention_recompute_is_one_more_forward_before_the_core(name):
    """`recompute_modules: [attention]` pays the q/k/v projections' (MLA: the low-rank chains')
    forward FLOPs again, not the output projection's and not the core's (its output is kept,
    `kernels.attention_core`); a few percent of a layer's step FLOPs at 4k tokens per sequence."""
    m, tokens, seq = load_model(name), 8192, 4096
    extra = st.attention_recompute(m, tokens)
    o_in = m.num_heads * (m.mla.v_head_dim if m.mla else m.head_dim)
    before_o = st.attention_projections(m, tokens).flops - 2.0 * tokens * o_in * m.hidden_size
    assert extra.flops == pytest.approx(before_o)
    assert 0 < extra.hbm_bytes < st.attention_projections(m, tokens).hbm_bytes * 2
    layer = 3 * (st.attention_projections(m, tokens).flops + st.routed_experts(m, tokens * m.top_k, m.num_experts).flops
                 + st.shared_experts(m, tokens).flops) + 3.5 * st.attention_core(m, tokens, seq).flops
    assert extra.flops / layer < 0.1


SETTINGS = [(dtype, kernel, clipped) for dtype in ("fp32", "bf16") for kernel in ("torch", "triton")
            for clipped in (True, False)]


def flat_adamw_passes(state_dtype: str, update_kernel: str, clipped: bool) -> dict[str, tuple[int, int]]:
    """FlatAdamW's passes of one step on a GPU bucket, (read, written) bytes per parameter of each, from
    the per-tensor sizes as the runtime's docstrings list them (runtime/state/flat_adamw.py, kernels/adamw.py)."""
    moment, fp32_moment = st.MOMENT[state_dtype], st.FP32
    passes = {"zero_grad": (0, st.MAIN_GRAD), "grad norm": (st.MAIN_GRAD, 0)}
    if update_kernel == "triton":  # one pass: master, grad, m, v in; master, m, v and the bf16 parameter out
        passes["adamw_update"] = (st.MASTER + st.MAIN_GRAD + 2 * moment, st.MASTER + 2 * moment + st.COMPUTE_PARAM)
        return passes
    if state_dtype == "bf16":  # `_step_rounded_moments`: fp32 copies of m and v
        passes["moments to fp32 copies"] = (2 * moment, 2 * fp32_moment)
    passes["fused AdamW"] = (st.MASTER + st.MAIN_GRAD + 2 * fp32_moment,
                             st.MASTER + 2 * fp32_moment + (st.MAIN_GRAD if clipped else 0))  # a clip: grad back
    if state_dtype == "bf16":
        passes["copies rounded into m, v"] = (2 * fp32_moment, 2 * moment)
    passes["masters -> parameters"] = (st.MASTER, st.COMPUTE_PARAM)
    return passes


@pytest.mark.parametrize("state_dtype, update_kernel, clipped", SETTINGS)
def test_the_optimizer_step_counts_the_passes_of_each_update_kernel_and_moment_dtype(state_dtype, update_kernel,
                                                                                     clipped):
    passes = flat_adamw_passes(state_dtype, update_kernel, clipped)
    update = [rw for name, rw in passes.items() if name not in ("zero_grad", "grad norm")]
    assert st.adamw_update_bytes(state_dtype, update_kernel, clipped) == (sum(r for r, _ in update),
                                                                          sum(w for _, w in update))
    per_param = sum(r + w for r, w in passes.values())
    params = np.array([1.0, 3e9])
    np.testing.assert_array_equal(st.optimizer_step(params, state_dtype, update_kernel, clipped).hbm_bytes,
                                  params * per_param)


def test_the_update_kernel_and_bf16_moments_each_move_fewer_bytes():
    """Triton's one pass beats torch's fused AdamW and copy for either moment dtype, bf16 moments
    beat fp32 in Triton's pass (torch widens them to fp32 copies: more bytes, not fewer), and only
    torch's update pays for the clip (the scaled gradient written back)."""
    step = lambda *setting: st.optimizer_step(1.0, *setting).hbm_bytes  # noqa: E731
    for dtype in ("fp32", "bf16"):
        assert step(dtype, "triton", True) < step(dtype, "torch", True)
        assert step(dtype, "triton", True) == step(dtype, "triton", False)
        assert step(dtype, "torch", True) - step(dtype, "torch", False) == st.MAIN_GRAD
    assert step("bf16", "triton", True) < step("fp32", "triton", True)
    assert step("bf16", "torch", True) > step("fp32", "torch", True)
    with pytest.raises(ValueError, match="update kernel 'cuda'"):
        st.optimizer_step(1.0, "fp32", "cuda", True)
    with pytest.raises(ValueError, match="state dtype 'fp16'"):
        st.optimizer_step(1.0, "fp16", "triton", True)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("clipped", [True, False])
def test_the_offloaded_step_is_torchs_update_plus_the_staging_traffic(state_dtype, clipped):
    """Offloaded buckets take torch's path whatever `optim.update_kernel` says (`FlatAdamW._step_offloaded`):
    torch's passes, the staging slots written and read once per link byte, the host link both ways."""
    from disagmoe.roofline.optimizer_state import host_link_bytes

    params, link = 5e8, host_link_bytes(state_dtype)
    offloaded = st.offloaded_optimizer_step(params, link, state_dtype, clipped)
    torch_passes = flat_adamw_passes(state_dtype, "torch", clipped)
    assert offloaded.hbm_bytes == pytest.approx(params * (sum(r + w for r, w in torch_passes.values()) + 2 * link))
    assert offloaded.host_bytes == params * link
    assert (offloaded.flops, offloaded.nvlink_bytes, offloaded.scaleout_bytes) == (0, 0, 0)


def test_paired_weight_gradient_launches_count_the_odd_micro_batch_alone():
    """`kernels.wgrad_pairs` pairs micro-batches in call order, the last of an odd count launching alone: over m
    micro-batches ceil(m / 2) launches (`main_grad_passes`), 2 floor(m / 2) of the micro-batches in a paired one
    (`paired_share`); unpaired, one launch each and none in a pair."""
    for m in range(1, 10):
        launches = [2] * (m // 2) + [1] * (m % 2)  # micro-batches per launch, as the kernel pairs them
        assert float(st.main_grad_passes(m, True)) == pytest.approx(len(launches) / m)
        assert float(st.paired_share(m, True)) == pytest.approx(sum(n for n in launches if n == 2) / m)
        assert (float(st.main_grad_passes(m, False)), float(st.paired_share(m, False))) == (1.0, 0.0)
    both = st.paired_share(np.array([3.0, 4.0, 3.0]), np.array([True, True, False]))
    assert both.tolist() == pytest.approx([2 / 3, 1.0, 0.0])
