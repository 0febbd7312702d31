"""The fused sigmoid router top-k as a ``torch.library`` custom op (namespace ``titan_moe``).

``titan_moe::router_topk(logits [N, n] fp32, bias [n], top_k, routed_scale)
-> (weights [N, k] fp32, expert_idx [N, k] int64, scores [N, k] fp32)``

computes, in one call, what :func:`titan_moe.model.moe.route` computes from
``torch.sigmoid(logits)``: the top-k experts of the biased scores and their normalised,
scaled unbiased scores; ``scores`` are the selected unbiased sigmoid scores. Ranking and
tie-break (larger biased score first, lower expert index on ties) are stated in
:mod:`titan_moe.ops.router.reference`. :func:`router_topk` returns ``(expert_idx, weights)``,
the pair ``route`` returns, and is a drop-in for ``route(torch.sigmoid(logits), ...)``.

Why a third output: the backward needs the selected scores ``s`` ([N, k]) and the
indices. A custom op's autograd context can only save its inputs and outputs, and saving
the [N, n] logits instead would keep the largest router tensor alive for the backward
(the unfused graph keeps the [N, n] sigmoid output). Saving ``expert_idx`` and ``scores``,
the op keeps ``12 N k`` bytes instead of ``4 N n`` (k=16, n=896: 19x less).

Implementations, chosen per call:

* CUDA: the Triton kernel of :mod:`.triton_kernel` (one pass over the logits).
* CPU: the plain-PyTorch :func:`.reference.router_topk_torch` (one host read, to find rows
  whose ties need the slow ranking path).
* ``[kernels] router_topk`` (`titan_moe.ops.choices`) = ``torch`` forces the PyTorch code on
  CUDA too; ``triton`` forces the kernel (on CPU only when ``TRITON_INTERPRET=1`` was set
  before the kernel module was first imported: tests); ``auto``: the choice above.

Backward (gradient to the logits only; bias, top_k and routed_scale get none): plain
PyTorch ops in :func:`.reference.router_topk_backward_torch`, not a kernel. They run inside
the autograd formula, so under ``torch.compile`` AOTAutograd traces them into the
compiled backward graph, where Inductor fuses the [N, k] elementwise part, the zero fill
and the scatter (one generated C++ kernel for the whole backward on CPU with torch 2.13)
and can fuse whatever else consumes the logits' gradient (e.g. the sigmoid gradient of
other users of the scores). The work is writing the dense [N, n] gradient, k nonzeros per
row; a hand-written kernel could not do less, and would be opaque to the compiler.
"""

from __future__ import annotations


import torch
from torch import Tensor

from titan_moe.ops import choices
from titan_moe.ops.nvtx import nvtx_range
from titan_moe.ops.router.reference import router_topk_backward_torch, router_topk_torch



def resolve_backend(device: torch.device) -> str:
    """"triton" or "torch": the implementation a call on ``device`` uses (module docstring)."""
    return choices.pick_backend(choices.current().router_topk, device.type)


def _triton_kernel():
    # Imported on first use: the module decides at import time whether its kernel is
    # compiled or interpreted (TRITON_INTERPRET), and the CPU path never needs it.
    from titan_moe.ops.router import triton_kernel

    return triton_kernel


def check_args(logits_Nn: Tensor, bias_n: Tensor, top_k: int) -> None:
    """Shape/dtype checks that need no data (safe under tracing and in the fake impl)."""
    if logits_Nn.dim() != 2:
        raise ValueError(f"router_topk: logits must be [N, n], got shape {tuple(logits_Nn.shape)}")
    if logits_Nn.dtype != torch.float32:
        raise ValueError(f"router_topk: logits must be fp32 (the router runs in fp32), got {logits_Nn.dtype}")
    n = logits_Nn.shape[1]
    if bias_n.dim() != 1 or bias_n.shape[0] != n or not bias_n.dtype.is_floating_point:
        raise ValueError(
            f"router_topk: bias must be a float [n] = [{n}] tensor, got {bias_n.dtype} {tuple(bias_n.shape)}"
        )
    if not 0 < top_k <= n:
        raise ValueError(f"router_topk: need 0 < top_k <= n_experts, got top_k={top_k}, n={n}")
    if logits_Nn.device != bias_n.device:
        raise ValueError(f"router_topk: logits on {logits_Nn.device}, bias on {bias_n.device}")


@torch.library.custom_op("titan_moe::router_topk", mutates_args=())
def _router_topk_op(
    logits_Nn: Tensor, bias_n: Tensor, top_k: int, routed_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    check_args(logits_Nn, bias_n, top_k)
    with nvtx_range("op.router_topk"):
        if resolve_backend(logits_Nn.device) == "triton":
            return _triton_kernel().router_topk_triton(logits_Nn, bias_n, top_k, routed_scale)
        return router_topk_torch(logits_Nn, bias_n, top_k, routed_scale)


@_router_topk_op.register_fake
def _(logits_Nn: Tensor, bias_n: Tensor, top_k: int, routed_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    check_args(logits_Nn, bias_n, top_k)
    N = logits_Nn.shape[0]
    return (
        logits_Nn.new_empty(N, top_k),
        logits_Nn.new_empty(N, top_k, dtype=torch.int64),
        logits_Nn.new_empty(N, top_k),
    )


def _setup_context(ctx, inputs, output) -> None:
    logits_Nn, _, _, routed_scale = inputs
    _, expert_idx_Nk, scores_Nk = output
    ctx.save_for_backward(expert_idx_Nk, scores_Nk)
    ctx.n_experts = logits_Nn.shape[1]
    ctx.routed_scale = routed_scale
    ctx.mark_non_differentiable(expert_idx_Nk)


def _backward(ctx, grad_weights_Nk: Tensor | None, grad_idx, grad_scores_Nk: Tensor | None):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    expert_idx_Nk, scores_Nk = ctx.saved_tensors
    grad_logits_Nn = router_topk_backward_torch(
        grad_weights_Nk, grad_scores_Nk, expert_idx_Nk, scores_Nk, ctx.n_experts, ctx.routed_scale
    )
    return grad_logits_Nn, None, None, None


_router_topk_op.register_autograd(_backward, setup_context=_setup_context)


def router_topk(logits_Nn: Tensor, bias_n: Tensor, top_k: int, routed_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Drop-in for ``route(torch.sigmoid(logits_Nn), bias_n, top_k, routed_scale)``.

    Args:
        logits_Nn: [N, n] fp32 router logits; differentiable.
        bias_n: [n] per-expert bias (any float dtype; no gradient).
        top_k: experts per token, ``0 < top_k <= n``.
        routed_scale: factor on the normalised weights.

    Returns:
        ``expert_idx_Nk`` [N, k] int64 by decreasing biased score (ties: lower index first)
        and ``weights_Nk`` [N, k] fp32.
    """
    check_args(logits_Nn, bias_n, top_k)
    weights_Nk, expert_idx_Nk, _ = torch.ops.titan_moe.router_topk(logits_Nn, bias_n, top_k, float(routed_scale))
    return expert_idx_Nk, weights_Nk
