"""The quick subset (`pytest -m "not slow"`): the README names it beside the full command, and
every test that starts processes (a Ray cluster, a distributed trainer, a subprocess run) is
marked `slow` (read from the test files' AST). tests/conftest.py names, after a run, any test
past 5 s without the marker."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"
STARTS = ("DistributedTrainer(", "WorkerGroup.start(", "subprocess.Popen(", "Cluster(", "ray.init(")
# refused before any actor starts: never reaches Ray; a lock held by a bare Python process, refused before Ray
QUICK_ANYWAY = {("runtime/test_plan_layout.py", "test_plans_the_runtime_cannot_run_are_refused_before_any_actor"),
                ("cli/test_train_reliability.py", "test_a_second_run_on_a_busy_out_dir_is_refused_in_one_line")}


def test_the_readme_names_the_quick_subset_beside_the_full_command():
    text = README.read_text()
    setup = text.split("## Set-up", 1)[1].split("## Quickstart", 1)[0]
    assert ". .venv/bin/activate && python -m pytest -q -n auto\n" in setup  # the full suite, as CI runs it
    assert 'python -m pytest -q -n auto -m "not slow"' in setup


def _marked_slow(node: ast.FunctionDef) -> bool:
    return any("slow" in ast.unparse(d) for d in node.decorator_list)


def test_tests_that_start_processes_are_marked_slow():
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
                          and "slow" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            body = "\n".join(lines[node.lineno - 1:node.end_lineno])  # get_source_segment rescans the file per call
            where = (str(path.relative_to(TESTS)), node.name)
            if any(s in body for s in STARTS) and not (module_slow or _marked_slow(node)) and where not in QUICK_ANYWAY:
                unmarked.append("::".join(where))
    assert unmarked == [], "mark these @pytest.mark.slow (they start processes)"


def _seconds(text: str) -> float:
    number, unit = text.split()[:2]
    return float(number) * (60 if unit.startswith("minute") else 1)


def test_the_readme_states_the_times_docs_benchmarks_recorded_on_a_fresh_clone():
    """README's install, main-job, suite and quick-subset times against the fresh-clone table of
    docs/benchmarks.md (issue 24's section): each within 0.6x-1.5x of what was measured."""
    import re

    readme = README.read_text()
    stated = {
        "install": re.search(r"install about (\d+ s)", readme).group(1),
        "main job": re.search(r"the run about (\d+ s)", readme).group(1),
        "full suite": re.search(r"about ([\d.]+ minutes) on 2 cores\)", readme).group(1),
        "quick subset": re.search(r"quick subset \(about ([\d.]+ minutes)", readme).group(1),
    }
    doc = (README.parent / "docs" / "benchmarks.md").read_text().split("## A new user's first hour on CPU", 1)[1]
    for step, text in stated.items():
        row = next(line for line in doc.splitlines() if line.startswith(f"| {step} |"))
        measured = float(re.search(r"\| ([\d.]+) s\b", row).group(1))
        assert 0.6 * measured <= _seconds(text) <= 1.5 * measured, (step, text, measured)
