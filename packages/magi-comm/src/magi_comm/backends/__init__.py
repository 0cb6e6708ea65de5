"""Backend registry: the seam where transports plug in.

A backend moves the rows described by a validated plan and performs the post-processing. It is
created per :class:`magi_comm.GroupCollective` by a factory ``factory(group, rank, world_size)``.

Built in: ``"a2av"`` (torch.distributed all_to_all_single; gloo and NCCL) and ``"native"``
(NVSHMEM symmetric buffers + a Triton peer-store kernel, one node; module
``magi_comm.backends.native``, which registers itself with :func:`register_backend` on import
without importing nvshmem4py or triton). Selecting a backend that cannot run here (module
missing, no CUDA, no nvshmem4py) raises :class:`BackendUnavailableError` with the reason.

Selection order: the ``backend=`` argument, else the environment variable
``MAGI_COMM_BACKEND``, else ``"a2av"``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .._plan import CastPlan, ReducePlan
from ..work import GroupCollectiveWork

__all__ = [
    "DEFAULT_BACKEND",
    "ENV_BACKEND",
    "BackendUnavailableError",
    "CommBackend",
    "available_backends",
    "create_backend",
    "register_backend",
    "resolve_backend_name",
]

logger = logging.getLogger(__name__)

ENV_BACKEND = "MAGI_COMM_BACKEND"
DEFAULT_BACKEND = "a2av"


class BackendUnavailableError(RuntimeError):
    """The requested backend is known but cannot be loaded in this installation."""


@runtime_checkable
class CommBackend(Protocol):
    """What a transport must provide. Plans and tensors arrive already validated.

    Optional: ``empty_output(shape, dtype)`` / ``free_output(tensor)`` (collective), outputs the
    transport can write into faster (the native backend's symmetric outputs); without them
    :meth:`magi_comm.GroupCollective.empty_output` hands out plain tensors.
    """

    name: str

    def group_cast(
        self, input: torch.Tensor, output: torch.Tensor, plan: CastPlan, async_op: bool
    ) -> GroupCollectiveWork: ...

    def group_reduce(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        plan: ReducePlan,
        async_op: bool,
        reduce_op: str,
        input_lse: torch.Tensor | None,
        output_lse: torch.Tensor | None,
        acc_reduce: bool,
    ) -> GroupCollectiveWork: ...

    def close(self) -> None: ...


BackendFactory = Callable[..., CommBackend]

_lock = threading.Lock()
_factories: dict[str, BackendFactory] = {}
# Backends known by name whose module is imported on first use (it calls register_backend).
_lazy_modules: dict[str, str] = {
    "a2av": "magi_comm.backends.a2av",
    "native": "magi_comm.backends.native",
}


def register_backend(name: str, factory: BackendFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(group, rank, world_size) -> CommBackend`` under ``name``."""
    name = name.strip().lower()
    with _lock:
        if name in _factories and not overwrite and _factories[name] is not factory:
            raise ValueError(f"magi_comm backend {name!r} is already registered")
        _factories[name] = factory
    logger.debug("registered magi_comm backend %r", name)


def available_backends() -> tuple[str, ...]:
    """Names that may be selected (lazily loaded ones included; loading may still fail)."""
    return tuple(sorted(set(_factories) | set(_lazy_modules)))


def resolve_backend_name(backend: str | None) -> str:
    """Argument > ``$MAGI_COMM_BACKEND`` > ``"a2av"``; raises ValueError for an unknown name."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(ENV_BACKEND) or DEFAULT_BACKEND
        source = f"${ENV_BACKEND}"
    if not isinstance(backend, str):
        raise TypeError(f"magi_comm: backend must be a str, got {backend!r} ({type(backend).__name__})")
    name = backend.strip().lower()
    if name not in _factories and name not in _lazy_modules:
        raise ValueError(
            f"magi_comm: unknown backend {backend!r} (from {source}); known: {', '.join(available_backends())}"
        )
    return name


def _factory(name: str) -> BackendFactory:
    factory = _factories.get(name)
    if factory is not None:
        return factory
    module = _lazy_modules[name]
    try:
        importlib.import_module(module)
    except ImportError as e:
        hint = (
            " The NVSHMEM backend is missing from this installation; use backend='a2av' "
            "(the default) or unset MAGI_COMM_BACKEND."
            if name == "native"
            else ""
        )
        raise BackendUnavailableError(
            f"magi_comm backend {name!r} is unavailable: importing {module} failed ({e}).{hint}"
        ) from e
    factory = _factories.get(name)
    if factory is None:
        raise BackendUnavailableError(
            f"magi_comm backend {name!r}: module {module} was imported but did not call "
            f"magi_comm.register_backend({name!r}, ...)"
        )
    return factory


def create_backend(name: str, group, rank: int, world_size: int) -> CommBackend:
    """Instantiate backend ``name`` (already resolved) for one process group."""
    backend = _factory(name)(group, rank, world_size)
    logger.debug("created magi_comm backend %r for rank %d/%d", name, rank, world_size)
    return backend
