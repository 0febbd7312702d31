"""Pack tokenized documents into fixed-length rows with per-row document ids.

Documents (each already ``[bos] + tokens + [eos]``) are laid end to end in one stream,
and the stream is cut into rows of ``row_len = seq_len + 1`` tokens; consecutive rows do
not overlap. A row gives

    input_T   = row[:-1]   int64 [T]
    labels_T  = row[1:]    int64 [T]
    doc_ids_T              int32 [T]  numbers the documents of the row's input tokens:
                                      0 at the row's first token, +1 wherever a new
                                      document begins (the contract of
                                      titan_moe.model.packing).

A document longer than what is left of a row continues in the next row, where its tail
starts with doc id 0. A stream that ends with fewer than `row_len` tokens left drops them.

A document may come with a loss mask (`loss_mask[i]`: whether token i is a training target,
as synthetic tasks give, loss on their answers only); a row then carries the mask of its
tokens and `collate_rows` sets the labels of the other tokens to IGNORE_INDEX (-100).

Every row carries the stream position just after it, ``(cursor, offset)``: the cursor
of the document holding the next unconsumed token and that token's offset in it (offset
== len(document) when the row ended exactly at the document's end). Restarting
`pack_rows` from that position, with the same document given from `offset` on, yields
exactly the rows that would have followed: a row boundary never carries state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
from tensordict import TensorDict

IGNORE_INDEX = -100  # torchtitan's cross-entropy skips these labels


@dataclass
class PackedRow:
    """One row of `row_len` tokens, its doc ids, and the stream position after it."""

    tokens: list[int]
    doc_ids: list[int]
    cursor: Any
    offset: int
    loss_mask: list[bool] | None = None  # None: every token is a target


def pack_rows(docs: Iterable[tuple], row_len: int) -> Iterator[PackedRow]:
    """Cut a stream of documents into rows of `row_len` tokens.

    docs: (cursor, tokens, start) or (cursor, tokens, start, loss_mask) per document; packing
        takes tokens[start:] (start is non-zero only for a document resumed mid-way). `cursor`
        is opaque, handed back in `PackedRow.cursor`; loss_mask None means all targets.
    """
    if row_len < 2:
        raise ValueError(f"row_len must be >= 2 (seq_len >= 1), got {row_len}")
    row_tokens: list[int] = []
    row_doc_ids: list[int] = []
    row_mask: list[bool] | None = None  # made only for a row that holds a masked document
    doc_in_row = 0
    for cursor, tokens, offset, *rest in docs:
        mask = rest[0] if rest else None
        while offset < len(tokens):
            # each pass places one piece of this document; a non-empty row means the
            # piece starts a new document inside the row
            doc_in_row = doc_in_row + 1 if row_tokens else 0
            take = min(len(tokens) - offset, row_len - len(row_tokens))
            if mask is not None and row_mask is None:
                row_mask = [True] * len(row_tokens)
            if row_mask is not None:
                row_mask.extend(mask[offset : offset + take] if mask is not None else [True] * take)
            row_tokens.extend(tokens[offset : offset + take])
            row_doc_ids.extend([doc_in_row] * take)
            offset += take
            if len(row_tokens) == row_len:
                yield PackedRow(row_tokens, row_doc_ids, cursor, offset, row_mask)
                row_tokens, row_doc_ids, row_mask = [], [], None


def collate_rows(rows: Sequence[PackedRow]) -> tuple[TensorDict, torch.Tensor]:
    """Stack B rows into a batch.

    Returns (input_dict, labels_BT): input_dict is a TensorDict of batch_size [B] with
    "input" int64 [B, T] and "doc_ids" int32 [B, T]; labels_BT int64 [B, T]; T = row_len - 1.
    """
    tokens_BR = torch.tensor([r.tokens for r in rows], dtype=torch.int64)
    doc_ids_BR = torch.tensor([r.doc_ids for r in rows], dtype=torch.int32)
    input_dict = TensorDict(
        {"input": tokens_BR[:, :-1].contiguous(), "doc_ids": doc_ids_BR[:, :-1].contiguous()},
        batch_size=[len(rows)],
    )
    labels_BT = tokens_BR[:, 1:].clone()  # its own storage: masking must not reach the inputs
    if any(r.loss_mask is not None for r in rows):
        mask_BR = torch.tensor([r.loss_mask if r.loss_mask is not None else [True] * len(r.tokens) for r in rows])
        labels_BT[~mask_BR[:, 1:]] = IGNORE_INDEX
    return input_dict, labels_BT
