"""Activation memory per token (disagmoe/roofline/memory.py): the terms against what the code keeps."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disagmoe.model.loss import chunk_size
from disagmoe.model_ref import load_model
from disagmoe.roofline import memory as mem
from disagmoe.roofline.stages import attention_io_per_token
from tests.kernels.test_fp8_ffn import SMALL


@pytest.mark.parametrize("logit_bytes", [4, 2], ids=["torch-fp32-copy", "fused-bf16"])
@pytest.mark.parametrize("tokens, vocab", [(8192, 4096), (8192, 151_936), (100, 151_936), (3, 32), (65_536, 129_280)])
def test_the_head_chunk_rule_is_the_losss(tokens, vocab, logit_bytes):
    assert mem.loss_chunk_tokens(tokens, vocab, logit_bytes) == chunk_size(tokens, vocab, None, logit_bytes)


def test_the_fused_head_holds_its_chunks_logits_once_and_no_product_of_d_w():
    """Fused (a GPU run's default) a chunk's logits are held once, in bf16, at twice the tokens a chunk of
    Qwen3-30B's vocabulary, and no [V, H] product a chunk: 1.5 GiB less than torch's ops at 8k tokens; where
    the vocabulary is small the backward's scaled d h is the larger transient."""
    m = load_model("qwen3-30b-a3b")
    tokens, H, V = 8192, m.hidden_size, m.vocab_size
    kept = 2 * tokens * 2 * H + 4 * V * H  # norm input, d h, fp32 d W
    fused, torch_ops = mem.head_bytes(m, tokens, 2, fused=True), mem.head_bytes(m, tokens, 2)
    assert fused == kept + chunk_size(tokens, V, None, 2) * V * 2
    assert chunk_size(tokens, V, None, 2) == 2 * chunk_size(tokens, V) + 1  # 883 against 441
    assert torch_ops == kept + chunk_size(tokens, V) * V * 2 + V * H * 6  # d W's product and cast, the gradients
    assert (torch_ops - fused) / 2**30 > 1.5
    # fp32 operands: the fp32 logits' chunk, and no fused d W GEMM (each chunk's fp32 product formed)
    assert mem.head_bytes(m, tokens, 4, fused=True) == (2 * tokens * 4 * H + 4 * V * H
                                                        + chunk_size(tokens, V) * V * 4 + 4 * V * H)
    small = m.model_copy(update={"vocab_size": 64})
    assert mem.head_bytes(small, tokens, 2, fused=True) == 3 * tokens * 2 * H + 4 * 64 * H


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
    backward recomputes it in every run, so expert_swiglu drops nothing more); the all-FP8 backward
    (fp8_expert_backward fp8) holds d y, d h13 and the recomputed SwiGLU output in bf16 and e4m3
    copies with their scales, each dropped after its GEMM, whatever is dropped (the input rows are
    read from the tokens, not regathered). d y and d h13 are quantised both ways in one pass each: with the SwiGLU output
    alive, d y's two copies (2H) or d y's and act's token groups (H + F), each beside d h13's rows (2F) where
    the split SwiGLU pass writes them (`fused_copies`, the default); after it is dropped,
    d h13's two (4F) or the w13 gradient's operands (H + 2F). The split SwiGLU gradient (Hopper's
    default) holds d act [F] beside d h13 and act while d y's two copies live."""
    m = load_model("qwen3-30b-a3b")
    H, F, K = m.hidden_size, m.expert_ffn_size, m.top_k
    kept = 2 * ((0 if "expert_input" in dropped else H) + 2 * F)
    assert mem.expert_row_bytes(m, 2, dropped, fp8=True) == kept
    assert mem.expert_row_bytes(m, 2, fp8=True) - mem.expert_row_bytes(m, 2, dropped, fp8=True) == (
        2 * H if "expert_input" in dropped else 0)
    e4m3 = 1 + 4 / 128
    held = max(2 * (H + 4 * F) + e4m3 * (2 * H + 2 * F), 2 * (H + 3 * F) + e4m3 * (H + 3 * F),
               2 * (H + 2 * F) + e4m3 * max(4 * F, H + 2 * F))
    assert mem.expert_row_grad_bytes(m, 2, dropped, fp8=True, fp8_backward="fp8") == int(held)
    # Qwen3's peak: d y's two copies and d h13's rows, d act
    assert H > 2 * F and held == 2 * (H + 4 * F) + e4m3 * (2 * H + 2 * F)
    assert mem.layer_bytes(m, True, 2, dropped, fp8=True) == (mem.attention_bytes(m, True, 2) + mem.combine_bytes(m, 2)
                                                             + K * kept)
    assert mem.layer_bytes(m, False, 2, dropped, fp8=True) == mem.layer_bytes(m, False, 2)  # no experts there
    tokens = 8192
    if "expert_input" in dropped:
        assert mem.activation_bytes(m, tokens, 2, dropped=dropped, fp8=True) < mem.activation_bytes(m, tokens, 2,
                                                                                                   fp8=True)
    # the plain FP8 row keeps F fewer bf16 values than the plain bf16 row (no SwiGLU output)
    assert mem.expert_row_bytes(m, 2) - mem.expert_row_bytes(m, 2, fp8=True) == 2 * F


