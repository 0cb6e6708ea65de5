"""Backend selection: the CuTe DSL kernels on Hopper, the torch reference everywhere else.

``FFA_BACKEND`` (read at every call, so it can be changed at run time):

- ``reference``: always the pure-torch reference.
- ``cute``: always the CuTe DSL kernels; an error if they cannot run (CPU tensor, import failure).
- unset or empty: ``cute`` for float16/bfloat16 tensors on a CUDA device of compute capability 9.x
  when ``ffa_kernels.cute`` imports and exposes ``cute_forward``; the reference otherwise.

``ffa_kernels.cute`` is imported lazily (only when a CUDA tensor asks for it), so CPU-only
installs never touch the CuTe DSL. In the default mode a ``NotImplementedError`` raised by
``cute_forward`` (a configuration the kernel does not support: head dim, dtype, ...) also falls
back to the reference. The backward follows the same choice (``cute_backward_stage``); a
configuration its kernel does not serve falls back the same way.

Every fallback goes through `fallback` (the one place that decides): a CUDA call the kernels do
not serve warns once per reason (`BackendFallbackWarning`, naming the reason and the backend used)
and runs on the reference; with ``FFA_BACKEND=cute`` it raises ``RuntimeError`` naming the reason
instead. CPU tensors are not a fallback (the kernels are CUDA-only): no warning.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

__all__ = [
    "ENV_VAR",
    "BackendFallbackWarning",
    "fallback",
    "load_cute",
    "select_backward_backend",
    "select_forward_backend",
]

ENV_VAR = "FFA_BACKEND"
REFERENCE = "reference"
CUTE = "cute"
_CHOICES = (REFERENCE, CUTE)
_CUTE_DTYPES = (torch.float16, torch.bfloat16)

_warned: set[str] = set()


class _Unset(enum.Enum):
    UNSET = enum.auto()


_UNSET = _Unset.UNSET
_cute: ModuleType | _Unset | None = _UNSET  # cached result of load_cute(): module, or None when unavailable
_cute_error: str = ""


class BackendFallbackWarning(UserWarning):
    """A CUDA call that the CuTe kernels do not serve ran on the (much slower) reference backend.

    Issued once per reason. ``FFA_BACKEND=reference`` chooses the reference on purpose (no
    warning); ``FFA_BACKEND=cute`` turns the fallback into a ``RuntimeError``.
    """


def fallback(reason: str, cause: BaseException | None = None) -> str:
    """The one decision for a call the CuTe backend cannot serve: raise ``RuntimeError`` naming
    ``reason`` under ``FFA_BACKEND=cute`` (chained to ``cause``, e.g. the kernel's
    ``NotImplementedError``), else warn once per reason and return ``"reference"``."""
    if forced_backend() == CUTE:
        raise RuntimeError(
            f"{ENV_VAR}=cute, but the CuTe backend cannot serve this call: {reason}"
        ) from cause
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"ffa_kernels: the CuTe backend cannot serve this call ({reason}); it runs on the "
            f"reference backend (much slower). Set {ENV_VAR}=reference to choose the reference "
            f"without this warning, or {ENV_VAR}=cute to make this an error.",
            BackendFallbackWarning,
            stacklevel=2,
        )
    return REFERENCE


def reset_cache() -> None:
    """Forget the cached import of ``ffa_kernels.cute``, the choices made and the warn-once
    memory (for tests)."""
    global _cute, _cute_error
    _cute, _cute_error = _UNSET, ""
    _capability.cache_clear()
    _warned.clear()
    _chosen.clear()


# (direction, FFA_BACKEND's raw value, CUDA device, dtype) -> the backend chosen: every call asks,
# and nothing it depends on changes but the variable (part of the key) and what reset_cache
# forgets. CPU calls choose afresh (cheap there, and tests swap the backend's parts on the CPU).
_chosen: dict[tuple, str] = {}


def load_cute() -> ModuleType | None:
    """Import ``ffa_kernels.cute`` once; return it if it exposes ``cute_forward``, else None."""
    global _cute, _cute_error
    if _cute is _UNSET:
        try:
            mod = importlib.import_module("ffa_kernels.cute")
        except ImportError as exc:
            _cute, _cute_error = None, f"import failed: {exc}"
        else:
            if callable(getattr(mod, "cute_forward", None)):
                _cute = mod
            else:
                _cute, _cute_error = None, "ffa_kernels.cute does not expose cute_forward"
    return _cute


def forced_backend() -> str | None:
    """The backend named by ``FFA_BACKEND``, or None when it is unset/empty."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR} must be 'reference' or 'cute' (or unset), got {value!r}")
    return value


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    # asked on every forward call; a device's capability does not change
    return torch.cuda.get_device_capability(device)


def _cute_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the CuTe kernels cannot serve tensors of this CUDA device and dtype, or None."""
    major, minor = _capability(device)
    if major != 9:
        return f"compute capability {major}.{minor} of {device} is not 9.x (sm90)"
    if dtype not in _CUTE_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"{name} inputs (the kernels take float16/bfloat16; torch.autocast casts to them)"
    if load_cute() is None:
        return f"the CuTe backend is unavailable: {_cute_error}"
    return None


def _kept_choice(direction: str, device: torch.device, dtype: torch.dtype, select) -> str:
    """``select(device, dtype)``, kept in ``_chosen`` for CUDA devices. A fallback's choice is
    kept (its warning was given, once); a forced but impossible choice raises and is not."""
    if device.type != "cuda":
        return select(device, dtype)
    key = (direction, os.environ.get(ENV_VAR), device, dtype)
    choice = _chosen.get(key)
    if choice is None:
        choice = _chosen[key] = select(device, dtype)
    return choice


def select_forward_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``"cute"`` or ``"reference"`` for a forward on tensors of this device and dtype."""
    return _kept_choice("forward", device, dtype, _select_forward)


def _select_forward(device: torch.device, dtype: torch.dtype) -> str:
    forced = forced_backend()
    if forced == REFERENCE:
        return REFERENCE
    if device.type != "cuda":
        if forced == CUTE:
            raise RuntimeError(f"{ENV_VAR}=cute needs CUDA tensors, got device {device}")
        return REFERENCE  # CPU and other devices: the reference is the backend, not a fallback
    reason = _cute_unavailable_reason(device, dtype)
    return CUTE if reason is None else fallback(reason)


def select_backward_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``"cute"`` or ``"reference"`` for a backward: the forward's choice, where the CuTe module
    also has the backward kernel (``cute_backward_stage``)."""
    return _kept_choice("backward", device, dtype, _select_backward)


def _select_backward(device: torch.device, dtype: torch.dtype) -> str:
    choice = select_forward_backend(device, dtype)
    if choice == CUTE and not callable(getattr(load_cute(), "cute_backward_stage", None)):
        return fallback("the CuTe module has no backward kernel (cute_backward_stage)")
    return choice
