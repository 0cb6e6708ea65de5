"""Multi-rank reliability (issue 23): a right result or a clear error on every rank, never a hang.

Each test runs its scenario on a fresh CPU gloo group through `magi_dist.testing.run_ranks`,
which kills the ranks after a hard timeout and fails the test as a "hang" instead of blocking
CI. The scenarios are module-level functions ``fn(rank, world, ...)`` run in every rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import magi_dist as md
from ffa_kernels import flex_flash_attn_func
from magi_dist.testing import Case, RankHangError, run_case, run_ranks
from magi_solver import DispatchConfig, DistAttnConfig, OverlapConfig, masks

I32 = torch.int32
CU = [0, 40, 96]


def _outcome(fn, *args, **kwargs) -> tuple[str, str]:
    """``("ok", "")`` or ``(exception type name, message)``: what a rank saw."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", ""


def _inputs(n: int, hq: int, hk: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, hq, d, generator=g, dtype=torch.float64),
        torch.randn(n, hk, d, generator=g, dtype=torch.float64),
        torch.randn(n, hk, d, generator=g, dtype=torch.float64),
    )


def _dynamic_config(chunk: int = 16) -> DistAttnConfig:
    return DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=chunk),
        overlap_config=OverlapConfig(mode="dynamic", degree=None, dynamic_max_degree=3, min_chunk_size=8),
    )


# ----------------------------------------------------------------------------- row a


def ranges_rewritten_by_broadcast(rank: int, world: int) -> list[tuple[str, str]]:
    """Ranges rewritten on every rank by ``dist.broadcast`` into the existing tensor (the
    receivers' version counters do not move): the new values are checked and used."""
    q, k, v = _inputs(256, 2, 2, 8)
    qr = torch.tensor([[0, 256]], dtype=I32)
    kr = torch.tensor([[0, 256]], dtype=I32)
    flex_flash_attn_func(q, k, v, qr, kr)  # checked (and cached) with in-bounds ranges
    seen = []
    for new_end in (128, 10_000):  # in bounds (a new mask), then out of bounds (Tk = 256)
        if rank == 0:
            kr[0, 1] = new_end
        dist.broadcast(kr, src=0)
        out, _ = (None, None)
        try:
            out, _ = flex_flash_attn_func(q, k, v, qr, kr)
        except ValueError as e:
            seen.append(("ValueError", str(e)))
            continue
        fresh, _ = flex_flash_attn_func(q, k, v, qr, kr.clone())
        seen.append(("ok", "same" if torch.equal(out, fresh) else "stale result"))
    return seen


def test_ranges_rewritten_without_version_bump_are_checked_again():
    for r, seen in enumerate(run_ranks(2, ranges_rewritten_by_broadcast, timeout=90)):
        assert seen[0] == ("ok", "same"), (r, seen)
        assert seen[1][0] == "ValueError" and "k_ranges[0] = [0, 10000)" in seen[1][1], (r, seen)


# ----------------------------------------------------------------------------- row b


def inference_mode_then_training(rank: int, world: int) -> None:
    case = Case.from_mask("after-inference", masks.varlen([0, 37, 121, 190], causal=True), degree=None)
    q, k, v = _inputs(case.total, case.hq, case.hk, case.d)
    key = md.magi_attn_flex_key(
        case.q_ranges, case.k_ranges, case.types, case.total, case.total, case.hq, case.hk, case.d,
        None, dist_attn_config=case.config(),
    )  # fmt: skip
    with torch.inference_mode():
        lq, lk, lv = (md.dispatch(x, key) for x in (q, k, v))
        out, _ = md.calc_attn(lq, lk, lv, key)
        out = md.undispatch(out, key)
        qr, kr = (torch.tensor(r, dtype=I32).reshape(-1, 2) for r in (case.q_ranges, case.k_ranges))
        ref, _ = flex_flash_attn_func(q, k, v, qr, kr, torch.tensor(case.types, dtype=I32))
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)
    run_case(case)  # forward and backward of the same key, outside inference mode


def test_inference_mode_runs_and_the_next_training_call_works():
    run_ranks(2, inference_mode_then_training, timeout=90)


# ----------------------------------------------------------------------------- row c

KEY_FIELDS = {
    # which argument one rank changes -> the key field the error must name
    "num_heads_kv": "num_heads_kv",
    "cu_seqlens": "q_ranges",
    "causal": "mask_types",
    "config": "config",
}


