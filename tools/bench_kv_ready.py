"""The forward with late key/value rows (``ffa_forward(kv_ready=...)``) on one GPU: what the wait
costs, and what it overlaps.

    source .dk/bin/env.sh && python tools/bench_kv_ready.py [--tokens 32768] [--remote all|half]

A cp-like call: q has T tokens, K/V have 2T rows, ``[local; remote]``; q attends to the local
keys causally and (``--remote all``) every q row to the remote ones fully (a later rank's view
of one causal document at cp 2) or (``half``) only the second half of q (the first half's tiles
read local rows only), the local slice listed
first. Hq 32, Hk 8, D 128, bf16. Timed (CUDA events, median of rounds, the four calls in turn each round):

* plain: the forward over complete rows;
* flag up: the same with ``kv_ready`` whose flag holds already (the ``wait_kv`` kernel's cost);
* in turn: a side stream "receives" the remote rows (a copy from pinned host memory, the
  slow wire's stand-in), the forward starts after it (what degree 0 does today);
* beside: the same transfer, with the forward issued at once with ``kv_ready``, the flag raised
  after the copy by a stream write (``cuStreamWriteValue32``): the local keys' blocks run while
  the rows travel.

The transfer uses no SM (a copy engine, a stream memory operation): a forward whose CTAs wait
for the flag fill every SM, and a side stream that needed one (a sleep or a fill kernel) would
never run; the wait's bound then ends the launch with an error (the first version of this tool
did exactly that). magi-dist's use needs the same: rows delivered without SMs, or SMs left free.

Each timed call checks its output against the plain one (bitwise).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ffa_kernels import KVReady, ffa_forward
from ffa_kernels._kv_ready import stream_write_value32  # no SM (see above)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768, help="q tokens (K/V rows: twice as many)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--remote", choices=("all", "half"), default="all", help="the q rows that see remote keys"
    )
    args = ap.parse_args()
    t, hq, hk, d = args.tokens, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_src = torch.randn(2 * t, 2, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = kv_src.clone()
    remote_host = kv_src[t:].cpu().pin_memory()
    k, v = kv[:, 0], kv[:, 1]
    r0 = 0 if args.remote == "all" else t // 2
    qr = torch.tensor([[0, t], [r0, t]], dtype=torch.int32, device="cuda")
    kr = torch.tensor([[0, t], [t, 2 * t]], dtype=torch.int32, device="cuda")
    types = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()

    want = ffa_forward(q, k, v, qr, kr, types)[0]
    area = t * t / 2 + (t - r0) * t  # causal local + full remote
    flops = 4 * area * hq * d
    rows: dict[str, list[float]] = {}
    value = 0

    def timed(name, body, keep: bool):
        nonlocal value
        value += 1
        if name in ("plain", "flag up"):  # the rows in place before the clock starts
            kv[t:].copy_(kv_src[t:])
            stream_write_value32(torch.cuda.current_stream(), flag, value)
        else:
            kv[t:].fill_(float("nan"))  # the remote rows, not yet arrived
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = body(start)
        end.record()
        torch.cuda.synchronize()
        assert torch.equal(out, want), name
        if keep:
            rows.setdefault(name, []).append(start.elapsed_time(end))

    def receive(start):
        side.wait_event(start)
        with torch.cuda.stream(side):
            kv[t:].copy_(remote_host, non_blocking=True)
        stream_write_value32(side, flag, value)
        return side

    def plain(start):
        return ffa_forward(q, k, v, qr, kr, types)[0]

    def flag_up(start):
        return ffa_forward(q, k, v, qr, kr, types, kv_ready=KVReady(flag, value, t))[0]

    def in_turn(start):
        s = receive(start)
        torch.cuda.current_stream().wait_stream(s)
        return ffa_forward(q, k, v, qr, kr, types)[0]

    def beside(start):
        s = receive(start)
        out = ffa_forward(q, k, v, qr, kr, types, kv_ready=KVReady(flag, value, t))[0]
        torch.cuda.current_stream().wait_stream(s)
        return out

    for r in range(args.rounds + 2):  # the calls in turn each round (the GPU's clock drifts)
        for name, body in (("plain", plain), ("flag up", flag_up), ("in turn", in_turn), ("beside", beside)):
            timed(name, body, keep=r >= 2)
    print(
        f"T {t}, K/V rows {2 * t} (remote {t}, copied from pinned host memory; q rows {r0}: on see them), Hq {hq}, Hk {hk}, D {d}, bf16"
    )
    print("| call | median ms | TFLOP/s | timings ms |\n|---|---|---|---|")
    for name, ms in rows.items():
        med = statistics.median(ms)
        print(f"| {name} | {med:.3f} | {flops / med / 1e9:.1f} | {' '.join(f'{x:.2f}' for x in ms)} |")


if __name__ == "__main__":
    main()
