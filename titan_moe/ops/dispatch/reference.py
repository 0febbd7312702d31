"""Plain-PyTorch token dispatch: the CPU path of the ``titan_moe::moe_*`` ops and their reference.

Contract (shared with :mod:`titan_moe.ops.dispatch.op` and the Triton kernels):

* ``N`` tokens, each routed to ``k`` experts, give ``M = N*k`` token copies. Copy ``j`` of
  token ``n`` is the flat copy ``n*k + j`` (the row-major order of ``expert_idx_Nk``).
* ``order_M`` [M] int64 (what :meth:`titan_moe.model.moe.LatentMoE.route_and_sort` returns):
  sorted row ``m`` holds flat copy ``order_M[m]``, i.e. a copy of token ``order_M[m] // k``.
* ``pos_Nk`` [N, k] int32/int64, the inverse permutation (what the ops take): copy ``j`` of
  token ``n`` sits in sorted row ``pos_Nk[n, j]``; ``pos.view(-1)[order[m]] == m``.
  It must be a permutation of ``range(M)``: that is not checked (it would cost a sort),
  and a violation leaves rows of the outputs unwritten.
* Aligned layouts (:func:`aligned_positions`): the sorted rows may also live in a buffer of
  ``R > M`` rows in which each expert's group starts at a multiple of an alignment (what
  fp8 grouped GEMMs need). ``pos_Nk`` is then injective into ``range(R)``, and the ``R - M``
  rows that no copy owns (padding) are zero in every ``[R, L]`` result: the permute's
  output and the combine's row gradient.

The ops take ``pos_Nk`` because every one of them (forwards and backwards) is then a
token-major loop: token ``n`` reads or writes its ``k`` rows ``pos_Nk[n]``; no direction
needs ``order`` and none needs an argsort or an atomic accumulation.

* permute:            ``x_sorted[pos[n, j]] = x[n]``                              [M, L]
* unpermute_combine:  ``out[n] = sum_j w[n, j] * y_sorted[pos[n, j]]``            [N, L]
  (``w = None``: a plain sum; this is also the gradient of permute), fp32 accumulation,
  one rounding to the output dtype;
* its backward:       ``dy_sorted[pos[n, j]] = w[n, j] * grad[n]`` and
  ``dw[n, j] = <grad[n], y_sorted[pos[n, j]]>`` (fp32 products and sums).

The functions here materialise the gathered ``[N, k, L]`` copies (in fp32 for the sums), as
the plain gathers of the model did: simple, and on CPU the same numbers as before.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sorted_positions(order_M: Tensor, k: int) -> Tensor:
    """The inverse of ``order_M`` as ``pos_Nk`` [M // k, k] int64 (one integer scatter, no sort)."""
    m = order_M.shape[0]
    order_M = order_M.long()  # scatter indices must be int64
    inverse_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(m, device=order_M.device))
    return inverse_M.view(m // k, k)


def padded_rows(n_copies: int, n_experts: int, alignment: int) -> int:
    """Static row count of an aligned layout: every group padded to a multiple of
    ``alignment`` adds at most ``alignment - 1`` rows; rounded up to ``alignment``."""
    rows = n_copies + n_experts * (alignment - 1)
    return -(-rows // alignment) * alignment


def aligned_positions(pos_Nk: Tensor, expert_Nk: Tensor, counts_E: Tensor, alignment: int) -> tuple[Tensor, Tensor, int]:
    """Move the sorted rows of ``pos_Nk`` into a layout whose groups start at multiples of
    ``alignment``, on the device, without a host sync.

    Args:
        pos_Nk: [N, k] sorted row of each copy (groups contiguous, in expert order).
        expert_Nk: [N, k] expert of each copy.
        counts_E: [E] rows per expert (``counts_E[e] == (expert_Nk == e).sum()``).
        alignment: >= 1.

    Returns:
        ``pos_Nk`` [N, k] int64 rows in the aligned buffer, ``offs_E`` [E] int32 cumulative
        ends of the padded groups (multiples of ``alignment``), and the buffer's static row
        count ``R`` (:func:`padded_rows`; rows past ``offs_E[-1]`` belong to no group).
    """
    shift_E, offs_pad_E = aligned_group_shift(counts_E, alignment)
    pos_aligned_Nk = pos_Nk.long() + shift_E[expert_Nk.long()]
    rows = padded_rows(pos_Nk.numel(), counts_E.shape[0], alignment)
    return pos_aligned_Nk, offs_pad_E.to(torch.int32), rows


def aligned_group_shift(counts_E: Tensor, alignment: int) -> tuple[Tensor, Tensor]:
    """For groups of ``counts_E`` [E] rows laid out back to back, each padded to a multiple
    of ``alignment``: ``shift_E`` [E] int64, how far each group's rows move (its padded start
    minus its packed start), and ``offs_pad_E`` [E] int64, the padded groups' cumulative ends."""
    counts = counts_E.long()
    padded_E = (counts + alignment - 1) // alignment * alignment
    offs_pad_E = torch.cumsum(padded_E, 0)
    return (offs_pad_E - padded_E) - (torch.cumsum(counts, 0) - counts), offs_pad_E


def sorted_rows(name: str, rows: int | None, n_copies: int) -> int:
    """Rows of a sorted buffer: ``rows`` (None or 0: ``n_copies``, the packed layout); a
    ValueError naming ``name`` if it cannot hold the ``n_copies`` copies."""
    if rows and rows < n_copies:
        raise ValueError(f"{name}: {rows} sorted rows cannot hold N*k = {n_copies} copies")
    return rows or n_copies


def sorted_rows_buffer(like: Tensor, rows: int, n_copies: int) -> Tensor:
    """[rows, L] output buffer: zero where copies leave padding rows (``rows > n_copies``)."""
    shape = (rows, like.shape[-1])
    return like.new_zeros(shape) if rows > n_copies else like.new_empty(shape)


def permute_torch(x_NL: Tensor, pos_Nk: Tensor, rows: int | None = None) -> Tensor:
    """``out[pos[n, j]] = x[n]`` -> [rows (default N*k), L] in ``x_NL.dtype``, padding rows
    zero (a broadcast index_put, no repeat)."""
    n, k = pos_Nk.shape
    out_RL = sorted_rows_buffer(x_NL, sorted_rows("permute_torch", rows, n * k), n * k)
    return out_RL.index_put_((pos_Nk.long(),), x_NL.unsqueeze(1))


def unpermute_combine_torch(
    y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor | None, out_dtype: torch.dtype | None = None
) -> Tensor:
    """``out[n] = sum_j w[n, j] * y[pos[n, j]]`` (``w = None``: plain sum) -> [N, L].

    fp32 products and sum; the result is rounded once to ``out_dtype`` (default ``y_ML.dtype``).
    """
    n, k = pos_Nk.shape
    y_NkL = y_ML[pos_Nk.reshape(-1)].view(n, k, y_ML.shape[1]).float()
    if weights_Nk is not None:
        y_NkL = y_NkL * weights_Nk.float().unsqueeze(-1)
    return y_NkL.sum(1).to(out_dtype or y_ML.dtype)


def unpermute_combine_backward_torch(
    grad_NL: Tensor, y_ML: Tensor, pos_Nk: Tensor, weights_Nk: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`unpermute_combine_torch` with weights.

    Returns ``dy_ML`` [rows of y, L] in ``y_ML.dtype`` (``dy[pos[n, j]] = w[n, j] * grad[n]``,
    padding rows zero) and ``dw_Nk`` [N, k] in ``weights_Nk.dtype``
    (``dw[n, j] = <grad[n], y[pos[n, j]]>``).
    """
    n, k = pos_Nk.shape
    grad_N1L = grad_NL.float().unsqueeze(1)
    y_NkL = y_ML[pos_Nk.reshape(-1)].view(n, k, y_ML.shape[1]).float()
    dw_Nk = (y_NkL * grad_N1L).sum(-1).to(weights_Nk.dtype)
    dy_NkL = (weights_Nk.float().unsqueeze(-1) * grad_N1L).to(y_ML.dtype)
    dy_ML = sorted_rows_buffer(y_ML, y_ML.shape[0], n * k).index_put_((pos_Nk.long(),), dy_NkL)
    return dy_ML, dw_Nk
