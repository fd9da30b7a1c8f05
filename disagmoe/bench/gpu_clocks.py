"""The GPUs' SM clock, power draw, temperature and clock-event reasons while a benchmark trains, sampled
by `nvidia-smi` in the background, so that every timed row says at what clocks it ran.

A step time is only as comparable as the clocks it ran at: under sustained load an H200 may hold its
SM clock below the boost clock to stay within its power limit, and a profile whose steps are spaced
out by the profiler's own host work may run at higher clocks than back-to-back training steps. The
benchmark rows therefore carry the clocks of their timed steps (`bench train`'s rows, the baseline's).

    with GpuClockSampler.for_devices([0]) as clocks:       # nvidia-smi -lms in a reader thread
        ... train, calling clocks.mark() at the end of each step ...
    summary = clocks.summary(clocks.marks[warmup - 1], clocks.marks[-1])
    per_step = clocks.per_step_sm_mhz()                    # one median per step window

Without nvidia-smi (a CPU host), or where it refuses the query, the sampler records nothing and says
why (`unavailable`); nothing else changes. The reasons are nvidia-smi's `clocks_event_reasons.active`
bits (`clocks_throttle_reasons.active` on drivers before the rename). Each sample is placed in time by
nvidia-smi's own timestamp (so a buffered pipe cannot shift it into the next step). A summary counts
only the GPUs that worked in its window (a GPU idle throughout, e.g. one a smaller distributed run left
unused, would pull the median down); GPUs of other hosts are not sampled.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
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


@dataclass(frozen=True)
class ClockSample:
    at_s: float  # time.monotonic() when nvidia-smi took it (its timestamp), else when the line was read
    gpu: int  # nvidia-smi's index of the GPU
    sm_mhz: float
    power_w: float | None  # None where the board does not report it ("[N/A]")
    temperature_c: float | None
    reasons: int  # clock-event reason bits (`REASONS`)


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
    marks: list[float] = field(default_factory=list)  # time.monotonic() at each `mark`
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
        for line in process.stdout:
            sample = parse_line(line, time.monotonic(), self._offset_s)
            if sample is not None:
                self.samples.append(sample)

    def mark(self) -> float:
        """Note the end of a step (`per_step_sm_mhz` windows); returns the time noted."""
        now = time.monotonic()
        self.marks.append(now)
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
        if self._reader is not None:
            self._reader.join(timeout=5)
        process.stdout.close()

    def window(self, start_s: float, end_s: float) -> list[ClockSample]:
        """The samples taken between the two instants, of the GPUs that worked then (any sample
        without the gpu_idle reason; all of them where every GPU idled)."""
        samples = [s for s in self.samples if start_s < s.at_s <= end_s]
        working = {s.gpu for s in samples if not s.reasons & IDLE}
        return [s for s in samples if s.gpu in working] if working else samples

    def summary(self, start_s: float, end_s: float) -> dict | None:
        """The clocks between two `time.monotonic()` instants, over every sampled GPU: SM clock
        median / min / max (MHz), power median / max (W), hottest temperature (C), and the share of
        samples each clock-event reason was active in. None without samples there (say why with
        `unavailable`)."""
        samples = self.window(start_s, end_s)
        if not samples:
            return None
        sm = [s.sm_mhz for s in samples]
        power = [s.power_w for s in samples if s.power_w is not None]
        temperature = [s.temperature_c for s in samples if s.temperature_c is not None]
        reasons: dict[str, float] = {}
        for s in samples:
            for name in reason_names(s.reasons):
                reasons[name] = reasons.get(name, 0.0) + 1 / len(samples)
        return {"samples": len(samples), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
                "sm_mhz_max": max(sm), "power_w_median": statistics.median(power) if power else None,
                "power_w_max": max(power) if power else None, "temperature_c_max": max(temperature) if temperature else None,
                "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]))}

    def timed_summary(self, warmup: int) -> dict | None:
        """`summary` of the steps after the first `warmup` (from the `warmup`-th mark to the last)."""
        if len(self.marks) <= warmup:
            return None
        start = self.marks[warmup - 1] if warmup else self._first_sample_time()
        return self.summary(start, self.marks[-1])

    def _first_sample_time(self) -> float:
        return self.samples[0].at_s - 1e-9 if self.samples else 0.0

    def per_step_sm_mhz(self) -> list[float | None]:
        """Median SM clock over each step's window (from the previous mark; the first step from the
        first sample, so it holds the run's set-up too), None for a step no sample fell in (shorter
        than the interval). One entry per mark: a run that repeats steps (a distributed run restarted
        from its checkpoint) has more marks than steps."""
        out: list[float | None] = []
        start = self._first_sample_time()
        for end in self.marks:
            sm = [s.sm_mhz for s in self.window(start, end)]
            out.append(statistics.median(sm) if sm else None)
            start = end
        return out


def describe(summary: dict | None, unavailable: str | None = None) -> str:
    """One line for a log: 'SM 1,755-1,980 MHz (median 1,830), power 652 W (max 700), 61 C; clock
    events: sw_power_cap 62%', or why there is none."""
    if summary is None:
        return f"GPU clocks not sampled ({unavailable or 'no sample in the timed steps'})"
    text = (f"SM {summary['sm_mhz_min']:,.0f}-{summary['sm_mhz_max']:,.0f} MHz (median {summary['sm_mhz_median']:,.0f})"
            + (f", power {summary['power_w_median']:,.0f} W (max {summary['power_w_max']:,.0f})"
               if summary.get("power_w_median") is not None else "")
            + (f", {summary['temperature_c_max']:.0f} C" if summary.get("temperature_c_max") is not None else ""))
    events = ", ".join(f"{name} {share:.0%}" for name, share in summary["reasons"].items())
    return text + f"; clock events: {events or 'none'}"