@pytest.mark.parametrize("dropped", [frozenset(), frozenset({"expert_input"}), frozenset({"expert_swiglu"}),
                                     frozenset({"expert_input", "expert_swiglu"})])
def test_each_fp8_backward_recipe_holds_what_it_allocates(dropped):
    """Under FP8 the backward's transient follows its recipe (`fp8_backward`), expert_swiglu changing
    nothing: "fp8" as above, never an input row; "bf16-wgrad" (the default) d y's and d h13's e4m3 rows
    (the split SwiGLU pass quantises d h13 as it writes it) beside d y, act, d h13 and d act at the d h13
    GEMM and its pass, or at the w13 gradient d y, d h13 and, under
    expert_input, the input rows gathered again ([N, H] bf16), whichever is more; "bf16" the bf16
    experts' backward with the SwiGLU output recomputed and, under expert_input, the rows gathered
    again. At Qwen3-30B's shape (H < 4F) the regathered row stays below bf16-wgrad's d h13 GEMM; at
    H = 8F it sets the peak. The default is named by the default argument."""
    e4m3, regathered = 1 + 4 / 128, "expert_input" in dropped
    for m in (load_model("qwen3-30b-a3b"), load_model("qwen3-30b-a3b").model_copy(update={"expert_ffn_size": 256})):
        H, F = m.hidden_size, m.expert_ffn_size
        held = {b: mem.expert_row_grad_bytes(m, 2, dropped, fp8=True, fp8_backward=b)
                for b in ("fp8", "bf16-wgrad", "bf16")}
        assert held["fp8"] == mem.expert_row_grad_bytes(m, 2, fp8=True, fp8_backward="fp8")
        d_h13_gemm, w13_gradient = 2 * (H + 4 * F) + e4m3 * (H + 2 * F), 2 * (H + 2 * F + (H if regathered else 0))
        assert held["bf16-wgrad"] == int(max(d_h13_gemm, w13_gradient))
        assert held["bf16-wgrad"] == mem.expert_row_grad_bytes(m, 2, dropped, fp8=True)
        assert (w13_gradient > d_h13_gemm) == (regathered and H == 8 * F)
        assert held["bf16"] == 2 * (H + 2 * F + F + (H if regathered else 0))
        assert held["bf16-wgrad"] < held["fp8"]  # no token-group copies, whether or not the rows are gathered
    with pytest.raises(ValueError, match="backward 'fp16': choose one of fp8, bf16-wgrad, bf16"):
        mem.expert_row_grad_bytes(m, 2, fp8=True, fp8_backward="fp16")


