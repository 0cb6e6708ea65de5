"""Planner benchmark: time make_plan on large masks and report balance and traffic per dispatch algorithm.

    python tools/bench_solver.py [--seqlen 1048576] [--docs 1500] [--cp 64] [--chunk 2048] [--degree 4]
                                 [--scaling-chunks 1024,2048,4096,16384] [--scaling-only]

Not a timed test: prints two tables (paste into docs/perf.md). The first plans 1M-token masks
at 2048-token chunks for every dispatch algorithm; the second ("chunk scaling") plans masks of
1k-16k chunks of 64 tokens (256k-1M tokens, cp 8, the default config otherwise), where a
planner that is quadratic in the chunks shows (block-causal at 4,096 chunks took 15-16 s).
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

from magi_solver import DispatchAlg, DispatchConfig, DistAttnConfig, OverlapConfig, make_plan, masks
from magi_solver.testing import cu_seqlens, long_tailed_lengths


def bench_masks(seqlen: int, docs: int) -> dict:
    cu = cu_seqlens(long_tailed_lengths(seqlen, docs))
    return {
        "varlen causal": lambda: masks.varlen(cu, causal=True),
        "varlen full": lambda: masks.varlen(cu),
        "causal": lambda: masks.causal(seqlen),
        "sliding window 4k causal": lambda: masks.sliding_window(seqlen, (4096, 0), causal=True),
        "varlen block-causal 2k": lambda: masks.block_causal(cu, 2048),
    }


def scaling_masks(seqlen: int) -> dict:
    return {
        "causal (one document)": lambda: masks.causal(seqlen),
        "block-causal 256": lambda: masks.block_causal([0, seqlen], 256),
        "sliding window 4k causal": lambda: masks.sliding_window(seqlen, (4096, 0), causal=True),
        "sliding window 1k, 1k": lambda: masks.sliding_window(seqlen, (1024, 1024)),
        "varlen causal, 421 docs": lambda: masks.varlen(
            cu_seqlens(long_tailed_lengths(seqlen, 421)), causal=True
        ),
    }


def scaling(chunk_counts: list[int], chunk: int, cp: int, repeat: int) -> None:
    print(f"chunk scaling: chunk {chunk}, cp {cp}, default overlap (degree 1), dispatch min_heap")
    print()
    print(
        f"| mask | chunks | seqlen | mask slices | plan slices | plan time (s, best of {repeat}) | "
        "imbalance max/mean |"
    )
    print("|---|---|---|---|---|---|---|")
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=chunk))
    for name in scaling_masks(chunk):
        for n in chunk_counts:
            mask = scaling_masks(n * chunk)[name]()
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                plan = make_plan(mask, cp, cfg)
                times.append(time.perf_counter() - t0)
            slices = sum(len(r.calc.host) + sum(len(s) for s in r.calc.remote) for r in plan.ranks)
            print(
                f"| {name} | {plan.num_chunks:,} | {n * chunk:,} | {len(mask)} | {slices:,} | "
                f"{min(times):.3f} | {plan.stats.imbalance:.4f} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--scaling-chunks", default="1024,2048,4096,16384", help="chunk counts of the second table"
    )
    ap.add_argument("--scaling-chunk", type=int, default=64, help="chunk size of the second table")
    ap.add_argument("--scaling-cp", type=int, default=8)
    ap.add_argument("--scaling-repeat", type=int, default=3)
    ap.add_argument("--scaling-only", action="store_true", help="print the second table only")
    args = ap.parse_args()
    counts = [int(x) for x in args.scaling_chunks.split(",") if x]
    if args.scaling_only:
        scaling(counts, args.scaling_chunk, args.scaling_cp, args.scaling_repeat)
        return

    builders = bench_masks(args.seqlen, args.docs)
    print(
        f"seqlen {args.seqlen}, docs {args.docs}, cp {args.cp}, chunk {args.chunk}, overlap degree {args.degree}"
    )
    print()
    print(
        f"| mask | slices | dispatch | plan time (s, best of {args.repeat}) | peak MiB | imbalance max/mean | "
        "recv tokens/rank (max) | ring / all-gather tokens/rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, build in builders.items():
        mask = build()
        for alg in (DispatchAlg.MIN_HEAP, DispatchAlg.LPT_SWAP, DispatchAlg.ZIGZAG):
            cfg = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=args.chunk, alg=alg),
                overlap_config=OverlapConfig(degree=args.degree),
            )
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                plan = make_plan(mask, args.cp, cfg)
                times.append(time.perf_counter() - t0)
            tracemalloc.start()
            make_plan(mask, args.cp, cfg)
            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
            st = plan.stats
            print(
                f"| {name} | {len(mask)} | {alg.value} | {min(times):.3f} | {peak:.0f} | {st.imbalance:.4f} | "
                f"{max(st.recv_tokens_per_rank)} (mean {statistics.mean(st.recv_tokens_per_rank):.0f}) | "
                f"{st.ring_tokens_per_rank[0]} |",
                flush=True,
            )
    if counts:
        print()
        scaling(counts, args.scaling_chunk, args.scaling_cp, args.scaling_repeat)


if __name__ == "__main__":
    main()
