"""tools/bench_dist.py and tools/allgather_cp.py on the CPU: the benchmark's cases, FLOP counts and
tables, the all-gather baseline's forward and backward against one process, and both modes of the
benchmark run end to end on 2 gloo ranks with tiny sizes (the GPU-only peers, torch's ring
context_parallel, are skipped there and show as "–")."""

from __future__ import annotations

# allgather_cp, bench_dist, step_series: tools/*.py, by name (conftest.py)
import allgather_cp
import bench_dist as bd
import pytest
import step_series as ss
import torch
import torch.distributed as dist

from ffa_kernels import flex_flash_attn_func
from magi_dist.testing import run_ranks
from magi_solver import masks


def test_cases_and_flops():
    cases = bd.bench_cases(bd.STEP_MASKS, [65536, 131072])
    assert [c.name for c in cases[:4]] == [
        "varlen causal 64k",
        "varlen full 64k",
        "causal 64k",
        "varlen block causal 64k",
    ]
    assert len(cases) == 8 and all(c.mask.total_seqlen_q == c.total for c in cases)
    assert [c.causal for c in cases[:4]] == [True, False, True, True]
    causal = cases[2]
    assert causal.mask.area() == bd.plain_area(65536, True) == 65536 * 65537 // 2
    # forward 4·area·Hq·D, a step 3.5x that (backward 2.5x the forward)
    assert bd.attn_flops(10, 32, 128) == 4 * 10 * 32 * 128
    assert bd.attn_flops(10, 32, 128, step=True) == 3.5 * 4 * 10 * 32 * 128
    assert bd.tflops(2e12, 0.5, 2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown mask kind 'ring'"):
        bd.bench_cases("ring", [1024])
    args = bd.parse_args(["--step"])
    assert args.masks == bd.STEP_MASKS and args.whole and not args.deterministic and args.alternate == 0
    for bad in (
        ["--step", "--alternate", "-1"],
        ["--alternate", "2"],
        ["--step", "--no-whole", "--alternate", "1"],
    ):
        with pytest.raises(SystemExit):
            bd.parse_args(bad)
    assert bd.parse_args([]).masks == bd.FORWARD_MASKS


def test_step_series_arguments():
    """tools/step_series.py: bench_dist's mask kinds only, free mode by default."""
    args = ss.parse_args(["--mask", "varlen_full", "--modes", "free", "sync"])
    assert (args.mask, args.total, args.modes) == ("varlen_full", 65536, ["free", "sync"])
    assert ss.parse_args([]).modes == ["free"]
    with pytest.raises(SystemExit):
        ss.parse_args(["--mask", "ring"])


def test_step_table():
    nan = float("nan")
    row = bd.StepRow("causal 64k", 7e14, 7e14, 1.0, 0.95, 0.9, 1.8, 1.1, 1.25, 1.001)
    cells = row.cells(cp=2)
    # magi 350 TFLOP/s per GPU; one GPU over the whole mask: 7e14 / 1.8 s = 388.9 -> 90%
    assert cells[:8] == ["causal 64k", "350.0", "368.4", "95.0%", "388.9", "90.0%", "388.9", "90.0%"]
    assert cells[8:12] == ["318.2", "110.0%", "280.0", "125.0%"]
    partial = bd.StepRow("x", 1e12, nan, 1.0, 1.0, 1.0, nan, 1.0, nan, 1.0)
    assert partial.cells(2).count("–") == 4  # no whole-mask time, no ring: their cells and ratios
    lines = bd.step_table([row, partial], 2).splitlines()
    assert lines[0] == bd.STEP_HEADER and lines[1].count("---") == lines[0].count("|") - 1
    assert lines[2] == "| " + " | ".join(cells) + " |" and len(lines) == 4


def allgather_fwd_bwd(rank: int, world: int) -> list[float]:
    mask = masks.varlen([0, 100, 230, 300], causal=True)
    ag = allgather_cp.AllGatherCP(mask, dist.group.WORLD, 16)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(300, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    lq, lk, lv = (ag.dispatch(x, rank).requires_grad_() for x in (q, k, v))
    out = ag.forward(lq, lk, lv)
    grads = torch.autograd.grad(out, (lq, lk, lv), ag.dispatch(dout, rank))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ranges = (torch.tensor(x, dtype=torch.int32) for x in mask.to_lists())
    ref = flex_flash_attn_func(*ref_in, *ranges)[0]
    ref_grads = torch.autograd.grad(ref, ref_in, dout)
    pairs = zip((ref, *ref_grads), (out, *grads))
    return [float((ag.dispatch(r.detach(), rank) - x).abs().max()) for r, x in pairs]


def on_gloo(rank: int, world: int, argvs: list[list[str]]) -> tuple[list[float], list[str]]:
    """The all-gather check, then each benchmark run (one process group for all: spawning ranks
    costs more than the tiny benchmark)."""
    return allgather_fwd_bwd(rank, world), [bd.run(bd.parse_args(argv)) for argv in argvs]


def test_allgather_baseline_and_both_benchmark_modes_on_gloo():
    tiny = ["--totals", "512", "--hq", "2", "--hk", "1", "--d", "16", "--chunk", "64", "--iters", "1"]
    argvs = [
        [*tiny, "--step", "--masks", "varlen_causal,full"],
        [*tiny, "--masks", "causal"],
        [*tiny, "--step", "--masks", "causal", "--no-baselines", "--alternate", "1"],
    ]
    ranks = run_ranks(2, on_gloo, argvs, timeout=180)
    for rank, (errs, _) in enumerate(ranks):
        assert max(errs) < 1e-12, (rank, errs)  # all-gather CP: out, dq, dk, dv against one process
    step, fwd, magi_only = ranks[0][1]
    lines = step.strip().splitlines()
    assert lines[-4] == bd.STEP_HEADER
    assert lines[-2].startswith("| varlen causal 512 | ") and lines[-1].startswith("| full 512 | ")
    assert "| causal 512 | " in fwd and "K/V bytes received per rank" in fwd
    # --no-baselines (with --alternate): the magi step and the whole mask on one GPU, every
    # baseline's cell empty
    row = magi_only.strip().splitlines()[-1].split(" | ")
    assert row[0] == "| causal 512" and row[1] != "–" and row[6] != "–" and row[7] != "–"
    assert row[2:6] == ["–"] * 4 and row[8:12] == ["–"] * 4


def test_alternate_timings_take_turns():
    calls = []
    a = iter([5.0, 1.0])
    b = iter([7.0, 9.0])

    def time_a():
        calls.append("a")
        return next(a)

    def time_b():
        calls.append("b")
        return next(b)

    assert bd.alternate_timings(time_a, time_b, 3.0, 8.0, 2) == ([3.0, 5.0, 1.0], [8.0, 7.0, 9.0])
    assert calls == ["a", "b", "a", "b"]
    assert bd.alternate_timings(time_a, time_b, 3.0, 8.0, 0) == ([3.0], [8.0]) and len(calls) == 4
