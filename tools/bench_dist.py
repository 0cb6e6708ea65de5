"""Distributed attention forward benchmark (run with torchrun on N GPUs).

    torchrun --standalone --nproc-per-node 2 tools/bench_dist.py [--totals 65536 131072] [--degree N]
    torchrun --standalone --nproc-per-node 8 tools/bench_dist.py --tokens-per-gpu 16384 \
        --masks full,causal,varlen_full,varlen_causal,varlen_block_causal

Per-GPU TFLOP/s of ``magi_dist.calc_attn`` (4·area·Hq·D / (max-rank time · cp)) for the masks of
``--masks`` (default varlen causal and varlen full), beside, in the same run on the same inputs:
  (a) the same per-GPU work without communication (each rank's stages on K/V it already has),
      and the same rows in one FFA call over all the K/V they read (single-GPU FFA on the same
      load): scaling efficiency = that time / calc_attn time;
  (b) all-gather K/V context parallelism (Llama-3 / Kvax; tools/allgather_cp.py);
  (c) PyTorch's experimental ``context_parallel`` (ring SDPA), which only expresses full/causal
      masks: it runs the plain causal/full mask of the same length (its FLOPs counted on that mask).
Prints markdown tables on rank 0: throughput, and the K/V bytes each rank receives per forward
against ring attention and all-gather (from the plan).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

# tools/allgather_cp.py: a script's own folder is first on sys.path (python and torchrun alike)
from allgather_cp import AllGatherCP

import magi_dist as md
from ffa_kernels import ffa_forward_stage, flex_flash_attn_func
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig, make_plan, masks
from magi_solver.testing import cu_seqlens, long_tailed_lengths


def timeit(fn, iters: int, group) -> float:
    """Max over ranks of the mean time of ``fn`` (seconds), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end) / iters / 1e3], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def trace(fn, name: str, rank: int, group, calls: int = 3) -> None:
    """torch.profiler timeline (CPU and GPU, every stream) of ``calls`` calls of ``fn``, written
    as a Chrome trace to ``$OUT/dist_trace_<name>_rank<rank>.json`` (chrome://tracing, Perfetto):
    shows whether the casts run beside the attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), f"dist_trace_{name}_rank{rank}.json"))
    dist.barrier(group)


def ring_sdpa_time(total, hq, d, causal, iters, group) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (dist.get_world_size(group),))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, hq, total, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        return timeit(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), iters, group
        )


def init_nccl(high_priority: bool) -> None:
    """NCCL process group whose internal streams, and the native backend's group stream, run at
    high priority (``high_priority``) or at the default one."""
    from magi_comm.backends.native import ENV_STREAM_PRIORITY

    os.environ[ENV_STREAM_PRIORITY] = "-1" if high_priority else "0"
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    dist.init_process_group("nccl", pg_options=opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--totals", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--masks",
        default="varlen_causal,varlen_full",
        help="comma list of full, causal, varlen_full, varlen_causal, varlen_block_causal",
    )
    ap.add_argument("--tokens-per-gpu", type=int, default=0, help="if > 0: one total, this many tokens x cp")
    ap.add_argument(
        "--trace", action="store_true", help="also write a profiler timeline of calc_attn per mask"
    )
    ap.add_argument(
        "--comm-priority",
        choices=("high", "normal"),
        default="high",
        help="CUDA priority of the communication streams (NCCL's and magi-comm native's): high "
        "lets a cast overlapped with an attention kernel take SMs as that kernel's programs retire "
        "(sets $MAGI_COMM_NATIVE_STREAM_PRIORITY, overriding a value set by the user)",
    )
    args = ap.parse_args()

    init_nccl(args.comm_priority == "high")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = dist.group.WORLD
    rows = []
    traffic = []
    totals = [args.tokens_per_gpu * cp] if args.tokens_per_gpu > 0 else args.totals
    for total in totals:
        lens = long_tailed_lengths(total, max(4, total // 8192), seed=total)
        cu = cu_seqlens(lens)
        for kind in args.masks.split(","):
            mask, causal = bench_mask(kind, total, cu)
            name = f"{kind.replace('_', ' ')} {total // 1024}k"
            flops = 4 * mask.area() * args.hq * args.d
            cfg = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=args.chunk),
                overlap_config=OverlapConfig(degree=args.degree),
            )
            key = md.magi_attn_flex_key(
                mask.q_ranges, mask.k_ranges, mask.mask_types, total, total,
                args.hq, args.hk, args.d, group, dist_attn_config=cfg,
            )  # fmt: skip
            g = torch.Generator(device="cuda").manual_seed(rank)
            rt = md.get_runtime(key)
            n = rt.shard_seqlen

            def rnd(h):
                return torch.randn(n, h, args.d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: B023

            q, k, v = rnd(args.hq), rnd(args.hk), rnd(args.hk)
            t_magi = timeit(lambda: md.calc_attn(q, k, v, key), args.iters, group)  # noqa: B023
            if args.trace:
                trace(lambda: md.calc_attn(q, k, v, key), f"{kind}_cp{cp}_deg{args.degree}", rank, group)  # noqa: B023

            # (a) the same stages with K/V already in place: one call per stage on local K/V sized buffers
            stage_inputs = []
            for st, calc in zip(
                [rt.host_tensors(q.device), *rt.remote_tensors(q.device)],
                [rt.me.calc.host, *rt.me.calc.remote],
            ):
                if st.empty:
                    continue
                kk = torch.randn(
                    calc.total_seqlen_k, args.hk, args.d, device="cuda", dtype=torch.bfloat16, generator=g
                )
                stage_inputs.append((st, kk))

            def compute_only():
                out = torch.zeros(n, args.hq, args.d, device="cuda")  # noqa: B023
                lse = torch.full((n, args.hq), float("-inf"), device="cuda")  # noqa: B023
                for st, kk in stage_inputs:  # noqa: B023
                    ffa_forward_stage(q, kk, kk, st.q_ranges, st.k_ranges, st.attn_types, out, lse)  # noqa: B023

            t_local = timeit(compute_only, args.iters, group)

            # (a') the same rows in ONE kernel call over [local; remote] K/V (the degree-0 plan of
            # the same dispatch): single-GPU FFA on this rank's load, the strict efficiency reference
            one = make_plan(mask, cp, cfg.model_copy(update={"overlap_config": OverlapConfig(degree=0)}))
            calc = one.ranks[rank].calc.remote[0]
            as_t = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda").reshape(-1, 2)  # noqa: E731
            one_args = (
                as_t(calc.q_ranges),
                as_t(calc.k_ranges),
                torch.tensor(calc.attn_types, dtype=torch.int32, device="cuda"),
            )
            kk_all = torch.randn(
                calc.total_seqlen_k, args.hk, args.d, device="cuda", dtype=torch.bfloat16, generator=g
            )
            t_one = timeit(lambda: flex_flash_attn_func(q, kk_all, kk_all, *one_args), args.iters, group)  # noqa: B023

            # (b) all-gather K/V baseline
            ag = AllGatherCP(mask, group, args.chunk)
            t_ag = timeit(lambda: ag.forward(q, k, v), args.iters, group)  # noqa: B023

            # (c) torch context_parallel on the plain mask of the same length
            try:
                t_ring = ring_sdpa_time(ag.plan.padded_seqlen, args.hq, args.d, causal, args.iters, group)
                plain = masks.causal(ag.plan.padded_seqlen) if causal else masks.full(ag.plan.padded_seqlen)
                ring_tf = 4 * plain.area() * args.hq * args.d / (t_ring * cp) / 1e12
            except Exception as e:  # an experimental API: report, do not abort the table
                if rank == 0:
                    print(f"context_parallel failed: {type(e).__name__}: {e}", flush=True)
                ring_tf = float("nan")
            tf = lambda t, f=flops: f / (t * cp) / 1e12  # noqa: E731
            rows.append(
                (
                    name,
                    tf(t_magi),
                    tf(t_local),
                    t_local / t_magi,
                    tf(t_one),
                    t_one / t_magi,
                    tf(t_ag),
                    ring_tf,
                    rt.plan.stats.imbalance,
                )
            )
            stats = rt.plan.stats
            traffic.append(
                (name, max(stats.recv_tokens_per_rank), max(stats.ring_tokens_per_rank),
                 max(stats.allgather_tokens_per_rank))
            )  # fmt: skip
            md.clear_cache()
    if rank == 0:
        print(
            f"\ncp {cp}, Hq {args.hq}, Hk {args.hk}, D {args.d}, bf16, chunk {args.chunk}, overlap degree {args.degree}, "
            f"comm streams at {args.comm_priority} priority"
        )
        print(
            "| mask | magi calc_attn TFLOP/s/GPU | same stages, no comm | eff. | one FFA call, same load | eff. | "
            "all-gather K/V | torch context_parallel (plain mask) | imbalance |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1%} | {r[4]:.1f} | {r[5]:.1%} | {r[6]:.1f} | "
                f"{r[7]:.1f} | {r[8]:.3f} |"
            )
        kv_bytes = 2 * args.hk * args.d * 2  # one token's K and V rows, bf16
        print("\nK/V bytes received per rank (max over ranks), per forward:")
        print("| mask | magi | ring attention | all-gather | magi / ring |")
        print("|---|---|---|---|---|")
        for name, magi, ring, ag in traffic:
            mib = lambda t: f"{t * kv_bytes / 2**20:.1f} MiB"  # noqa: E731
            print(f"| {name} | {mib(magi)} | {mib(ring)} | {mib(ag)} | {magi / max(ring, 1):.1%} |")
    dist.destroy_process_group()


def bench_mask(kind: str, total: int, cu: list[int]):
    """(mask, causal flag for the plain-mask context_parallel peer) of a benchmark mask kind."""
    if kind == "full":
        return masks.full(total), False
    if kind == "causal":
        return masks.causal(total), True
    if kind == "varlen_full":
        return masks.varlen(cu), False
    if kind == "varlen_causal":
        return masks.varlen(cu, causal=True), True
    if kind == "varlen_block_causal":
        return masks.block_causal(cu, 2048), True
    raise ValueError(f"--masks: unknown mask kind {kind!r}")


if __name__ == "__main__":
    main()
