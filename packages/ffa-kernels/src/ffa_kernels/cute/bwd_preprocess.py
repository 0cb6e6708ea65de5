"""The backward's preprocess (device code): per (row, head) statistics the main kernel reads.

    stats[0, h, r] = lse[r, h] * log2(e) - lse2_shift   (+inf where lse = -inf: P = 0 there)
    stats[1, h, r] = sum_d dout[r, h, d] * out[r, h, d]     (delta, in float32)
    stats[:, h, Tq:stat_stride] = +inf / 0                  (padding a q block may read)

Memory-bound: ``threads_per_row`` = D / 8 consecutive threads read one (row, head)'s D elements of
dout and out, 8 per thread in 16-byte (32 for float32) vector loads, and reduce the dot product
with butterfly shuffles. One launch replaces torch's casts, product and sum (five passes).

``lse2_shift`` is log2 of the scale the backward folds into P (``bwd_interface.fold_scale``:
softmax_scale for bfloat16, so the main kernel's P = exp2(S * scale_log2 - lse2) comes out as
softmax_scale * P and dS, dQ and dK carry the scale with no multiply per block, dV dividing it out
once at the end; 1, a shift of 0, for float16; see bwd_sm90.py).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

_LOG2_E = math.log2(math.e)
_VEC = 8  # elements per thread per tensor
_THREADS = 256


class BwdPreprocess:
    """One compiled kernel per (dout dtype, out dtype, head dim)."""

    def __init__(self, do_dtype, out_dtype, head_dim: int):
        assert head_dim % _VEC == 0 and _THREADS % (head_dim // _VEC) == 0
        self.do_dtype, self.out_dtype, self.hdim = do_dtype, out_dtype, head_dim
        self.threads_per_row = head_dim // _VEC
        self.rows_per_cta = _THREADS // self.threads_per_row

    @cute.jit
    def __call__(
        self,
        ptr_do: cute.Pointer,  # (Tq, Hq, D) contiguous
        ptr_out: cute.Pointer,  # (Tq, Hq, D) contiguous
        ptr_lse: cute.Pointer,  # (Tq, Hq) f32 contiguous
        ptr_stats: cute.Pointer,  # (2, Hq, stat_stride) f32 contiguous, written
        total_q: Int32,
        num_heads: Int32,
        stat_stride: Int32,
        lse2_shift: Float32,
        stream: cuda.CUstream,
    ):
        num_rows = total_q * num_heads
        num_pad = (stat_stride - total_q) * num_heads
        items = num_rows + num_pad
        self.kernel(ptr_do, ptr_out, ptr_lse, ptr_stats, total_q, num_heads, stat_stride, lse2_shift).launch(
            grid=[(items + self.rows_per_cta - 1) // self.rows_per_cta, 1, 1],
            block=[_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        ptr_do: cute.Pointer,
        ptr_out: cute.Pointer,
        ptr_lse: cute.Pointer,
        ptr_stats: cute.Pointer,
        total_q: Int32,
        num_heads: Int32,
        stat_stride: Int32,
        lse2_shift: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tpr = self.threads_per_row
        item = bidx * self.rows_per_cta + tidx // tpr  # a (row, head) pair, rows then heads
        lane = tidx % tpr
        num_rows = total_q * num_heads
        plane = Int64(num_heads) * Int64(stat_stride)
        mStats = cute.make_tensor(ptr_stats, cute.make_layout(2 * plane))

        partial = Float32(0.0)
        if item < num_rows:
            off = cute.assume(Int64(item) * self.hdim + lane * _VEC, divby=_VEC)
            rdo = cute.make_rmem_tensor(_VEC, self.do_dtype)
            rout = cute.make_rmem_tensor(_VEC, self.out_dtype)
            cute.autovec_copy(cute.make_tensor(ptr_do + off, cute.make_layout(_VEC)), rdo)
            cute.autovec_copy(cute.make_tensor(ptr_out + off, cute.make_layout(_VEC)), rout)
            prod = rdo.load().to(Float32) * rout.load().to(Float32)
            for i in cutlass.range_constexpr(_VEC):
                partial = partial + prod[i]
        # the row's threads are consecutive lanes of one warp: butterfly over them
        for i in cutlass.range_constexpr(tpr.bit_length() - 1):
            partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=tpr >> (i + 1))
        if lane == 0:
            if item < num_rows:
                row = item // num_heads
                head = item - row * num_heads
                at = Int64(head) * Int64(stat_stride) + row
                lse = cute.make_tensor(ptr_lse, cute.make_layout(num_rows))[item]
                lse2 = lse * _LOG2_E - lse2_shift
                if lse == -math.inf:
                    lse2 = Float32(math.inf)
                mStats[at] = lse2
                mStats[plane + at] = partial
            elif item < num_rows + (stat_stride - total_q) * num_heads:
                pad_len = stat_stride - total_q
                p = item - num_rows
                head = p // pad_len
                at = Int64(head) * Int64(stat_stride) + total_q + (p - head * pad_len)
                mStats[at] = Float32(math.inf)
                mStats[plane + at] = Float32(0.0)
