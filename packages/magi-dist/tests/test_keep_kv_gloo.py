"""The degree-0 backward's two switches, on CPU gloo groups. MAGI_DIST_KEEP_KV=1: it reuses the
forward's gathered K/V rows: the same gradients as without it (bitwise), no group_cast in the
backward on any rank (also on a rank that has no work and kept nothing), a bad value named.
MAGI_DIST_BWD_SPLIT=1 (remote keys first, their reduce started, then the local keys): the
single-process result, with and without kept K/V, and two kernel calls where both parts exist,
the remote keys' (over the whole [local; remote] buffer) before the local keys' (the local rows
alone), with MAGI_DIST_BWD_SPLIT_HEADS the q heads per CTA both calls are asked for.
MAGI_DIST_FWD_SPLIT=1 (the local keys' forward call while the remote K/V rows travel,
then the remote keys'): the single-process result, and the calls in that order around the
cast's wait. MAGI_DIST_BWD_LOW_PRECISION_REDUCE=1: the partials summed in the inputs' dtype; the
degree-0 backward in one call adds the owners' sums into its own buffer's local rows. That the
reduce or the cast overlaps a call is timing, which only the GPU run shows."""

from __future__ import annotations

import os
import random

import pytest
import torch

import magi_dist as md
from magi_dist.testing import Case, run_case, run_ranks, spawn_gloo
from magi_solver import masks
from magi_solver.testing import random_mask


def _step(case: Case, keep: str, casts: list[str]) -> tuple[torch.Tensor, ...]:
    """One forward + backward of ``case`` with MAGI_DIST_KEEP_KV=``keep``: this rank's (out, dq,
    dk, dv), and in ``casts`` one "fwd" / "bwd" per group_cast call."""
    import magi_dist.attn as attn

    os.environ["MAGI_DIST_KEEP_KV"] = keep
    g = torch.Generator().manual_seed(case.seed)
    q, k, v, dout = (
        torch.randn(case.total, h, case.d, generator=g, dtype=torch.float64)
        for h in (case.hq, case.hk, case.hk, case.hq)
    )
    key = md.magi_attn_flex_key(
        case.q_ranges, case.k_ranges, case.types, case.total, case.total, case.hq, case.hk, case.d,
        None, dist_attn_config=case.config(),
    )  # fmt: skip
    lq, lk, lv = (md.dispatch(x, key).requires_grad_() for x in (q, k, v))
    real, phase = attn.group_cast, ["fwd"]

    def counted(*args, **kwargs):
        casts.append(phase[0])
        return real(*args, **kwargs)

    attn.group_cast = counted
    try:
        out, _ = md.calc_attn(lq, lk, lv, key)
        phase[0] = "bwd"
        (out * md.dispatch(dout, key)).sum().backward()
    finally:
        attn.group_cast = real
    return tuple(x.detach() for x in (out, lq.grad, lk.grad, lv.grad))


def kept_equals_recast(rank: int, world: int, cases: list[Case]) -> list[tuple[int, int]]:
    """Per case: (backward casts without keeping, with keeping); asserts bitwise equal results."""
    seen = []
    for case in cases:
        plain_casts: list[str] = []
        kept_casts: list[str] = []
        plain = _step(case, "0", plain_casts)
        kept = _step(case, "1", kept_casts)
        for a, b in zip(plain, kept):
            assert torch.equal(a, b), (case.name, rank)
        seen.append((plain_casts.count("bwd"), kept_casts.count("bwd")))
    return seen


