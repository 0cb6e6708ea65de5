"""Input validation, done once per call and before any compute: the one module that
ffa_kernels and magi_dist share (magi_dist's ``calc_attn`` calls `validate_attn_inputs`).

Every error names the offending argument and the value seen, so a wrong call fails loudly
instead of producing a silently wrong result. The checks are cheap: shape/dtype/device checks
are metadata only, and the range values reach the host once (one device-to-host copy of an
``(N, 5)`` int tensor), after which the value checks are vectorised; repeated calls with the
same range tensors reuse the result (see ``_CHECKED_RANGES`` for what a hit needs). The range
tensors of a live `ffa_kernels.FlexMask` were checked when it was built (`register_mask`): they
skip the value checks for as long as they live unmodified, with no cache to fall out of. Range
tensors checked by a call get the same kind of record for their normalised (device) copies, so
the next call with them, and the kernels' plan lookup (cute/tile_plan.py), cost one dict lookup.
What is checked where, and what is not, is in docs/reliability.md.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from dataclasses import dataclass, field

import torch

from ._identity_cache import IdentityCache, cacheable

__all__ = [
    "SUPPORTED_DTYPES",
    "AttnInputs",
    "ValidatedAttnArgs",
    "accumulator_dtype",
    "check_accumulator",
    "check_attn_metadata",
    "check_bool",
    "check_float_tensor",
    "check_sink",
    "check_sink_shape",
    "check_token_tensor",
    "mask_record",
    "register_mask",
    "validate_attn_args",
    "validate_attn_inputs",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SINK_LAYOUTS = ("sh", "ssh")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that attention over inputs of ``dtype`` accumulates in: float64 for float64
    (the reference path's exact checks), float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ValidatedAttnArgs:
    """Normalised attention arguments (contiguous tensors, defaults resolved).

    Attributes:
        q, k, v: ``(Tq, Hq, D)`` contiguous, ``(Tk, Hk, D)``, ``(Tk, Hk, D)`` with contiguous
            rows (rows may stand apart: packed K/V).
        q_ranges, k_ranges: contiguous int32 ``(N, 2)`` on q's device.
        attn_type_map: contiguous int32 ``(N,)`` on q's device (all FULL when None was given).
        slices: host copy, one ``(qs, qe, ks, ke, type)`` tuple of ints per slice.
        softmax_scale: resolved scale (``D ** -0.5`` when None was given).
        softcap: float >= 0 (0 disables softcap).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    slices: list[tuple[int, int, int, int, int]]
    softmax_scale: float
    softcap: float

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the reference math and of the stage accumulators (`accumulator_dtype`)."""
        return accumulator_dtype(self.q.dtype)


def _desc(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_token_tensor(name: str, t: object) -> torch.Tensor:
    """Check that ``t`` is a 3-D ``(tokens, heads, head_dim)`` tensor (q, k or v); return it."""
    t = _require_tensor(name, t)
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (tokens, heads, head_dim), got {_desc(t)}")
    return t


def _check_qkv(q: object, k: object, v: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = {
        "q": check_token_tensor("q", q),
        "k": check_token_tensor("k", k),
        "v": check_token_tensor("v", v),
    }
    for name, t in tensors.items():
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype must be one of float16/bfloat16/float32/float64, got {t.dtype}")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same tokens and heads, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if v.shape[2] < 1:
        raise ValueError(f"v's head_dim must be >= 1, got v {_desc(v)}")
    hq, d = q.shape[1], q.shape[2]
    hk = k.shape[1]
    if hq < 1 or hk < 1:
        raise ValueError(f"head counts must be >= 1, got q heads {hq}, k heads {hk}")
    if d < 1:
        raise ValueError(f"head_dim must be >= 1, got q {_desc(q)}")
    if k.shape[2] != d:
        raise ValueError(f"head_dim mismatch: q has {d}, k has {k.shape[2]}")
    if hq % hk != 0:
        raise ValueError(f"num_heads_q ({hq}) must be a multiple of num_heads_kv ({hk})")
    # The kernels and our views assume contiguous q and dense rows of K/V; copying is never
    # wrong, whereas a wrong stride assumption would be. K/V rows may stand apart (packed K/V,
    # e.g. kv[:, 0] and kv[:, 1] of a (Tk, 2, Hk, D) tensor): the kernel reads those in place.
    return q.contiguous(), _dense_rows(k), _dense_rows(v)


def has_dense_rows(t: torch.Tensor) -> bool:
    """Whether each row's ``(H, D)`` block of the 3-D ``t`` is contiguous (rows any distance
    apart, not overlapping): the K/V layout the kernels read in place."""
    _, h, d = t.shape
    st = t.stride()
    return st[2] == 1 and (st[1] == d or h == 1) and st[0] >= h * d


def reads_in_place(t: torch.Tensor) -> bool:
    """Whether the sm90 kernels read K or V ``t`` where it lies: dense rows (`has_dense_rows`)
    a multiple of 16 bytes apart (a stride that fits an int32) and a 16-byte aligned base (TMA);
    anything else is copied first."""
    stride = t.stride(0)
    return (
        has_dense_rows(t)
        and stride < 2**31
        and stride * t.element_size() % 16 == 0
        and t.data_ptr() % 16 == 0
    )


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it `has_dense_rows`, else a contiguous copy."""
    return t if has_dense_rows(t) else t.contiguous()


