"""The bounded KDA decay gate (SPEC §1).

    g = lower_bound * sigmoid(exp(A_log_h) * (z + dt_bias))       in [lower_bound, 0]

`g` is the per-channel log-space decay of the recurrent state. Because sigmoid lies in
(0, 1), every gate lies in `[lower_bound, 0]` (0 and `lower_bound` only where sigmoid
rounds to 0 or 1), which is what lets the chunked kernels exponentiate cumulative decays
inside a 16-token tile without overflow. Parameter layout follows fla's KDA layer:
`A_log` has one entry per head, `dt_bias` one per (head, key channel), flattened.
"""

from __future__ import annotations

import torch

G_MIN_ALLOWED = -5.0  # the most negative lower bound the chunked kernels are designed for


def check_lower_bound(lower_bound: float) -> None:
    """Raise ValueError unless `lower_bound` lies in [-5, 0)."""
    if not (G_MIN_ALLOWED <= lower_bound < 0.0):
        raise ValueError(f"lower_bound must lie in [{G_MIN_ALLOWED}, 0), got {lower_bound}")


def kda_gate(
    z: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Bounded log-space decay from the raw gate input.

    Args:
        z: raw gate input `[..., H, dk]` (any float dtype).
        A_log: per-head log scale `[H]`.
        dt_bias: per-channel bias `[H * dk]`.
        lower_bound: the most negative gate value, in [-5, 0).
        output_dtype: dtype of the result (math is fp32, or float64 for float64 `z`).

    Returns:
        g `[..., H, dk]` in `output_dtype`, every entry in `[lower_bound, 0]`.
    """
    check_lower_bound(lower_bound)
    if z.dim() < 2:
        raise ValueError(f"z must be [..., H, dk], got shape {tuple(z.shape)}")
    H, dk = z.shape[-2], z.shape[-1]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape ({H},), got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * dk,):
        raise ValueError(f"dt_bias must have shape ({H * dk},), got {tuple(dt_bias.shape)}")
    compute_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    z_HK = z.to(compute_dtype) + dt_bias.to(compute_dtype).view(H, dk)
    rate_H1 = A_log.to(compute_dtype).exp().view(H, 1)
    return (lower_bound * torch.sigmoid(rate_H1 * z_HK)).to(output_dtype)
