"""WGMMA helpers (device side): fragment views of the sm90 accumulator and async GEMM issue."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum


def tiled_wgmma(
    dtype,
    atom_layout_mnk: tuple,
    tiler_mn: tuple,
    *,
    a_transposed: bool = False,
    b_transposed: bool = False,
    a_in_registers: bool = False,
):
    """A float32-accumulating wgmma of ``dtype`` operands over the warpgroups ``atom_layout_mnk``
    (each computing a ``tiler_mn`` tile). A is K-major (from shared memory, or from registers
    with ``a_in_registers``), or MN-major with ``a_transposed``; B is K-major, or MN-major with
    ``b_transposed`` (a row-major tile read as its transpose)."""
    major = warpgroup.OperandMajorMode
    return sm90_helpers.make_trivial_tiled_mma(
        dtype,
        dtype,
        major.MN if a_transposed else major.K,
        major.MN if b_transposed else major.K,
        Float32,
        atom_layout_mnk=atom_layout_mnk,
        tiler_mn=tiler_mn,
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM,
    )


def smem_layout(dtype, rows: int, cols: int, stages: int | None, atom_cols: int | None = None):
    """Swizzled row-major (cols contiguous) shared-memory layout of a (rows, cols[, stages]) tile.

    The swizzle atom is the widest that ``atom_cols`` columns allow (default: all of them); a
    tile that a GEMM reads MN-major in slices of n columns needs atoms no wider than n.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype
    )
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    order = (0, 1) if stages is None else (0, 1, 2)
    return cute.tile_to_shape(atom, shape, order=order)


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View an sm90 accumulator ((2, 2, V), M, N) as (rows, cols) = ((2, M), (2, V, N)).

    In the wgmma C layout a thread holds, per 64-row atom, two rows (r and r + 8) and, per
    8-column group, two adjacent columns; the rows of one thread quad hold the same rows.
    """
    lay = acc.layout
    sh, st = lay.shape, lay.stride
    shape = ((sh[0][1], sh[1]), (sh[0][0], sh[0][2], sh[2]))
    stride = ((st[0][1], st[1]), (st[0][0], st[0][2], st[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit sm90 accumulator ((2, 2, V), M, N) as an RS-wgmma A fragment.

    A k-block of 16 columns is two 8-column groups: ((2, 2, 2), M, (V / 2, N)).
    """
    lay = acc.layout
    sh, st = lay.shape, lay.stride
    v = sh[0][2]
    assert v % 2 == 0
    shape = ((sh[0][0], sh[0][1], 2), sh[1], (v // 2, sh[2]))
    stride = ((st[0][0], st[0][1], st[0][2]), st[1], (st[0][2] * 2, st[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def smem_transpose(s: cute.Tensor) -> cute.Tensor:
    """(a, b, ...) -> (b, a, ...) view of a shared-memory tensor."""
    shape = (s.shape[1], s.shape[0], *s.shape[2:])
    order = (1, 0, *range(2, cute.rank(s)))
    return cute.composition(s, cute.make_ordered_layout(shape, order=order))


@cute.jit
def wgmma(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    frag_a: cute.Tensor,
    frag_b: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wait: cutlass.Constexpr[int],
):
    """acc (+)= A @ B over all k-blocks as one wgmma commit group.

    wait < 0 leaves the group in flight (the caller waits with warpgroup.wait_group).
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wait >= 0):
        warpgroup.wait_group(wait)
