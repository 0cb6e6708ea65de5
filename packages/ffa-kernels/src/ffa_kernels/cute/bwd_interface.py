"""The sm90 backward's host interface: preprocess (delta, lse in the log2 domain), the
backward plan, argument packing, ``cute_backward_stage`` (adds into float32 accumulators) and
``cute_backward`` (one whole backward, gradients in the input dtype)."""

from __future__ import annotations

import math

import torch

from .._identity_cache import IdentityCache, cacheable
from .._types import as_dtype
from .._validate import check_heads_per_cta
from .compile_cache import CompileKey, arch, compiled_kernel, cutlass_modules, dtype_of, placeholder_args
from .config import (
    BWD_MAX_TILE_M,
    HEAD_GROUP_SHIFT,
    STAT_PAD,
    BwdConfig,
    default_bwd_config,
    deterministic_bwd_config,
)
from .interface import (
    _aligned16,
    _kv_rows,
    equal_group,
    kernel_scales,
    l2_head_group,
    num_sms,
    score_constants,
)
from .kernel_args import current_stream_handle, make_launcher
from .tile_plan import get_plan


def bwd_arg_spec(dkv_store: bool) -> list[tuple[str, str, int]]:
    """(kind, element, alignment) of the backward kernel's arguments (kernel_args.arg_spec's format).

    Order: pointers q, k, v, dout ("in"), lse2, delta, dq_acc (f32; dq_acc is a TMA target,
    16-byte aligned), dk, dv (``dkv_store``: "in", 16-byte aligned TMA store targets, a segment
    tile's rows stored two elements at a time; else f32 accumulators, 8-byte aligned, added to
    two at a time), work, entries, ranks,
    semaphores (i32; the last two read by the deterministic variant only); int32 total_q, total_k, heads_q, heads_k, num_work, num_entries, kv_row_stride,
    dkv_row_stride, stat_stride, heads_per_cta; float32 scale_log2, score_premul, grad_scale,
    dv_scale (`fold_scale`); int32 flags; the stream.
    """
    dkv = ("ptr", "in", 16) if dkv_store else ("ptr", "f32", 8)
    ptrs = [("ptr", "in", 16)] * 4 + [("ptr", "f32", 16)] * 3 + [dkv] * 2 + [("ptr", "i32", 16)] * 2
    ptrs += [("ptr", "i32", 4)] * 2
    return ptrs + [("i32", "", 0)] * 10 + [("f32", "", 0)] * 4 + [("i32", "", 0), ("stream", "", 0)]


def bwd_compile_key(
    torch_dtype, cfg: BwdConfig, has_softcap: bool, dkv_store: bool, deterministic: bool = False
) -> CompileKey:
    """Everything a compiled backward depends on; no per-call shape or range content."""
    return CompileKey(
        kernel="ffa_bwd_sm90",
        dtype=str(torch_dtype),
        config=cfg.key(),
        flags=(
            ("softcap", bool(has_softcap)),
            ("dkv_store", bool(dkv_store)),
            ("deterministic", bool(deterministic)),
        ),
        arg_spec=repr(bwd_arg_spec(dkv_store)),
        arch=arch(),
    )


def get_bwd_kernel(
    torch_dtype,
    cfg: BwdConfig,
    has_softcap: bool,
    dkv_store: bool = False,
    deterministic: bool = False,
    *,
    use_disk_cache: bool = True,
):
    """Compiled backward for (dtype, cfg, softcap, dk/dv stored or added, deterministic or not):
    memory cache, then disk cache, then compile."""

    def build():
        from .bwd_sm90 import FFABackwardSm90

        return FFABackwardSm90(dtype_of(torch_dtype), cfg, has_softcap, dkv_store, deterministic)

    return compiled_kernel(
        bwd_compile_key(torch_dtype, cfg, has_softcap, dkv_store, deterministic),
        "ffa_bwd_",
        build,
        lambda: placeholder_args(bwd_arg_spec(dkv_store), dtype_of(torch_dtype)),
        f"sm90 backward (dtype={torch_dtype}, hdim={cfg.head_dim}, softcap={has_softcap}, "
        f"dk/dv {'stored' if dkv_store else 'added'}{', deterministic' if deterministic else ''})",
        use_disk_cache=use_disk_cache,
    )


_LAUNCHERS: dict[tuple, object] = {}


