"""The forward kernel alone (cute_forward) under other configurations than the default: a sweep of
FwdConfig fields, each variant timed in interleaved rounds (median) beside the default, and its
output checked against the default's (a variant that computes something else is reported, not
timed as a win).

    python tools/bench_fwd_kernel.py --cases causal8k_d64,full8k_d64 \\
        --variants "m128:tile_m=128,num_mma_wg=2,mma_regs=240,producer_regs=24;stages3:num_stages=3"

A variant is ``label:field=value,...`` (FwdConfig fields, ints or true/false), variants separated
by ``;``; a variant FwdConfig refuses (its asserts) is reported as n/a. ``--head-dims`` adds
bench_ffa's full/causal 8k cases at those head dims (e.g. 64).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from bench_ffa import bench, case_inputs, make_cases


def parse_variants(spec: str, head_dim: int, head_dim_v: int) -> dict[str, object]:
    """``label -> FwdConfig`` (or the refusal's text) from ``--variants``, on the default of
    ``head_dim`` / ``head_dim_v``; ``base`` (the default) first."""
    from ffa_kernels.cute.config import default_config

    base = default_config(head_dim, head_dim_v)
    out: dict[str, object] = {"base": base}
    for item in (x for x in spec.split(";") if x.strip()):
        label, _, fields = item.partition(":")
        if not fields:
            raise ValueError(f"--variants: expected label:field=value,..., got {item!r}")
        changes: dict[str, object] = {}
        for kv in fields.split(","):
            name, _, value = kv.partition("=")
            if name not in {f.name for f in dataclasses.fields(base)}:
                raise ValueError(f"--variants: {label}: FwdConfig has no field {name!r}")
            low = value.strip().lower()
            changes[name] = low == "true" if low in ("true", "false") else type(getattr(base, name))(value)
        try:
            out[label.strip()] = dataclasses.replace(base, **changes)
        except AssertionError as exc:
            out[label.strip()] = f"n/a ({exc})"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="causal8k_d64")
    ap.add_argument("--head-dims", default="", help="also bench_ffa's full/causal 8k at these head dims")
    ap.add_argument("--variants", default="")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    args = ap.parse_args()
    from ffa_kernels.cute import cute_forward

    head_dims = [x for x in args.head_dims.split(",") if x]
    for case in make_cases([x for x in args.cases.split(",") if x], head_dims=head_dims):
        inputs = case_inputs(case)
        timed = {}
        ref = None
        for label, cfg in parse_variants(args.variants, case.d, case.dv).items():
            if isinstance(cfg, str):
                print(f"{case.name:30s} {label:12s} {cfg}", flush=True)
                continue

            def fwd(cfg=cfg, inputs=inputs):
                return cute_forward(*inputs, softmax_scale=None, softcap=0.0, sink=None,
                                    sink_layout="sh", return_max_logits=False, config=cfg)[0]  # fmt: skip

            out = fwd().float()
            if ref is None:
                ref = out
            diff = (out - ref).abs().max().item()
            if not diff <= 2e-2:  # the default's output, up to bf16 rounding of another order
                print(f"{case.name:30s} {label:12s} WRONG: max |out - base| {diff:.3g}", flush=True)
                continue
            timed[label] = fwd
        # every variant in turn per round, the median: clock drift hits all of them alike
        times: dict[str, list[float]] = {label: [] for label in timed}
        for _ in range(args.rounds):
            for label, fn in timed.items():
                times[label].append(bench(fn, args.iters))
        for label, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            tf = 4 * case.area * case.hq * case.d / t / 1e12
            print(f"{case.name:30s} {label:12s} {t * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s", flush=True)
        del inputs, ref, timed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
