"""tools/step_ab.py on the CPU: its settings, the environment it sets and restores, the turns it
takes, its tables, and a run on 2 gloo ranks in which each setting's switch is seen by the
backward while (and only while) that setting is timed."""

from __future__ import annotations

import os

# bench_dist, step_ab: tools/*.py, by name as step_ab imports its neighbours (conftest.py)
import bench_dist
import pytest
import step_ab as ab

from magi_dist.testing import run_ranks


def test_settings_parse_and_refuse_what_is_not_read_per_call():
    assert ab.parse_setting("default") == ab.Setting("default", {})
    st = ab.parse_setting("both:MAGI_DIST_BWD_SPLIT=1,MAGI_DIST_KEEP_KV=1")
    assert st.env == {"MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_KEEP_KV": "1"}
    for bad in (
        "",
        ":MAGI_DIST_BWD_SPLIT=1",
        "a b",
        "x:MAGI_DIST_BWD_SPLIT",
        "x:MAGI_COMM_NATIVE_MAX_PROGRAMS=16",
        "x:MAGI_DIST_BWD_SPLIT=yes",  # a value the switch's own reader refuses
        "x:MAGI_DIST_SYMMETRIC_PARTIALS_MB=-1",
    ):
        with pytest.raises(ValueError, match="--setting"):
            ab.parse_setting(bad)
    args, bargs = ab.parse_args(["--setting", "a", "--setting", "b:MAGI_DIST_FWD_SPLIT=1", "--totals", "512"])
    assert [s.name for s in args.settings] == ["a", "b"] and args.rounds == 8
    assert (bargs.step, bargs.degree, bargs.totals) == (True, 0, [512])
    assert ab.parse_args(["--setting", "a", "--degree", "2"])[1].degree == 2
    bad_argvs = (
        ["--setting", "a", "--setting", "a"],
        ["--setting", "a", "--rounds", "0"],
        [],
        ["--setting", "a", "--trace"],
        ["--setting", "a", "--alternate", "1"],
    )
    for bad_argv in bad_argvs:
        with pytest.raises(SystemExit):
            ab.parse_args(bad_argv)


def test_applied_sets_unsets_and_restores(monkeypatch):
    split, keep, low = "MAGI_DIST_BWD_SPLIT", "MAGI_DIST_KEEP_KV", "MAGI_DIST_BWD_LOW_PRECISION_REDUCE"
    monkeypatch.setenv(split, "0")
    monkeypatch.setenv(low, "1")  # exported outside, named by no setting
    monkeypatch.delenv(keep, raising=False)
    a, b = ab.Setting("a", {keep: "1"}), ab.Setting("b", {split: "1"})
    with ab.applied(a):
        assert os.environ[keep] == "1" and split not in os.environ and low not in os.environ
    assert os.environ[split] == "0" and os.environ[low] == "1" and keep not in os.environ
    with ab.applied(b):
        assert os.environ[split] == "1" and keep not in os.environ and low not in os.environ
    assert os.environ[split] == "0" and os.environ[low] == "1" and keep not in os.environ


def test_turns_and_tables():
    calls = []

    def timer(name, values):
        it = iter(values)

        def t():
            calls.append(name)
            return next(it)

        return t

    got = bench_dist.round_robin({"a": timer("a", [3.0, 1.0, 2.0]), "b": timer("b", [4.0, 6.0, 5.0])}, 3)
    assert got == {"a": [3.0, 1.0, 2.0], "b": [4.0, 6.0, 5.0]} and calls == ["a", "b"] * 3
    table = ab.ab_table("t", {"a": [0.002, 0.004, 0.003], "b": [0.006]}, 1e12, 2)
    rows = table.splitlines()
    # a: median 3 ms, 1e12 / 3e-3 / 2 GPUs = 166.7 TFLOP/s; b: 6 ms, twice a's
    assert rows[3] == "| a | 3.000 | 166.7 | +0.0% | 2.00 4.00 3.00 |"
    assert rows[4] == "| b | 6.000 | 83.3 | +100.0% | 6.00 |"


def test_kernel_times_of_a_trace():
    def x(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}

    trace = {
        "traceEvents": [
            x("kernel_cutlass_kernel_ffa_kernelscutefwd_sm90FFAForwardSm90_object", 0, 40),
            x("kernel_cutlass_kernel_ffa_kernelscutebwd_preprocessBwdPreprocess_object", 40, 5),
            x("kernel_cutlass_kernel_ffa_kernelscutebwd_sm90FFABackwardSm90_object", 45, 100),
            x("_copy_kernel", 150, 20),
            x("void at::native::direct_copy_kernel_cuda(...)", 170, 4),  # torch's, not magi-comm's
            x("_reduce_kernel", 174, 6),
            {"ph": "X", "cat": "cpu_op", "name": "FFABackward host", "ts": 0, "dur": 999},
        ]
    }
    got = ab.kernel_times(trace, steps=2)
    assert got == {"bwd": 50.0, "fwd": 20.0, "reduce": 3.0, "copies": 10.0, "window": 90.0}


def ab_on_gloo(rank: int, world: int, argv: list[str]) -> tuple[str, list[bool], list[int]]:
    """step_ab's run, recording what the backward read of the split switch at each call, and
    when (after how many backward calls) the symmetric partials' pool was freed."""
    import magi_dist.attn as attn

    seen = []
    real = attn.bwd_split

    def spy(cp_size):
        seen.append(real(cp_size))
        return seen[-1]

    args, bargs = ab.parse_args(argv)  # (its check of the settings' values reads the switch too)
    attn.bwd_split = spy
    freed = []
    real_free = ab.free_partials
    ab.free_partials = lambda group: freed.append(len(seen)) or real_free(group)
    return ab.run(args, bargs), seen, freed


def test_settings_take_turns_on_gloo():
    argv = [
        "--setting", "default", "--setting", "split:MAGI_DIST_BWD_SPLIT=1",
        "--setting", "sym:MAGI_DIST_SYMMETRIC_PARTIALS_MB=64", "--rounds", "2",
        "--totals", "512", "--hq", "2", "--hk", "1", "--d", "16", "--chunk", "64", "--iters", "2",
        "--masks", "varlen_causal",
    ]  # fmt: skip
    ranks = run_ranks(2, ab_on_gloo, argv, timeout=180)
    text, seen, freed = ranks[0]
    # each timing: one warm-up step and --iters steps under its setting (cp 2: split off by default)
    assert seen == ([False] * 3 + [True] * 3 + [False] * 3) * 2
    # the pool freed after each timing of the setting that sizes it, on every rank
    assert freed == [9, 18] and ranks[1][1:] == (seen, freed)
    rows = text.splitlines()
    assert [r.split(" | ")[0] for r in rows[-3:]] == ["| default", "| split", "| sym"]
    default, split, _ = (r.strip("| ").split(" | ") for r in rows[-3:])
    assert default[3] == "+0.0%" and len(default[4].split()) == len(split[4].split()) == 2
