"""CPU-only tests of the sm90 CuTe DSL forward: the host plan (exactly), and compilation of
every kernel variant for sm_90a with no GPU (skipped when nvidia-cutlass-dsl is missing)."""

from __future__ import annotations

import itertools
import os
import random
import time

import pytest
import torch

from ffa_kernels import testing
from ffa_kernels.cute.config import default_config
from ffa_kernels.cute.tile_plan import build_plan_cpu, plan_cost


def dense_mask(q_ranges, k_ranges, types, tq, tk):
    """How often each cell is covered, int32 (the plan simulation's dtype)."""
    return testing.dense_mask(q_ranges, k_ranges, types, tq, tk, counts=True).to(torch.int32)


def simulate_plan(work, entries, tq, tk, tile_m, tile_n, every_tile=True, every_row=False):
    """Replay the kernel's block loop and band masks; returns how often each cell is counted
    (rows from a work tile's m_end on are computed but not owned: not counted; ``every_row``
    counts them too, as the backward's dQ does: every computed key of a key tile below tq adds
    to dQ, its own or not).

    every_tile: the forward plan has a work tile for every row tile, and those tiles partition
    the rows; in its unmasked blocks the rows it stores must be covered. Otherwise (the
    backward's plan: empty key tiles dropped, only tiles with blocks launched) an unmasked block
    must be covered on all its rows below tq, since rows past a tile's end are other keys whose
    scores would reach dQ; its tiles own disjoint rows (grid or per-document key tiles)."""
    cov = torch.zeros(tq, tk, dtype=torch.int32)
    tiles = []
    for m0, e0, e1, nb, m_end in work.tolist():
        assert m0 < m_end <= min(m0 + tile_m, tq), (m0, m_end)
        tiles.append((m0, m_end))
        total = 0
        for e in range(e0, e1):
            k_lo, nblk, ks, ke, lo, hi, qs, qe, jf_lo, jf_hi = entries[e].tolist()[:10]
            assert 0 <= jf_lo <= jf_hi <= nblk
            total += nblk
            for j in range(nblk):
                kb = k_lo + j * tile_n
                rows = torch.arange(m0, m0 + tile_m).unsqueeze(1)
                cols = torch.arange(kb, kb + tile_n).unsqueeze(0)
                d = cols - rows
                keep = (cols >= ks) & (cols < ke) & (rows >= qs) & (rows < qe) & (d >= lo) & (d <= hi)
                keep &= ((rows < tq) if every_row else (rows < m_end)) & (cols < tk) & (cols >= 0)
                if jf_lo <= j < jf_hi:  # planned as unmasked: every stored cell must be covered
                    assert bool(keep[: m_end - m0].all()), (m0, e, j)
                    if not every_tile:  # and in the backward every computed one (rows below tq)
                        band = (cols >= ks) & (cols < ke) & (rows >= qs) & (rows < qe) & (d >= lo) & (d <= hi)
                        assert bool(band[: min(tile_m, tq - m0)].all()), (m0, e, j)
                r, c = torch.nonzero(keep, as_tuple=True)
                cov[rows[r, 0], cols[0, c]] += 1
        assert total == nb
    if every_tile:
        tiles.sort()
        assert tiles[0][0] == 0 and tiles[-1][1] == tq, "the work tiles cover every row"
        assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:])), "the work tiles partition the rows"
    else:
        assert bool((work[:, 3] > 0).all()), "a work tile with no block is not launched"
        tiles.sort()
        assert all(a[1] <= b[0] for a, b in zip(tiles, tiles[1:])), "work tiles own disjoint rows"
    return cov


def random_slices(rng, tq, tk, n):
    return testing.grid_slices(rng, tq, tk, n, density=0.35)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("tile_m", [64, 80, 128])  # q block heights of the backward configs
def test_deterministic_bwd_plan_is_aligned_and_ranked(seed, tile_m):
    """The deterministic backward plan: still every cell once, q blocks on the tile grid, and
    the visit ranks equal a brute-force count of earlier visits (in CTA order) to each block."""
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu, visit_ranks

    tile_n = 128  # key tile
    rng = random.Random(500 + seed)
    tq, tk = rng.randrange(1, 900), rng.randrange(1, 900)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 7))
    ranges = (torch.tensor(qr, dtype=torch.int32), torch.tensor(kr, dtype=torch.int32), torch.tensor(ty))
    work, ent, _ = build_bwd_plan_cpu(*ranges, tk, tile_n, tile_m, aligned=True)
    cov = simulate_plan(work, ent, tk, tq, tile_n, tile_m, every_tile=False).T
    assert torch.equal(cov, dense_mask(qr, kr, ty, tq, tk))
    assert bool((ent[: int(work[:, 2].max()) if work.shape[0] else 0, 0] % tile_m == 0).all())
    ranks = visit_ranks(work, ent, tile_m).tolist()
    n_work = work.shape[0]
    seen: dict[int, int] = {}
    v = 0
    for w, (_, e0, e1, *_) in enumerate(work.tolist()):
        assert ranks[w] == n_work + v
        for e in range(e0, e1):
            q_lo, nblk = ent[e, 0].item(), ent[e, 1].item()
            for j in range(nblk):
                block = q_lo // tile_m + j
                assert ranks[n_work + v] == seen.get(block, 0), (w, e, j)
                seen[block] = seen.get(block, 0) + 1
                v += 1
    assert v == len(ranks) - n_work


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mask", ["varlen_causal", "sliding_window"])
@pytest.mark.parametrize("tile_m", [64, 80, 128])
def test_deterministic_order_never_waits_in_lockstep(seed, mask, tile_m):
    """On causal documents and sliding windows, the deterministic plan's order lets every CTA
    add to a q block after all earlier CTAs (its rank) did, if all walk in lockstep: along the
    CTA order, the steps at which the visits to one q block happen strictly increase. Slice
    boundaries lie on both tile grids (multiples of lcm(tile_n, tile_m)): a q block that two
    documents share can make the second document's first key tile wait for the first's last."""
    import math

    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu

    tile_n = 128
    unit = math.lcm(tile_n, tile_m)
    units = 40 if unit == tile_n else 12
    rng = random.Random(700 + seed)
    if mask == "varlen_causal":
        cuts = sorted(rng.sample(range(1, units), rng.randrange(1, 6)))
        bounds = [0, *(c * unit for c in cuts), units * unit]
        qr = [[a, b] for a, b in zip(bounds[:-1], bounds[1:])]
        kr = qr
    else:
        n, w = units * unit, rng.randrange(1, 6) * tile_n
        # slice per row band: q rows [i, i+unit) see keys [i - w, i + unit), causal
        qr = [[i, i + unit] for i in range(0, n, unit)]
        kr = [[max(0, a - w), b] for a, b in qr]
    ty = [1] * len(qr)
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    total = qr[-1][1]
    work, ent, _ = build_bwd_plan_cpu(t(qr), t(kr), t(ty), total, tile_n, tile_m, aligned=True)
    last_step: dict[int, int] = {}
    for _, e0, e1, *_ in work.tolist():
        step = 0
        for e in range(e0, e1):
            q_lo, nblk = ent[e, 0].item(), ent[e, 1].item()
            for j in range(nblk):
                block = q_lo // tile_m + j
                assert last_step.get(block, -1) < step, (block, step)
                last_step[block] = step
                step += 1


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tiles", [(128, 128), (64, 32), (128, 64), (128, 80)])
@pytest.mark.parametrize("backward", [False, True])
def test_plan_covers_mask_exactly(seed, tiles, backward):
    """The forward plan (row tiles = q tiles) and the backward's (the forward's construction on
    the transposed mask: row tiles = key tiles, blocks of q rows) cover every cell once."""
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu

    tile_m, tile_n = tiles
    rng = random.Random(seed + 100 * backward)
    tq, tk = rng.randrange(1, 700), rng.randrange(1, 700)
    qr, kr, ty = random_slices(rng, tq, tk, rng.randrange(1, 6))
    ranges = (torch.tensor(qr, dtype=torch.int32), torch.tensor(kr, dtype=torch.int32), torch.tensor(ty))
    if backward:
        work, ent, _ = build_bwd_plan_cpu(*ranges, tk, tile_m, tile_n)
        cov = simulate_plan(work, ent, tk, tq, tile_m, tile_n, every_tile=False).T
    else:
        work, ent, _ = build_plan_cpu(*ranges, tq, tile_m, tile_n)
        cov = simulate_plan(work, ent, tq, tk, tile_m, tile_n)
    assert torch.equal(cov, dense_mask(qr, kr, ty, tq, tk))
    # longest first
    assert torch.all(work[:-1, 3] >= work[1:, 3])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles", [(128, 80), (128, 64)])
