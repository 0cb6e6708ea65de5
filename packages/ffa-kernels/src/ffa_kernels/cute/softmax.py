"""Online softmax in the log2 domain (device side).

Scores stay unscaled in the accumulator; the softmax scale is folded into exp2:
p = exp2(s * scale_log2 - m * scale_log2). Row sums are kept per thread and reduced over
the thread quad only once, at the end. Lazy rescaling: the running max is only raised
when a block's max exceeds it by more than ``threshold`` (in log2 units), so most blocks
rescale nothing (row_scale == 1) and exp2 inputs stay bounded by 2**threshold.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .mma import acc_rows_cols

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _tree_reduce(vals, op, lanes: int = 8):
    """Reduce a static list with `lanes` independent chains, then combine them pairwise."""
    lanes = min(lanes, len(vals))
    acc = list(vals[:lanes])
    for i in range(lanes, len(vals)):
        acc[i % lanes] = op(acc[i % lanes], vals[i])
    while len(acc) > 1:
        nxt = [op(acc[i], acc[i + 1]) for i in range(0, len(acc) - 1, 2)]
        if len(acc) % 2:
            nxt.append(acc[-1])
        acc = nxt
    return acc[0]


def quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


def quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1)


def init_state(num_rows: int):
    """(row_max, row_sum) register tensors of the online softmax state."""
    row_max = cute.make_rmem_tensor(num_rows, Float32)
    row_sum = cute.make_rmem_tensor(num_rows, Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    return row_max, row_sum


@cute.jit
def online_step(
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    acc_S: cute.Tensor,
    row_scale: cute.Tensor,
    true_max: cute.Tensor,
    scale_log2: Float32,
    threshold: cutlass.Constexpr[float],
):
    """Exponentiate one block of scores in place; row_scale gets the factor for O.

    true_max tracks the exact running max (row_max may be stale by design).
    """
    s = acc_rows_cols(acc_S)
    ncol = cute.size(s, mode=[1])
    thr_raw = Float32(threshold) / scale_log2
    for r in cutlass.range_constexpr(cute.size(row_max)):
        m_blk = _tree_reduce([s[r, c] for c in range(ncol)], cute.arch.fmax)
        m_blk = quad_max(m_blk)
        true_max[r] = cute.arch.fmax(true_max[r], m_blk)
        m_old = row_max[r]
        # lazy rescaling: raise the max only when it grows by more than the threshold
        m_new = m_blk if m_blk > m_old + thr_raw else m_old
        m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
        scale_r = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
        mc = m_safe * scale_log2
        for c in cutlass.range_constexpr(ncol):
            s[r, c] = cute.math.exp2(s[r, c] * scale_log2 - mc, fastmath=True)
        acc = _tree_reduce([s[r, c] for c in range(ncol)], lambda a, b: a + b)
        row_sum[r] = row_sum[r] * scale_r + acc
        row_max[r] = m_new
        row_scale[r] = scale_r


@cute.jit
def finalize(
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    sink_lse: cute.Tensor,
    row_inv: cute.Tensor,
    row_lse: cute.Tensor,
):
    """Fold in the sink (natural-log logsumexp of the sink logits, -inf for none).

    row_inv gets 1/sum (0 for empty rows), row_lse the natural-log LSE (after the sink).
    """
    for r in cutlass.range_constexpr(cute.size(row_max)):
        ssum = quad_sum(row_sum[r])
        m = row_max[r]
        sk = sink_lse[r]
        inv = Float32(0.0)
        lse = sk
        if m != -Float32.inf:
            mc = m * scale_log2
            ssum = ssum + cute.math.exp2(sk * LOG2_E - mc, fastmath=True)
            inv = cute.arch.rcp_approx(ssum)
            lse = (mc + cute.math.log2(ssum, fastmath=True)) * LN_2
        row_inv[r] = inv
        row_lse[r] = lse


@cute.jit
def rescale_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    o = acc_rows_cols(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]
