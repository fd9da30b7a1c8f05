"""GPU timing helpers: kernel time is the GPU's own time, event time includes the host's."""

import pytest
import torch

from disagmoe.bench import timing


@pytest.mark.gpu
def test_kernel_time_equals_event_time_for_a_large_kernel_and_drops_the_host_for_tiny_ones():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big_events, big_kernels = timing.median_ms(lambda _: a @ a, 3, 10), timing.kernel_ms(lambda _: a @ a, 3, 10)
    assert big_kernels == pytest.approx(big_events, rel=0.1)
    x = torch.zeros(16, device="cuda")
    many = lambda _: [x.add_(1.0) for _ in range(50)]  # noqa: E731  50 launches of a 16-element kernel
    assert timing.kernel_ms(many, 3, 10) < timing.median_ms(many, 3, 10)


def test_a_bad_count_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="iters >= 1"):
        timing.kernel_ms(lambda _: None, 0, 0)


def test_the_capture_steps_of_a_run_by_its_config():
    """`capture_steps`: WARMUP_STEPS = 3 eager steps, so a captured bf16 single run captures on step 4;
    precision fp8 counting every 10th step (the default) also on step 10, the first counting step after
    the warm-up, or on a shorter run's last (which counts); a run too short to reach a capture, an eager
    one (cuda_graphs off, a CPU run) none; a captured distributed run on 4 and 5 (its two phases')."""
    from disagmoe.config import FP8_COUNTERS_EVERY, load_train_config
    from disagmoe.runtime.training.graphed_step import WARMUP_STEPS

    assert (WARMUP_STEPS, FP8_COUNTERS_EVERY) == (3, 10)
    bf16 = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "mode=single", "experts_backend=triton"])
    fp8 = bf16.model_copy(update={"precision": "fp8"})
    assert timing.capture_steps(bf16) == timing.capture_steps(bf16, 20) == [4]
    assert timing.capture_steps(fp8) == timing.capture_steps(fp8, 20) == [4, 10]
    assert [timing.capture_steps(fp8, steps) for steps in (6, 4, 3)] == [[4, 6], [4], []]
    assert timing.capture_steps(fp8, 6, last=7) == [4]  # configured longer: its last, counted step not reached
    assert timing.capture_steps(fp8.model_copy(update={"fp8_counters_every": 1})) == [4]
    assert timing.capture_steps(bf16.model_copy(update={"cuda_graphs": "off"})) == []
    assert timing.capture_steps(bf16.model_copy(update={"device": "cpu"})) == []
    split = load_train_config("configs/h200x2-qwen3-30b.yaml", ["transport=nvshmem"])
    assert split.mode == "disaggregated" and timing.capture_steps(split) == [4, 5]
    assert timing.capture_steps(split, 4) == [4]
    assert timing.capture_steps(split.model_copy(update={"transport": "nccl"})) == []


def test_a_captured_config_warms_up_through_its_capture_steps():
    """`warmup_past_capture` (`bench profile`'s and `bench train`'s): where the step is captured
    (cuda_graphs auto on a single CUDA run) the warm-up runs through the capture step (WARMUP_STEPS + 1)
    and says why; more warm-up is kept; an eager run keeps what it was given; a run of a given length
    captures its counting graph on its last step where that comes before the Nth."""
    from disagmoe.config import load_train_config
    from disagmoe.runtime.training.graphed_step import WARMUP_STEPS

    cfg = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "mode=single", "experts_backend=triton"])
    assert timing.warmup_past_capture(cfg, 0) == (WARMUP_STEPS + 1, f"the step is captured on step {WARMUP_STEPS + 1}")
    assert timing.warmup_past_capture(cfg, WARMUP_STEPS + 2) == (WARMUP_STEPS + 2, None)
    assert timing.warmup_past_capture(cfg.model_copy(update={"cuda_graphs": "off"}), 1) == (1, None)
    # precision fp8 counting every 10th step: a graph for each kind, the counting one first captured on step 10
    fp8 = cfg.model_copy(update={"precision": "fp8"})
    warmup, why = timing.warmup_past_capture(fp8, 4)
    assert warmup == 10 and why.startswith("the step is captured on steps 4 and 10 (one graph for the steps without")
    assert timing.warmup_past_capture(fp8, 3, 6)[0] == 6  # 6 steps: the last counts, its graph captured there
    assert timing.warmup_past_capture(fp8, 3, 30)[0] == 10
    assert timing.warmup_past_capture(fp8.model_copy(update={"fp8_counters_every": 1}), 0)[0] == WARMUP_STEPS + 1
    assert timing.warmup_past_capture(fp8.model_copy(update={"fp8_counters_every": 2}), 0)[0] == 5  # 4 counts


def test_a_captured_distributed_run_warms_up_through_both_phases_steps():
    """The distributed modes' rank steps (nvshmem, one attention rank per pipeline group: captured)
    capture a graph per phase of the transport's counts: step 4, and 5 where the phases alternate,
    which the driver does not know, so the warm-up covers both; an eager layout keeps its warm-up, and
    a refused `cuda_graphs: on` raises the refusal."""
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/h200x2-qwen3-30b.yaml", ["transport=nvshmem"])
    warmup, why = timing.warmup_past_capture(cfg, 3)
    assert warmup == 5 and why.startswith("the rank steps are captured on step 4, and on step 5 where")
    assert timing.warmup_past_capture(cfg, 3, 4) == (4, "the rank steps are captured on step 4")
    nccl = cfg.model_copy(update={"transport": "nccl"})
    assert timing.warmup_past_capture(nccl, 3) == (3, None)
    with pytest.raises(ValueError, match="cuda_graphs: on cannot capture"):
        timing.warmup_past_capture(nccl.model_copy(update={"cuda_graphs": "on"}), 3)
