"""The seeded initialisation draws the same values whatever tensor it fills."""

from __future__ import annotations

import pytest
import torch

from disagmoe.model.init import seeded_normal_, staged_draws, stream


@pytest.mark.parametrize("shape", [(5,), (17, 33), (1000, 3)])
def test_a_draw_is_the_same_into_the_tensor_through_the_staging_buffer_and_into_a_view(shape):
    """Directly into a contiguous fp32 CPU tensor, through the reused staging buffer into bf16 and
    into a transposed view (its logical order), and after a larger draw left the buffer bigger:
    all the values of a fresh tensor drawn from the same stream."""
    fresh = torch.empty(shape).normal_(0.0, 0.02, generator=stream(3, "w"))
    direct = torch.empty(shape)
    seeded_normal_(direct, 3, "w", 0.02)
    outside = torch.empty(shape, dtype=torch.bfloat16)
    seeded_normal_(outside, 3, "w", 0.02)  # no staging block: a buffer of its own
    with staged_draws():
        seeded_normal_(torch.empty(4096, dtype=torch.bfloat16), 1, "bigger", 0.02)  # grows the buffer first
        half = torch.empty(shape, dtype=torch.bfloat16)
        seeded_normal_(half, 3, "w", 0.02)
        view = torch.empty(tuple(reversed(shape))).t() if len(shape) == 2 else torch.empty(shape)
        seeded_normal_(view, 3, "w", 0.02)
    assert torch.equal(direct, fresh) and torch.equal(outside, fresh.bfloat16())
    assert torch.equal(half, fresh.bfloat16()) and torch.equal(view, fresh)


@pytest.mark.gpu
def test_cuda_a_model_materialised_on_the_gpu_is_the_cpu_models_init_bit_for_bit():
    """The staged path (CPU draws copied into device memory through the reused buffer): a tiny model
    built on meta and materialised on CUDA equals one built and initialised on the CPU."""
    from disagmoe.model import MoETransformer
    from disagmoe.model.init import materialise
    from disagmoe.model_ref import load_model

    cfg = load_model("tiny")
    with torch.device("meta"):
        model = MoETransformer(cfg)
    materialise(model, torch.device("cuda"), 5)
    reference = MoETransformer(cfg)
    reference.init_weights(5)
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(got.cpu(), want), name
