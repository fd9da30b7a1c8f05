"""`bench.gpu_clocks`: nvidia-smi's clock samples read in the background, summarised over a run's
timed steps and per step, against a fake nvidia-smi (a script that answers the query as the real
one does: one-shot, then looping every --loop-ms)."""

from __future__ import annotations

import json
import stat
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from disagmoe.bench import gpu_clocks
from disagmoe.bench.gpu_clocks import ClockSample, GpuClockSampler, Mark, describe, parse_line, reason_names
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
    summary of the steps after the first takes only their samples, of the two working GPUs (and says
    which), names the power-cap events by their share, and every step gets its median SM clock; a
    driver without the renamed field is asked the old one."""
    with GpuClockSampler(["0", "1", "2"], interval_ms=10, command=fake_nvidia_smi(tmp_path, old_driver)) as clocks:
        deadline = time.monotonic() + 10
        while not clocks.samples and time.monotonic() < deadline:  # the fake's interpreter starting
            time.sleep(0.01)
        clocks.mark(0)
        for _ in range(4):
            time.sleep(0.2)
            clocks.mark()
    assert clocks.unavailable is None and {s.gpu for s in clocks.samples} == {0, 1, 2}
    assert [m.step for m in clocks.marks] == [0, 1, 2, 3, 4]
    summary = clocks.timed_summary(warmup=1)
    timed = clocks.window(clocks.marks[1].at_s, clocks.marks[-1].at_s)
    assert summary["samples"] == len([s for s in timed if s.gpu != 2]) and summary["steps"] == 3
    assert summary["gpus"] == [0, 1] and summary["gpu_count"] == 2 and summary["idle_gpus"] == [2]
    assert summary["sm_mhz_min"] == 1755 and summary["sm_mhz_max"] == 1980 and "gpu_idle" not in summary["reasons"]
    assert summary["power_w_max"] == 650.25 and summary["temperature_c_max"] <= 62
    assert 0 < summary["reasons"]["sw_power_cap"] < 1
    assert summary["window_s"] == pytest.approx(clocks.marks[-1].at_s - clocks.marks[1].at_s)
    assert summary["coverage"] > 0.5  # the fake's 10 ms loop on a busy host: near 1
    per_step = clocks.per_step_sm_mhz()
    assert len(per_step) == 4 and all(m is None or 1755 <= m <= 1980 for m in per_step) and any(per_step)
    assert describe(summary).startswith("SM 1,755-1,980 MHz (median ") and "sw_power_cap" in describe(summary)
    assert ", GPUs 0, 1 (idle, left out: 2); clock events: " in describe(summary)


def test_a_benchmark_can_wait_for_the_first_sample_before_a_short_timing(tmp_path):
    """nvidia-smi takes a moment to start: `wait_for_sample` returns once its first line is read (so a timing of
    tens of milliseconds that starts after it is sampled), and False at once where nothing samples."""
    with GpuClockSampler(["0"], interval_ms=10, command=fake_nvidia_smi(tmp_path)) as clocks:
        assert clocks.wait_for_sample(timeout_s=30.0) and clocks.samples
    with GpuClockSampler(["0"], command=str(tmp_path / "absent")) as clocks:
        started = time.monotonic()
        assert not clocks.wait_for_sample(timeout_s=30.0) and time.monotonic() - started < 1.0


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


def sampled(*runs: tuple[float, float, int, float, int], interval_s: float = 0.1) -> GpuClockSampler:
    """A sampler holding samples every `interval_s` (nvidia-smi not run): per run (from_s, to_s, gpu,
    SM MHz, reasons), power 500 W where busy and 100 W where idle."""
    clocks = GpuClockSampler(["0"], interval_ms=round(interval_s * 1e3))
    for start, end, gpu, sm, reasons in runs:
        for n in range(round((end - start) / interval_s)):
            clocks.samples.append(ClockSample(start + (n + 0.5) * interval_s, gpu, sm, 100.0 if reasons & 1 else 500.0,
                                              60.0, reasons))
    return clocks


def marked(clocks: GpuClockSampler, *marks: tuple[int, float, int]) -> GpuClockSampler:
    clocks.marks = [Mark(step, at_s, attempt) for step, at_s, attempt in marks]
    return clocks


def test_a_summary_of_a_window_sampled_in_part_is_marked_partial_and_describe_keeps_the_note():
    """nvidia-smi stopped 1 s into a 10 s timed window: the summary says 11.5% of it was sampled
    (to its last sample, at 0.95 s, and two intervals past it) and is partial, and the log line says so
    and keeps the early exit's note; a window sampled to its end is whole."""
    stopped = marked(sampled((0.0, 1.0, 0, 1980, 0)), (0, 0.0, 0), *((n, float(n), 0) for n in range(1, 11)))
    summary = stopped.timed_summary(0)
    assert summary["window_s"] == 10 and summary["coverage"] == pytest.approx(0.115) and summary["partial"] is True
    line = describe(summary, "nvidia-smi stopped sampling early (exit 1)")
    assert line.startswith("SM 1,980-1,980 MHz") and "; partial: 12% of the window sampled; " in line
    assert line.endswith("; nvidia-smi stopped sampling early (exit 1)")
    whole = marked(sampled((0.0, 10.0, 0, 1980, 0)), (0, 0.0, 0), *((n, float(n), 0) for n in range(1, 11)))
    summary = whole.timed_summary(0)
    assert summary["coverage"] == 1.0 and summary["partial"] is False and "partial" not in describe(summary)
    assert describe(summary, "nvidia-smi stopped sampling early (exit 1)").endswith("; nvidia-smi stopped sampling early (exit 1)")


