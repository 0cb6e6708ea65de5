"""Check calc_attn against single-process flex_flash_attn_func (tests, CPU gloo and GPU NCCL).

``run_case`` runs on every rank of an initialised group; ``spawn_gloo`` starts a CPU group of
``world`` processes (file store, no ports) and runs a list of cases in each. ``run_ranks`` runs
any function on every rank of a fresh CPU group under a hard timeout: a rank that hangs fails the
test as a "hang" instead of blocking CI.
"""

from __future__ import annotations

import datetime
import faulthandler
import importlib.util
import inspect
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import magi_dist as md
from ffa_kernels import flex_flash_attn_func
from magi_comm import close_default_collectives
from magi_dist.attn import dsink_reduce
from magi_solver import AttnMask, DispatchConfig, DistAttnConfig, OverlapConfig


@dataclass(frozen=True)
class Case:
    """One distributed attention problem; ``degree=None`` means dynamic overlap."""

    name: str
    q_ranges: list[tuple[int, int]]
    k_ranges: list[tuple[int, int]]
    types: list[int]
    total: int
    hq: int = 4
    hk: int = 2
    d: int = 16
    dv: int = 0  # V's head dim; 0: d
    degree: int | None = 1
    dtype: str = "float64"
    chunk: int = 16
    min_chunk: int = 8
    sink: str | None = None  # None | "sh" | "ssh"
    softcap: float = 0.0
    max_logits: bool = True
    seed: int = 0
    tol: float = 1e-9

    @staticmethod
    def from_mask(name: str, mask: AttnMask, **kw) -> Case:
        q, k, t = mask.to_lists()
        return Case(name, q, k, t, mask.total_seqlen_q, **kw)

    def config(self) -> DistAttnConfig:
        ov = (
            OverlapConfig(mode="dynamic", degree=None, dynamic_max_degree=3, min_chunk_size=self.min_chunk)
            if self.degree is None
            else OverlapConfig(degree=self.degree, min_chunk_size=self.min_chunk)
        )
        return DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=self.chunk), overlap_config=ov)


def run_case(case: Case, group=None, device: torch.device | None = None) -> dict[str, float]:
    """Run ``case`` on this rank: dispatch, calc_attn, backward, undispatch; compare output, lse,
    max_logits and dq, dk, dv (and dsink) with the single-process result. Returns the max errors;
    raises ``AssertionError`` above ``case.tol``."""
    device = device or torch.device("cpu")
    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(case.seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    T = case.total
    dv = case.dv or case.d
    q, k, v, dout = (
        rand(T, case.hq, case.d),
        rand(T, case.hk, case.d),
        rand(T, case.hk, dv),
        rand(T, case.hq, dv),
    )
    sink = None
    if case.sink == "sh":
        sink = rand(2, case.hq).float()
    elif case.sink == "ssh":
        sink = rand(T, 2, case.hq).float()

    key = md.magi_attn_flex_key(
        case.q_ranges,
        case.k_ranges,
        case.types,
        T,
        T,
        case.hq,
        case.hk,
        case.d,
        group,
        dist_attn_config=case.config(),
        head_dim_v=dv,
    )
    lq, lk, lv = (md.dispatch(x, key).requires_grad_() for x in (q, k, v))
    lsink = None
    if sink is not None:
        lsink = (sink if case.sink == "sh" else md.dispatch(sink, key)).clone().requires_grad_()
    out, meta = md.calc_attn(
        lq, lk, lv, key, sink=lsink, softcap=case.softcap, return_max_logits=case.max_logits
    )
    (out.float() * md.dispatch(dout, key).float()).sum().backward()

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_sink = None if sink is None else sink.clone().requires_grad_()
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device).reshape(-1, 2)  # noqa: E731
    ro, rmeta = flex_flash_attn_func(
        ref_in[0],
        ref_in[1],
        ref_in[2],
        as_t(case.q_ranges),
        as_t(case.k_ranges),
        torch.tensor(case.types, dtype=torch.int32, device=device),
        sink=ref_sink,
        sink_layout=case.sink or "sh",
        softcap=case.softcap,
        return_max_logits=case.max_logits,
    )
    (ro.float() * dout.float()).sum().backward()

    def grad(x: torch.Tensor | None) -> torch.Tensor:
        assert x is not None and x.grad is not None, "no gradient reached this tensor"
        return x.grad

    def err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
        assert a is not None and b is not None
        a, b = a.detach().double(), b.detach().double()
        both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
        diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
        return float(diff.max()) if diff.numel() else 0.0

    errs = {
        "out": err(md.undispatch(out.detach(), key), ro.detach()),
        "lse": err(md.undispatch(meta.lse, key), rmeta.lse),
        "dq": err(md.undispatch(grad(lq), key), ref_in[0].grad),
        "dk": err(md.undispatch(grad(lk), key), ref_in[1].grad),
        "dv": err(md.undispatch(grad(lv), key), ref_in[2].grad),
    }
    if case.max_logits:
        errs["max_logits"] = err(meta.max_logits, rmeta.max_logits)
    if sink is not None:
        if case.sink == "sh":  # each rank holds the gradient of its rows (MAGI_DIST_DSINK_REDUCE=none)
            total = grad(lsink).clone()
            if dsink_reduce() == "none":
                dist.all_reduce(total, group=group)
            errs["dsink"] = err(total, grad(ref_sink))
        else:
            errs["dsink"] = err(md.undispatch(grad(lsink), key), grad(ref_sink))
    # the sink and its gradient are float32 by contract, whatever the inputs' dtype
    tols = {n: max(case.tol, 1e-5) if n == "dsink" else case.tol for n in errs}
    bad = {n: e for n, e in errs.items() if not e <= tols[n]}
    assert not bad, f"case {case.name}: errors above {case.tol}: {bad}"
    return errs


