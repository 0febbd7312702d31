"""Token-by-token KDA recurrence: the plain reference for every other implementation.

Per head, with state `S ∈ R^{dk×dv}` (SPEC §1):

    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

Slow (a Python loop over tokens) and obviously correct; differentiable, so tests use it
for reference gradients too.
"""

from __future__ import annotations

import torch

from titan_moe.ops.kda.chunk_torch import check_kda_inputs, prepare_qkg, seqlens_bounds


def _recurrence(
    q_BTHK: torch.Tensor,
    k_BTHK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTHK: torch.Tensor,
    beta_BTH: torch.Tensor,
    S_BHKV: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over T for a batch of independent sequences (already scaled q)."""
    if q_BTHK.shape[1] == 0:
        return torch.zeros_like(v_BTHV), S_BHKV
    outs = []
    for t in range(q_BTHK.shape[1]):
        k_BHK = k_BTHK[:, t]
        S_BHKV = S_BHKV * torch.exp(g_BTHK[:, t])[..., None]
        residual_BHV = v_BTHV[:, t] - torch.einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)
        S_BHKV = S_BHKV + torch.einsum("bhk,bhv->bhkv", beta_BTH[:, t, :, None] * k_BHK, residual_BHV)
        outs.append(torch.einsum("bhkv,bhk->bhv", S_BHKV, q_BTHK[:, t]))
    return torch.stack(outs, dim=1), S_BHKV


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference KDA: same arguments and results as `chunk_kda`.

    q, k `[B, T, H, dk]`, v `[B, T, H, dv]`, g `[B, T, H, dk]` (bounded log decay, or the
    raw gate input when `gate_in_kernel`), beta `[B, T, H]`, initial_state
    `[N, H, dk, dv]`, cu_seqlens int `[N+1]` (B must be 1). Math in fp32, or float64 when
    q is float64. Returns `o [B, T, H, dv]` in v's dtype and the final state
    `[N, H, dk, dv]` (compute dtype) or None.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, g = prepare_qkg(
        q, k, g, use_qk_l2norm=use_qk_l2norm, gate_in_kernel=gate_in_kernel,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
    )
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = dk**-0.5
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    q = q * scale
    if initial_state is None:
        S0 = q.new_zeros(N, H, dk, dv)
    else:
        S0 = initial_state.to(dtype)

    if cu_seqlens is None:
        o, S = _recurrence(q, k, v, g, beta, S0)
    else:
        bounds = seqlens_bounds(cu_seqlens, T)
        pieces, states = [], []
        for n in range(N):
            s, e = bounds[n], bounds[n + 1]
            o_n, S_n = _recurrence(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S0[n : n + 1])
            pieces.append(o_n)
            states.append(S_n)
        o, S = torch.cat(pieces, dim=1), torch.cat(states)
    return o.to(v.dtype), (S if output_final_state else None)
