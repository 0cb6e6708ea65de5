"""Global-memory operations of the backward (device side): its partial gradients written two
elements at a time (float32 reductions, or 16-bit stores where one CTA owns the rows), and the
acquire / release pair of its deterministic mode's semaphores."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """``ptr[0] += a; ptr[1] += b`` as one 8-byte vector reduction (``red.global.add.v2.f32``,
    sm_90); ``ptr`` must be 8-byte aligned. Fire-and-forget: nothing is returned."""
    llvm.inline_asm(
        None,
        [
            ptr.toint(loc=loc, ip=ip).ir_value(),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def store_pair_16bit(ptr: cute.Pointer, a: Float32, b: Float32, is_bf16: bool, *, loc=None, ip=None) -> None:
    """``ptr[0] = a; ptr[1] = b`` rounded to bf16 (``is_bf16``) or fp16, as one 4-byte store;
    ``ptr`` must be 4-byte aligned. (cvt packs its first operand into the upper half, which is
    ``ptr[1]`` in little-endian order, hence the swapped operands.)"""
    cvt = "bf16x2" if is_bf16 else "f16x2"
    llvm.inline_asm(
        None,
        [
            ptr.toint(loc=loc, ip=ip).ir_value(),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        f"{{ .reg .b32 t; cvt.rn.{cvt}.f32 t, $2, $1; st.global.b32 [$0], t; }}",
        "l,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def load_acquire_i32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """``ptr[0]`` read with acquire semantics at GPU scope (``ld.acquire.gpu``): what another
    CTA wrote before its matching release is visible after this load."""
    return Int32(
        llvm.inline_asm(
            Int32.mlir_type,
            [ptr.toint(loc=loc, ip=ip).ir_value()],
            "ld.acquire.gpu.global.s32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def add_release_i32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """``ptr[0] += value`` with release semantics at GPU scope (``red.release.gpu``): everything
    this thread made visible before it is visible to a CTA that acquires the new value."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
