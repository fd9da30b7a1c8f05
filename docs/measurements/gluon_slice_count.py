# The Gluon FP8 row GEMM's K-slice loop compiled for sm_90a on a CPU (Triton 3.6's ptxas), Mixtral's down GEMM at 128 x 128:
# instructions a warp per 128-deep slice. Run from the repository root: python docs/measurements/gluon_slice_count.py MODULE.py
import importlib.util, re, sys, torch
from triton.compiler import compile, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import JITFunction, create_function_from_signature
sys.path.insert(0, ".")
from tests.kernels.test_compile_for_hopper import HOPPER, sass_of, ptxas_usage
spec = importlib.util.spec_from_file_location("fg_under_test", sys.argv[1]); fg = importlib.util.module_from_spec(spec)
sys.modules["fg_under_test"] = fg; spec.loader.exec_module(fg)
backend, built = make_backend(HOPPER), []
def compile_only(self, *args, grid, warmup, **kwargs):
    kwargs.setdefault("debug", False)
    bound, specialization, options = create_function_from_signature(self.signature, self.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
    built.append(compile(GluonASTSource(self, signature, constexprs, attrs), target=HOPPER, options=options.__dict__))
JITFunction.run = compile_only
E, rows, K, N, FP8 = 8, 2048, 14336, 4096, torch.float8_e4m3fn  # Mixtral's down GEMM, 128 x 128, 4 stages
fg.gluon_fp8_rows_gemm(torch.empty(E * rows, K, dtype=FP8), torch.ones(E * rows, K // 128),
                       torch.full((E,), rows).cumsum(0).to(torch.int32), torch.empty(E, N, K, dtype=FP8).transpose(1, 2),
                       torch.ones(E, K // 128, N // 128), num_programs=132)
ins = [(int(m.group(1), 16), m.group(2)) for l in sass_of(built[0]).splitlines()
       if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", l))]
addr = {a: i for i, (a, _) in enumerate(ins)}
loops = []
for i, (a, t) in enumerate(ins):  # loops: a backward branch; the innermost holding the QGMMAs is the K loop
    m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
    if m and int(m.group(1), 16) < a and int(m.group(1), 16) in addr:
        body = [x for _, x in ins[addr[int(m.group(1), 16)]:i + 1]]
        if sum("QGMMA" in x for x in body) == 4:
            loops.append(body)
body = min(loops, key=len)
count = lambda op: sum(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] == op for x in body)
print(f"K-slice loop: {len(body)} instructions a warp, QGMMA 4, FFMA {count('FFMA')}, "
      f"MOV {count('MOV') + count('IMAD.MOV.U32')}, spills {ptxas_usage(built[0].asm['ptx'])[1]} bytes")
