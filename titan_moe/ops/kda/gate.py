"""The bounded KDA decay gate (SPEC §1), and the unbounded one it replaced.

    g = lower_bound * sigmoid(exp(A_log_h) * (z + dt_bias))       in [lower_bound, 0]
    g = -exp(A_log_h) * softplus(z + dt_bias)                      in (-inf, 0]   (`softplus_gate`)

`g` is the per-channel log-space decay of the recurrent state. Because sigmoid lies in
(0, 1), every gate lies in `[lower_bound, 0]` (0 and `lower_bound` only where sigmoid
rounds to 0 or 1), which is what lets the chunked kernels exponentiate cumulative decays
inside a 16-token tile without overflow. Parameter layout follows fla's KDA layer:
`A_log` has one entry per head, `dt_bias` one per (head, key channel), flattened.
The unbounded softplus form (Kimi Linear's gate, fla's default) is kept for ablation only:
only the PyTorch chunked path takes it (`ModelArgs.kda_gate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    rate_H1, z_HK = _gate_operands(z, A_log, dt_bias)
    return (lower_bound * torch.sigmoid(rate_H1 * z_HK)).to(output_dtype)


def softplus_gate(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, output_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unbounded log-space decay `g = -exp(A_log_h) * softplus(z + dt_bias)`, shapes as `kda_gate`.

    Returns g `[..., H, dk]` in `output_dtype`, every entry <= 0 with no lower bound (fla's
    `naive_kda_gate`). The Triton kernels do not take it (their tiles need g >= -5).
    """
    rate_H1, z_HK = _gate_operands(z, A_log, dt_bias)
    return (-rate_H1 * F.softplus(z_HK)).to(output_dtype)


def _gate_operands(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`exp(A_log)` as `[H, 1]`, `z + dt_bias` as `[..., H, dk]`) in fp32 (float64 for float64 z),
    after checking the shapes."""
    if z.dim() < 2:
        raise ValueError(f"z must be [..., H, dk], got shape {tuple(z.shape)}")
    H, dk = z.shape[-2], z.shape[-1]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape ({H},), got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * dk,):
        raise ValueError(f"dt_bias must have shape ({H * dk},), got {tuple(dt_bias.shape)}")
    compute_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    z_HK = z.to(compute_dtype) + dt_bias.to(compute_dtype).view(H, dk)
    return A_log.to(compute_dtype).exp().view(H, 1), z_HK
