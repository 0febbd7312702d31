"""KDA's short convolution: depthwise causal conv over the q|k|v channels, then SiLU.

    y[t, c] = silu( sum_{j=0}^{K-1} w[c, j] * x[t - (K-1) + j, c] * same_doc(t, t - (K-1) + j) )

``x [B, T, C]`` are the projected q|k|v channels, ``w [C, K]`` the taps (the last one hits the
current token), left context ``x[t < 0]`` from the decode state (zeros in training), and a tap
that reaches back across a document start (per ``doc_ids [B, T]``) is dropped. Math in fp32,
output in x's dtype (float64 inputs compute in float64).

:func:`short_conv_silu` is the training form: its autograd keeps only ``x`` (in its own dtype,
e.g. bf16) and the taps, and the backward recomputes the fp32 pre-activation. Written as plain
PyTorch ops, eager autograd would keep the fp32 padded input and the fp32 pre-activation, 24
KiB per token at small_1gpu's 3072 channels, against 6 here. :func:`short_conv_silu_reference`
is the plain form (also the decode path, which carries a conv state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """`t.to(dtype)` only when the dtype differs. torch 2.11's Dynamo loses the gradient of an
    autograd.Function whose forward returns `out.to(out.dtype)` (a no-op cast): compiled, the
    inputs got zero gradients (seen with aot_eager on the CPU)."""
    return t if t.dtype == dtype else t.to(dtype)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32, or the input's dtype when wider (float64 checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def _tap_masks(doc_ids_BT: Tensor | None, K: int, T: int) -> list[Tensor | None]:
    """masks[s] [B, T, 1] bool: token t may read token t - s (same document); None: all may."""
    masks: list[Tensor | None] = [None]
    for s in range(1, K):
        if doc_ids_BT is None:
            masks.append(None)
            continue
        B = doc_ids_BT.shape[0]
        # the first s tokens read the zero left context, so their mask value is moot
        head = torch.ones(B, min(s, T), dtype=torch.bool, device=doc_ids_BT.device)
        masks.append(torch.cat([head, doc_ids_BT[:, s:] == doc_ids_BT[:, :-s]], dim=1)[..., None])
    return masks


def _pre_activation(x_ext: Tensor, w_CK: Tensor, masks: list[Tensor | None], T: int) -> Tensor:
    """fp32 [B, T, C] conv output before SiLU, from the left-padded fp32 input [B, K-1+T, C]."""
    K = w_CK.shape[1]
    y_BTC = x_ext[:, K - 1 :] * w_CK[:, K - 1]
    for s in range(1, K):  # tap reaching s tokens back
        tap_BTC = x_ext[:, K - 1 - s : K - 1 - s + T] * w_CK[:, K - 1 - s]
        if masks[s] is not None:
            tap_BTC = tap_BTC * masks[s]
        y_BTC = y_BTC + tap_BTC
    return y_BTC


def short_conv_silu_reference(
    x_BTC: Tensor, w_CK: Tensor, doc_ids_BT: Tensor | None, conv_state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch form. conv_state [B, K-1, C] (None: zeros). Returns (y [B, T, C] in x's
    dtype, the new conv state: the last K-1 inputs, [B, K-1, C])."""
    B, T, C = x_BTC.shape
    K = w_CK.shape[1]
    left_BLC = x_BTC.new_zeros(B, K - 1, C) if conv_state is None else conv_state.to(x_BTC.dtype)
    compute = _compute_dtype(x_BTC)
    x_ext = torch.cat([left_BLC, x_BTC], dim=1).to(compute)
    y_BTC = _pre_activation(x_ext, w_CK.to(compute), _tap_masks(doc_ids_BT, K, T), T)
    new_state = _cast(x_ext[:, x_ext.shape[1] - (K - 1) :], x_BTC.dtype)
    return _cast(F.silu(y_BTC), x_BTC.dtype), new_state


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTC: Tensor, w_CK: Tensor, doc_ids_BT: Tensor | None) -> Tensor:
        ctx.save_for_backward(x_BTC, w_CK, doc_ids_BT)
        y, _ = short_conv_silu_reference(x_BTC, w_CK, doc_ids_BT, None)
        return y

    @staticmethod
    def backward(ctx, grad_BTC: Tensor):
        x_BTC, w_CK, doc_ids_BT = ctx.saved_tensors
        B, T, C = x_BTC.shape
        K = w_CK.shape[1]
        compute = _compute_dtype(x_BTC)
        w = w_CK.to(compute)
        masks = _tap_masks(doc_ids_BT, K, T)
        x_ext = torch.cat([x_BTC.new_zeros(B, K - 1, C), x_BTC], dim=1).to(compute)
        y_BTC = _pre_activation(x_ext, w, masks, T)
        sig = torch.sigmoid(y_BTC)
        dy_BTC = grad_BTC.to(compute) * sig * (1 + y_BTC * (1 - sig))  # silu'(y)
        dx_BTC = torch.zeros_like(dy_BTC)
        dw_columns = []
        for j in range(K):  # tap j reads x_ext[:, j : j + T], i.e. s = K-1-j tokens back
            s = K - 1 - j
            dy_s = dy_BTC if masks[s] is None else dy_BTC * masks[s]
            dw_columns.append((dy_s * x_ext[:, j : j + T]).sum(dim=(0, 1)))
            # input token t - s receives dy_s[t] * w[j]; inputs before the sequence are dropped
            dx_BTC = dx_BTC + F.pad((dy_s * w[:, j])[:, s:], (0, 0, 0, min(s, T)))
        dw_CK = torch.stack(dw_columns, dim=1)
        return _cast(dx_BTC, x_BTC.dtype), _cast(dw_CK, w_CK.dtype), None


def short_conv_silu(x_BTC: Tensor, w_CK: Tensor, doc_ids_BT: Tensor | None = None) -> Tensor:
    """Training form (no conv state): y [B, T, C] in x's dtype; autograd keeps x and w only.

    Outside autograd (inference, or no input needing a gradient) it is the reference."""
    if torch.is_grad_enabled() and (x_BTC.requires_grad or w_CK.requires_grad):
        return _ShortConvSiLU.apply(x_BTC, w_CK, doc_ids_BT)
    return short_conv_silu_reference(x_BTC, w_CK, doc_ids_BT, None)[0]