def test_kept_kv_gives_the_same_gradients_without_the_backward_cast():
    cu = [0, 37, 121, 190]
    cases = [
        Case.from_mask("varlen-causal", masks.varlen(cu, causal=True), degree=0, seed=1),
        Case.from_mask("sliding-window", masks.sliding_window(150, (13, 0), causal=True), degree=0, seed=2),
        Case.from_mask("random", random_mask(random.Random(3), 170, max_slices=8), degree=0, seed=3),
        # only the first 32 rows attend: on 3 ranks some rank has no work but holds K/V others need
        Case("idle-rank", [[0, 32]], [[0, 192]], [0], 192, degree=0, chunk=16, seed=4),
    ]
    for r, seen in enumerate(run_ranks(3, kept_equals_recast, cases, timeout=240)):
        for case, (plain, kept) in zip(cases, seen):
            # degree 0 without keeping: every rank casts once in the backward (the count works)
            assert plain == 1 and kept == 0, (r, case.name, plain, kept)


def test_kept_kv_matches_single_process():
    cu = [0, 37, 40, 121, 190]
    segments = masks.from_segment_ids([3] * 50 + [1] * 61 + [3] * 40, causal=True)
    cases = [
        Case.from_mask("varlen-causal", masks.varlen(cu, causal=True), degree=0, seed=0),
        Case.from_mask("segments", segments, degree=0, hq=8, hk=2, seed=1),
        Case.from_mask("mla-dv", masks.varlen(cu, causal=True), degree=0, d=24, dv=16, sink="sh", seed=2),
    ]
    spawn_gloo(2, cases, env={"MAGI_DIST_KEEP_KV": "1"})


def _appending(calls: list, value_of):
    """A wrapper factory for `_recorded_runs`: the wrapped function appends ``value_of(*args)``
    to ``calls``, then runs."""

    def wrap(real):
        def wrapped(*args, **kwargs):
            calls.append(value_of(*args))
            return real(*args, **kwargs)

        return wrapped

    return wrap


def _recorded_runs(cases: list[Case], settings: list[dict], calls: list, wrappers: dict, before_run=None):
    """`run_case` of each case under each of ``settings`` (environment variables), with the
    functions of ``magi_dist.attn`` named in ``wrappers`` replaced by ``wrappers[name](real)``
    (put back, and the variables removed, afterwards); per run, a copy of ``calls`` as the
    wrappers filled it (``before_run`` runs first)."""
    import magi_dist.attn as attn

    real = {name: getattr(attn, name) for name in wrappers}
    for name, wrap in wrappers.items():
        setattr(attn, name, wrap(real[name]))
    seen = []
    try:
        for case in cases:
            for env in settings:
                os.environ.update(env)
                calls.clear()
                if before_run is not None:
                    before_run()
                run_case(case)
                seen.append(list(calls))
    finally:
        for name, fn in real.items():
            setattr(attn, name, fn)
        for env in settings:
            for name in env:
                os.environ.pop(name, None)
    return seen


def split_backward(rank: int, world: int, cases: list[Case]) -> list[list[int]]:
    """Each case with MAGI_DIST_BWD_SPLIT=1, K/V kept and not (checked against one process by
    `run_case`); per run, in call order, the K rows of each backward kernel call on this rank and
    -1 for each group_reduce started."""
    calls: list[int] = []
    settings = [{"MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_KEEP_KV": keep} for keep in ("0", "1")]
    wrappers = {
        "ffa_backward_stage": _appending(calls, lambda dout, q, k, *_: k.shape[0]),
        "group_reduce": _appending(calls, lambda *_: -1),
    }
    return _recorded_runs(cases, settings, calls, wrappers)


def test_split_backward_matches_single_process():
    cu = [0, 37, 121, 190]
    window = masks.sliding_window(150, (13, 0), causal=True)
    cases = [
        Case.from_mask("varlen-causal", masks.varlen(cu, causal=True), degree=0, seed=5),
        Case.from_mask("sliding-window", window, degree=0, seed=6, sink="sh", hq=4, hk=4),
        Case.from_mask("mla-dv", masks.varlen(cu, causal=True), degree=0, d=24, dv=16, seed=7),
        Case("idle-rank", [[0, 32]], [[0, 192]], [0], 192, degree=0, chunk=16, seed=8),
    ]
    seen = run_ranks(3, split_backward, cases, timeout=240)
    runs = [[per_rank[2 * c + keep] for per_rank in seen] for c in range(len(cases)) for keep in (0, 1)]
    for i, ranks in enumerate(runs[:-2]):  # every case but idle-rank, K/V kept and not
        # some rank split its backward (else nothing was tested): the remote part first, its
        # reduce started before the local part's call
        calls = [[r for r in rows if r >= 0] for rows in ranks]
        assert any(len(c) == 2 for c in calls), (i, seen)
        assert all(len(c) <= 1 or c[0] > c[1] for c in calls), (i, seen)
        assert all(rows[:3] == [c[0], -1, c[1]] for rows, c in zip(ranks, calls) if len(c) == 2), (i, seen)