def test_with_no_warmup_the_timed_steps_start_at_the_start_mark_not_with_the_set_up():
    """A second of set-up at 1,200 MHz (building, compiling: not idle), then two steps at 1,980: with
    warmup 0 the summary and the first step's clock start at the start mark (step 0), so the set-up
    is in neither."""
    clocks = marked(sampled((0.0, 1.0, 0, 1200, 0), (1.0, 2.0, 0, 1980, 0)), (0, 1.0, 0), (1, 1.5, 0), (2, 2.0, 0))
    summary = clocks.timed_summary(0)
    assert summary["sm_mhz_min"] == 1980 and summary["steps"] == 2 and summary["steps_left_out"] == 0
    assert clocks.per_step_sm_mhz() == [1980, 1980]
    without_start = marked(sampled((0.0, 1.0, 0, 1200, 0), (1.0, 2.0, 0, 1980, 0)), (1, 1.5, 0), (2, 2.0, 0))
    assert without_start.per_step_sm_mhz() == [None, 1980]  # no start mark: the first step has no window
    assert without_start.timed_summary(0)["steps_left_out"] == 1
    assert "1 timed step left out (start not marked" in describe(without_start.timed_summary(0))


def test_timed_steps_shorter_than_the_interval_say_why_they_have_no_clocks():
    """Two 5 ms steps between samples 100 ms apart (the tiny config on a GPU): no summary, and the note
    says how long the timed steps ran against the interval, which the log line carries; sampled
    steps have no note, and an early exit's note is kept."""
    short = marked(sampled((0.0, 1.0, 0, 1980, 0)), (0, 0.51, 0), (1, 0.515, 0), (2, 0.52, 0))
    assert short.timed_summary(0) is None
    note = short.timed_note(0)
    assert note == ("no sample fell in the 2 timed steps (10.0 ms in all, one sample every 100 ms); "
                    "time more or longer steps")
    assert describe(None, note) == f"GPU clocks not sampled ({note})"
    assert marked(sampled((0.0, 1.0, 0, 1980, 0)), (1, 0.52, 0)).timed_note(0) == "no timed step has a marked start and end"
    whole = marked(sampled((0.0, 1.0, 0, 1980, 0)), (0, 0.0, 0), (1, 1.0, 0))
    assert whole.timed_summary(0) is not None and whole.timed_note(0) is None
    whole.unavailable = "nvidia-smi stopped sampling early (exit 1)"
    assert whole.timed_note(0) == "nvidia-smi stopped sampling early (exit 1)"


