"""The version of `bench calibrate`'s probe (what it measures, and how), and the check that a
calibrated hardware file was measured by the current one. Torch-free: `plan` and `roofline` import it.

`bench calibrate` records PROBE_VERSION and PROBE_FINGERPRINT in the YAML's `calibration` block;
`plan` and `roofline` still read a file of another version but say so in one warning line
(`stale_note`). PROBE_FINGERPRINT is a hash of the code PROBE_PARTS names (docstrings stripped,
so formatting, comments and docstrings do not move it); tests/bench/test_probe.py fails when
that code changes and the constants here do not.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from disagmoe.config import PRESETS_DIR, HardwareConfig, preset_names

PROBE_VERSION = 9
# 1: before 47ee5dd: CUDA events around each call (`timing.median_ms`: for a tiny op, the host's
#    time to launch it), the expert curve on 8 experts, fixed costs the event time of the smallest probes.
# 2: 47ee5dd: GPU kernel time (`timing.kernel_ms`), fixed cost at next to no work, curve points net
#    of it, the expert curve on the model's own experts (up to ROWS_PER_OP rows per op).
# 3: the expert FFN timed in the step's three passes (forward; data gradients; weight gradients
#    adding into fp32 main gradients, the Triton kernels' accumulate path), each rate fitted against
#    the planner's own stage work (`roofline.stages.expert_passes`, `attention_core_passes`, through
#    `roofline.calibration.fitted_fraction` under the calibrated file's ceilings), a `wgrad` rate per
#    expert point, rows per expert 512 and 2,048 added, up to 256k rows per op; FlatAdamW's step
#    timed as the trainer runs it, its HBM rate fitted against `roofline.stages.optimizer_step`;
#    the Triton permute and combine, forward and backward, against `roofline.stages.permute`;
#    attention timed on the model's own KV heads (GQA through enable_gqa, as `model.attention`
#    calls SDPA; version 2 expanded K and V to every query head); the attention projections'
#    GEMMs (the model's own nn.Linear shapes) as a curve over tokens per micro-batch; every forward
#    timed with autograd on (saving for its backward, as the step's; version 2 ran them under no_grad);
#    a layer's norms, RoPE, copies and residual adds (GQA), against `roofline.stages.norms_and_residuals`.
# 4: kernel time read from the profiler's raw kineto events (`timing.device_intervals`): version 3 read
#    `prof.events()`, which on an H200 (torch 2.11) left out kernels the Chrome trace holds (a training
#    step's 505 ms of kernels read as 436), so its times may be short; the optimizer's step timed with the
#    Triton update (the new default, `calibrate.OPTIMIZER_OPTIM`) and fitted against that update's own bytes
#    (`roofline.stages.optimizer_step` by update kernel, moments' dtype and clip; version 3: torch's, against 42 B).
#    (Session 16, still version 4, not yet measured: the stage functions took first touch's and ZeRO-1's
#    arguments, whose defaults price the probe's own launches as before; the norms probe's attention output
#    is token-major and `stages.norms_and_residuals` has no v or output layout copies, as `rope_heads` now.)
# 5: the FP8 expert curve (`Calibration.expert_gemm_fp8`) on GPUs with FP8 tensor cores (sm_89 on) under the
#    triton experts: `kernels.fp8_ffn.expert_ffn_fp8` at the bf16 curve's rows per expert, its e4m3 weight copies
#    made once outside the timed calls, weight gradients into fp32 main gradients; forward, and the backward
#    whole (no deferred weight gradients in FP8), fitted against the bf16 stage work net of the bf16 FFN's fixed
#    cost (`calibrate.fp8_expert_point`, the backward through `roofline.calibration.fitted_shared_fraction`),
#    capped at fp8_tflops / bf16_tflops; the bf16 terms are measured as in version 4.
# 6: the MLA curves (`Calibration.attention_mla`, `projections_mla`): causal SDPA and the attention module's
#    projection GEMMs at MLA's shape (the calibration model's when it is MLA, else `calibrate.MLA_MODEL`'s, DeepSeek-V3:
#    128 heads of q/k 192, v 128, its low-rank q and kv chains) at the same sequence lengths and tokens, fitted as the
#    attention and projection curves against that shape's `roofline.stages` work; the planner prices MLA models'
#    attention block with them (`roofline.calibration.attention_curves`; version 5 priced it at the calibration model's
#    GQA curves: DeepSeek's cuDNN attention 141 ms a step against 111 priced). Every attention probe's q, k, v and
#    output gradient are tokens-first in memory viewed heads-first, MLA's v the value columns of the kv projection's
#    heads, as the model passes them (version 5: heads-first contiguous GQA tensors; the same times on an H200).
# 7: the FP8 projection curve (`Calibration.projections_fp8`) on GPUs with FP8 tensor cores: the calibration model's
#    attention projections as `fp8_dense` runs them (`calibrate.fp8_projection_passes`: rowwise e4m3 forward and data
#    gradient through torch._scaled_mm, the bf16 weight gradient, q/k/v reading one quantised input, the e4m3 weight
#    copies made once outside the timed calls, every quantiser counting) at the projection curve's tokens, fitted
#    against the bf16 projections' stage work (`calibrate.fp8_projection_point`); the planner prices `fp8_dense` at
#    it over the bf16 curve, the quantisers inside (version 6: the datasheet ratio, the quantisers at HBM speed,
#    where an H100's profile measured the rowwise quantiser cost more than the FP8 GEMMs saved). The terms of
#    version 6 are measured as before.
# 8: the FP8 projection curve measured under the run's default dense recipe: session 34 made blockwise the default
#    (`config.FP8_DENSE_SCALING`: 1 x 128 activation groups, 128 x 128 weight blocks, its weights' two e4m3 copies
#    written by one launch), so version 7's rowwise curve priced a recipe a default run no longer trains. Blockwise
#    where the GPU runs it (`kernels.fp8_dense.blockwise_unavailable`: Hopper, torch >= 2.9 with CUDA >= 12.9), else
#    rowwise (`calibrate.fp8_projection_scaling`), the linears off blockwise's 512 grid in bf16 as the run keeps them
#    (`model.layers.set_linears_fp8`), the recipe recorded (`Calibration.projections_fp8_scaling`; a file without it
#    reads as rowwise); the planner prices a run's recipe at the curve of that recipe only, the other at the
#    datasheet ratio (`placement.cost.fp8_dense_pricing`). The terms of version 7 are measured as before.
# 9: the FP8 expert curve measured under a run's default recipe (`calibrate.fp8_probe_recipe`): the forward's down
#    GEMM alone in FP8 (`config.RUN_FP8_EXPERT_FORWARD`; version 8 and before: both, the kernels' default), and on
#    Hopper the Gluon row GEMMs storing by TMA (`RUN_FP8_GLUON`, `RUN_FP8_GLUON_STORE`; before: the Triton kernels, the
#    kernels' default), recorded as `config.FP8_CURVE_FORWARDS`; the planner prices a run's forward from the blend
#    measured (`placement.cost._unblend` for another forward). The bf16 terms and the backward as in version 8.
PROBE_FINGERPRINT = "99fcc97927d0243a"  # `code_fingerprint()` of the code that measures version PROBE_VERSION

# The code that decides what a calibration's numbers mean: file (under disagmoe/) -> top-level name
# -> why it belongs. Left out on purpose: the experts backends and `model.Block` (the probe measures
# the runtime's own code as it stands: a faster kernel asks for a new measurement, not a new probe),
# how the file is assembled (`merge_calibration`, `calibrated_hardware`, `preset_text`), and
# `bench hardware`'s ceilings (the `efficiency` fractions, outside the calibration block).
PROBE_PARTS: dict[str, dict[str, str]] = {
    "bench/calibrate.py": {
        "ROWS_PER_EXPERT": "the expert curve's sizes",
        "SEQ_LENS": "the attention curve's sizes",
        "ATTENTION_TOKENS": "tokens per attention point (its batch)",
        "ROWS_PER_OP": "the cap on rows per expert-curve op",
        "FIXED_TOKENS": "the fixed-cost probes' sequence",
        "MESSAGE_BYTES": "the link fits' message sizes",
        "MOVED": "bytes per link call in the link fits",
        "OPTIMIZER_PARAMS": "the optimizer probe's size",
        "OPTIMIZER_OPTIM": "the optimizer probe's settings (its update kernel and moments), priced as such",
        "optimizer_probe_work": "the optimizer bytes the optimizer rate is fitted against (the probe's settings)",
        "PERMUTE_TOKENS": "the permute probe's size",
        "PROJECTION_TOKENS": "the projection curve's sizes",
        "MLA_MODEL": "the MLA curves' shape (when the calibration model is not MLA)",
        "mla_probe_model": "which model's attention block the MLA curves measure",
        "projection_point": "the projection rates (the model's and MLA's), fitted the same way",
        "projection_passes": "the projection probe's calls",
        "attention_linears": "which GEMMs the projection probe runs (the model's own)",
        "_projection_times": "the projection probe's inputs",
        "norms_passes": "the elementwise probe's calls (the model's own norms, RoPE, copies, adds)",
        "_norms_times": "the elementwise probe's inputs",
        "permute_passes": "the permute probe's calls (the step's permute and combine)",
        "_permute_times": "the permute probe's inputs",
        "optimizer_pass": "the optimizer probe's calls (the trainer's step)",
        "_optimizer_times": "the optimizer probe's inputs",
        "PassTimes": "the backward as forward+backward minus forward",
        "ExpertTimes": "the expert FFN's three passes",
        "curve_experts": "experts per expert-curve op",
        "attention_batch": "sequences per attention point",
        "fit_link": "latency and bandwidth from the link timings",
        "expert_point": "the expert rates: which stage work each pass is fitted against, net of the fixed cost",
        "fp8_expert_point": "the FP8 expert rates: the same stage work, the backward whole, the cap",
        "fp8_measured": "which GPUs and experts backends measure the FP8 curve",
        "Fp8FFNPasses": "the FP8 expert FFN's passes",
        "fp8_ffn_passes": "how each FP8 expert pass runs (weight copies made once, main gradients)",
        "_fp8_ffn_times": "how the FP8 expert probe's passes are timed",
        "fp8_probe_recipe": "the FP8 expert probe's recipe and Gluon paths (a run's defaults)",
        "attention_point": "the attention rates (the model's and MLA's), the same way",
        "fp8_projection_point": "the FP8 projection rates: the bf16 projections' stage work, the cap",
        "fp8_projections_measured": "which GPUs and models measure the FP8 projection curve",
        "fp8_projection_scaling": "which dense FP8 recipe the FP8 projection curve measures (recorded with it)",
        "fp8_projection_passes": "how the FP8 projections run (fp8_dense's path, one quantised input, copies once)",
        "BLOCK_INPUT_READERS": "which FP8 projections read the one block input",
        "_fp8_projection_times": "how the FP8 projection probe's passes are timed",
        "op_fixed_us": "which probe is each op's fixed cost",
        "calibration_from": "which timings make which terms",
        "measure_all": "the peak the fractions refer to; which parts run",
        "measure_timings": "what each term's probe runs (sizes, experts)",
        "_passes": "forward and backward timed with timing.kernel_ms",
        "FFNPasses": "the expert FFN's passes",
        "ffn_passes": "how each expert pass runs (the main gradients, what is held back)",
        "_ffn_times": "how the expert FFN probe's passes are timed",
        "_ffn_inputs": "the expert probes' inputs (bf16 and FP8)",
        "sdpa_shapes": "the attention probe's q, k, v shapes (the model's own heads)",
        "_sdpa_times": "the attention probe's inputs and call",
        "_block_times": "the attention block probe (the attention ops' fixed cost)",
        "nccl_links": "the link probes",
        "_nccl_worker": "how each collective is timed",
    },
    "bench/timing.py": {
        "kernel_ms": "the timing method of every curve point and fixed cost",
        "device_intervals": "which profiler activities kernel_ms counts",
        "median_ms": "the timing method of the link probes",
    },
    "roofline/stages.py": {
        "Work": "the stage work the rates are fitted against (its backward)",
        "GEMM_BWD": "the projections' backward FLOPs per forward FLOP (Work.backward's default)",
        "ATTN_CORE_BWD": "the attention backward's FLOPs per forward FLOP, in its rate",
        "attention_core": "the attention work the attention rates are fitted against",
        "attention_projections": "the projection work the projection rates are fitted against",
        "attention_projection_passes": "its forward and backward",
        "attention_core_passes": "its forward and backward",
        "attention_io_per_token": "the head widths attention_core counts",
        "expert_passes": "the expert stages the expert rates are fitted against",
        "routed_experts": "the forward's work",
        "swiglu_ffn": "what routed_experts counts",
        "expert_data_grads": "the data gradients' work",
        "expert_weight_grads": "the weight gradients' work, with the fp32 main-gradient traffic",
        "optimizer_step": "the optimizer's bytes the optimizer rate is fitted against",
        "adamw_update_bytes": "the update's bytes in optimizer_step, by update kernel, moments and clip",
        "MASTER": "bytes per fp32 master in the optimizer's passes",
        "MAIN_GRAD": "bytes per fp32 main gradient in them",
        "COMPUTE_PARAM": "bytes per bf16 parameter the update writes",
        "MOMENT": "bytes per AdamW moment, by state dtype",
        "permute": "the permute and combine bytes the permute rate is fitted against",
        "norms_and_residuals": "the elementwise bytes the norms rate is fitted against",
        "BF16": "bytes per bf16 value in that work",
        "FP32": "bytes per fp32 value in it",
    },
    "roofline/params.py": {
        "attention_params": "the projection weights attention_projections counts",
    },
    "roofline/calibration.py": {
        "fitted_fraction": "the rate from a stage's work and its measured time",
        "fitted_shared_fraction": "one rate from several stages' work and their measured time together",
        "compute_ceilings": "how a fitted rate prices a stage (fitted_shared_fraction inverts it)",
        "fitted_hbm_fraction": "the HBM rate from a memory-bound stage's work and its measured time",
    },
    "roofline/ceilings.py": {
        "Ceilings": "how a stage's work becomes time (fitted_fraction inverts it)",
    },
}

PACKAGE = Path(__file__).resolve().parents[1]


def _without_docstrings(node: ast.AST) -> ast.AST:
    """`node` with the docstring of every function and class in it removed (in place)."""
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = inner.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                inner.body = body[1:] or [ast.Pass()]
    return node


def _canonical(value: object) -> str:
    """The AST as text, the same on every Python version: node types and fields, no positions,
    empty fields left out (ast.dump's own text changes between versions: 3.13 drops them, 3.12
    added type_params)."""
    if isinstance(value, ast.AST):
        fields = [(name, getattr(value, name, None)) for name in value._fields]
        inner = ",".join(f"{name}={_canonical(v)}" for name, v in fields if v is not None and v != [])
        return f"{type(value).__name__}({inner})"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    return repr(value)


def _definitions(source: str, path: str) -> dict[str, ast.AST]:
    """The top-level functions, classes and assignments of a module, by name."""
    found: dict[str, ast.AST] = {}
    for node in ast.parse(source, path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
    return found


def fingerprint(sources: Mapping[str, str]) -> str:
    """A hash of the PROBE_PARTS definitions in `sources` (file under disagmoe/ -> its source text)."""
    digest = hashlib.sha256()
    for path, names in PROBE_PARTS.items():
        defined = _definitions(sources[path], path)
        for name in names:
            if name not in defined:
                raise ValueError(f"PROBE_PARTS names {name} in disagmoe/{path}, which defines no top-level "
                                 f"{name}: update PROBE_PARTS in disagmoe/bench/probe.py")
            digest.update(f"{path}:{name}:{_canonical(_without_docstrings(defined[name]))}\n".encode())
    return digest.hexdigest()[:16]


def probe_sources() -> dict[str, str]:
    """The current source text of every file PROBE_PARTS names."""
    return {path: (PACKAGE / path).read_text() for path in PROBE_PARTS}


def code_fingerprint() -> str:
    """The fingerprint of the probe's code as it is now (PROBE_FINGERPRINT records it)."""
    return fingerprint(probe_sources())


