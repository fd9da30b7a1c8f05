"""The fixed (micro-batch, data-parallel rank) split of a step's batch (disagmoe/runtime/batching.py)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.data import TokenDataset, synthetic_corpus
from disagmoe.runtime.batching import batch_rows, inputs_and_targets


@pytest.mark.parametrize(("batch", "micro", "dp"), [(8, 1, 1), (8, 2, 1), (8, 2, 2), (12, 3, 2), (16, 4, 4)])
def test_pieces_partition_the_batch_in_order(batch, micro, dp):
    covered = []
    for m in range(micro):
        for r in range(dp):
            rows = batch_rows(batch, micro, dp, m, r)
            covered.extend(range(batch)[rows])
    assert covered == list(range(batch))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_a_micro_batch_holds_the_same_rows_whatever_the_data_parallel_width(dp):
    for m in range(2):
        alone = list(range(16)[batch_rows(16, 2, 1, m, 0)])
        spread = [i for r in range(dp) for i in range(16)[batch_rows(16, 2, dp, m, r)]]
        assert spread == alone


def test_indivisible_batch_is_a_user_error():
    with pytest.raises(ValueError, match="multiple of micro_batches"):
        batch_rows(10, 4, 1, 0, 0)


def test_targets_are_inputs_shifted_by_one():
    tokens_BS1 = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    inputs_BS, targets_BS = inputs_and_targets(tokens_BS1)
    assert inputs_BS.shape == targets_BS.shape == (4, 8)
    assert torch.equal(inputs_BS[:, 1:], targets_BS[:, :-1])
    assert torch.equal(targets_BS[:, -1], tokens_BS1[:, -1])


def test_each_rank_reads_exactly_its_piece_of_the_step_batch():
    data = TokenDataset(synthetic_corpus(20_000), seq_len=16, batch_size=8, seed=0, split="train")
    pieces = [data.rows(3, batch_rows(8, 2, 2, m, r)) for m in range(2) for r in range(2)]
    assert torch.equal(torch.cat(pieces), data.batch(3))
    assert torch.equal(data.rows(3, batch_rows(8, 2, 2, 1, 0)), pieces[2])
