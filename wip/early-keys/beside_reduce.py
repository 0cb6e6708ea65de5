"""wip/early-keys (twelfth session), torchrun --nproc-per-node 2: the one-call backward on each GPU
with magi-comm's group_reduce of a 256 MB float32 partial (each rank's to the other) started
beside it, against the kernel alone and the reduce alone; backend from MAGI_COMM_BACKEND."""

import os
import statistics

import torch
import torch.distributed as dist

from ffa_kernels import ffa_backward_stage, ffa_forward
from magi_comm import group_reduce

rank = int(os.environ["RANK"])
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
g = dist.group.WORLD
other = 1 - rank
torch.manual_seed(rank)
Tq, Tk, Hq, Hk, D, doc = 32768, 65536, 32, 8, 128, 2048
qr, kr, ty = [], [], []
for i in range(Tq // doc):
    qr += [[i * doc, (i + 1) * doc]] * 2
    kr += [[i * doc, (i + 1) * doc], [Tq + i * doc, Tq + (i + 1) * doc]]
    ty += [1, 0]
qr, kr, ty = (torch.tensor(x, dtype=torch.int32, device=dev) for x in (qr, kr, ty))
bf = torch.bfloat16
q = torch.randn(Tq, Hq, D, device=dev, dtype=bf)
k = torch.randn(Tk, Hk, D, device=dev, dtype=bf)
v = torch.randn(Tk, Hk, D, device=dev, dtype=bf)
dout = torch.randn(Tq, Hq, D, device=dev, dtype=bf)
out, lse, _ = ffa_forward(q, k, v, qr, kr, ty)
dq = torch.zeros(Tq, Hq, D, device=dev)
dk = torch.zeros(Tk, Hk, D, device=dev)
dv = torch.zeros(Tk, Hk, D, device=dev)
N, W = 32768, 2 * Hk * D
part = torch.randn(N, W, device=dev)
red = torch.zeros(N, W, device=dev)
side = torch.cuda.Stream(dev, priority=-1)
main = torch.cuda.current_stream(dev)


def bwd():
    ffa_backward_stage(dout, q, k, v, out, lse, qr, kr, ty, dq, dk, dv)


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
