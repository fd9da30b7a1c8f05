# session 41 sweep: fp8.quantize_blocks' launch shape (rows a chunk, warps, programs an SM) on the expert weights
# as a run quantises them each step (bf16 [E, K, N] in, the natural and transposed e4m3 copies out); every
# shape's bytes and scales checked against the shipped one's; each the median of 10 event-timed launches after one
import itertools, os, torch
from disagmoe.bench.timing import median_ms
from disagmoe.kernels import fp8
dev = torch.device("cuda")
cases = {"mixtral w13 [8, 4096, 28672]": (8, 4096, 28672), "mixtral w2 [8, 14336, 4096]": (8, 14336, 4096),
         "qwen3 w13 [128, 2048, 1536]": (128, 2048, 1536), "qwen3 w2 [128, 768, 2048]": (128, 768, 2048)}
shipped = (fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM)
grid = (eval(os.environ["CANDIDATES"]) if os.environ.get("CANDIDATES")
        else list(itertools.product((16, 32, 64), (4, 8), (2, 4, 8))))
for name, (E, K, N) in cases.items():
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    qt = torch.empty(E, N, K, device=dev, dtype=fp8.FP8)
    fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM = shipped
    want_q, want_s = fp8.quantize_blocks(w, transposed_out=qt)
    want_qt = qt.clone()
    gb = w.numel() * 4 / 1e9  # bf16 read, two e4m3 copies written (scales aside)
    rows = []
    for r, warps, per_sm in grid:
        fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM = r, warps, per_sm
        try:
            q, s = fp8.quantize_blocks(w, transposed_out=qt)
            same = (torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
                    and torch.equal(qt.view(torch.uint8), want_qt.view(torch.uint8)))
            rows.append((median_ms(lambda _: fp8.quantize_blocks(w, transposed_out=qt), 1, 10), (r, warps, per_sm), same))
        except Exception as err:  # a launch that does not fit (registers, shared memory)
            rows.append((float("inf"), (r, warps, per_sm), repr(err)[:60]))
    fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM = shipped
    rows.sort(key=lambda row: row[0])
    ship = [row for row in rows if row[1] == shipped]
    print(f"{name}: shipped {shipped} {ship[0][0]:.3f} ms ({gb / ship[0][0] * 1e3:,.0f} GB/s)")
    for t, cfg, same in rows[:int(os.environ.get("TOP", 6))]:
        print(f"   rows {cfg[0]:3} warps {cfg[1]} programs/SM {cfg[2]}: {t:.3f} ms ({gb / t * 1e3:,.0f} GB/s) same bytes: {same}")
    del w, qt
