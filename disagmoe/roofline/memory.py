"""Activation memory of a training step: what the forward keeps for the backward, per token.

    attention_bytes(m, moe, value_bytes)      one token of one layer on the attention side
    combine_bytes(m, value_bytes)             the K expert-output rows a token's weighted combine keeps
    expert_row_bytes(m, value_bytes)          one (token, expert) row of the routed experts
    attention_grad_bytes, expert_row_grad_bytes   the gradients one layer's backward holds
    head_bytes(m, tokens, value_bytes, chunked, fused)   final norm, LM head and loss at their peak
    activation_bytes(m, tokens, value_bytes, chunked, ...)   one process's peak over one micro-batch
    fp8_emulate_transient_bytes(m, rows, value_bytes, forward)   `fp8_emulate`'s dequantised operands

`value_bytes` is the activations' dtype (2: bf16, 4: fp32); reductions keep fp32 where the model
does (router scores, the attention's log-sum-exp). `dropped` is what recomputation does not keep
(`TrainConfig.recompute_set`, `kernels/recompute.py`): selective's expert_input, expert_output,
expert_swiglu, attention leave the forward's terms and add to the backward's the transient it
recomputes (the regathered input rows, the SwiGLU output, the attention block's internals);
`recompute: full` (`FULL`) keeps of a layer only its input and routing (`block_input_bytes`; on
the distributed ranks `attention_half_kept_bytes`, `expert_token_bytes`) and its backward holds
the whole layer again (the plain run's terms) beside its gradients. `fp8` (precision fp8: the
experts in `kernels.fp8_ffn`) changes the expert rows' terms: the FP8 forward never keeps the
SwiGLU output (its backward recomputes it in every run), so expert_swiglu drops nothing more there
and expert_output is not built (no fused FP8 combine), and the backward holds beside its gradients
what its recipe (`fp8_backward`, `TrainConfig.fp8_expert_backward`) makes: e4m3 copies, and under
expert_input with the bf16-wgrad (default) and bf16 recipes the input rows gathered again
(`fp8_expert_row_grad_bytes`). These are estimates of what autograd saves,
read off the code (no allocator slack, no attention score matrix: the attention is flash). Where a
rank holds how many micro-batches comes from its program: `runtime/activation_memory.py` replays
it with these terms (roofline does not import the runtime); the planner prices the same terms.

Calibration: `configs/h200x2-qwen3-30b.yaml` in mode single, 8 micro-batches of 8,192 tokens,
peaked at 70.8 GiB on an H200 (docs/benchmarks.md, the a3ee5cb row; tests/roofline/test_memory.py).
"""

from __future__ import annotations

import numpy as np

from disagmoe.config import (DEFAULT_FP8_EXPERT_BACKWARD, DEFAULT_FP8_EXPERT_FORWARD, FP8_EXPERT_BACKWARDS, ModelConfig,
                              fp8_weight_copies)
from disagmoe.roofline.stages import EXPERT_RECOMPUTE_MODULES, FP32, Num, attention_io_per_token, loss_chunk_tokens


FP8_VALUE_BYTES = 1 + FP32 / 128  # an e4m3 value with its share of its 1 x 128 (or 128 x 1) group's fp32 scale


# The routed experts' SwiGLU weights by thirds of their parameters: w13 [E, H, 2F] two, w2 [E, F, H] one.
ROUTED_WEIGHT_THIRDS = {"w13": 2, "w2": 1}
FP8_BLOCK_SCALE_BYTES = FP32 / (128 * 128)  # a weight copy's fp32 scale per 128 x 128 block, per value


def fp8_weight_copy_shares(forward: str = DEFAULT_FP8_EXPERT_FORWARD,
                           backward: str = DEFAULT_FP8_EXPERT_BACKWARD) -> tuple[float, float]:
    """(quantised, held) per routed expert parameter under the FP8 experts' recipe (`forward`,
    `backward`; `config.fp8_weight_copies` says which e4m3 copies it reads, so makes): the fraction
    of the parameters quantised each optimizer step (their weight has a copy: its bf16 values read
    once) and the e4m3 values held per parameter (each copy one a value of its weight):
      both, fp8 or bf16-wgrad      (1, 2)       both, bf16      (1, 1)
      gate-up, fp8 or bf16-wgrad   (1, 5/3)     gate-up, bf16   (2/3, 2/3)
      down, fp8 or bf16-wgrad      (1, 4/3)     down, bf16      (1/3, 1/3)"""
    copies = fp8_weight_copies(forward, backward)
    quantised = sum(thirds for weight, thirds in ROUTED_WEIGHT_THIRDS.items()
                    if weight in copies or f"{weight}_t" in copies)
    held = sum(ROUTED_WEIGHT_THIRDS[name.removesuffix("_t")] for name in copies)
    return quantised / 3, held / 3


