"""Exact packed causal attention by query chunks, as ``torch.library`` custom ops.

    titan_moe::doc_attention_fwd(q, k, v, starts, scale, chunk, q_offset) -> (o, lse)
    titan_moe::doc_attention_bwd(do, q, k, v, o, lse, starts, scale, chunk, q_offset) -> (dq, dk, dv)

Queries q [B, H, Tq, D] sit at positions ``q_offset + i`` of a sequence whose keys k
[B, Hk, Tk, D] and values v [B, Hk, Tk, V] sit at positions 0..Tk-1 (Tk >= q_offset + Tq);
``starts`` [B, Tq] is the position where each query's document begins. Query i sees key j iff
``starts[i] <= j <= q_offset + i``. Hk is H, or 1 for keys and values shared by every head
(MLA's latent form: the key and value gradients are then summed over the heads).
``q_offset = 0`` and Tk = Tq is the plain packed row; a context-parallel rank passes its
slice of queries and the gathered keys before and within it.

The queries are taken `chunk` at a time; a chunk scores only the keys from the earliest
document start among its queries to its last query, with the softmax in fp32 (float64 for
float64 inputs) and the mask built for that chunk alone. Autograd keeps q, k, v, o and the
log-sum-exp ``lse`` [B, H, Tq]; the backward recomputes each chunk's probabilities from
``lse`` (FlashAttention's algebra). Memory is O(B * H * chunk * Tk) in both directions:
never a T x T tensor, also when one document fills the row. Runs on any device; it is the
CPU path of MLA and the exact fallback elsewhere. Being a custom op, it is one opaque node
inside compiled regions.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch import Tensor

from titan_moe.ops.nvtx import nvtx_range

DEFAULT_CHUNK = 512


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_bounds(starts: Tensor, chunk: int, q_offset: int) -> list[tuple[int, int, int, int]]:
    """(s, e, lo, hi) per query chunk: local queries [s, e) see at most keys [lo, hi).

    Without values (fake or meta `starts`: the memory planner's shapes-only runs) every chunk
    starts at key 0, as in a row that is one document: the largest score block."""
    Tq = starts.shape[1]
    if is_fake(starts) or starts.device.type == "meta":
        lows = [0] * len(range(0, Tq, chunk))
    else:
        lows = starts[:, ::chunk].min(dim=0).values.tolist()  # one host read for all chunks
    return [(s, min(s + chunk, Tq), lo, q_offset + min(s + chunk, Tq)) for s, lo in zip(range(0, Tq, chunk), lows)]


def _chunk_scores(q_c: Tensor, k_c: Tensor, starts: Tensor, bounds: tuple[int, int, int, int], q_offset: int,
                  scale: float) -> Tensor:
    """Masked scores [B, H, e - s, hi - lo] of one query chunk (-inf where not visible)."""
    s, e, lo, hi = bounds
    scores = (q_c @ k_c.transpose(-1, -2)) * scale
    q_pos = torch.arange(q_offset + s, q_offset + e, device=q_c.device)[:, None]
    k_pos = torch.arange(lo, hi, device=q_c.device)[None, :]
    visible_BCL = (k_pos <= q_pos) & (k_pos >= starts[:, s:e, None])
    return scores.masked_fill(~visible_BCL[:, None], float("-inf"))


def _to_key_heads(x: Tensor, heads: int) -> Tensor:
    """Per-head key/value gradient contributions summed over the heads for shared keys."""
    return x.sum(dim=1, keepdim=True) if heads == 1 and x.shape[1] != 1 else x


def chunked_forward(
    q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float, chunk: int, q_offset: int = 0
) -> tuple[Tensor, Tensor]:
    """(o [B, H, Tq, V], lse [B, H, Tq]) by query chunks: the forward op's body."""
    B, H, Tq, _ = q.shape
    acc = _accum_dtype(q.dtype)
    o = q.new_empty(B, H, Tq, v.shape[-1])
    lse = torch.empty(B, H, Tq, device=q.device, dtype=acc)
    for bounds in _chunk_bounds(starts, chunk, q_offset):
        s, e, lo, hi = bounds
        scores = _chunk_scores(q[:, :, s:e].to(acc), k[:, :, lo:hi].to(acc), starts, bounds, q_offset, scale)
        lse_c = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse_c[..., None])
        o[:, :, s:e] = (p @ v[:, :, lo:hi].to(acc)).to(o.dtype)
        lse[:, :, s:e] = lse_c
    return o, lse


