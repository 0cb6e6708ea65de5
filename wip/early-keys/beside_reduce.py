"""wip/early-keys (twelfth session), torchrun --nproc-per-node 2: the one-call backward on each GPU
with magi-comm's group_reduce of a 256 MB float32 partial (each rank's to the other) started
beside it, against the kernel alone and the reduce alone; backend from MAGI_COMM_BACKEND."""

import os
import statistics

import torch
import torch.distributed as dist
from beside_common import HK, D, one_call_backward

from magi_comm import group_reduce

rank = int(os.environ["RANK"])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
g = dist.group.WORLD
other = 1 - rank
bwd = one_call_backward(dev, seed=rank)
N, W = 32768, 2 * HK * D
part = torch.randn(N, W, device=dev)
red = torch.zeros(N, W, device=dev)
side = torch.cuda.Stream(dev, priority=-1)
main = torch.cuda.current_stream(dev)


def reduce():
    return group_reduce(part, red, [N], [N], [other], [[other]], g, async_op=True)


for _ in range(3):
    bwd()
    reduce().wait()
torch.cuda.synchronize()
rows = {}
kern = []
for name in ("kernel alone", "reduce alone", "kernel + reduce beside"):
    ks = []
    for _ in range(8):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(main)
        if name == "reduce alone":
            reduce().wait()
        elif name == "kernel alone":
            bwd()
        else:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                w = reduce()
            bwd()
            c = torch.cuda.Event(enable_timing=True)
            c.record(main)
            w.wait()
        b.record(main)
        torch.cuda.synchronize()
        ks.append(a.elapsed_time(b))
        if name == "kernel + reduce beside":
            kern.append(a.elapsed_time(c))
    rows[name] = statistics.median(ks)
rows["(its kernel to its end)"] = statistics.median(kern)
print(
    f"rank {rank} {os.environ.get('MAGI_COMM_BACKEND')}: "
    + "; ".join(f"{k_} {v_:.3f} ms" for k_, v_ in rows.items())
)
dist.destroy_process_group()
