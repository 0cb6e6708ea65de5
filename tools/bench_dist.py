"""Distributed attention benchmark: forward, or the training step (run with torchrun on N GPUs).

    torchrun --standalone --nproc-per-node 2 tools/bench_dist.py [--totals 65536 131072] [--degree N]
    torchrun --standalone --nproc-per-node 8 tools/bench_dist.py --tokens-per-gpu 16384 \
        --masks full,causal,varlen_full,varlen_causal,varlen_block_causal
    torchrun --standalone --nproc-per-node 2 tools/bench_dist.py --step [--deterministic]

Forward (default): per-GPU TFLOP/s of ``magi_dist.calc_attn`` (4·area·Hq·D / (max-rank time ·
cp)) for the masks of ``--masks`` (default varlen causal and varlen full), beside, in the same
run on the same inputs:
  (a) the same per-GPU work without communication (each rank's stages on K/V it already has),
      and the same rows in one FFA call over all the K/V they read (single-GPU FFA on the same
      load): scaling efficiency = that time / calc_attn time;
  (b) all-gather K/V context parallelism (Llama-3 / Kvax; tools/allgather_cp.py);
  (c) PyTorch's experimental ``context_parallel`` (ring SDPA), which only expresses full/causal
      masks: it runs the plain causal/full mask of the same length (its FLOPs counted on that mask).
Prints markdown tables on rank 0: throughput, and the K/V bytes each rank receives per forward
against ring attention and all-gather (from the plan).

``--step``: the training step, forward + backward (``calc_attn`` then the gradients of q, k, v
for a random dout), TFLOP/s per GPU over the mask area with the backward counted 2.5x the
forward (3.5 · 4·area·Hq·D per step). Default masks varlen causal, varlen full (long-tailed
documents), causal and varlen block-causal. Beside it, in the same run on the same inputs, each
forward + backward:
  (a) "same stages, no comm": each rank's forward and backward stage calls on K/V in place;
  (a') "one FFA, same rows": the rank's rows in one ``flex_flash_attn_func`` call over all the
      K/V they read (the forward mode's reference), eff. = its time / the step's;
  (a'') "one GPU, whole mask": ``flex_flash_attn_func`` over the whole mask on one GPU (every
      rank runs it on its own), eff. = magi TFLOP/s per GPU / that TFLOP/s: the issue's
      efficiency against single-GPU FFA on the same total (``--no-whole`` skips it);
  (b) all-gather K/V with its backward (autograd through the gather and FFA; dK/dV
      reduce-scattered to their owners);
  (c) torch ring ``context_parallel`` forward + backward on the plain causal mask (causal and
      block-causal masks) or the plain full mask (full masks, head-tail load balancing off).

``--alternate N`` times the magi step and the whole-mask step N more times in turn and reports
each one's median: the GPUs run a step at their power limit, so one mean depends on what ran
before it (docs/perf.md, the cp 2 step at a743a34).

The pure parts (cases, FLOPs, tables) are importable and tested on the CPU
(integration_tests/test_bench_dist.py), which also runs `run` on gloo ranks with tiny sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# tools/allgather_cp.py: a script's own folder is first on sys.path (python and torchrun alike)
from allgather_cp import AllGatherCP

import magi_dist as md
from ffa_kernels import (
    ffa_backward_stage,
    ffa_forward_stage,
    flex_flash_attn_func,
    forward_accumulators,
)
from magi_solver import AttnMask, DispatchConfig, DistAttnConfig, OverlapConfig, make_plan, masks
from magi_solver.testing import cu_seqlens, long_tailed_lengths

MASK_KINDS = ("full", "causal", "varlen_full", "varlen_causal", "varlen_block_causal")
FORWARD_MASKS = "varlen_causal,varlen_full"
STEP_MASKS = "varlen_causal,varlen_full,causal,varlen_block_causal"
BACKWARD_FACTOR = 2.5  # backward FLOPs = 2.5 x forward (docs/api.md)


# ----------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class BenchCase:
    name: str  # e.g. "varlen causal 64k"
    kind: str  # one of MASK_KINDS
    total: int
    mask: AttnMask
    causal: bool  # the plain mask torch's ring context_parallel runs instead


def bench_mask(kind: str, total: int, cu: list[int]):
    """(mask, causal flag for the plain-mask context_parallel peer) of a benchmark mask kind."""
    if kind == "full":
        return masks.full(total), False
    if kind == "causal":
        return masks.causal(total), True
    if kind == "varlen_full":
        return masks.varlen(cu), False
    if kind == "varlen_causal":
        return masks.varlen(cu, causal=True), True
    if kind == "varlen_block_causal":
        return masks.block_causal(cu, 2048), True
    raise ValueError(f"--masks: unknown mask kind {kind!r}")


def bench_cases(mask_kinds: str, totals: list[int]) -> list[BenchCase]:
    """Every (total, mask kind) of a run; documents of long-tailed lengths (each at most a
    quarter of the total, ``total // 8192`` of them, at least 4), the same for every kind."""
    cases = []
    for total in totals:
        cu = cu_seqlens(long_tailed_lengths(total, max(4, total // 8192), seed=total))
        for kind in mask_kinds.split(","):
            mask, causal = bench_mask(kind, total, cu)
            size = f"{total // 1024}k" if total % 1024 == 0 else str(total)
            cases.append(BenchCase(f"{kind.replace('_', ' ')} {size}", kind, total, mask, causal))
    return cases


def attn_flops(area: int, hq: int, d: int, step: bool = False) -> float:
    """Forward FLOPs ``4·area·Hq·D``; a training step adds the backward at 2.5x: 3.5x that."""
    fwd = 4.0 * area * hq * d
    return fwd * (1.0 + BACKWARD_FACTOR) if step else fwd


def plain_area(total: int, causal: bool) -> int:
    """Area of the plain causal / full mask of ``total`` tokens (what ring CP computes)."""
    return total * (total + 1) // 2 if causal else total * total


def tflops(flops: float, seconds: float, cp: int) -> float:
    """TFLOP/s per GPU when ``cp`` GPUs take ``seconds`` for ``flops``."""
    return flops / (seconds * cp) / 1e12


def _pct(x: float) -> str:
    return "–" if x != x else f"{x:.1%}"


# H100 / H200 SXM dense bf16 peak: a number above it was not measured right (the ring CP column
# once timed local attention on the shards and read 1063-1132)
PEAK_TFLOPS = 989.0


def _tf(x: float) -> str:
    if x != x:
        return "–"
    return f"{x:.1f}" + (" (above the chip's peak: not a valid measurement)" if x > PEAK_TFLOPS else "")


def forward_table(rows: list[tuple]) -> str:
    """Rows: (name, magi, same stages, eff, one FFA, eff, all-gather, ring, imbalance)."""
    lines = [
        "| mask | magi calc_attn TFLOP/s/GPU | same stages, no comm | eff. | one FFA call, same load | eff. | "
        "all-gather K/V | torch context_parallel (plain mask) | imbalance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r[0]} | {_tf(r[1])} | {_tf(r[2])} | {_pct(r[3])} | {_tf(r[4])} | {_pct(r[5])} | "
            f"{_tf(r[6])} | {_tf(r[7])} | {r[8]:.3f} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class StepRow:
    """One mask of the --step table; every time in seconds (max over ranks), nan = not run."""

    name: str
    flops: float  # the mask's step FLOPs (3.5 x forward)
    ring_flops: float  # the plain mask's step FLOPs (ring CP)
    t_magi: float
    t_stages: float
    t_one: float  # one FFA fwd+bwd over this rank's rows (same rows)
    t_whole: float  # one FFA fwd+bwd over the whole mask on one GPU
    t_allgather: float
    t_ring: float
    imbalance: float

    def cells(self, cp: int) -> list[str]:
        magi = tflops(self.flops, self.t_magi, cp)
        whole = self.flops / self.t_whole / 1e12  # one GPU does it all
        ag = tflops(self.flops, self.t_allgather, cp)
        ring = tflops(self.ring_flops, self.t_ring, cp)
        return [
            self.name,
            _tf(magi),
            _tf(tflops(self.flops, self.t_stages, cp)),
            _pct(self.t_stages / self.t_magi),
            _tf(tflops(self.flops, self.t_one, cp)),
            _pct(self.t_one / self.t_magi),
            _tf(whole),
            _pct(magi / whole),
            _tf(ag),
            _pct(magi / ag),
            _tf(ring),
            _pct(magi / ring),
            f"{self.imbalance:.3f}",
        ]


STEP_HEADER = (
    "| mask | magi step TFLOP/s/GPU | same stages, no comm | eff. | one FFA, same rows | eff. | "
    "one GPU, whole mask | eff. | all-gather K/V | magi/AG | torch ring CP (plain mask) | magi/ring | "
    "imbalance |"
)


def step_table(rows: list[StepRow], cp: int) -> str:
    lines = [STEP_HEADER, "|" + "---|" * STEP_HEADER.count(" | ") + "---|"]
    lines += ["| " + " | ".join(r.cells(cp)) + " |" for r in rows]
    return "\n".join(lines)


def traffic_table(traffic: list[tuple[str, int, int, int]], kv_bytes: int) -> str:
    lines = ["| mask | magi | ring attention | all-gather | magi / ring |", "|---|---|---|---|---|"]
    for name, magi, ring, ag in traffic:
        mib = lambda t: f"{t * kv_bytes / 2**20:.1f} MiB"  # noqa: E731
        lines.append(f"| {name} | {mib(magi)} | {mib(ring)} | {mib(ag)} | {magi / max(ring, 1):.1%} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, iters: int, group, device: torch.device | None = None) -> float:
    """Max over ranks of the mean time of ``fn`` (seconds), after a warm-up call (CUDA events
    on a GPU, the wall clock on the CPU)."""
    device = device or torch.device("cuda")
    fn()
    _sync(device)
    dist.barrier(group)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / iters / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        seconds = (time.perf_counter() - t0) / iters
    comm = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([seconds], device=comm, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def trace(fn, name: str, rank: int, group, calls: int = 3) -> None:
    """torch.profiler timeline (CPU and GPU, every stream) of ``calls`` calls of ``fn``, written
    as a Chrome trace to ``$OUT/dist_trace_<name>_rank<rank>.json`` (chrome://tracing, Perfetto):
    shows whether the casts run beside the attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), f"dist_trace_{name}_rank{rank}.json"))
    dist.barrier(group)


def _set_ring_load_balance(on: bool) -> bool:
    """torch's ring CP shards head-tail (load balanced) by default, which it refuses for
    non-causal masks; returns the old setting (a private option of the experimental API)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    except ImportError:  # older torch
        from torch.distributed.tensor.experimental._attention import _cp_options
    old = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = on
    return old


def ring_sdpa_time(total, hq, d, causal, iters, group, step: bool = False) -> float:
    """torch ``context_parallel`` (ring SDPA) on the plain causal/full mask of ``total`` tokens
    (MHA: K/V with Hq heads), forward or forward + backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (dist.get_world_size(group),))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, hq, total, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )

    def sdpa(*args, **kwargs):
        # looked up at each call: context_parallel swaps this attribute for its ring version
        # while it is active (torch's default dispatch mode), so a reference taken before the
        # context would time local attention on the shards
        return torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)

    old = _set_ring_load_balance(causal)  # no load balancer for full masks (refused with one)
    try:
        with context_parallel(
            mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}
        ):
            if not step:
                return timeit(lambda: sdpa(q, k, v, is_causal=causal), iters, group)
            for x in (q, k, v):
                x.requires_grad_()
            dout = torch.randn_like(q)

            def fwd_bwd():
                torch.autograd.grad(sdpa(q, k, v, is_causal=causal), (q, k, v), dout)

            try:
                return timeit(fwd_bwd, iters, group)
            finally:
                for x in (q, k, v):
                    x.requires_grad_(False)
    finally:
        _set_ring_load_balance(old)


def init_nccl(high_priority: bool) -> None:
    """NCCL process group whose internal streams, and the native backend's group stream, run at
    high priority (``high_priority``) or at the default one."""
    from magi_comm.backends.native import ENV_STREAM_PRIORITY

    os.environ[ENV_STREAM_PRIORITY] = "-1" if high_priority else "0"
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    dist.init_process_group("nccl", pg_options=opts)


@contextlib.contextmanager
def nccl_ranks(high_priority: bool):
    """This torchrun process on its GPU (``$LOCAL_RANK``) in the NCCL process group of
    `init_nccl`, destroyed on the way out (the tools' ``main``)."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_nccl(high_priority)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- measurements


def _as_t(x, device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=device).reshape(-1, 2)


class _Setup:
    """One case on this rank: the key, its runtime, local inputs and the reference inputs."""

    def __init__(self, case: BenchCase, args, group, device, dtype):
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.cfg = DistAttnConfig(
            dispatch_config=DispatchConfig(chunk_size=args.chunk),
            overlap_config=OverlapConfig(degree=args.degree),
        )
        mask = case.mask
        self.key = md.magi_attn_flex_key(
            mask.q_ranges, mask.k_ranges, mask.mask_types, case.total, case.total,
            args.hq, args.hk, args.d, group, dist_attn_config=self.cfg,
        )  # fmt: skip
        self.rt = md.get_runtime(self.key)
        self.g = torch.Generator(device=device).manual_seed(self.rank)
        self.device, self.dtype, self.args = device, dtype, args
        n = self.rt.shard_seqlen
        self.q, self.k, self.v = self.rnd(n, args.hq), self.rnd(n, args.hk), self.rnd(n, args.hk)
        # the stages of this rank with K/V already in place (local-sized buffers)
        self.stages = []
        for st, calc in zip(
            [self.rt.host_tensors(device), *self.rt.remote_tensors(device)],
            [self.rt.me.calc.host, *self.rt.me.calc.remote],
        ):
            if not st.empty:
                self.stages.append(
                    (st, self.rnd(calc.total_seqlen_k, args.hk), self.rnd(calc.total_seqlen_k, args.hk))
                )
        # the same rows in ONE kernel call over [local; remote] K/V (the degree-0 plan of the
        # same dispatch): single-GPU FFA on this rank's load
        one = make_plan(
            mask, self.cp, self.cfg.model_copy(update={"overlap_config": OverlapConfig(degree=0)})
        )
        calc = one.ranks[self.rank].calc.remote[0]
        self.one_args = (
            _as_t(calc.q_ranges, device),
            _as_t(calc.k_ranges, device),
            torch.tensor(calc.attn_types, dtype=torch.int32, device=device),
        )
        self.k_all, self.v_all = (
            self.rnd(calc.total_seqlen_k, args.hk),
            self.rnd(calc.total_seqlen_k, args.hk),
        )

    def rnd(self, n: int, h: int) -> torch.Tensor:
        return torch.randn(n, h, self.args.d, device=self.device, dtype=self.dtype, generator=self.g)

    def time(self, fn) -> float:
        return timeit(fn, self.args.iters, self.key.group, self.device)


def measure_forward(case: BenchCase, args, group, device, dtype) -> tuple[tuple, tuple]:
    s = _Setup(case, args, group, device, dtype)
    q, k, v, key = s.q, s.k, s.v, s.key
    t_magi = s.time(lambda: md.calc_attn(q, k, v, key))
    if args.trace:
        trace(lambda: md.calc_attn(q, k, v, key), f"{case.kind}_cp{s.cp}_deg{args.degree}", s.rank, group)

    def compute_only():
        out, lse, _ = forward_accumulators(q)
        for st, kk, vv in s.stages:
            ffa_forward_stage(q, kk, vv, st.q_ranges, st.k_ranges, st.attn_types, out, lse)

    t_local = s.time(compute_only)
    t_one = s.time(lambda: flex_flash_attn_func(q, s.k_all, s.v_all, *s.one_args))
    ag = AllGatherCP(case.mask, group, args.chunk)
    t_ag = s.time(lambda: ag.forward(q, k, v))
    ring_tf = float("nan")
    if device.type == "cuda":
        try:
            t_ring = ring_sdpa_time(ag.plan.padded_seqlen, args.hq, args.d, case.causal, args.iters, group)
            ring_tf = tflops(
                attn_flops(plain_area(ag.plan.padded_seqlen, case.causal), args.hq, args.d), t_ring, s.cp
            )
        except Exception as e:  # an experimental API: report, do not abort the table
            if s.rank == 0:
                print(f"context_parallel failed: {type(e).__name__}: {e}", flush=True)
    flops = attn_flops(case.mask.area(), args.hq, args.d)
    tf = lambda t: tflops(flops, t, s.cp)  # noqa: E731
    stats = s.rt.plan.stats
    row = (case.name, tf(t_magi), tf(t_local), t_local / t_magi, tf(t_one), t_one / t_magi, tf(t_ag), ring_tf,
           stats.imbalance)  # fmt: skip
    traffic = (case.name, max(stats.recv_tokens_per_rank), max(stats.ring_tokens_per_rank),
               max(stats.allgather_tokens_per_rank))  # fmt: skip
    return row, traffic


def _whole_step(case: BenchCase, args, s: _Setup, device, det: bool):
    """One FFA forward + backward over the whole mask on this rank's GPU (a function to time)."""
    total = case.total
    wq, wk, wv = (s.rnd(total, h).requires_grad_() for h in (args.hq, args.hk, args.hk))
    wdout = s.rnd(total, args.hq)
    qr, kr, ty = case.mask.to_lists()
    wargs = (_as_t(qr, device), _as_t(kr, device), torch.tensor(ty, dtype=torch.int32, device=device))

    def whole_step():
        out = flex_flash_attn_func(wq, wk, wv, *wargs, deterministic=det)[0]
        torch.autograd.grad(out, (wq, wk, wv), wdout)

    return whole_step


def round_robin(timers: dict, rounds: int) -> dict[str, list[float]]:
    """Call every timer in turn (a, b, c, a, b, c, ...), ``rounds`` times: their results by name.
    The GPUs run a step at their power limit, so one mean depends on what ran before it
    (docs/perf.md); taking turns spreads that over all of them."""
    out: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            out[name].append(timer())
    return out


def alternate_timings(time_a, time_b, first_a: float, first_b: float, rounds: int):
    """``first_a`` / ``first_b`` and ``rounds`` more timings of each, taken in turn (a, b, a, b,
    ...; `round_robin`): ``(a's timings, b's timings)``."""
    more = round_robin({"a": time_a, "b": time_b}, rounds)
    return [first_a, *more["a"]], [first_b, *more["b"]]


def _peer_step_times(case: BenchCase, args, s: _Setup, tensors, group, device) -> tuple[float, float, float]:
    """``(all-gather step seconds, ring step seconds, ring FLOPs)`` on this rank's inputs
    ``(q, k, v, dout)``; the ring's NaN off CUDA or when torch's context_parallel fails."""
    q, k, v, dout = tensors
    ag = AllGatherCP(case.mask, group, args.chunk)

    def ag_step():
        out = ag.forward(q, k, v, deterministic=args.deterministic)
        torch.autograd.grad(out, (q, k, v), dout)

    t_ag = s.time(ag_step)
    t_ring = ring_flops = float("nan")
    if device.type == "cuda":
        total = ag.plan.padded_seqlen
        ring_flops = attn_flops(plain_area(total, case.causal), args.hq, args.d, step=True)
        try:
            t_ring = ring_sdpa_time(total, args.hq, args.d, case.causal, args.iters, group, step=True)
        except Exception as e:  # an experimental API: report, do not abort the table
            if s.rank == 0:
                print(f"context_parallel failed: {type(e).__name__}: {e}", flush=True)
    return t_ag, t_ring, ring_flops


def _local_step_times(s: _Setup, q: torch.Tensor, dout: torch.Tensor, det: bool) -> tuple[float, float]:
    """``(stages, one FFA)`` step times of the rank: calc_attn's stages forward then backward
    without communication, and one FFA call over the rank's rows and the whole K/V."""
    qd = q.detach()

    def stages_step():
        out, lse, _ = forward_accumulators(qd)
        for st, kk, vv in s.stages:
            ffa_forward_stage(qd, kk, vv, st.q_ranges, st.k_ranges, st.attn_types, out, lse)
        out = out.to(qd.dtype)
        dq = torch.zeros_like(qd, dtype=lse.dtype)
        for st, kk, vv in s.stages:
            dk, dv = (torch.zeros_like(x, dtype=lse.dtype) for x in (kk, vv))
            ffa_backward_stage(dout, qd, kk, vv, out, lse, st.q_ranges, st.k_ranges, st.attn_types,
                               dq, dk, dv, deterministic=det)  # fmt: skip

    t_stages = s.time(stages_step)
    k_all, v_all = (x.requires_grad_() for x in (s.k_all, s.v_all))

    def one_step():
        out = flex_flash_attn_func(q, k_all, v_all, *s.one_args, deterministic=det)[0]
        torch.autograd.grad(out, (q, k_all, v_all), dout)

    return t_stages, s.time(one_step)


def magi_step_fn(s: _Setup, hq: int, det: bool):
    """``(step, (q, k, v, dout))``: calc_attn forward + backward on this rank's inputs of ``s``
    (also tools/step_series.py's step)."""
    q, k, v = (x.requires_grad_() for x in (s.q, s.k, s.v))
    dout = s.rnd(q.shape[0], hq)

    def step():
        out, _ = md.calc_attn(q, k, v, s.key, deterministic=det)
        torch.autograd.grad(out, (q, k, v), dout)

    return step, (q, k, v, dout)


def measure_step(case: BenchCase, args, group, device, dtype) -> StepRow:
    s = _Setup(case, args, group, device, dtype)
    det = args.deterministic
    magi_step, (q, k, v, dout) = magi_step_fn(s, args.hq, det)
    t_magi = s.time(magi_step)
    if args.trace:
        trace(magi_step, f"step_{case.kind}_cp{s.cp}_deg{args.degree}", s.rank, group)
    flops = attn_flops(case.mask.area(), args.hq, args.d, step=True)
    nan = float("nan")
    t_stages = t_one = t_ag = t_ring = ring_flops = nan
    if args.baselines:
        t_stages, t_one = _local_step_times(s, q, dout, det)
    whole = _whole_step(case, args, s, device, det) if args.whole else None
    t_whole = s.time(whole) if whole is not None else nan
    if args.alternate <= 0:
        whole = None  # its whole-mask inputs freed before the baselines that follow
    if args.baselines:
        t_ag, t_ring, ring_flops = _peer_step_times(case, args, s, (q, k, v, dout), group, device)
    if whole is not None:  # --alternate
        magis, wholes = alternate_timings(
            lambda: s.time(magi_step), lambda: s.time(whole), t_magi, t_whole, args.alternate
        )
        t_magi, t_whole = statistics.median(magis), statistics.median(wholes)
        if s.rank == 0:
            ms = lambda ts: " / ".join(f"{t * 1e3:.2f}" for t in ts)  # noqa: E731
            print(f"{case.name}: magi step {ms(magis)} ms, whole mask {ms(wholes)} ms (in turn)", flush=True)
    return StepRow(
        case.name,
        flops,
        ring_flops,
        t_magi,
        t_stages,
        t_one,
        t_whole,
        t_ag,
        t_ring,
        s.rt.plan.stats.imbalance,
    )


# ----------------------------------------------------------------------------- the run


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", action="store_true", help="forward + backward (the training step)")
    ap.add_argument("--totals", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hk", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--degree", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--masks",
        default=None,
        help=f"comma list of {', '.join(MASK_KINDS)} (default: {FORWARD_MASKS}; with --step {STEP_MASKS})",
    )
    ap.add_argument("--tokens-per-gpu", type=int, default=0, help="if > 0: one total, this many tokens x cp")
    ap.add_argument(
        "--trace", action="store_true", help="also write a profiler timeline of calc_attn per mask"
    )
    ap.add_argument(
        "--deterministic", action="store_true", help="--step: deterministic=True in every backward"
    )
    ap.add_argument(
        "--whole",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--step: also time FFA forward + backward of the whole mask on one GPU (every rank)",
    )
    ap.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--step: also time the same stages without comm, one FFA over the same rows, "
        "all-gather and ring CP (--no-baselines: the magi step and --whole only, for A/B runs of "
        "settings)",
    )
    ap.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="--step with --whole: N more timings of the magi step and of the whole-mask step, in "
        "turn; both columns then report the median of 1 + N (the GPUs run a step at their power "
        "limit, so one mean depends on what ran before it)",
    )
    ap.add_argument(
        "--comm-priority",
        choices=("high", "normal"),
        default="high",
        help="CUDA priority of the communication streams (NCCL's and magi-comm native's): high "
        "lets a cast overlapped with an attention kernel take SMs as that kernel's programs retire "
        "(sets $MAGI_COMM_NATIVE_STREAM_PRIORITY, overriding a value set by the user)",
    )
    args = ap.parse_args(argv)
    if args.masks is None:
        args.masks = STEP_MASKS if args.step else FORWARD_MASKS
    for kind in args.masks.split(","):
        if kind not in MASK_KINDS:
            ap.error(f"--masks: unknown mask kind {kind!r} (expected {', '.join(MASK_KINDS)})")
    if args.alternate < 0 or (args.alternate and not (args.step and args.whole)):
        ap.error(f"--alternate: a count >= 0, with --step and the whole mask, got {args.alternate}")
    return args


def run_setup(args: argparse.Namespace, group) -> tuple[torch.device, torch.dtype, list[BenchCase], str]:
    """``(device, dtype, cases, header)`` of a run on ``group`` (NCCL with one GPU per rank: bf16
    on the GPU, else the CPU in float32; `bench_cases` of ``args``; the settings line, the
    deterministic backward named there for ``--step``)."""
    cp = dist.get_world_size(group)
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    totals = [args.tokens_per_gpu * cp] if args.tokens_per_gpu > 0 else args.totals
    head = (
        f"cp {cp}, Hq {args.hq}, Hk {args.hk}, D {args.d}, {str(dtype).removeprefix('torch.')}, "
        f"chunk {args.chunk}, overlap degree {args.degree}, comm streams at {args.comm_priority} priority, "
        f"comm backend {os.environ.get('MAGI_COMM_BACKEND', 'a2av')}"
        + (", deterministic backward" if args.step and args.deterministic else "")
    )
    return device, dtype, bench_cases(args.masks, totals), head


def run(args: argparse.Namespace, group=None) -> str:
    """Benchmark every case on this group (initialised; see `run_setup`); returns the tables
    (printed by rank 0)."""
    group = group or dist.group.WORLD
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    device, dtype, cases, head = run_setup(args, group)
    if args.step:
        rows = []
        for case in cases:
            rows.append(measure_step(case, args, group, device, dtype))
            md.clear_cache()
        text = (
            f"\n{head}\nforward + backward, TFLOP/s per GPU over the mask area, backward counted "
            f"{BACKWARD_FACTOR}x the forward; torch ring CP: MHA K/V, plain causal/full mask\n"
            + step_table(rows, cp)
        )
    else:
        rows, traffic = [], []
        for case in cases:
            row, tr = measure_forward(case, args, group, device, dtype)
            rows.append(row)
            traffic.append(tr)
            md.clear_cache()
        kv_bytes = 2 * args.hk * args.d * dtype.itemsize  # one token's K and V rows
        text = (
            f"\n{head}\n"
            + forward_table(rows)
            + "\n\nK/V bytes received per rank (max over ranks), per forward:\n"
            + traffic_table(traffic, kv_bytes)
        )
    if rank == 0:
        print(text, flush=True)
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    with nccl_ranks(args.comm_priority == "high"):
        run(args)


if __name__ == "__main__":
    main()