def test_bwd_segment_key_tiles(seed, causal, tiles):
    """The backward's plan with per-document key tiles: key tiles start at every document's
    first key and stop at its last (work column 4), cover the mask exactly, and run a block
    unmasked only where every computed key of the tile (past a tile's end: the next document's)
    is covered; the default takes them where they plan fewer blocks."""
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu, plan_cost

    tile_n, tile_m = tiles
    rng = random.Random(700 + seed)
    tk = rng.randrange(200, 3000)
    cuts = sorted(rng.sample(range(1, tk), rng.randrange(1, 12)))
    bounds = [0, *cuts, tk]
    docs = [[a, b] for a, b in zip(bounds[:-1], bounds[1:]) if rng.random() < 0.8] or [[0, tk]]
    ty = [1 if causal else 0] * len(docs)
    ranges = (torch.tensor(docs), torch.tensor(docs), torch.tensor(ty))
    seg = build_bwd_plan_cpu(*ranges, tk, tile_n, tile_m, segment_rows=True)
    work, ent, _ = seg
    cov = simulate_plan(work, ent, tk, tk, tile_n, tile_m, every_tile=False).T
    assert torch.equal(cov, dense_mask(docs, docs, ty, tk, tk))
    dq = simulate_plan(work, ent, tk, tk, tile_n, tile_m, every_tile=False, every_row=True).T
    assert torch.equal(dq, dense_mask(docs, docs, ty, tk, tk)), "dQ gets every cell once"
    starts = set(work[:, 0].tolist())
    assert all(a in starts for a, _ in docs), "a key tile starts at every document's first key"
    grid = build_bwd_plan_cpu(*ranges, tk, tile_n, tile_m, segment_rows=False)
    chosen = build_bwd_plan_cpu(*ranges, tk, tile_n, tile_m)
    best = seg if plan_cost(seg) < plan_cost(grid) else grid
    assert torch.equal(chosen[0], best[0]) and torch.equal(chosen[1], best[1])


@pytest.mark.parametrize("segment_rows", [True, None])
def test_bwd_key_tiles_on_shared_keys_stay_on_the_grid(segment_rows):
    """Slices that share keys: per-document key tiles, even forced, would let a tile's keys
    past its end (still inside its slice) add to dQ there and again in the next tile; the plan
    keeps the grid (dK/dV and dQ each count every cell once)."""
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu

    qr, kr, ty = [[0, 300], [300, 600]], [[0, 200], [100, 300]], [0, 0]
    tq, tk, tile_n, tile_m = 600, 300, 128, 64
    ranges = (torch.tensor(qr), torch.tensor(kr), torch.tensor(ty))
    work, ent, _ = build_bwd_plan_cpu(*ranges, tk, tile_n, tile_m, segment_rows=segment_rows)
    assert all(m0 % tile_n == 0 for m0 in work[:, 0].tolist()), "grid key tiles"
    want = dense_mask(qr, kr, ty, tq, tk)
    assert torch.equal(simulate_plan(work, ent, tk, tq, tile_n, tile_m, every_tile=False).T, want)
    dq = simulate_plan(work, ent, tk, tq, tile_n, tile_m, every_tile=False, every_row=True).T
    assert torch.equal(dq, want)


def test_plan_shared_q_rows_and_types():
    # several slices sharing q rows, all four types, sq > sk and sq < sk
    qr = [[0, 300], [0, 300], [300, 310], [310, 600], [310, 600]]
    kr = [[0, 100], [100, 500], [0, 700], [0, 50], [60, 61]]
    ty = [1, 2, 3, 1, 0]
    tq, tk = 640, 700
    work, ent, _ = build_plan_cpu(torch.tensor(qr), torch.tensor(kr), torch.tensor(ty), tq, 128, 128)
    assert torch.equal(simulate_plan(work, ent, tq, tk, 128, 128), dense_mask(qr, kr, ty, tq, tk))


def test_plan_full_blocks_are_found():
    # causal 1024 in 128-tiles: all blocks but the 8 diagonal ones are unmasked
    _, ent, _ = build_plan_cpu(
        torch.tensor([[0, 1024]]), torch.tensor([[0, 1024]]), torch.tensor([1]), 1024, 128, 128
    )
    n_full = int((ent[:, 9] - ent[:, 8]).sum())
    assert n_full == 36 - 8
    # full 1000 x 1000: the last k block is partial; the last q tile has 104 rows: its rows past
    # row 1000 are never stored, so on the fixed grid as in a segment tile they need no mask
    full = (torch.tensor([[0, 1000]]), torch.tensor([[0, 1000]]), torch.tensor([0]), 1000, 128, 128)
    for segment_rows in (False, True):
        _, ent, _ = build_plan_cpu(*full, segment_rows=segment_rows)
        assert int((ent[:, 9] - ent[:, 8]).sum()) == 8 * 7
    # a slice that stops before the last tile's stored rows do: those rows still need the mask
    part = (torch.tensor([[0, 990]]), torch.tensor([[0, 1000]]), torch.tensor([0]), 1000, 128, 128)
    _, ent, _ = build_plan_cpu(*part, segment_rows=False)
    assert int((ent[:, 9] - ent[:, 8]).sum()) == 7 * 7


