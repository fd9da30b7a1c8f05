# session 40 diagnosis: does the Gluon FP8 weight gradient's rate grow with its item length (chunks an item)?
import torch
from disagmoe.kernels import fp8, fp8_gluon
dev, E, H, F = torch.device("cuda"), 8, 4096, 14336
def case(R):
    N = E * R
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * R
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    dh13 = torch.randn(N, 2 * F, device=dev, dtype=torch.bfloat16)
    qa, sa, pad = fp8.quantize_token_groups(x, offs)
    qb, sb, _ = fp8.quantize_token_groups(dh13, offs)
    return N, (qa, sa), (qb, sb), pad
main = torch.zeros(E, H, 2 * F, device=dev, dtype=torch.float32)
def timed(fn, flop):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(10):
        fn()
    e.record(); torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 10
    return ms, flop / ms / 1e9
rows = []
for R in (1024, 2048, 4096):
    N, a, b, pad = case(R)
    flop = 2.0 * N * H * 2 * F
    for stages in (3, 4, 5):
        for bn in (64, 128):
            try:
                ms, tf = timed(lambda: fp8_gluon.gluon_fp8_weight_grad(a, b, pad, out=main, accumulate=True, stages=stages, block_n=bn), flop)
                rows.append((f"R={R} ({R // 128} chunks) stages={stages} block_n={bn}", ms, tf))
            except ValueError as err:
                rows.append((f"R={R} stages={stages} block_n={bn}: {err}"[:90], 0, 0))
    if R == 2048:
        ms, tf = timed(lambda: fp8_gluon.gluon_fp8_weight_grad(a, b, pad, out=main, accumulate=True, second=(a, b, pad)), 2 * flop)
        rows.append(("R=2048 paired with itself (32 chunks an item)", ms, tf))
    del a, b
    torch.cuda.empty_cache()
for name, ms, tf in rows:
    print(f"{name:60} {ms:8.3f} ms {tf:7.0f} TFLOP/s", flush=True)
