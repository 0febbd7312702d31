"""Offline data pipeline: document sources, byte-level BPE tokenizer, packing, loader.

    tok = load_tokenizer()                      # the tokenizer shipped with the package
    loader = build_dataloader(tokenizer=tok, source="builtin", path=None, split="train",
                              seq_len=256, local_batch_size=4, dp_rank=0, dp_world_size=1)
    for input_dict, labels_BT in loader:        # input_dict["input"], input_dict["doc_ids"]
        ...
"""

from titan_moe.data.corpus import (
    DocumentSource,
    build_source,
    builtin_source,
    epoch_order,
    hf_disk_source,
    text_source,
)
from titan_moe.data.loader import PackedTextDataLoader, build_dataloader
from titan_moe.data.packing import PackedRow, collate_rows, pack_rows
from titan_moe.data.tokenizer import (
    BUILTIN_TOKENIZER_PATH,
    BPETokenizer,
    build_tokenizer,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "BPETokenizer",
    "BUILTIN_TOKENIZER_PATH",
    "DocumentSource",
    "PackedRow",
    "PackedTextDataLoader",
    "build_dataloader",
    "build_source",
    "build_tokenizer",
    "builtin_source",
    "collate_rows",
    "epoch_order",
    "hf_disk_source",
    "load_tokenizer",
    "pack_rows",
    "text_source",
    "train_bpe",
]
