# Session 48 (diagnosis, for the next lease): what the bf16 gate/up GEMM's SwiGLU epilogue costs on the Mixtral and
# Qwen3 configs' launches (issue 20 item 3: Mixtral's forward at 81% of the matmul ceiling against the bar's 84%;
# the H200 table's gate/up runs at 706 TFLOP/s where its down GEMM runs at 776). Each launch over the same rows and
# weights, CUDA-event medians of 20, the class's tile from this GPU's table (`FFNTiles.for_shape`):
#   train    SwiGLU epilogue, act and the pre-activations h13 stored (as a training step launches it)
#   act      SwiGLU epilogue, act only (no h13: 2F of each row's 3F bf16 columns not written)
#   plain    no epilogue: x @ w13 into [rows, 2F] at the down GEMM's tile (the bare GEMM of the same FLOPs)
#   gluon    the Gluon SwiGLU kernel at each of the tuner's tiles (act by TMA where it says so), h13 stored
#   stored   our Triton kernel storing act and h13 by TMA (`TileConfig.tma_store`, session 48) at each gate/up tile
#            the tuner offers it on
# The gap train - plain is what the epilogue costs; train - act what storing h13 costs of it.
# Run: python docs/measurements/gate-up-epilogue-probe-s48.py   (one GPU; about a minute with a warm Triton cache)
import dataclasses

import torch

from disagmoe.bench.tune_experts import GLUON_SWIGLU_CANDIDATES, candidates
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles

dev = torch.device("cuda")
SHAPES = {"mixtral (8 x 4096 -> 14336, 2048 rows each)": (8, 4096, 14336, 2048),
          "qwen3 m=2 (128 x 2048 -> 768, 2048 rows each)": (128, 2048, 768, 2048)}


def med(fn, n=20):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[n // 2]


def probe(name, E, H, F, per_expert):
    rows = E * per_expert
    offsets = (torch.arange(1, E + 1, device=dev, dtype=torch.int64) * per_expert).to(torch.int32)
    x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(E, H, 2 * F, device=dev, dtype=torch.bfloat16) / H**0.5
    act = torch.empty(rows, F, device=dev, dtype=torch.bfloat16)
    h13 = torch.empty(rows, 2 * F, device=dev, dtype=torch.bfloat16)
    tiles = FFNTiles.for_shape(rows, E, H, F, dev)
    flops = 2.0 * rows * H * 2 * F
    variants = {
        f"train ({'gluon' if tiles.gate_up.gluon else 'triton'} table tile)": (
            lambda: gg.ragged_rows_gemm(x, offsets, w13, tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13,
                                        out=act), 3 * F),
        "act only (table tile)": (
            lambda: gg.ragged_rows_gemm(x, offsets, w13, tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU, out=act), F),
        "plain [rows, 2F] (down's tile)": (
            lambda: gg.ragged_rows_gemm(x, offsets, w13, dataclasses.replace(tiles.down, library=False), out=h13),
            2 * F),
    }
    for bm, bn, stages, tma in GLUON_SWIGLU_CANDIDATES:
        tile = dataclasses.replace(tiles.gate_up, gluon=True, gluon_block_m=bm, gluon_block_n=bn, gluon_stages=stages,
                                   gluon_tma_store=tma)
        variants[f"gluon {bm}x{bn} s{stages}{' tma' if tma else ''}"] = (
            lambda tile=tile: gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13,
                                                  out=act), 3 * F)
    for tile in (t for t in candidates("gate_up") if t.tma_store):
        variants[f"stored {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"] = (
            lambda tile=tile: gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13,
                                                  out=act), 3 * F)
    for label, (fn, stored_columns) in variants.items():
        try:
            ms = med(fn)
        except Exception as err:  # a tile that does not fit here
            print(f"{name:48} {label:34} skipped: {type(err).__name__}")
            continue
        print(f"{name:48} {label:34} {ms:7.3f} {flops / ms / 1e9:8.0f} {rows * stored_columns * 2 / 1e9:9.2f}")


print(f"{'shape':48} {'variant':34} {'ms':>7} {'TFLOP/s':>8} {'GB stored':>9}")
for name, dims in SHAPES.items():
    probe(name, *dims)
    torch.cuda.empty_cache()
