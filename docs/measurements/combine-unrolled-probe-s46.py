# Session 46 (diagnosis): the combine's forward at the Qwen3 config's shape (32,768 tokens a micro-batch, top-8,
# hidden 2,048, bf16, with the residual) in session 45's kernel (a runtime k loop, 256 columns a program:
# `git show 7c52ff8^:disagmoe/kernels/permute.py > permute_s45.py`, beside this script) and today's
# (k unrolled, 128 columns): CUDA-event medians of 30 launches, the bytes
# moved over the time; and the backward for scale. The same outputs are checked bit for bit.
import importlib.util, sys, torch
sys.path.insert(0, ".")
from disagmoe.kernels import permute as new
spec = importlib.util.spec_from_file_location("permute_s45", "permute_s45.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cuda")
def med(fn, n=30):
    for _ in range(3): fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev: a.record(); fn(); b.record()
    torch.cuda.synchronize(); return sorted(a.elapsed_time(b) for a, b in ev)[n // 2]
print(f"{'shape':24} {'kernel':10} {'ms':>7} {'GB/s':>7}")
for T, K, H in ((32768, 8, 2048), (16384, 2, 4096), (16384, 6, 2048)):
    g = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randn(T * K, H, device=dev, dtype=torch.bfloat16, generator=g)
    dest = torch.randperm(T * K, device=dev, generator=g).to(torch.int32).view(T, K)
    w = torch.rand(T, K, device=dev, generator=g)
    h = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    assert torch.equal(old.combine_forward(rows, dest, w, residual_TH=h),
                       new.combine_forward(rows, dest, w, residual_TH=h))
    gb = (T * K * H * 2 + 2 * T * H * 2) / 1e9
    for name, mod in (("s45", old), ("unrolled", new)):
        ms = med(lambda: mod.combine_forward(rows, dest, w, residual_TH=h))
        print(f"{f'T{T} K{K} H{H}':24} {name:10} {ms:7.3f} {gb / ms * 1e3:7.0f}")
    for name, mod in (("s45 pbwd", old), ("unr pbwd", new)):  # the permute's backward: no weights, no residual
        ms = med(lambda: mod.combine_forward(rows, dest, None))
        print(f"{f'T{T} K{K} H{H}':24} {name:10} {ms:7.3f} {(T * K * H * 2 + T * H * 2) / 1e9 / ms * 1e3:7.0f}")
    dy = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    ms = med(lambda: new.combine_backward(dy, rows, dest, w))
    print(f"{f'T{T} K{K} H{H}':24} {'backward':10} {ms:7.3f} {(2 * T * K * H * 2 + T * H * 2) / 1e9 / ms * 1e3:7.0f}")
