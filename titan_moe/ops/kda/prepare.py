"""`titan_moe::kda_prepare` / `titan_moe::kda_prepare_bwd`: the KDA layer's input maps in one op.

    kda_prepare(q, k, z, A_log, dt_bias, lower_bound, cu_seqlens=None, chunk_cumsum=False)
        -> (q_hat, k_hat, g)
    kda_prepare_bwd(q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg, cu_seqlens=None,
                    chunk_cumsum=False)
        -> (dq, dk, dz, dA_log, ddt_bias)

Shapes: q, k, z `[..., H, dk]` (any leading dims, one shape); A_log `[H]`; dt_bias `[H * dk]`.
q_hat, k_hat in q's and k's dtypes; g fp32 (float64 for float64 z). Per token, head h and
channel c, in fp32 (fp64 stays fp64), eps = 1e-6:

    q_hat = q r_q,   r_q = (sum_c q^2 + eps)^(-1/2)          (k likewise)
    g     = lb * sigmoid(a_h (z + b_hc)),   a_h = exp(A_log_h),  b = dt_bias.view(H, dk)

Backward (r recomputed from q, nothing but the inputs saved):

    dq = r_q (dq_hat - q_hat sum_c q_hat dq_hat)             (q_hat the fp32 value)
    dz = dg lb s (1 - s) a_h,  s = sigmoid(a_h (z + b_hc))
    ddt_bias_hc = sum over tokens of dz;   dA_log_h = sum over tokens and c of dz (z + b_hc)

With `chunk_cumsum` (q, k, z then `[B, T, H, dk]`, cu_seqlens as in `chunk_kda`) the op
returns G, the cumulative sum of g inside each 64-token chunk of the KDA chunked form
(`chunk_torch.chunk_local_cumsum`), instead of g, and its backward takes dG (reverse-summed
in the same pass): the KDA core ops then skip their own cumsum kernels (`g_cumsum=True`).

This is what `chunk_kda(..., use_qk_l2norm=True, gate_in_kernel=True)` applies before the
recurrence: the same maths as `chunk_torch.l2norm` and `gate.kda_gate` (which stay the
references), as one opaque op. The PyTorch implementation below serves every device; on
CUDA the Triton kernels of `triton_prepare` replace it when the `[kernels] kda` choice picks
Triton (one pass over q, k, z forward, one backward, where the composite runs about a dozen
elementwise and reduction kernels, with casts and gradient sums around the KDA op).

`chunk_kda` calls it in eager mode; compiled layers take the PyTorch composite, which
Inductor fuses with its neighbours. The op also keeps less for the backward than the eager
composite would (q, k, z in their dtypes, nothing else).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_moe.ops.kda.chunk_torch import chunk_local_cumsum
from titan_moe.ops.kda.gate import check_lower_bound
from titan_moe.ops.nvtx import nvtx_range

FWD_OP = "titan_moe::kda_prepare"
BWD_OP = "titan_moe::kda_prepare_bwd"
EPS = 1e-6


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_prepare_inputs(
    q: Tensor, k: Tensor, z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float,
    cu_seqlens: Tensor | None = None, chunk_cumsum: bool = False,
) -> None:
    """ValueError unless the shapes match the contract above and `lower_bound` is in [-5, 0)."""
    check_lower_bound(lower_bound)
    if q.dim() < 2 or q.shape != k.shape or q.shape != z.shape:
        raise ValueError(
            f"q, k and z must share one [..., H, dk] shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(z.shape)}"
        )
    if chunk_cumsum and q.dim() != 4:
        raise ValueError(f"chunk_cumsum needs [B, T, H, dk] inputs, got {tuple(q.shape)}")
    if cu_seqlens is not None and not chunk_cumsum:
        raise ValueError("cu_seqlens is only used with chunk_cumsum=True")
    if cu_seqlens is not None and (
        q.shape[0] != 1 or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(f"cu_seqlens needs B = 1 and one int32/int64 dimension, got q {tuple(q.shape)}, "
                         f"cu_seqlens {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    H, dk = q.shape[-2], q.shape[-1]
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape ({H},), got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * dk,):
        raise ValueError(f"dt_bias must have shape ({H * dk},), got {tuple(dt_bias.shape)}")


def _normalised(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x r, r) in the compute dtype, r = (sum x^2 + eps)^(-1/2) over the last dim."""
    x_c = x.to(_compute_dtype(x))
    r = torch.rsqrt(x_c.square().sum(-1, keepdim=True) + EPS)
    return x_c * r, r


