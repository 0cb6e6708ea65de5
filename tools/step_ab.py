"""The distributed training step under several settings, timed in turns in one process (run with
torchrun on N GPUs; on the CPU, gloo ranks run it in the tests):

    torchrun --standalone --nproc-per-node 2 tools/step_ab.py \\
        --setting default --setting split:MAGI_DIST_BWD_SPLIT=1 \\
        [--rounds 8] [--profile] [bench_dist.py's case arguments: --masks varlen_causal \\
        --totals 65536 131072 --iters 8 --degree 0 --hq --hk --d --chunk --deterministic ...]

Why: at cp 2 the GPUs run the step at their power limit, so one timing depends on what ran
before it, and a process's first steps run cooler than its later ones (docs/perf.md). Comparing
settings process against process (bench_dist.py once per setting) then measures the order as
much as the setting. magi_dist's switches are read at each call, so here one process builds each
case once and times every setting in turn, ``--rounds`` times (``--iters`` steps each, after
one warm-up step under that setting): each setting's median, its ratio to the first setting.

A setting is ``NAME[:VAR=VALUE[,VAR=VALUE...]]``: the variables set while it is timed, every
other switch of `PER_CALL_VARIABLES` unset then (also one exported outside). Only the switches
magi_dist reads at each call are accepted, their values checked when the arguments are parsed;
the communication backend's ``MAGI_COMM_*`` settings are read once per process and would
silently not apply. A setting that sizes the symmetric partials' pool frees it after each of its
timings (collective), so the next setting runs without it. ``--degree`` defaults to 0 here (the
switches are about the degree-0 path); bench_dist's ``--trace`` and ``--alternate`` are refused.

``--profile`` (GPU): after the timings, `PROFILE_STEPS` steps of each setting under the
profiler, and per rank the GPU time per step of the attention backward and forward kernels, the
fused reduction, the copy kernels and the window from the first to the last GPU event
(`kernel_times`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field

# tools/: a script's own folder is first on sys.path (python and torchrun alike)
import bench_dist
import torch
import torch.distributed as dist
import trace_summary

import magi_dist as md
from magi_dist import attn as md_attn
from magi_dist.partials import ENV_SYMMETRIC_MB, free_partials, symmetric_budget

# the switches magi_dist reads at each call, with a reader that raises on a bad value
PER_CALL_VARIABLES = {
    md_attn.ENV_BWD_SPLIT: lambda: md_attn.bwd_split(2),
    md_attn.ENV_BWD_SPLIT_HEADS: md_attn.bwd_split_heads,
    md_attn.ENV_FWD_SPLIT: md_attn.fwd_split,
    md_attn.ENV_KEEP_KV: md_attn.keep_kv,
    md_attn.ENV_BWD_LOW_PRECISION_REDUCE: lambda: md_attn.bwd_reduce_dtype(torch.float32, torch.bfloat16),
    ENV_SYMMETRIC_MB: symmetric_budget,
}

# what `kernel_times` sums per step: (column, a kernel name contains it, or is it when exact):
# the attention kernels by their classes, magi-comm's Triton kernels by their names (torch's own
# copies, "direct_copy_kernel_cuda", are not magi-comm's)
KERNEL_COLUMNS = (
    ("bwd", "FFABackward", False),
    ("fwd", "FFAForward", False),
    ("reduce", "_reduce_kernel", True),
    ("copies", "_copy_kernel", True),
)


@dataclass(frozen=True)
class Setting:
    """A named set of environment variables (values as strings)."""

    name: str
    env: dict[str, str] = field(default_factory=dict)


def parse_setting(spec: str) -> Setting:
    """``NAME[:VAR=VALUE,...]`` -> `Setting`; ValueError naming ``--setting`` for a bad one."""
    name, _, assigns = spec.partition(":")
    if not name or any(c in name for c in " =,"):
        raise ValueError(f"--setting: expected NAME[:VAR=VALUE,...], got {spec!r}")
    env = {}
    for item in filter(None, assigns.split(",")):
        var, eq, value = item.partition("=")
        if not eq or var not in PER_CALL_VARIABLES:
            raise ValueError(
                f"--setting {name}: expected VAR=VALUE with VAR one of {', '.join(PER_CALL_VARIABLES)} "
                f"(read at each call), got {item!r}"
            )
        env[var] = value
    setting = Setting(name, env)
    with applied(setting):  # a bad value raises here, not in the first timed step
        for var in env:
            try:
                PER_CALL_VARIABLES[var]()
            except ValueError as e:
                raise ValueError(f"--setting {name}: {e}") from e
    return setting


@contextlib.contextmanager
def applied(setting: Setting):
    """The environment with ``setting``'s variables set and every other of `PER_CALL_VARIABLES`
    unset (a value exported outside would otherwise hold in every setting); the previous values
    back afterwards."""
    names = set(PER_CALL_VARIABLES)
    saved = {v: os.environ.get(v) for v in names}
    try:
        for v in names:
            os.environ.pop(v, None)
        os.environ.update(setting.env)
        yield
    finally:
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old


def ab_table(title: str, seconds: dict[str, list[float]], flops: float, cp: int) -> str:
    """One row per setting: median step time, TFLOP/s per GPU at that median, the ratio of the
    median to the first setting's and every timing in turn."""
    lines = [
        f"{title}",
        "| setting | median ms | TFLOP/s/GPU | vs first | timings ms |",
        "|---|---|---|---|---|",
    ]
    base = None
    for name, ts in seconds.items():
        med = statistics.median(ts)
        base = base or med
        runs = " ".join(f"{t * 1e3:.2f}" for t in ts)
        lines.append(
            f"| {name} | {med * 1e3:.3f} | {bench_dist.tflops(flops, med, cp):.1f} | {med / base - 1:+.1%} | {runs} |"
        )
    return "\n".join(lines)


