"""Every Triton kernel compiles for the GPU it runs on (sm_90, Hopper), checked on the CPU.

The interpreter tests run the kernels' Python, not Triton's compiler: a kernel can pass them and
still be refused by the compiler (a helper whose branches return different types, say), which
then surfaces only on the GPU machine. Here each wrapper is called on CPU tensors with
`JITFunction.run` replaced by a compile-only step for an sm_90 target (Triton's front end, its
passes and ptxas, down to a cubin); nothing is launched, so the outputs are ignored. The waits'
clock (`kernels.signal.timed`) is switched on, as on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes (Ray, gloo) or compiles: the quick subset skips it

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(fn: JITFunction, backend, args: tuple, kwargs: dict):
    """`fn` bound to a launch's arguments and compiled for HOPPER (front end, passes, ptxas): the
    compiled kernel, whose `asm` holds its TTGIR, PTX and cubin. Nothing is launched."""
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=HOPPER, options=options.__dict__)


_PTXAS_REPORTS: dict[str, str] = {}  # sha256 of a PTX -> its `ptxas_report`


def ptxas_usage(ptx: str) -> tuple[int, int]:
    """ptxas -v's (registers per thread, spill stores in bytes) for `ptx` on sm_90a, with the ptxas
    Triton ships; once per distinct PTX in a process (the tests compile some kernels alike: 224 calls
    on 177 PTX texts in one process)."""
    import re

    report = ptxas_report(ptx)
    return (int(re.search(r"Used (\d+) registers", report).group(1)),
            int(re.search(r"(\d+) bytes spill stores", report).group(1)))


def ptxas_report(ptx: str) -> str:
    """ptxas -v's report (stderr) for `ptx` on sm_90a, with the ptxas Triton ships: its usage lines and its
    advisories (e.g. wgmma serialised for want of registers); once per distinct PTX in a process."""
    import hashlib
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    key = hashlib.sha256(ptx.encode()).hexdigest()
    if key not in _PTXAS_REPORTS:
        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "k.ptx"
            source.write_text(ptx)
            _PTXAS_REPORTS[key] = subprocess.run(
                [str(ptxas), "-v", "--gpu-name", "sm_90a", str(source), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, check=True).stderr
    return _PTXAS_REPORTS[key]


def sass_of(kernel) -> str:
    """The SASS of a kernel compiled by `compile_for_hopper` (cuobjdump of its cubin, the one Triton ships)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def spill_store_bytes(ptx: str) -> int:
    """ptxas -v's spill stores (bytes) for `ptx` on sm_90a (`ptxas_usage`)."""
    return ptxas_usage(ptx)[1]


@pytest.fixture
def compiled(monkeypatch):
    """Kernels launched while this is active are compiled for HOPPER (their names returned)."""
    from disagmoe.kernels import fused_return, signal

    names: list[str] = []
    backend = make_backend(HOPPER)

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        assert kernel.asm.get("cubin"), f"{self.fn.__name__}: no cubin"
        names.append(self.fn.__name__)

    monkeypatch.setattr(JITFunction, "run", compile_only)
    for module in (signal, fused_return):
        monkeypatch.setattr(module, "timed", lambda _t: True)
    return names


@pytest.fixture
def usage(monkeypatch):
    """Kernels launched while this is active are compiled for HOPPER; `usage.found` gets each one's
    (`usage.label` at its launch, ptxas registers, spill-store bytes)."""
    backend = make_backend(HOPPER)
    record = SimpleNamespace(found=[], label="")

    def compile_and_count(self, *args, grid, warmup, **kwargs):
        record.found.append((record.label, *ptxas_usage(compile_for_hopper(self, backend, args, kwargs).asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_count)
    return record


def _tiles():
    from disagmoe.kernels.tile_configs import TileConfig

    return TileConfig(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=3)


def test_the_arrival_flags_compile(compiled):
    from disagmoe.kernels import signal

    flags, status = torch.zeros(4, dtype=torch.int64), signal.new_status("cpu")
    signal.raise_flag(flags, 1)
    signal.raise_flag(flags, 1, failed=True)
    signal.wait_flag(flags, signal.new_consumed(flags), 1, status, timeout_s=1.0)
    assert compiled == ["_raise_flag_kernel"] * 2 + ["_wait_flag_kernel"]


def test_the_fused_return_compiles(compiled):
    from disagmoe.kernels import fused_return as fr

    tokens, top_k, experts, hidden, ffn, seg = 64, 2, 4, 64, 32, 16
    dtype = torch.bfloat16
    pairs = torch.arange(tokens * top_k, dtype=torch.int32)
    offsets = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    segments = fr.num_segments(tokens, seg)
    flags = torch.zeros(1, segments, dtype=torch.int64)
    dst = torch.zeros(tokens * top_k, hidden, dtype=dtype)
    fr.down_to_destination(torch.zeros(tokens * top_k, ffn, dtype=dtype), offsets,
                           torch.zeros(experts, ffn, hidden, dtype=dtype), _tiles(), dst_PH=dst, dst_rows_N=pairs,
                           tokens=tokens, top_k=top_k, segment_tokens=seg,
                           counters_S=torch.zeros(segments, dtype=torch.int32), flags_QS=flags, source=0,
                           num_programs=8)
    served, offsets_served = torch.tensor([96], dtype=torch.int32), torch.tensor([24, 48, 72, 96], dtype=torch.int32)
    fr.down_to_destination(torch.zeros(tokens * top_k, ffn, dtype=dtype), offsets_served,  # rows 96+: spare
                           torch.zeros(experts, ffn, hidden, dtype=dtype), _tiles(), dst_PH=dst, dst_rows_N=pairs,
                           tokens=tokens, top_k=top_k, segment_tokens=seg,
                           counters_S=torch.zeros(segments, dtype=torch.int32), flags_QS=flags, source=0,
                           served_1=served, num_programs=8)
    status = torch.zeros(2, dtype=torch.int32)
    for weights in (torch.ones(tokens, top_k, dtype=dtype), None):
        fr.combine_landed(dst, weights, flags, torch.zeros_like(flags), seg, top_k, status, num_programs=4,
                          flag_base=64)
    assert compiled == ["_ragged_rows_gemm_kernel"] * 2 + ["_combine_landed_kernel"] * 2


def test_the_expert_ffn_and_the_permute_compile(compiled):
    from disagmoe.kernels import moe_ffn, permute

    rows, experts, hidden, ffn = 128, 4, 64, 32
    dtype = torch.bfloat16
    tiles = moe_ffn.FFNTiles.uniform(_tiles())
    x = torch.zeros(rows, hidden, dtype=dtype)
    offsets = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    w13, w2 = torch.zeros(experts, hidden, 2 * ffn, dtype=dtype), torch.zeros(experts, ffn, hidden, dtype=dtype)
    y, act, h13 = moe_ffn.moe_ffn_forward(x, offsets, w13, w2, tiles, save_for_backward=True, num_programs=8)
    main = (torch.zeros(experts, hidden, 2 * ffn), torch.zeros(experts, ffn, hidden))
    moe_ffn.moe_ffn_backward(torch.zeros_like(y), x, offsets, w13, w2, act, h13, tiles, num_programs=8,
                             main_grads=main)
    idx = torch.zeros(64, 2, dtype=torch.int32)
    permute.permute_forward(torch.zeros(64, hidden, dtype=dtype), idx, experts)
    assert compiled.count("_ragged_rows_gemm_kernel") == 4 and compiled.count("_ragged_weight_grad_kernel") == 2
    assert "_block_histogram_kernel" in compiled


@pytest.mark.parametrize("top_k", [2, 8])
def test_the_combine_loads_every_destination_before_its_first_sum(monkeypatch, top_k):
    """The combine's forward is compiled per top-k with its k loop unrolled (`permute.combine_forward`): no loop
    in its SASS, every 32-bit load (the pairs' destinations and weights) issued before the first FFMA of the sum,
    so each program waits for one round trip of them, not one per k; no spills at the Qwen3 config's hidden."""
    import re

    from disagmoe.kernels import permute

    backend, built = make_backend(HOPPER), []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: built.append(
        compile_for_hopper(self, backend, args, kwargs)))
    tokens, hidden = 64, 2048
    permute.combine_forward(torch.zeros(tokens * top_k, hidden, dtype=torch.bfloat16),
                            torch.zeros(tokens, top_k, dtype=torch.int32), torch.zeros(tokens, top_k),
                            residual_TH=torch.zeros(tokens, hidden, dtype=torch.bfloat16))
    (kernel,) = built
    assert ptxas_usage(kernel.asm["ptx"])[1] == 0
    sass = sass_of(kernel)
    with pytest.raises(AssertionError, match="no loop"):  # no k loop
        _first_loop_sass(sass)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0]
           for line in sass.splitlines() if (m := re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line))]
    first_sum = ops.index("FFMA")
    assert ops[first_sum:].count("LDG.E") == 0 and ops[:first_sum].count("LDG.E") >= 2 * top_k


