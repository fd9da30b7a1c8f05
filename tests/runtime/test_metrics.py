"""Load imbalance, MFU and the metrics JSONL file (disagmoe/runtime/metrics.py)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.runtime.metrics import MetricsLog, load_imbalance, mfu, read_metrics


def test_load_imbalance_is_max_over_mean_per_layer():
    load_LE = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    expected = [max(row) / (sum(row) / len(row)) for row in load_LE.tolist()]
    assert load_imbalance(load_LE) == pytest.approx(expected)


def test_a_layer_without_tokens_counts_as_balanced():
    assert load_imbalance(torch.tensor([[0, 0, 0], [2, 2, 2]])) == [1.0, 1.0]


def test_mfu_needs_a_peak():
    assert mfu(1e12, 2.0, None) is None
    assert mfu(1e12, 2.0, 1e12) == pytest.approx(0.5)


def test_log_writes_one_object_per_line_and_resume_drops_later_steps(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    records = [{"step": s, "loss": 1.0 / s, "expert_load": [[s, 0], [0, s]]} for s in range(1, 6)]
    with MetricsLog(path) as log:
        for r in records:
            log.write(r)
    assert read_metrics(path) == records
    with MetricsLog(path, resume_after_step=3) as log:
        log.write({"step": 4, "loss": 9.0})
    assert read_metrics(path) == [*records[:3], {"step": 4, "loss": 9.0}]
    with MetricsLog(path) as log:  # not resuming: a fresh file
        pass
    assert read_metrics(path) == []
