"""The work of each stage of a MoE layer on one GPU: FLOPs and bytes per memory or link.

Every function takes per-GPU quantities (tokens an attention GPU processes, rows an expert GPU
receives, bytes a GPU sends) and returns a `Work`. Arithmetic is plain numpy-broadcastable
expressions, so the placement solver can price thousands of candidate layouts in one call by
passing arrays where these take numbers. bf16 activations and weights (2 bytes) throughout.

Backward passes: GEMMs cost twice their forward FLOPs (data gradient + weight gradient); the
attention core 2.5 times (FlashAttention's backward recomputes the score matrix). The routed
experts' backward is two stages, because its two halves are separate launches bound by different
roofs: the data gradients (compute) and the weight gradients, which add into the fp32 main
gradients (8 bytes of HBM traffic per expert parameter per micro-batch: memory-bound at a few
hundred rows per expert; 4 at a step's first launch where it stores, `kernels.first_touch`). Every other bf16 weight gradient is added into its fp32 main gradient
by its own elementwise kernel (`main_grad_add`). The optimizer counts every pass FlatAdamW makes
over the parameters in a step, as its update kernel and the moments' dtype make them
(`optimizer_step`). Norms, RoPE, layout copies and residual adds are priced by their HBM bytes
(`norms_and_residuals`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, get_args

import numpy as np

from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, Fp8DenseScaling, ModelConfig
from disagmoe.roofline.params import DenseLinear, attention_params, dense_linears, router_params

BF16 = 2
FP32 = 4
GEMM_BWD = 2.0
ATTN_CORE_BWD = 2.5
FP8_SCALE_GROUP = 128  # the blockwise FP8 recipes' fp32 scale: per 1 x 128 values of a row, per 128 x 128 weight block
# an e4m3 token-group copy's bytes a value (`kernels.fp8.quantize_token_groups`): one, and an fp32 scale per 128 tokens
FP8_TOKEN_GROUP_BYTES = 1 + FP32 / FP8_SCALE_GROUP
BLOCKWISE_MULTIPLE = 512  # `kernels.fp8_dense.BLOCKWISE_MULTIPLE`: a blockwise linear's dimensions (a test pins it)

Num = Any  # a float or a numpy array of floats (broadcastable)


@dataclass(frozen=True)
class Work:
    """What one stage asks of one GPU. Each field may be a number or an array of candidates."""

    flops: Num = 0.0
    hbm_bytes: Num = 0.0
    nvlink_bytes: Num = 0.0
    scaleout_bytes: Num = 0.0
    transfers: Num = 0.0  # one-sided messages on the critical path (each pays a put latency)
    collectives: Num = 0.0  # collective calls on the critical path (each pays their fixed cost)
    fixed_s: Num = 0.0  # measured fixed seconds (an op's launches, `HardwareConfig.calibration`)
    host_bytes: Num = 0.0  # over the host link, per direction (both directions run at once)

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Work)))

    def scale(self, k: Num) -> Work:
        return Work(*(getattr(self, f.name) * k for f in fields(Work)))

    def backward(self, flop_factor: float = GEMM_BWD, byte_factor: float = 2.0) -> Work:
        """The backward's work: more FLOPs and bytes, the same messages; no fixed cost (a
        backward op's own fixed cost is added where it is known)."""
        return Work(self.flops * flop_factor, self.hbm_bytes * byte_factor,
                    self.nvlink_bytes, self.scaleout_bytes, self.transfers, self.collectives)


def attention_io_per_token(m: ModelConfig) -> tuple[int, int, int]:
    """(q width, k width, v width) per token after projection, in elements."""
    if m.attention == "mla":
        assert m.mla is not None
        qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
        return m.num_heads * qk, m.num_heads * qk, m.num_heads * m.mla.v_head_dim
    return m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.num_kv_heads * m.head_dim


def attention_projections(m: ModelConfig, tokens: Num) -> Work:
    """q/k/v (or MLA's low-rank chains) and output projections of one layer."""
    weights = attention_params(m) - m.hidden_size  # minus the input norm
    q, k, v = attention_io_per_token(m)
    o_in = m.num_heads * (m.mla.v_head_dim if m.mla else m.head_dim)
    io = 2 * m.hidden_size + q + k + v + o_in
    return Work(flops=2.0 * tokens * weights, hbm_bytes=BF16 * (weights + tokens * io))


def dense_fp8_quantise(tokens: Num, inputs: Num, outputs: Num, scaling: str) -> tuple[Work, Work]:
    """(forward, backward) HBM passes, per call, of FP8 dense linears (`kernels.fp8_dense`) with
    `inputs` / `outputs` features per token summed over the linears: forward, each input row read in
    bf16 and written in e4m3; backward, the output gradients per token for the data gradient (the
    weight gradient runs in bf16 on the bf16 operands). `scaling` rowwise: one fp32 scale per row
    (negligible); blockwise: one per 1 x 128 group of the row, written beside it (`fp8.quantize_rows`,
    token-major: `fp8_dense.quantize_token_blocks`). The weights' two e4m3 copies are made once per
    optimizer step (`dense_fp8_weight_copies`), not per call."""
    per = BF16 + 1 + (FP32 / FP8_SCALE_GROUP if _blockwise(scaling) else 0.0)
    return Work(hbm_bytes=per * tokens * inputs), Work(hbm_bytes=per * tokens * outputs)


