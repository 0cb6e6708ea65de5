"""The backward's partial [dK, dV] buffers (``magi_dist.partials``, issue 19 item 2).

* native backend, on magi_comm's fake NVSHMEM world (ranks = threads, CPU tensors; see
  ``magi_comm.testing.native_fake``): calc_attn's forward and backward (``_DistAttnFunc``, the
  autograd function calc_attn applies) with the partials in symmetric outputs: gradients equal
  single-process attention and, bitwise, the same run with plain partials; every group-reduce
  reads a symmetric input and the owners pull rows; every rank allocates the same buffers in the
  same order (also where a rank has no remote rows), a repeat allocates nothing.
* the pool's decisions against a fake collective (growth, budget, zero rows, freeing).
* a2av on 2 gloo processes: plain tensors, no symmetric allocation, results as before.
"""

from __future__ import annotations

import pytest
import torch

import magi_comm
import magi_dist.attn as attn
from ffa_kernels import flex_flash_attn_func
from magi_comm.backends import native
from magi_comm.backends.native import NativeBackend, NativeConfig
from magi_comm.testing import native_fake
from magi_dist import partials
from magi_dist.dispatch import _take_local
from magi_dist.key import DistAttnRuntimeKey
from magi_dist.runtime import DistAttnRuntime
from magi_dist.testing import Case, run_case, run_ranks
from magi_solver import AttnMask, DispatchConfig, DistAttnConfig, OverlapConfig, make_plan, masks

HQ, HK, D = 4, 2, 16
DV = 12  # v's head dim: the packed [dK, dV] rows of unequal halves go through the pool too

# One slice whose keys all lie on a few ranks: at cp 2 and 3 some rank receives no remote rows
# in some stage while others do (checked below), so its allocations must still match theirs.
LOPSIDED = AttnMask([(11, 22)], [(46, 68)], [2], 120, 120)
VARLEN = masks.varlen([0, 37, 40, 121, 190], causal=True)


def _runtime(mask: AttnMask, world: int, rank: int, degree: int, group) -> DistAttnRuntime:
    """The runtime calc_attn would build, without torch.distributed (the fake world's group is
    an object per rank)."""
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=8),
        overlap_config=OverlapConfig(degree=degree, min_chunk_size=4),
    )
    q, k, t = mask.to_lists()
    key = DistAttnRuntimeKey(
        tuple(map(tuple, q)), tuple(map(tuple, k)), tuple(t), mask.total_seqlen_q, mask.total_seqlen_k,
        HQ, HK, D, DV, tuple(range(world)), config.model_dump_json(), group,
    )  # fmt: skip
    return DistAttnRuntime(key=key, plan=make_plan(mask, world, config), rank=rank, group=group)