def _init(rank: int, world: int, store_path: str, backend: str) -> torch.device:
    faulthandler.enable()  # a native abort in a rank still shows its Python stack
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    return device


def _shutdown(ok: bool) -> None:
    """A rank's teardown. ``ok``: the rank's work is done (its result recorded): leave together,
    tear down, and end the process here, without the interpreter's finalisation, whose
    destructors of torch's and gloo's objects in no fixed order aborted a rank now and then
    ("terminate called without an active exception", SIGABRT, in a full `make test`). Not
    ``ok``: tear down and return, so the exception on its way out is recorded."""
    if ok:  # leave together: a rank tearing gloo down while a peer still talks to it can abort
        dist.barrier()
    md.clear_cache()
    close_default_collectives()
    dist.destroy_process_group()
    if ok:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _worker(
    rank: int, world: int, store_path: str, cases: list[Case], env: dict[str, str], backend: str
) -> None:
    os.environ.update(env)
    device = _init(rank, world, store_path, backend)
    ok = False
    try:
        for case in cases:
            try:
                run_case(case, device=device)
            except Exception as e:
                raise AssertionError(
                    f"rank {rank}/{world}, case {case.name}: {e}\n{traceback.format_exc()}"
                ) from e
        ok = True
    finally:
        _shutdown(ok)


def _join(context: mp.ProcessContext, timeout: float, what: str) -> None:
    """Join spawned ranks; past ``timeout`` seconds kill them (these processes only) and fail
    as a hang rather than block the caller (a rank's failure raises as in ``mp.spawn``)."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            hung = [r for r, p in enumerate(context.processes) if p.is_alive()]
            for r in hung:
                context.processes[r].kill()
            for r in hung:
                context.processes[r].join(10)
            raise RankHangError(f"hang: {what}: ranks {hung} still running after {timeout:.0f} s (killed)")


def spawn_gloo(
    world: int,
    cases: list[Case],
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    timeout: float = 900.0,
) -> None:
    """Run ``cases`` on a fresh group of ``world`` processes (CPU gloo, or ``backend="nccl"`` with
    one GPU per rank); raises if any rank fails, `RankHangError` after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(
            _worker,
            args=(world, os.path.join(tmp, "store"), cases, _rank_env(env, backend), backend),
            nprocs=world,
            join=False,
        )
        _join(context, timeout, f"cases {[c.name for c in cases]} on {world} ranks")


def _expect(exc: type[Exception], match: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert match in str(e), f"{exc.__name__} raised, but {match!r} not in {str(e)!r}"
        return
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__} ({match!r})")


