"""JIT compile cache of the sm90 kernels: in memory, then on disk, then ``cute.compile``.

The disk cache lives under ``$FFA_CACHE_DIR`` (default ``~/.cache/ffa_kernels``) in a folder
named by a hash of every Python source of this package folder and the DSL version, so any
change to a kernel, or to a device helper it imports, compiles afresh (a hand-kept list of
device files could miss a new one and reuse a stale kernel).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

_COMPILED: dict[tuple, object] = {}
_LOCK = threading.Lock()


def cutlass_modules():
    """``(cutlass, cutlass.cute)``, imported with the target named first."""
    # The kernels target sm_90a only. Naming the arch before cutlass is first imported lets
    # compilation and the disk-cache export work on machines without a GPU too.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def dtype_of(torch_dtype):
    """The DSL element type of a 16-bit torch dtype."""
    cutlass, _ = cutlass_modules()
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[torch_dtype]


def arch() -> str:
    return os.environ.get("CUTE_DSL_ARCH", "sm_90a")


def placeholder_args(spec, elem_dtype) -> list:
    """Arguments for cute.compile from an argument spec (launcher.arg_spec's format): null
    pointers and dummy sizes, all runtime values."""
    from .launcher import dsl_args

    placeholders = [0 if kind in ("ptr", "stream") else 1 for kind, _, _ in spec]
    return dsl_args(spec, placeholders, elem_dtype)


@functools.cache
def source_hash() -> str:
    """Hash of every ``.py`` file of this folder (sorted by name) and of the DSL version."""
    import cutlass

    h = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(str(getattr(cutlass, "__version__", "")).encode())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("FFA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ffa_kernels")
    return pathlib.Path(root)


def forget(key: tuple | None = None) -> None:
    """Drop one compiled kernel (or all, with None) from the in-memory cache (for tests)."""
    if key is None:
        _COMPILED.clear()
    else:
        _COMPILED.pop(key, None)


def compiled_kernel(
    key: tuple,
    name_prefix: str,
    build: Callable[[], object],
    compile_args: Callable[[], list],
    what: str,
    *,
    use_disk_cache: bool = True,
):
    """The compiled function for ``key``: memory cache, then disk cache, then compile
    ``build()`` with ``compile_args()`` (and export it to the disk cache). ``what`` names the
    kernel in the log line of a first compile."""
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is not None:
            return fn
        _, cute = cutlass_modules()
        kdir = None
        name = name_prefix + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        if use_disk_cache:
            kdir = cache_dir() / source_hash()
            obj = kdir / f"{name}.o"
            if obj.exists():
                try:
                    from cutlass.cute.runtime import load_module

                    fn = getattr(load_module(str(obj)), name)
                    _COMPILED[key] = fn
                    return fn
                except Exception as exc:  # corrupt / incompatible file: recompile
                    logger.warning("ffa_kernels: could not load cached kernel %s (%s); recompiling", obj, exc)
        t0 = time.perf_counter()
        fn = cute.compile(build(), *compile_args(), options=f"--gpu-arch {arch()}")
        logger.info("ffa_kernels: compiled %s %s in %.1f s", what, name, time.perf_counter() - t0)
        if kdir is not None:
            try:
                kdir.mkdir(parents=True, exist_ok=True)
                tmp = kdir / f".{name}.{os.getpid()}"
                tmp.mkdir(exist_ok=True)
                fn.export_to_c(str(tmp), name, function_prefix=name)
                for f in tmp.iterdir():
                    os.replace(f, kdir / f.name)
                tmp.rmdir()
            except Exception as exc:
                logger.debug("ffa_kernels: disk cache write failed: %s", exc)
        _COMPILED[key] = fn
        return fn
