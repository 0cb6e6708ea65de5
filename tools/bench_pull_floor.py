"""The floor of a pull group_reduce on 2 GPUs: what any protocol with a per-call READY and DONE can
reach against the raw peer copy (issue 19's "group_reduce >= 80% of the raw copy").

    source .dk/bin/env.sh && torchrun --standalone --nproc-per-node 2 tools/bench_pull_floor.py [--sizes 16,64]

Each rank's input (S MiB of bf16) lies in the native backend's symmetric receive buffer (used
raw: no native call is in flight), and each rank reduces the peer's input into its own output:
``out = out + own + peer`` in float32 (the memory traffic of bench_comm's reduce-sym: the peer's
rows read over NVLink, the own rows and the output locally). Printed, both ranks at once:

* signal round trips: a stream memory operation (``cuStreamWriteValue32`` into the peer,
  ``cuStreamWaitValue32`` on the own word), a one-program kernel each way, and one kernel
  that ping-pongs in a loop (pure in-kernel latency, no launches);
* the raw copies (``copy_`` over the peer view: copy engine; push and pull), the share of the
  push (bench_comm's raw copy) that every row below reaches;
* the pull + add kernel alone (no protocol: the kernel's own ceiling), per tile shape;
* one launch per call (`pull_add` with ``PROTOCOL``): program 0 raises READY on the peer, every
  program waits for the peer's READY, then its tiles; the last program raises DONE on the peer
  and waits for the peer's DONE (its input read): the fewest launches and handshakes a call that
  lets the caller reuse its input at once can make. No arm (who accepts pulls is taken as
  agreed), no headers (the peer's rows are where they were last time).

GB/s per rank = S / time per call (slowest rank, host ahead: the device's time alone).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ffa_kernels._kv_ready import stream_wait_value32, stream_write_value32

MIB = 1 << 20
FLAGS_AT = 200 * MIB  # byte offset of the flag words in the symmetric buffer (inputs below it)
SHAPES = (
    (4096, 4, 528),
    (2048, 4, 1056),
    (1024, 2, 2112),
    (1024, 2, 0),
)  # BLOCK, warps, grid (0: a tile each)


@triton.jit(do_not_specialize=["epoch"])
def pull_add(
    out, own, peer_in, my_flags, peer_flags, counter, epoch, n, BLOCK: tl.constexpr, PROTOCOL: tl.constexpr
):
    """``out = out + own + peer_in`` (float32 sums, stored in out's dtype) over ``n`` elements, programs striding
    over tiles of ``BLOCK``. ``PROTOCOL``: word 0 of the flags is READY, word 1 DONE (int32,
    raised to ``epoch``), ``counter`` a local int32 that is zero between launches."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if PROTOCOL:
        if pid == 0:
            tl.atomic_xchg(peer_flags, epoch, sem="release", scope="sys")  # my input is complete
        f = tl.load(my_flags, volatile=True)
        while f < epoch:
            f = tl.load(my_flags, volatile=True)
        never = tl.full((), -1, tl.int32)
        tl.atomic_cas(my_flags, never, never, sem="acquire", scope="sys")  # the ordering point
    t = pid
    while t < tl.cdiv(n, BLOCK):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(out + offs, mask=m).to(tl.float32)
        b = tl.load(own + offs, mask=m).to(tl.float32)
        c = tl.load(peer_in + offs, mask=m, cache_modifier=".cg").to(tl.float32)
        tl.store(out + offs, (a + b + c).to(out.dtype.element_ty), mask=m)
        t += nprog
    if PROTOCOL:
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == nprog - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(peer_flags + 1, epoch, sem="release", scope="sys")  # I read your input
            g = tl.load(my_flags + 1, volatile=True)
            while g < epoch:
                g = tl.load(my_flags + 1, volatile=True)


@triton.jit
def ping_pong(my_flag, peer_flag, iters, FIRST: tl.constexpr):
    """``iters`` round trips in one program: raise the peer's word, wait for ours (``FIRST``),
    or the other way round."""
    i = 1
    while i <= iters:
        if FIRST:
            tl.atomic_xchg(peer_flag, i, sem="release", scope="sys")
        f = tl.load(my_flag, volatile=True)
        while f < i:
            f = tl.load(my_flag, volatile=True)
        if not FIRST:
            tl.atomic_xchg(peer_flag, i, sem="release", scope="sys")
        i += 1


@triton.jit(do_not_specialize=["value"])
def raise_word(ptr, value):
    tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit(do_not_specialize=["value"])
def await_word(ptr, value):
    f = tl.load(ptr, volatile=True)
    while f < value:
        f = tl.load(ptr, volatile=True)


def flag_words(st, peer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ours, the peer's)``: the int32 flag words in the symmetric buffer, at ``FLAGS_AT``."""
    return tuple(t[FLAGS_AT : FLAGS_AT + 64].view(torch.int32) for t in (st.buf, st.peers[peer]))


def reset(flags: torch.Tensor) -> None:
    """Zero our flag words with both ranks idle: no signal of an earlier run reaches the next."""
    torch.cuda.synchronize()
    dist.barrier()
    flags.zero_()
    torch.cuda.synchronize()
    dist.barrier()


def round_trips(flags: torch.Tensor, peer_flags: torch.Tensor, rank: int, timed, log) -> None:
    """Signal round trips: stream memory operations, a kernel each way, one looping kernel."""
    count = [0]

    def memop():
        count[0] += 1
        s = torch.cuda.current_stream()
        stream_write_value32(s, peer_flags, count[0])
        stream_wait_value32(s, flags, count[0])

    def kernels():
        count[0] += 1
        raise_word[(1,)](peer_flags[1:], count[0])
        await_word[(1,)](flags[1:], count[0])

    for name, fn in (("stream memops", memop), ("a kernel each way", kernels)):
        count[0] = 0
        reset(flags)
        log(f"round trip, {name}: {timed(fn, 200, 3, True) * 1e6:6.2f} us")
    iters = 10000
    reset(flags)
    ping_pong[(1,)](flags[2:], peer_flags[2:], 10, FIRST=rank == 0)  # compiles: the ranks start apart
    reset(flags)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ping_pong[(1,)](flags[2:], peer_flags[2:], iters, FIRST=rank == 0)
    end.record()
    end.synchronize()
    log(f"round trip, one looping kernel: {start.elapsed_time(end) * 1e3 / iters:6.2f} us ({iters} in a row)")
    dist.barrier()


def pull_rows(mib: int, st, peer: int, dev, timed, log) -> None:
    """The raw copies, the pull + add alone and the one-launch call at ``mib`` MiB, checked."""
    n = mib * MIB // 2
    inp = st.buf[: n * 2].view(torch.bfloat16)
    peer_in = st.peers[peer][: n * 2].view(torch.bfloat16)
    flags, peer_flags = flag_words(st, peer)
    gen = torch.Generator(device=dev).manual_seed(1234 + mib)
    inp.copy_(torch.randn(n, device=dev, generator=gen).to(torch.bfloat16))
    own = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.randn(n, device=dev, generator=gen).to(torch.bfloat16)
    scratch = torch.empty_like(out)
    push_to = st.peers[peer][2 * n : 4 * n].view(torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    dist.barrier()
    t_push = timed(lambda: push_to.copy_(inp), 20, 3, True)
    t_pull = timed(lambda: scratch.copy_(peer_in), 20, 3, True)

    def row(name: str, t: float) -> None:
        log(f"| {mib} | {name} | {t * 1e6:7.1f} | {mib * MIB / t / 1e9:6.1f} | {100 * t_push / t:5.1f}% |")

    row("raw copy, push (copy engine)", t_push)
    row("raw copy, pull (copy engine)", t_pull)
    epoch = [0]

    def launcher(block: int, warps: int, programs: int, protocol: bool):
        def call():
            epoch[0] += 1
            pull_add[(programs,)](
                out, own, peer_in, flags, peer_flags, counter, epoch[0], n,
                BLOCK=block, PROTOCOL=protocol, num_warps=warps,
            )  # fmt: skip

        return call

    for protocol in (False, True):
        for block, warps, grid in SHAPES:
            programs = grid or triton.cdiv(n, block)
            call = launcher(block, warps, programs, protocol)
            epoch[0] = 0
            reset(flags)
            what = "one launch: READY, pull + add, DONE" if protocol else "pull + add alone"
            row(f"{what} ({block} x {warps} warps, grid {programs})", timed(call, 20, 3, True))
    # one more call, checked against its float32 sum
    ref = (out.float() + own.float() + peer_in.float()).to(torch.bfloat16)
    call()
    torch.cuda.synchronize()
    ok = torch.tensor([int(torch.equal(ref, out))], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    log(f"check {mib} MiB: out == out + own + peer on every rank: {bool(ok)}")
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,64", help="MiB each rank reduces from its peer")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if max(sizes) * MIB * 2 > FLAGS_AT:
        raise ValueError(f"--sizes: at most {FLAGS_AT // MIB // 2} MiB, got {max(sizes)}")
    from magi_comm.testing import init_torchrun_gpus

    rank, world, local_rank = init_torchrun_gpus(120)
    dev = torch.device("cuda", local_rank)
    if world != 2:
        raise SystemExit(f"bench_pull_floor: runs on 2 ranks, got {world}")
    from bench_comm import timed

    from magi_comm import GroupCollective
    from magi_comm.backends import native as native_mod

    os.environ.setdefault(native_mod.ENV_BUFFER_MB, str(FLAGS_AT // MIB + 64))
    nat = GroupCollective(None, "native")
    st = nat._backend._state
    peer = 1 - rank

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    log(f"## pull floor, 2 x {torch.cuda.get_device_name()}")
    round_trips(*flag_words(st, peer), rank, timed, log)
    log("\n| MiB | what | us per call | GB/s per rank | / raw push |\n|---|---|---|---|---|")
    for mib in sizes:
        pull_rows(mib, st, peer, dev, timed, log)
    nat.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
