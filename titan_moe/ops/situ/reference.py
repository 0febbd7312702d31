"""SiTU-GLU in plain PyTorch: the maths every backend matches (SPEC §6).

    hidden = (β1 tanh(z_g/β1) sigmoid(z_g)) (β2 tanh(z_u/β2))
    d hidden / d z_g = ((1 - t_g^2) s + β1 t_g s (1 - s)) β2 t_u
    d hidden / d z_u = β1 t_g s (1 - t_u^2)

with ``t_g = tanh(z_g/β1)``, ``s = sigmoid(z_g)``, ``t_u = tanh(z_u/β2)``. The backward
computes in at least fp32 and returns the gradients in the inputs' dtypes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def situ_glu_forward_torch(z_gate: Tensor, z_up: Tensor, beta1: float, beta2: float) -> Tensor:
    """hidden, in the inputs' dtype (elementwise; any shape, both the same)."""
    gate = beta1 * torch.tanh(z_gate / beta1) * torch.sigmoid(z_gate)
    up = beta2 * torch.tanh(z_up / beta2)
    return gate * up


def situ_glu_backward_torch(
    z_gate: Tensor, z_up: Tensor, grad_out: Tensor, beta1: float, beta2: float
) -> tuple[Tensor, Tensor]:
    """(d z_gate, d z_up) for upstream gradient `grad_out`, in z_gate's and z_up's dtypes."""
    compute = torch.promote_types(grad_out.dtype, torch.float32)
    zg, zu, g = z_gate.to(compute), z_up.to(compute), grad_out.to(compute)
    t_g, s, t_u = torch.tanh(zg / beta1), torch.sigmoid(zg), torch.tanh(zu / beta2)
    gate = beta1 * t_g * s
    d_gate = (1 - t_g * t_g) * s + gate * (1 - s)
    grad_gate = g * d_gate * (beta2 * t_u)
    grad_up = g * gate * (1 - t_u * t_u)
    return grad_gate.to(z_gate.dtype), grad_up.to(z_up.dtype)
