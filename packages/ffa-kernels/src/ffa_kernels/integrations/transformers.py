"""Hugging Face ``transformers`` attention on `flex_flash_attn_func`: ``attn_implementation="ffa"``.

::

    pip install "ffa-kernels[transformers]"

    from ffa_kernels.integrations.transformers import register
    register()                                  # once per process
    model = LlamaForCausalLM(config)            # config._attn_implementation = "ffa", or
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="ffa")
    logits = model(input_ids=ids, position_ids=pos).logits   # ids, pos: (B, S)

`register` adds ``"ffa"`` to ``transformers.AttentionInterface`` (the attention function,
`ffa_attention_forward`) and to ``transformers.masking_utils.AttentionMaskInterface`` (the same
mask function as ``flash_attention_2``: the model builds no dense ``(S, S)`` mask, at most the
2D padding mask is passed on).

Every batch row holds packed documents; a token attends only to its own document. The documents
come, in this order of precedence, from

1. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (keyword arguments of the model's forward, as for
   ``flash_attention_2``, e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
   cumulative document lengths over the flattened ``B * S`` tokens;
2. a 2D padding mask ``attention_mask`` ``(B, S_k)`` (1 = token, 0 = padding): one document per
   row, the row's tokens, which must be contiguous (left or right padding); rows of padding get
   output 0;
3. ``position_ids`` ``(B, S)``: a new document starts wherever the position is not the previous
   one plus 1 (as ``transformers`` detects packed sequences, and ``flash_attention_2`` too);
4. otherwise each row is one document.

Within a document the attention is causal (``module.is_causal``, or the ``is_causal`` keyword)
or full, and with ``sliding_window=w`` (the keyword the model passes, from its config, per layer)
a token sees the ``w`` tokens up to and including itself (causal: ``0 <= q - k < w``) or those at
distance below ``w`` (full: ``|q - k| < w``), as ``flash_attention_2`` does (FlashAttention's
``window_size=(w - 1, w - 1)``). With a KV cache (``S_k > S_q``) the queries are the last tokens of
their document (bottom-right aligned). The mask is a handful of slices per document
(docs/masks.md): causal, ``BICAUSAL`` bands for a window; nothing quadratic is materialised.

GQA runs on the key heads as they are (no ``repeat_kv``). ``softcap`` and ``s_aux`` (attention
sink logits, one per query head, as in gpt-oss) are supported. The mask is built on the host
once per batch (one device-to-host copy of ``position_ids`` / the padding mask / the cumulative
lengths) and reused by every layer: it is cached by the identity of those tensors (an in-place
write invalidates it). Building it reads tensor values, so ``torch.compile`` breaks the graph
there (the attention operators themselves trace, see ffa_kernels' README).

Importing this module does not import ``transformers``; `register` does. ``import ffa_kernels``
imports neither.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from .._flex_mask import FlexMask
from .._frontend import flex_flash_attn_func
from .._identity_cache import IdentityCache
from .._types import BICAUSAL, CAUSAL, FULL, INVCAUSAL

__all__ = ["ATTN_IMPLEMENTATION", "document_mask", "document_slices", "ffa_attention_forward", "register"]

ATTN_IMPLEMENTATION = "ffa"

# (q_start, q_end, k_start, k_end) in the flattened (B * S) token axes; the document's query rows
# are its last tokens (query row q_end - 1 is key k_end - 1).
_Doc = tuple[int, int, int, int]
_Slice = tuple[int, int, int, int, int]  # qs, qe, ks, ke, type

_MASKS = IdentityCache(maxsize=16)


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register `ffa_attention_forward` as ``attn_implementation=name`` (default ``"ffa"``) with
    ``transformers.AttentionInterface``, and ``transformers``' ``flash_attention_mask`` as its mask
    function with ``AttentionMaskInterface`` (no dense mask is built). Idempotent; returns ``name``.

    Raises:
        ImportError: ``transformers`` is not installed (``pip install "ffa-kernels[transformers]"``).
        TypeError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError(
            'ffa_kernels.integrations.transformers.register needs transformers: pip install "ffa-kernels[transformers]"'
        ) from e
    AttentionInterface.register(name, ffa_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def ffa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``transformers`` attention function of ``attn_implementation="ffa"``.

    Args:
        module: the attention module (its ``is_causal``, default True, when ``is_causal`` is None).
        query: ``(B, Hq, S_q, D)``; key: ``(B, Hk, S_k, D)``; value: ``(B, Hk, S_k, Dv)``;
            ``Hq % Hk == 0``; float16 / bfloat16 / float32 / float64 (as `flex_flash_attn_func`).
        attention_mask: None, or a 2D padding mask ``(B, S_k)`` of bool or integers (contiguous
            tokens per row). A 4D (dense) mask is refused: pass ``position_ids`` or
            ``cu_seq_lens_q`` / ``cu_seq_lens_k`` for documents.
        dropout: must be 0 (no attention dropout).
        scaling: softmax scale; None means ``D ** -0.5``.
        sliding_window: None or ``w >= 1`` (see the module docstring).
        softcap: None / 0 (off) or ``> 0``: logits ``softcap * tanh(logits / softcap)``.
        is_causal: overrides ``module.is_causal``.
        s_aux: None or ``(Hq,)`` sink logits (float32 math; differentiable).
        **kwargs: ``position_ids`` ``(B, S_q)`` or ``(1, S_q)``; ``cu_seq_lens_q`` /
            ``cu_seq_lens_k`` ``(N + 1,)`` integers, both or neither; ``deterministic``; other
            keywords of the model (``max_length_q``, ``output_attentions``, ...) are ignored.

    Returns:
        ``(attn_output, None)``: attn_output ``(B, S_q, Hq, Dv)`` in query's dtype (0 for query rows
        that are padding); no attention weights.

    Raises:
        ValueError / TypeError naming the argument and its value: dropout > 0, a 4D or
        non-contiguous padding mask, bad shapes, cumulative lengths that do not cover the tokens,
        a window that cannot be expressed (see `document_mask`).
    """
    b, hq, sq, sk = _check_qkv(query, key, value)
    if not isinstance(dropout, numbers.Real) or dropout != 0:
        raise ValueError(
            f"dropout: attn_implementation='ffa' has no attention dropout, got dropout={dropout!r} "
            "(set config.attention_dropout = 0.0, or call model.eval())"
        )
    if s_aux is not None and (not isinstance(s_aux, torch.Tensor) or s_aux.numel() != hq):
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(f"s_aux: expected one sink logit per query head, shape ({hq},), got {shape}")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    mask = document_mask(
        b,
        sq,
        sk,
        position_ids=kwargs.get("position_ids"),
        attention_mask=attention_mask,
        cu_seq_lens_q=kwargs.get("cu_seq_lens_q"),
        cu_seq_lens_k=kwargs.get("cu_seq_lens_k"),
        causal=causal,
        sliding_window=sliding_window,
        device=query.device,
    )
    hk, dv = key.shape[1], value.shape[-1]
    q = query.transpose(1, 2).reshape(b * sq, hq, query.shape[-1])
    k = key.transpose(1, 2).reshape(b * sk, hk, key.shape[-1])
    v = value.transpose(1, 2).reshape(b * sk, hk, dv)
    sink = None if s_aux is None else s_aux.to(device=query.device, dtype=torch.float32).reshape(1, hq)
    out, _ = flex_flash_attn_func(
        q,
        k,
        v,
        mask=mask,
        sink=sink,
        softmax_scale=scaling,
        softcap=float(softcap or 0.0),
        deterministic=bool(kwargs.get("deterministic") or False),
    )
    return out.view(b, sq, hq, dv), None


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, int, int, int]:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
    if key.shape[0] != query.shape[0] or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"key, value: expected (batch={query.shape[0]}, Hk, S_k, ...) with the same Hk and S_k, got "
            f"key {tuple(key.shape)} and value {tuple(value.shape)} for query {tuple(query.shape)}"
        )
    return query.shape[0], query.shape[1], query.shape[2], key.shape[2]