def fp8_weight_copy_bytes(routed_expert_params: Num, forward: str = DEFAULT_FP8_EXPERT_FORWARD,
                          backward: str = DEFAULT_FP8_EXPERT_BACKWARD) -> Num:
    """`precision: fp8`: the routed experts' e4m3 weight copies their recipe (`forward`, `backward`)
    reads, the forward's blocks and the transposes the data gradients read (1 byte a value each,
    `fp8_weight_copy_shares`: 2 bytes a parameter under the kernels' default recipe (both forward GEMMs),
    4/3 under a run's default (forward down, backward bf16-wgrad), 2/3 under forward gate-up with
    backward bf16), with one fp32 scale per 128 x 128 block of each: held beside the bf16
    weights for the whole run (`kernels.fp8_ffn.Fp8ExpertWeights`)."""
    return fp8_weight_copy_shares(forward, backward)[1] * routed_expert_params * (1 + FP8_BLOCK_SCALE_BYTES)


# `kernels.fp8_ffn.DEQUANTIZE_PIECE`: the values one piece of an emulated dequantisation widens to fp32 at
# a time, with their three fp32 temporaries (the e4m3 values widened, the scales expanded, their product)
# (roofline imports no torch; a test pins the two together)
EMULATE_PIECE_VALUES = 1 << 25
EMULATE_PIECE_FP32_TENSORS = 3


def fp8_emulate_transient_bytes(m: ModelConfig, rows: int, value_bytes: int, forward: str,
                                experts: int | None = None) -> int:
    """`fp8_emulate`: the most one layer's emulated FP8 expert forward (`kernels.fp8_ffn._emulated_forward`)
    holds beside what the layer keeps, over `rows` rows of `experts` experts (default the model's): for
    each GEMM it emulates (`forward`: both, gate-up or down) its A rows and weights dequantised to the
    run's dtype ([rows, K] and [E, K, N], made per call and dropped after it), beside one piece's fp32
    temporaries; the gate/up GEMM's are dropped before the down GEMM's are made, so the larger counts.
    Not counted: the dense projections' emulated GEMMs (fp64 operands of one projection at a time)."""
    experts = m.num_experts if experts is None else experts
    hidden, ffn = m.hidden_size, m.expert_ffn_size
    gemms = {"gate-up": (hidden, 2 * ffn), "down": (ffn, hidden)}  # (K, N) of each FP8 GEMM
    return max((value_bytes * (rows * k + experts * k * n)
                + EMULATE_PIECE_FP32_TENSORS * FP32 * min(EMULATE_PIECE_VALUES, max(rows * k, experts * k * n)))
               for name, (k, n) in gemms.items() if forward in (name, "both"))


def attention_values(m: ModelConfig, moe: bool) -> int:
    """Values (in the compute dtype) one token keeps in one layer on the attention side: the two
    norms' inputs, the projections' input, q/k before qk-norm, q, k, v and the attention output
    as SDPA saves them, the FFN norm's output (router, dispatch and shared experts read it), the
    shared experts' or dense FFN's SwiGLU. The routed combine's rows are `combine_bytes`."""
    q, k, v = attention_io_per_token(m)
    o_in = m.num_heads * (m.mla.v_head_dim if m.mla else m.head_dim)
    qk_norm = q + k if m.qk_norm and m.attention != "mla" else 0
    common = 3 * m.hidden_size + q + k + v + o_in + qk_norm + m.hidden_size
    return common + 4 * (m.shared_ffn_size if moe else m.dense_ffn_size)  # SwiGLU: gate, up, silu, product


