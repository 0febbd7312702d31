"""Document boundaries of packed sequences.

A batch row packs several documents end to end. `doc_ids_BT` (int32, [B, T]) numbers
the documents inside each row; it is non-decreasing along a row and a new value starts a
new document. Attention and recurrent state must not cross a boundary.

Recurrent ops take `cu_seqlens` instead: int32 [N+1] cumulative ends of the N documents
in the row-major flattened stream of B*T tokens, row ends counted as boundaries.
"""

from __future__ import annotations

import torch

from titan_moe.ops.attention.reference import doc_start_mask  # re-exported: the model's name for it


def cu_seqlens_from_doc_ids(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """int32 [N+1]: document boundaries of the flattened [B*T] stream, starting at 0.

    The number of documents N depends on the data, so the result has a data-dependent
    length (one host sync); compute it once per batch, outside compiled regions.
    """
    starts_N = doc_start_mask(doc_ids_BT).flatten().nonzero().flatten()
    total = torch.tensor([doc_ids_BT.numel()], device=doc_ids_BT.device, dtype=starts_N.dtype)
    return torch.cat([starts_N, total]).to(torch.int32)


def same_doc_causal_mask(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T]: query i may attend key j iff j <= i and both lie in one document."""
    T = doc_ids_BT.shape[1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=doc_ids_BT.device).tril()
    same_BTT = doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]
    return (same_BTT & causal_TT)[:, None]