def fp8_expert_input_bytes(hidden: Num, tokens: Num, top_k: Num, once: Num) -> Num:
    """HBM bytes of the FP8 experts' input rows (e4m3, one fp32 scale per 1 x 128 group) for
    `tokens` tokens of `top_k` pairs each: `once` (where true) each token's bf16 row quantised once
    and its e4m3 row and scales copied to its pairs' rows (`kernels.permute.quantize_then_permute`:
    the copy reads a token's row once, its K pairs being neighbours in one program's block, and
    writes each pair's), else each pair's bf16 row quantised as it is (`fp8.quantize_rows` of the
    grouped rows, inside the FFN). The runtime quantises tokens once where that is the fewer of
    the two (`kernels.permute.quantises_tokens_once`, the same bytes: a test holds them together)."""
    row = hidden * (1 + FP32 / 128)  # a row in e4m3 with its scales
    quantise = hidden * BF16 + row
    return np.where(once, tokens * (quantise + (1 + top_k) * row), tokens * top_k * quantise)


def dense_fp8_weight_copies(weights: Num, scaling: str) -> Work:
    """The dense linears' e4m3 weight copies of one optimizer step (`fp8_dense.Fp8WeightCopies`,
    refreshed by `prepare_fp8`), W's for the forward and W^T's for the data gradient, of `weights`
    parameters under `scaling`: rowwise, two launches, each reading the bf16 weights and writing one
    copy (scaled per output feature, then per input feature; the scales negligible); blockwise, one
    launch reading them once and writing both copies, each with its fp32 scale per 128 x 128 block
    (`fp8.quantize_blocks(transposed_out=)`: the transpose's blocks are W's, nothing quantised twice)."""
    if _blockwise(scaling):
        return Work(hbm_bytes=(BF16 + 2 * (1 + FP32 / FP8_SCALE_GROUP**2)) * weights)
    return Work(hbm_bytes=2 * (BF16 + 1) * weights)


def dense_fp8_linears(m: ModelConfig, part: str, scaling: str) -> list[DenseLinear]:
    """The linears of one layer's `part` (`params.dense_linears`) whose GEMMs run in FP8 under
    `scaling`: every one rowwise; blockwise those with both dimensions multiples of
    BLOCKWISE_MULTIPLE (`fp8_dense.fits_blockwise`): the rest, such as MLA's kv_a (576 wide), keep
    their GEMMs in bf16 (`MoETransformer.set_dense_fp8`)."""
    linears = dense_linears(m, part)
    if not _blockwise(scaling):
        return linears
    return [lin for lin in linears
            if lin.in_features % BLOCKWISE_MULTIPLE == 0 and lin.out_features % BLOCKWISE_MULTIPLE == 0]


def dense_fp8_params(m: ModelConfig, part: str, scaling: str) -> int:
    """Parameters of one layer's FP8 dense linears of `part` under `scaling` (`dense_fp8_linears`)."""
    return sum(lin.in_features * lin.out_features for lin in dense_fp8_linears(m, part, scaling))


def dense_fp8_share(m: ModelConfig, part: str, scaling: str) -> float:
    """The share of one layer's `part`'s dense GEMM FLOPs (2 x parameters per token each) that run in
    FP8 under `scaling`: 1 rowwise, below it blockwise where a linear is off its grid."""
    every = sum(lin.in_features * lin.out_features for lin in dense_linears(m, part))
    return dense_fp8_params(m, part, scaling) / every if every else 1.0


def dense_fp8_weights(m: ModelConfig, moe_layers: Num, dense_layers: Num, scaling: str) -> Num:
    """Parameters of the FP8 dense linears of `moe_layers` MoE and `dense_layers` dense layers
    (attention in both, shared experts in the MoE ones, the FFN in the dense ones) under `scaling`."""
    shared = dense_fp8_params(m, "shared experts", scaling) if m.shared_ffn_size else 0
    return ((moe_layers + dense_layers) * dense_fp8_params(m, "attention", scaling) + moe_layers * shared
            + dense_layers * dense_fp8_params(m, "dense ffn", scaling))


