"""Token dispatch for the routed experts as ``torch.library`` custom ops (namespace ``titan_moe``).

:func:`permute` copies each token's latent row to the ``k`` sorted rows of its copies, and
:func:`unpermute_combine` brings the experts' sorted outputs back and sums each token's
``k`` copies weighted by the router weights, in one pass. Both take ``order_M`` as
:meth:`titan_moe.model.moe.LatentMoE.route_and_sort` returns it (sorted row ``m`` holds
flat copy ``order_M[m]`` = token ``order_M[m] // k``, slot ``order_M[m] % k``) and invert it
once with an integer scatter (:func:`.reference.sorted_positions`); the ops themselves take
the inverse ``pos_Nk`` [N, k], with which every direction, backward included, is a
token-major gather or scatter of whole rows: no argsort, no atomics, deterministic. The
contract is stated in :mod:`titan_moe.ops.dispatch.reference`.

Ops (each opaque to ``torch.compile``, in the forward and in the backward graph):

* ``titan_moe::moe_permute(x [N,L], pos [N,k], rows) -> [R, L]``: ``out[pos[n,j]] = x[n]``,
  ``R = rows`` (0: ``N*k``); rows that no copy owns (an aligned layout, ``R > N*k``) are
  zero. Backward: ``moe_unpermute_combine(grad, pos, None)`` (each token gets the sum of
  its k copies' gradients).
* ``titan_moe::moe_unpermute_combine(y [R,L], pos [N,k], w [N,k]?, fp32_out) -> [N, L]``:
  ``out[n] = sum_j w[n,j] y[pos[n,j]]`` (no ``w``: plain sum), fp32 accumulation, output
  in fp32 with ``fp32_out``, else in y's dtype. (A flag, not a dtype argument: torch 2.11's
  AOTInductor decodes a ``ScalarType`` op argument wrongly, float32 arriving as float64.) Backward: ``moe_permute(grad)`` without ``w``, else
* ``titan_moe::moe_unpermute_combine_backward(grad [N,L], y [R,L], pos, w) -> (dy [R,L], dw [N,k])``:
  ``dy[pos[n,j]] = w[n,j] grad[n]``, ``dw[n,j] = <grad[n], y[pos[n,j]]>``, in one pass
  (``dw`` is computed whenever ``w`` is given, also if only ``y`` needs a gradient); rows of
  ``dy`` that no copy owns are zero.

The public functions :func:`permute` / :func:`unpermute_combine` take ``order``;
:func:`scatter_copies` / :func:`combine_copies` take the positions themselves, also those of
an aligned layout (:func:`titan_moe.ops.dispatch.reference.aligned_positions`).

Implementation, chosen per call by the ``[kernels] dispatch`` choice (`titan_moe.ops.choices`,
read at run time, also inside compiled graphs, where the ops are opaque calls):

* ``auto`` (default): ``triton`` for CUDA tensors, ``torch`` otherwise (the kernels beat the
  ``torch`` path in every measured direction: ``profiling/bench_moe.py --dispatch``).
* ``torch``: the plain-PyTorch functions of :mod:`.reference` (gathers, a broadcast
  ``index_put``, fp32 multiply and sum).
* ``triton``: the kernels of :mod:`.triton_kernel`; on CUDA, or on CPU when
  ``TRITON_INTERPRET=1`` was set before that module was first imported (tests); elsewhere a
  ``ValueError``.
"""

from __future__ import annotations


import torch
from torch import Tensor

from titan_moe.ops.dispatch.reference import (
    permute_torch,
    sorted_positions,
    sorted_rows,
    unpermute_combine_backward_torch,
    unpermute_combine_torch,
)
from titan_moe.ops import choices
from titan_moe.ops.nvtx import nvtx_range

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(device: torch.device) -> str:
    """"torch" or "triton" for a call on ``device``: ``[kernels] dispatch`` (module docstring)."""
    return choices.pick_backend(choices.current().dispatch, device.type)


def _kernels():
    # Imported on first use: the module decides at import time whether its kernels are
    # compiled or interpreted (TRITON_INTERPRET), and the torch backend never needs it.
    from titan_moe.ops.dispatch import triton_kernel

    return triton_kernel


def _check_pos(name: str, pos_Nk: Tensor, n_rows: int | None = None) -> None:
    if pos_Nk.dim() != 2 or pos_Nk.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: pos must be [N, k] int32/int64, got {pos_Nk.dtype} {tuple(pos_Nk.shape)}")
    if n_rows is not None and n_rows < pos_Nk.shape[0] * pos_Nk.shape[1]:
        raise ValueError(f"{name}: expected at least N*k = {pos_Nk.shape[0] * pos_Nk.shape[1]} sorted rows, "
                         f"got {n_rows}")


def _check_rows(name: str, t: Tensor) -> None:
    if t.dim() != 2 or t.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected a 2-D tensor of {_DTYPES}, got {t.dtype} {tuple(t.shape)}")


