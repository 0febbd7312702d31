"""Train the byte-level BPE tokenizer shipped in titan_moe/data/assets/tokenizer.json.

It learns from the builtin corpus's train split (the Python standard library's sources,
see titan_moe/data/corpus.py), in sorted path order; when that split holds more than
--max-mb megabytes, an evenly strided, fixed subset of files is taken. Same Python
version + same arguments -> the same file.

    python scripts/train_tokenizer.py [--vocab-size 4096] [--max-mb 12] [--output PATH]
"""

from __future__ import annotations

import argparse
import os
import time

from titan_moe.data.corpus import builtin_source
from titan_moe.data.tokenizer import BUILTIN_TOKENIZER_PATH, train_bpe


def _strided_subset(n_items: int, sizes: list[int], max_bytes: int) -> list[int]:
    """Indices of an evenly spaced subset whose sizes sum to about max_bytes."""
    total = sum(sizes)
    if total <= max_bytes:
        return list(range(n_items))
    stride = total / max_bytes
    return [i for i in range(n_items) if int(i / stride) != int((i + 1) / stride)] or [0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-mb", type=float, default=12.0, help="cap on training text (MB)")
    parser.add_argument("--output", default=BUILTIN_TOKENIZER_PATH)
    args = parser.parse_args()

    docs = builtin_source("train")
    sizes = [os.path.getsize(os.path.join(docs.root, k)) for k in docs.keys]
    picked = _strided_subset(len(docs), sizes, int(args.max_mb * 1e6))
    print(f"training on {len(picked)}/{len(docs)} files, "
          f"{sum(sizes[i] for i in picked) / 1e6:.1f} MB, vocab {args.vocab_size}")
    t0 = time.perf_counter()
    tok = train_bpe((docs[i] for i in picked), vocab_size=args.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tok.save(args.output)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1e3:.0f} kB) "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
