"""What recomputation (`TrainConfig.recompute`) drops from the forward's saved state: selective's
modules of the expert FFN and the attention block, where dropped input rows come from again (or
that they were never written, where nothing reads them), and `recompute: full`'s whole block with
the routing it keeps (torch only: the runtime's stages name these without importing Triton;
`kernels.moe_ffn` says how expert_input and expert_swiglu come back, `kernels.fused_moe` how the
combine does without expert_output).

Shape legend: T tokens, K top-k, N = T K grouped rows, H hidden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

EXPERT_SWIGLU, EXPERT_INPUT, EXPERT_OUTPUT = "expert_swiglu", "expert_input", "expert_output"
RECOMPUTABLE = (EXPERT_INPUT, EXPERT_OUTPUT, EXPERT_SWIGLU)  # what the expert FFN may drop (how each returns: kernels.moe_ffn)
# What the FP8 experts (`kernels.fp8_ffn`, precision fp8) may drop: expert_input (the grouped rows,
# re-read from the tokens by the all-FP8 backward's quantiser, gathered again in bf16 by the
# bf16-wgrad and bf16 backwards' w13 gradient) and expert_swiglu (nothing more to drop: the
# FP8 forward never keeps the SwiGLU output). Not expert_output: the FP8 layer has no fused combine
# (`kernels.fused_moe` runs bf16 GEMMs), so `kernels.permute.combine_rows` keeps the output rows for
# the routing weights' gradient (`FP8_NO_EXPERT_OUTPUT` says so where it is refused).
FP8_RECOMPUTABLE = (EXPERT_INPUT, EXPERT_SWIGLU)
FP8_NO_EXPERT_OUTPUT = ("the FP8 experts have no fused combine (kernels/fused_moe.py's one op runs bf16 GEMMs), so "
                        "the combine keeps their output rows for the routing weights' gradient")
# The attention side (`model.block.Block.attention_part`): keep only the block's input (the residual
# stream before the pre-attention norm) and the output projection's input with the core's
# log-sum-exp; the norm, q/k/v (and MLA's low-rank chains and their norms), qk-norm and RoPE run
# again in the backward (torch.utils.checkpoint, non-reentrant), the attention core not
# (`kernels.attention_core`). Any experts backend; the router is not in it.
ATTENTION = "attention"
MODULES = (*RECOMPUTABLE, ATTENTION)  # everything `recompute: selective`'s recompute_modules may name
# `recompute: full` (`TrainConfig.recompute_set` is {BLOCK}): a block keeps its input and its routing
# (`SavedRouting`) and runs whole again in the backward (`recomputed`). In one process the block is
# attention and FFN (`model.block`); on an attention rank its attention half, from its input; on
# an expert rank its experts, from the received rows and routing (`model.local_experts`,
# `runtime.stages.pair_return`). Any experts backend.
BLOCK = "block"


def expert_modules(modules: frozenset[str]) -> frozenset[str]:
    """The part of a recompute set the routed experts act on (`BLOCK` included: an expert rank's)."""
    return frozenset(modules) & frozenset((*RECOMPUTABLE, BLOCK))


class SavedRouting:
    """`recompute: full`: a block's routing, kept by its forward for the backward's recomputation.

    The forward's run stores each value the first time it is asked for (the router's top-k ids;
    the permutation and offsets derived from them); the recomputation gets the stored ones, so it
    routes exactly as the forward did even where recomputed scores would round to another top-k,
    and never sorts again. Device tensors only: nothing is read on the host."""

    def __init__(self) -> None:
        self.topk_idx_NK: torch.Tensor | None = None  # the router's choice (`model.block.MoEBlock.route`)
        self._derived: dict[str, Any] = {}

    def choice(self, fixed_topk_idx_NK: torch.Tensor | None) -> torch.Tensor | None:
        """The ids to route by: the forward's once stored, else `fixed_topk_idx_NK` (None: select)."""
        return fixed_topk_idx_NK if self.topk_idx_NK is None else self.topk_idx_NK

    def record(self, topk_idx_NK: torch.Tensor) -> None:
        """Keep the forward's ids (a recomputation passes its own copy of them: a no-op)."""
        if self.topk_idx_NK is None:
            self.topk_idx_NK = topk_idx_NK.detach()

    def derived(self, name: str, compute: Callable[[], Any]) -> Any:
        """`compute()` (a function of the routing alone: a permutation, offsets) on the forward's
        run, kept; the kept value on the recomputation's."""
        if name not in self._derived:
            self._derived[name] = compute()
        return self._derived[name]


def derived(routing: SavedRouting | None, name: str, compute: Callable[[], Any]) -> Any:
    """`routing.derived(name, compute)`, or `compute()` where nothing is kept (no `recompute: full`)."""
    return compute() if routing is None else routing.derived(name, compute)


def recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args, routing) under a non-reentrant checkpoint with a fresh `SavedRouting`: the forward
    keeps `args` (the tensors among them) and what `fn` stores in the routing, nothing `fn` computes;
    the backward runs `fn` again on them (the same ops on the same values: in fp32 the plain run's
    gradients to the bit) and backpropagates through that. No RNG state is stashed (no dropout;
    stashing the CUDA RNG state is a host read a CUDA graph would freeze); the recomputed ops'
    backward runs in the outer backward, so weight gradients still wait under `deferred_weight_grads`.
    Its outputs may be any structure of tensors (torch's non-reentrant checkpoint)."""
    return checkpoint(fn, *args, SavedRouting(), use_reentrant=False, preserve_rng_state=False)


def pair_of_rows(dest_TK: torch.Tensor) -> torch.Tensor:
    """int64 [N]: the pair t K + k each grouped row holds, from a permute's destinations
    (`kernels.permute.permute_tokens`: pair (t, k) at row dest_TK[t, k]), on the device."""
    pairs = dest_TK.numel()
    return torch.empty(pairs, dtype=torch.int64, device=dest_TK.device).scatter_(
        0, dest_TK.reshape(-1).long(), torch.arange(pairs, device=dest_TK.device))


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Where the grouped rows came from: row r is x_TH[token_N[r]] (rows of pairs served elsewhere:
    any token; no GEMM reads them). Kept instead of the rows under `expert_input` recomputation."""

    x_TH: torch.Tensor
    token_N: torch.Tensor  # int64 [N]

    @classmethod
    def of_permute(cls, x_TH: torch.Tensor, dest_TK: torch.Tensor) -> RowSource:
        """From a permute's destinations (`pair_of_rows`): every row's token, on the device (no
        host sync)."""
        return cls(x_TH.detach(), pair_of_rows(dest_TK) // dest_TK.shape[1])

    def rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows [N, H] again, in `dtype` (the GEMMs' operand dtype)."""
        return self.x_TH.index_select(0, self.token_N).to(dtype)


@dataclasses.dataclass(frozen=True)
class UnwrittenRows:
    """A permute's grouped rows left unwritten because nothing reads them (`RoutedExperts.reads_rows`
    in `model.experts`: FP8 experts given their e4m3 rows that recompute expert_input): row
    dest_TK[t, k] would be x_TH[t]. x_TH keeps its autograd history: the experts taking these in place
    of the rows return the rows' gradient to the tokens as the permute's backward does
    (`kernels.fp8_ffn`)."""

    x_TH: torch.Tensor
    dest_TK: torch.Tensor  # int32, `kernels.permute.pair_destinations`'
