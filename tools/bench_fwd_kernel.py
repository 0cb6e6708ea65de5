"""The forward kernel alone (cute_forward) under other configurations than the default: a sweep of
FwdConfig fields, each variant timed in interleaved rounds (median) beside the default, and its
output checked against the default's (a variant that computes something else is reported, not
timed as a win).

    python tools/bench_fwd_kernel.py --cases causal8k_d64,full8k_d64 \\
        --variants "m128:tile_m=128,num_mma_wg=2,mma_regs=240,producer_regs=24;stages3:num_stages=3"

A variant is ``label:field=value,...`` (FwdConfig fields but the head dims; bools as true/false or
1/0), variants separated by ``;``; a variant FwdConfig refuses (its asserts), or that fails to
compile or launch, is reported as n/a; one whose output or lse differs from the default's as
WRONG (not timed). ``--head-dims`` adds
bench_ffa's full/causal 8k cases at those head dims (e.g. 64).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from bench_ffa import case_inputs, make_cases, median, tflops, time_rounds

_FIXED = ("head_dim", "head_dim_v")  # set by the case's inputs, not by a variant


def _field_value(label: str, name: str, value: str, current):
    """``value`` as the type of the config field ``name`` (whose default is ``current``)."""
    low = value.strip().lower()
    if isinstance(current, bool):
        if low in ("true", "1"):
            return True
        if low in ("false", "0"):
            return False
        raise ValueError(f"--variants: {label}: {name} takes true/false or 1/0, got {value!r}")
    if low in ("true", "false"):
        raise ValueError(f"--variants: {label}: {name} is a {type(current).__name__}, got {value!r}")
    return type(current)(value.strip())


def parse_variants(spec: str, head_dim: int, head_dim_v: int) -> dict[str, object]:
    """``label -> FwdConfig`` (or the refusal's text) from ``--variants``, on the default of
    ``head_dim`` / ``head_dim_v``; ``base`` (the default) first."""
    from ffa_kernels.cute.config import default_config

    base = default_config(head_dim, head_dim_v)
    fields = {f.name for f in dataclasses.fields(base)} - set(_FIXED)
    out: dict[str, object] = {"base": base}
    for item in (x for x in spec.split(";") if x.strip()):
        label, _, body = item.partition(":")
        label = label.strip()
        if not body.strip():
            raise ValueError(f"--variants: expected label:field=value,..., got {item!r}")
        if label in out:
            raise ValueError(f"--variants: label {label!r} used twice (base is the default's)")
        changes: dict[str, object] = {}
        for kv in body.split(","):
            name, _, value = (x.strip() for x in kv.partition("="))
            if name not in fields:
                raise ValueError(
                    f"--variants: {label}: no FwdConfig field {name!r} to set (one of {sorted(fields)})"
                )
            changes[name] = _field_value(label, name, value, getattr(base, name))
        try:
            out[label] = dataclasses.replace(base, **changes)
        except AssertionError as exc:
            out[label] = f"n/a ({str(exc) or 'refused by FwdConfig'})"
    return out


def bench_case(case, spec: str, rounds: int, iters: int) -> None:
    """Check and time every variant of ``spec`` on ``case``; prints one line per variant. The
    case's tensors die with this frame."""
    from ffa_kernels.cute import cute_forward

    inputs = case_inputs(case)
    timed = {}
    ref = None
    for label, cfg in parse_variants(spec, case.d, case.dv).items():
        if isinstance(cfg, str):
            print(f"{case.name:30s} {label:12s} {cfg}", flush=True)
            continue

        def fwd(cfg=cfg):
            return cute_forward(*inputs, softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh",
                                return_max_logits=False, config=cfg)  # fmt: skip

        try:
            out, lse, _ = fwd()
        except Exception as exc:  # a variant that does not compile or launch is reported, not timed
            print(f"{case.name:30s} {label:12s} n/a ({type(exc).__name__}: {exc})", flush=True)
            continue
        if ref is None:
            ref = (out.float(), lse)
        d_out = (out.float() - ref[0]).abs().max().item()
        d_lse = (lse - ref[1]).abs().max().item()
        # the default's output up to bf16 rounding of another summation order; lse in float32
        if not (d_out <= 2e-2 and d_lse <= 1e-3):
            print(
                f"{case.name:30s} {label:12s} WRONG: max |out - base| {d_out:.3g}, |lse - base| {d_lse:.3g}"
            )
            continue
        timed[label] = fwd
    for label, ts in time_rounds(timed, rounds, iters).items():
        t = median(ts)
        print(f"{case.name:30s} {label:12s} {t * 1e3:8.3f} ms  {tflops(case, t):6.1f} TFLOP/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="causal8k_d64")
    ap.add_argument("--head-dims", default="", help="also bench_ffa's full/causal 8k at these head dims")
    ap.add_argument("--variants", default="", help="label:field=value,...;label:...")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    args = ap.parse_args()
    head_dims = [x for x in args.head_dims.split(",") if x]
    for case in make_cases([x for x in args.cases.split(",") if x], head_dims=head_dims):
        bench_case(case, args.variants, args.rounds, args.iters)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