def test_plan_empty_blocks_never_planned():
    # causal 1024: block count is the lower triangle only (in 128x128 tiles: 8*9/2 = 36)
    _, _, total = build_plan_cpu(
        torch.tensor([[0, 1024]]), torch.tensor([[0, 1024]]), torch.tensor([1]), 1024, 128, 128
    )
    assert total == 36


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("causal", [False, True])
def test_segment_tiles_start_at_documents(seed, causal):
    """Documents (slices sharing no q rows, gaps between them): with per-document tiles the
    plan's q tiles start at every document's first row and stop at its last and cover the mask
    exactly; the default takes the cheaper of the two tilings (`plan_cost`); the grid is kept
    where slices share rows."""
    rng = random.Random(900 + seed)
    tq = rng.randrange(200, 3000)
    cuts = sorted(rng.sample(range(1, tq), rng.randrange(1, 12)))
    bounds = [0, *cuts, tq]
    docs = [[a, b] for a, b in zip(bounds[:-1], bounds[1:]) if rng.random() < 0.8]  # gaps: uncovered
    if not docs:
        docs = [[0, tq]]
    ty = [1 if causal else 0] * len(docs)
    ranges = (torch.tensor(docs), torch.tensor(docs), torch.tensor(ty))
    seg = build_plan_cpu(*ranges, tq, 128, 128, segment_rows=True)
    work, ent, _ = seg
    cov = simulate_plan(work, ent, tq, tq, 128, 128)
    assert torch.equal(cov, dense_mask(docs, docs, ty, tq, tq))
    starts = set(work[:, 0].tolist())
    assert all(a in starts for a, _ in docs), "a tile starts at every document's first row"
    grid = build_plan_cpu(*ranges, tq, 128, 128, segment_rows=False)
    chosen = build_plan_cpu(*ranges, tq, 128, 128)
    assert any(all(torch.equal(a, b) for a, b in zip(chosen[:2], p[:2])) for p in (seg, grid))
    assert plan_cost(chosen) == min(plan_cost(seg), plan_cost(grid))
    cov = simulate_plan(chosen[0], chosen[1], tq, tq, 128, 128)
    assert torch.equal(cov, dense_mask(docs, docs, ty, tq, tq))
    # a case where per-document tiles plan fewer blocks (8 against 10): they are taken
    d2 = [[0, 100], [100, 300]]
    r2 = (torch.tensor(d2), torch.tensor(d2), torch.tensor([0, 0]))
    assert sorted(build_plan_cpu(*r2, 300, 128, 128)[0][:, 0].tolist()) == [0, 100, 228]
    # a case where per-document tiles plan more blocks (128 x 80, the head_dim 256 tile): the
    # grid is kept
    d4 = [[0, 178], [178, 740], [740, 1225], [1225, 2171]]
    r4 = (torch.tensor(d4), torch.tensor(d4), torch.tensor([1] * 4))
    seg4 = build_plan_cpu(*r4, 2171, 128, 80, segment_rows=True)
    grid4 = build_plan_cpu(*r4, 2171, 128, 80, segment_rows=False)
    assert seg4[2] > grid4[2] and build_plan_cpu(*r4, 2171, 128, 80)[2] == grid4[2]
    # slices sharing rows: the fixed grid, although per-document tiles would plan fewer blocks
    # (8 against 10) here, so only the shared rows keep it
    shared = (torch.tensor([[0, 100], [100, 300], [0, 100]]), torch.tensor([[0, 100], [100, 300], [0, 1]]))
    work, _, _ = build_plan_cpu(*shared, torch.tensor([1, 1, 0]), 300, 128, 128)
    assert sorted(work[:, 0].tolist()) == [0, 128, 256]


os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported: compile with no GPU


VARIANTS = [
    *itertools.product((64, 128), (torch.bfloat16, torch.float16), (False, True), (False, True)),
    # head dim 256: every epilogue and softcap in bf16; fp16 changes only the element type
    *itertools.product((256,), (torch.bfloat16,), (False, True), (False, True)),
    (256, torch.float16, False, False),
]  # (head_dim, dtype, softcap, accumulate)


def assert_packed_launch_equals_dsl(fn, torch_dtype, accumulate: bool) -> None:
    """The packed launcher hands the compiled host function exactly the C values the DSL's own
    marshalling would, for random argument values (nothing is launched: a spy takes the call)."""
    from ffa_kernels.cute import compile_cache, kernel_args

    spec = kernel_args.arg_spec(accumulate)
    elem = compile_cache.dtype_of(torch_dtype)
    assert kernel_args.packed_matches_dsl(fn, spec, elem)
    rng = random.Random(len(spec))
    vals = [
        rng.randrange(1, 2**43) * 16 if kind in ("ptr", "stream")
        else rng.randrange(-(2**31), 2**31) if kind == "i32"
        else rng.uniform(-10.0, 10.0)
        for kind, _, _ in spec
    ]  # fmt: skip
    seen = []

    class Spy:
        execution_args = fn.execution_args

        def run_compiled_program(self, addrs):
            seen.append(kernel_args.read_c_values(spec, addrs))

    kernel_args.PackedLauncher(Spy(), spec)(vals)
    dsl_objects = tuple(kernel_args.dsl_args(spec, vals, elem))
    exe_args, _adapted = fn.execution_args.generate_execution_args(dsl_objects, {})
    assert seen == [kernel_args.read_c_values(spec, exe_args)]


PACKED_VARIANTS = [  # (head_dim, head_dim_v, dtype, softcap, G): GQA packed tiles (tile_m % G == 0)
    (128, 128, torch.bfloat16, False, 8),
    (128, 128, torch.float16, True, 2),
    (64, 64, torch.bfloat16, True, 8),
    (256, 256, torch.bfloat16, False, 4),
    (192, 128, torch.bfloat16, False, 8),
    (64, 64, torch.bfloat16, False, 6),  # G not a power of two (tile_m 192)
]


