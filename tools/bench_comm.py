"""GroupCast / GroupReduce bandwidth: native (NVSHMEM) vs a2av (NCCL all_to_all_single) vs raw peer copy.

    source .dk/bin/env.sh && torchrun --standalone --nproc-per-node 2 tools/bench_comm.py [--sizes 1,16,64]

Layout per rank (sizes in MiB = S): the input has S MiB of bf16 rows (8 heads x 128 = 2 KiB per
row) in 8 splits; every split goes to every other rank, and the even splits also to the rank
itself (a true cast: those splits have two destinations). Each rank's output interleaves the
splits of all sources. group_reduce runs the transposed layout (the partial rows go back and
are summed in float32 with the rank's existing output).

GB/s counts useful bytes that cross GPUs: S x (W - 1) per rank per call (what each rank sends
to the others; the self copies are free extras), divided by the time per call (slowest rank,
CUDA events, after warm-up), timed two ways: back to back (each call issued when the last one
has been issued: the host path counts) and host ahead (the GPU sleeps until the host has issued
every call: device time alone, the case of a cast issued ahead of the attention kernels it
overlaps). The same bytes define the raw limits:

* ``raw copy``: every rank at once ``copy_`` of S MiB into a peer's symmetric buffer view
  (copy engine over NVLink, the physical limit ~380 GB/s per H200 with both pushing);
* ``raw kernel``: the native copy kernel storing S MiB into a peer (SM stores over NVLink).

``cast-sym`` is the native cast into an output from ``GroupCollective.empty_output`` (symmetric
heap: direct mode, peers write the rows straight into it); ``reduce-sym`` the native reduce of
an input from ``empty_output`` (pull: receivers read the rows from it in place over NVLink). Before timing, native (both
outputs) and a2av outputs are compared bitwise. Prints one line per measurement
and a final markdown table (rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

ROW = (8, 128)
ROW_BYTES = 8 * 128 * 2
NSPLIT = 8


def layout(rank: int, world: int, rows: int):
    """group_cast arguments of the benchmark layout (see module docstring)."""
    base = rows // NSPLIT
    sizes = [base] * (NSPLIT - 1) + [rows - base * (NSPLIT - 1)]

    def dsts(r, i):
        d = [p for p in range(world) if p != r]
        return [*d, r] if i % 2 == 0 else d

    in_sizes = sizes
    dst = [dsts(rank, i) for i in range(NSPLIT)]
    out_sizes, src = [], []
    for i in range(NSPLIT):
        for k in range(world):
            s = (rank + i + k) % world  # rotate the source order per split: interleaved output
            if rank in dsts(s, i):
                out_sizes.append(sizes[i])
                src.append(s)
    return in_sizes, out_sizes, dst, src


def start_line(line: torch.Tensor, iters: int, ahead: bool) -> None:
    """Where the ranks' streams meet before timed calls: with ``ahead`` the GPU first sleeps
    ~1.5 ms per call (at ~2 GHz) so the host can enqueue them all (a native reduce's host path
    took 165-366 us a call on the H100 hosts: 0.5 ms was sometimes too short); then an
    all_reduce of ``line`` (a one-element tensor made beforehand) on the device."""
    if ahead:
        torch.cuda._sleep(iters * 3_000_000)
    dist.all_reduce(line)


def timed_calls(fn, iters: int, ahead: bool, line: torch.Tensor):
    """``iters`` calls of ``fn`` after the start line (`start_line` with ``line``). Returns the
    event recorded right before the first call and ``behind()``, to ask once the stream is
    synchronized: whether, host ahead, the host took longer to enqueue the calls than the GPU
    slept (the period is then the host's, not device time)."""
    slept, start = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    slept.record()
    start_line(line, iters, ahead)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    return start, lambda: ahead and host_ms >= slept.elapsed_time(start)


def timed(fn, iters: int, warmup: int, ahead: bool = False) -> float:
    """Seconds per call: slowest rank, CUDA events on the current stream.

    ``ahead``: the GPU first sleeps for a fixed time (~1.5 ms per call), meant to let the host
    enqueue all ``iters`` calls first, so the time is the device's alone (the host path hidden,
    as when a cast is issued ahead of the kernels it overlaps). NaN when the host took longer
    than the sleep on some rank (no device time to report). Either way the ranks' streams meet
    in an all_reduce right before the first timed call, so no rank's time includes waiting for
    another rank to start."""
    for _ in range(warmup):
        fn()
    line = torch.zeros(1, device=torch.cuda.current_device())
    torch.cuda.synchronize()
    dist.barrier()
    start, behind = timed_calls(fn, iters, ahead, line)
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    t = torch.tensor([start.elapsed_time(end) / 1e3 / iters, float(behind())], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float("nan") if t[1] else float(t[0])


def host_profile(fn, rank: int, iters: int = 50, top: int = 25) -> None:
    """Host microseconds per call (no synchronisation: the launch path only), then where they go
    (cProfile of ``iters`` calls, printed by rank 0; every rank makes the calls)."""
    import cProfile
    import time

    from profile_host import print_profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        print(f"host path: {host:.1f} us per call", flush=True)
        print_profile(prof, top)


def peer_push(
    state,
    rank: int,
    world: int,
    words: int,
    block_words: int,
    dev,
    fenced: bool = True,
    num_warps: int = 8,
    max_programs: int = 0,
):
    """A copy-kernel launch (built once) that pushes ``words`` int64 words from a source address
    to the next rank's symmetric buffer: call it as ``launch(src_address, 0, stream)``.
    ``max_programs``: the grid cap, as the backend's ``NativeConfig.max_programs`` (0: none)."""
    from magi_comm.backends.native.kernels import CopyLaunch
    from magi_comm.backends.native.layout import TaskTable, to_blocks

    peer = (rank + 1) % world
    peer_addr = [None] * world
    peer_addr[peer] = state.peer_addr[peer]
    dst_rows = torch.full((1, world + 1), -1, dtype=torch.int64)
    dst_rows[0, peer] = 0
    table = to_blocks(
        TaskTable(torch.zeros(1, dtype=torch.int64), torch.tensor([words]), dst_rows), 1, block_words
    )
    fence = state.fence_addr if fenced else 0
    return CopyLaunch(
        table.to(dev),
        peer_addr,
        torch.int64,
        vec=2,
        fence=fence,
        num_warps=num_warps,
        max_programs=max_programs,
    )


def sweep_kernel(nat, rank: int, world: int, dev, mib: float, iters: int = 20) -> None:
    """GB/s of the raw copy kernel pushing ``mib`` MiB to the next rank, per block size and warp
    count (rank 0 prints; the backend's setting is NativeConfig.block_bytes / num_warps)."""
    state, cap = nat._backend._state, nat._backend.config.max_programs
    nbytes = int(mib * (1 << 20)) // 16 * 16
    x = torch.randn(nbytes // 2, device=dev).to(torch.bfloat16)
    for block_bytes in (8192, 16384, 32768, 65536):
        for warps in (4, 8, 16):
            push = peer_push(
                state, rank, world, nbytes // 8, block_bytes // 8, dev, num_warps=warps, max_programs=cap
            )
            sec = timed(lambda push=push: push(x.data_ptr(), 0, None), iters, 3)
            if rank == 0:
                print(f"kernel {mib:g} MiB block {block_bytes:6d} B warps {warps:2d}: "
                      f"{sec * 1e6:8.1f} us {nbytes / sec / 1e9:7.1f} GB/s", flush=True)  # fmt: skip
    torch.cuda.synchronize()
    dist.barrier()


def signal_latency(nat, rank: int, world: int, dev, iters: int = 50) -> None:
    """Microseconds per step of the native backend's stream-ordered pieces, alone (rank 0 prints):
    a signal to the peer plus the wait for the peer's signal; a one-block copy kernel with and
    without its system-scope fence."""
    from magi_comm.backends.native.protocol import READY

    st = nat._backend._state
    peer, source = (rank + 1) % world, (rank - 1) % world
    count = [0]  # signals from the source so far (a fresh backend: its slots are zeroed below)
    x = torch.zeros(1024, dtype=torch.int64, device=dev)
    fenced = peer_push(st, rank, world, 1024, 1024, dev)
    plain = peer_push(st, rank, world, 1024, 1024, dev, fenced=False)
    torch.cuda.synchronize()

    def sig():
        count[0] += 1
        st.signal(READY, peer)
        st.wait(READY, source, count[0])

    def copy_fenced():
        fenced(x.data_ptr(), 0, st.stream)

    def copy_plain():
        plain(x.data_ptr(), 0, st.stream)

    for name, fn in (("signal+wait", sig), ("copy 8 KiB fenced", copy_fenced), ("copy 8 KiB", copy_plain)):
        for _ in range(5):
            fn()
        st.stream.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(st.stream)
        for _ in range(iters):
            fn()
        b.record(st.stream)
        b.synchronize()
        if rank == 0:
            print(f"{name:20s} {a.elapsed_time(b) / iters * 1e3:8.1f} us per step (GPU)", flush=True)
        dist.barrier()
    st.sig.zero_()  # leave the counters as a fresh backend would find them
    torch.cuda.synchronize()
    dist.barrier()


def trace(fn, rank: int, name: str, iters: int = 10, ahead: bool = False) -> None:
    """torch.profiler timeline (CPU and GPU) of ``iters`` calls: a table on rank 0, and Chrome
    traces ``comm_trace_<name>_rank<r>.json`` in $OUT (or the working directory). ``ahead``: the
    calls host ahead, as :func:`timed` makes them (the GPU sleeps while the host enqueues them,
    the ranks' streams start together); every rank then prints its trace's summary per call
    (`trace_summary.summarize`, without the sleep and NCCL's start line: the window is the
    call's period, the streams' busy time its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    # the start line's tensor made before the profile: its fill kernel in the trace would be
    # the "first step" summarize leaves out, and every call would then count (20 calls over 19
    # steps: 5% too long, the seventeenth session's first profiles, docs/perf.md)
    line = torch.zeros(1, device=torch.cuda.current_device()) if ahead else None
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if line is not None:
            _, behind = timed_calls(fn, iters, ahead, line)
        else:
            for _ in range(iters):
                fn()
        torch.cuda.synchronize()
    if line is not None and behind():  # as in timed: the period is the host's
        print(f"-- {name} rank {rank}: the host took longer than the sleep: not device time", flush=True)
    dist.barrier()
    path = os.path.join(os.environ.get("OUT", "."), f"comm_trace_{name}_rank{rank}.json")
    prof.export_chrome_trace(path)
    if rank == 0 and not ahead:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    if ahead:
        import json

        import trace_summary

        with open(path) as f:
            events = [
                e
                for e in trace_summary.gpu_events(json.load(f))
                if "spin_kernel" not in e.name and "nccl" not in e.name  # torch.cuda._sleep, the start line
            ]
        for r in range(dist.get_world_size()):
            if r == rank:
                report = trace_summary.summarize(events, steps=iters, top=4, gaps=0)
                print(f"-- {name} rank {rank}, host ahead, {iters} calls:\n{report}", flush=True)
            dist.barrier()


@dataclasses.dataclass
class _SizeBuffers:
    """One size's tensors, checked: native cast outputs (``out_n``; ``out_d`` in the symmetric
    heap) and a2av's (``out_a``), reduce partials (``part``; ``part_d`` in the symmetric heap) and
    the accumulator's start value ``acc0``; ``args``: the group-cast arguments (ins, outs, dst, src)."""

    args: tuple
    x: torch.Tensor
    out_n: torch.Tensor
    out_a: torch.Tensor
    out_d: torch.Tensor
    part: torch.Tensor
    part_d: torch.Tensor
    acc0: torch.Tensor


def _checked_buffers(
    nat, a2a, nat_host, rank: int, world: int, rows: int, dev
) -> tuple[_SizeBuffers, bool, bool]:
    """The size's buffers, with whether native (and ``nat_host``) cast and reduce match a2av bitwise
    on this rank."""
    ins, outs, dst, src = layout(rank, world, rows)
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn((rows, *ROW), device=dev, generator=g).to(torch.bfloat16)
    out_n = torch.empty((sum(outs), *ROW), dtype=torch.bfloat16, device=dev)
    out_a = torch.empty_like(out_n)

    # correctness first (bitwise), then timing
    nat.group_cast(x, out_n, ins, outs, dst, src).wait()
    a2a.group_cast(x, out_a, ins, outs, dst, src).wait()
    ok_cast = torch.equal(out_n.view(torch.int16), out_a.view(torch.int16))
    # direct mode: the output lives in the symmetric heap, peers write straight into it
    out_d = nat.empty_output((sum(outs), *ROW), torch.bfloat16)
    out_d.fill_(float("nan"))
    nat.group_cast(x, out_d, ins, outs, dst, src).wait()
    ok_cast &= torch.equal(out_d.view(torch.int16), out_a.view(torch.int16))
    part = torch.randn((sum(outs), *ROW), device=dev, generator=g).to(torch.bfloat16)
    acc0 = torch.randn((rows, *ROW), device=dev, generator=g).to(torch.bfloat16)
    red_n, red_a = acc0.clone(), acc0.clone()
    nat.group_reduce(part, red_n, outs, ins, src, dst).wait()
    a2a.group_reduce(part, red_a, outs, ins, src, dst).wait()
    ok_red = torch.equal(red_n.view(torch.int16), red_a.view(torch.int16))
    # pull: the partial rows live in the symmetric heap, receivers read them in place
    part_d = nat.empty_output(part.shape, torch.bfloat16)
    part_d.copy_(part)
    red_d = acc0.clone()
    nat.group_reduce(part_d, red_d, outs, ins, src, dst).wait()
    ok_red &= torch.equal(red_d.view(torch.int16), red_a.view(torch.int16))
    ok_red &= torch.equal(part_d.view(torch.int16), part.view(torch.int16))
    if nat_host is not None:
        out_h = torch.full_like(out_n, float("nan"))
        nat_host.group_cast(x, out_h, ins, outs, dst, src).wait()
        out_d.fill_(float("nan"))
        nat_host.group_cast(x, out_d, ins, outs, dst, src).wait()
        ok_cast &= torch.equal(out_h.view(torch.int16), out_a.view(torch.int16))
        ok_cast &= torch.equal(out_d.view(torch.int16), out_a.view(torch.int16))
        red_h = acc0.clone()
        nat_host.group_reduce(part, red_h, outs, ins, src, dst).wait()
        ok_red &= torch.equal(red_h.view(torch.int16), red_a.view(torch.int16))
    bufs = _SizeBuffers((ins, outs, dst, src), x, out_n, out_a, out_d, part, part_d, acc0)
    return bufs, ok_cast, ok_red


def run_size(
    mib: float, nat, a2a, rank: int, world: int, dev, iters: int, log, profile: str = "", nat_host=None
) -> None:
    """Check native == a2av bitwise, then time cast / reduce / raw copies for S = ``mib`` MiB
    (``profile``: "host" for ``--profile-host``, "device" for ``--profile-device``, no timing).
    ``nat_host``: a second native collective with the handshake on the host (NVSHMEM signal
    and wait operations), checked and timed alongside as ``native-host``."""
    rows = int(mib * (1 << 20)) // ROW_BYTES
    cross = rows * ROW_BYTES * (world - 1)
    iters = iters or (50 if mib <= 4 else 20)
    b, ok_cast, ok_red = _checked_buffers(nat, a2a, nat_host, rank, world, rows, dev)
    flags = torch.tensor([int(ok_cast), int(ok_red)], dtype=torch.int64, device=dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(
            f"check {mib:.0f} MiB: cast native==a2av {bool(flags[0])}, reduce native==a2av {bool(flags[1])}"
        )

    ins, outs, dst, src = b.args
    red = b.acc0.clone()
    calls = {  # (op, backend) -> one call
        ("cast", "native"): lambda: nat.group_cast(b.x, b.out_n, ins, outs, dst, src),
        ("cast-sym", "native"): lambda: nat.group_cast(b.x, b.out_d, ins, outs, dst, src),
        ("cast", "a2av"): lambda: a2a.group_cast(b.x, b.out_a, ins, outs, dst, src),
        ("reduce", "native"): lambda: nat.group_reduce(b.part, red, outs, ins, src, dst),
        ("reduce-sym", "native"): lambda: nat.group_reduce(b.part_d, red, outs, ins, src, dst),
        ("reduce", "a2av"): lambda: a2a.group_reduce(b.part, red, outs, ins, src, dst),
    }
    if profile == "device":
        _profile_device(calls, mib, rank)
    elif profile:
        _profile_calls(calls, mib, rank)
    else:
        for ahead, tag in ((False, ""), (True, " ahead")):
            if nat_host is not None:
                host_calls = {
                    "cast": lambda: nat_host.group_cast(b.x, b.out_n, ins, outs, dst, src),
                    "cast-sym": lambda: nat_host.group_cast(b.x, b.out_d, ins, outs, dst, src),
                    "reduce": lambda: nat_host.group_reduce(b.part, red, outs, ins, src, dst),
                }
                for op, call in host_calls.items():
                    log(op, mib, "native-host" + tag, timed(call, iters, 3, ahead), cross)
            for (op, backend), call in calls.items():
                log(op, mib, backend + tag, timed(call, iters, 3, ahead), cross)
        _time_raw_limits(nat, b.x, rows, rank, world, dev, iters, log, mib)
    nat.free_output(b.out_d)
    nat.free_output(b.part_d)


def _profile_device(calls: dict, mib: float, rank: int) -> None:
    """Device timelines of the native reduces host ahead (``--profile-device``): each rank's
    kernels and the call's period (:func:`trace`)."""
    for op in ("reduce", "reduce-sym"):
        trace(calls[(op, "native")], rank, f"native_{op}_{mib:g}MiB_ahead", iters=20, ahead=True)


def _profile_calls(calls: dict, mib: float, rank: int) -> None:
    """Host profile and timeline of each native / a2av call (``run_size --profile-host``)."""
    for key in (
        ("cast", "native"),
        ("cast-sym", "native"),
        ("cast", "a2av"),
        ("reduce", "native"),
        ("reduce-sym", "native"),
    ):
        op, backend = key
        name = f"{backend} {op}"
        if rank == 0:
            print(f"== {name} {mib:.0f} MiB", flush=True)
        host_profile(calls[key], rank)
        trace(calls[key], rank, f"{name.replace(' ', '_')}_{mib:g}MiB")


def _time_raw_limits(
    nat, x: torch.Tensor, rows: int, rank: int, world: int, dev, iters: int, log, mib: float
) -> None:
    """Raw limits: every rank pushes S into the next rank's symmetric buffer (no native call is in
    flight: synchronized and fenced by barriers on both sides), by ``copy_`` and by the native
    copy kernel."""
    state = nat._backend._state
    nbytes = rows * ROW_BYTES
    torch.cuda.synchronize()
    dist.barrier()
    if world > 1 and nbytes <= state.capacity:
        peer = (rank + 1) % world
        dst_view = state.peers[peer][:nbytes]
        src_bytes = x.view(-1).view(torch.uint8)[:nbytes]
        cfg = nat._backend.config
        push = peer_push(
            state, rank, world, nbytes // 8, cfg.block_bytes // 8, dev, max_programs=cfg.max_programs
        )

        def raw_copy():
            dst_view.copy_(src_bytes)

        def raw_kernel():
            push(src_bytes.data_ptr(), 0, None)

        log("raw", mib, "copy", timed(raw_copy, iters, 3), nbytes)
        log("raw", mib, "kernel", timed(raw_kernel, iters, 3), nbytes)
        torch.cuda.synchronize()
        dist.barrier()


def _reduce_rates(nat, a2a, mib: float, rank: int, world: int, dev, iters: int) -> tuple[float, float, bool]:
    """``(reduce GB/s, reduce-sym GB/s, bitwise equal to a2av on every rank)`` of ``nat`` at
    ``mib`` MiB per rank, host ahead (the buffers and checks of `_checked_buffers`)."""
    rows = int(mib * (1 << 20)) // ROW_BYTES
    b, _, ok_red = _checked_buffers(nat, a2a, None, rank, world, rows, dev)
    flag = torch.tensor([int(ok_red)], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    ins, outs, dst, src = b.args
    red = b.acc0.clone()
    n = iters or (50 if mib <= 4 else 20)
    cross = rows * ROW_BYTES * (world - 1)
    t_plain = timed(lambda: nat.group_reduce(b.part, red, outs, ins, src, dst), n, 3, True)
    t_sym = timed(lambda: nat.group_reduce(b.part_d, red, outs, ins, src, dst), n, 3, True)
    nat.free_output(b.out_d)
    nat.free_output(b.part_d)
    return cross / t_plain / 1e9, cross / t_sym / 1e9, bool(flag.item())


def sweep_reduce(shapes: str, sizes: list[float], nat, a2a, rank: int, world: int, dev, iters: int) -> None:
    """group_reduce (plain and symmetric input: pulled) GB/s, host ahead, for each fused-reduction
    tile shape of ``shapes`` ("ROWSxWARPS,...", "0x0" the defaults, i.e. ``nat`` itself;
    NativeConfig.reduce_tile_rows / reduce_warps), each checked bitwise against a2av first; rank 0
    prints a table."""
    from magi_comm import GroupCollective
    from magi_comm.backends import native as native_mod

    lines = []
    for shape in shapes.split(","):
        tile_rows, warps = shape.lower().split("x")
        shaped = nat
        if (tile_rows, warps) != ("0", "0"):
            os.environ[native_mod.ENV_REDUCE_ROWS], os.environ[native_mod.ENV_REDUCE_WARPS] = tile_rows, warps
            shaped = GroupCollective(None, "native")  # reads its config from the environment
            del os.environ[native_mod.ENV_REDUCE_ROWS], os.environ[native_mod.ENV_REDUCE_WARPS]
        for mib in sizes:
            lines.append((shape, mib, *_reduce_rates(shaped, a2a, mib, rank, world, dev, iters)))
        if shaped is not nat:
            shaped.close()
    if rank == 0:
        print("\n| tile rows x warps | MiB | reduce GB/s | reduce-sym GB/s | bitwise == a2av |")
        print("|---|---:|---:|---:|---|")
        for shape, mib, gp, gs, ok in lines:
            print(f"| {shape} | {mib:.0f} | {gp:.1f} | {gs:.1f} | {ok} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,16,64", help="MiB sent by each rank to the others")
    ap.add_argument("--iters", type=int, default=0, help="0 = by size")
    ap.add_argument(
        "--compare-handshake",
        action="store_true",
        help="also time native with the handshake on the host (NVSHMEM operations): 'native-host'",
    )
    ap.add_argument("--signal-latency", action="store_true", help="time the native signal/copy steps alone")
    ap.add_argument(
        "--sweep-kernel", action="store_true", help="raw copy kernel GB/s per block size and warps, no timing"
    )
    ap.add_argument(
        "--profile-host", action="store_true", help="host time per call and its cProfile, no timing"
    )
    ap.add_argument(
        "--profile-device",
        action="store_true",
        help="the native reduces' kernels and period per call, host ahead (torch.profiler), no timing",
    )
    ap.add_argument(
        "--sweep-reduce",
        default="",
        help="fused-reduction tile shapes ROWSxWARPS,... (0x0: the defaults): reduce GB/s per shape, host ahead",
    )
    args = ap.parse_args()
    faulthandler.dump_traceback_later(int(os.environ.get("MAGI_COMM_BENCH_TIMEOUT", "240")), exit=True)

    from magi_comm.testing import init_torchrun_gpus

    rank, world, local_rank = init_torchrun_gpus(120)
    dev = torch.device("cuda", local_rank)

    from magi_comm import GroupCollective
    from magi_comm.backends import native as native_mod

    sizes = [float(s) for s in args.sizes.split(",")]
    need = int(max(sizes) * (1 << 20) * 1.1)
    os.environ.setdefault(native_mod.ENV_BUFFER_MB, str(max(256, need * 2 >> 20)))
    nat = GroupCollective(None, "native")
    nat_host = None
    if args.compare_handshake:  # same group state, config read from the environment at creation
        os.environ[native_mod.ENV_DEVICE_HANDSHAKE] = "0"
        nat_host = GroupCollective(None, "native")
        del os.environ[native_mod.ENV_DEVICE_HANDSHAKE]
        assert nat._backend.config.device_handshake and not nat_host._backend.config.device_handshake
    a2a = GroupCollective(None, "a2av")
    results = []

    def log(op, mib, name, sec, cross):
        gbs = cross / sec / 1e9
        results.append((op, mib, name, gbs, sec))
        if rank == 0:
            print(f"{op:7s} {mib:6.0f} MiB {name:12s} {sec * 1e6:9.1f} us {gbs:8.1f} GB/s", flush=True)

    if args.signal_latency:
        signal_latency(nat, rank, world, dev)
        sizes = []
    if args.sweep_kernel:
        for mib in sizes:
            sweep_kernel(nat, rank, world, dev, mib)
        sizes = []
    if args.sweep_reduce:
        sweep_reduce(args.sweep_reduce, sizes, nat, a2a, rank, world, dev, args.iters)
        sizes = []
    for mib in sizes:
        profile = "device" if args.profile_device else "host" if args.profile_host else ""
        run_size(mib, nat, a2a, rank, world, dev, args.iters, log, profile, nat_host)

    if rank == 0 and results:
        by = {(op, mib, name): gbs for op, mib, name, gbs, _ in results}
        print(f"\n## magi-comm GroupCast / GroupReduce, {world} x {torch.cuda.get_device_name()}")
        print("GB/s of bytes crossing GPUs per rank (S x (W-1)); raw = every rank pushing S to a peer;")
        print("cast-sym: the output from empty_output (symmetric heap: direct mode, no receive copy)")
        print("reduce-sym: the input from empty_output (symmetric heap: receivers read it in place)")
        print("back to back: calls issued one after the other, host path included; host ahead: the")
        print("host enqueued every call before the GPU reached the first (device time alone)\n")
        print("native-host: the handshake through NVSHMEM's on-stream operations (--compare-handshake)\n")
        print(
            "| op | MiB | timing | native | native-host | a2av | native/a2av | raw copy | raw kernel | native/raw copy |"
        )
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        for op in ("cast", "cast-sym", "reduce", "reduce-sym"):
            for mib in sizes:
                rc, rk = by.get(("raw", mib, "copy")), by.get(("raw", mib, "kernel"))
                for tag, timing in (("", "back to back"), (" ahead", "host ahead")):
                    # a2av has no symmetric outputs: its empty_output is torch.empty, the same cast
                    # NaN (the host did not get ahead) shows as "-"
                    n, h = by.get((op, mib, "native" + tag)), by.get((op, mib, "native-host" + tag))
                    a = by.get((op.removesuffix("-sym"), mib, "a2av" + tag))
                    n, h, a = (None if v is None or v != v else v for v in (n, h, a))
                    ratio = "-" if not (n and a) else f"{n / a:.2f}x"
                    vs_raw = "-" if not (n and rc) else f"{100 * n / rc:.0f}%"
                    print(
                        f"| {op} | {mib:.0f} | {timing} | {f(n)} | {f(h)} | {f(a)} | {ratio} | {f(rc)} | {f(rk)} "
                        f"| {vs_raw} |"
                    )
    if nat_host is not None:
        nat_host.close()
    nat.close()
    a2a.close()
    native_mod.shutdown()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