def _check_index_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    t = _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got dtype {t.dtype}")
    if t.device != device and t.device.type != "cpu":
        raise ValueError(f"{name} must be on q's device ({device}) or on the CPU, got {t.device}")
    return t


def _first_bad(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask)[0, 0])


# Range checks already done, so that a repeated call makes no device->host copy and no sync.
# A hit needs the same tensor objects with the same version counter (`IdentityCache`), and for
# ranges on the host also the same content: reading host memory costs no sync, and it sees the
# writes that the version counter misses (through .numpy() or .data, or dist.broadcast into the
# tensor). Ranges on q's device are trusted by their version counter alone: comparing their
# content would copy them to the host and wait for the stream on every call. Writes to device
# ranges that bypass the counter are therefore not seen; docs/reliability.md says so.
_CHECKED_RANGES = IdentityCache(maxsize=256)


def _host_content(tensors: tuple[torch.Tensor | None, ...]) -> tuple[bytes | None, ...]:
    """The bytes of the host tensors among ``tensors`` (None for device tensors and None)."""
    return tuple(t.numpy().tobytes() if t is not None and t.device.type == "cpu" else None for t in tensors)


@dataclass(eq=False)
class MaskRecord:
    """What `ffa_kernels.FlexMask` checked once (``owned``), or a call checked of its ranges on
    q's device (`_remember_checked`): kept beside the ``q_ranges`` tensor (weakly referenced, so
    it lives exactly as long as the tensors). ``plans``: the CuTe tile plans of the mask
    (cute/tile_plan.py), kept here so that live ranges never plan twice."""

    q_ref: weakref.ReferenceType
    k_ref: weakref.ReferenceType
    tm_ref: weakref.ReferenceType
    versions: tuple[int, int, int]
    total_q: int
    total_k: int
    device: torch.device
    slices: list[tuple[int, int, int, int, int]]
    plans: dict = field(default_factory=dict)
    # False for the records `_check_ranges` keeps of ranges it checked: those give way to a
    # FlexMask's (owned) record of the same tensors, never the other way round
    owned: bool = True


# id(q_ranges) -> record; the entry goes when that tensor dies (weakref callback), before its
# id can be reused. A plain dict: the lookup on every call is one dict.get.
_MASK_RECORDS: dict[int, MaskRecord] = {}


def _forget(key: int, ref: weakref.ReferenceType) -> None:
    rec = _MASK_RECORDS.get(key)
    if rec is not None and rec.q_ref is ref:
        del _MASK_RECORDS[key]


def register_mask(
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor,
    total_q: int,
    total_k: int,
    slices: list[tuple[int, int, int, int, int]],
    owned: bool = True,
) -> MaskRecord:
    """Record that these (contiguous int32, one device) range tensors hold the checked ``slices``
    for ``total_q`` x ``total_k`` tokens. For `ffa_kernels.FlexMask`, which owns the tensors
    (``owned``), and for ranges a call checked (`_check_ranges`)."""
    key = id(q_ranges)
    rec = MaskRecord(
        weakref.ref(q_ranges, functools.partial(_forget, key)),
        weakref.ref(k_ranges),
        weakref.ref(attn_type_map),
        (q_ranges._version, k_ranges._version, attn_type_map._version),
        int(total_q),
        int(total_k),
        q_ranges.device,
        slices,
        owned=owned,
    )
    _MASK_RECORDS[key] = rec
    return rec