def _inputs(mask: AttnMask, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = mask.total_seqlen_q
    return [
        torch.randn(T, h, d, generator=g, dtype=torch.float64).to(dtype)
        for h, d in ((HQ, D), (HK, D), (HK, DV), (HQ, DV))
    ]


def _reference(mask: AttnMask, x: list[torch.Tensor]) -> list[torch.Tensor]:
    """dq, dk, dv of single-process attention for the loss sum(out * dout)."""
    q, k, v = (t.clone().requires_grad_() for t in x[:3])
    ranges = [torch.tensor(r, dtype=torch.int32).reshape(-1, 2) for r in mask.to_lists()[:2]]
    types = torch.tensor(mask.to_lists()[2], dtype=torch.int32)
    out, _ = flex_flash_attn_func(q, k, v, *ranges, types)
    (out * x[3]).sum().backward()
    return [t.grad for t in (q, k, v)]


CASES = [  # (mask, degree, dtype); the last repeats the first: the pool is reused
    (LOPSIDED, 2, torch.float64),
    (VARLEN, 1, torch.float64),
    (LOPSIDED, 0, torch.float64),
    (VARLEN, 0, torch.float32),
    (VARLEN, 2, torch.float64),
    (LOPSIDED, 2, torch.float64),
]


def _fake_world_run(world: int, monkeypatch, budget_mb: str) -> tuple[native_fake.FakeWorld, dict]:
    """Every case of CASES twice on a fresh fake world of ``world`` ranks through the native
    backend; returns the world and, per rank, the gradients, the symmetric allocations made
    (in order) and per group-reduce whether its input lay in a symmetric output."""
    monkeypatch.setenv(magi_comm.ENV_BACKEND, "native")
    monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, budget_mb)
    fw = native_fake.FakeWorld(world)
    seen: dict = {r: {"grads": [], "allocs": [], "reduces": []} for r in range(world)}

    def rank_fn(rank):
        group = ("cp", rank)  # one per rank: the threads share magi_comm's registry
        log = seen[rank]
        be = NativeBackend(group, rank, world, NativeConfig(buffer_bytes=1 << 20))
        real_empty, real_free, real_reduce = be.empty_output, be.free_output, be.group_reduce

        def empty_output(shape, dtype):
            log["allocs"].append(("empty", tuple(shape), dtype))
            return real_empty(shape, dtype)

        def free_output(t):
            log["allocs"].append(("free", tuple(t.shape)))
            real_free(t)

        def group_reduce(input, *args):
            log["reduces"].append((be._state.outputs.index(input) is not None, input.shape[0]))
            return real_reduce(input, *args)

        be.empty_output, be.free_output, be.group_reduce = empty_output, free_output, group_reduce
        with native_fake.default_collective(group, be):
            for rnd in range(2):
                for i, (mask, degree, dtype) in enumerate(CASES):
                    rt = _runtime(mask, world, rank, degree, group)
                    q, k, v, dout = (_take_local(t, rt, 0.0) for t in _inputs(mask, dtype, seed=i))
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    out, _lse, _ = attn._DistAttnFunc.apply(
                        q, k, v, None, rt, "sh", D**-0.5, 0.0, False, False
                    )
                    (out * dout).sum().backward()
                    log["grads"].append([t.grad for t in (q, k, v)])
                log[f"allocs_after_round{rnd}"] = len(log["allocs"])
            log["aliased"] = _backward_results_alias_the_pool(world, rank, group)
            log["sums_as_cast"] = _sums_in_grad_dtype_equal_the_cast(world, rank, group)
        native.shutdown()

    native_fake.run_ranks(fw, rank_fn)
    return fw, seen


def _backward_results_alias_the_pool(world: int, rank: int, group) -> bool:
    """Whether a degree-0 backward's dq, dk, dv change when the next call reuses the pooled
    buffer (the local rows' gradients are computed in it: they must be returned apart)."""
    rt = _runtime(VARLEN, world, rank, 0, group)
    q, k, v, dout = (_take_local(t, rt, 0.0) for t in _inputs(VARLEN, torch.float64, seed=9))
    out, lse, _, _ = attn._forward(rt, q, k, v, None, "sh", D**-0.5, 0.0, False)
    first = attn._backward(rt, dout, q, k, v, out, lse, D**-0.5, 0.0, False)
    kept = [t.clone() for t in first]
    attn._backward(rt, 2 * dout, q, k, v, out, lse, D**-0.5, 0.0, False)
    return not all(torch.equal(a, b) for a, b in zip(first, kept))


def _sums_in_grad_dtype_equal_the_cast(world: int, rank: int, group) -> list[bool]:
    """Per overlap degree (0: one [local; remote] call, 2: stages), whether dq, dk, dv asked in
    bfloat16 (`_backward`'s grad_dtype: the final sums written in it, dq cast while the reduces
    travel) come out in bfloat16, bitwise equal to the float32 result cast."""
    ok = []
    for degree in (0, 2):
        rt = _runtime(VARLEN, world, rank, degree, group)
        q, k, v, dout = (_take_local(t, rt, 0.0) for t in _inputs(VARLEN, torch.float32, seed=11))
        out, lse, _, _ = attn._forward(rt, q, k, v, None, "sh", D**-0.5, 0.0, False)
        wide = [t.clone() for t in attn._backward(rt, dout, q, k, v, out, lse, D**-0.5, 0.0, False)]
        got = attn._backward(rt, dout, q, k, v, out, lse, D**-0.5, 0.0, False, grad_dtype=torch.bfloat16)
        ok.append(
            all(g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16)) for g, w in zip(got, wide))
            and wide[1].abs().max() > 0
        )
    return ok


