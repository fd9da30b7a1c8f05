import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# --- parallel runs (README: `python -m pytest -q -n auto`, pytest-xdist). The tests of a file that
# starts Ray (clusters, trainers, `disagmoe train` or `bench placement` in a process or through the
# CLI runner) run one after another on one worker, in one of two units of work (`RAY_UNITS`: the
# driver's and the README's files, then every other such file), so at most two Ray clusters run at
# once; a third beside them on a 2-core machine misses its start-up timeouts. Every other test
# (spawned gloo ranks included) is a unit of its own, spread over the workers. xdist runs the
# units with the most tests first, so the two long Ray units start at once. (xdist's "loadgroup"
# marks groups by rewriting node ids, which pytest 9 no longer reads: this scheduler groups by file.)
RAY_STARTS = ("DistributedTrainer(", "WorkerGroup.start(", "Cluster(", "ray.init(", '"-m", "disagmoe"', '["train"',
              '"bench", "placement"', '"bench", "train"')
RAY_UNITS = {"tests/runtime/cluster/test_driver.py": "ray-driver-and-readme", "tests/test_readme.py": "ray-driver-and-readme"}
# Tests sharing an expensive module-scoped fixture or cache (node id prefixes): one unit each, so
# that it is made once, not once per worker.
SHARED_UNITS = ("tests/runtime/state/test_flat_adamw.py::test_zero1_", "tests/runtime/state/test_offload.py::test_zero1_",
                "tests/kernels/test_recompute.py::test_recomputation_keeps_less",
                "tests/kernels/test_fp8_recompute.py::test_fp8_recomputation_keeps_less",
                "tests/kernels/test_fused_moe.py::test_one_op_is_the_three_ops_without_their_rows",
                "tests/runtime/stages/test_pair_return.py::test_recomputed_pair_rows_keep_less")
TESTS_ROOT = Path(__file__).resolve().parent.parent
_ray_files: dict[str, bool] = {}


def _starts_ray(test_file: str) -> bool:
    """Whether the test file (a path relative to the repository, as node ids name it) starts Ray."""
    if test_file not in _ray_files:
        path = TESTS_ROOT / test_file
        text = path.read_text() if path.suffix == ".py" and path.is_file() else ""
        _ray_files[test_file] = any(s in text for s in RAY_STARTS)
    return _ray_files[test_file]


def pytest_configure(config):
    """In an xdist worker, torch's intra-op threads are the worker's share of the cores (1 with `-n
    auto`). With torch's default (every core) each worker's OpenMP threads spun on the core the
    other worker, the Ray actors and the processes of the tests needed: on 2 cores the restart
    tests of test_driver.py took 2-3x as long beside a 2-thread torch process as beside a 1-thread
    one, and test_worker_peer_stores.py (tiny tensors, many ops) 105 s against 26 s. Code that sets
    its own count (`cpu_threads`: the trainers, the Ray actors) still does."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (`-p no:xdist`) does not know the hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            test_file = nodeid.split("::", 1)[0]
            if _starts_ray(test_file):
                return RAY_UNITS.get(test_file, "ray-other")
            return next((prefix for prefix in SHARED_UNITS if nodeid.startswith(prefix)), nodeid)

    return RayFilesTogether(config, log)


# --- Triton's CPU interpreter, switched on for one test at a time (kernel tests, runtime tests of fused paths)


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a tensor used as a loop bound into an int with
    `int(array)`, which NumPy >= 2.4 refuses for the 1-element arrays the interpreter makes of
    scalars (program ids, scalar loads, reductions). Convert through `.item()` instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_disagmoe_patched", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._disagmoe_patched = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _patch_interpreter_descriptor_reduce() -> None:
    """Triton 3.6's interpreter has no `create_descriptor_reduce` (a tensor descriptor's `atomic_add`, which a GPU
    runs as the tensor memory accelerator's reduce-add: the weight gradient's `TileConfig.tma_store` epilogue). The
    add as the hardware does it, for the interpreter's one program at a time: the box's elements inside the tensor
    read, added and written back, those outside it (clipped by the descriptor's bounds) left alone."""
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if hasattr(builder, "create_descriptor_reduce"):
        return

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"the interpreter's descriptor reduce takes ADD only, not {kind}")
        ptrs, mask = desc.materialize_pointers(indices)
        other = interpreter.TensorHandle(np.zeros_like(value.data), value.dtype)
        prior = self.create_masked_load(ptrs, mask, other, cache_modifier=None, eviction_policy=None,
                                        is_volatile=False)
        total = interpreter.TensorHandle(prior.data + value.data, value.dtype)
        return self.create_masked_store(ptrs, total, mask, None, None)

    builder.create_descriptor_reduce = create_descriptor_reduce


