"""Backend selection: the CuTe DSL kernels on Hopper, the torch reference everywhere else.

``FFA_BACKEND`` (read at every call, so it can be changed at run time):

- ``reference``: always the pure-torch reference.
- ``cute``: always the CuTe DSL kernels; an error if they cannot run (CPU tensor, import failure).
- unset or empty: ``cute`` for float16/bfloat16 tensors on a CUDA device of compute capability 9.x
  when ``ffa_kernels.cute`` imports and exposes ``cute_forward``; the reference otherwise.

``ffa_kernels.cute`` is imported lazily (only when a CUDA tensor asks for it), so CPU-only
installs never touch the CuTe DSL. In the default mode a ``NotImplementedError`` raised by
``cute_forward`` (a configuration the kernel does not support) also falls back to the reference.
Each reason for falling back is logged once. The backward follows the same choice
(``cute_backward_stage``); a configuration its kernel does not serve falls back the same way.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType

import torch

__all__ = ["ENV_VAR", "load_cute", "select_backward_backend", "select_forward_backend"]

ENV_VAR = "FFA_BACKEND"
REFERENCE = "reference"
CUTE = "cute"
_CHOICES = (REFERENCE, CUTE)
_CUTE_DTYPES = (torch.float16, torch.bfloat16)

_log = logging.getLogger(__name__)
_logged: set[str] = set()
_UNSET = object()
_cute: object = _UNSET  # cached result of load_cute(): module, or None when unavailable
_cute_error: str = ""


def log_once(key: str, msg: str, *args: object) -> None:
    """Log ``msg`` at INFO level the first time ``key`` is seen in this process."""
    if key not in _logged:
        _logged.add(key)
        _log.info(msg, *args)


def reset_cache() -> None:
    """Forget the cached import of ``ffa_kernels.cute`` and the log-once memory (for tests)."""
    global _cute, _cute_error
    _cute, _cute_error = _UNSET, ""
    _capability.cache_clear()
    _logged.clear()


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
    return _cute  # type: ignore[return-value]


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


def select_forward_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``"cute"`` or ``"reference"`` for a forward on tensors of this device and dtype."""
    forced = forced_backend()
    if forced == REFERENCE:
        return REFERENCE
    if forced == CUTE:
        if device.type != "cuda":
            raise RuntimeError(f"{ENV_VAR}=cute needs CUDA tensors, got device {device}")
        if load_cute() is None:
            raise RuntimeError(f"{ENV_VAR}=cute but the CuTe backend is unavailable ({_cute_error})")
        return CUTE
    if device.type != "cuda":
        return REFERENCE
    major, minor = _capability(device)
    if major != 9:
        log_once(
            f"cc{major}{minor}",
            "ffa_kernels: compute capability %d.%d is not 9.x; using the reference backend",
            major,
            minor,
        )
        return REFERENCE
    if dtype not in _CUTE_DTYPES:
        log_once(
            f"dtype-{dtype}",
            "ffa_kernels: the CuTe backend takes float16/bfloat16, got %s; using the reference backend",
            dtype,
        )
        return REFERENCE
    if load_cute() is None:
        log_once(
            "cute-missing",
            "ffa_kernels: CuTe backend unavailable (%s); using the reference backend",
            _cute_error,
        )
        return REFERENCE
    return CUTE


def select_backward_backend(device: torch.device, dtype: torch.dtype) -> str:
    """``"cute"`` or ``"reference"`` for a backward: the forward's choice, where the CuTe module
    also has the backward kernel (``cute_backward_stage``)."""
    choice = select_forward_backend(device, dtype)
    if choice == CUTE and not callable(getattr(load_cute(), "cute_backward_stage", None)):
        log_once(
            "cute-no-backward", "ffa_kernels: no CuTe backward; the backward runs on the reference backend"
        )
        return REFERENCE
    return choice
