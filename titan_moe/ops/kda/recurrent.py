"""Single-token KDA step for decoding (SPEC §1, "Decode").

One application of the recurrence per head:

    S' = (I - beta k k^T) Diag(exp g) S + beta k v^T,        o = scale * S'^T q

Plain PyTorch (one token is a handful of small batched matmuls); it is meant for
inference and has no custom backward. A fused recurrent kernel can replace it later.
"""

from __future__ import annotations

import torch

from titan_moe.ops.kda.chunk_torch import prepare_qkg


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the KDA state by one token.

    Args:
        q, k: `[B, H, dk]`; v: `[B, H, dv]`; g: `[B, H, dk]` (bounded log decay, or the raw
            gate input with `gate_in_kernel=True`, as in `chunk_kda`); beta: `[B, H]`.
        state: `[B, H, dk, dv]` fp32 (float64 allowed), the state before this token.
        scale, use_qk_l2norm, gate_in_kernel, A_log, dt_bias, lower_bound: as `chunk_kda`.

    Returns:
        `o [B, H, dv]` in v's dtype and the new state `[B, H, dk, dv]` in state's dtype.
        `state` itself is not modified.
    """
    if q.dim() != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k, g must all be [B, H, dk], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}"
        )
    B, H, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (B, H):
        raise ValueError(f"v must be [B, H, dv] = [{B}, {H}, dv], got {tuple(v.shape)}")
    if beta.shape != (B, H):
        raise ValueError(f"beta must be [B, H] = [{B}, {H}], got {tuple(beta.shape)}")
    if state.shape != (B, H, dk, v.shape[-1]):
        raise ValueError(f"state must be [B, H, dk, dv] = {(B, H, dk, v.shape[-1])}, got {tuple(state.shape)}")
    if state.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"state must be float32 (float64 allowed), got {state.dtype}")
    q, k, g = prepare_qkg(
        q, k, g, use_qk_l2norm=use_qk_l2norm, gate_in_kernel=gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
    )
    if scale is None:
        scale = dk**-0.5
    out_dtype, dtype = v.dtype, state.dtype
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))

    S_BHKV = state * torch.exp(g)[..., None]
    residual_BHV = v - torch.einsum("bhkv,bhk->bhv", S_BHKV, k)
    S_BHKV = S_BHKV + (beta[..., None] * k)[..., :, None] * residual_BHV[..., None, :]
    o_BHV = torch.einsum("bhkv,bhk->bhv", S_BHKV, q * scale)
    return o_BHV.to(out_dtype), S_BHKV
