"""Plain-PyTorch reference for the grouped expert GEMM.

Contract (shared with :func:`titan_moe.ops.grouped_gemm.grouped_mm`):

* ``x_MK``  [M, K]    rows sorted by group: group ``e`` owns rows ``offs[e-1]:offs[e]``
  (``offs[-1] := 0`` for ``e = 0``).
* ``w_EKN`` [E, K, N] one weight matrix per group, same dtype as ``x_MK``.
* ``offs_E`` [E] int32, non-decreasing cumulative group ends with ``offs[-1] <= M``.
  Empty groups (``offs[e] == offs[e-1]``) are allowed.
* returns [M, N] in the dtype of ``x_MK``: ``out[rows of e] = x[rows of e] @ w[e]``,
  accumulated in fp32; rows ``offs[-1]:M`` (not owned by any group) are zero.
"""

from __future__ import annotations

from torch import Tensor


def group_bounds(offs_E: Tensor, m: int) -> list[tuple[int, int]]:
    """Host-side (start, end) row range of every group; checks the offsets contract.

    Reads ``offs_E`` on the host (a device sync on GPU), so it is only for eager
    fallbacks and tests.
    """
    ends = offs_E.tolist()
    bounds = []
    start = 0
    for e, end in enumerate(ends):
        if end < start or end > m:
            raise ValueError(
                f"grouped_mm: offs must be non-decreasing and <= M={m}, got offs={ends} (group {e})"
            )
        bounds.append((start, end))
        start = end
    return bounds


def grouped_mm_reference(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """Loop over groups: one fp32 matmul per non-empty group. Shapes as in the module doc."""
    out_MN = x_MK.new_zeros(x_MK.shape[0], w_EKN.shape[-1])
    for e, (start, end) in enumerate(group_bounds(offs_E, x_MK.shape[0])):
        if end > start:
            out_MN[start:end] = (x_MK[start:end].float() @ w_EKN[e].float()).to(out_MN.dtype)
    return out_MN


def grouped_mm_dw_reference(x_MK: Tensor, grad_MN: Tensor, offs_E: Tensor) -> Tensor:
    """Weight gradient ``dw[e] = x[rows of e]^T @ grad[rows of e]`` -> [E, K, N] (zero for empty groups)."""
    n_groups = offs_E.shape[0]
    dw_EKN = x_MK.new_zeros(n_groups, x_MK.shape[1], grad_MN.shape[1])
    for e, (start, end) in enumerate(group_bounds(offs_E, x_MK.shape[0])):
        if end > start:
            dw_EKN[e] = (x_MK[start:end].float().t() @ grad_MN[start:end].float()).to(dw_EKN.dtype)
    return dw_EKN
