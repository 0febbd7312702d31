"""KDA ops that keep the forward's intermediates for the backward (`$TITAN_MOE_KDA_KEEP`).

    kda_chunk_fwd_kept(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, output_final_state,
                       g_cumsum=False)
        -> (o, final_state, G, Aqk, Ainv, W, h, v_new, k_to_end, decay)
    kda_chunk_bwd_kept(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, do, dht?,
                       G, Aqk, Ainv, W, h, v_new, k_to_end, decay, g_cumsum=False)
        -> (dq, dk, dv, dg, dbeta, dh0)

The same contract as `kda_chunk_fwd` / `kda_chunk_bwd` (see `op`) plus the eight residuals
of the Triton forward (`triton_fwd.RESIDUAL_NAMES`; shapes and dtypes in
`triton_fwd.residual_specs`: the chunk-local cumsum G, A_qk, (I + A_kk)^-1, W, the chunk
states h, V~, and under the lean walk K~ and e^{G_last}; with `g_cumsum`, g is G already and
the G residual is an empty `[0]` tensor: an op may not return its input). The recomputing
backward runs the forward's stages 1-3 again (cumsum, tiles, WY factors, state walk: about 2.7 of 15.3 ms at
T = 32K on the H200, BENCHMARKS.md); with these ops it reads them instead, at the price of
holding them from the forward to the backward: per token and head 4 (dk + 2 C) bytes plus
(2 dk + dv + dk dv / C) walk-dtype elements (dk = dv = 128, C = 64, bf16: 2.25 KiB; 16 heads:
36 KiB per token and layer). Under full activation checkpointing the layer's forward is rerun
right before its backward, so the residuals live only for that layer's backward.

`chunk_kda` uses these ops when autograd records the call, unless `$TITAN_MOE_KDA_KEEP=0`
(the default 1 since the H200 timing: forward+backward 12.75 against 15.46 ms at T = 32K,
BENCHMARKS.md). The memory planner counts the residuals when the switch is on
(`cuda_shaped_residuals` below for its eager measurement,
`plan.activations.kept_residual_bytes_per_token` for the compiled count). On the CPU (and
for shapes the Triton kernels do not cover) the forward returns empty `[0]` residuals and
the backward recomputes, exactly as `kda_chunk_bwd`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from titan_moe.ops.kda import op as kda_op
from titan_moe.ops.nvtx import nvtx_range

FWD_OP = "titan_moe::kda_chunk_fwd_kept"
BWD_OP = "titan_moe::kda_chunk_bwd_kept"
N_RESIDUALS = 8  # len(triton_fwd.RESIDUAL_NAMES); not imported here, since importing Triton
# decides once per process whether its kernels are compiled or interpreted


_cuda_shaped = False  # set by `cuda_shaped_residuals` (the memory planner's measurements)


@contextlib.contextmanager
def cuda_shaped_residuals() -> Iterator[None]:
    """While active, the PyTorch implementation (and the fake) of the kept forward return
    zero residuals of the shapes the CUDA kernels keep, for inputs the kernels cover: a CPU
    or fake-tensor measurement then sees what autograd holds on the GPU. Zeros: for memory
    accounting only (the PyTorch backward ignores the residuals)."""
    global _cuda_shaped
    previous, _cuda_shaped = _cuda_shaped, True
    try:
        yield
    finally:
        _cuda_shaped = previous


def _residuals(
    q: Tensor, v: Tensor, g: Tensor, cu_seqlens: Tensor | None, on_cuda_kernels: bool, g_cumsum: bool
) -> list[Tensor]:
    """The residuals' storage as the implementation that runs makes them: the CUDA kernels'
    shapes (`triton_fwd.residual_specs`; zeros here) when `on_cuda_kernels` or under
    `cuda_shaped_residuals`, for inputs the kernels cover; else eight empty tensors."""
    from titan_moe.ops.kda import triton_op

    if not ((on_cuda_kernels or _cuda_shaped) and triton_op.kernels_cover(q, v, g)):
        return [q.new_empty(0, dtype=torch.float32) for _ in range(N_RESIDUALS)]
    from titan_moe.ops.kda.triton_fwd import residual_specs, selected_walk

    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    specs = residual_specs(q, v, N, cu_seqlens is not None, selected_walk(), g_cumsum)
    return [q.new_zeros(shape, dtype=dtype) for shape, dtype in specs]


def kda_chunk_fwd_kept_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, output_final_state: bool, g_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch implementation (every device without the kernels): `kda_chunk_fwd` plus
    empty residuals (CUDA-shaped zeros under `cuda_shaped_residuals`)."""
    o, final_state = kda_op.kda_chunk_fwd_torch(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum
    )
    return (o, final_state, *_residuals(q, v, g, cu_seqlens, on_cuda_kernels=False, g_cumsum=g_cumsum))


