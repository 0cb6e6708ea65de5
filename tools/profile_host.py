"""Where the host's time of one call goes: cProfile over many calls of ``flex_flash_attn_func``'s
forward (``fwd``), its training step (``step``: forward + backward), and the same for
FlashAttention-4 (``--fa4``), per case. Prints the host microseconds per call (no synchronisation
inside the timed loop: where that is close to the GPU time, the call is host-bound) and the
functions that take the most time of their own (tottime) and in all (cumtime).

    python tools/profile_host.py [--cases swa8k,causal8k] [--calls 200] [--top 25] [--fa4]
                                 [--api | --breakdown]

``--api``: instead of cProfile, torch.profiler's CPU events (torch ops, CUDA runtime and driver
calls: a synchronising call shows up there with its count). ``--breakdown``: instead of
profiles, the unprofiled host microseconds of each layer of a call
(argument checks, the forward kernel's host interface, the autograd forward, the backward's
host interface, the whole step), so that the difference between two lines is that layer's cost.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from bench_ffa import case_inputs, host_us, make_cases, run_fa4, run_ffa_autograd, training_step


def host_profile(fn, calls: int, top: int, label: str) -> None:
    """Print ``fn``'s host microseconds per call over ``calls`` calls (after a warm-up), then the
    ``top`` functions of a profile of the same calls by own time and by cumulative time."""
    host = host_us_per_call(fn, calls)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"== {label}: host {host:.0f} us per call (unprofiled)", flush=True)
    print_profile(prof, top)


def print_profile(prof: cProfile.Profile, top: int) -> None:
    """Print ``prof``'s ``top`` functions by own time, then by cumulative time (also
    tools/bench_comm.py's ``--profile-host``)."""
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(top)
        body = s.getvalue()
        # the header lines pstats prints before its table carry nothing per call
        print(body[body.find("ncalls") :], flush=True)


def host_us_per_call(fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` over ``calls`` calls, after a warm-up (no sync inside)."""
    for _ in range(5):
        fn()
    return host_us(fn, calls)


def breakdown(case, calls: int) -> None:
    """Print the host time of each layer of one FFA call and step (see the module docstring)."""
    from ffa_kernels._validate import validate_attn_args
    from ffa_kernels.cute import cute_backward, cute_forward

    q, k, v, qr, kr, ty = case_inputs(case, requires_grad=True)
    fwd = run_ffa_autograd(q, k, v, qr, kr, ty)
    with torch.no_grad():
        out, lse, _ = cute_forward(q, k, v, qr, kr, ty, softmax_scale=None, softcap=0.0, sink=None,
                                   sink_layout="sh", return_max_logits=False)  # fmt: skip
    dout = torch.randn_like(out)
    fwd_kw = dict(softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh", return_max_logits=False)
    layers = {
        "validate_attn_args": lambda: validate_attn_args(q, k, v, qr, kr, ty, None, 0.0),
        "cute_forward": lambda: cute_forward(q, k, v, qr, kr, ty, **fwd_kw),
        "flex_flash_attn_func (grad)": fwd,
        "cute_backward": lambda: cute_backward(
            q, k, v, dout, out, lse, qr, kr, ty, softmax_scale=None, softcap=0.0
        ),
        "step": training_step(fwd, (q, k, v)),
    }
    f4 = run_fa4(case, q, k, v)
    if f4 is not None:
        layers["fa4 fwd (grad)"] = f4
        layers["fa4 step"] = training_step(f4, (q, k, v))
    for name, fn in layers.items():
        print(f"{case.name:32s} {name:28s} {host_us_per_call(fn, calls):7.1f} us", flush=True)


def api_calls(fn, calls: int, top: int, label: str) -> None:
    """Print the CPU-side events (torch ops and CUDA runtime / driver calls) of ``calls`` calls
    of ``fn`` under torch.profiler, by their own CPU time: a synchronising call (a device-to-host
    copy, a stream sync) shows up with its count."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"== {label}: {calls} calls", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="swa8k,causal8k")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--fa4", action="store_true", help="profile FlashAttention-4's calls too")
    ap.add_argument("--breakdown", action="store_true", help="host time per layer, no profiles")
    ap.add_argument("--api", action="store_true", help="torch.profiler's CPU events (runtime calls) instead")
    args = ap.parse_args(argv)
    for case in make_cases(args.cases.split(",")):
        if args.breakdown:
            breakdown(case, args.calls)
            continue
        q, k, v, qr, kr, ty = case_inputs(case, requires_grad=True)
        fwd = run_ffa_autograd(q, k, v, qr, kr, ty)
        runs = {"ffa fwd": fwd, "ffa step": training_step(fwd, (q, k, v))}
        if args.fa4:
            f4 = run_fa4(case, q, k, v)
            if f4 is not None:
                runs["fa4 step"] = training_step(f4, (q, k, v))
        for name, fn in runs.items():
            if args.api:
                api_calls(fn, args.calls, args.top, f"{case.name} {name}")
            else:
                host_profile(fn, args.calls, args.top, f"{case.name} {name}")


if __name__ == "__main__":
    main()
