"""Forward / training-step benchmark: FFA (CuTe DSL sm90) vs FlashAttention-4, cuDNN SDPA and
FlexAttention.

TFLOP/s are counted over the mask area: 2 * area * Hq * (D + Dv) per forward (4 * area * Hq * D
where v's head dim Dv is D), 2.5x that per backward, 3.5x per training step (forward + backward
through autograd; backward = step - forward). ``--head-dims 192/128`` (MLA: q/k 192, v 128) runs
FFA's forward kernel; its backward runs on the reference (warned). Every library runs in this
process on the same inputs. Usage (GPU machine):

    python tools/bench_ffa.py [--cases full8k,causal8k,...] [--iters 20] [--no-flex] [--check] [--bwd]
        [--lengths uniform,long-tailed,many-short,few-long-many-short,equal --totals 32768,131072]
        [--head-dims 64,128,256,192/128]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch


# ----------------------------------------------------------------------------- masks
def area_of(q_ranges, k_ranges, types) -> int:
    tot = 0
    for (qs, qe), (ks, ke), t in zip(q_ranges, k_ranges, types):
        sq, sk = qe - qs, ke - ks
        if sq <= 0 or sk <= 0:
            continue
        i = torch.arange(sq, dtype=torch.int64)
        hi = torch.full_like(i, sk - 1)
        lo = torch.zeros_like(i)
        if t in (1, 3):
            hi = torch.minimum(hi, i + (sk - sq))
        if t in (2, 3):
            lo = torch.maximum(lo, i)
        tot += int((hi - lo + 1).clamp_min(0).sum())
    return tot


def doc_lengths(total: int, n: int, seed: int, max_frac: float | None = None) -> list[int]:
    rng = random.Random(seed)
    if max_frac is None:
        w = [rng.uniform(0.5, 1.5) for _ in range(n)]
    else:  # long-tailed: a few long documents, many short ones, each <= max_frac * total
        w = [rng.paretovariate(1.2) for _ in range(n)]
    s = sum(w)
    lens = [max(1, int(total * x / s)) for x in w]
    if max_frac is not None:
        cap = int(max_frac * total)
        lens = [min(x, cap) for x in lens]
    lens[-1] += total - sum(lens)
    while lens[-1] <= 0 or (max_frac is not None and lens[-1] > int(max_frac * total)):
        # rebalance into the shortest documents
        extra = lens[-1] - (int(max_frac * total) if max_frac else 1)
        lens[-1] -= extra
        j = min(range(len(lens) - 1), key=lambda a: lens[a])
        lens[j] += extra
    assert sum(lens) == total
    return lens


def cu_from(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


class Case:
    def __init__(
        self, name, total, hq, hk, d, q_ranges, k_ranges, types, *, fa4=None, sdpa=None, flex=None, dv=None
    ):
        self.name, self.total, self.hq, self.hk, self.d = name, total, hq, hk, d
        self.dv = d if dv is None else dv  # v's head dim (MLA: 192 / 128)
        self.q_ranges, self.k_ranges, self.types = q_ranges, k_ranges, types
        self.fa4, self.sdpa, self.flex = fa4, sdpa, flex  # descriptions of the peer calls
        self.area = area_of(q_ranges, k_ranges, types)


T8, T32 = 8192, 32768


def dense_case(name: str, heads: int, d: int, causal: bool, dv: int | None = None) -> Case:
    """Full or causal attention over one 8k sequence (MHA); ``dv``: v's own head dim."""
    return Case(name, T8, heads, heads, d, [[0, T8]], [[0, T8]], [int(causal)],
                fa4=dict(causal=causal), sdpa=None if dv not in (None, d) else dict(causal=causal),
                flex=dict(kind="causal" if causal else "full"), dv=dv)  # fmt: skip


def varlen_case(name: str, hq: int, hk: int, lens: list[int], causal: bool) -> Case:
    """Packed documents of lengths ``lens`` (their sum is the total), each full or causal within itself."""
    cu = cu_from(lens)
    n = len(lens)
    qr = [[cu[i], cu[i + 1]] for i in range(n)]
    return Case(name, cu[-1], hq, hk, 128, qr, qr, [int(causal)] * n,
                fa4=dict(cu=cu, causal=causal), flex=dict(kind="doc", cu=cu, causal=causal))  # fmt: skip


