"""First touch of the experts' fp32 main gradients (disagmoe/kernels/first_touch.py): the step's
first weight-gradient launch into a main gradient marked untouched stores its result, later ones
add, and the gradients equal zero_grad-then-accumulate's bit for bit.

Under Triton's interpreter (fp32, CPU): a step of three micro-batches over ragged experts (one
empty in the first micro-batch only, one empty in all), undeferred and deferred (the expert
stage's held-back launches, run after every backward); the one-op layer (`kernels.fused_moe`); a
step in which no expert receives a row. The untouched main gradients start as NaN, so any read
of them (an add into what zero_grad no longer fills) would show. On a GPU the same in bf16, with
the load-add-store and the atomic epilogues.

Legend: M micro-batches, N rows, H hidden, F expert FFN, E experts, T tokens, K top-k.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.kernels.first_touch import is_untouched, mark_untouched
from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
# rows per expert in each micro-batch: expert 1 is empty in the first, expert 4 in all three
COUNTS_ME = [[5, 0, 19, 1, 0], [3, 9, 0, 12, 0], [0, 4, 7, 2, 0]]
HIDDEN, FFN = 24, 16


@pytest.fixture
def kernels(interpreted):
    return interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.permute", "disagmoe.kernels.moe_ffn",
                       "disagmoe.kernels.fused_moe")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 tensor's bit patterns (torch.equal on them tells -0 from +0 and compares NaNs)."""
    return t.contiguous().view(torch.int32)


def _weights(experts: int, device, dtype, seed: int = 0, hidden: int = HIDDEN,
             ffn: int = FFN) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    return torch.nn.Parameter(w13.to(device, dtype)), torch.nn.Parameter(w2.to(device, dtype))


def _micro_batches(counts_ME, device, dtype, seed: int = 1,
                   hidden: int = HIDDEN) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x_NH, offsets_E, dy_NH) per micro-batch, with three spare rows past offsets[-1] (served
    elsewhere: the experts never read them)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for counts_E in counts_ME:
        rows = sum(counts_E) + 3
        offsets_E = torch.tensor(counts_E).cumsum(0).to(torch.int32)
        x = torch.randn(rows, hidden, generator=gen)
        dy = torch.randn(rows, hidden, generator=gen)
        out.append((x.to(device, dtype), offsets_E.to(device), dy.to(device, dtype)))
    return out


def _main_grads(w13, w2, first_touch: bool) -> None:
    """Attach fp32 main gradients as FlatAdamW's zero_grad leaves them: zeros, or (first touch) NaN
    marked untouched (stale values no writer may read)."""
    for w in (w13, w2):
        if first_touch:
            w.main_grad = torch.full(w.shape, float("nan"), dtype=torch.float32, device=w.device)
            mark_untouched(w.main_grad)
        else:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)


def _step(moe_ffn, batches, experts, first_touch: bool, deferred: bool, tiles, device="cpu", dtype=torch.float32,
          ffn: int = FFN):
    """The weight gradients of one step over `batches` (fp32 main gradients), each micro-batch's
    launches run at once or held back (`deferred_weight_grads`) and run after every backward."""
    from disagmoe.kernels.deferral import deferred_weight_grads

    w13, w2 = _weights(experts, device, dtype, hidden=batches[0][0].shape[1], ffn=ffn)
    _main_grads(w13, w2, first_touch)
    held = []
    for x, offsets_E, dy in batches:
        x = x.clone().requires_grad_()
        if deferred:
            with deferred_weight_grads() as work:
                moe_ffn.ExpertFFNFunction.apply(x, offsets_E, w13, w2, tiles, 3).backward(dy)
            assert len(work) == 1 and x.grad is not None
            held += work
        else:
            moe_ffn.ExpertFFNFunction.apply(x, offsets_E, w13, w2, tiles, 3).backward(dy)
        assert w13.grad is None and w2.grad is None
    for work in held:
        work()
    assert not is_untouched(w13.main_grad) and not is_untouched(w2.main_grad)
    return w13.main_grad, w2.main_grad


def _reference(moe_ffn, batches, experts):
    """Autograd through the torch reference, fp32: the step's weight gradients summed over micro-batches."""
    w13, w2 = _weights(experts, "cpu", torch.float32)
    for x, offsets_E, dy in batches:
        served = int(offsets_E[-1])
        moe_ffn.expert_ffn_reference(x[:served], offsets_E, w13, w2).backward(dy[:served])
    return w13.grad, w2.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.slow  # two steps of three micro-batches in the interpreter: about 9 s on 2 busy cores