@pytest.mark.parametrize("split", ["0", "1"])  # the degree-0 backward in one call, or split by keys
@pytest.mark.parametrize("world", [2, 3, 8])  # 8: cp 8's packed peer words all in use
def test_native_partials_are_pulled_from_symmetric_outputs(world, split, monkeypatch):
    monkeypatch.setenv(attn.ENV_BWD_SPLIT, split)  # read per backward; the same on every rank here
    for mask, degree, _ in CASES:  # the lopsided mask has a rank without remote rows somewhere
        if mask is LOPSIDED:
            plan = _runtime(mask, world, 0, degree, None).plan
            rows = [x for r in plan.ranks for x in r.comm.num_recv_tokens_per_stage]
            assert 0 in rows and any(rows), (degree, rows)

    fw, seen = _fake_world_run(world, monkeypatch, budget_mb="256")
    plain_fw, plain = _fake_world_run(world, monkeypatch, budget_mb="0")

    for rank in range(world):
        log = seen[rank]
        # every partial with rows went out from a symmetric output (an empty view has no
        # address); with the budget 0, none did
        assert log["reduces"] and all(sym for sym, rows in log["reduces"] if rows), log["reduces"]
        assert not any(sym for sym, _ in plain[rank]["reduces"]) and not plain[rank]["allocs"]
        # the same collective allocations, in the same order, on every rank; none in the repeat
        assert log["allocs"] == seen[0]["allocs"], (rank, log["allocs"], seen[0]["allocs"])
        assert log["allocs"] and log["allocs_after_round0"] == log["allocs_after_round1"]
        assert not log["aliased"] and not plain[rank]["aliased"]
        assert log["sums_as_cast"] == [True, True] and plain[rank]["sums_as_cast"] == [True, True]
        for i, (got, again, base) in enumerate(
            zip(log["grads"], log["grads"][len(CASES) :], plain[rank]["grads"])
        ):
            mask, _degree, dtype = CASES[i]
            rt = _runtime(mask, world, rank, CASES[i][1], None)
            ref = [_take_local(g, rt, 0.0) for g in _reference(mask, _inputs(mask, dtype, seed=i))]
            tol = 1e-9 if dtype == torch.float64 else 2e-4
            for name, a, b, p, r in zip("qkv", got, again, base, ref):
                assert torch.equal(a, p), (rank, i, name)  # bitwise the plain partials' result
                assert torch.equal(a, b), (rank, i, name)  # a reused buffer: the same again
                assert (a - r).abs().max() <= tol, (rank, i, name, float((a - r).abs().max()))
    # the owners read rows in place from the senders' partials, and the senders waited for them
    assert fw.pulled_rows > 0 and fw.published_maps > 0 and fw.done_waits > 0
    assert plain_fw.pulled_rows == 0
    # some rank reduced an empty partial (no remote rows) and still allocated like its peers
    assert any(rows == 0 for r in range(world) for _, rows in seen[r]["reduces"])


def test_partial_rows_are_the_largest_rank_s():
    """Per group-reduce of the backward, the most rows any rank's partial buffer has: the same
    from every rank's runtime, also from a rank that receives nothing."""
    for degree in (0, 1, 2):
        rts = [_runtime(LOPSIDED, 3, r, degree, None) for r in range(3)]
        every = [r.comm.num_recv_tokens_per_stage for r in rts[0].plan.ranks]
        if degree == 0:  # one buffer over [local; remote] rows
            every = [[rts[0].shard_seqlen + rows[0]] for rows in every]
        want = tuple(max(col) for col in zip(*every))
        assert [rt.partial_rows() for rt in rts] == [want] * 3, (degree, every)
        assert any(0 in rows for rows in every) or degree == 0


# ----------------------------------------------------------------------------- the pool alone


