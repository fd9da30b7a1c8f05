"""Issue 20 item 5 (session 47): `disagmoe roofline -c CFG --layout single --hardware h200-sxm-calibrated
routing=balanced` beside the single-GPU step measured on an H200 with `disagmoe bench train -c CFG --mode single
--baseline hf routing=balanced hardware=h200-sxm` in this session (the records beside this script). The calibration
(`bench calibrate`, probe version 9) is fitted from probes, never from these steps. Run from the repository root:
    python docs/measurements/calibration_vs_steps_h200_s47.py
"""
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {  # config -> the record of its measured step (the tile table as committed at that step)
    "configs/h200x2-qwen3-30b.yaml": "qwen3-hf-h200-s47.json",
    "configs/h200-mixtral-8x7b.yaml": "mixtral-hf-h200-s47.json",
    "configs/h200-deepseek-v3.yaml": "deepseek-hf-h200-s47.json",
}


def predicted_s(config: str) -> float:
    out = subprocess.run([sys.executable, "-m", "disagmoe", "roofline", "-c", config, "--layout", "single",
                          "--hardware", "h200-sxm-calibrated", "--json", "routing=balanced"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["plan"]["step_time_s"]


def measured_s(record: str) -> float:
    modes = json.loads((HERE / record).read_text())["modes"]
    return next(m for m in modes if m["mode"] == "single")["median_step_s"]


print("| config | predicted | measured on an H200 | predicted / measured |")
print("|---|---|---|---|")
for config, record in RUNS.items():
    p, m = predicted_s(config), measured_s(record)
    print(f"| `{config}` | {p * 1e3:.0f} ms | {m * 1e3:.1f} ms ({record}) | {p / m:.2f} |")