def swa_case() -> Case:
    w = 1024
    return Case("sliding-window causal 8k w1024", T8, 16, 16, 128, [[0, w], [w, T8]], [[0, w], [0, T8]],
                [1, 3], fa4=dict(causal=True, window=(w, 0)), flex=dict(kind="swa", w=w))  # fmt: skip


def block_causal_case() -> Case:
    cu = cu_from(doc_lengths(T32, 12, 4))
    blk = 2048
    qr, kr = [], []
    for i in range(12):
        s, e = cu[i], cu[i + 1]
        for b0 in range(s, e, blk):
            b1 = min(b0 + blk, e)
            qr.append([b0, b1])
            kr.append([s, b1])
    return Case("varlen block-causal 32k b2048", T32, 16, 16, 128, qr, kr, [0] * len(qr),
                flex=dict(kind="blockcausal", cu=cu, blk=blk))  # fmt: skip


CASES = {  # name -> builder; make_cases keeps this order whatever the order of the names asked for
    "full8k": lambda: dense_case("full 8k", 16, 128, causal=False),
    "causal8k": lambda: dense_case("causal 8k", 16, 128, causal=True),
    "full8k_d64": lambda: dense_case("full 8k d64 32h", 32, 64, causal=False),
    "causal8k_d64": lambda: dense_case("causal 8k d64 32h", 32, 64, causal=True),
    "full8k_d256": lambda: dense_case("full 8k d256 8h", 8, 256, causal=False),
    "causal8k_d256": lambda: dense_case("causal 8k d256 8h", 8, 256, causal=True),
    "varlen_causal32k": lambda: varlen_case(
        "varlen causal 32k/12", 16, 16, doc_lengths(T32, 12, 0), causal=True
    ),
    "varlen_full32k": lambda: varlen_case(
        "varlen full 32k/12", 16, 16, doc_lengths(T32, 12, 1), causal=False
    ),
    "gqa_varlen_causal32k": lambda: varlen_case(
        "GQA 64:8 varlen causal 32k", 64, 8, doc_lengths(T32, 24, 2, max_frac=0.25), causal=True
    ),
    "swa8k": swa_case,
    "block_causal32k": block_causal_case,
}


