# Session 46 (diagnosis): `disagmoe bench experts --precision fp8` on Mixtral's shape, the run's recipe at 128 rows
# (TMA store) and at 256 rows, in-process, with the Gluon FP8 row GEMM's ring at STAGES256 stages where it runs
# 256-row tiles (argv[1]; the kernel's default is 4). Session 45's ncu timed the down GEMM at 256 x 128 with 3
# stages (1.23x the 128-row tile), where session 44's block at 256 rows (4 stages) lost.
import functools, sys
from disagmoe.kernels import fp8_gluon
stages256 = int(sys.argv[1])
original = fp8_gluon.gluon_fp8_rows_gemm
@functools.wraps(original)
def patched(*args, block_m=128, stages=4, **kwargs):
    return original(*args, block_m=block_m, stages=stages256 if block_m == 256 else stages, **kwargs)
fp8_gluon.gluon_fp8_rows_gemm = patched
sys.argv = ["disagmoe", "bench", "experts", "--precision", "fp8", "--shape", "mixtral-8x7b", "--backend", "grouped_mm",
            "--backend", "triton", "--backend", "triton-fp8:run", "--backend", "triton-fp8:run-256", "--iters", "10",
            "--markdown"]
from disagmoe.cli.app import main
main()
