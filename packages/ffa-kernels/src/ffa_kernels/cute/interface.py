"""The sm90 forward's host interface: the compiled kernel for a configuration (through
`compile_cache`), the checks every sm90 kernel shares (`kernel_scales`), ``cute_forward``
(fresh output; ``kv_ready``: key/value rows still arriving) and ``cute_forward_accumulate``
(merge into a float32 accumulator in place)."""

from __future__ import annotations

import functools
import logging
import math
import os

import torch

from .._kv_ready import KVReady, refuse_copies
from .._sink import sink_lse
from .._validate import check_accumulator, reads_in_place
from .compile_cache import CompileKey, arch, compiled_kernel, cutlass_modules, dtype_of, placeholder_args
from .config import FWD_HEAD_DIMS, HEAD_GROUP_SHIFT, FwdConfig, default_config
from .kernel_args import ACCUMULATOR_ALIGN, arg_spec, current_stream_handle, make_launcher
from .tile_plan import TilePlan, get_plan

logger = logging.getLogger(__name__)

_LOG2_E = math.log2(math.e)


def compile_key(
    torch_dtype, cfg: FwdConfig, has_softcap: bool, accumulate: bool = False, pack: int = 1,
    wait_kv: bool = False,
) -> CompileKey:  # fmt: skip
    """Everything a compiled forward depends on; no per-call shape or range content. ``pack``
    (GQA packed tiles, G q heads per K/V head) enters the key only when > 1 and ``wait_kv``
    (late key/value rows) only when on, so the other kernels keep their disk-cache names."""
    flags: tuple = (("softcap", bool(has_softcap)), ("accumulate", bool(accumulate)))
    if pack > 1:
        flags += (("pack", int(pack)),)
    if wait_kv:
        flags += (("wait_kv", True),)
    return CompileKey(
        kernel="ffa_fwd_sm90",
        dtype=str(torch_dtype),
        config=cfg.key(),
        flags=flags,
        arg_spec=repr(arg_spec(accumulate)),
        arch=arch(),
    )


def _compile_args(torch_dtype, accumulate: bool = False):
    """Placeholder arguments for cute.compile: null pointers and dummy sizes (all runtime values)."""
    return placeholder_args(arg_spec(accumulate), dtype_of(torch_dtype))


def get_kernel(
    torch_dtype,
    cfg: FwdConfig,
    has_softcap: bool,
    *,
    accumulate: bool = False,
    pack: int = 1,
    wait_kv: bool = False,
    use_disk_cache: bool = True,
):
    """Compiled kernel for (dtype, cfg, softcap, accumulate, pack, wait_kv): memory cache, then
    disk cache, then compile."""

    def build():
        from .fwd_sm90 import FFAForwardSm90

        return FFAForwardSm90(dtype_of(torch_dtype), cfg, has_softcap, accumulate, pack, wait_kv)

    return compiled_kernel(
        compile_key(torch_dtype, cfg, has_softcap, accumulate, pack, wait_kv),
        "ffa_fwd_",
        build,
        lambda: _compile_args(torch_dtype, accumulate),
        f"sm90 forward (dtype={torch_dtype}, hdim={cfg.head_dim}, hdim_v={cfg.head_dim_v}, "
        f"softcap={has_softcap}, accumulate={accumulate}, pack={pack}, wait_kv={wait_kv})",
        use_disk_cache=use_disk_cache,
    )


_L2_BUDGET = 24 * 1024 * 1024


def equal_group(units: int, target: int) -> int:
    """A group size near ``target`` (>= 1) for ``units`` units run group after group: the largest
    divisor of ``units`` up to ``target`` (equal groups) when it is more than half the target,
    else ``target`` itself (a smaller last group: e.g. 7 units with a target of 3 give 3, 3, 1
    rather than seven groups of 1). Clamped to [1, units]."""
    target = max(1, min(units, target))
    even = max(d for d in range(1, target + 1) if units % d == 0)
    return even if 2 * even > target else target


