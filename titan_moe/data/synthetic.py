"""Synthetic whole-context tasks: passkey retrieval and multi-query associative recall (MQAR).

Each task is one document of exactly `length` tokens, ``[bos] ... [eos]``, built from pieces
tokenized separately and laid end to end (so a piece's tokens are the same wherever it
stands), with filler taken from real text (`Filler`: the corpus's own documents):

  passkey  filler | "\\n# The pass key is 71432. Remember it. 71432 is the pass key.\\n" at
           `depth` (0: first, 1: just before the question) | filler |
           "\\n# What is the pass key? The pass key is" -> answer " 71432" | ".\\n"
  mqar     filler with n pair lines "\\nqzvk = 417\\n" at random places | then every key asked
           once, in another random order: "\\nqzvk =" -> answer " 417"
  copy     "\\n# Copy: qzvk mwpa ..." (random four-letter words filling half the row) |
           "\\n# Again:\\n" -> answer: the same words, token for token | "\\n"

Every copy answer token can only be predicted by looking back half a task: the densest signal
for the copying (induction) that passkey and MQAR need (`titan_moe.evaluate` measures it).

`Task.loss_mask[i]` is True where token i is an answer token: training puts its loss only
there (`titan_moe.data.packing`), and an evaluation counts a question as answered when the
model's argmax at every answer token is that token (what greedy decoding would produce).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Sequence

from titan_moe.data.corpus import DocumentSource

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Task:
    kind: str
    tokens: list[int]
    loss_mask: list[bool]
    answers: list[tuple[int, int]]  # [start, end) token spans of the answers
    depth: float | None = None  # passkey: where the key sits (fraction of the filler before it)
    info: dict = field(default_factory=dict)


def task_rng(seed: int, index: int, salt: str = "synthetic") -> random.Random:
    """A generator for task `index`, the same on every machine and Python version."""
    digest = hashlib.blake2b(f"{salt}:{seed}:{index}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


class Filler:
    """Real text as filler tokens: documents of `documents`, tokenized, joined by newlines.

    `take(rng, n)` returns n tokens starting at a random document (drawn from `rng`) and
    continuing through the following ones; tokenized documents are cached (a few hundred).
    """

    def __init__(self, documents: DocumentSource, tokenizer, cache_docs: int = 256):
        if len(documents) == 0:
            raise ValueError(f"{documents!r}: no documents for filler text")
        self.documents = documents
        self.tokenizer = tokenizer
        self._cache: dict[int, list[int]] = {}
        self._cache_docs = cache_docs
        self._newline = tokenizer.encode("\n")

    def _doc(self, i: int) -> list[int]:
        tokens = self._cache.get(i)
        if tokens is None:
            tokens = self.tokenizer.encode(self.documents[i]) + self._newline
            if len(self._cache) >= self._cache_docs:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = tokens
        return tokens

    def take(self, rng: random.Random, n: int) -> list[int]:
        out: list[int] = []
        i = rng.randrange(len(self.documents))
        empty_run = 0
        while len(out) < n:
            tokens = self._doc(i)
            out.extend(tokens[: n - len(out)])
            empty_run = empty_run + 1 if len(tokens) <= len(self._newline) else 0
            if empty_run > len(self.documents):
                raise ValueError(f"{self.documents!r}: the filler documents hold no text")
            i = (i + 1) % len(self.documents)
        return out


def _assemble(tokenizer, pieces: Sequence[tuple[list[int], bool]], kind: str, **info) -> Task:
    tokens = [tokenizer.bos_id]
    mask = [False]
    answers = []
    for piece, is_answer in pieces:
        if is_answer:
            answers.append((len(tokens), len(tokens) + len(piece)))
        tokens.extend(piece)
        mask.extend([is_answer] * len(piece))
    tokens.append(tokenizer.eos_id)
    mask.append(False)
    depth = info.pop("depth", None)
    return Task(kind, tokens, mask, answers, depth, info)


def passkey_task(tokenizer, filler: Filler, length: int, rng: random.Random, depth: float | None = None) -> Task:
    """A passkey document of exactly `length` tokens; `depth` in [0, 1] (None: uniform)."""
    key = str(rng.randrange(10_000, 100_000))
    needle = tokenizer.encode(f"\n# The pass key is {key}. Remember it. {key} is the pass key.\n")
    question = tokenizer.encode("\n# What is the pass key? The pass key is")
    answer = tokenizer.encode(f" {key}")
    end = tokenizer.encode(".\n")
    n_filler = length - 2 - len(needle) - len(question) - len(answer) - len(end)
    if n_filler < 0:
        raise ValueError(f"a passkey task needs at least {length - n_filler} tokens, got length {length}")
    if depth is None:
        depth = rng.random()
    text = filler.take(rng, n_filler)
    cut = round(depth * n_filler)
    return _assemble(tokenizer, [(text[:cut], False), (needle, False), (text[cut:], False), (question, False),
                                 (answer, True), (end, False)], "passkey", depth=depth, key=key)


def mqar_task(tokenizer, filler: Filler, length: int, rng: random.Random, n_pairs: int | None = None) -> Task:
    """An MQAR document of exactly `length` tokens with `n_pairs` keys (None: length // 128,
    between 1 and 32), each asked for once at the end."""
    if n_pairs is None:
        n_pairs = max(1, min(32, length // 128))
    keys: list[str] = []
    while len(keys) < n_pairs:
        k = "".join(rng.choice(_LETTERS) for _ in range(4))
        if k not in keys:
            keys.append(k)
    values = [str(rng.randrange(100, 1000)) for _ in keys]
    asks = [tokenizer.encode(f"\n{k} =") for k in keys]
    answers = [tokenizer.encode(f" {v}") for v in values]
    newline = tokenizer.encode("\n")
    pair_tokens = sum(len(a) + len(b) + len(newline) for a, b in zip(asks, answers))
    fixed = 2 + 2 * pair_tokens - len(newline) * n_pairs + len(newline)
    n_filler = length - fixed
    if n_filler < 0:
        raise ValueError(f"an MQAR task with {n_pairs} pairs needs at least {fixed} tokens, got length {length}")
    text = filler.take(rng, n_filler)
    cuts = sorted(rng.randrange(n_filler + 1) for _ in keys)
    pieces: list[tuple[list[int], bool]] = []
    last = 0
    for cut, ask, ans in zip(cuts, asks, answers):
        pieces += [(text[last:cut], False), (ask + ans + newline, False)]
        last = cut
    pieces.append((text[last:], False))
    for j in rng.sample(range(n_pairs), n_pairs):
        pieces += [(asks[j], False), (answers[j], True)]
    pieces.append((newline, False))
    return _assemble(tokenizer, pieces, "mqar", n_pairs=n_pairs)


def copy_task(tokenizer, filler: Filler, length: int, rng: random.Random) -> Task:
    """A copy document of exactly `length` tokens: random words, then the same tokens again
    (the answer). An odd token left over is filler text at the start."""
    head = tokenizer.encode("\n# Copy:")
    middle = tokenizer.encode("\n# Again:\n")
    end = tokenizer.encode("\n")
    fixed = 2 + len(head) + len(middle) + len(end)
    n_words = (length - fixed) // 2
    if n_words < 1:
        raise ValueError(f"a copy task needs at least {fixed + 2} tokens, got length {length}")
    words: list[int] = []
    while len(words) < n_words:
        words += tokenizer.encode(" " + "".join(rng.choice(_LETTERS) for _ in range(4)))
    words = words[:n_words]
    lead = filler.take(rng, length - fixed - 2 * n_words)
    return _assemble(tokenizer, [(lead, False), (head, False), (words, False), (middle, False), (words, True),
                                 (end, False)], "copy", copied=n_words)


MIN_LENGTH = {"passkey": 64, "mqar": 64, "copy": 64}


class SyntheticTasks:
    """Task `index` of a training stream: the kind cycles through `tasks` (in a shuffled order
    per round, from `seed`), its content drawn from `task_rng(seed, index)`. Training puts the
    loss on a task's answers only (`Task.loss_mask`): with every token a target (the filler,
    the random keys) the debug flavor learned to copy far later (docs/LOG.md, 2026-12-07)."""

    def __init__(self, tokenizer, filler: Filler, tasks: Sequence[str], seed: int):
        unknown = [t for t in tasks if t not in MIN_LENGTH]
        if unknown or not tasks:
            raise ValueError(f"synthetic tasks must be among {sorted(MIN_LENGTH)}, got {list(tasks)}")
        self.tokenizer = tokenizer
        self.filler = filler
        self.tasks = list(tasks)
        self.seed = seed
        self.min_length = max(MIN_LENGTH[t] for t in self.tasks)

    def kind(self, index: int) -> str:
        return self.tasks[index % len(self.tasks)]

    def task(self, index: int, length: int) -> Task:
        rng = task_rng(self.seed, index)
        kind = self.kind(index)
        if kind == "passkey":
            return passkey_task(self.tokenizer, self.filler, length, rng)
        if kind == "copy":
            return copy_task(self.tokenizer, self.filler, length, rng)
        return mqar_task(self.tokenizer, self.filler, length, rng)
