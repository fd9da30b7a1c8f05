# session 42 (prepared, not yet run): the Gluon bf16 row GEMMs (kernels/gluon_rows.py) against our Triton kernel at its
# tuned tile and the library's grouped GEMM, on the Qwen3 config's and Mixtral's expert shapes at even loads (one
# micro-batch's rows: Qwen3 8,192 tokens x top-8 over 128 experts; Mixtral 8,192 x top-2 over 8), each launch as the
# bf16 FFN runs it. Timed (median of 20 after 3), or under ncu with argv[1] == "ncu" (each case launched 3 times):
#   ncu --clock-control none -k regex:"_gluon_|_ragged_rows" --launch-skip 1 --launch-count 100 --section SpeedOfLight \
#     --section WarpStateStats --section SchedulerStats python3 docs/measurements/gluon-rows-probe-s42.py ncu
import dataclasses
import sys

import torch

from disagmoe.bench.timing import median_ms
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles

dev = torch.device("cuda")
SHAPES = {"qwen3": (128, 2048, 768, 8192 * 8), "mixtral": (8, 4096, 14336, 8192 * 2)}  # E, H, F, pairs
GLUON = [(128, 128, 4, False), (128, 128, 4, True), (128, 256, 3, False), (128, 256, 3, True)]
cases, flops = {}, {}
for name, (E, H, F, pairs) in SHAPES.items():
    offsets = (torch.arange(1, E + 1, device=dev, dtype=torch.int64) * (pairs // E)).to(torch.int32)
    gen = torch.Generator(device=dev).manual_seed(0)
    randn = lambda *size: torch.randn(*size, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    x, act, dh13 = randn(pairs, H), randn(pairs, F), randn(pairs, 2 * F)
    w13, w2 = randn(E, H, 2 * F) / H**0.5, randn(E, F, H) / F**0.5
    tiles = FFNTiles.for_shape(pairs, E, H, F, dev, torch.bfloat16)
    launches = {  # role: (a, b, tuned tile, epilogue, FLOPs)
        "gate_up": (x, w13, tiles.gate_up, gg.EPILOGUE_SWIGLU, 2.0 * pairs * H * 2 * F),
        "down": (act, w2, tiles.down, gg.EPILOGUE_PLAIN, 2.0 * pairs * F * H),
        "gate_up_dgrad": (dh13, w13.transpose(1, 2), tiles.gate_up_dgrad, gg.EPILOGUE_PLAIN, 2.0 * pairs * 2 * F * H),
    }
    for role, (a, b, tile, epilogue, gemm_flops) in launches.items():
        variants = {"triton (tuned)": dataclasses.replace(tile, gluon=False, library=False)}
        if epilogue == gg.EPILOGUE_PLAIN:
            variants["library"] = dataclasses.replace(tile, gluon=False, library=True)
            for m, n, s, t in GLUON:
                variants[f"gluon {m}x{n} s{s}{' tma' if t else ''}"] = dataclasses.replace(
                    tile, gluon=True, library=False, gluon_block_m=m, gluon_block_n=n, gluon_stages=s,
                    gluon_tma_store=t)
        else:
            for m, n, s, t in [(128, 128, 4, False), (128, 128, 3, False), (128, 128, 4, True), (128, 64, 4, False)]:
                variants[f"gluon swiglu {m}x{n} s{s}{' tma' if t else ''}"] = dataclasses.replace(
                    tile, gluon=True, library=False, gluon_block_m=m, gluon_block_n=n, gluon_stages=s,
                    gluon_tma_store=t)
        for label, config in variants.items():
            key = f"{name} {role} {label}"
            cases[key] = (lambda a=a, b=b, c=config, e=epilogue: gg.ragged_rows_gemm(a, offsets, b, c, epilogue=e))
            flops[key] = gemm_flops
if sys.argv[1:] == ["ncu"]:
    for fn in cases.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    sys.exit(0)
reference = {}
for key, fn in cases.items():
    name, role = key.split()[:2]
    out = fn()
    ref = reference.setdefault((name, role), out.float())
    err = ((out.float() - ref).norm() / ref.norm()).item()
    ms = median_ms(lambda _: fn(), 3, 20)
    print(f"{key:44} {ms:8.3f} ms {flops[key] / ms / 1e9:6.0f} TFLOP/s  rel err vs the first {err:.1e}", flush=True)
