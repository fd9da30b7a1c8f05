# Session 48 (CPU, compile only): does Gluon 3.6 lower a TMA load into a cluster-broadcast shared layout to a multicast
# copy? Issue 21's FP8 row GEMM sits at its 128-row tile's L2-to-SM (crossbar) bound (session 46), and the lever named
# there is TMA multicast across a cluster (each B tile read from L2 once for two CTAs), which `tma.
# async_copy_global_to_shared` takes no CTA mask for. This compiles, for sm_90a, a kernel launched with num_ctas=2
# whose shared buffer's `cga_layout` is broadcast across the pair ([[0, 0]]: both CTAs hold the whole box: what a
# multicast would fill), and prints the PTX's bulk tensor copies.
# Found (triton 3.6.0): a cluster of 2 is made (.reqnctapercluster 2) but each CTA issues its own
# `cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes` of the box: no `.multicast::cluster`,
# so the broadcast layout reads the box from L2 twice, as two plain CTAs would. Multicast stays outside Gluon 3.6.
# Run: python docs/measurements/gluon_multicast_check_s48.py   (no GPU: Triton's front end, passes and PTX)
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import compile, make_backend
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import JITFunction, create_function_from_signature

HOPPER = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(HOPPER)
built = []


def compile_only(self, *args, grid, warmup, **kwargs):
    """JITFunction.run replaced: the kernel compiled for sm_90a, nothing launched."""
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, specialization, options)
    built.append(compile(GluonASTSource(self, signature, constexprs, attrs), target=HOPPER, options=options.__dict__))


@gluon.jit
def box_copy(desc, out_ptr, SMEM_LAYOUT: gl.constexpr, REG_LAYOUT: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SMEM_LAYOUT)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, 64 * 64 * 2)
    tma.async_copy_global_to_shared(desc, [0, 0], bar, buf)
    mbarrier.wait(bar, 0)
    x = buf.load(REG_LAYOUT)
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, REG_LAYOUT))
    offs_n = gl.arange(0, 64, layout=gl.SliceLayout(0, REG_LAYOUT))
    gl.store(out_ptr + offs_m[:, None] * 64 + offs_n[None, :], x)


JITFunction.run = compile_only
for name, cga in (("broadcast", [[0, 0]]),):
    smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=cga)
    regs = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=cga)
    desc = TensorDescriptor.from_tensor(torch.empty(256, 64, dtype=torch.bfloat16), [64, 64], smem)
    box_copy[(2,)](desc, torch.empty(64, 64, dtype=torch.bfloat16), smem, regs, num_warps=4, num_ctas=2)
    ptx = built[0].asm["ptx"]
    copies = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.tensor" in line]
    cluster = [line.strip() for line in ptx.splitlines() if line.strip().startswith(".reqnctapercluster")]
    print(f"{name} cga_layout {cga}: {cluster}, multicast: {any('multicast' in c for c in copies)}")
    for copy in copies:
        print(f"  {copy}")
