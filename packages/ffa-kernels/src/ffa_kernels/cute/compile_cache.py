"""JIT compile cache of the sm90 kernels: in memory, then on disk, then ``cute.compile``.

The disk cache lives under ``$FFA_CACHE_DIR`` (default ``~/.cache/ffa_kernels``) in a folder
named by a hash of every Python source of this package folder and the DSL version, so any
change to a kernel, or to a device helper it imports, compiles afresh (a hand-kept list of
device files could miss a new one and reuse a stale kernel).

A cached file is machine code that this process loads and runs, so the cache is trusted only
as far as nobody else can write it:

- the cache folders are created with mode 0700;
- a cache folder (``$FFA_CACHE_DIR`` or its hash folder) that is not owned by this user, or is
  group- or world-writable, is neither read nor written: one warning, then kernels compile in
  memory;
- every file is written atomically (into a private temporary folder, then renamed), with its
  sha256 recorded beside it (``<file>.sha256``, written before the file appears), and a file is
  loaded only when its content still has that hash; otherwise the kernel compiles again (and
  the entry is rewritten).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileKey:
    """Everything one compiled kernel depends on: never a per-call shape or range content.

    Its ``repr`` (field names included) names the kernel's file in the disk cache, so two
    keys that differ in any field never share a compiled object."""

    kernel: str  # which kernel class: "ffa_fwd_sm90", "ffa_bwd_sm90"
    dtype: str  # str() of the torch element dtype
    config: tuple  # the config dataclass's fields, in order (FwdConfig / BwdConfig .key())
    flags: tuple[tuple[str, bool | int], ...]  # named compile-time variants (softcap, accumulate, pack, ...)
    arg_spec: str  # repr of the packed launcher's argument spec (kernel_args)
    arch: str  # the target, e.g. "sm_90a"


_COMPILED: dict[CompileKey, object] = {}
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
    """Arguments for cute.compile from an argument spec (kernel_args.arg_spec's format): null
    pointers and dummy sizes, all runtime values."""
    from .kernel_args import dsl_args

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


def forget(key: CompileKey | None = None) -> None:
    """Drop one compiled kernel (or all, with None) from the in-memory cache (for tests)."""
    if key is None:
        _COMPILED.clear()
    else:
        _COMPILED.pop(key, None)


_WARNED_DIRS: set[str] = set()


def dir_problem(path: pathlib.Path) -> str | None:
    """Why the existing folder ``path`` cannot hold trusted kernels, or None when it can: it must
    be a folder owned by this user and not writable by its group or by others."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is group- or world-writable (mode {stat.S_IMODE(st.st_mode):#o})"
    return None


def make_private_dirs(path: pathlib.Path) -> None:
    """``mkdir -p`` where every folder created gets mode 0700 (existing folders are left alone)."""
    missing = []
    p = pathlib.Path(path)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            os.mkdir(d, 0o700)


def usable_cache_dir(kdir: pathlib.Path) -> bool:
    """Create ``kdir`` and its parent (the cache root) with mode 0700 where missing, and check
    both with `dir_problem`. A folder that fails is reported once (a warning) and not used."""
    for d in (kdir.parent, kdir):
        problem: str | None
        try:
            make_private_dirs(d)
        except OSError as exc:
            problem = f"cannot be created ({exc.strerror or exc})"
        else:
            problem = dir_problem(d)
        if problem is not None:
            if str(d) not in _WARNED_DIRS:
                _WARNED_DIRS.add(str(d))
                logger.warning(
                    "ffa_kernels: not using the kernel disk cache %s: it %s; compiling in memory "
                    "(set FFA_CACHE_DIR to a folder of your own, mode 0700)",
                    d,
                    problem,
                )
            return False
    return True


def file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def digest_path(path: pathlib.Path) -> pathlib.Path:
    """Where the sha256 of a cached file is recorded: ``<file>.sha256`` beside it."""
    return path.with_name(path.name + ".sha256")


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to a temporary file in ``path``'s folder, then rename it onto ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store_file(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Move ``src`` onto ``dst`` (same file system: an atomic rename) after recording its sha256
    beside ``dst``. The digest comes first, so a reader never finds the new file without it."""
    write_atomic(digest_path(dst), f"{file_sha256(src)}  {dst.name}\n".encode())
    os.replace(src, dst)


def verify_file(path: pathlib.Path) -> str | None:
    """Why ``path`` must not be loaded, or None when its content has the sha256 recorded beside it."""
    try:
        recorded = digest_path(path).read_text().split()
    except OSError:
        return "no recorded sha256 beside it"
    if not recorded:
        return "an empty sha256 record"
    try:
        actual = file_sha256(path)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    if actual != recorded[0]:
        return f"its sha256 {actual[:16]}... differs from the recorded {recorded[0][:16]}..."
    return None


def load_module(path: pathlib.Path, name: str):
    """The compiled function ``name`` of the exported object file ``path``."""
    from cutlass.cute.runtime import load_module as _load

    return getattr(_load(str(path)), name)


def export_kernel(fn, kdir: pathlib.Path, name: str) -> None:
    """Export ``fn`` into ``kdir``: into a private temporary folder first, then each file moved
    into place by `store_file` (sha256 recorded, atomic rename)."""
    tmp = pathlib.Path(tempfile.mkdtemp(dir=kdir, prefix=f".{name}."))  # mode 0700
    try:
        fn.export_to_c(str(tmp), name, function_prefix=name)
        files = sorted(tmp.iterdir(), key=lambda f: f.suffix == ".o")  # the object file last
        for f in files:
            store_file(f, kdir / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def compiled_kernel(
    key: CompileKey,
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
            if not usable_cache_dir(kdir):
                kdir = None
        if kdir is not None:
            obj = kdir / f"{name}.o"
            if obj.exists():
                problem = verify_file(obj)
                if problem is None:
                    try:
                        fn = load_module(obj, name)
                        _COMPILED[key] = fn
                        return fn
                    except Exception as exc:  # incompatible file: recompile
                        logger.warning(
                            "ffa_kernels: could not load cached kernel %s (%s); recompiling", obj, exc
                        )
                else:
                    logger.warning("ffa_kernels: not loading cached kernel %s: %s; recompiling", obj, problem)
        t0 = time.perf_counter()
        fn = cute.compile(build(), *compile_args(), options=f"--gpu-arch {arch()}")
        logger.info("ffa_kernels: compiled %s %s in %.1f s", what, name, time.perf_counter() - t0)
        if kdir is not None:
            try:
                export_kernel(fn, kdir, name)
            except Exception as exc:
                logger.debug("ffa_kernels: disk cache write failed: %s", exc)
        _COMPILED[key] = fn
        return fn