def test_a_working_gpus_idle_samples_stay_out_of_its_clock_power_and_temperature():
    """A GPU that worked half its window (1,980 MHz) and idled the other half (345 MHz, gpu_idle): the
    clock and power figures are of its working samples; gpu_idle keeps its share of the reasons."""
    clocks = marked(sampled((0.0, 1.0, 0, 1980, 0x4), (1.0, 2.0, 0, 345, 0x1)), (0, 0.0, 0), (1, 2.0, 0))
    summary = clocks.timed_summary(0)
    assert (summary["sm_mhz_min"], summary["sm_mhz_median"], summary["power_w_median"]) == (1980, 1980, 500.0)
    assert summary["samples"] == 20 and summary["idle_samples"] == 10
    assert summary["reasons"] == {"sw_power_cap": pytest.approx(0.5), "gpu_idle": pytest.approx(0.5)}
    assert clocks.per_step_sm_mhz() == [1980]
    idle = marked(sampled((0.0, 1.0, 0, 345, 0x1)), (0, 0.0, 0), (1, 1.0, 0))  # every GPU idle: the idle clock
    assert idle.timed_summary(0)["sm_mhz_median"] == 345 and idle.timed_summary(0)["reasons"] == {"gpu_idle": 1.0}


def test_a_summary_names_the_gpus_it_covers():
    clocks = marked(sampled((0.0, 1.0, 0, 1980, 0), (0.0, 1.0, 3, 1900, 0), (0.0, 1.0, 5, 345, 0x1)),
                    (0, 0.0, 0), (1, 1.0, 0))
    summary = clocks.timed_summary(0)
    assert (summary["gpus"], summary["gpu_count"], summary["idle_gpus"]) == ([0, 3], 2, [5])
    assert ", GPUs 0, 3 (idle, left out: 5); " in describe(summary)
    one = marked(sampled((0.0, 1.0, 2, 1980, 0)), (0, 0.0, 0), (1, 1.0, 0)).timed_summary(0)
    assert ", GPU 2; clock events: none" in describe(one)


def test_after_a_restart_the_re_run_steps_replace_their_first_tries_and_no_window_spans_it():
    """Steps 1-3 at 1,980 MHz, a failure, 4 s of restart at 600 MHz (the failed attempt's end, new
    actors: not idle), then steps 1-4 again (attempt 1, resumed from step 0): the steps' windows are
    the second attempt's, the first step after the restart (whose start is the restart) has none,
    and the timed summary holds no restart sample; so for a restart resumed from a checkpoint at the
    last step marked (the next step's number follows it, only the attempt tells)."""
    samples = ((0.0, 3.0, 0, 1980, 0), (3.0, 7.0, 0, 600, 0), (7.0, 11.0, 0, 1980, 0))
    clocks = marked(sampled(*samples), (0, 0.0, 0), (1, 1.0, 0), (2, 2.0, 0), (3, 3.0, 0),
                    (1, 8.0, 1), (2, 9.0, 1), (3, 10.0, 1), (4, 11.0, 1))
    assert list(clocks.step_windows().items()) == [(1, (None, 8.0)), (2, (8.0, 9.0)), (3, (9.0, 10.0)), (4, (10.0, 11.0))]
    assert clocks.per_step_sm_mhz() == [None, 1980, 1980, 1980]
    summary = clocks.timed_summary(1)
    assert summary["sm_mhz_min"] == 1980 and summary["steps"] == 3 and summary["steps_left_out"] == 0
    summary = clocks.timed_summary(0)
    assert summary["sm_mhz_min"] == 1980 and summary["steps_left_out"] == 1
    resumed = marked(sampled(*samples), (0, 0.0, 0), (1, 1.0, 0), (2, 2.0, 0), (3, 3.0, 0), (4, 8.0, 1), (5, 9.0, 1))
    assert list(resumed.step_windows().items()) == [(1, (0.0, 1.0)), (2, (1.0, 2.0)), (3, (2.0, 3.0)),
                                                    (4, (None, 8.0)), (5, (8.0, 9.0))]
    assert resumed.timed_summary(0)["sm_mhz_min"] == 1980


