"""Band geometry against a cell-by-cell definition."""

from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver.band import Band

N = 12
coord = st.integers(0, N)
diag = st.one_of(st.none(), st.integers(-N - 2, N + 2))


@st.composite
def bands(draw):
    q0, q1 = sorted((draw(coord), draw(coord)))
    k0, k1 = sorted((draw(coord), draw(coord)))
    return Band(q0, q1, k0, k1, draw(diag), draw(diag))


def cells(b: Band) -> set:
    return {
        (q, k)
        for q in range(b.q0, b.q1)
        for k in range(b.k0, b.k1)
        if (b.lo is None or k - q >= b.lo) and (b.hi is None or k - q <= b.hi)
    }


def slice_cells(qs, qe, ks, ke, t) -> set:
    sq, sk = qe - qs, ke - ks
    out = set()
    for i in range(sq):
        for j in range(sk):
            causal_ok = j <= i + (sk - sq)
            inv_ok = j >= i
            if [True, causal_ok, inv_ok, causal_ok and inv_ok][t]:
                out.add((qs + i, ks + j))
    return out


@settings(max_examples=400, deadline=None)
@given(bands())
def test_area_slices_and_touched_cols_are_exact(b):
    want = cells(b)
    assert b.area() == len(want)
    assert b.is_empty() == (not want)
    got = set()
    slices = b.to_slices()
    assert len(slices) <= 3
    for s in slices:
        c = slice_cells(*s)
        assert c, f"empty slice {s} emitted"
        assert not (got & c), "decomposition overlaps itself"
        got |= c
    assert got == want
    c0, c1 = b.touched_cols()
    assert {k for _, k in want} == set(range(c0, c1))


@settings(max_examples=200, deadline=None)
@given(bands(), bands(), st.integers(-5, 5), st.integers(-5, 5))
def test_clip_intersect_and_shift(a, b, dq, dk):
    assert cells(a.intersect(b)) == cells(a) & cells(b)
    assert cells(a.clip_rows(b.q0, b.q1)) == {c for c in cells(a) if b.q0 <= c[0] < b.q1}
    assert cells(a.clip_cols(b.k0, b.k1)) == {c for c in cells(a) if b.k0 <= c[1] < b.k1}
    assert cells(a.shifted(dq, dk)) == {(q + dq, k + dk) for q, k in cells(a)}


@settings(max_examples=200, deadline=None)
@given(st.integers(0, N), st.integers(0, N), st.integers(0, N), st.integers(0, N), st.integers(0, 3))
def test_from_slice_matches_api_semantics(qs, sq, ks, sk, t):
    assert cells(Band.from_slice(qs, qs + sq, ks, ks + sk, t)) == slice_cells(qs, qs + sq, ks, ks + sk, t)
