"""Load imbalance, MFU and the metrics JSONL file (disagmoe/runtime/observe/metrics.py)."""

from __future__ import annotations

import pytest
import torch

from disagmoe.runtime.observe.metrics import MetricsLog, load_imbalance, mfu, read_metrics


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


RECORDS = [{"step": s, "loss": 1.0 / s, "expert_load": [[s, 0], [0, s]]} for s in range(1, 6)]


def written(path):
    with MetricsLog(path) as log:
        for r in RECORDS:
            log.write(r)
    return path.read_bytes()


@pytest.mark.parametrize("cut", [1, 10, -2], ids=["one-byte", "mid-record", "all-but-brace"])
def test_resume_repairs_a_torn_last_line_with_a_warning(tmp_path, cut):
    from disagmoe.runtime.failures import RunWarning

    path = tmp_path / "metrics.jsonl"
    data = written(path)
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[:last_start + cut] if cut > 0 else data[:cut])  # step 5's line torn
    with pytest.warns(RunWarning, match=rf"{path}:5: dropped a torn last line"):
        log = MetricsLog(path, resume_after_step=5)
    with log:
        log.write({"step": 5, "loss": 7.0})
    assert read_metrics(path) == [*RECORDS[:4], {"step": 5, "loss": 7.0}]


def test_a_last_record_missing_only_its_line_end_is_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(written(path).rstrip(b"\n"))
    with MetricsLog(path, resume_after_step=5) as log:
        log.write({"step": 6, "loss": 7.0})
    assert read_metrics(path) == [*RECORDS, {"step": 6, "loss": 7.0}]


@pytest.mark.parametrize("garbage", [b"{not json\n", b"\xff\xfe\n"], ids=["json", "utf-8"])
def test_a_damaged_line_before_the_last_names_the_file_and_line(tmp_path, garbage):
    path = tmp_path / "metrics.jsonl"
    lines = written(path).splitlines(keepends=True)
    path.write_bytes(b"".join([*lines[:2], garbage, *lines[2:]]))
    with pytest.raises(ValueError, match=rf"{path}:3 is not a metrics record"):
        MetricsLog(path, resume_after_step=5)
    with pytest.raises(ValueError, match=rf"{path}:3"):
        read_metrics(path)


def test_each_record_is_one_write_and_a_short_write_leaves_no_torn_line(tmp_path, monkeypatch):
    import os

    from disagmoe.runtime.observe import metrics

    path = tmp_path / "metrics.jsonl"
    calls = []
    real_write = os.write

    def disk_filling_write(fd, data):
        calls.append(data)
        return real_write(fd, data[: len(data) // 2]) if len(calls) == 3 else real_write(fd, data)

    monkeypatch.setattr(metrics.os, "write", disk_filling_write)
    with MetricsLog(path) as log:
        log.write(RECORDS[0])
        log.write(RECORDS[1])
        with pytest.raises(OSError, match="metrics record"):
            log.write(RECORDS[2])
    assert all(c.endswith(b"\n") and c.count(b"\n") == 1 for c in calls)
    assert read_metrics(path) == RECORDS[:2] and path.read_bytes().endswith(b"\n")


def test_mfu_counts_every_gpu_of_the_run_and_the_measured_ceiling():
    from disagmoe.config import TrainConfig, load_hardware
    from disagmoe.runtime.observe.metrics import mfu, peak_and_ceiling

    cfg = TrainConfig(model="tiny", hardware="h200-sxm")
    hw = load_hardware("h200-sxm")
    peak1, ceiling1 = peak_and_ceiling(cfg, gpus=1)
    peak2, _ = peak_and_ceiling(cfg, gpus=2)
    assert peak2 == 2 * peak1 == 2 * hw.bf16_tflops * 1e12
    assert ceiling1 == pytest.approx(peak1 * hw.efficiency.matmul)
    assert mfu(1e15, 1.0, peak2) == pytest.approx(mfu(1e15, 1.0, peak1) / 2)
    assert peak_and_ceiling(TrainConfig(model="tiny"), gpus=2) == (None, None)


def test_a_cuda_out_of_memory_error_becomes_one_line_naming_the_knobs():
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.observe.metrics import OutOfMemory, out_of_memory_hint

    cfg = TrainConfig(model="tiny", batch_size=16, micro_batches=8, seq_len=4096)
    with pytest.raises(OutOfMemory) as err, out_of_memory_hint(cfg, "rank 1 (E0.0)"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    text = str(err.value)
    assert "\n" not in text and text.startswith("rank 1 (E0.0) ran out of memory (CUDA out of memory.")
    assert all(k in text for k in ("micro_batches=8", "batch_size", "seq_len", "expert_ranks", "pipeline_groups",
                                   "offload_optimizer: true"))
    assert "ranks_per_gpu" not in text
    offloaded = cfg.model_copy(update={"offload_optimizer": True})
    with pytest.raises(OutOfMemory) as err, out_of_memory_hint(offloaded):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    assert "offload_optimizer" not in str(err.value)  # already on: not a fix
    # only the knobs this config accepts and does not use: fp8 experts recompute their input rows and
    # SwiGLU only (no expert_output, no full), and bf16 moments are already on
    fp8 = TrainConfig(model="tiny", batch_size=16, micro_batches=8, device="cuda", experts_backend="triton",
                      precision="fp8", optim={"state_dtype": "bf16"})
    with pytest.raises(OutOfMemory) as err, out_of_memory_hint(fp8):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    assert "recompute: selective with recompute_modules: [expert_input, expert_swiglu]" in str(err.value)
    assert "recompute: full" not in str(err.value) and "state_dtype" not in str(err.value)
    assert "offload_optimizer: true" in str(err.value)
    selective = TrainConfig(model="tiny", batch_size=16, micro_batches=8, device="cuda", experts_backend="triton",
                            recompute="selective")
    with pytest.raises(OutOfMemory) as err, out_of_memory_hint(selective):
        raise torch.OutOfMemoryError("CUDA out of memory.")
    assert "recompute: full" in str(err.value) and "recompute: selective" not in str(err.value)
    shared = TrainConfig(model="tiny", batch_size=16, micro_batches=8, device="cuda", transport="nvshmem",
                         ranks_per_gpu=2)
    with pytest.raises(OutOfMemory) as err, out_of_memory_hint(shared, "rank 0 (A0.0)"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
    assert "does not fit: 2 ranks share each GPU (ranks_per_gpu): lower it over more GPUs, or raise" in str(err.value)


@pytest.mark.slow  # dynamo's first compile in the process: about 20 s on 2 cores
def test_the_host_sync_check_is_lifted_only_while_torch_compile_compiles(monkeypatch):
    """A `fused` function's first call compiles inside the step (inductor reads CUDA tensors: the
    fp8 zero-sync GPU tests failed on it). The check ('error') is lifted to 'default' for the
    compilation and put back for the compiled code; a call that compiles nothing changes nothing."""
    from disagmoe.runtime.observe.metrics import no_host_syncs

    modes = ["default"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with no_host_syncs(True, torch.device("cuda")):
        assert modes[-1] == "error"
        double(torch.ones(3))  # compiles
        assert modes[-3:] == ["error", "default", "error"]
        seen = len(modes)
        double(torch.ones(3))  # cached: no compile, no change
        assert len(modes) == seen
    assert modes[-1] == "default"
    double(torch.ones(4))  # compiles outside the check: left alone
    assert modes[-1] == "default" and modes.count("error") == 2
