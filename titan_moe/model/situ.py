"""SiTU-GLU activation (SPEC §6).

    hidden = (β1 tanh(z_g/β1) ⊙ sigmoid(z_g)) ⊙ (β2 tanh(z_u/β2))

the gated hidden activation that the down projection ``W_d`` consumes. Each factor is a
soft clip of SwiGLU's: ``β tanh(z/β) -> z`` as ``z/β -> 0``, so SiTU-GLU equals SwiGLU
(``silu(z_g) * z_u``) near zero and as β -> ∞, while ``|hidden| < β1·β2`` for every input
(|tanh| < 1 and 0 < sigmoid < 1). That bound keeps expert outputs finite under bf16/fp8
training whatever the pre-activations do.

Autograd keeps only the two pre-activations (`_SiTUGLU`, and the `titan_moe::situ_glu` op
behind `situ_glu_packed` that the layers call): eager PyTorch would keep six
intermediates (each tanh, the sigmoid, the scaled branches and the gate), 84 KiB against
36 KiB per token in small_1gpu's routed experts. The backward recomputes the activations from
``z_g`` and ``z_u`` in at least fp32, with the derivatives

    d hidden / d z_g = ((1 - t_g^2) s + β1 t_g s (1 - s)) · β2 t_u
    d hidden / d z_u = β1 t_g s · (1 - t_u^2)

where ``t_g = tanh(z_g/β1)``, ``s = sigmoid(z_g)``, ``t_u = tanh(z_u/β2)``. Under
``torch.compile`` Inductor fuses both directions into one elementwise kernel each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_moe.ops.situ import situ_glu_backward_torch, situ_glu_forward_torch
from titan_moe.ops.situ import situ_glu_packed as ops_situ_glu_packed

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
    if torch.is_grad_enabled() and (z_gate.requires_grad or z_up.requires_grad):
        return _SiTUGLU.apply(z_gate, z_up, beta1, beta2)
    return situ_glu_forward_torch(z_gate, z_up, beta1, beta2)


def situ_glu_packed(z: Tensor, beta1: float = DEFAULT_BETA1, beta2: float = DEFAULT_BETA2) -> Tensor:
    """SiTU-GLU of a fused gate|up projection `z [..., 2 * hidden]` -> `[..., hidden]`.

    Eager: the `titan_moe::situ_glu` op (`titan_moe.ops.situ`: one Triton pass per direction
    on CUDA when `$TITAN_MOE_SITU_BACKEND` selects it). Compiled: `situ_glu` on the two
    halves, which Inductor fuses with its neighbours (an opaque op would stop that).
    """
    if torch.compiler.is_compiling():
        hidden = z.shape[-1] // 2
        return situ_glu(z[..., :hidden], z[..., hidden:], beta1, beta2)
    return ops_situ_glu_packed(z, beta1, beta2)


class _SiTUGLU(torch.autograd.Function):
    """SiTU-GLU that saves ``z_gate`` and ``z_up`` only and recomputes the rest (module
    docstring)."""

    @staticmethod
    def forward(ctx, z_gate: Tensor, z_up: Tensor, beta1: float, beta2: float) -> Tensor:
        ctx.save_for_backward(z_gate, z_up)
        ctx.betas = (beta1, beta2)
        return situ_glu_forward_torch(z_gate, z_up, beta1, beta2)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        z_gate, z_up = ctx.saved_tensors
        return (*situ_glu_backward_torch(z_gate, z_up, grad_out, *ctx.betas), None, None)
