"""The ``native`` backend: NVSHMEM symmetric buffers + Triton copy kernels, one node.

Importing this package only registers the backend; nvshmem4py, cuda.core and triton are imported
when the first :class:`NativeBackend` is created (``pip install magi-comm[native]``).

Design, signalling protocol and a map of the modules: ``packages/magi-comm/docs/native.md``.
"""

from __future__ import annotations

from .. import BackendUnavailableError, register_backend  # noqa: F401  (an attribute here before)
from .backend import NativeBackend
from .config import (
    ENV_BUFFER_MB,
    ENV_COPY_ENGINE,
    ENV_DEVICE_HANDSHAKE,
    ENV_FUSED_REDUCE,
    ENV_KNOWN_ARMS,
    ENV_MAX_PROGRAMS,
    ENV_ONE_LAUNCH_PULL,
    ENV_OVERLAP_CHUNK_KB,
    ENV_REDUCE_PROGRAMS,
    ENV_REDUCE_ROWS,
    ENV_REDUCE_WARPS,
    ENV_STREAM_PRIORITY,
    ENV_WAIT_TIMEOUT,
    OVERLAP_MIN_CHUNKS,  # noqa: F401  (an attribute here before)
    NativeConfig,
)
from .runtime import shutdown

__all__ = [
    "ENV_BUFFER_MB",
    "ENV_COPY_ENGINE",
    "ENV_DEVICE_HANDSHAKE",
    "ENV_FUSED_REDUCE",
    "ENV_KNOWN_ARMS",
    "ENV_MAX_PROGRAMS",
    "ENV_ONE_LAUNCH_PULL",
    "ENV_OVERLAP_CHUNK_KB",
    "ENV_REDUCE_PROGRAMS",
    "ENV_REDUCE_ROWS",
    "ENV_REDUCE_WARPS",
    "ENV_STREAM_PRIORITY",
    "ENV_WAIT_TIMEOUT",
    "NativeBackend",
    "NativeConfig",
    "shutdown",
]

register_backend("native", NativeBackend)
