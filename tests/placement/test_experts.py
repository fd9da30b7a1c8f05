"""Expert -> GPU mapping balances expected load, with and without replicas."""

import json

import numpy as np
import pytest

from disagmoe.placement.experts import imbalance, map_layer, read_histogram


def zipf_loads(n, s=1.2, seed=0):
    rng = np.random.default_rng(seed)
    loads = 1.0 / np.arange(1, n + 1) ** s
    rng.shuffle(loads)
    return loads.tolist()


@pytest.mark.parametrize("n, gpus", [(64, 8), (16, 5), (32, 32), (8, 16), (128, 24)])
def test_every_expert_placed_within_the_slots(n, gpus):
    owners = map_layer(zipf_loads(n), gpus)
    assert len(owners) == n and all(owners)
    per_gpu = np.bincount([g for gs in owners for g in gs], minlength=gpus)
    assert per_gpu.max() <= -(-n // gpus)  # memory: no GPU holds more than ceil(n / gpus) experts
    assert all(len(set(gs)) == len(gs) for gs in owners)  # no replica twice on one GPU


def test_skewed_loads_balance_better_than_round_robin():
    loads = zipf_loads(64, s=1.2)
    gpus = 8
    ours = imbalance(loads, map_layer(loads, gpus), gpus)
    round_robin = imbalance(loads, [[e % gpus] for e in range(64)], gpus)
    assert ours < round_robin
    # Greedy LPT is within 4/3 of the optimum, which is at least max(mean, hottest expert).
    lower_bound = max(1.0, max(loads) * gpus / sum(loads))
    assert ours <= 4 / 3 * lower_bound + 1e-9


def test_replicas_relieve_a_hot_expert():
    loads = [10.0] + [1.0] * 15
    gpus = 8
    plain = imbalance(loads, map_layer(loads, gpus), gpus)
    with_replicas = map_layer(loads, gpus, max_replicas=3)
    assert len(with_replicas[0]) > 1
    assert imbalance(loads, with_replicas, gpus) < plain


def test_more_gpus_than_experts_replicates_hottest():
    loads = [5.0, 1.0, 1.0, 1.0]
    owners = map_layer(loads, 6)
    assert len(owners[0]) == 3 and sum(map(len, owners)) == 6


def test_histogram_from_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 3.0, "expert_load": [[1, 2, 3], [4, 5, 6]]},
            {"step": 2, "loss": 2.0},
            {"step": 3, "expert_load": [[1, 0, 0], [0, 0, 1]]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_histogram(path, 2, 3) == [[2, 2, 3], [4, 5, 7]]
    with pytest.raises(ValueError, match="2 MoE layers x 4 experts"):
        read_histogram(path, 2, 4)
    with pytest.raises(ValueError, match="cannot read"):
        read_histogram(tmp_path / "nope.jsonl", 2, 3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="no 'expert_load'"):
        read_histogram(empty, 2, 3)