def attention_recomputed_values(m: ModelConfig) -> int:
    """Compute-dtype values per token per layer that `attention` recomputation
    (`kernels.recompute.ATTENTION`) drops from `attention_values`: the pre-attention norm's output
    (the projections' input), q/k before qk-norm, q, k, v as SDPA saves them. It keeps the block's
    input (the norm's input: the checkpoint's) and the core's output (the output projection's
    input) with SDPA's log-sum-exp (`kernels.attention_core.KeptCore`: the core's backward starts
    from them, the core does not run again); the backward holds the dropped values again for the
    layer's span (`attention_grad_bytes`)."""
    q, k, v = attention_io_per_token(m)
    qk_norm = q + k if m.qk_norm and m.attention != "mla" else 0
    return m.hidden_size + q + k + v + qk_norm


def attention_fp32_values(m: ModelConfig, moe: bool) -> int:
    """fp32 values per token per layer on the attention side: SDPA's log-sum-exp per head; in a
    MoE layer the router's scores (and logits, with a z-loss). The gate's weight gradient reads
    the FFN norm's output in the activations' dtype (`model.router.router_logits`: no fp32 copy),
    which `attention_values` counts already."""
    if not moe:
        return m.num_heads
    return m.num_heads + m.num_experts * (2 if m.router.z_loss_coef > 0 else 1)


def attention_recomputed_bytes(m: ModelConfig, value_bytes: int) -> int:
    """Bytes per token per layer `attention` recomputation drops (`attention_recomputed_values`)."""
    return value_bytes * attention_recomputed_values(m)


NOTHING_DROPPED: frozenset[str] = frozenset()
SELECTIVE: frozenset[str] = EXPERT_RECOMPUTE_MODULES  # recompute: selective's default
BLOCK = "block"  # `recompute: full` (`kernels.recompute.BLOCK`): a block keeps its input and its routing
FULL: frozenset[str] = frozenset({BLOCK})
# What `recompute: full` keeps of a (token, k) pair's routing (`kernels.recompute.SavedRouting`): its
# top-k id (int64) and its grouped row, the permutation derived from the ids (int64 in plain torch,
# int32 from the Triton permute: counted at the larger). On an expert rank: its local expert id
# (int32, the received one) and the permutation.
ROUTING_BYTES_PER_PAIR = 8 + 8
EXPERT_ROUTING_BYTES_PER_PAIR = 4 + 8


def block_input_bytes(m: ModelConfig, moe: bool, value_bytes: int) -> int:
    """Bytes one token keeps in one whole layer in one process under `recompute: full`: the
    block's input (the residual stream entering it, the checkpoint's input) and, in a MoE layer,
    its routing (`ROUTING_BYTES_PER_PAIR` per pair); the rest runs again in the backward."""
    return value_bytes * m.hidden_size + (m.top_k * ROUTING_BYTES_PER_PAIR if moe else 0)


def attention_half_kept_bytes(m: ModelConfig, moe: bool, value_bytes: int) -> int:
    """Bytes one token keeps in one layer on an attention rank under `recompute: full`: the
    segment's input (its checkpoint's) and the outputs its backward starts from, referenced until
    then as the backward's roots and the messages' sources: a dense layer's output; a MoE layer's
    h (the residual stream sent on), the FFN-normed rows and routing weights (dispatched), the
    shared experts' output, and the router's ids (int64)."""
    if not moe:
        return value_bytes * 2 * m.hidden_size
    shared = m.hidden_size if m.shared_ffn_size else 0
    return value_bytes * (3 * m.hidden_size + shared + m.top_k) + 8 * m.top_k


def attention_bytes(m: ModelConfig, moe: bool, value_bytes: int, dropped: frozenset[str] = frozenset()) -> int:
    """Bytes one token keeps in one layer on the attention side until its backward (less what
    `attention` recomputation drops, where `dropped` names it; under `recompute: full` only
    `attention_half_kept_bytes`)."""
    if BLOCK in dropped:
        return attention_half_kept_bytes(m, moe, value_bytes)
    kept = value_bytes * attention_values(m, moe) + FP32 * attention_fp32_values(m, moe)
    return kept - (attention_recomputed_bytes(m, value_bytes) if "attention" in dropped else 0)