# ----------------------------------------------------------------------------- the mask


def document_mask(
    batch: int,
    q_len: int,
    k_len: int,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | Sequence[int] | None = None,
    cu_seq_lens_k: torch.Tensor | Sequence[int] | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> FlexMask:
    """The `FlexMask` that `ffa_attention_forward` uses, over ``batch * q_len`` query and
    ``batch * k_len`` key tokens (batch rows flattened, row-major). Documents and window as in the
    module docstring; cached by the identity of the tensors passed (and the other arguments).

    Raises:
        ValueError / TypeError naming the argument and the value seen.
    """
    for name, n in (("batch", batch), ("q_len", q_len), ("k_len", k_len)):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise TypeError(f"{name}: expected an int >= 0, got {n!r}")
    window = _check_window(sliding_window)
    tensors = [x if isinstance(x, torch.Tensor) else None for x in (position_ids, attention_mask)]
    cu = [x if isinstance(x, torch.Tensor) else None for x in (cu_seq_lens_q, cu_seq_lens_k)]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    extra = (batch, q_len, k_len, bool(causal), window, str(dev))
    plain_cu = any(x is not None and not isinstance(x, torch.Tensor) for x in (cu_seq_lens_q, cu_seq_lens_k))
    if not plain_cu:
        hit = _MASKS.get([*tensors, *cu], extra)
        if hit is not None:
            return hit
    docs = _documents(batch, q_len, k_len, position_ids, attention_mask, cu_seq_lens_q, cu_seq_lens_k, causal)
    slices = [s for doc in docs for s in document_slices(doc, causal, window)]
    mask = FlexMask.from_ranges(
        [(s[0], s[1]) for s in slices],
        [(s[2], s[3]) for s in slices],
        [s[4] for s in slices],
        total_q=batch * q_len,
        total_k=batch * k_len,
        device=dev,
    )
    if not plain_cu:
        _MASKS.put([*tensors, *cu], extra, mask)
    return mask


def _check_window(sliding_window: object) -> int | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"sliding_window: expected None or an int >= 1, got {sliding_window!r}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window: expected None or an int >= 1, got {sliding_window}")
    return int(sliding_window)


