"""Rows that are one long document each, from real text, for the peer harness.

    python profiling/peer_long_docs.py --seq-len 32768 --count 15 --out OUT/long_docs_32768
    # then train on them: --training.dataset text --training.dataset_path OUT/long_docs_32768
    #                     --data.val_fraction 0

The text: the standard library's modules that make up the built-in corpus
(`titan_moe.data.corpus.builtin_source`, test folders excluded), concatenated package by
package: the top-level modules first, then each package in name order, a package's
`__init__.py` before its other modules, a folder's own modules before its subpackages;
files joined by a newline. (The corpus's own documents are single files, few of them longer
than 32K tokens.) That stream is cut into consecutive pieces of exactly `seq_len - 1` tokens
of our tokenizer; the loader writes each as `[bos] piece [eos]` = seq_len + 1 tokens, which is
exactly one packed row (`seq_len` inputs and their labels), so every row of the run is one
document: doc ids all 0, no eos among the inputs. Pieces are cut at token boundaries and
re-encoded; where the re-encoding differs in length (a cut inside a pre-token), the cut moves
by a token until it holds exactly `seq_len - 1`. When the stream runs out, it starts over
(the manifest counts the passes), so any length works; the stdlib holds a few million tokens.

Each document is one `.txt` file (`doc_00000.txt`, ...); `.manifest.json` (hidden, so the
text source does not read it as a document) records seq_len, count, the tokenizer file's hash
and the passes. An existing folder with the same manifest is reused. `--data.val_fraction 0` keeps every file in the training split.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Iterator

from titan_moe.data.corpus import builtin_source
from titan_moe.data.tokenizer import BUILTIN_TOKENIZER_PATH, BPETokenizer, load_tokenizer

_MAX_ADJUST = 16  # cut moves tried before giving up on a piece (never seen needing more than 2)


def _package_order_key(key: str) -> tuple:
    parts = key.split("/")
    folder, name = parts[:-1], parts[-1]
    return (folder, name != "__init__.py", name)


def stdlib_texts_in_package_order() -> Iterator[str]:
    """The built-in corpus's files (all of them: no val split), in package order."""
    source = builtin_source("train", val_fraction=0.0)
    keys = sorted(source.keys, key=_package_order_key)
    index = {k: i for i, k in enumerate(source.keys)}
    for key in keys:
        yield source[index[key]]


def _exact_piece(tokenizer: BPETokenizer, text: str, n_tokens: int) -> tuple[str, int] | None:
    """(the longest prefix of `text` cut at a token boundary that encodes to exactly n_tokens
    tokens, its length in characters), or None if `text` holds fewer than n_tokens tokens."""
    enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    if len(enc.ids) < n_tokens:
        return None
    k = n_tokens
    for _ in range(_MAX_ADJUST):
        cut = enc.offsets[k - 1][1]
        got = len(tokenizer.encode(text[:cut]))
        if got == n_tokens:
            return text[:cut], cut
        k += n_tokens - got
        if not 0 < k <= len(enc.ids):
            break
    raise RuntimeError(f"peer_long_docs: could not cut a piece of exactly {n_tokens} tokens")


def long_documents(tokenizer: BPETokenizer, seq_len: int, count: int) -> tuple[list[str], int]:
    """`count` texts of exactly seq_len - 1 tokens each, consecutive in the stdlib stream;
    and the number of passes over the stream that took (1 = no text repeated)."""
    if seq_len < 2 or count < 1:
        raise ValueError(f"peer_long_docs: need seq_len >= 2 and count >= 1, got {seq_len=} {count=}")
    n = seq_len - 1
    docs: list[str] = []
    passes, buffer = 1, ""
    texts = stdlib_texts_in_package_order()
    # about 3.4 characters per token on this corpus: read ahead 4.5 x n characters
    want_chars = int(4.5 * n) + 1024
    while len(docs) < count:
        while len(buffer) < want_chars:
            text = next(texts, None)
            if text is None:
                passes += 1
                texts = stdlib_texts_in_package_order()
                continue
            buffer = buffer + "\n" + text if buffer else text
        piece = _exact_piece(tokenizer, buffer, n)
        if piece is None:
            want_chars *= 2
            continue
        text, cut = piece
        docs.append(text)
        buffer = buffer[cut:]
    return docs, passes


def _tokenizer_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=8).hexdigest()


def write_long_documents(out_dir: str, *, seq_len: int, count: int, tokenizer_path: str | None = None) -> dict:
    """Write the documents to `out_dir` (reused when its manifest matches); the manifest."""
    tokenizer_file = tokenizer_path or BUILTIN_TOKENIZER_PATH
    if os.path.isdir(tokenizer_file):
        tokenizer_file = os.path.join(tokenizer_file, "tokenizer.json")
    want = {"seq_len": seq_len, "count": count, "tokenizer": _tokenizer_hash(tokenizer_file)}
    manifest_path = os.path.join(out_dir, ".manifest.json")
    if os.path.isfile(manifest_path):
        with open(manifest_path) as f:
            manifest = json.load(f)
        if all(manifest.get(k) == v for k, v in want.items()):
            return manifest
    docs, passes = long_documents(load_tokenizer(tokenizer_path), seq_len, count)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        if name.startswith("doc_") and name.endswith(".txt"):
            os.remove(os.path.join(out_dir, name))
    for i, text in enumerate(docs):
        with open(os.path.join(out_dir, f"doc_{i:05d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    manifest = {**want, "passes": passes, "tokens_per_document": seq_len - 1,
                "source": "standard library modules in package order"}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--count", type=int, required=True, help="documents (= rows) to write")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the shipped one)")
    args = parser.parse_args(argv)
    try:
        manifest = write_long_documents(args.out, seq_len=args.seq_len, count=args.count,
                                        tokenizer_path=args.tokenizer)
    except (ValueError, RuntimeError) as e:
        print(f"peer_long_docs: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
