"""`disagmoe bench quantise`: the FP8 quantisers' GPU time with and without their counters, against
the HBM copy rate measured in the same run.

A step under `precision: fp8` quantises every expert GEMM operand it reads (`kernels.fp8`: the rows
x and dy, the SwiGLU output from h13, d h13; the weights' 128 x 128 block copies once a step; with
`fp8_expert_backward: fp8` the weight gradients' token-contiguous copies, 128 x 1 token groups padded
per expert, of x and act, and of dy and d h13 beside their 1 x 128 rows from one pass) and the dense
projections' operands (`kernels.fp8_rowwise`), each with its `Fp8Stats` counters. These are
HBM-bound passes: their bytes (read + written) over their kernel time against the copy rate say how
far from the bound each runs, and the two columns say what the counters cost (session 20 found them
2.4-4.8x the quantising; docs/benchmarks.md). Shapes are `bench experts`' (`--shape`): one
micro-batch's rows of that model's experts on one rank, grouped by its seeded Zipf routing.

`--epilogues` adds the kernels that quantise their own output 1 x 128 beside their work (the default
recipe's bf16 gate/up GEMM writing the down GEMM's e4m3 act, the weighted combine's backward writing the
experts' e4m3 dy rows) against the same kernel writing bf16 and the row quantiser's pass after it: the
same bytes out, so their times alone say which a step should run.

Legend: N rows (token-expert pairs), T tokens (N / top-k), E local experts, H hidden, F expert FFN,
P padded rows (each expert's rows rounded up to 128, `fp8.padded_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagmoe.bench.experts import SHAPES
from disagmoe.bench.timing import environment, hbm_copy_gbps, kernel_ms


@dataclass(frozen=True)
class Case:
    """One quantiser launch: its name, the input's shape, and the bytes it moves (read + written:
    bf16 in, e4m3 out, a 4-byte scale per 128 values (per row for the rowwise one); the block copy
    writes its values twice, the transposed copy beside them; a token-group copy writes all P
    padded rows of each column, the padding too)."""

    name: str
    kind: str  # rows | swiglu | blocks | rowwise | token_groups | rows_and_token_groups: which quantiser (`launch`)
    shape: tuple[int, ...]
    bytes: int


def cases(shape: str) -> list[Case]:
    """The quantisers one micro-batch of `shape` runs (`bench experts`' SHAPES), in step order."""
    from disagmoe.kernels.fp8 import padded_capacity

    experts, hidden, ffn, top_k = SHAPES[shape].dims
    rows = SHAPES[shape].pairs
    tokens = rows // top_k
    padded = padded_capacity(rows, experts)

    def group_bytes(*dims: int, read: int = 2, copies: int = 1) -> int:
        values = 1
        for d in dims:
            values *= d
        return values * read + copies * (values + 4 * values // 128)

    def token_group_bytes(k: int, rows_too: bool = False) -> int:
        """bf16 [N, k] read; the [k, P] copy and its scales written (and the 1 x 128 rows copy: `rows_too`)."""
        return rows * k * 2 + group_bytes(k, padded, read=0) + (group_bytes(rows, k, read=0) if rows_too else 0)

    return [
        Case("x (and dy), 1 x 128", "rows", (rows, hidden), group_bytes(rows, hidden)),
        Case("act from h13, 1 x 128", "swiglu", (rows, 2 * ffn), rows * 2 * ffn * 2 + group_bytes(rows, ffn, read=0)),
        Case("d h13, 1 x 128", "rows", (rows, 2 * ffn), group_bytes(rows, 2 * ffn)),
        Case("w13 and its transpose, 128 x 128", "blocks", (experts, hidden, 2 * ffn),
             group_bytes(experts, hidden, 2 * ffn, copies=2)),
        Case("a dense projection's input, rowwise", "rowwise", (tokens, hidden), tokens * hidden * 3 + 4 * tokens),
        Case("dy, 1 x 128 and 128 x 1", "rows_and_token_groups", (rows, hidden), token_group_bytes(hidden, True)),
        Case("act, 128 x 1 token groups", "token_groups", (rows, ffn), token_group_bytes(ffn)),
        Case("d h13, 1 x 128 and 128 x 1", "rows_and_token_groups", (rows, 2 * ffn), token_group_bytes(2 * ffn, True)),
        Case("x, 128 x 1 token groups", "token_groups", (rows, hidden), token_group_bytes(hidden)),
    ]


def launch(case: Case, x: torch.Tensor, stats_row: torch.Tensor | None,
           offsets_E: torch.Tensor) -> Callable[[int], object]:
    """fn(i) running `case`'s quantiser on `x` (counting into `stats_row` where given); the token-group
    quantisers group x's rows by `offsets_E`."""
    from disagmoe.kernels import fp8, fp8_rowwise

    if case.kind == "swiglu":
        return lambda _: fp8.quantize_swiglu_rows(x, stats_row)
    if case.kind == "rows":
        return lambda _: fp8.quantize_rows(x, stats_row)
    if case.kind == "blocks":
        transposed = torch.empty((x.shape[0], x.shape[2], x.shape[1]), dtype=fp8.FP8, device=x.device)
        return lambda _: fp8.quantize_blocks(x, stats_row, transposed_out=transposed)
    if case.kind == "token_groups":
        return lambda _: fp8.quantize_token_groups(x, offsets_E, stats_row)
    if case.kind == "rows_and_token_groups":
        return lambda _: fp8.quantize_rows_and_token_groups(x, offsets_E, stats_row, offsets_E[-1:])
    return lambda _: fp8_rowwise.quantize_rowwise(x, stats_row)


def epilogue_launches(shape: str, device: torch.device,
                      gen: torch.Generator) -> list[tuple[str, Callable[[int], object], Callable[[int], object],
                                                          Callable[[int], object]]]:
    """(name, plain, fused, separate) per quantising epilogue of one micro-batch of `shape`: the kernel
    writing bf16 alone, the kernel quantising its output itself, and the kernel then `fp8.quantize_rows`
    of its output (what a step ran before the fused one)."""
    from disagmoe.kernels import fp8, permute
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.moe_ffn import FFNTiles
    from disagmoe.kernels.tile_configs import launching_for

    experts, hidden, ffn, top_k = SHAPES[shape].dims
    rows = SHAPES[shape].pairs
    tokens = rows // top_k
    offsets_E = SHAPES[shape].offsets(device)
    bf16 = dict(generator=gen, device=device, dtype=torch.bfloat16)
    x_NH = torch.randn(rows, hidden, **bf16)
    w13_EH2F = torch.randn(experts, hidden, 2 * ffn, **bf16) / hidden**0.5
    h13_N2F = torch.empty(rows, 2 * ffn, device=device, dtype=torch.bfloat16)
    with launching_for(SHAPES[shape].loads):  # the shape's own loads, not whatever the process last launched for
        gate_up = FFNTiles.for_shape(rows, experts, hidden, ffn, device, torch.bfloat16).gate_up

    def swiglu(quantized_out=None):
        return gg.ragged_rows_gemm(x_NH, offsets_E, w13_EH2F, gate_up, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_N2F,
                                   quantized_out=quantized_out)

    dy_TH, rows_NH = torch.randn(tokens, hidden, **bf16), torch.randn(rows, hidden, **bf16)
    dest_TK = torch.randperm(rows, generator=gen, device=device).view(tokens, top_k).to(torch.int32)
    w_TK = torch.rand(tokens, top_k, generator=gen, device=device, dtype=torch.bfloat16)
    out = []
    if gg.swiglu_quantizes(gate_up):
        act = fp8.empty_quantized_rows(rows, ffn, device)
        out.append(("act by the gate/up GEMM's SwiGLU epilogue", lambda _: swiglu(), lambda _: (swiglu(act), act[1]),
                    lambda _: fp8.quantize_rows(swiglu())))
    out.append(("dy by the weighted combine's backward", lambda _: permute.combine_backward(dy_TH, rows_NH, dest_TK, w_TK),
                lambda _: permute.combine_backward_quantized(dy_TH, rows_NH, dest_TK, w_TK),
                lambda _: fp8.quantize_rows(permute.combine_backward(dy_TH, rows_NH, dest_TK, w_TK)[0])))
    return out


def run(shapes: list[str], warmup: int = 3, iters: int = 10, log: Callable[[str], None] = print,
        epilogues: bool = False) -> dict:
    """Time every case of `shapes` without and with counters, and the HBM copy, on cuda:0; with
    `epilogues` also each quantising epilogue against its kernel and pass (`epilogue_launches`)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("`disagmoe bench quantise` times the FP8 quantisers on a GPU with FP8 tensor cores "
                         "(sm_89 or newer); none is visible here")
    from disagmoe.kernels.fp8_stats import ACTIVATIONS, Fp8Stats

    device = torch.device("cuda", 0)
    copy_gbps = hbm_copy_gbps(device, warmup, iters)
    stats = Fp8Stats(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for shape in shapes:
        offsets_E = SHAPES[shape].offsets(device)
        for case in cases(shape):
            log(f"{shape}: {case.name} {case.shape}")
            x = torch.randn(case.shape, generator=gen, device=device, dtype=torch.bfloat16)
            plain = kernel_ms(launch(case, x, None, offsets_E), warmup, iters)
            counted = kernel_ms(launch(case, x, stats.row(ACTIVATIONS), offsets_E), warmup, iters)
            stats.reset()
            rows.append({"shape": shape, "quantiser": case.name, "input": list(case.shape), "bytes": case.bytes,
                         "ms": plain, "ms_with_counters": counted, "counters_cost": counted / plain,
                         "gbps": case.bytes / plain / 1e6, "of_copy_rate": case.bytes / plain / 1e6 / copy_gbps,
                         "gbps_with_counters": case.bytes / counted / 1e6,
                         "of_copy_rate_with_counters": case.bytes / counted / 1e6 / copy_gbps})
            del x
    fused = []
    for shape in shapes if epilogues else []:
        for name, plain, together, apart in epilogue_launches(shape, device, gen):
            log(f"{shape}: {name}")
            ms = {key: kernel_ms(fn, warmup, iters) for key, fn in (("plain", plain), ("fused", together),
                                                                     ("separate", apart))}
            fused.append({"shape": shape, "epilogue": name, "plain_ms": ms["plain"], "fused_ms": ms["fused"],
                          "separate_ms": ms["separate"], "fused_over_separate": ms["fused"] / ms["separate"]})
        torch.cuda.empty_cache()
    return {"environment": environment(device), "copy_gbps": copy_gbps, "rows": rows, "epilogues": fused}