def regenerate_command(hw: HardwareConfig, ref: str) -> str:
    """The command that re-measures `hw` (loaded from `ref`, a preset name or a file) with the
    current probe into the same file: over its base preset, with the --model and
    --experts-backend of the command recorded on the file's first line (`bench.hardware.preset_yaml`)."""
    path = _path(ref)
    base = hw.name.removesuffix("-calibrated")
    base = base if base in preset_names("hardware") else "PRESET"
    try:
        first = path.read_text().splitlines()[0] if path.is_file() else ""
    except (OSError, IndexError):
        first = ""
    recorded = "".join(f" {flag} {found.group(1)}" for flag in ("--model", "--experts-backend")
                       if (found := re.search(rf"{flag} ([^\s`]+)", first)))
    return f"disagmoe bench calibrate --hardware {base} --out {_shown(path)}{recorded}"


def stale_note(hw: HardwareConfig, ref: str) -> str | None:
    """One line saying that `hw` (loaded from `ref`, a preset name or a file) was calibrated by
    another probe version than the current one, and the command that re-measures it; None if it was not."""
    cal = hw.calibration
    if cal is None or cal.probe_version == PROBE_VERSION:
        return None
    measured = ("records no probe version (older than versions)" if cal.probe_version is None
                else f"was measured by probe version {cal.probe_version}")
    return (f"{_shown(_path(ref))}: its calibration {measured} of `disagmoe bench calibrate`, which is now at version "
            f"{PROBE_VERSION}: its terms were measured another way (planning with them anyway); re-measure on the "
            f"GPU with `{regenerate_command(hw, ref)}`")


def _path(ref: str) -> Path:
    """The file `ref` (a preset name or a path) names."""
    preset = PRESETS_DIR / "hardware" / f"{ref}.yaml"
    return preset if "/" not in ref and preset.is_file() else Path(ref)


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it lies below it (a preset: from the repository root)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
