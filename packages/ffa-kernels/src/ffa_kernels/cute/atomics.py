"""Global-memory writes of the backward's partial gradients, two elements at a time (device side):
float32 reductions, or 16-bit stores where one CTA owns the rows."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
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
