"""Host launch code of the sm90 forward: JIT compile cache (memory + disk), ``cute_forward``
(fresh output) and ``cute_forward_accumulate`` (merge into a float32 accumulator in place)."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import pathlib
import threading
import time

import torch

from .config import FwdConfig, default_config
from .plan import get_plan

logger = logging.getLogger(__name__)

_LOG2_E = math.log2(math.e)
_COMPILED: dict[tuple, object] = {}
_LOCK = threading.Lock()


def _cutlass():
    # The kernels target sm_90a only. Naming the arch before cutlass is first imported lets
    # compilation and the disk-cache export work on machines without a GPU too.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def _dtype_of(torch_dtype):
    cutlass, _ = _cutlass()
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[torch_dtype]


def _arch() -> str:
    return os.environ.get("CUTE_DSL_ARCH", "sm_90a")


def compile_key(torch_dtype, cfg: FwdConfig, has_softcap: bool, accumulate: bool = False) -> tuple:
    """Everything a compiled kernel depends on; no per-call shape or range content."""
    return ("ffa_fwd_sm90", str(torch_dtype), cfg.key(), bool(has_softcap), bool(accumulate), _arch())


def _source_hash() -> str:
    import cutlass

    h = hashlib.sha256()
    here = pathlib.Path(__file__).parent
    for f in sorted(here.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(str(getattr(cutlass, "__version__", "")).encode())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("FFA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ffa_kernels")
    return pathlib.Path(root)


def _compile_args(torch_dtype, cfg: FwdConfig, accumulate: bool = False):
    """Placeholder arguments for cute.compile: null pointers and dummy sizes (all runtime values).

    accumulate: the output pointer is float32 (the accumulator) instead of the input dtype, and
    the lse and max_logits pointers are only assumed 4-byte aligned (the caller's tensors).
    """
    cutlass, cute = _cutlass()
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    dt = _dtype_of(torch_dtype)
    gmem = cute.AddressSpace.gmem
    p16 = lambda t: make_ptr(t, 0, gmem, assumed_align=16)  # noqa: E731
    args = [
        p16(dt),
        p16(dt),
        p16(dt),
        p16(cutlass.Float32) if accumulate else p16(dt),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4) if accumulate else p16(cutlass.Float32),
        p16(cutlass.Int32),
        p16(cutlass.Int32),
        p16(cutlass.Float32),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4) if accumulate else p16(cutlass.Float32),
    ]
    args += [cutlass.Int32(1)] * 6 + [cutlass.Float32(1.0)] * 3 + [cutlass.Int32(0)]
    args.append(cuda.CUstream(0))
    return args


def get_kernel(
    torch_dtype, cfg: FwdConfig, has_softcap: bool, *, accumulate: bool = False, use_disk_cache: bool = True
):
    """Compiled kernel for (dtype, cfg, softcap, accumulate): memory cache, then disk cache, then compile."""
    key = compile_key(torch_dtype, cfg, has_softcap, accumulate)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is not None:
            return fn
        _, cute = _cutlass()
        kdir = None
        name = "ffa_fwd_" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        if use_disk_cache:
            kdir = cache_dir() / _source_hash()
            obj = kdir / f"{name}.o"
            if obj.exists():
                try:
                    from cutlass.cute.runtime import load_module

                    mod = load_module(str(obj))
                    fn = getattr(mod, name)
                    _COMPILED[key] = fn
                    return fn
                except Exception as exc:  # corrupt / incompatible file: recompile
                    logger.warning("ffa_kernels: could not load cached kernel %s (%s); recompiling", obj, exc)
        from .fwd_sm90 import FFAForwardSm90

        t0 = time.perf_counter()
        kernel = FFAForwardSm90(_dtype_of(torch_dtype), cfg, has_softcap, accumulate)
        fn = cute.compile(
            kernel, *_compile_args(torch_dtype, cfg, accumulate), options=f"--gpu-arch {_arch()}"
        )
        logger.info(
            "ffa_kernels: compiled sm90 forward %s (dtype=%s, hdim=%d, softcap=%s, accumulate=%s) in %.1f s",
            name,
            torch_dtype,
            cfg.head_dim,
            has_softcap,
            accumulate,
            time.perf_counter() - t0,
        )
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


_L2_BUDGET = 24 * 1024 * 1024


def head_group_size(total_k: int, hq: int, hk: int, d: int, elem: int, override: int | None = None) -> int:
    """How many q heads run side by side (CTA order) so that their K and V stay in L2."""
    env = os.environ.get("FFA_HEAD_GROUP")
    g = override if override is not None else (int(env) if env else None)
    if g is None:
        ratio = hq // hk
        kv_bytes_per_kv_head = 2 * total_k * d * elem
        kv_heads = max(1, _L2_BUDGET // max(1, kv_bytes_per_kv_head))
        g = kv_heads * ratio
    return int(max(1, min(hq, g, (1 << 23) - 1)))


def _sink_lse(sink, sink_layout: str, total_q: int, num_heads: int, device) -> torch.Tensor | None:
    if sink is None:
        return None
    s = sink.to(device=device, dtype=torch.float32)
    if sink_layout == "sh":  # (S, Hq)
        lse = torch.logsumexp(s, dim=0)  # (Hq,)
        return lse.unsqueeze(0).expand(total_q, num_heads).contiguous()
    if sink_layout == "ssh":  # (Tq, S, Hq)
        return torch.logsumexp(s, dim=1).contiguous()
    raise ValueError(f"unknown sink_layout {sink_layout!r}")


class _Runtime:
    """Objects every launch needs, imported/built once (keeps the per-call host path short)."""

    def __init__(self):
        _cutlass()
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        from .fwd_sm90 import FLAG_HAS_SINK, FLAG_MAX_LOGITS, HEAD_GROUP_SHIFT

        self.cuda, self.make_ptr = cuda, make_ptr
        self.f32, self.i32 = cutlass.Float32, cutlass.Int32
        self.gmem = cute.AddressSpace.gmem
        self.flag_sink, self.flag_ml, self.group_shift = FLAG_HAS_SINK, FLAG_MAX_LOGITS, HEAD_GROUP_SHIFT
        self.dtypes = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
        self.streams: dict[int, object] = {}
        self.kernels: dict[tuple, object] = {}

    def ptr(self, dtype, t: torch.Tensor, align: int = 16):
        return self.make_ptr(dtype, t.data_ptr(), self.gmem, assumed_align=align)

    def stream(self, dev):
        h = torch.cuda.current_stream(dev).cuda_stream
        st = self.streams.get(h)
        if st is None:
            st = self.streams[h] = self.cuda.CUstream(h)
        return st


_RT: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RT
    if _RT is None:
        _RT = _Runtime()
    return _RT


SUPPORTED_HEAD_DIMS = (64, 128)


def cute_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    *,
    softmax_scale: float | None,
    softcap: float,
    sink: torch.Tensor | None,
    sink_layout: str,
    return_max_logits: bool,
    config: FwdConfig | None = None,
    head_group: int | None = None,
):
    """sm90 CuTe DSL forward. Returns (out (Tq,Hq,D) q.dtype, lse f32 (Tq,Hq), max_logits f32 (Hq,) | None)."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    # Say "unsupported" before anything runs: the frontend then serves the call from the reference.
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head_dim: the sm90 kernel supports {SUPPORTED_HEAD_DIMS}, got {d}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"q: the sm90 kernel supports bfloat16 and float16, got {q.dtype}")
    rt = _runtime()
    if softmax_scale is None:
        softmax_scale = d**-0.5
    cfg = config or default_config(d)
    has_softcap = bool(softcap) and softcap > 0.0
    kkey = (q.dtype, cfg, has_softcap)
    fn = rt.kernels.get(kkey)
    if fn is None:
        fn = rt.kernels[kkey] = get_kernel(q.dtype, cfg, has_softcap)
    dev = q.device
    plan = get_plan(q_ranges, k_ranges, attn_type_map, total_q, cfg.tile_m, cfg.tile_n, dev)

    out = torch.empty(q.shape, dtype=q.dtype, device=dev)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=dev)
    sink_lse = _sink_lse(sink, sink_layout, total_q, hq, dev)
    max_logits = (
        torch.full((hq,), float("-inf"), dtype=torch.float32, device=dev) if return_max_logits else None
    )
    flags = 0
    if sink_lse is not None:
        flags |= rt.flag_sink
    if return_max_logits:
        flags |= rt.flag_ml
    flags |= head_group_size(total_k, hq, hk, d, q.element_size(), head_group) << rt.group_shift
    if total_q == 0:
        return out, lse, max_logits
    if plan.total_blocks == 0 or total_k == 0:  # nothing covered: no launch (and no 0-sized TMA descriptor)
        out.zero_()
        lse.copy_(sink_lse if sink_lse is not None else torch.full_like(lse, float("-inf")))
        return out, lse, max_logits
    # TMA and the compiled kernel assume 16-byte aligned bases
    q, k, v = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v))
    if has_softcap:
        scale_log2 = float(softcap) * _LOG2_E
        premul = float(softmax_scale) / float(softcap)
    else:
        scale_log2 = float(softmax_scale) * _LOG2_E
        premul = 1.0

    dt = rt.dtypes[q.dtype]
    f32, i32 = rt.f32, rt.i32
    if plan.ptrs is None:  # the plan's tables live as long as the plan: build their pointers once
        plan.ptrs = (rt.ptr(i32, plan.work), rt.ptr(i32, plan.entries))
    fn(
        rt.ptr(dt, q),
        rt.ptr(dt, k),
        rt.ptr(dt, v),
        rt.ptr(dt, out),
        rt.ptr(f32, lse),
        plan.ptrs[0],
        plan.ptrs[1],
        rt.ptr(f32, sink_lse if sink_lse is not None else lse),  # lse: any valid f32 pointer
        rt.ptr(f32, max_logits if max_logits is not None else lse),
        i32(total_q),
        i32(total_k),
        i32(hq),
        i32(hk),
        i32(plan.num_work),
        i32(plan.num_entries),
        f32(scale_log2),
        f32(premul),
        f32(float(softmax_scale)),
        i32(flags),
        rt.stream(dev),
    )
    return out, lse, max_logits