def _patch_device_call_restore() -> None:
    """Triton 3.6's interpreter patches triton.language for a device-function call (a @triton.jit
    helper called from a kernel: tl.cdiv, a kernel module's own helpers) and, unlike a launch,
    never restores it: interpreter builtins stay in triton.language.core, and a kernel compiled
    later in the same process fails in the front end ("'block_argument' object has no attribute
    'get_element_ty'": test_compile_for_hopper after an interpreter test, on a cold Triton cache).
    The same call, restoring its patches when it returns (to the launch's own, still in place)."""
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.__call__
    if getattr(original, "_disagmoe_patched", False):
        return

    def call(self, *args, **kwargs):
        scope = interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    call._disagmoe_patched = True
    interpreter.InterpretedFunction.__call__ = call


class _NothingToRestore:
    def restore(self) -> None:
        pass


def _patch_lang_once() -> None:
    """Triton 3.6's `_patch_lang` (a launch's, and a device-function call's) patches the
    triton.language modules its function's globals name: every builtin of the module (found by
    `inspect.getmembers`), of its tensor class and of `tl.math`. A device call inside a launch
    patched again the modules the launch (or an enclosing call) had patched and not yet
    restored, a no-op done thousands of times a step (a fifth of an interpreted training step's
    time). The same patches, but a module patched by an enclosing scope is left as it is: a call
    patches what is still original (tl.core for a tl.standard helper under a kernel naming `tl`),
    restores just that, and a call finding everything patched patches nothing."""
    import inspect
    from types import SimpleNamespace

    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_disagmoe_patched", False):
        return
    tl = interpreter.tl
    active: list = []  # the modules patched by scopes not yet restored (a reload keeps a module's identity)

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)]
        todo = [lang for i, lang in enumerate(langs) if not any(lang is seen for seen in active + langs[:i])]
        if langs and not todo:
            return _NothingToRestore()  # an enclosing scope patched them all (and tensor_descriptor_base)
        scope = original(SimpleNamespace(__globals__={f"lang{i}": lang for i, lang in enumerate(todo)}))
        active.extend(todo)
        restore = scope.restore

        def restore_and_forget():
            restore()
            for lang in todo:
                active.remove(lang)

        scope.restore = restore_and_forget
        return scope

    patch_lang._disagmoe_patched = True
    interpreter._patch_lang = patch_lang


def _patch_np_dtype_lookup() -> None:
    """Triton 3.6's interpreter maps a Triton type to its NumPy storage type (`_get_np_dtype`) by
    building a dict of every dtype at each call: 664,146 calls, 6% of test_fp8_ffn.py's time. The
    same mapping with the answer kept per element type (pointers and blocks resolved as it does;
    a dtype equals another of its name, which is its hash too)."""
    from triton.runtime import interpreter

    original = interpreter._get_np_dtype
    if getattr(original, "_disagmoe_patched", False):
        return
    tl = interpreter.tl
    by_name: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type) or not isinstance(tt_dtype, tl.dtype):
            return original(tt_dtype)
        if tt_dtype.name not in by_name:
            by_name[tt_dtype.name] = original(tt_dtype)
        return by_name[tt_dtype.name]

    get_np_dtype._disagmoe_patched = True
    interpreter._get_np_dtype = get_np_dtype


# Modules of Triton itself whose @triton.jit helpers (tl.cdiv, tl.sum, tl.sigmoid, ...) must be
# rebuilt when the interpreter is switched on after Triton was first imported (e.g. by another
# test module): the interpreter only calls helpers that were decorated in interpreter mode.
TRITON_JIT_MODULES = ("triton.language.standard", "triton.language")
# kernel modules that read TRITON_INTERPRET when they load and that other kernel modules import names from:
# reloaded before the modules a test asks for (and after it, compiled), so those bind this build's functions
KERNEL_LEAF_MODULES = ("disagmoe.kernels.fp8_rounding",)


