"""CUDA kernels for the `titan_moe::kda_chunk_fwd/bwd` and `kda_prepare{,_bwd}` ops (the
latter in `triton_prepare`), from the Triton launchers.

    TITAN_MOE_KDA_BACKEND=triton   register the Triton kernels for CUDA tensors (default)
    TITAN_MOE_KDA_BACKEND=torch    keep the plain-PyTorch chunked path on CUDA too

The adapters translate between the ops' contract (an empty `[0]` tensor stands for "no
final state" / "no initial-state gradient", gradients in the inputs' dtypes) and the
launchers' (None). Shapes the kernels do not cover (float64, head dims outside
{16, 32, 64, 128}) go to the PyTorch implementation, so registering never narrows the op.

The kernels are the CUDA default since the registered op was checked and timed end to end
on the H200: small_1gpu trains about 6x faster per step than with the PyTorch path
(BENCHMARKS.md). CPU tensors always take the PyTorch path.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from titan_moe.ops.kda import op as kda_op
from titan_moe.ops.nvtx import nvtx_range

BACKEND_ENV = "TITAN_MOE_KDA_BACKEND"
_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


_registered = False


def kernels_registered() -> bool:
    """Whether `register_cuda_kernels` put the Triton kernels under the ops."""
    return _registered


def kernels_cover(q: Tensor, v: Tensor, g: Tensor) -> bool:
    return (
        q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and g.dtype != torch.float16
        and q.shape[-1] in _SUPPORTED_HEAD_DIMS
        and v.shape[-1] in _SUPPORTED_HEAD_DIMS
    )


def kda_chunk_fwd_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum=False):
    """`titan_moe::kda_chunk_fwd` contract on top of `chunk_kda_fwd_triton`."""
    if not kernels_cover(q, v, g):
        return kda_op.kda_chunk_fwd_torch(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum
        )
    from titan_moe.ops.kda.triton_fwd import chunk_kda_fwd_triton

    with nvtx_range("op.kda_chunk_fwd"):
        o, final_state = chunk_kda_fwd_triton(
            q, k, v, g, beta, scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            output_final_state=output_final_state, g_cumsum=g_cumsum,
        )
    if final_state is None:
        final_state = q.new_empty(0, dtype=torch.float32)
    return o, final_state


def kda_chunk_bwd_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum=False, kept=None):
    """`titan_moe::kda_chunk_bwd` contract on top of `chunk_kda_bwd_triton` (`kept`: the
    residuals of `triton_fwd.kept_forward`, or None to recompute them)."""
    if not kernels_cover(q, v, g):
        return kda_op.kda_chunk_bwd_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum)
    from titan_moe.ops.kda.triton_bwd import chunk_kda_bwd_triton

    with nvtx_range("op.kda_chunk_bwd"):
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd_triton(
            q, k, v, g, beta, scale, do, initial_state=initial_state, cu_seqlens=cu_seqlens, dht=dht, kept=kept,
            g_cumsum=g_cumsum,
        )
    dh0 = q.new_empty(0, dtype=torch.float32) if dh0 is None else dh0.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), dh0


def selected_backend() -> str:
    backend = os.environ.get(BACKEND_ENV) or "triton"
    if backend not in ("torch", "triton"):
        raise ValueError(f"{BACKEND_ENV} must be 'torch' or 'triton', got {backend!r}")
    return backend


def register_cuda_kernels() -> bool:
    """Register the Triton kernels for CUDA when selected; return whether they were."""
    global _registered
    if selected_backend() != "triton" or not torch.cuda.is_available():
        return False
    torch.library.register_kernel(kda_op.FWD_OP, "cuda", kda_chunk_fwd_triton)
    torch.library.register_kernel(kda_op.BWD_OP, "cuda", kda_chunk_bwd_triton)
    from titan_moe.ops.kda import kept, prepare, triton_prepare

    kept.register_cuda_kernels()
    torch.library.register_kernel(prepare.FWD_OP, "cuda", triton_prepare.kda_prepare_triton)
    torch.library.register_kernel(prepare.BWD_OP, "cuda", triton_prepare.kda_prepare_bwd_triton)
    _registered = True
    return True
