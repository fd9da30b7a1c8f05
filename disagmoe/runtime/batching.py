"""The one fixed split of a step's batch into (micro-batch, data-parallel rank) pieces.

A step's batch is a layout-independent [B, S + 1] token tensor (see `disagmoe.data`). Micro-batch
m of M owns rows [m * B/M, (m + 1) * B/M); within it, data-parallel rank r of D owns the r-th
contiguous block of B/(M * D) rows. Every mode (single, colocated, disaggregated) cuts the batch
with `batch_rows`, so a micro-batch holds the same tokens whatever the layout, and per-micro-batch
quantities (auxiliary losses, expert loads) agree between the oracle and the distributed runtime.

Legend: B sequences in the step's batch, S sequence length.
"""

from __future__ import annotations

import torch


def check_divisible(batch_size: int, micro_batches: int, dp_size: int) -> None:
    if batch_size % (micro_batches * dp_size):
        raise ValueError(
            f"batch_size={batch_size} must be a multiple of micro_batches * data-parallel ranks = "
            f"{micro_batches} * {dp_size}; change batch_size or micro_batches"
        )


def batch_rows(batch_size: int, micro_batches: int, dp_size: int, micro_batch: int, dp_rank: int) -> slice:
    """The rows of the step's batch that (micro_batch, dp_rank) processes."""
    check_divisible(batch_size, micro_batches, dp_size)
    assert 0 <= micro_batch < micro_batches and 0 <= dp_rank < dp_size
    rows_per_piece = batch_size // (micro_batches * dp_size)
    start = (micro_batch * dp_size + dp_rank) * rows_per_piece
    return slice(start, start + rows_per_piece)


def inputs_and_targets(tokens_BS1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split windows of S + 1 tokens into model inputs [B, S] and next-token targets [B, S]."""
    return tokens_BS1[:, :-1], tokens_BS1[:, 1:]
