"""Chunked bounded-decay delta attention in plain PyTorch (SPEC §1, chunked form).

This is the CPU implementation behind `titan_moe::kda_chunk_fwd` and the oracle that
future Triton kernels are checked against, so it follows the kernel's plan step by step
rather than being clever:

1. Gather the token stream into chunks of `chunk_size` (64) tokens. A chunk never spans
   two sequences; a sequence's last chunk is padded with `k = q = v = 0, beta = 0, g = 0`
   tokens, which leave the state untouched (no decay, no write).
2. Per chunk, in parallel: `G = cumsum(g)`, the intra-chunk matrices
   `A_kk[i,j] = beta_i Σ_c k_ic k_jc e^{G_ic - G_jc}` (j < i) and
   `A_qk[i,j] = Σ_c q_ic k_jc e^{G_ic - G_jc}` (j <= i), and the WY factors
   `W = (I + A_kk)^{-1} Diag(beta) (e^G ⊙ K)`, `U = (I + A_kk)^{-1} Diag(beta) V`.
3. Sequentially over chunks (all sequences at once):
   `V~ = U - W S`, `O = (Q ⊙ e^G) S + A_qk V~`,
   `S <- Diag(e^{G_last}) S + (e^{G_last - G} ⊙ K)^T V~`.

Why the pairwise decays never overflow: `G` falls by at most `|g_min| <= 5` per token,
so over a 64-token chunk `e^{±G}` alone would reach e^320. The chunk is cut into
16-token tiles, and tile `J` gets an anchor `c_J` = `G` at its middle row. A pair
(i, j) with j in tile J is evaluated as `(x_i e^{G_i - c_J}) · (k_j e^{c_J - G_j})`:
inside the tile both exponents are at most 8 * 5 = 40 in magnitude, and for rows i in
later tiles `G_i - c_J <= 0`. Every tile, the diagonal ones included, is one dense
product; exponents for pairs that the causal mask discards are zeroed before `exp`.

Everything is computed in fp32 (float64 when `q` is float64, which makes this a tight
algebraic check in tests); `o` is returned in `v`'s dtype.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from titan_moe.ops.kda.gate import check_lower_bound, kda_gate

CHUNK = 64  # tokens per chunk of the chunked form (this path's default, the Triton kernels' only size)
TILE = 16  # sub-chunk size: the span over which pairwise decays are exponentiated directly
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------
# Shared input handling (used by chunk_kda, naive_recurrent_kda and this module)
# ----------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(||x||^2 + eps)` over the last dim, computed in fp32 (fp64 stays fp64)."""
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_c = x.to(compute_dtype)
    return (x_c * torch.rsqrt(x_c.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Validate shapes, dtypes and devices of the KDA operator inputs (SPEC §1 contract).

    Returns the number of sequences N (`B`, or `len(cu_seqlens) - 1` for varlen).
    Raises ValueError on any mismatch. Checks only metadata, so it is safe to call under
    torch.compile; the values of `cu_seqlens` are checked where they are read.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, dk], got shape {tuple(q.shape)}")
    B, T, H, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, dv] = [{B}, {T}, {H}, dv], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if B == 0 or T == 0 or H == 0 or dk == 0 or v.shape[-1] == 0:
        raise ValueError(f"empty inputs are not supported: q {tuple(q.shape)}, v {tuple(v.shape)}")

    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"cu_seqlens (varlen) needs batch size 1 (flatten the batch), got B={B}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        expected = (N, H, dk, v.shape[-1])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state must be [N, H, dk, dv] = {expected}, got {tuple(initial_state.shape)}")
        if initial_state.dtype not in _STATE_DTYPES:
            raise ValueError(f"initial_state must be float32 (float64 allowed for tests), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
    return N


def prepare_qkg(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    *,
    use_qk_l2norm: bool,
    gate_in_kernel: bool,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the optional per-head L2 norm of q/k and the optional bounded gate.

    Differentiable PyTorch; with `gate_in_kernel=True`, `g` is the raw gate input and the
    result is `kda_gate(g, A_log, dt_bias, lower_bound)` in fp32 (float64 for float64 g).
    """
    check_lower_bound(lower_bound)
    if gate_in_kernel:
        if A_log is None or dt_bias is None:
            raise ValueError("gate_in_kernel=True needs both A_log [H] and dt_bias [H*dk]")
        out_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
        g = kda_gate(g, A_log, dt_bias, lower_bound, output_dtype=out_dtype)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log/dt_bias are only used with gate_in_kernel=True")
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, g


# ----------------------------------------------------------------------------------------
# Chunk plan: which tokens go into which chunk, and in what order chunks are scanned
# ----------------------------------------------------------------------------------------
@dataclass
class _ChunkPlan:
    """Token layout of the chunked computation.

    Chunks are stored step-major: all sequences' first chunks, then all second chunks, ...
    Sequences are sorted by decreasing chunk count, so the sequences still running at
    step s are a prefix of that order and their chunks a contiguous slice.
    """

    gather_idx: torch.Tensor  # long [NC * C]: source token of each chunk slot (pad -> B*T)
    scatter_idx: torch.Tensor  # long [B*T]: chunk slot of each source token
    order: torch.Tensor  # long [N]: sequence index at each sorted position
    inverse_order: torch.Tensor  # long [N]: sorted position of each sequence
    active: list[int]  # sequences still running at each step (non-increasing)


# id(cu_seqlens) -> (a weak reference to it, its version counter, its bounds): see
# `seqlens_bounds` (not a WeakKeyDictionary: that compares tensor keys with ==)
_bounds_read: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def _forget_bounds(key: int) -> None:
    _bounds_read.pop(key, None)


def seqlens_bounds(cu_seqlens: torch.Tensor, n_tokens: int) -> list[int]:
    """cu_seqlens as a Python list, checked: non-decreasing from 0 to n_tokens.

    Reading a CUDA tensor on the host waits for the GPU to drain its queue, so the list is
    remembered per tensor object (until the tensor is freed or changed in place, which bumps
    its version counter): one packed batch's cu_seqlens, passed to every KDA layer's input
    maps and core ops in the forward and again in the backward, is read once."""
    try:
        version = cu_seqlens._version
    except RuntimeError:  # inference tensors keep no version counter: read every time
        version = None
    if version is not None:
        key = id(cu_seqlens)
        seen = _bounds_read.get(key)
        if seen is not None and seen[0]() is cu_seqlens and seen[1] == version:
            bounds = seen[2]
        else:
            bounds = [int(b) for b in cu_seqlens.tolist()]
            ref = weakref.ref(cu_seqlens, lambda _ref, key=key: _forget_bounds(key))
            _bounds_read[key] = (ref, version, bounds)
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != n_tokens or any(a > b for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={n_tokens}, got {bounds}")
    return list(bounds)


def _make_plan(bounds: list[int], n_tokens: int, C: int, device: torch.device) -> _ChunkPlan:
    N = len(bounds) - 1
    n_chunks = [-(-(bounds[n + 1] - bounds[n]) // C) for n in range(N)]
    order = sorted(range(N), key=lambda n: -n_chunks[n])
    steps = n_chunks[order[0]]
    active = []
    running = N
    for s in range(steps):
        while n_chunks[order[running - 1]] <= s:
            running -= 1
        active.append(running)
    chunk_seq = [order[r] for s in range(steps) for r in range(active[s])]
    chunk_step = [s for s in range(steps) for _ in range(active[s])]

    bounds_t = torch.tensor(bounds, dtype=torch.long)
    seq_t = torch.tensor(chunk_seq, dtype=torch.long)
    start_t = bounds_t[seq_t] + torch.tensor(chunk_step, dtype=torch.long) * C
    pos_NcC = start_t[:, None] + torch.arange(C)
    valid_NcC = pos_NcC < bounds_t[seq_t + 1][:, None]
    gather_idx = torch.where(valid_NcC, pos_NcC, n_tokens).flatten()
    scatter_idx = torch.empty(n_tokens, dtype=torch.long)
    scatter_idx[pos_NcC[valid_NcC]] = torch.arange(pos_NcC.numel())[valid_NcC.flatten()]
    order_t = torch.tensor(order, dtype=torch.long)
    return _ChunkPlan(
        gather_idx=gather_idx.to(device),
        scatter_idx=scatter_idx.to(device),
        order=order_t.to(device),
        inverse_order=torch.argsort(order_t).to(device),
        active=active,
    )


def _to_chunks(x: torch.Tensor, plan: _ChunkPlan, C: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, *d] -> [NC, H, C, *d] in `dtype`, zero at padding slots."""
    B, T, H = x.shape[:3]
    x_flat = x.reshape(B * T, H, *x.shape[3:]).to(dtype)
    x_pad = torch.cat([x_flat, x_flat.new_zeros(1, *x_flat.shape[1:])])
    x_chunks = x_pad.index_select(0, plan.gather_idx).view(-1, C, *x_flat.shape[1:])
    return x_chunks.transpose(1, 2)


def _fill_padding_with_last(G_c: torch.Tensor, plan: _ChunkPlan, n_tokens: int, C: int) -> torch.Tensor:
    """`[NC, H, C, dk]` chunk-local cumsums with the padding slots of each sequence's last
    chunk set to the last real token's value (what cumsum over g = 0 padding gives)."""
    real_NC = (plan.gather_idx.view(-1, C) != n_tokens).sum(-1)
    slot_NC = torch.minimum(torch.arange(C, device=G_c.device)[None, :], real_NC[:, None] - 1)
    return G_c.gather(2, slot_NC[:, None, :, None].expand_as(G_c))


def chunk_local_cumsum(
    x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, reverse: bool = False, chunk_size: int = CHUNK
) -> torch.Tensor:
    """Cumulative sum of `x [B, T, H, *d]` over the tokens of each chunk of `chunk_size`
    (chunks start at every sequence start, as in `chunk_kda_torch`); `reverse` sums from each
    token to its chunk's end (the cumsum's gradient). Same shape and dtype as x; float32
    (float64) arithmetic."""
    B, T, H = x.shape[:3]
    bounds = list(range(0, B * T + 1, T)) if cu_seqlens is None else seqlens_bounds(cu_seqlens, T)
    plan = _make_plan(bounds, B * T, chunk_size, x.device)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_c = _to_chunks(x, plan, chunk_size, dtype)
    sums_c = x_c.flip(2).cumsum(2).flip(2) if reverse else x_c.cumsum(2)
    flat = sums_c.transpose(1, 2).reshape(-1, H, *x.shape[3:]).index_select(0, plan.scatter_idx)
    return flat.view(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------------------
# Intra-chunk pieces
# ----------------------------------------------------------------------------------------
def _pairwise_decayed(
    x_rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor, inclusive: bool
) -> torch.Tensor:
    """`A[i,j] = Σ_c x_ic k_jc e^{G_ic - G_jc}` for j < i (j <= i if inclusive), else 0.

    Shapes: x_rows, k, G `[..., C, dk]` -> A `[..., C, C]`. Uses the tile anchors
    described in the module docstring, so no exponent exceeds about 40 * 2.
    """
    C = G.shape[-2]
    n_tiles = C // TILE
    anchor_idx = torch.arange(n_tiles, device=G.device) * TILE + TILE // 2
    c_Jk = G[..., anchor_idx, :]  # [..., nT, dk]
    # column side: k_j e^{c_J - G_j} with J the tile of j
    k_col = k * torch.exp(c_Jk.repeat_interleave(TILE, dim=-2) - G)
    # row side: x_i e^{G_i - c_J} for every tile J at or before i's tile
    row_tile = torch.arange(C, device=G.device) // TILE
    keep_CJ = row_tile[:, None] >= torch.arange(n_tiles, device=G.device)[None, :]
    expo = G[..., :, None, :] - c_Jk[..., None, :, :]  # [..., C, nT, dk]
    expo = torch.where(keep_CJ[:, :, None], expo, 0.0)  # discarded pairs: no overflow, no NaN grads
    x_row = x_rows[..., :, None, :] * torch.exp(expo) * keep_CJ[:, :, None]
    k_col_tiles = k_col.unflatten(-2, (n_tiles, TILE))  # [..., nT, TILE, dk]
    A = torch.einsum("...itc,...tjc->...itj", x_row, k_col_tiles).flatten(-2)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(0 if inclusive else -1)
    return A.masked_fill(~causal_CC, 0.0)


# ----------------------------------------------------------------------------------------
# The chunked operator
# ----------------------------------------------------------------------------------------
def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    g_cumsum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward (differentiable PyTorch).

    Args:
        q, k: `[B, T, H, dk]`; used as given (no L2 norm here).
        v: `[B, T, H, dv]`.
        g: `[B, T, H, dk]` log-space decay, already bounded: `g_min <= g <= 0`, g_min >= -5.
            With `g_cumsum`, g holds instead its chunk-local cumulative sum G
            (`chunk_local_cumsum(g, cu_seqlens, chunk_size=chunk_size)`), as the input-map op
            can emit it; the gradient is then dG.
        beta: `[B, T, H]`.
        scale: query scale, default `dk ** -0.5`.
        initial_state: `[N, H, dk, dv]` fp32 or None (zeros).
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: int `[N+1]` sequence boundaries over the T axis (B must be 1), or None
            (each batch row is one sequence, N = B).
        chunk_size: multiple of 16; 64 is the kernel's size.

    Returns:
        `o [B, T, H, dv]` in v's dtype, and `final_state [N, H, dk, dv]` (fp32; float64
        when q is float64) or None.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size <= 0 or chunk_size % TILE != 0:
        raise ValueError(f"chunk_size must be a positive multiple of {TILE}, got {chunk_size}")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = chunk_size
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = dk**-0.5

    if cu_seqlens is None:
        bounds = list(range(0, B * T + 1, T))
    else:
        bounds = seqlens_bounds(cu_seqlens, T)
    plan = _make_plan(bounds, B * T, C, q.device)

    q_c = _to_chunks(q, plan, C, dtype) * scale  # [NC, H, C, dk]
    k_c = _to_chunks(k, plan, C, dtype)
    v_c = _to_chunks(v, plan, C, dtype)  # [NC, H, C, dv]
    G_c = _to_chunks(g, plan, C, dtype)
    G_c = _fill_padding_with_last(G_c, plan, B * T, C) if g_cumsum else G_c.cumsum(-2)
    beta_c = _to_chunks(beta, plan, C, dtype)  # [NC, H, C]

    # intra-chunk: WY factors and the causal q.k matrix
    A_kk = _pairwise_decayed(k_c, k_c, G_c, inclusive=False) * beta_c[..., :, None]
    A_qk = _pairwise_decayed(q_c, k_c, G_c, inclusive=True)
    eye_CC = torch.eye(C, dtype=dtype, device=q.device)
    rhs = torch.cat([v_c, k_c * torch.exp(G_c)], dim=-1) * beta_c[..., None]
    UW = torch.linalg.solve_triangular(eye_CC + A_kk, rhs, upper=False, unitriangular=True)
    U_c, W_c = UW.split([dv, dk], dim=-1)

    G_last = G_c[..., -1:, :]  # padding slots have g = 0, so this is the last real token's G
    q_decay = q_c * torch.exp(G_c)
    k_to_end = (k_c * torch.exp(G_last - G_c)).transpose(-1, -2)  # [NC, H, dk, C]
    state_decay = torch.exp(G_last).transpose(-1, -2)  # [NC, H, dk, 1]

    # inter-chunk scan, all sequences at once (sorted so running ones form a prefix)
    if initial_state is None:
        S = q.new_zeros(N, H, dk, dv, dtype=dtype)
    else:
        S = initial_state.to(dtype).index_select(0, plan.order)
    outs = []
    offset = 0
    for m in plan.active:
        sl = slice(offset, offset + m)
        offset += m
        S_m = S[:m]
        v_new = U_c[sl] - W_c[sl] @ S_m
        outs.append(q_decay[sl] @ S_m + A_qk[sl] @ v_new)
        S_m = state_decay[sl] * S_m + k_to_end[sl] @ v_new
        S = S_m if m == N else torch.cat([S_m, S[m:]])
    o_c = torch.cat(outs)  # [NC, H, C, dv]

    o_flat = o_c.transpose(1, 2).reshape(-1, H, dv).index_select(0, plan.scatter_idx)
    o = o_flat.view(B, T, H, dv).to(v.dtype)
    final_state = S.index_select(0, plan.inverse_order) if output_final_state else None
    return o, final_state
