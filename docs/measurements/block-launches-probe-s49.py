# Session 49 (diagnosis, for the next lease): where the Mixtral block's fwd+bwd loses time on tiles that win their
# launches alone. On an H100, `bench tune-experts --shape mixtral-8x7b` moved the down GEMM and the down data gradient
# to TMA-store tiles (the latter off the library's grouped GEMM: 3.449 ms against 3.466 alone), and `bench experts
# --main-grads --shape mixtral-8x7b` then ran fwd+bwd 5% slower (613 -> 585 TFLOP/s, same machine, same call);
# `--backend triton:tma-store` (every launch by TMA) had lost 5% on another H100 too. This probe profiles one
# fwd+bwd pass of that block (`bench experts`' triton block, weight gradients into fp32 main gradients) at each tile
# set and prints every GPU kernel of the pass in launch order with its time, side by side:
#   table       the tiles this GPU's tables give the shape (`FFNTiles.for_shape`, routed loads)
#   tma-store   the same with every launch of our Triton kernel storing by TMA (`FFNTiles.on_tma_store`)
#   <file>      the mixtral classes of a tuned table given as an argument (e.g. a retune's returned JSON)
# Run: python docs/measurements/block-launches-probe-s49.py [TABLE.json ...]   (one GPU; about a minute)
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from disagmoe.bench.experts import (SHAPES, _forward_backward, _grad_inputs, make_block, make_inputs, make_output_grad,
                                    time_block)
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import ROLES, TileConfig, shape_class

device = torch.device("cuda")
shape = SHAPES["mixtral-8x7b"]
experts, hidden, ffn, _ = shape.dims
inputs = make_inputs(shape, device)
dy = make_output_grad(inputs)
table = FFNTiles.for_shape(shape.pairs, experts, hidden, ffn, device)
sets = {"table": table, "tma-store": table.on_tma_store()}
for path in map(Path, sys.argv[1:]):
    table_json = json.loads(path.read_text())  # a tuned table (entries), or a tune's record (results)
    entries = table_json.get("entries") or {key: r["config"] for key, r in table_json["results"].items()}
    dims = FFNTiles.gemm_dims(hidden, ffn)
    keys = {role: shape_class(role, *dims[role], shape.pairs, experts) for role in ROLES}
    sets[path.stem] = FFNTiles(**{role: TileConfig(**entries[keys[role]]) if keys[role] in entries
                                  else getattr(table, role) for role in ROLES})


def launches(tiles: FFNTiles) -> tuple[float, list[tuple[str, float]]]:
    """(the block's fwd+bwd median ms, [(kernel, ms)] of one profiled pass in launch order)."""
    block = make_block("triton", tiles)
    median = time_block(block, inputs, dy, "fwd+bwd", 3, 10, main_grads=True)
    leaves = _grad_inputs(inputs, main_grads=True)
    _forward_backward(block, leaves, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _forward_backward(block, leaves, dy)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    return median, [(e.name, e.time_range.elapsed_us() / 1e3) for e in kernels]


for name, tiles in sets.items():
    print(f"{name}: " + " | ".join(f"{role} {dataclasses.asdict(getattr(tiles, role))}" for role in ROLES)[:600])
results = {name: launches(tiles) for name, tiles in sets.items()}
names = list(results)
print("\n" + " ".join(f"{n[:24]:>26}" for n in names) + "   kernel (launch order of the first set)")
print(" ".join(f"{results[n][0]:23.3f} ms" for n in names) + "   fwd+bwd median of 10")
rows = max(len(results[n][1]) for n in names)
for i in range(rows):
    cells = [results[n][1][i] if i < len(results[n][1]) else ("-", 0.0) for n in names]
    print(" ".join(f"{ms:23.3f} ms" for _, ms in cells) + "   " + " / ".join(dict.fromkeys(k[:48] for k, _ in cells)))