def _reload_all(names):
    return [importlib.reload(importlib.import_module(name)) for name in names]


@pytest.fixture(autouse=True)
def _fp8_gluon_choices_restored():
    """A trainer sets the FP8 experts' kernel choices for its whole process (`kernels.fp8_ffn.set_gluon`): each
    test gets them back as it found them, so one that asserts the FFN's defaults does not see an earlier test's
    run settings (a GPU run of the bench and model tests in one process did, session 39)."""
    module = sys.modules.get("disagmoe.kernels.fp8_ffn")
    saved = None if module is None else dataclasses.asdict(module._gluon)
    yield
    module = sys.modules.get("disagmoe.kernels.fp8_ffn")
    if module is not None:
        for name, value in (saved or dataclasses.asdict(module._GluonChoices())).items():
            setattr(module._gluon, name, value)


@pytest.fixture(autouse=True)
def _expert_loads_restored():
    """A trainer sets the loads its process's expert launches read their tiles for (`tile_configs.set_expert_loads`):
    each test gets them back as it found them, so a later test's lookups never read an earlier run's loads."""
    module = sys.modules.get("disagmoe.kernels.tile_configs")
    saved = None if module is None else module.expert_loads()
    yield
    module = sys.modules.get("disagmoe.kernels.tile_configs")
    if module is not None:
        module.set_expert_loads(saved or "routed")


@pytest.fixture
def interpreted():
    """Reload the given kernel modules with TRITON_INTERPRET=1 (so @triton.jit builds interpreted
    functions, whatever was imported before), and restore the compiled build after the test (so
    GPU tests in the same run get compiled kernels)."""
    reloaded = []
    loaded_before = set(sys.modules)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_interpreter_index()
    _patch_interpreter_descriptor_reduce()
    _patch_device_call_restore()
    _patch_lang_once()
    _patch_np_dtype_lookup()
    _reload_all(TRITON_JIT_MODULES)
    _reload_all(KERNEL_LEAF_MODULES)

    def load(*names: str):
        modules = _reload_all(names)
        reloaded.extend(modules)
        return modules if len(modules) > 1 else modules[0]

    yield load
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous
    _reload_all(TRITON_JIT_MODULES)
    _reload_all(KERNEL_LEAF_MODULES)
    # kernel modules first imported during the test (by the reloaded ones: fp8, fp8_stats, ...) were
    # built interpreted too; rebuilt compiled, dependencies first (sys.modules lists a module before
    # the modules its import then imports), before the modules that import them. Left interpreted,
    # a later compile of a kernel calling their helpers failed ("Cannot call @triton.jit'd outside
    # of the scope of a kernel": test_compile_for_hopper after test_recompute in one worker).
    first_imported = [name for name in sys.modules if name not in loaded_before and name.startswith("disagmoe.kernels.")]
    _reload_all(reversed(first_imported))
    for module in reloaded:
        importlib.reload(module)


# --- the quick subset (`pytest -m "not slow"`, README): a test past QUICK_LIMIT_S without the
# `slow` marker is named at the end of the run, so the subset stays under 3 minutes on 2 cores.
# The files that take the most time (set-up, call and tear-down) are named too, so a CI run that
# nears its budget (.ci/run: 20 minutes on 2 cores) says where to cut.
QUICK_LIMIT_S = 5.0
FILES_NAMED = 12
_long_unmarked: list[tuple[str, float]] = []
_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    if report.when == "call" and report.duration > QUICK_LIMIT_S and "slow" not in report.keywords:
        _long_unmarked.append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter):
    if _long_unmarked:
        terminalreporter.section("tests over 5 s without @pytest.mark.slow (mark them: README, quick subset)")
        for nodeid, seconds in sorted(_long_unmarked, key=lambda t: -t[1]):
            terminalreporter.write_line(f"{seconds:6.1f}s {nodeid}")
    if len(_file_seconds) > 1:
        total = sum(_file_seconds.values())
        terminalreporter.section(f"the {FILES_NAMED} slowest test files ({total:.0f} s in all tests)")
        for path, seconds in sorted(_file_seconds.items(), key=lambda t: -t[1])[:FILES_NAMED]:
            terminalreporter.write_line(f"{seconds:7.1f}s {100 * seconds / total:5.1f}% {path}")

