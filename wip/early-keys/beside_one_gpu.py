"""wip/early-keys (twelfth session): how much a concurrent 256 MB transfer slows the one-call backward
(cp-2-like shape on one GPU), by kind: an SM elementwise copy on the same GPU, a D2D memcpy, a
copy-engine P2P copy to GPU 1 (cudaMemcpyPeerAsync), against the kernel alone."""

import statistics

import torch
from beside_common import one_call_backward

d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
torch.cuda.set_device(d0)
bwd = one_call_backward(d0)
MB = 256
src = torch.randn(MB * 2**18, device=d0)
dst0 = torch.empty_like(src)
dst1 = torch.empty(src.shape, device=d1)
side = torch.cuda.Stream(d0, priority=-1)
main = torch.cuda.current_stream(d0)


sides = {
    "none": None,
    "sm add (same GPU)": lambda: torch.add(src, 1.0, out=dst0),
    "memcpy D2D": lambda: dst0.copy_(src),
    "CE P2P to GPU 1": lambda: dst1.copy_(src, non_blocking=True),
    "2x CE P2P": lambda: (dst1.copy_(src, non_blocking=True), dst1.copy_(src, non_blocking=True)),
}
for _ in range(3):
    bwd()
torch.cuda.synchronize()
for name, work in sides.items():
    ks, ss = [], []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(main)
        if work is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                c.record(side)
                work()
                e.record(side)
        bwd()
        b.record(main)
        torch.cuda.synchronize()
        ks.append(a.elapsed_time(b))
        if work is not None:
            ss.append(c.elapsed_time(e))
    alone = []
    if work is not None:
        for _ in range(5):
            c, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c.record(main)
            work()
            e.record(main)
            torch.cuda.synchronize()
            alone.append(c.elapsed_time(e))
    print(
        f"| {name} | {statistics.median(ks):.3f} | "
        f"{statistics.median(ss) if ss else 0:.3f} | {statistics.median(alone) if alone else 0:.3f} |"
    )