class _Allocations(TorchDispatchMode):
    """The storages the ops under it allocate (an output sharing no input's storage: views, and the
    interpreter's host aliases of its arguments, are none), in order as (op, shape, dtype), and
    the most bytes of them alive at once, taken after every op (a storage is alive while a tensor
    on it made under the mode is)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._storages: dict[int, tuple[int, list[weakref.ref]]] = {}  # data pointer -> (bytes, its tensors)
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() if isinstance(a, torch.Tensor) else a.data_ptr()
                  for a in (*args, *(kwargs or {}).values()) if isinstance(a, (torch.Tensor, torch.UntypedStorage))}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if self._alive(storage.data_ptr()):
                self._storages[storage.data_ptr()][1].append(weakref.ref(t))
            elif storage.data_ptr() not in inputs:  # a new storage (maybe where a freed one was)
                self._storages[storage.data_ptr()] = (storage.nbytes(), [weakref.ref(t)])
                self.made.append((func.__name__, tuple(t.shape), t.dtype))
        alive = sum(self._storages[pointer][0] for pointer in self._storages if self._alive(pointer))
        self.peak_bytes = max(self.peak_bytes, alive)
        return out

    def _alive(self, pointer: int) -> bool:
        return pointer in self._storages and any(ref() is not None for ref in self._storages[pointer][1])


@pytest.mark.parametrize("recipe", ["fp8", "bf16-wgrad", "bf16"])
def test_the_fp8_experts_backward_allocates_what_the_memory_model_counts(interpreted, recipe):
    """Measured (interpreter, fp32): the FP8 FFN's backward, weight gradients into main gradients,
    with the rows kept and with expert_input recomputed from their tokens (`RowSource`); the peak
    of what it allocates, taken after every op. bf16-wgrad and bf16 gather the rows again (one
    index_select [N, H]): through the source their peak rises by at most those rows (bf16: exactly,
    the rows alive throughout) and equals N x `expert_row_grad_bytes` (at this shape, H = 4F,
    bf16-wgrad's w13 gradient sets it: the regathered rows beside d h13 and dx; the model counts
    d y, which the backward did not allocate, where dx [N, H] stands). With the rows kept the model
    is an upper bound (bf16-wgrad's d h13 GEMM there: d y, and d act, which the fused CPU kernel
    does not write). The fp8 recipe gathers nothing: its quantiser reads the tokens, and its peak
    is the kept-rows run's."""
    *_, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn")
    from disagmoe.kernels.recompute import EXPERT_INPUT, RowSource

    counts, hidden, ffn = [9, 7], 64, 16
    rows = sum(counts)
    gen = torch.Generator().manual_seed(3)
    x_NH, dy_NH = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    w13, w2 = torch.randn(2, hidden, 2 * ffn, generator=gen) / 8, torch.randn(2, ffn, hidden, generator=gen) / 8
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    token_N = torch.randperm(rows, generator=gen)
    x_TH = torch.empty_like(x_NH)
    x_TH[token_N] = x_NH
    tiles = ffn8.Fp8Tiles(**SMALL)
    m = load_model("tiny").model_copy(update={"hidden_size": hidden, "expert_ffn_size": ffn})

    def backward(source: RowSource | None) -> _Allocations:
        params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
        for p in params:
            p.main_grad = torch.zeros(p.shape)
        y = ffn8.expert_ffn_fp8(x_NH.clone().requires_grad_(), offsets_E, *params, tiles=tiles, num_programs=3,
                                backward=recipe, recompute=frozenset({EXPERT_INPUT}) if source else frozenset(),
                                source=source)
        with _Allocations() as allocations:
            y.backward(dy_NH)
        return allocations

    kept, recomputed = backward(None), backward(RowSource(x_TH, token_N))
    gathers = [made for made in recomputed.made if made[0].startswith("index_select")]
    if recipe == "fp8":
        assert gathers == [] and recomputed.peak_bytes == kept.peak_bytes
        return
    model = {dropped: rows * mem.expert_row_grad_bytes(m, 4, dropped, fp8=True, fp8_backward=recipe)
             for dropped in (frozenset(), frozenset({EXPERT_INPUT}))}
    assert gathers == [("index_select.default", (rows, hidden), torch.float32)]
    assert recomputed.peak_bytes == model[frozenset({EXPERT_INPUT})]
    rows_bytes = rows * hidden * 4
    assert kept.peak_bytes < recomputed.peak_bytes <= kept.peak_bytes + rows_bytes
    assert kept.peak_bytes <= model[frozenset()]  # bf16-wgrad's d h13 GEMM there: d y and d act counted
    if recipe == "bf16":  # the rows alive throughout its backward
        assert recomputed.peak_bytes == kept.peak_bytes + rows_bytes


