"""Ordering of an expert rank's rows (disagmoe/runtime/expert_stage.py)."""

import torch

from disagmoe.runtime.expert_stage import expert_major


def test_rows_are_ordered_by_expert_then_source():
    gen = torch.Generator().manual_seed(0)
    counts_DE = torch.tensor([[2, 0, 1], [1, 3, 0]])
    rows = [torch.randn(int(c.sum()), 4, generator=gen) for c in counts_DE]
    chunks = expert_major(rows, counts_DE)
    assert [c.shape[0] for c in chunks] == [2, 1, 0, 3, 1, 0]  # (e0,d0) (e0,d1) (e1,d0) (e1,d1) ...
    assert torch.equal(chunks[0], rows[0][:2]) and torch.equal(chunks[1], rows[1][:1])
    assert torch.equal(chunks[3], rows[1][1:4]) and torch.equal(chunks[4], rows[0][2:3])
    torch.testing.assert_close(torch.cat(chunks).sum(0), torch.cat(rows).sum(0))  # every row exactly once
