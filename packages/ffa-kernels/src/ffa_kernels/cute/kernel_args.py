"""The forward kernel's argument list, and the per-call host path that feeds it.

The compiled kernel takes 25 arguments: 10 global-memory pointers, 8 int32 sizes, 3 float32
scales, an int32 flag word, the two int32 of the wait for late key/value rows and a CUDA
stream. ``arg_spec`` names their kinds once; the compile placeholders and both launchers below
are derived from it.

Why a launcher of our own: calling a compiled CuTe DSL function marshals every argument anew
(a DSL object per pointer and scalar, adapters, type casts, then a list of the addresses of C
values): about 80 µs of Python per launch on a slow host core, which is the whole kernel time of
a short call (an 8k sliding window runs ~0.15 ms). The kinds never change, so `PackedLauncher`
keeps one C value per argument and, per call, only stores the new numbers into them before
handing the fixed address list to the compiled host function. It checks once, against the
DSL's own marshalling of sentinel values, that the two agree, and otherwise `DslLauncher`
(the DSL's regular path) is used.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


# Byte alignment the accumulate kernel assumes of the caller's accumulators (see arg_spec).
ACCUMULATOR_ALIGN = {"out_acc": 16, "lse_acc": 4, "max_logits_acc": 4}


def arg_spec(accumulate: bool) -> list[tuple[str, str, int]]:
    """(kind, element, alignment) per argument; kind in ptr / i32 / f32 / stream; a pointer's
    element is "in" (the q/k/v dtype), "f32" or "i32".

    Order: pointers q, k, v, out, lse, work, entries, sink_lse, max_logits, ready (an int32
    flag word, 4-byte aligned); int32 total_q, total_k, heads_q, heads_k, num_work,
    num_entries, k_row_stride, v_row_stride; float32 scale_log2, score_premul, softmax_scale;
    int32 flags, ready_value, ready_row (read only by the ``wait_kv`` kernels); the stream.
    accumulate: out is the float32 accumulator, and lse / max_logits are the caller's tensors,
    only assumed 4-byte aligned.
    """
    align = ACCUMULATOR_ALIGN if accumulate else dict.fromkeys(ACCUMULATOR_ALIGN, 16)
    ptrs = [
        ("ptr", "in", 16),
        ("ptr", "in", 16),
        ("ptr", "in", 16),
        ("ptr", "f32" if accumulate else "in", align["out_acc"]),
        ("ptr", "f32", align["lse_acc"]),
        ("ptr", "i32", 16),
        ("ptr", "i32", 16),
        ("ptr", "f32", 16),
        ("ptr", "f32", align["max_logits_acc"]),
        ("ptr", "i32", 4),
    ]
    scalars = [("i32", "", 0)] * 8 + [("f32", "", 0)] * 3 + [("i32", "", 0)] * 3
    return ptrs + scalars + [("stream", "", 0)]


def dsl_args(spec, values: Sequence[Any], elem_dtype) -> list:
    """The DSL objects for ``values`` (ints for pointers and the stream handle, numbers else)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    elems = {"in": elem_dtype, "f32": cutlass.Float32, "i32": cutlass.Int32}
    out: list[Any] = []
    for (kind, elem, align), val in zip(spec, values, strict=True):
        if kind == "ptr":
            out.append(make_ptr(elems[elem], val, cute.AddressSpace.gmem, assumed_align=align))
        elif kind == "i32":
            out.append(cutlass.Int32(val))
        elif kind == "f32":
            out.append(cutlass.Float32(val))
        else:
            out.append(cuda.CUstream(val))
    return out


class DslLauncher:
    """Launch through the DSL's own argument marshalling (the reference path)."""

    def __init__(self, fn, spec, elem_dtype):
        self.fn, self.spec, self.elem_dtype = fn, spec, elem_dtype

    def __call__(self, values: Sequence[Any]) -> None:
        self.fn(*dsl_args(self.spec, values, self.elem_dtype))


_CTYPE: dict[str, type[ctypes._SimpleCData[Any]]] = {
    "ptr": ctypes.c_void_p,
    "stream": ctypes.c_void_p,
    "i32": ctypes.c_int32,
    "f32": ctypes.c_float,
}


class PackedLauncher:
    """Launch with one persistent C value per argument (see the module docstring)."""

    def __init__(self, fn, spec):
        self.fn = fn
        self.slots = [_CTYPE[kind]() for kind, _, _ in spec]
        # as c_void_p objects, which the DSL's run_compiled_program stores into its packed array
        # as they are; plain ints it converts one by one on every launch (~11 µs per launch of 30
        # arguments on the 2-core development host, against ~3.5 µs)
        self.addrs = [ctypes.c_void_p(ctypes.addressof(s)) for s in self.slots]
        # the slots are shared: one thread fills and launches at a time
        self.lock = threading.Lock()

    def __call__(self, values: Sequence[Any]) -> None:
        with self.lock:
            for slot, val in zip(self.slots, values):
                slot.value = val
            self.fn.run_compiled_program(self.addrs)


def current_stream_handle(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as the raw handle the kernels take: what
    ``torch.cuda.current_stream(device).cuda_stream`` gives, without building a Stream object
    (and resolving the device) per launch, which the host path did three times per training
    step. Falls back to that public call where torch lacks the raw accessor."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device).cuda_stream
    return raw(device.index if device.index is not None else torch.cuda.current_device())


def _sentinels(spec) -> list:
    vals: list[float] = []
    for i, (kind, _, _) in enumerate(spec):
        if kind in ("ptr", "stream"):
            vals.append(0x7F0000001000 + 0x1000 * i)  # distinct, 4 KiB aligned
        elif kind == "i32":
            vals.append(1000 + i)
        else:
            vals.append(0.5 + i)
    return vals


def read_c_values(spec, addrs) -> list:
    """The C values at ``addrs`` (one address per argument of ``spec``: ints or c_void_p), read
    with each argument's C type."""
    out = []
    for i, ((kind, _, _), addr) in enumerate(zip(spec, addrs, strict=True)):
        at = addr.value if isinstance(addr, ctypes.c_void_p) else int(addr)
        if not at:
            raise ValueError(f"argument {i}: null address")
        out.append(_CTYPE[kind].from_address(at).value)
    return out


def packed_matches_dsl(fn, spec, elem_dtype) -> bool:
    """Whether the DSL marshals ``spec`` as one address of a C value per argument, as
    `PackedLauncher` does (checked on distinct sentinel values; nothing is launched)."""
    try:
        vals = _sentinels(spec)
        # the DSL objects own the C values the addresses point at: keep them alive while reading
        args = tuple(dsl_args(spec, vals, elem_dtype))
        exe_args, _adapted = fn.execution_args.generate_execution_args(args, {})
        if len(exe_args) != len(spec):
            return False
        for (kind, _, _), seen, val in zip(spec, read_c_values(spec, exe_args), vals):
            if (seen != val) if kind != "f32" else abs(seen - val) > 1e-6:
                return False
        return callable(getattr(fn, "run_compiled_program", None))
    except Exception as exc:  # any change in the DSL's internals: use its own path
        logger.debug("ffa_kernels: packed launch unavailable (%s)", exc)
        return False


def make_launcher(fn, spec, elem_dtype) -> Callable[[Sequence[Any]], None]:
    """`PackedLauncher` when it provably feeds the kernel the same arguments, else `DslLauncher`."""
    if packed_matches_dsl(fn, spec, elem_dtype):
        return PackedLauncher(fn, spec)
    logger.info("ffa_kernels: using the DSL's argument marshalling for launches (slower host path)")
    return DslLauncher(fn, spec, elem_dtype)
