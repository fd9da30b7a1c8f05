"""The package's import structure, read from the AST of every module: no import cycle between
modules or between packages (imports inside functions count; only `if TYPE_CHECKING:` blocks are
exempt), and every import goes the way `MAY_IMPORT` allows (docs/architecture.md's layout map)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import disagmoe

PACKAGE = Path(disagmoe.__file__).parent
RUNTIME_SUBPACKAGES = ("schedule", "stages", "state", "observe", "training", "cluster")

# The layers below everything: the schema, the model references, the shared message names, data.
BASE = {"safe_io", "config", "hf_config", "model_ref", "wire", "data", "compact"}
# What each node (a top-level module, or a package: runtime's sub-packages are nodes of their own,
# runtime's top-level modules form the node "runtime") may import besides itself.
MAY_IMPORT: dict[str, set[str]] = {
    "safe_io": set(),
    "wire": set(),
    "compact": set(),
    "config": {"safe_io"},
    "hf_config": {"config", "safe_io"},
    "model_ref": {"config", "hf_config"},
    "data": {"config", "safe_io"},
    "roofline": {"config", "safe_io"},
    "kernels": {"config", "wire"},  # a leaf: config, torch, triton
    "comm": {"config", "wire", "kernels"},
    "model": {"config", "hf_config", "model_ref", "kernels"},
    "runtime.schedule": {"config", "wire"},  # pure and torch-free: the planner replays it
    "placement": {"config", "safe_io", "model_ref", "wire", "roofline", "runtime.schedule"},
    # runtime's shared pieces (topology, the rank's model, batching, ...), below its sub-packages
    "runtime": BASE | {"roofline", "kernels", "model", "runtime.schedule"},
    "runtime.state": BASE | {"roofline", "kernels", "model", "runtime", "runtime.schedule"},
    "runtime.observe": BASE | {"roofline", "runtime", "runtime.schedule"},
    "runtime.stages": BASE | {"roofline", "kernels", "comm", "model", "runtime", "runtime.schedule"},
    "runtime.training": BASE | {"roofline", "placement", "kernels", "model", "runtime", "runtime.schedule",
                                "runtime.state", "runtime.observe"},
    "runtime.cluster": BASE | {"roofline", "placement", "kernels", "comm", "model", "runtime", "runtime.schedule",
                               "runtime.stages", "runtime.state", "runtime.observe", "runtime.training"},
}
# benchmarks sit above the library; the CLI above everything; nothing imports the CLI but __main__
MAY_IMPORT["bench"] = set(MAY_IMPORT) | {"bench"}
MAY_IMPORT["cli"] = MAY_IMPORT["bench"] | {"bench"}
MAY_IMPORT["__main__"] = {"cli"}


def module_files() -> dict[str, Path]:
    """Dotted module name (under `disagmoe`) -> its file; a package is named by its __init__.py."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exempt.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return exempt


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports, anywhere in its file (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text(), str(path))
    exempt = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "disagmoe")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "disagmoe":
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                found.add(child if child in modules else target)
    return {name for name in found if name != module}


def module_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        targets = imports_of(name, path, modules)
        unknown = targets - set(modules)
        assert not unknown, f"{name} imports {sorted(unknown)}, which are not modules of the package"
        graph[name] = targets
    return graph


def node_of(module: str) -> str:
    """The node of `MAY_IMPORT` a module belongs to."""
    parts = module.split(".")[1:]
    if not parts:
        return "disagmoe"
    if parts[0] == "runtime" and len(parts) > 1 and parts[1] in RUNTIME_SUBPACKAGES:
        return f"runtime.{parts[1]}"
    return parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    nodes: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        nodes[node_of(module)].update(node_of(t) for t in targets if node_of(t) != node_of(module))
    return dict(nodes)


def test_no_import_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_no_import_cycle_between_packages():
    assert cycles(package_graph(module_graph())) == []


def test_imports_go_the_allowed_way():
    wrong = []
    graph = module_graph()
    for module, targets in sorted(graph.items()):
        source = node_of(module)
        if source == "disagmoe":
            continue  # the package's own __init__
        assert source in MAY_IMPORT, f"{module}: its package {source!r} is not in MAY_IMPORT; add it with its rule"
        wrong.extend(f"{module} -> {t}" for t in sorted(targets)
                     if node_of(t) != source and node_of(t) not in MAY_IMPORT[source])
    assert wrong == []


def test_the_checks_see_cycles_and_function_level_imports(tmp_path):
    """The AST reading counts an import inside a function, skips a TYPE_CHECKING block, and the
    cycle search finds a two-module loop (a check that sees nothing would pass the tests above)."""
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from disagmoe.config import X\n"
                      "def f():\n    from disagmoe.wire import Payload\n")
    modules = {"disagmoe.mod": source, "disagmoe.wire": PACKAGE / "wire.py", "disagmoe.config": PACKAGE / "config.py"}
    assert imports_of("disagmoe.mod", source, modules) == {"disagmoe.wire"}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert node_of("disagmoe.runtime.stages.messages") == "runtime.stages"
    assert node_of("disagmoe.runtime.topology") == "runtime"


def test_runtime_subpackages_say_what_they_own():
    for name in RUNTIME_SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / "runtime" / name / "__init__.py").read_text()))
        assert doc and "import" in doc, f"runtime/{name}/__init__.py: say what it owns and what it may import"


def test_runtime_schedule_imports_without_torch():
    code = ("import sys\n"
            "import disagmoe.runtime.schedule.schedule, disagmoe.runtime.schedule.schedule_sim\n"
            "import disagmoe.runtime.schedule.colocated, disagmoe.runtime.schedule.reuse_order\n"
            "import disagmoe.runtime.schedule.roles, disagmoe.runtime.topology\n"
            "print(','.join(m for m in ('torch', 'ray', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
