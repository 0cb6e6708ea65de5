"""Global-memory reductions the backward adds its partial gradients with (device side)."""

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