def chunked_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, starts: Tensor, scale: float, chunk: int,
    q_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), recomputing each chunk's probabilities from `lse`: the backward op's body."""
    acc = _accum_dtype(q.dtype)
    Hk = k.shape[1]
    delta = (do.to(acc) * o.to(acc)).sum(dim=-1)  # [B, H, Tq]
    dq = torch.zeros(q.shape, device=q.device, dtype=acc)
    dk = torch.zeros(k.shape, device=q.device, dtype=acc)
    dv = torch.zeros(v.shape, device=q.device, dtype=acc)
    for bounds in _chunk_bounds(starts, chunk, q_offset):
        s, e, lo, hi = bounds
        q_c, do_c = q[:, :, s:e].to(acc), do[:, :, s:e].to(acc)
        k_c, v_c = k[:, :, lo:hi].to(acc), v[:, :, lo:hi].to(acc)
        p = torch.exp(_chunk_scores(q_c, k_c, starts, bounds, q_offset, scale) - lse[:, :, s:e, None])
        dv[:, :, lo:hi] += _to_key_heads(p.transpose(-1, -2) @ do_c, Hk)
        ds = p * (do_c @ v_c.transpose(-1, -2) - delta[:, :, s:e, None]) * scale
        dq[:, :, s:e] = ds @ k_c
        dk[:, :, lo:hi] += _to_key_heads(ds.transpose(-1, -2) @ q_c, Hk)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("titan_moe::doc_attention_fwd", mutates_args=())
def doc_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float, chunk: int, q_offset: int
) -> tuple[Tensor, Tensor]:
    with nvtx_range("op.doc_attention_fwd"):
        return chunked_forward(q, k, v, starts, scale, chunk, q_offset)


@doc_attention_fwd.register_fake
def _fwd_fake(q, k, v, starts, scale, chunk, q_offset):
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[-1]), q.new_empty(B, H, T, dtype=_accum_dtype(q.dtype))


@torch.library.custom_op("titan_moe::doc_attention_bwd", mutates_args=())
def doc_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, starts: Tensor, scale: float, chunk: int,
    q_offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    with nvtx_range("op.doc_attention_bwd"):
        return chunked_backward(do, q, k, v, o, lse, starts, scale, chunk, q_offset)


@doc_attention_bwd.register_fake
def _bwd_fake(do, q, k, v, o, lse, starts, scale, chunk, q_offset):
    # contiguous, as the implementation returns them (q, k, v are often transposed views)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, starts, scale, chunk, q_offset = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts)
    ctx.scale, ctx.chunk, ctx.q_offset = scale, chunk, q_offset
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do: Tensor, _dlse: Tensor):
    q, k, v, o, lse, starts = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_moe.doc_attention_bwd(
        do.contiguous(), q, k, v, o, lse, starts, ctx.scale, ctx.chunk, ctx.q_offset
    )
    return dq, dk, dv, None, None, None, None


doc_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def doc_attention_chunked(
    q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, starts_BT: Tensor, scale: float, chunk: int = DEFAULT_CHUNK,
    q_offset: int = 0,
) -> Tensor:
    """o [B, H, Tq, V] of causal attention within documents (`starts_BT` [B, Tq] from
    `doc_starts`, in key positions), queries at key positions `q_offset`.. ; k and v with H or
    1 heads; differentiable; exact up to the accumulation dtype (module docstring)."""
    B, H, Tq, _ = q_BHTK.shape
    if chunk <= 0:
        raise ValueError(f"doc_attention_chunked: chunk must be > 0, got {chunk}")
    if starts_BT.shape != (B, Tq):
        raise ValueError(f"starts must be [B, T] = {(B, Tq)}, got {tuple(starts_BT.shape)}")
    if k_BHTK.shape[1] not in (1, H) or k_BHTK.shape[2] < q_offset + Tq or q_offset < 0:
        raise ValueError(
            f"keys {tuple(k_BHTK.shape)} must have 1 or {H} heads and cover positions up to q_offset + Tq = {q_offset + Tq}"
        )
    o_BHTV, _ = torch.ops.titan_moe.doc_attention_fwd(
        q_BHTK, k_BHTK, v_BHTV, starts_BT, float(scale), int(chunk), int(q_offset)
    )
    return o_BHTV
