"""`bench.gpu_clocks`: nvidia-smi's clock samples read in the background, summarised over a run's
timed steps and per step, against a fake nvidia-smi (a script that answers the query as the real
one does: one-shot, then looping every --loop-ms)."""

from __future__ import annotations

import json
import stat
import sys
import time

import pytest
from typer.testing import CliRunner

from disagmoe.bench import gpu_clocks
from disagmoe.bench.gpu_clocks import GpuClockSampler, describe, parse_line, reason_names
from disagmoe.cli.app import app

FAKE = """#!{python}
import datetime, itertools, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
fields = args["--query-gpu"]
if {old_driver} and "clocks_event_reasons" in fields:
    print('Field "clocks_event_reasons.active" is not a valid field to query.')
    sys.exit(2)
ids = args["--id"].split(",")
clocks = itertools.cycle([(1980, "650.25", "0x0000000000000000"), (1755, "[N/A]", "0x0000000000000004")])
for n in itertools.count():
    sm, power, reasons = next(clocks)
    stamp = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    for i, _ in enumerate(ids):  # the last GPU idles at 345 MHz (a rank-less GPU of a smaller run)
        idle = i == len(ids) - 1 and len(ids) > 1
        print(f"{{stamp}}, {{i}}, {{345 if idle else sm}}, {{power}}, {{60 + n % 3}}, {{'0x1' if idle else reasons}}",
              flush=True)
    if "--loop-ms" not in args:
        break
    time.sleep(int(args["--loop-ms"]) / 1000)
"""


def fake_nvidia_smi(tmp_path, old_driver: bool = False) -> str:
    path = tmp_path / ("nvidia-smi-old" if old_driver else "nvidia-smi")
    path.write_text(FAKE.format(python=sys.executable, old_driver=old_driver))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_line_parses_with_missing_power_and_hex_reasons():
    sample = parse_line("2026/12/05 00:46:15.250, 3, 1755, [N/A], 61, 0x0000000000000024", 5.0)
    assert (sample.gpu, sample.sm_mhz, sample.power_w, sample.temperature_c, sample.reasons) == (3, 1755.0, None, 61.0, 0x24)
    assert sample.at_s == 5.0  # no clock offset given: when it was read
    assert reason_names(sample.reasons) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert reason_names(0x204) == ["sw_power_cap", "0x200"]
    assert parse_line("2026/12/05 00:46:15.250, 0, 1980, 700, 60, [N/A]", 0.0).reasons == 0
    assert parse_line("", 0.0) is None and parse_line("No devices were found", 0.0) is None


def test_a_sample_is_placed_by_its_timestamp_not_by_when_it_was_read():
    """A line read late (a buffered pipe) keeps the time nvidia-smi took it: its local timestamp on
    the monotonic clock."""
    from datetime import datetime

    offset = 1_000_000.0  # wall minus monotonic
    wall = datetime(2026, 12, 5, 0, 46, 15, 250000).timestamp()
    sample = parse_line("2026/12/05 00:46:15.250, 0, 1980, 700, 60, 0x0", read_at_s=99.0, wall_minus_monotonic_s=offset)
    assert sample.at_s == pytest.approx(wall - offset, abs=1e-6)
    assert parse_line("not a time, 0, 1980, 700, 60, 0x0", 99.0, offset).at_s == 99.0


@pytest.mark.parametrize("old_driver", [False, True])
def test_the_sampler_summarises_the_timed_steps_and_each_step(tmp_path, old_driver):
    """Samples of three GPUs (the last idle throughout) every 10 ms while four 'steps' of 0.2 s run: the
    summary of the steps after the first takes only their samples, of the two working GPUs, names the
    power-cap events by their share, and every step gets its median SM clock; a driver without the
    renamed field is asked the old one."""
    with GpuClockSampler(["0", "1", "2"], interval_ms=10, command=fake_nvidia_smi(tmp_path, old_driver)) as clocks:
        deadline = time.monotonic() + 10
        while not clocks.samples and time.monotonic() < deadline:  # the fake's interpreter starting
            time.sleep(0.01)
        for _ in range(4):
            time.sleep(0.2)
            clocks.mark()
    assert clocks.unavailable is None and {s.gpu for s in clocks.samples} == {0, 1, 2}
    summary = clocks.timed_summary(warmup=1)
    timed = clocks.window(clocks.marks[0], clocks.marks[-1])
    assert {s.gpu for s in timed} == {0, 1} and summary["samples"] == len(timed)
    assert summary["sm_mhz_min"] == 1755 and summary["sm_mhz_max"] == 1980 and "gpu_idle" not in summary["reasons"]
    assert summary["power_w_max"] == 650.25 and summary["temperature_c_max"] <= 62
    assert 0 < summary["reasons"]["sw_power_cap"] < 1
    per_step = clocks.per_step_sm_mhz()
    assert len(per_step) == 4 and all(m is None or 1755 <= m <= 1980 for m in per_step) and any(per_step)
    assert describe(summary).startswith("SM 1,755-1,980 MHz (median ") and "sw_power_cap" in describe(summary)