def _check_accumulator(name: str, t: torch.Tensor, shape: tuple, device, align: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: must be float32, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (it is updated in place)")
    if t.data_ptr() % align != 0:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")


def cute_forward_accumulate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    *,
    softmax_scale: float | None,
    softcap: float,
    max_logits_acc: torch.Tensor | None = None,
    config: FwdConfig | None = None,
    head_group: int | None = None,
):
    """sm90 CuTe DSL forward that merges its result into a float32 accumulator in place.

    q: (Tq, Hq, D), k/v: (Tk, Hk, D), bf16 or fp16, Hq % Hk == 0, D in (64, 128).
    q_ranges/k_ranges: int32 (N, 2), attn_type_map: int32 (N,) or None (all FULL), as in
    ``cute_forward``. The slices of one call must not cover a cell twice.
    out_acc: float32 (Tq, Hq, D), contiguous, 16-byte aligned; lse_acc: float32 (Tq, Hq),
    contiguous: a previous partial result (out normalised, lse natural log; rows with
    lse = -inf hold out = 0, though their out is ignored and may hold anything).
    max_logits_acc: float32 (Hq,) or None; max-updated with this call's softmax_scale * q.k max.

    For every row this call covers: l = logaddexp(l_acc, l_new), out = exp(l_acc - l) * out_acc +
    exp(l_new - l) * out_new, written back in float32; a row with l_acc = -inf becomes
    (out_new, l_new). Rows this call does not cover are not written. No sink in this mode (add
    the sink once, outside). Several calls over disjoint key sets thus combine to the result of
    one call over their union. Returns (out_acc, lse_acc), the same tensors.
    """
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head_dim: the sm90 kernel supports {SUPPORTED_HEAD_DIMS}, got {d}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"q: the sm90 kernel supports bfloat16 and float16, got {q.dtype}")
    dev = q.device
    _check_accumulator("out_acc", out_acc, (total_q, hq, d), dev, 16)
    _check_accumulator("lse_acc", lse_acc, (total_q, hq), dev, 4)
    if max_logits_acc is not None:
        _check_accumulator("max_logits_acc", max_logits_acc, (hq,), dev, 4)
    rt = _runtime()
    if softmax_scale is None:
        softmax_scale = d**-0.5
    cfg = config or default_config(d)
    has_softcap = bool(softcap) and softcap > 0.0
    kkey = (q.dtype, cfg, has_softcap, True)
    fn = rt.kernels.get(kkey)
    if fn is None:
        fn = rt.kernels[kkey] = get_kernel(q.dtype, cfg, has_softcap, accumulate=True)
    if total_q == 0 or total_k == 0:
        return out_acc, lse_acc
    plan = get_plan(q_ranges, k_ranges, attn_type_map, total_q, cfg.tile_m, cfg.tile_n, dev)
    if plan.total_blocks == 0:  # nothing covered: nothing to merge
        return out_acc, lse_acc
    flags = rt.flag_ml if max_logits_acc is not None else 0
    flags |= head_group_size(total_k, hq, hk, d, q.element_size(), head_group) << rt.group_shift
    q, k, v = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v))
    if has_softcap:
        scale_log2 = float(softcap) * _LOG2_E
        premul = float(softmax_scale) / float(softcap)
    else:
        scale_log2 = float(softmax_scale) * _LOG2_E
        premul = 1.0

    dt = rt.dtypes[q.dtype]
    f32, i32 = rt.f32, rt.i32
    if plan.ptrs is None:
        plan.ptrs = (rt.ptr(i32, plan.work), rt.ptr(i32, plan.entries))
    fn(
        rt.ptr(dt, q),
        rt.ptr(dt, k),
        rt.ptr(dt, v),
        rt.ptr(f32, out_acc),
        rt.ptr(f32, lse_acc, align=4),
        plan.ptrs[0],
        plan.ptrs[1],
        rt.ptr(f32, out_acc),  # sink: unused in this mode, any valid 16-byte aligned f32 pointer
        rt.ptr(f32, max_logits_acc if max_logits_acc is not None else lse_acc, align=4),
        i32(total_q),
        i32(total_k),
        i32(hq),
        i32(hk),
        i32(plan.num_work),
        i32(plan.num_entries),
        f32(scale_log2),
        f32(premul),
        f32(float(softmax_scale)),
        i32(flags),
        rt.stream(dev),
    )
    return out_acc, lse_acc