def check_bad_inputs(rank: int, world: int) -> None:
    """Bad arguments raise errors naming them (run on every rank of a 2-process group)."""
    import dataclasses

    cu = [0, 40, 96]
    key = md.magi_attn_varlen_key(cu, cu, 4, 2, 8, None, causal=True)
    rt = md.get_runtime(key)
    n = rt.shard_seqlen
    q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
    md.calc_attn(q, k, v, key)
    _expect(ValueError, "calc_attn takes dispatched tensors", md.calc_attn, torch.randn(96, 4, 8), k, v, key)
    _expect(ValueError, "q: expected shape", md.calc_attn, torch.randn(n, 3, 8), k, v, key)
    _expect(ValueError, "k: expected shape", md.calc_attn, q, torch.randn(n, 2, 4), v, key)
    _expect(ValueError, "v: expected shape", md.calc_attn, q, k, torch.randn(n, 2, 4), key)
    _expect(ValueError, "head_dim_v", md.magi_attn_varlen_key, cu, cu, 4, 2, 8, None, head_dim_v=0)
    _expect(TypeError, "must share one dtype", md.calc_attn, q, k, v.double(), key)
    _expect(ValueError, "sink with sink_layout='sh'", md.calc_attn, q, k, v, key, sink=torch.zeros(2, 3))
    _expect(ValueError, "softcap", md.calc_attn, q, k, v, key, softcap=-1.0)
    _expect(TypeError, "key: expected a DistAttnRuntimeKey", md.calc_attn, q, k, v, "key")
    _expect(ValueError, "x: expected the global token axis", md.dispatch, torch.randn(95, 4), key)
    _expect(ValueError, "local_x: expected", md.undispatch, torch.randn(n + 1, 4), key)
    _expect(ValueError, "num_heads_q: 3 is not a multiple", md.magi_attn_varlen_key, cu, cu, 3, 2, 8, None)
    _expect(ValueError, "head_dim", md.magi_attn_varlen_key, cu, cu, 4, 2, 0, None)
    _expect(TypeError, "cp_group_or_mesh", md.magi_attn_varlen_key, cu, cu, 4, 2, 8, "group")
    _expect(ValueError, "cu_seqlens_q", md.magi_attn_varlen_key, [0, 50, 40], cu, 4, 2, 8, None)
    _expect(
        ValueError,
        "self-attention",
        md.get_runtime,
        md.magi_attn_flex_key([[0, 8]], [[0, 16]], "full", 8, 16, 4, 2, 8, None),
    )
    only_rank0 = dist.new_group([0])
    if rank == 0:
        md.magi_attn_varlen_key(cu, cu, 4, 2, 8, only_rank0)
    else:
        _expect(ValueError, "not a member", md.magi_attn_varlen_key, cu, cu, 4, 2, 8, only_rank0)
        foreign = dataclasses.replace(key, group=only_rank0, group_ranks=(0,))
        _expect(ValueError, "key: made for a process group", md.calc_attn, q, k, v, foreign)


def _fn_worker(rank: int, world: int, store_path: str, fn_name: str) -> None:
    _init(rank, world, store_path, "gloo")
    ok = False
    try:
        globals()[fn_name](rank, world)
        ok = True
    finally:
        _shutdown(ok)