def test_a_sampler_that_stops_early_says_so(tmp_path):
    stops = tmp_path / "nvidia-smi"
    stops.write_text(f"#!{sys.executable}\nimport datetime, sys\n"
                     "stamp = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
                     "print(f'{stamp}, 0, 1980, 700, 60, 0x0', flush=True)\n"
                     "sys.exit(3 if any(a.startswith('--loop-ms') for a in sys.argv) else 0)\n")
    stops.chmod(stops.stat().st_mode | stat.S_IXUSR)
    with GpuClockSampler(["0"], command=str(stops)) as clocks:
        time.sleep(0.5)
    assert clocks.unavailable == f"{stops} stopped sampling early (exit 3)"


def test_without_nvidia_smi_nothing_is_sampled_and_the_row_says_why(tmp_path):
    with GpuClockSampler(["0"], command=str(tmp_path / "absent")) as clocks:
        clocks.mark()
    assert clocks.samples == [] and "not found" in clocks.unavailable
    assert clocks.timed_summary(0) is None
    assert describe(None, clocks.unavailable) == f"GPU clocks not sampled ({clocks.unavailable})"


def test_a_refused_query_leaves_the_sampler_unavailable(tmp_path):
    refuses = tmp_path / "nvidia-smi"
    refuses.write_text(f"#!{sys.executable}\nprint('NVIDIA-SMI has failed'); raise SystemExit(9)\n")
    refuses.chmod(refuses.stat().st_mode | stat.S_IXUSR)
    with GpuClockSampler(["0"], command=str(refuses)) as clocks:
        pass
    assert clocks.unavailable == f"{refuses} refused the clock query: NVIDIA-SMI has failed"


@pytest.mark.slow  # a training run
def test_bench_train_rows_carry_their_steps_clocks(tmp_path, monkeypatch):
    """Each row of `bench train` (here the tiny CPU config, with the fake sampler standing in for the
    GPU's) holds its timed steps' clock summary and one clock per step, and the table shows the
    median SM clock."""
    from disagmoe.bench import train as bench

    command = fake_nvidia_smi(tmp_path)
    monkeypatch.setattr(bench, "clock_sampler", lambda cfg: GpuClockSampler(["0"], interval_ms=5, command=command))
    real = bench.train_row

    def slow_steps(cfg, on_step=None):  # steps longer than the interval: each gets samples
        def step_ended(record):
            time.sleep(0.05)
            on_step(record)
        return real(cfg, step_ended)

    monkeypatch.setattr(bench, "train_row", slow_steps)
    out = tmp_path / "run.json"
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps",
                                 "3", "--warmup", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["modes"]
    assert row["gpu_clocks"]["samples"] > 0 and row["gpu_clocks"]["sm_mhz_max"] == 1980
    assert len(row["step_sm_mhz"]) == 3 and row["gpu_clocks_note"] is None
    assert "SM clock" in r.output and " MHz" in r.output and "single: SM 1," in r.output


def test_off_cuda_a_row_has_no_clocks():
    from disagmoe.bench import train as bench
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/tiny-cpu.yaml", [])
    assert bench.clock_sampler(cfg) is None
    assert bench.clock_fields(None, 1) == {"gpu_clocks": None, "step_sm_mhz": None, "gpu_clocks_note": None}
    assert gpu_clocks.DEFAULT_INTERVAL_MS <= 200


@pytest.mark.gpu
def test_cuda_the_real_nvidia_smi_reports_the_gpu_torch_calls_device_0():
    """On a GPU host: GPU 0 named to nvidia-smi by its UUID, sampled while a matmul loop runs: SM
    clocks in the hundreds of MHz at least, one GPU's samples, a summary over the loop."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with GpuClockSampler.for_devices([0], interval_ms=20) as clocks:
        start = clocks.mark()
        while time.monotonic() - start < 1.0:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
        clocks.mark()
    assert clocks.unavailable is None, clocks.unavailable
    summary = clocks.timed_summary(warmup=1)
    assert summary["samples"] >= 10 and summary["sm_mhz_min"] >= 100 and len({s.gpu for s in clocks.samples}) == 1