def test_the_banded_weight_grads_compile(compiled):
    """The weight gradients over G = 2 x E row groups (segment-major order): the backward's two
    launches into fp32 main gradients, and a flattening tile config (not applied when banded)."""
    import dataclasses

    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels import moe_ffn

    rows, experts, hidden, ffn = 128, 4, 64, 32
    dtype = torch.bfloat16
    tiles = moe_ffn.FFNTiles.uniform(_tiles())
    x = torch.zeros(rows, hidden, dtype=dtype)
    offsets_G = torch.tensor([16, 32, 48, 64, 80, 96, 112, 128], dtype=torch.int32)
    w13, w2 = torch.zeros(experts, hidden, 2 * ffn, dtype=dtype), torch.zeros(experts, ffn, hidden, dtype=dtype)
    act, h13 = torch.zeros(rows, ffn, dtype=dtype), torch.zeros(rows, 2 * ffn, dtype=dtype)
    main = (torch.zeros(experts, hidden, 2 * ffn), torch.zeros(experts, ffn, hidden))
    moe_ffn.moe_ffn_backward(torch.zeros(rows, hidden, dtype=dtype), x, offsets_G, w13, w2, act, h13, tiles,
                             num_programs=8, main_grads=main)
    flat = dataclasses.replace(_tiles(), flatten=True)
    gg.ragged_weight_grad(x, h13, offsets_G, flat, weights=experts, num_programs=8)
    assert compiled.count("_ragged_weight_grad_kernel") == 3


