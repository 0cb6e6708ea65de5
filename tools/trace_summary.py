"""Where a profiled step's GPU time goes, from a torch.profiler Chrome trace (the files of
``bench_dist.py --trace``: 3 steps; ``bench_comm.py --profile-host``: pass ``--steps 10``;
``profile_step.py --trace``: its ``--steps``):

    python tools/trace_summary.py TRACE.json [--steps 3] [--top 12] [--gaps 8] [--keep-first]

Per CUDA stream: its busy time (the union of its kernels, copies and fills) and its largest
kernels by total time. For the compute stream (the busiest one): the window from the first to
the last GPU event of the trace, the stream's idle time inside it, how much of that idle time
another stream was busy (communication the compute stream waited for, or at least did not
overlap) and how much no stream was (the host or a dependency), and its largest idle gaps with
the kernels on either side. Times are per step: totals divided by ``--steps``. The first step's
share of the GPU events (the first 1 / steps of them by start, as profile_step.py drops it) is
left out unless ``--keep-first``: the first call under the profiler waits on its start-up
(gaps of 50-260 us where later steps have 3).

"Busy" is any kernel on the stream, including communication kernels that only wait for a peer
(the arm-and-wait launch, a fused reduction's wait, NCCL's kernels): "idle while another stream
was busy" is the communication the compute stream did not overlap plus the ranks' skew, not
the transfers' time alone.

The pure parts (`gpu_events`, `union`, `overlap`, `summarize`) are tested on the CPU with
synthetic traces (integration_tests/test_trace_summary.py).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class GpuEvent:
    """One GPU activity of a trace, times in microseconds."""

    name: str
    stream: int
    start: float
    end: float


def gpu_events(trace: dict) -> list[GpuEvent]:
    """The kernels, copies and fills of a Chrome trace (``traceEvents`` with ``ph`` "X" and a
    GPU category), sorted by start."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATEGORIES:
            continue
        stream = int(e.get("args", {}).get("stream", -1))
        start = float(e["ts"])
        out.append(GpuEvent(e.get("name", "?"), stream, start, start + float(e.get("dur", 0.0))))
    return sorted(out, key=lambda ev: ev.start)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``(start, end)`` intervals."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, e - s)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def idle(busy: list[tuple[float, float]], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The parts of ``window`` outside ``busy`` (disjoint, sorted)."""
    gaps, at = [], window[0]
    for s, e in busy:
        if s > at:
            gaps.append((at, min(s, window[1])))
        at = max(at, e)
    if at < window[1]:
        gaps.append((at, window[1]))
    return [(s, e) for s, e in gaps if e > s]


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def summarize(
    events: list[GpuEvent], steps: int = 1, top: int = 12, gaps: int = 8, skip_first: bool = True
) -> str:
    """The report (see the module docstring) of ``events`` (sorted by start), times per step;
    ``skip_first``: without the first step's share of the events (when ``steps`` > 1)."""
    if not events:
        return "no GPU events in the trace (was CUDA profiled?)"
    steps = max(1, steps)
    if skip_first and steps > 1:
        events = events[len(events) // steps :]
        steps -= 1
    by_stream: dict[int, list[GpuEvent]] = defaultdict(list)
    for ev in events:
        by_stream[ev.stream].append(ev)
    busy = {s: union([(e.start, e.end) for e in evs]) for s, evs in by_stream.items()}
    window = (events[0].start, max(e.end for e in events))
    span = window[1] - window[0]
    lines = [f"window {span / steps:.1f} us per step ({steps} steps, {len(events)} GPU events)"]
    compute = max(busy, key=lambda s: length(busy[s]))
    for s in sorted(by_stream, key=lambda s: -length(busy[s])):
        tag = " (compute)" if s == compute else ""
        lines.append(f"\nstream {s}{tag}: busy {length(busy[s]) / steps:.1f} us per step "
                     f"({100 * length(busy[s]) / span:.1f}% of the window)")  # fmt: skip
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in by_stream[s]:
            totals[ev.name][0] += ev.end - ev.start
            totals[ev.name][1] += 1
        for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {t / steps:9.1f} us  {n / steps:5.1f}x  {_short(name)}")
    others = union([iv for s, ivs in busy.items() if s != compute for iv in ivs])
    gap_list = idle(busy[compute], window)
    waited = overlap(gap_list, others)
    lines.append(
        f"\ncompute stream {compute} idle {length(gap_list) / steps:.1f} us per step: "
        f"{waited / steps:.1f} us while another stream was busy, "
        f"{(length(gap_list) - waited) / steps:.1f} us with no stream busy"
    )
    comp = by_stream[compute]
    for s, e in sorted(gap_list, key=lambda g: g[0] - g[1])[:gaps]:
        before = max((ev for ev in comp if ev.end <= s), key=lambda ev: ev.end, default=None)
        after = min((ev for ev in comp if ev.start >= e), key=lambda ev: ev.start, default=None)
        other = overlap([(s, e)], others)
        lines.append(
            f"  gap {e - s:8.1f} us at +{s - window[0]:.1f} (other streams busy {other:.1f} us): "
            f"after {_short(before.name, 40) if before else '-'} / before {_short(after.name, 40) if after else '-'}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+", help="Chrome trace JSON files (one report each)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps in each trace (bench_dist: 3)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per stream")
    ap.add_argument("--gaps", type=int, default=8, help="largest idle gaps of the compute stream listed")
    ap.add_argument("--keep-first", action="store_true", help="count the first step too")
    args = ap.parse_args(argv)
    for path in args.trace:
        with open(path) as f:
            trace = json.load(f)
        print(f"== {path}")
        print(summarize(gpu_events(trace), args.steps, args.top, args.gaps, not args.keep_first), flush=True)


if __name__ == "__main__":
    main()
