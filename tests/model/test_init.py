"""The seeded initialisation draws the same values whatever tensor it fills."""

from __future__ import annotations

import pytest
import torch

from disagmoe.model.init import seeded_normal_, stream


@pytest.mark.parametrize("shape", [(5,), (17, 33), (1000, 3)])
def test_a_draw_is_the_same_into_the_tensor_through_the_staging_buffer_and_into_a_view(shape):
    """Directly into a contiguous fp32 CPU tensor, through the reused staging buffer into bf16 and
    into a transposed view (its logical order), and after a larger draw left the buffer bigger:
    all the values of a fresh tensor drawn from the same stream."""
    fresh = torch.empty(shape).normal_(0.0, 0.02, generator=stream(3, "w"))
    direct = torch.empty(shape)
    seeded_normal_(direct, 3, "w", 0.02)
    seeded_normal_(torch.empty(4096, dtype=torch.bfloat16), 1, "bigger", 0.02)  # grows the buffer first
    half = torch.empty(shape, dtype=torch.bfloat16)
    seeded_normal_(half, 3, "w", 0.02)
    view = torch.empty(tuple(reversed(shape))).t() if len(shape) == 2 else torch.empty(shape)
    seeded_normal_(view, 3, "w", 0.02)
    assert torch.equal(direct, fresh) and torch.equal(half, fresh.bfloat16()) and torch.equal(view, fresh)
