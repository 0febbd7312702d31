"""Document sources: random-access lists of text documents, split into train and val.

A source is a `DocumentSource`: `len(src)` documents, `src[i]` reads document i as a
`str` (lazily, one at a time), and iteration walks them in the source's fixed base
order. `epoch_order` gives the deterministic order the loader visits them in.

Three kinds (`build_source`):

- ``"builtin"``: the Python standard library's own ``.py`` files
  (``sysconfig.get_paths()["stdlib"]``), skipping ``site-packages``/``dist-packages``,
  test folders (``test``, ``tests``, ``idle_test``) and ``__pycache__``, in sorted
  relative-path order. Real text that every Python install has, no network. The file
  set, and so the corpus, differs between Python versions.
- ``"text"``: the user's own files. ``path`` is a file, a directory (searched
  recursively for files with a suffix in `TEXT_SUFFIXES`; hidden files and folders are
  skipped) or a glob pattern (``*``, ``?``, ``[``; ``**`` recurses; every matching
  regular file is taken, whatever its suffix). **Each file is one document**, read as
  UTF-8 with undecodable bytes replaced.
- ``"hf_disk"``: a Hugging Face dataset written with ``datasets.save_to_disk``; each
  row's ``column`` (default ``"text"``) is one document. A `DatasetDict` that holds a
  ``train`` split and a ``validation``/``val``/``test`` split uses those; a single
  `Dataset` (or a `DatasetDict` with one split) is split by row hash as below.

Train/val split: a document goes to val iff a stable 64-bit hash of its key, read as a
fraction of 2**64, is below ``val_fraction``. The key of a file is its path relative to
the source root with ``/`` separators (blake2b), the key of a dataset row its row index
(splitmix64). The split depends on nothing else (no seed, no machine, no file order), so
every machine agrees, and adding files never moves an old file across the split.

A missing path, or a split with no documents, raises ValueError naming the path; a file
that holds NUL bytes in its first 8 KiB is not text and raises `CorpusError` (a ValueError)
naming it when it is read.
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import sysconfig
from typing import Any, Iterator, Sequence

from titan_moe.runtime.optional_packages import is_placeholder

SOURCES = ("builtin", "text", "hf_disk")
SPLITS = ("train", "val")

TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu",
     ".rs", ".go", ".java", ".js", ".ts", ".sh", ".tex", ".html", ".css", ".toml",
     ".yaml", ".yml", ".json", ".csv"}
)
_SKIPPED_STDLIB_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_VAL_SPLIT_NAMES = ("validation", "val", "test")


_BINARY_PROBE = 8192  # bytes looked at for a NUL, as git does


class CorpusError(ValueError):
    """Damaged input found while reading the corpus (during training, too): one line."""


# ---------------------------------------------------------------------------- split
def _fraction_of_hash(digest: int) -> float:
    return digest / 2.0**64


def path_in_val(key: str, val_fraction: float) -> bool:
    """True iff the document keyed by `key` (a relative path) belongs to the val split."""
    digest = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")
    return _fraction_of_hash(digest) < val_fraction


def _splitmix64(x):
    """splitmix64 finaliser; works elementwise on uint64 numpy arrays (wrapping)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


def rows_in_val(num_rows: int, val_fraction: float):
    """bool numpy array [num_rows]: which dataset rows (keyed by index) belong to val."""
    import numpy as np  # a dependency of `datasets`, needed only with it

    with np.errstate(over="ignore"):
        h = _splitmix64(np.arange(num_rows, dtype=np.uint64))
    return h.astype(np.float64) / 2.0**64 < val_fraction