def dense_fp8_quantise_passes(m: ModelConfig, tokens: Num, part: str, scaling: str) -> tuple[Work, Work]:
    """`dense_fp8_quantise` of one layer's `part` under `scaling`: "attention" (q/k/v or MLA's
    chains, and o), "shared experts" or "dense ffn" (SwiGLU: gate, up and down), as the run
    quantises under either scaling: the FP8 linears' inputs (`dense_fp8_linears`; blockwise keeps
    the ones off its grid in bf16, quantising nothing) in the model's order, the block input once for
    readers back to back (GQA's q, k, v; a SwiGLU's gate and up: `fp8_dense.quantize_input`) and
    again where another FP8 linear ran between (MLA's q_b before kv_a), and their output gradients.
    (Until session 34 the rowwise count read the hidden row once per reader, and MLA's chains by an
    estimate.)"""
    linears = dense_fp8_linears(m, part, scaling)
    inputs = sum(lin.in_features for i, lin in enumerate(linears)
                 if not (lin.reads_block_input and i and linears[i - 1].reads_block_input))
    return dense_fp8_quantise(tokens, inputs, sum(lin.out_features for lin in linears), scaling)


def _blockwise(scaling: str) -> bool:
    """Whether `scaling` (`kernels.fp8_dense.SCALINGS`) is blockwise; ValueError for another word."""
    if scaling not in get_args(Fp8DenseScaling):
        raise ValueError(f"unknown FP8 dense scaling {scaling!r}; choose one of {', '.join(get_args(Fp8DenseScaling))}")
    return scaling == "blockwise"


def attention_core(m: ModelConfig, tokens: Num, seq_len: Num) -> Work:
    """Causal softmax(QK^T)V: each query sees (S + 1) / 2 keys on average (flash, no S x S in HBM)."""
    q, k, v = attention_io_per_token(m)
    qk_dim = q // m.num_heads
    v_dim = (m.mla.v_head_dim if m.mla else m.head_dim)
    keys_seen = (seq_len + 1) / 2.0
    flops = 2.0 * tokens * keys_seen * m.num_heads * (qk_dim + v_dim)
    return Work(flops=flops, hbm_bytes=BF16 * tokens * (q + k + v + m.num_heads * v_dim))


def norms_and_residuals(m: ModelConfig, tokens: Num) -> tuple[Work, Work]:
    """(forward, backward) of one layer's elementwise kernels around the GEMMs and attention, each
    reading its inputs and writing its outputs once (bf16): the two RMSNorms (read and write H),
    the q/k norm and RoPE (read and write q and k; v and the attention's output are only viewed
    heads-first and back, token-major in memory: `model.attention.rope_heads`), the two residual
    adds (read 2H, write H). Their backwards: a norm reads x and d out and writes d x, RoPE reads
    and writes the gradients of q and k and reads the saved q, k, and each residual sums two
    gradients. These are the passes `bench calibrate`'s norms probe times (`norms_passes`), and its HBM
    rate is fitted against them: on a GPU the model fuses some of them (the attention's residual add with
    the FFN norm, `layers.add_rms_norm`; the FFN's residual add into the weighted combine), 3H fewer bytes
    forward and 2H backward, which a calibrated file prices as the probe's passes (at most a few tenths of
    a percent of a step over)."""
    q, k, _ = attention_io_per_token(m)
    H = m.hidden_size
    fwd = 2 * 2 * H + 2 * (q + k) + 2 * 3 * H
    bwd = 2 * 3 * H + 2 * (q + k) + (q + k) + 2 * 3 * H
    return Work(hbm_bytes=BF16 * tokens * fwd), Work(hbm_bytes=BF16 * tokens * bwd)


def router(m: ModelConfig, tokens: Num) -> Work:
    """Gate GEMM, scores in fp32, top-k."""
    w = router_params(m)
    return Work(flops=2.0 * tokens * w,
                hbm_bytes=BF16 * (w + tokens * m.hidden_size) + FP32 * tokens * m.num_experts)


def swiglu_ffn(hidden: int, ffn: Num, rows: Num, weight_copies: Num = 1) -> Work:
    """A SwiGLU FFN over `rows` rows; `weight_copies` distinct weight sets are read (experts)."""
    weights = 3.0 * hidden * ffn
    return Work(flops=2.0 * rows * weights,
                hbm_bytes=BF16 * (weights * weight_copies + rows * (2 * hidden + 3 * ffn)))


def routed_experts(m: ModelConfig, rows: Num, local_experts: Num) -> Work:
    """The expert GPU's grouped GEMMs: `rows` token-expert pairs over `local_experts` experts."""
    return swiglu_ffn(m.hidden_size, m.expert_ffn_size, rows, local_experts)


def expert_data_grads(m: ModelConfig, rows: Num, local_experts: Num) -> Work:
    """The routed experts' input gradient (down dgrad with the SwiGLU derivative, gate/up dgrad):
    the forward's FLOPs, and like it a read of every local expert's bf16 weights and of the rows."""
    return routed_experts(m, rows, local_experts)


