"""What the native backend takes from its process, in one object: the seam the CPU tests plug into.

The backend reaches CUDA streams and events, torch.distributed, nvshmem4py and its Triton kernels
only through the platform it is given (``NativeBackend(..., platform=...)``; by default
:func:`process_platform`), never through module globals. :mod:`magi_comm.testing.native_fake`
installs one platform per simulated rank with :func:`use_platform` and so runs every host path
of the backend on the CPU (``packages/magi-comm/docs/native.md``, "Testing").
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

from .config import unavailable

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["CudaPlatform", "process_platform", "use_platform"]


class CudaPlatform:
    """The real platform: torch's CUDA API, torch.distributed, nvshmem4py, the Triton kernels.

    A stand-in provides the same attributes and methods.

    Attributes:
        cuda: ``torch.cuda``; the backend uses ``is_available``, ``current_device``,
            ``Stream``, ``Event``, ``current_stream``, ``stream`` and ``synchronize``.
        dist: ``torch.distributed``; the backend uses ``get_process_group_ranks``,
            ``get_global_rank``, ``broadcast_object_list``, ``all_reduce`` and ``ReduceOp``.
        lock: guards ``runtime`` and its per-group states.
        runtime: the process's NVSHMEM runtime once a backend bootstrapped it, else None (one
            per process: a platform stands for a process).
    """

    def __init__(self) -> None:
        self.cuda = torch.cuda
        self.dist = torch.distributed
        self.lock = threading.Lock()
        self.runtime: Runtime | None = None
        self._driver: Any = None  # cuda.bindings.driver, imported by the first memcpy

    def device(self, index: int) -> torch.device:
        """The device of CUDA ordinal ``index``."""
        return torch.device("cuda", index)

    def device_memory(self, index: int) -> int:
        """Bytes of memory of CUDA device ``index`` (sizes the default symmetric heap)."""
        return int(torch.cuda.get_device_properties(index).total_memory)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Keep ``tensor``'s memory from reuse until the work enqueued on ``stream`` is done."""
        tensor.record_stream(stream)

    def memcpy(self, dst: int, src: int, nbytes: int, stream) -> None:
        """Enqueue on ``stream`` a copy of ``nbytes`` from device address ``src`` to ``dst``
        (local, or a peer's memory mapped over NVLink) by the copy engines
        (``cuMemcpyAsync``: unified addressing finds both ends). A kernel enqueued after it
        on ``stream`` starts once the copy is complete, so its system-scope release and
        signal (the send launch's) make the rows visible to the peer it signals: the ordering
        the copy-engine send relies on (``NativeConfig.copy_engine``)."""
        if self._driver is None:
            import cuda.bindings.driver

            self._driver = cuda.bindings.driver
        drv = self._driver
        handle = (stream if stream is not None else torch.cuda.current_stream()).cuda_stream
        (err,) = drv.cuMemcpyAsync(drv.CUdeviceptr(dst), drv.CUdeviceptr(src), nbytes, drv.CUstream(handle))
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"magi_comm native: cuMemcpyAsync of {nbytes} bytes failed: {err}")

    def nvshmem(self, heap_bytes: int):
        """``(nvshmem.core, nvshmem.bindings, cuda.core.Device)``, imported on first use. The
        symmetric heap gets ``heap_bytes`` unless ``$NVSHMEM_SYMMETRIC_SIZE`` is set (NVSHMEM
        reads it at init). Raises ImportError when nvshmem4py or cuda.core is missing."""
        import nvshmem.bindings as bindings
        import nvshmem.core as core
        from cuda.core import Device

        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes))
        return core, bindings, Device

    def kernels(self):
        """The kernel module (:mod:`.kernels`: ``CopyLaunch``, ``launch_reduce``,
        ``reduce_tile_rows``), imported on first use: it needs triton."""
        try:
            from . import kernels
        except ImportError as e:
            raise unavailable(f"triton cannot be imported ({e})") from e
        return kernels


_PROCESS = CudaPlatform()
_installed: contextvars.ContextVar[CudaPlatform | None] = contextvars.ContextVar(
    "magi_comm_native_platform", default=None
)


def process_platform() -> CudaPlatform:
    """This process's platform, the default of every native backend and of
    :func:`~magi_comm.backends.native.shutdown`: the one :func:`use_platform` installed in the
    current context (a simulated process of the CPU tests), else the real one."""
    return _installed.get() or _PROCESS


@contextlib.contextmanager
def use_platform(platform) -> Iterator:
    """Context: :func:`process_platform` returns ``platform`` (an object with the attributes and
    methods of :class:`CudaPlatform`) in this context (thread / task) until it exits."""
    token = _installed.set(platform)
    try:
        yield platform
    finally:
        _installed.reset(token)
