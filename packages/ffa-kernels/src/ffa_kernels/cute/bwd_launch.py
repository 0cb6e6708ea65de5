"""Host launch code of the sm90 backward: preprocess (delta, lse in the log2 domain), the
backward plan, argument packing and ``cute_backward_stage``."""

from __future__ import annotations

import math

import torch

from .._identity_cache import IdentityCache
from .compile_cache import arch, compiled_kernel, dtype_of, placeholder_args
from .config import HEAD_GROUP_SHIFT, BwdConfig, default_bwd_config
from .launch import _aligned16, _kv_rows, kernel_scales, l2_head_group, score_constants
from .launcher import make_launcher
from .plan import get_plan

_LOG2_E = math.log2(math.e)


def bwd_arg_spec() -> list[tuple[str, str, int]]:
    """(kind, element, alignment) of the backward kernel's arguments (launcher.arg_spec's format).

    Order: pointers q, k, v, dout ("in"), lse2, delta, dq_acc (f32; dq_acc is a TMA target,
    16-byte aligned), dk_acc, dv_acc (f32, only 8-byte aligned: added to two elements at a time),
    work, entries (i32); int32 total_q, total_k, heads_q, heads_k, num_work, num_entries,
    kv_row_stride, dkv_row_stride, stat_stride; float32 scale_log2, score_premul, softmax_scale;
    int32 flags; the stream.
    """
    ptrs = (
        [("ptr", "in", 16)] * 4
        + [("ptr", "f32", 16)] * 3
        + [("ptr", "f32", 8)] * 2
        + [("ptr", "i32", 16)] * 2
    )
    return ptrs + [("i32", "", 0)] * 9 + [("f32", "", 0)] * 3 + [("i32", "", 0), ("stream", "", 0)]


def bwd_compile_key(torch_dtype, cfg: BwdConfig, has_softcap: bool) -> tuple:
    """Everything a compiled backward depends on; no per-call shape or range content."""
    return ("ffa_bwd_sm90", str(torch_dtype), cfg.key(), bool(has_softcap), repr(bwd_arg_spec()), arch())


def get_bwd_kernel(torch_dtype, cfg: BwdConfig, has_softcap: bool, *, use_disk_cache: bool = True):
    """Compiled backward for (dtype, cfg, softcap): memory cache, then disk cache, then compile."""

    def build():
        from .bwd_sm90 import FFABackwardSm90

        return FFABackwardSm90(dtype_of(torch_dtype), cfg, has_softcap)

    return compiled_kernel(
        bwd_compile_key(torch_dtype, cfg, has_softcap),
        "ffa_bwd_",
        build,
        lambda: placeholder_args(bwd_arg_spec(), dtype_of(torch_dtype)),
        f"sm90 backward (dtype={torch_dtype}, hdim={cfg.head_dim}, softcap={has_softcap})",
        use_disk_cache=use_disk_cache,
    )


_LAUNCHERS: dict[tuple, object] = {}


def _launcher(torch_dtype, cfg: BwdConfig, has_softcap: bool):
    key = (torch_dtype, cfg, has_softcap)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        kernel = get_bwd_kernel(torch_dtype, cfg, has_softcap)
        fn = _LAUNCHERS[key] = make_launcher(kernel, bwd_arg_spec(), dtype_of(torch_dtype))
    return fn


def bwd_head_group_size(total_q: int, hq: int, d: int, override: int | None = None) -> int:
    """The backward's head group: q heads whose Q, dO (16-bit) and dq rows (float32) stay in L2
    while the key tiles of the group re-read them."""
    return l2_head_group(total_q * d * 8, 1, hq, override)


def stat_stride(total_q: int, tile_m: int) -> int:
    """Row length of the preprocess's (Hq, stride) tensors: Tq plus one q block of padding, so a
    block that starts at any row below Tq reads no further than the padding; a multiple of 4."""
    return (total_q + tile_m + 3) // 4 * 4


# The stages of one backward run back to back: one entry (its GPU tensor stays alive until the
# next backward replaces it).
_STATS_CACHE = IdentityCache(maxsize=1)


def bwd_preprocess(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, tile_m: int) -> torch.Tensor:
    """float32 ``(2, Hq, stat_stride)``: ``[0]`` lse2 = lse * log2(e) (+inf where lse = -inf, and
    in the padding past Tq), ``[1]`` delta = rowsum(dout * out) (0 in the padding).

    dout, out: ``(Tq, Hq, D)``; lse: ``(Tq, Hq)``, the final ones. Cached on the identity of the
    three tensors, so the stages of one backward compute it once."""
    extra = (tile_m,)
    hit = _STATS_CACHE.get((dout, out, lse), extra)
    if hit is not None:
        return hit
    tq, hq, _ = dout.shape
    stats = torch.empty(2, hq, stat_stride(tq, tile_m), dtype=torch.float32, device=dout.device)
    stats[0, :, tq:] = float("inf")
    stats[1, :, tq:] = 0.0
    lse32 = lse.to(torch.float32)
    torch.mul(lse32.t(), _LOG2_E, out=stats[0, :, :tq])
    stats[0, :, :tq].masked_fill_(lse32.t() == float("-inf"), float("inf"))
    delta = (dout.to(torch.float32) * out.to(torch.float32)).sum(dim=-1)  # (Tq, Hq)
    stats[1, :, :tq].copy_(delta.t())
    _STATS_CACHE.put((dout, out, lse), extra, stats)
    return stats