@pytest.mark.parametrize("forward", ["gate-up", "down", "both"])
def test_the_emulated_fp8_forward_allocates_what_the_memory_model_counts(interpreted, forward):
    """Measured (interpreter, fp32): the emulated FP8 forward (`fp8_emulate`, its weight copies made
    before), the peak of what it allocates taken after every op, is the transient the memory model
    counts (`fp8_emulate_transient_bytes`: the dequantised rows and weights of the larger emulated GEMM
    and one piece's three fp32 temporaries) and at most the forward's kept outputs more (h13 and y,
    counted by the kept terms; K and N multiples of 128, as the scale blocks pad a piece's temporaries
    to them). The piece is the kernel's (`kernels.fp8_ffn.DEQUANTIZE_PIECE`; roofline imports no torch)."""
    *_, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn")
    assert mem.EMULATE_PIECE_VALUES == ffn8.DEQUANTIZE_PIECE
    counts, hidden, ffn = [9, 7], 128, 128
    rows = sum(counts)
    gen = torch.Generator().manual_seed(3)
    x_NH = torch.randn(rows, hidden, generator=gen)
    w13, w2 = torch.randn(2, hidden, 2 * ffn, generator=gen) / 8, torch.randn(2, ffn, hidden, generator=gen) / 8
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    weights = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward=forward, backward="bf16")
    with _Allocations() as allocations:
        ffn8.expert_ffn_fp8(x_NH, offsets_E, w13, w2, weights=weights, tiles=ffn8.Fp8Tiles(**SMALL), num_programs=3,
                            backward="bf16", forward=forward, emulate=True)
    m = load_model("tiny").model_copy(update={"hidden_size": hidden, "expert_ffn_size": ffn})
    transient = mem.fp8_emulate_transient_bytes(m, rows, 4, forward, experts=len(counts))
    assert transient <= allocations.peak_bytes <= transient + rows * (2 * ffn + hidden) * 4


