"""Planner benchmark: time make_plan on large masks and report balance and traffic per dispatch algorithm.

    python tools/bench_solver.py [--seqlen 1048576] [--docs 1500] [--cp 64] [--chunk 2048] [--degree 4]

Not a timed test: prints a table (paste into docs/perf.md).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--cp", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--degree", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

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
                f"{st.ring_tokens_per_rank[0]} |"
            )


if __name__ == "__main__":
    main()
