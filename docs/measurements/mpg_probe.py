"""Scratch probe (not a product benchmark): two processes sharing GPU 0, as ranks_per_gpu = 2 runs.

    python3 docs/measurements/mpg_probe.py none     # gloo collectives on CUDA tensors, NVSHMEM's mode, memory
    python3 docs/measurements/mpg_probe.py reduce   # ... then NVSHMEM's own on-stream all-reduce

Needs nvshmem4py (`.carry`, source .carry/install.sh). What it printed on one H200 is in
docs/benchmarks.md ("Layouts on one shared GPU").
"""

import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, port: int, mode: str) -> None:
    os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(256 << 20)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    y = torch.empty(2, device="cuda")
    dist.reduce_scatter_tensor(y, torch.arange(4.0, device="cuda"))
    z = torch.empty(8, device="cuda", dtype=torch.bfloat16)
    dist.all_gather_into_tensor(z, x.bfloat16())
    print(rank, "gloo", x.tolist(), y.tolist(), z.tolist(), flush=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        dist.all_reduce(x, async_op=True).wait()
        print(rank, "gloo under sync-debug: no host wait", flush=True)
    except RuntimeError as err:
        print(rank, "gloo under sync-debug:", type(err).__name__, str(err)[:160], flush=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    import numpy as np
    import nvshmem.core as nv
    from cuda.core import Device

    uid = nv.get_unique_id() if rank == 0 else nv.get_unique_id(empty=True)
    relayed = [uid._data.tobytes() if rank == 0 else None]
    dist.broadcast_object_list(relayed, src=0)
    if rank:
        uid._data.view(np.int8)[:] = np.frombuffer(relayed[0], dtype=np.int8)
    device = Device(0)
    device.set_current()
    nv.init(device=device, uid=uid, rank=rank, nranks=2, initializer_method="uid")
    stream = torch.cuda.current_stream()
    t = nv.tensor((4,), dtype=torch.float32)
    t.fill_(rank + 1)
    nv.barrier_all(stream=stream)
    stream.synchronize()
    print(rank, "nvshmem init_status", nv.init_status(), flush=True)  # 3: limited MPG (several PEs per GPU)
    if rank == 0:
        os.system("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader")
    dist.barrier()
    if mode == "reduce":
        out = nv.tensor((4,), dtype=torch.float32)
        nv.reduce(nv.Teams.TEAM_WORLD, out, t, "sum", stream=stream)
        stream.synchronize()
        print(rank, "nvshmem reduce", out.tolist(), flush=True)
    nv.barrier_all(stream=stream)
    stream.synchronize()
    nv.free_tensor(t)
    nv.finalize()


if __name__ == "__main__":
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, sys.argv[1] if len(sys.argv) > 1 else "none"))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    print("exit codes", [p.exitcode for p in procs])
    for p in procs:
        if p.is_alive():
            p.kill()