@pytest.mark.parametrize("d,dv,dt,softcap,g", PACKED_VARIANTS)
def test_compile_packed_gqa_variants(d, dv, dt, softcap, g, tmp_path, monkeypatch):
    """The forward with GQA packed tiles (q and O through a (D, G, tile_m / G) TMA box over
    ((G, Tq), D, Hk)) compiles for sm_90a with no GPU, under its own compile key."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from ffa_kernels.cute import compile_cache, interface

    cfg = default_config(d, dv)
    key = interface.compile_key(dt, cfg, softcap, False, g)
    assert key != interface.compile_key(dt, cfg, softcap, False) and ("pack", g) in key.flags
    compile_cache.forget(key)
    fn = interface.get_kernel(dt, cfg, softcap, pack=g, use_disk_cache=False)
    assert_packed_launch_equals_dsl(fn, dt, False)


def test_choose_pack_by_plan_cost(monkeypatch):
    """Packed tiles where they cost fewer blocks over all heads: many short documents (20 of
    90 rows, causal, 64:8: 128-row tiles waste most rows, 16-token tiles few), not one full
    document of a multiple of 128 tokens (the same cost: a tie stays unpacked); chosen by
    default, forced and refused by PACK_GQA / $FFA_PACK_GQA."""
    from ffa_kernels.cute import interface
    from ffa_kernels.cute.tile_plan import get_plan

    def plans(q_ranges, types, total):
        qr = torch.tensor(q_ranges, dtype=torch.int32)
        tm = torch.tensor(types, dtype=torch.int32)
        cpu = torch.device("cpu")
        return get_plan(qr, qr, tm, total, 128, 128, cpu), get_plan(qr, qr, tm, total, 16, 128, cpu)

    monkeypatch.setattr(interface, "PACK_GQA", None)  # the default: by plan cost
    monkeypatch.delenv(interface.ENV_PACK_GQA, raising=False)
    short = plans([[i * 100, i * 100 + 90] for i in range(20)], [1] * 20, 2000)
    long = plans([[0, 4096]], [0], 4096)  # the same blocks packed or not: a tie keeps it plain
    assert short[1].total_blocks < short[0].total_blocks * 8 / 2  # the packed plan's saving
    assert interface.pack_gqa_setting() is None
    assert interface.choose_pack(8, *short) == 8
    assert interface.choose_pack(8, *long) == 1
    assert interface.choose_pack(8, *long, forced=True) == 8
    monkeypatch.setenv(interface.ENV_PACK_GQA, "1")
    assert interface.pack_gqa_setting() is True
    monkeypatch.setenv(interface.ENV_PACK_GQA, "0")
    assert interface.pack_gqa_setting() is False
    monkeypatch.setattr(interface, "PACK_GQA", True)  # the module setting wins over the env
    assert interface.pack_gqa_setting() is True
    monkeypatch.setattr(interface, "PACK_GQA", False)
    assert interface.pack_gqa_setting() is False


def test_plan_and_pack_only_where_g_divides_the_tile(monkeypatch):
    """The forward call's choice (`interface.plan_and_pack`, the host side, on the CPU): many
    short documents pack G = 8 (the plan of 16-token tiles) and G = 3 at D 64 (192-row tiles),
    not G = 3 at D 128 (128 rows are no whole number of 3-head tokens) nor MHA, nor when refused;
    one full document packs only when forced."""
    from ffa_kernels.cute import interface
    from ffa_kernels.cute.config import default_config

    monkeypatch.setattr(interface, "PACK_GQA", None)
    monkeypatch.delenv(interface.ENV_PACK_GQA, raising=False)
    docs = torch.tensor([[i * 100, i * 100 + 90] for i in range(20)], dtype=torch.int32)
    types = torch.ones(20, dtype=torch.int32)
    cpu = torch.device("cpu")

    def choice(d, hq, hk):
        return interface.plan_and_pack(docs, docs, types, 2000, default_config(d), hq, hk, cpu)

    pack, plan = choice(128, 64, 8)
    assert pack == 8 and int(plan.work[:, 4].max()) <= 2000 and plan.num_work >= 20 * 90 // 16
    assert choice(64, 12, 4)[0] == 3  # 192 / 3 = 64 tokens per tile
    pack, plain = choice(128, 12, 4)
    assert pack == 1 and plain is choice(128, 4, 4)[1]  # the plain plan (cached), as for MHA
    one = torch.tensor([[0, 4096]], dtype=torch.int32)  # one full document: a tie stays plain
    full = torch.zeros(1, dtype=torch.int32)
    assert interface.plan_and_pack(one, one, full, 4096, default_config(128), 64, 8, cpu)[0] == 1
    monkeypatch.setenv(interface.ENV_PACK_GQA, "1")  # forced
    assert interface.plan_and_pack(one, one, full, 4096, default_config(128), 64, 8, cpu)[0] == 8
    monkeypatch.setattr(interface, "PACK_GQA", False)  # refused (over the env)
    assert choice(128, 64, 8)[0] == 1


def test_compile_every_variant(tmp_path, monkeypatch):
    """Every compiled variant (normal and accumulate epilogue), for sm_90a, on a machine with no
    GPU; also exercises the disk cache."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from ffa_kernels.cute import compile_cache, interface

    times = {}
    for d, dt, softcap, acc in VARIANTS:
        cfg = default_config(d)
        compile_cache.forget(interface.compile_key(dt, cfg, softcap, acc))
        t0 = time.perf_counter()
        fn = interface.get_kernel(dt, cfg, softcap, accumulate=acc, use_disk_cache=True)
        times[(d, str(dt), softcap, acc)] = time.perf_counter() - t0
        assert_packed_launch_equals_dsl(fn, dt, acc)
        # return_max_logits and sink are runtime flags: no extra variants
    print("compile times (s):", {k: round(v, 2) for k, v in times.items()})
    # the disk cache now holds every variant: a fresh process-level cache loads them back
    objs = list(tmp_path.rglob("*.o"))
    assert len(objs) == len(times)
    compile_cache.forget()
    import cutlass.cute

    def no_compile(*args, **kwargs):
        raise AssertionError("recompiled although the disk cache holds the kernel")

    monkeypatch.setattr(cutlass.cute, "compile", no_compile)
    t0 = time.perf_counter()
    for d, dt, softcap, acc in VARIANTS:
        fn = interface.get_kernel(dt, default_config(d), softcap, accumulate=acc, use_disk_cache=True)
        assert_packed_launch_equals_dsl(fn, dt, acc)
    print(f"{len(VARIANTS)} variants loaded from the disk cache in {time.perf_counter() - t0:.2f} s")


# MLA (q/k head dim 192, v head dim 128): every epilogue and softcap in bf16, fp16 plain
MLA_VARIANTS = [
    *itertools.product((torch.bfloat16,), (False, True), (False, True)),
    (torch.float16, False, False),
]  # (dtype, softcap, accumulate)