def _check_weights(name: str, weights_Nk: Tensor | None, pos_Nk: Tensor) -> None:
    if weights_Nk is not None and (weights_Nk.shape != pos_Nk.shape or not weights_Nk.dtype.is_floating_point):
        raise ValueError(
            f"{name}: weights must be float [N, k] = {tuple(pos_Nk.shape)}, got {weights_Nk.dtype} "
            f"{tuple(weights_Nk.shape)}"
        )


# --------------------------------------------------------------------------- permute
def _sorted_rows(pos_Nk: Tensor, rows: int) -> int:
    return sorted_rows("moe_permute", rows, pos_Nk.shape[0] * pos_Nk.shape[1])


@torch.library.custom_op("titan_moe::moe_permute", mutates_args=())
def _permute_op(x_NL: Tensor, pos_Nk: Tensor, rows: int) -> Tensor:
    with nvtx_range("op.moe_permute"):
        if resolve_backend(x_NL.device) == "triton":
            return _kernels().permute_triton(x_NL, pos_Nk, rows=_sorted_rows(pos_Nk, rows))
        return permute_torch(x_NL, pos_Nk, _sorted_rows(pos_Nk, rows))


@_permute_op.register_fake
def _(x_NL: Tensor, pos_Nk: Tensor, rows: int) -> Tensor:
    _check_rows("moe_permute", x_NL)
    _check_pos("moe_permute", pos_Nk)
    if x_NL.shape[0] != pos_Nk.shape[0]:
        raise ValueError(f"moe_permute: x has {x_NL.shape[0]} tokens, pos {pos_Nk.shape[0]}")
    return x_NL.new_empty(_sorted_rows(pos_Nk, rows), x_NL.shape[1])


def _permute_setup_context(ctx, inputs, output) -> None:
    _, pos_Nk, _ = inputs
    ctx.save_for_backward(pos_Nk)


def _permute_backward(ctx, grad_RL: Tensor):
    if not ctx.needs_input_grad[0]:
        return None, None, None
    (pos_Nk,) = ctx.saved_tensors
    return _combine_op(grad_RL.contiguous(), pos_Nk, None, False), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup_context)


# --------------------------------------------------------------------------- unpermute + combine
@torch.library.custom_op("titan_moe::moe_unpermute_combine", mutates_args=())
def _combine_op(y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor | None, fp32_out: bool) -> Tensor:
    out_dtype = torch.float32 if fp32_out else None
    with nvtx_range("op.moe_unpermute_combine"):
        if resolve_backend(y_ML.device) == "triton":
            return _kernels().gather_sum_triton(y_ML, pos_Nk, weights_Nk, out_dtype)
        return unpermute_combine_torch(y_ML, pos_Nk, weights_Nk, out_dtype)


@_combine_op.register_fake
def _(y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor | None, fp32_out: bool) -> Tensor:
    _check_rows("moe_unpermute_combine", y_ML)
    _check_pos("moe_unpermute_combine", pos_Nk, y_ML.shape[0])
    _check_weights("moe_unpermute_combine", weights_Nk, pos_Nk)
    return y_ML.new_empty(pos_Nk.shape[0], y_ML.shape[1], dtype=torch.float32 if fp32_out else y_ML.dtype)


@torch.library.custom_op("titan_moe::moe_unpermute_combine_backward", mutates_args=())
def _combine_backward_op(grad_NL: Tensor, y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor) -> tuple[Tensor, Tensor]:
    with nvtx_range("op.moe_unpermute_combine_backward"):
        if resolve_backend(y_ML.device) == "triton":
            return _kernels().combine_backward_triton(grad_NL, y_ML, pos_Nk, weights_Nk)
        return unpermute_combine_backward_torch(grad_NL, y_ML, pos_Nk, weights_Nk)


@_combine_backward_op.register_fake
def _(grad_NL: Tensor, y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(y_ML), torch.empty_like(weights_Nk)


def _combine_setup_context(ctx, inputs, output) -> None:
    y_ML, pos_Nk, weights_Nk, _ = inputs
    ctx.has_weights = weights_Nk is not None
    ctx.y_dtype, ctx.y_rows = y_ML.dtype, y_ML.shape[0]
    # Without weights the backward is a permute: it needs the positions only.
    ctx.save_for_backward(y_ML if ctx.has_weights else None, pos_Nk, weights_Nk)


def _combine_backward(ctx, grad_NL: Tensor):
    need_y, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_y or need_w):
        return None, None, None, None
    y_ML, pos_Nk, weights_Nk = ctx.saved_tensors
    grad_NL = grad_NL.contiguous()
    if not ctx.has_weights:
        return _permute_op(grad_NL.to(ctx.y_dtype), pos_Nk, ctx.y_rows), None, None, None
    dy_ML, dw_Nk = _combine_backward_op(grad_NL, y_ML, pos_Nk, weights_Nk)
    return dy_ML if need_y else None, None, dw_Nk if need_w else None, None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup_context)


