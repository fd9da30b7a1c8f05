"""Parameter counts reproduce the published totals (within 2%)."""

import pytest

from disagmoe.model_ref import load_model
from disagmoe.roofline.params import count_params

PUBLISHED = {  # name: (total, active), from the model cards / technical reports
    "deepseek-v3": (671e9, 37e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    counts = count_params(load_model(name))
    total, active = PUBLISHED[name]
    assert abs(counts.total / total - 1) < 0.02
    assert abs(counts.active / active - 1) < 0.02


def test_split_adds_up():
    c = count_params(load_model("deepseek-v3"))
    assert c.total == c.non_expert + c.routed_experts
    assert c.active < c.total
