"""How the CTA order's head groups shape the tail of a kernel, simulated on the CPU (no GPU).

The sm90 kernels run one CTA per (work tile, head) in the order of ``cute/schedule.py``: heads
in groups of G, in a group the work tiles longest first with the G heads of a tile side by side.
The hardware hands the next CTA in that order to the first SM that frees up (one CTA per SM for
these kernels). This tool replays that order with each CTA costing its walk (the plan's blocks;
for the backward times its q heads per CTA) plus ``--fixed`` blocks of per-CTA setup, and prints
the makespan over the ideal (total work / SMs) for the host's current group size and for others.
It models the tail only, not L2 traffic (which is what caps G from above).

On an H100 the backward of causal 8k (16 heads of 128) measured 505 / 531 / 575 TFLOP/s with
groups of 3 / 1 / 4; this model gives 1.156 / 1.111 / 1.005 (ratios 1.14 / 1.08 measured against
1.15 / 1.11 modelled). Usage (from tools/, CPU):

    python sim_head_groups.py [--cases causal8k,full8k,swa8k] [--lengths uniform --totals 32768]
"""

from __future__ import annotations

import argparse
import heapq

import torch
from bench_ffa import grid_args, make_cases


def makespan_over_ideal(costs: list[float], sms: int) -> float:
    """CTAs of ``costs`` dispatched in order to the first free SM: the last end over sum / sms."""
    free = [0.0] * sms
    end = 0.0
    for c in costs:
        start = heapq.heappop(free)
        heapq.heappush(free, start + c)
        end = max(end, start + c)
    return end / (sum(costs) / sms)


def cta_costs(walks: list[float], slots: int, group: int) -> list[float]:
    """Per-CTA costs in launch order (schedule.cta_work_and_head): ``slots`` head slots in groups
    of ``group``; inside a group the work tiles in plan order, the group's slots of a tile adjacent."""
    costs: list[float] = []
    for h0 in range(0, slots, group):
        costs += [w for w in walks for _ in range(min(group, slots - h0))]
    return costs


def main() -> None:
    from ffa_kernels.cute.bwd_interface import bwd_head_group_size, bwd_heads_per_cta
    from ffa_kernels.cute.config import default_bwd_config, default_config
    from ffa_kernels.cute.interface import head_group_size, tail_head_group
    from ffa_kernels.cute.tile_plan import get_plan

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--cases", default="full8k,causal8k,swa8k,full8k_d64,causal8k_d64,full8k_d256,causal8k_d256"
    )
    ap.add_argument("--lengths", default="", help="bench_ffa's length distributions, comma-separated")
    ap.add_argument("--totals", default="32768,131072", help="as bench_ffa")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument(
        "--fixed", type=float, default=None, help="per-CTA setup cost, in blocks (default: the host rule's)"
    )
    ap.add_argument("--groups", default="1,2,3,4,6,8,12,16")
    args = ap.parse_args()
    if args.fixed is None:
        from ffa_kernels.cute.interface import _CTA_SETUP_BLOCKS

        args.fixed = float(_CTA_SETUP_BLOCKS)
    lengths, totals = grid_args(ap, args.lengths, args.totals)
    cpu = torch.device("cpu")
    for case in make_cases(args.cases.split(","), lengths, totals):
        qr, kr, ty = (torch.tensor(x, dtype=torch.int32) for x in (case.q_ranges, case.k_ranges, case.types))
        rows = []
        fcfg = default_config(case.d, case.dv)
        plan = get_plan(qr, kr, ty, case.total, fcfg.tile_m, fcfg.tile_n, cpu)
        walks = [float(w) + args.fixed for w in plan.work[:, 3].tolist()]
        g_now = tail_head_group(
            head_group_size(case.total, case.hq, case.hk, case.d, case.dv, 2), case.hq // case.hk, case.hq, plan,
            args.sms,
        )  # fmt: skip
        rows.append(("fwd", walks, case.hq, case.hq // case.hk, g_now))  # groups of q heads, whole K/V heads
        if case.d in (64, 128):
            bcfg = default_bwd_config(case.d)
            plan = get_plan(qr, kr, ty, case.total, bcfg.tile_n, bcfg.tile_m, cpu, backward=True)
            hpc = bwd_heads_per_cta(
                plan.num_work, case.hq, case.hk, args.sms, None, plan.walk_blocks * bcfg.tile_m
            )
            walks = [hpc * float(w) + args.fixed for w in plan.work[:, 3].tolist()]
            g_now = bwd_head_group_size(case.total, case.hq, case.d, hpc)
            rows.append((f"bwd h{hpc}", walks, case.hq // hpc, 1, g_now))  # groups of head slots
        for kind, walks, slots, unit, g_now in rows:
            cells = [f"now g{g_now} {makespan_over_ideal(cta_costs(walks, slots, g_now), args.sms):.3f}"]
            for g in (int(x) for x in args.groups.split(",") if x):
                if g % unit == 0 and g <= slots and g != g_now:
                    cells.append(f"g{g} {makespan_over_ideal(cta_costs(walks, slots, g), args.sms):.3f}")
            print(f"{case.name:34s} {kind:6s} tiles {len(walks):5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
