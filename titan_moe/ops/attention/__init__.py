"""Causal attention over packed documents, never forming a T x T tensor.

A batch row packs several documents end to end; a query attends to the keys of its own
document up to itself. Every path here describes the documents by `starts_BT` (int32
[B, T]: the position where each token's document begins, see `doc_starts`), so that
"query i may see key j" is ``starts[i] <= j <= i``.

    doc_starts(doc_ids_BT)                         -> starts_BT             (once per forward)
    doc_attention_chunked(q, k, v, starts_BT, ...) -> o                     (any device; exact)
    doc_attention_varlen(q_BTHK, k_BTHK, v_BTHV, cu_seqlens, ...)           (CUDA: FlashAttention-2 varlen)
    doc_attention_reference(q, k, v, doc_ids_BT, ...)                       (tests: per document)

Shapes: q [B, H, T, K], k [B, H, T, K], v [B, H, T, V] (V may differ from K); o [B, H, T, V].
"""

from titan_moe.ops.attention.chunked import doc_attention_chunked
from titan_moe.ops.attention.reference import doc_attention_reference, doc_starts
from titan_moe.ops.attention.varlen import doc_attention_varlen

__all__ = [
    "doc_attention_chunked",
    "doc_attention_reference",
    "doc_attention_varlen",
    "doc_starts",
]
