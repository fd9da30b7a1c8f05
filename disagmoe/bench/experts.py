"""`disagmoe bench experts`: the routed expert block, three ways, timed in one run.

The block: permute the (token, k) pairs by expert -> SwiGLU expert FFN -> weighted combine.
Backends: `triton` (our permute, persistent expert FFN and combine kernels), `grouped_mm` (what a
good PyTorch user writes: torch permutation, torch._grouped_mm for both GEMMs, a separate SwiGLU,
a gather + bmm combine) and `loop` (the same torch permutation, one matmul pair per expert);
on request `triton-fp8` (our permute and combine, every expert GEMM in FP8 with 1 x 128 / 128 x 128
scaling, `kernels.fp8_ffn`, at the tuned tiles of the shape class (`Fp8Tiles.for_shape`); its
weights quantised once per weight tensor, as once per optimizer step in training, outside the
timed calls), and `triton-fp8:<promote>`: the same tiles with every FP8 K loop promoted as
<promote> says (`kernels.fp8.PROMOTE_VARIANTS`), to A/B the variants in one run. With
`--precision fp8` also `scaled-grouped-mm`, the library's FP8 forward (`torch._scaled_grouped_mm`:
row-wise scales, one per row of the activations and per output column of each expert's weight,
groups aligned to 16 rows; no backward, so it has no fwd+bwd row): our permute and combine, the
rows laid into 16-aligned groups on the device, quantised row-wise (`kernels.fp8_rowwise`), the
gate/up GEMM, SwiGLU, the output quantised row-wise, the down GEMM; its weight copies made once
per weight tensor outside the timed calls, as ours.
The weight gradients are fresh tensors in the weights' dtype unless `--main-grads` asks for training's
accumulation: each fwd+bwd then adds them into fp32 main gradients, as a step's micro-batches after its
first do (our kernels in their epilogues, the torch backends by an add after autograd), so the fp32
read-modify-write that bounds the weight gradients in training (`bench profile`'s bounds) is timed too.
Every row says the SM clock it was timed at, beside the ceiling probe's (`clock_lines`): in session 50 one H100
timed the same Mixtral tiles at 603 TFLOP/s fwd+bwd as its first run and 573-575 in six runs after a tune.
Legend: T tokens, K experts per token, N = T*K pairs, E local experts, H hidden, F expert FFN size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from disagmoe.bench.gpu_clocks import GpuClockSampler
from disagmoe.bench.timing import copies_to_defeat_l2, environment, matmul_ceiling_tflops, median_ms
from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.model.router import balanced_topk
from disagmoe.model_ref import load_model
from disagmoe.kernels.fp8 import PROMOTE_VARIANTS
from disagmoe.kernels.fp8_ffn import (DEFAULT_BACKWARD, DEFAULT_FORWARD, Fp8ExpertWeights, Fp8Tiles, expert_ffn_fp8,
                                      gluon_paths, kernel_paths)
from disagmoe.kernels.moe_ffn import FFNTiles, expert_ffn_reference, expert_ffn_triton
from disagmoe.kernels.permute import (Fp8RowGradSlot, combine_reference, combine_rows, permute_reference,
                                      permute_tokens)
from disagmoe.kernels.tile_configs import TileConfig, device_architecture, launching_for, tile_source

ZIPF_EXPONENT = 1.2
# nvidia-smi's sampling interval while timing: a row's timing lasts a fraction of a second, the ceiling's less
CLOCK_INTERVAL_MS = 20
FEW_SAMPLES = 3  # a row's clock from fewer samples says how many
BACKENDS = ("triton", "grouped_mm", "loop")  # the default set
FP8_BACKEND = "triton-fp8"  # asked for by name: needs FP8 tensor cores (sm_89+)


def _run_recipe() -> dict[str, bool | int | str]:
    """A run's default FP8 recipe and kernel paths as one variant: the down GEMM's forward alone in FP8 and bf16
    weight gradients (`config.RUN_FP8_EXPERT_FORWARD`, `DEFAULT_FP8_EXPERT_BACKWARD`), the Gluon row GEMMs with
    their epilogue as `fp8_ffn.set_gluon` sets them for a run (`RUN_FP8_GLUON`, `RUN_FP8_GLUON_STORE`): what
    `bench calibrate`'s FP8 probe runs (`calibrate.fp8_probe_recipe`, which imports this module: not read here)."""
    from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, RUN_FP8_EXPERT_FORWARD, RUN_FP8_GLUON, RUN_FP8_GLUON_STORE
    from disagmoe.kernels.fp8_ffn import GLUON_TMA_STORE_BLOCK_M

    tma = RUN_FP8_GLUON and RUN_FP8_GLUON_STORE == "tma"
    return {"rows": RUN_FP8_GLUON, "swiglu": RUN_FP8_GLUON, "tma_store": tma,
            **({"block_m": GLUON_TMA_STORE_BLOCK_M} if tma else {}),
            "forward": RUN_FP8_EXPERT_FORWARD, "backward": DEFAULT_FP8_EXPERT_BACKWARD}