def _check_split(split: str, val_fraction: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")


def epoch_order(num_docs: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order (a permutation of range(num_docs)) in which epoch `epoch` visits documents.

    Shuffled with a generator seeded from (seed, epoch) through a hash, so the order is
    the same on every machine and Python version; unshuffled it is the base order.
    """
    order = list(range(num_docs))
    if shuffle:
        mixed = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
        random.Random(int.from_bytes(mixed, "little")).shuffle(order)
    return order


# -------------------------------------------------------------------------- sources
class DocumentSource(Sequence[str]):
    """A fixed, random-access list of documents. `src[i]` reads document i (a `str`)."""

    description: str

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        raise NotImplementedError

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description}, {len(self)} documents)"


class FileDocuments(DocumentSource):
    """One document per file. `keys[i]` is file i's relative path (its split key)."""

    def __init__(self, root: str, keys: list[str], description: str):
        self.root = root
        self.keys = keys
        self.description = description

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        path = os.path.join(self.root, *self.keys[i].split("/"))
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:_BINARY_PROBE]:
            raise CorpusError(f"{path!r} is not a text file (it holds NUL bytes); the text corpus takes "
                              "UTF-8 text: remove it or point training.dataset_path elsewhere")
        return data.decode("utf-8", errors="replace")


class HFDiskDocuments(DocumentSource):
    """One document per dataset row: `dataset[rows[i]][column]`."""

    def __init__(self, dataset: Any, column: str, rows: Sequence[int] | None, description: str):
        self.dataset = dataset
        self.column = column
        self.rows = rows
        self.description = description

    def __len__(self) -> int:
        return len(self.dataset) if self.rows is None else len(self.rows)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        row = i if self.rows is None else int(self.rows[i])
        text = self.dataset[row][self.column]
        return "" if text is None else str(text)


def _split_files(root: str, keys: list[str], split: str, val_fraction: float,
                 description: str) -> FileDocuments:
    want_val = split == "val"
    kept = [k for k in keys if path_in_val(k, val_fraction) == want_val]
    if not kept:
        raise ValueError(
            f"{description}: the {split!r} split is empty ({len(keys)} documents in all, "
            f"val_fraction={val_fraction})"
        )
    return FileDocuments(root, kept, f"{description} [{split}]")


def _walk_files(root: str, keep_dir, keep_file) -> list[str]:
    """Relative '/'-joined paths of the files under `root` that pass the filters, sorted."""
    keys = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        keys.extend(prefix + f for f in filenames if keep_file(os.path.join(dirpath, f)))
    return sorted(keys)


def builtin_source(split: str = "train", val_fraction: float = 0.02) -> FileDocuments:
    """The standard library's .py files (see the module docstring), one split of them."""
    _check_split(split, val_fraction)
    root = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ValueError(f"builtin corpus: standard library folder {root!r} not found")
    keys = _walk_files(
        root,
        keep_dir=lambda d: d not in _SKIPPED_STDLIB_DIRS,
        keep_file=lambda p: p.endswith(".py") and os.path.getsize(p) > 0,
    )
    return _split_files(root, keys, split, val_fraction, f"builtin corpus at {root!r}")


def _has_glob_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def text_source(path: str, split: str = "train", val_fraction: float = 0.02) -> FileDocuments:
    """The user's text files at `path` (a file, a directory or a glob), one split of them."""
    _check_split(split, val_fraction)
    if not path:
        raise ValueError("text corpus: a path (file, directory or glob) is required")
    path = os.path.expanduser(path)
    description = f"text corpus at {path!r}"
    if _has_glob_magic(path):
        # keys are relative to the folder above the first component holding a wildcard
        parts = path.replace(os.sep, "/").split("/")
        first_magic = next(i for i, p in enumerate(parts) if _has_glob_magic(p))
        root = "/".join(parts[:first_magic]) or ("/" if path.startswith("/") else ".")
        matches = [m for m in glob.glob(path, recursive=True) if os.path.isfile(m)]
        keys = sorted(os.path.relpath(m, root).replace(os.sep, "/") for m in matches)
    elif os.path.isdir(path):
        root = path
        keys = _walk_files(
            root,
            keep_dir=lambda d: not d.startswith("."),
            keep_file=lambda p: (not os.path.basename(p).startswith("."))
            and os.path.splitext(p)[1].lower() in TEXT_SUFFIXES,
        )
    elif os.path.isfile(path):
        root, keys = os.path.dirname(path) or ".", [os.path.basename(path)]
    else:
        raise ValueError(f"{description}: no such file or directory")
    if not keys:
        raise ValueError(f"{description}: no text files found")
    return _split_files(root, keys, split, val_fraction, description)


def hf_disk_source(path: str, split: str = "train", val_fraction: float = 0.02,
                   column: str = "text") -> HFDiskDocuments:
    """Rows of a dataset saved with `datasets.save_to_disk` at `path`, one split of them."""
    _check_split(split, val_fraction)
    if not path:
        raise ValueError("hf_disk corpus: a path to a dataset saved with save_to_disk is required")
    path = os.path.expanduser(path)
    description = f"hf_disk dataset at {path!r}"
    if not os.path.exists(path):
        raise ValueError(f"{description}: no such file or directory")
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"{description}: the `datasets` package is not installed") from e
    if is_placeholder(datasets):
        raise ValueError(f"{description}: the `datasets` package is not installed")
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise ValueError(f"{description}: not a dataset written by save_to_disk ({e})") from e

    rows, presplit = None, False
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded.keys())
        val_name = next((n for n in _VAL_SPLIT_NAMES if n in loaded), None)
        if "train" in loaded and val_name is not None:
            name = "train" if split == "train" else val_name
            ds, presplit = loaded[name], True
            description += f" [{name}]"
        elif len(names) == 1:
            ds = loaded[names[0]]
        else:
            raise ValueError(
                f"{description}: cannot tell train from val among splits {names}; "
                f"expected 'train' and one of {_VAL_SPLIT_NAMES}, or a single split"
            )
    else:
        ds = loaded
    if column not in ds.column_names:
        raise ValueError(f"{description}: no column {column!r} (columns: {ds.column_names})")
    ds = ds.select_columns([column])
    if not presplit:
        in_val = rows_in_val(len(ds), val_fraction)
        rows = (in_val if split == "val" else ~in_val).nonzero()[0]
        description += f" [{split}]"
    docs = HFDiskDocuments(ds, column, rows, description)
    if len(docs) == 0:
        raise ValueError(f"{description}: the {split!r} split is empty (val_fraction={val_fraction})")
    return docs


def build_source(source: str, path: str | None, split: str, *, val_fraction: float = 0.02,
                 hf_text_column: str = "text") -> DocumentSource:
    """Dispatch on `source` ("builtin" | "text" | "hf_disk")."""
    if source == "builtin":
        if path:
            raise ValueError(f"the builtin corpus takes no path, got {path!r}")
        return builtin_source(split, val_fraction)
    if source == "text":
        return text_source(path or "", split, val_fraction)
    if source == "hf_disk":
        return hf_disk_source(path or "", split, val_fraction, column=hf_text_column)
    raise ValueError(f"unknown corpus source {source!r}; expected one of {SOURCES}")
