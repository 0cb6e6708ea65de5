"""Integrations of `flex_flash_attn_func` with other libraries, each an optional dependency.

- `ffa_kernels.integrations.transformers`: ``attn_implementation="ffa"`` for Hugging Face
  ``transformers`` models (``pip install ffa-kernels[transformers]``).

Nothing here is imported by ``import ffa_kernels``: a submodule imports its library only when it
is imported itself.
"""
