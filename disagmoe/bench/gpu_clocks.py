"""The GPUs' SM clock, power draw, temperature and clock-event reasons while a benchmark trains, sampled
by `nvidia-smi` in the background, so that every timed row says at what clocks it ran.

A step time is only as comparable as the clocks it ran at: under sustained load an H200 may hold its
SM clock below the boost clock to stay within its power limit, and a profile whose steps are spaced
out by the profiler's own host work may run at higher clocks than back-to-back training steps. The
benchmark rows therefore carry the clocks of their timed steps (`bench train`'s rows, the baseline's).

    with GpuClockSampler.for_devices([0]) as clocks:       # nvidia-smi -lms in a reader thread
        clocks.mark(0)                                      # immediately before the first step
        ... train, calling clocks.mark(step) at the end of each step ...
    summary = clocks.timed_summary(warmup)                  # the steps after the first `warmup`
    per_step = clocks.per_step_sm_mhz()                     # one median per step

Without nvidia-smi (a CPU host), or where it refuses the query, the sampler records nothing and says
why (`unavailable`); nothing else changes. The reasons are nvidia-smi's `clocks_event_reasons.active`
bits (`clocks_throttle_reasons.active` on drivers before the rename). Each sample is placed in time by
nvidia-smi's own timestamp (so a buffered pipe cannot shift it into the next step). A mark names
its step and the run's restarts so far, so that a restarted run's re-run steps replace their first
tries and no window spans a restart (`GpuClockSampler.mark`).

What a summary's figures mean: the SM clock, power and temperature are those of the GPUs that worked
in its window, while they worked: a GPU idle throughout (e.g. one a smaller distributed run left
unused) is left out, and so are a working GPU's samples with the gpu_idle reason (the compile, the
host's gaps between kernels), which would pull its median towards the idle clock; the reasons' shares
count every sample of the working GPUs, so gpu_idle's share says how much of the window they idled.
A summary names the GPUs it covers, and says how much of its window was sampled: where nvidia-smi
started late or stopped early (`unavailable` says so), the figures are of the part sampled, and the
summary is marked partial. GPUs of other hosts are not sampled.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

DEFAULT_INTERVAL_MS = 100
# nvidia-smi's clock-event reason bits (nvmlClocksEventReasons), in its own names
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
_REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer drivers first
_FIELDS = ("timestamp", "index", "clocks.sm", "power.draw", "temperature.gpu")
IDLE = 0x1  # the gpu_idle reason bit
FULLY_SAMPLED = 0.9  # a summary of less of its window than this is marked partial
FIRST_SAMPLE_TIMEOUT_S = 5.0  # how long `wait_for_sample` waits for nvidia-smi's first line
READER_JOIN_S = 5.0  # how long leaving the block waits for the reader thread to drain the pipe


@dataclass(frozen=True)
class ClockSample:
    at_s: float  # time.monotonic() when nvidia-smi took it (its timestamp), else when the line was read
    gpu: int  # nvidia-smi's index of the GPU
    sm_mhz: float
    power_w: float | None  # None where the board does not report it ("[N/A]")
    temperature_c: float | None
    reasons: int  # clock-event reason bits (`REASONS`)


@dataclass(frozen=True)
class Mark:
    step: int  # the step that ended (0: the start, immediately before the first step)
    at_s: float  # time.monotonic()
    attempt: int  # the run's restarts so far (`GpuClockSampler.mark`)


def reason_names(bits: int) -> list[str]:
    """The names of the clock-event reason bits set in `bits` (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if bits & bit]
    rest = bits & ~sum(REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def parse_line(line: str, read_at_s: float, wall_minus_monotonic_s: float | None = None) -> ClockSample | None:
    """One CSV line of the query (`_FIELDS` then the reasons, no header, no units); None for a line
    that is not one (a blank line, a message). The sample's time: its timestamp (local wall time, to
    the millisecond) on the monotonic clock, given the offset between the two clocks; else `read_at_s`.
    Reasons a board does not report ("[N/A]") read as none."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(_FIELDS) + 1:
        return None
    try:
        gpu, sm_mhz = int(parts[1]), float(parts[2])
    except ValueError:
        return None
    try:
        reasons = int(parts[5], 16) if parts[5].lower().startswith("0x") else int(parts[5])
    except ValueError:
        reasons = 0
    at_s = read_at_s
    if wall_minus_monotonic_s is not None:
        try:
            at_s = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp() - wall_minus_monotonic_s
        except ValueError:
            pass
    return ClockSample(at_s, gpu, sm_mhz, _number(parts[3]), _number(parts[4]), reasons)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


@dataclass
class GpuClockSampler:
    """`nvidia-smi --query-gpu=... --loop-ms=interval_ms --id=gpus` read line by line in a daemon thread
    while the block runs (module docstring). `gpus`: nvidia-smi ids (indices or UUIDs); `command`
    the executable (tests pass a fake)."""

    gpus: Sequence[str]
    interval_ms: int = DEFAULT_INTERVAL_MS
    command: str = "nvidia-smi"
    samples: list[ClockSample] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)  # every `mark`, in the order taken
    unavailable: str | None = None  # why nothing (or not all) was sampled
    _offset_s: float = field(default=0.0, init=False, repr=False)  # time.time() - time.monotonic()
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _reader: threading.Thread | None = field(default=None, init=False, repr=False)

    @classmethod
    def for_devices(cls, devices: Sequence[int], interval_ms: int = DEFAULT_INTERVAL_MS,
                    command: str = "nvidia-smi") -> GpuClockSampler:
        """A sampler of these CUDA devices (torch's ordinals, named to nvidia-smi by UUID, so that
        CUDA_VISIBLE_DEVICES' renumbering does not matter)."""
        import torch

        ids = []
        for device in devices:
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            ids.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        return cls(ids, interval_ms, command)

    def __enter__(self) -> GpuClockSampler:
        executable = shutil.which(self.command)
        if executable is None:
            self.unavailable = f"{self.command} not found"
            return self
        query = self._query(executable)
        if query is None:
            return self
        self._offset_s = time.time() - time.monotonic()
        self._process = subprocess.Popen(
            [executable, f"--query-gpu={query}", "--format=csv,noheader,nounits", f"--loop-ms={self.interval_ms}",
             f"--id={','.join(self.gpus)}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, args=(self._process,), daemon=True)
        self._reader.start()
        return self

    def wait_for_sample(self, timeout_s: float = FIRST_SAMPLE_TIMEOUT_S) -> bool:
        """Wait until nvidia-smi's first sample has been read (it takes a moment to start), so that a timing
        begun after this is sampled from its start; False where it is not sampling or none came in `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._process is not None and not self.samples and time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            time.sleep(0.005)
        return bool(self.samples)

    def _query(self, executable: str) -> str | None:
        """The query fields this nvidia-smi takes (the reasons under their current name, else the old
        one), checked by one sample; None with `unavailable` set where neither is taken."""
        error = ""
        for reasons in _REASON_FIELDS:
            query = ",".join((*_FIELDS, reasons))
            try:
                done = subprocess.run([executable, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                       f"--id={','.join(self.gpus)}"], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as err:
                self.unavailable = f"{self.command} failed: {err}"
                return None
            if done.returncode == 0 and parse_line(done.stdout.splitlines()[0] if done.stdout else "", 0.0):
                return query
            error = (done.stdout + done.stderr).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            error = error[0]
        self.unavailable = f"{self.command} refused the clock query: {error}"
        return None

    def _read(self, process: subprocess.Popen) -> None:
        """Read the samples until the pipe ends, then close it: the reader owns the pipe, so that a
        reader still draining it when the block is left (a child of nvidia-smi holding it open) is
        never read from a closed file."""
        with process.stdout as lines:
            for line in lines:
                sample = parse_line(line, time.monotonic(), self._offset_s)
                if sample is not None:
                    self.samples.append(sample)

    def mark(self, step: int | None = None, attempt: int = 0) -> float:
        """Note the end of step `step` (default: the step after the last noted, the first being 1), or
        with step 0 the start: immediately before the first step, after the set-up (building, loading),
        so that the first step's window (and a summary of every step, warmup 0) starts there. Returns
        the time noted.

        `attempt`: the run's restarts so far (`DistributedTrainer.restarts`). A mark of a new attempt,
        or of a step not after the last noted, is a restart: the steps it re-runs keep only their new
        windows (as the run's metrics keep only their new records), and its first step, whose start
        fell in the restart (the failed attempt's end, the downtime, the new actors), has no window."""
        now = time.monotonic()
        if step is None:
            step = self.marks[-1].step + 1 if self.marks else 1
        self.marks.append(Mark(step, now, attempt))
        return now

    def __exit__(self, *exc: object) -> None:
        process = self._process
        if process is None:
            return
        ended = process.poll()
        if ended is not None:  # it stopped by itself: the samples end there
            self.unavailable = f"{self.command} stopped sampling early (exit {ended})"
        else:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._reader is not None:  # still reading after this (the pipe held open): a daemon, left be
            self._reader.join(timeout=READER_JOIN_S)

    def step_windows(self) -> dict[int, tuple[float | None, float]]:
        """Each step's window, by step number in step order: (start, end) on time.monotonic(), from
        the mark before it (the previous step's end, or the start mark) to its own. Where a restart
        re-ran steps (`mark`), their last run's; the start is None where none was marked: a first step
        without the start mark, and the first step after a restart."""
        windows: dict[int, tuple[float | None, float]] = {}
        previous: Mark | None = None
        for mark in self.marks:
            start = None if previous is None else previous.at_s
            if previous is not None and (mark.attempt != previous.attempt or mark.step <= previous.step):
                windows = {step: window for step, window in windows.items() if step < mark.step}
                start = None
            if mark.step > 0:
                windows[mark.step] = (start, mark.at_s)
            previous = mark
        return dict(sorted(windows.items()))

    def window(self, start_s: float, end_s: float) -> list[ClockSample]:
        """The samples taken between the two instants (after the first, up to the second), in time order."""
        times, ordered = self._ordered()
        return ordered[bisect_right(times, start_s):bisect_right(times, end_s)]

    def _ordered(self) -> tuple[list[float], list[ClockSample]]:
        """(times, samples) in time order: sorted once, so that a window is two bisections."""
        ordered = sorted(self.samples, key=lambda s: s.at_s)
        return [s.at_s for s in ordered], ordered

    def summary(self, windows: Sequence[tuple[float, float]]) -> dict | None:
        """The clocks in these windows ((start, end) `time.monotonic()` instants), as the module
        docstring says what they mean: SM clock median / min / max (MHz), power median / max (W),
        hottest temperature (C), the share of samples each clock-event reason was active in, the GPUs
        covered (`gpus`, nvidia-smi's indices; `idle_gpus` those left out), the samples counted and
        the gpu_idle ones left out of the figures (`idle_samples`), and how much of the windows was
        sampled (`window_s`, `sampled_s`, their ratio `coverage`; `partial` below `FULLY_SAMPLED`).
        None without samples there (say why with `unavailable`)."""
        times, ordered = self._ordered()
        spans = _merged(windows)
        sampled_s = 0.0
        taken: list[ClockSample] = []
        for start, end in spans:
            inside = ordered[bisect_right(times, start):bisect_right(times, end)]
            sampled_s += _sampled_s(start, end, inside, self.interval_ms / 1e3)
            taken += inside
        if not taken:
            return None
        counted, busy = _working(taken)
        sm = [s.sm_mhz for s in busy]
        power = [s.power_w for s in busy if s.power_w is not None]
        temperature = [s.temperature_c for s in busy if s.temperature_c is not None]
        reasons: dict[str, int] = {}
        for s in counted:
            for name in reason_names(s.reasons):
                reasons[name] = reasons.get(name, 0) + 1
        gpus = sorted({s.gpu for s in counted})
        window_s = sum(end - start for start, end in spans)
        coverage = sampled_s / window_s if window_s > 0 else 1.0
        return {"samples": len(counted), "idle_samples": len(counted) - len(busy), "gpus": gpus,
                "gpu_count": len(gpus), "idle_gpus": sorted({s.gpu for s in taken} - set(gpus)),
                "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm), "sm_mhz_max": max(sm),
                "power_w_median": statistics.median(power) if power else None,
                "power_w_max": max(power) if power else None, "temperature_c_max": max(temperature) if temperature else None,
                "reasons": {name: n / len(counted) for name, n in sorted(reasons.items(), key=lambda kv: -kv[1])},
                "window_s": window_s, "sampled_s": sampled_s, "coverage": coverage, "partial": coverage < FULLY_SAMPLED}

    def timed_summary(self, warmup: int) -> dict | None:
        """`summary` of the steps after the first `warmup` (their windows, `step_windows`), with the
        timed steps it covers (`steps`) and those it leaves out for want of a marked start
        (`steps_left_out`: the first step after a restart; the first step, without the start mark).
        None where no step is timed or none was sampled."""
        timed = [window for step, window in self.step_windows().items() if step > warmup]
        covered = [(start, end) for start, end in timed if start is not None]
        summary = self.summary(covered) if covered else None
        if summary is None:
            return None
        return {**summary, "steps": len(covered), "steps_left_out": len(timed) - len(covered)}

    def timed_note(self, warmup: int) -> str | None:
        """Why the timed steps have no clock figures (`timed_summary` None), or what limits them:
        `unavailable` where sampling failed or stopped early; else, where no sample fell in the
        timed steps, how long they ran against the sampling interval (steps of a few milliseconds:
        time more of them); None where they were sampled and nothing went wrong."""
        if self.unavailable or self.timed_summary(warmup) is not None:
            return self.unavailable
        timed = [(start, end) for step, (start, end) in self.step_windows().items()
                 if step > warmup and start is not None]
        if not timed:
            return "no timed step has a marked start and end"
        span_ms = sum(end - start for start, end in timed) * 1e3
        steps = f"{len(timed)} timed step{'s' if len(timed) > 1 else ''}"
        return (f"no sample fell in the {steps} ({span_ms:,.1f} ms in all, one sample every {self.interval_ms} ms); "
                "time more or longer steps")

    def per_step_sm_mhz(self) -> list[float | None]:
        """Median SM clock over each step's window (`step_windows`, in step order: one entry per step,
        a step re-run after a restart its last run's), of the working GPUs while they worked (as
        `summary`); None for a step without a window or without a sample (shorter than the interval)."""
        times, ordered = self._ordered()
        out: list[float | None] = []
        for start, end in self.step_windows().values():
            busy = [] if start is None else _working(ordered[bisect_right(times, start):bisect_right(times, end)])[1]
            out.append(statistics.median(s.sm_mhz for s in busy) if busy else None)
        return out


def _working(samples: list[ClockSample]) -> tuple[list[ClockSample], list[ClockSample]]:
    """(the samples of the GPUs that worked: any sample without the gpu_idle reason; those of them
    without it). Where every GPU idled throughout: every sample, both times."""
    working = {s.gpu for s in samples if not s.reasons & IDLE}
    if not working:
        return samples, samples
    counted = [s for s in samples if s.gpu in working]
    return counted, [s for s in counted if not s.reasons & IDLE]


def _merged(windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The windows in time order, those that touch or overlap (consecutive steps) joined into one."""
    spans: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def _sampled_s(start: float, end: float, inside: list[ClockSample], interval_s: float) -> float:
    """How much of the window its samples cover: from its first sample to its last, each standing for
    up to two intervals on its outer side (nvidia-smi's period is the interval plus the query's own
    time). A window sampled from beginning to end counts in full; one whose samples begin late
    (nvidia-smi starting) or end early (it stopped) counts what they span."""
    if not inside:
        return 0.0
    slack_s = 2 * interval_s
    return max(0.0, min(end, inside[-1].at_s + slack_s) - max(start, inside[0].at_s - slack_s))


def describe(summary: dict | None, unavailable: str | None = None) -> str:
    """One line for a log: 'SM 1,755-1,980 MHz (median 1,830), power 652 W (max 700), 61 C, GPUs 0, 1;
    clock events: sw_power_cap 62%', then where so, that the summary is partial, the timed steps it
    leaves out, and why not everything was sampled (`unavailable`: an early exit); or why there is none."""
    if summary is None:
        return f"GPU clocks not sampled ({unavailable or 'no sample in the timed steps'})"
    gpus = summary.get("gpus")
    text = (f"SM {summary['sm_mhz_min']:,.0f}-{summary['sm_mhz_max']:,.0f} MHz (median {summary['sm_mhz_median']:,.0f})"
            + (f", power {summary['power_w_median']:,.0f} W (max {summary['power_w_max']:,.0f})"
               if summary.get("power_w_median") is not None else "")
            + (f", {summary['temperature_c_max']:.0f} C" if summary.get("temperature_c_max") is not None else "")
            + (f", GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}" if gpus else "")
            + (f" (idle, left out: {', '.join(map(str, summary['idle_gpus']))})" if summary.get("idle_gpus") else ""))
    events = ", ".join(f"{name} {share:.0%}" for name, share in summary["reasons"].items())
    notes = [f"clock events: {events or 'none'}"]
    if summary.get("partial"):
        notes.append(f"partial: {summary['coverage']:.0%} of the window sampled")
    if summary.get("steps_left_out"):
        left_out = summary["steps_left_out"]
        notes.append(f"{left_out} timed step{'s' if left_out > 1 else ''} left out (start not marked: the first "
                     "after a restart, or a first step without the start mark)")
    if unavailable:
        notes.append(unavailable)
    return "; ".join([text, *notes])
