"""tools/step_ab.py on the CPU: its settings, the environment it sets and restores, the turns it
takes, its tables, and a run on 2 gloo ranks in which each setting's switch is seen by the
backward while (and only while) that setting is timed."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from magi_dist.testing import run_ranks

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _ab():
    """tools/step_ab.py, imported as the script imports its neighbours (bench_dist,
    trace_summary): by name, from the tools folder."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    return importlib.import_module("step_ab")


def test_settings_parse_and_refuse_what_is_not_read_per_call():
    ab = _ab()
    assert ab.parse_setting("default") == ab.Setting("default", {})
    st = ab.parse_setting("both:MAGI_DIST_BWD_SPLIT=1,MAGI_DIST_KEEP_KV=1")
    assert st.env == {"MAGI_DIST_BWD_SPLIT": "1", "MAGI_DIST_KEEP_KV": "1"}
    for bad in (
        "",
        ":MAGI_DIST_BWD_SPLIT=1",
        "a b",
        "x:MAGI_DIST_BWD_SPLIT",
        "x:MAGI_COMM_NATIVE_MAX_PROGRAMS=16",
    ):
        with pytest.raises(ValueError, match="--setting"):
            ab.parse_setting(bad)
    args, bargs = ab.parse_args(["--setting", "a", "--setting", "b:MAGI_DIST_FWD_SPLIT=1", "--totals", "512"])
    assert [s.name for s in args.settings] == ["a", "b"] and args.rounds == 8
    assert (bargs.step, bargs.degree, bargs.totals) == (True, 0, [512])
    assert ab.parse_args(["--setting", "a", "--degree", "2"])[1].degree == 2
    for bad_argv in (["--setting", "a", "--setting", "a"], ["--setting", "a", "--rounds", "0"], []):
        with pytest.raises(SystemExit):
            ab.parse_args(bad_argv)


def test_applied_sets_unsets_and_restores(monkeypatch):
    ab = _ab()
    split, keep = "MAGI_DIST_BWD_SPLIT", "MAGI_DIST_KEEP_KV"
    monkeypatch.setenv(split, "0")
    monkeypatch.delenv(keep, raising=False)
    a, b = ab.Setting("a", {keep: "1"}), ab.Setting("b", {split: "1"})
    with ab.applied(a, [a, b]):
        assert os.environ[keep] == "1" and split not in os.environ  # b's variable unset
    assert os.environ[split] == "0" and keep not in os.environ
    with ab.applied(b, [a, b]):
        assert os.environ[split] == "1" and keep not in os.environ
    assert os.environ[split] == "0" and keep not in os.environ


def test_turns_and_tables():
    ab = _ab()
    calls = []

    def timer(name, values):
        it = iter(values)

        def t():
            calls.append(name)
            return next(it)

        return t

    got = ab.round_robin({"a": timer("a", [3.0, 1.0, 2.0]), "b": timer("b", [4.0, 6.0, 5.0])}, 3)
    assert got == {"a": [3.0, 1.0, 2.0], "b": [4.0, 6.0, 5.0]} and calls == ["a", "b"] * 3
    table = ab.ab_table("t", {"a": [0.002, 0.004, 0.003], "b": [0.006]}, 1e12, 2)
    rows = table.splitlines()
    # a: median 3 ms, 1e12 / 3e-3 / 2 GPUs = 166.7 TFLOP/s; b: 6 ms, twice a's
    assert rows[3] == "| a | 3.000 | 166.7 | +0.0% | 2.00 4.00 3.00 |"
    assert rows[4] == "| b | 6.000 | 83.3 | +100.0% | 6.00 |"


def test_kernel_times_of_a_trace():
    ab = _ab()

    def x(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}

    trace = {
        "traceEvents": [
            x("FFAForwardSm90", 0, 40),
            x("BwdPreprocess", 40, 5),
            x("FFABackwardSm90", 45, 100),
            x("_copy_kernel", 150, 20),
            x("_reduce_kernel", 170, 10),
            {"ph": "X", "cat": "cpu_op", "name": "FFABackward host", "ts": 0, "dur": 999},
        ]
    }
    got = ab.kernel_times(trace, steps=2)
    assert got == {"bwd": 50.0, "fwd": 20.0, "reduce": 5.0, "copies": 10.0, "window": 90.0}


def ab_on_gloo(rank: int, world: int, argv: list[str]) -> tuple[str, list[bool]]:
    """step_ab's run, recording what the backward read of the split switch at each call."""
    import magi_dist.attn as attn

    ab = _ab()
    seen = []
    real = attn.bwd_split

    def spy(cp_size):
        seen.append(real(cp_size))
        return seen[-1]

    attn.bwd_split = spy
    args, bargs = ab.parse_args(argv)
    return ab.run(args, bargs), seen


def test_settings_take_turns_on_gloo():
    argv = [
        "--setting", "default", "--setting", "split:MAGI_DIST_BWD_SPLIT=1", "--rounds", "2",
        "--totals", "512", "--hq", "2", "--hk", "1", "--d", "16", "--chunk", "64", "--iters", "2",
        "--masks", "varlen_causal",
    ]  # fmt: skip
    ranks = run_ranks(2, ab_on_gloo, argv, timeout=180)
    text, seen = ranks[0]
    # each timing: one warm-up step and --iters steps under its setting (cp 2: split off by default)
    assert seen == ([False] * 3 + [True] * 3) * 2
    assert ranks[1][1] == seen
    rows = text.splitlines()
    assert rows[-2].startswith("| default | ") and rows[-1].startswith("| split | ")
    default, split = (r.strip("| ").split(" | ") for r in rows[-2:])
    assert default[3] == "+0.0%" and len(default[4].split()) == len(split[4].split()) == 2