def combine_bytes(m: ModelConfig, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED) -> int:
    """The weighted combine keeps the K expert-output rows of a token (`kernels.permute.combine_rows`):
    on the attention side in one process, on the expert rank with the compact hop; none where
    expert_output is dropped (`kernels.fused_moe`) or the whole layer is (`recompute: full`)."""
    return 0 if "expert_output" in dropped or BLOCK in dropped else value_bytes * m.top_k * m.hidden_size


def expert_row_values(m: ModelConfig, dropped: frozenset[str] = NOTHING_DROPPED, fp8: bool = False) -> int:
    """Values of one (token, expert) row in the routed experts: the input row (unless
    expert_input is dropped: the tokens are kept anyway), the gate/up pre-activations (2F) and the
    SwiGLU output (F, unless expert_swiglu is dropped, or never under `fp8`: the FP8 experts keep
    the bf16 input rows and h13 only, `kernels.fp8_ffn`), as the Triton experts save them."""
    row_in = 0 if "expert_input" in dropped else m.hidden_size
    swiglu = 0 if fp8 or "expert_swiglu" in dropped else m.expert_ffn_size
    return row_in + 2 * m.expert_ffn_size + swiglu


def expert_row_bytes(m: ModelConfig, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                     fp8: bool = False) -> int:
    """Bytes one (token, expert) row keeps on its expert rank (`expert_row_values`); under
    `recompute: full` only its routing: its weight and `EXPERT_ROUTING_BYTES_PER_PAIR`."""
    if BLOCK in dropped:
        return value_bytes + EXPERT_ROUTING_BYTES_PER_PAIR
    return value_bytes * expert_row_values(m, dropped, fp8)


def expert_token_bytes(m: ModelConfig, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                       pair_rows: bool = False) -> int:
    """Bytes per received token an expert rank keeps beside its rows: under `recompute: full` the
    received row (its recomputation's input) and, returning partial sums, the token's partial sum
    (its backward's root; pair rows land in the receiver's buffer); else none counted (the rows
    are `expert_row_bytes`)."""
    if BLOCK not in dropped:
        return 0
    return value_bytes * m.hidden_size * (1 if pair_rows else 2)


def attention_grad_bytes(m: ModelConfig, moe: bool, value_bytes: int, dropped: frozenset[str] = frozenset()) -> int:
    """Gradient bytes per token one layer's attention-side backward holds: d y of each projection
    (q, k, v, output; the SwiGLU's gate, up and down). Deferred weight gradients
    (`kernels.deferral`) keep them, with their saved inputs, until the held-back work runs at the
    op's end; without deferral they live through the layer's backward all the same. With `attention`
    recomputed the backward also holds what it runs again (`attention_recomputed_bytes`)."""
    if BLOCK in dropped:  # `recompute: full`: the half runs again whole, beside its gradients
        return attention_bytes(m, moe, value_bytes) + attention_grad_bytes(m, moe, value_bytes)
    q, k, v = attention_io_per_token(m)
    ffn = m.shared_ffn_size if moe else m.dense_ffn_size
    recomputed = attention_recomputed_bytes(m, value_bytes) if "attention" in dropped else 0
    return value_bytes * (q + k + v + m.hidden_size + (2 * ffn + m.hidden_size if ffn else 0)) + recomputed


def expert_row_grad_bytes(m: ModelConfig, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                          fp8: bool = False, fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD,
                          fused_copies: bool = True) -> int:
    """Gradient bytes per (token, expert) row an expert backward holds: d y and d h13 (the
    weight-gradient GEMMs' operands, kept until they run), and what it recomputes for them: the
    regathered input row (expert_input), the SwiGLU output (expert_swiglu); under `recompute:
    full` the whole row again with its combine share (the partial sums' hop; pair rows hold no
    combine rows there: counted all the same). Under `fp8` what the backward recipe `fp8_backward`
    holds (`fp8_expert_row_grad_bytes`, `fused_copies` as there)."""
    if BLOCK in dropped:
        recomputed = expert_row_bytes(m, value_bytes, fp8=fp8) + combine_bytes(m, value_bytes) // m.top_k
        return recomputed + expert_row_grad_bytes(m, value_bytes, fp8=fp8, fp8_backward=fp8_backward,
                                                  fused_copies=fused_copies)
    if fp8:
        return fp8_expert_row_grad_bytes(m, value_bytes, "expert_input" in dropped, fp8_backward, fused_copies)
    H, F = m.hidden_size, m.expert_ffn_size
    recomputed = (H if "expert_input" in dropped else 0) + (F if "expert_swiglu" in dropped else 0)
    return value_bytes * (H + 2 * F + recomputed)


