"""Bounded-decay delta attention (KDA, SPEC §1): custom ops, references and decode step.

    chunk_kda            the training/prefill operator (torch.library custom ops)
    naive_recurrent_kda  token-by-token reference recurrence
    kda_decode_step      one-token recurrent step for generation
    kda_gate             the bounded decay gate
"""

from titan_moe.ops.kda import kept  # noqa: F401  (registers the kept-intermediates ops)
from titan_moe.ops.kda.chunk_torch import chunk_kda_torch, l2norm
from titan_moe.ops.kda.gate import kda_gate
from titan_moe.ops.kda.naive import naive_recurrent_kda
from titan_moe.ops.kda.op import chunk_kda
from titan_moe.ops.kda.recurrent import kda_decode_step
from titan_moe.ops.kda.triton_op import register_cuda_kernels

register_cuda_kernels()  # Triton kernels for CUDA tensors unless TITAN_MOE_KDA_BACKEND=torch

__all__ = [
    "chunk_kda",
    "chunk_kda_torch",
    "kda_decode_step",
    "kda_gate",
    "l2norm",
    "naive_recurrent_kda",
]
