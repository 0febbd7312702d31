"""Triton kernels of `titan_moe::situ_glu` / `situ_glu_bwd`: one elementwise pass each.

The input is the fused gate|up projection `z [M, 2H]` (row m: gate in columns [0, H), up in
[H, 2H)); a program handles BLOCK consecutive elements of the `[M, H]` output. Maths in fp32
(`reference`; tanh in `_tanh`).
Forward reads z once and writes hidden; backward reads z and the upstream gradient once and
writes dz, where the PyTorch path runs about 17 elementwise kernels over fp32 copies.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.triton_runtime import cdiv

BLOCK = 1024


@triton.jit
def _tanh(x):
    """tanh in fp32 to a few ulp: the exponential form for |x| >= 1/4 (no overflow), its odd
    Taylor series to x^9 below, where 1 - e^{-2|x|} would cancel (the up branch's z/β2 is
    mostly small). Series truncation at |x| = 1/4: under 1e-8 relative."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(ax < 0.25, series, tl.where(x < 0, -t, t))


@triton.jit
def _load(z, offs, n, H: tl.constexpr):
    """Gate and up pre-activations (fp32) of output elements `offs` of `[M, H]`."""
    mask = offs < n
    row, col = offs // H, offs % H
    p_gate = row.to(tl.int64) * (2 * H) + col
    z_g = tl.load(z + p_gate, mask=mask, other=0.0).to(tl.float32)
    z_u = tl.load(z + p_gate + H, mask=mask, other=0.0).to(tl.float32)
    return z_g, z_u, p_gate, mask


@triton.jit
def situ_hidden(z_g, z_u, beta1, beta2):
    """The hidden activation from fp32 gate and up pre-activations (0 at z_g = z_u = 0); also
    called by the fp8 row quantization that fuses SiTU-GLU (`titan_moe.float8.quantize`)."""
    return beta1 * _tanh(z_g / beta1) * tl.sigmoid(z_g) * (beta2 * _tanh(z_u / beta2))


@triton.jit
def _situ_fwd_kernel(z, out, n, beta1, beta2, H: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z_g, z_u, _, mask = _load(z, offs, n, H)
    tl.store(out + offs, situ_hidden(z_g, z_u, beta1, beta2).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(z, grad, dz, n, beta1, beta2, H: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    z_g, z_u, p_gate, mask = _load(z, offs, n, H)
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    t_g, s, t_u = _tanh(z_g / beta1), tl.sigmoid(z_g), _tanh(z_u / beta2)
    gate = beta1 * t_g * s
    d_gate = g * ((1.0 - t_g * t_g) * s + gate * (1.0 - s)) * (beta2 * t_u)
    d_up = g * gate * (1.0 - t_u * t_u)
    tl.store(dz + p_gate, d_gate.to(dz.dtype.element_ty), mask=mask)
    tl.store(dz + p_gate + H, d_up.to(dz.dtype.element_ty), mask=mask)


def situ_glu_triton(z_M2H: Tensor, beta1: float, beta2: float, out_MH: Tensor) -> None:
    """Fill `out_MH [M, H]` from contiguous `z_M2H [M, 2H]`."""
    n = out_MH.numel()
    if n:
        H = out_MH.shape[-1]
        _situ_fwd_kernel[(cdiv(n, BLOCK),)](z_M2H, out_MH, n, float(beta1), float(beta2), H=H, BLOCK=BLOCK)


def situ_glu_bwd_triton(z_M2H: Tensor, grad_MH: Tensor, beta1: float, beta2: float, dz_M2H: Tensor) -> None:
    """Fill `dz_M2H [M, 2H]` from contiguous `z_M2H` and `grad_MH [M, H]`."""
    n = grad_MH.numel()
    if n:
        H = grad_MH.shape[-1]
        _situ_bwd_kernel[(cdiv(n, BLOCK),)](
            z_M2H, grad_MH, dz_M2H, n, float(beta1), float(beta2), H=H, BLOCK=BLOCK
        )
