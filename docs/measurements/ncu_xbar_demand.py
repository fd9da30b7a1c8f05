# From an ncu record of `--metrics l1tex__m_xbar2l1tex_read_bytes.sum.per_second,
# sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,...` (e.g. ncu-fp8-rows-l2-h100-s45.txt):
# per kernel launch, the bytes a second the L2 delivered into the SMs (the crossbar), the tensor pipe's active share,
# and the crossbar rate the kernel would need at a fully busy tensor pipe (the first over the second).
# Run from the repository root: python docs/measurements/ncu_xbar_demand.py docs/measurements/ncu-fp8-rows-l2-h100-s45.txt
import re, sys
launches, current = [], None
for line in open(sys.argv[1]):
    if m := re.match(r"\s+(\w+) \((\d+), 1, 1\)x\((\d+), 1, 1\)", line):
        current = {"kernel": m.group(1), "threads": int(m.group(3))}
        launches.append(current)
    elif current is not None and (m := re.match(r"\s+(\S+)\s+\S+\s+([\d.,]+)\s*$", line)):
        current[m.group(1)] = float(m.group(2).replace(",", ""))
print(f"{'kernel':32} {'threads':>7} {'ms':>6} {'xbar TB/s':>10} {'tensor %':>9} {'xbar TB/s at 100%':>18}")
for k in launches:
    xbar = k["l1tex__m_xbar2l1tex_read_bytes.sum.per_second"]
    tensor = k["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]
    print(f"{k['kernel']:32} {k['threads']:>7} {k['gpu__time_duration.sum']:>6.2f} {xbar:>10.2f} {tensor:>9.1f} "
          f"{xbar / tensor * 100:>18.1f}")