# asked for by name: the FP8 experts with one choice changed from the FFN's defaults, as
# `triton-fp8:<name>`: the Gluon paths (`fp8_ffn.gluon_paths`, Hopper), which backward GEMMs run
# in FP8 (`expert_ffn_fp8`'s backward, `fp8_expert_backward`) or which forward ones (its forward,
# `fp8_expert_forward`); and `run`, every choice as a training run makes it
FP8_VARIANTS = {
    "fp8-wgrad": {"backward": "fp8"},  # the weight gradients in FP8 too (DeepSeek-V3's all-FP8 recipe)
    "gluon-wgrad": {"wgrad": True, "backward": "fp8"},  # those in the Gluon kernel
    # the row GEMMs and the split SwiGLU GEMMs in the Gluon kernels (`TrainConfig.fp8_gluon`: a run's
    # default, the FFN's own off, `fp8_ffn._GluonChoices`)
    "gluon": {"rows": True, "swiglu": True},
    "gluon-256": {"rows": True, "swiglu": True, "block_m": 256},  # the same at 256-row tiles
    # the same with the row GEMM's epilogue by TMA (`fp8_gluon.gluon_fp8_rows_gemm(tma_store=True)`, unmeasured)
    "gluon-tma-store": {"rows": True, "swiglu": True, "tma_store": True},
    # a run's Gluon defaults (gluon-tma-store) with the weight gradients in FP8 too, in the Gluon kernel
    # (`fp8_gluon.gluon_fp8_weight_grad`: its scales carried in the ring, its sums added by fp32 reductions)
    "gluon-tma-store-wgrad": {"rows": True, "swiglu": True, "tma_store": True, "wgrad": True, "backward": "fp8"},
    "bf16-backward": {"backward": "bf16"},  # the whole backward in bf16 (the forward alone in FP8)
    "down-forward": {"forward": "down"},  # the forward's gate/up GEMM in bf16 (the loss FP8 costs is its)
    # the same with its act written in bf16 and quantised in a pass, as before the epilogue wrote it in e4m3
    # (`fp8_ffn._GluonChoices.act_epilogue`): the epilogue's A/B in one run
    "down-forward-pass": {"forward": "down", "act_epilogue": False},
    # the run's forward with dy's rows quantised in the FFN's pass, as before the combine's backward wrote them
    # (`permute.Fp8RowGradSlot`; the FP8 backends with an FP8 data gradient take them from the combine, as a run
    # does, but for this one and run-dy-pass): its A/B
    "down-forward-dy-pass": {"forward": "down", "combine_dy": False},
    # the block as a run's default recipe runs it (the variants above each change one choice from the FFN's
    # defaults, which are not a run's): what `bench calibrate`'s FP8 probe times for the planner
    "run": (_RUN := _run_recipe()),
    # the run's recipe with one epilogue undone: act quantised in a pass after the bf16 gate/up GEMM, or dy's rows
    # in the FFN's pass instead of the combine's backward (the epilogues' A/B under the kernels a run runs)
    "run-act-pass": {**_RUN, "act_epilogue": False},
    "run-dy-pass": {**_RUN, "combine_dy": False},
    # the run's recipe, and the all-FP8 one in the Gluon kernels, at 256-row Gluon tiles (B read once per 256 rows;
    # their epilogue the masked store: the TMA store takes 128-row tiles at the FFN's 128 columns): on one H200 the
    # FP8 forward at 128 rows ran below our bf16 one on Mixtral's shape (session 42), the 256-row tiles 1.11x the
    # 128-row ones there on an H100 (session 34)
    "run-256": {**_RUN, "block_m": 256, "tma_store": False},
    "gluon-256-wgrad": {"rows": True, "swiglu": True, "block_m": 256, "wgrad": True, "backward": "fp8"},
}
VARIANT_BACKENDS = tuple(f"{FP8_BACKEND}:{name}" for name in FP8_VARIANTS)


def variant_of(backend: str) -> tuple[dict[str, bool | int], str, str]:
    """(Gluon path changes, backward precision, forward GEMMs in FP8) of an FP8 backend (`FP8_VARIANTS`)."""
    changes = dict(FP8_VARIANTS.get(backend.split(":", 1)[-1], {}) if ":" in backend else {})
    return changes, changes.pop("backward", DEFAULT_BACKWARD), changes.pop("forward", DEFAULT_FORWARD)
LIBRARY_FP8_BACKEND = "scaled-grouped-mm"  # torch._scaled_grouped_mm, forward only: needs sm_90
FORWARD_ONLY = (LIBRARY_FP8_BACKEND,)
# our bf16 block with every launch our Gluon kernels can run sent there (`FFNTiles.on_gluon`, Hopper), beside `triton`
GLUON_BACKEND = "triton:gluon"
# our bf16 block with every launch of our Triton kernel writing its results by TMA (`FFNTiles.on_tma_store`, Hopper)
TMA_STORE_BACKEND = "triton:tma-store"
BF16_VARIANTS = (GLUON_BACKEND, TMA_STORE_BACKEND)  # our bf16 block at other kernels, each read against `triton`
LIBRARY_FP8_ALIGN = 16  # torch._scaled_grouped_mm's rows per group: a multiple of this
ALL_BACKENDS = (*BACKENDS, *BF16_VARIANTS, FP8_BACKEND, LIBRARY_FP8_BACKEND)