def kernel_times(trace: dict, steps: int) -> dict[str, float]:
    """GPU microseconds per step in a Chrome trace of ``steps`` steps: each `KERNEL_COLUMNS`
    column's kernels summed, and ``window``, the first GPU event's start to the last one's end."""
    events = trace_summary.gpu_events(trace)
    out = {
        col: sum(e.end - e.start for e in events if (e.name == name if exact else name in e.name)) / steps
        for col, name, exact in KERNEL_COLUMNS
    }
    out["window"] = (max(e.end for e in events) - min(e.start for e in events)) / steps if events else 0.0
    return out


PROFILE_STEPS = 3  # steps recorded per setting under the profiler


def _profile(step, group, steps: int = PROFILE_STEPS) -> dict[str, float]:
    # One step in the profiler's warm-up (the tracer starts there, taking a different time on
    # each rank), then the ranks together, then the recorded steps: else a rank's collectives
    # would wait in the record for a peer whose tracer was still starting.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule) as prof:
        step()
        torch.cuda.synchronize()
        dist.barrier(group)
        prof.step()
        for i in range(steps):
            step()
            if i == steps - 1:
                torch.cuda.synchronize()
            prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernel_times(json.load(f), steps)


def _profile_table(title: str, per_setting: dict[str, list[dict[str, float]]]) -> str:
    cols = [c for c, _, _ in KERNEL_COLUMNS] + ["window"]
    lines = [
        title,
        "| setting | rank | " + " | ".join(f"{c} us" for c in cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for name, ranks in per_setting.items():
        for r, times in enumerate(ranks):
            lines.append(f"| {name} | {r} | " + " | ".join(f"{times[c]:.0f}" for c in cols) + " |")
    return "\n".join(lines)


def _drop_pool(setting: Setting, group) -> None:
    """After a setting that sizes the symmetric partials' pool: free it (collective), so that the
    next setting neither reuses its buffers nor runs with less symmetric memory beside them."""
    if ENV_SYMMETRIC_MB in setting.env:
        free_partials(group)


def measure(case, bargs, settings: list[Setting], rounds: int, profile: bool, group, device, dtype) -> str:
    """The tables of one case (see the module docstring)."""
    s = bench_dist._Setup(case, bargs, group, device, dtype)
    step, _ = bench_dist.magi_step_fn(s, bargs.hq, bargs.deterministic)

    def timer(setting: Setting):
        def run() -> float:
            with applied(setting):
                seconds = bench_dist.timeit(step, bargs.iters, group, device)
            _drop_pool(setting, group)
            return seconds

        return run

    seconds = bench_dist.round_robin({st.name: timer(st) for st in settings}, rounds)
    flops = bench_dist.attn_flops(case.mask.area(), bargs.hq, bargs.d, step=True)
    text = ab_table(f"{case.name}: the step per setting, {rounds} rounds in turn", seconds, flops, s.cp)
    if profile and device.type == "cuda":
        per_setting = {}
        for st in settings:
            with applied(st):
                mine = _profile(step, group)
            _drop_pool(st, group)
            gathered: list[object] = [None] * s.cp
            dist.all_gather_object(gathered, mine, group=group)
            per_setting[st.name] = gathered
        title = f"{case.name}: GPU time per step (profiler, {PROFILE_STEPS} steps)"
        text += "\n\n" + _profile_table(title, per_setting)
    return text


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """``(this tool's arguments, bench_dist's)``: the arguments this tool does not know go to
    bench_dist.py's parser (with ``--step`` and, unless given, ``--degree 0``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", action="append", required=True, help="NAME[:VAR=VALUE,...]; repeat it")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also per-kernel GPU time per setting (on GPUs; none on the CPU)",
    )
    args, rest = ap.parse_known_args(argv)
    try:
        args.settings = [parse_setting(spec) for spec in args.setting]
    except ValueError as e:
        ap.error(str(e))
    names = [st.name for st in args.settings]
    if len(set(names)) != len(names):
        ap.error(f"--setting: names must differ, got {names}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    bargs = bench_dist.parse_args(["--step", "--degree", "0", *rest])
    if bargs.trace or bargs.alternate:
        ap.error("--trace, --alternate: bench_dist.py's, not this tool's (it takes turns itself)")
    return args, bargs


def run(args: argparse.Namespace, bargs: argparse.Namespace, group=None) -> str:
    """Every case of ``bargs`` on this group (NCCL: bf16 on this rank's GPU; else the CPU in
    float32); returns the tables (printed by rank 0)."""
    group = group or dist.group.WORLD
    device, dtype, cases, head = bench_dist.run_setup(bargs, group)
    parts = [
        f"{head}, {bargs.iters} steps per timing; settings: "
        + "; ".join(f"{st.name} {st.env or '{}'}" for st in args.settings)
    ]
    for case in cases:
        parts.append(measure(case, bargs, args.settings, args.rounds, args.profile, group, device, dtype))
        md.clear_cache()
    text = "\n\n".join(parts)
    if dist.get_rank(group) == 0:
        print(text, flush=True)
    return text


def main(argv=None) -> None:
    args, bargs = parse_args(argv)
    with bench_dist.nccl_ranks(bargs.comm_priority == "high"):
        run(args, bargs)


if __name__ == "__main__":
    main()