def mask_record(
    q_ranges: object,
    k_ranges: object,
    attn_type_map: object,
    total_q: int | None = None,
    total_k: int | None = None,
) -> MaskRecord | None:
    """The record of these tensors (a live `FlexMask`'s, or ranges a call checked on q's
    device), unmodified since it was made (and made for ``total_q`` x ``total_k`` when they are
    given), else None. No device access."""
    rec = _MASK_RECORDS.get(id(q_ranges))
    if rec is None or rec.q_ref() is not q_ranges:
        return None
    if rec.k_ref() is not k_ranges or rec.tm_ref() is not attn_type_map:
        return None
    # the record's own (live) tensors from here on; the checks only narrow their types
    if not (
        isinstance(q_ranges, torch.Tensor)
        and isinstance(k_ranges, torch.Tensor)
        and isinstance(attn_type_map, torch.Tensor)
    ):
        return None
    if (q_ranges._version, k_ranges._version, attn_type_map._version) != rec.versions:
        return None  # written in place: not the checked mask any more
    if (total_q is not None and total_q != rec.total_q) or (total_k is not None and total_k != rec.total_k):
        return None
    return rec


def _check_ranges(
    q_ranges: object, k_ranges: object, attn_type_map: object, tq: int, tk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, int]]]:
    rec = mask_record(q_ranges, k_ranges, attn_type_map, tq, tk)
    if rec is not None and rec.device == device:
        # a FlexMask's tensors, or device ranges an earlier call checked: unmodified since
        assert isinstance(q_ranges, torch.Tensor) and isinstance(k_ranges, torch.Tensor)
        assert isinstance(attn_type_map, torch.Tensor)  # mask_record checked all three
        return q_ranges, k_ranges, attn_type_map, rec.slices
    tensors = _check_range_tensors(q_ranges, k_ranges, attn_type_map, device)
    if not cacheable(tensors):  # inference tensors: no version counter to key by
        return _check_ranges_uncached(q_ranges, k_ranges, attn_type_map, tq, tk, device)
    extra = (tq, tk, str(device))
    content = _host_content(tensors)
    hit = _CHECKED_RANGES.get(tensors, extra)
    if hit is not None and hit[0] == content:
        result = hit[1]
    else:
        result = _check_ranges_uncached(q_ranges, k_ranges, attn_type_map, tq, tk, device)
        _CHECKED_RANGES.put(tensors, extra, (content, result))
    _remember_checked(result, tq, tk)
    return result


def _remember_checked(
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, int]]],
    tq: int,
    tk: int,
) -> None:
    """Keep a record (`register_mask`, not owned) of the checked ranges ``result`` (normalised:
    on q's device), unless they have a current one or a FlexMask's record of the same live
    tensors exists. Ranges on the CPU (a CPU call's) keep none: a write through ``.numpy()``
    misses the version counter, so they are compared by content every call; device ranges are
    trusted by their version counter, as in ``_CHECKED_RANGES``. Inference tensors (normalised
    copies made under ``torch.inference_mode``) have no version counter: none either."""
    qr, kr, tm, slices = result
    if qr.device.type == "cpu" or not cacheable((qr, kr, tm)):
        return
    if mask_record(qr, kr, tm, tq, tk) is not None:
        return
    old = _MASK_RECORDS.get(id(qr))
    if old is not None and old.owned and old.q_ref() is qr:
        return
    register_mask(qr, kr, tm, tq, tk, slices, owned=False)