def test_compile_mla_variants(tmp_path, monkeypatch):
    """The 192/128 forward compiles for sm_90a with no GPU in every epilogue, with the packed
    launcher (its V / O row strides are their own arguments), and loads back from the disk cache."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from ffa_kernels.cute import compile_cache, interface

    cfg = default_config(192, 128)
    for dt, softcap, acc in MLA_VARIANTS:
        compile_cache.forget(interface.compile_key(dt, cfg, softcap, acc))
        fn = interface.get_kernel(dt, cfg, softcap, accumulate=acc, use_disk_cache=True)
        assert_packed_launch_equals_dsl(fn, dt, acc)
    assert len(list(tmp_path.rglob("*.o"))) == len(MLA_VARIANTS)
    compile_cache.forget()
    import cutlass.cute

    def no_compile(*args, **kwargs):
        raise AssertionError("recompiled although the disk cache holds the kernel")

    monkeypatch.setattr(cutlass.cute, "compile", no_compile)
    for dt, softcap, acc in MLA_VARIANTS:
        interface.get_kernel(dt, cfg, softcap, accumulate=acc, use_disk_cache=True)
    compile_cache.forget()


def test_mla_config_and_keys_of_existing_configs():
    """default_config(192, 128): 128x128 tiles in the shared memory budget; head_dim_v defaults to
    head_dim and leaves the configs of the other head dims, and their keys, as they were; pairs
    the kernel does not serve are refused."""
    from ffa_kernels.cute.config import SM90_SMEM_BYTES, FwdConfig

    cfg = default_config(192, 128)
    assert (cfg.head_dim, cfg.head_dim_v, cfg.tile_m, cfg.tile_n, cfg.num_mma_wg) == (192, 128, 128, 128, 2)
    # Q 48 KiB + 2 x (K 48 KiB + V 32 KiB), each buffer 1024-aligned after the barriers
    assert cfg.smem_bytes() == 1024 + (48 + 2 * (48 + 32)) * 1024 <= SM90_SMEM_BYTES
    assert cfg.key()[-1] == 128 and len(cfg.key()) == len(default_config(128).key()) + 1
    assert default_config(128).key() == (128, 128, 128, 2, 2, 240, 24, True, True, 8.0)
    assert default_config(64).key() == (64, 192, 128, 2, 3, 160, 32, True, True, 8.0)
    assert default_config(256).key() == (256, 128, 80, 2, 2, 240, 24, True, True, 8.0)
    for d in (64, 128, 256):
        assert default_config(d).head_dim_v == d and default_config(d, d) == default_config(d)
    assert FwdConfig(head_dim=128, head_dim_v=128) == FwdConfig(head_dim=128)
    for d, dv in ((192, 192), (192, 0), (128, 64), (256, 128), (96, 96)):
        with pytest.raises(AssertionError, match="head_dim"):
            FwdConfig(head_dim=d, head_dim_v=dv)
    with pytest.raises(AssertionError, match="shared memory"):
        FwdConfig(head_dim=192, head_dim_v=128, tile_n=144)
    with pytest.raises(AssertionError):
        default_config(192)  # no 192 / 192 kernel (and not D 128's by accident)


def test_compile_key_is_stable_and_separates_variants():
    pytest.importorskip("cutlass")
    from ffa_kernels.cute import interface

    k1 = interface.compile_key(torch.bfloat16, default_config(128), False)
    assert k1 == interface.compile_key(torch.bfloat16, default_config(128), False)
    others = [
        interface.compile_key(torch.bfloat16, default_config(128), False, True),
        interface.compile_key(torch.float16, default_config(128), False),
        interface.compile_key(torch.bfloat16, default_config(64), False),
        interface.compile_key(torch.bfloat16, default_config(128), True),
        interface.compile_key(torch.bfloat16, default_config(192, 128), False),
    ]
    assert len({k1, *others}) == 6
    # typed: the fields say what each part is, and the backward's keys never collide with these
    from ffa_kernels.cute import bwd_interface
    from ffa_kernels.cute.compile_cache import CompileKey
    from ffa_kernels.cute.config import default_bwd_config

    assert isinstance(k1, CompileKey) and k1.kernel == "ffa_fwd_sm90" and dict(k1.flags)["softcap"] is False
    bwd = [
        bwd_interface.bwd_compile_key(torch.bfloat16, default_bwd_config(128), False, store, det)
        for store in (False, True)
        for det in (False, True)
    ]
    assert len({k1, *others, *bwd}) == 10 and all(k.kernel == "ffa_bwd_sm90" for k in bwd)
    assert all(dict(k.flags)["deterministic"] == det for k, det in zip(bwd, (False, True) * 2))


def test_accumulate_exported_and_validates():
    """cute_forward_accumulate is exported with cutlass and rejects bad accumulators before any launch."""
    pytest.importorskip("cutlass")
    import ffa_kernels.cute as fc
    from ffa_kernels.cute.interface import cute_forward_accumulate

    assert callable(fc.cute_forward_accumulate) and "cute_forward_accumulate" in fc.__all__
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    r = torch.tensor([[0, 8]], dtype=torch.int32)
    lse = torch.full((8, 2), float("-inf"))
    kw = dict(softmax_scale=None, softcap=0.0)
    with pytest.raises(TypeError, match="float32"):
        cute_forward_accumulate(q, k, k, r, r, None, torch.zeros(8, 2, 64, dtype=torch.bfloat16), lse, **kw)
    with pytest.raises(ValueError, match="shape"):
        cute_forward_accumulate(q, k, k, r, r, None, torch.zeros(8, 2, 32), lse, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        cute_forward_accumulate(q, k, k, r, r, None, torch.zeros(8, 64, 2).transpose(1, 2), lse, **kw)
    with pytest.raises(ValueError, match="shape"):
        cute_forward_accumulate(
            q, k, k, r, r, None, torch.zeros(8, 2, 64), lse, max_logits_acc=torch.zeros(3), **kw
        )
    with pytest.raises(NotImplementedError):
        cute_forward_accumulate(q.float(), k, k, r, r, None, torch.zeros(8, 2, 64), lse, **kw)


# ----------------------------------------------------------------------------- backward
def test_bwd_plan_causal_counts():
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu

    # causal 1024, key tiles of 128 and q blocks of 64 starting at each tile's diagonal: tile i
    # needs q rows [128 i, 1024), i.e. (1024 - 128 i) / 64 blocks, 2 of them on the diagonal
    _, ent, total = build_bwd_plan_cpu(
        torch.tensor([[0, 1024]]), torch.tensor([[0, 1024]]), torch.tensor([1]), 1024, 128, 64
    )
    assert total == sum((1024 - 128 * i) // 64 for i in range(8))
    assert int((ent[:, 1] - (ent[:, 9] - ent[:, 8])).sum()) == 2 * 8


# (head dim, dtype, softcap, dk/dv stored in the input dtype rather than added in float32)
BWD_VARIANTS = list(
    itertools.product((64, 128), (torch.bfloat16, torch.float16), (False, True), (False, True))
)


def test_compile_every_bwd_variant(tmp_path, monkeypatch):
    """Every backward variant (head dim, dtype, softcap, dk/dv stored or added) compiles for
    sm_90a with no GPU, and the packed launcher feeds it what the DSL's marshalling would."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from ffa_kernels.cute import bwd_interface, compile_cache, kernel_args
    from ffa_kernels.cute.config import default_bwd_config

    for d, dt, softcap, store in BWD_VARIANTS:
        compile_cache.forget(
            bwd_interface.bwd_compile_key(dt, default_bwd_config(d, softcap), softcap, store)
        )
        fn = bwd_interface.get_bwd_kernel(dt, default_bwd_config(d, softcap), softcap, store)
        assert kernel_args.packed_matches_dsl(
            fn, bwd_interface.bwd_arg_spec(store), compile_cache.dtype_of(dt)
        )
    # the deterministic mode (ordered dQ reduce-adds; dK/dV stored, or added in head order)
    for d, store in ((64, True), (64, False), (128, True), (128, False)):
        cfg = default_bwd_config(d)
        compile_cache.forget(bwd_interface.bwd_compile_key(torch.bfloat16, cfg, False, store, True))
        fn = bwd_interface.get_bwd_kernel(torch.bfloat16, cfg, False, store, True)
        assert kernel_args.packed_matches_dsl(
            fn, bwd_interface.bwd_arg_spec(store), compile_cache.dtype_of(torch.bfloat16)
        )
    # 64-row q blocks without softcap (the defaults are 128 / 80 rows there; 64 rows issue dV's
    # GEMM before the dP^T wait)
    from ffa_kernels.cute.config import BwdConfig

    for cfg in (BwdConfig(head_dim=64, tile_m=64), BwdConfig(head_dim=128, tile_m=64)):
        compile_cache.forget(bwd_interface.bwd_compile_key(torch.bfloat16, cfg, False, False))
        fn = bwd_interface.get_bwd_kernel(torch.bfloat16, cfg, False, False)
        assert kernel_args.packed_matches_dsl(
            fn, bwd_interface.bwd_arg_spec(False), compile_cache.dtype_of(torch.bfloat16)
        )
    assert len(list(tmp_path.rglob("*.o"))) == len(BWD_VARIANTS) + 6


