"""Triton kernels of `titan_moe::kda_prepare` / `kda_prepare_bwd` (maths: `prepare`).

One program per (block of BT tokens, head) reads a `[BT, dk]` tile of q, k and z and writes
q_hat, k_hat and g (forward), or dq, dk, dz and its token-block partial sums of the gate
parameters' gradients (backward; the partials are summed over blocks by PyTorch, so the
result does not depend on the order threads finish). All arithmetic in fp32.

With `chunk_cumsum` the gate works on the KDA chunks (64 tokens from each sequence start,
the chunk layout of `triton_fwd`): the forward runs the norms in the plain token blocks and
then `_gate_cumsum_fwd_kernel`, one small program per chunk, head and 64 gate channels,
which stores the chunk-local cumsum G of g; the backward runs one program per chunk and head
that does the norms' gradients and reverse-sums the incoming dG in registers before the
gate's chain rule. This replaces the KDA forward's `_chunk_cumsum_kernel` and the
backward's `_bwd_reverse_cumsum_kernel`, each a full pass over a `[tokens, H, dk]` fp32
tensor.

Registered for CUDA tensors by `triton_op.register_cuda_kernels` with the KDA kernels, under
the same choice (`[kernels] kda`); dtypes they do not cover (float64) take the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops import launch_env
from titan_moe.ops.kda import prepare
from titan_moe.ops.kda.chunk_torch import seqlens_bounds
from titan_moe.ops.kda.triton_fwd import CHUNK, _chunk_layout, _chunk_location
from titan_moe.ops.nvtx import nvtx_range
from titan_moe.ops.triton_runtime import cdiv, next_power_of_2

BLOCK_TOKENS = 32
GATE_CHANNELS = 64  # gate channels per program of `_gate_cumsum_fwd_kernel`
CHUNK_WARPS_ENV = "TITAN_MOE_KDA_PREPARE_CHUNK_WARPS"  # warps of the backward kernel in chunk mode, for tuning


def chunk_warps() -> int:
    """num_warps of the backward kernel in chunk mode (a `[64, dk]` tile per program): default
    8; `$TITAN_MOE_KDA_PREPARE_CHUNK_WARPS` (read per call) overrides it for tuning."""
    text = launch_env.read(CHUNK_WARPS_ENV) or "8"
    if text not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"{CHUNK_WARPS_ENV} must be a power of two <= 16, got {text!r}")
    return int(text)


_COVERED = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _tile(i_t, i_h, n_tokens, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr):
    """Offsets `[BT, BK]` into a `[tokens, H, K]` tensor, the tile's mask, the channel ids."""
    rows = i_t * BT + tl.arange(0, BT)
    cols = tl.arange(0, BK)
    mask = (rows < n_tokens)[:, None] & (cols < K)[None, :]
    offsets = (rows.to(tl.int64)[:, None] * H + i_h) * K + cols[None, :]
    return offsets, mask, cols


@triton.jit
def _chunk_tile(cu_seqlens, chunk_indices, i_c, i_h, i_kb, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                BT: tl.constexpr):
    """`_tile` of KDA chunk i_c (its BT = 64 rows, cut at the sequence's end), head i_h and
    column block i_kb of BK channels."""
    bos, T, i_t = _chunk_location(cu_seqlens, chunk_indices, i_c)
    o_t = i_t * BT + tl.arange(0, BT)
    cols = i_kb * BK + tl.arange(0, BK)
    mask = (o_t < T)[:, None] & (cols < K)[None, :]
    offsets = ((bos + o_t) * H + i_h)[:, None] * K + cols[None, :]
    return offsets, mask, cols


