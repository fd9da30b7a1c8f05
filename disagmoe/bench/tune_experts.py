"""`disagmoe bench tune-experts`: pick the grouped GEMM tiles per shape class on this GPU.

Checks each candidate TileConfig against the heuristic tiles' result, then times it on each launch
(role) of the expert FFN, forward and backward, for the benchmark shapes, and writes the fastest
per shape class to disagmoe/kernels/tuned/<gpu>.json (data, looked up at launch by
disagmoe.kernels.tile_configs). With precision fp8, the FP8 FFN's three tile choices
(`kernels.fp8_ffn.Fp8Tiles`: rows, swiglu, wgrad, each with its K loop's promotion) instead, each
timed over the two launches it serves, against the defaults; same file, `tile_configs.FP8_ROLES`.
Legend as in grouped_gemm.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from disagmoe.bench.experts import ExpertShape
from disagmoe.bench.timing import environment, median_ms
from disagmoe.bench.tune_block import block_check, block_timer
from disagmoe.bench.tune_compile import compile_jobs, precompile, worker_count
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import (FP8_ROLES, ROLES, TUNED_DIR, TileConfig, clear_cache, device_architecture,
                                          gpu_slug, heuristic, launching_for, shape_class, tma_store_fits)

# (block_m, block_n, block_k, num_warps, num_stages, programs_per_sm[, flatten]); block_m tiles
# the rows (for the weight gradients: the reduction over rows), block_n the output columns, block_k
# the reduction (for the weight gradients: the output rows). Two programs per SM hide one tile's
# pipeline start and epilogue under the other's main loop, at the price of fewer stages.
ROW_GEMM_CANDIDATES = [(128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 128, 64, 8, 4, 1),
                       (128, 128, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (256, 128, 64, 8, 3, 1),
                       (64, 256, 64, 8, 4, 1), (64, 128, 64, 4, 3, 2), (128, 128, 64, 8, 2, 2),
                       (128, 256, 64, 8, 4, 1, True), (128, 128, 64, 8, 4, 1, True),
                       (64, 256, 64, 8, 4, 1, True)]
# The down data gradient (SwiGLU-gradient epilogue): (..., flatten, epilogue_chunk), ptxas-checked on a
# CPU (tests/kernels/test_compile_for_hopper.py): no spills, 198-255 registers; 64 x 128 on 4 warps
# fits twice per SM (registers and shared memory). No flattening (it spills kilobytes in this
# epilogue); the whole tile at once (chunk = block_n, the epilogue before chunks) stays as a
# reference, spilling. The heuristic (`tile_configs.heuristic`: 128 x 128, chunks of 16) competes too.
DOWN_DGRAD_CANDIDATES = [(128, 128, 64, 8, 4, 1, False, 32),
                         (128, 128, 64, 8, 4, 1, False, 128), (128, 128, 64, 8, 3, 1, False, 16),
                         (64, 128, 64, 4, 4, 2, False, 16), (64, 128, 64, 4, 3, 2, False, 16),
                         (64, 128, 64, 4, 4, 1, False, 16), (64, 256, 64, 8, 4, 1, False, 16),
                         (64, 256, 64, 8, 4, 1, False, 32)]
GATE_UP_CANDIDATES = [(128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (64, 128, 64, 4, 4, 1),
                      (128, 64, 64, 4, 4, 1), (64, 256, 64, 8, 3, 1), (128, 128, 32, 8, 5, 1),
                      (64, 128, 64, 4, 3, 2), (128, 128, 32, 8, 3, 2),
                      (128, 128, 32, 8, 5, 1, True), (64, 128, 64, 4, 4, 1, True)]
WGRAD_CANDIDATES = [(64, 128, 128, 8, 3, 1), (64, 256, 128, 8, 3, 1), (64, 128, 128, 4, 4, 1),
                    (32, 128, 128, 4, 5, 1), (64, 128, 256, 8, 3, 1), (128, 128, 128, 8, 3, 1),
                    (64, 128, 128, 4, 3, 2), (64, 256, 128, 8, 2, 2), (32, 128, 128, 4, 3, 2),
                    (64, 256, 128, 8, 3, 1, True), (64, 128, 128, 4, 3, 2, True),
                    (32, 128, 128, 4, 3, 2, True)]
# Deeper rings only the TMA loads have shared memory for (both operands' boxes in shared memory, no
# register staging): offered atomic with TMA only (`candidates`).
WGRAD_TMA_CANDIDATES = [(64, 256, 128, 8, 4, 1), (64, 256, 128, 8, 4, 1, True), (64, 128, 128, 4, 5, 1, True),
                        (128, 128, 128, 8, 3, 1, True)]

# The largest output tile (block_k x block_n fp32 elements) a prefetching wgrad candidate holds twice
# (`TileConfig.prefetch_accumulator`: the sum and the main gradient's prior values) at 8 warps.
PREFETCH_TILE_ELEMENTS = 128 * 128

# FP8: (block_m, block_n, block_k, num_warps, num_stages, programs_per_sm, promote), each compiled
# for sm_90a on a CPU first (ptxas spill stores and registers, the FP8 loop's wgmma waits: tests
# kernels/test_compile_for_hopper.py's tools): none spills. Two programs per SM where a program
# fits in half the registers and shared memory (at most 128 registers at 8 warps): one tile's
# promotion runs under the other's wgmma, as DeepGEMM's two math warp groups. "pipelined" is left
# out of the SwiGLU tiles: six accumulator tiles spill at every tile that fits its block_n = 128.
FP8_ROWS_CANDIDATES = [(128, 128, 128, 8, 3, 1, "hoisted"), (128, 128, 128, 8, 3, 1, "pipelined"),
                       (128, 128, 128, 8, 3, 1, "pingpong"), (128, 128, 128, 8, 4, 1, "pingpong"),
                       (128, 128, 64, 8, 4, 1, "hoisted"), (128, 128, 64, 8, 4, 1, "pingpong"),
                       (64, 128, 128, 8, 3, 2, "hoisted"), (64, 128, 128, 8, 4, 2, "hoisted"),
                       (64, 128, 64, 8, 4, 2, "pingpong"), (64, 64, 128, 4, 4, 2, "pipelined"),
                       (64, 64, 128, 4, 4, 2, "pingpong")]
FP8_SWIGLU_CANDIDATES = [(64, 128, 128, 8, 3, 1, "hoisted"), (64, 128, 128, 8, 3, 1, "pingpong"),
                         (64, 128, 128, 8, 4, 1, "pingpong"), (64, 128, 128, 8, 2, 1, "pingpong"),
                         (64, 128, 128, 8, 2, 1, "hoisted"), (64, 128, 64, 8, 3, 1, "pingpong"),
                         (64, 128, 64, 8, 4, 1, "pingpong")]
FP8_WGRAD_CANDIDATES = [(128, 128, 64, 8, 3, 1, "hoisted"), (128, 128, 64, 8, 3, 1, "pipelined"),
                        (128, 128, 64, 8, 3, 1, "pingpong"), (128, 128, 64, 8, 4, 1, "pipelined"),
                        (128, 128, 64, 8, 4, 1, "pingpong"), (64, 128, 64, 8, 3, 1, "pingpong"),
                        (64, 256, 64, 8, 3, 1, "hoisted"), (64, 256, 64, 8, 3, 1, "pingpong"),
                        (128, 128, 128, 8, 3, 1, "pipelined"), (64, 128, 128, 8, 3, 1, "pipelined"),
                        (128, 64, 64, 4, 3, 2, "pipelined"), (128, 64, 64, 4, 3, 2, "pingpong")]
# Roles whose launches the library's grouped GEMM can run (`TileConfig.library`): plain products.
LIBRARY_ROLES = ("down", "gate_up_dgrad")
# Our warp-specialised Gluon kernel for those roles on Hopper (`TileConfig.gluon`, `kernels.gluon_rows`): (block_m,
# block_n, ring stages, TMA-store epilogue), each compiled for sm_90a on a CPU without spills
# (tests/kernels/test_gluon_rows.py); 128 x 256 takes 3 stages beside the TMA store's two [64, 256] buffers, 4
# without them (on Mixtral's down GEMM its tensor pipe ran 86-89% active at 3 stages against the Triton tile's 97%).
GLUON_ROWS_CANDIDATES = [(128, 128, 4, False), (128, 128, 4, True), (128, 256, 3, False), (128, 256, 3, True),
                         (128, 256, 4, False)]
# and its SwiGLU form for the gate/up GEMM (`gluon_rows.gluon_swiglu_gemm`: gate and up sums, two B boxes a stage):
# (block_m, block_n, ring stages, act stored by TMA), each compiled for sm_90a on a CPU without spills
GLUON_SWIGLU_CANDIDATES = [(128, 128, 4, False), (128, 128, 3, False), (128, 128, 4, True), (128, 128, 3, True),
                           (128, 64, 4, False)]
# and its weight gradient for the wgrad roles (`kernels.gluon_wgrad`: 128 KA rows an item, two consumer warpgroups):
# (block_n, ring stages, TMA epilogue, atomic register epilogue), each compiled for sm_90a on a CPU without spills
# (tests/kernels/test_gluon_wgrad.py); with the TMA epilogue's two fp32 [64, block_n] buffers beside the ring.
GLUON_WGRAD_CANDIDATES = [(128, 4, False, True), (128, 5, True, True), (256, 4, False, True), (256, 3, False, True),
                          (64, 6, True, True)]
FP8_CANDIDATES = {"fp8_rows": FP8_ROWS_CANDIDATES, "fp8_swiglu": FP8_SWIGLU_CANDIDATES,
                  "fp8_wgrad": FP8_WGRAD_CANDIDATES}


# The search's final round (`final_round`): the tiles this close to the fastest, at most this many, timed this many
# times more in turn
FINAL_ROUND_WITHIN = 0.03
FINAL_ROUND_SIZE = 4
FINAL_ROUNDS = 2


def _bf16_tiles(table: list[tuple], **fields) -> list[TileConfig]:
    """The bf16 tiles of a candidate table's rows ((block_m, block_n, block_k, num_warps, num_stages,
    programs_per_sm[, flatten[, epilogue_chunk]])), each with `fields` set."""
    return [TileConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, programs_per_sm=p,
                       flatten=bool(rest and rest[0]), **({"epilogue_chunk": rest[1]} if len(rest) > 1 else {}),
                       **fields)
            for m, n, k, w, s, p, *rest in table]


def candidates(role: str) -> list[TileConfig]:
    if role in FP8_CANDIDATES:
        return [TileConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, programs_per_sm=p,
                           promote=promote) for m, n, k, w, s, p, promote in FP8_CANDIDATES[role]]
    table = (GATE_UP_CANDIDATES if role == "gate_up" else DOWN_DGRAD_CANDIDATES if role == "down_dgrad" else
             WGRAD_CANDIDATES if role.startswith("wgrad") else ROW_GEMM_CANDIDATES)
    configs = _bf16_tiles(table)
    if role.startswith("wgrad"):  # each tile with the main gradient's add loaded and stored, or atomic;
        # the atomic ones (every tuned winner since session 16) also with TMA loads
        atomic = [dataclasses.replace(c, atomic_accumulate=True) for c in configs]
        # and the load-add-store ones with the main gradient's tile loaded before the row loop where it
        # fits the registers beside the sum (8 warps, at most 128 x 128: compiled for sm_90a without spills;
        # at 4 warps, or wider, it spills), both ways of loading the rows
        prefetch = [dataclasses.replace(c, prefetch_accumulator=True) for c in configs
                    if c.num_warps == 8 and c.block_k * c.block_n <= PREFETCH_TILE_ELEMENTS]
        loaded = [dataclasses.replace(c, tma=True) for c in atomic] + _bf16_tiles(WGRAD_TMA_CANDIDATES,
                                                                                  atomic_accumulate=True, tma=True)
        # and the atomic TMA tiles adding by the tensor memory accelerator's reduce-add where its fp32 buffer fits
        # beside the ring (`grouped_gemm.weight_grad_store_descriptor`), not flattened
        reduced = [dataclasses.replace(c, tma_store=True) for c in loaded
                   if not c.flatten and tma_store_fits(c, role)]
        configs += (atomic + loaded + reduced + prefetch + [dataclasses.replace(c, tma=True) for c in prefetch])
    else:  # each row GEMM tile also with TMA loads (`grouped_gemm.rows_gemm_descriptors`), but the flattened
        # gate/up ones: two accumulators and the fused loop spill more with TMA (sm_90a ptxas); and those of the
        # plain and SwiGLU epilogues (not down dgrad's fused one) also storing by TMA where the buffer fits beside
        # the ring (`tma_store_fits`), not flattened (`grouped_gemm.rows_store_descriptors`)
        loaded = [dataclasses.replace(c, tma=True) for c in configs if not (role == "gate_up" and c.flatten)]
        stored = [dataclasses.replace(c, tma_store=True) for c in loaded
                  if role != "down_dgrad" and not c.flatten and tma_store_fits(c, role)]
        configs += loaded + stored
    if role.startswith("wgrad") and _hopper():  # our Gluon weight gradient where it can run the launch
        configs += [dataclasses.replace(heuristic(role), gluon=True, gluon_block_n=n, gluon_stages=s,
                                        gluon_tma_store=t, atomic_accumulate=atomic)
                    for n, s, t, atomic in GLUON_WGRAD_CANDIDATES]
    if role in LIBRARY_ROLES:  # the library's grouped GEMM competes where it can run the launch
        configs.append(dataclasses.replace(heuristic(role), library=True))
        if _hopper():  # and our Gluon kernel where it can (elsewhere the heuristic's Triton tile runs)
            configs += _gluon_tiles(heuristic(role), GLUON_ROWS_CANDIDATES)
    if role == "gate_up" and _hopper():  # our Gluon SwiGLU kernel where it can run the launch
        configs += _gluon_tiles(heuristic(role), GLUON_SWIGLU_CANDIDATES)
    if role == "down_dgrad":  # the epilogue split off a plain GEMM (ours at the plain tiles, loading and storing by
        # TMA too, or the library's, or on a Hopper our Gluon kernel's)
        plain = dataclasses.replace(heuristic("down"), split_epilogue=True)
        configs += [plain, dataclasses.replace(plain, library=True)]
        configs += [dataclasses.replace(c, tma=True, tma_store=True, split_epilogue=True)
                    for c in _bf16_tiles(ROW_GEMM_CANDIDATES) if not c.flatten and tma_store_fits(c, "down")]
        if _hopper():
            configs += _gluon_tiles(plain, GLUON_ROWS_CANDIDATES)
    return configs


def _gluon_tiles(triton_tile: TileConfig, table: list[tuple[int, int, int, bool]]) -> list[TileConfig]:
    """A Gluon candidate table's rows (block_m, block_n, ring stages, TMA store) as tiles over `triton_tile`, the
    Triton tile a launch the Gluon kernels cannot take runs (a scattered or gathered one: the fused return's down
    GEMM, the weighted path's gathered rows; the FP8 down-only forward's quantising gate/up launch)."""
    return [dataclasses.replace(triton_tile, gluon=True, gluon_block_m=m, gluon_block_n=n, gluon_stages=s,
                                gluon_tma_store=t) for m, n, s, t in table]


def _hopper() -> bool:
    """Whether this process's GPU is a Hopper (sm_90), where the Gluon row kernel runs."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def default_config(role: str) -> TileConfig:
    """What a launch runs when nothing is tuned: the heuristic, or `Fp8Tiles`' default field."""
    if role in FP8_CANDIDATES:
        from disagmoe.kernels.fp8_ffn import Fp8Tiles

        return getattr(Fp8Tiles(), role.removeprefix("fp8_"))
    return heuristic(role)


