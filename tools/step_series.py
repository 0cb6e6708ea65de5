"""The distributed training step, step by step: each step's GPU time, the host's time per call,
and in ``sync`` mode the SM clock and board power NVML reports after it (run with torchrun on N
GPUs).

    torchrun --standalone --nproc-per-node 2 tools/step_series.py [--mask varlen_causal]
        [--total 65536] [--steps 20] [--modes free sync]

Why: at cp 2 the step draws the GPUs' power limit, so the clock falls as they warm and a run's
mean depends on what ran before it (docs/perf.md, "the backward's cast beside its zeros"). A
series shows the drift that ``bench_dist.py --step``'s mean hides; to compare two trees, run this
once per tree, alternating, several times. Modes: ``free`` (the host enqueues step after step, as
in training and in bench_dist) and ``sync`` (a device synchronisation after each step: the host's
launch time of a step is then inside its time, and each NVML reading follows its step; in
``free`` mode the host runs ahead, so no reading is taken). Case, sizes and inputs as
bench_dist's ``--step`` at overlap degree 0 (its ``--chunk``, ``--hq``, ``--hk``, ``--d``
defaults). NVML readings need the ``pynvml`` module (``nvidia-ml-py``); without it the clock /
power row is left out.
"""

from __future__ import annotations

import argparse
import time

# tools/bench_dist.py: a script's own folder is first on sys.path (python and torchrun alike)
import bench_dist
import torch
import torch.distributed as dist


def _nvml_reader():
    """``() -> (SM MHz, W)`` of this process's GPU (torch's NVML helpers, which map the device
    through ``$CUDA_VISIBLE_DEVICES``), or None without pynvml."""
    try:
        import pynvml  # noqa: F401  (what torch.cuda.clock_rate / power_draw need)
    except ImportError:
        return None
    return lambda: (torch.cuda.clock_rate(), torch.cuda.power_draw() // 1000)


def series(step, steps: int, sync: bool, read_nvml=None):
    """Run ``step`` ``steps`` times; ``(GPU ms per step, host ms per call, NVML readings after
    each call: empty without read_nvml)``."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    host, nvml = [], []
    events[0].record()
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        events[i + 1].record()
        if sync:
            torch.cuda.synchronize()
        host.append((time.perf_counter() - t0) * 1e3)
        if read_nvml is not None:
            nvml.append(read_nvml())
    torch.cuda.synchronize()
    gpu = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    return gpu, host, nvml


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", default="varlen_causal", choices=bench_dist.MASK_KINDS)
    ap.add_argument("--total", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["free"], choices=["free", "sync"])
    ap.add_argument("--tag", default="", help="a label printed on each line (which tree ran)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    bargs = bench_dist.parse_args(
        ["--step", "--degree", "0", "--masks", args.mask, "--totals", str(args.total)]
    )
    with bench_dist.nccl_ranks(bargs.comm_priority == "high"):
        case = bench_dist.bench_cases(args.mask, [args.total])[0]
        setup = bench_dist._Setup(case, bargs, dist.group.WORLD, torch.device("cuda"), torch.bfloat16)
        step, _ = bench_dist.magi_step_fn(setup, bargs.hq, bargs.deterministic)
        flops = bench_dist.attn_flops(case.mask.area(), bargs.hq, bargs.d, step=True)
        read_nvml = _nvml_reader()
        for mode in args.modes:
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            dist.barrier()
            sync = mode == "sync"
            gpu, host, nvml = series(step, args.steps, sync, read_nvml if sync else None)
            mean = sum(gpu) / len(gpu)
            if dist.get_rank() == 0:
                tf = bench_dist.tflops(flops, mean * 1e-3, dist.get_world_size())
                print(f"== {args.tag} {case.name} {mode}: mean GPU step {mean:.2f} ms ({tf:.1f} TFLOP/s/GPU)")
                print("  GPU ms  ", " ".join(f"{x:.2f}" for x in gpu))
                print("  host ms ", " ".join(f"{x:.2f}" for x in host))
                if nvml:
                    print("  MHz/W   ", " ".join(f"{c}/{p}" for c, p in nvml), flush=True)


if __name__ == "__main__":
    main()