@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
def test_first_touch_stores_the_bits_of_zero_then_accumulate(kernels, deferred):
    """Three micro-batches, ragged: the first launch into each NaN-filled, untouched main gradient
    stores, the others add, and the step's gradients are zero_grad-then-accumulate's, bit for bit;
    zeros (not NaN) for the expert no micro-batch routes to, the reference's sums otherwise."""
    _, _, moe_ffn, _ = kernels
    batches = _micro_batches(COUNTS_ME, "cpu", torch.float32)
    experts = len(COUNTS_ME[0])
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    old = _step(moe_ffn, batches, experts, first_touch=False, deferred=False, tiles=tiles)
    new = _step(moe_ffn, batches, experts, first_touch=True, deferred=deferred, tiles=tiles)
    for a, b in zip(old, new, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert torch.isfinite(b).all() and torch.equal(_bits(b[4]), _bits(torch.zeros_like(b[4])))
    for got, want in zip(new, _reference(moe_ffn, batches, experts), strict=True):
        assert _rel(got, want) < 1e-5


def test_a_step_whose_experts_receive_no_rows_stores_zeros(kernels):
    """No expert gets a row (every row served elsewhere, and a micro-batch of no rows at all): the
    launches still write every element, so the untouched NaN main gradients become +0 exactly."""
    _, _, moe_ffn, _ = kernels
    experts = 3
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    gen = torch.Generator().manual_seed(5)
    for rows in (7, 0):
        w13, w2 = _weights(experts, "cpu", torch.float32)
        _main_grads(w13, w2, first_touch=True)
        x = torch.randn(rows, HIDDEN, generator=gen).requires_grad_()
        offsets_E = torch.zeros(experts, dtype=torch.int32)
        moe_ffn.ExpertFFNFunction.apply(x, offsets_E, w13, w2, tiles, 3).backward(torch.randn(rows, HIDDEN))
        for main in (w13.main_grad, w2.main_grad):
            assert not is_untouched(main) and torch.equal(_bits(main), _bits(torch.zeros_like(main))), rows


def test_the_one_op_layer_stores_at_first_touch(kernels):
    """`kernels.fused_moe` (routed experts as one op, a spare bucket of pairs served elsewhere, an
    expert no pair picks), two micro-batches into NaN-filled untouched main gradients: the bits of
    zero-then-accumulate."""
    _, _, _, fused_moe = kernels
    from disagmoe.kernels.moe_ffn import FFNTiles

    experts, tokens, top_k = 5, 23, 2
    steps = []
    for first_touch in (False, True):
        w13, w2 = _weights(experts, "cpu", torch.float32, seed=3)
        _main_grads(w13, w2, first_touch)
        for mb in range(2):
            g = torch.Generator().manual_seed(100 + mb)
            topk = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
            topk[topk == 2] = experts  # expert 2 gets nothing: its pairs are served elsewhere
            x = torch.randn(tokens, HIDDEN, generator=g).requires_grad_()
            w = torch.rand(tokens, top_k, generator=g).requires_grad_()
            y = fused_moe.fused_moe(x, topk, w, w13, w2, spare_last=True, tiles=FFNTiles.uniform(SMALL_TILES),
                                    num_programs=3)
            y.backward(torch.randn(tokens, HIDDEN, generator=g))
        steps.append((w13.main_grad, w2.main_grad))
    for a, b in zip(*steps, strict=True):
        assert torch.equal(_bits(a), _bits(b)) and torch.isfinite(b).all()
        assert not b[2].any()


@pytest.mark.gpu
@pytest.mark.parametrize("atomic", [False, True], ids=["load-add-store", "atomic"])
@pytest.mark.parametrize("deferred", [False, True], ids=["at-once", "deferred"])
def test_gpu_first_touch_stores_the_bits_of_zero_then_accumulate(atomic, deferred):
    """On a GPU, bf16 operands into fp32 main gradients at larger ragged counts (an expert empty in
    the first micro-batch, one empty in all): the first-touch step's gradients equal
    zero-then-accumulate's bit for bit, with the load-add-store epilogue and with fp32 atomics (no
    denormals among these values, which the atomics would flush where a store keeps them)."""
    from disagmoe.kernels import moe_ffn

    counts_ME = [[300, 0, 1000, 7, 0], [129, 511, 64, 3, 0], [0, 900, 17, 250, 0]]
    hidden, ffn = 512, 384
    batches = _micro_batches(counts_ME, "cuda", torch.bfloat16, hidden=hidden)
    experts = len(counts_ME[0])
    default = moe_ffn.FFNTiles.for_shape(1500, experts, hidden, ffn, torch.device("cuda"))
    tiles = dataclasses.replace(default, wgrad_w2=dataclasses.replace(default.wgrad_w2, atomic_accumulate=atomic),
                                wgrad_w13=dataclasses.replace(default.wgrad_w13, atomic_accumulate=atomic))
    old = _step(moe_ffn, batches, experts, False, False, tiles, "cuda", torch.bfloat16, ffn)
    new = _step(moe_ffn, batches, experts, True, deferred, tiles, "cuda", torch.bfloat16, ffn)
    torch.cuda.synchronize()
    for a, b in zip(old, new, strict=True):
        assert torch.equal(_bits(a), _bits(b))
        assert torch.isfinite(b).all() and not b[4].any()
