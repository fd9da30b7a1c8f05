"""Activation memory per token (disagmoe/roofline/memory.py): the terms against what the code keeps."""

from __future__ import annotations

import pytest

from disagmoe.model.loss import chunk_size
from disagmoe.model_ref import load_model
from disagmoe.roofline import memory as mem
from disagmoe.roofline.stages import attention_io_per_token


@pytest.mark.parametrize("tokens, vocab", [(8192, 4096), (8192, 151_936), (100, 151_936), (3, 32), (65_536, 129_280)])
def test_the_head_chunk_rule_is_the_losss(tokens, vocab):
    assert mem.loss_chunk_tokens(tokens, vocab) == chunk_size(tokens, vocab)


def test_the_chunked_head_keeps_no_whole_logits():
    """Qwen3-30B's 151,936-token head over 8k tokens: whole fp32 logits would be 4.6 GiB and the
    oracle keeps three such; the chunked loss keeps d h, an fp32 d W and one chunk's logits."""
    m = load_model("qwen3-30b-a3b")
    tokens = 8192
    logits = tokens * m.vocab_size * 4
    chunked = mem.head_bytes(m, tokens, 2)
    assert chunked < logits
    assert chunked >= 4 * m.vocab_size * m.hidden_size + 2 * tokens * m.hidden_size  # d W fp32 and d h
    assert mem.head_bytes(m, tokens, 4, chunked=False) >= 3 * logits
    # more tokens add their rows, not their logits
    assert mem.head_bytes(m, 2 * tokens, 2) - chunked == 2 * 2 * tokens * m.hidden_size


def test_one_process_keeps_every_layer_and_one_layers_backward():
    m = load_model("qwen3-30b-a3b")
    tokens = 4096
    kept = tokens * m.num_layers * mem.layer_bytes(m, True, 2)
    extra = mem.activation_bytes(m, tokens, 2) - kept
    assert extra == max(mem.head_bytes(m, tokens, 2), tokens * mem.layer_grad_bytes(m, True, 2))
    assert mem.activation_bytes(m, 2 * tokens, 2) > 1.8 * mem.activation_bytes(m, tokens, 2)  # ~linear: the head's d W is fixed


def test_a_moe_layer_splits_into_attention_combine_and_expert_rows():
    m = load_model("qwen3-30b-a3b")
    assert mem.layer_bytes(m, True, 2) == (mem.attention_bytes(m, True, 2) + mem.combine_bytes(m, 2)
                                           + m.top_k * mem.expert_row_bytes(m, 2))
    # fp32: SDPA's log-sum-exp per head and the router's scores (the gate reads the bf16 norm output)
    assert mem.attention_fp32_values(m, True) == m.num_heads + m.num_experts * (2 if m.router.z_loss_coef > 0 else 1)
    dense = load_model("deepseek-v3")
    assert mem.attention_bytes(dense, False, 2) > 2 * 4 * dense.dense_ffn_size  # the dense SwiGLU


@pytest.mark.parametrize("dropped", [frozenset({"expert_input"}), frozenset({"expert_output"}),
                                     frozenset({"expert_swiglu"}),
                                     frozenset({"expert_input", "expert_output", "expert_swiglu"})])
