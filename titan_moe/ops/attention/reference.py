"""Document starts and the per-document reference of packed causal attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def doc_start_mask(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: True where a token starts a document (every row's first token too).

    `doc_ids_BT` is non-decreasing along a row and a new value starts a new document (see
    `titan_moe.model.packing`)."""
    if doc_ids_BT.dim() != 2:
        raise ValueError(f"doc_ids must be [B, T], got shape {tuple(doc_ids_BT.shape)}")
    starts_BT = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    return starts_BT


def doc_starts(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """int32 [B, T]: for each token, the position where its document begins. One cumulative
    max, no host sync: fit for compiled code."""
    is_start_BT = doc_start_mask(doc_ids_BT)
    B, T = doc_ids_BT.shape
    pos_BT = torch.arange(T, device=doc_ids_BT.device, dtype=torch.int32).expand(B, T)
    return torch.where(is_start_BT, pos_BT, 0).cummax(dim=1).values.to(torch.int32)


def doc_attention_reference(
    q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, doc_ids_BT: torch.Tensor, scale: float
) -> torch.Tensor:
    """o [B, H, T, V]: causal SDPA on each document of each row on its own (a Python loop
    over documents; differentiable; the tests' oracle, run in float64)."""
    B, _, T, _ = q_BHTK.shape
    starts_BT = doc_starts(doc_ids_BT)
    rows = []
    for b in range(B):
        begins = sorted(set(starts_BT[b].tolist()))
        pieces = []
        for begin, end in zip(begins, begins[1:] + [T]):
            q, k, v = (t[b : b + 1, :, begin:end] for t in (q_BHTK, k_BHTK, v_BHTV))
            pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)
