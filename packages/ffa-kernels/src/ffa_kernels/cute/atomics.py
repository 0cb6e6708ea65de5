"""Global-memory operations of the kernels (device side): the backward's partial gradients
written two elements at a time (float32 reductions, or 16-bit stores where one CTA owns the
rows), the acquire / release pair of its deterministic mode's semaphores, and the forward's
bounded wait for key/value rows that another stream, engine or GPU is still writing
(`await_flag`)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _asm(result_type, operands: list, text: str, constraints: str):
    """One inline PTX statement with side effects (never reordered or dropped by the compiler)."""
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """``ptr[0] += a; ptr[1] += b`` as one 8-byte vector reduction (``red.global.add.v2.f32``,
    sm_90); ``ptr`` must be 8-byte aligned. Fire-and-forget: nothing is returned."""
    _asm(
        None,
        [
            ptr.toint(loc=loc, ip=ip).ir_value(),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
    )


@dsl_user_op
def store_pair_16bit(ptr: cute.Pointer, a: Float32, b: Float32, is_bf16: bool, *, loc=None, ip=None) -> None:
    """``ptr[0] = a; ptr[1] = b`` rounded to bf16 (``is_bf16``) or fp16, as one 4-byte store;
    ``ptr`` must be 4-byte aligned. (cvt packs its first operand into the upper half, which is
    ``ptr[1]`` in little-endian order, hence the swapped operands.)"""
    cvt = "bf16x2" if is_bf16 else "f16x2"
    _asm(
        None,
        [
            ptr.toint(loc=loc, ip=ip).ir_value(),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
        f"{{ .reg .b32 t; cvt.rn.{cvt}.f32 t, $2, $1; st.global.b32 [$0], t; }}",
        "l,f,f",
    )


@dsl_user_op
def load_acquire_i32(ptr: cute.Pointer, scope: str = "gpu", *, loc=None, ip=None) -> Int32:
    """``ptr[0]`` read with acquire semantics at ``scope`` (``ld.acquire.<scope>``): "gpu", what
    another CTA wrote before its matching release is visible after this load; "sys", also what
    another GPU, a copy engine or the host made visible before raising the word."""
    assert scope in ("gpu", "sys"), f"scope: gpu or sys, got {scope!r}"
    text = f"ld.acquire.{scope}.global.s32 $0, [$1];"
    return Int32(_asm(Int32.mlir_type, [ptr.toint(loc=loc, ip=ip).ir_value()], text, "=r,l"))


@dsl_user_op
def add_release_i32(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> None:
    """``ptr[0] += value`` with release semantics at GPU scope (``red.release.gpu``): everything
    this thread made visible before it is visible to a CTA that acquires the new value."""
    _asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
    )


# how long `await_flag` waits before it ends the kernel: 2**36 ns, about 69 s
WAIT_LIMIT_NS = 1 << 36


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the launch: the CUDA context is left in error, so the host's next CUDA call raises."""
    _asm(None, [], "trap;", "")


@cute.jit
def await_flag(ptr: cute.Pointer, value: Int32):
    """Spin until the int32 at ``ptr`` is >= ``value`` (acquire, system scope), then fence the
    async proxy so that the TMA loads that follow see what was written before the flag rose.
    A flag that has not risen after ``WAIT_LIMIT_NS`` ends the kernel with ``trap``: an error
    on the host, never a hang."""
    start = cute.arch.globaltimer()
    while load_acquire_i32(ptr, "sys") < value:
        if cute.arch.globaltimer() - start > cutlass.Int64(WAIT_LIMIT_NS):
            trap()
    cute.arch.fence_proxy("async.global")