def split_heads(rank: int, world: int, cases: list[Case]) -> list[list[tuple]]:
    """Each case split by keys under each MAGI_DIST_BWD_SPLIT_HEADS of `HEADS_RUNS` (checked
    against one process by `run_case`), with `ffa_kernels.backward_heads_per_cta` answering
    `STAGE_MARK`; per run, in call order: ("rule", K rows, slices) for each question to it and
    ("call", K rows, slices, heads_per_cta) for each backward kernel call."""
    calls: list[tuple] = []

    def record_call(real):
        def wrapped(dout, q, k, v, out, lse, q_ranges, *args, **kwargs):
            calls.append(("call", k.shape[0], q_ranges.shape[0], kwargs.get("heads_per_cta")))
            return real(dout, q, k, v, out, lse, q_ranges, *args, **kwargs)

        return wrapped

    def record_rule(real):
        def wrapped(q, k, v, q_ranges, *args, **kwargs):
            calls.append(("rule", k.shape[0], q_ranges.shape[0]))
            return STAGE_MARK

        return wrapped

    settings = [{"MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_BWD_SPLIT_HEADS": h} for h in HEADS_RUNS]
    wrappers = {"ffa_backward_stage": record_call, "backward_heads_per_cta": record_rule}
    return _recorded_runs(cases, settings, calls, wrappers)


HEADS_RUNS = ("auto", "stage", "2", "")  # "": the switch empty, read as unset (the default)
STAGE_MARK = 1  # what the stubbed rule answers for the whole stage (it divides every case's group)


def test_split_backward_heads_per_cta():
    """auto: each call by the kernel's rule (None passed, the rule not asked); stage (and the
    switch unset, its default): the rule asked once, over the whole stage (the remote keys'
    call's K rows, both calls' slices), and its answer passed to both calls; a number: that one
    to both; the single-process result under each (GQA 4:2 and 8:2, so 2 divides the group)."""
    cu = [0, 37, 121, 190]
    cases = [
        Case.from_mask("varlen-causal", masks.varlen(cu, causal=True), degree=0, seed=16),
        Case.from_mask("varlen-full", masks.varlen(cu), degree=0, seed=17, hq=8, hk=2),
    ]
    seen = run_ranks(2, split_heads, cases, timeout=240)
    want = {"auto": None, "stage": STAGE_MARK, "2": 2, "": STAGE_MARK}
    both = 0
    for per_rank in seen:
        for i, run in enumerate(per_rank):
            setting = HEADS_RUNS[i % len(HEADS_RUNS)]
            kernel = [c for c in run if c[0] == "call"]
            rule = [c for c in run if c[0] == "rule"]
            assert all(c[3] == want[setting] for c in kernel), (setting, run)
            if len(kernel) == 2:  # both parts: the remote keys' call over [local; remote] first
                both += 1
                whole = (kernel[0][1], kernel[0][2] + kernel[1][2])
                asked = [whole] if want[setting] == STAGE_MARK else []
                assert [r[1:] for r in rule] == asked, (setting, run)
    # every run had a rank with both parts (else the parts were not both asked)
    assert both >= len(seen[0]), seen


def heads_not_dividing(rank: int, world: int) -> None:
    os.environ.update({"MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_BWD_SPLIT_HEADS": "3"})
    run_case(Case.from_mask("varlen-causal", masks.varlen([0, 37, 121, 190], causal=True), degree=0, seed=18))


