"""Triton kernels of `titan_moe::kda_prepare` / `kda_prepare_bwd` (maths: `prepare`).

One program per (block of BT tokens, head) reads a `[BT, dk]` tile of q, k and z and writes
q_hat, k_hat and g (forward), or dq, dk, dz and its token-block partial sums of the gate
parameters' gradients (backward; the partials are summed over blocks by PyTorch, so the
result does not depend on the order threads finish). All arithmetic in fp32.

Registered for CUDA tensors by `register_cuda_kernels` with the KDA kernels (same switch,
`TITAN_MOE_KDA_BACKEND`); dtypes they do not cover (float64) take the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.kda import prepare
from titan_moe.ops.nvtx import nvtx_range

BLOCK_TOKENS = 32
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
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    offsets, mask, cols = _tile(i_t, i_h, n_tokens, H, K, BK, BT)
    _l2norm_fwd(q, q_hat, offsets, mask, eps)
    _l2norm_fwd(k, k_hat, offsets, mask, eps)
    _, _, s = _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K)
    tl.store(g + offsets, lower_bound * s, mask=mask)


@triton.jit
def _prepare_bwd_kernel(
    q, k, z, A_log, dt_bias, dq_hat, dk_hat, dg, dq, dk, dz, ddt_part, dA_part, n_tokens, lower_bound, eps,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
):
    """ddt_part `[blocks, H, K]`, dA_part `[blocks, H]` fp32: this block's token sums."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    offsets, mask, cols = _tile(i_t, i_h, n_tokens, H, K, BK, BT)
    _l2norm_bwd(q, dq_hat, dq, offsets, mask, eps)
    _l2norm_bwd(k, dk_hat, dk, offsets, mask, eps)
    u, a, s = _gate_terms(z, A_log, dt_bias, offsets, mask, cols, i_h, K)
    b_dg = tl.load(dg + offsets, mask=mask, other=0.0).to(tl.float32)
    b_dz = b_dg * lower_bound * s * (1.0 - s) * a  # zero where masked (dg loaded as 0)
    tl.store(dz + offsets, b_dz.to(dz.dtype.element_ty), mask=mask)
    tl.store(ddt_part + (i_t * H + i_h) * K + cols, tl.sum(b_dz, axis=0), mask=cols < K)
    tl.store(dA_part + i_t * H + i_h, tl.sum(tl.sum(b_dz * u, axis=1), axis=0))


def _covered(*tensors: Tensor) -> bool:
    return all(t.dtype in _COVERED for t in tensors)


def _flat(x: Tensor) -> Tensor:
    """`[..., H, K]` -> contiguous `[tokens, H, K]`."""
    return x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()


def _launch_args(q: Tensor) -> tuple[int, int, int, tuple[int, int]]:
    H, K = q.shape[-2], q.shape[-1]
    n_tokens = q.numel() // (H * K) if q.numel() else 0
    return n_tokens, H, K, (triton.cdiv(n_tokens, BLOCK_TOKENS), H)


def kda_prepare_triton(q, k, z, A_log, dt_bias, lower_bound):
    """`titan_moe::kda_prepare` on CUDA (or interpreted) tensors; outputs as the op's."""
    if not _covered(q, k, z) or q.numel() == 0:
        return prepare.kda_prepare_torch(q, k, z, A_log, dt_bias, lower_bound)
    n_tokens, H, K, grid = _launch_args(q)
    q_f, k_f, z_f = _flat(q), _flat(k), _flat(z)
    q_hat, k_hat = torch.empty_like(q_f), torch.empty_like(k_f)
    g = torch.empty(q_f.shape, dtype=torch.float32, device=q.device)
    with nvtx_range("op.kda_prepare"):
        _prepare_fwd_kernel[grid](
            q_f, k_f, z_f, A_log.contiguous(), dt_bias.contiguous(), q_hat, k_hat, g, n_tokens,
            float(lower_bound), prepare.EPS, H=H, K=K, BK=triton.next_power_of_2(K), BT=BLOCK_TOKENS, num_warps=4,
        )
    return q_hat.view(q.shape), k_hat.view(k.shape), g.view(z.shape)


def kda_prepare_bwd_triton(q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg):
    """`titan_moe::kda_prepare_bwd` on CUDA (or interpreted) tensors; outputs as the op's."""
    if not _covered(q, k, z, dq_hat, dk_hat, dg) or q.numel() == 0:
        return prepare.kda_prepare_bwd_torch(q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg)
    n_tokens, H, K, grid = _launch_args(q)
    q_f, k_f, z_f = _flat(q), _flat(k), _flat(z)
    dq, dk, dz = torch.empty_like(q_f), torch.empty_like(k_f), torch.empty_like(z_f)
    f32 = dict(dtype=torch.float32, device=q.device)
    ddt_part = torch.empty(grid[0], H, K, **f32)
    dA_part = torch.empty(grid[0], H, **f32)
    with nvtx_range("op.kda_prepare_bwd"):
        _prepare_bwd_kernel[grid](
            q_f, k_f, z_f, A_log.contiguous(), dt_bias.contiguous(), _flat(dq_hat), _flat(dk_hat), _flat(dg),
            dq, dk, dz, ddt_part, dA_part, n_tokens, float(lower_bound), prepare.EPS,
            H=H, K=K, BK=triton.next_power_of_2(K), BT=BLOCK_TOKENS, num_warps=4,
        )
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt_bias = ddt_part.sum(0).reshape(H * K).to(dt_bias.dtype)
    return dq.view(q.shape), dk.view(k.shape), dz.view(z.shape), dA_log, ddt_bias
