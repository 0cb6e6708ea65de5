"""CuTe DSL kernels for sm90 (Hopper).

``cute_forward`` is the entry point the frontend calls when backend == "cute";
``cute_backward_stage`` adds one stage's dq, dk, dv into float32 accumulators;
``cute_backward`` is one whole backward with its gradients in the input dtype;
``cute_backward_prepare`` enqueues the preprocess the stages of one backward share.
``cute_forward_accumulate`` is the same forward merging its result, by log-sum-exp, into a
float32 (out, lse) accumulator in place (several calls over disjoint key sets combine exactly;
the frontend's stage API uses it when ``accumulators_fit``). Importing this package needs only
torch (the host plan, the config and the launch code import cutlass on first call); the two
forwards are exported only when nvidia-cutlass-dsl is installed.
"""

from __future__ import annotations

import importlib.util

from .config import FwdConfig, default_config
from .interface import accumulators_fit

HAVE_CUTLASS = importlib.util.find_spec("cutlass") is not None

if HAVE_CUTLASS:
    from .bwd_interface import (
        cute_backward,
        cute_backward_heads_per_cta,
        cute_backward_prepare,
        cute_backward_stage,
    )
    from .interface import cute_forward, cute_forward_accumulate

    __all__ = [
        "HAVE_CUTLASS",
        "FwdConfig",
        "accumulators_fit",
        "cute_backward",
        "cute_backward_heads_per_cta",
        "cute_backward_prepare",
        "cute_backward_stage",
        "cute_forward",
        "cute_forward_accumulate",
        "default_config",
    ]
else:  # the frontend sees no cute_forward and falls back to the reference backend
    __all__ = ["HAVE_CUTLASS", "FwdConfig", "accumulators_fit", "default_config"]