def test_the_emulated_fp8_forwards_transient_reaches_the_memory_checks():
    """`fp8_emulate` raises one process's predicted activations by what its largest layer forward holds
    beyond the backward's peak (`activation_bytes`' forward_transient), and an expert rank's by its
    rows' and local experts' transient at its expert forwards; without it nothing changes."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.activation_memory import rank_activations, single_activation_bytes
    from disagmoe.runtime.topology import Topology

    m = load_model("qwen3-30b-a3b").model_copy(update={"num_layers": 2, "vocab_size": 4096})
    base = dict(model=m, device="cuda", experts_backend="triton", batch_size=4, seq_len=4096, micro_batches=2,
                precision="fp8", fp8_expert_backward="bf16", fp8_expert_forward="gate-up",
                expert_wgrad_pairs="off")  # (their waiting rows: tests/runtime/training/test_expert_wgrad_pairs.py)
    plain, emulated = (TrainConfig(**base, mode="single", fp8_emulate=e) for e in (False, True))
    tokens = 2 * 4096
    transient = mem.fp8_emulate_transient_bytes(m, tokens * m.top_k, 2, "gate-up")
    assert transient > 0
    assert single_activation_bytes(emulated, m) == mem.activation_bytes(
        m, tokens, 2, fp8=True, fp8_backward="bf16", forward_transient=transient)
    assert single_activation_bytes(emulated, m) > single_activation_bytes(plain, m)
    layout = dict(base, mode="disaggregated", attention_ranks=1, expert_ranks=1)
    peaks = {}
    for emulate in (False, True):
        cfg = TrainConfig(**layout, fp8_emulate=emulate)
        peaks[emulate] = [r.peak_bytes for r in rank_activations(cfg, m, Topology.from_config(cfg, m))]
    assert peaks[True][0] == peaks[False][0]  # the attention rank runs no expert
    assert peaks[True][1] > peaks[False][1]


def test_the_runs_fp8_recomputation_reaches_the_memory_check():
    """`precision: fp8` with recompute selective of expert_input and expert_swiglu: one process's
    predicted activations fall by the grouped input rows of every MoE layer (2 bytes x K x H per
    token), and expert_swiglu alone changes nothing; each backward recipe (`fp8_expert_backward`)
    holds its own transient; the runtime's replay counts the FP8 rows too."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.activation_memory import rank_activations, single_activation_bytes
    from disagmoe.runtime.topology import Topology

    m = load_model("tiny")
    base = dict(model=m, precision="fp8", device="cuda", experts_backend="triton", batch_size=8, seq_len=64,
                micro_batches=2, expert_wgrad_pairs="off")  # (their waiting rows: test_expert_wgrad_pairs.py)
    plain = TrainConfig(**base, mode="single")
    lean = TrainConfig(**base, mode="single", recompute="selective",
                       recompute_modules=["expert_input", "expert_swiglu"])
    swiglu = TrainConfig(**base, mode="single", recompute="selective", recompute_modules=["expert_swiglu"])
    tokens = 8 // 2 * 64
    rows = tokens * m.num_moe_layers * m.top_k * m.hidden_size * 2
    assert single_activation_bytes(plain, m) - single_activation_bytes(lean, m) == rows
    assert single_activation_bytes(swiglu, m) == single_activation_bytes(plain, m)
    assert single_activation_bytes(plain, m) == mem.activation_bytes(m, tokens, 2, fp8=True, fused_loss=True)
    longer = dict(base, seq_len=1024)  # the layer's backward, not the head, sets one process's peak
    recipes = {backward: TrainConfig(**longer, mode="single", recompute="selective", recompute_modules=["expert_input"],
                                     fp8_expert_backward=backward) for backward in ("fp8", "bf16-wgrad", "bf16")}
    for backward, run in recipes.items():
        assert single_activation_bytes(run, m) == mem.activation_bytes(m, 8 // 2 * 1024, 2, dropped=run.recompute_set,
                                                                       fp8=True, fp8_backward=backward,
                                                                       fused_loss=True)
    assert len({single_activation_bytes(run, m) for run in recipes.values()}) == 3
    split = dict(base, mode="disaggregated", transport="nccl")
    plain_d, lean_d = TrainConfig(**split), TrainConfig(**split, recompute="selective",
                                                          recompute_modules=["expert_input", "expert_swiglu"])
    topology = Topology.from_config(plain_d, m)
    for rank, (a, b) in enumerate(zip(rank_activations(lean_d, m, topology), rank_activations(plain_d, m, topology),
                                      strict=True)):
        assert (a.peak_bytes < b.peak_bytes) == (topology.expert_role(rank) is not None), rank


# (quantised, held) per routed-expert parameter of each FP8 recipe's weight copies (w13 2/3 of the
# parameters, w2 1/3): the forward's FP8 gate/up GEMM reads w13's copy, its FP8 down GEMM w2's, an
# FP8 data gradient (backward fp8, bf16-wgrad) both transposes; the bf16 backward none.
COPY_SHARES = {("both", "fp8"): (1, 2), ("both", "bf16-wgrad"): (1, 2), ("both", "bf16"): (1, 1),
               ("gate-up", "fp8"): (1, 5 / 3), ("gate-up", "bf16-wgrad"): (1, 5 / 3), ("gate-up", "bf16"): (2 / 3, 2 / 3),
               ("down", "fp8"): (1, 4 / 3), ("down", "bf16-wgrad"): (1, 4 / 3), ("down", "bf16"): (1 / 3, 1 / 3)}