def _check_range_tensors(
    q_ranges: object, k_ranges: object, attn_type_map: object, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Types, dtypes, devices and shapes of the range arguments (metadata only, no copy)."""
    qr = _check_index_tensor("q_ranges", q_ranges, device)
    kr = _check_index_tensor("k_ranges", k_ranges, device)
    for name, t in (("q_ranges", qr), ("k_ranges", kr)):
        if t.dim() != 2 or t.shape[1] != 2:
            raise ValueError(f"{name} must have shape (N, 2), got {tuple(t.shape)}")
    n = qr.shape[0]
    if kr.shape[0] != n:
        raise ValueError(f"q_ranges and k_ranges must have the same N, got {qr.shape[0]} and {kr.shape[0]}")
    if attn_type_map is None:
        return qr, kr, None
    tm = _check_index_tensor("attn_type_map", attn_type_map, device)
    if tm.dim() != 1 or tm.shape[0] != n:
        raise ValueError(f"attn_type_map must have shape (N,) = ({n},), got {tuple(tm.shape)}")
    return qr, kr, tm


def _check_ranges_uncached(
    q_ranges: object, k_ranges: object, attn_type_map: object, tq: int, tk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, int]]]:
    qr, kr, tm = _check_range_tensors(q_ranges, k_ranges, attn_type_map, device)
    if tm is None:
        tm = torch.zeros(qr.shape[0], dtype=torch.int32, device=qr.device)

    # One host copy for all value checks (and for the reference backend's slice loop).
    parts = [qr, kr, tm.view(-1, 1)]
    if len({t.device for t in parts}) > 1:  # mixed CPU / q's device: gather on q's device
        parts = [t.to(device) for t in parts]
    # Ranges already on the CPU stay there (no host -> device -> host round trip).
    host = torch.cat(parts, dim=1).to(device="cpu", dtype=torch.int64)
    for name, cols, limit in (("q_ranges", (0, 1), tq), ("k_ranges", (2, 3), tk)):
        start, end = host[:, cols[0]], host[:, cols[1]]
        for bad, what in (
            (start < 0, "has a negative start"),
            (end < start, "has end < start"),
            (end > limit, f"has end > {'Tq' if name == 'q_ranges' else 'Tk'} = {limit}"),
        ):
            if bool(bad.any()):
                i = _first_bad(bad)
                raise ValueError(f"{name}[{i}] = [{int(start[i])}, {int(end[i])}) {what}")
    codes = host[:, 4]
    bad = (codes < 0) | (codes > 3)
    if bool(bad.any()):
        i = _first_bad(bad)
        raise ValueError(f"attn_type_map[{i}] = {int(codes[i])} is not a mask type code in 0..3")

    slices = [tuple(row) for row in host.tolist()]
    return (
        qr.to(device=device).contiguous(),
        kr.to(device=device).contiguous(),
        tm.to(device=device).contiguous(),
        slices,
    )


def _check_real(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(x).__name__} {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return x


def validate_attn_args(
    q: object,
    k: object,
    v: object,
    q_ranges: object,
    k_ranges: object,
    attn_type_map: object,
    softmax_scale: object,
    softcap: object,
) -> ValidatedAttnArgs:
    """Check and normalise the arguments shared by every entry point (see module docstring)."""
    q, k, v = _check_qkv(q, k, v)
    qr, kr, tm, slices = _check_ranges(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0], q.device)
    scale, cap = _check_scale_softcap(q, softmax_scale, softcap)
    return ValidatedAttnArgs(q, k, v, qr, kr, tm, slices, scale, cap)


def check_attn_metadata(
    q: object,
    k: object,
    v: object,
    q_ranges: object,
    k_ranges: object,
    attn_type_map: object,
    softmax_scale: object,
    softcap: object,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, float
]:
    """`validate_attn_args` without the range values: types, shapes, dtypes, devices, scale and
    softcap; ``(q, k, v, q_ranges, k_ranges, attn_type_map or None, softmax_scale, softcap)``
    normalised as there. Metadata only (no copy of the ranges, no device access), so it also runs
    while torch.compile traces; the values are then checked by the operator when it runs
    (`validate_attn_args` in `_ops.py`)."""
    q, k, v = _check_qkv(q, k, v)
    qr, kr, tm = _check_range_tensors(q_ranges, k_ranges, attn_type_map, q.device)
    scale, cap = _check_scale_softcap(q, softmax_scale, softcap)
    return q, k, v, qr, kr, tm, scale, cap


def _check_scale_softcap(q: torch.Tensor, softmax_scale: object, softcap: object) -> tuple[float, float]:
    scale = q.shape[2] ** -0.5 if softmax_scale is None else _check_real("softmax_scale", softmax_scale)
    cap = _check_real("softcap", softcap)
    if cap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {cap}")
    return scale, cap


@dataclass(frozen=True)
class AttnInputs:
    """What `validate_attn_inputs` checked, normalised: q contiguous, k/v with dense rows, the
    sink contiguous (or None), ``softmax_scale`` resolved (``D ** -0.5`` for None), ``softcap``
    a float >= 0."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sink: torch.Tensor | None
    sink_layout: str
    softmax_scale: float
    softcap: float
    return_max_logits: bool


def validate_attn_inputs(
    q: object,
    k: object,
    v: object,
    *,
    sink: object = None,
    sink_layout: object = "sh",
    softmax_scale: object = None,
    softcap: object = 0.0,
    return_max_logits: object = False,
) -> AttnInputs:
    """Check every argument of `flex_flash_attn_func` but the ranges, with its messages.

    The same checks `flex_flash_attn_func` makes (q/k/v shapes, dtypes and devices, GQA;
    ``softmax_scale`` None or a finite real, not a bool or a string; ``softcap`` a finite real
    >= 0; ``sink`` float32 (float64 for float64 q) of its layout's shape on q's device;
    ``return_max_logits`` a bool), for callers that build the ranges themselves: magi_dist's
    ``calc_attn`` runs them before any collective, on every rank, so a bad argument fails the
    same way everywhere instead of on the ranks that happen to have work.

    Raises:
        TypeError / ValueError naming the argument and the value seen.
    """
    q, k, v = _check_qkv(q, k, v)
    scale, cap = _check_scale_softcap(q, softmax_scale, softcap)
    sink = check_sink(sink, sink_layout, q)
    assert isinstance(sink_layout, str)  # check_sink checked it
    return AttnInputs(
        q, k, v, sink, sink_layout, scale, cap, check_bool("return_max_logits", return_max_logits)
    )


def check_sink_shape(sink: object, sink_layout: object, tq: int, hq: int) -> torch.Tensor:
    """Check that ``sink`` is a tensor of the shape its layout needs for ``tq`` rows, ``hq`` heads.

    ``"sh"``: ``(S_sink, hq)``; ``"ssh"``: ``(tq, S_sink, hq)``; ``S_sink >= 1``. Returns the sink
    unchanged. Shared by `check_sink` and the public sink helpers (`apply_sink`, `sink_backward`),
    where a wrong shape could otherwise broadcast silently (e.g. an ``(Tq, 1, Hq)`` sink as "sh").
    """
    if not isinstance(sink_layout, str) or sink_layout not in SINK_LAYOUTS:
        raise ValueError(f"sink_layout must be 'sh' or 'ssh', got {sink_layout!r}")
    sink = _require_tensor("sink", sink)
    if sink_layout == "sh":
        ok = sink.dim() == 2 and sink.shape[1] == hq and sink.shape[0] >= 1
        expected = f"(S_sink, {hq})"
    else:
        ok = sink.dim() == 3 and sink.shape[0] == tq and sink.shape[2] == hq and sink.shape[1] >= 1
        expected = f"({tq}, S_sink, {hq})"
    if not ok:
        raise ValueError(
            f"sink with sink_layout={sink_layout!r} must have shape {expected} with S_sink >= 1, "
            f"got {tuple(sink.shape)}"
        )
    return sink


def check_sink(sink: object, sink_layout: object, q: torch.Tensor) -> torch.Tensor | None:
    """Validate a sink for queries ``q`` ``(Tq, Hq, D)``; return it contiguous (or None).

    ``"sh"``: float32 ``(S_sink, Hq)``; ``"ssh"``: float32 ``(Tq, S_sink, Hq)``; ``S_sink >= 1``.
    float64 is accepted too when q is float64 (for float64 gradient checks).
    """
    if not isinstance(sink_layout, str) or sink_layout not in SINK_LAYOUTS:
        raise ValueError(f"sink_layout must be 'sh' or 'ssh', got {sink_layout!r}")
    if sink is None:
        return None
    sink = _require_tensor("sink", sink)
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if sink.dtype not in allowed:
        raise TypeError(f"sink must be float32 (float64 allowed for float64 q), got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"sink must be on q's device ({q.device}), got {sink.device}")
    return check_sink_shape(sink, sink_layout, q.shape[0], q.shape[1]).contiguous()


def check_float_tensor(
    name: str,
    t: object,
    shape: tuple[int, ...],
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    """Check a float tensor argument (shape, dtype, device); return it unchanged (not copied).

    ``dtypes`` None accepts any floating-point dtype.
    """
    t = _require_tensor(name, t)
    if dtypes is None:
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    elif t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    return t


def check_accumulator(
    name: str, t: object, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Check an in-place float accumulator. It is NOT made contiguous: results must land in it.

    ``dtype`` None means float32 or float64.
    """
    dtypes = (dtype,) if dtype is not None else (torch.float32, torch.float64)
    return check_float_tensor(name, t, shape, device, dtypes)


def check_heads_per_cta(x: object, hq: int, hk: int) -> int | None:
    """``heads_per_cta`` of a backward call: None (the kernel's rule) or a positive int dividing
    ``hq // hk``, the q heads of one K/V head."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"heads_per_cta must be an int or None, got {type(x).__name__} {x!r}")
    group = hq // hk
    if x < 1 or group % x:
        raise ValueError(f"heads_per_cta must divide Hq / Hk = {group}, got {x}")
    return x


def check_bool(name: str, x: object) -> bool:
    """A flag argument: a real ``bool`` (not 0/1, not a string)."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return x
