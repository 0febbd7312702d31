"""Byte-level BPE tokenizer (HF `tokenizers`) behind torchtitan's `BaseTokenizer`.

The vocabulary holds two special tokens, ``<|bos|>`` and ``<|eos|>`` (ids `bos_id`,
`eos_id`), and byte-level BPE pieces; every UTF-8 string encodes, and
``decode(encode(text)) == text`` exactly (no normaliser, no prefix space). Special-token
strings that occur inside a text are encoded as ordinary text, so user data can never
inject a document boundary.

`load_tokenizer()` returns the tokenizer shipped with the package
(``titan_moe/data/assets/tokenizer.json``, trained by ``scripts/train_tokenizer.py`` on
the builtin corpus); `load_tokenizer(path)` loads a ``tokenizer.json`` file or a folder
holding one.
"""

from __future__ import annotations

import os
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtitan.components.tokenizer import BaseTokenizer

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
BUILTIN_TOKENIZER_PATH = os.path.join(os.path.dirname(__file__), "assets", "tokenizer.json")


class BPETokenizer(BaseTokenizer):
    """torchtitan tokenizer over a byte-level BPE `tokenizers.Tokenizer`.

    encode(text, add_bos=False, add_eos=False) -> list[int]
    encode_batch(texts, add_bos=False, add_eos=False) -> list[list[int]]
    decode(ids, skip_special_tokens=False) -> str
    """

    def __init__(self, tokenizer: Tokenizer):
        super().__init__()
        bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
        if bos_id is None or eos_id is None:
            raise ValueError(f"tokenizer lacks the special tokens {SPECIAL_TOKENS}")
        # Text that happens to spell "<|eos|>" must stay text, not become a boundary.
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = BOS_TOKEN, EOS_TOKEN
        self.bos_id: int = bos_id
        self.eos_id: int = eos_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False, add_eos: bool = False) -> list[list[int]]:
        """`encode` of each text, computed in parallel by the Rust backend."""
        head, tail = [self.bos_id] if add_bos else [], [self.eos_id] if add_eos else []
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [head + e.ids + tail for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def vocab_size(self) -> int:
        return self.get_vocab_size()

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def save(self, path: str) -> None:
        """Write the tokenizer as a ``tokenizer.json`` file at `path`."""
        self.tokenizer.save(path, pretty=False)


def new_byte_level_bpe() -> Tokenizer:
    """An untrained byte-level BPE `Tokenizer` with this module's pre-tokeniser and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts, vocab_size: int = 4096, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE on an iterable of strings; the specials take ids 0 and 1.

    `vocab_size` counts the specials and the 256 byte symbols.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    tok = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tok)


def load_tokenizer(path: str | None = None) -> BPETokenizer:
    """Load a byte-level BPE tokenizer.

    path: None for the tokenizer shipped with the package; else a ``tokenizer.json``
    file, or a folder that holds one. Raises FileNotFoundError naming the path, or ValueError
    naming it for a file that does not parse or lacks the special tokens.
    """
    file = BUILTIN_TOKENIZER_PATH if path is None else os.path.expanduser(path)
    if os.path.isdir(file):
        file = os.path.join(file, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"tokenizer file {file!r} not found (from path {path!r})")
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # the Rust parser raises a bare Exception
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"tokenizer file {file!r} does not load ({reason}); point data.tokenizer at a "
                         "tokenizer.json saved by the `tokenizers` library") from None
    try:
        return BPETokenizer(tokenizer)
    except ValueError as e:
        raise ValueError(f"tokenizer file {file!r}: {e}") from None


build_tokenizer = load_tokenizer