@triton.jit
def _block_tile(n_tokens, cu_seqlens, chunk_indices, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                BT: tl.constexpr, CHUNKED: tl.constexpr):
    """`_tile` of this program: token block program_id(0) of BT rows, or (CHUNKED) the KDA
    chunk program_id(0) of the chunk layout (BT = its 64 rows, cut at the sequence's end)."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    if CHUNKED:
        offsets, mask, cols = _chunk_tile(cu_seqlens, chunk_indices, i_b, i_h, 0, H, K, BK, BT)
    else:
        offsets, mask, cols = _tile(i_b, i_h, n_tokens, H, K, BK, BT)
    return offsets, mask, cols, i_b, i_h


@triton.jit
def _l2norm_fwd(x, y, offsets, mask, eps):
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + offsets, (b_x * r[:, None]).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_bwd(x, dy, dx, offsets, mask, eps):
    b_x = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)
    b_y = b_x * r[:, None]
    b_dy = tl.load(dy + offsets, mask=mask, other=0.0).to(tl.float32)
    b_dx = r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    tl.store(dx + offsets, b_dx.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K: tl.constexpr):
    """(u = z + b, a, s = sigmoid(a u)) for the tile; u is 0 + b where masked."""
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b = tl.load(dt_bias + i_h * K + cols, mask=cols < K, other=0.0).to(tl.float32)
    u = tl.load(z + offsets, mask=mask, other=0.0).to(tl.float32) + b[None, :]
    return u, a, tl.sigmoid(a * u)


@triton.jit
def _prepare_fwd_kernel(
    q, k, z, A_log, dt_bias, q_hat, k_hat, g, n_tokens, lower_bound, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, GATE: tl.constexpr,
):
    """One block of BT tokens: the norms and (GATE) the gate g; without GATE (chunk mode,
    `_gate_cumsum_fwd_kernel` does the gate) the norms only."""
    i_h = tl.program_id(1)
    offsets, mask, cols = _tile(tl.program_id(0), i_h, n_tokens, H, K, BK, BT)
    _l2norm_fwd(q, q_hat, offsets, mask, eps)
    _l2norm_fwd(k, k_hat, offsets, mask, eps)
    if GATE:
        _, _, s = _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K)
        tl.store(g + offsets, lower_bound * s, mask=mask)


@triton.jit
def _prepare_bwd_kernel(
    q, k, z, A_log, dt_bias, dq_hat, dk_hat, dg, dq, dk, dz, ddt_part, dA_part, n_tokens, lower_bound, eps,
    cu_seqlens, chunk_indices,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, CHUNKED: tl.constexpr,
):
    """ddt_part `[blocks, H, K]`, dA_part `[blocks, H]` fp32: this block's token sums.
    dg: the gate's gradient, or (CHUNKED) G's, summed here from each row to its chunk's end."""
    offsets, mask, cols, i_t, i_h = _block_tile(n_tokens, cu_seqlens, chunk_indices, H, K, BK, BT, CHUNKED)
    _l2norm_bwd(q, dq_hat, dq, offsets, mask, eps)
    _l2norm_bwd(k, dk_hat, dk, offsets, mask, eps)
    u, a, s = _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K)
    b_dg = tl.load(dg + offsets, mask=mask, other=0.0).to(tl.float32)
    if CHUNKED:
        b_dg = tl.cumsum(b_dg, axis=0, reverse=True)
    b_dz = b_dg * lower_bound * s * (1.0 - s) * a  # zero where masked (dg loaded as 0)
    tl.store(dz + offsets, b_dz.to(dz.dtype.element_ty), mask=mask)
    tl.store(ddt_part + (i_t * H + i_h) * K + cols, tl.sum(b_dz, axis=0), mask=cols < K)
    tl.store(dA_part + i_t * H + i_h, tl.sum(tl.sum(b_dz * u, axis=1), axis=0))


@triton.jit
def _gate_cumsum_fwd_kernel(z, A_log, dt_bias, G, lower_bound, cu_seqlens, chunk_indices,
                            H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr):
    """Chunk mode: G, the chunk-local cumsum of the gate, for BK channels of a chunk.
    Grid: (chunks, H, cdiv(K, BK))."""
    i_c, i_h, i_kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offsets, mask, cols = _chunk_tile(cu_seqlens, chunk_indices, i_c, i_h, i_kb, H, K, BK, BT)
    _, _, s = _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K)
    tl.store(G + offsets, tl.cumsum(tl.where(mask, lower_bound * s, 0.0), axis=0), mask=mask)


def _covered(*tensors: Tensor) -> bool:
    return all(t.dtype in _COVERED for t in tensors)


def _flat(x: Tensor) -> Tensor:
    """`[..., H, K]` -> contiguous `[tokens, H, K]`."""
    return x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()


def _n_tokens(q: Tensor) -> int:
    H, K = q.shape[-2], q.shape[-1]
    return q.numel() // (H * K) if q.numel() else 0


