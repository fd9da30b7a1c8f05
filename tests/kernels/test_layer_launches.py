"""The launches `disagmoe bench layer` times (disagmoe/bench/layer.py: `ExpertSide.launch`, `combine`)
under the interpreter, here for its fixture: GPU 1's forward and backward storing every pair row
at its pair row, locally (the baseline) and with flags raised per segment into a buffer standing
for GPU 0's (the fused path), then GPU 0's combine; against the plain torch MoE layer (fp32)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

pytestmark = pytest.mark.slow  # starts processes (Ray, gloo) or compiles: the quick subset skips it

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


@pytest.fixture
def modules(interpreted):
    *_, layer = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fused_return",
                            "disagmoe.bench.layer")
    return layer


def _fp32(layer, inputs):
    return layer.LayerInputs(*(t.float() if t.is_floating_point() else t for t in (
        inputs.x_TH, inputs.topk_TK, inputs.weights_TK, inputs.w13_EH2F, inputs.w2_EFH, inputs.dy_TH)))


@pytest.mark.parametrize("segment_tokens", [8, 64], ids=["5-segments", "one-segment"])
def test_both_variants_return_every_row_and_combine_to_the_reference(modules, segment_tokens):
    layer = modules
    from disagmoe.kernels import fused_return as fr  # reloaded by the fixture: the interpreted build
    from disagmoe.kernels.moe_ffn import FFNTiles

    shape = layer.LayerShape("tiny", experts=6, hidden=40, ffn=24, top_k=3, tokens=37)
    inputs = _fp32(layer, layer.make_inputs(shape, torch.device("cpu"), seed=2))
    want = layer.reference_results(inputs)
    pairs_N, offsets_E = layer.group_pairs(inputs.topk_TK, shape.experts)
    x_NH, dy_NH = layer.expert_rows(inputs, pairs_N)
    side = layer.ExpertSide(x_NH, dy_NH, pairs_N, offsets_E, inputs.w13_EH2F, inputs.w2_EFH, shape.top_k,
                            FFNTiles.uniform(SMALL_TILES), num_programs=3)
    segments = fr.num_segments(shape.tokens, segment_tokens)
    by_segment = side.in_segment_order(segment_tokens, segments)
    flags_QS = torch.zeros(1, segments, dtype=torch.int64)
    consumed_QS = torch.zeros_like(flags_QS)
    counters_S = torch.zeros(segments, dtype=torch.int32)
    ready_QS = torch.full((1, segments), layer.READY, dtype=torch.int64)
    ready_consumed_QS = torch.zeros_like(ready_QS)
    status = torch.zeros(2, dtype=torch.int32)
    close = dict(rtol=1e-4, atol=1e-4)
    for i, (p, name) in enumerate((("fwd", "y"), ("bwd", "dx"))):
        local_PH = torch.full((shape.pairs, shape.hidden), float("nan"))
        side.launch(p, local_PH)
        baseline = layer.combine(local_PH, p, inputs.weights_TK, ready_QS, ready_consumed_QS, segment_tokens,
                                 shape.top_k, 2, status)
        peer_PH = torch.full((shape.pairs, shape.hidden), float("nan"))  # GPU 0's buffer, in the test a CPU tensor
        side.launch(p, peer_PH, layer.Signal(flags_QS, counters_S, segment_tokens))
        assert (flags_QS == 2 * i + 1).all() and (counters_S == 0).all()  # one message counted per launch
        fused = layer.combine(peer_PH, p, inputs.weights_TK, flags_QS, consumed_QS, segment_tokens, shape.top_k, 2,
                              status)
        assert status.tolist() == [0, 0] and (consumed_QS == 2 * i + 1).all()
        assert torch.equal(peer_PH, local_PH), "the same kernels store the same rows"
        by_segment_PH = torch.full((shape.pairs, shape.hidden), float("nan"))  # `--order segment`'s rows
        by_segment.launch(p, by_segment_PH, layer.Signal(flags_QS, counters_S, segment_tokens))
        assert (flags_QS == 2 * i + 2).all() and (counters_S == 0).all()
        consumed_QS += 1  # that message is not combined here
        torch.testing.assert_close(by_segment_PH, local_PH, **close)
        torch.testing.assert_close(baseline, want[name], **close)
        torch.testing.assert_close(fused, want[name], **close)
        if p == "fwd":
            torch.testing.assert_close(layer.router_grad(inputs.dy_TH, peer_PH, shape.top_k), want["d_weights"],
                                       **close)
    dw13, dw2 = side.weight_grads()
    torch.testing.assert_close(dw13, want["dw13"], **close)
    torch.testing.assert_close(dw2, want["dw2"], **close)
