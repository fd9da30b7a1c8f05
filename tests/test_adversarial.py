"""Bad inputs, as a careless or a hostile user gives them, to every command (issue 23).

Each case is one invocation of `plan`, `roofline`, `train`, `config` or `bench` that must end with
exit code 2, exactly one `error:` line on stderr naming what is wrong, no traceback, within 15 s
and memory measured, not imposed: in-process (typer's CliRunner, so the suite takes seconds)
the case may add under 1 GiB to the process's resident memory (its high-water mark, reset
before the case through /proc/self/clear_refs, minus the resident memory then); the
unbounded-read cases run again in fresh processes (`test_an_unbounded_read_in_a_fresh_process`),
whose whole peak (VmHWM, read at exit) must stay under 1 GiB. They are grouped by the issue's
classes: 1 busy out_dir, 2 unbounded reads, 3 waits, 4 value types, 5 numbers that overflow,
6 sizes, 8 late or miscoded input errors (class 7, deletion, is not an input error: see
tests/runtime/test_out_dir.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagmoe.cli.app import app
from disagmoe.model_ref import load_model

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs/tiny-cpu.yaml")
FAST = ["steps=3", "batch_size=4", "seq_len=32", "eval_every=0", "mode=single"]
PLAN = ["--hardware", "h200-sxm", "--gpus", "4", "--seq-len", "128", "--global-batch-tokens", "4096"]
GIB = 1 << 30
TINY = load_model("tiny")
MIXTRAL_HF = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
                  rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=4096)


class Files:
    """Bad files made on demand in a case's own folder (`root`); `out` names a path of the
    module's shared folder (the busy out_dir and its kin, made by the `files` fixture)."""

    def __init__(self, root: Path, shared: Path | None = None) -> None:
        self.root = root
        self.shared = root if shared is None else shared

    def case(self, name: str) -> "Files":
        """The Files of one case: a new folder of its own."""
        (self.shared / "cases" / name).mkdir(parents=True)
        return Files(self.shared / "cases" / name, self.shared)

    def text(self, name: str, text: str) -> str:
        path = self.root / name
        path.write_text(text)
        return str(path)

    def fifo(self, name: str) -> str:
        path = self.root / name
        os.mkfifo(path)
        return str(path)

    def sparse(self, name: str, size: int) -> str:
        path = self.root / name
        with path.open("wb") as f:
            f.truncate(size)
        return str(path)

    def folder(self, name: str) -> str:
        path = self.root / name
        path.mkdir()
        return str(path)

    def hf(self, name: str, **changes: object) -> str:
        path = self.root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**MIXTRAL_HF, **changes}))
        return str(path / "config.json")

    def histogram(self, name: str, load: object) -> str:
        return self.text(name, json.dumps({"step": 1, "expert_load": load}) + "\n")

    def trace(self, name: str, events: object) -> str:
        return self.text(name, json.dumps({"traceEvents": events}))

    def span(self, **changes: object) -> dict:
        return {"ph": "X", "pid": 0, "tid": 0, "name": "OptimizerStep", "cat": "compute", "ts": 0, "dur": 1, **changes}

    def out(self, name: str) -> str:
        return str(self.shared / name)

    def run(self) -> str:
        return str(self.root / "run")


def train(f: Files, *extra: str) -> list[str]:
    return ["train", "--config", CONFIG, "--out-dir", f.run(), *FAST, *extra]


def train_dist(f: Files, *extra: str) -> list[str]:
    return ["train", "--config", CONFIG, "--out-dir", f.run(), "steps=2", *extra]


def plan_hist(path: str) -> list[str]:
    return ["plan", "--model", "tiny", *PLAN, "--load-histogram", path]


def compare(path: str) -> list[str]:
    return ["roofline", "--compare", path, "--config", CONFIG, "--hardware", "h200-sxm"]


def deep_yaml(depth: int) -> str:
    return "model: tiny\ndata: " + "[" * depth + "]" * depth + "\n"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Case = tuple[str, Callable[[Files], list[str]]]
ROW = [1] * TINY.num_experts

