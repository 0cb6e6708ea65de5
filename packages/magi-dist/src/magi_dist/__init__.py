"""Context-parallel flexible-mask attention: key, dispatch/undispatch, calc_attn."""

__version__ = "0.1.0"
