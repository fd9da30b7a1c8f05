"""What selective recomputation (`TrainConfig.recompute: selective`) may drop from the expert
FFN's saved state, and where dropped input rows come from again (torch only: the runtime's
stages name these without importing Triton; `kernels.moe_ffn` says how expert_input and
expert_swiglu come back, `kernels.fused_moe` how the combine does without expert_output).

Shape legend: T tokens, K top-k, N = T K grouped rows, H hidden.
"""

from __future__ import annotations

import dataclasses

import torch

EXPERT_SWIGLU, EXPERT_INPUT, EXPERT_OUTPUT = "expert_swiglu", "expert_input", "expert_output"
RECOMPUTABLE = (EXPERT_INPUT, EXPERT_OUTPUT, EXPERT_SWIGLU)  # what the expert FFN may drop (how each returns: kernels.moe_ffn)
# The attention side (`model.block.Block.attention_part`): keep only the block's input (the residual
# stream before the pre-attention norm) and the output projection's input; the norm, q/k/v (and
# MLA's low-rank chains and their norms), qk-norm, RoPE and the attention core run again in the
# backward (torch.utils.checkpoint, non-reentrant). Any experts backend; the router is not in it.
ATTENTION = "attention"
MODULES = (*RECOMPUTABLE, ATTENTION)  # everything `recompute: selective`'s recompute_modules may name


def expert_modules(modules: frozenset[str]) -> frozenset[str]:
    """The part of a recompute set the routed experts act on."""
    return frozenset(modules) & frozenset(RECOMPUTABLE)


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
