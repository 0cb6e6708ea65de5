"""The native backend's fused reduction kernel alone, on one GPU: terms from the receive regions
vs terms read in place from the source's input (the pull path), for rank 0 of bench_comm's
2-rank reduce layout. Every "peer" address is local here, so this times the kernel's own cost
(loads, address arithmetic, the DONE step), not NVLink; bench_comm times the transport. The
device time alone is timed (the host enqueues every call while the GPU sleeps).

    source .dk/bin/env.sh && python tools/bench_reduce_kernel.py [--sizes 16,64] [--iters 50]

GB/s counts the bytes the kernel reads from the peer's side (S MiB: what crosses NVLink in the
2-GPU run). A device-to-device copy of S MiB is timed beside for scale.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_comm import ROW, ROW_BYTES, layout  # tools/ is first on sys.path when run as a script


def _time(fn, iters: int) -> float:
    """Seconds per call on the device alone: the GPU first sleeps (~0.1 ms per call) while the
    host enqueues every call, so the launch path's host time is hidden (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(iters * 200_000)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def run(mib: float, iters: int, shapes=((None, None),)) -> list[tuple[str, float, float]]:
    """Per (tile rows, warps) in ``shapes`` (None: the default) both paths, then the copy:
    ``(name, seconds, GB/s of peer bytes)``; every configuration's result is checked bitwise."""
    from magi_comm._plan import build_reduce_plan
    from magi_comm.backends.native import protocol as proto
    from magi_comm.backends.native.kernels import launch_reduce
    from magi_comm.backends.native.terms import (
        build_pull_terms,
        build_reduce_terms,
        publish_row,
        publish_table,
    )

    W, dev = 2, torch.device("cuda")
    rows = int(mib * (1 << 20)) // ROW_BYTES
    plans = []
    for r in range(W):
        ins, outs, dst, src = layout(r, W, rows)
        plans.append(build_reduce_plan(outs, ins, src, dst, r, W))  # the transposed layout
    me, peer = 0, 1
    R = max(plans[peer].send_counts[me], 1)
    E = ROW[0] * ROW[1]
    inputs = [torch.randn((p.num_input_rows, E), device=dev).to(torch.bfloat16) for p in plans]
    region = torch.empty((R, E), dtype=torch.bfloat16, device=dev)
    # the region holds what the peer would have sent: its rows for us, in pair order
    ids = plans[peer].send_split_ids[me]
    off = [0]
    for n in plans[peer].input_split_sizes:
        off.append(off[-1] + n)
    region.copy_(torch.cat([inputs[peer][off[i] : off[i + 1]] for i in ids]))
    term_row, term_self, nterms = build_reduce_terms(plans[me], R)
    term_pull = build_pull_terms(plans[me], term_row, term_self, nterms, R)
    width = 1 + max(len(x) for x in plans[peer].send_split_ids)
    row = publish_row(publish_table(plans[peer], width, (0, 0, E * 2)), W, me)
    maps = torch.zeros((W, width), dtype=torch.int64)
    maps[peer, : row.numel()] = row
    bases = torch.tensor([[0, inputs[peer].data_ptr()]], dtype=torch.int64)
    tables = [t.to(dev) for t in (term_row, term_self, nterms, term_pull, maps, bases)]
    sig = torch.zeros(proto.NUM_SIGNALS * W, dtype=torch.int64, device=dev)
    sig_peers = torch.tensor([sig.data_ptr()] * W, dtype=torch.int64, device=dev)
    counter = torch.zeros(4, dtype=torch.int32, device=dev)
    hs = proto.Handshake(sig.data_ptr(), sig_peers.data_ptr(), counter.data_ptr(), me)
    decided = torch.zeros(W, dtype=torch.int64, device=dev)
    done = (proto.pack_done(), proto.pack_done(0, 1))  # raise DONE on the source, wait for none
    out = torch.randn((plans[me].num_output_rows, E), device=dev).to(torch.bfloat16)
    outs = {}

    def reduce(pulled: bool, rows, warps):
        m = tables[4].clone() if pulled else torch.zeros_like(tables[4])
        reg = region if not pulled else torch.full_like(region, float("nan"))

        def call():
            launch_reduce(out, inputs[me], reg, *tables[:3], acc_reduce=True, average=False,
                          pull=(tables[3], m.data_ptr(), tables[5].data_ptr(), width),
                          end=(hs, counter.data_ptr(), decided.data_ptr(), done, False), tile_rows=rows,
                          num_warps=warps)  # fmt: skip

        return call, (m, reg)

    keep, results = [], []
    for rows, warps in shapes:
        tag = (
            ""
            if rows is None and warps is None
            else f" {rows or 'default'} rows x {warps or 'default'} warps"
        )
        for name, pulled in (("regions", False), ("pull", True)):
            call, k = reduce(pulled, rows, warps)
            keep.append(k)
            out.zero_()
            call()
            outs[name + tag] = out.clone()
            results.append((name + tag, _time(call, iters)))
    ref = next(iter(outs.values()))
    assert all(torch.equal(o, ref) for o in outs.values()), "paths or shapes disagree"
    nbytes = R * E * 2
    a, b = (
        torch.empty(nbytes, dtype=torch.uint8, device=dev),
        torch.empty(nbytes, dtype=torch.uint8, device=dev),
    )
    results.append(("d2d copy", _time(lambda: b.copy_(a), iters)))
    return [(name, sec, nbytes / sec / 1e9) for name, sec in results]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64", help="MiB the peer sends (bench_comm's S)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="tile rows 1..64 x warps 1..16")
    ap.add_argument("--shapes", default="", help="tile shapes to time, 'rows x warps,...' (e.g. 1x4,2x8)")
    args = ap.parse_args()
    shapes = (
        [(r, w) for r in (1, 2, 4, 8, 16, 32, 64) for w in (1, 2, 4, 8, 16)] if args.sweep else [(None, None)]
    )
    if args.shapes:
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
    print(f"## fused reduction kernel alone, {torch.cuda.get_device_name()}\n")
    print("| MiB | path | us | GB/s of peer bytes |\n|---:|---|---:|---:|")
    for mib in (float(s) for s in args.sizes.split(",")):
        run(mib, 3, shapes[:1])  # warm-up (clocks, caches)
        for name, sec, gbs in run(mib, args.iters, shapes):
            print(f"| {mib:g} | {name} | {sec * 1e6:.1f} | {gbs:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
