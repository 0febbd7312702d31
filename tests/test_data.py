"""Data pipeline: corpus sources and splits, tokenizer, packing contract, loader sharding/resume."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from tensordict import TensorDict
from torch.distributed.checkpoint.stateful import Stateful
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from titan_moe.data import (
    BPETokenizer,
    build_dataloader,
    build_source,
    builtin_source,
    collate_rows,
    epoch_order,
    hf_disk_source,
    load_tokenizer,
    pack_rows,
    text_source,
    train_bpe,
)
from titan_moe.model.packing import doc_start_mask


@pytest.fixture(scope="module")
def tok() -> BPETokenizer:
    return load_tokenizer()


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _random_text(rng: random.Random, n_words: int) -> str:
    words = ["alpha", "beta", "gamma", "δέλτα", "日本語", "naïve", "x", "42", "\n", "  ", "😀", "def", "()"]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture()
def tiny_corpus(tmp_path):
    """A text corpus of 7 small files (a few to ~60 tokens each, ~250 in all)."""
    rng = random.Random(1234)
    root = tmp_path / "corpus"
    for i in range(7):
        _write(str(root / f"sub{i % 2}" / f"doc{i}.txt"), _random_text(rng, rng.randint(1, 20)))
    return str(root)


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_round_trip_on_real_and_unicode_text(tok):
    assert isinstance(tok, BaseTokenizer)
    docs = builtin_source("val")
    texts = [docs[i] for i in range(0, len(docs), max(1, len(docs) // 5))]
    rng = random.Random(0)
    # random code points from several planes (no surrogates, which UTF-8 cannot hold)
    pool = [c for c in range(0x20, 0x3000) if not 0xD800 <= c < 0xE000] + list(range(0x1F600, 0x1F650))
    texts += ["".join(chr(rng.choice(pool)) for _ in range(n)) for n in (1, 17, 300)]
    texts += ["", " leading space", "tabs\t\tand\r\nCRLF\n\n", "ünïcödé — “quotes” 中文 🙂", "<|eos|> <|bos|>"]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.get_vocab_size() for i in ids)
    assert tok.encode_batch(texts, add_bos=True, add_eos=True) == [
        tok.encode(t, add_bos=True, add_eos=True) for t in texts
    ]
    # real code compresses: well below one token per byte
    code = texts[0]
    assert len(tok.encode(code)) < 0.5 * len(code.encode("utf-8"))


def test_tokenizer_special_tokens(tok):
    assert tok.get_vocab_size() == 4096
    assert tok.bos_id != tok.eos_id
    assert tok.id_to_token(tok.bos_id) == "<|bos|>" and tok.id_to_token(tok.eos_id) == "<|eos|>"
    ids = tok.encode("hello world", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert ids[1:-1] == tok.encode("hello world")
    # special-token text inside a document stays ordinary text
    inner = tok.encode("a <|eos|> b <|bos|> c")
    assert tok.bos_id not in inner and tok.eos_id not in inner
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"


def test_load_tokenizer_from_file_and_dir_and_missing(tmp_path, tok):
    rng = random.Random(5)
    trained = train_bpe([_random_text(rng, 200) for _ in range(20)], vocab_size=300)
    assert trained.get_vocab_size() <= 300
    trained.save(str(tmp_path / "tokenizer.json"))
    text = _random_text(rng, 50)
    for path in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        loaded = load_tokenizer(path)
        assert loaded.encode(text) == trained.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    missing = str(tmp_path / "nowhere" / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(missing)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(str(empty_dir))


# -------------------------------------------------------------------- packing
def _reference_rows(docs: list[list[int]], row_len: int):
    """Rows and doc ids by plain concatenation: the stream cut every row_len tokens."""
    stream = [t for d in docs for t in d]
    doc_of = [k for k, d in enumerate(docs) for _ in d]
    out = []
    for s in range(0, len(stream) - row_len + 1, row_len):
        ids = doc_of[s : s + row_len]
        out.append((stream[s : s + row_len], [i - ids[0] for i in ids]))
    return out


@pytest.mark.parametrize("row_len,max_doc", [(2, 5), (9, 4), (17, 60), (33, 33)])
def test_pack_rows_matches_reference(row_len, max_doc):
    rng = random.Random(row_len * 100 + max_doc)
    docs = [[rng.randrange(1000) for _ in range(rng.randint(1, max_doc))] for _ in range(40)]
    rows = list(pack_rows(((k, d, 0) for k, d in enumerate(docs)), row_len))
    ref = _reference_rows(docs, row_len)
    assert [(r.tokens, r.doc_ids) for r in rows] == ref
    # restart from every row's end position reproduces the rest of the stream
    for k in range(0, len(rows), 3):
        cur, off = rows[k].cursor, rows[k].offset
        resumed = pack_rows(((c, docs[c], off if c == cur else 0) for c in range(cur, len(docs))), row_len)
        assert [(r.tokens, r.doc_ids) for r in resumed] == ref[k + 1 :]


def test_collate_rows_contract():
    row_len, B = 12, 3
    docs = [list(range(100 * k, 100 * k + n)) for k, n in enumerate([5, 20, 3, 3, 9, 1, 14])]
    rows = list(pack_rows(((k, d, 0) for k, d in enumerate(docs)), row_len))[:B]
    input_dict, labels_BT = collate_rows(rows)
    assert isinstance(input_dict, TensorDict) and tuple(input_dict.batch_size) == (B,)
    x_BT, doc_ids_BT = input_dict["input"], input_dict["doc_ids"]
    assert x_BT.dtype == torch.int64 and labels_BT.dtype == torch.int64 and doc_ids_BT.dtype == torch.int32
    assert x_BT.shape == labels_BT.shape == doc_ids_BT.shape == (B, row_len - 1)
    assert torch.equal(x_BT[:, 1:], labels_BT[:, :-1])  # labels are inputs shifted by one
    for b, row in enumerate(rows):
        assert labels_BT[b, -1].item() == row.tokens[-1]
    assert (doc_ids_BT[:, 0] == 0).all()
    steps_BT = doc_ids_BT[:, 1:] - doc_ids_BT[:, :-1]
    assert ((steps_BT == 0) | (steps_BT == 1)).all()
    # a new doc id exactly where a document's first token (value 100*k) sits
    starts_BT = doc_start_mask(doc_ids_BT)
    first_tokens = {d[0] for d in docs}
    for b in range(B):
        for t in range(1, row_len - 1):
            assert starts_BT[b, t].item() == (x_BT[b, t].item() in first_tokens)
    # document 1 (20 tokens) spans rows 0 and 1: its tail starts row 1 with doc id 0
    assert x_BT[1, 0].item() == 100 + (row_len - 5) and doc_ids_BT[1, 0].item() == 0
    assert doc_ids_BT[1, 1].item() == 0


# --------------------------------------------------------------------- corpus
def test_builtin_split_disjoint_stable_and_sized():
    train, val = builtin_source("train"), builtin_source("val")
    all_keys = builtin_source("train", val_fraction=0.0).keys
    assert set(train.keys).isdisjoint(val.keys)
    assert sorted(train.keys + val.keys) == all_keys
    assert builtin_source("val").keys == val.keys  # stable across calls
    n, p = len(all_keys), 0.02
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(len(val) - n * p) < 5 * sigma  # binomial count, 5 sigma
    assert not any("site-packages" in k or k.startswith("test/") for k in all_keys)
    assert all(k.endswith(".py") for k in all_keys)
    text = val[0]
    with open(os.path.join(val.root, val.keys[0]), encoding="utf-8") as f:
        assert text == f.read()


def test_text_source_dir_glob_file_and_split_stability(tmp_path):
    root = tmp_path / "texts"
    contents = {f"a/b/{i}.txt": f"file {i} ü\n" * (i + 1) for i in range(30)}
    contents.update({"notes.md": "# notes", "code.py": "print('hi')"})
    for rel, text in contents.items():
        _write(str(root / rel), text)
    _write(str(root / ".hidden.txt"), "hidden")
    _write(str(root / ".git" / "x.txt"), "hidden dir")
    (root / "blob.bin").write_bytes(b"\x00\xff")

    train, val = text_source(str(root), "train", 0.3), text_source(str(root), "val", 0.3)
    assert sorted(train.keys + val.keys) == sorted(contents)
    assert set(train.keys).isdisjoint(val.keys) and len(val) > 0
    for docs in (train, val):
        for i, key in enumerate(docs.keys):
            assert docs[i] == contents[key]
    # adding files never moves an old file across the split
    for i in range(30, 60):
        _write(str(root / f"a/b/{i}.txt"), "more")
    val_after = text_source(str(root), "val", 0.3)
    assert set(val.keys) == set(val_after.keys) & set(contents)

    globbed = text_source(str(root / "a" / "**" / "*.txt"), "train", 0.0)
    assert len(globbed) == 60 and all(k.startswith("b/") for k in globbed.keys)
    single = text_source(str(root / "notes.md"), "train", 0.0)
    assert list(single) == ["# notes"]


def test_missing_and_empty_sources_raise(tmp_path):
    missing = str(tmp_path / "no_such_dir")
    for source in ("text", "hf_disk"):
        with pytest.raises(ValueError, match="no_such_dir"):
            build_source(source, missing, "train")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty_dir"):
        text_source(str(empty))
    with pytest.raises(ValueError, match="nothing_matches"):
        text_source(str(tmp_path / "nothing_matches*.txt"))
    _write(str(tmp_path / "one" / "one.txt"), "x")
    with pytest.raises(ValueError, match="split is empty"):
        text_source(str(tmp_path / "one"), "val", 0.0)
    with pytest.raises(ValueError, match="takes no path"):
        build_source("builtin", "/some/path", "train")
    with pytest.raises(ValueError, match="unknown corpus source"):
        build_source("web", None, "train")
    with pytest.raises(ValueError, match="split"):
        build_source("builtin", None, "test")


def test_hf_disk_source(tmp_path, tok):
    datasets = pytest.importorskip("datasets", reason="the `datasets` package is not installed")
    rng = random.Random(7)
    texts = [_random_text(rng, rng.randint(1, 30)) for _ in range(200)]
    path = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"body": texts, "n": list(range(200))}).save_to_disk(path)
    train = hf_disk_source(path, "train", 0.1, column="body")
    val = hf_disk_source(path, "val", 0.1, column="body")
    assert sorted(list(train) + list(val)) == sorted(texts)
    assert set(int(r) for r in train.rows).isdisjoint(int(r) for r in val.rows)
    assert 0 < len(val) < 60
    assert list(hf_disk_source(path, "val", 0.1, column="body")) == list(val)
    with pytest.raises(ValueError, match="column"):
        hf_disk_source(path, "train", column="text")

    # a DatasetDict with its own splits is used as is
    dd_path = str(tmp_path / "dd")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": texts[:150]}),
         "validation": datasets.Dataset.from_dict({"text": texts[150:]})}
    ).save_to_disk(dd_path)
    assert list(hf_disk_source(dd_path, "val")) == texts[150:]

    loader = build_dataloader(tokenizer=tok, source="hf_disk", path=dd_path, split="val", seq_len=32,
                              local_batch_size=2, dp_rank=0, dp_world_size=1, infinite=False)
    stream = [t for d in texts[150:] for t in tok.encode(d, add_bos=True, add_eos=True)]
    got = [t for x, y in loader for row_x, row_y in zip(x["input"].tolist(), y.tolist())
           for t in row_x + row_y[-1:]]
    assert got == stream[: len(got)] and len(stream) - len(got) < 2 * 33


# --------------------------------------------------------------------- loader
def _reference_global_rows(tok, docs, seq_len, *, seed, shuffle, epochs):
    """Global packed rows by plain concatenation of the documents, epoch after epoch."""
    tokenized = []
    for epoch in range(epochs):
        for i in epoch_order(len(docs), seed=seed, epoch=epoch, shuffle=shuffle):
            if docs[i]:
                tokenized.append(tok.encode(docs[i], add_bos=True, add_eos=True))
    return _reference_rows(tokenized, seq_len + 1)


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _loader(tok, path, **kw):
    args = dict(tokenizer=tok, source="text", path=path, split="train", seq_len=16, local_batch_size=2,
                dp_rank=0, dp_world_size=1, seed=3, val_fraction=0.0)
    args.update(kw)
    return build_dataloader(**args)


def test_loader_matches_global_stream_and_shards(tok, tiny_corpus):
    seq_len, B, W, steps = 16, 2, 2, 12
    full = _loader(tok, tiny_corpus, local_batch_size=B * W)
    assert isinstance(full, BaseDataLoader) and isinstance(full, Stateful)
    full_batches = _take(full, steps)
    ref = _reference_global_rows(tok, full.documents, seq_len, seed=3, shuffle=True, epochs=6)
    assert len(ref) >= steps * B * W
    for i, (x, y) in enumerate(full_batches):
        assert x["input"].dtype == torch.int64 and x["doc_ids"].dtype == torch.int32
        assert y.shape == x["input"].shape == (B * W, seq_len)
        for j in range(B * W):
            tokens, doc_ids = ref[i * B * W + j]
            assert x["input"][j].tolist() == tokens[:-1] and y[j].tolist() == tokens[1:]
            assert x["doc_ids"][j].tolist() == doc_ids[:-1]
    assert full.state_dict()["dp_rank_0"]["epoch"] > 0  # the run crossed epoch boundaries

    for r in range(W):
        shard = _take(_loader(tok, tiny_corpus, dp_rank=r, dp_world_size=W), steps)
        for (xs, ys), (xf, yf) in zip(shard, full_batches):
            assert torch.equal(xs["input"], xf["input"][r * B : (r + 1) * B])
            assert torch.equal(xs["doc_ids"], xf["doc_ids"][r * B : (r + 1) * B])
            assert torch.equal(ys, yf[r * B : (r + 1) * B])


def test_loader_sharding_on_builtin(tok):
    kw = dict(tokenizer=tok, source="builtin", path=None, split="train", seq_len=64, seed=1)
    full = _take(build_dataloader(local_batch_size=6, dp_rank=0, dp_world_size=1, **kw), 4)
    for r in range(3):
        shard = _take(build_dataloader(local_batch_size=2, dp_rank=r, dp_world_size=3, **kw), 4)
        for (xs, ys), (xf, yf) in zip(shard, full):
            assert torch.equal(xs["input"], xf["input"][2 * r : 2 * r + 2])
            assert torch.equal(xs["doc_ids"], xf["doc_ids"][2 * r : 2 * r + 2])
            assert torch.equal(ys, yf[2 * r : 2 * r + 2])


def test_loader_resume_is_exact_across_epochs(tok, tiny_corpus):
    W, total = 2, 14
    saved_epochs = set()
    for rank in range(W):
        uninterrupted = _take(_loader(tok, tiny_corpus, dp_rank=rank, dp_world_size=W), total)
        for n in (0, 1, 5, 9, 13):
            first = _loader(tok, tiny_corpus, dp_rank=rank, dp_world_size=W)
            _take(first, n)
            state = first.state_dict()
            flat = state[f"dp_rank_{rank}"]
            assert all(isinstance(v, int) for v in flat.values()) and state["world_size"] == W
            saved_epochs.add(flat["epoch"])
            fresh = _loader(tok, tiny_corpus, dp_rank=rank, dp_world_size=W)
            fresh.load_state_dict(state)
            for (x, y), (xr, yr) in zip(_take(fresh, total - n), uninterrupted[n:]):
                assert torch.equal(x["input"], xr["input"]) and torch.equal(y, yr)
                assert torch.equal(x["doc_ids"], xr["doc_ids"])
    assert len(saved_epochs) >= 3  # resumed from inside several epochs
    # loading an empty state is a no-op
    fresh = _loader(tok, tiny_corpus)
    fresh.load_state_dict({})
    assert torch.equal(_take(fresh, 1)[0][1], _take(_loader(tok, tiny_corpus), 1)[0][1])


def test_loader_state_survives_dcp(tok, tiny_corpus, tmp_path):
    import torch.distributed.checkpoint as dcp

    uninterrupted = _take(_loader(tok, tiny_corpus), 9)
    saved = _loader(tok, tiny_corpus)
    _take(saved, 6)
    dcp.save({"dataloader": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    restored = _loader(tok, tiny_corpus)
    dcp.load({"dataloader": restored}, checkpoint_id=str(tmp_path / "ckpt"))
    assert restored.state_dict() == saved.state_dict()
    for (x, y), (xr, yr) in zip(_take(restored, 3), uninterrupted[6:]):
        assert torch.equal(x["input"], xr["input"]) and torch.equal(y, yr)


def test_loader_resume_with_new_seq_len_continues_the_stream(tok, tiny_corpus):
    """A context-length stage resumes the same token stream with longer rows."""
    def flat(batches):
        return [t for x, y in batches for rx, ry in zip(x["input"].tolist(), y.tolist()) for t in rx + ry[-1:]]

    whole = flat(_take(_loader(tok, tiny_corpus, local_batch_size=1), 30))
    short = _loader(tok, tiny_corpus, local_batch_size=1)
    head = flat(_take(short, 7))
    longer = _loader(tok, tiny_corpus, local_batch_size=1, seq_len=40)
    longer.load_state_dict(short.state_dict())
    tail = flat(_take(longer, 5))
    assert head + tail == whole[: len(head) + len(tail)]


def test_shuffle_per_epoch_and_val_order(tok, tiny_corpus):
    n = 50
    orders = [epoch_order(n, seed=0, epoch=e, shuffle=True) for e in range(3)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert epoch_order(n, seed=0, epoch=1, shuffle=True) == orders[1]
    assert epoch_order(n, seed=1, epoch=1, shuffle=True) != orders[1]
    assert epoch_order(n, seed=0, epoch=4, shuffle=False) == list(range(n))


def test_finite_val_loader_stops_at_end(tok, tiny_corpus):
    seq_len, B, W = 8, 2, 2
    docs = text_source(tiny_corpus, "train", 0.0)
    ref = _reference_global_rows(tok, docs, seq_len, seed=0, shuffle=False, epochs=1)
    expected = len(ref) // (B * W)
    # val_fraction close to 1 puts every document in val (each lands there unless its
    # hash fraction is above it: probability 1e-6 per file, checked below)
    for r in range(W):
        loader = build_dataloader(tokenizer=tok, source="text", path=tiny_corpus, split="val", seq_len=seq_len,
                                  local_batch_size=B, dp_rank=r, dp_world_size=W, val_fraction=0.999999,
                                  infinite=False)
        assert sorted(loader.documents.keys) == sorted(docs.keys)
        batches = list(loader)
        assert len(batches) == expected
        for i, (x, y) in enumerate(batches):
            for j in range(B):
                tokens, _ = ref[i * B * W + r * B + j]
                assert x["input"][j].tolist() == tokens[:-1]
        again = list(loader)  # the next pass starts over
        assert len(again) == expected
        assert all(torch.equal(y, y2) for (_, y), (_, y2) in zip(batches, again))
        it = iter(loader)
        next(it)
        loader.reset()
        assert torch.equal(next(iter(loader))[1], batches[0][1])


def test_first_batch_is_fast(tok):
    t0 = time.perf_counter()
    loader = build_dataloader(tokenizer=tok, source="builtin", path=None, split="train", seq_len=2048,
                              local_batch_size=8, dp_rank=1, dp_world_size=2)
    x, y = next(iter(loader))
    elapsed = time.perf_counter() - t0
    assert x["input"].shape == (8, 2048)
    assert elapsed < 2.0, f"build + first batch took {elapsed:.2f} s"


def test_loader_argument_errors(tok):
    kw = dict(tokenizer=tok, source="builtin", path=None, split="train", seq_len=16, local_batch_size=2)
    with pytest.raises(ValueError, match="dp_rank"):
        build_dataloader(dp_rank=2, dp_world_size=2, **kw)
    with pytest.raises(ValueError, match="seq_len"):
        build_dataloader(dp_rank=0, dp_world_size=1, **{**kw, "seq_len": 0})
    with pytest.raises(ValueError, match="val_fraction"):
        build_dataloader(dp_rank=0, dp_world_size=1, val_fraction=1.0, **kw)
