# Session 43 (diagnosis): the Mixtral down GEMM (8 experts, K 14,336 -> N 4,096, 2,048 rows each) on our tuned Triton
# tile and on the Gluon rows kernel at 128 x 256 (3 stages, masked / TMA store) and 128 x 128 (4 stages), each
# launched twice (ncu: --launch-skip 0 counts both; read the second).
import dataclasses
import torch
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.moe_ffn import FFNTiles
dev = torch.device("cuda")
E, H, F, pairs = 8, 4096, 14336, 16384
offsets = (torch.arange(1, E + 1, device=dev, dtype=torch.int64) * (pairs // E)).to(torch.int32)
act = torch.randn(pairs, F, device=dev, dtype=torch.bfloat16)
w2 = torch.randn(E, F, H, device=dev, dtype=torch.bfloat16) / F**0.5
x = torch.randn(pairs, H, device=dev, dtype=torch.bfloat16)
tile = FFNTiles.for_shape(pairs, E, H, F, dev, torch.bfloat16).down
print("triton tile", tile)
for config in (dataclasses.replace(tile, gluon=False, library=False),
               dataclasses.replace(tile, gluon=True, library=False, gluon_block_m=128, gluon_block_n=256, gluon_stages=3),
               dataclasses.replace(tile, gluon=True, library=False, gluon_block_m=128, gluon_block_n=256, gluon_stages=3,
                                   gluon_tma_store=True),
               dataclasses.replace(tile, gluon=True, library=False, gluon_block_m=128, gluon_block_n=128, gluon_stages=4)):
    for _ in range(2):
        gg.ragged_rows_gemm(act, offsets, w2, config)
wg = FFNTiles.for_shape(pairs, E, H, F, dev, torch.bfloat16).wgrad_w2
main = torch.zeros(E, F, H, device=dev)
for config in (dataclasses.replace(wg, gluon=False), dataclasses.replace(wg, gluon=True, gluon_block_n=256, gluon_stages=4,
                                                                         atomic_accumulate=True)):
    for _ in range(2):
        gg.ragged_weight_grad(act, x, offsets, config, out=main, accumulate=True)
torch.cuda.synchronize()
