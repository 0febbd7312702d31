"""SiTU-GLU of a fused gate|up projection as ``torch.library`` custom ops (namespace ``titan_moe``).

* ``titan_moe::situ_glu(z [..., 2H], beta1, beta2) -> hidden [..., H]`` (z's dtype): the
  activation of `reference` with gate = ``z[..., :H]``, up = ``z[..., H:]``.
  Backward: ``titan_moe::situ_glu_bwd(z, grad [..., H], beta1, beta2) -> dz [..., 2H]``.
  Autograd keeps only ``z`` (the two pre-activations) and recomputes the rest.

Implementation, per call from the ``[kernels] situ`` choice (`titan_moe.ops.choices`):

* ``auto`` (default): ``triton`` on CUDA, ``torch`` elsewhere. The Triton kernels are one
  elementwise pass per direction where the PyTorch path runs about 17 over fp32 copies.
* ``torch``: `reference` (in at least fp32).
* ``triton``: :mod:`.triton_kernel`, on CUDA (or on CPU when ``TRITON_INTERPRET=1`` was set
  before that module was first imported: tests).
"""

from __future__ import annotations


import torch
from torch import Tensor

from titan_moe.ops import choices
from titan_moe.ops.nvtx import nvtx_range
from titan_moe.ops.situ.reference import situ_glu_backward_torch, situ_glu_forward_torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_backend(device: torch.device) -> str:
    """"torch" or "triton": the implementation a call on ``device`` uses (module docstring)."""
    return choices.pick_backend(choices.current().situ, device.type)


def _use_kernels(*tensors: Tensor) -> bool:
    if resolve_backend(tensors[0].device) != "triton" or not all(t.dtype in _KERNEL_DTYPES for t in tensors):
        return False
    from titan_moe.ops.situ import triton_kernel
    from titan_moe.ops.triton_runtime import check_runs_on

    check_runs_on(triton_kernel._situ_fwd_kernel, tensors[0].device, "situ_glu", "titan_moe.ops.situ.triton_kernel")
    return True


def _halves(z: Tensor) -> tuple[Tensor, Tensor]:
    H = z.shape[-1] // 2
    return z[..., :H], z[..., H:]


@torch.library.custom_op("titan_moe::situ_glu", mutates_args=())
def situ_glu_op(z: Tensor, beta1: float, beta2: float) -> Tensor:
    with nvtx_range("op.situ_glu"):
        if not _use_kernels(z):
            return situ_glu_forward_torch(*_halves(z), beta1, beta2)
        from titan_moe.ops.situ.triton_kernel import situ_glu_triton

        z_M2H = z.reshape(-1, z.shape[-1]).contiguous()
        out = z.new_empty(*z.shape[:-1], z.shape[-1] // 2)
        situ_glu_triton(z_M2H, beta1, beta2, out.view(-1, out.shape[-1]))
        return out


@situ_glu_op.register_fake
def _situ_glu_fake(z, beta1, beta2):
    return z.new_empty(*z.shape[:-1], z.shape[-1] // 2)


@torch.library.custom_op("titan_moe::situ_glu_bwd", mutates_args=())
def situ_glu_bwd_op(z: Tensor, grad: Tensor, beta1: float, beta2: float) -> Tensor:
    with nvtx_range("op.situ_glu_bwd"):
        if not _use_kernels(z, grad):
            return torch.cat(situ_glu_backward_torch(*_halves(z), grad, beta1, beta2), dim=-1)
        from titan_moe.ops.situ.triton_kernel import situ_glu_bwd_triton

        dz = torch.empty_like(z, memory_format=torch.contiguous_format)
        situ_glu_bwd_triton(
            z.reshape(-1, z.shape[-1]).contiguous(), grad.reshape(-1, grad.shape[-1]).contiguous(),
            beta1, beta2, dz.view(-1, z.shape[-1]),
        )
        return dz


@situ_glu_bwd_op.register_fake
def _situ_glu_bwd_fake(z, grad, beta1, beta2):
    return torch.empty_like(z, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    z, beta1, beta2 = inputs
    ctx.save_for_backward(z)
    ctx.betas = (beta1, beta2)


def _backward(ctx, grad: Tensor):
    (z,) = ctx.saved_tensors
    return torch.ops.titan_moe.situ_glu_bwd(z, grad, *ctx.betas), None, None


situ_glu_op.register_autograd(_backward, setup_context=_setup_context)


def situ_glu_packed(z: Tensor, beta1: float, beta2: float) -> Tensor:
    """SiTU-GLU of `z [..., 2H]` = [gate | up] -> `[..., H]`, differentiable (module docstring)."""
    if z.shape[-1] % 2:
        raise ValueError(f"situ_glu: the last dim of z must be 2 * hidden, got {tuple(z.shape)}")
    if beta1 <= 0 or beta2 <= 0:
        raise ValueError(f"situ_glu: beta1 and beta2 must be > 0, got {beta1}, {beta2}")
    return torch.ops.titan_moe.situ_glu(z, float(beta1), float(beta2))