def expert_weight_grads(m: ModelConfig, rows: Num, local_experts: Num, stored_share: Num = 0.0,
                        main_grad_passes: Num = 1.0, operand_bytes: Num = BF16) -> Work:
    """d w13 and d w2 of the local experts for one micro-batch's `rows`, added into their fp32 main
    gradients by the GEMMs themselves (the Triton backend under FlatAdamW): the forward's FLOPs; reads
    the rows' x, d y, activation and d gate/up, and reads and writes the fp32 main gradient of every
    local expert `main_grad_passes` times (1; paired micro-batches, `kernels.wgrad_pairs`: ceil(m / 2) /
    m, a launch per two), less a read where it is stored: `stored_share` of the micro-batches (first
    touch, `kernels.first_touch`: the bf16 Triton experts store at their weights' first launch of a
    step, what `zero_grad` no longer zeroes; 1 / micro-batches of a step's, none for the probe's
    accumulating launches). `operand_bytes`: a row value's bytes as the kernels read them (bf16; the
    all-FP8 backward's token-group copies `FP8_TOKEN_GROUP_BYTES`)."""
    H, F = m.hidden_size, m.expert_ffn_size
    weights = 3.0 * H * F * local_experts
    return Work(flops=2.0 * rows * 3.0 * H * F,
                hbm_bytes=operand_bytes * rows * (2 * H + 3 * F)
                + (2 * main_grad_passes - stored_share) * FP32 * weights)


def main_grad_passes(micro_batches: Num, paired: Num = False) -> Num:
    """The expert weight gradients' main-gradient passes per micro-batch (`expert_weight_grads`): 1, or
    paired (`kernels.wgrad_pairs`: a launch per two micro-batches, the odd one alone) ceil(m / 2) / m."""
    return np.where(paired, np.ceil(np.asarray(micro_batches) / 2) / micro_batches, 1.0)


