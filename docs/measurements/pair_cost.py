"""Scratch measurement (not a product benchmark; docs/benchmarks.md, session 5): on one GPU, the
Qwen3-30B expert shape, a MoE layer's expert side forward and backward: the compact path (permute,
experts, weighted combine) against the pair-row path into local buffers (grouping by band, the
fused down / dgrad epilogues storing pair rows with flags, combine_landed, the input-gradient sum).

    PAIR_BANDS=1 COMBINE_PROGS=528 python3 docs/measurements/pair_cost.py    # PROFILE=1: top kernels
"""
import torch
from disagmoe.comm.base import PairLanding, PairTarget
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.local_experts import local_expert_block
from disagmoe.runtime.stages import pair_return

T, K, E, H, F, ST = 8192, 8, 128, 2048, 768, 256
dev, dt = torch.device("cuda"), torch.bfloat16
torch.manual_seed(0)
experts = RoutedExperts(E, H, F, backend="triton").to(dev, dt)
with torch.no_grad():
    experts.w13_EH2F.normal_(0, 0.02); experts.w2_EFH.normal_(0, 0.02)
x = torch.randn(T, H, device=dev, dtype=dt)
topk = torch.rand(T, E, device=dev).topk(K).indices.to(torch.int32)
w = torch.softmax(torch.randn(T, K, device=dev), -1).to(dt)
dy = torch.randn(T, H, device=dev, dtype=dt)
S = -(-T // ST)
rows, drows = (torch.zeros(T * K, H, device=dev, dtype=dt) for _ in range(2))
flags, dflags = (torch.zeros(1, S, dtype=torch.int64, device=dev) for _ in range(2))
counters = torch.zeros(S, dtype=torch.int32, device=dev)
status = torch.zeros(2, dtype=torch.int32, device=dev)
seq = [0]

def compact():
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    local_expert_block(xl, topk, wl, experts).backward(dy)
    return xl.grad

import os
BANDS = int(os.environ.get("PAIR_BANDS", "4")); PROGS = int(os.environ.get("COMBINE_PROGS", "16"))

def pair():
    seq[0] += 1
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    saved = pair_return.expert_pair_rows(xl, topk, w, experts, PairTarget(rows, flags, 0, seq[0]), counters, ST,
                                         bands=BANDS)
    y = pair_return.combine_pairs(PairLanding(rows, flags, seq[0], status), wl, ST, num_programs=PROGS)
    y.backward(dy)
    pair_return.expert_pair_rows_backward(saved, dy, PairTarget(drows, dflags, 0, seq[0]), counters, ST)
    return pair_return.sum_pairs(PairLanding(drows, dflags, seq[0], status), K, ST, num_programs=PROGS)

def timed(fn, iters=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        out = fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / iters, out

t_c, dx_c = timed(compact)
t_p, dx_p = timed(pair)
err = ((dx_p.float() - dx_c.float()).norm() / dx_c.float().norm()).item()
print(f"bands {BANDS} combine programs {PROGS}: expert side fwd+bwd, T={T} K={K} E={E} H={H} F={F}: compact {t_c:.2f} ms, pair rows (local buffers) {t_p:.2f} ms, "
      f"ratio {t_p / t_c:.2f}, dx rel err {err:.2e}, status {status.tolist()}")

if __import__("os").environ.get("PROFILE"):
    from torch.profiler import ProfilerActivity, profile
    for name, fn in (("compact", compact), ("pair", pair)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name}: top kernels (ms per iteration)")
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:10]
        for e in events:
            print(f"{e.device_time_total / 3e3:8.3f} ms  x{e.count // 3:3d}  {e.key[:90]}")
