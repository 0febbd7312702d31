"""Plain-PyTorch sigmoid router top-k: the CPU implementation of ``titan_moe::router_topk``
and the reference its Triton kernel is tested against.

Maths (SPEC §5), per token row ``i`` of ``logits_Nn``::

    s_ij = sigmoid(logits_ij)                      fp32
    T_i  = the k experts with the largest s_ij + b_j
    p_ij = routed_scale * s_ij / Σ_{r∈T_i} s_ir     (the bias never enters p)

Tie-break (the op's contract, identical in every implementation): experts are ranked by
``(s_ij + b_j, -j)``, i.e. by decreasing biased score and, among equal biased scores, by
increasing expert index. The selection and the output order both follow that ranking.
``torch.topk`` makes no such promise: on CPU (torch 2.13) it returns tied values in
neither index order. :func:`ranking_key` turns every biased score into an int64 key that is
unique per row and orders exactly as the ranking above; ``torch.topk`` on the keys is
the ranking (:func:`topk_indices`). ``-0.0`` and ``+0.0`` count as equal. NaN scores are
outside the contract (the result is some valid set of k distinct experts, but which one is
unspecified).
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW32 = 0xFFFFFFFF


def ranking_key(values_Nn: Tensor) -> Tensor:
    """[N, n] fp32 -> [N, n] int64 keys: ``key_ij > key_ir`` iff ``(v_ij, -j) > (v_ir, -r)``.

    High 32 bits: the fp32 bit pattern made order-preserving as a signed integer (negative
    floats have their magnitude bits flipped); low 32 bits: ``2^32 - 1 - j``, so that a lower
    index wins a tie.
    """
    values_Nn = torch.where(values_Nn == 0, 0.0, values_Nn)  # -0.0 -> +0.0
    bits_Nn = values_Nn.contiguous().view(torch.int32)
    ordered_Nn = torch.where(bits_Nn < 0, bits_Nn ^ 0x7FFFFFFF, bits_Nn).to(torch.int64)
    col_n = torch.arange(values_Nn.shape[-1], device=values_Nn.device, dtype=torch.int64)
    return (ordered_Nn << 32) | (_LOW32 - col_n)


def topk_indices(values_Nn: Tensor, top_k: int) -> Tensor:
    """[N, n] fp32 -> [N, k] int64 indices of the k largest values per row, ranked by
    decreasing value and, among equal values, increasing index.

    Off CPU: ``torch.topk`` of :func:`ranking_key` (no host sync). On CPU, where building the
    int64 keys costs about as much as the fp32 top-k itself: ``torch.topk`` of the ``k + 1``
    largest values, the first k re-ranked by (value, index), and only the rows where a tie
    straddles the cut (the (k+1)-th largest value equals the k-th) or a NaN was selected are
    redone with keys; that takes one host read of whether such rows exist.
    """
    n = values_Nn.shape[-1]
    if values_Nn.device.type != "cpu":
        return torch.topk(ranking_key(values_Nn), top_k, dim=-1).indices
    top_vals_Nj, idx_Nj = torch.topk(values_Nn, min(top_k + 1, n), dim=-1)
    redo_N = torch.isnan(top_vals_Nj).any(-1)
    if top_k < n:
        redo_N |= top_vals_Nj[:, top_k] == top_vals_Nj[:, top_k - 1]
    top_vals_Nk, idx_Nk = top_vals_Nj[:, :top_k], idx_Nj[:, :top_k]
    # Within the selection: sort by index, then stably by decreasing value.
    idx_Nk, by_index_Nk = idx_Nk.sort(dim=-1)
    by_value_Nk = torch.sort(top_vals_Nk.gather(-1, by_index_Nk), dim=-1, descending=True, stable=True).indices
    idx_Nk = idx_Nk.gather(-1, by_value_Nk)
    if bool(redo_N.any()):
        rows = redo_N.nonzero().squeeze(1)
        idx_Nk[rows] = torch.topk(ranking_key(values_Nn[rows]), top_k, dim=-1).indices
    return idx_Nk


def router_topk_torch(
    logits_Nn: Tensor, bias_n: Tensor, top_k: int, routed_scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid, biased top-k with the index tie-break, gather and normalisation.

    Args:
        logits_Nn: [N, n] fp32 router logits (``x @ W^T``).
        bias_n: [n] per-expert bias, any float dtype (used in fp32; moves the selection only).
        top_k: experts per token, ``0 < top_k <= n``.
        routed_scale: factor on the normalised weights.

    Returns:
        ``weights_Nk`` [N, k] fp32 ``= routed_scale * s / Σ s`` over the selected experts,
        ``expert_idx_Nk`` [N, k] int64 (ranked as in the module docstring), and
        ``scores_Nk`` [N, k] fp32, the selected unbiased sigmoid scores ``s``.
    """
    scores_Nn = torch.sigmoid(logits_Nn)
    expert_idx_Nk = topk_indices(scores_Nn + bias_n.float(), top_k)
    scores_Nk = scores_Nn.gather(-1, expert_idx_Nk)
    weights_Nk = scores_Nk / scores_Nk.sum(-1, keepdim=True) * routed_scale
    return weights_Nk, expert_idx_Nk, scores_Nk


def router_topk_backward_torch(
    grad_weights_Nk: Tensor | None,
    grad_scores_Nk: Tensor | None,
    expert_idx_Nk: Tensor,
    scores_Nk: Tensor,
    n_experts: int,
    routed_scale: float,
) -> Tensor:
    """Gradient of the logits [N, n] fp32 from the gradients of ``weights_Nk`` / ``scores_Nk``.

    With ``S = Σ_k s_k`` and ``w_j = c s_j / S``: ``dL/ds_j = (c g_j - Σ_k g_k w_k) / S`` plus
    the direct gradient of ``scores_Nk``; then ``dL/dlogit_j = dL/ds_j * s_j (1 - s_j)`` at the
    k selected experts and zero elsewhere (the top-k selection itself has no gradient).
    Either gradient may be None (that output was not used).
    """
    grad_s_Nk = torch.zeros_like(scores_Nk)
    if grad_weights_Nk is not None:
        total_N1 = scores_Nk.sum(-1, keepdim=True)
        weights_Nk = scores_Nk / total_N1 * routed_scale
        grad_w_Nk = grad_weights_Nk.float()
        grad_s_Nk = (grad_w_Nk * routed_scale - (grad_w_Nk * weights_Nk).sum(-1, keepdim=True)) / total_N1
    if grad_scores_Nk is not None:
        grad_s_Nk = grad_s_Nk + grad_scores_Nk.float()
    grad_z_Nk = grad_s_Nk * scores_Nk * (1.0 - scores_Nk)
    grad_logits_Nn = scores_Nk.new_zeros(scores_Nk.shape[0], n_experts)
    # The k indices of a row are distinct, so a plain scatter is exact (no accumulation).
    return grad_logits_Nn.scatter(-1, expert_idx_Nk, grad_z_Nk)