class _FakeCollective:
    """The two collectives the pool makes, recorded; one rank's view."""

    def __init__(self, symmetric=True):
        self.calls: list[tuple] = []
        self.reserved: list[tuple[int, int]] = []  # reserve_rows arguments, in call order
        self.symmetric_outputs = symmetric
        self.group = object()
        self.closed = False

    def empty_output(self, shape, dtype):
        self.calls.append(("empty", tuple(shape)))
        return torch.full(shape, 7, dtype=dtype)

    def free_output(self, t):
        self.calls.append(("free", tuple(t.shape)))

    def reserve_rows(self, rows_per_peer, row_bytes):
        self.reserved.append((rows_per_peer, row_bytes))


class _Rt:
    group = None  # get_group_collective is replaced by the test

    def __init__(self, mine, most):
        self.mine = mine  # what this rank's call will ask for (at most ``most``)
        self.rows = tuple(most)

    def partial_rows(self):
        return self.rows

    def max_pair_rows(self):
        return max(self.rows) // 2 + 1  # any value the plan could give: passed on as it is


def test_pool_grows_by_the_largest_rank_within_the_budget(monkeypatch):
    gc = _FakeCollective()
    monkeypatch.setattr(partials, "get_group_collective", lambda group: gc)
    monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, "1")  # 1 MiB
    grain, row = 1 << 16, (2, 4, 8)  # float32 rows of 256 bytes
    take = lambda mine, most: partials.Partials.take(_Rt(mine, most), row, torch.float32, torch.device("cpu"))  # noqa: E731

    # this rank has no rows in stage 1, a peer has 10: the slot is allocated all the same
    p = take([3, 0], [3, 10])
    assert gc.calls == [("empty", (grain,)), ("empty", (grain,))]
    assert p.symmetric(0) and p.symmetric(1)
    z = p.zeros(1, 0)
    assert z.shape == (0, *row) and p.zeros(0, 3).eq(0).all()  # zeroed, not the 7s underneath
    # within what is held: nothing allocated; a stage that no rank has rows in: no slot
    gc.calls.clear()
    take([256, 1, 0], [256, 10, 0])
    assert gc.calls == []
    # growth: freed, then allocated with headroom (1.25 x 64 KiB > 300 rows), rounded to the grain
    take([300, 0], [300, 0])
    assert gc.calls == [("free", (grain,)), ("empty", (2 * grain,))]
    # over the budget: a plain tensor this time, the held slot kept for later calls
    gc.calls.clear()
    p = take([4096, 1], [4096, 1])
    assert gc.calls == [] and not p.symmetric(0) and p.symmetric(1)
    assert p.zeros(0, 4096).shape == (4096, *row)
    # growth to the rows rounded to the grain (more than the headroom), then a growth that the
    # headroom would take past the budget takes only what fits: 1 MiB less slot 0's 2 x 64 KiB
    take([1, 3000], [1, 3000])
    assert gc.calls[-2:] == [("free", (grain,)), ("empty", (12 * grain,))]
    take([1, 3200], [1, 3200])
    assert gc.calls[-2:] == [("free", (12 * grain,)), ("empty", (14 * grain,))]


