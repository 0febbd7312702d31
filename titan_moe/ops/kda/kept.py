"""KDA ops that keep the forward's intermediates for the backward (the `kda_keep` choice).

    kda_chunk_fwd_kept(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, output_final_state,
                       g_cumsum=False)
        -> (o, final_state, G, Aqk, Ainv, W, h, v_new, k_to_end, decay)
    kda_chunk_bwd_kept(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, do, dht?,
                       G, Aqk, Ainv, W, h, v_new, k_to_end, decay, g_cumsum=False)
        -> (dq, dk, dv, dg, dbeta, dh0)

The same contract as `kda_chunk_fwd` / `kda_chunk_bwd` (see `op`) plus the eight residuals
of the Triton forward (`RESIDUAL_NAMES`; shapes and dtypes in
`residual_specs`: the chunk-local cumsum G, A_qk, (I + A_kk)^-1, W, the chunk
states h, V~, K~ and e^{G_last}; with `g_cumsum`, g is G already and the G residual is an
empty `[0]` tensor: an op may not return its input). The recomputing backward runs the
forward's stages 1-3 again (cumsum, tiles, WY factors, state walk); with these ops it reads
them instead, at the price of holding them from the forward to the backward: per token and
head 4 (dk + 2 C) bytes plus (2 dk + dv + dk dv / C) input-dtype elements
(`residual_bytes_per_token`; dk = dv = 128, C = 64, bf16: 2.25 KiB; 16 heads: 36 KiB per
token and layer). Under full activation checkpointing the layer's forward is rerun right
before its backward, so the residuals live only for that layer's backward.

`chunk_kda` uses these ops when autograd records the call, unless the `kda_keep` choice is
off. The memory planner counts the residuals when it is on (`cuda_shaped_residuals` below
for its eager measurement, `residual_bytes_per_token` for the compiled count). On the CPU
(and for shapes the Triton kernels do not cover) the forward returns empty `[0]` residuals
and the backward recomputes, exactly as `kda_chunk_bwd`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from titan_moe.ops.kda import op as kda_op
from titan_moe.ops.kda.chunk_torch import CHUNK
from titan_moe.ops.nvtx import nvtx_range

FWD_OP = "titan_moe::kda_chunk_fwd_kept"
BWD_OP = "titan_moe::kda_chunk_bwd_kept"
# the residuals, in the ops' order (the layout lives here rather than in `triton_fwd`:
# importing Triton decides once per process whether its kernels are compiled or interpreted)
RESIDUAL_NAMES = ("G", "Aqk", "Ainv", "W", "h", "v_new", "k_to_end", "decay")


def max_chunk_rows(B: int, T: int, N: int, varlen: bool) -> int:
    """An upper bound on the chunk count from shapes alone: B * ceil(T / C) without packing;
    with N packed sequences over T tokens, sum ceil(len_n / C) <= T // C + N."""
    return T // CHUNK + N if varlen else B * (-(-T // CHUNK))


def residual_specs(
    q: Tensor, v: Tensor, N: int, varlen: bool, g_cumsum: bool = False
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each of `RESIDUAL_NAMES` as `triton_fwd.kept_forward` returns them
    for q `[B, T, H, dk]`, v `[B, T, H, dv]` and N sequences (the fake implementation of the
    kept-forward op builds its outputs from this). G is an empty `[0]` fp32 tensor when the
    input g is G already (`g_cumsum`)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    TT, rows = B * T, max_chunk_rows(B, T, N, varlen)
    walk_dtype, f32 = q.dtype, torch.float32
    return [
        ((0,) if g_cumsum else (TT, H, K), f32), ((TT, H, CHUNK), f32), ((TT, H, CHUNK), f32), ((TT, H, K), walk_dtype),
        ((rows, H, K, V), walk_dtype), ((TT, H, V), walk_dtype), ((TT, H, K), walk_dtype), ((rows, H, K), f32),
    ]


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
    shapes (`residual_specs`; zeros here) when `on_cuda_kernels` or under
    `cuda_shaped_residuals`, for inputs the kernels cover; else eight empty tensors."""
    from titan_moe.ops.kda import triton_op

    if not ((on_cuda_kernels or _cuda_shaped) and triton_op.kernels_cover(q, v, g)):
        return [q.new_empty(0, dtype=torch.float32) for _ in RESIDUAL_NAMES]
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    specs = residual_specs(q, v, N, cu_seqlens is not None, g_cumsum)
    return [q.new_zeros(shape, dtype=dtype) for shape, dtype in specs]


def residual_bytes_per_token(H: int, dk: int, dv: int, dtype: torch.dtype, g_cumsum: bool = False) -> float:
    """Bytes per token that one call of the kept forward holds for its backward on the CUDA
    kernels (whole chunks of one sequence), for q / k / v of `dtype`; 0 for shapes the kernels
    do not cover (they keep nothing). `g_cumsum`: g is the chunk-local cumsum G already (the
    eager input-map op's case), so no G of its own is kept. The memory planner's count."""
    from titan_moe.ops.kda import triton_op

    T = 16 * CHUNK
    with torch.device("meta"):
        q = torch.empty(1, T, H, dk, dtype=dtype)
        v = torch.empty(1, T, H, dv, dtype=dtype)
    if not triton_op.kernels_cover(q, v, q.float()):
        return 0.0
    specs = residual_specs(q, v, 1, False, g_cumsum)
    return sum(math.prod(shape) * dt.itemsize for shape, dt in specs) / T


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
    on_kernels = triton_op.kernels_registered() and q.device.type == "cuda" and triton_op.kernels_selected(q.device)
    return (o, final_state, *_residuals(q, v, g, cu_seqlens, on_cuda_kernels=on_kernels, g_cumsum=g_cumsum))


def kda_chunk_bwd_kept_torch(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, do: Tensor, dht: Tensor | None,
    G: Tensor, Aqk: Tensor, Ainv: Tensor, W: Tensor, h: Tensor, v_new: Tensor, k_to_end: Tensor, decay: Tensor,
    g_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch implementation: recompute as `kda_chunk_bwd` (the residuals, empty unless a
    CUDA forward made them, are not read)."""
    return kda_op.kda_chunk_bwd_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum)


kda_chunk_bwd_kept = torch.library.custom_op(BWD_OP, kda_chunk_bwd_kept_torch, mutates_args=())


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

