# session 41 sweep: fp8.quantize_blocks' launch shape (rows a chunk, warps, programs an SM) on the expert weights
# as a run quantises them each step (bf16 [E, K, N] in, the natural and transposed e4m3 copies out); every
# shape's bytes and scales checked against the shipped one's (its outputs filled with a sentinel first, so that a
# launch that skips part of them cannot pass on an earlier launch's bytes); each the median of 10 event-timed
# launches after one
import itertools, os, torch
from disagmoe.bench.timing import median_ms
from disagmoe.kernels import fp8
dev = torch.device("cuda")
cases = {"mixtral w13 [8, 4096, 28672]": (8, 4096, 28672), "mixtral w2 [8, 14336, 4096]": (8, 14336, 4096),
         "qwen3 w13 [128, 2048, 1536]": (128, 2048, 1536), "qwen3 w2 [128, 768, 2048]": (128, 768, 2048)}
shipped = (fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM)
grid = (eval(os.environ["CANDIDATES"]) if os.environ.get("CANDIDATES")
        else list(itertools.product((16, 32, 64), (4, 8), (2, 4, 8))))
grid = grid if shipped in grid else [shipped, *grid]


def set_shape(shape):
    fp8.BLOCK_ROWS, fp8.BLOCKS_WARPS, fp8.QUANTISER_PROGRAMS_PER_SM = shape


def quantised(w, q, s, qt):
    q.view(torch.uint8).fill_(0x7F)  # e4m3's NaN: no quantised value
    qt.view(torch.uint8).fill_(0x7F)
    s.fill_(float("nan"))
    return fp8.quantize_blocks(w, transposed_out=qt, out=(q, s))


for name, (E, K, N) in cases.items():
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    q, qt = (torch.empty(shape, device=dev, dtype=fp8.FP8) for shape in ((E, K, N), (E, N, K)))
    s = torch.empty(E, K // 128, N // 128, device=dev)
    set_shape(shipped)
    want = [t.clone() for t in (*quantised(w, q, s, qt), qt)]
    gb = w.numel() * 4 / 1e9  # bf16 read, two e4m3 copies written (scales aside)
    rows = []
    for shape in grid:
        set_shape(shape)
        try:
            got = [*quantised(w, q, s, qt), qt]
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fp8.FP8
                       else torch.equal(a, b) for a, b in zip(got, want))
            timed = median_ms(lambda _: fp8.quantize_blocks(w, transposed_out=qt, out=(q, s)), 1, 10)
            rows.append((timed, shape, same))
        except Exception as err:  # a launch that does not fit (registers, shared memory)
            rows.append((float("inf"), shape, repr(err)[:60]))
    set_shape(shipped)
    rows.sort(key=lambda row: row[0])
    ship = next(row for row in rows if row[1] == shipped)
    print(f"{name}: shipped {shipped} {ship[0]:.3f} ms ({gb / ship[0] * 1e3:,.0f} GB/s)")
    for t, shape, same in rows[:int(os.environ.get("TOP", 6))]:
        print(f"   rows {shape[0]:3} warps {shape[1]} programs/SM {shape[2]}: {t:.3f} ms ({gb / t * 1e3:,.0f} GB/s) "
              f"same bytes: {same}")
    del w, q, qt, s
