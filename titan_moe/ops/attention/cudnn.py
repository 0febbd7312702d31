"""Packed causal attention as one cuDNN causal attention call per document (CUDA).

    titan_moe::doc_attention_cudnn_fwd(q, k, v, starts, scale) -> (o, lse)
    titan_moe::doc_attention_cudnn_bwd(do, q, k, v, o, lse, starts, scale) -> (dq, dk, dv)

`starts` is a CPU int32 tensor [B, T] (`doc_starts`, copied to the host once per forward;
its shape is fixed, so compiled regions see no new shapes from step to step). Each
document of n tokens is one causal attention call over a window of `window_length(n)`
tokens starting at the document's first token: the document's queries see only keys at or
before themselves, so the tokens after its end in the window change nothing for them. Their
outputs are dropped; in the backward they get zero output gradients and +inf log-sum-exp,
so they add nothing to any gradient. Rounding n up to a few lengths per octave bounds the
number of distinct shapes cuDNN builds an execution plan for (a plan per new length would
be built in every step), at most 25% more work per document. A window that would run past
the row's end is copied into a zero-padded buffer instead.

Every call is the dense causal kernel at full rate on at most 1.25x the work the mask leaves,
and nothing of size T x T exists. Both ops are opaque nodes inside compiled regions; the
loop over documents runs on the host (one launch per document and direction).
"""

from __future__ import annotations

import torch
from torch import Tensor

from titan_moe.ops.nvtx import nvtx_range

aten = torch.ops.aten
MIN_WINDOW = 128


def window_length(n: int) -> int:
    """The length of the call for an n-token document: n rounded up to a multiple of a
    quarter of its power-of-two octave, at least MIN_WINDOW (module docstring)."""
    if n <= MIN_WINDOW:
        return MIN_WINDOW
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def documents(starts_cpu: Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of `starts_cpu` [B, T]."""
    T = starts_cpu.shape[1]
    out = []
    for b in range(starts_cpu.shape[0]):
        begins = torch.unique_consecutive(starts_cpu[b]).tolist()
        out += [(b, s, e) for s, e in zip(begins, begins[1:] + [T])]
    return out


def _window(x: Tensor, b: int, s: int, e: int, length: int, fill: float = 0.0) -> Tensor:
    """x[b:b+1, :, s:s+length] when it fits in the row, else x[b:b+1, :, s:e] padded with `fill`."""
    if s + length <= x.shape[2]:
        return x[b : b + 1, :, s : s + length]
    return _padded(x, b, s, e, length, fill)


def _padded(x: Tensor, b: int, s: int, e: int, length: int, fill: float = 0.0) -> Tensor:
    """x[b:b+1, :, s:e] followed by `fill` up to `length` tokens (a new tensor)."""
    out = x.new_full((1, x.shape[1], length, *x.shape[3:]), fill)
    out[:, :, : e - s] = x[b : b + 1, :, s:e]
    return out


@torch.library.custom_op("titan_moe::doc_attention_cudnn_fwd", mutates_args=())
def doc_attention_cudnn_fwd(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    with nvtx_range("op.doc_attention_cudnn_fwd"):
        B, H, T, _ = q.shape
        o = q.new_empty(B, H, T, v.shape[-1])
        lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
        for b, s, e in documents(starts):
            L = window_length(e - s)
            out = aten._scaled_dot_product_cudnn_attention(
                _window(q, b, s, e, L), _window(k, b, s, e, L), _window(v, b, s, e, L),
                None, True, 0.0, True, False, scale=scale,
            )
            o[b : b + 1, :, s:e] = out[0][:, :, : e - s]
            lse[b : b + 1, :, s:e] = out[1].reshape(1, H, L)[:, :, : e - s]
        return o, lse


@doc_attention_cudnn_fwd.register_fake
def _fwd_fake(q, k, v, starts, scale):
    B, H, T, _ = q.shape
    return q.new_empty(B, H, T, v.shape[-1]), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("titan_moe::doc_attention_cudnn_bwd", mutates_args=())
def doc_attention_cudnn_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, starts: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    with nvtx_range("op.doc_attention_cudnn_bwd"):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for b, s, e in documents(starts):
            n, L = e - s, window_length(e - s)
            grads = aten._scaled_dot_product_cudnn_attention_backward(
                _padded(do, b, s, e, L), _window(q, b, s, e, L), _window(k, b, s, e, L), _window(v, b, s, e, L),
                _padded(o, b, s, e, L), _padded(lse[..., None], b, s, e, L, float("inf")),
                None, None, None, None, None, L, L, 0.0, True, scale=scale,
            )
            for full, part in zip((dq, dk, dv), grads):
                full[b : b + 1, :, s:e] = part[:, :, :n]
        return dq, dk, dv


@doc_attention_cudnn_bwd.register_fake
def _bwd_fake(do, q, k, v, o, lse, starts, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, starts, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, starts)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do: Tensor, _dlse: Tensor):
    q, k, v, o, lse, starts = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_moe.doc_attention_cudnn_bwd(do, q, k, v, o, lse, starts, ctx.scale)
    return dq, dk, dv, None, None


doc_attention_cudnn_fwd.register_autograd(_backward, setup_context=_setup_context)


def doc_attention_cudnn(q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, starts_cpu_BT: Tensor, scale: float) -> Tensor:
    """o [B, H, T, V] of causal attention within documents (`starts_cpu_BT`: `doc_starts` on
    the host), bf16/fp16 on CUDA; differentiable (module docstring)."""
    if starts_cpu_BT.device.type != "cpu":
        raise ValueError("doc_attention_cudnn: the document starts must be a CPU tensor")
    if starts_cpu_BT.shape != (q_BHTK.shape[0], q_BHTK.shape[2]):
        raise ValueError(f"starts must be [B, T] = {(q_BHTK.shape[0], q_BHTK.shape[2])}, got {tuple(starts_cpu_BT.shape)}")
    o_BHTV, _ = torch.ops.titan_moe.doc_attention_cudnn_fwd(q_BHTK, k_BHTK, v_BHTV, starts_cpu_BT, float(scale))
    return o_BHTV
