"""MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 values sharing an E8M0 scale.

Stored layout of a weight `W [out, in]` (compressed-tensors' `mxfp4-pack-quantized`, as the
public Kimi K3 checkpoint stores its routed experts):

    weight_packed  uint8 [out, in / 2]    two E2M1 codes per byte, element 2j in the low nibble
    weight_scale   uint8 [out, in / 32]   one E8M0 code per block of 32 consecutive elements

E2M1 code `s e1 e0 m` (4 bits): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, the
sign bit (8) negates them. E8M0 code `x`: the scale 2^(x - 127); x = 255 is NaN (no
infinity, no zero). So `W[r, c] = e2m1(code[r, c]) * 2^(scale[r, c // 32] - 127)`, computed
exactly in float32 (the products need at most 2 significant bits) up to float32's range:
scales above 2^125 overflow to inf.
"""

from __future__ import annotations

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> the E2M1 codes, uint8 [..., n] (low nibble first)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`weight_packed` uint8 [..., in / 2] and `weight_scale` uint8 [..., in / 32] -> [..., in]."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} (packed) and {scale.dtype} (scale)")
    n = 2 * packed.shape[-1]
    if n % BLOCK or tuple(scale.shape) != (*packed.shape[:-1], n // BLOCK):
        raise ValueError(f"MXFP4 shapes do not match: packed {tuple(packed.shape)} holds {n} values per row, "
                         f"which needs a scale of shape {(*packed.shape[:-1], n // BLOCK)}, got {tuple(scale.shape)}")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[unpack_e2m1(packed).long()].unflatten(-1, (n // BLOCK, BLOCK))
    # 2^(x - 127) built from its float32 bits: exponent field x for x >= 1, the subnormal 2^-127 for x = 0
    code = scale.to(torch.int32)
    factor = torch.where(code == 0, torch.full_like(code, 1 << 22), code << 23).view(torch.float32)
    out = values * factor.unsqueeze(-1)
    out = torch.where((scale == E8M0_NAN).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out.flatten(-2).to(dtype)