def _launcher(torch_dtype, cfg: BwdConfig, has_softcap: bool, dkv_store: bool, deterministic: bool):
    key = (torch_dtype, cfg, has_softcap, dkv_store, deterministic)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        kernel = get_bwd_kernel(torch_dtype, cfg, has_softcap, dkv_store, deterministic)
        fn = _LAUNCHERS[key] = make_launcher(kernel, bwd_arg_spec(dkv_store), dtype_of(torch_dtype))
    return fn


_CTAS_PER_SM = 32
# The most q rows one CTA should walk over all its heads (heads x `tile_plan.mean_walk` x the
# plan's block rows). Measured on an H100 (GQA 64:8, D 128, 80-row blocks, whole backward, TFLOP/s
# with 1 / 2 heads per CTA; 8 heads, what the CTA-count rule alone takes at 128k, from a run
# disturbed by tests beside it): causal 128k, uniform (walk 99 blocks) 545 / 524 (8: 318),
# long-tailed (197) 544 / 509 (410), equal (137) 568 / 582 (460); full 128k within 2% of each
# other. At 32k (walks 26-97 blocks) 1 head loses to 2 everywhere (uniform causal 396 / 443,
# long-tailed full 502 / 531), so the cap (256 blocks of 80 rows) keeps 2 there and takes 1 or 2
# at 128k: 1-4% behind the other choice on uniform causal (takes 2) and equal causal (takes 1),
# whose walks (99, 137) no single cap separates the right way.
MAX_CTA_WALK_ROWS = 256 * 80