def keys_that_differ(rank: int, world: int, what: str) -> tuple[str, str]:
    odd = rank == world - 1
    hq, hk, d = 4, 2, 8
    cu, causal, config = CU, True, DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=16))
    if odd and what == "num_heads_kv":
        hk = 1
    elif odd and what == "cu_seqlens":
        cu = [0, 50, 96]
    elif odd and what == "causal":
        causal = False
    elif odd and what == "config":
        config = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=8))
    key = md.magi_attn_varlen_key(cu, cu, hq, hk, d, None, causal=causal, dist_attn_config=config)
    q, k, v = _inputs(96, hq, hk, d)
    lq, lk, lv = (md.dispatch(x, key) for x in (q, k, v))
    return _outcome(md.calc_attn, lq, lk, lv, key)


@pytest.mark.parametrize("what", list(KEY_FIELDS))
def test_ranks_with_different_keys_all_raise_naming_the_field(what):
    outcomes = run_ranks(2, keys_that_differ, what, timeout=90)
    for r, (kind, msg) in enumerate(outcomes):
        assert kind == "ValueError" and KEY_FIELDS[what] in msg, (r, kind, msg)


def three_ranks_one_differs(rank: int, world: int) -> tuple[str, str]:
    hk = 1 if rank == 1 else 2
    key = md.magi_attn_varlen_key(CU, CU, 4, hk, 8, None, causal=True)
    q = _inputs(96, 4, hk, 8)[0]
    return _outcome(md.undispatch, md.dispatch(q, key), key)


def test_the_error_names_the_ranks_and_their_values():
    for r, (kind, msg) in enumerate(run_ranks(3, three_ranks_one_differs, timeout=90)):
        assert kind == "ValueError", (r, kind, msg)
        assert "num_heads_kv" in msg and "rank 1: 1" in msg and "ranks 0, 2: 2" in msg, msg


# ----------------------------------------------------------------------------- row d


def _case(name: str, cu: list[int]) -> Case:
    return Case.from_mask(name, masks.varlen(cu, causal=True), degree=None, chunk=16, min_chunk=8)


def diverging_caches(rank: int, world: int, how: str) -> None:
    """Dynamic overlap mode with runtime caches that differ between the ranks."""
    a, b = _case("A", [0, 37, 121, 190]), _case("B", [0, 64, 100, 190])
    if how == "clear_cache":
        run_case(a)
        if rank == 0:
            md.clear_cache()
        run_case(a)
    elif how == "cache_size":  # MAGI_DIST_RUNTIME_CACHE_SIZE=1 on rank 0 only (read per call)
        if rank == 0:
            os.environ["MAGI_DIST_RUNTIME_CACHE_SIZE"] = "1"
        for c in (a, b, a, b):
            run_case(c)
    elif how == "exception":  # rank 0's first plan fails after planning; it catches and goes on
        import magi_dist.runtime as runtime

        real = runtime.make_plan
        calls = []

        def fails_once(*args, **kwargs):
            plan = real(*args, **kwargs)
            if not calls:
                calls.append(1)
                raise RuntimeError("injected failure after planning")
            return plan

        if rank == 0:
            runtime.make_plan = fails_once
            try:
                run_case(a)
            except RuntimeError as e:
                assert "injected" in str(e)
        run_case(a)
        run_case(b)


@pytest.mark.parametrize("how", ["clear_cache", "cache_size", "exception"])
def test_ranks_never_diverge_on_collectives(how):
    run_ranks(2, diverging_caches, how, timeout=90)


# ----------------------------------------------------------------------------- row e


def bad_arguments(rank: int, world: int) -> list[tuple[str, str]]:
    # All work lies in chunk 0: one rank has rows to compute, the other has none.
    key = md.magi_attn_flex_key([[0, 16]], [[0, 16]], "full", 128, 128, 4, 2, 8, None,
                                dist_attn_config=DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=16)))  # fmt: skip
    q, k, v = (md.dispatch(x, key) for x in _inputs(128, 4, 2, 8))
    q, k, v = q.float(), k.float(), v.float()
    seen = []
    for kwargs in (
        {"softmax_scale": float("nan")},
        {"softmax_scale": "0.5"},
        {"softcap": True},
        {"sink": torch.zeros(2, 4, dtype=torch.float16)},
        {"sink": torch.zeros(2, 4, dtype=torch.bfloat16)},
        {"sink": torch.zeros(2, 4, dtype=torch.int64)},
        {"return_max_logits": "yes"},
    ):
        seen.append(_outcome(md.calc_attn, q, k, v, key, **kwargs))
    md.calc_attn(q, k, v, key)  # and the group still works
    return seen


