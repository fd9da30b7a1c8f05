"""Issue 21 (session 47): how far each FP8 expert recipe can lift the expert block and the step, at most.

Arithmetic, no new run. The expert FFN's six GEMMs in units of one H x F GEMM over the routed rows: forward gate/up
2 and down 1, the data gradients down 1 and gate/up 2, the weight gradients w2 1 and w13 2 (9 in all). A recipe
(`fp8_expert_forward` x `fp8_expert_backward`) runs some of them in FP8, each at `r` times its bf16 rate; the rest
and everything outside the expert GEMMs keep their time. `r` is 2.0 at the datasheet and about 1.7 for our kernels
at the crossbar bound session 46 read (`ncu_xbar_demand.py`: the FP8 row GEMM near 84% of its tensor pipe at
256 x 128, the bf16 one 97%, so 2 x 0.84 / 0.97). Ceilings, not predictions: the quantisers, the permute and the
combine are left out (the block's time has them), and each row GEMM's time is taken in proportion to its FLOPs.
The profiles' "expert row GEMMs" family holds the split SwiGLU-gradient pass (`_swiglu_grad_rows_kernel`, beside
the library's down data gradient): memory-bound, it runs under FP8 too, so it keeps its time here.

Step shares from profile records: the Qwen3 config on one H200 (this session, `qwen3-profile-bf16-h200-s47.txt`)
and the Mixtral config on one H100 (session 45, `mixtral-profile-h100-s45.json`; no Mixtral profile on an H200 yet).
    python docs/measurements/fp8_recipe_ceilings.py
"""
import json
import re
from pathlib import Path

HERE = Path(__file__).parent
FORWARD = {"down": 1, "gate-up": 2, "both": 3}  # units of the forward in FP8 (rows GEMMs)
BACKWARD = {"bf16": (0, 0), "bf16-wgrad": (3, 0), "fp8": (3, 3)}  # (data-gradient units, weight-gradient units)
RATES = (1.7, 2.0)


def qwen3_h200():
    text = (HERE / "qwen3-profile-bf16-h200-s47.txt").read_text()
    total = float(re.search(r"\(([\d.]+) ms of kernels\)", text).group(1))
    rows = float(re.search(r"expert row GEMMs \(bf16\)\s*│\s*([\d.]+)", text).group(1))
    wgrad = float(re.search(r"expert weight gradients \(bf16\)\s*│\s*([\d.]+)", text).group(1))
    swiglu_pass = sum(float(m) for m in re.findall(r"│ _swiglu_grad_rows\w*\s*│[^│]*│\s*([\d.]+)", text))
    return total, rows - swiglu_pass, wgrad


def mixtral_h100():
    record = json.loads((HERE / "mixtral-profile-h100-s45.json").read_text())
    family = {b["family"]: b["ms_per_step"] for b in record["bounds"]}
    swiglu_pass = sum(k["ms_per_step"] for k in record["kernels"] if k["name"].startswith("_swiglu_grad_rows"))
    return (record["kernel_ms_per_step"], family["expert row GEMMs (bf16)"] - swiglu_pass,
            family["expert weight gradients (bf16)"])


def block_ceiling(fp8_units: int, r: float) -> float:
    return 9 / ((9 - fp8_units) + fp8_units / r)


def step_ceiling(total: float, rows: float, wgrad: float, row_units: int, wgrad_units: int, r: float) -> float:
    saved = (rows * row_units / 6 + wgrad * wgrad_units / 3) * (1 - 1 / r)
    return total / (total - saved)


steps = {"Qwen3, H200": qwen3_h200(), "Mixtral, H100": mixtral_h100()}
for name, (total, rows, wgrad) in steps.items():
    print(f"{name}: kernels {total:.1f} ms a step, expert row GEMMs {rows:.1f} ms (less the SwiGLU-gradient pass), "
          f"weight gradients {wgrad:.1f} ms "
          f"({(rows + wgrad) / total:.0%} of the step)")
print()
head = " | ".join(f"block r={r}" for r in RATES) + " | " + " | ".join(
    f"{name} step r={r}" for name in steps for r in RATES)
print(f"| forward | backward | FP8 units of 9 | {head} |")
print("|---|---|---|" + "---|" * (len(RATES) * (1 + len(steps))))
for forward, f_units in FORWARD.items():
    for backward, (d_units, w_units) in BACKWARD.items():
        units = f_units + d_units + w_units
        cells = [f"{block_ceiling(units, r):.2f}x" for r in RATES]
        cells += [f"{step_ceiling(*steps[name], f_units + d_units, w_units, r):.3f}x" for name in steps for r in RATES]
        run = " (a run's default)" if (forward, backward) == ("down", "bf16-wgrad") else ""
        print(f"| {forward}{run} | {backward} | {units} | " + " | ".join(cells) + " |")
