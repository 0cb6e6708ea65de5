"""Key/value rows that are still arriving when a forward is issued (``ffa_forward``'s
``kv_ready``): the checks, and the wait of the reference backend.

A caller that receives part of K/V from elsewhere (magi-dist's remote rows, written by a copy
engine or a peer GPU) can issue the forward before they are complete: the kernel reads the rows
from ``first_row`` on only after the int32 word ``flag`` holds at least ``value``, and the rows
before them at once. Whoever writes the rows raises the word once they are complete and
visible (a stream write after the copy on its stream, a release store by a peer), and must need
no SM to do so: the waiting kernel may hold every SM.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from ._validate import reads_in_place

__all__ = [
    "KVReady",
    "check_kv_ready",
    "refuse_copies",
    "stream_wait_value32",
    "stream_write_value32",
    "wait_on_stream",
]


class KVReady(NamedTuple):
    """Where and when the late key/value rows of a forward call are complete.

    Attributes:
        flag: int32 tensor (at least one element) on k's device: its first element is the word,
            whose values stay in ``[0, 2**31)`` (the kernel compares them signed, the
            reference's stream wait cyclically: the two agree there).
        value: the word's value, in ``[0, 2**31)``, from which rows ``first_row:`` are complete.
        first_row: the first late row, in ``[0, Tk]`` (``Tk``: nothing is late).
    """

    flag: torch.Tensor
    value: int
    first_row: int


def check_kv_ready(kv_ready, k: torch.Tensor, v: torch.Tensor) -> KVReady | None:
    """``kv_ready`` as a `KVReady` (a 3-tuple is taken), checked against the caller's k
    ``(Tk, Hk, D)`` and v; None, and a call with no late row (``first_row == Tk``), give None.
    k and v must be read where they lie (dense rows a multiple of 16 bytes apart, 16-byte
    aligned bases): a copy made before the kernel would read the late rows before they arrive.
    Raises TypeError / ValueError naming ``kv_ready`` and the field."""
    if kv_ready is None:
        return None
    if not isinstance(kv_ready, tuple) or len(kv_ready) != 3:
        raise TypeError(f"kv_ready: expected KVReady(flag, value, first_row), got {kv_ready!r}")
    flag, value, first_row = kv_ready
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.numel() < 1:
        seen = (
            f"{flag.dtype} tensor of {flag.numel()} elements"
            if isinstance(flag, torch.Tensor)
            else type(flag).__name__
        )
        raise TypeError(f"kv_ready.flag: expected an int32 tensor of at least one element, got {seen}")
    if flag.device != k.device:
        raise ValueError(f"kv_ready.flag: must be on k's device {k.device}, got {flag.device}")
    value = _index("value", value, 2**31 - 1)
    first_row = _index("first_row", first_row, k.shape[0])
    if first_row == k.shape[0]:
        return None
    refuse_copies(k, v)
    return KVReady(flag, value, first_row)


def refuse_copies(k: torch.Tensor, v: torch.Tensor) -> None:
    """With late rows, k and v must be read where they lie (dense rows a multiple of 16 bytes
    apart, 16-byte aligned bases): a copy made before the kernel would read the late rows before
    they arrive. The caller's check and the CuTe launch, where such a copy would be made, both
    call it. Raises ValueError naming the tensor, its strides and address."""
    for name, t in (("k", k), ("v", v)):
        if not reads_in_place(t):
            raise ValueError(
                f"kv_ready: {name} must be read in place (dense rows a multiple of 16 bytes apart, "
                f"a 16-byte aligned base), got strides {tuple(t.stride())} at address {t.data_ptr():#x}"
            )


def _index(name: str, x, hi: int) -> int:
    """``x`` as an int in ``[0, hi]`` (any integer type but bool), else an error naming it."""
    if isinstance(x, bool):
        raise TypeError(f"kv_ready.{name}: expected an int, got bool")
    try:
        i = operator.index(x)
    except TypeError:
        raise TypeError(f"kv_ready.{name}: expected an int, got {type(x).__name__}") from None
    if not 0 <= i <= hi:
        raise ValueError(f"kv_ready.{name}: must lie in [0, {hi}], got {i}")
    return i


def wait_on_stream(kv_ready: KVReady | None) -> None:
    """What the reference backend does instead of the kernel's wait: on CUDA, the current stream
    waits until the word is >= ``value`` (``cuStreamWaitValue32``; needs cuda-python), and the
    reference's input checks then block the host until it does, so the writer must be enqueued
    before the call; on the CPU, where nothing runs beside the call, the word must hold it
    already."""
    if kv_ready is None:
        return
    flag = kv_ready.flag
    if flag.device.type != "cuda":
        seen = int(flag.reshape(-1)[0])
        if seen < kv_ready.value:
            raise ValueError(
                f"kv_ready.flag: holds {seen} < value {kv_ready.value} on the CPU, where nothing "
                "runs beside the call to raise it"
            )
        return
    try:
        stream_wait_value32(torch.cuda.current_stream(flag.device), flag, kv_ready.value)
    except RuntimeError as exc:  # the caller passed kv_ready, not a stream: name it
        raise RuntimeError(f"kv_ready: the reference backend's wait on the stream: {exc}") from exc


# Stream memory operations: the GPU's front end runs them, not an SM, so they make progress while
# a kernel that waits for a word holds every SM. The tools (bench_kv_ready, bench_pull_floor)
# raise and await their words with these too: one wrapper of the driver calls.


def stream_wait_value32(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
    """Enqueue on ``stream`` a wait until ``word``'s first element, an int32 in device memory
    (this GPU's or a peer's it can reach), is >= ``value``, compared cyclically
    (``cuStreamWaitValue32``). Needs cuda-python; a ``word`` that is not an int32 CUDA tensor
    is a ValueError, a driver error a RuntimeError naming the call."""
    drv = _driver("cuStreamWaitValue32", word)
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    (err,) = drv.cuStreamWaitValue32(
        drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(word.data_ptr()), value, geq
    )
    _check(drv, "cuStreamWaitValue32", err, word, value)


def stream_write_value32(stream: torch.cuda.Stream, word: torch.Tensor, value: int) -> None:
    """Enqueue on ``stream`` a write of ``value`` into ``word``'s first element, an int32 in
    device memory (this GPU's or a peer's it can reach), once the work before it on ``stream``
    is done (``cuStreamWriteValue32``). Needs cuda-python; a ``word`` that is not an int32 CUDA
    tensor is a ValueError, a driver error a RuntimeError naming the call."""
    drv = _driver("cuStreamWriteValue32", word)
    default = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    (err,) = drv.cuStreamWriteValue32(
        drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(word.data_ptr()), value, default
    )
    _check(drv, "cuStreamWriteValue32", err, word, value)


def _driver(call: str, word: torch.Tensor):
    """cuda-python's driver module, once ``word`` is known to be an int32 CUDA tensor (the
    driver would take a host address too, and compare 32 bits of whatever lies there)."""
    if not isinstance(word, torch.Tensor) or word.dtype != torch.int32 or word.device.type != "cuda":
        seen = f"{word.dtype} on {word.device}" if isinstance(word, torch.Tensor) else type(word).__name__
        raise ValueError(f"word: {call} needs an int32 CUDA tensor, got {seen}")
    try:
        import cuda.bindings.driver as drv
    except ImportError as exc:
        raise RuntimeError(f"{call} needs cuda-python (cuda.bindings)") from exc
    return drv


def _check(drv, call: str, err, word: torch.Tensor, value: int) -> None:
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(
            f"{call}(word at {word.data_ptr():#x} on {word.device}, value {value}) failed: {err}"
        )