def test_bad_arguments_fail_on_every_rank_before_any_collective():
    expected = [
        ("ValueError", "softmax_scale must be finite"),
        ("TypeError", "softmax_scale must be a real number, got str"),
        ("TypeError", "softcap must be a real number, got bool"),
        ("TypeError", "sink must be float32"),
        ("TypeError", "sink must be float32"),
        ("TypeError", "sink must be float32"),
        ("TypeError", "return_max_logits must be a bool"),
    ]
    for r, seen in enumerate(run_ranks(2, bad_arguments, timeout=90)):
        for (kind, msg), (want_kind, want) in zip(seen, expected, strict=True):
            assert kind == want_kind and want in msg, (r, kind, msg, want)


# ----------------------------------------------------------------------------- row f


def two_groups_same_ranks(rank: int, world: int) -> None:
    g1, g2 = dist.new_group(list(range(world))), dist.new_group(list(range(world)))
    k1 = md.magi_attn_varlen_key(CU, CU, 4, 2, 8, g1, causal=True)
    k2 = md.magi_attn_varlen_key(CU, CU, 4, 2, 8, g2, causal=True)
    assert k1 != k2
    assert md.get_runtime(k1).group is g1 and md.get_runtime(k2).group is g2
    q, k, v = _inputs(96, 4, 2, 8)
    outs = [
        md.undispatch(md.calc_attn(*(md.dispatch(x, kk) for x in (q, k, v)), kk)[0], kk) for kk in (k1, k2)
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_runtime_cache_key_holds_the_group():
    run_ranks(2, two_groups_same_ranks, timeout=90)


# ----------------------------------------------------------------------------- row g


def double_backward(rank: int, world: int) -> tuple[str, str]:
    key = md.magi_attn_varlen_key(CU, CU, 4, 2, 8, None, causal=True)
    q, k, v = (md.dispatch(x, key).requires_grad_() for x in _inputs(96, 4, 2, 8))
    out, _ = md.calc_attn(q, k, v, key)
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return _outcome(torch.autograd.grad, gq.sum(), q)


def test_double_backward_raises_on_every_rank():
    for r, (kind, msg) in enumerate(run_ranks(2, double_backward, timeout=90)):
        assert kind == "RuntimeError" and "once_differentiable" in msg, (r, kind, msg)


# ----------------------------------------------------------------------------- get_position_ids


def position_ids(rank: int, world: int) -> None:
    total = 190
    key = md.magi_attn_varlen_key([0, 37, 121, total], [0, 37, 121, total], 4, 2, 8, None, causal=True,
                                  dist_attn_config=DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=16)))  # fmt: skip
    pos = md.get_position_ids(key)
    rt = md.get_runtime(key)
    assert pos.dtype == torch.int64 and pos.shape == (rt.shard_seqlen,)
    parts = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(parts, pos)
    every = torch.cat(parts)  # the ranks' rows together: each padded position exactly once
    assert torch.equal(every.sort().values, torch.arange(rt.plan.padded_seqlen))
    x = torch.arange(total, dtype=torch.float64)[:, None] * torch.ones(1, 3, dtype=torch.float64)
    local = md.dispatch(x, key, pad_value=-1.0)
    real = pos < total
    assert torch.equal(local[real, 0], pos[real].double()) and bool((local[~real] == -1).all())


def test_get_position_ids_on_three_ranks():
    run_ranks(3, position_ids, timeout=90)


# ----------------------------------------------------------------------------- a peer fails mid-collective

# The timeout of the cp group in the scenario where a peer stops without leaving (seconds): the
# survivors' error must come from it, so it is short here. The group is made for the scenario
# (the default group, which the ranks' start-up meets, keeps a long timeout for a loaded CI host).
STALL_TIMEOUT = 6.0
FAIL_AT = {"forward": 2, "backward": 3}  # the failing rank's n-th stage kernel of the pass


def _fail(how: str) -> None:
    if how == "raise":
        raise RuntimeError("injected failure on rank 1")
    if how == "exit":
        os._exit(7)  # no exception, no teardown: the process is gone
    if how == "stall":
        time.sleep(STALL_TIMEOUT + 4)  # longer than the group's timeout, then carry on
        return
    raise AssertionError(how)


