"""Key/value rows that are still arriving when a forward is issued (``ffa_forward``'s
``kv_ready``): the checks, and the wait of the reference backend.

A caller that receives part of K/V from elsewhere (magi-dist's remote rows, written by a copy
engine or a peer GPU) can issue the forward before they are complete: the kernel reads the rows
from ``first_row`` on only after the int32 word ``flag`` holds at least ``value``, and the rows
before them at once. Whoever writes the rows raises the word once they are complete and
visible (a stream write after the copy on its stream, a release store by a peer).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["KVReady", "check_kv_ready", "wait_on_stream"]


class KVReady(NamedTuple):
    """Where and when the late key/value rows of a forward call are complete.

    Attributes:
        flag: int32 tensor (at least one element) on k's device: its first element is the word.
        value: the word's value, in ``[0, 2**31)``, from which rows ``first_row:`` are complete.
        first_row: the first late row, in ``[0, Tk]`` (``Tk``: nothing is late).
    """

    flag: torch.Tensor
    value: int
    first_row: int


def check_kv_ready(kv_ready, k: torch.Tensor) -> KVReady | None:
    """``kv_ready`` as a `KVReady` (a 3-tuple is taken), checked against k ``(Tk, Hk, D)``;
    None stays None. Raises TypeError / ValueError naming ``kv_ready`` and the field."""
    if kv_ready is None:
        return None
    if not isinstance(kv_ready, tuple) or len(kv_ready) != 3:
        raise TypeError(f"kv_ready: expected KVReady(flag, value, first_row), got {kv_ready!r}")
    flag, value, first_row = kv_ready
    if not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.numel() < 1:
        seen = (
            f"{flag.dtype} tensor of {flag.numel()} elements"
            if isinstance(flag, torch.Tensor)
            else type(flag)
        )
        raise TypeError(f"kv_ready.flag: expected an int32 tensor of at least one element, got {seen}")
    if flag.device != k.device:
        raise ValueError(f"kv_ready.flag: must be on k's device {k.device}, got {flag.device}")
    for name, v, hi in (("value", value, 2**31 - 1), ("first_row", first_row, k.shape[0])):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"kv_ready.{name}: expected an int, got {type(v).__name__}")
        if not 0 <= v <= hi:
            raise ValueError(f"kv_ready.{name}: must lie in [0, {hi}], got {v}")
    return KVReady(flag, value, first_row)


def wait_on_stream(kv_ready: KVReady | None, total_k: int) -> None:
    """What the reference backend does instead of the kernel's wait (k has ``total_k`` rows):
    on CUDA, the current stream waits until the word is >= ``value`` (``cuStreamWaitValue32``;
    needs cuda-python); on the CPU, where nothing runs beside the call, the word must hold it
    already. Nothing when no row is late."""
    if kv_ready is None or kv_ready.first_row >= total_k:
        return
    flag = kv_ready.flag
    if flag.device.type != "cuda":
        seen = int(flag.view(-1)[0])
        if seen < kv_ready.value:
            raise ValueError(
                f"kv_ready.flag: holds {seen} < value {kv_ready.value} on the CPU, where nothing "
                "runs beside the call to raise it"
            )
        return
    try:
        import cuda.bindings.driver as drv
    except ImportError as exc:
        raise RuntimeError(
            "kv_ready: the reference backend waits on CUDA with cuda-python (cuda.bindings)"
        ) from exc
    stream = torch.cuda.current_stream(flag.device).cuda_stream
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    (err,) = drv.cuStreamWaitValue32(
        drv.CUstream(stream), drv.CUdeviceptr(flag.data_ptr()), kv_ready.value, geq
    )
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"kv_ready: cuStreamWaitValue32 failed: {err}")
