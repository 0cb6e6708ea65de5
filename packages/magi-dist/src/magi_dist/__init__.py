"""magi-dist: context-parallel flexible-mask attention.

Typical use (every rank of the cp group)::

    key = magi_attn_varlen_key(cu_seqlens, cu_seqlens, Hq, Hk, D, cp_group, causal=True)
    q, k, v = (dispatch(x, key) for x in (q_global, k_global, v_global))
    out, meta = calc_attn(q, k, v, key)
    out_global = undispatch(out, key)

Runs on CPU (gloo, reference attention) and on GPUs (NCCL, FFA kernels). What is checked
where (arguments, keys across ranks, caches): docs/reliability.md.
"""

from ffa_kernels import AttnForwardMeta
from magi_dist.attn import calc_attn
from magi_dist.dispatch import dispatch, get_position_ids, undispatch
from magi_dist.key import DistAttnRuntimeKey, magi_attn_flex_key, magi_attn_varlen_key
from magi_dist.runtime import clear_cache, get_runtime

__version__ = "0.1.0"

__all__ = [
    "AttnForwardMeta",
    "DistAttnRuntimeKey",
    "calc_attn",
    "clear_cache",
    "dispatch",
    "get_position_ids",
    "get_runtime",
    "magi_attn_flex_key",
    "magi_attn_varlen_key",
    "undispatch",
]