# --lengths: document length distributions of the varlen grid (issue 20)
def _lengths_many_short(total: int, seed: int) -> list[int]:
    """Documents of 64-512 tokens (chat, code), the last one takes the remainder."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(min(rng.randint(64, 512), total - sum(lens)))
    return lens


def _lengths_few_long_many_short(total: int, seed: int) -> list[int]:
    """Half the tokens in 2 long documents, the other half in documents of 64-512 tokens."""
    long_part = total // 2
    return [long_part // 2, long_part - long_part // 2, *_lengths_many_short(total - long_part, seed)]


LENGTHS = {  # name -> (total, seed) -> document lengths summing to total
    "uniform": lambda total, seed: doc_lengths(total, 12, seed),
    "long-tailed": lambda total, seed: doc_lengths(total, 24, seed, max_frac=0.25),
    "many-short": _lengths_many_short,
    "few-long-many-short": _lengths_few_long_many_short,
    "equal": lambda total, seed: [total // 8] * 7 + [total - 7 * (total // 8)],
}


def varlen_grid(lengths: list[str], totals: list[int]) -> list[Case]:
    """Varlen causal and full, MHA 16:16 and GQA 64:8, for each length distribution and total."""
    cases = []
    for dist in lengths:
        for total in totals:
            lens = LENGTHS[dist](total, 0)
            for causal in (True, False):
                for hq, hk in ((16, 16), (64, 8)):
                    kind = "causal" if causal else "full"
                    name = f"{dist} {kind} {total // 1024}k/{len(lens)} {hq}:{hk}"
                    cases.append(varlen_case(name, hq, hk, lens, causal))
    return cases


def head_dim_cases(specs: list[str]) -> list[Case]:
    """Full and causal 8k for each head dim spec: "128", or "192/128" (q/k 192, v 128: MLA);
    heads chosen so that every case does the same work as 16 heads of 128."""
    cases = []
    for spec in specs:
        d, _, dv = spec.partition("/")
        d, dv = int(d), int(dv or d)
        heads = max(1, 16 * 256 // (d + dv))
        for causal in (False, True):
            name = f"{'causal' if causal else 'full'} 8k d{spec} {heads}h"
            cases.append(dense_case(name, heads, d, causal, dv=dv))
    return cases


def make_cases(names, lengths: list[str] | None = None, totals: list[int] | None = None, head_dims=None):
    """The named cases in CASES order, then the varlen grid over ``lengths`` x ``totals`` and
    the dense cases of ``head_dims``."""
    cases = [make() for name, make in CASES.items() if name in names]
    if lengths:
        cases += varlen_grid(lengths, totals or [T32])
    if head_dims:
        cases += head_dim_cases(head_dims)
    return cases


# ----------------------------------------------------------------------------- timing
# A timed run lasts at least this long: at 10 iterations a 0.5 ms call (the sliding-window
# backward) is timed over 5 ms, and such cases moved by up to a quarter between runs.
MIN_TIMED_S = 0.025


def bench(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call of ``fn``: the mean over at least ``iters`` calls and ``MIN_TIMED_S``,
    after ``warmup`` calls (the last of them, timed alone, sets how many calls that takes)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for _ in range(max(warmup - 1, 0)):
        fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = max(start.elapsed_time(end) * 1e-3, 1e-6)
    n = max(iters, math.ceil(MIN_TIMED_S / one))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e-3


def paired_overhead(base, variant, iters: int, pairs: int = 15) -> float:
    """Median over back-to-back pairs of time(variant) / time(base) - 1, the order alternating
    within the pairs: both sides of a pair see the same clock, so drift cancels."""
    ratios = []
    for i in range(pairs):
        if i % 2:
            tv = bench(variant, iters, warmup=1)
            tb = bench(base, iters, warmup=1)
        else:
            tb = bench(base, iters, warmup=1)
            tv = bench(variant, iters, warmup=1)
        ratios.append(tv / tb - 1.0)
    return median(ratios)


def median(xs: list[float]) -> float:
    """The upper median (the middle of an odd count)."""
    return sorted(xs)[len(xs) // 2]


def time_rounds(fns: dict, rounds: int, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns`` (name -> callable) in ``rounds`` rounds, each round
    timing every function once in turn (`bench`): clock and thermal drift over the run hit all
    of them alike, where timing one after another favoured whichever ran first. Per name, the
    rounds' times (take their `median`)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn, iters))
    return times


def host_us(fn, iters: int = 20) -> float:
    """Host time per call (launch overhead), measured without synchronising."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / iters * 1e6


def tflops(case: Case, sec: float) -> float:
    """Forward TFLOP/s over the mask area: 2 * area * Hq * (D + Dv) (= 4 * area * Hq * D)."""
    return 2 * case.area * case.hq * (case.d + case.dv) / sec / 1e12


# ----------------------------------------------------------------------------- peers
def run_ffa(q, k, v, qr, kr, ty, *, max_logits: bool = False, head_group: int | None = None):
    from ffa_kernels.cute import cute_forward

    def f():
        return cute_forward(q, k, v, qr, kr, ty, softmax_scale=None, softcap=0.0, sink=None, sink_layout="sh",
                            return_max_logits=max_logits, head_group=head_group)  # fmt: skip

    return f


def run_ffa_autograd(q, k, v, qr, kr, ty):
    """The user's path: flex_flash_attn_func (autograd; its backward is the kernel's)."""
    from ffa_kernels import flex_flash_attn_func

    def f():
        return flex_flash_attn_func(q, k, v, qr, kr, ty)[0]

    return f


def training_step(fwd, leaves):
    """forward + backward of ``fwd`` (whose output is a tensor or a tuple starting with one),
    with a fixed random output gradient; the leaves' .grad are dropped each step (no accumulate)."""
    out = fwd()
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn_like(out)

    def f():
        for x in leaves:
            x.grad = None
        o = fwd()
        o = o[0] if isinstance(o, tuple) else o
        o.backward(grad)

    return f


