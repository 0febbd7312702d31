"""CUDA kernels for the `titan_moe::kda_chunk_fwd/bwd` and `kda_prepare{,_bwd}` ops (the
latter in `triton_prepare`), from the Triton launchers.

They are registered for CUDA tensors whenever CUDA is present, each behind a check of the
`[kernels] kda` choice per call (`kernels_selected`: "auto" and "triton" pick the kernels on
CUDA; "torch" keeps the plain-PyTorch path on CUDA too). CPU tensors always take the PyTorch
path of the ops; the tests call these adapters directly under Triton's interpreter.

The adapters translate between the ops' contract (an empty `[0]` tensor stands for "no
final state" / "no initial-state gradient", gradients in the inputs' dtypes) and the
launchers' (None). Shapes the kernels do not cover (float64, head dims outside
{16, 32, 64, 128}) go to the PyTorch implementation, so registering never narrows the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_moe.ops import choices
from titan_moe.ops.kda import op as kda_op
from titan_moe.ops.nvtx import nvtx_range

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


_registered = False


def kernels_registered() -> bool:
    """Whether `register_cuda_kernels` put the Triton kernels under the ops."""
    return _registered


def kernels_selected(device: torch.device) -> bool:
    """Whether the `[kernels] kda` choice in force picks the Triton kernels on `device`."""
    return choices.pick_backend(choices.current().kda, device.type) == "triton"


def kernels_cover(q: Tensor, v: Tensor, g: Tensor) -> bool:
    """Whether the kernels take these shapes and dtypes."""
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


def when_selected(kernel, fallback):
    """An op implementation that runs `kernel` for calls whose device the `[kernels] kda`
    choice gives the Triton kernels (`kernels_selected`, read per call), else `fallback`."""

    def implementation(*args, **kwargs):
        return (kernel if kernels_selected(args[0].device) else fallback)(*args, **kwargs)

    return implementation


def register_cuda_kernels() -> bool:
    """Register the Triton kernels for CUDA tensors (behind `when_selected`) when CUDA is
    present; return whether they were."""
    global _registered
    if not torch.cuda.is_available():
        return False
    from titan_moe.ops.kda import kept, prepare, triton_prepare

    for name, kernel, fallback in (
        (kda_op.FWD_OP, kda_chunk_fwd_triton, kda_op.kda_chunk_fwd_torch),
        (kda_op.BWD_OP, kda_chunk_bwd_triton, kda_op.kda_chunk_bwd_torch),
        (kept.FWD_OP, kept.kda_chunk_fwd_kept_triton, kept.kda_chunk_fwd_kept_torch),
        (kept.BWD_OP, kept.kda_chunk_bwd_kept_triton, kept.kda_chunk_bwd_kept_torch),
        (prepare.FWD_OP, triton_prepare.kda_prepare_triton, prepare.kda_prepare_torch),
        (prepare.BWD_OP, triton_prepare.kda_prepare_bwd_triton, prepare.kda_prepare_bwd_torch),
    ):
        torch.library.register_kernel(name, "cuda", when_selected(kernel, fallback))
    _registered = True
    return True