def peer_fails_mid_collective(
    rank: int, world: int, where: str, how: str, device: str = "cpu", timeout: float = 0.0
) -> str:
    """Rank 1 fails inside ``calc_attn`` (``where``: the forward, while a K/V group-cast is in
    flight, or the backward, while a dK/dV group-reduce is): it raises (and so leaves), exits,
    or stalls past the cp group's timeout (``timeout`` > 0: a new group with that timeout, else
    the default group). Every rank runs two training steps and raises with how long it waited;
    "no error" means a rank finished them."""
    import datetime

    import magi_dist.attn as attn

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout)) if timeout else None
    key = md.magi_attn_varlen_key([0, 100, 256], [0, 100, 256], 4, 2, 8, group, causal=True,
                                  dist_attn_config=DistAttnConfig(
                                      dispatch_config=DispatchConfig(chunk_size=16),
                                      overlap_config=OverlapConfig(degree=2, min_chunk_size=8)))  # fmt: skip
    q, k, v = (md.dispatch(x.to(device), key).requires_grad_() for x in _inputs(256, 4, 2, 8))
    if rank == 1:
        name = "ffa_forward_stage" if where == "forward" else "ffa_backward_stage"
        real, calls = getattr(attn, name), []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == FAIL_AT[where]:
                _fail(how)
            return real(*args, **kwargs)

        setattr(attn, name, failing)
    start = time.monotonic()
    try:
        for _ in range(2):
            out, _ = md.calc_attn(q, k, v, key)
            md.undispatch(out, key).square().sum().backward()
        if device != "cpu":
            torch.cuda.synchronize()
    except Exception as e:
        raise RuntimeError(f"rank {rank} raised after {time.monotonic() - start:.1f} s") from e
    return "no error"


def _waited(traceback_text: str) -> float:
    import re

    found = re.search(r"raised after ([0-9.]+) s", traceback_text)
    assert found, traceback_text
    return float(found.group(1))


@pytest.mark.parametrize(
    "where, how, world",
    [("forward", "raise", 2), ("backward", "exit", 3), ("backward", "stall", 2)],
)
def test_a_peer_that_fails_mid_collective_is_an_error_on_every_rank(where, how, world):
    """A peer that raises or exits: the others' transport fails at once (gloo sees the closed
    connection). A peer that stalls: the others fail at the group's timeout, and the stalled
    rank fails when it comes back. Never a hang."""
    stall = how == "stall"
    seen = run_ranks(
        world, peer_fails_mid_collective, where, how, "cpu", STALL_TIMEOUT if stall else 0.0,
        timeout=120, outcomes=True,
    )  # fmt: skip
    for r, (kind, detail) in enumerate(seen):
        if r == 1 and how == "exit":
            assert (kind, detail) == ("died", 7), (r, kind, detail)
            continue
        assert kind == "error", (r, kind, detail)  # an exception on every rank, no "no error"
        if r == 1 and how == "raise":
            assert "injected failure on rank 1" in detail, detail
            continue
        waited = _waited(detail)
        if r == 1:  # stalled, then met the closed group
            assert waited >= STALL_TIMEOUT, detail
        elif stall:  # the group's timeout, not later
            assert STALL_TIMEOUT - 1 <= waited <= STALL_TIMEOUT + 10, detail
        else:  # the peer's socket closed: no wait for a timeout
            assert waited < 30, detail


@pytest.mark.gpu
@pytest.mark.parametrize("comm", ["a2av", "native"])
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_peer_that_fails_mid_collective_on_two_gpus(how, comm):
    """NCCL (and the native backend): the survivors end within the process group's timeout
    (an exception, or the NCCL watchdog ending the process), never a hang."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pg_timeout = 30.0  # the NCCL group's; the native kernels' waits give up after 20 s
    start = time.monotonic()
    seen = run_ranks(
        2, peer_fails_mid_collective, "backward", how, "cuda", timeout=120, pg_timeout=pg_timeout,
        # (run_ranks turns NCCL's debug dump off and shortens the watchdog's wait for it)
        env={"MAGI_COMM_BACKEND": comm, "MAGI_COMM_NATIVE_WAIT_TIMEOUT_S": "20"}, outcomes=True,
        backend="nccl",
    )  # fmt: skip
    assert seen[0][0] in ("error", "died"), seen[0]
    assert seen[1][0] in ("error", "died"), seen[1]
    assert time.monotonic() - start < pg_timeout + 60, seen


# ----------------------------------------------------------------------------- the harness


def one_rank_hangs(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(3600)


def test_a_hanging_rank_fails_as_hang():
    start = time.monotonic()
    with pytest.raises(RankHangError, match=r"^hang: one_rank_hangs on 2 ranks: ranks \[.*1\]"):
        run_ranks(2, one_rank_hangs, timeout=20)
    assert time.monotonic() - start < 60