@pytest.mark.parametrize("forward, backward", list(COPY_SHARES))
def test_each_fp8_recipe_holds_the_weight_copies_it_reads(forward, backward):
    """`fp8_weight_copy_bytes` by recipe: one e4m3 byte a value of each copy the recipe reads
    (`config.fp8_weight_copies`) with a fp32 scale per 128 x 128 block; the default recipe's two
    bytes a parameter as before; an unknown recipe refused with the choices."""
    from disagmoe.config import fp8_weight_copies

    quantised, held = COPY_SHARES[forward, backward]
    assert mem.fp8_weight_copy_shares(forward, backward) == pytest.approx((quantised, held))
    params = 6 * 10**9
    assert mem.fp8_weight_copy_bytes(params, forward, backward) == pytest.approx(held * params * (1 + 4 / 128**2))
    thirds = {"w13": 2, "w13_t": 2, "w2": 1, "w2_t": 1}
    assert held == pytest.approx(sum(thirds[name] for name in fp8_weight_copies(forward, backward)) / 3)
    assert mem.fp8_weight_copy_bytes(params) == 2 * params * (1 + 4 / 128**2)  # the default: all four
    with pytest.raises(ValueError, match="backward 'bf32': choose one of fp8, bf16-wgrad, bf16"):
        mem.fp8_weight_copy_bytes(params, forward, "bf32")


def test_the_token_group_rows_are_the_quantisers_padded_capacity():
    """`fp8_token_group_rows` (torch-free, for the planner) sizes a token-group copy as the quantiser allocates
    it (`kernels.fp8.padded_capacity`), for scalars and for the planner's float arrays alike."""
    import numpy as np

    from disagmoe.kernels.fp8 import padded_capacity
    from disagmoe.roofline.memory import fp8_token_group_rows

    for rows, groups in [(0, 1), (1, 1), (127, 1), (128, 1), (129, 1), (16384, 8), (65536, 128), (1000, 37), (5, 64)]:
        assert fp8_token_group_rows(rows, groups) == padded_capacity(rows, groups)
    rows, groups = np.array([16384.0, 65536.0, 1000.0]), np.array([8.0, 128.0, 37.0])
    assert list(fp8_token_group_rows(rows, groups)) == [padded_capacity(int(r), int(g)) for r, g in zip(rows, groups)]


def test_the_all_fp8_backwards_waiting_copies_are_what_its_quantiser_allocates(interpreted):
    """`paired_wgrad_waiting_bytes(..., fp8_token_groups=True)`: the bytes of the four token-group copies (x, d y:
    H; act: F; d h13: 2F) and their scales that `kernels.fp8.quantize_token_groups` returns for those rows."""
    fp8 = interpreted("disagmoe.kernels.fp8")
    from disagmoe.config import ModelConfig
    from disagmoe.roofline.memory import paired_wgrad_waiting_bytes

    m = ModelConfig(name="t", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                    num_experts=3, top_k=2, expert_ffn_size=16)
    offsets_E = torch.tensor([5, 5, 140], dtype=torch.int32)  # an empty group, one past 128 rows
    rows = int(offsets_E[-1])
    total = 0
    for width in (m.hidden_size, m.hidden_size, m.expert_ffn_size, 2 * m.expert_ffn_size):
        q_KP, s_KC, _ = fp8.quantize_token_groups(torch.randn(rows, width), offsets_E)
        total += q_KP.numel() * q_KP.element_size() + s_KC.numel() * s_KC.element_size()
    assert paired_wgrad_waiting_bytes(m, rows, 3, 2, fp8_token_groups=True) == total
    assert paired_wgrad_waiting_bytes(m, rows, 3, 2) == rows * (2 * 32 + 3 * 16) * 2  # the bf16 rows


