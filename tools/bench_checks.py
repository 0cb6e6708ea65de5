"""The cost of the reliability checks (docs/reliability.md), on the CPU.

1. ffa_kernels' validation per call (``validate_attn_args``, what flex_flash_attn_func and each
   stage of calc_attn run) with 1k and 100k slices: the first call with new range tensors, and a
   repeated call with the same (host) tensors, which compares their bytes with the checked ones;
   ``validate_attn_inputs`` (calc_attn's argument check).
2. magi_dist's per-call overhead for a key already used (argument checks, key check, runtime
   lookup) and the cross-rank key check of a new key object (``check_key``: fingerprint and one
   all-gather) on CPU gloo groups of 2 and 4 ranks, with 3, 1k and 100k slices.

3. ``--gpu``: the same validation with CUDA tensors beside one 32k-token varlen causal forward
   of flex_flash_attn_func (16 heads of 128, bf16): the checks' share of a call.

Usage: python tools/bench_checks.py [--worlds 2 4] [--slices 1000 100000] [--gpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _ranges(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` one-row slices over ``n`` tokens (q and k the same), causal."""
    qr = torch.stack([torch.arange(n), torch.arange(n) + 1], 1).to(torch.int32)
    return qr, qr.clone(), torch.ones(n, dtype=torch.int32)


def bench_validation(slices: list[int]) -> None:
    from ffa_kernels import validate_attn_inputs
    from ffa_kernels._validate import _CHECKED_RANGES, validate_attn_args

    print("ffa_kernels validation per call (CPU tensors; median us)")
    print(f"{'slices':>8} | {'first call':>11} | {'same tensors':>12} | {'validate_attn_inputs':>20}")
    for n in slices:
        q, k, v = torch.randn(n, 8, 128), torch.randn(n, 8, 128), torch.randn(n, 8, 128)
        qr, kr, tm = _ranges(n)
        reps = 20 if n <= 10_000 else 5

        def first(qr=qr, kr=kr, tm=tm, q=q, k=k, v=v):
            _CHECKED_RANGES.clear()
            validate_attn_args(q, k, v, qr, kr, tm, None, 0.0)

        def again(qr=qr, kr=kr, tm=tm, q=q, k=k, v=v):
            validate_attn_args(q, k, v, qr, kr, tm, None, 0.0)

        def inputs(q=q, k=k, v=v):
            validate_attn_inputs(q, k, v, softcap=0.0)

        print(
            f"{n:>8} | {_median_us(first, reps):>11.1f} | {_median_us(again, reps * 10):>12.1f} | "
            f"{_median_us(inputs, 200):>20.1f}"
        )


