"""Bounded-decay delta attention (KDA, SPEC §1): custom ops, references and decode step.

    chunk_kda            the training/prefill operator (torch.library custom ops)
    naive_recurrent_kda  token-by-token reference recurrence
    kda_decode_step      one-token recurrent step for generation
    kda_gate             the bounded decay gate
    softplus_gate        the unbounded softplus gate (ablation; PyTorch path only)
    keep_selected        whether `chunk_kda` keeps the forward's intermediates (`kda_keep` choice)
    residual_bytes_per_token  what the kept forward holds per token (the memory planner's count)
"""

from titan_moe.ops.kda import kept  # noqa: F401  (registers the kept-intermediates ops)
from titan_moe.ops.kda.chunk_torch import chunk_kda_torch, l2norm
from titan_moe.ops.kda.gate import kda_gate, softplus_gate
from titan_moe.ops.kda.kept import residual_bytes_per_token
from titan_moe.ops.kda.naive import naive_recurrent_kda
from titan_moe.ops.kda.op import chunk_kda, keep_selected
from titan_moe.ops.kda.recurrent import kda_decode_step
from titan_moe.ops.kda.triton_op import register_cuda_kernels

register_cuda_kernels()  # Triton kernels for CUDA tensors, run when the `[kernels] kda` choice picks them

__all__ = [
    "chunk_kda",
    "chunk_kda_torch",
    "kda_decode_step",
    "kda_gate",
    "keep_selected",
    "l2norm",
    "naive_recurrent_kda",
    "residual_bytes_per_token",
    "softplus_gate",
]