def test_plain_partials_without_symmetric_outputs_or_budget(monkeypatch):
    for gc, mb in ((_FakeCollective(symmetric=False), "256"), (_FakeCollective(), "0")):
        monkeypatch.setattr(partials, "get_group_collective", lambda group, gc=gc: gc)
        monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, mb)
        p = partials.Partials.take(_Rt([5], [9]), (2, 1, 4), torch.float64, torch.device("cpu"))
        t = p.zeros(0, 5)
        assert not p.symmetric(0) and gc.calls == [] and t.eq(0).all() and t.shape == (5, 2, 1, 4)
        # room for the reduces reserved whatever the partials are: the plan's most rows between
        # two ranks, of 8 float64 (64 bytes)
        assert gc.reserved == [(9 // 2 + 1, 64)]


def test_partials_reduced_in_another_dtype_are_plain_and_reserve_its_rows(monkeypatch):
    """MAGI_DIST_BWD_LOW_PRECISION_REDUCE: the float32 buffers are cast before they travel, so no
    pool (receivers could not read them in place) and the reserve counts the cast rows."""
    gc = _FakeCollective()
    monkeypatch.setattr(partials, "get_group_collective", lambda group: gc)
    monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, "256")
    p = partials.Partials.take(
        _Rt([5], [9]), (2, 4), torch.float32, torch.device("cpu"), reduce_dtype=torch.bfloat16
    )
    assert not p.symmetric(0) and gc.calls == [] and p.zeros(0, 5).dtype == torch.float32
    assert gc.reserved == [(9 // 2 + 1, 16)]  # 8 bfloat16 per row
    partials.Partials.take(
        _Rt([5], [9]), (2, 4), torch.float32, torch.device("cpu"), reduce_dtype=torch.float32
    )
    assert gc.calls and gc.reserved[-1] == (9 // 2 + 1, 32)  # the same dtype: pooled, float32 rows


def test_max_pair_rows_is_the_plan_s_most_between_two_ranks():
    """The most rows one rank receives from one peer in one stage (so sends back in the
    reduce), counted here from the senders' side of the casts (input splits and their
    destinations), where the runtime counts the receivers': the same from every rank's runtime."""
    for mask, world in ((LOPSIDED, 3), (VARLEN, 2), (VARLEN, 3)):
        for degree in (0, 1, 2):
            rts = [_runtime(mask, world, r, degree, None) for r in range(world)]
            ranks = rts[0].plan.ranks
            want = 0
            for stage in range(len(ranks[0].comm.stages)):
                for src, rp in enumerate(ranks):
                    a = rp.comm.stages[stage]
                    for dst in range(world):
                        if dst != src:
                            sent = sum(n for n, d in zip(a.input_split_sizes, a.dst_indices) if dst in d)
                            want = max(want, sent)
            assert [rt.max_pair_rows() for rt in rts] == [want] * world, (degree, world)
            assert want > 0


def test_free_partials_frees_the_group_pool_once(monkeypatch):
    gc = _FakeCollective()
    monkeypatch.setattr(partials, "get_group_collective", lambda group: gc)
    monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, "8")
    partials.Partials.take(_Rt([1, 2], [1, 2]), (4,), torch.float32, torch.device("cpu"))
    gc.calls.clear()
    partials.free_partials(object())  # another group's: not this pool
    assert gc.calls == []
    partials.free_partials(gc.group)
    assert gc.calls == [("free", (1 << 16,)), ("free", (1 << 16,))]
    partials.free_partials(gc.group)  # nothing left
    assert len(gc.calls) == 2


@pytest.mark.parametrize("bad", ["-1", "lots", "nan"])
def test_budget_env_rejects_bad_values(monkeypatch, bad):
    monkeypatch.setenv(partials.ENV_SYMMETRIC_MB, bad)
    with pytest.raises(ValueError, match=partials.ENV_SYMMETRIC_MB):
        partials.symmetric_budget()


def test_pools_are_per_collective_and_do_not_keep_it_alive():
    import gc as garbage

    gc = _FakeCollective()
    pool = partials._pool(gc)
    assert partials._pool(gc) is pool and partials._pool(_FakeCollective()) is not pool
    n = len(partials._POOLS)
    del gc
    garbage.collect()
    assert len(partials._POOLS) < n


# ----------------------------------------------------------------------------- a2av


def _a2av_rank(rank: int, world: int) -> list:
    """run_case on a2av with the allocations watched: no symmetric output, plain partials."""
    made, taken = [], []
    real_take = partials.Partials.take

    def take(*args, **kwargs):
        p = real_take(*args, **kwargs)
        taken.append(p.slots)
        return p

    magi_comm.GroupCollective.empty_output = lambda self, *a, **k: made.append(a)
    partials.Partials.take = take
    mask = masks.varlen([0, 37, 40, 121, 190], causal=True)
    for degree in (0, 2):
        run_case(Case.from_mask(f"a2av-deg{degree}", mask, degree=degree, chunk=8, min_chunk=4))
    return [made, taken]


def test_a2av_keeps_plain_partials():
    for made, taken in run_ranks(2, _a2av_rank, env={magi_comm.ENV_BACKEND: "a2av"}, timeout=180):
        assert made == [] and len(taken) == 2 and taken == [[], []]
