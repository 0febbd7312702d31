"""MoE token dispatch (``titan_moe::moe_permute``, ``titan_moe::moe_unpermute_combine`` custom
ops), their Triton kernels and the plain-PyTorch path they share a contract with."""

from titan_moe.ops.dispatch.op import combine_copies, permute, scatter_copies, unpermute_combine
from titan_moe.ops.dispatch.reference import (
    aligned_positions,
    padded_rows,
    permute_torch,
    sorted_positions,
    unpermute_combine_backward_torch,
    unpermute_combine_torch,
)

__all__ = [
    "permute",
    "unpermute_combine",
    "scatter_copies",
    "combine_copies",
    "aligned_positions",
    "padded_rows",
    "sorted_positions",
    "permute_torch",
    "unpermute_combine_torch",
    "unpermute_combine_backward_torch",
]