# --------------------------------------------------------------------------- public API
def _check_order(name: str, order_M: Tensor, n_tokens: int, k: int) -> None:
    if order_M.dim() != 1 or order_M.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: order must be a 1-D int32/int64 tensor, got {order_M.dtype} {tuple(order_M.shape)}")
    if k < 1 or order_M.shape[0] != n_tokens * k:
        raise ValueError(f"{name}: order has {order_M.shape[0]} entries, expected N*k = {n_tokens}*{k}")


def scatter_copies(x_NL: Tensor, pos_Nk: Tensor, rows: int | None = None) -> Tensor:
    """Sorted token copies: ``out[pos_Nk[n, j]] = x_NL[n]``.

    Args:
        x_NL: [N, L] token rows (fp32, bf16 or fp16); differentiable.
        pos_Nk: [N, k] int32/int64 sorted row of each copy, injective (not checked): the
            inverse of ``order`` (:func:`titan_moe.ops.dispatch.reference.sorted_positions`)
            or an aligned layout's (``aligned_positions``).
        rows: rows of the result, >= N*k (default N*k); rows no copy owns are zero.

    Returns:
        [rows, L] in ``x_NL.dtype``. Its gradient flows back as ``dx[n] = sum_j dout[pos[n, j]]``
        (fp32 sum of the k copies' gradients, one rounding).
    """
    _check_rows("scatter_copies", x_NL)
    _check_pos("scatter_copies", pos_Nk, rows)
    if x_NL.shape[0] != pos_Nk.shape[0]:
        raise ValueError(f"scatter_copies: x has {x_NL.shape[0]} tokens, pos {pos_Nk.shape[0]}")
    return _permute_op(x_NL, pos_Nk, rows or 0)


def combine_copies(y_RL: Tensor, pos_Nk: Tensor, weights_Nk: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``out[n] = sum_j weights[n, j] * y[pos_Nk[n, j]]`` in one pass.

    Args:
        y_RL: [R >= N*k, L] sorted rows (fp32, bf16 or fp16); differentiable (rows no copy
            owns get a zero gradient).
        pos_Nk: [N, k] sorted row of each copy, as for :func:`scatter_copies`.
        weights_Nk: [N, k] float (fp32 in the model); differentiable
            (``dw[n, j] = <dout[n], y[pos[n, j]]>``).
        out_dtype: None or ``y_RL.dtype`` (the default), or float32.

    Returns:
        [N, L]: fp32 products and sum over the k copies, rounded once to ``out_dtype``.
    """
    _check_rows("combine_copies", y_RL)
    _check_pos("combine_copies", pos_Nk, y_RL.shape[0])
    _check_weights("combine_copies", weights_Nk, pos_Nk)
    if out_dtype not in (None, y_RL.dtype, torch.float32):
        raise ValueError(f"combine_copies: out_dtype must be y's dtype ({y_RL.dtype}) or float32, got {out_dtype}")
    fp32_out = out_dtype == torch.float32 and y_RL.dtype != torch.float32
    return _combine_op(y_RL, pos_Nk, weights_Nk, fp32_out)


def permute(x_NL: Tensor, order_M: Tensor, k: int) -> Tensor:
    """Sorted token copies: row ``m`` of the result is row ``order_M[m] // k`` of ``x_NL``.

    Args:
        x_NL: [N, L] token rows (fp32, bf16 or fp16); differentiable.
        order_M: [M = N*k] permutation of the flat copy indices ``n*k + j`` (sorted row ->
            copy).
        k: copies per token.

    Returns:
        [M, L] in ``x_NL.dtype`` (:func:`scatter_copies` with the inverse of ``order_M``).
    """
    _check_rows("permute", x_NL)
    _check_order("permute", order_M, x_NL.shape[0], k)
    return _permute_op(x_NL, sorted_positions(order_M, k), 0)


def unpermute_combine(
    y_sorted_ML: Tensor, order_M: Tensor, weights_Nk: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """``out[n] = sum_j weights[n, j] * y_sorted[pos(n, j)]`` in one pass, where ``pos(n, j)``
    is the sorted row of copy ``n*k + j`` (``order_M[pos] == n*k + j``).

    Args:
        y_sorted_ML: [M = N*k, L] rows in the sorted order of ``order_M``; differentiable.
        order_M: [M] sorted row -> flat copy ``n*k + j`` (as for :func:`permute`).
        weights_Nk: [N, k] float; differentiable.
        out_dtype: as for :func:`combine_copies`.

    Returns:
        [N, L] (:func:`combine_copies` with the inverse of ``order_M``).
    """
    _check_rows("unpermute_combine", y_sorted_ML)
    if weights_Nk.dim() != 2:
        raise ValueError(f"unpermute_combine: weights must be [N, k], got {tuple(weights_Nk.shape)}")
    n_tokens, k = weights_Nk.shape
    _check_order("unpermute_combine", order_M, n_tokens, k)
    if y_sorted_ML.shape[0] != order_M.shape[0]:
        raise ValueError(f"unpermute_combine: y has {y_sorted_ML.shape[0]} rows, order {order_M.shape[0]}")
    return combine_copies(y_sorted_ML, sorted_positions(order_M, k), weights_Nk, out_dtype)