def step_peak_mib(step) -> float | None:
    """Peak memory allocated during one training step beyond what was allocated before it."""
    if step is None:
        return None
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_fa4(case, q, k, v):
    if case.fa4 is None:
        return None
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    spec = case.fa4
    if "cu" in spec:
        cu = torch.tensor(spec["cu"], dtype=torch.int32, device="cuda")
        mx = max(b - a for a, b in zip(spec["cu"][:-1], spec["cu"][1:]))

        def f():
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx,
                                          max_seqlen_k=mx, causal=spec["causal"])  # fmt: skip

        return f
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))
    window = spec.get("window", (None, None))

    def f():
        return flash_attn_func(qb, kb, vb, causal=spec["causal"], window_size=window)

    return f


def run_sdpa_cudnn(case, q, k, v):
    if case.sdpa is None:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    if case.hk != case.hq:
        return None

    def f():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=case.sdpa["causal"])

    return f


_FLEX_COMPILED = None


def run_flex(case, q, k, v):
    global _FLEX_COMPILED
    if case.flex is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    spec = case.flex
    T = case.total
    kind = spec["kind"]
    if kind in ("doc", "blockcausal"):
        doc = torch.zeros(T, dtype=torch.int32, device="cuda")
        cu = spec["cu"]
        for i in range(len(cu) - 1):
            doc[cu[i] : cu[i + 1]] = i
    if kind == "full":
        mask_mod = None
    elif kind == "causal":

        def mask_mod(b, h, qi, ki):
            return ki <= qi
    elif kind == "doc":
        causal = spec["causal"]

        def mask_mod(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return (same & (ki <= qi)) if causal else same
    elif kind == "swa":
        w = spec["w"]

        def mask_mod(b, h, qi, ki):
            return (ki <= qi) & (qi - ki <= w)
    elif kind == "blockcausal":
        blk = spec["blk"]
        start = torch.tensor(cu[:-1], dtype=torch.int32, device="cuda")[doc.long()]

        def mask_mod(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return same & (((ki - start[ki]) // blk) <= ((qi - start[qi]) // blk))
    else:
        return None
    bm = (
        None if mask_mod is None else create_block_mask(mask_mod, 1, None, T, T, device="cuda", _compile=True)
    )
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = case.hq != case.hk

    def f():
        return _FLEX_COMPILED(qh, kh, vh, block_mask=bm, enable_gqa=gqa)

    return f


# ----------------------------------------------------------------------------- main
def case_inputs(case: Case, dtype=torch.bfloat16, requires_grad: bool = False) -> tuple:
    """``(q, k, v, q_ranges, k_ranges, types)`` of ``case`` on the GPU: random q, k, v drawn in that
    order after seeding 0 (every tool's runs see the same data), int32 range tensors."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(case.total, h, d, device="cuda", dtype=dtype, requires_grad=requires_grad)
        for h, d in ((case.hq, case.d), (case.hk, case.d), (case.hk, case.dv))
    )
    qr = torch.tensor(case.q_ranges, dtype=torch.int32, device="cuda")
    kr = torch.tensor(case.k_ranges, dtype=torch.int32, device="cuda")
    ty = torch.tensor(case.types, dtype=torch.int32, device="cuda")
    return q, k, v, qr, kr, ty


def grid_args(ap: argparse.ArgumentParser, lengths: str, totals: str) -> tuple[list[str], list[int]]:
    """``--lengths`` / ``--totals`` as lists; an unknown distribution is an argparse error."""
    names = [x for x in lengths.split(",") if x]
    for name in names:
        if name not in LENGTHS:
            ap.error(f"--lengths: unknown distribution {name!r} (one of {', '.join(LENGTHS)})")
    return names, [int(x) for x in totals.split(",") if x]


def bench_case(case: Case, args, dtype) -> tuple[dict, float]:
    """Time FFA and the peers on one case: ``(results, seconds of FFA's first call)``. The case's
    tensors (and the closures holding them) die with this frame."""
    q, k, v, qr, kr, ty = case_inputs(case, dtype, requires_grad=args.bwd)
    res = {}
    t0 = time.perf_counter()
    ffa = run_ffa_autograd(q, k, v, qr, kr, ty) if args.bwd else run_ffa(q, k, v, qr, kr, ty)
    ffa()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    res["ffa_host_us"] = host_us(ffa)
    fns = {"ffa": ffa}
    # forward-only calls with a given head group: timed in the same rounds, not in the steps
    grouped = {
        f"ffa[g={g}]": run_ffa(q, k, v, qr, kr, ty, head_group=int(g)) for g in args.groups.split(",") if g
    }
    ffa_ml = run_ffa(q, k, v, qr, kr, ty, max_logits=True) if args.max_logits else None
    _add_peers(case, args, (q, k, v), ffa, fns, res)
    times = time_rounds({**fns, **grouped}, args.rounds, args.iters)
    for name, ts in times.items():
        res[name] = tflops(case, median(ts))
    if args.bwd:
        _time_training_steps(case, args, (q, k, v), fns, times, res)
    if ffa_ml is not None:
        res["maxlogits_overhead"] = paired_overhead(ffa, ffa_ml, args.iters)
    return res, first


def _add_peers(case: Case, args, qkv: tuple, ffa, fns: dict, res: dict) -> None:
    """Build the peer libraries' calls for ``case`` into ``fns`` (a peer that cannot run the case
    gets ``res[name] = None``); FA4's host time, and with ``--check`` FFA's max difference to it."""
    q, k, v = qkv
    peers = [] if args.no_peers else [("fa4", run_fa4), ("cudnn", run_sdpa_cudnn)]
    if not args.no_flex and not args.no_peers:
        peers.append(("flex", run_flex))
    for name, mk in peers:
        try:
            f = mk(case, q, k, v)
            res[name] = None
            if f is None:
                continue
            f()
            fns[name] = f
            if name == "fa4":
                res["fa4_host_us"] = host_us(f)
            if name == "fa4" and args.check:
                res["maxdiff_vs_fa4"] = _max_diff(case, f(), ffa())  # FA4 first, as it ran
        except Exception as exc:  # a peer failing must not stop the table
            print(f"  [{case.name}] {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            res[name] = None


def _max_diff(case: Case, o_ref, o_ffa) -> float:
    """Max abs difference of two outputs (either may be a tuple holding the output first)."""
    o_ref = o_ref[0] if isinstance(o_ref, tuple) else o_ref
    o_ref = o_ref.reshape(case.total, case.hq, case.dv)
    o_ffa = o_ffa[0] if isinstance(o_ffa, tuple) else o_ffa
    return (o_ffa.float() - o_ref.float()).abs().max().item()


def _time_training_steps(case: Case, args, qkv: tuple, fns: dict, times: dict, res: dict) -> None:
    """Time a training step (forward + backward) of every library in interleaved rounds; ``times``:
    the forward times, for the backward's share. Adds ``<name>_step``, ``<name>_bwd`` (TFLOPS),
    and for FFA and FA4 the peak memory per step and ``<name>_step_us`` / ``<name>_step_host_us``
    (the step's time, and the host's time to issue it: close to each other, the step is
    host-bound) to ``res``."""
    steps = {name: training_step(f, qkv) for name, f in fns.items()}
    step_times = time_rounds(steps, args.rounds, args.iters)
    for name, ts in step_times.items():
        t_step = median(ts)
        t_fwd = median(times[name])
        res[f"{name}_step"] = 3.5 * tflops(case, t_step)
        res[f"{name}_bwd"] = 2.5 * tflops(case, max(t_step - t_fwd, 1e-9))
        if name in ("ffa", "fa4"):
            res[f"{name}_step_us"] = t_step * 1e6
            res[f"{name}_step_host_us"] = host_us(steps[name])
    res["ffa_peak_mib"], res["fa4_peak_mib"] = (
        step_peak_mib(steps.get("ffa")),
        step_peak_mib(steps.get("fa4")),
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--cases",
        default="full8k,causal8k,varlen_causal32k,varlen_full32k,gqa_varlen_causal32k,swa8k,block_causal32k",
    )
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--check", action="store_true", help="compare FFA to FA4 outputs where FA4 runs")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-logits", action="store_true", help="also time FFA with return_max_logits")
    ap.add_argument("--bwd", action="store_true", help="also time the training step (forward + backward)")
    ap.add_argument(
        "--groups", default="", help="also time FFA with each of these q-head group sizes (e.g. 1,2,16)"
    )
    ap.add_argument(
        "--lengths",
        default="",
        help=f"also the varlen grid for these length distributions ({','.join(LENGTHS)})",
    )
    ap.add_argument("--totals", default="32768,131072", help="token totals of the varlen grid")
    ap.add_argument(
        "--head-dims", default="", help="also full/causal 8k at these head dims (e.g. 64,256,192/128)"
    )
    args = ap.parse_args(argv)
    lengths, totals = grid_args(ap, args.lengths, args.totals)
    head_dims = [x for x in args.head_dims.split(",") if x]
    dtype = getattr(torch, args.dtype)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; dtype {args.dtype}", flush=True)
    rows = []
    cases = make_cases([x for x in args.cases.split(",") if x], lengths, totals, head_dims)
    for case in cases:
        res, first = bench_case(case, args, dtype)
        torch.cuda.empty_cache()  # give the finished case's memory back before the next one
        rows.append((case, res, first))
        fmt = lambda x: "   n/a" if x is None else f"{x:6.1f}"  # noqa: E731
        ratio = res["ffa"] / res["fa4"] if res.get("fa4") else None
        print(
            f"{case.name:34s} area={case.area / 1e6:9.1f}M  ffa {fmt(res['ffa'])}  fa4 {fmt(res.get('fa4'))}  "
            f"cudnn {fmt(res.get('cudnn'))}  flex {fmt(res.get('flex'))}  ffa/fa4 "
            f"{'  n/a' if ratio is None else f'{ratio:5.2f}'}"
            + (f"  max_logits {res['maxlogits_overhead']:+.1%}" if "maxlogits_overhead" in res else "")
            + (f"  maxdiff {res['maxdiff_vs_fa4']:.2e}" if "maxdiff_vs_fa4" in res else "")
            + "".join(f"  {k} {v:6.1f}" for k, v in res.items() if k.startswith("ffa[g="))
            + f"  host us/call ffa {res['ffa_host_us']:.0f} fa4 {res.get('fa4_host_us', float('nan')):.0f}"
            + f"  (first call {first:.1f}s)",
            flush=True,
        )
    print_table(rows)
    if args.bwd:
        print_step_table(rows)
    return rows


def print_table(rows) -> None:
    """Markdown table for docs/perf.md (TFLOP/s over mask area)."""
    cell = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
    print("\n| case | FFA | FA4 | cuDNN | Flex | FFA/FA4 | FFA/Flex | max_logits overhead |")
    print("|---|---|---|---|---|---|---|---|")
    for case, res, _ in rows:
        fa4, flex = res.get("fa4"), res.get("flex")
        ml = res.get("maxlogits_overhead")
        ffa = res["ffa"]
        r_fa4 = "n/a" if not fa4 else f"{ffa / fa4:.2f}"
        r_flex = "n/a" if not flex else f"{ffa / flex:.2f}"
        print(
            f"| {case.name} | {cell(res['ffa'])} | {cell(fa4)} | {cell(res.get('cudnn'))} | {cell(flex)} | "
            f"{r_fa4} | {r_flex} | "
            f"{'n/a' if ml is None else f'{ml:+.1%}'} |"
        )


def print_step_table(rows) -> None:
    """Markdown table of the backward and the training step (TFLOP/s over mask area)."""
    cell = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
    ratio = lambda a, b: "n/a" if not a or not b else f"{a / b:.2f}"  # noqa: E731
    print("\n| case | FFA bwd | FA4 bwd | cuDNN bwd | Flex bwd | FFA/FA4 bwd | FFA step | FA4 step | FFA/FA4 step |"
          " FFA/Flex step | peak MiB FFA / FA4 | FFA µs: step / host | FA4 µs: step / host |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, res, _ in rows:
        g = res.get
        print(
            f"| {case.name} | {cell(g('ffa_bwd'))} | {cell(g('fa4_bwd'))} | {cell(g('cudnn_bwd'))} | "
            f"{cell(g('flex_bwd'))} | {ratio(g('ffa_bwd'), g('fa4_bwd'))} | {cell(g('ffa_step'))} | "
            f"{cell(g('fa4_step'))} | {ratio(g('ffa_step'), g('fa4_step'))} | {ratio(g('ffa_step'), g('flex_step'))} | "
            f"{cell(g('ffa_peak_mib'))} / {cell(g('fa4_peak_mib'))} | "
            f"{cell(g('ffa_step_us'))} / {cell(g('ffa_step_host_us'))} | {cell(g('fa4_step_us'))} / "
            f"{cell(g('fa4_step_host_us'))} |"
        )


if __name__ == "__main__":
    main()
