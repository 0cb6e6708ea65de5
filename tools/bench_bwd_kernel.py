"""The backward kernel alone (cute_backward_stage, preprocess cached). The variant ``tile_mN``
(e.g. ``tile_m64``) runs the default config with N-row q blocks (correct gradients). (A
``no_dq`` variant, the consumers' dQ hand-off switched off, was removed: the dQ writer warp
waits for that hand-off, so the kernel never ended.)

    python tools/bench_bwd_kernel.py [--cases full8k,causal8k] [--variants base,tile_m64]
                                     [--whole 0,1,2,4,8] [--deterministic]
                                     [--lengths many-short,uniform --totals 32768]

``--whole``: also time `cute_backward` (one whole backward, gradients in the input dtype) with
that many q heads per CTA (0: the default choice); ``--deterministic``: each of those also with
``deterministic=True`` (ordered dQ and dK/dV adds). ``--lengths`` / ``--totals``: bench_ffa's
varlen grid (document length distributions) after the named cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch
from bench_ffa import bench, make_cases


def _variant(name: str) -> None:
    """Set up one variant (its default config) and drop every compiled backward."""
    from ffa_kernels.cute import bwd_interface, compile_cache

    os.environ["FFA_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"ffa_{name}_")
    compile_cache.forget()
    bwd_interface._LAUNCHERS.clear()
    if not hasattr(bwd_interface, "_orig_default_bwd_config"):
        bwd_interface._orig_default_bwd_config = bwd_interface.default_bwd_config
    bwd_interface.default_bwd_config = bwd_interface._orig_default_bwd_config
    if name.startswith("tile_m"):
        # the default config with another q block height (correct gradients), e.g. tile_m128
        orig, rows = bwd_interface._orig_default_bwd_config, int(name[len("tile_m") :])
        bwd_interface.default_bwd_config = lambda d, softcap=False: dataclasses.replace(
            orig(d, softcap), tile_m=rows
        )


def _valid_at(d: int) -> bool:
    """Whether the current variant's config exists at head dim ``d`` (e.g. 80-row blocks only
    at D 128): BwdConfig asserts its constraints when built."""
    from ffa_kernels.cute import bwd_interface

    try:
        bwd_interface.default_bwd_config(d)
    except AssertionError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="full8k,causal8k")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--whole", default="")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--lengths", default="", help="bench_ffa's length distributions, comma-separated")
    ap.add_argument("--totals", default="32768", help="their totals, comma-separated")
    args = ap.parse_args()
    from ffa_kernels.cute import cute_backward, cute_backward_stage, cute_forward

    lengths = [x for x in args.lengths.split(",") if x]
    totals = [int(x) for x in args.totals.split(",") if x]
    for case in make_cases(args.cases.split(","), lengths, totals):
        torch.manual_seed(0)
        q = torch.randn(case.total, case.hq, case.d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(case.total, case.hk, case.d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(case.total, case.hk, case.dv, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        qr = torch.tensor(case.q_ranges, dtype=torch.int32, device="cuda")
        kr = torch.tensor(case.k_ranges, dtype=torch.int32, device="cuda")
        ty = torch.tensor(case.types, dtype=torch.int32, device="cuda")
        out, lse, _ = cute_forward(q, k, v, qr, kr, ty, softmax_scale=None, softcap=0.0, sink=None,
                                   sink_layout="sh", return_max_logits=False)  # fmt: skip
        accs = [torch.zeros(x.shape, device="cuda") for x in (q, k, v)]
        call = (q, k, v, dout, out, lse, qr, kr, ty, *accs)
        for name in args.variants.split(","):
            _variant(name)
            if not _valid_at(case.d):
                print(f"{case.name:30s} {name:10s} n/a (no such config at D {case.d})", flush=True)
                continue
            t = bench(lambda c=call: cute_backward_stage(*c, softmax_scale=None, softcap=0.0), args.iters)
            tf = 10 * case.area * case.hq * case.d / t / 1e12
            print(f"{case.name:30s} {name:10s} {t * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s", flush=True)
        _variant("base")
        for det in (False, True) if args.deterministic else (False,):
            for hpc in [int(x) for x in args.whole.split(",") if x]:
                if (case.hq // case.hk) % max(hpc, 1):
                    continue

                def whole(hpc=hpc, det=det, call=call):
                    cute_backward(*call[:9], softmax_scale=None, softcap=0.0, heads_per_cta=hpc or None,
                                  deterministic=det)  # fmt: skip

                t = bench(whole, args.iters)
                tf = 10 * case.area * case.hq * case.d / t / 1e12
                label = f"whole{' det' if det else ''} h{hpc}"
                print(f"{case.name:30s} {label:12s} {t * 1e3:8.3f} ms  {tf:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
