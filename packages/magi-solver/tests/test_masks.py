"""Every builder equals a direct dense definition of its mask."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magi_solver import AttnMaskType, masks

lengths = st.lists(st.integers(0, 9), min_size=1, max_size=5)


def cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def doc_of(cu_seqlens, t):
    for d in range(len(cu_seqlens) - 1):
        if cu_seqlens[d] <= t < cu_seqlens[d + 1]:
            return d
    return None


def dense(pred, tq, tk):
    return [[bool(pred(q, k)) for k in range(tk)] for q in range(tq)]


window = st.tuples(st.integers(-1, 6), st.integers(-1, 6))


@settings(max_examples=150, deadline=None)
@given(lengths, st.data(), st.booleans(), window, st.integers(0, 4))
def test_varlen(lens_q, data, causal, win, global_window):
    lens_k = data.draw(st.lists(st.integers(0, 9), min_size=len(lens_q), max_size=len(lens_q)))
    cq, ck = cu(lens_q), cu(lens_k)
    left, right = win
    if causal:
        right = 0 if right == -1 else min(right, 0)

    def pred(q, k):
        d = doc_of(cq, q)
        if d is None or doc_of(ck, k) != d:
            return False
        i, j = q - cq[d], k - ck[d]
        rel = j - (i + lens_k[d] - lens_q[d])
        in_window = (left == -1 or rel >= -left) and (right == -1 or rel <= right)
        is_global = j < global_window and (not causal or rel <= 0)
        return in_window or is_global

    m = masks.varlen(cq, ck, causal=causal, window_size=win, global_window_size=global_window)
    assert m.to_dense() == dense(pred, cq[-1], ck[-1])
    qr, kr, types, tq, tk = masks.infer_attn_mask_from_cu_seqlens(cq, ck, causal, win, global_window)
    assert (qr, kr, types, tq, tk) == (m.q_ranges, m.k_ranges, list(m.mask_types), cq[-1], ck[-1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=24), st.booleans(), st.sampled_from([None, 0]))
def test_from_segment_ids(ids, causal, pad_id):
    m = masks.from_segment_ids(ids, causal=causal, pad_id=pad_id)

    def pred(q, k):
        return ids[q] == ids[k] and ids[q] != pad_id and (not causal or k <= q)

    assert m.to_dense() == dense(pred, len(ids), len(ids))


@settings(max_examples=100, deadline=None)
@given(lengths, st.integers(1, 5))
def test_block_causal(lens, block):
    c = cu(lens)
    m = masks.block_causal(c, block)

    def pred(q, k):
        d = doc_of(c, q)
        return d is not None and doc_of(c, k) == d and (k - c[d]) // block <= (q - c[d]) // block

    assert m.to_dense() == dense(pred, c[-1], c[-1])
    assert set(m.mask_types) <= {AttnMaskType.FULL}


@settings(max_examples=100, deadline=None)
@given(lengths, st.data())
def test_prefix_lm(lens, data):
    c = cu(lens)
    prefixes = data.draw(st.lists(st.integers(0, 10), min_size=len(lens), max_size=len(lens)))
    m = masks.prefix_lm(c, prefixes)

    def pred(q, k):
        d = doc_of(c, q)
        return d is not None and doc_of(c, k) == d and k - c[d] <= max(q - c[d], prefixes[d] - 1)

    assert m.to_dense() == dense(pred, c[-1], c[-1])


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 6), st.lists(st.integers(0, 6), max_size=4))
def test_shared_question(qlen, answers):
    m = masks.shared_question(qlen, answers)
    starts = cu([qlen, *answers])

    def pred(q, k):
        a, b = doc_of(starts, q), doc_of(starts, k)
        if a == 0:
            return b == 0 and k <= q
        return b == 0 or (a == b and k <= q)

    assert m.to_dense() == dense(pred, starts[-1], starts[-1])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 14), window, st.booleans())
def test_sliding_window(n, win, causal):
    m = masks.sliding_window(n, win, causal=causal)
    left, right = win
    if causal:
        right = 0 if right == -1 else min(right, 0)
    assert m.to_dense() == dense(
        lambda q, k: (left == -1 or k >= q - left) and (right == -1 or k <= q + right), n, n
    )


def test_sliding_window_uses_few_slices():
    m = masks.sliding_window(100_000, (1024, 0), causal=True)
    assert len(m) <= 3 and m.area() == sum(min(q, 1024) + 1 for q in range(100_000))


def test_block_diagonal_and_full_causal():
    m = masks.block_diagonal([masks.full(2, 3), masks.causal(2)])
    assert m.total_seqlen_q == 4 and m.total_seqlen_k == 5
    assert m.to_dense() == [
        [True, True, True, False, False],
        [True, True, True, False, False],
        [False, False, False, True, False],
        [False, False, False, True, True],
    ]


def test_builder_bad_inputs():
    with pytest.raises(ValueError, match="cu_seqlens_q: must start with 0"):
        masks.varlen([1, 4])
    with pytest.raises(ValueError, match=r"cu_seqlens_q: must be non-decreasing"):
        masks.varlen([0, 4, 2])
    with pytest.raises(ValueError, match="cu_seqlens_k: has 2 entries"):
        masks.varlen([0, 2, 4], [0, 4])
    with pytest.raises(ValueError, match="window_size"):
        masks.varlen([0, 4], window_size=(-2, 0))
    with pytest.raises(ValueError, match="block_size"):
        masks.block_causal([0, 4], 0)
    with pytest.raises(ValueError, match="prefix_lens"):
        masks.prefix_lm([0, 4, 8], [1])
    with pytest.raises(ValueError, match="global_window_size"):
        masks.varlen([0, 4], global_window_size=-1)
