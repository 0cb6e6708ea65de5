"""flex_flash_attn_func: flexible-mask FlashAttention (CuTe DSL Hopper kernels and a torch reference backend).

Public API (the contract is docs/api.md):

- `flex_flash_attn_func(q, k, v, q_ranges, k_ranges, attn_type_map=None, *, mask=None, sink=None,
  sink_layout="sh", softmax_scale=None, softcap=0.0, deterministic=False,
  return_max_logits=False) -> (out, AttnForwardMeta(lse, max_logits))`; torch.compile traces it
  with no graph break (operators ``torch.ops.ffa_kernels.flex_flash_attn_forward`` / ``_backward``).
- `FlexMask.from_ranges(q_ranges, k_ranges, attn_type_map, total_q, total_k)`: a mask checked
  once, passed as ``mask=`` (no host copy or sync per call).
- per-stage API for combining several calls over different key sets exactly (magi-dist):
  `ffa_forward_stage` (with `forward_accumulators`, `accumulator_dtype`), `ffa_backward_stage`
  (with `ffa_backward_prepare`: its shared preprocess, enqueued ahead of the K/V rows, and
  `backward_heads_per_cta`: the launch shape a call would take, for a caller that splits one key
  set into calls),
  `apply_sink`, `sink_backward`, `merge_lse_`; and `ffa_forward`, the whole forward of one key set without autograd (a single-stage caller; `KVReady`: rows of K/V still arriving when it is issued).
- mask type codes `MaskType` / `FULL`, `CAUSAL`, `INVCAUSAL`, `BICAUSAL`, and `mask_type_code`.
- `validate_attn_inputs`: `flex_flash_attn_func`'s checks of every argument but the ranges, for
  callers that make the ranges themselves (magi-dist checks its arguments with it, before any
  collective). What is checked where: docs/reliability.md.
- `once_differentiable(what)`: the backward decorator of flex_flash_attn_func's autograd
  Function and magi-dist's (a second differentiation raises instead of being silently wrong).

Backend: ``FFA_BACKEND=reference|cute``; by default the CuTe kernels on CUDA compute capability
9.x when ``ffa_kernels.cute`` is importable, the pure-torch reference elsewhere. A CUDA call the
kernels do not serve warns once per reason (`BackendFallbackWarning`) and runs on the reference;
``FFA_BACKEND=cute`` makes that a ``RuntimeError``.
"""

from . import _ops  # noqa: F401  (registers the torch.library operators)
from ._backend import BackendFallbackWarning
from ._flex_mask import FlexMask
from ._frontend import (
    backward_heads_per_cta,
    ffa_backward_prepare,
    ffa_backward_stage,
    ffa_forward,
    ffa_forward_stage,
    flex_flash_attn_func,
    forward_accumulators,
    once_differentiable,
)
from ._kv_ready import KVReady
from ._merge import merge_lse_
from ._sink import apply_sink, sink_backward, sink_lse
from ._types import BICAUSAL, CAUSAL, FULL, INVCAUSAL, AttnForwardMeta, MaskType, mask_type_code
from ._validate import AttnInputs, accumulator_dtype, validate_attn_inputs

__version__ = "0.1.0"

__all__ = [
    "BICAUSAL",
    "CAUSAL",
    "FULL",
    "INVCAUSAL",
    "AttnForwardMeta",
    "AttnInputs",
    "BackendFallbackWarning",
    "FlexMask",
    "KVReady",
    "MaskType",
    "__version__",
    "accumulator_dtype",
    "apply_sink",
    "backward_heads_per_cta",
    "ffa_backward_prepare",
    "ffa_backward_stage",
    "ffa_forward",
    "ffa_forward_stage",
    "flex_flash_attn_func",
    "forward_accumulators",
    "mask_type_code",
    "merge_lse_",
    "once_differentiable",
    "sink_backward",
    "sink_lse",
    "validate_attn_inputs",
]