def test_selective_recomputation_drops_exactly_its_terms_and_pays_its_transients(dropped):
    """What `recompute: selective` leaves out of a MoE layer (per token: K input rows of H, the
    combine's K output rows of H, K SwiGLU outputs of F) and what the backward recomputes instead
    (the input rows and the SwiGLU output, while the layer's backward runs)."""
    m = load_model("qwen3-30b-a3b")
    H, F, K = m.hidden_size, m.expert_ffn_size, m.top_k
    saved = 2 * K * ((H if "expert_input" in dropped else 0) + (H if "expert_output" in dropped else 0)
                     + (F if "expert_swiglu" in dropped else 0))
    assert mem.layer_bytes(m, True, 2) - mem.layer_bytes(m, True, 2, dropped) == saved
    transient = 2 * K * ((H if "expert_input" in dropped else 0) + (F if "expert_swiglu" in dropped else 0))
    assert mem.layer_grad_bytes(m, True, 2, dropped) - mem.layer_grad_bytes(m, True, 2) == transient
    assert mem.layer_bytes(m, False, 2, dropped) == mem.layer_bytes(m, False, 2)  # nothing of a dense layer
    tokens = 8192
    assert mem.activation_bytes(m, tokens, 2, dropped=dropped) < mem.activation_bytes(m, tokens, 2)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_attention_recomputation_drops_the_blocks_internals_in_every_layer(name):
    """`attention` (kernels/recompute.py) leaves H + q + k + v (+ q + k before qk-norm) values per
    token out of every layer, dense ones too (the core's output and fp32 log-sum-exp stay:
    kernels/attention_core.py), and the layer's backward holds them again; with the experts' three it cuts the Qwen3-30B config's activations >= 40%."""
    m = load_model(name)
    attention = frozenset({"attention"})
    drop = mem.attention_recomputed_bytes(m, 2)
    q, k, v = attention_io_per_token(m)
    assert drop == 2 * (m.hidden_size + q + k + v + (q + k if m.qk_norm and m.attention != "mla" else 0))
    for moe in (True, False):
        assert mem.layer_bytes(m, moe, 2) - mem.layer_bytes(m, moe, 2, attention) == drop
        assert mem.layer_grad_bytes(m, moe, 2, attention) - mem.layer_grad_bytes(m, moe, 2) == drop
    tokens = 8192
    both = attention | mem.SELECTIVE
    plain, lean = mem.activation_bytes(m, tokens, 2), mem.activation_bytes(m, tokens, 2, dropped=both)
    assert lean < mem.activation_bytes(m, tokens, 2, dropped=mem.SELECTIVE) < plain
    if name == "qwen3-30b-a3b":
        assert 1 - lean / plain >= 0.4


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_full_recomputation_keeps_each_layers_input_and_routing_and_holds_one_layer_again(name):
    """`recompute: full` (`memory.FULL`) in one process: per token a layer keeps its input (H values)
    and, in a MoE layer, its routing (per pair a top-k id and a grouped row, 8 bytes each); one
    layer's backward holds that whole layer again beside its gradients. On a rank: an attention
    half keeps its input and the outputs its backward starts from; an expert rank its pairs'
    routing and each received token's row and partial sum, and its backward the rows again."""
    m = load_model(name)
    H, K = m.hidden_size, m.top_k
    assert mem.layer_bytes(m, True, 2, mem.FULL) == 2 * H + K * (8 + 8)
    assert mem.layer_bytes(m, False, 2, mem.FULL) == 2 * H
    for moe in (True, False):
        assert mem.layer_grad_bytes(m, moe, 2, mem.FULL) == mem.layer_bytes(m, moe, 2) + mem.layer_grad_bytes(m, moe, 2)
        assert mem.attention_grad_bytes(m, moe, 2, mem.FULL) == (mem.attention_bytes(m, moe, 2)
                                                                 + mem.attention_grad_bytes(m, moe, 2))
    shared = H if m.shared_ffn_size else 0
    assert mem.attention_bytes(m, True, 2, mem.FULL) == 2 * (3 * H + shared + K) + 8 * K  # x, h, xn, shared, w; ids
    assert mem.attention_bytes(m, False, 2, mem.FULL) == 2 * 2 * H  # x and the layer's output
    assert mem.expert_row_bytes(m, 2, mem.FULL) == 2 + 4 + 8  # weight, local id, grouped row
    assert mem.combine_bytes(m, 2, mem.FULL) == 0
    assert mem.expert_token_bytes(m, 2, mem.FULL) == 2 * 2 * H and mem.expert_token_bytes(m, 2, mem.FULL, True) == 2 * H
    assert mem.expert_token_bytes(m, 2) == 0
    tokens = 8192
    everything = mem.SELECTIVE | frozenset({"attention"})
    full, lean, plain = (mem.activation_bytes(m, tokens, 2, dropped=d)
                         for d in (mem.FULL, everything, mem.NOTHING_DROPPED))
    assert full < lean < plain


@pytest.mark.parametrize("dropped", [frozenset(), frozenset({"expert_input"}), frozenset({"expert_swiglu"}),
                                     frozenset({"expert_input", "expert_swiglu"})])