def fp8_expert_row_grad_bytes(m: ModelConfig, value_bytes: int, input_dropped: bool, backward: str,
                              fused_copies: bool = True) -> int:
    """Gradient bytes per row the FP8 experts' backward (`kernels.fp8_ffn`) holds under `backward`
    (`TrainConfig.fp8_expert_backward`, `kernels.fp8_ffn.BACKWARD_PRECISIONS`), `input_dropped` with
    expert_input recomputed (the rows kept as their tokens, `RowSource`). Every recipe recomputes the
    SwiGLU output in every run (whatever expert_swiglu says) and holds d y and d h13.
      "fp8"         the e4m3 copies of d y, act, d h13 and x (`FP8_VALUE_BYTES`), each dropped after
                    the one GEMM that reads it, and no input row: the w13 gradient's token-group
                    quantiser reads the rows from their tokens in place. d y and d h13 are each
                    quantised both ways (two passes, `fp8_ffn._quantize_both_ways`), so their two copies
                    live together: d y's (1 x 128 rows and token groups: 2H) through the d h13 GEMM, then
                    d y's token groups and
                    act's (H + F) through the w2 gradient, after which act (bf16) is dropped too; then
                    d h13's two (4F) through the dx GEMM, x's and d h13's token groups (H + 2F) through
                    the w13 gradient. With `fused_copies` the split SwiGLU-gradient pass writes d h13's
                    1 x 128 rows (Hopper, a step not counting its numerics), that copy (2F) alive from
                    the pass through the w2 gradient too. The peak is the larger of the first half (act
                    alive) and the second (act dropped).
      "bf16-wgrad"  d y's and d h13's 1 x 128 rows, each through its data gradient; where the split
                    SwiGLU pass quantises d h13 as it writes it (a step not counting its numerics,
                    `fp8_ffn._down_data_gradient`; `fused_copies`), d h13's copy joins d y's there and lives through
                    the w2 gradient. The w13 gradient (bf16) reads the input rows, gathered again from
                    the tokens into a [N, H] copy under expert_input (`RowSource.rows`), alive beside
                    d y and d h13 until that GEMM returns (act and the e4m3 copies are dropped by then).
                    The peak is the larger of the d h13 GEMM and its pass (act, d y's and d h13's rows)
                    and the w13 gradient: the copy sets it only where H exceeds about 6F with the fused
                    copies (bf16: 4H + 4F against 3.03H + 10.06F), about 4.1F without them (3.03H + 8F).
      "bf16"        the bf16 experts' backward (`moe_ffn.moe_ffn_backward`) with the SwiGLU output
                    recomputed: under expert_input the rows gathered again before it, alive throughout.
    On Hopper the d h13 GEMM runs split (`fp8_ffn._GluonChoices.swiglu`): the Gluon GEMM writes
    d act [F], read by the SwiGLU-gradient pass that writes d h13 and act, so d act is alive beside
    them there (counted on every GPU: an upper bound where the fused kernel runs).
    `fused_copies`: whether that pass writes d h13's e4m3 rows beside its work (counted on every GPU where
    asked: an upper bound where the split pass does not run): a one-GPU step that does not count its FP8
    numerics (`TrainConfig.counters_every` > 1); never on a distributed rank, which counts every step and
    quantises d h13 in a pass of its own (after the w2 gradient: its rows alive through the dx GEMM alone)."""
    if backward not in FP8_EXPERT_BACKWARDS:
        raise ValueError(f"FP8 experts' backward {backward!r}: choose one of {', '.join(FP8_EXPERT_BACKWARDS)}")
    if backward == "bf16":
        recomputed = {"expert_swiglu", "expert_input"} if input_dropped else {"expert_swiglu"}
        return expert_row_grad_bytes(m, value_bytes, frozenset(recomputed))
    H, F = m.hidden_size, m.expert_ffn_size
    fused = 2 * F if fused_copies else 0  # d h13's e4m3 rows from the split SwiGLU-gradient pass on
    if backward == "bf16-wgrad":
        d_h13_gemm = value_bytes * (H + 4 * F) + FP8_VALUE_BYTES * (H + fused)  # d act alive, d y's e4m3 rows
        w13_gradient = value_bytes * (H + 2 * F + (H if input_dropped else 0))
        return int(max(d_h13_gemm, w13_gradient))
    with_act = max(value_bytes * (H + 4 * F) + FP8_VALUE_BYTES * (2 * H + fused),  # the d h13 GEMM, d act alive
                   value_bytes * (H + 3 * F) + FP8_VALUE_BYTES * (H + F + fused))  # the w2 gradient
    return int(max(with_act, _fp8_backward_without_act(m, value_bytes)))


