"""Eager calls of our custom ops without the custom-op dispatch.

A ``torch.library.custom_op`` is what torch.compile and export need: an opaque node with a
fake implementation and registered autograd. In an eager call the same dispatch costs host
time and buys nothing: measured on an x86 CPU with the GPU work stubbed out, the fp8 grouped
GEMM's forward+backward took 465 us through its two ops and 279 us through the same
functions called directly (``profiling/fp8_host_cost.py``; BENCHMARKS.md, "fp8 expert GEMM at
E = 64 timed three ways"). :func:`direct_autograd` builds the ``torch.autograd.Function``
for that direct path out of the op's own pieces, so the two paths cannot drift apart:

    forward = Direct.apply if takes_direct_path(x, w) else op

(:func:`takes_direct_path`: real tensors in an eager call; tensor subclasses, fake and meta
tensors, a dispatch mode or a graph being traced keep the op, whose fake implementation is
what they need). The op's backward function reads ``ctx.eager_impl`` (set only on the direct
path) to call its backward implementation directly too, and the op otherwise.

Only for ops whose implementation is one Python function for every device (the grouped
GEMMs choose their backend inside it); ops with per-device kernels registered through
``torch.library.register_kernel`` (KDA) would need that choice repeated here.
"""

from __future__ import annotations

from typing import Callable

import torch


def takes_direct_path(*tensors) -> bool:
    """Whether an op call on ``tensors`` (None entries ignored) may skip the custom-op
    dispatch: no graph is being traced (torch.compile, export), no dispatch mode is active
    (FakeTensorMode, a recording mode), and every tensor is a plain ``torch.Tensor`` (not a
    FakeTensor, DTensor or other subclass) off the ``meta`` device."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(type(t) is torch.Tensor and t.device.type != "meta" for t in tensors if t is not None)


def direct_autograd(name: str, forward_impl: Callable, setup_context: Callable, backward: Callable) -> type:
    """A ``torch.autograd.Function`` named ``name`` whose ``apply(*inputs)`` returns
    ``forward_impl(*inputs)`` (the op's implementation; ``inputs`` all of the op's arguments,
    positionally) after ``setup_context(ctx, inputs, output)``, and whose backward is
    ``backward(ctx, *grads)``: the functions given to ``register_autograd``."""

    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        ctx.eager_impl = True
        return output

    def backward_(ctx, *grads):
        return backward(ctx, *grads)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward_),
        "__doc__": f"Eager path of {forward_impl.__module__}.{forward_impl.__name__} (titan_moe.ops.eager_path).",
    })