def _documents(
    b: int,
    sq: int,
    sk: int,
    position_ids: object,
    attention_mask: object,
    cu_q: object,
    cu_k: object,
    causal: bool,
) -> list[_Doc]:
    if (cu_q is None) != (cu_k is None):
        raise ValueError(
            "cu_seq_lens_q, cu_seq_lens_k: give both or neither, got "
            f"cu_seq_lens_q={'None' if cu_q is None else '...'}, cu_seq_lens_k={'None' if cu_k is None else '...'}"
        )
    if cu_q is not None:
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: a padding mask and cu_seq_lens_q / cu_seq_lens_k cannot be given together "
                f"(got attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}); padding-free "
                "batches need no padding mask"
            )
        qs = _cumulative("cu_seq_lens_q", cu_q, b * sq)
        ks = _cumulative("cu_seq_lens_k", cu_k, b * sk)
        if len(qs) != len(ks):
            raise ValueError(
                f"cu_seq_lens_q, cu_seq_lens_k: expected the same number of documents, got {len(qs) - 1} and {len(ks) - 1}"
            )
        return [(qs[i], qs[i + 1], ks[i], ks[i + 1]) for i in range(len(qs) - 1)]
    if attention_mask is not None:
        return _docs_from_padding(attention_mask, b, sq, sk, causal)
    if position_ids is not None:
        return _docs_from_positions(position_ids, b, sq, sk)
    return [(r * sq, (r + 1) * sq, r * sk, (r + 1) * sk) for r in range(b)]


def _cumulative(name: str, cu: object, total: int) -> list[int]:
    if isinstance(cu, torch.Tensor):
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool or cu.dim() != 1:
            raise TypeError(
                f"{name}: expected a 1D integer tensor, got dtype {cu.dtype} shape {tuple(cu.shape)}"
            )
        values = [int(x) for x in cu.tolist()]
    elif isinstance(cu, Sequence) and all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu
    ):
        values = [int(x) for x in cu]
    else:
        raise TypeError(f"{name}: expected a 1D integer tensor or a sequence of ints, got {cu!r:.80}")
    if not values or values[0] != 0 or values[-1] != total or any(a > c for a, c in zip(values, values[1:])):
        raise ValueError(
            f"{name}: expected non-decreasing cumulative lengths from 0 to {total} (the batch's flattened "
            f"tokens), got {values if len(values) <= 12 else [*values[:6], '...', *values[-6:]]}"
        )
    return values