def _gate_terms(z: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(u = z + b, a [H, 1], s = sigmoid(a u)) in the compute dtype."""
    c = _compute_dtype(z)
    H, dk = z.shape[-2], z.shape[-1]
    u = z.to(c) + dt_bias.to(c).view(H, dk)
    a = A_log.to(c).exp().view(H, 1)
    return u, a, torch.sigmoid(a * u)


def kda_prepare_torch(
    q: Tensor, k: Tensor, z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float,
    cu_seqlens: Tensor | None = None, chunk_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward in PyTorch (contract: module docstring)."""
    with nvtx_range("op.kda_prepare"):
        q_hat, _ = _normalised(q)
        k_hat, _ = _normalised(k)
        _, _, s = _gate_terms(z, A_log, dt_bias)
        g = lower_bound * s
        if chunk_cumsum:
            g = chunk_local_cumsum(g, cu_seqlens)
        return q_hat.to(q.dtype), k_hat.to(k.dtype), g


def kda_prepare_bwd_torch(
    q: Tensor, k: Tensor, z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float,
    dq_hat: Tensor, dk_hat: Tensor, dg: Tensor, cu_seqlens: Tensor | None = None, chunk_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward in PyTorch (formulas: module docstring; with `chunk_cumsum`, dg is dG);
    gradients in the inputs' dtypes."""
    with nvtx_range("op.kda_prepare_bwd"):
        if chunk_cumsum:
            dg = chunk_local_cumsum(dg, cu_seqlens, reverse=True)
        grads = []
        for x, dy in ((q, dq_hat), (k, dk_hat)):
            y, r = _normalised(x)
            dy_c = dy.to(y.dtype)
            grads.append((r * (dy_c - y * (y * dy_c).sum(-1, keepdim=True))).to(x.dtype))
        u, a, s = _gate_terms(z, A_log, dt_bias)
        dz = dg.to(u.dtype) * lower_bound * s * (1 - s) * a
        H, dk = z.shape[-2], z.shape[-1]
        lead = tuple(range(dz.dim() - 2))
        ddt_bias = dz.sum(lead).reshape(H * dk)
        dA_log = (dz * u).sum(lead).sum(-1)
        return grads[0], grads[1], dz.to(z.dtype), dA_log.to(A_log.dtype), ddt_bias.to(dt_bias.dtype)


kda_prepare_op = torch.library.custom_op(FWD_OP, kda_prepare_torch, mutates_args=())
kda_prepare_bwd_op = torch.library.custom_op(BWD_OP, kda_prepare_bwd_torch, mutates_args=())


@kda_prepare_op.register_fake
def _kda_prepare_fake(q, k, z, A_log, dt_bias, lower_bound, cu_seqlens=None, chunk_cumsum=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(z, dtype=_compute_dtype(z))


@kda_prepare_bwd_op.register_fake
def _kda_prepare_bwd_fake(q, k, z, A_log, dt_bias, lower_bound, dq_hat, dk_hat, dg, cu_seqlens=None,
                          chunk_cumsum=False):
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(z),
        torch.empty_like(A_log), torch.empty_like(dt_bias),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, z, A_log, dt_bias, lower_bound, cu_seqlens, chunk_cumsum = inputs
    ctx.save_for_backward(q, k, z, A_log, dt_bias, cu_seqlens)
    ctx.lower_bound = lower_bound
    ctx.chunk_cumsum = chunk_cumsum


def _backward(ctx, dq_hat: Tensor | None, dk_hat: Tensor | None, dg: Tensor | None):
    q, k, z, A_log, dt_bias, cu_seqlens = ctx.saved_tensors
    dq_hat = torch.zeros_like(q) if dq_hat is None else dq_hat
    dk_hat = torch.zeros_like(k) if dk_hat is None else dk_hat
    dg = torch.zeros_like(z, dtype=_compute_dtype(z)) if dg is None else dg
    dq, dk, dz, dA_log, ddt_bias = torch.ops.titan_moe.kda_prepare_bwd(
        q, k, z, A_log, dt_bias, ctx.lower_bound, dq_hat, dk_hat, dg, cu_seqlens, ctx.chunk_cumsum
    )
    return dq, dk, dz, dA_log, ddt_bias, None, None, None


kda_prepare_op.register_autograd(_backward, setup_context=_setup_context)


def kda_prepare(
    q: Tensor, k: Tensor, z: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float,
    cu_seqlens: Tensor | None = None, chunk_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """L2-normalised q and k and the bounded gate g (its chunk-local cumsum G with
    `chunk_cumsum`), differentiable (module docstring)."""
    check_prepare_inputs(q, k, z, A_log, dt_bias, lower_bound, cu_seqlens, chunk_cumsum)
    return torch.ops.titan_moe.kda_prepare(q, k, z, A_log, dt_bias, float(lower_bound), cu_seqlens, chunk_cumsum)
