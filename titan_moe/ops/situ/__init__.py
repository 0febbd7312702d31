"""SiTU-GLU activation as custom ops (``titan_moe::situ_glu``, ``situ_glu_bwd``), their Triton
kernels and the plain-PyTorch maths they share (`reference`)."""

from titan_moe.ops.situ.op import situ_glu_packed
from titan_moe.ops.situ.reference import situ_glu_backward_torch, situ_glu_forward_torch

__all__ = ["situ_glu_packed", "situ_glu_forward_torch", "situ_glu_backward_torch"]