def _chunks_of(q: Tensor, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    """The KDA chunk layout (cu_seqlens, chunk_indices) of `[B, T, ...]` inputs."""
    B, T = q.shape[:2]
    bounds = list(range(0, B * T + 1, T)) if cu_seqlens is None else seqlens_bounds(cu_seqlens, T)
    cu, chunk_indices, _ = _chunk_layout(bounds, q.device)
    return cu, chunk_indices


def kda_prepare_triton(q, k, z, A_log, dt_bias, lower_bound, cu_seqlens=None, chunk_cumsum=False):
    """`titan_moe::kda_prepare` on CUDA (or interpreted) tensors; outputs as the op's."""
    if not _covered(q, k, z) or q.numel() == 0:
        return prepare.kda_prepare_torch(q, k, z, A_log, dt_bias, lower_bound, cu_seqlens, chunk_cumsum)
    H, K, n_tokens = q.shape[-2], q.shape[-1], _n_tokens(q)
    q_f, k_f, z_f = _flat(q), _flat(k), _flat(z)
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    q_hat, k_hat = torch.empty_like(q_f), torch.empty_like(k_f)
    g = torch.empty(q_f.shape, dtype=torch.float32, device=q.device)
    with nvtx_range("op.kda_prepare"):
        _prepare_fwd_kernel[(cdiv(n_tokens, BLOCK_TOKENS), H)](
            q_f, k_f, z_f, A_log, dt_bias, q_hat, k_hat, g, n_tokens, float(lower_bound), prepare.EPS,
            H=H, K=K, BK=next_power_of_2(K), BT=BLOCK_TOKENS, GATE=not chunk_cumsum, num_warps=4,
        )
        if chunk_cumsum:
            cu, chunk_indices = _chunks_of(q, cu_seqlens)
            _gate_cumsum_fwd_kernel[(chunk_indices.shape[0], H, cdiv(K, GATE_CHANNELS))](
                z_f, A_log, dt_bias, g, float(lower_bound), cu, chunk_indices, H=H, K=K, BK=GATE_CHANNELS,
                BT=CHUNK, num_warps=4,
            )
    return q_hat.view(q.shape), k_hat.view(k.shape), g.view(z.shape)


def kda_prepare_bwd_triton(q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg, cu_seqlens=None,
                           chunk_cumsum=False):
    """`titan_moe::kda_prepare_bwd` on CUDA (or interpreted) tensors; outputs as the op's."""
    if not _covered(q, k, z, dq_hat, dk_hat, dg) or q.numel() == 0:
        return prepare.kda_prepare_bwd_torch(
            q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg, cu_seqlens, chunk_cumsum
        )
    H, K, n_tokens = q.shape[-2], q.shape[-1], _n_tokens(q)
    if chunk_cumsum:  # one program per KDA chunk
        cu, chunk_indices = _chunks_of(q, cu_seqlens)
        grid, BT, layout, warps = (chunk_indices.shape[0], H), CHUNK, (cu, chunk_indices), chunk_warps()
    else:  # token blocks
        grid, BT, layout, warps = (cdiv(n_tokens, BLOCK_TOKENS), H), BLOCK_TOKENS, (None, None), 4
    q_f, k_f, z_f, dg_f = _flat(q), _flat(k), _flat(z), _flat(dg)
    dq, dk, dz = torch.empty_like(q_f), torch.empty_like(k_f), torch.empty_like(z_f)
    f32 = dict(dtype=torch.float32, device=q.device)
    ddt_part = torch.empty(grid[0], H, K, **f32)
    dA_part = torch.empty(grid[0], H, **f32)
    with nvtx_range("op.kda_prepare_bwd"):
        _prepare_bwd_kernel[grid](
            q_f, k_f, z_f, A_log.contiguous(), dt_bias.contiguous(), _flat(dq_hat), _flat(dk_hat), dg_f,
            dq, dk, dz, ddt_part, dA_part, n_tokens, float(lower_bound), prepare.EPS, *layout,
            H=H, K=K, BK=next_power_of_2(K), BT=BT, CHUNKED=chunk_cumsum, num_warps=warps,
        )
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt_bias = ddt_part.sum(0).reshape(H * K).to(dt_bias.dtype)
    return dq.view(q.shape), dk.view(k.shape), dz.view(z.shape), dA_log, ddt_bias
