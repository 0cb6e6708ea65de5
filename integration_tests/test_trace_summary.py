"""tools/trace_summary.py on synthetic Chrome traces: the events it takes, the interval
arithmetic, and the report's numbers (busy, idle, idle while another stream was busy)."""

from __future__ import annotations

import json

# tools/trace_summary.py, by name (conftest.py)
import trace_summary as ts


def _x(name, cat, stream, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_interval_arithmetic():
    assert ts.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert ts.overlap([(0, 3), (5, 8)], [(2, 6)]) == 2
    assert ts.idle([(1, 2), (4, 5)], (0, 6)) == [(0, 1), (2, 4), (5, 6)]
    assert ts.idle([(0, 6)], (0, 6)) == []


def test_report_of_a_step(tmp_path, capsys):
    # compute stream 7: attention 0-50, a gap 50-70 while stream 9 copies 45-65, fill 70-75,
    # a gap 75-80 with nothing running, attention 80-100; CPU ops and other phases are ignored
    events = [
        _x("attn_fwd", "kernel", 7, 0, 50),
        _x("_copy_kernel", "kernel", 9, 45, 20),
        _x("Memset (Device)", "gpu_memset", 7, 70, 5),
        _x("attn_bwd", "kernel", 7, 80, 20),
        _x("aten::add", "cpu_op", 0, 0, 100),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3, "args": {"stream": 7}},
    ]
    evs = ts.gpu_events({"traceEvents": events})
    assert [e.name for e in evs] == ["attn_fwd", "_copy_kernel", "Memset (Device)", "attn_bwd"]
    report = ts.summarize(evs, steps=1, top=5, gaps=2)
    assert "window 100.0 us per step" in report
    assert "stream 7 (compute): busy 75.0 us" in report and "stream 9: busy 20.0 us" in report
    # idle 25 us: 15 of them (50-65) while the copy ran, 10 with no stream busy
    assert (
        "idle 25.0 us per step: 15.0 us while another stream was busy, 10.0 us with no stream busy" in report
    )
    assert (
        "gap     20.0 us at +50.0 (other streams busy 15.0 us): after attn_fwd / before Memset (Device)"
        in report
    )
    # per step over 2 steps, from a file through main, the first step kept
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ts.main([str(path), "--steps", "2", "--keep-first"])
    out = capsys.readouterr().out
    assert "window 50.0 us per step (2 steps" in out and "busy 37.5 us per step" in out
    # by default the first step's share of the events goes: a slow first step (a 100 us wait
    # before its kernel) does not count
    two = [_x("k", "kernel", 7, 100, 10), _x("k", "kernel", 7, 113, 10), _x("k", "kernel", 7, 126, 10)]
    report = ts.summarize(ts.gpu_events({"traceEvents": [_x("k", "kernel", 7, 0, 10), *two]}), steps=4)
    assert "window 12.0 us per step (3 steps, 3 GPU events)" in report and "idle 2.0 us per step" in report
    assert ts.summarize([]).startswith("no GPU events")