kda_chunk_fwd_kept = torch.library.custom_op(FWD_OP, kda_chunk_fwd_kept_torch, mutates_args=())


@kda_chunk_fwd_kept.register_fake
def _kda_chunk_fwd_kept_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum=False):
    from titan_moe.ops.kda import triton_op

    o, final_state = kda_op._kda_chunk_fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state)
    on_kernels = q.device.type == "cuda" and triton_op.kernels_registered()
    return (o, final_state, *_residuals(q, v, g, cu_seqlens, on_cuda_kernels=on_kernels, g_cumsum=g_cumsum))


@torch.library.custom_op(BWD_OP, mutates_args=())
def kda_chunk_bwd_kept(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, do: Tensor, dht: Tensor | None,
    G: Tensor, Aqk: Tensor, Ainv: Tensor, W: Tensor, h: Tensor, v_new: Tensor, k_to_end: Tensor, decay: Tensor,
    g_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch implementation: the residuals are empty here; recompute as `kda_chunk_bwd`."""
    return kda_op.kda_chunk_bwd_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum)


@kda_chunk_bwd_kept.register_fake
def _kda_chunk_bwd_kept_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, *residuals_and_g_cumsum):
    return kda_op._kda_chunk_bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht)


def kda_chunk_fwd_kept_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum=False):
    """CUDA implementation: `triton_fwd.kept_forward` in the op's contract."""
    from titan_moe.ops.kda import triton_op
    from titan_moe.ops.kda.triton_fwd import kept_forward

    if not triton_op.kernels_cover(q, v, g):
        return kda_chunk_fwd_kept_torch(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum
        )
    with nvtx_range("op.kda_chunk_fwd"):  # one range name for both forwards
        o, final_state, residuals = kept_forward(
            q, k, v, g, beta, scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            output_final_state=output_final_state, g_cumsum=g_cumsum,
        )
    if final_state is None:
        final_state = q.new_empty(0, dtype=torch.float32)
    return (o, final_state, *residuals)


def kda_chunk_bwd_kept_triton(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, G, Aqk, Ainv, W, h, v_new, k_to_end, decay,
    g_cumsum=False,
):
    """CUDA implementation: `chunk_kda_bwd_triton(kept=residuals)`; empty residuals (a
    forward that did not make them) recompute."""
    from titan_moe.ops.kda import triton_op

    residuals = [G, Aqk, Ainv, W, h, v_new, k_to_end, decay]
    kept = residuals if Aqk.numel() else None  # G is empty under g_cumsum, A_qk never when kept
    return triton_op.kda_chunk_bwd_triton(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, kept=kept, g_cumsum=g_cumsum
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum = inputs
    residuals = output[2:]
    ctx.mark_non_differentiable(*residuals)
    # no zero-filled gradients for the residuals (h alone is [chunks, H, dk, dv]): the
    # backward takes None for every gradient it is not given
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *residuals)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.g_cumsum = g_cumsum


def _backward(ctx, do: Tensor | None, dht: Tensor | None, *unused_residual_grads):
    q, k, v, g, beta, initial_state, cu_seqlens, *residuals = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.titan_moe.kda_chunk_bwd_kept(
        q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, dht, *residuals, ctx.g_cumsum
    )
    return dq, dk, dv, dg, dbeta, None, (None if initial_state is None else dh0), None, None, None


kda_chunk_fwd_kept.register_autograd(_backward, setup_context=_setup_context)


def register_cuda_kernels() -> None:
    torch.library.register_kernel(FWD_OP, "cuda", kda_chunk_fwd_kept_triton)
    torch.library.register_kernel(BWD_OP, "cuda", kda_chunk_bwd_kept_triton)
