"""Tile configurations for the grouped GEMM kernels: tuned JSON data first, a heuristic otherwise.

A *shape class* is (kernel role, reduction size K, output columns N, average rows per expert rounded
up to a power of two). `disagmoe bench tune-experts` measures candidate tiles per class on a GPU and
writes them to `disagmoe/kernels/tuned/<gpu-slug>.json`; launches look them up by the running GPU.
The FP8 expert FFN's roles (`FP8_ROLES`, `kernels.fp8_ffn.Fp8Tiles.for_shape`) share the file.

A GPU without a table of its own reads the table of a GPU of the same architecture (`architecture`:
compute capability and SM count, which the tiles depend on; recorded in each table) before falling
back to the heuristic: an H100 (sm_90, 132 SMs) launches the tiles tuned on an H200 (sm_90, 132
SMs), which differ in HBM bandwidth and capacity, not in what a tile fits or how many run at once.
Tuning on a GPU writes its own table, read first; a class it lacks is still read from the same
architecture's. `tile_source` says which tables a GPU reads.

A class is tuned for the loads its launches meet (`LOADS`): `routed` (a run's learned routing; the tuner routes
its rows Zipf-skewed) or `even` (`routing: balanced`, every expert its mean rows: the benchmarks' rows, keyed
`<class>/even`). The winners differ: on an H100 (session 49) the Mixtral classes tuned on even loads moved two
launches to the library's grouped GEMM, which Zipf-skewed loads slow, and cost `bench experts`' Zipf-routed
mixtral-8x7b row 5 points of its forward and 7 of its fwd+bwd. A process launches for the loads `set_expert_loads`
says (its run's routing, as the trainer and every rank set it; `launching_for` for a block of launches), reading a
class's other loads' entry where its own was never tuned in that table (a GPU's own table is read whole before
another's of its architecture).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

TUNED_DIR = Path(__file__).parent / "tuned"

# Kernel roles: which GEMM of the expert FFN a launch computes.
ROLES = ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2", "wgrad_w13")
# The FP8 FFN's tile choices (`kernels.fp8_ffn.Fp8Tiles`' fields), each serving two launches (rows:
# down and gate/up dgrad; swiglu: gate/up and down dgrad; wgrad: both weight gradients), their
# shape class keyed by the FFN's hidden size as K and its expert FFN size as N.
FP8_ROLES = ("fp8_rows", "fp8_swiglu", "fp8_wgrad")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Compile-time tile shape of one grouped GEMM launch (see grouped_gemm.py for the axes)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1  # persistent programs per SM when the launch does not fix the count
    flatten: bool = False  # fuse the work-list loop with the reduction loop (software pipelining)
    # FP8 kernels only (`kernels.fp8.PROMOTE_VARIANTS`): how each scale group's dot is promoted into
    # the fp32 sum; the bf16 kernels ignore it
    promote: str = "inline"
    # the SwiGLU-gradient epilogue (down dgrad) finishes its tile this many columns at a time
    # (`grouped_gemm._swiglu_grad_epilogue`); narrower chunks hold fewer fp32 temporaries at once
    # (ptxas on sm_90a at 128 x 128, 8 warps: 255 registers and spills for the whole tile, 199 for
    # chunks of 16); so does the FP8 one (`fp8._swiglu_grad_epilogue`: 255 registers at 64 x 128,
    # 8 warps, inline promotion; 172 in chunks of 16); the other kernels ignore it
    epilogue_chunk: int = 16
    # weight gradients accumulating into an fp32 main gradient (`grouped_gemm.ragged_weight_grad`'s
    # accumulate): add each finished tile with relaxed fp32 vector atomics (SASS REDG.E.ADD.F32x4, done
    # at L2 without the program waiting for the read) instead of a load, add and store that stall the
    # next tile's main loop; one program writes each element per launch, so the sum is the
    # load-add-store one, bit for bit except denormals, which the reduction flushes to zero; the other
    # kernels and non-accumulating launches ignore it (`bench tune-experts` offers every wgrad tile with it and
    # without, and some also prefetching, `prefetch_accumulator`; every tuned class on an H200 has chosen it
    # since session 16, and on an H100 in session 34)
    atomic_accumulate: bool = False
    # weight gradients accumulating with the load-add-store epilogue (not atomic_accumulate): load the tile's
    # main-gradient values before its row loop instead of after it (`grouped_gemm._ragged_weight_grad_kernel`'s
    # PREFETCH), so their HBM read overlaps the tile's MMAs; the same sum. It holds the tile in registers
    # through the loop (BLOCK_K x BLOCK_N fp32 more per program); `bench tune-experts` offers it beside the
    # atomic tiles; the other kernels and non-accumulating launches ignore it
    prefetch_accumulator: bool = False
    # down and gate/up data gradient only: run the launch as the library's grouped GEMM
    # (`torch._grouped_mm`: cuBLAS/CUTLASS) instead of our kernel, where `bench tune-experts` measures it
    # faster; it takes launches with a plain result only (no gathered, scattered or signalled rows, one
    # row group per expert, a new output, 16-byte aligned bf16 operands on a GPU: `grouped_gemm.library_takes`)
    # and the tile fields serve the others. The other roles ignore it (their epilogues are ours; the weight
    # gradients' fused fp32 add has no library form: its output dtype must be the operands')
    library: bool = False
    # down dgrad only: the SwiGLU-gradient epilogue split off the GEMM (`grouped_gemm.swiglu_grad_rows`): a
    # plain GEMM with these tile fields (or the library's, with `library`) writes d act in the operands'
    # dtype, then one elementwise pass applies the SwiGLU derivative (and the row dots, the recomputed
    # SwiGLU output). The fused epilogue's register pressure and traffic cost it about half the plain GEMM's
    # rate on the Qwen3 shape (373 against 605 TFLOP/s, session 16); the split one rounds d act to bf16 once
    # more. `bench tune-experts` offers it; the other roles ignore it
    split_epilogue: bool = False
    # load the operands with the tensor memory accelerator (host-made TensorDescriptors) instead of per-thread
    # pointer loads: the weight gradients' whole row steps (`grouped_gemm._rows_dot_tma`; each row group's last
    # partial step still masked), the row GEMMs' a rows and weight boxes (`grouped_gemm.rows_gemm_descriptors`);
    # operands TMA cannot take (`grouped_gemm.tma_takes`) and gathered rows load through pointers. The FP8
    # kernels ignore it. `bench tune-experts` offers the atomic and the prefetching wgrad tiles and the row tiles
    # both ways
    tma: bool = False
    # the row GEMMs' plain and SwiGLU epilogues (down, gate/up and its data gradient, down dgrad's split plain GEMM):
    # each tile whose rows lie inside its group stored by TMA through shared memory (`grouped_gemm.
    # rows_store_descriptors`; the SwiGLU form's act and both pre-activations), the last box's copy draining under
    # the next tile's main loop, where our Triton kernel otherwise issues the masked stores from the MMA layout
    # between its main loops (the gate/up GEMM writes 3 bf16 columns a row for every 2 of K x 2F it multiplies: 5x
    # the down GEMM's bytes a FLOP at Mixtral's shape). A group's last partial tile, scattered, signalled or
    # quantised results, flattened loops and C off the column tiles keep the masked stores. One more
    # [block_m, block_n] buffer in shared memory beside the ring: tiles it does not fit fail to launch and the tuner
    # skips them. The weight gradients: each tile's fp32 sums written, or (`atomic_accumulate`) reduce-added into the
    # main gradient, by TMA in two halves of rows through one [block_k / 2, block_n] buffer (`grouped_gemm.
    # weight_grad_store_descriptor`; K whole block_k tiles), instead of the relaxed atomics from registers.
    # `bench tune-experts` offers it on every TMA-loading row tile and atomic weight-gradient tile its buffer fits
    # beside (`tma_store_fits`)
    tma_store: bool = False
    # down, gate/up data gradient and gate/up: run the launch as our warp-specialised Gluon kernel
    # (`kernels.gluon_rows`: a TMA producer warp, two consumer warpgroups, Hopper only; the gate/up GEMM's SwiGLU
    # epilogue in `gluon_swiglu_gemm`) at its own tile, gluon_block_m x gluon_block_n with gluon_stages ring stages,
    # where it takes the launch (`grouped_gemm.gluon_takes`: a plain or SwiGLU result, not quantised, rows neither
    # gathered nor scattered nor signalled, bf16 or fp16 operands TMA can address, K a multiple of 64 and N of its
    # block_n, its ring and buffers within shared memory); our Triton kernel runs the others at this config's own
    # fields (the heuristic's, in the tiles `bench tune-experts` offers: as the library's tiles, what runs where the
    # Gluon kernel cannot is not the tile the tuner timed). `gluon_tma_store`: its epilogue stores each 64-row
    # wave of the result (the SwiGLU form: of act) by TMA through shared memory, drained under the next tile's K loop. `bench tune-experts`
    # offers it on Hopper (`tune_experts.GLUON_ROWS_CANDIDATES`, `GLUON_SWIGLU_CANDIDATES`), and for down dgrad
    # under `split_epilogue` (its plain GEMM). The weight gradients: `kernels.gluon_wgrad` (128 KA rows an item,
    # a C tile of gluon_block_n, gluon_stages ring stages; gluon_block_m unused; `gluon_tma_store`: the main
    # gradient reduce-added by TMA where `atomic_accumulate`, else from registers, atomically where it), where
    # `grouped_gemm.gluon_wgrad_takes` (`tune_experts.GLUON_WGRAD_CANDIDATES`)
    gluon: bool = False
    gluon_block_m: int = 128
    gluon_block_n: int = 128
    gluon_stages: int = 4
    gluon_tma_store: bool = False

    def to_json(self) -> dict[str, int | bool | str]:
        return dataclasses.asdict(self)

    def for_element_size(self, itemsize: int) -> TileConfig:
        """The same tile for wider elements: shrink the K tile so the shared-memory stages stay
        the size they were tuned at for 2-byte (bf16) operands (e.g. fp32 halves block_k), and store through
        pointers: a `tma_store` buffer of wider outputs would take more shared memory than the tuner counted beside
        the ring (at fp32, 278,528 bytes at two of the offered down tiles: more than a Hopper block has)."""
        if itemsize <= 2:
            return self
        return dataclasses.replace(self, block_k=max(16, self.block_k * 2 // itemsize), tma_store=False)

    def shared_memory_bytes(self, itemsize: int, b_tiles: int = 1) -> int:
        """Bytes of the operand ring the software pipeline keeps in shared memory: each of
        `num_stages` stages holds one A tile [block_m, block_k] and `b_tiles` B tiles [block_k,
        block_n] (2 for the gate/up launch, which loads gate and up columns): what Triton allocates
        when the MMA reads both operands from shared memory (`lookup` says when it does)."""
        tile_elements = self.block_m * self.block_k + b_tiles * self.block_k * self.block_n
        return tile_elements * itemsize * self.num_stages

    def fit_shared_memory(self, itemsize: int, budget_bytes: int, b_tiles: int = 1) -> TileConfig:
        """The same tile with fewer pipeline stages (down to 2), then a halved K tile (down to 16),
        until its operand ring fits `budget_bytes` (the GPU's opt-in shared memory per block), so a
        tile tuned for one dtype or GPU cannot fail at launch with Triton's OutOfResources."""
        config = self
        while config.shared_memory_bytes(itemsize, b_tiles) > budget_bytes:
            if config.num_stages > 2:
                config = dataclasses.replace(config, num_stages=config.num_stages - 1)
            elif config.block_k > 16:
                config = dataclasses.replace(config, block_k=config.block_k // 2)
            else:
                break  # the smallest ring this shape allows; let the launch say what it needs
        return config


def gpu_slug(device_name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the tuned file's name)."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


# The loads a class is tuned for (module docstring): a run's learned routing, or `routing: balanced`'s even rows.
LOADS = ("routed", "even")


class _Loads:
    """The loads this process's expert launches look their tiles up for (`set_expert_loads`; default routed)."""

    current = "routed"


def _check_loads(loads: str) -> str:
    if loads not in LOADS:
        raise ValueError(f"expert loads {loads!r}: choose {' or '.join(LOADS)} (routing: learned routes its rows "
                         "unevenly, routing: balanced evenly)")
    return loads


def set_expert_loads(loads: str) -> None:
    """Process-wide, as `model.layers.set_fusion`: the expert launches from here on read the tiles tuned for `loads`
    (`LOADS`; a run's `routing` gives it: `loads_of_routing`)."""
    _Loads.current = _check_loads(loads)


def expert_loads() -> str:
    """The loads this process's expert launches read their tiles for (`set_expert_loads`)."""
    return _Loads.current


@contextlib.contextmanager
def launching_for(loads: str) -> Iterator[None]:
    """`set_expert_loads(loads)` for the block's launches, the process's own loads restored after it."""
    before = _Loads.current
    set_expert_loads(loads)
    try:
        yield
    finally:
        _Loads.current = before


def loads_of_routing(routing: str) -> str:
    """A run's `routing` ('learned' or 'balanced') as the loads its expert launches meet (`LOADS`)."""
    return "even" if routing == "balanced" else "routed"


def shape_class(role: str, k: int, n: int, rows: int, experts: int, loads: str = "routed") -> str:
    """Key of the tuned table: role, K, N, average rows per expert rounded up to a power of 2, and `/even` for the
    even loads' class (module docstring)."""
    if role not in ROLES + FP8_ROLES:
        raise ValueError(f"unknown kernel role {role!r}; choose one of {ROLES + FP8_ROLES}")
    avg = max(1, rows // max(1, experts))
    bucket = 1 << (avg - 1).bit_length()
    return f"{role}/k{k}/n{n}/m{bucket}" + ("/even" if _check_loads(loads) == "even" else "")


def architecture(capability: tuple[int, int], sms: int) -> str:
    """A GPU's tile-relevant architecture, as tables record it: (9, 0), 132 -> 'sm_90x132'."""
    return f"sm_{capability[0]}{capability[1]}x{sms}"


def device_architecture(device) -> str | None:
    """`architecture` of a torch CUDA device (None off CUDA)."""
    import torch

    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return architecture((props.major, props.minor), props.multi_processor_count)


@functools.cache
def _tables() -> dict[str, dict]:
    """Every tuned table in `TUNED_DIR`, by slug (its file's name)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(TUNED_DIR.glob("*.json"))}


@functools.cache
def table_slugs(device_name: str, arch: str | None = None) -> tuple[str, ...]:
    """The slugs of the tables this GPU reads, in the order a shape class is looked up: its own
    where tuned on it, then those (by name) of GPUs of the same `architecture` (module docstring);
    empty: the heuristics."""
    tables, own = _tables(), gpu_slug(device_name)
    siblings = tuple(slug for slug, table in tables.items()
                     if arch is not None and slug != own and table.get("architecture") == arch)
    return ((own,) if own in tables else ()) + siblings


def tile_source(device_name: str, arch: str | None = None) -> str:
    """Where this GPU's tiles come from, for a benchmark's log: its own table, a same-architecture
    GPU's (named) for the classes its own lacks, or the heuristics."""
    slugs, own = table_slugs(device_name, arch), gpu_slug(device_name)
    if not slugs:
        return f"untuned defaults (no table tuned on {device_name} or on a GPU of its architecture"\
               + (f" {arch})" if arch else ")")
    siblings = [f"{_tables()[slug].get('environment', {}).get('gpu', slug)} ({slug}.json)"
                for slug in slugs if slug != own]
    borrowed = f"tuned on {', '.join(siblings)}, the same architecture ({arch})" if siblings else ""
    if own not in slugs:
        return f"{borrowed}; tune-experts here writes this GPU's own"
    return f"tuned on this GPU ({own}.json)" + (f", else {borrowed}" if borrowed else "")


@functools.cache
def _tuned_table(slug: str) -> dict[str, TileConfig]:
    return {key: TileConfig(**value) for key, value in _tables()[slug]["entries"].items()}


def clear_cache() -> None:
    """Forget the tables read (after `TUNED_DIR` changed or a table was written)."""
    for cached in (_tables, table_slugs, _tuned_table):
        cached.cache_clear()


def tuned(role: str, k: int, n: int, rows: int, experts: int, device_name: str,
          arch: str | None = None, loads: str | None = None) -> TileConfig | None:
    """The tuned config of this shape class on this GPU (or, where this class was not tuned here,
    on a GPU of its `architecture` `arch`: `table_slugs`), each table's entry for `loads` (default: `expert_loads()`)
    before its entry for the other loads (module docstring); None when none was tuned. A table is read whole before
    the next: a GPU's own tiles for either loads win over another GPU's (so keying the classes by their loads
    changed no run's tiles)."""
    wanted = _check_loads(loads or _Loads.current)
    keys = [shape_class(role, k, n, rows, experts, each) for each in sorted(LOADS, key=lambda each: each != wanted)]
    return next((config for slug in table_slugs(device_name, arch) for key in keys
                 if (config := _tuned_table(slug).get(key)) is not None), None)


def untuned_classes(dims: dict[str, tuple[int, int]], rows: int, experts: int, device_name: str,
                    arch: str | None = None, loads: str | None = None) -> list[str]:
    """The shape classes for `loads` of the launches `dims` names (role -> (K, N), as `moe_ffn.FFNTiles.gemm_dims`
    gives them) over `rows` routed rows and `experts` experts that no table this GPU reads has tuned for either
    loads (`tuned`; default: `expert_loads()`): the launches that run the heuristic tiles, in `dims`' order."""
    loads = _check_loads(loads or _Loads.current)
    return [shape_class(role, k, n, rows, experts, loads) for role, (k, n) in dims.items()
            if tuned(role, k, n, rows, experts, device_name, arch, loads) is None]


# A Hopper's shared memory a block may take (227 KiB; the Gluon kernels' budget too, `gluon_ragged`), and what
# Triton's barriers and alignment take beside a ring (`tma_store_fits`; a tile that still does not fit fails to
# launch, and the tuner's search skips it)
HOPPER_SHARED_MEMORY_BYTES = 227 * 1024
SHARED_MEMORY_RESERVE_BYTES = 1_024


def tma_store_fits(config: TileConfig, role: str) -> bool:
    """Whether a tile's TMA-store buffer fits beside its ring of `num_stages` operand boxes in a Hopper's shared
    memory: a row GEMM's [block_m, block_n] bf16 (one buffer for the tile's boxes in turn) beside its A and B boxes
    (two B boxes for the SwiGLU launch); a weight gradient's [block_k / 2, block_n] fp32 (the main gradient's sums,
    half a tile's rows at a time) beside its [block_m, block_k] and [block_m, block_n] row boxes."""
    if role.startswith("wgrad"):  # the row step's boxes of both operands a stage (not `shared_memory_bytes`' axes)
        ring = config.num_stages * config.block_m * (config.block_k + config.block_n) * 2
        buffer = config.block_k // 2 * config.block_n * 4
    else:
        ring = config.shared_memory_bytes(2, b_tiles=2 if role == "gate_up" else 1)
        buffer = config.block_m * config.block_n * 2
    return ring + buffer <= HOPPER_SHARED_MEMORY_BYTES - SHARED_MEMORY_RESERVE_BYTES


def heuristic(role: str) -> TileConfig:
    """Untuned default (the tiles that won most shape classes on an H200)."""
    if role.startswith("wgrad"):  # atomic and TMA: how 3 of the 4 classes tuned on an H200 won (session 21)
        return TileConfig(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3, atomic_accumulate=True,
                          tma=True)
    if role == "gate_up":  # two accumulators (gate and up): keep the N tile at 128
        return TileConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=5)
    if role == "down_dgrad":  # the SwiGLU-gradient epilogue holds two more tiles in registers
        return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
    return TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)


def lookup(role: str, k: int, n: int, rows: int, experts: int, device_name: str,
           itemsize: int = 2, shared_memory_bytes: int | None = None, arch: str | None = None) -> TileConfig:
    """The tuned config of this shape class on this GPU (tuned for bf16 operands), or the
    heuristic when none was tuned, adjusted to `itemsize`-byte operands and, for operands wider
    than bf16 given the GPU's per-block `shared_memory_bytes`, shrunk until its operand ring fits.

    Only wider operands are fitted: Hopper's tf32 MMA takes both operands from shared memory in
    K-major order, so an fp32 launch allocates the whole ring (and the weight-gradient heuristic's
    ring, 240 KiB, failed on an H200's 227 KiB), while a bf16 launch can feed A from registers and
    allocate less than `shared_memory_bytes` estimates: bf16 tiles launch as tuned (each tuned
    entry and the heuristics ran on the GPU)."""
    config = (tuned(role, k, n, rows, experts, device_name, arch) or heuristic(role)).for_element_size(itemsize)
    if shared_memory_bytes is None or itemsize <= 2:
        return config
    return config.fit_shared_memory(itemsize, shared_memory_bytes, b_tiles=2 if role == "gate_up" else 1)
