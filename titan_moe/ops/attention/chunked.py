"""Exact packed causal attention by query chunks, as ``torch.library`` custom ops.

    titan_moe::doc_attention_fwd(q, k, v, starts, scale, chunk) -> (o, lse)
    titan_moe::doc_attention_bwd(do, q, k, v, o, lse, starts, scale, chunk) -> (dq, dk, dv)

The rows' queries are taken `chunk` at a time; a chunk [s, e) scores only the keys
[lo, e), lo being the earliest document start among its queries, with the softmax in fp32
(float64 for float64 inputs) and the mask ``starts[i] <= j <= i`` built for that chunk
alone. Autograd keeps q, k, v, o and the log-sum-exp ``lse`` [B, H, T]; the backward
recomputes each chunk's probabilities from ``lse`` (FlashAttention's algebra). Memory is
O(B * H * chunk * T) in both directions: never a T x T tensor, also when one document fills
the row. Runs on any device; it is the CPU path of MLA and the exact fallback elsewhere.
Being a custom op, it is one opaque node inside compiled regions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_moe.ops.nvtx import nvtx_range

DEFAULT_CHUNK = 512


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_bounds(starts: Tensor, chunk: int) -> list[tuple[int, int, int]]:
    """(s, e, lo) per query chunk: queries [s, e) see at most keys [lo, e)."""
    T = starts.shape[1]
    lows = starts[:, ::chunk].min(dim=0).values.tolist()  # one host read for all chunks
    return [(s, min(s + chunk, T), lo) for s, lo in zip(range(0, T, chunk), lows)]


def _chunk_scores(q_c: Tensor, k_c: Tensor, starts: Tensor, s: int, e: int, lo: int, scale: float) -> Tensor:
    """Masked scores [B, H, e - s, e - lo] of one query chunk (-inf where not visible)."""
    scores = (q_c @ k_c.transpose(-1, -2)) * scale
    q_pos = torch.arange(s, e, device=q_c.device)[:, None]
    k_pos = torch.arange(lo, e, device=q_c.device)[None, :]
    visible_BCL = (k_pos <= q_pos) & (k_pos >= starts[:, s:e, None])
    return scores.masked_fill(~visible_BCL[:, None], float("-inf"))


def chunked_forward(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float, chunk: int) -> tuple[Tensor, Tensor]:
    """(o [B, H, T, V], lse [B, H, T]) by query chunks: the forward op's body."""
    B, H, T, _ = q.shape
    acc = _accum_dtype(q.dtype)
    o = q.new_empty(B, H, T, v.shape[-1])
    lse = torch.empty(B, H, T, device=q.device, dtype=acc)
    for s, e, lo in _chunk_bounds(starts, chunk):
        scores = _chunk_scores(q[:, :, s:e].to(acc), k[:, :, lo:e].to(acc), starts, s, e, lo, scale)
        lse_c = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse_c[..., None])
        o[:, :, s:e] = (p @ v[:, :, lo:e].to(acc)).to(o.dtype)
        lse[:, :, s:e] = lse_c
    return o, lse


def chunked_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, starts: Tensor, scale: float, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), recomputing each chunk's probabilities from `lse`: the backward op's body."""
    acc = _accum_dtype(q.dtype)
    delta = (do.to(acc) * o.to(acc)).sum(dim=-1)  # [B, H, T]
    dq = torch.zeros(q.shape, device=q.device, dtype=acc)
    dk = torch.zeros(k.shape, device=q.device, dtype=acc)
    dv = torch.zeros(v.shape, device=q.device, dtype=acc)
    for s, e, lo in _chunk_bounds(starts, chunk):
        q_c, k_c, v_c, do_c = q[:, :, s:e].to(acc), k[:, :, lo:e].to(acc), v[:, :, lo:e].to(acc), do[:, :, s:e].to(acc)
        p = torch.exp(_chunk_scores(q_c, k_c, starts, s, e, lo, scale) - lse[:, :, s:e, None])
        dv[:, :, lo:e] += p.transpose(-1, -2) @ do_c
        ds = p * (do_c @ v_c.transpose(-1, -2) - delta[:, :, s:e, None]) * scale
        dq[:, :, s:e] = ds @ k_c
        dk[:, :, lo:e] += ds.transpose(-1, -2) @ q_c
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("titan_moe::doc_attention_fwd", mutates_args=())
def doc_attention_fwd(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float, chunk: int) -> tuple[Tensor, Tensor]:
    with nvtx_range("op.doc_attention_fwd"):
        return chunked_forward(q, k, v, starts, scale, chunk)


@doc_attention_fwd.register_fake
def _fwd_fake(q, k, v, starts, scale, chunk):
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[-1]), q.new_empty(B, H, T, dtype=_accum_dtype(q.dtype))


@torch.library.custom_op("titan_moe::doc_attention_bwd", mutates_args=())
def doc_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, starts: Tensor, scale: float, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    with nvtx_range("op.doc_attention_bwd"):
        return chunked_backward(do, q, k, v, o, lse, starts, scale, chunk)


@doc_attention_bwd.register_fake
def _bwd_fake(do, q, k, v, o, lse, starts, scale, chunk):
    # contiguous, as the implementation returns them (q, k, v are often transposed views)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, starts, scale, chunk = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts)
    ctx.scale, ctx.chunk = scale, chunk
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do: Tensor, _dlse: Tensor):
    q, k, v, o, lse, starts = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_moe.doc_attention_bwd(do.contiguous(), q, k, v, o, lse, starts, ctx.scale, ctx.chunk)
    return dq, dk, dv, None, None, None


doc_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def doc_attention_chunked(
    q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, starts_BT: Tensor, scale: float, chunk: int = DEFAULT_CHUNK
) -> Tensor:
    """o [B, H, T, V] of causal attention within documents (`starts_BT` from `doc_starts`),
    differentiable; exact up to the accumulation dtype (module docstring)."""
    if chunk <= 0:
        raise ValueError(f"doc_attention_chunked: chunk must be > 0, got {chunk}")
    if starts_BT.shape != (q_BHTK.shape[0], q_BHTK.shape[2]):
        raise ValueError(f"starts must be [B, T] = {(q_BHTK.shape[0], q_BHTK.shape[2])}, got {tuple(starts_BT.shape)}")
    o_BHTV, _ = torch.ops.titan_moe.doc_attention_fwd(q_BHTK, k_BHTK, v_BHTV, starts_BT, float(scale), int(chunk))
    return o_BHTV
