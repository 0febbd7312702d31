"""bf16 -> fp32 widening of the fp8 experts' weight gradients, one vectorized pass.

The fp8 grouped GEMM's weight gradient comes out of ``torch._grouped_mm`` /
``torch._scaled_grouped_mm`` in bf16 (neither writes fp32), while the expert weights it
belongs to are fp32 parameters. ATen converts with its dynamic-casting copy, well below the
copy bandwidth of the GPU. A bf16 value widened to fp32 is its 16 bits followed by 16 zero
bits, so the kernel here moves the bits with an integer shift and stores whole vectors:
exact, bit for bit ``t.float()`` (NaN payloads included).

:func:`widen_to_fp32` takes its backend from its caller (the fp8 experts' recipe key
``[quantize.grouped_mm.float8] widen``): "torch" (default, ``t.float()``; the kernel has been
measured only as part of a whole fp8 recipe, not alone), "triton" for the kernel where it
runs (CUDA; the CPU under the interpreter), ``t.float()`` elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.triton_runtime import cdiv, check_runs_on, is_interpreted, kernel_runs_on

BLOCK = 4096
BACKENDS = ("torch", "triton")


@triton.jit
def _widen_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Program: BLOCK consecutive elements; bf16 bits (as int16) -> the fp32 with those high bits."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
    tl.store(dst_ptr + offs, (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True), mask=mask)


def widen_to_fp32_triton(t: Tensor) -> Tensor:
    """:func:`widen_to_fp32` through ``_widen_kernel`` (``t`` bf16; copied if not contiguous)."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"widen_to_fp32_triton: expected bf16, got {t.dtype}")
    check_runs_on(_widen_kernel, t.device, "widen_to_fp32_triton", __name__)
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    n = t.numel()
    if n:
        _widen_kernel[(cdiv(n, BLOCK),)](t.view(torch.int16), out, n, BLOCK=BLOCK,
                                         num_warps=4 if is_interpreted(_widen_kernel) else 8)
    return out


def widen_to_fp32(t: Tensor, backend: str | None = None) -> Tensor:
    """``t.float()`` for a bf16 ``t`` (same values bit for bit), through the kernel when the
    backend is "triton" and it runs on t's device; other dtypes, and the default "torch", go
    to ``t.float()``. ``backend`` None (or ""): "torch"."""
    choice = backend or "torch"
    if choice not in BACKENDS:
        raise ValueError(f"widen_to_fp32: backend must be torch or triton, got {choice!r}")
    if choice == "triton" and t.dtype == torch.bfloat16 and kernel_runs_on(_widen_kernel, t.device):
        return widen_to_fp32_triton(t)
    return t.float()