def _docs_from_padding(mask: object, b: int, sq: int, sk: int, causal: bool) -> list[_Doc]:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention_mask: expected None or a 2D padding mask tensor, got {type(mask).__name__} "
            "(a BlockMask or other dense mask cannot be used with attn_implementation='ffa')"
        )
    if mask.dim() != 2 or tuple(mask.shape) != (b, sk):
        raise ValueError(
            f"attention_mask: expected a 2D padding mask (batch, S_k) = ({b}, {sk}), got shape {tuple(mask.shape)}; "
            "a dense (4D) mask cannot be used with attn_implementation='ffa': pass position_ids or "
            "cu_seq_lens_q / cu_seq_lens_k for packed documents"
        )
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask: a padding mask holds bool or integers (1 = token), got dtype {mask.dtype}"
        )
    m = mask.bool()
    count = m.sum(1)
    first = m.int().argmax(1)
    last = sk - 1 - m.flip(1).int().argmax(1)
    rows = torch.stack([count, first, last]).tolist()
    docs: list[_Doc] = []
    # query row i is key position off + i (bottom-right) for self-attention; a non-causal call with
    # other lengths (cross-attention) keeps every query row
    off = sk - sq
    aligned = causal or sq == sk
    for r, (n, f, last_k) in enumerate(zip(*rows)):
        if n == 0:
            continue
        if n != last_k - f + 1:
            raise ValueError(
                f"attention_mask: row {r} has padding between its tokens (tokens {n}, from {f} to {last_k}); "
                "attn_implementation='ffa' takes left or right padding only (or packed documents through "
                "position_ids / cu_seq_lens_q, cu_seq_lens_k)"
            )
        ke = last_k + 1
        if not aligned:
            docs.append((r * sq, (r + 1) * sq, r * sk + f, r * sk + ke))
        elif ke > off:
            docs.append((r * sq + max(f, off) - off, r * sq + ke - off, r * sk + f, r * sk + ke))
    return docs


def _docs_from_positions(position_ids: object, b: int, sq: int, sk: int) -> list[_Doc]:
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids: expected a tensor, got {type(position_ids).__name__}")
    if (
        position_ids.dim() != 2
        or position_ids.shape[0] not in (1, b)
        or position_ids.shape[1] != sq
        or position_ids.dtype.is_floating_point
    ):
        raise ValueError(
            f"position_ids: expected integers of shape ({b}, {sq}) or (1, {sq}), got {position_ids.dtype} "
            f"{tuple(position_ids.shape)}; for other layouts pass cu_seq_lens_q / cu_seq_lens_k"
        )
    pos = position_ids.expand(b, sq)
    starts = torch.ones(b, sq, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if sq != sk:
        restarts = starts[:, 1:].nonzero()
        if restarts.numel():
            r, t = restarts[0].tolist()
            raise ValueError(
                f"position_ids: a document starts inside row {r} (at token {t + 1}) but the keys ({sk} tokens) "
                f"are not the queries ({sq} tokens, e.g. with a KV cache); pass cu_seq_lens_q / cu_seq_lens_k"
            )
        return [(r * sq, (r + 1) * sq, r * sk, (r + 1) * sk) for r in range(b)]
    bounds = [*starts.reshape(-1).nonzero().flatten().tolist(), b * sq]
    return [(s, e, s, e) for s, e in zip(bounds, bounds[1:])]


def document_slices(doc: _Doc, causal: bool, window: int | None) -> list[_Slice]:
    """The slices ``(qs, qe, ks, ke, type)`` of one document: query rows ``[qs, qe)`` are its last
    ``qe - qs`` tokens among the keys ``[ks, ke)`` (query row ``qe - 1`` is key ``ke - 1``).

    Causal: key position ``k`` is seen by the query at key position ``p`` when ``k <= p`` and, with a
    window ``w``, ``p - k < w``: a CAUSAL slice for the rows whose window starts at the document's
    start, then one BICAUSAL band. Full: everything, or with a window ``|p - k| < w`` (that needs
    as many queries as keys): the causal part plus the band above the diagonal (BICAUSAL, and an
    INVCAUSAL tail)."""
    qs, qe, ks, ke = doc
    if qe <= qs or ke <= ks:
        return []
    if not causal and window is None:
        return [(qs, qe, ks, ke, int(FULL))]
    shift = ke - qe  # key position of query row r: r + shift
    first = max(qs + shift, ks)  # rows before it (more queries than keys) see nothing
    head_end = ke if window is None else min(ke, ks + window)
    out: list[_Slice] = []
    if first < head_end:
        out.append((first - shift, head_end - shift, ks, head_end, int(CAUSAL)))
    band = max(first, head_end)
    if window is not None and band < ke:
        out.append((band - shift, ke - shift, band - window + 1, ke, int(BICAUSAL)))
    if causal:
        return out
    assert window is not None
    if qe - qs != ke - ks:
        raise ValueError(
            f"sliding_window: a non-causal window needs as many queries as keys per document, got "
            f"{qe - qs} queries and {ke - ks} keys (sliding_window={window})"
        )
    # above the diagonal: p < k <= p + w - 1
    mid = max(ks, ke - window + 1)
    if window >= 2 and ks < mid:
        out.append((qs, mid - shift, ks + 1, ke, int(BICAUSAL)))
    if mid < ke - 1:
        out.append((mid - shift, ke - 1 - shift, mid + 1, ke, int(INVCAUSAL)))
    return out