@dataclasses.dataclass(frozen=True)
class AccumulatingLaunch:
    """A launch adding into `out` (the weight gradients into their fp32 main gradients, as a step
    runs them): `search` checks it from a zeroed `out` (`reset`) and times it accumulating."""

    run: Callable[[TileConfig], torch.Tensor]
    out: torch.Tensor

    def __call__(self, config: TileConfig) -> torch.Tensor:
        return self.run(config)

    def reset(self) -> None:
        self.out.zero_()


def role_launches(shape: ExpertShape,
                  device: torch.device) -> dict[str, Callable[[TileConfig], torch.Tensor]]:
    """Per role, a function launching that GEMM of the expert FFN with a given tile config."""
    experts, hidden, ffn, top_k = shape.dims
    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    offsets = shape.offsets(device)
    rows = shape.pairs
    x, dy = torch.randn(rows, hidden, **bf16), torch.randn(rows, hidden, **bf16)
    act, h13 = torch.randn(rows, ffn, **bf16), torch.randn(rows, 2 * ffn, **bf16)
    dh13 = torch.randn(rows, 2 * ffn, **bf16)
    w13 = torch.randn(experts, hidden, 2 * ffn, **bf16) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, **bf16) / ffn**0.5
    out_f, out_2f = torch.empty_like(act), torch.empty_like(h13)
    h13_out = torch.empty_like(h13)
    # the weight gradients as a training step runs them: added into fp32 main gradients, over two micro-batches'
    # rows in one launch where the run pairs them (the second set's own rows, routed alike)
    dw13, dw2 = (torch.zeros(w.shape, device=device, dtype=torch.float32) for w in (w13, w2))
    second_w2 = second_w13 = None
    if shape.paired_wgrads:
        second_w2 = (torch.randn(rows, ffn, **bf16), torch.randn(rows, hidden, **bf16), offsets)
        second_w13 = (torch.randn(rows, hidden, **bf16), torch.randn(rows, 2 * ffn, **bf16), offsets)
    return {
        "gate_up": lambda c: gg.ragged_rows_gemm(x, offsets, w13, c, epilogue=gg.EPILOGUE_SWIGLU,
                                                 h13_N2C=h13_out, out=out_f),
        # into a new output, as the step runs them (the library cannot write into a given one)
        "down": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c),
        "down_dgrad": lambda c: gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), c,
                                                    epilogue=gg.EPILOGUE_SWIGLU_GRAD,
                                                    h13_N2C=h13, out=out_2f),
        "gate_up_dgrad": lambda c: gg.ragged_rows_gemm(dh13, offsets, w13.transpose(1, 2), c),
        "wgrad_w2": AccumulatingLaunch(lambda c: gg.ragged_weight_grad(act, dy, offsets, c, out=dw2, accumulate=True,
                                                                       second=second_w2), dw2),
        "wgrad_w13": AccumulatingLaunch(lambda c: gg.ragged_weight_grad(x, dh13, offsets, c, out=dw13,
                                                                        accumulate=True, second=second_w13), dw13),
    }


