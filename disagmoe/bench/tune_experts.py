"""`disagmoe bench tune-experts`: pick the grouped GEMM tiles per shape class on this GPU.

Checks each candidate TileConfig against the heuristic tiles' result, then times it on each launch
(role) of the expert FFN, forward and backward, for the benchmark shapes, and writes the fastest
per shape class to disagmoe/kernels/tuned/<gpu>.json (data, looked up at launch by
disagmoe.kernels.tile_configs). Legend as in grouped_gemm.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from disagmoe.bench.experts import ExpertShape
from disagmoe.bench.timing import environment, median_ms
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import TUNED_DIR, TileConfig, gpu_slug, heuristic, shape_class

# (block_m, block_n, block_k, num_warps, num_stages, programs_per_sm[, flatten]); block_m tiles
# the rows (for the weight gradients: the reduction over rows), block_n the output columns, block_k
# the reduction (for the weight gradients: the output rows). Two programs per SM hide one tile's
# pipeline start and epilogue under the other's main loop, at the price of fewer stages.
ROW_GEMM_CANDIDATES = [(128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 128, 64, 8, 4, 1),
                       (128, 128, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (256, 128, 64, 8, 3, 1),
                       (64, 256, 64, 8, 4, 1), (64, 128, 64, 4, 3, 2), (128, 128, 64, 8, 2, 2),
                       (128, 256, 64, 8, 4, 1, True), (128, 128, 64, 8, 4, 1, True),
                       (64, 256, 64, 8, 4, 1, True)]
GATE_UP_CANDIDATES = [(128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (64, 128, 64, 4, 4, 1),
                      (128, 64, 64, 4, 4, 1), (64, 256, 64, 8, 3, 1), (128, 128, 32, 8, 5, 1),
                      (64, 128, 64, 4, 3, 2), (128, 128, 32, 8, 3, 2),
                      (128, 128, 32, 8, 5, 1, True), (64, 128, 64, 4, 4, 1, True)]
WGRAD_CANDIDATES = [(64, 128, 128, 8, 3, 1), (64, 256, 128, 8, 3, 1), (64, 128, 128, 4, 4, 1),
                    (32, 128, 128, 4, 5, 1), (64, 128, 256, 8, 3, 1), (128, 128, 128, 8, 3, 1),
                    (64, 128, 128, 4, 3, 2), (64, 256, 128, 8, 2, 2), (32, 128, 128, 4, 3, 2),
                    (64, 256, 128, 8, 3, 1, True), (64, 128, 128, 4, 3, 2, True),
                    (32, 128, 128, 4, 3, 2, True)]


def candidates(role: str) -> list[TileConfig]:
    table = (GATE_UP_CANDIDATES if role == "gate_up" else
             WGRAD_CANDIDATES if role.startswith("wgrad") else ROW_GEMM_CANDIDATES)
    return [TileConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s,
                       programs_per_sm=p, flatten=bool(rest and rest[0]))
            for m, n, k, w, s, p, *rest in table]


def role_launches(shape: ExpertShape,
                  device: torch.device) -> dict[str, Callable[[TileConfig], torch.Tensor]]:
    """Per role, a function launching that GEMM of the expert FFN with a given tile config."""
    experts, hidden, ffn, top_k = shape.dims
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    idx = shape.routing(seed=0).reshape(-1)
    offsets = torch.bincount(idx, minlength=experts).cumsum(0).to(device, torch.int32)
    rows = shape.pairs
    x, dy = torch.randn(rows, hidden, **bf16), torch.randn(rows, hidden, **bf16)
    act, h13 = torch.randn(rows, ffn, **bf16), torch.randn(rows, 2 * ffn, **bf16)
    dh13 = torch.randn(rows, 2 * ffn, **bf16)
    w13 = torch.randn(experts, hidden, 2 * ffn, **bf16) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, **bf16) / ffn**0.5
    out_h, out_f, out_2f = torch.empty_like(x), torch.empty_like(act), torch.empty_like(h13)
    h13_out = torch.empty_like(h13)
    dw13, dw2 = torch.empty_like(w13), torch.empty_like(w2)
    return {
        "gate_up": lambda c: gg.ragged_rows_gemm(x, offsets, w13, c, epilogue=gg.EPILOGUE_SWIGLU,
                                                 h13_N2C=h13_out, out=out_f),
        "down": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c, out=out_h),
        "down_dgrad": lambda c: gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), c,
                                                    epilogue=gg.EPILOGUE_SWIGLU_GRAD,
                                                    h13_N2C=h13, out=out_2f),
        "gate_up_dgrad": lambda c: gg.ragged_rows_gemm(dh13, offsets, w13.transpose(1, 2), c,
                                                       out=out_h),
        "wgrad_w2": lambda c: gg.ragged_weight_grad(act, dy, offsets, c, out=dw2),
        "wgrad_w13": lambda c: gg.ragged_weight_grad(x, dh13, offsets, c, out=dw13),
    }


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def tune(shapes: list[ExpertShape], warmup: int, iters: int,
         log: Callable[[str], None] = print) -> dict:
    """Best tile per (role, shape class) with its time and the heuristic's, for every shape."""
    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench tune-experts` needs a CUDA GPU (none is visible)")
    device = torch.device("cuda")
    results = {}
    for shape in shapes:
        name = shape.name
        experts, hidden, ffn, _ = shape.dims
        gemm_flops = 2.0 * shape.pairs * hidden * ffn
        for role, launch in role_launches(shape, device).items():
            flops = gemm_flops * (2 if role in ("gate_up", "gate_up_dgrad", "wgrad_w13") else 1)
            k, c = FFNTiles.gemm_dims(hidden, ffn)[role]
            reference = launch(heuristic(role)).clone()
            timed = []
            for config in [heuristic(role), *candidates(role)]:
                try:
                    error = _relative_error(launch(config), reference)
                    if not error < 1e-2:  # a tiling must compute the same function
                        log(f"  reject {role} {config}: relative error {error:.1e}")
                        continue
                    timed.append((median_ms(lambda _: launch(config), warmup, iters), config))
                except Exception as err:  # a tile that does not fit (shared memory, registers)
                    log(f"  skip {role} {config}: {type(err).__name__}")
            best_ms, best = min(timed, key=lambda t: t[0])
            key = shape_class(role, k, c, shape.pairs, experts)
            results[key] = {"config": best.to_json(), "ms": best_ms,
                            "tflops": flops / best_ms / 1e9, "heuristic_ms": timed[0][0],
                            "shape": name}
            log(f"{name:20s} {role:14s} best {best_ms:7.3f} ms ({flops / best_ms / 1e9:4.0f} "
                f"TFLOP/s), heuristic {timed[0][0]:7.3f} ms: {best}")
    return {"environment": environment(device), "results": results}


def write_tuned(record: dict, out: Path | None) -> Path:
    """Merge the winners into the GPU's tuned table (the data the launcher reads)."""
    path = out or TUNED_DIR / f"{gpu_slug(record['environment']['gpu'])}.json"
    table = json.loads(path.read_text()) if path.exists() else {"entries": {}, "measured": {}}
    table["environment"] = record["environment"]
    for key, result in sorted(record["results"].items()):
        table["entries"][key] = result["config"]
        table["measured"][key] = {k: v for k, v in result.items() if k != "config"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path