def paired_share(micro_batches: Num, paired: Num = False) -> Num:
    """The share of a step's micro-batches whose expert weight gradients run in a paired launch (two
    micro-batches' rows, `kernels.wgrad_pairs`): all of an even count, all but the odd one of an odd count
    (its launch alone, one micro-batch's rows), none unpaired."""
    m = np.asarray(micro_batches)
    return np.where(paired, 2 * (m // 2) / m, 0.0)


def expert_passes(m: ModelConfig, rows: Num, local_experts: Num, stored_share: Num = 0.0,
                  main_grad_passes: Num = 1.0) -> dict[str, tuple[Work, Work]]:
    """The routed experts' stages as the step runs them, (forward, backward) work of each: `routed
    experts` (the forward; the data gradients) and `expert weight grads` (nothing; the weight
    gradients with their fp32 main-gradient read and write, `expert_weight_grads`). The one
    definition the planner prices (`placement.cost.evaluate`) and `bench calibrate` fits its
    expert curve against (`bench.calibrate.calibration_from`, through
    `roofline.calibration.fitted_fraction`): a curve point read back at the probe's own shape is
    the probe's measured time, so the two cannot count the traffic differently. `stored_share` and
    `main_grad_passes`: `expert_weight_grads`'s (the probe's launches accumulate: 0; one pass each)."""
    return {"routed experts": (routed_experts(m, rows, local_experts), expert_data_grads(m, rows, local_experts)),
            "expert weight grads": (Work(), expert_weight_grads(m, rows, local_experts, stored_share,
                                                                 main_grad_passes))}


def attention_projection_passes(m: ModelConfig, tokens: Num) -> tuple[Work, Work]:
    """(forward, backward) of the attention projections (the backward: data and weight gradients,
    twice the forward), as the planner prices them and `bench calibrate` fits its projection curve."""
    proj = attention_projections(m, tokens)
    return proj, proj.backward()


def attention_core_passes(m: ModelConfig, tokens: Num, seq_len: Num) -> tuple[Work, Work]:
    """(forward, backward) of the attention core, as the planner prices it and `bench calibrate`
    fits its attention curve against (the backward ATTN_CORE_BWD times the forward's FLOPs)."""
    core = attention_core(m, tokens, seq_len)
    return core, core.backward(ATTN_CORE_BWD)


def main_grad_add(params: Num) -> Work:
    """bf16 weight gradients added into their fp32 main gradients (FlatAdamW's post-accumulate
    hook, one elementwise kernel per parameter): read both, write the fp32 one."""
    return Work(hbm_bytes=(BF16 + 2 * FP32) * params)


def shared_experts(m: ModelConfig, tokens: Num) -> Work:
    if m.shared_ffn_size == 0:
        return Work()
    return swiglu_ffn(m.hidden_size, m.shared_ffn_size, tokens)


def dense_ffn(m: ModelConfig, tokens: Num) -> Work:
    return swiglu_ffn(m.hidden_size, m.dense_ffn_size, tokens)


# The FP8 experts' backward recipes (`kernels.fp8_ffn.BACKWARD_PRECISIONS`) whose w13 gradient runs in
# bf16 on the input rows: under expert_input they gather the rows again from the tokens into a bf16
# copy (`kernels.recompute.RowSource.rows`); "fp8"'s token-group quantiser reads them in place.
FP8_BACKWARDS_REGATHERING_ROWS = ("bf16-wgrad", "bf16")


EXPERT_RECOMPUTE_MODULES = frozenset({"expert_input", "expert_output", "expert_swiglu"})  # recompute: selective's default


def selective_recompute(m: ModelConfig, rows: Num, fp8: bool = False,
                        fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD,
                        modules: frozenset[str] = EXPERT_RECOMPUTE_MODULES) -> Work:
    """What `recompute: selective` of the expert `modules` dropped adds to the expert backward of
    `rows` rows (`kernels.moe_ffn`,
    `kernels.fused_moe`): expert_input gathers the input rows again (read and write [rows, H]),
    expert_swiglu writes the SwiGLU output once more (the down dgrad's epilogue computes it from
    h13 while loading it: no extra FLOPs), expert_output costs nothing (the routing weights'
    gradient comes from the backward's first GEMM). Memory-bound bytes, no FLOPs. With the FP8
    experts (`fp8`, `kernels.fp8_ffn`) the SwiGLU output costs nothing (their backward recomputes
    it in every run) and expert_input reads each row's int64 token index; then, by the backward
    recipe `fp8_backward`: "fp8"'s w13-gradient quantiser reads the input rows from their tokens
    instead of the kept rows (the same bytes), bf16-wgrad and bf16 (`FP8_BACKWARDS_REGATHERING_ROWS`)
    gather them again into bf16 rows for their bf16 w13 gradient (the permute's row copy once more:
    `permute_rows`). A module not in `modules` is kept, and costs nothing here."""
    gathers = "expert_input" in modules
    if fp8:
        if not gathers:
            return Work()
        regather = permute_rows(m, rows) if fp8_backward in FP8_BACKWARDS_REGATHERING_ROWS else Work()
        return Work(hbm_bytes=8 * rows) + regather
    row_bytes = 2 * m.hidden_size * gathers + m.expert_ffn_size * ("expert_swiglu" in modules)
    return Work(hbm_bytes=BF16 * rows * row_bytes)


def attention_recompute(m: ModelConfig, tokens: Num) -> Work:
    """What `recompute_modules: [attention]` (`kernels.recompute.ATTENTION`) adds to one layer's
    attention backward of `tokens` tokens: the forward of everything before the output projection
    once more: the pre-attention norm, the q/k/v projections (MLA's low-rank chains), qk-norm and
    RoPE (one forward of those elementwise kernels, less the o-projection's half and the residual).
    Not the attention core: its output and log-sum-exp are kept (`kernels.attention_core`), so its
    backward runs from them as in the plain run (where the GPU's SDPA is cuDNN, or flash with equal
    head counts; elsewhere the core's forward runs again, which this does not price)."""
    o_in = m.num_heads * (m.mla.v_head_dim if m.mla else m.head_dim)
    proj = attention_projections(m, tokens)
    o_proj = Work(flops=2.0 * tokens * o_in * m.hidden_size,
                  hbm_bytes=BF16 * (o_in * m.hidden_size + tokens * (o_in + m.hidden_size)))
    q, k, v = attention_io_per_token(m)
    elementwise = Work(hbm_bytes=BF16 * tokens * (2 * m.hidden_size + 2 * (q + k + v)))
    return proj + o_proj.scale(-1.0) + elementwise


def permute(m: ModelConfig, rows: Num) -> Work:
    """Gather rows into expert order and the weighted scatter back: read + write each row twice."""
    return Work(hbm_bytes=2.0 * 2 * BF16 * rows * m.hidden_size)


def permute_rows(m: ModelConfig, rows: Num) -> Work:
    """The gather alone, `permute`'s forward less the combine's: the bf16 row copy of `rows` grouped
    rows (`kernels.permute.copy_rows`), each read from its token and written grouped; not run where
    nothing reads the rows (FP8 experts given their e4m3 rows that recompute expert_input:
    `RoutedExperts.reads_rows`, `model/experts.py`)."""
    return Work(hbm_bytes=2.0 * BF16 * rows * m.hidden_size)


# `model/loss.py`'s chunk rule (roofline imports no torch; tests/roofline/test_memory.py pins the two together)
DEFAULT_CHUNK_TOKENS = 4096
LOGIT_BYTES_PER_CHUNK = 1 << 28


def loss_chunk_tokens(tokens: Num, vocab: int, logit_bytes: int = FP32) -> Num:
    """Tokens per chunk of the chunked LM-head loss (`model.loss.chunk_size` with its default) whose softmax
    holds `logit_bytes` a logit (torch's ops an fp32 copy; the fused kernel the logits' own dtype);
    `tokens` may be a numpy array (the planner's candidates)."""
    chunk = max(256, min(DEFAULT_CHUNK_TOKENS, LOGIT_BYTES_PER_CHUNK // (logit_bytes * vocab)))
    if isinstance(tokens, np.ndarray):
        return np.maximum(1, np.minimum(tokens, chunk))
    return max(1, min(tokens, chunk))


# HBM bytes of the chunked loss (`model.loss`), fused (`kernels.cross_entropy`, each chunk's d W summed by its GEMM
# in fp32) and by torch's ops: per bf16 logit, its GEMM's write, the softmax's passes (fused: read twice, written
# once over the logits; torch: an fp32 copy, log-sum-exp, subtract-exp, divide, cast back: 44) and the d h and
# d W GEMMs' reads; per element of d W [V, H] a chunk, the fp32 accumulator's read and write (torch: the bf16
# product written and read, its fp32 cast written, and the add's two reads and a write).
LOSS_LOGIT_BYTES = {True: 2 + 6 + 4, False: 2 + 44 + 4}
LOSS_WGRAD_BYTES = {True: 2 * FP32, False: 2 * BF16 + FP32 + 3 * FP32}


def lm_head(m: ModelConfig, tokens: Num, fused: bool = True) -> Work:
    """Final norm, vocabulary projection and cross-entropy as `model.loss` runs it, the forward's share: the
    loss computes its gradients in the forward, a chunk of tokens at a time, and `Work.backward` doubles this,
    so the forward holds the logits GEMM's FLOPs and a third of the bytes. Per chunk its GEMMs read the head's
    weight twice and the d W sum passes over [V, H] (`LOSS_WGRAD_BYTES`); per logit `LOSS_LOGIT_BYTES`; per
    token the hidden state read and d h written. `fused`: the fused kernel's chunks (twice the tokens at
    large vocabularies, `loss_chunk_tokens`), else torch's ops (`fused_loss: false`)."""
    V, H = m.vocab_size, m.hidden_size
    w = V * H
    chunks = np.ceil(tokens / loss_chunk_tokens(tokens, V, BF16 if fused else FP32))
    total = (LOSS_LOGIT_BYTES[fused] * tokens * V + chunks * (2 * BF16 + LOSS_WGRAD_BYTES[fused]) * w
             + 3 * BF16 * tokens * H)
    return Work(flops=2.0 * tokens * w, hbm_bytes=total / 3.0)


def embedding(m: ModelConfig, tokens: Num) -> Work:
    return Work(hbm_bytes=2.0 * BF16 * tokens * m.hidden_size)


def transfer(nbytes: Num, scaleout_fraction: Num) -> Work:
    """One-sided puts: bytes one GPU moves over its busier link direction, split by link."""
    return Work(nvlink_bytes=nbytes * (1.0 - scaleout_fraction),
                scaleout_bytes=nbytes * scaleout_fraction, transfers=1.0)


SPARSE_INDEX = 4  # bytes a sparse dispatch or combine row adds: its int32 token index


def _miss(num_experts: Num, held: Num, k: int) -> Num:
    """C(E - g, k) / C(E, k) as prod_{i < k} (E - g - i) / (E - i), each factor floored at 0: the
    chance that k of E experts (distinct, uniform) all miss the g experts one GPU holds."""
    E, g = np.asarray(num_experts, dtype=float), np.asarray(held, dtype=float)
    miss = np.ones(np.broadcast(E, g).shape)
    for i in range(k):
        miss = miss * np.maximum(E - g - i, 0.0) / np.maximum(E - i, 1.0)
    return miss


def rank_reach(num_experts: int, top_k: int, share: Num, num_groups: int = 1, topk_groups: int = 1) -> Num:
    """The probability that a token's top-k experts include at least one of the g = share x E
    experts one GPU holds, every k-subset of E equally likely (uniform routing without replacement):

        1 - C(E - g, k) / C(E, k)  =  1 - prod_{i < k} (E - g - i) / (E - i)

    The product form takes a continuous g, so a GPU's share of the routed pairs (from a load
    histogram) can stand in for g / E.

    Group-limited routing (`router.num_groups` G, `router.topk_groups` M: DeepSeek-V3's 8 and 4)
    concentrates a token's experts: its M groups are any M of the G alike, and each chosen group
    gives k / M of them (a group is chosen for its best experts, so it rarely gives none: the
    router on i.i.d. scores, in tests/roofline/test_stages.py, sends a token to within 6% of the
    ranks this counts, the uniform form up to 34% more). Groups and a GPU's experts are both
    contiguous ranges (the default expert map): a GPU with g <= E / G lies inside one group (one that
    straddles two is counted as inside one: exact where g divides E / G),
    reached with M / G x (1 - C(E / G - g, k / M) / C(E / G, k / M)); a GPU over c whole groups
    is reached when any of them is chosen, 1 - C(G - c, M) / C(G, M). A fractional k / M or c
    interpolates between the whole numbers around it."""
    E, k = float(num_experts), min(int(top_k), int(num_experts))
    g = np.clip(np.asarray(share, dtype=float) * E, 0.0, E)
    if num_groups <= 1:
        return 1.0 - _miss(E, g, k)
    G, M = int(num_groups), int(topk_groups)
    per_group, each = E / G, k / M
    low_k, high_k = math.floor(each), math.ceil(each)
    miss = _miss(per_group, np.minimum(g, per_group), low_k)
    miss = miss + (each - low_k) * (_miss(per_group, np.minimum(g, per_group), high_k) - miss)
    inside = M / G * (1.0 - miss)
    by_groups = np.array([1.0 - math.comb(G - c, M) / math.comb(G, M) for c in range(G + 1)])
    c = g / per_group
    low, high = np.clip(np.floor(c), 1, G).astype(int), np.clip(np.ceil(c), 1, G).astype(int)
    spanning = by_groups[low] + (c - low) * (by_groups[high] - by_groups[low])
    return np.where(c <= 1.0, inside, spanning)


def dispatch_rows(m: ModelConfig, ranks: Num, imbalance: Num = 1.0) -> tuple[Num, Num, Num]:
    """A MoE layer's dispatch over a set of `ranks` GPUs each holding E / ranks of the experts, as
    the runtime sends it (`runtime.stages.messages.dispatch_mode`: sparse where a set has more than
    one GPU): (rows a source sends per token, the share of a source's tokens the busiest GPU of
    the set receives, bytes a row adds). Sparse: a token goes to ranks x rank_reach(1 / ranks) GPUs
    on average (group-limited routing counted), the busiest GPU (`imbalance` times the mean share
    of pairs, a load histogram's peak) gets rank_reach(imbalance / ranks) of the tokens, and each row carries its token index.
    These are the bytes the nvshmem runtime moves (one Triton launch stores only the routed rows,
    `kernels.sparse_dispatch`); nccl and local move the worst-case buffer. Dense (one GPU): every
    token to every GPU."""
    ranks = np.asarray(ranks, dtype=float)
    share = 1.0 / np.maximum(ranks, 1.0)
    sparse = ranks > 1
    groups = (m.router.num_groups, m.router.topk_groups)
    sent = np.where(sparse, ranks * rank_reach(m.num_experts, m.top_k, share, *groups), ranks)
    busiest = np.where(sparse, rank_reach(m.num_experts, m.top_k, np.minimum(share * imbalance, 1.0), *groups), 1.0)
    return sent, busiest, np.where(sparse, SPARSE_INDEX, 0)


def all_to_all(nbytes: Num, scaleout_fraction: Num, ranks: Num = 2) -> Work:
    """One NCCL all-to-all among `ranks` GPUs: the same bytes as `transfer`, plus a collective's
    fixed cost; nothing at all among one rank (no peer: no call)."""
    return Work(nvlink_bytes=nbytes * (1.0 - scaleout_fraction),
                scaleout_bytes=nbytes * scaleout_fraction, collectives=np.where(np.asarray(ranks) > 1, 1.0, 0.0))


def ring_allreduce(nbytes: Num, ranks: Num, scaleout_fraction: Num) -> Work:
    """Ring all-reduce of `nbytes` over `ranks` GPUs: each sends 2 (n - 1) / n of the data."""
    ranks = np.maximum(ranks, 1)
    moved = 2.0 * (ranks - 1) / ranks * nbytes
    return Work(nvlink_bytes=moved * (1.0 - scaleout_fraction), scaleout_bytes=moved * scaleout_fraction,
                collectives=np.where(ranks > 1, 1.0, 0.0))


def ring_reduce_scatter(nbytes: Num, ranks: Num, scaleout_fraction: Num) -> Work:
    """Ring reduce-scatter of `nbytes` over `ranks` GPUs (ZeRO-1's gradient sum,
    `FlatAdamW.reduce_scatter`): each sends (n - 1) / n of the data."""
    ranks = np.maximum(ranks, 1)
    moved = (ranks - 1) / ranks * nbytes
    return Work(nvlink_bytes=moved * (1.0 - scaleout_fraction), scaleout_bytes=moved * scaleout_fraction,
                collectives=np.where(ranks > 1, 1.0, 0.0))


def ring_all_gather(nbytes: Num, ranks: Num, scaleout_fraction: Num) -> Work:
    """Ring all-gather of `nbytes` (the whole gathered tensor) over `ranks` GPUs (ZeRO-1's updated
    compute parameters): the same bytes on the links as a reduce-scatter."""
    return ring_reduce_scatter(nbytes, ranks, scaleout_fraction)


# Bytes per parameter of each tensor FlatAdamW's step touches (runtime/state/flat_adamw.py)
MASTER = FP32  # the fp32 master weight
MAIN_GRAD = FP32  # the fp32 main gradient
COMPUTE_PARAM = BF16  # the bf16 parameter the forward reads (the masters' compute copy)
MOMENT = {"fp32": FP32, "bf16": BF16}  # one AdamW moment (exp_avg or exp_avg_sq), by `optim.state_dtype`
UPDATE_KERNELS = ("torch", "triton")  # `optim.update_kernel`


def adamw_update_bytes(state_dtype: str, update_kernel: str, clipped: bool) -> tuple[int, int]:
    """(read, written) bytes per parameter of FlatAdamW's update, the masters' bf16 compute copy
    included, as `FlatAdamW.step` runs it on a GPU bucket (runtime/state/flat_adamw.py; the totals
    are kernels/adamw.py's docstring table). m and v are the moments, `MOMENT[state_dtype]` each:

        kernel  moments  pass                       read                     written
        torch   fp32     fused AdamW                master, grad, m, v 16    master, m, v 12 (+ grad 4 clipped)
                         masters -> parameters      master 4                 parameter 2
        torch   bf16     m, v into fp32 copies      m, v 4                   the copies 8
                         fused AdamW on the copies  master, grad, copies 16  master, copies 12 (+ grad 4 clipped)
                         copies rounded into m, v   the copies 8             m, v 4
                         masters -> parameters      master 4                 parameter 2
        triton  fp32     one pass (kernels.adamw)   master, grad, m, v 16    master, m, v, parameter 14
        triton  bf16     one pass                   master, grad, m, v 12    master, m, v, parameter 10

    Clipped, torch reads 20 and writes 18 with fp32 moments, 32 and 30 with bf16 ones (bf16:
    `_step_rounded_moments`). A clip hands torch's fused kernel `grad_scale` (the clip coefficient's
    inverse, `FlatAdamW.step`), and it writes the scaled gradient back; the Triton kernel divides in
    registers, so its bytes do not depend on the clip. The trainer passes a clip coefficient
    whenever `optim.grad_clip` > 0 (runtime/training/trainer.py, runtime/cluster/worker.py)."""
    if state_dtype not in MOMENT or update_kernel not in UPDATE_KERNELS:
        raise ValueError(f"state dtype {state_dtype!r} / update kernel {update_kernel!r}: the state dtype must be "
                         f"one of {sorted(MOMENT)}, the update kernel one of {list(UPDATE_KERNELS)}")
    moments = 2 * MOMENT[state_dtype]
    if update_kernel == "triton":
        return MASTER + MAIN_GRAD + moments, MASTER + moments + COMPUTE_PARAM
    fp32_moments = 2 * FP32  # torch's fused AdamW updates fp32 moments only
    read = MASTER + MAIN_GRAD + fp32_moments
    written = MASTER + fp32_moments + (MAIN_GRAD if clipped else 0)
    if state_dtype != "fp32":  # through fp32 copies: widened before the kernel, rounded back after it
        read, written = read + moments + fp32_moments, written + fp32_moments + moments
    return read + MASTER, written + COMPUTE_PARAM  # then the masters -> bf16 parameters pass


def optimizer_step(params: Num, state_dtype: str, update_kernel: str, clipped: bool,
                   first_touch_params: Num = 0, shards: Num = 1) -> Work:
    """FlatAdamW's passes over the parameters in one step (runtime/state/flat_adamw.py), bytes per
    parameter: zero the fp32 main gradients (write 4; not the `first_touch_params` ones, which the
    first weight-gradient launch of the step stores: `kernels.first_touch`), their norm (read 4:
    the trainer takes it every step), then the update with the compute copy (`adamw_update_bytes`:
    `optim.state_dtype`, `optim.update_kernel`, and `clipped` where `optim.grad_clip` > 0).
    Clipped, that is 46 with torch and fp32 moments, 70 with torch and bf16, 38 with triton and
    fp32, 30 with triton and bf16 (4 less for a first-touch parameter). ZeRO-1 over `shards` > 1
    GPUs (`optim.shard_states`, `FlatAdamW._step`): every main gradient is zeroed, the norm and the
    update run over the GPU's slice (1 / shards of the parameters); the updated slice is cast to
    the compute dtype into a temporary (the Triton update writes no compute copy there: it reads
    the master once more, 4 bytes; torch's path counts that pass already), and the all-gather reads
    the temporary (2) and writes the whole compute buffer (2 per parameter)."""
    zero, norm = MAIN_GRAD, MAIN_GRAD
    read, written = adamw_update_bytes(state_dtype, update_kernel, clipped)
    shards = np.maximum(shards, 1)
    recast = MASTER if update_kernel == "triton" else 0
    gathered = np.where(shards > 1, params / shards * (recast + COMPUTE_PARAM) + COMPUTE_PARAM * params, 0.0)
    return Work(hbm_bytes=params / shards * (norm + read + written) + (params - first_touch_params) * zero + gathered)


def offloaded_optimizer_step(params: Num, link_bytes: Num, state_dtype: str, clipped: bool,
                             first_touch_params: Num = 0, shards: Num = 1) -> Work:
    """`optimizer_step` with the masters and moments in host memory (`offload_optimizer`,
    runtime/state/offload.py): torch's update whatever `optim.update_kernel` says (`FlatAdamW._step_offloaded`
    runs `adamw_chunk`, torch's fused AdamW, on each chunk in the device slots, then writes the compute
    copy from the slot's masters), plus the staging slots written by the copies in and read by the
    copies out (`link_bytes` per parameter each way, `optimizer_state.host_link_bytes`), which cross the
    host link in both directions at once, overlapped with the update."""
    update = optimizer_step(params, state_dtype, "torch", clipped, first_touch_params, shards)
    return update + Work(hbm_bytes=2 * params * link_bytes, host_bytes=params * link_bytes)
