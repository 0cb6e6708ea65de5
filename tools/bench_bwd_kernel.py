"""The backward kernel alone (cute_backward_stage, preprocess cached). The variant ``tile_mN``
(e.g. ``tile_m64``) passes the default config with N-row q blocks (correct gradients). (A
``no_dq`` variant, the consumers' dQ hand-off switched off, was removed: the dQ writer warp
waits for that hand-off, so the kernel never ended.)

    python tools/bench_bwd_kernel.py [--cases full8k,causal8k] [--variants base,tile_m64]
                                     [--whole 0,1,2,4,8] [--head-groups 1,2,3,4] [--deterministic]
                                     [--lengths many-short,uniform --totals 32768]

``--whole``: also time `cute_backward` (one whole backward, gradients in the input dtype) with
that many q heads per CTA (0: the default choice); ``--deterministic``: each of those also with
``deterministic=True`` (ordered dQ and dK/dV adds); ``--head-groups``: each of those with that
head group (CTA head slots side by side in the CTA order, schedule.py; only with ``--whole``).
Every variant of a case is timed once per round, in turn (``--rounds``, median), so that clock
drift over the run does not favour the first. ``--lengths`` / ``--totals``: bench_ffa's varlen
grid (document length distributions) after the named cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
from bench_ffa import case_inputs, grid_args, make_cases, median, tflops, time_rounds


def variant_config(name: str, d: int):
    """The config of variant ``name`` at head dim ``d``: None for ``base`` (the default), the
    default with N-row q blocks for ``tile_mN``; ``False`` where no such config exists (e.g.
    80-row blocks only at D 128: BwdConfig asserts its constraints when built)."""
    from ffa_kernels.cute.config import default_bwd_config

    if name == "base":
        return None
    if not name.startswith("tile_m") or not name[len("tile_m") :].isdigit():
        raise ValueError(f"--variants: expected base or tile_mN, got {name!r}")
    try:
        return dataclasses.replace(default_bwd_config(d), tile_m=int(name[len("tile_m") :]))
    except AssertionError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="full8k,causal8k")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    ap.add_argument("--whole", default="")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument(
        "--head-groups",
        default="",
        help="the whole backward's head_group values (in CTA head slots; default: the host's choice)",
    )
    ap.add_argument("--lengths", default="", help="bench_ffa's length distributions, comma-separated")
    ap.add_argument("--totals", default="32768,131072", help="their totals, comma-separated (as bench_ffa)")
    args = ap.parse_args()
    from ffa_kernels.cute import cute_backward, cute_backward_stage, cute_forward

    lengths, totals = grid_args(ap, args.lengths, args.totals)
    for case in make_cases(args.cases.split(","), lengths, totals):
        q, k, v, qr, kr, ty = case_inputs(case)
        dout = torch.randn_like(q)
        out, lse, _ = cute_forward(q, k, v, qr, kr, ty, softmax_scale=None, softcap=0.0, sink=None,
                                   sink_layout="sh", return_max_logits=False)  # fmt: skip
        accs = [torch.zeros(x.shape, device="cuda") for x in (q, k, v)]
        call = (q, k, v, dout, out, lse, qr, kr, ty, *accs)
        timed: dict[str, object] = {}
        for name in args.variants.split(","):
            cfg = variant_config(name, case.d)
            if cfg is False:
                print(f"{case.name:30s} {name:10s} n/a (no such config at D {case.d})", flush=True)
                continue
            timed[name] = lambda c=call, cfg=cfg: cute_backward_stage(
                *c, softmax_scale=None, softcap=0.0, config=cfg
            )
        for det in (False, True) if args.deterministic else (False,):
            groups = [int(x) for x in args.head_groups.split(",") if x] or [0]
            for hpc, hg in itertools.product([int(x) for x in args.whole.split(",") if x], groups):
                if (case.hq // case.hk) % max(hpc, 1):
                    continue

                def whole(hpc=hpc, hg=hg, det=det, call=call):
                    cute_backward(*call[:9], softmax_scale=None, softcap=0.0, heads_per_cta=hpc or None,
                                  head_group=hg or None, deterministic=det)  # fmt: skip

                timed[f"whole{' det' if det else ''} h{hpc}" + (f" g{hg}" if hg else "")] = whole
        for label, ts in time_rounds(timed, args.rounds, args.iters).items():
            t = median(ts)
            tf = 2.5 * tflops(case, t)  # the backward: 2.5x the forward's FLOPs
            print(f"{case.name:30s} {label:12s} {t * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