def test_the_swiglu_grad_gemm_does_not_spill_at_its_tiles(usage):
    """The down data gradient with the SwiGLU-gradient epilogue (`grouped_gemm._swiglu_grad_epilogue`)
    for sm_90a at the heuristic down_dgrad tile (the tuned one on an H200: 128 x 128 x 64, 8 warps) and
    at 64 x 128 on 4 warps (two programs per SM fit at <= 255 registers), as the FFN launches it:
    plain, and fused (row scale, gathered token rows), each with and without the SwiGLU output
    recomputed: no spill stores, and registers below the 255 cap (the whole tile at once: 255 and
    732 bytes of spill stores with the row scale; in 16-column chunks 198-230 registers). Every
    down_dgrad tile `bench tune-experts` times in chunks (`tune_experts.DOWN_DGRAD_CANDIDATES`),
    fused with the output recomputed (the most registers), no spill stores either."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import TileConfig, heuristic

    found = usage.found
    rows, experts, hidden, ffn = 1024, 4, 2048, 768
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    dy, h13 = torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16)
    w2_t = torch.zeros(experts, ffn, hidden, dtype=torch.bfloat16).transpose(1, 2)
    small = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4, programs_per_sm=2)
    for tile in (heuristic("down_dgrad"), small):
        for fused in (False, True):
            for act in (None, torch.zeros(rows, ffn, dtype=torch.bfloat16)):
                usage.label = f"{tile.block_m}x{tile.block_n}/{tile.num_warps} fused={fused} act={act is not None}"
                kw = {}
                if fused:
                    kw = dict(a_rows_N=torch.zeros(rows, dtype=torch.int64),
                              row_scale=(torch.zeros(rows), torch.zeros(ffn // tile.block_n, rows)))
                gg.ragged_rows_gemm(dy, offsets, w2_t, tile, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                                    act_N_C=act, num_programs=8, **kw)
    assert len(found) == 8, found
    assert all(spill == 0 for _, _, spill in found), found
    assert all(registers <= 240 for _, registers, _ in found), found
    found.clear()
    chunked = [c for c in tuner.candidates("down_dgrad")  # the split epilogue's: the next test's
               if c.epilogue_chunk < c.block_n and not c.split_epilogue]
    for tile in chunked:
        usage.label = str(tile)
        gg.ragged_rows_gemm(dy, offsets, w2_t, tile, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                            act_N_C=torch.zeros(rows, ffn, dtype=torch.bfloat16), num_programs=8,
                            a_rows_N=torch.zeros(rows, dtype=torch.int64),
                            row_scale=(torch.zeros(rows), torch.zeros(ffn // tile.block_n, rows)))
    assert len(found) == len(chunked) >= 6 and all(spill == 0 for _, _, spill in found), found

def test_message_values_are_not_specialised_on():
    """A flag index or timeout compiles no new variant (`kernels.signal.MESSAGE_VALUES`): one that
    did would load a module while a wait of the same process spins (the H200 run of the
    fused-return test: seq 1 in the warm-up, seq 2 after, the expert launch stuck behind). The
    senders take no message value at all (flags count: `kernels.signal`)."""
    from disagmoe.kernels import fused_return, grouped_gemm, signal, sparse_dispatch

    kernels = (signal._raise_flag_kernel, signal._wait_flag_kernel, fused_return._combine_landed_kernel)
    for kernel in kernels:
        values = [p.name for p in kernel.params if p.name in signal.MESSAGE_VALUES]
        assert values and all(p.do_not_specialize for p in kernel.params if p.name in values), kernel.fn.__name__
    for sender in (grouped_gemm._ragged_rows_gemm_kernel, sparse_dispatch._dispatch_rows_kernel):
        assert not {"seq", "value"} & {p.name for p in sender.params}, sender.fn.__name__


def test_the_fp8_quantisers_and_gemm_compile(compiled):
    """The e4m3 quantisers (bf16 and fp32 in) and the FP8 grouped GEMMs (fp8 tl.dot with an explicit
    max_num_imprecise_acc): forward with a full-depth and a half-depth K tile, the data gradient on
    the transposed blocks, the weight gradient into an fp32 main gradient, the gate/up GEMM with the
    SwiGLU-and-quantise epilogue, the down data gradient with the SwiGLU-gradient epilogue, the
    quantising permute, the token-group quantiser reading rows from their tokens (`expert_input`
    under FP8), the one-pass row and token-group quantiser (the FP8 backward's dy and d h13), all
    for sm_90."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.tile_configs import TileConfig

    rows, experts, k, n = 256, 4, 256, 256
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    qa, sa = fp8.quantize_rows(x)
    qb, sb = fp8.quantize_blocks(torch.zeros(experts, k, n, dtype=torch.bfloat16))
    offsets = torch.tensor([64, 128, 192, 256], dtype=torch.int32)
    for tiles in (TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
                  TileConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)):
        fp8.fp8_rows_gemm(qa, sa, offsets, qb, sb, tiles, num_programs=8)
        fp8.fp8_rows_gemm(qa, sa, offsets, qb, sb, tiles, num_programs=8, imprecise_k=32)
    fp8.fp8_rows_gemm(qa, sa, offsets, *fp8.transpose_blocks(qb, sb), tiles, num_programs=8)  # dgrad
    qx, qd = fp8.quantize_token_groups(x, offsets), fp8.quantize_token_groups(torch.zeros(rows, n), offsets)
    wgrad = TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
    fp8.fp8_weight_grad(qx[:2], qd[:2], qx[2], wgrad, out=torch.zeros(experts, k, n), accumulate=True,
                        num_programs=8)
    for tiles in (TileConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
                  TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)):
        fp8.fp8_swiglu_gemm(qa, sa, offsets, qb, sb, tiles, h13_M2F=torch.zeros(rows, n, dtype=torch.bfloat16),
                            num_programs=8)
    h13 = torch.zeros(rows, 2 * n, dtype=torch.bfloat16)
    fp8.fp8_swiglu_grad_gemm(qa, sa, offsets, *fp8.transpose_blocks(qb, sb), h13, _tiles(),
                             act_MF=torch.zeros(rows, n, dtype=torch.bfloat16), num_programs=8)
    from disagmoe.kernels import permute

    permute.quantize_then_permute(torch.zeros(64, 300, dtype=torch.bfloat16), torch.zeros(64, 2, dtype=torch.int32))
    fp8.quantize_token_groups(torch.zeros(rows // 2, k, dtype=torch.bfloat16), offsets,
                              rows_M=torch.zeros(rows, dtype=torch.int64))
    fp8.quantize_rows_and_token_groups(x, offsets, valid_rows=offsets[-1:])
    fp8.quantize_rows_and_token_groups(torch.zeros(rows, n), offsets)
    assert compiled == (["_quantize_rows_kernel", "_quantize_blocks_kernel"] + ["_fp8_rows_gemm_kernel"] * 5
                        + ["_quantize_token_groups_kernel"] * 2 + ["_fp8_weight_grad_kernel"]
                        + ["_fp8_rows_gemm_kernel"] * 3
                        + ["_quantize_rows_kernel", "_permute_copy_kernel", "_permute_copy_kernel"]
                        + ["_quantize_token_groups_kernel"] + ["_quantize_rows_and_token_groups_kernel"] * 2)


def test_the_default_fp8_tiles_do_not_spill(monkeypatch):
    """ptxas (sm_90a) on the FP8 kernels at `fp8_ffn.Fp8Tiles`' defaults: no spill stores in the
    quantisers and the row GEMMs with each epilogue (the two-accumulator SwiGLU tile spills at
    4 warps, the SwiGLU-gradient one did with its loads before the loop); the weight gradient's
    tile spills a few bytes (12 measured; 792 at 128 x 128 x 128), bounded here."""
    from disagmoe.kernels import fp8, fp8_ffn

    backend = make_backend(HOPPER)
    spills: list[tuple[str, int]] = []

    def compile_and_count(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        spills.append((self.fn.__name__, spill_store_bytes(kernel.asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_count)
    tiles = fp8_ffn.Fp8Tiles()
    rows, experts, k, n = 512, 4, 512, 256
    offsets = torch.tensor([128, 256, 384, 512], dtype=torch.int32)
    qa, sa = fp8.quantize_rows(torch.zeros(rows, k, dtype=torch.bfloat16))
    q13, s13 = fp8.quantize_blocks(torch.zeros(experts, k, 2 * n, dtype=torch.bfloat16))
    fp8.fp8_swiglu_gemm(qa, sa, offsets, q13, s13, tiles.swiglu, h13_M2F=torch.zeros(rows, 2 * n, dtype=torch.bfloat16),
                        num_programs=8)
    w2t = fp8.transpose_blocks(*fp8.quantize_blocks(torch.zeros(experts, n, k, dtype=torch.bfloat16)))
    fp8.fp8_swiglu_grad_gemm(qa, sa, offsets, *w2t, torch.zeros(rows, 2 * n, dtype=torch.bfloat16), tiles.swiglu,
                             act_MF=torch.zeros(rows, n, dtype=torch.bfloat16), num_programs=8)
    fp8.fp8_rows_gemm(qa, sa, offsets, *w2t, tiles.rows, num_programs=8)
    qx = fp8.quantize_token_groups(torch.zeros(rows, k, dtype=torch.bfloat16), offsets)
    fp8.fp8_weight_grad(qx[:2], qx[:2], qx[2], tiles.wgrad, out=torch.zeros(experts, k, k), accumulate=True,
                        num_programs=8)
    wgrad = [b for name, b in spills if name == "_fp8_weight_grad_kernel"]
    assert wgrad and max(wgrad) <= 64, spills
    assert all(b == 0 for name, b in spills if name != "_fp8_weight_grad_kernel"), spills
    assert len(spills) == 8, spills



def test_the_fp8_swiglu_grad_gemm_finishes_its_tile_in_column_chunks(usage):
    """ptxas (sm_90a) on `fp8.fp8_swiglu_grad_gemm` at `fp8_ffn.Fp8Tiles().swiglu` (64 x 128 x 128,
    8 warps), with and without the SwiGLU output recomputed, in each K-loop promotion: the epilogue
    in 16-column chunks (`fp8._swiglu_grad_epilogue`) keeps the inline default at 172 registers
    (the whole tile at once: 255, on an accumulator of 32 per thread), the others below the cap
    with no spill stores (whole tile: hoisted 255, pipelined 255 and 64-76 bytes of spill stores,
    pingpong's halves 173-184; chunked: 128, 212-237, 158-164)."""
    import dataclasses

    from disagmoe.kernels import fp8, fp8_ffn

    found = usage.found
    rows, experts, hidden, ffn = 1024, 4, 2048, 768
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    dy, sdy = torch.zeros(rows, hidden, dtype=fp8.FP8), torch.ones(rows, hidden // 128)
    w2t, sw2t = torch.zeros(experts, hidden, ffn, dtype=fp8.FP8), torch.ones(experts, hidden // 128, ffn // 128)
    h13 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16)
    default = fp8_ffn.Fp8Tiles().swiglu
    assert default.promote == "inline" and default.epilogue_chunk == 16
    for promote in fp8.PROMOTE_VARIANTS:
        for act in (None, torch.zeros(rows, ffn, dtype=torch.bfloat16)):
            usage.label = f"{promote} act={act is not None}"
            fp8.fp8_swiglu_grad_gemm(dy, sdy, offsets, w2t, sw2t, h13, dataclasses.replace(default, promote=promote),
                                     act_MF=act, num_programs=8)
    assert len(found) == 2 * len(fp8.PROMOTE_VARIANTS), found
    assert all(spill == 0 and registers < 255 for _, registers, spill in found), found
    assert all(registers <= 200 for launch, registers, _ in found if launch.startswith("inline")), found


def test_every_expert_gemm_feeds_hopper_mma_through_the_async_pipeline(monkeypatch):
    """The expert FFN's GEMMs, bf16 and FP8, forward and backward, compiled for sm_90: each is a
    wgmma (MMA v3) whose operands both arrive by asynchronous copies into shared memory, none
    staged through registers (`local_alloc` of a loaded tensor). An N-major FP8 B operand or FP8
    tokens of unknown alignment take that slow path (the FP8 experts measured 0.15x our bf16 ones
    with it); the interpreter cannot see it, the compiler's TTGIR does."""
    import re

    from disagmoe.kernels import fp8_ffn, moe_ffn
    from disagmoe.kernels.fp8_stats import Fp8Stats

    backend = make_backend(HOPPER)
    gemms: list[tuple[str, str]] = []

    def compile_and_keep(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        if "warp_group_dot" in kernel.asm["ttgir"] or "tt.dot" in kernel.asm["ttgir"]:
            gemms.append((self.fn.__name__, kernel.asm["ttgir"]))

    monkeypatch.setattr(JITFunction, "run", compile_and_keep)
    rows, experts, hidden, ffn = 512, 4, 512, 256
    offsets = torch.tensor([100, 256, 256, 512], dtype=torch.int32)  # ragged, one expert empty
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    w13 = torch.zeros(experts, hidden, 2 * ffn, dtype=torch.bfloat16)
    w2 = torch.zeros(experts, ffn, hidden, dtype=torch.bfloat16)
    fp8_tiles = fp8_ffn.Fp8Tiles()
    for stats in (None, Fp8Stats("cpu")):  # a precision: fp8 run counts (issue 21's numerics) in the same kernels
        weights = fp8_ffn.Fp8ExpertWeights.quantize(w13, w2, stats)
        fp8_ffn.fp8_ffn_forward(x, offsets, weights, fp8_tiles, save_for_backward=True, num_programs=8, stats=stats)
        fp8_ffn.fp8_ffn_backward(x, x, offsets, weights, torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16),
                                 fp8_tiles, num_programs=8, stats=stats)
    tiles = moe_ffn.FFNTiles.for_shape(rows, experts, hidden, ffn, torch.device("cpu"))
    _, act, h13 = moe_ffn.moe_ffn_forward(x, offsets, w13, w2, tiles, save_for_backward=True, num_programs=8)
    moe_ffn.moe_ffn_backward(x, x, offsets, w13, w2, act, h13, tiles, num_programs=8,
                             main_grads=(torch.zeros(w13.shape), torch.zeros(w2.shape)))
    names = [name for name, _ in gemms]
    assert names.count("_fp8_rows_gemm_kernel") == 8 and names.count("_fp8_weight_grad_kernel") == 4, names
    assert names.count("_ragged_rows_gemm_kernel") == 4 and names.count("_ragged_weight_grad_kernel") == 2, names
    for name, ttgir in gemms:
        assert "versionMajor = 3" in ttgir and "warp_group_dot " in ttgir, f"{name}: not a Hopper wgmma"
        staged = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<[^>]*>", ttgir)
        assert not staged, f"{name}: operands staged through registers, outside the pipeline: {staged}"
        assert "async_copy_global_to_local" in ttgir, f"{name}: no asynchronous operand copies"


def test_the_fp8_counters_compile_with_their_atomics_and_no_spills(monkeypatch):
    """The quantisers (the one-pass row and token-group one too), the SwiGLU epilogue and the FP8
    permute's quantiser with a stats row (STATS: five atomics per tile, or per program in the persistent
    quantisers: `fp8._record_stats`, `fp8._add_counts`) compile for sm_90a
    at `Fp8Tiles`' defaults with no spill stores, and their PTX holds the int64 atomics (a max and
    adds); without a row, no atomics."""
    from disagmoe.kernels import fp8, fp8_ffn, permute
    from disagmoe.kernels.fp8_stats import Fp8Stats

    backend = make_backend(HOPPER)
    found: list[tuple[str, int, bool]] = []

    def compile_and_count(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        ptx = kernel.asm["ptx"]
        atomics = "atom.global" in ptx and ".max.s64" in ptx and ".add.u64" in ptx
        found.append((self.fn.__name__, spill_store_bytes(ptx), atomics))

    monkeypatch.setattr(JITFunction, "run", compile_and_count)
    stats = Fp8Stats("cpu")
    tiles = fp8_ffn.Fp8Tiles()
    rows, experts, k, n = 512, 4, 512, 256
    offsets = torch.tensor([128, 256, 384, 512], dtype=torch.int32)
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    qa, sa = fp8.quantize_rows(x, stats.row(0))
    q13, s13 = fp8.quantize_blocks(torch.zeros(experts, k, 2 * n, dtype=torch.bfloat16), stats.row(1))
    fp8.fp8_swiglu_gemm(qa, sa, offsets, q13, s13, tiles.swiglu, h13_M2F=torch.zeros(rows, 2 * n, dtype=torch.bfloat16),
                        num_programs=8, stats=stats.row(0))
    fp8.quantize_token_groups(x, offsets, stats.row(2))
    permute.quantize_then_permute(torch.zeros(64, 300, dtype=torch.bfloat16), torch.zeros(64, 2, dtype=torch.int32),
                                  stats.row(0))
    fp8.quantize_rows_and_token_groups(x, offsets, stats.row(2), offsets[-1:])
    counted = [f for f in found if f[0] != "_permute_copy_kernel"]  # the e4m3 rows' copies: no counters
    assert [name for name, _, _ in counted] == ["_quantize_rows_kernel", "_quantize_blocks_kernel",
                                                "_fp8_rows_gemm_kernel", "_quantize_token_groups_kernel",
                                                "_quantize_rows_kernel",
                                                "_quantize_rows_and_token_groups_kernel"], found
    assert all(spill == 0 and atomics for _, spill, atomics in counted), found
    found.clear()
    fp8.quantize_rows(x)
    assert found == [("_quantize_rows_kernel", 0, False)]


def test_the_quantising_swiglu_gradient_pass_compiles_without_spills(monkeypatch):
    """`fp8.swiglu_grad_rows_quantized` (bf16 d act, h13 and act, the FFN sizes of Qwen3 and Mixtral's
    multiple of 128) for sm_90a: the hardware's e4m3 conversion (`cvt.rn.satfinite.e4m3x2.f32`), the
    correctly rounded scale and x / scale divisions, no spill stores."""
    from disagmoe.kernels import fp8

    backend = make_backend(HOPPER)
    found: list[tuple[str, int, bool, bool]] = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        ptx = compile_for_hopper(self, backend, args, kwargs).asm["ptx"]
        found.append((self.fn.__name__, spill_store_bytes(ptx), "cvt.rn.satfinite.e4m3x2.f32" in ptx,
                      "div.rn.f32" in ptx))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    offsets = torch.tensor([100, 256], dtype=torch.int32)
    for width in (768, 128):
        fp8.swiglu_grad_rows_quantized(torch.zeros(256, width, dtype=torch.bfloat16),
                                       torch.zeros(256, 2 * width, dtype=torch.bfloat16), offsets,
                                       act_N_C=torch.zeros(256, width, dtype=torch.bfloat16))
    assert found == [("_swiglu_grad_rows_quantized_kernel", 0, True, True)] * 2, found


def test_the_rowwise_quantiser_compiles_without_spills_at_its_gpu_tiles(monkeypatch):
    """The dense projections' rowwise quantiser (`kernels.fp8_rowwise`) at `gpu_tiles` for sm_90a:
    row-major rows held whole (bf16 and fp32), long rows in chunks, a transposed view read
    column-major, each with a stats row (the int64 atomics) and without; no spill stores."""
    from disagmoe.kernels import fp8_rowwise
    from disagmoe.kernels.fp8_stats import Fp8Stats

    backend = make_backend(HOPPER)
    found: list[tuple[int, bool]] = []

    def compile_and_count(self, *args, grid, warmup, **kwargs):
        ptx = compile_for_hopper(self, backend, args, kwargs).asm["ptx"]
        found.append((spill_store_bytes(ptx), "atom.global" in ptx and ".max.s64" in ptx and ".add.u64" in ptx))

    monkeypatch.setattr(JITFunction, "run", compile_and_count)
    row = Fp8Stats("cpu").row(3)
    inputs = [torch.zeros(256, 2048, dtype=torch.bfloat16), torch.zeros(64, 1000),
              torch.zeros(16, 8192, dtype=torch.bfloat16), torch.zeros(4096, 512, dtype=torch.bfloat16).t(),
              torch.zeros(2048, 64, dtype=torch.bfloat16).t()]  # few columns: 16-row tiles
    for x in inputs:
        block_m, block_k = fp8_rowwise.gpu_tiles(x)
        for stats in (row, None):
            fp8_rowwise.quantize_rowwise(x, stats, block_m=block_m, block_k=block_k)
    assert [fp8_rowwise.gpu_tiles(x)[0] for x in inputs[-2:]] == [64, 16]  # (the CPU counts 4 SMs)
    assert found == [(0, True), (0, False)] * len(inputs), found
    found.clear()  # split over K (two launches: the amax merge has no int64 counters; the quantise has)
    for x in inputs[-2:]:
        fp8_rowwise.quantize_rowwise(x, row, split_k=True)
    assert [spill for spill, _ in found] == [0] * 4 and [counted for _, counted in found] == [False, True] * 2, found


def test_the_one_pass_row_and_token_group_quantiser_fits_its_registers(usage):
    """`fp8.quantize_rows_and_token_groups` (persistent over [128 rows, 128 columns] tiles, each
    quantised in halves: 64 rows, then 64 columns, at a time) for sm_90a at its 16 warps: bf16 and
    fp32 in, with a stats row and without, with valid_rows and without: within 16 warps' cap of 128
    registers (measured: 104-110 without counters, 127-128 with) and no spill stores (the tile held
    whole across both quantisations spilled 8-140 bytes once persistent and pipelined)."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.fp8_stats import Fp8Stats

    rows, k = 1024, 512
    offsets = torch.tensor([128, 300, 300, 1000], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for stats in (None, Fp8Stats("cpu").row(2)):
            for valid in (None, offsets[-1:]):
                usage.label = f"{dtype} stats={stats is not None} valid={valid is not None}"
                fp8.quantize_rows_and_token_groups(torch.zeros(rows, k, dtype=dtype), offsets, stats, valid)
    assert fp8._ROWS_AND_TOKEN_GROUPS_WARPS == 16 and len(usage.found) == 8, usage.found
    assert all(registers <= 128 and spill == 0 for _, registers, spill in usage.found), usage.found


SM_REGISTERS = 65536  # 32-bit registers an SM (sm_90)
SM_SHARED_BYTES = 227 * 1024  # shared memory a block may take on an H100


def _quantiser_builds(monkeypatch, name: str) -> list[tuple[dict, tuple[int, int], int, str, list[str]]]:
    """Each launch of kernel `name` while active, compiled for sm_90a: (its constexprs and num_warps, ptxas'
    registers and spill-store bytes, shared memory bytes, PTX, its first loop's SASS); `quantize_token_groups`
    at its GPU tiles (`fp8._TOKEN_GROUPS_BLOCK_K` and `_COUNTING_TOKEN_GROUPS_BLOCK_K`, not the interpreter's)."""
    from disagmoe.kernels import fp8

    backend = make_backend(HOPPER)
    found = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ == name:
            kernel = compile_for_hopper(self, backend, args, kwargs)
            ptx = kernel.asm["ptx"]
            found.append((kwargs, ptxas_usage(ptx), kernel.metadata.shared, ptx, _first_loop_sass(sass_of(kernel))))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    monkeypatch.setattr(fp8, "_token_groups_block_k", lambda device: fp8._TOKEN_GROUPS_BLOCK_K)
    monkeypatch.setattr(fp8, "_counting_token_groups_block_k", lambda device: fp8._COUNTING_TOKEN_GROUPS_BLOCK_K)
    return found


def _stores_the_transposed_copy_in_16_bytes(ptx: str) -> bool:
    """The token-contiguous e4m3 copy stored 16 bytes a thread (`st.global.v4.b32`), no byte store
    (the layout conversion before the store goes through shared memory)."""
    return "st.global.v4.b32" in ptx and "st.global.b8" not in ptx and "st.global.u8" not in ptx


def _division_checks(loop: list[str]) -> int:
    """The loop's FCHK instructions: one per correctly rounded division (its slow-path test)."""
    return sum("FCHK" in text for text in loop)


def test_the_token_group_quantisers_load_their_tiles_into_resident_programs(monkeypatch):
    """`fp8.quantize_token_groups` at its GPU tiles for sm_90a, bf16 and fp32, rows in place and
    gathered: without counters [128, 64] at 2 warps, its loads straight into registers 16 bytes a
    thread (no cp.async through shared memory: Triton read that buffer back a column a thread with
    8-way bank conflicts, and the unpipelined tile measured faster on an H100), the transposed copy
    stored 16 bytes a thread, x / scale by no division per element (the columns' reciprocals alone
    take FCHKs: at most 8 a loop, where a division per element would take 128), and
    `_TOKEN_GROUPS_PROGRAMS_PER_SM` programs (4) fit an SM's registers and shared memory (255
    registers a thread measured, bf16: exactly); counting, [128, 32] at 4 warps, unpipelined, and
    `_COUNTING_TOKEN_GROUPS_PROGRAMS_PER_SM` (2) fit. None spills."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.fp8_stats import Fp8Stats

    found = _quantiser_builds(monkeypatch, "_quantize_token_groups_kernel")
    offsets = torch.tensor([1000, 1000, 3000, 4096], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for stats in (None, Fp8Stats("cpu").row(0)):
            for rows_M in (None, torch.arange(4096)):
                fp8.quantize_token_groups(torch.zeros(4096, 2048, dtype=dtype), offsets, stats, rows_M=rows_M)
    assert len(found) == 8
    for kwargs, (registers, spill), shared, ptx, loop in found:
        assert kwargs["STAGES"] == 1 and spill == 0, (kwargs, spill)
        assert _stores_the_transposed_copy_in_16_bytes(ptx), kwargs
        assert "cp.async" not in ptx and "ld.global.v4" in ptx, kwargs
        threads = 32 * kwargs["num_warps"]
        if kwargs["STATS"]:
            assert (kwargs["BLOCK_K"], kwargs["num_warps"]) == (32, 4) == (
                fp8._COUNTING_TOKEN_GROUPS_BLOCK_K, fp8._COUNTING_TOKEN_GROUPS_WARPS), kwargs
            assert registers * threads * fp8._COUNTING_TOKEN_GROUPS_PROGRAMS_PER_SM <= SM_REGISTERS, (kwargs, registers)
            continue
        assert (kwargs["BLOCK_K"], kwargs["num_warps"]) == (64, 2) == (
            fp8._TOKEN_GROUPS_BLOCK_K, fp8._TOKEN_GROUPS_WARPS), kwargs
        assert registers * threads * fp8._TOKEN_GROUPS_PROGRAMS_PER_SM <= SM_REGISTERS, (kwargs, registers)
        assert shared * fp8._TOKEN_GROUPS_PROGRAMS_PER_SM <= SM_SHARED_BYTES, (kwargs, shared)
        # a division per element would take 128 x BLOCK_K / threads FCHKs a thread
        assert _division_checks(loop) <= kwargs["BLOCK_K"] // 8, (kwargs, _division_checks(loop))


def test_the_one_pass_quantiser_pipelines_its_loads_and_stores_the_transposed_copy_in_16_bytes(monkeypatch):
    """`fp8.quantize_rows_and_token_groups` for sm_90a, bf16 without counters (the backward's dy and d h13):
    one persistent program an SM (at most 128 registers a thread at 16 warps; no spill), its loads
    software-pipelined 3 deep (cp.async into shared memory, within an H100 block's shared memory), the
    transposed copy stored 16 bytes a thread, x / scale without a division per element (4 FCHK a loop:
    the rows' and columns' reciprocals; 82 in the one-program-a-tile kernel it replaced), and its loop at
    most 1,600 instructions a thread for a [128, 128] tile (1,359 measured; the kernel it replaced issued
    about 1,850 for one, 2,288 with its divisions' slow-path calls). Counting or fp32 in: unpipelined."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.fp8_stats import Fp8Stats

    found = _quantiser_builds(monkeypatch, "_quantize_rows_and_token_groups_kernel")
    offsets = torch.tensor([1000, 1000, 3000, 4096], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for stats in (None, Fp8Stats("cpu").row(0)):
            fp8.quantize_rows_and_token_groups(torch.zeros(4096, 2048, dtype=dtype), offsets, stats, offsets[-1:])
    assert [(kwargs["STATS"], kwargs["STAGES"]) for kwargs, *_ in found] == [(False, 3), (True, 1), (False, 1),
                                                                            (True, 1)]
    (kwargs, (registers, spill), shared, ptx, loop) = found[0]
    assert registers * 32 * kwargs["num_warps"] <= SM_REGISTERS and spill == 0 and shared <= SM_SHARED_BYTES
    assert "cp.async.cg.shared.global" in ptx and "ld.global.v4" not in ptx
    assert _stores_the_transposed_copy_in_16_bytes(ptx)
    assert _division_checks(loop) <= 8 and len(loop) <= 1600, (_division_checks(loop), len(loop))


def dot_waits(ttgir: str) -> list[str]:
    """Per `ttng.warp_group_dot` of a TTGIR: "sync" when a `warp_group_dot_wait {pendings = 0}` on its
    result follows it at once (Triton's wgmma pipeliner does so for a dot whose result is used in its
    own loop iteration), else "async": the dot runs on after it is issued (its result carried to the
    next iteration, whose first synchronous dot's wait completes it)."""
    import re

    lines = [line.strip() for line in ttgir.splitlines() if line.strip()]
    waits = []
    for line, after in zip(lines, lines[1:]):
        dot = re.match(r"(%[\w#]+) = ttng\.warp_group_dot ", line)
        if dot:
            waited = re.match(r"%\S+ = ttng\.warp_group_dot_wait " + re.escape(dot.group(1)) + r"\b.*pendings = 0\b",
                              after)
            waits.append("sync" if waited else "async")
    return waits


def fmas_under_wgmma(ptx: str) -> int:
    """fp32 FMAs and multiplies issued while a wgmma group is in flight: between a
    `wgmma.commit_group` and the next `wgmma.wait_group` in the PTX's text (the promotion's scaled
    adds running under a carried dot's wgmma)."""
    count, in_flight = 0, False
    for line in ptx.splitlines():
        op = line.strip()
        if op.startswith("wgmma.commit_group"):
            in_flight = True
        elif op.startswith("wgmma.wait_group"):
            in_flight = False
        elif in_flight and op.startswith(("fma.rn.f32", "mul.f32", "mul.rn.f32")):
            count += 1
    return count


# (promote, launch) pairs allowed to spill where the inline loop does not: "pipelined" holds three
# accumulator-sized tiles per dot (the sum, the carried second half, the next one), six in the
# SwiGLU GEMM (gate and up), too many at `Fp8Tiles.swiglu`'s 64 x 128 on 8 warps (ptxas: 524 and
# 56 bytes of spill stores measured); the tuner times it there as any other tile.
PROMOTION_SPILLS = {("pipelined", "swiglu"), ("pipelined", "swiglu_grad")}


def test_each_fp8_promotion_compiles_to_its_overlap(monkeypatch):
    """The FP8 GEMMs at `Fp8Tiles`' defaults with each K-loop promotion (`fp8.PROMOTE_VARIANTS`),
    compiled for sm_90a: wgmma (MMA v3) fed by asynchronous copies; spill stores no more than the
    inline loop's at the same tile (but `PROMOTION_SPILLS`); and the overlap each variant exists for:
    inline and hoisted wait for every dot at once and add nothing under a wgmma, pipelined and
    pingpong leave a dot of each K loop running (`dot_waits`) while their scaled adds issue
    (`fmas_under_wgmma`). Fails if Triton starts waiting for the carried dot at once."""
    import dataclasses
    import re

    from disagmoe.kernels import fp8, fp8_ffn

    backend = make_backend(HOPPER)
    found: dict[tuple[str, str], tuple] = {}
    launch = [""]

    def compile_and_keep(self, *args, grid, warmup, **kwargs):
        if "PROMOTE" not in kwargs:  # the quantisers
            return
        kernel = compile_for_hopper(self, backend, args, kwargs)
        ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
        staged = re.findall(r"ttg\.local_alloc %\S+ : \(tensor<[^>]*>", ttgir)
        mma3 = "versionMajor = 3" in ttgir and not staged and "async_copy_global_to_local" in ttgir
        found[(kwargs["PROMOTE"], launch[0])] = (dot_waits(ttgir), fmas_under_wgmma(ptx), spill_store_bytes(ptx), mma3)

    monkeypatch.setattr(JITFunction, "run", compile_and_keep)
    rows, experts, k, n = 512, 4, 512, 256
    offsets = torch.tensor([128, 256, 384, 512], dtype=torch.int32)
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    weights = fp8_ffn.Fp8ExpertWeights.quantize(torch.zeros(experts, k, 2 * n, dtype=torch.bfloat16),
                                                torch.zeros(experts, n, k, dtype=torch.bfloat16))  # K-major
    qa, sa = fp8.quantize_rows(x)
    qx = fp8.quantize_token_groups(x, offsets)
    defaults = fp8_ffn.Fp8Tiles()
    for promote in fp8.PROMOTE_VARIANTS:
        tiles = fp8_ffn.Fp8Tiles(**{field.name: dataclasses.replace(getattr(defaults, field.name), promote=promote)
                                    for field in dataclasses.fields(defaults)})
        launch[0] = "swiglu"
        fp8.fp8_swiglu_gemm(qa, sa, offsets, *weights.w13, tiles.swiglu, num_programs=8,
                            h13_M2F=torch.zeros(rows, 2 * n, dtype=torch.bfloat16))
        launch[0] = "swiglu_grad"
        fp8.fp8_swiglu_grad_gemm(qa, sa, offsets, *weights.w2_t, torch.zeros(rows, 2 * n, dtype=torch.bfloat16),
                                 tiles.swiglu,
                                 act_MF=torch.zeros(rows, n, dtype=torch.bfloat16), num_programs=8)
        launch[0] = "rows"
        fp8.fp8_rows_gemm(qa[:, :n], sa[:, :n // 128], offsets, *weights.w2, tiles.rows, num_programs=8)
        launch[0] = "wgrad"
        fp8.fp8_weight_grad(qx[:2], qx[:2], qx[2], tiles.wgrad, out=torch.zeros(experts, k, k), accumulate=True,
                            num_programs=8)
    assert len(found) == 4 * len(fp8.PROMOTE_VARIANTS), found
    table = "\n".join(f"{key}: {value}" for key, value in found.items())
    for (index, name), (waits, fmas, spill, mma3) in found.items():
        promote = fp8.PROMOTE_VARIANTS[index]
        assert mma3 and waits, f"{promote} {name}: not wgmma fed by asynchronous copies\n{table}"
        if (promote, name) not in PROMOTION_SPILLS:
            assert spill <= found[(0, name)][2], f"{promote} {name}: spills more than inline\n{table}"
        overlapped = promote in ("pipelined", "pingpong")
        assert ("async" in waits) == overlapped and (fmas > 0) == overlapped, f"{promote} {name}\n{table}"


def test_the_fp8_tuners_candidates_compile_without_spills(monkeypatch):
    """Every FP8 tile `bench tune-experts --precision fp8` times (`tune_experts.FP8_CANDIDATES`),
    each on both launches its role serves, compiles for sm_90a to wgmma without spill stores (the
    list's promise: a GPU's tuning time goes to tiles that can win), and its promotion's overlap is
    there (`dot_waits`: a dot left running in pipelined and pingpong loops, none in the others)."""
    from disagmoe.bench import tune_experts as tuner

    backend = make_backend(HOPPER)
    found: list[tuple[list[str], int]] = []

    def compile_and_count(self, *args, grid, warmup, **kwargs):
        if "PROMOTE" in kwargs:  # not the quantisers making the operands
            kernel = compile_for_hopper(self, backend, args, kwargs)
            found.append((dot_waits(kernel.asm["ttgir"]), spill_store_bytes(kernel.asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_count)
    offsets = torch.tensor([300, 700, 1024, 1024], dtype=torch.int32)
    launches = tuner.fp8_role_launches(offsets, 1024, 512)
    bad = []
    for role, launch in launches.items():
        for config in tuner.candidates(role):
            found.clear()
            launch(config)
            overlapped = config.promote in ("pipelined", "pingpong")
            if len(found) != 2 or any(spill or ("async" in waits) != overlapped for waits, spill in found):
                bad.append((role, config, list(found)))
    assert not bad, bad


def test_the_adamw_update_compiles_to_one_layout_with_correctly_rounded_fp32_division(monkeypatch):
    """The one-pass AdamW (`kernels.adamw`) for sm_90a, fp32 and bf16 moments, with every option: no
    layout conversion through shared memory (at 8 elements per thread the fp32 stores took another
    layout: 3 conversions, 6 barriers), 16-byte accesses to the fp32 tensors, no spill stores, and
    the fp32 divisions and square root correctly rounded (div.rn / sqrt.rn, as nvcc compiles torch's
    kernel; Triton's plain `/` would be div.full), the fp64 ones too; the per-element fp64 multiply-
    adds contracted to FMAs (as in torch's kernel, which nvcc compiles with contraction on)."""
    from disagmoe.kernels import adamw

    backend = make_backend(HOPPER)
    found = []

    def compile_and_read(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        found.append((kernel.asm["ttgir"], kernel.asm["ptx"], ptxas_usage(kernel.asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_read)
    n = 1 << 16
    for moments in (torch.float32, torch.bfloat16):
        adamw.adamw_update(torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments),
                           torch.zeros(()), torch.zeros(()), torch.zeros(4, dtype=torch.float64), torch.ones(()),
                           torch.zeros(()), torch.zeros(n, dtype=torch.bfloat16), num_programs=8)
    assert len(found) == 2
    for ttgir, ptx, (registers, spills) in found:
        assert "convert_layout" not in ttgir and "bar.sync" not in ptx
        assert spills == 0 and registers <= 128, registers
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx and "div.full" not in ptx and "sqrt.approx" not in ptx
        assert "fma.rn.f64" in ptx and "cvt.rn.f32.f64" in ptx


def test_the_atomic_weight_gradient_adds_with_reductions_and_no_spills(monkeypatch):
    """`TileConfig.atomic_accumulate` at the tuner's first wgrad tile and the heuristic's, into an fp32
    main gradient, for sm_90a: the PTX's relaxed vector atomics (`atom.global.gpu.relaxed.add.v4.f32`,
    result unused) become fire-and-forget reductions in the SASS (`REDG.E.ADD.F32x4`, which flush
    denormals: `.FTZ`), with no spill stores; the plain accumulation has none of them. Found here
    (2026-12-03): the heuristic tile (64 x 256 x 128, 8 warps) spills 252 bytes with the plain
    load-add-store epilogue, none with the atomic one."""
    import dataclasses

    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import heuristic

    backend = make_backend(HOPPER)
    found: list[tuple[bool, bool, int]] = []
    atomic_now = [False]

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        sass = sass_of(kernel)
        found.append((atomic_now[0], "REDG.E.ADD.F32x4.FTZ" in sass and "ATOMG" not in sass,
                      spill_store_bytes(kernel.asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    x, dh, offsets, main = _wgrad_operands()
    for tile in (tuner.candidates("wgrad_w13")[0], heuristic("wgrad_w13")):
        for atomic in (False, True):
            atomic_now[0] = atomic
            gg.ragged_weight_grad(x, dh, offsets, dataclasses.replace(tile, atomic_accumulate=atomic), out=main,
                                  accumulate=True, num_programs=8)
    assert [(atomic, reduces) for atomic, reduces, _ in found] == [(False, False), (True, True)] * 2, found
    assert [spills for atomic, _, spills in found if atomic] == [0, 0], found


def test_the_prefetching_weight_gradient_reads_the_main_gradient_before_its_mmas_without_spills(monkeypatch):
    """`TileConfig.prefetch_accumulator` at every prefetching wgrad tile the tuner offers, bf16 rows into
    an fp32 main gradient, for sm_90a: every global load of the tile (the main gradient's 16 x 16 bytes a
    thread, and the offsets) comes before its first wgmma in the SASS, none spills, and each stays within
    the registers (at most 255); the same tile without it loads the main gradient after the MMAs. Found
    here (2026-12-06): at 4 warps, or a 64 x 256 output tile at 8, the prefetched values spill (688-832
    bytes), so the tuner offers only 8-warp tiles of at most 128 x 128."""
    import dataclasses
    import re

    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg

    backend = make_backend(HOPPER)
    found: list[tuple[bool, bool, int]] = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        lines = [line for line in sass_of(kernel).splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        first_mma = next(i for i, line in enumerate(lines) if "HGMMA" in line)
        loads_after = sum("LDG.E" in line for line in lines[first_mma:])
        found.append((kwargs["PREFETCH"], loads_after == 0, spill_store_bytes(kernel.asm["ptx"])))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    x, dh, offsets, main = _wgrad_operands()
    tiles = [tile for tile in tuner.candidates("wgrad_w13") if tile.prefetch_accumulator]
    assert len(tiles) >= 2
    for tile in tiles:
        for early in (True, False):
            gg.ragged_weight_grad(x, dh, offsets, dataclasses.replace(tile, prefetch_accumulator=early), out=main,
                                  accumulate=True, num_programs=8)
    assert found == [(True, True, 0), (False, False, 0)] * len(tiles), found


def test_the_tma_weight_gradient_loads_by_tensor_map_without_spills(monkeypatch):
    """`TileConfig.tma` at the tuner's TMA wgrad tiles, bf16 rows into an fp32 main gradient with the
    atomic epilogue, for sm_90a: the whole row steps load through the tensor maps (PTX
    `cp.async.bulk.tensor`, the descriptors passed as kernel parameters), the MMA reads the
    transposed A box from shared memory (`wgmma`), and no tile spills."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg

    backend = make_backend(HOPPER)
    found: list[tuple[bool, bool, int]] = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        ptx = compile_for_hopper(self, backend, args, kwargs).asm["ptx"]
        found.append(("cp.async.bulk.tensor" in ptx, "wgmma.mma_async" in ptx, spill_store_bytes(ptx)))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    x, dh, offsets, main = _wgrad_operands()
    tiles = [tile for tile in tuner.candidates("wgrad_w13") if tile.tma and not tile.prefetch_accumulator]
    assert tiles and all(tile.atomic_accumulate for tile in tiles)  # (the prefetching ones: the test above)
    for tile in tiles:
        gg.ragged_weight_grad(x, dh, offsets, tile, out=main, accumulate=True, num_programs=8)
    assert found == [(True, True, 0)] * len(tiles), found


def _wgrad_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, dh, offsets, main): a weight gradient's bf16 rows (4 experts of 256 rows, K 256, C 512) and the fp32
    main gradient [4, 256, 512] it adds into, on the CPU (the launch is only compiled)."""
    rows, experts, hidden, cols = 1024, 4, 256, 512
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    x, dh = torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.zeros(rows, cols, dtype=torch.bfloat16)
    return x, dh, offsets, torch.zeros(experts, hidden, cols)


def _row_gemm_launches(split_down_dgrad: bool) -> dict:
    """The bf16 FFN's four row GEMM launches over CPU operands (4 experts of 256 rows, hidden 512, ffn 256), each a
    function of its tile: gate/up with its SwiGLU epilogue, down, down dgrad (its fused SwiGLU-gradient epilogue, or
    with `split_down_dgrad` the split epilogue's plain GEMM, as the split tile launches it) and gate/up dgrad."""
    import dataclasses

    from disagmoe.kernels import grouped_gemm as gg

    rows, experts, hidden, ffn = 1024, 4, 512, 256
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    bf16 = dict(dtype=torch.bfloat16)
    x, dy = torch.zeros(rows, hidden, **bf16), torch.zeros(rows, hidden, **bf16)
    h13, dh13 = torch.zeros(rows, 2 * ffn, **bf16), torch.zeros(rows, 2 * ffn, **bf16)
    act = torch.zeros(rows, ffn, **bf16)
    w13, w2 = torch.zeros(experts, hidden, 2 * ffn, **bf16), torch.zeros(experts, ffn, hidden, **bf16)
    if split_down_dgrad:
        def down_dgrad(c):
            return gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), dataclasses.replace(c, split_epilogue=False),
                                       num_programs=8)
    else:
        def down_dgrad(c):
            return gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), c, epilogue=gg.EPILOGUE_SWIGLU_GRAD,
                                       h13_N2C=h13, num_programs=8)
    return {
        "gate_up": lambda c: gg.ragged_rows_gemm(x, offsets, w13, c, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13,
                                                 out=act, num_programs=8),
        "down": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c, num_programs=8),
        "down_dgrad": down_dgrad,
        "gate_up_dgrad": lambda c: gg.ragged_rows_gemm(dh13, offsets, w13.transpose(1, 2), c, num_programs=8),
    }


def test_the_tma_row_gemms_load_by_tensor_map_without_spills(monkeypatch):
    """`TileConfig.tma` in the row GEMMs at every TMA tile the tuner offers, bf16, for sm_90a: the gate/up
    SwiGLU launch and the down launch (weights as rows), the down data gradient with its fused
    SwiGLU-gradient epilogue and the gate/up data gradient (transposed weights): each loads through the
    tensor maps (`cp.async.bulk.tensor`) and runs wgmma, and spills no more than the same tile loading
    through pointers (found here: the flattened 128 x 128 x 32 gate/up tile spills 24 bytes with pointers,
    52 with TMA: left out of the TMA candidates; the plain one 4 and 0); a gathered A loads through
    pointers (no tensor map)."""
    import dataclasses

    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg

    backend = make_backend(HOPPER)
    found: list[tuple[str, bool, bool, int]] = []
    label = [""]

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        ptx = compile_for_hopper(self, backend, args, kwargs).asm["ptx"]
        found.append((label[0], "cp.async.bulk.tensor" in ptx, "wgmma.mma_async" in ptx, spill_store_bytes(ptx)))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    launches = _row_gemm_launches(split_down_dgrad=False)
    bad = []
    for role, launch in launches.items():
        for tile in tuner.candidates(role):
            if tile.tma and not tile.library and not tile.split_epilogue and not tile.tma_store:  # (the next test's)
                label[0] = f"{role} {tile}"
                launch(tile)
                if found[-1][1:3] != (True, True):
                    bad.append(found[-1])
                elif found[-1][3]:  # spills: no more than its pointer-loading twin
                    launch(dataclasses.replace(tile, tma=False))
                    if found[-2][3] > found[-1][3]:
                        bad.append((found[-2], found[-1][3]))
    assert {label.split()[0] for label, *_ in found} == set(launches)
    assert not bad, bad
    found.clear()
    gathered = next(t for t in tuner.candidates("down") if t.tma)
    act, w2 = torch.zeros(1024, 256, dtype=torch.bfloat16), torch.zeros(4, 256, 512, dtype=torch.bfloat16)
    gg.ragged_rows_gemm(act, torch.tensor([256, 512, 768, 1024], dtype=torch.int32), w2, gathered,
                        a_rows_N=torch.arange(1024, dtype=torch.int32), num_programs=8)
    assert [f[1] for f in found] == [False]


def test_the_row_gemms_store_by_tensor_map_where_the_tuner_offers_it(monkeypatch):
    """`TileConfig.tma_store` at every tile the tuner offers it on (`tile_configs.tma_store_fits`), bf16, for sm_90a:
    the gate/up SwiGLU launch with its pre-activations, the down launch, the gate/up data gradient and down dgrad's
    split plain GEMM each store through a tensor map (`cp.async.bulk.tensor.2d.global.shared::cta`) from one
    [block_m, block_n] buffer beside the ring, within a Hopper's shared memory as the tuner's arithmetic says, and
    without the TMA-loading twin's store instructions; ptxas keeps at most one register for the item loop in local
    memory (found: 4-8 bytes of spill stores at the gate/up tiles, one store before the item loop and one load at
    its end, none in the K loop), none at the plain epilogue's tiles."""
    import dataclasses
    import re

    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels.tile_configs import HOPPER_SHARED_MEMORY_BYTES

    backend = make_backend(HOPPER)
    found = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        ptx = kernel.asm["ptx"]
        stores = len(re.findall(r"st\.global", ptx))
        found.append(("cp.async.bulk.tensor.2d.global.shared::cta" in ptx, spill_store_bytes(ptx),
                      kernel.metadata.shared, stores))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    launches = _row_gemm_launches(split_down_dgrad=True)
    bad, tried = [], 0
    for role, launch in launches.items():
        for tile in (t for t in tuner.candidates(role) if t.tma_store):
            tried += 1
            launch(dataclasses.replace(tile, tma_store=False))
            launch(tile)
            (_, _, loaded_shared, loaded_stores), (bulk, spilled, shared, stores) = found[-2:]
            buffer = tile.block_m * tile.block_n * 2
            if not bulk or shared != loaded_shared + buffer or shared > HOPPER_SHARED_MEMORY_BYTES \
                    or spilled > (8 if role == "gate_up" else 0) or stores > loaded_stores:
                bad.append((role, tile, found[-2:]))
    assert tried >= 4 * 6 and not bad, bad


def test_the_weight_gradient_reduce_adds_by_tensor_map_where_the_tuner_offers_it(monkeypatch):
    """`TileConfig.tma_store` in the weight gradient at every tile the tuner offers it on, bf16 rows into an fp32
    main gradient with the atomic epilogue, for sm_90a: each tile's two halves of rows reduce-added through a tensor
    map (`cp.reduce.async.bulk.tensor`) from one [block_k / 2, block_n] fp32 buffer beside the ring, within a
    Hopper's shared memory, without spills (the tuner's winner on Mixtral's w13 and w2 on an H200, 64 x 256 x 128
    at 3 stages, fits only so: the whole tile's buffer would take 128 KiB)."""
    import dataclasses

    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import HOPPER_SHARED_MEMORY_BYTES, TileConfig

    backend = make_backend(HOPPER)
    found = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        kernel = compile_for_hopper(self, backend, args, kwargs)
        ptx = kernel.asm["ptx"]
        found.append((ptx.count("cp.reduce.async.bulk.tensor"), spill_store_bytes(ptx), kernel.metadata.shared))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    x, dh, offsets, main = _wgrad_operands()
    tiles = [t for t in tuner.candidates("wgrad_w13") if t.tma_store]
    assert TileConfig(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3, atomic_accumulate=True,
                      tma=True, tma_store=True) in tiles
    bad = []
    for tile in tiles:
        gg.ragged_weight_grad(x, dh, offsets, dataclasses.replace(tile, tma_store=False), out=main, accumulate=True,
                              num_programs=8)
        gg.ragged_weight_grad(x, dh, offsets, tile, out=main, accumulate=True, num_programs=8)
        (_, _, loaded_shared), (reduces, spilled, shared) = found[-2:]
        buffer = tile.block_k // 2 * tile.block_n * 4
        if reduces != 2 or spilled or not buffer <= shared - loaded_shared <= buffer + 2048 \
                or shared > HOPPER_SHARED_MEMORY_BYTES:
            bad.append((tile, found[-2:]))
    assert not bad, bad


def _first_loop_sass(sass: str) -> list[str]:
    """The SASS instructions of a kernel's first loop: from the first backward branch's target to it."""
    import re

    lines = [(int(m.group(1), 16), line) for line in sass.splitlines()
             if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line))]
    for address, line in lines:
        branch = re.search(r"BRA (?:!?P\d, )?0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            return [text for at, text in lines if start <= at <= address]
    raise AssertionError("no loop in the SASS")


def _loops_without_and_with_counters(monkeypatch, name: str,
                                     launch) -> dict[bool, tuple[list[str], tuple[int, int]]]:
    """`launch(stats_row)` called without a stats row and with one, its kernel `name` compiled for sm_90a
    each time (any other kernel it launches is skipped): by STATS, (the first loop's SASS,
    `_first_loop_sass`; ptxas' registers and spill-store bytes)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats

    backend = make_backend(HOPPER)
    found: dict[bool, tuple[list[str], tuple[int, int]]] = {}

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ == name:
            kernel = compile_for_hopper(self, backend, args, kwargs)
            found[kwargs["STATS"]] = (_first_loop_sass(sass_of(kernel)), ptxas_usage(kernel.asm["ptx"]))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    launch(None)
    launch(Fp8Stats("cpu").row(0))
    return found


def _barriers(loop: list[str]) -> int:
    return sum("BAR.SYNC" in text for text in loop)


def _assert_no_barrier_or_spill_added(found: dict[bool, tuple[list[str], tuple[int, int]]]) -> None:
    """The counting loop (`_loops_without_and_with_counters`) holds as many barriers as the plain one, at
    most 40% more instructions, and neither spills."""
    (plain, (_, plain_spills)), (counted, (_, spills)) = found[False], found[True]
    assert _barriers(counted) == _barriers(plain), (_barriers(counted), _barriers(plain))
    assert len(counted) <= 7 * len(plain) // 5, (len(counted), len(plain))
    assert spills == plain_spills == 0, found


def test_the_rows_quantisers_counters_add_no_barrier_to_its_loop(monkeypatch):
    """`quantize_rows` with its Fp8Stats counters, for sm_90a: the tile loop holds no more barriers than
    the loop without counters (each element position and row position keeps its counts in registers,
    summed once a program), and at most a third more instructions. Found here (2026-12-04): the
    clean-tile count it replaced reduced across the program's warps three times a tile, its loop 20
    barriers against 2 (`disagmoe bench quantise` measured those counters at 2.96x the quantiser's
    time on an H200)."""
    from disagmoe.kernels import fp8

    x = torch.zeros(4096, 2048, dtype=torch.bfloat16)
    found = _loops_without_and_with_counters(monkeypatch, "_quantize_rows_kernel",
                                             lambda row: fp8.quantize_rows(x, row))
    loops = {stats: loop for stats, (loop, _) in found.items()}
    barriers = {stats: _barriers(loop) for stats, loop in loops.items()}
    assert barriers[True] == barriers[False], barriers
    assert len(loops[True]) <= 4 * len(loops[False]) // 3, (len(loops[True]), len(loops[False]))


@pytest.mark.parametrize("dtype,gathered", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_the_token_group_quantisers_counters_add_no_barrier_to_its_loop(monkeypatch, dtype, gathered):
    """`quantize_token_groups` with its Fp8Stats counters (rows read in place or gathered from their
    tokens), for sm_90a: the tile loop holds no more barriers than the loop without counters, at most
    40% more instructions, and no spill stores: both unpipelined (as both launch since session 41) at one
    tile and warp count (the counting launch's 4 warps; on the GPU the uncounted one runs [128, 64] at 2:
    `test_the_token_group_quantisers_load_their_tiles_into_resident_programs`). Before, one program a
    tile with the clean-tile count: 21 barriers a program with counters against 6 without, and five
    atomics a tile."""
    from disagmoe.kernels import fp8

    monkeypatch.setattr(fp8, "_TOKEN_GROUPS_STAGES", 1)
    monkeypatch.setattr(fp8, "_TOKEN_GROUPS_WARPS", fp8._COUNTING_TOKEN_GROUPS_WARPS)
    x = torch.zeros(4096, 2048, dtype=dtype)
    offsets = torch.tensor([1000, 1000, 3000, 4096], dtype=torch.int32)
    rows_M = torch.arange(4096) if gathered else None
    found = _loops_without_and_with_counters(monkeypatch, "_quantize_token_groups_kernel",
                                             lambda row: fp8.quantize_token_groups(x, offsets, row, rows_M=rows_M))
    _assert_no_barrier_or_spill_added(found)


@pytest.mark.parametrize("transposed", [True, False])
def test_the_split_rowwise_quantisers_counters_add_no_barrier_to_its_loop(monkeypatch, transposed):
    """`fp8_rowwise.quantize_rowwise(split_k=True)`'s quantising launch (64 x 64 tiles; x^T read
    column-major, and row-major x) with its counters, for sm_90a: the tile loop holds no more
    barriers than without counters (2, and 0 row-major), at most 40% more instructions (253 against
    200, 218 against 163 measured), and no spill stores. Before, one program a tile: 10 and 8
    barriers a program with counters against 1 and 0 without, and five atomics a tile."""
    from disagmoe.kernels import fp8_rowwise

    bf16 = dict(dtype=torch.bfloat16)
    x = torch.zeros(4096, 512, **bf16).t() if transposed else torch.zeros(256, 2048, **bf16)
    found = _loops_without_and_with_counters(monkeypatch, "_split_quantize_kernel",
                                             lambda row: fp8_rowwise.quantize_rowwise(x, row, split_k=True))
    _assert_no_barrier_or_spill_added(found)


def test_the_split_swiglu_gradient_epilogue_compiles_without_spills(usage):
    """`TileConfig.split_epilogue`: the plain down data gradient, then `swiglu_grad_rows` (with the
    recomputed SwiGLU output and the row dots, and without them) compile for sm_90a, and the
    elementwise pass holds its block in registers (no spill stores)."""
    import dataclasses

    import triton

    from disagmoe.kernels import grouped_gemm as gg

    rows, hidden, ffn, experts = 128, 128, 96, 4
    dtype = torch.bfloat16
    offsets = torch.tensor([32, 64, 96, 128], dtype=torch.int32)
    dy, h13 = torch.zeros(rows, hidden, dtype=dtype), torch.zeros(rows, 2 * ffn, dtype=dtype)
    w2_t = torch.zeros(experts, ffn, hidden, dtype=dtype).transpose(1, 2)
    split = dataclasses.replace(_tiles(), split_epilogue=True)
    rowdot = torch.zeros(triton.cdiv(ffn, split.block_n), rows)
    usage.label = "split launch"
    gg.ragged_rows_gemm(dy, offsets, w2_t, split, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                        act_N_C=torch.zeros(rows, ffn, dtype=dtype), row_scale=(torch.ones(rows), rowdot))
    usage.label = "plain pass"
    gg.swiglu_grad_rows(torch.zeros(rows, ffn, dtype=dtype), h13, offsets)
    labels = [label for label, _, _ in usage.found]
    assert labels == ["split launch", "split launch", "plain pass"], labels  # the GEMM, then the pass
    assert all(spills == 0 for label, _, spills in usage.found[1:]), usage.found


def test_the_paired_weight_gradient_compiles_at_the_tuned_tiles_without_spills(monkeypatch):
    """`ragged_weight_grad(second=...)` (`kernels.wgrad_pairs`: two micro-batches' rows in one launch) at the H100's
    tuned Qwen3 wgrad tiles, flattened and not (64 x 256 x 128, 8 warps, atomic, TMA), bf16 rows into an fp32 main
    gradient, for sm_90a: both row sets load through their tensor maps (four descriptors, each passed as a kernel
    parameter), the MMAs stay wgmma, and nothing spills: the second row loop costs no registers the first needs."""
    import dataclasses

    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import lookup

    backend = make_backend(HOPPER)
    found: list[tuple[int, bool, int]] = []

    def compile_and_look(self, *args, grid, warmup, **kwargs):
        assert kwargs["PAIRED"]
        ptx = compile_for_hopper(self, backend, args, kwargs).asm["ptx"]
        found.append((ptx.count(".param .align 64 .b8"), "wgmma.mma_async" in ptx, spill_store_bytes(ptx)))

    monkeypatch.setattr(JITFunction, "run", compile_and_look)
    rows, experts, hidden, cols = 1024, 4, 256, 512
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    sets = [(torch.zeros(rows, hidden, dtype=torch.bfloat16), torch.zeros(rows, cols, dtype=torch.bfloat16), offsets)
            for _ in range(2)]
    main = torch.zeros(experts, hidden, cols)
    tuned = lookup("wgrad_w2", 768, 2048, 65536, 128, "NVIDIA H100 80GB HBM3")
    assert tuned.tma and tuned.atomic_accumulate and tuned.flatten
    for tile in (tuned, dataclasses.replace(tuned, flatten=False)):
        gg.ragged_weight_grad(*sets[0], tile, out=main, accumulate=True, num_programs=8, second=sets[1])
    assert found == [(4, True, 0)] * 2, found  # an unpaired launch passes 2 (a and b)


def test_the_quantising_swiglu_epilogue_compiles_at_the_gate_up_tiles_without_spills(usage):
    """The default FP8 recipe's bf16 gate/up GEMM writing the down GEMM's e4m3 act and scales from its SwiGLU
    epilogue (`ragged_rows_gemm(quantized_out=)`), bf16 for sm_90a at every tuned gate/up tile of both GPUs'
    tables that takes it and the heuristic's (128 columns: `swiglu_quantizes`), through pointers and TMA, and with
    its pre-activations stored by TMA (`tma_store`): it compiles without spilling (the launch writing bf16 act
    spills 4 bytes at one of them)."""
    import dataclasses
    import json
    from pathlib import Path

    from disagmoe.kernels import fp8_rounding
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import TileConfig, heuristic

    tables = Path(gg.__file__).parent / "tuned"
    tiles = {heuristic("gate_up"), *(TileConfig(**{k: v for k, v in entry.items() if k in TileConfig.__dataclass_fields__})
                                     for table in tables.glob("*.json")
                                     for key, entry in json.loads(table.read_text())["entries"].items()
                                     if key.startswith("gate_up/"))}
    tiles = sorted((t for t in tiles if gg.swiglu_quantizes(t)), key=str)
    assert len(tiles) >= 3
    rows, experts, hidden, ffn = 1024, 4, 512, 384
    offsets = torch.tensor([256, 512, 768, 1024], dtype=torch.int32)
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    w13 = torch.zeros(experts, hidden, 2 * ffn, dtype=torch.bfloat16)
    h13 = torch.zeros(rows, 2 * ffn, dtype=torch.bfloat16)
    q = torch.zeros(rows, ffn, dtype=fp8_rounding.FP8)
    s = torch.zeros(rows, ffn // 128, dtype=torch.float32)
    tiles += [dataclasses.replace(tile, tma=True, tma_store=True) for tile in tiles if not tile.flatten]  # h13 by TMA
    for tile in tiles:
        usage.label = str(tile)
        gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13, num_programs=8)
        gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13, num_programs=8,
                            quantized_out=(q, s))
    assert len(usage.found) == 2 * len(tiles)
    # none spills (the plain launch spills 4 bytes at 128 x 128 x 32): the epilogue saves h13 before it quantises;
    # with h13 by TMA at most 8 bytes (found at 128 x 128 x 32, 5 stages: two registers stored before the item loop
    # and reloaded in its epilogue, none in the K loop)
    spilled = [(plain, fused) for plain, fused in zip(usage.found[::2], usage.found[1::2])
               if fused[2] > (8 if "tma_store=True" in fused[0] else 0)]
    assert not spilled, spilled


def test_the_combines_backward_compiles_quantising_dy_without_spills(usage):
    """The weighted combine's backward that also writes the FP8 experts' dy rows in e4m3 with their 1 x 128
    scales (`permute.combine_backward_quantized`, one scale group a program), bf16 for sm_90a at top-8 as
    at top-2: no spills, beside the plain launch."""
    from disagmoe.kernels import permute

    hidden = 512
    for top_k in (2, 8):
        tokens = 64
        dest = torch.arange(tokens * top_k, dtype=torch.int32).view(tokens, top_k)
        dy, rows = torch.zeros(tokens, hidden, dtype=torch.bfloat16), torch.zeros(tokens * top_k, hidden,
                                                                                    dtype=torch.bfloat16)
        weights = torch.zeros(tokens, top_k, dtype=torch.bfloat16)
        usage.label = f"top-{top_k} plain"
        permute.combine_backward(dy, rows, dest, weights)
        usage.label = f"top-{top_k} quantising"
        permute.combine_backward_quantized(dy, rows, dest, weights)
    assert [label for label, *_ in usage.found] == ["top-2 plain", "top-2 quantising", "top-8 plain", "top-8 quantising"]
    assert not [found for found in usage.found if found[2]], usage.found


def test_the_fused_cross_entropy_compiles_without_spills(usage):
    """The LM head's fused softmax cross-entropy (`kernels.cross_entropy`) for sm_90a in bf16 at the config's
    vocabulary (one 4,096 block a row), a published one (151,936: the online max over 4,096 blocks) and a small
    one, with and without the gradient pass: no spill stores."""
    from disagmoe.kernels import cross_entropy as ce

    for vocab in (4096, 151_936, 50):
        for divisor in (None, 8192.0):
            usage.label = f"V={vocab} grad={divisor is not None}"
            ce.softmax_cross_entropy_(torch.zeros(8, vocab, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int64),
                                      divisor)
    assert len(usage.found) == 6 and all(spill == 0 for _, _, spill in usage.found), usage.found