def test_split_heads_not_dividing_the_group_raises_on_every_rank():
    outcomes = run_ranks(2, heads_not_dividing, timeout=120, outcomes=True)
    for kind, detail in outcomes:
        assert kind == "error" and "MAGI_DIST_BWD_SPLIT_HEADS: must divide Hq / Hk = 2, got 3" in detail, (
            outcomes
        )


def split_forward(rank: int, world: int, cases: list[Case]) -> list[list[int]]:
    """Each case with MAGI_DIST_FWD_SPLIT=1, with MAGI_DIST_KEEP_KV and MAGI_DIST_BWD_SPLIT off
    and on together (checked against one process by `run_case`, max_logits included); per run,
    in call order, the K rows of each forward kernel call on this rank and -1 where the
    forward's cast is waited for."""
    calls: list[int] = []
    phase = ["fwd"]

    class _Waited:
        def __init__(self, work):
            self.work = work

        def wait(self):
            if phase[0] == "fwd":
                calls.append(-1)
            return self.work.wait()

    def to_phase(name: str):
        def enter(*_):
            phase[0] = name

        return enter

    settings = [
        {"MAGI_DIST_FWD_SPLIT": "1", "MAGI_DIST_KEEP_KV": both, "MAGI_DIST_BWD_SPLIT": both}
        for both in ("0", "1")
    ]
    wrappers = {
        "ffa_forward_stage": _appending(calls, lambda q, k, *_: k.shape[0]),
        "group_cast": lambda real: lambda *a, **kw: _Waited(real(*a, **kw)),
        "_backward": _appending([], to_phase("bwd")),  # the casts waited after it are the backward's
    }
    return _recorded_runs(cases, settings, calls, wrappers, before_run=to_phase("fwd"))


def test_split_forward_matches_single_process():
    cu = [0, 37, 121, 190]
    window = masks.sliding_window(150, (13, 0), causal=True)
    cases = [
        Case.from_mask("varlen-causal", masks.varlen(cu, causal=True), degree=0, seed=9, max_logits=True),
        Case.from_mask("sliding-window", window, degree=0, seed=10, sink="sh", hq=4, hk=2),
        Case.from_mask("mla-dv", masks.varlen(cu, causal=True), degree=0, d=24, dv=16, sink="ssh", seed=11),
        Case("idle-rank", [[0, 32]], [[0, 192]], [0], 192, degree=0, chunk=16, seed=12),
    ]
    seen = run_ranks(3, split_forward, cases, timeout=240)
    for i in range(2 * (len(cases) - 1)):  # every case but idle-rank, switches off and on
        ranks = [per_rank[i] for per_rank in seen]
        # some rank split its forward (else nothing was tested): the local keys' call on the
        # local rows before the cast is waited for, the remote keys' over [local; remote] after
        split = [rows for rows in ranks if len([r for r in rows if r >= 0]) == 2]
        assert split, (i, seen)
        assert all(rows[1] == -1 and rows[0] < rows[2] for rows in split), (i, seen)


@pytest.mark.parametrize(
    "name, read, args, bad",
    [
        ("MAGI_DIST_KEEP_KV", "keep_kv", (), "yes"),
        ("MAGI_DIST_BWD_SPLIT", "bwd_split", (4,), "on"),
        ("MAGI_DIST_BWD_SPLIT_HEADS", "bwd_split_heads", (), "0"),
        ("MAGI_DIST_BWD_SPLIT_HEADS", "bwd_split_heads", (), "half"),
        ("MAGI_DIST_FWD_SPLIT", "fwd_split", (), "true"),
        ("MAGI_DIST_BWD_LOW_PRECISION_REDUCE", "bwd_reduce_dtype", (torch.float32, torch.bfloat16), "bf16"),
    ],
)
def test_a_bad_switch_value_is_named(monkeypatch, name, read, args, bad):
    import magi_dist.attn as attn

    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        getattr(attn, read)(*args)