def spawn_gloo_fn(world: int, fn_name: str, timeout: float = 300.0) -> None:
    """Run ``magi_dist.testing.<fn_name>(rank, world)`` on a fresh CPU gloo group (hard
    ``timeout`` as in `spawn_gloo`)."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(
            _fn_worker, args=(world, os.path.join(tmp, "store"), fn_name), nprocs=world, join=False
        )
        _join(context, timeout, f"{fn_name} on {world} ranks")


# ----------------------------------------------------------------------------- run_ranks


class RankHangError(AssertionError):
    """Some ranks of a `run_ranks` group were still running at the hard timeout (killed)."""


def _load_function(path: str, qualname: str) -> Callable:
    # Load the caller's file by path: test modules (pytest's importlib mode) are not importable
    # by name in a fresh process, and pickling the function by reference would need that.
    spec = importlib.util.spec_from_file_location(f"_magi_dist_rank_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _rank_main(
    rank: int,
    world: int,
    store_path: str,
    fn_path: str,
    fn_qualname: str,
    args: tuple,
    env: dict[str, str],
    result_path: str,
    hang_dump_s: float,
    pg_timeout_s: float,
    backend: str,
) -> None:
    os.environ.update(env)
    faulthandler.enable()
    # A rank that hangs prints its Python stack before the parent kills it.
    faulthandler.dump_traceback_later(hang_dump_s, exit=False)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    try:
        value = _load_function(fn_path, fn_qualname)(rank, world, *args)
    except BaseException:
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        sys.stderr.flush()
        # No teardown: peers may sit in a collective this rank will never join.
        os._exit(1)
    with open(result_path, "wb") as f:
        pickle.dump(("ok", value), f)
    faulthandler.cancel_dump_traceback_later()
    _shutdown(True)


# NCCL ranks: torch's watchdog sleeps 4x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default)
# for a debug dump between a timed-out collective and ending the process; the harness times
# ranks itself, so the dump is off and the wait short (a caller's env overrides them)
_NCCL_RANK_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500"}


def _rank_env(env: dict[str, str] | None, backend: str) -> dict[str, str]:
    """The environment a rank adds to its own: the caller's, over the NCCL settings above."""
    return {**_NCCL_RANK_ENV, **(env or {})} if backend == "nccl" else dict(env or {})


def run_ranks(
    world: int,
    fn: Callable,
    *args,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    pg_timeout: float = 300.0,
    outcomes: bool = False,
    backend: str = "gloo",
) -> list:
    """Run ``fn(rank, world, *args)`` on every rank of a fresh CPU gloo group of ``world``
    processes and return the ranks' return values (in rank order).

    ``fn`` is a module-level function of any file (loaded by path in each rank); ``args`` and
    the return values must pickle. Fails with `RankHangError` (message starting "hang") when a
    rank is still running after ``timeout`` seconds (its Python stack is printed, then it is
    killed), and with ``AssertionError`` when a rank raised (every failing rank's traceback)
    or died (e.g. SIGABRT). ``pg_timeout`` is the process group's own timeout, longer than
    ``timeout`` so that a hang is reported as one.

    ``outcomes=True`` (scenarios in which ranks are meant to fail): return every rank's outcome
    instead, ``("ok", value)``, ``("error", traceback text)`` or ``("died", exit code)``; a hang
    still raises `RankHangError`. ``backend="nccl"``: one GPU per rank (rank % device count).
    A rank that raises leaves at once (``os._exit(1)``, no teardown), as a process whose
    exception reached the top would, without waiting for its peers.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    rank_env = _rank_env(env, backend)
    fn_path, fn_qualname = inspect.getsourcefile(fn), fn.__qualname__
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        results = [os.path.join(tmp, f"result{r}.pkl") for r in range(world)]
        store = os.path.join(tmp, "store")
        hang_dump_s = max(1.0, timeout - 5.0)
        procs = []
        for r in range(world):
            rank_args = (r, world, store, fn_path, fn_qualname, args, rank_env, results[r])
            procs.append(ctx.Process(target=_rank_main, args=(*rank_args, hang_dump_s, pg_timeout, backend)))
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:  # only the processes started here, by their own handles
            procs[r].kill()
        for r in hung:
            procs[r].join(10)
        seen = []
        for r in range(world):
            if os.path.exists(results[r]):
                with open(results[r], "rb") as f:
                    seen.append(pickle.load(f))
            else:
                seen.append(("died", procs[r].exitcode))
    name = f"{fn_qualname} on {world} ranks"
    done = {r: o for r, o in enumerate(seen) if r not in hung}
    if hung:
        raise RankHangError(
            f"hang: {name}: ranks {hung} still running after {timeout:.0f} s (killed); "
            f"the others: {_describe(done)}"
        )
    if outcomes:
        return seen
    failed = {r: o for r, o in done.items() if o[0] != "ok"}
    if failed:
        raise AssertionError(f"{name}: {_describe(failed)}")
    return [o[1] for o in seen]


def _describe(outcomes: dict[int, tuple]) -> str:
    parts = []
    for r, (kind, detail) in outcomes.items():
        if kind == "ok":
            parts.append(f"rank {r} returned")
        elif kind == "died":
            parts.append(f"rank {r} died with exit code {detail} (negative: killed by that signal)")
        else:
            parts.append(f"rank {r} raised:\n{detail}")
    return "; ".join(parts) if parts else "none"