def test_a_bench_row_marks_its_start_once_built_and_each_step_with_the_runs_restarts(monkeypatch):
    """`train_row` marks step 0 after the trainer is built (not before: the set-up is no step's) and
    each step's end with the step's number and the trainer's restarts, so a restarted distributed
    run's marks say where it restarted."""
    import disagmoe.runtime.cluster.driver as driver
    from disagmoe.bench import train as bench

    events = []

    class Restarting:  # a distributed trainer that fails in step 3 and restarts from step 0
        def __init__(self, cfg):
            events.append("built")
            self.step, self.restarts = 0, 0

        def run(self, on_step):
            for restarts, steps in ((0, (1, 2)), (1, (1, 2, 3))):
                self.restarts = restarts
                for step in steps:
                    events.append(f"step {step}")
                    on_step({"step": step})

    class Recorder:
        def mark(self, step=None, attempt=0):
            events.append((step, attempt))

    monkeypatch.setattr(driver, "DistributedTrainer", Restarting)
    bench.train_row(SimpleNamespace(mode="disaggregated"), Recorder())
    assert events == ["built", (0, 0), "step 1", (1, 0), "step 2", (2, 0), "step 1", (1, 1), "step 2", (2, 1),
                      "step 3", (3, 1)]


def test_the_steps_clocks_take_one_sort_not_a_scan_per_step():
    """1,000 steps of 2 s over 160,000 samples (8 GPUs at 100 ms): a scan of every sample per step
    is 1,000 passes over them; one sort and two bisections a step cost a few. Timed against one
    plain pass over the samples on the same machine (a fixed wall-clock bound failed under a loaded
    CI), with room: under 200 passes."""
    clocks = GpuClockSampler(["0"])
    clocks.samples = [ClockSample(i * 0.1 / 8, i % 8, 1980.0, 700.0, 60.0, 0) for i in range(8 * 20000)]
    clocks.marks = [Mark(step, 2.0 * step, 0) for step in range(1001)]
    one_pass = min(_timed(lambda: [s for s in clocks.samples if s.sm_mhz and not s.reasons]) for _ in range(3))
    per_step = []
    elapsed = _timed(lambda: per_step.extend(clocks.per_step_sm_mhz()))
    assert elapsed < 200 * one_pass, (elapsed, one_pass)
    assert len(per_step) == 1000 and set(per_step) == {1980.0}