def bench_gpu(slices: list[int]) -> None:
    """Validation of CUDA tensors (new range tensors, then the same again) against one forward."""
    from ffa_kernels import flex_flash_attn_func
    from ffa_kernels._validate import _CHECKED_RANGES, validate_attn_args

    total, heads = 32768, 16
    q, k, v = (torch.randn(total, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # 12 documents: the varlen causal case of tools/bench_ffa.py's size
    cu = torch.linspace(0, total, 13, dtype=torch.int64).tolist()
    docs = torch.tensor([[a, b] for a, b in zip(cu[:-1], cu[1:])], dtype=torch.int32, device="cuda")
    types = torch.ones(docs.shape[0], dtype=torch.int32, device="cuda")

    def forward():
        flex_flash_attn_func(q, k, v, docs, docs, attn_type_map=types)

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        forward()
    end.record()
    torch.cuda.synchronize()
    fwd_us = start.elapsed_time(end) / 20 * 1e3
    print(f"\nGPU: varlen causal 32k forward {fwd_us:.0f} us (flex_flash_attn_func, CUDA events)")
    # the checks' share of the forward's wall time: the same calls with validation replaced
    # by its memoised result (the host runs ahead of the GPU, so this is what a user sees)
    from ffa_kernels import _frontend

    checked = validate_attn_args(q, k, v, docs, docs, types, None, 0.0)
    real = _frontend.validate_attn_args
    for label, patched in (("with checks", real), ("checks memoised", lambda *a: checked)):
        _frontend.validate_attn_args = patched
        try:
            forward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                forward()
            host_us = (time.perf_counter() - t0) / 50 * 1e6
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) / 50 * 1e6
        finally:
            _frontend.validate_attn_args = real
        print(f"  {label:16s}: wall {wall_us:7.1f} us per call, host (launch) {host_us:6.1f} us")
    print(f"{'slices':>8} | {'first call':>11} | {'same tensors':>12} | {'share of the forward':>20}")
    for n in [12, *(min(n, total) for n in slices)]:
        qr, kr, tm = (t.to("cuda") for t in _ranges(n))
        if n == 12:
            qr, kr, tm = docs, docs, types

        def first(qr=qr, kr=kr, tm=tm):
            _CHECKED_RANGES.clear()
            validate_attn_args(q, k, v, qr, kr, tm, None, 0.0)

        def again(qr=qr, kr=kr, tm=tm):
            validate_attn_args(q, k, v, qr, kr, tm, None, 0.0)

        t_first, t_again = _median_us(first, 5), _median_us(again, 200)
        print(f"{n:>8} | {t_first:>11.1f} | {t_again:>12.1f} | {100 * t_again / fwd_us:>19.2f}%")


def _flex_key(n: int, group=None):
    import magi_dist as md
    from magi_solver import DispatchConfig, DistAttnConfig

    ranges = [(i, i + 1) for i in range(n)]
    config = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=max(16, n // 64)))
    return md.magi_attn_flex_key(ranges, ranges, "causal", n, n, 8, 8, 64, group, dist_attn_config=config)


def key_checks(rank: int, world: int, slices: list[int]) -> list[tuple[int, float, float, float]]:
    """On every rank: (slices, fingerprint us, check_key us of a new key, per-call overhead us)."""
    import dataclasses

    import torch.distributed as dist

    import magi_dist as md
    from ffa_kernels import validate_attn_inputs
    from magi_dist.fingerprint import check_key, key_fingerprint
    from magi_dist.runtime import get_runtime

    rows = []
    for n in slices:
        key = _flex_key(n)
        reps = 10 if n <= 10_000 else 3
        fp = _median_us(lambda key=key: key_fingerprint(key), reps)
        times = []
        for _ in range(reps):
            fresh = dataclasses.replace(key)  # a new key object: not checked yet
            dist.barrier()
            t = time.perf_counter()
            check_key(fresh)
            times.append(time.perf_counter() - t)
        rt = get_runtime(key)
        q = torch.randn(rt.shard_seqlen, 8, 64)

        def per_call(key=key, q=q):  # calc_attn's checks before its first data collective
            validate_attn_inputs(q, q, q)
            check_key(key)
            get_runtime(key)

        check_key(key)
        rows.append((n, fp, statistics.median(times) * 1e6, _median_us(per_call, 200)))
        md.clear_cache()
    return rows


def bench_key_checks(worlds: list[int], slices: list[int]) -> None:
    from magi_dist.testing import run_ranks

    print("\nmagi_dist key check on CPU gloo (median us; rank 0)")
    print(
        f"{'ranks':>5} | {'slices':>8} | {'fingerprint':>11} | {'check_key (new key)':>19} | {'per call (known key)':>20}"
    )
    for world in worlds:
        for n, fp, check, per_call in run_ranks(world, key_checks, [3, *slices], timeout=600)[0]:
            print(f"{world:>5} | {n:>8} | {fp:>11.1f} | {check:>19.1f} | {per_call:>20.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--slices", type=int, nargs="+", default=[1000, 100_000])
    parser.add_argument("--gpu", action="store_true", help="only the CUDA measurement (item 3)")
    args = parser.parse_args()
    if args.gpu:
        bench_gpu(args.slices)
        return
    torch.set_num_threads(1)
    bench_validation(args.slices)
    bench_key_checks(args.worlds, args.slices)


if __name__ == "__main__":
    main()