def test_the_first_backward_of_a_pair_holds_what_waits_instead_of_being_dropped():
    """`paired_first_held_bytes`: under the all-FP8 backward the first backward of a pair keeps its w2 gradient's
    token-group copies (d y's H, act's F values) through the rest of its span, above its own peak where the second
    half's was near it; none where the d h13 GEMM's half stays higher, as it does at Qwen3's shape and, with d h13's
    rows from the split SwiGLU pass counted there (one GPU's `fused_copies`), at Mixtral's (17,216 bytes a row
    below it; 12,352 above it on a distributed rank, which writes no such copies); bf16-wgrad's act (bf16 F)
    through the w13 gradient, F values more
    only where that gradient's half is the peak (the input regathered, H = 16F); the bf16 recipes nothing."""
    qwen3, mixtral = load_model("qwen3-30b-a3b"), load_model("mixtral-8x7b")
    H, F = mixtral.hidden_size, mixtral.expert_ffn_size
    held = mem.fp8_expert_row_grad_bytes(mixtral, 2, False, "fp8")
    second_half = 2 * (H + 2 * F) + mem.FP8_VALUE_BYTES * max(4 * F, H + 2 * F)
    assert mem.paired_first_held_bytes(mixtral, 2, fp8=True, fp8_backward="fp8") == 0
    assert held - int(second_half + mem.FP8_VALUE_BYTES * (H + F)) == 17216  # the d h13 GEMM's half: 160,896 bytes
    assert mem.paired_first_held_bytes(qwen3, 2, fp8=True, fp8_backward="fp8") == 0
    wide, regathered = qwen3.model_copy(update={"expert_ffn_size": 128}), frozenset({"expert_input"})  # H = 16F
    assert mem.paired_first_held_bytes(wide, 2, regathered, fp8=True, fp8_backward="bf16-wgrad") == 2 * 128
    for m in (qwen3, mixtral, wide):
        for dropped in (frozenset(), regathered):
            if m is not wide or not dropped:
                assert mem.paired_first_held_bytes(m, 2, dropped, fp8=True, fp8_backward="bf16-wgrad") == 0
        assert mem.paired_first_held_bytes(m, 2) == 0
        assert mem.paired_first_held_bytes(m, 2, fp8=True, fp8_backward="bf16") == 0


def test_the_fused_e4m3_copies_count_only_where_a_kernel_writes_them():
    """`fused_copies`: a one-GPU step that does not count its FP8 numerics has the split SwiGLU-gradient pass write
    d h13's 1 x 128 rows beside its work, alive from that pass (2F e4m3 values a row more at the d h13 GEMM, and
    under the all-FP8 backward through the w2 gradient); a distributed rank counts every step and quantises d h13 in
    a pass of its own after the w2 gradient, its rows alive through the dx GEMM alone, below that half's peak. At
    Mixtral's shape the all-FP8 first half is then d y's two copies beside d act (131,328 bytes a row against
    160,896), and the first backward of a pair holds 12,352 bytes a row more (none with the fused copies)."""
    mixtral = load_model("mixtral-8x7b")
    H, F, e4m3 = mixtral.hidden_size, mixtral.expert_ffn_size, mem.FP8_VALUE_BYTES
    fused = {f: mem.fp8_expert_row_grad_bytes(mixtral, 2, False, "fp8", f) for f in (True, False)}
    assert fused == {True: int(2 * (H + 4 * F) + e4m3 * (2 * H + 2 * F)), False: int(2 * (H + 4 * F) + e4m3 * 2 * H)}
    assert fused == {True: 160896, False: 131328}
    assert {f: mem.paired_first_held_bytes(mixtral, 2, fp8=True, fp8_backward="fp8", fused_copies=f)
            for f in (True, False)} == {True: 0, False: 12352}
    for m in (mixtral, load_model("qwen3-30b-a3b")):
        H, F = m.hidden_size, m.expert_ffn_size
        wgrad = {f: mem.fp8_expert_row_grad_bytes(m, 2, False, "bf16-wgrad", f) for f in (True, False)}
        assert wgrad[True] - wgrad[False] == int(e4m3 * 2 * F)  # the d h13 GEMM's half is the peak at both shapes
        # expert_row_grad_bytes passes it on, recomputed blocks included; the bf16 experts have no such copies
        for dropped in (mem.NOTHING_DROPPED, mem.FULL):
            assert (mem.expert_row_grad_bytes(m, 2, dropped, True, "bf16-wgrad", True)
                    - mem.expert_row_grad_bytes(m, 2, dropped, True, "bf16-wgrad", False)) == wgrad[True] - wgrad[False]
            bf16 = mem.expert_row_grad_bytes(m, 2, dropped)
            assert mem.expert_row_grad_bytes(m, 2, dropped, fused_copies=False) == bf16
