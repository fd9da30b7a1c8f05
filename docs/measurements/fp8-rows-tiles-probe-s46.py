# Session 46 (diagnosis): the FP8 Gluon row GEMM on Mixtral's down (K 14,336 -> 4,096) and gate/up (K 4,096 ->
# 28,672) GEMMs, 8 experts of 2,048 rows, at 128 x 128 (4 stages, plain and TMA store) and 256 x 128 (3 and 4
# stages): CUDA-event medians of 20 launches each. Session 45's ncu put 256 x 128 x 3 at 1.23x 128 x 128 x 4 on the
# down GEMM, where session 44's block had the 256-row recipe slower.
import torch
from disagmoe.kernels import fp8, fp8_gluon
from disagmoe.kernels.fp8_ffn import Fp8ExpertWeights
dev = torch.device("cuda")
E, H, F, pairs = 8, 4096, 14336, 16384
offsets = (torch.arange(1, E + 1, device=dev, dtype=torch.int64) * (pairs // E)).to(torch.int32)
act = torch.randn(pairs, F, device=dev, dtype=torch.bfloat16)
x = torch.randn(pairs, H, device=dev, dtype=torch.bfloat16)
w13 = torch.randn(E, H, 2 * F, device=dev, dtype=torch.bfloat16) / H**0.5
w2 = torch.randn(E, F, H, device=dev, dtype=torch.bfloat16) / F**0.5
weights = Fp8ExpertWeights.quantize(w13, w2)
q_act, s_act = fp8.quantize_rows(act)
q_x, s_x = fp8.quantize_rows(x)
def med(fn, n=20):
    for _ in range(3): fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev: a.record(); fn(); b.record()
    torch.cuda.synchronize(); return sorted(a.elapsed_time(b) for a, b in ev)[n // 2]
print(f"{'gemm':8} {'tile':18} {'ms':>7} {'TFLOP/s':>8}")
gemms = {"down": (q_act, s_act, weights.w2, H, F), "gate_up": (q_x, s_x, weights.w13, 2 * F, H)}
for name, (q, s, w, n_out, k) in gemms.items():
    out = torch.empty(pairs, n_out, device=dev, dtype=torch.bfloat16)
    for block_m, stages, tma in ((128, 4, False), (128, 4, True), (256, 3, False), (256, 4, False)):
        ms = med(lambda: fp8_gluon.gluon_fp8_rows_gemm(q, s, offsets, *w, out=out, block_m=block_m, stages=stages,
                                                       tma_store=tma))
        print(f"{name:8} {f'{block_m}x128 s{stages}' + (' tma' if tma else ''):18} {ms:7.3f} "
              f"{2 * pairs * k * n_out / ms / 1e9:8.0f}")