CASES: dict[str, list[Case]] = {
    "busy": [  # the `busy` fixture holds f.out("busy"); "elsewhere" and "live" hold lock files only
        ("train-busy", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy"), *FAST]),
        ("train-busy-slash", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy") + "/", *FAST]),
        ("train-busy-dot", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy") + "/.", *FAST]),
        ("train-busy-override", lambda f: ["train", "--config", CONFIG, *FAST, f"out_dir={f.out('busy')}"]),
        ("train-busy-symlink", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy-link"), *FAST]),
        ("train-busy-resume", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy"), *FAST,
                                         "resume=true"]),
        ("train-busy-disaggregated", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy"), "steps=2"]),
        ("train-busy-plan", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("busy"), "--plan",
                                       f.out("plan.yaml"), "steps=2"]),
        ("train-lock-of-another-host", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("elsewhere"),
                                                  *FAST]),
        ("train-lock-of-a-live-pid", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("live"), *FAST]),
    ],
    "reads": [
        ("config-fifo", lambda f: ["train", "--config", f.fifo("c.yaml"), *FAST]),
        ("config-dev-zero", lambda f: ["train", "--config", "/dev/zero", *FAST]),
        ("config-folder", lambda f: ["train", "--config", f.folder("c.yaml"), *FAST]),
        ("config-huge", lambda f: ["train", "--config", f.sparse("c.yaml", 17 << 20), *FAST]),
        ("config-deep-yaml", lambda f: ["train", "--config", f.text("c.yaml", deep_yaml(100_000)), *FAST]),
        ("config-deep-json", lambda f: ["train", "--config", f.text("c.json", "[" * 100_000 + "]" * 100_000)]),
        ("config-nested-past-the-cap", lambda f: ["config", "check", f.text("c.yaml", deep_yaml(100))]),
        ("config-check-fifo", lambda f: ["config", "check", f.fifo("c.yaml")]),
        ("override-deep", lambda f: train(f, "data=" + "[" * 50_000 + "]" * 50_000)),
        ("model-fifo", lambda f: ["plan", "--model", f.fifo("m.yaml"), *PLAN]),
        ("model-dev-zero", lambda f: ["plan", "--model", "/dev/zero", *PLAN]),
        ("model-deep-config-json", lambda f: ["plan", "--model", f.text("config.json", "[" * 100_000), *PLAN]),
        ("hardware-fifo", lambda f: ["plan", "--model", "tiny", "--hardware", f.fifo("h.yaml"), "--gpus", "4"]),
        ("plan-fifo", lambda f: train(f, "--plan", f.fifo("p.yaml"))),
        ("plan-huge", lambda f: train(f, "--plan", f.sparse("p.yaml", 65 << 20))),
        ("histogram-fifo", lambda f: plan_hist(f.fifo("m.jsonl"))),
        ("histogram-dev-zero", lambda f: plan_hist("/dev/zero")),
        ("histogram-huge", lambda f: plan_hist(f.sparse("m.jsonl", (1 << 30) + 1))),
        ("histogram-deep", lambda f: plan_hist(f.text("m.jsonl", "[" * 100_000 + "\n"))),
        ("trace-fifo", lambda f: compare(f.fifo("t.json"))),
        ("trace-dev-zero", lambda f: compare("/dev/zero")),
        ("bench-train-fifo", lambda f: ["bench", "train", "--config", f.fifo("c.yaml")]),
        ("bench-placement-dev-zero", lambda f: ["bench", "placement", "--config", "/dev/zero"]),
    ],
    "waits": [
        ("address-closed-port", lambda f: train_dist(f, f"ray_address=127.0.0.1:{closed_port()}")),
        ("address-closed-port-localhost", lambda f: train_dist(f, f"ray_address=localhost:{closed_port()}")),
        ("address-closed-port-short-bound", lambda f: train_dist(f, f"ray_address=127.0.0.1:{closed_port()}",
                                                                 "ray_connect_timeout_s=0.5")),
        ("address-no-port", lambda f: train_dist(f, "ray_address=127.0.0.1")),
        ("address-port-zero", lambda f: train_dist(f, "ray_address=127.0.0.1:0")),
        ("address-port-too-big", lambda f: train_dist(f, "ray_address=127.0.0.1:70000")),
        ("address-empty-host", lambda f: train_dist(f, "ray_address=:6379")),
        ("address-word", lambda f: train_dist(f, "ray_address=cluster")),
        ("address-space", lambda f: train_dist(f, "ray_address='a b:6379'")),
        ("connect-timeout-zero", lambda f: train_dist(f, "ray_connect_timeout_s=0")),
        ("connect-timeout-negative", lambda f: train_dist(f, "ray_connect_timeout_s=-1")),
        ("connect-timeout-huge", lambda f: train_dist(f, "ray_connect_timeout_s=1e9")),
        ("recv-timeout-zero", lambda f: train_dist(f, "recv_timeout_s=0")),
    ],
    "types": [
        ("hf-size-as-string", lambda f: ["plan", "--model", f.hf("a", hidden_size="64"), *PLAN]),
        ("hf-heads-null", lambda f: ["plan", "--model", f.hf("b", num_attention_heads=None), *PLAN]),
        ("hf-heads-zero", lambda f: ["plan", "--model", f.hf("c", num_attention_heads=0), *PLAN]),
        ("hf-rope-scaling-string", lambda f: ["plan", "--model", f.hf("d", rope_scaling="yarn"), *PLAN]),
        ("hf-rope-theta-string", lambda f: ["plan", "--model", f.hf("e", rope_theta="1e6"), *PLAN]),
        ("hf-tie-string", lambda f: ["plan", "--model", f.hf("g", tie_word_embeddings="yes"), *PLAN]),
        ("hf-experts-fraction", lambda f: ["plan", "--model", f.hf("h", num_local_experts=5.5), *PLAN]),
        ("hf-vocab-bool", lambda f: ["plan", "--model", f.hf("i", vocab_size=True), *PLAN]),
        ("hf-yarn-factor-string", lambda f: ["plan", "--model", f.hf("j", rope_scaling={"type": "yarn",
                                                                                         "factor": "x"}), *PLAN]),
        ("hf-model-type-list", lambda f: ["plan", "--model", f.hf("k", model_type=["mixtral"]), *PLAN]),
        ("hf-eps-nan", lambda f: ["roofline", "--model", f.text("nan.json", json.dumps(MIXTRAL_HF).replace(
            '"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN')), *PLAN]),
        ("histogram-load-string", lambda f: plan_hist(f.histogram("h1.jsonl", "x"))),
        ("histogram-rows-not-lists", lambda f: plan_hist(f.histogram("h2.jsonl", [1, 2]))),
        ("histogram-null-load", lambda f: plan_hist(f.histogram("h3.jsonl", [[None] * TINY.num_experts]
                                                                * TINY.num_moe_layers))),
        ("histogram-wrong-shape", lambda f: plan_hist(f.histogram("h4.jsonl", [[1]] * TINY.num_moe_layers))),
        ("histogram-negative", lambda f: plan_hist(f.histogram("h5.jsonl", [[-1] * TINY.num_experts]
                                                               * TINY.num_moe_layers))),
        ("histogram-string-load", lambda f: plan_hist(f.histogram("h6.jsonl", [["1"] * TINY.num_experts]
                                                                  * TINY.num_moe_layers))),
        ("histogram-not-json", lambda f: plan_hist(f.text("h7.jsonl", "{not json\n"))),
        ("trace-events-mapping", lambda f: compare(f.trace("t1.json", {"a": 1}))),
        ("trace-pid-string", lambda f: compare(f.trace("t2.json", [f.span(pid="0")]))),
        ("trace-ts-null", lambda f: compare(f.trace("t3.json", [f.span(ts=None)]))),
        ("trace-dur-string", lambda f: compare(f.trace("t4.json", [f.span(dur="1")]))),
        ("trace-name-empty", lambda f: compare(f.trace("t5.json", [f.span(name=" ")]))),
        ("trace-name-number", lambda f: compare(f.trace("t6.json", [f.span(name=5)]))),
        ("trace-no-cat", lambda f: compare(f.trace("t7.json", [{k: v for k, v in f.span().items() if k != "cat"}]))),
        ("trace-top-level-list", lambda f: compare(f.text("t8.json", "[]"))),
        ("trace-not-json", lambda f: compare(f.text("t9.json", "{"))),
    ],
    "numbers": [
        ("lr-1e308", lambda f: train(f, "optim.lr=1e308")),
        ("lr-11", lambda f: train(f, "optim.lr=11")),
        ("lr-nan", lambda f: train(f, "optim.lr=.nan")),
        ("lr-inf", lambda f: train(f, "optim.lr=.inf")),
        ("lr-negative", lambda f: train(f, "optim.lr=-1")),
        ("weight-decay-1e308", lambda f: train(f, "optim.weight_decay=1e308")),
        ("weight-decay-negative", lambda f: train(f, "optim.weight_decay=-0.1")),
        ("eps-1e308", lambda f: train(f, "optim.eps=1e308")),
        ("grad-clip-1e308", lambda f: train(f, "optim.grad_clip=1e308")),
        ("beta1-above-one", lambda f: train(f, "optim.beta1=1.5")),
        ("config-check-lr", lambda f: ["config", "check", f.text("lr.yaml", "model: tiny\noptim: {lr: 1.0e+308}\n")]),
    ],
    "sizes": [
        ("threads-million", lambda f: train(f, "cpu_threads=1000000")),
        ("threads-over-cores", lambda f: train(f, f"cpu_threads={8 * (os.cpu_count() or 1) + 1}")),
        ("batch-million", lambda f: train(f, "batch_size=1000000", "seq_len=4096")),
        ("seq-len-huge", lambda f: train(f, "seq_len=16000000", "batch_size=4")),
        ("batch-over-bound", lambda f: train(f, "batch_size=100000000")),
        ("steps-over-bound", lambda f: train(f, "steps=100000000000000000000")),
        ("huge-model", lambda f: train(f, "--config", f.text("big.yaml", "model:\n  name: big\n  vocab_size: 1000\n"
                                       "  hidden_size: 16000000\n  num_layers: 4\n  num_heads: 8\n  head_dim: 64\n"
                                       "  num_experts: 8\n  top_k: 2\n  expert_ffn_size: 1024\n"))[:1]
                                       + ["--config", str(f.root / "big.yaml"), *FAST]),
        ("plan-gpus-huge", lambda f: ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "1000000000"]),
        ("plan-seq-len-huge", lambda f: ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4",
                                         "--seq-len", "1000000000000"]),
        ("plan-batch-tokens-huge", lambda f: ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4",
                                              "--global-batch-tokens", "100000000000000000000"]),
        ("roofline-gpus-zero", lambda f: ["roofline", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "0"]),
    ],
    "late": [
        ("out-dir-empty", lambda f: ["train", "--config", CONFIG, *FAST, "out_dir=''"]),
        ("out-dir-name-too-long", lambda f: ["train", "--config", CONFIG, "--out-dir", f.run() + "x" * 300, *FAST]),
        ("out-dir-symlink-loop", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("loop-a/run"), *FAST]),
        ("out-dir-read-only", lambda f: ["train", "--config", CONFIG, "--out-dir", "/proc/disagmoe-run", *FAST]),
        ("out-dir-a-file", lambda f: ["train", "--config", CONFIG, "--out-dir", f.text("file", "x"), *FAST]),
        ("out-dir-under-a-file", lambda f: ["train", "--config", CONFIG, "--out-dir", f.text("f2", "x") + "/run",
                                            *FAST]),
        ("checkpoints-a-file", lambda f: ["train", "--config", CONFIG, "--out-dir", f.out("ckfile"), *FAST]),
        ("seed-negative", lambda f: train(f, "seed=-1")),
        ("seed-too-big", lambda f: train(f, f"seed={1 << 64}")),
        ("config-check-seed", lambda f: ["config", "check", f.text("seed.yaml", "model: tiny\nseed: -5\n")]),
        ("plan-out-read-only", lambda f: ["plan", "--model", "tiny", *PLAN, "--out", "/proc/disagmoe-plan.yaml"]),
        ("plan-out-folder", lambda f: ["plan", "--model", "tiny", *PLAN, "--out", f.folder("planned.yaml")]),
        ("plan-out-name-too-long", lambda f: ["plan", "--model", "tiny", *PLAN, "--out", f.run() + "p" * 300 + ".yaml"]),
        ("roofline-plot-read-only", lambda f: ["roofline", "--model", "tiny", *PLAN, "--plot",
                                               "/proc/disagmoe-roofline.png"]),
        ("bench-train-missing-config", lambda f: ["bench", "train", "--config", f.run() + "-missing.yaml"]),
        ("bench-train-bad-override", lambda f: ["bench", "train", "--config", CONFIG, "seed=-1"]),
    ],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The cases' folder, with a run holding `busy` (another process), and lock files of another
    host and of a live process in `elsewhere` and `live`."""
    root = tmp_path_factory.mktemp("adversarial")
    hold = "import sys, time\nfrom disagmoe.runtime.run_lock import acquire\nacquire(sys.argv[1]); " \
           "print('held', flush=True); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", hold, str(root / "busy")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    (root / "busy-link").symlink_to(root / "busy")
    for name, info in (("elsewhere", {"pid": 1, "host": "elsewhere.example", "pid_started": 1, "time": 0}),
                       ("live", {"pid": os.getppid(), "host": socket.gethostname(), "time": 0,
                                 "pid_started": int(Path(f"/proc/{os.getppid()}/stat").read_text()
                                                    .rpartition(")")[2].split()[19])})):
        (root / name).mkdir()
        (root / name / "run.lock").write_text(json.dumps(info))
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "ckfile").mkdir()
    (root / "ckfile" / "checkpoints").write_text("not a folder")
    (root / "plan.yaml").write_text("layout: single\n")
    try:
        yield Files(root)
    finally:
        proc.kill()
        proc.wait()


def status_bytes(key: str) -> int:
    """A memory figure of /proc/self/status (VmHWM: the resident high-water mark, VmRSS: now)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def peak_rss_reset() -> int:
    """Reset the high-water mark to the resident memory now; returns that."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


ALL = [(cls, name, argv) for cls, cases in CASES.items() for name, argv in cases]


HELPERS = {"train": "train", "train_dist": "train", "plan_hist": "plan", "compare": "roofline"}
COMMANDS = ("plan", "roofline", "train", "config", "bench")


def command_of(argv: Callable[[Files], list[str]]) -> str:
    """The command a case runs, read from its code (its first list item, or the helper it calls)."""
    code = argv.__code__
    named = [HELPERS[n] for n in code.co_names if n in HELPERS]
    consts = [x for c in code.co_consts for x in (c if isinstance(c, tuple) else (c,))]
    return named[0] if named else next(c for c in consts if c in COMMANDS)


def test_the_suite_covers_every_class_and_command_with_at_least_8_each_and_80_in_all():
    assert len(ALL) >= 80 and all(len(cases) >= 8 for cases in CASES.values())
    assert len({name for _, name, _ in ALL}) == len(ALL)
    commands = [command_of(argv) for _, _, argv in ALL]
    assert set(commands) == set(COMMANDS) and all(commands.count(c) >= 3 for c in COMMANDS)


@pytest.mark.parametrize("cls, name, argv", ALL, ids=[f"{cls}-{name}" for cls, name, _ in ALL])
def test_a_bad_input_is_one_line_and_exit_2(files, cls, name, argv):
    args = argv(files.case(f"{cls}-{name}"))
    before = peak_rss_reset()
    start = time.monotonic()
    result = CliRunner().invoke(app, args)
    elapsed = time.monotonic() - start
    assert not isinstance(result.exception, BaseException) or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    assert elapsed < 15, f"{elapsed:.1f} s"
    added = status_bytes("VmHWM") - before
    assert added < GIB, f"the case added {added / GIB:.2f} GiB of resident memory at its peak"


MEMORY_CASES = ["config-dev-zero", "config-huge", "config-deep-yaml", "model-dev-zero", "histogram-dev-zero",
                "histogram-huge", "trace-dev-zero", "override-deep"]


# Runs the CLI and writes its own peak resident memory (VmHWM of this process's image, so not the
# forking parent's) to $PEAK_FILE at exit.
MEASURED = textwrap.dedent("""
    import atexit, os, sys
    from pathlib import Path
    def peak():
        status = Path("/proc/self/status").read_text().splitlines()
        Path(os.environ["PEAK_FILE"]).write_text(next(x for x in status if x.startswith("VmHWM:")).split()[1])
    atexit.register(peak)
    sys.argv = ["disagmoe", *sys.argv[1:]]
    from disagmoe.cli.app import main
    main()
""")


@pytest.mark.slow
@pytest.mark.parametrize("name", MEMORY_CASES)
def test_an_unbounded_read_in_a_fresh_process(tmp_path, name):
    """The case in a process of its own: exit 2, one line, and its peak RSS under 1 GiB."""
    argv = next(argv for _, n, argv in ALL if n == name)
    args = argv(Files(tmp_path))
    peak_file = tmp_path / "peak"
    done = subprocess.run([sys.executable, "-c", MEASURED, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PEAK_FILE": str(peak_file)})
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: "), done.stderr
    peak = int(peak_file.read_text()) * 1024
    assert peak < GIB, f"peak RSS {peak / GIB:.2f} GiB"
