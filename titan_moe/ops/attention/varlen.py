"""Packed causal attention as one variable-length FlashAttention call (CUDA).

    doc_attention_varlen(q_BTHK, k_BTHK, v_BTHV, cu_seqlens, scale) -> o_BTHV

The B rows are flattened into one stream of B*T tokens whose documents are given by
`cu_seqlens` (int32 [N+1] on the device, `titan_moe.model.packing.cu_seqlens_from_doc_ids`).
torch's `varlen_attn` (FlashAttention-2) attends causally within each document in a single
launch per direction, with no per-document host work and no data-dependent shape: the
longest document is bounded by T, which is passed as the maximum length (blocks past a
document's end exit at once). FlashAttention-2 wants equal head dims for keys and values,
so v is zero-padded from V to K and the padding is sliced off the output. Differentiable
(torch registers the backward); traceable by torch.compile.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import Tensor


def _causal_kwargs(varlen_attn) -> dict:
    """`is_causal=True` in the torch versions that have it, else the window (-1, 0)."""
    params = inspect.signature(varlen_attn).parameters
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


def varlen_causal(q_NHK: Tensor, k_NHK: Tensor, v_NHV: Tensor, cu_seqlens: Tensor, max_len: int, scale: float) -> Tensor:
    """o [N, H, V] of causal attention within each document of `cu_seqlens` over N tokens."""
    from torch.nn.attention.varlen import varlen_attn

    K, V = q_NHK.shape[-1], v_NHV.shape[-1]
    v_pad = F.pad(v_NHV, (0, K - V)) if V < K else v_NHV
    o_NHK = varlen_attn(q_NHK, k_NHK, v_pad, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                        **_causal_kwargs(varlen_attn))
    return o_NHK[..., :V]


def doc_attention_varlen(q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """o [B, T, H, V] of causal attention within documents; bf16/fp16 on CUDA (module docstring)."""
    if not q_BTHK.is_cuda:
        raise ValueError("doc_attention_varlen needs CUDA tensors (FlashAttention-2)")
    B, T, H, K = q_BTHK.shape
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [N+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    o_NHV = varlen_causal(q_BTHK.reshape(B * T, H, K), k_BTHK.reshape(B * T, H, K),
                          v_BTHV.reshape(B * T, H, -1), cu_seqlens, T, scale)
    return o_NHV.view(B, T, H, -1)
