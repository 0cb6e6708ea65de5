"""``once_differentiable``: an autograd Function's backward that refuses, loudly, to be
differentiated again (flex_flash_attn_func's and magi_dist.calc_attn's)."""

from __future__ import annotations

import functools

import torch


class _NoDoubleBackward(torch.autograd.Function):
    """Passes first-order gradients through; raises when they are differentiated again."""

    @staticmethod
    def forward(ctx, what, num_anchors, *tensors):
        ctx.what = what
        return tuple(t.clone() for t in tensors[num_anchors:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.what}: double backward is not supported (its backward is once_differentiable): "
            "a second derivative through it would be wrong"
        )


def once_differentiable(what: str):
    """Decorator for an autograd Function's ``backward``: run it without recording a graph and,
    under ``create_graph=True``, return gradients whose own backward raises ``RuntimeError``
    ("double backward is not supported") naming ``what``.

    ``torch.autograd.function.once_differentiable`` hangs its error node on detached copies, so
    ``torch.autograd.grad(first_grad, q)`` never reaches it (it reports "not used in the
    graph", or with ``allow_unused`` drops the term silently). Here the node hangs on what the
    gradients really depend on: the incoming gradients and the saved tensors that need grad.
    """

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grad_outputs):
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            if not torch.is_grad_enabled():  # a plain backward (create_graph=False)
                return grads
            anchors = [
                t
                for t in (*grad_outputs, *ctx.saved_tensors)
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if not anchors:
                return grads
            at = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor)]
            wrapped = _NoDoubleBackward.apply(what, len(anchors), *anchors, *(grads[i] for i in at))
            out = list(grads)
            for i, g in zip(at, wrapped):
                out[i] = g
            return tuple(out)

        return wrapper

    return decorate