@pytest.mark.parametrize(
    "kw",
    [dict(head_dim=128), dict(head_dim=128, tile_m=80), dict(head_dim=64), dict(head_dim=64, tile_m=128)],
)
def test_bwd_config_smem(kw):
    """BwdConfig.smem_bytes() is what the compiled kernel's SharedStorage takes (read off the
    struct while it traces); that it fits sm90's 227 KiB with the 1 KiB static part is
    BwdConfig's own check (next test)."""
    pytest.importorskip("cutlass")
    from ffa_kernels.cute.config import BwdConfig

    cfg = BwdConfig(**kw)
    assert _bwd_shared_storage_bytes(cfg) == cfg.smem_bytes()


def _bwd_shared_storage_bytes(cfg) -> int:
    """Bytes of the backward's shared-memory struct for ``cfg`` (bfloat16), read off the struct
    while a small function traces (no kernel is compiled)."""
    import cutlass
    import cutlass.cute as cute

    from ffa_kernels.cute.bwd_sm90 import FFABackwardSm90

    found: list[int] = []
    kernel = FFABackwardSm90(cutlass.BFloat16, cfg, has_softcap=False, dkv_store=True)

    @cute.jit
    def probe():
        sq, sk, sv, sds, _, sdq = kernel.smem_layouts()
        found.append(int(kernel.shared_storage(sq, sk, sv, sds, sdq).size_in_bytes()))

    cute.compile(probe)
    return found[0]


def test_bwd_config_rejects_too_much_smem():
    from ffa_kernels.cute.config import BwdConfig  # pure Python: runs without cutlass too

    with pytest.raises(AssertionError, match="shared memory"):
        BwdConfig(head_dim=128, tile_m=80, num_stages=4)


def test_source_hash_covers_every_kernel_module():
    """The disk cache's key changes with any module of the kernel folder (a new device file is
    never left out of it)."""
    pytest.importorskip("cutlass")
    import pathlib

    from ffa_kernels.cute import compile_cache

    here = pathlib.Path(compile_cache.__file__).parent
    names = {p.name for p in here.glob("*.py")}
    assert {"bwd_sm90.py", "fwd_sm90.py", "atomics.py", "masking.py", "schedule.py"} <= names
    compile_cache.source_hash.cache_clear()
    h1 = compile_cache.source_hash()
    orig = pathlib.Path.read_bytes

    def changed(self):
        data = orig(self)
        return data + b"\n# changed" if self.name == "atomics.py" else data

    try:
        pathlib.Path.read_bytes = changed
        compile_cache.source_hash.cache_clear()
        assert compile_cache.source_hash() != h1
    finally:
        pathlib.Path.read_bytes = orig
        compile_cache.source_hash.cache_clear()


def test_compile_bwd_preprocess_variants(tmp_path, monkeypatch):
    """The backward's preprocess kernel compiles for every (dout, out) dtype pair it serves,
    with the packed launcher."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from ffa_kernels.cute import bwd_interface, kernel_args

    pairs = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32),
             (torch.float32, torch.float32)]  # fmt: skip
    bwd_interface._PREPROCESS.clear()
    for do_dtype, out_dtype in pairs:
        for d in (64, 128):
            fn = bwd_interface._preprocess_launcher(do_dtype, out_dtype, d)
            assert isinstance(fn, kernel_args.PackedLauncher), (do_dtype, out_dtype, d)
    assert len(list(tmp_path.rglob("ffa_bwd_pre_*.o"))) == 2 * len(pairs)


@pytest.mark.parametrize(
    "mask, rows",
    [("sliding_window", 64), ("causal", 80), ("full", 80), ("varlen_causal", 80)],
)
def test_deterministic_rows_follow_the_walk_length(mask, rows):
    """The deterministic backward keeps the default 80-row q blocks at D 128 where key tiles walk
    long (full, causal, long documents) and takes 64 rows on a sliding window, whose 128-key tiles
    walk about 15 blocks (measured: +36% against +9% over the default backward on an H100)."""
    from ffa_kernels.cute.config import default_bwd_config, deterministic_bwd_config
    from ffa_kernels.cute.tile_plan import build_bwd_plan_cpu, mean_walk

    n, w = 8192, 1024
    if mask == "sliding_window":
        qr, kr, ty = [[0, w], [w, n]], [[0, w], [0, n]], [1, 3]  # causal band of width w
    elif mask == "varlen_causal":
        bounds = [0, 1000, 7000, n]
        qr = [[a, b] for a, b in zip(bounds[:-1], bounds[1:])]
        kr, ty = qr, [1] * len(qr)
    else:
        qr, kr, ty = [[0, n]], [[0, n]], [1 if mask == "causal" else 0]
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cfg = default_bwd_config(128)
    work, _, _ = build_bwd_plan_cpu(t(qr), t(kr), t(ty), n, cfg.tile_n, cfg.tile_m, aligned=True)
    assert deterministic_bwd_config(cfg, mean_walk(work)).tile_m == rows


def test_mean_walk_weights_by_work():
    """Two tiles of 2 and 8 blocks: (4 + 64) / 10; an empty plan walks 0."""
    from ffa_kernels.cute.tile_plan import mean_walk

    work = torch.zeros(2, 5, dtype=torch.int32)
    work[:, 3] = torch.tensor([2, 8])
    assert mean_walk(work) == pytest.approx(6.8)
    assert mean_walk(torch.zeros(0, 5, dtype=torch.int32)) == 0.0


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_backward_plan_takes_the_deterministic_rows(monkeypatch, deterministic, given):
    """`_plan_and_split` (no GPU: the SM count is stubbed): a deterministic call without a config
    on a sliding window gets 64-row blocks and a plan aligned to them; the default mode, or a
    config the caller passed, keeps its rows."""
    from ffa_kernels.cute import bwd_interface
    from ffa_kernels.cute.config import default_bwd_config

    monkeypatch.setattr(bwd_interface, "_num_sms", lambda index: 132)
    n, w = 8192, 1024
    q = torch.empty(n, 16, 128, dtype=torch.bfloat16)
    k = torch.empty(n, 16, 128, dtype=torch.bfloat16)
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    ranges = (t([[0, w], [w, n]]), t([[0, w], [0, n]]), t([1, 3]))
    cfg = default_bwd_config(128)
    plan, split, used = bwd_interface._plan_and_split(
        q, k, *ranges, cfg if given else None, 0.0, None, deterministic
    )
    rows = 64 if deterministic and not given else cfg.tile_m
    assert used.tile_m == rows and split == 1
    if deterministic:
        assert plan.ranks is not None
        assert bool((plan.entries[: plan.num_entries, 0] % rows == 0).all())


def test_current_stream_handle_asks_the_raw_accessor_for_the_device(monkeypatch):
    """The launch's stream: torch's raw accessor with the tensor's device index (the current
    device for a bare "cuda"), or the public Stream object where torch has no raw accessor."""
    from ffa_kernels.cute import kernel_args

    asked = []
    monkeypatch.setattr(
        torch._C, "_cuda_getCurrentRawStream", lambda i: asked.append(i) or 1000 + i, raising=False
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert kernel_args.current_stream_handle(torch.device("cuda", 1)) == 1001
    assert kernel_args.current_stream_handle(torch.device("cuda")) == 1003
    assert asked == [1, 3]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")

    class FakeStream:
        cuda_stream = 77

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream())
    assert kernel_args.current_stream_handle(torch.device("cuda", 0)) == 77


@pytest.mark.parametrize("seed", range(6))
def test_bwd_heads_per_cta_is_the_largest_divisor_within_both_limits(seed):
    """A GQA CTA walks the largest divisor d of the group with enough CTAs per SM and d x the
    plan's mean walk in rows within MAX_CTA_WALK_ROWS; 1 where none qualifies; an override must
    divide the group."""
    from ffa_kernels.cute.bwd_interface import _CTAS_PER_SM, MAX_CTA_WALK_ROWS, bwd_heads_per_cta

    rng = random.Random(seed)
    for _ in range(200):
        hk, group = rng.choice([1, 2, 8]), rng.choice([1, 2, 4, 6, 8, 16])
        work, walk = rng.randint(1, 4096), rng.uniform(0.0, 400.0) * 80
        d = bwd_heads_per_cta(work, hk * group, hk, 132, None, walk)

        fits = [
            x
            for x in range(1, group + 1)
            if group % x == 0
            and work * hk * (group // x) >= _CTAS_PER_SM * 132
            and x * walk <= MAX_CTA_WALK_ROWS
        ]
        assert d == max(fits, default=1), (work, hk, group, walk, d)
    assert bwd_heads_per_cta(10, 64, 8, 132, 4, 1000.0) == 4
    with pytest.raises(ValueError, match="heads_per_cta"):
        bwd_heads_per_cta(10, 64, 8, 132, 3)


def test_long_causal_documents_split_the_gqa_group(monkeypatch):
    """GQA 64:8 causal, 128k tokens at D 128 (80-row blocks): the CTA-count rule alone would give
    each CTA all 8 q heads (1024 key tiles; uniform documents measured 318-344 against 539-545
    TFLOP/s with 1 head on an H100); the walk cap takes 2 heads over 8k documents (mean walk about
    68 blocks) and 1 over 32k ones (about 274); eight 4k documents (32k tokens) keep the CTA-count
    rule's 2. D 64 (128-row blocks) counts the same rows: 16 documents of 8k take 2 heads there too."""
    from ffa_kernels.cute import bwd_interface

    monkeypatch.setattr(bwd_interface, "_num_sms", lambda index: 132)
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    for doc, docs, d, heads in ((32768, 4, 128, 1), (8192, 16, 128, 2), (4096, 8, 128, 2), (8192, 16, 64, 2)):
        n = docs * doc
        q, k = torch.empty(n, 64, d, dtype=torch.bfloat16), torch.empty(n, 8, d, dtype=torch.bfloat16)
        qr = t([[i * doc, (i + 1) * doc] for i in range(docs)])
        _, split, _ = bwd_interface._plan_and_split(q, k, qr, qr, t([1] * docs), None, 0.0, None, False)
        assert split == heads, (doc, split)


