# The "permute and combine" row of `bench profile`'s bounds table (disagmoe/bench/kernel_bounds.py) for session 45's
# profile of the Qwen3 config's 3-layer step at two micro-batches on one H100, from that profile's own kernel times
# (docs/measurements/qwen3-3l-m2-profile-h100-s45.txt), under the h100-sxm preset. Run from the repository root:
#   python docs/measurements/permute_bounds_s45.py
import re
from disagmoe.bench.kernel_bounds import kernel_bounds
from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
kernels = {m.group(1): float(m.group(2)) for line in open("docs/measurements/qwen3-3l-m2-profile-h100-s45.txt")
           if (m := re.match(r"│ (_permute_copy_kernel|_combine_kernel|_combine_backward_kernel)\s+│[^│]+│\s+([\d.]+)", line))}
cfg = TrainConfig(model="qwen3-30b-a3b", mode="single", device="cuda", experts_backend="triton", batch_size=16,
                  seq_len=4096, micro_batches=2, hardware="h100-sxm")
m = load_model("qwen3-30b-a3b").model_copy(update={"num_layers": 3})
row = next(r for r in kernel_bounds(cfg, m, kernels) if r["family"] == "permute and combine")
print(kernels)
print(f"{row['ms_per_step']:.2f} ms a step against a bound of {row['bound_ms_per_step']:.2f} ms ({row['gb']:.1f} GB at "
      f"the HBM rate): {row['ratio']:.2f}x")