def _timed(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


@pytest.mark.slow  # a fake nvidia-smi whose child process writes for 2 s
def test_a_reader_still_draining_the_pipe_is_left_be_not_read_from_a_closed_file(tmp_path, monkeypatch):
    """An nvidia-smi whose child keeps writing to the pipe after it is stopped: leaving the block
    waits for the reader as long as `READER_JOIN_S` and then leaves it be; it reads to the end and
    closes the pipe itself (closing it under the reader raised ValueError in its thread)."""
    holds = tmp_path / "nvidia-smi"
    holds.write_text(f"#!{sys.executable}\nimport datetime, subprocess, sys, time\n"
                     "line = lambda: datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3] + ', 0, 1980, 700, 60, 0x0'\n"
                     "if not any(a.startswith('--loop-ms') for a in sys.argv):\n    print(line()); sys.exit()\n"
                     "child = 'import time\\nfor _ in range(40): print(%r, flush=True); time.sleep(0.05)' % line()\n"
                     "subprocess.Popen([sys.executable, '-c', child])\n"
                     "time.sleep(60)\n")
    holds.chmod(holds.stat().st_mode | stat.S_IXUSR)
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    monkeypatch.setattr(gpu_clocks, "READER_JOIN_S", 0.05)
    with GpuClockSampler(["0"], command=str(holds)) as clocks:
        deadline = time.monotonic() + 10
        while not clocks.samples and time.monotonic() < deadline:
            time.sleep(0.01)
    assert clocks._reader.is_alive()  # the child still writes
    clocks._reader.join(timeout=10)
    assert not clocks._reader.is_alive() and raised == [] and clocks._process.stdout.closed
    assert len(clocks.samples) == 40


@pytest.mark.slow  # a training run
def test_bench_train_rows_carry_their_steps_clocks(tmp_path, monkeypatch):
    """Each row of `bench train` (here the tiny CPU config, with the fake sampler standing in for the
    GPU's) holds its timed steps' clock summary and one clock per step, and the table shows the
    median SM clock."""
    from disagmoe.bench import train as bench

    command = fake_nvidia_smi(tmp_path)

    class SlowSteps(GpuClockSampler):  # steps longer than the interval: each gets samples
        def mark(self, step=None, attempt=0):
            if step:
                time.sleep(0.05)
            else:  # the start: once the fake nvidia-smi samples (a loaded machine starts it late)
                deadline = time.monotonic() + 30
                while not self.samples and time.monotonic() < deadline:
                    time.sleep(0.01)
            return super().mark(step, attempt)

    monkeypatch.setattr(bench, "clock_sampler",
                        lambda cfg, sample=True: SlowSteps(["0"], interval_ms=5, command=command) if sample else None)
    out = tmp_path / "run.json"
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps",
                                 "3", "--warmup", "1", "-o", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["modes"]
    assert row["gpu_clocks"]["samples"] > 0 and row["gpu_clocks"]["sm_mhz_max"] == 1980
    assert len(row["step_sm_mhz"]) == 3 and row["gpu_clocks_note"] is None
    assert row["step_sm_mhz"][0] is not None  # the first step's window: from the start mark
    assert "SM clock" in r.output and " MHz" in r.output and "single: SM 1," in r.output
    # --no-gpu-clocks: the same row timed without nvidia-smi beside it, and the row says so
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps",
                                 "2", "--warmup", "1", "--no-gpu-clocks", "-o", str(out)])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(out.read_text())["modes"]
    assert row["gpu_clocks"] is None and row["gpu_clocks_note"] == "not sampled (bench train --no-gpu-clocks)"


@pytest.mark.slow  # a training run
def test_the_table_marks_a_partial_clock_summary(monkeypatch):
    """A row whose timed steps nvidia-smi sampled in part (it stopped early): the table's SM clock
    says partial, and the log line says how much was sampled and why."""
    from disagmoe.bench import train as bench

    stopped = marked(sampled((0.0, 1.0, 0, 1980, 0)), (0, 0.0, 0), (1, 5.0, 0), (2, 10.0, 0))
    note = "nvidia-smi stopped sampling early (exit 1)"
    fields = {"gpu_clocks": stopped.timed_summary(0), "step_sm_mhz": stopped.per_step_sm_mhz(), "gpu_clocks_note": note}
    monkeypatch.setattr(bench, "clock_fields", lambda clocks, warmup, sampled=True: fields)
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps",
                                 "2", "--warmup", "0"])
    assert r.exit_code == 0, r.output
    assert " 1,980 MHz " in r.output and " (partial) " in r.output  # the SM clock's cell (wrapped in two lines)
    assert describe(fields["gpu_clocks"], note).endswith(f"; partial: 12% of the window sampled; {note}")


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