def l2_head_group(unit_bytes: int, heads_per_unit: int, hq: int, override: int | None = None) -> int:
    """How many q heads run side by side in the CTA order (schedule.py): whole units of
    ``heads_per_unit`` q heads, as many as keep the ``unit_bytes`` each unit's CTAs re-read
    within the L2 budget, in equal groups where `equal_group` finds them (``override``: that many
    heads). Clamped to [1, hq]. Equal groups: the groups run one after another, each longest tile
    first, so a last group of fewer heads runs its longest tiles with too few CTAs to fill the
    GPU (on an H100, backward causal 8k with 16 heads: groups of 3, the last of 1, 504 TFLOP/s;
    groups of 2, 570; docs/perf.md)."""
    g = override
    if g is None:
        units = max(1, hq // heads_per_unit)
        g = equal_group(units, _L2_BUDGET // max(1, unit_bytes)) * heads_per_unit
    return int(max(1, min(hq, g, (1 << 23) - 1)))


def head_group_size(
    total_k: int, hq: int, hk: int, d: int, dv: int, elem: int, override: int | None = None
) -> int:
    """The forward's head group: the q heads of whole kv heads whose K (head dim ``d``) and V
    (``dv``) stay in L2."""
    return l2_head_group(total_k * (d + dv) * elem, hq // hk, hq, override)


# A CTA's setup, in blocks of its walk (also tools/sim_head_groups.py's default), and how much
# longer than a head group's work per SM its longest work tile may be before it is doubled.
_CTA_SETUP_BLOCKS = 2
_TAIL_RATIO = 1.5


def tail_head_group(group: int, heads_per_unit: int, hq: int, plan: TilePlan, num_sms: int) -> int:
    """The forward's head group ``group`` (the L2 rule's), doubled where one group's work is too
    thin to hide its longest work tile: groups run one after another, each longest tile first,
    so when a tile walks more than ``_TAIL_RATIO`` times the group's blocks per SM, the next
    group's first CTAs start before it ends and the last group leaves SMs idle. Document masks
    with one long document among short ones at 32k do that with the L2 rule's groups of 1 (16
    heads): on an H100, long-tailed causal 16:16 471-489 -> 514 TFLOP/s, few-long-many-short
    causal 496 -> 524 with groups of 2 (tools/sim_head_groups.py models 1.061 -> 1.009 and
    1.033 -> 1.004 of the ideal makespan); the masks whose ratio stays under 1.5 did not gain.
    Doubled once at most, in whole units of ``heads_per_unit`` heads, and only into equal groups
    (`equal_group`'s choice must divide the units: 5 heads stay in groups of 1 rather than 4 + 1,
    whose last group is the tail again); the L2 budget is what stops larger groups (4 lost to 2
    there)."""
    if group >= hq or plan.num_work == 0:
        return group
    per_head = plan.total_blocks + _CTA_SETUP_BLOCKS * plan.num_work
    if plan.max_walk + _CTA_SETUP_BLOCKS <= _TAIL_RATIO * group * per_head / num_sms:
        return group
    units = hq // heads_per_unit
    doubled = equal_group(units, 2 * group // heads_per_unit)
    return doubled * heads_per_unit if units % doubled == 0 else group


# GQA packed forward tiles (a tile's rows: tile_m / G tokens x the G q heads of one K/V head,
# as FA4's pack_gqa): None chooses per call by plan cost (`choose_pack`), False never, True
# wherever allowed (tests). Left at None, $FFA_PACK_GQA may force ("1") or refuse ("0") them.
PACK_GQA: bool | None = None
_PACK_ENV = {"0": False, "1": True}
ENV_PACK_GQA = "FFA_PACK_GQA"


def pack_gqa_setting() -> bool | None:
    """`PACK_GQA` if set, else ``$FFA_PACK_GQA`` ("1": True, "0": False, else None: by cost)."""
    if PACK_GQA is not None:
        return PACK_GQA
    return _PACK_ENV.get(os.environ.get(ENV_PACK_GQA, "").strip().lower())


def choose_pack(g: int, plan: TilePlan, packed: TilePlan, forced: bool = False) -> int:
    """``g`` (pack the G q heads of each K/V head into a tile) when the packed plan costs less
    over all heads than the plain one (`TilePlan.cost` per CTA head: the plain plan runs for G
    times as many) or ``forced`` (`PACK_GQA` = True or $FFA_PACK_GQA=1), else 1. Short documents
    gain: at 32k causal with 128 x 128 blocks, blocks over the mask's ideal per head fall from
    1.71 to 1.43 (many short documents) and 1.10 to 1.05 (12 of uniform length) with 8 heads
    packed."""
    if forced:
        return g
    return g if packed.cost() < plan.cost() * g else 1


def plan_and_pack(q_ranges, k_ranges, attn_type_map, total_q: int, cfg: FwdConfig, hq: int, hk: int, device):
    """``(pack, plan)`` of a forward call: G = hq / hk packed q heads per tile and the plan of
    tile_m / G tokens per tile where `choose_pack` takes them (GQA, tile_m a multiple of G,
    packing allowed by `pack_gqa_setting`), else ``(1, the plain plan)``."""
    plan = get_plan(q_ranges, k_ranges, attn_type_map, total_q, cfg.tile_m, cfg.tile_n, device)
    g = hq // hk
    setting = pack_gqa_setting()  # read once per call
    if g > 1 and cfg.tile_m % g == 0 and setting is not False:
        packed = get_plan(q_ranges, k_ranges, attn_type_map, total_q, cfg.tile_m // g, cfg.tile_n, device)
        if choose_pack(g, plan, packed, forced=setting is True) > 1:
            return g, packed
    return 1, plan


@functools.cache
def num_sms(device_index: int) -> int:
    """The SM count of CUDA device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def score_constants(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """``(scale_log2, score_premul)`` of the kernels' softmax: exp2(s * scale_log2 - ...) with
    s the raw score, or with softcap, s = tanh(premul * raw) and scale_log2 = softcap * log2(e)."""
    if softcap > 0.0:
        return softcap * _LOG2_E, softmax_scale / softcap
    return softmax_scale * _LOG2_E, 1.0


def _sink_lse(sink, sink_layout: str, total_q: int, num_heads: int, device) -> torch.Tensor | None:
    """Per-row sink log-sum-exp, float32 ``(Tq, Hq)`` contiguous (what the kernel reads), or None."""
    if sink is None:
        return None
    lse = sink_lse(sink.to(device=device, dtype=torch.float32), sink_layout)  # (Hq,) or (Tq, Hq)
    return lse.expand(total_q, num_heads).contiguous()


class _Runtime:
    """What every launch needs, imported/built once (keeps the per-call host path short)."""

    def __init__(self):
        cutlass_modules()
        from .fwd_sm90 import FLAG_HAS_SINK, FLAG_MAX_LOGITS

        self.flag_sink, self.flag_ml = FLAG_HAS_SINK, FLAG_MAX_LOGITS
        self.launchers: dict[tuple, object] = {}

    def launcher(
        self,
        torch_dtype,
        cfg: FwdConfig,
        has_softcap: bool,
        accumulate: bool,
        pack: int = 1,
        wait_kv: bool = False,
    ):
        key = (torch_dtype, cfg, has_softcap, accumulate, pack, wait_kv)
        fn = self.launchers.get(key)
        if fn is None:
            kernel = get_kernel(
                torch_dtype, cfg, has_softcap, accumulate=accumulate, pack=pack, wait_kv=wait_kv
            )
            fn = self.launchers[key] = make_launcher(kernel, arg_spec(accumulate), dtype_of(torch_dtype))
        return fn


_RT: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RT
    if _RT is None:
        _RT = _Runtime()
    return _RT


# (q/k head dim, v head dim) pairs each sm90 kernel serves (the frontend falls back to the
# reference for the others): the forward also MLA's 192 / 128, the backward only Dv == D
SUPPORTED_HEAD_DIMS: dict[str, tuple[tuple[int, int], ...]] = {
    "forward": FWD_HEAD_DIMS,
    "backward": ((64, 64), (128, 128)),
}


def kernel_scales(
    q: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, softcap: float, what: str
) -> tuple[float, float]:
    """``(softmax_scale, softcap)`` as the kernels take them (None -> D ** -0.5; softcap <= 0 -> 0),
    after the checks every sm90 kernel shares. "Unsupported" is said (NotImplementedError, naming
    ``what``: "forward" or "backward") before anything runs: the frontend then serves the call
    from the reference backend."""
    d, dv = q.shape[-1], v.shape[-1]
    pairs = SUPPORTED_HEAD_DIMS[what]
    if (d, dv) not in pairs:
        dims = tuple(sorted({p[0] for p in pairs}))
        if d not in dims:
            raise NotImplementedError(f"head_dim: the sm90 {what} supports {dims}, got {d}")
        dvs = tuple(p[1] for p in pairs if p[0] == d)
        same = " (equal to q's)" if dvs == (d,) else ""
        raise NotImplementedError(
            f"head_dim: the sm90 {what} needs v's head dim {' or '.join(map(str, dvs))}{same} "
            f"at q's head dim {d}, got {dv}"
        )
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"q: the sm90 {what} supports bfloat16 and float16, got {q.dtype}")
    softmax_scale = float(d**-0.5 if softmax_scale is None else softmax_scale)
    if not softmax_scale > 0.0:
        # the kernels mask scores to -inf before scaling them: a scale <= 0 would turn masked
        # cells into +inf or NaN
        raise NotImplementedError(f"softmax_scale: the sm90 {what} supports scales > 0, got {softmax_scale}")
    softcap = float(softcap) if softcap and softcap > 0.0 else 0.0
    return softmax_scale, softcap


def _prepare(
    q: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, softcap: float, config: FwdConfig | None
):
    """Checks and settings both forward entry points share: (runtime, config, softmax_scale, softcap)."""
    softmax_scale, softcap = kernel_scales(q, v, softmax_scale, softcap, "forward")
    d, dv = q.shape[-1], v.shape[-1]
    if config is None:
        config = default_config(d, dv)
    elif (config.head_dim, config.head_dim_v) != (d, dv):
        raise ValueError(
            f"config: compiled for head dims ({config.head_dim}, {config.head_dim_v}), "
            f"but q and v have ({d}, {dv})"
        )
    return _runtime(), config, softmax_scale, softcap


def accumulators_fit(
    out_acc: torch.Tensor, lse_acc: torch.Tensor, max_logits_acc: torch.Tensor | None
) -> bool:
    """Whether the accumulate kernel can merge into these tensors themselves: float32,
    contiguous, bases aligned as ``ACCUMULATOR_ALIGN`` says."""
    named = (("out_acc", out_acc), ("lse_acc", lse_acc), ("max_logits_acc", max_logits_acc))
    return all(
        t is None
        or (t.dtype == torch.float32 and t.is_contiguous() and t.data_ptr() % ACCUMULATOR_ALIGN[name] == 0)
        for name, t in named
    )


def _check_accumulator(name: str, t: torch.Tensor, shape: tuple, device) -> None:
    check_accumulator(name, t, shape, device, torch.float32)
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (it is updated in place)")
    if t.data_ptr() % ACCUMULATOR_ALIGN[name] != 0:
        raise ValueError(f"{name}: data pointer must be {ACCUMULATOR_ALIGN[name]}-byte aligned")


def _aligned16(t: torch.Tensor) -> torch.Tensor:
    # TMA and the compiled kernel assume 16-byte aligned bases
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _rows_in_place(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(t, row stride in elements)`` as the kernels read K or V: in place where it can
    (`reads_in_place`: packed K/V views among them), else a contiguous copy first. K and V are
    taken each on its own (their row strides are separate kernel arguments)."""
    if reads_in_place(t):
        return t, t.stride(0)
    return _aligned16(t.contiguous()), t.shape[1] * t.shape[2]


def _kv_rows(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(k, v, row stride in elements)`` as the backward kernel reads them, with one row stride
    for both: each as `_rows_in_place` takes it (packed K/V, e.g. views ``kv[:, 0]`` /
    ``kv[:, 1]`` of a ``(Tk, 2, Hk, D)`` tensor, are read in place); if their strides then
    differ, both are copied to contiguous tensors. v must have k's shape (Dv == D)."""
    assert v.shape == k.shape, (
        f"_kv_rows: one row stride for K and V needs equal shapes, got {k.shape}, {v.shape}"
    )
    (k_in, k_stride), (v_in, v_stride) = _rows_in_place(k), _rows_in_place(v)
    if k_stride == v_stride:
        return k_in, v_in, k_stride
    # the one _rows_in_place copied is contiguous already (no second copy of it)
    return _aligned16(k_in.contiguous()), _aligned16(v_in.contiguous()), k.shape[1] * k.shape[2]


def _launch(
    rt: _Runtime, accumulate: bool, cfg: FwdConfig, q, k, v, out, lse, plan, sink_lse, max_logits,
    softmax_scale: float, softcap: float, flags: int, head_group: int | None, pack: int = 1,
    kv_ready: KVReady | None = None,
) -> None:  # fmt: skip
    """Fill the kernel's arguments (see kernel_args.arg_spec) and launch on the current stream.

    sink_lse / max_logits may be None (the kernel reads them only under their flags; any valid
    pointer of the right alignment stands in). ``pack`` > 1: GQA packed tiles (``plan`` built
    with tile_m / pack tokens per tile); the head group then counts K/V heads. ``kv_ready``
    (checked, some rows late): the ``wait_kv`` kernel."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    has_softcap = softcap > 0.0
    ready_ptr, ready_value, ready_row = (
        (lse.data_ptr(), 0, total_k) if kv_ready is None
        else (kv_ready.flag.data_ptr(), kv_ready.value, kv_ready.first_row)
    )  # fmt: skip
    if kv_ready is not None:  # the copy `_rows_in_place` would make reads the late rows early
        refuse_copies(k, v)
    q = _aligned16(q)
    k, k_row_stride = _rows_in_place(k)
    v, v_row_stride = _rows_in_place(v)
    fn = rt.launcher(q.dtype, cfg, has_softcap, accumulate, pack, kv_ready is not None)
    scale_log2, premul = score_constants(softmax_scale, softcap)
    ctas_per_tile = hq // pack  # the CTAs' head axis: q heads, or packed K/V heads
    override = None if head_group is None else max(1, head_group // pack)
    group = head_group_size(total_k, ctas_per_tile, hk, d, v.shape[2], q.element_size(), override)
    if head_group is None:
        unit = ctas_per_tile // hk
        group = tail_head_group(group, unit, ctas_per_tile, plan, num_sms(q.device.index or 0))
    flags |= group << HEAD_GROUP_SHIFT
    fn(
        (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            plan.work.data_ptr(), plan.entries.data_ptr(),
            (sink_lse if sink_lse is not None else out).data_ptr(),
            (max_logits if max_logits is not None else lse).data_ptr(), ready_ptr,
            total_q, total_k, hq, hk, plan.num_work, plan.num_entries, k_row_stride, v_row_stride,
            scale_log2, premul, softmax_scale, flags, ready_value, ready_row,
            current_stream_handle(q.device),
        )
    )  # fmt: skip


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
    kv_ready: KVReady | None = None,
):
    """sm90 CuTe DSL forward. q (Tq,Hq,D), k (Tk,Hk,D), v (Tk,Hk,Dv) with (D, Dv) one of
    ``SUPPORTED_HEAD_DIMS["forward"]``. Returns (out (Tq,Hq,Dv) q.dtype, lse f32 (Tq,Hq),
    max_logits f32 (Hq,) | None). ``kv_ready`` (checked by `_kv_ready.check_kv_ready`, which
    gives None where no row is late): rows from its ``first_row`` on are read only once its
    flag holds ``value`` (the ``wait_kv`` kernel)."""
    rt, cfg, softmax_scale, softcap = _prepare(q, v, softmax_scale, softcap, config)
    total_q, hq, _ = q.shape
    total_k = k.shape[0]
    dev = q.device
    out = torch.empty(total_q, hq, v.shape[2], dtype=q.dtype, device=dev)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=dev)
    sink_lse = _sink_lse(sink, sink_layout, total_q, hq, dev)
    max_logits = (
        torch.full((hq,), float("-inf"), dtype=torch.float32, device=dev) if return_max_logits else None
    )
    if total_q == 0:
        return out, lse, max_logits
    pack, plan = plan_and_pack(q_ranges, k_ranges, attn_type_map, total_q, cfg, hq, k.shape[1], dev)
    if plan.total_blocks == 0 or total_k == 0:  # nothing covered: no launch (and no 0-sized TMA descriptor)
        out.zero_()
        if sink_lse is not None:
            lse.copy_(sink_lse)
        else:
            lse.fill_(float("-inf"))
        return out, lse, max_logits
    flags = (rt.flag_sink if sink_lse is not None else 0) | (rt.flag_ml if return_max_logits else 0)
    _launch(
        rt,
        False,
        cfg,
        q,
        k,
        v,
        out,
        lse,
        plan,
        sink_lse,
        max_logits,
        softmax_scale,
        softcap,
        flags,
        head_group,
        pack,
        kv_ready,
    )
    return out, lse, max_logits


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

    q: (Tq, Hq, D), k: (Tk, Hk, D), v: (Tk, Hk, Dv), bf16 or fp16, Hq % Hk == 0, (D, Dv) in
    (64, 64), (128, 128), (256, 256), (192, 128).
    q_ranges/k_ranges: int32 (N, 2), attn_type_map: int32 (N,) or None (all FULL), as in
    ``cute_forward``. The slices of one call must not cover a cell twice.
    out_acc: float32 (Tq, Hq, Dv), contiguous, 16-byte aligned; lse_acc: float32 (Tq, Hq),
    contiguous: a previous partial result (out normalised, lse natural log; rows with
    lse = -inf hold out = 0, though their out is ignored and may hold anything).
    max_logits_acc: float32 (Hq,) or None; max-updated with this call's softmax_scale * q.k max.

    For every row this call covers: l = logaddexp(l_acc, l_new), out = exp(l_acc - l) * out_acc +
    exp(l_new - l) * out_new, written back in float32; a row with l_acc = -inf becomes
    (out_new, l_new). Rows this call does not cover are not written. No sink in this mode (add
    the sink once, outside). Several calls over disjoint key sets thus combine to the result of
    one call over their union. Returns (out_acc, lse_acc), the same tensors.
    """
    rt, cfg, softmax_scale, softcap = _prepare(q, v, softmax_scale, softcap, config)
    total_q, hq, _ = q.shape
    total_k = k.shape[0]
    dev = q.device
    _check_accumulator("out_acc", out_acc, (total_q, hq, v.shape[2]), dev)
    _check_accumulator("lse_acc", lse_acc, (total_q, hq), dev)
    if max_logits_acc is not None:
        _check_accumulator("max_logits_acc", max_logits_acc, (hq,), dev)
    if total_q == 0 or total_k == 0:
        return out_acc, lse_acc
    plan = get_plan(q_ranges, k_ranges, attn_type_map, total_q, cfg.tile_m, cfg.tile_n, dev)
    if plan.total_blocks == 0:  # nothing covered: nothing to merge
        return out_acc, lse_acc
    flags = rt.flag_ml if max_logits_acc is not None else 0
    _launch(
        rt,
        True,
        cfg,
        q,
        k,
        v,
        out_acc,
        lse_acc,
        plan,
        None,
        max_logits_acc,
        softmax_scale,
        softcap,
        flags,
        head_group,
    )
    return out_acc, lse_acc