@pytest.mark.parametrize(
    "hq, heads_per_unit, fit, group",
    [(16, 1, 3, 2), (16, 1, 4, 4), (32, 1, 12, 8), (8, 1, 3, 2), (64, 8, 3, 16), (7, 1, 3, 3), (14, 1, 6, 6),
     (16, 1, 40, 16)],
)  # fmt: skip
def test_l2_head_groups_are_equal(hq, heads_per_unit, fit, group):
    """The head group: whole units within the L2 budget (``fit`` units of it), the largest
    divisor of the units up to that when above half of it (equal groups), else ``fit`` (7 heads:
    3, 3, 1); an override wins."""
    from ffa_kernels.cute.interface import _L2_BUDGET, l2_head_group

    unit_bytes = _L2_BUDGET // fit
    assert l2_head_group(unit_bytes, heads_per_unit, hq) == group
    assert l2_head_group(unit_bytes, heads_per_unit, hq, override=3) == 3


@pytest.mark.parametrize("num_cols", [64, 80, 128])
def test_band_mask_element_counts(num_cols):
    """masking._elements_below(x) counts a thread's accumulator columns (thread-0 coordinates
    0, 1, 8, 9, ...) below x, for any x: the bounds of the kept run of elements in a row."""
    pytest.importorskip("cutlass")
    from ffa_kernels.cute.masking import _elements_below

    coords = [c // 2 * 8 + c % 2 for c in range(num_cols // 4)]
    for x in [-(1 << 30), -9, -1, *range(num_cols + 10), 1 << 30]:
        assert _elements_below(x, num_cols) == sum(c < x for c in coords), x


@pytest.mark.parametrize(
    "slots, l2_group, per_slot, group",
    [(16, 1, 1, 4), (16, 2, 1, 4), (16, 8, 1, 8), (32, 1, 1, 4), (6, 1, 1, 3), (7, 1, 1, 4), (2, 1, 1, 2),
     (1, 1, 1, 1), (8, 1, 8, 1), (8, 1, 2, 2), (16, 1, 4, 1), (10, 1, 1, 4), (10, 2, 1, 4), (5, 1, 1, 4),
     (8, 1, 3, 2)],
)  # fmt: skip
def test_deterministic_head_group(slots, l2_group, per_slot, group):
    """The deterministic backward's head group: slots of about DET_HEAD_GROUP (4) q heads side by
    side (rounded up to whole slots), equal groups where a divisor is more than half of that,
    never below the L2 rule's group nor above the slots."""
    from ffa_kernels.cute.bwd_interface import deterministic_head_group

    assert deterministic_head_group(slots, l2_group, per_slot) == group


def test_backward_head_group_choice():
    """One launch's head group: an override wins; deterministic mode raises the L2 rule's group
    only where each K/V head has one slot (MHA, or a whole GQA group per CTA)."""
    from ffa_kernels.cute.bwd_interface import backward_head_group, bwd_head_group_size

    args = (8192, 16, 16, 128)  # Tq, Hq, Hk, D: L2 rule 2 (16 slots, 8 MiB each)
    l2 = bwd_head_group_size(8192, 16, 128, 1)
    assert l2 == 2
    assert backward_head_group(*args, 1, None, False) == l2
    assert backward_head_group(*args, 1, None, True) == 4
    assert backward_head_group(*args, 1, 3, True) == 3  # override
    # GQA 16:2 with 2 q heads per CTA: 4 slots per K/V head, the L2 rule stays
    gqa = (8192, 16, 2, 128, 2)
    assert backward_head_group(*gqa, None, True) == backward_head_group(*gqa, None, False)
    # a whole group of 8 q heads per CTA: one slot per K/V head, 4 q heads = 1 slot
    assert backward_head_group(8192, 16, 2, 128, 8, None, True) == bwd_head_group_size(8192, 16, 128, 8)


@pytest.mark.parametrize(
    "units, target, group", [(16, 3, 2), (16, 6, 4), (7, 3, 3), (9, 4, 3), (10, 4, 4), (5, 9, 5)]
)
def test_equal_group(units, target, group):
    """equal_group: the largest divisor up to the target when above half of it, else the target."""
    from ffa_kernels.cute.interface import equal_group

    assert equal_group(units, target) == group


def _causal_docs_plan(lengths):
    """The forward's tile plan (D 128 config) of causal documents of ``lengths`` tokens."""
    from ffa_kernels.cute.tile_plan import get_plan

    cfg = default_config(128)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    qr = torch.tensor([[s, s + n] for s, n in zip(starts, lengths)], dtype=torch.int32)
    ty = torch.ones(len(lengths), dtype=torch.int32)
    return get_plan(qr, qr.clone(), ty, sum(lengths), cfg.tile_m, cfg.tile_n, torch.device("cpu"))


@pytest.mark.parametrize(
    "lengths, hq, heads_per_unit, group, doubled",
    [
        ([8192] + [1024] * 24, 16, 1, 1, 2),  # one long document among short ones: its tile is the tail
        ([4096] * 8, 16, 1, 1, 1),  # equal documents: no tile longer than the group's share
        ([8192] + [1024] * 24, 16, 1, 16, 16),  # one group already holds every head
        ([2048], 64, 8, 8, 16),  # GQA: whole K/V heads (ratio 14.1 / 8 heads)
        ([2048] + [256] * 24, 6, 1, 2, 3),  # doubled to 4 would leave 4 + 2: equal groups of 3
        ([2048] + [256] * 24, 16, 1, 1, 2),  # doubled once at most (ratio 7.1)
        ([8192] + [1024] * 24, 64, 8, 8, 8),  # GQA: whole K/V heads hold enough work (2.5 / 8)
        ([2048] + [256] * 24, 5, 1, 1, 1),  # 5 heads: no equal groups of 2, so kept (not 4 + 1)
    ],
)
def test_tail_head_group(lengths, hq, heads_per_unit, group, doubled):
    """The forward's head group is doubled (once, in whole units and equal groups) where a work
    tile walks more than _TAIL_RATIO times the group's blocks per SM, and kept otherwise."""
    from ffa_kernels.cute.interface import _CTA_SETUP_BLOCKS, _TAIL_RATIO, tail_head_group

    plan = _causal_docs_plan(lengths)
    ratio = (plan.max_walk + _CTA_SETUP_BLOCKS) / (
        group * (plan.total_blocks + _CTA_SETUP_BLOCKS * plan.num_work) / 132
    )
    assert (ratio > _TAIL_RATIO) == (doubled != group) or group >= hq or hq % (2 * group), ratio
    assert tail_head_group(group, heads_per_unit, hq, plan, 132) == doubled


@pytest.mark.parametrize("hq, hk", [(32, 8), (16, 16)])
def test_backward_heads_per_cta_is_what_the_stage_launches(monkeypatch, hq, hk):
    """`cute_backward_heads_per_cta` answers the heads per CTA `cute_backward_stage` launches with
    for the same call (no GPU: the SM count is stubbed and the launch recorded, not run), more for a
    larger call; a stage given ``heads_per_cta`` launches with it; what the kernel does not serve
    says so."""
    from ffa_kernels.cute import bwd_interface

    monkeypatch.setattr(bwd_interface, "_num_sms", lambda index: 132)
    launched = []
    monkeypatch.setattr(bwd_interface, "_launch", lambda *a: launched.append(a[13]))
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    answers = []
    for n in (2048, 65536):  # documents of 2048 tokens, causal: short walks, many tiles at 64k
        q = torch.zeros(n, hq, 128, dtype=torch.bfloat16)
        k = torch.zeros(n, hk, 128, dtype=torch.bfloat16)
        docs = [[s, s + 2048] for s in range(0, n, 2048)]
        ranges = (t(docs), t(docs), t([1] * len(docs)))
        h = bwd_interface.cute_backward_heads_per_cta(q, k, k, *ranges, 0.0, False)
        grads = (torch.zeros(n, hq, 128), torch.zeros(n, hk, 128), torch.zeros(n, hk, 128))
        lse = torch.zeros(n, hq)
        for given in (None, hq // hk):
            bwd_interface.cute_backward_stage(
                q, k, k, q, q, lse, *ranges, *grads, softmax_scale=None, softcap=0.0, heads_per_cta=given
            )
        assert launched[-2:] == [h, hq // hk], (launched, h)
        answers.append(h)
    assert answers[0] <= answers[1] and (hq == hk or answers[1] > 1), answers
    with pytest.raises(NotImplementedError, match="head_dim"):
        x = torch.zeros(8, hq, 96, dtype=torch.bfloat16)
        y = torch.zeros(8, hk, 96, dtype=torch.bfloat16)
        bwd_interface.cute_backward_heads_per_cta(x, y, y, t([[0, 8]]), t([[0, 8]]), t([0]), 0.0, False)


WAIT_KV_VARIANTS = [  # (head_dim, head_dim_v, dtype, softcap, G): the forward waiting for late K/V rows
    (128, 128, torch.bfloat16, False, 1),
    (128, 128, torch.float16, True, 8),
    (192, 128, torch.bfloat16, False, 1),
]


@pytest.mark.parametrize("d,dv,dt,softcap,g", WAIT_KV_VARIANTS)
def test_compile_wait_kv_variants(d, dv, dt, softcap, g, tmp_path, monkeypatch):
    """The forward that waits for late key/value rows (`ffa_forward`'s ``kv_ready``: its load
    warp spins on a flag before the first block reaching them) compiles for sm_90a with no GPU,
    under its own compile key, and takes the arguments the packed launcher gives it. Its PTX
    has the wait: a system-scope acquire load of the flag, the global timer read in the loop
    (the bound), the trap past it and the async-proxy fence before the TMA loads."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("FFA_CACHE_DIR", str(tmp_path))
    from cutlass.cutlass_dsl import CuTeDSL

    from ffa_kernels.cute import compile_cache, interface

    # the DSL read CUTE_DSL_KEEP_PTX / _DUMP_DIR at import: its settings object, patched
    dump = tmp_path / "dump"
    dump.mkdir()
    envar = CuTeDSL._get_dsl().envar
    monkeypatch.setattr(envar, "keep_ptx", True)
    monkeypatch.setattr(envar, "dump_dir", str(dump))

    cfg = default_config(d, dv)
    key = interface.compile_key(dt, cfg, softcap, False, g, wait_kv=True)
    assert ("wait_kv", True) in key.flags and key != interface.compile_key(dt, cfg, softcap, False, g)
    compile_cache.forget(key)
    fn = interface.get_kernel(dt, cfg, softcap, pack=g, wait_kv=True, use_disk_cache=False)
    assert_packed_launch_equals_dsl(fn, dt, False)
    (ptx,) = [p.read_text() for p in dump.glob("*.ptx")]
    loop = ptx[ptx.index("ld.acquire.sys.global.s32") :]
    assert "%globaltimer" in loop[: loop.index("fence.proxy.async.global")], (
        "the bound's clock is not read in the loop"
    )
    assert "trap;" in loop[: loop.index("fence.proxy.async.global")]