@pytest.mark.parametrize("value, heads", [(None, "stage"), ("", "stage"), (" Auto ", "auto"), ("4", 4)])
def test_the_split_backward_takes_the_stages_heads_per_cta_unless_told(monkeypatch, value, heads):
    import magi_dist.attn as attn

    if value is None:
        monkeypatch.delenv("MAGI_DIST_BWD_SPLIT_HEADS", raising=False)
    else:
        monkeypatch.setenv("MAGI_DIST_BWD_SPLIT_HEADS", value)
    assert attn.bwd_split_heads() == heads


@pytest.mark.parametrize(
    "value, cp, split", [(None, 2, False), (None, 4, True), (None, 8, True), ("0", 8, False), ("1", 2, True)]
)
def test_the_backward_splits_from_cp_4_unless_told(monkeypatch, value, cp, split):
    import magi_dist.attn as attn

    if value is None:
        monkeypatch.delenv("MAGI_DIST_BWD_SPLIT", raising=False)
    else:
        monkeypatch.setenv("MAGI_DIST_BWD_SPLIT", value)
    assert attn.bwd_split(cp) is split


SWITCH_RUNS = (("0", "0"), ("1", "0"), ("0", "1"))  # (BWD_LOW_PRECISION_REDUCE, BWD_SPLIT)


def reduce_targets(rank: int, world: int, cases: list[Case]) -> list[list[tuple[str, str, bool]]]:
    """Each case under each of `SWITCH_RUNS` (checked against one process by `run_case` at the
    case's tolerance); per run, for each group_reduce started, the input and output dtypes and
    whether the output is the local rows of the input's [dK, dV] buffer (just before its rows)."""
    import magi_dist.attn as attn

    def target(partial, out, *_):
        # the buffer's local rows: the output ends where the partial (its remote rows) begins
        same = out.untyped_storage().data_ptr() == partial.untyped_storage().data_ptr()
        same = same and out.data_ptr() + out.nbytes == partial.data_ptr()
        return (str(partial.dtype), str(out.dtype), same)

    calls: list[tuple[str, str, bool]] = []
    settings = [
        {attn.ENV_BWD_LOW_PRECISION_REDUCE: low, attn.ENV_BWD_SPLIT: split} for low, split in SWITCH_RUNS
    ]
    return _recorded_runs(cases, settings, calls, {"group_reduce": _appending(calls, target)})


def test_backward_reduce_dtype_and_target():
    """MAGI_DIST_BWD_LOW_PRECISION_REDUCE=1 sums the partials in the inputs' dtype (bf16
    here; float64 inputs: unchanged); the degree-0 backward in one call adds the owners' sums
    straight into the local rows of its [dK, dV] buffer, the split one and the staged one into
    a buffer apart."""
    cu = [0, 37, 121, 190]
    cases = [
        Case.from_mask(
            "bf16 degree 0", masks.varlen(cu, causal=True), degree=0, seed=13, dtype="bfloat16", tol=3e-2
        ),
        Case.from_mask(
            "bf16 staged", masks.varlen(cu, causal=False), degree=2, seed=14, dtype="bfloat16", tol=3e-2
        ),
        Case.from_mask("float64", masks.varlen(cu, causal=True), degree=0, seed=15),
    ]
    seen = run_ranks(3, reduce_targets, cases, timeout=240)
    f32, bf16, f64 = "torch.float32", "torch.bfloat16", "torch.float64"
    want = [
        (f32, f32, True), (bf16, bf16, False), (f32, f32, False),  # degree 0: one call, low, split
        (f32, f32, False), (bf16, bf16, False), (f32, f32, False),  # staged
        (f64, f64, True), (f64, f64, True), (f64, f64, False),  # float64: no lower dtype
    ]  # fmt: skip
    for per_rank in seen:
        for run, w in zip(per_rank, want, strict=True):
            assert run and all(call == w for call in run), (w, per_rank)