def fp8_role_launches(offsets_E: torch.Tensor, hidden: int, ffn: int,
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      ) -> dict[str, Callable[[TileConfig], tuple[torch.Tensor, ...]]]:
    """Per FP8 role (`tile_configs.FP8_ROLES`), a function running both launches its `Fp8Tiles`
    field serves with a given tile config, on operands quantised once here (as the FFN's are), and
    returning their outputs: rows (down, gate/up data gradient), swiglu (gate/up with the SwiGLU
    epilogue, down data gradient with its derivative), wgrad (both weight gradients)."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.fp8_ffn import Fp8ExpertWeights

    device, experts, rows = offsets_E.device, offsets_E.shape[0], int(offsets_E[-1])
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *size: torch.randn(*size, device=device, dtype=dtype, generator=gen)  # noqa: E731
    x, dy, act, dh13 = randn(rows, hidden), randn(rows, hidden), randn(rows, ffn), randn(rows, 2 * ffn)
    h13 = randn(rows, 2 * ffn)
    weights = Fp8ExpertWeights.quantize(randn(experts, hidden, 2 * ffn) / hidden**0.5,
                                        randn(experts, ffn, hidden) / ffn**0.5)
    (qx, sx), (q_act, s_act), (q_dy, s_dy), (q_dh, s_dh) = (fp8.quantize_rows(t) for t in (x, act, dy, dh13))
    t_x, t_act, t_dy, t_dh = (fp8.quantize_token_groups(t, offsets_E) for t in (x, act, dy, dh13))
    y, dx, h13_out, act_out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(h13), torch.empty_like(act)
    dw13 = torch.empty((experts, hidden, 2 * ffn), device=device)
    dw2 = torch.empty((experts, ffn, hidden), device=device)

    def rows_(c):
        return (fp8.fp8_rows_gemm(q_act, s_act, offsets_E, *weights.w2, c, out=y),
                fp8.fp8_rows_gemm(q_dh, s_dh, offsets_E, *weights.w13_t, c, out=dx))

    def swiglu(c):
        _, s_out = fp8.fp8_swiglu_gemm(qx, sx, offsets_E, *weights.w13, c, h13_M2F=h13_out)
        dh = fp8.fp8_swiglu_grad_gemm(q_dy, s_dy, offsets_E, *weights.w2_t, h13, c, act_MF=act_out)
        return h13_out, s_out, dh, act_out

    def wgrad(c):
        return (fp8.fp8_weight_grad(t_x[:2], t_dh[:2], t_x[2], c, weights=experts, out=dw13),
                fp8.fp8_weight_grad(t_act[:2], t_dy[:2], t_x[2], c, weights=experts, out=dw2))

    return {"fp8_rows": rows_, "fp8_swiglu": swiglu, "fp8_wgrad": wgrad}


def _relative_error(got, want) -> float:
    """‖got − want‖ / ‖want‖, the largest over the tensors of two equal tuples (or of two tensors)."""
    if isinstance(got, torch.Tensor):
        got, want = (got,), (want,)
    return max(((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
               for g, w in zip(got, want, strict=True))


def search(launch: Callable[[TileConfig], object], default: TileConfig, configs: list[TileConfig],
           time_ms: Callable[[Callable[[], object]], float], log: Callable[[str], None], label: str,
           progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[float, TileConfig, float]:
    """(best ms, best config, the default's ms): each config checked against the default's result
    (a tiling must compute the same function; an `AccumulatingLaunch` from its zeroed output), then
    timed by `time_ms`; the default competes too, and the tiles close to the fastest are timed again in turn
    (`final_round`). Where the library's grouped GEMM or our Gluon kernel
    competed, the best of each kernel kind is logged beside the winner (`kernel_kind`). `progress` is told
    (candidates done, candidates in all) as each one ends, the default first: its first launch compiles it."""
    reset = getattr(launch, "reset", lambda: None)
    reset()
    result = launch(default)
    reference = tuple(t.clone() for t in result) if isinstance(result, tuple) else result.clone()
    timed = []
    tried = [default, *(c for c in dict.fromkeys(configs) if c != default)]  # each tile once (the heuristic is a
    # candidate of most roles' lists too)
    for done, config in enumerate(tried, 1):
        try:
            reset()
            error = _relative_error(launch(config), reference)
            if not error < 1e-2:
                log(f"  reject {label} {config}: relative error {error:.1e}")
                continue
            timed.append((time_ms(lambda: launch(config)), config))
        except Exception as err:  # a tile that does not fit (shared memory, registers)
            log(f"  skip {label} {config}: {type(err).__name__}")
        finally:
            progress(done, len(tried))
    timed = final_round(timed, lambda config: (reset(), time_ms(lambda: launch(config)))[1], log, label)
    best_ms, best = min(timed, key=lambda t: t[0])
    kinds: dict[str, tuple[float, TileConfig]] = {}
    for ms, config in timed:
        kind = kernel_kind(config)
        if kind not in kinds or ms < kinds[kind][0]:
            kinds[kind] = (ms, config)
    if len(kinds) > 1:
        bests = ", ".join(f"{kind} {ms:.3f} ms" for kind, (ms, _) in sorted(kinds.items()))
        log(f"  {label}: best by kernel: {bests}")
    return best_ms, best, timed[0][0]


def final_round(timed: list[tuple[float, TileConfig]], time_config: Callable[[TileConfig], float],
                log: Callable[[str], None], label: str) -> list[tuple[float, TileConfig]]:
    """`timed` ((ms, tile) in the search's order) with the tiles within `FINAL_ROUND_WITHIN` of the fastest (at
    most `FINAL_ROUND_SIZE` of them) timed `FINAL_ROUNDS` times more, in turn, each keeping its fastest timing.
    The search times one tile after another while the GPU warms (session 50: one H100's block ran 5% slower on the
    same tiles after a tune than before it), so a close call between a tile timed early and one timed late is the
    order's as much as the tiles'; timed in turn, drift falls on them alike."""
    if not timed:
        return timed
    best: dict[TileConfig, float] = {}
    for ms, config in timed:
        best[config] = min(ms, best.get(config, ms))
    fastest = min(best.values())
    close = sorted((c for c, ms in best.items() if ms <= fastest * (1 + FINAL_ROUND_WITHIN)), key=best.__getitem__)
    contenders = close[:FINAL_ROUND_SIZE]
    if len(contenders) < 2:
        return timed
    for _ in range(FINAL_ROUNDS):
        for config in contenders:
            try:
                best[config] = min(best[config], time_config(config))
            except Exception as err:  # as the search: a launch that fails now keeps its earlier timing
                log(f"  {label}: final round: {kernel_kind(config)} tile not timed again ({type(err).__name__})")
    log(f"  {label}: final round, {len(contenders)} tiles within {FINAL_ROUND_WITHIN:.0%} timed {FINAL_ROUNDS} times "
        f"more in turn: " + ", ".join(f"{kernel_kind(c)} {best[c]:.3f} ms" for c in contenders))
    return [(best[config], config) for _, config in timed]


def kernel_kind(config: TileConfig) -> str:
    """Which kernel a row GEMM tile runs where it can: 'library' (`torch._grouped_mm`), 'gluon' (our
    warp-specialised Hopper kernel) or 'triton' (ours)."""
    return "library" if config.library else "gluon" if config.gluon else "triton"


def tune_roles(launches: dict[str, Callable[[TileConfig], object]], dims: dict[str, tuple[int, int]],
               flops: dict[str, float], rows: int, experts: int, shape_name: str, loads: str,
               time_ms: Callable[[Callable[[], object]], float], log: Callable[[str], None] = print,
               configs: Callable[[str], list[TileConfig]] = candidates,
               default: Callable[[str], TileConfig] = default_config,
               tuned: Callable[[dict], object] = lambda results: None,
               progress: Callable[[str, int, int], None] = lambda label, done, total: None) -> dict:
    """One shape's results, keyed by shape class (`tile_configs.shape_class` of each role's dims,
    `rows`, `experts` and the `loads` its launches met): the best config of `default(role)` and
    `configs(role)` (`search`), its time, rate and the default's time: what `write_tuned` saves. `tuned` is handed
    each class's result as soon as its search ends (`{class: result}`), so a caller can save it before the next role
    starts; `progress` (shape and role, candidates done, in all) as each candidate ends."""
    results = {}
    for role, launch in launches.items():
        best_ms, best, default_ms = search(launch, default(role), configs(role), time_ms, log, role,
                                           lambda done, total: progress(f"{shape_name} {role}", done, total))
        rate = flops[role] / best_ms / 1e9
        key = shape_class(role, *dims[role], rows, experts, loads)
        results[key] = {
            "config": best.to_json(), "ms": best_ms, "tflops": rate, "heuristic_ms": default_ms, "shape": shape_name}
        tuned({key: results[key]})
        log(f"{shape_name:20s} {role:14s} best {best_ms:7.3f} ms ({rate:4.0f} TFLOP/s), default {default_ms:7.3f} ms: "
            f"{best}")
    return results


def check_roles(roles: list[str] | None, precision: str) -> None:
    """ValueError naming the choices unless every one of `roles` is a role `precision` tunes."""
    choices = FP8_ROLES if precision == "fp8" else ROLES
    unknown = [role for role in roles or [] if role not in choices]
    if unknown:
        raise ValueError(f"--role {', '.join(unknown)}: --precision {precision} tunes {', '.join(choices)}")


def shape_launches(shape: ExpertShape, precision: str, roles: list[str] | None,
                   device: torch.device | None = None) -> dict[str, Callable[[TileConfig], object]]:
    """The launches `tune` searches for one shape: the bf16 roles' (`role_launches`) or the FP8 FFN's
    (`fp8_role_launches`), only `roles` where given; on the current CUDA device unless told. Module-level, so a
    compile worker (`tune_compile`) builds its own from the same arguments."""
    device = device or torch.device("cuda")
    if precision == "fp8":
        _, hidden, ffn, _ = shape.dims
        launches = fp8_role_launches(shape.offsets(device), hidden, ffn)
    else:
        launches = role_launches(shape, device)
    return {role: launch for role, launch in launches.items() if not roles or role in roles}


def table_tiles(shape: ExpertShape, device: torch.device) -> FFNTiles:
    """The tiles the tables give `shape`'s launches now, for its loads: what a run launched before this shape's
    search (after an earlier shape's of the same tune, where they share classes: the last shape tuned wins)."""
    experts, hidden, ffn, _ = shape.dims
    clear_cache()
    with launching_for(shape.loads):
        return FFNTiles.for_shape(shape.pairs, experts, hidden, ffn, device)


def tune(shapes: list[ExpertShape], warmup: int, iters: int, log: Callable[[str], None] = print,
         precision: str = "bf16", roles: list[str] | None = None,
         save: Callable[[dict], object] = lambda record: None,
         progress: Callable[[str, int, int], None] = lambda label, done, total: None,
         compile_workers: int | None = 0, block_checks: bool = True) -> dict:
    """Best tile per (role, shape class) with its time and the default's (the heuristic, or
    `Fp8Tiles`' field), for every shape (fp8: the FP8 FFN's roles), only `roles` where given (the
    other classes' entries stay as the table has them). `save` is handed a record of each class alone
    as soon as it is tuned (`write_tuned` merges it), so an interrupted search keeps what it measured; `progress`
    (shape and role, candidates done, in all) as each candidate's check and timing end. `compile_workers`
    processes (None: `tune_compile.worker_count`'s choice; 0: none) first compile each shape's candidates into
    Triton's cache, so the search's first launches load them instead of compiling one after another.
    `block_checks`: once all six bf16 GEMMs of a shape are tuned, its whole block is timed on the new tiles against
    the table's before (`tune_block`), and a GEMM whose new tile slows the block keeps (and is saved with) its old
    one; where the run pairs the weight gradients (which the block runs unpaired), only the four row GEMMs are
    compared so, the weight gradients keeping the tiles their paired search ranked first."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"--precision {precision!r}: choose bf16 or fp8")
    check_roles(roles, precision)
    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench tune-experts` needs a CUDA GPU (none is visible)")
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("`tune-experts --precision fp8` needs FP8 tensor cores (sm_89 or newer)")
    device = torch.device("cuda")
    time_ms = lambda fn: median_ms(lambda _: fn(), warmup, iters)  # noqa: E731
    env, arch = environment(device), device_architecture(device)
    results = {}
    for shape in shapes:
        # the bf16 weight gradients are timed paired where the run pairs them; the FP8 tile's Triton weight
        # gradient (`fp8_role_launches`) runs a pair as two launches (`kernels.wgrad_pairs`): one set is its launch
        name = shape.name + ("-paired-wgrads" if shape.paired_wgrads and precision == "bf16" else "")
        experts, hidden, ffn, _ = shape.dims
        gemm_flops = 2.0 * shape.pairs * hidden * ffn
        if compile_workers != 0:  # the build's peak, temporaries included: what each worker's own build will reach
            allocated = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        launches = shape_launches(shape, precision, roles, device)
        checked = block_checks and precision == "bf16" and set(launches) == set(ROLES)
        before = table_tiles(shape, device) if checked else None  # before the search saves its first class
        if precision == "fp8":
            dims = {role: (hidden, ffn) for role in launches}
            flops = {role: 3 * gemm_flops for role in launches}  # two launches: 2F + F columns
        else:
            dims = FFNTiles.gemm_dims(hidden, ffn)
            flops = {role: gemm_flops * (2 if role in ("gate_up", "gate_up_dgrad", "wgrad_w13") else 1)
                     * (2 if shape.paired_wgrads and role.startswith("wgrad") else 1) for role in launches}
        if compile_workers != 0:
            jobs = compile_jobs({role: [default_config(role), *candidates(role)] for role in launches})
            operand_bytes = torch.cuda.max_memory_allocated(device) - allocated
            torch.cuda.empty_cache()  # the build's freed temporaries are the workers' room, not this process's cache
            workers = worker_count(compile_workers, len(jobs), operand_bytes, torch.cuda.mem_get_info(device)[0])
            if workers:
                log(f"{name}: compiling {len(jobs)} candidate kernels in {workers} processes")
                label = f"{name} compiling ({workers} processes)"
                precompile(functools.partial(shape_launches, shape, precision, roles), jobs, workers,
                           progress=lambda done, total: progress(label, done, total), log=log)
        shape_results = tune_roles(launches, dims, flops, shape.pairs, experts, name, shape.loads, time_ms, log,
                                   tuned=lambda one: save({"environment": env, "architecture": arch, "results": one}),
                                   progress=progress)
        if checked:
            keys = {role: shape_class(role, *dims[role], shape.pairs, experts, shape.loads) for role in launches}
            after = FFNTiles(**{role: TileConfig(**shape_results[keys[role]]["config"]) for role in launches})
            compared = ROLES
            if shape.paired_wgrads:  # the block runs them unpaired: the search's paired timings rank their tiles
                compared = tuple(role for role in ROLES if not role.startswith("wgrad"))
                before = dataclasses.replace(before, **{role: getattr(after, role) for role in ROLES
                                                        if role not in compared})
                log("  block check: the weight gradients run paired, so the block compares the row GEMMs' tiles "
                    "and the weight gradients keep the search's")
            try:
                verdict = block_check(before, after, block_timer(shape, device, warmup, iters), roles=compared)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as err:  # the search's winners stand unchecked
                verdict = None
                log(f"  block check skipped ({type(err).__name__}: {str(err).splitlines()[0][:120]}): the search's "
                    "tiles stand")
            for line in verdict.lines if verdict else ():
                log(line)
            for role in verdict.kept_old if verdict else ():  # saved again with the old tile, timed on its launch
                old, winner, launch = getattr(before, role), shape_results[keys[role]], launches[role]
                ms = time_ms(lambda: launch(old))
                why = ("the new tiles together slowed the block, and no single one explained it" if verdict.together
                       else "that tile slowed the block")
                kept = {"config": old.to_json(), "ms": ms, "tflops": flops[role] / ms / 1e9,
                        "heuristic_ms": winner["heuristic_ms"], "shape": name,
                        "block_check": f"kept over the search's {winner['ms']:.3f} ms tile: {why}"}
                shape_results[keys[role]] = kept
                save({"environment": env, "architecture": arch, "results": {keys[role]: kept}})
        results.update(shape_results)
        del launches
        torch.cuda.empty_cache()
    return {"environment": env, "architecture": arch, "results": results}


def write_tuned(record: dict, out: Path | None, log: Callable[[str], None] = lambda line: None) -> Path:
    """Merge the winners into the GPU's tuned table (the data the launcher reads), with the GPU's
    architecture (`tile_configs.architecture`: GPUs of the same one without a table read it). A class is keyed by
    its GEMM, K, N, rows an expert and loads (`tile_configs.LOADS`) only, so shapes that differ in their skew or
    weight-gradient pairing share it (`bench experts`' Zipf-routed mixtral-8x7b and the Mixtral config's learned
    routing, 2,048 rows an expert each): `log` is told of every entry this write replaces that another shape's
    search had written (`replaced_entries`)."""
    path = out or TUNED_DIR / f"{gpu_slug(record['environment']['gpu'])}.json"
    table = json.loads(path.read_text()) if path.exists() else {"entries": {}, "measured": {}}
    for line in replaced_entries(table, record["results"]):
        log(line)
    table["environment"] = record["environment"]
    if record.get("architecture"):
        table["architecture"] = record["architecture"]
    for key, result in sorted(record["results"].items()):
        table["entries"][key] = result["config"]
        table["measured"][key] = {k: v for k, v in result.items() if k != "config"}
    path.parent.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a file of this write's own beside the table, moved over it (an interrupted write leaves
    # the table as it was; two tuners never share the file)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    clear_cache()  # this process's later launches read the table just written
    return path


def replaced_entries(table: dict, results: dict) -> list[str]:
    """A line for each class of `results` whose entry in `table` another shape's search wrote: the class, that
    shape and its time, and the shape replacing it (the last tune of a class is what every shape of it launches)."""
    lines = []
    for key, result in sorted(results.items()):
        before = table.get("measured", {}).get(key)
        if key in table.get("entries", {}) and before and before.get("shape") not in (None, result.get("shape")):
            lines.append(f"  {key}: replaces the tile tuned on {before['shape']} ({before['ms']:.3f} ms there) with "
                         f"{result.get('shape')}'s ({result['ms']:.3f} ms): both shapes launch this class's tile")
    return lines
