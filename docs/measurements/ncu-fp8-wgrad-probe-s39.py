# session 39's ncu probe, as call 10 ran it (docs/benchmarks.md, session 39, the ncu diagnosis): the Gluon FP8 weight gradient against the Gluon FP8 row GEMM on Mixtral's
# w13 shape (8 experts x 2048 tokens a micro-batch, KA 4096, C 28672), timed, and under ncu (argv[1] == "ncu": each
# kernel launched 3 times, nothing timed)
import sys, torch
from disagmoe.kernels import fp8, fp8_gluon
from disagmoe.kernels.fp8_ffn import Fp8ExpertWeights
dev, E, R, H, F = torch.device("cuda"), 8, 2048, 4096, 14336
N = E * R
offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * R
x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
dh13 = torch.randn(N, 2 * F, device=dev, dtype=torch.bfloat16)
act = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
qa, sa, pad = fp8.quantize_token_groups(x, offs)
qb, sb, _ = fp8.quantize_token_groups(dh13, offs)
main = torch.zeros(E, H, 2 * F, device=dev, dtype=torch.float32)
w2 = torch.randn(E, F, H, device=dev, dtype=torch.bfloat16) / F ** 0.5
w13 = torch.randn(E, H, 2 * F, device=dev, dtype=torch.bfloat16) / H ** 0.5
weights = Fp8ExpertWeights.quantize(w13, w2, forward="both", backward="fp8")
q_act, s_act = fp8.quantize_rows(act)
q_dh, s_dh = fp8.quantize_rows(dh13)
cases = {
    "wgrad w13 accumulate (tma)": lambda: fp8_gluon.gluon_fp8_weight_grad((qa, sa), (qb, sb), pad, out=main, accumulate=True),
    "wgrad w13 fresh fp32 (tma)": lambda: fp8_gluon.gluon_fp8_weight_grad((qa, sa), (qb, sb), pad, out=main),
    "rows down fwd [N,F]x[F,H]": lambda: fp8_gluon.gluon_fp8_rows_gemm(q_act, s_act, offs, *weights.w2, block_m=128, tma_store=True),
    "rows dx [N,2F]x[2F,H]": lambda: fp8_gluon.gluon_fp8_rows_gemm(q_dh, s_dh, offs, *weights.w13_t, block_m=128, tma_store=True),
}
flops = {"wgrad w13 accumulate (tma)": 2.0 * N * H * 2 * F, "wgrad w13 fresh fp32 (tma)": 2.0 * N * H * 2 * F,
         "rows down fwd [N,F]x[F,H]": 2.0 * N * F * H, "rows dx [N,2F]x[2F,H]": 2.0 * N * 2 * F * H}
if sys.argv[1:] == ["ncu"]:
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    sys.exit(0)
for name, fn in cases.items():
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        fn()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 10
    print(f"{name:30} {ms:8.3f} ms {flops[name] / ms / 1e9:7.0f} TFLOP/s", flush=True)
