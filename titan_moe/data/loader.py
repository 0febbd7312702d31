"""Stateful, data-parallel-aware loader of packed token rows.

One global stream of packed rows (titan_moe.data.packing) is cut into global batches of
G = local_batch_size * dp_world_size rows: global batch i is rows [i*G, (i+1)*G), and
dp rank r takes rows i*G + r*local_batch_size + j for j < local_batch_size. Every rank
tokenizes the whole stream (lazily, one document at a time) and keeps only its rows, so
a run on W ranks sees exactly the rows of a 1-rank run with W times the local batch.

Document order: the split's documents (titan_moe.data.corpus), shuffled per epoch from
(seed, epoch) for "train", in base order for "val". With infinite=True epochs follow one
another and a row may span the boundary; with infinite=False iteration ends at the end
of the split, dropping the leftover tokens and a last incomplete global batch (so all
ranks run the same number of steps), and the next pass starts over.

State: the stream position after the last batch handed out, which is the same on every
rank: (epoch, doc_index in that epoch's order, token offset in that document), plus
counters. After load_state_dict the next batches equal those of an uninterrupted run bit
for bit; the position does not depend on seq_len or the batch size, so a run may also
resume with another seq_len (a context-length stage) and continue the same document
stream. Each rank stores its state under "dp_rank_{r}", as torchtitan's
ParallelAwareDataloader does.

Data mix (the context ladder's stages, `set_stage`): besides the corpus, the stream may draw
documents from a source of long documents (`long_documents`, its own per-epoch order) and
synthetic whole-context tasks (`synthetic`, `titan_moe.data.synthetic`), at target fractions
of the stage's tokens. Before each document the stream picks the source whose share is
furthest behind: a synthetic task while its tokens are below `synthetic_fraction` of the
stage's tokens so far and at least a quarter of the current row is free (the task then
fills the row exactly, so it is never cut), else a long document while below
`long_fraction`, else the corpus. With `synthetic_max_length` > 0 tasks are short documents
instead: a task starts wherever the row has room for the shortest task, its length drawn
log-uniformly between that shortest length and min(synthetic_max_length, the room left) (a
task that would leave less room than the shortest task takes the rest of the row), so many
tasks (many retrieval examples for the same share of tokens) share a row, still uncut.
The position then holds every source's place (epoch and index of its current or next
document, the synthetic tasks' count), which source holds the next token and the stage's
token counts: a resume still continues bit for bit.
Synthetic tasks carry a loss mask: labels are IGNORE_INDEX (-100) except on their answers.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Iterator

import torch
from tensordict import TensorDict
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from titan_moe.data.corpus import CorpusError, DocumentSource, build_source, epoch_order
from titan_moe.data.packing import PackedRow, collate_rows, pack_rows
from titan_moe.data.synthetic import SyntheticTasks, task_rng

logger = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "doc_index", "token_offset", "batches", "rows",
               # the data mix (all 0 without long documents or synthetic tasks)
               "source", "long_epoch", "long_index", "synth_index", "synth_len", "stage",
               "corpus_tokens", "long_tokens", "synth_tokens")
CORPUS, LONG, SYNTH = 0, 1, 2  # values of "source"
_LONG_SEED_SALT = 7919  # the long documents' shuffle differs from the corpus's
# documents tokenized per group: enough text to amortise a batched encode, little
# enough that the first batch comes quickly
_GROUP_DOCS = 64
_GROUP_CHARS = 1 << 18


class PackedTextDataLoader(BaseDataLoader):
    """Iterates `(input_dict, labels_BT)` batches of packed documents for one dp rank.

    input_dict: TensorDict, batch_size [B], "input" int64 [B, T], "doc_ids" int32 [B, T];
    labels_BT: int64 [B, T]; B = local_batch_size, T = seq_len.

    Each `iter(loader)` continues from the loader's current position, which advances as
    batches are handed out; an iterator made before `load_state_dict` keeps its own place.
    A finite loader (infinite=False) rewinds when a pass reaches the end of the split, so
    every full pass yields the split once; `reset()` rewinds at any time.
    """

    def __init__(
        self,
        *,
        documents: DocumentSource,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        long_documents: DocumentSource | None = None,
        synthetic: SyntheticTasks | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank=} {dp_world_size=}")
        if len(documents) == 0:
            raise ValueError(f"{documents!r} holds no documents")
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.shuffle = shuffle
        self.infinite = infinite
        self._rank_key = f"dp_rank_{dp_rank}"
        self.long_documents = long_documents
        self.synthetic = synthetic
        self.long_fraction = 0.0
        self.synthetic_fraction = 0.0
        self.synthetic_max_length = 0
        self.reset()
        self._order_cache: tuple[int, list[int]] | None = None
        self._long_order_cache: tuple[int, list[int]] | None = None

    def set_stage(self, stage: int, *, seq_len: int, local_batch_size: int, long_fraction: float = 0.0,
                  synthetic_fraction: float = 0.0, synthetic_max_length: int = 0) -> None:
        """Switch to a ladder stage: rows of `seq_len`, `local_batch_size` rows per rank and the
        stage's data mix (`synthetic_max_length` 0: whole-row tasks; > 0: short tasks, see the
        module docstring). The stream goes on from the current position; entering another stage
        than the position's restarts the mix's token counts. Make a new iterator afterwards."""
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len and local_batch_size must be >= 1, got {seq_len}, {local_batch_size}")
        if long_fraction > 0 and self.long_documents is None:
            raise ValueError("long_fraction > 0 needs long documents (data.long_documents)")
        if synthetic_fraction > 0 and self.synthetic is None:
            raise ValueError("synthetic_fraction > 0 needs synthetic tasks (data.synthetic_tasks)")
        if synthetic_max_length < 0 or (
                synthetic_max_length > 0 and self.synthetic is not None
                and synthetic_max_length < self.synthetic.min_length):
            shortest = self.synthetic.min_length if self.synthetic is not None else 1
            raise ValueError(f"synthetic_max_length must be 0 (whole-row tasks) or >= {shortest} "
                             f"(the shortest task), got {synthetic_max_length}")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.long_fraction, self.synthetic_fraction = long_fraction, synthetic_fraction
        self.synthetic_max_length = synthetic_max_length
        if self._position["stage"] != stage:
            self._position = {**self._position, "stage": stage, "corpus_tokens": 0, "long_tokens": 0,
                              "synth_tokens": 0}

    # ------------------------------------------------------------------ stream
    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = epoch_order(len(self.documents), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """[bos] + tokens + [eos] per text; batched (multi-threaded) when the tokenizer can."""
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        if encode_batch is not None:
            return encode_batch(texts, add_bos=True, add_eos=True)
        return [self.tokenizer.encode(t, add_bos=True, add_eos=True) for t in texts]

    def _corpus(self, epoch: int, doc_index: int, one_epoch: bool = False):
        """(epoch, index, [bos]+tokens+[eos]) of the corpus from the given place on.

        Documents are read and tokenized a small group at a time (lazily); empty ones are
        skipped, since they would only add a bare [bos, eos]. A finite loader (or `one_epoch`)
        stops at the end of the epoch.
        """
        while True:
            order = self._order(epoch)
            found_text = False
            i = doc_index
            while i < len(order):
                group_index, group_text, chars = [], [], 0
                while i < len(order) and len(group_index) < _GROUP_DOCS and chars < _GROUP_CHARS:
                    text = self.documents[order[i]]
                    if text:
                        group_index.append(i)
                        group_text.append(text)
                        chars += len(text)
                    i += 1
                for j, tokens in zip(group_index, self._encode(group_text)):
                    found_text = True
                    yield epoch, j, tokens
            if not self.infinite or one_epoch:
                return
            if not found_text and doc_index == 0:
                raise ValueError(f"{self.documents!r}: every document is empty")
            epoch, doc_index = epoch + 1, 0

    def _long(self, epoch: int, index: int):
        """(epoch, index, tokens) of the long documents, endlessly, one at a time."""
        assert self.long_documents is not None
        n = len(self.long_documents)
        while True:
            if self._long_order_cache is None or self._long_order_cache[0] != epoch:
                order = epoch_order(n, seed=self.seed + _LONG_SEED_SALT, epoch=epoch, shuffle=self.shuffle)
                self._long_order_cache = (epoch, order)
            order = self._long_order_cache[1]
            found = False
            for i in range(index, n):
                text = self.long_documents[order[i]]
                if text:
                    found = True
                    yield epoch, i, self._encode([text])[0]
            if not found and index == 0:
                raise ValueError(f"{self.long_documents!r}: every document is empty")
            epoch, index = epoch + 1, 0

    def _documents(self, pos: dict[str, int], one_epoch: bool = False):
        """(cursor, tokens, start, loss_mask) from position `pos` on: the mixed document stream.

        cursor: the stream position at this document (every source's place, the counts before
        it), which `pack_rows` hands back with the offset after a row.
        """
        state = {k: pos[k] for k in _STATE_KEYS if k not in ("token_offset", "batches", "rows")}
        row_len = self.seq_len + 1
        offset = pos["token_offset"]
        fill = 0  # tokens in the current row; the rest of the current document starts a row
        corpus = self._corpus(state["epoch"], state["doc_index"], one_epoch)
        long_docs = self._long(state["long_epoch"], state["long_index"]) if self.long_documents is not None else None
        source = state["source"]
        while True:
            if source == SYNTH:
                assert self.synthetic is not None
                task = self.synthetic.task(state["synth_index"], state["synth_len"])
                tokens, mask = task.tokens, task.loss_mask
            elif source == LONG:
                assert long_docs is not None
                state["long_epoch"], state["long_index"], tokens = next(long_docs)
                mask = None
            else:
                got = next(corpus, None)
                if got is None:
                    return
                state["epoch"], state["doc_index"], tokens = got
                mask = None
            state["source"] = source
            yield dict(state), tokens, offset, mask
            # past this document: its source moves on, its tokens count
            count_key = ("corpus_tokens", "long_tokens", "synth_tokens")[source]
            state[count_key] += len(tokens)
            if source == SYNTH:
                state["synth_index"] += 1
            elif source == LONG:
                state["long_index"] += 1
            else:
                state["doc_index"] += 1
            fill = (fill + len(tokens) - offset) % row_len
            offset = 0
            source = self._next_source(state, row_len - fill)
            if source == SYNTH:
                state["synth_len"] = self._synthetic_length(state["synth_index"], row_len - fill)

    def _next_source(self, state: dict[str, int], free: int) -> int:
        """The source of the next document (the rule in the module docstring)."""
        total = state["corpus_tokens"] + state["long_tokens"] + state["synth_tokens"]
        if self.synthetic_fraction > 0 and state["synth_tokens"] < self.synthetic_fraction * total:
            room = self.synthetic.min_length if self.synthetic_max_length else (self.seq_len + 1) // 4
            if free >= max(self.synthetic.min_length, room):
                return SYNTH
        if self.long_fraction > 0 and state["long_tokens"] < self.long_fraction * total:
            return LONG
        return CORPUS

    def _synthetic_length(self, index: int, free: int) -> int:
        """Tokens of synthetic task `index` when `free` tokens of its row are left: all of them
        (whole-row tasks), or log-uniform in [shortest task, min(synthetic_max_length, free)]
        from the task's own generator (the same on a resumed run), all of them again where
        fewer than the shortest task's would be left (so up to synthetic_max_length + the
        shortest task's length - 1)."""
        if not self.synthetic_max_length:
            return free
        low, high = self.synthetic.min_length, min(self.synthetic_max_length, free)
        u = task_rng(self.seed, index, salt="synthetic_length").random()
        length = min(high, max(low, round(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))))
        # A gap too short for any task would start a corpus document, one that may run for many
        # rows: the synthetic share could then never catch up. The row's last task takes it.
        return free if free - length < low else length

    def __iter__(self) -> Iterator[tuple[TensorDict, torch.Tensor]]:
        pos = dict(self._position)
        rows = pack_rows(self._documents(pos), row_len=self.seq_len + 1)
        B = self.local_batch_size
        first = self.dp_rank * B
        while True:
            mine: list[PackedRow] = []
            last = None
            for j in range(B * self.dp_world_size):
                last = next(rows, None)
                if last is None:
                    # finite stream ended inside this global batch: drop it, and rewind
                    # so that the next pass (the next validation round) starts over
                    self.reset()
                    return
                if first <= j < first + B:
                    mine.append(last)
            pos = {
                **last.cursor,
                "token_offset": last.offset,
                "batches": pos["batches"] + 1,
                "rows": pos["rows"] + B * self.dp_world_size,
            }
            # position updated before the batch is handed out: state_dict() taken after
            # next() describes the stream after that batch
            self._position = pos
            yield collate_rows(mine)

    def check_fills_a_batch(self, advice: str = "add text or lower the batch size or seq_len") -> None:
        """Raise CorpusError (ending in `advice`) unless one pass over the split fills one global
        batch: a smaller corpus would be repeated in every batch (train) or give no eval step (val)."""
        need = self.local_batch_size * self.dp_world_size
        rows = pack_rows(self._documents(dict.fromkeys(_STATE_KEYS, 0), one_epoch=True), row_len=self.seq_len + 1)
        have = sum(1 for _ in itertools.islice(rows, need))
        if have < need:
            raise CorpusError(
                f"{self.documents.description}: one pass gives {have} rows of {self.seq_len + 1} tokens, fewer "
                f"than the {need} of one batch; {advice}")

    # ------------------------------------------------------------------- state
    def reset(self) -> None:
        """Go back to the start of the stream (epoch 0, first document)."""
        self._position = dict.fromkeys(_STATE_KEYS, 0)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self._position, seq_len=self.seq_len, seed=self.seed)
        return {self._rank_key: state, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        state = state_dict.get(self._rank_key)
        if state is None:
            # positions are rank-independent, so another rank's state serves as well
            others = [k for k in state_dict if str(k).startswith("dp_rank_")]
            if not others:
                logger.warning("dataloader state has no entry for %s; starting fresh", self._rank_key)
                return
            state = state_dict[others[0]]
        if int(state.get("seed", self.seed)) != self.seed:
            logger.warning("dataloader resumes with seed %d, saved with %s", self.seed, state["seed"])
        # keys of the data mix are absent from checkpoints written before it: 0
        self._position = {k: int(state.get(k, 0)) for k in _STATE_KEYS}


def build_dataloader(
    *,
    tokenizer: BaseTokenizer,
    source: str,
    path: str | None,
    split: str,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int = 0,
    val_fraction: float = 0.02,
    infinite: bool = True,
    hf_text_column: str = "text",
    long_documents: DocumentSource | None = None,
    synthetic: SyntheticTasks | None = None,
) -> PackedTextDataLoader:
    """A packed-row loader over one split ("train" shuffles per epoch, "val" does not).

    source: "builtin" (path must be None), "text" or "hf_disk"; see titan_moe.data.corpus.
    """
    documents = build_source(source, path, split, val_fraction=val_fraction, hf_text_column=hf_text_column)
    return PackedTextDataLoader(
        documents=documents,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        shuffle=split == "train",
        infinite=infinite,
        long_documents=long_documents,
        synthetic=synthetic,
    )
