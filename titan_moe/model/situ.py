"""SiTU-GLU activation (SPEC §6).

    hidden = (β1 tanh(z_g/β1) ⊙ sigmoid(z_g)) ⊙ (β2 tanh(z_u/β2))

the gated hidden activation that the down projection ``W_d`` consumes. Each factor is a
soft clip of SwiGLU's: ``β tanh(z/β) -> z`` as ``z/β -> 0``, so SiTU-GLU equals SwiGLU
(``silu(z_g) * z_u``) near zero and as β -> ∞, while ``|hidden| < β1·β2`` for every input
(|tanh| < 1 and 0 < sigmoid < 1). That bound keeps expert outputs finite under bf16/fp8
training whatever the pre-activations do.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_BETA1 = 4.0
DEFAULT_BETA2 = 25.0


def situ_glu(z_gate: Tensor, z_up: Tensor, beta1: float = DEFAULT_BETA1, beta2: float = DEFAULT_BETA2) -> Tensor:
    """Elementwise SiTU-GLU hidden activation.

    Args:
        z_gate: gate pre-activation ``W_g x``, any shape.
        z_up: up pre-activation ``W_u x``, same shape as ``z_gate``.
        beta1: clip scale of the gate branch (> 0).
        beta2: clip scale of the up branch (> 0).

    Returns:
        Tensor of the common shape and dtype, bounded by ``beta1 * beta2`` in absolute value.
    """
    if beta1 <= 0 or beta2 <= 0:
        raise ValueError(f"situ_glu: beta1 and beta2 must be > 0, got {beta1}, {beta2}")
    if z_gate.shape != z_up.shape:
        raise ValueError(f"situ_glu: gate {tuple(z_gate.shape)} and up {tuple(z_up.shape)} shapes differ")
    gate = beta1 * torch.tanh(z_gate / beta1) * torch.sigmoid(z_gate)
    up = beta2 * torch.tanh(z_up / beta2)
    return gate * up