def bwd_heads_per_cta(
    num_work: int, hq: int, hk: int, num_sms: int, override: int | None = None, walk_rows: float = 0.0
) -> int:
    """How many q heads of a K/V head one CTA walks: the largest divisor of the GQA group that
    still gives ``_CTAS_PER_SM`` CTAs per SM and keeps a CTA's walk over its heads within
    ``MAX_CTA_WALK_ROWS`` (``walk_rows``: the plan's `tile_plan.mean_walk` times its q block
    rows), 1 at worst. The whole group sums dK/dV in registers (one writer per K/V row, stored in
    the input dtype), but its CTAs are long and few: on an H100, GQA 64:8 varlen causal 32k runs
    fastest with 2 heads per CTA (459 TFLOP/s against 418 with all 8 and 437 with 1), and causal
    masks of long documents lose up to 40% with long CTAs (see ``MAX_CTA_WALK_ROWS``)."""
    group = hq // hk
    checked = check_heads_per_cta(override, hq, hk)
    if checked is not None:
        return checked
    for d in sorted((d for d in range(1, group + 1) if group % d == 0), reverse=True):
        if num_work * hk * (group // d) >= _CTAS_PER_SM * num_sms and d * walk_rows <= MAX_CTA_WALK_ROWS:
            return d
    return 1


def bwd_head_group_size(
    total_q: int, hq: int, d: int, heads_per_cta: int, override: int | None = None
) -> int:
    """The backward's head group (in CTA head slots of ``heads_per_cta`` q heads): slots whose Q,
    dO (16-bit) and dq rows (float32) stay in L2 while the key tiles of the group re-read them."""
    return l2_head_group(total_q * d * 8 * heads_per_cta, 1, hq // heads_per_cta, override)


# The deterministic backward's head group target, in q heads (CTA head slots side by side in the
# CTA order).
# There the dQ adds to a q block wait for the earlier key tiles of the same head, so CTAs of one
# head stall on each other; slots of other heads running beside them fill those waits. Measured
# on an H200 (docs/perf.md), deterministic whole backward with groups of 1 / 2 / 4 / 8 / 16 slots:
# varlen causal 32k 2.53 / 2.36 / 2.15 / 2.19 / 2.43 ms (the default mode: 2.12), causal 8k
# - / 1.37 / 1.33 / 1.62 / 1.96; full 8k and the sliding window best at 4 as well (MHA: a slot
# is one q head; slots of several q heads are counted in q heads, not measured).
DET_HEAD_GROUP = 4


def deterministic_head_group(slots: int, l2_group: int, heads_per_slot: int = 1) -> int:
    """The deterministic backward's head group (in slots of ``heads_per_slot`` q heads) where each
    K/V head has one slot (no dK/dV adds between CTAs): slots of about `DET_HEAD_GROUP` q heads
    side by side (`interface.equal_group` of that many; larger groups lost: 8 and 16 heads ran
    causal 8k 22% and 47% slower than 4), never fewer than the L2 rule's ``l2_group``."""
    want = -(-DET_HEAD_GROUP // heads_per_slot)
    return max(l2_group, equal_group(slots, want))


def backward_head_group(
    total_q: int, hq: int, hk: int, d: int, heads_per_cta: int, override: int | None, deterministic: bool
) -> int:
    """The head group (in CTA head slots) of one backward launch: ``override``, else the L2 rule
    (`bwd_head_group_size`), raised in deterministic mode where each K/V head has one slot
    (`deterministic_head_group`). Where a K/V head has several slots, their dK/dV adds wait on
    each other too, and the L2 rule stays (GQA 64:8 varlen causal 32k, 2 q heads per slot and 4
    slots per K/V head, deterministic: 15.5 ms with 4 slots side by side against 13.5 with the L2
    rule's 1)."""
    group = bwd_head_group_size(total_q, hq, d, heads_per_cta, override)
    if deterministic and override is None and heads_per_cta * hk == hq:
        group = deterministic_head_group(hq // heads_per_cta, group, heads_per_cta)
    return group


_num_sms = num_sms  # a module attribute of its own: the CPU tests set it


def stat_stride(total_q: int) -> int:
    """Row length of the preprocess's (Hq, stride) tensors: Tq plus the tallest q block of any
    backward config and STAT_PAD values of padding, so the statistics copy of a block that starts
    at any row below Tq (from that row rounded down to 4, ``tile_m + STAT_PAD`` values) reads no
    further than the padding whatever the config (the stages of one backward may differ in
    ``tile_m`` and share the statistics); a multiple of 4, so every head's row starts 16-byte
    aligned."""
    return (total_q + BWD_MAX_TILE_M + STAT_PAD + 3) // 4 * 4


# The stages of one backward run back to back: one entry (its GPU tensor stays alive until the
# next backward replaces it).
_STATS_CACHE = IdentityCache(maxsize=1)

# (kind, element, alignment): dout, out, lse, stats pointers; total_q, heads, stat_stride;
# lse2_shift; stream
_PRE_SPEC_16 = [("ptr", "in", 16), ("ptr", "in", 16), ("ptr", "f32", 4), ("ptr", "f32", 16)]
_PRE_SCALARS = [("i32", "", 0)] * 3 + [("f32", "", 0), ("stream", "", 0)]


def preprocess_arg_spec(out_is_f32: bool) -> list[tuple[str, str, int]]:
    """The preprocess kernel's arguments; ``out_is_f32``: out is float32 while dout is not."""
    ptrs = list(_PRE_SPEC_16)
    if out_is_f32:
        ptrs[1] = ("ptr", "f32", 16)
    return ptrs + _PRE_SCALARS


_PREPROCESS: dict[tuple, object] = {}


def _preprocess_launcher(do_dtype: torch.dtype, out_dtype: torch.dtype, d: int):
    key = (do_dtype, out_dtype, d)
    fn = _PREPROCESS.get(key)
    if fn is None:
        cutlass, _ = cutlass_modules()
        elems = {
            torch.bfloat16: cutlass.BFloat16,
            torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32,
        }
        spec = preprocess_arg_spec(out_dtype == torch.float32 and do_dtype != torch.float32)

        def build():
            from .bwd_preprocess import BwdPreprocess

            return BwdPreprocess(elems[do_dtype], elems[out_dtype], d)

        kernel = compiled_kernel(
            CompileKey(
                kernel="ffa_bwd_pre",
                dtype=str(do_dtype),
                config=(str(out_dtype), d),
                flags=(),
                arg_spec=repr(spec),
                arch=arch(),
            ),
            "ffa_bwd_pre_",
            build,
            lambda: placeholder_args(spec, elems[do_dtype]),
            f"backward preprocess (dout={do_dtype}, out={out_dtype}, hdim={d})",
        )
        fn = _PREPROCESS[key] = make_launcher(kernel, spec, elems[do_dtype])
    return fn


def fold_scale(softmax_scale: float, dtype: torch.dtype) -> float:
    """The scale the backward folds into P (``bwd_sm90.py``): softmax_scale for bfloat16 (its
    log2 shifts lse2), 1 for float16, whose 5-bit exponent would turn more of a scaled P and dS
    subnormal (the kernel then multiplies dQ and dK by the scale itself). The kernels take
    scales > 0 only (`kernel_scales`)."""
    return softmax_scale if dtype == torch.bfloat16 else 1.0


def bwd_preprocess(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, fold: float = 1.0
) -> torch.Tensor:
    """float32 ``(2, Hq, stat_stride)``: ``[0]`` lse2 = lse * log2(e) - log2(fold) (+inf where
    lse = -inf, and in the padding past Tq), ``[1]`` delta = rowsum(dout * out) in float32 (0 in
    the padding). ``fold`` (> 0, `fold_scale`): the main kernel's P comes out times ``fold``, so
    that dS, dQ and dK carry the softmax scale with no multiply per block (``bwd_sm90.py``).

    dout: ``(Tq, Hq, D)`` (q's dtype), out ``(Tq, Hq, D)``, lse ``(Tq, Hq)``: the final ones.
    One kernel (`bwd_preprocess.BwdPreprocess`); cached on the identity of the three tensors, so
    the stages of one backward compute it once."""
    if not fold > 0.0:
        raise ValueError(f"fold: must be > 0, got {fold!r}")
    shift = math.log2(fold)
    extra = shift
    hit = _STATS_CACHE.get((dout, out, lse), extra)
    if hit is not None:
        return hit
    tq, hq, d = dout.shape
    stats = torch.empty(2, hq, stat_stride(tq), dtype=torch.float32, device=dout.device)
    if out.dtype not in (dout.dtype, torch.float32):
        out = out.to(torch.float32)
    do_c = _aligned16(dout.contiguous())
    out_c = _aligned16(out.contiguous())
    lse_c = as_dtype(lse, torch.float32).contiguous()
    _preprocess_launcher(dout.dtype, out_c.dtype, d)(
        (
            do_c.data_ptr(), out_c.data_ptr(), lse_c.data_ptr(), stats.data_ptr(), tq, hq, stats.shape[-1],
            shift, current_stream_handle(dout.device),
        )
    )  # fmt: skip
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


def _tma_store_rows(t: torch.Tensor) -> bool:
    """Rows of (H, D) 16-bit elements the kernel stores by TMA (whole tiles) or two at a time (a
    segment tile's): dense rows 16 bytes apart at least in alignment, a 16-byte aligned base."""
    return (
        t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
    )


def _dout_as_is(dout: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel reads ``dout`` itself (in ``dtype``, contiguous, 16-byte aligned), not
    a converted copy: only then can a preprocess prepared ahead (`cute_backward_prepare`) serve."""
    return dout.dtype == dtype and dout.is_contiguous() and dout.data_ptr() % 16 == 0


def _launch(
    q, k, v, dout, out, lse, plan, cfg, dq, dk, dv, dkv_row_stride, dkv_store, heads_per_cta,
    softmax_scale, softcap, head_group, deterministic,
) -> None:  # fmt: skip
    """Preprocess (cached per backward) and one kernel launch; q/k/v/dout as the caller gave them.
    ``deterministic``: ``plan`` has its visit ranks; zeroed semaphores per q block and q head
    and per work tile and K/V head."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    q = _aligned16(q.contiguous())
    do = dout if _dout_as_is(dout, q.dtype) else _aligned16(as_dtype(dout, q.dtype).contiguous())
    fold = fold_scale(softmax_scale, q.dtype)
    stats = bwd_preprocess(do, out, lse, fold)
    k, v, kv_row_stride = _kv_rows(k, v)
    scale_log2, premul = score_constants(softmax_scale, softcap)
    group = backward_head_group(total_q, hq, hk, d, heads_per_cta, head_group, deterministic)
    flags = group << HEAD_GROUP_SHIFT
    fn = _launcher(q.dtype, cfg, softcap > 0.0, dkv_store, deterministic)
    if deterministic:
        # per q block and q head (dQ order), then per work tile and K/V head (dK/dV order)
        sem = torch.zeros(
            -(-total_q // cfg.tile_m) * hq + plan.num_work * hk, dtype=torch.int32, device=q.device
        )
        ranks_ptr, sem_ptr = plan.ranks.data_ptr(), sem.data_ptr()
    else:
        ranks_ptr = sem_ptr = plan.work.data_ptr()  # not read
    lse2_ptr = stats.data_ptr()  # stats[0] and stats[1], without two indexing ops
    delta_ptr = lse2_ptr + stats.stride(0) * stats.element_size()
    fn(
        (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse2_ptr, delta_ptr,
            dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), plan.work.data_ptr(), plan.entries.data_ptr(),
            ranks_ptr, sem_ptr, total_q, total_k, hq, hk, plan.num_work, plan.num_entries, kv_row_stride, dkv_row_stride,
            stats.shape[-1], heads_per_cta, scale_log2, premul, softmax_scale / fold, 1.0 / fold, flags,
            current_stream_handle(q.device),
        )
    )  # fmt: skip


def _plan_and_split(q, k, q_ranges, k_ranges, attn_type_map, config, softcap, heads_per_cta, deterministic):
    """``(plan, q heads per CTA, cfg)``: the backward plan and its config, ``config`` or else the
    default, which deterministic mode moves to 64-row q blocks on masks whose key tiles walk few
    blocks (`config.deterministic_bwd_config`; the default-config plan it reads that from stays
    cached). So a deterministic result depends on whether ``config`` was passed."""
    total_k, hk, _ = k.shape

    def plan_for(c: BwdConfig):
        return get_plan(
            q_ranges, k_ranges, attn_type_map, total_k, c.tile_n, c.tile_m, q.device,
            backward=True, deterministic=deterministic,
        )  # fmt: skip

    cfg = config or default_bwd_config(q.shape[-1], softcap > 0.0)
    plan = plan_for(cfg)
    if deterministic and config is None:
        chosen = deterministic_bwd_config(cfg, plan.walk_blocks)
        if chosen is not cfg:
            cfg, plan = chosen, plan_for(chosen)
    split = bwd_heads_per_cta(
        plan.num_work,
        q.shape[1],
        hk,
        _num_sms(q.device.index or 0),
        heads_per_cta,
        plan.walk_blocks * cfg.tile_m,
    )
    return plan, split, cfg


def cute_backward_heads_per_cta(
    q, k, v, q_ranges, k_ranges, attn_type_map, softcap: float, deterministic: bool
) -> int:
    """The q heads per CTA `cute_backward_stage` takes for these arguments by its rule
    (`bwd_heads_per_cta` over the call's plan, the default config). Shapes as for
    `cute_backward_stage`; raises NotImplementedError where the kernel does not serve the call."""
    _, softcap = kernel_scales(q, v, None, softcap, "backward")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return 1
    return _plan_and_split(q, k, q_ranges, k_ranges, attn_type_map, None, softcap, None, deterministic)[1]


def cute_backward_prepare(
    q: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float | None,
    softcap: float,
) -> None:
    """Enqueue the preprocess (`bwd_preprocess`) that the stages of one backward share, on the
    current stream, before any of them, for callers whose K/V rows are still travelling
    (magi-dist): the preprocess reads none of them. `cute_backward_stage` finds it cached when
    it gets the very same ``dout``, ``out`` and ``lse`` objects, unchanged in place since, with
    q's dtype and softmax scale as here, on the same stream, and no other backward's preprocess
    ran between (the cache holds one entry). Where the stage could not find it (``dout`` not
    already contiguous, 16-byte aligned and in q's dtype, so that `_launch` makes a new tensor of
    it; inference tensors, which the cache does not hold) nothing is enqueued. Shapes as for
    `cute_backward_stage`; raises NotImplementedError where the kernel does not serve the call."""
    softmax_scale, _ = kernel_scales(q, v, softmax_scale, softcap, "backward")
    if q.shape[0] == 0:
        return
    if _dout_as_is(dout, q.dtype) and cacheable((dout, out, lse)):  # else the stage's own copy
        bwd_preprocess(dout, out, lse, fold_scale(softmax_scale, q.dtype))


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
    heads_per_cta: int | None = None,
    deterministic: bool = False,
) -> None:
    """sm90 CuTe DSL backward of one stage, added into float32 accumulators in place.

    q: (Tq, Hq, D), k/v: (Tk, Hk, D), bf16 or fp16, D in (64, 128), Hq % Hk == 0; dout / out:
    (Tq, Hq, D) and lse: (Tq, Hq) the FINAL output gradient, output and log-sum-exp of the rows
    (any float dtype); q_ranges / k_ranges int32 (N, 2), attn_type_map int32 (N,) or None, as in
    ``cute_forward``; dq_acc (Tq, Hq, D), dk_acc / dv_acc (Tk, Hk, D) float32, added to (views
    such as ``dkv[:, 0]`` / ``dkv[:, 1]`` of a packed (Tk, 2, Hk, D) buffer are updated in place;
    other layouts go through a contiguous temporary). ``heads_per_cta``: q heads one CTA walks
    (default `bwd_heads_per_cta`). ``head_group``: CTA head slots side by side in the CTA order
    (default `backward_head_group`, which deterministic mode raises). ``deterministic``: bitwise the same result every run (the dQ
    reduce-adds of a q block in a fixed order, and the dK/dV adds of the CTAs that share a K/V
    head in head order). Raises NotImplementedError for what the kernel does not
    serve (head dim, dtype, float64 accumulators): the caller falls back.
    """
    softmax_scale, softcap = kernel_scales(q, v, softmax_scale, softcap, "backward")
    d = q.shape[-1]
    for name, t in (("dq_acc", dq_acc), ("dk_acc", dk_acc), ("dv_acc", dv_acc)):
        if t.dtype != torch.float32:
            raise NotImplementedError(f"{name}: the sm90 backward adds into float32, got {t.dtype}")
    total_q = q.shape[0]
    total_k, hk, _ = k.shape
    if total_q == 0 or total_k == 0:
        return
    dev = q.device
    plan, split, cfg = _plan_and_split(
        q, k, q_ranges, k_ranges, attn_type_map, config, softcap, heads_per_cta, deterministic
    )
    if plan.num_work == 0:
        return
    in_place = dq_acc.is_contiguous() and dq_acc.data_ptr() % 16 == 0  # a TMA reduce target
    dq = dq_acc if in_place else torch.zeros(dq_acc.shape, dtype=torch.float32, device=dev)
    dkv_in_place = _dense_f32(dk_acc) and _dense_f32(dv_acc) and dk_acc.stride(0) == dv_acc.stride(0)
    if dkv_in_place:
        dk, dv, dkv_row_stride = dk_acc, dv_acc, dk_acc.stride(0)
    else:
        dk = torch.zeros(dk_acc.shape, dtype=torch.float32, device=dev)
        dv = torch.zeros(dv_acc.shape, dtype=torch.float32, device=dev)
        dkv_row_stride = hk * d
    _launch(q, k, v, dout, out, lse, plan, cfg, dq, dk, dv, dkv_row_stride, False, split,
            softmax_scale, softcap, head_group, deterministic)  # fmt: skip
    if dq is not dq_acc:
        dq_acc.add_(dq)
    if not dkv_in_place:
        dk_acc.add_(dk)
        dv_acc.add_(dv)


def cute_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor | None,
    *,
    softmax_scale: float | None,
    softcap: float,
    config: BwdConfig | None = None,
    head_group: int | None = None,
    heads_per_cta: int | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole backward of one attention call: ``(dq, dk, dv)`` in q's dtype, q's / k's shapes.

    Arguments as for `cute_backward_stage` (out / lse: the call's output and log-sum-exp).
    When one CTA walks a whole GQA group (always for MHA; see `bwd_heads_per_cta` for GQA),
    dK / dV are stored in the input dtype straight from the kernel: no float32 buffer, no
    atomics, no cast; key tiles nothing covers are zeros. dq goes through a float32 accumulator
    (several key tiles add to a q row) and one cast. ``deterministic`` as for
    `cute_backward_stage`.
    """
    softmax_scale, softcap = kernel_scales(q, v, softmax_scale, softcap, "backward")
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    dev = q.device
    if total_q == 0 or total_k == 0:
        plan = None
    else:
        plan, split, cfg = _plan_and_split(
            q, k, q_ranges, k_ranges, attn_type_map, config, softcap, heads_per_cta, deterministic
        )
    if plan is None or plan.num_work == 0:
        return (
            torch.zeros_like(q),
            torch.zeros(k.shape, dtype=q.dtype, device=dev),
            torch.zeros(v.shape, dtype=q.dtype, device=dev),
        )
    dq = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    if split == hq // hk:
        # every K/V row has one writer: stored in q's dtype; rows no work tile owns (key tiles
        # without work, gaps between documents' key tiles) are never written: zeros then
        alloc = torch.empty if plan.rows_owned == total_k else torch.zeros
        dk = alloc(k.shape, dtype=q.dtype, device=dev)
        dv = alloc(v.shape, dtype=q.dtype, device=dev)
        assert _tma_store_rows(dk) and _tma_store_rows(dv)
        _launch(q, k, v, dout, out, lse, plan, cfg, dq, dk, dv, hk * d, True, split,
                softmax_scale, softcap, head_group, deterministic)  # fmt: skip
    else:
        dk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=dev)
        _launch(q, k, v, dout, out, lse, plan, cfg, dq, dk, dv, hk * d, False, split,
                softmax_scale, softcap, head_group, deterministic)  # fmt: skip
        dk, dv = dk.to(q.dtype), dv.to(q.dtype)
    return dq.to(q.dtype), dk, dv