def _fp8_backward_without_act(m: ModelConfig, value_bytes: int) -> float:
    """The all-FP8 backward's second half per row (`fp8_expert_row_grad_bytes`): d y and d h13 (bf16) with d
    h13's two e4m3 copies through the dx GEMM, then x's and d h13's token groups through the w13 gradient."""
    H, F = m.hidden_size, m.expert_ffn_size
    return value_bytes * (H + 2 * F) + FP8_VALUE_BYTES * max(4 * F, H + 2 * F)


def paired_first_held_bytes(m: ModelConfig, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                            fp8: bool = False, fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD,
                            fused_copies: bool = True) -> int:
    """Bytes per row that the first expert backward of a pair (`kernels.wgrad_pairs`: the one that leaves its
    operands waiting) holds over its own span beyond `expert_row_grad_bytes`, because a weight-gradient operand
    it would have dropped part-way waits instead (the replay and the planner add it to that op alone;
    the waiting rows themselves count from the op's end, `paired_wgrad_waiting_bytes`):
      FP8 "fp8"          the w2 gradient's token-group copies (d y's H, act's F) through d h13's copies, the dx
                         GEMM and x's copy: the second half's peak plus H + F e4m3 values, where that passes the
                         first half's (with `fused_copies`, as `fp8_expert_row_grad_bytes`, none at Qwen3's or
                         Mixtral's shape, where the d h13 GEMM's half, with d h13's rows from the split SwiGLU pass,
                         is higher: by 17.2 kB a row at Mixtral's; without, 12.4 kB a row at Mixtral's);
      FP8 "bf16-wgrad"   act (F values) through the w13 gradient: up to F more where that GEMM's half nears or
                         passes the d h13 GEMM's (the input regathered, H past about 6F with the fused copies, 4.1F
                         without: `fp8_expert_row_grad_bytes`),
                         else none;
      bf16 experts, FP8 "bf16"   0: what waits is kept by the forward or held to the op's end anyway.
    `recompute: full` recomputes the row beside every phase alike: the same difference. Per row, as
    `expert_row_grad_bytes` counts the backward's e4m3 copies: each group's padding to 128 rows not counted
    (the waiting rows themselves count it, `paired_wgrad_waiting_bytes`)."""
    if not fp8 or fp8_backward == "bf16":
        return 0
    H, F = m.hidden_size, m.expert_ffn_size
    input_dropped = "expert_input" in dropped
    if fp8_backward == "fp8":
        paired = _fp8_backward_without_act(m, value_bytes) + FP8_VALUE_BYTES * (H + F)
    else:
        paired = value_bytes * (H + 3 * F + (H if input_dropped else 0))
    return int(max(0, paired - fp8_expert_row_grad_bytes(m, value_bytes, input_dropped, fp8_backward, fused_copies)))


