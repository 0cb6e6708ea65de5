"""Reliability of magi_solver (issue 23): planner speed, config and CLI errors.

- ``make_plan`` is near-linear in the number of chunks: its per-rank geometry handles each band's
  full-rectangle core as one piece instead of one piece per (band, interval) pair. The old
  geometry is kept below, verbatim, as the reference the new one must agree with.
- Cost factors of the overlap config are finite and bounded (a ValueError naming the field).
- ``magi-plan`` reports a bad input in one line on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import (
    DispatchAlg,
    DispatchConfig,
    DistAttnConfig,
    OverlapConfig,
    make_plan,
    masks,
)
from magi_solver import plan as plan_module
from magi_solver.band import Band
from magi_solver.cli import main
from magi_solver.overlap import ChunkCost
from magi_solver.plan import _cut, _Layout, _overlapping, _own_rows, _RankGeometry
from magi_solver.testing import cu_seqlens, long_tailed_lengths, plan_config, random_mask
from magi_solver.types import merge_intervals
from magi_solver.verify import _cells, check_plan

# ----------------------------------------------------------------------------- the old geometry


class _OldRankGeometry(_RankGeometry):
    """The planner's per-rank geometry before the near-linear rewrite, verbatim where it changed
    (`build`'s host and cost cuts, the stage cut): one band piece per (band, interval) pair
    (quadratic on long causal / block-causal masks). The rest is inherited."""

    @staticmethod
    def build(
        rank: int, layout: _Layout, bands: list[Band], chunk_bands: list[list[int]], config: DistAttnConfig
    ) -> _OldRankGeometry:
        host = layout.host_ranges(rank)
        h_starts, h_ends = [h[0] for h in host], [h[1] for h in host]
        rows = _own_rows(host, layout.cs, bands, chunk_bands)
        host_bands, remote = [], []
        for b, dq in rows:
            c0, c1 = b.touched_cols()
            cursor = c0
            for i in _overlapping(h_starts, h_ends, c0, c1):
                h0, h1, hl0 = host[i]
                piece = b.clip_cols(h0, h1)
                if not piece.is_empty():
                    host_bands.append(piece.shifted(dq, hl0 - h0))
                if h0 > cursor:
                    remote.append((cursor, h0))
                cursor = max(cursor, h1)
            if cursor < c1:
                remote.append((cursor, c1))
        needed = merge_intervals(remote)
        ov = config.overlap_config
        total = sum(e - s for s, e in needed)
        target = max(ov.min_chunk_size, -(-total // ov.max_num_chunks))
        chunks = _cut(needed, target)
        # calc cost of each chunk: area of the rank's bands over the chunk's columns
        p_starts, p_ends, p_chunk = [], [], []
        for ci, pieces in enumerate(chunks):
            for s, e in pieces:
                p_starts.append(s)
                p_ends.append(e)
                p_chunk.append(ci)
        area_per_chunk = [0] * len(chunks)
        for b, _ in rows:
            c0, c1 = b.touched_cols()
            for i in _overlapping(p_starts, p_ends, c0, c1):
                area_per_chunk[p_chunk[i]] += b.clip_cols(p_starts[i], p_ends[i]).area()
        costs = [
            ChunkCost(ov.comm_cost_factor * sum(e - s for s, e in pieces), ov.calc_cost_factor * a)
            for pieces, a in zip(chunks, area_per_chunk)
        ]
        host_area = sum(b.area() for b in host_bands)
        return _OldRankGeometry(
            rank=rank,
            config=config,
            host_ranges=host,
            rows=rows,
            host_bands=host_bands,
            remote_chunks=chunks,
            chunk_costs=costs,
            host_cost=ov.calc_cost_factor * host_area,
            area=host_area + sum(area_per_chunk),
        )

    def _cut_stage_bands(self) -> None:
        flat = [(a, b, o, t) for t, runs in enumerate(self.stage_runs) for a, b, o in runs]
        starts, ends = [f[0] for f in flat], [f[1] for f in flat]
        self.stage_bands = [[] for _ in self.stage_runs]
        for b, dq in self.rows:
            c0, c1 = b.touched_cols()
            for i in _overlapping(starts, ends, c0, c1):
                a, e, o, t = flat[i]
                piece = b.clip_cols(a, e)
                if not piece.is_empty():
                    self.stage_bands[t].append(piece.shifted(dq, o - a))


# ----------------------------------------------------------------------------- planner: same plan


def _old_plan(monkeypatch, mask, cp, cfg):
    with monkeypatch.context() as m:
        m.setattr(plan_module, "_RankGeometry", _OldRankGeometry)
        return make_plan(mask, cp, cfg)


def _stage_cells(calc):
    cells = _cells(calc)
    assert len(cells) == len(set(cells)) == calc.area
    return set(cells)


def assert_same_plan(new, old):
    """Everything equal but the slices of each stage, which cover the same cells (the new planner
    merges runs of full rectangles that lie side by side in a buffer) and are never more."""
    drop = {"ranks": {"__all__": {"calc"}}}
    assert new.model_dump(exclude=drop) == old.model_dump(exclude=drop)
    for rn, ro in zip(new.ranks, old.ranks):
        assert rn.calc.kv_concat == ro.calc.kv_concat and len(rn.calc.remote) == len(ro.calc.remote)
        for sn, so in zip([rn.calc.host, *rn.calc.remote], [ro.calc.host, *ro.calc.remote]):
            assert (sn.total_seqlen_k, sn.area) == (so.total_seqlen_k, so.area)
            assert len(sn) <= len(so)
            assert _stage_cells(sn) == _stage_cells(so)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    seqlen=st.integers(1, 160),
    cp=st.integers(1, 6),
    chunk=st.integers(1, 17),
    degree=st.sampled_from([0, 1, 2, 3, None]),
    alg=st.sampled_from(list(DispatchAlg)),
    min_chunk=st.integers(1, 17),
    max_chunks=st.integers(1, 9),
    overlap_alg=st.sampled_from(["uniform", "balanced"]),
)
def test_new_geometry_plans_like_the_old_one_on_random_masks(
    seed, seqlen, cp, chunk, degree, alg, min_chunk, max_chunks, overlap_alg
):
    mask = random_mask(random.Random(seed), seqlen, max_slices=10)
    cfg = plan_config(chunk, degree, alg, min_chunk, max_chunks, overlap_alg)
    with pytest.MonkeyPatch.context() as mp:
        assert_same_plan(make_plan(mask, cp, cfg), _old_plan(mp, mask, cp, cfg))


BUILDER_MASKS = {
    "causal": masks.causal(512),
    "varlen-causal": masks.varlen([0, 37, 40, 201, 300, 512], causal=True),
    "varlen-full": masks.varlen([0, 200, 512]),
    "window": masks.sliding_window(512, (40, 9)),
    "window-causal-global": masks.varlen(
        [0, 300, 512], causal=True, window_size=(50, 0), global_window_size=7
    ),
    "block-causal": masks.block_causal([0, 200, 512], 24),
    "segments": masks.from_segment_ids([1] * 90 + [2] * 140 + [1] * 80 + [3] * 202, causal=True),
    "prefix-lm": masks.prefix_lm([0, 260, 512], [40, 100]),
}


@pytest.mark.parametrize("name", list(BUILDER_MASKS))
@pytest.mark.parametrize(
    ("cp", "degree", "alg"), [(4, 2, "min_heap"), (3, 0, "zigzag"), (8, None, "lpt_swap")]
)
def test_new_geometry_plans_like_the_old_one_on_builder_masks(monkeypatch, name, cp, degree, alg):
    mask = BUILDER_MASKS[name]
    cfg = plan_config(8, degree, alg, min_chunk=16, max_chunks=6)
    new = make_plan(mask, cp, cfg)
    check_plan(new)
    assert_same_plan(new, _old_plan(monkeypatch, mask, cp, cfg))


def _num_slices(plan):
    return sum(len(r.calc.host) + sum(len(s) for s in r.calc.remote) for r in plan.ranks)


@pytest.mark.parametrize(
    "build",
    [
        lambda t: masks.causal(t),
        lambda t: masks.block_causal([0, t], 256),
        lambda t: masks.sliding_window(t, (4096, 0), causal=True),
    ],
    ids=["causal", "block-causal", "window"],
)
def test_plan_slices_grow_linearly_with_chunks(build):
    """A row chunk reading every earlier chunk is one rectangle per buffer, not one per chunk: the
    old planner gave 427,905 slices for causal at 2,048 chunks (cp 8), quadratic in chunks."""
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=64))
    plan = make_plan(build(1024 * 64), 8, cfg)
    assert plan.num_chunks == 1024
    assert _num_slices(plan) <= 5 * plan.num_chunks


def test_planner_time_at_4096_block_causal_chunks():
    """4,096 chunks took 15-16 s (quadratic); about 0.6 s now on a 2-core CPU. The bound is generous."""
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=64))
    mask = masks.block_causal([0, 262144], 256)
    t0 = time.perf_counter()
    plan = make_plan(mask, 8, cfg)
    elapsed = time.perf_counter() - t0
    assert plan.num_chunks == 4096 and sum(plan.stats.area_per_rank) == mask.area()
    assert elapsed < 5.0, f"make_plan took {elapsed:.1f} s for 4,096 block-causal chunks"


def test_planner_time_at_4096_window_and_varlen_chunks():
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=64))
    for mask in (
        masks.sliding_window(262144, (4096, 0), causal=True),
        masks.varlen(cu_seqlens(long_tailed_lengths(262144, 421)), causal=True),
    ):
        t0 = time.perf_counter()
        make_plan(mask, 8, cfg)
        elapsed = time.perf_counter() - t0
        assert elapsed < 5.0, f"make_plan took {elapsed:.1f} s for 4,096 chunks"


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["calc_cost_factor", "comm_cost_factor"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e308, 1e31, -1.0])
def test_cost_factor_out_of_range_is_a_value_error_at_construction(name, value):
    with pytest.raises(ValueError, match=rf"{name}: must be a finite number .* got {re.escape(repr(value))}"):
        OverlapConfig(**{name: value})
    with pytest.raises(ValueError, match=rf"{name}: must be a finite number .* got {re.escape(repr(value))}"):
        DistAttnConfig(overlap_config={"mode": "dynamic", "degree": None, name: value})


@pytest.mark.parametrize("name", ["calc_cost_factor", "comm_cost_factor"])
def test_cost_factor_bool_is_refused(name):
    with pytest.raises(ValueError, match=rf"{name}: must be a real number, got bool True"):
        OverlapConfig(**{name: True})


def test_calc_cost_factor_zero_is_refused_comm_zero_is_fine():
    with pytest.raises(ValueError, match=r"calc_cost_factor: must be a finite number > 0 .* got 0.0"):
        OverlapConfig(calc_cost_factor=0.0)
    assert OverlapConfig(comm_cost_factor=0).comm_cost_factor == 0.0


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_largest_cost_factors_plan(mode):
    overlap = OverlapConfig(
        mode=mode, degree=None if mode == "dynamic" else 2, calc_cost_factor=1e30, comm_cost_factor=1e30
    )
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=64), overlap_config=overlap)
    plan = make_plan(masks.causal(8192), 4, cfg)
    assert all(r.estimated_cost < float("inf") for r in plan.ranks)


# ----------------------------------------------------------------------------- the magi-plan CLI


CLI_ERRORS = [
    (["--mask", "varlen", "--mask-args", "{bad json", "--cp", "2"], r"--mask-args: invalid JSON"),
    (
        ["--mask", "varlen", "--mask-args", '{"cu_seqlens_q": [0, 64, 32]}', "--cp", "2"],
        r"cu_seqlens_q: must be non-decreasing, but cu_seqlens_q\[2\]=32 < 64",
    ),
    (
        ["--mask", "varlen", "--mask-args", "3", "--cp", "2"],
        r"--mask-args: expected a JSON object .* got int",
    ),
    (["--mask", "causal", "--mask-args", '{"nope": 1}', "--cp", "2"], r"TypeError: .*nope"),
    (["--mask", "causal", "--mask-args", "[256]", "--cp", "0"], r"--cp: must be >= 1, got 0"),
    (["--mask", "causal", "--mask-args", "[256]", "--cp", "-3"], r"--cp: must be >= 1, got -3"),
    (
        ["--mask", "causal", "--mask-args", "[256]", "--cp", "2", "--chunk-size", "0"],
        r"chunk_size: Input should be greater than 0, got 0",
    ),
    (
        ["--mask", "causal", "--mask-args", "[256]", "--cp", "2", "--degree", "two"],
        r"--degree: expected an int >= 0 or 'dynamic', got 'two'",
    ),
    (
        ["--mask", "causal", "--mask-args", "[256]", "--cp", "2", "--degree", "-1"],
        r"degree: Input should be greater than or equal to 0, got -1",
    ),
    (["--mask", "causal", "--mask-args", "[0]", "--cp", "2"], r"mask: total_seqlen_q is 0"),
    (["--mask", "spiral", "--cp", "2"], r"--mask: unknown builder 'spiral'"),
    (["--slices", "/nonexistent/mask.json", "--cp", "2"], r"--slices: cannot read '/nonexistent/mask.json'"),
]


@pytest.mark.parametrize(("argv", "pattern"), CLI_ERRORS, ids=[f"case{i}" for i in range(len(CLI_ERRORS))])
def test_cli_bad_input_is_one_line_and_status_2(capsys, argv, pattern):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("magi-plan: error: ")
    assert "Traceback" not in err and captured.out == ""
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"q_ranges": [[0, 4]], "k_ranges": [[0, 9]], '
        '"mask_types": [0], "total_seqlen_q": 4, "total_seqlen_k": 4}',
    ],
)
def test_cli_bad_slices_file_is_one_line(tmp_path, capsys, content):
    f = tmp_path / "mask.json"
    f.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--slices", str(f), "--cp", "2"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("magi-plan: error: "), err


def test_cli_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="cu_seqlens_q: must be non-decreasing"):
        main(["--mask", "varlen", "--mask-args", '{"cu_seqlens_q": [0, 64, 32]}', "--cp", "2", "--debug"])


def test_cli_console_script_exit_status_and_stderr():
    argv = ["--mask", "varlen", "--mask-args", '{"cu_seqlens_q": [0, 64, 32]}', "--cp", "2"]
    cmd = [sys.executable, "-m", "magi_solver.cli"]
    res = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == (
        "magi-plan: error: cu_seqlens_q: must be non-decreasing, but cu_seqlens_q[2]=32 < 64\n"
    )
    res = subprocess.run([*cmd, *argv, "--debug"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr
    assert "ValueError: cu_seqlens_q: must be non-decreasing" in res.stderr


def test_cli_good_input_still_works(capsys):
    assert (
        main(["--mask", "causal", "--mask-args", json.dumps([1024]), "--cp", "4", "--chunk-size", "64"]) == 0
    )
    assert "imbalance" in capsys.readouterr().out