def _dense_f32(t: torch.Tensor) -> bool:
    """Rows of (H, D) float32 the kernel can add to in place: dense, pairs 8-byte aligned."""
    return (
        t.dtype == torch.float32
        and t.stride(-1) == 1
        and t.stride(-2) == t.shape[-1]
        and t.stride(0) % 2 == 0
        and t.data_ptr() % 8 == 0
    )


def cute_backward_stage(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    dq_acc: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    *,
    softmax_scale: float | None,
    softcap: float,
    config: BwdConfig | None = None,
    head_group: int | None = None,
) -> None:
    """sm90 CuTe DSL backward of one stage, added into float32 accumulators in place.

    q: (Tq, Hq, D), k/v: (Tk, Hk, D), bf16 or fp16, D in (64, 128), Hq % Hk == 0; dout / out:
    (Tq, Hq, D) and lse: (Tq, Hq) the FINAL output gradient, output and log-sum-exp of the rows
    (any float dtype); q_ranges / k_ranges int32 (N, 2), attn_type_map int32 (N,) or None, as in
    ``cute_forward``; dq_acc (Tq, Hq, D), dk_acc / dv_acc (Tk, Hk, D) float32, added to (views
    such as ``dkv[:, 0]`` / ``dkv[:, 1]`` of a packed (Tk, 2, Hk, D) buffer are updated in place;
    other layouts go through a contiguous temporary). Raises NotImplementedError for what the
    kernel does not serve (head dim, dtype, float64 accumulators): the caller falls back.
    """
    softmax_scale, softcap = kernel_scales(q, softmax_scale, softcap, "backward")
    d = q.shape[-1]
    for name, t in (("dq_acc", dq_acc), ("dk_acc", dk_acc), ("dv_acc", dv_acc)):
        if t.dtype != torch.float32:
            raise NotImplementedError(f"{name}: the sm90 backward adds into float32, got {t.dtype}")
    cfg = config or default_bwd_config(d)
    total_q, hq, _ = q.shape
    total_k, hk, _ = k.shape
    if total_q == 0 or total_k == 0:
        return
    dev = q.device
    plan = get_plan(q_ranges, k_ranges, attn_type_map, total_k, cfg.tile_n, cfg.tile_m, dev, backward=True)
    if plan.num_work == 0:
        return
    stats = bwd_preprocess(dout, out, lse, cfg.tile_m)
    q = _aligned16(q.contiguous())
    do = _aligned16(dout.to(q.dtype).contiguous())
    k, v, kv_row_stride = _kv_rows(k, v)
    in_place = dq_acc.is_contiguous() and dq_acc.data_ptr() % 16 == 0  # a TMA reduce target
    dq = dq_acc if in_place else torch.zeros(dq_acc.shape, dtype=torch.float32, device=dev)
    dkv_in_place = _dense_f32(dk_acc) and _dense_f32(dv_acc) and dk_acc.stride(0) == dv_acc.stride(0)
    if dkv_in_place:
        dk, dv, dkv_row_stride = dk_acc, dv_acc, dk_acc.stride(0)
    else:
        dk = torch.zeros(dk_acc.shape, dtype=torch.float32, device=dev)
        dv = torch.zeros(dv_acc.shape, dtype=torch.float32, device=dev)
        dkv_row_stride = hk * d
    scale_log2, premul = score_constants(softmax_scale, softcap)
    flags = bwd_head_group_size(total_q, hq, d, head_group) << HEAD_GROUP_SHIFT
    fn = _launcher(q.dtype, cfg, softcap > 0.0)
    fn(
        (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), stats[0].data_ptr(), stats[1].data_ptr(),
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), plan.work.data_ptr(), plan.entries.data_ptr(),
            total_q, total_k, hq, hk, plan.num_work, plan.num_entries, kv_row_stride, dkv_row_stride,
            stats.shape[-1], scale_log2, premul, softmax_scale, flags,
            torch.cuda.current_stream(dev).cuda_stream,
        )
    )  # fmt: skip
    if dq is not dq_acc:
        dq_acc.add_(dq)
    if not dkv_in_place:
        dk_acc.add_(dk)
        dv_acc.add_(dv)