def test_fp8_experts_keep_their_rows_and_h13_and_drop_what_they_recompute(dropped):
    """Precision fp8 (`kernels.fp8_ffn`): a (token, expert) row keeps its bf16 input row (unless
    expert_input is dropped) and its pre-activations h13 (2F), never the SwiGLU output (its
    backward recomputes it in every run, so expert_swiglu drops nothing more); the backward holds
    d y, d h13 and the recomputed SwiGLU output in bf16 and e4m3 copies with their scales, each
    dropped after its GEMM, whatever is dropped (the input rows are read from the tokens, not
    regathered). d y and d h13 are quantised both ways in one pass each: with the SwiGLU output
    alive, d y's two copies (2H) or d y's and act's token groups (H + F); after it is dropped,
    d h13's two (4F) or the w13 gradient's operands (H + 2F). The split SwiGLU gradient (Hopper's
    default) holds d act [F] beside d h13 and act while d y's two copies live."""
    m = load_model("qwen3-30b-a3b")
    H, F, K = m.hidden_size, m.expert_ffn_size, m.top_k
    kept = 2 * ((0 if "expert_input" in dropped else H) + 2 * F)
    assert mem.expert_row_bytes(m, 2, dropped, fp8=True) == kept
    assert mem.expert_row_bytes(m, 2, fp8=True) - mem.expert_row_bytes(m, 2, dropped, fp8=True) == (
        2 * H if "expert_input" in dropped else 0)
    e4m3 = 1 + 4 / 128
    held = max(2 * (H + 4 * F) + e4m3 * 2 * H, 2 * (H + 3 * F) + e4m3 * (H + F),
               2 * (H + 2 * F) + e4m3 * max(4 * F, H + 2 * F))
    assert mem.expert_row_grad_bytes(m, 2, dropped, fp8=True) == int(held)
    assert H > 2 * F and held == 2 * (H + 4 * F) + e4m3 * 2 * H  # Qwen3's peak: d y's two copies, d act
    assert mem.layer_bytes(m, True, 2, dropped, fp8=True) == (mem.attention_bytes(m, True, 2) + mem.combine_bytes(m, 2)
                                                             + K * kept)
    assert mem.layer_bytes(m, False, 2, dropped, fp8=True) == mem.layer_bytes(m, False, 2)  # no experts there
    tokens = 8192
    if "expert_input" in dropped:
        assert mem.activation_bytes(m, tokens, 2, dropped=dropped, fp8=True) < mem.activation_bytes(m, tokens, 2,
                                                                                                   fp8=True)
    # the plain FP8 row keeps F fewer bf16 values than the plain bf16 row (no SwiGLU output)
    assert mem.expert_row_bytes(m, 2) - mem.expert_row_bytes(m, 2, fp8=True) == 2 * F


def test_the_runs_fp8_recomputation_reaches_the_memory_check():
    """`precision: fp8` with recompute selective of expert_input and expert_swiglu: one process's
    predicted activations fall by the grouped input rows of every MoE layer (2 bytes x K x H per
    token), and expert_swiglu alone changes nothing; the runtime's replay counts the FP8 rows too."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.activation_memory import rank_activations, single_activation_bytes
    from disagmoe.runtime.topology import Topology

    m = load_model("tiny")
    base = dict(model=m, precision="fp8", device="cuda", experts_backend="triton", batch_size=8, seq_len=64,
                micro_batches=2)
    plain = TrainConfig(**base, mode="single")
    lean = TrainConfig(**base, mode="single", recompute="selective",
                       recompute_modules=["expert_input", "expert_swiglu"])
    swiglu = TrainConfig(**base, mode="single", recompute="selective", recompute_modules=["expert_swiglu"])
    tokens = 8 // 2 * 64
    rows = tokens * m.num_moe_layers * m.top_k * m.hidden_size * 2
    assert single_activation_bytes(plain, m) - single_activation_bytes(lean, m) == rows
    assert single_activation_bytes(swiglu, m) == single_activation_bytes(plain, m)
    assert single_activation_bytes(plain, m) == mem.activation_bytes(m, tokens, 2, fp8=True)
    split = dict(base, mode="disaggregated", transport="nccl")
    plain_d, lean_d = TrainConfig(**split), TrainConfig(**split, recompute="selective",
                                                          recompute_modules=["expert_input", "expert_swiglu"])
    topology = Topology.from_config(plain_d, m)
    for rank, (a, b) in enumerate(zip(rank_activations(lean_d, m, topology), rank_activations(plain_d, m, topology),
                                      strict=True)):
        assert (a.peak_bytes < b.peak_bytes) == (topology.expert_role(rank) is not None), rank