def backends_for(backends: list[str] | None, precision: str, promotes: list[str] | None = None) -> list[str]:
    """The backends `bench experts` times: those named (default `BACKENDS`), and with `precision`
    fp8 our FP8 experts beside our bf16 ones (the comparison the FP8 table's ratio needs): at their
    tuned tiles, or with `promotes` one `triton-fp8:<promote>` per K-loop promotion named; and the
    library's FP8 forward (`scaled-grouped-mm`), the FP8 forward's baseline."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"--precision {precision!r}: choose bf16 or fp8")
    unknown = [p for p in promotes or [] if p not in PROMOTE_VARIANTS]
    if unknown:
        raise ValueError(f"--fp8-promote {', '.join(unknown)}: choose from {', '.join(PROMOTE_VARIANTS)}")
    if promotes and precision != "fp8":
        raise ValueError("--fp8-promote chooses among FP8 K loops: add --precision fp8")
    chosen = list(backends or BACKENDS)
    if precision == "fp8":
        fp8 = [f"{FP8_BACKEND}:{p}" for p in dict.fromkeys(promotes)] if promotes else [FP8_BACKEND]
        chosen += [b for b in ("triton", *fp8, LIBRARY_FP8_BACKEND) if b not in chosen]
    return chosen


def needs_fp8(backend: str) -> bool:
    """Whether a backend runs e4m3 GEMMs (ours or the library's)."""
    return is_fp8(backend) or backend == LIBRARY_FP8_BACKEND


def passes_of(backend: str) -> tuple[str, ...]:
    """The passes a backend is timed in: the forward alone for the library's FP8 (no backward)."""
    return ("fwd",) if backend in FORWARD_ONLY else PASSES


def is_fp8(backend: str) -> bool:
    """`triton-fp8`, one of its promotion variants `triton-fp8:<promote>`, or a recipe one (`VARIANT_BACKENDS`)."""
    return backend in (FP8_BACKEND, *VARIANT_BACKENDS) or (backend.startswith(FP8_BACKEND + ":")
                                                         and backend.split(":", 1)[1] in PROMOTE_VARIANTS)


def fp8_tiles_for(backend: str, tiles: Fp8Tiles) -> Fp8Tiles:
    """The tiles an FP8 backend runs: `tiles`, or them with its promotion everywhere."""
    return tiles if backend in (FP8_BACKEND, *VARIANT_BACKENDS) else tiles.with_promote(backend.split(":", 1)[1])
PASSES = ("fwd", "fwd+bwd")


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """One benchmark shape: a model's experts on one rank of an expert-parallel group, `pairs`
    (token, expert) rows per launch; routed Zipf-skewed, or `balanced` (every expert its mean
    rows, as a run's `routing: balanced`). `paired_wgrads`: its weight gradients run over two
    micro-batches' rows in one launch (`kernels.wgrad_pairs`), as a run that pairs them launches
    them (`bench tune-experts -c` times them so; the tile is looked up by one micro-batch's rows)."""

    name: str
    model: str | ModelConfig
    expert_parallel: int
    pairs: int
    balanced: bool = False
    paired_wgrads: bool = False

    @property
    def loads(self) -> str:
        """The loads its launches meet, as the tuned tiles are keyed (`tile_configs.LOADS`)."""
        return "even" if self.balanced else "routed"

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(local experts, hidden, expert FFN size, top-k) from the model preset."""
        m = load_model(self.model)
        return m.num_experts // self.expert_parallel, m.hidden_size, m.expert_ffn_size, m.top_k

    def routing(self, seed: int) -> torch.Tensor:
        """topk_idx_TK of the shape's tokens: Zipf-skewed, or round-robin when `balanced`."""
        experts, _, _, top_k = self.dims
        tokens = self.pairs // top_k
        if self.balanced:
            return balanced_topk(tokens, top_k, experts, torch.device("cpu"))
        return zipf_routing(tokens, top_k, experts, seed)

    def offsets(self, device: torch.device, seed: int = 0) -> torch.Tensor:
        """offsets_E (int32 cumulative rows per expert, on `device`) of `routing(seed)`'s pairs."""
        counts_E = torch.bincount(self.routing(seed).reshape(-1), minlength=self.dims[0])
        return counts_E.cumsum(0).to(device, torch.int32)

    def flops(self, pass_name: str) -> float:
        """GEMM FLOPs of the expert FFN: 3 GEMMs of 2NHF forward (gate, up, down), 3x fwd+bwd."""
        _, hidden, ffn, _ = self.dims
        forward = 6.0 * self.pairs * hidden * ffn
        return forward if pass_name == "fwd" else 3 * forward


SHAPES = {s.name: s for s in (
    ExpertShape("mixtral-8x7b", "mixtral-8x7b", 1, 16 * 1024),
    ExpertShape("qwen3-235b-ep8", "qwen3-235b-a22b", 8, 32 * 1024),
    ExpertShape("deepseek-v3-ep8", "deepseek-v3", 8, 32 * 1024),
    ExpertShape("deepseek-v3-ep8-4k", "deepseek-v3", 8, 4 * 1024),
    ExpertShape("qwen3-30b-a3b", "qwen3-30b-a3b", 1, 32 * 1024),
)}


def shape_of_run(cfg: TrainConfig, device: torch.device | None = None) -> ExpertShape:
    """The expert GEMMs of `cfg`'s micro-batches as one GPU of `mode: single` runs them (every
    expert local, `batch_size / micro_batches x seq_len` tokens per launch; `micro_batches: auto`
    chosen for `device`, as the run would), balanced when the run's routing is, the weight gradients
    paired where the run pairs them (`expert_wgrad_pairs: auto` resolved on `device`'s memory as the
    trainer resolves it; without a GPU, auto counts as on where it applies). The tuned table's
    shape class (K, N, mean rows per expert) is the same on each expert rank of a distributed
    layout that serves the same tokens per expert."""
    from disagmoe.runtime.training.micro_batches import device_capacity_bytes
    from disagmoe.runtime.training.single_memory import resolve_wgrad_pairs
    from disagmoe.runtime.training.tile_coverage import launch_rows
    from disagmoe.runtime.training.trainer import resolve_single_micro_batches

    model_cfg = load_model(cfg.model)
    cfg = cfg.model_copy(update={"mode": "single"})
    on_gpu = device is not None and device.type == "cuda"
    if cfg.micro_batches == "auto":
        if not on_gpu:
            raise ValueError("micro_batches: auto is chosen from the GPU's memory: run this on the GPU, or give "
                             "micro_batches=N")
        cfg, _ = resolve_single_micro_batches(cfg, model_cfg, device)
    if on_gpu:  # as the trainer does after choosing the split (which settles pairs only for the splits it weighs)
        cfg, _ = resolve_wgrad_pairs(cfg, model_cfg, device_capacity_bytes(device))
    pairs = launch_rows(cfg, model_cfg)
    name = f"{model_cfg.name}-t{pairs // model_cfg.top_k}" + ("-balanced" if cfg.routing == "balanced" else "")
    return ExpertShape(name, model_cfg, 1, pairs, balanced=cfg.routing == "balanced",
                       paired_wgrads=cfg.pairs_expert_wgrads)


def zipf_routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """topk_idx_TK drawn i.i.d. from Zipf(1.2) over a seeded shuffle of the experts (skewed)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(experts, generator=gen).double() + 1
    probs_E = ranks.pow(-ZIPF_EXPONENT)
    return torch.multinomial(probs_E, tokens * top_k, replacement=True,
                             generator=gen).view(tokens, top_k)


# --- the three backends: (x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH) -> y_TH -------------

def torch_permute(x_TH, topk_idx_TK, experts):
    """Stable argsort of the expert ids; counts by scatter_add (no host sync)."""
    top_k = topk_idx_TK.shape[1]
    flat_N = topk_idx_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    counts_E = torch.zeros(experts, dtype=torch.int64, device=flat_N.device)
    counts_E.scatter_add_(0, flat_N, torch.ones_like(flat_N))
    dest_N = torch.empty_like(order_N)
    dest_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return x_TH[order_N // top_k], counts_E.cumsum(0).to(torch.int32), dest_N.view_as(topk_idx_TK)


def torch_combine(rows_NH, dest_TK, weights_TK):
    """Gather the pairs back in token order and weight them with one batched matmul."""
    tokens, top_k = dest_TK.shape
    gathered_TKH = rows_NH[dest_TK.reshape(-1)].view(tokens, top_k, -1)
    return torch.bmm(weights_TK.to(rows_NH.dtype).unsqueeze(1), gathered_TKH).squeeze(1)


def grouped_mm_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH):
    ffn = w2_EFH.shape[1]
    h13_N2F = torch._grouped_mm(x_NH, w13_EH2F, offs=offsets_E)
    act_NF = F.silu(h13_N2F[:, :ffn]) * h13_N2F[:, ffn:]
    return torch._grouped_mm(act_NF, w2_EFH, offs=offsets_E)


def loop_ffn(x_NH, offsets_E, w13_EH2F, w2_EFH):
    return expert_ffn_reference(x_NH, offsets_E, w13_EH2F, w2_EFH)


def library_fp8_layout(offsets_E: torch.Tensor, rows: int, align: int = LIBRARY_FP8_ALIGN,
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(dest_N int64, aligned_offsets_E int32, capacity) for `rows` grouped rows (`offsets_E`: int32
    cumulative counts per expert): row r of group g goes to r - start_g + aligned_start_g, each
    group's count rounded up to a multiple of `align` (torch._scaled_grouped_mm's group alignment).
    Computed on the device, no host sync; capacity = rows + (align - 1) x E holds any routing,
    the rows between groups and past the last aligned offset being padding."""
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    aligned_counts_E = (counts_E + align - 1) // align * align
    aligned_offsets_E = aligned_counts_E.cumsum(0).to(torch.int32)
    row_N = torch.arange(rows, device=offsets_E.device)
    group_N = torch.searchsorted(offsets_E, row_N.to(offsets_E.dtype), right=True)
    shift_E = (aligned_offsets_E - aligned_counts_E) - (offsets_E - counts_E)
    return row_N + shift_E[group_N].to(torch.int64), aligned_offsets_E, rows + (align - 1) * offsets_E.numel()


def library_fp8_weights(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_EKN, scale_EN): e4m3 values of each expert's [K, N] weight with one scale per output
    column over K (row-wise over its transpose, `fp8_dense.quantize_rowwise`), laid out as
    torch._scaled_grouped_mm reads its second operand: each expert's [K, N] column-major."""
    from disagmoe.kernels.fp8_dense import quantize_rowwise

    experts, k, n = w_EKN.shape
    q, scale = quantize_rowwise(w_EKN.transpose(1, 2).reshape(experts * n, k))
    return q.view(experts, n, k).transpose(1, 2), scale.view(experts, n)


def library_fp8_ffn(rows_NH: torch.Tensor, offsets_E: torch.Tensor, w13: tuple[torch.Tensor, torch.Tensor],
                    w2: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The SwiGLU expert FFN forward on torch._scaled_grouped_mm (row-wise FP8, bf16 out) over rows
    grouped by expert; `w13`, `w2` from `library_fp8_weights`. The rows are laid into 16-aligned
    groups (`library_fp8_layout`) and the results gathered back."""
    from disagmoe.kernels.fp8_dense import quantize_rowwise

    dest_N, aligned_offsets_E, capacity = library_fp8_layout(offsets_E, rows_NH.shape[0])
    rows_PH = rows_NH.new_zeros((capacity, rows_NH.shape[1]))
    rows_PH[dest_N] = rows_NH
    q_PH, scale_P1 = quantize_rowwise(rows_PH)
    h13_P2F = torch._scaled_grouped_mm(q_PH, w13[0], scale_P1.view(-1), w13[1], offs=aligned_offsets_E,
                                       out_dtype=torch.bfloat16)
    ffn = h13_P2F.shape[1] // 2
    act_PF = F.silu(h13_P2F[:, :ffn]) * h13_P2F[:, ffn:]
    q_PF, scale_act_P1 = quantize_rowwise(act_PF)
    y_PH = torch._scaled_grouped_mm(q_PF, w2[0], scale_act_P1.view(-1), w2[1], offs=aligned_offsets_E,
                                    out_dtype=torch.bfloat16)
    return y_PH[dest_N]


def make_block(backend: str, tiles: FFNTiles | None = None,
               fp8_tiles: Fp8Tiles | None = None) -> Callable[..., torch.Tensor]:
    """The routed expert block of one backend (an FP8 one at `fp8_tiles`, default the tuned ones)."""
    if backend == LIBRARY_FP8_BACKEND:
        weight_copies: dict[tuple[int, int], tuple] = {}  # per weight tensor: made in the warm-up

        def library_fp8_block(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH):
            key = (w13_EH2F.data_ptr(), w2_EFH.data_ptr())
            if key not in weight_copies:
                weight_copies[key] = (library_fp8_weights(w13_EH2F.detach()), library_fp8_weights(w2_EFH.detach()))
            rows_NH, offsets_E, dest_TK = permute_tokens(x_TH, topk_idx_TK, w13_EH2F.shape[0])
            return combine_rows(library_fp8_ffn(rows_NH, offsets_E, *weight_copies[key]), dest_TK, weights_TK)
        return library_fp8_block
    if is_fp8(backend):
        copies: dict[tuple[int, int], Fp8ExpertWeights] = {}  # per weight tensor: made in the warm-up
        gluon, backward, forward = variant_of(backend)
        # dy's e4m3 rows from the combine's backward, as `model.block` has them made (not for a bf16 backward)
        combine_dy = gluon.pop("combine_dy", True) and backward != "bf16"

        def fp8_block(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH):
            key = (w13_EH2F.data_ptr(), w2_EFH.data_ptr())
            if key not in copies:  # the copies this backend's recipe reads, as a trainer makes them
                copies[key] = Fp8ExpertWeights.quantize(w13_EH2F.detach(), w2_EFH.detach(), forward=forward,
                                                        backward=backward)
            rows_NH, offsets_E, dest_TK = permute_tokens(x_TH, topk_idx_TK, w13_EH2F.shape[0])
            # the forward's Gluon paths are the ones its backward runs (`fp8_ffn._GluonChoices`)
            slot = Fp8RowGradSlot() if combine_dy else None
            with gluon_paths(**gluon):
                out_NH = expert_ffn_fp8(rows_NH, offsets_E, w13_EH2F, w2_EFH, weights=copies[key], tiles=fp8_tiles,
                                        backward=backward, forward=forward, grad_slot=slot)
            return combine_rows(out_NH, dest_TK, weights_TK, grad_slot=slot)
        return fp8_block
    if backend in ("triton", *BF16_VARIANTS):
        def block(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH):
            rows_NH, offsets_E, dest_TK = permute_tokens(x_TH, topk_idx_TK, w13_EH2F.shape[0])
            ffn_tiles = tiles
            if backend in BF16_VARIANTS:
                experts, hidden, two_ffn = w13_EH2F.shape
                ffn_tiles = tiles or FFNTiles.for_shape(rows_NH.shape[0], experts, hidden, two_ffn // 2,
                                                        rows_NH.device)
                ffn_tiles = ffn_tiles.on_gluon() if backend == GLUON_BACKEND else ffn_tiles.on_tma_store()
            out_NH = expert_ffn_triton(rows_NH, offsets_E, w13_EH2F, w2_EFH, tiles=ffn_tiles)
            return combine_rows(out_NH, dest_TK, weights_TK)
        return block
    ffn = {"grouped_mm": grouped_mm_ffn, "loop": loop_ffn}[backend]

    def torch_block(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH):
        rows_NH, offsets_E, dest_TK = torch_permute(x_TH, topk_idx_TK, w13_EH2F.shape[0])
        return torch_combine(ffn(rows_NH, offsets_E, w13_EH2F, w2_EFH), dest_TK, weights_TK)
    return torch_block


def reference_block(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH):
    rows_NH, offsets_E, dest_TK = permute_reference(x_TH, topk_idx_TK, w13_EH2F.shape[0])
    return combine_reference(expert_ffn_reference(rows_NH, offsets_E, w13_EH2F, w2_EFH),
                             dest_TK, weights_TK)


# --- inputs, checks, timing --------------------------------------------------------------------

def make_output_grad(inputs) -> torch.Tensor:
    """dy_TH for the block's backward over `make_inputs`' tokens: random bf16, its own fixed seed."""
    x = inputs[0]
    return torch.randn(x.shape, device=x.device, dtype=torch.bfloat16,
                       generator=torch.Generator(device=x.device).manual_seed(1))


def make_inputs(shape: ExpertShape, device: torch.device, seed: int = 0):
    """(x_TH, topk_idx_TK, weights_TK, w13_EH2F, w2_EFH) in bf16, random (never zeros)."""
    experts, hidden, ffn, top_k = shape.dims
    tokens = shape.pairs // top_k
    gen = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(tokens, hidden, **bf16)
    w13 = torch.randn(experts, hidden, 2 * ffn, **bf16) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, **bf16) / ffn**0.5
    weights = torch.rand(tokens, top_k, device=device, generator=gen)
    return x, shape.routing(seed).to(device), weights, w13, w2


def _grad_inputs(inputs, main_grads: bool = False):
    """The differentiable inputs (x, routing weights, w13, w2) as fresh leaves; with `main_grads` the two
    weights as parameters, each with a zeroed fp32 `main_grad` as FlatAdamW attaches it
    (`with_main_grad`)."""
    x, idx, weights, w13, w2 = inputs
    w13, w2 = (with_main_grad(w) if main_grads else w.detach().requires_grad_() for w in (w13, w2))
    return [x.detach().requires_grad_(), idx, weights.detach().requires_grad_(), w13, w2]


def with_main_grad(weight: torch.Tensor) -> torch.nn.Parameter:
    """`weight` as a parameter (sharing its storage) with a zeroed fp32 `main_grad`, as a mixed-precision
    optimizer attaches one: our experts' kernels add their weight gradients into it (`moe_ffn.main_grad_of`)
    and return none; not marked untouched (`kernels.first_touch`), so every write adds, as in a training
    step's micro-batches after its first."""
    param = torch.nn.Parameter(weight.detach())
    param.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return param


def _forward_backward(block, leaves, dy):
    """(y, grads of x, routing weights, w13, w2). A weight with a `main_grad` (`_grad_inputs(main_grads=True)`)
    ends with its gradient added into it, as a training step's: by our kernels (its grad then None), or,
    for a block whose autograd returns the gradient (the torch backends), by an add into it here, as
    FlatAdamW's post-accumulate hook adds (its grad still returned)."""
    y = block(*leaves)
    weights = leaves[3:5]
    mains = [getattr(w, "main_grad", None) for w in weights]
    grads = torch.autograd.grad(y, [leaves[0], leaves[2], *weights], dy, allow_unused=any(m is not None for m in mains))
    for main, grad in zip(mains, grads[2:]):
        if main is not None and grad is not None:
            main.add_(grad)
    return y, grads


def reference_outputs(inputs, dy):
    """(y, grads of x, routing weights, w13, w2) of the fp32 torch reference block."""
    ref_inputs = [t.float() if t.is_floating_point() else t for t in inputs]
    return _forward_backward(reference_block, _grad_inputs(ref_inputs), dy.float())


def relative_errors(block, inputs, dy, reference=None) -> dict[str, float]:
    """‖out − ref‖/‖ref‖ of y and of the grads of x, routing weights, w13, w2 vs fp32 torch
    (`reference`: `reference_outputs` of the same inputs, computed here when None)."""
    y, grads = _forward_backward(block, _grad_inputs(inputs), dy)
    y_ref, grads_ref = reference or reference_outputs(inputs, dy)
    names = ("y", "dx", "d_weights", "dw13", "dw2")
    return {name: ((got.double() - want.double()).norm() / want.double().norm()).item()
            for name, got, want in zip(names, (y, *grads), (y_ref, *grads_ref))}


def forward_error(block, inputs, dy, reference=None) -> dict[str, float]:
    """`relative_errors` of y alone, for a backend without a backward (`FORWARD_ONLY`)."""
    with torch.no_grad():
        y = block(*inputs)
    y_ref = (reference or reference_outputs(inputs, dy))[0]
    return {"y": ((y.double() - y_ref.double()).norm() / y_ref.double().norm()).item()}


def time_block(block, inputs, dy, pass_name: str, warmup: int, iters: int, main_grads: bool = False) -> float:
    """Median milliseconds of one pass over the block, rotating input copies if they fit in L2;
    `main_grads`: fwd+bwd adds the weight gradients into fp32 main gradients (`_forward_backward`)."""
    device = inputs[0].device
    set_bytes = sum(t.numel() * t.element_size() for t in inputs)
    copies = [inputs] + [[t.clone() for t in inputs]
                         for _ in range(copies_to_defeat_l2(set_bytes, device) - 1)]
    if pass_name == "fwd":
        with torch.no_grad():
            return median_ms(lambda i: block(*copies[i % len(copies)]), warmup, iters)
    leaves = [_grad_inputs(c, main_grads) for c in copies]
    return median_ms(lambda i: _forward_backward(block, leaves[i % len(leaves)], dy), warmup,
                     iters)


def run(shape_names: list[str], backends: list[str], warmup: int, iters: int,
        loop_iters: int, check: bool = True, log: Callable[[str], None] = print, main_grads: bool = False,
        gpu_clocks: bool = True) -> dict:
    """Time every backend on every shape (and the matmul ceiling) in one run; return the record.
    `main_grads`: every fwd+bwd adds its weight gradients into fp32 main gradients, as a training
    step's micro-batches after its first (`_forward_backward`); the errors are checked without. `gpu_clocks`:
    nvidia-smi samples the SM clock while each row is timed (`clock_lines`); off, the record says so."""
    unknown = [n for n in shape_names if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    bad = [b for b in backends if b not in ALL_BACKENDS and not is_fp8(b)]
    if bad or "grouped_mm" not in backends:
        raise ValueError(f"backends must include grouped_mm (the ratio's base) and come from "
                         f"{', '.join(ALL_BACKENDS)}, {', '.join(VARIANT_BACKENDS)} (or {FP8_BACKEND}:<promote>); "
                         f"got {backends}")
    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench experts` needs a CUDA GPU (none is visible)")
    capability = torch.cuda.get_device_capability()
    if any(map(needs_fp8, backends)) and capability < (8, 9):
        raise ValueError(f"{FP8_BACKEND} needs FP8 tensor cores (sm_89 or newer); this GPU is "
                         f"sm_{''.join(map(str, capability))}: leave out --precision fp8")
    if GLUON_BACKEND in backends and capability != (9, 0):
        raise ValueError(f"{GLUON_BACKEND} (our Gluon kernels) runs on Hopper (sm_90) only; this GPU is "
                         f"sm_{''.join(map(str, capability))}: leave it out of --backend")
    if TMA_STORE_BACKEND in backends and capability[0] < 9:
        raise ValueError(f"{TMA_STORE_BACKEND} (results written by TMA) needs Hopper (sm_90) or newer; this GPU is "
                         f"sm_{''.join(map(str, capability))}: leave it out of --backend")
    if LIBRARY_FP8_BACKEND in backends and capability[0] != 9:
        raise ValueError(f"{LIBRARY_FP8_BACKEND} (torch._scaled_grouped_mm) runs on sm_90 only; this GPU is "
                         f"sm_{''.join(map(str, capability))}: leave it out of --backend")
    device = torch.device("cuda")
    record = {"environment": environment(device), "zipf_exponent": ZIPF_EXPONENT,
              "warmup": warmup, "iters": iters, "loop_iters": loop_iters, "main_grads": main_grads}
    clocks = (GpuClockSampler.for_devices([torch.cuda.current_device()], interval_ms=CLOCK_INTERVAL_MS)
              if gpu_clocks else None)
    windows: dict[tuple[str, ...], tuple[float, float]] = {}  # ("ceiling",), (shape's index, backend, pass): when
    with clocks or contextlib.nullcontext():
        if clocks is not None:
            clocks.wait_for_sample()  # the ceiling probe lasts tens of milliseconds: sampled from its start
        start = time.monotonic()
        record["ceiling_tflops"] = matmul_ceiling_tflops(device)
        windows["ceiling",] = (start, time.monotonic())
        log(f"bf16 matmul 8192^3: {record['ceiling_tflops']:.0f} TFLOP/s")
        record["tile_source"] = tile_source(torch.cuda.get_device_name(device), device_architecture(device))
        log(f"tiles: {record['tile_source']}")
        record["shapes"] = []
        for name in shape_names:
            shape = SHAPES[name]
            with launching_for(shape.loads):  # the tiles tuned for its loads (`tile_configs.LOADS`)
                experts, hidden, ffn, top_k = shape.dims
                inputs = make_inputs(shape, device)
                dy = make_output_grad(inputs)
                loads = torch.bincount(inputs[1].reshape(-1), minlength=experts).float()
                tiles = FFNTiles.for_shape(shape.pairs, experts, hidden, ffn, device)
                fp8_tiles = {b: fp8_tiles_for(b, Fp8Tiles.for_shape(shape.pairs, experts, hidden, ffn, device))
                             for b in backends if is_fp8(b)}
                entry = {"name": name, "experts": experts, "hidden": hidden, "ffn": ffn, "top_k": top_k,
                         "pairs": shape.pairs, "load_max_over_mean": (loads.max() / loads.mean()).item(),
                         "loads": shape.loads,
                         "tiles": dataclasses.asdict(tiles),
                         "fp8_tiles": {b: dataclasses.asdict(t) for b, t in fp8_tiles.items()},
                         "fp8_kernels": {b: fp8_kernel_paths(b, hidden, ffn, device) for b in fp8_tiles},
                         "ms": {}, "tflops": {}}
                for backend, t in fp8_tiles.items():
                    log(f"{name} {backend} tiles: {t.describe()}")
                if check:
                    checked = [b for b in backends if b in ("triton", "grouped_mm", *BF16_VARIANTS) or needs_fp8(b)]
                    reference = reference_outputs(inputs, dy)
                    entry["rel_err"] = {b: (forward_error if b in FORWARD_ONLY else relative_errors)(
                        make_block(b, tiles, fp8_tiles.get(b)), inputs, dy, reference) for b in checked}
                    del reference
                for backend in backends:
                    block = make_block(backend, tiles, fp8_tiles.get(backend))
                    n_iters = loop_iters if backend == "loop" else iters
                    for pass_name in passes_of(backend):
                        start = time.monotonic()
                        ms = time_block(block, inputs, dy, pass_name, min(warmup, n_iters), n_iters, main_grads)
                        windows[str(len(record["shapes"])), backend, pass_name] = (start, time.monotonic())
                        entry["ms"].setdefault(backend, {})[pass_name] = ms
                        rate = shape.flops(pass_name) / ms / 1e9
                        entry["tflops"].setdefault(backend, {})[pass_name] = rate
                        log(f"{name} {backend} {pass_name}: {ms:.3f} ms")
            record["shapes"].append(entry)
            del inputs, dy
            torch.cuda.empty_cache()
    record["gpu_clocks_note"] = clocks.unavailable if clocks is not None else "not sampled (--no-gpu-clocks)"
    summary = (lambda key: clocks.summary([windows[key]])) if clocks is not None else (lambda key: None)
    record["ceiling_clocks"] = summary(("ceiling",))
    for index, entry in enumerate(record["shapes"]):  # by position: a shape named twice is timed twice
        entry["clocks"] = {backend: {pass_name: summary((str(index), backend, pass_name))
                                     for pass_name in passes} for backend, passes in entry["ms"].items()}
    return record


def clock_lines(record: dict) -> list[str]:
    """What the SM clock was while each row was timed (median MHz of the samples in its timing, `bench.gpu_clocks`),
    beside the ceiling probe's: a rate is a share of a ceiling timed in a short burst at the boost clock, and a
    sustained block may run below it (power cap, heat), so two runs of one build can differ by the clocks alone.
    A line per shape ('-': no sample fell in that timing; a count where fewer than `FEW_SAMPLES` did), and one
    saying why nothing was sampled where so."""
    def mhz(summary: dict | None) -> str:
        if summary is None:
            return "-"
        few = summary.get("samples", FEW_SAMPLES) < FEW_SAMPLES  # a timing of a few sampling intervals
        return f"{summary['sm_mhz_median']:,.0f}" + (f" ({summary['samples']} sample{'s' * (summary['samples'] > 1)})"
                                                      if few else "")

    def capped(summary: dict | None) -> str:
        share = (summary or {}).get("reasons", {}).get("sw_power_cap")
        return f" (power cap {share:.0%})" if share else ""

    if "ceiling_clocks" not in record:  # a record from before the clocks were sampled
        return []
    lines = [f"SM clock while timed, median MHz: ceiling probe {mhz(record['ceiling_clocks'])}"
             + capped(record["ceiling_clocks"])]
    for entry in record["shapes"]:
        rows = [f"{backend} " + " / ".join(f"{pass_name} {mhz(summary)}{capped(summary)}"
                                           for pass_name, summary in passes.items())
                for backend, passes in entry.get("clocks", {}).items()]
        lines.append(f"  {entry['name']}: " + "; ".join(rows))
    if record.get("gpu_clocks_note"):
        lines.append(f"  ({record['gpu_clocks_note']})")
    return lines


def error_text(shape_entry: dict, backend: str, pass_name: str) -> str:
    """A backend's relative error on one row: y's for the forward, the largest of y's and the
    gradients' for forward+backward ('-' unchecked)."""
    errors = shape_entry.get("rel_err", {}).get(backend)
    if not errors or (pass_name != "fwd" and backend in FORWARD_ONLY):
        return "-"
    return f"{errors['y']:.1e}" if pass_name == "fwd" else f"{max(errors.values()):.1e}"


def fp8_backends(backends: list[str]) -> list[str]:
    """The FP8 backends of a record's, each compared with `triton` (none when triton was not run)."""
    return [b for b in backends if is_fp8(b)] if "triton" in backends else []


def fp8_kernel_paths(backend: str, hidden: int, ffn: int, device: torch.device) -> str:
    """Which kernels an FP8 backend runs per GEMM role on `device` (`fp8_ffn.kernel_paths` with the
    backend's Gluon settings)."""
    gluon, backward, forward = variant_of(backend)
    paths = kernel_paths(hidden, ffn, device, rows=gluon.get("rows"), wgrad=gluon.get("wgrad"),
                         swiglu=gluon.get("swiglu"), backward=backward, forward=forward, block_m=gluon.get("block_m"),
                         tma_store=gluon.get("tma_store"), act_epilogue=gluon.get("act_epilogue"))
    # dy's rows are the combine's choice, not a kernel path of the FFN's: said here (`make_block`'s slot)
    return paths + (", dy quantised in a pass" if gluon.get("combine_dy") is False and backward != "bf16" else "")


def fp8_tiles_notes(record: dict) -> list[str]:
    """One line per shape and FP8 backend: the tiles and K-loop promotions it ran
    (`Fp8Tiles.describe`: block_m x block_n x block_k, warps, stages, programs per SM, promotion),
    and which GEMM roles ran the Gluon kernels instead of those tiles."""
    return [f"{s['name']} {backend}: " + Fp8Tiles(**{k: TileConfig(**v) for k, v in tiles.items()}).describe()
            + (f" (kernels: {s['fp8_kernels'][backend]})" if backend in s.get("fp8_kernels", {}) else "")
            for s in record["shapes"] for backend, tiles in s.get("fp8_tiles", {}).items()]


def _ratio_text(s: dict, over: str, under: str, pass_name: str) -> str:
    """'1.23x', one backend's rate over another's on a row ('-' where either has no such pass)."""
    top, bottom = s["tflops"].get(over, {}).get(pass_name), s["tflops"].get(under, {}).get(pass_name)
    return "-" if top is None or bottom is None else f"{top / bottom:.2f}x"


def table_rows(record: dict, short_fp8_names: bool = False) -> tuple[list[str], list[list[str]]]:
    """(head, rows) of the record's table, what the CLI prints and `markdown_table` quotes: every
    backend's rate (% of the ceiling; '-' for a pass it has not), ours against grouped_mm, our Gluon bf16
    block and each FP8 backend of ours against our bf16 and its error, and where the library's FP8 forward ran, ours
    against it. `short_fp8_names`: 'fp8:pingpong' for 'triton-fp8:pingpong' in the heads."""
    backends = list(record["shapes"][0]["tflops"]) if record["shapes"] else []
    ceiling = record["ceiling_tflops"]
    fp8 = fp8_backends(backends)
    against_triton = [b for b in BF16_VARIANTS if b in backends and "triton" in backends] + fp8
    library = LIBRARY_FP8_BACKEND in backends
    label = (lambda b: b.replace("triton-", "", 1)) if short_fp8_names else (lambda b: b)
    head = ["shape", "E", "H->F", "pairs", "max/mean load", "pass",
            *[f"{b} TFLOP/s (% of ceiling)" for b in backends], "triton / grouped_mm", "triton rel err",
            *[h for b in against_triton for h in (f"{label(b)} / triton", f"{label(b)} rel err")],
            *([f"{label(b)} / {LIBRARY_FP8_BACKEND}" for b in fp8] + [f"{LIBRARY_FP8_BACKEND} rel err"]
              if library else [])]
    rows = []
    for s in record["shapes"]:
        for pass_name in PASSES:
            rates = [s["tflops"][b].get(pass_name) for b in backends]
            cells = [s["name"], str(s["experts"]), f"{s['hidden']}->{s['ffn']}", str(s["pairs"]),
                     f"{s['load_max_over_mean']:.2f}", pass_name,
                     *["-" if r is None else f"{r:.0f} ({100 * r / ceiling:.0f}%)" for r in rates],
                     _ratio_text(s, "triton", "grouped_mm", pass_name), error_text(s, "triton", pass_name)]
            for b in against_triton:
                cells += [_ratio_text(s, b, "triton", pass_name), error_text(s, b, pass_name)]
            if library:
                cells += [_ratio_text(s, b, LIBRARY_FP8_BACKEND, pass_name) for b in fp8]
                cells.append(error_text(s, LIBRARY_FP8_BACKEND, pass_name))
            rows.append(cells)
    return head, rows


def markdown_table(record: dict) -> str:
    """The record as a GitHub table (what docs/benchmarks.md quotes), `table_rows`."""
    head, rows = table_rows(record)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])