def _larger(a: Num, b: Num) -> Num:
    """max of two byte counts, elementwise where either is a numpy array (the planner's candidates)."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def head_bytes(m: ModelConfig, tokens: Num, value_bytes: int, chunked: bool = True, fused: bool = False) -> Num:
    """Bytes the final norm, LM head and loss of `tokens` tokens hold at their peak.

    Chunked (`model.loss.linear_cross_entropy`: every fast path) the logits never exist whole: the
    forward keeps d h [N, H] and an fp32 d W [V, H] for the backward and holds one chunk's logits at
    a time; the backward holds d h scaled by the incoming gradient beside them (d W is added into the
    main gradient in place, where there is one: every bf16 run's FlatAdamW). By torch's ops (`fused`
    False: the CPU, `fused_loss: false`) a chunk's logits sit beside their fp32 copy and log-sum-exp's
    fp32 temporary, and each chunk's d W product beside its fp32 cast and the chunk's gradients; fused (a GPU
    run's default) the softmax works over the logits themselves, chunks hold twice the tokens at half
    the bytes a logit (`loss_chunk_tokens`), and each chunk's d W is summed into the fp32 one by the
    GEMM (`addmm` with `out_dtype`, torch >= 2.9: bf16 operands; fp32 ones form the product).
    Unchunked (the fp32 oracle's `F.cross_entropy`): the logits and log-probabilities [N, V] are
    kept, and their gradient joins them in the backward."""
    H, V = m.hidden_size, m.vocab_size
    norm_in = tokens * value_bytes * H
    if not chunked:
        return norm_in + tokens * 3 * FP32 * V
    kept = norm_in + tokens * value_bytes * H + FP32 * V * H
    scaled_dh = tokens * value_bytes * H
    fp32 = value_bytes >= FP32  # a .float() of an fp32 tensor is itself; an fp32 GEMM's d W is not fused
    if fused:
        logits = loss_chunk_tokens(tokens, V, value_bytes) * V * value_bytes
        return kept + _larger(logits + (V * H * FP32 if fp32 else 0), scaled_dh)
    logits = loss_chunk_tokens(tokens, V) * V
    if fp32:  # the logits and log-sum-exp's temporary; the gradients and d W's product
        softmax, wgrad = logits * 2 * FP32, logits * FP32 + V * H * FP32
    else:  # the logits, their fp32 copy and log-sum-exp's temporary; the gradients, d W's product and its cast
        softmax, wgrad = logits * (value_bytes + 2 * FP32), logits * value_bytes + V * H * (value_bytes + FP32)
    return kept + _larger(_larger(softmax, wgrad), scaled_dh)


# The share of a device a setting chosen for speed may plan for (`micro_batches: auto`, `expert_wgrad_pairs:
# auto`, in the single trainer and the planner alike). It covers what the model does not count: the CUDA
# context, cuBLAS/Triton workspaces and the allocator's fragmentation (measured peaks on one H200 were 0.3-3%
# above the predicted ones, docs/benchmarks.md), so a setting chosen is not the one that runs out of memory.
MEMORY_HEADROOM = 0.85


# a token group's rows (`kernels.fp8_rounding.SCALE_BLOCK`): each expert group is padded to a multiple of it
FP8_TOKEN_GROUP_ROWS = 128


def fp8_token_group_rows(rows: Num, groups: Num) -> Num:
    """Rows of a token-group copy of `rows` expert rows in `groups` groups as the quantiser sizes it from shapes
    (`kernels.fp8.padded_capacity`: each group adds at most 127 padding rows, the whole a multiple of 128; a
    test pins the two together)."""
    return -(-(rows + (FP8_TOKEN_GROUP_ROWS - 1) * groups) // FP8_TOKEN_GROUP_ROWS) * FP8_TOKEN_GROUP_ROWS


def paired_wgrad_waiting_bytes(m: ModelConfig, rows: Num, groups: Num, value_bytes: int,
                               fp8_token_groups: bool = False) -> Num:
    """What one MoE layer's expert backward leaves waiting for the next micro-batch's under paired expert
    weight gradients (`kernels.wgrad_pairs`), for its `rows` expert rows in `groups` expert groups: the two
    weight gradients' operands x [H], d y [H], act [F] and d h13 [2F] a row, in the compute dtype
    (`value_bytes`), whatever recomputation dropped (the backward made them). With `fp8_token_groups` (the
    all-FP8 backward, `fp8_expert_backward: fp8`) their 128 x 1 e4m3 copies wait instead
    (`wgrad_pairs.fp8_weight_grad_into`): each group's rows padded to a multiple of 128
    (`fp8_token_group_rows`), one fp32 scale per 128 rows of a column. A distributed rank's rows are its
    received rows of the layer (`runtime.activation_memory.rank_activations`)."""
    values = 2 * m.hidden_size + 3 * m.expert_ffn_size
    if not fp8_token_groups:
        return rows * values * value_bytes
    padded = fp8_token_group_rows(rows, groups)
    return padded * values + padded // FP8_TOKEN_GROUP_ROWS * values * FP32


def paired_wgrad_held_bytes(m: ModelConfig, tokens: Num, value_bytes: int, fp8_token_groups: bool = False) -> Num:
    """One GPU's rows waiting under paired expert weight gradients (mode single): one micro-batch of `tokens`
    tokens, its K rows in every MoE layer over all the experts (`paired_wgrad_waiting_bytes` of each layer),
    alive beside the next micro-batch's forward and backward; the single trainer's memory check and the
    planner's one-GPU candidates both count it so."""
    return m.num_moe_layers * paired_wgrad_waiting_bytes(m, tokens * m.top_k, m.num_experts, value_bytes,
                                                         fp8_token_groups)


def layer_bytes(m: ModelConfig, moe: bool, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                fp8: bool = False) -> int:
    """One token of one whole layer in one process: attention side, combine and its K expert rows
    (under `recompute: full` its input and routing, `block_input_bytes`; `fp8`: FP8 experts)."""
    if BLOCK in dropped:
        return block_input_bytes(m, moe, value_bytes)
    if not moe:
        return attention_bytes(m, False, value_bytes, dropped)
    return (attention_bytes(m, True, value_bytes, dropped) + combine_bytes(m, value_bytes, dropped)
            + m.top_k * expert_row_bytes(m, value_bytes, dropped, fp8))


def layer_grad_bytes(m: ModelConfig, moe: bool, value_bytes: int, dropped: frozenset[str] = NOTHING_DROPPED,
                     fp8: bool = False, fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD,
                     fused_copies: bool = True) -> int:
    """One token of one whole layer's backward in one process (`attention_grad_bytes` and the K rows');
    under `recompute: full` the layer's whole activations again beside them (one block at a time).
    `fp8_backward`: the FP8 experts' backward recipe, `fused_copies` as there (`expert_row_grad_bytes`)."""
    if BLOCK in dropped:
        return layer_bytes(m, moe, value_bytes, fp8=fp8) + layer_grad_bytes(m, moe, value_bytes, fp8=fp8,
                                                                            fp8_backward=fp8_backward,
                                                                            fused_copies=fused_copies)
    rows = m.top_k * expert_row_grad_bytes(m, value_bytes, dropped, fp8, fp8_backward, fused_copies) if moe else 0
    return attention_grad_bytes(m, moe, value_bytes, dropped) + rows


def activation_bytes(m: ModelConfig, tokens: int, value_bytes: int, chunked: bool = True,
                     dropped: frozenset[str] = NOTHING_DROPPED, fp8: bool = False,
                     fp8_backward: str = DEFAULT_FP8_EXPERT_BACKWARD, forward_transient: int = 0,
                     fused_copies: bool = True, fused_loss: bool = False) -> int:
    """Peak bytes of one process's forward and backward of `tokens` tokens (one micro-batch:
    gradient accumulation runs each micro-batch's backward before the next forward): every
    layer's activations, plus the largest of the head's peak, one layer's backward (under
    `recompute: full`: every layer's input and routing, plus the larger of the head's peak and
    one layer recomputed whole with its backward's gradients) and `forward_transient`, what one
    layer's forward holds for its span only (e.g. `fp8_emulate_transient_bytes`), counted as if every
    layer's activations were kept by then. `fp8`: the experts in FP8, their backward recipe
    `fp8_backward`, `fused_copies` whether its kernels write e4m3 copies beside their work
    (`fp8_expert_row_grad_bytes`: a step that does not count its numerics); `fused_loss` the head's loss as
    the fused kernel runs it (`head_bytes`)."""
    moe_layers = m.num_moe_layers
    dense_layers = m.num_layers - moe_layers
    kept = tokens * (moe_layers * layer_bytes(m, True, value_bytes, dropped, fp8)
                     + dense_layers * layer_bytes(m, False, value_bytes, dropped, fp8))
    grads = tokens * max(layer_grad_bytes(m, moe, value_bytes, dropped, fp8, fp8_backward, fused_copies) for moe in
                         ([True] if moe_layers else []) + ([False] if dense_layers else []))
    return kept + max(head_bytes(m, tokens, value_bytes, chunked, fused_loss), grads, forward_transient)
