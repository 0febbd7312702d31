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
``torch.compile`` Inductor fuses the forward into one elementwise kernel (with its
neighbours); the packed form's backward is the op's one-pass kernel (`situ_glu_packed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    on CUDA when `[kernels] situ` selects it). Compiled: `_SiTUGLUCompiled`, whose
    forward is plain PyTorch on the two halves, which Inductor fuses with its neighbours, and
    whose backward is the op's backward (`titan_moe::situ_glu_bwd`).
    """
    if torch.compiler.is_compiling():
        if beta1 <= 0 or beta2 <= 0:
            raise ValueError(f"situ_glu_packed: beta1 and beta2 must be > 0, got {beta1}, {beta2}")
        if torch.is_grad_enabled() and z.requires_grad:
            return _SiTUGLUCompiled.apply(z, float(beta1), float(beta2))
        hidden = z.shape[-1] // 2
        return situ_glu_forward_torch(z[..., :hidden], z[..., hidden:], beta1, beta2)
    return ops_situ_glu_packed(z, beta1, beta2)


def swiglu_packed(z: Tensor) -> Tensor:
    """SwiGLU of a fused gate|up projection `z [..., 2 * hidden]` -> `silu(z_g) * z_u [..., hidden]`.

    The activation of `ModelArgs.expert_activation = "swiglu"` (an ablation of SiTU-GLU): plain
    PyTorch on every device (no custom op; Inductor fuses it when compiled), unbounded.
    """
    hidden = z.shape[-1] // 2
    return F.silu(z[..., :hidden]) * z[..., hidden:]


GLU_ACTIVATIONS = ("situ", "swiglu")


def check_glu_activation(activation: str) -> None:
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"the GLU activation must be situ|swiglu, got {activation!r}")


def glu_packed(z: Tensor, activation: str, beta1: float = DEFAULT_BETA1, beta2: float = DEFAULT_BETA2) -> Tensor:
    """The GLU `activation` ("situ" or "swiglu", `ModelArgs.expert_activation`) of packed `z`."""
    if activation == "swiglu":
        return swiglu_packed(z)
    return situ_glu_packed(z, beta1, beta2)


class _SiTUGLUCompiled(torch.autograd.Function):
    """SiTU-GLU of packed `z [..., 2H]` for compiled regions: Inductor's forward, the op's backward.

    Why not plain autograd through `z[..., :H]` and `z[..., H:]`: its backward,
    `slice_backward(d z_g) + slice_backward(d z_u)`, fuses into one Inductor kernel over
    `[..., 2H]` in which every element loads both halves and evaluates both branches' tanh
    and sigmoid. The op's Triton backward reads each (z_g, z_u, grad) once and writes both
    halves of `dz`. Measured on the H200 (M = 65,536, H = 4096, bf16, compiled forward and
    backward, BENCHMARKS.md): 1.30 ms against 2.29 for the sliced form (a `cat` of the two
    gradients instead: 2.78 ms; the op in both directions: 1.42 ms, its forward cannot fuse).
    On the CPU the op's backward is the PyTorch reference.
    """

    @staticmethod
    def forward(ctx, z: Tensor, beta1: float, beta2: float) -> Tensor:
        hidden = z.shape[-1] // 2
        ctx.save_for_backward(z)
        ctx.betas = (beta1, beta2)
        return situ_glu_forward_torch(z[..., :hidden], z[..., hidden:], beta1, beta2)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (z,) = ctx.saved_tensors
        return torch.ops.titan_moe.situ_glu_bwd(z, grad_out.contiguous(), *ctx.betas), None, None


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
