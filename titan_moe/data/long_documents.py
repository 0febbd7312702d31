"""Long documents for the long-context stages, built from real text.

Two sources (`long_source`):

- ``"packages"``: each package of the Python standard library (a top-level folder with an
  ``__init__.py``, sub-packages included) becomes one document: its modules concatenated in
  import order, a module after the modules of the package it imports (found with `ast`;
  ties and cycles broken by path order), each preceded by a ``# file: <path>`` line. Code
  that uses a name then often sits tens of thousands of tokens after its definition, which
  is what a long-context stage should learn to use. The train/val split follows the
  corpus's per-file split (`corpus.path_in_val`): a package's train document holds its
  train files, its val document its val files, so no held-out file is ever trained on.
  Packages with fewer than two files in a split are left out of it (a single file is an
  ordinary corpus document).
- ``"text"``: the user's long files at a path (file, folder or glob), each file one
  document, split like the text corpus.

Documents are built lazily when read (`src[i]`).
"""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
from collections import defaultdict

from titan_moe.data.corpus import _SKIPPED_STDLIB_DIRS, DocumentSource, _walk_files, path_in_val, text_source

LONG_SOURCES = ("packages", "text")


def _module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(text: str, module: str, is_package: bool) -> set[str]:
    """Absolute names of the modules `module`'s source imports (relative imports resolved)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return set()
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base)
                name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def import_order(files: dict[str, str]) -> list[str]:
    """Relative paths ordered so that a module comes after the package modules it imports.

    files: relative path -> source text. Depth-first over the sorted paths: before a module,
    its not yet placed imports (a cycle is cut where it closes)."""
    by_name = {_module_name(rel): rel for rel in files}
    deps = {rel: sorted({by_name[n] for n in _imports(text, _module_name(rel), rel.endswith("__init__.py"))
                         if n in by_name and by_name[n] != rel})
            for rel, text in files.items()}
    placed: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: placed

    def visit(rel: str) -> None:
        if state.get(rel):
            return
        state[rel] = 1
        for dep in deps[rel]:
            visit(dep)
        state[rel] = 2
        placed.append(rel)

    for rel in sorted(files):
        visit(rel)
    return placed


class PackageDocuments(DocumentSource):
    """One document per package: its files (of one split) in import order."""

    def __init__(self, root: str, packages: list[tuple[str, list[str]]], description: str):
        self.root = root
        self.packages = packages  # (package name, relative paths)
        self.description = description
        self._built: dict[int, str] = {}  # documents already read (each is parsed for its imports)

    def __len__(self) -> int:
        return len(self.packages)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if i in self._built:
            return self._built[i]
        _, rels = self.packages[i]
        files = {}
        for rel in rels:
            with open(os.path.join(self.root, *rel.split("/")), "rb") as f:
                files[rel] = f.read().decode("utf-8", errors="replace")
        self._built[i] = "".join(f"# file: {rel}\n{files[rel]}\n" for rel in import_order(files))
        return self._built[i]


def _packages_at(root: str, keep, description: str, allow_empty: bool = False) -> PackageDocuments:
    """The packages (top-level folders with an ``__init__.py``) under `root`, each of its
    `.py` files for which ``keep(relative path)`` holds; packages left with one file are
    dropped. ValueError when none is left, unless `allow_empty`."""
    keys = _walk_files(root, keep_dir=lambda d: d not in _SKIPPED_STDLIB_DIRS,
                       keep_file=lambda p: p.endswith(".py") and os.path.getsize(p) > 0)
    top_packages = {k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith("/__init__.py")}
    grouped: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        top = k.split("/")[0]
        if "/" in k and top in top_packages and keep(k):
            grouped[top].append(k)
    packages = [(name, rels) for name, rels in sorted(grouped.items()) if len(rels) >= 2]
    if not packages and not allow_empty:
        raise ValueError(f"{description}: no package with two or more files")
    return PackageDocuments(root, packages, description)


def package_documents(split: str = "train", val_fraction: float = 0.02, root: str | None = None) -> PackageDocuments:
    """The standard library's packages as long documents (see the module docstring). The val
    split may be empty: a small standard library can have no package with two held-out
    files (held-out evaluation then reads the other sources); the train split may not."""
    root = root or sysconfig.get_paths()["stdlib"]
    want_val = split == "val"
    return _packages_at(root, lambda k: path_in_val(k, val_fraction) == want_val,
                        f"standard-library packages at {root!r} [{split}]", allow_empty=want_val)


@functools.lru_cache(maxsize=4)
def unseen_package_documents(root: str) -> PackageDocuments:
    """Every package under `root` whole (all its files, in import order), for held-out
    evaluation on code a run never trained on: an installed library's source folder, say
    (``.../site-packages/torch``: its sub-packages `_inductor`, `distributed`, ... each one
    document). The standard library's own held-out files are few, so its val documents
    stay short; these reach hundreds of thousands of tokens. Cached by root, so each ladder
    stage's evaluation reads and orders the files once."""
    if not os.path.isdir(root):
        raise ValueError(f"held-out packages at {root!r}: no such directory")
    return _packages_at(root, lambda k: True, f"held-out packages at {root!r}")


class ConcatSource(DocumentSource):
    """Several sources as one list of documents."""

    def __init__(self, parts: list[DocumentSource]):
        self.parts = parts
        self.description = " + ".join(p.description for p in parts)
        self._offsets = []
        n = 0
        for p in parts:
            self._offsets.append(n)
            n += len(p)
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        for part, start in zip(reversed(self.parts), reversed(self._offsets)):
            if i >= start:
                return part[i - start]
        raise IndexError(i)


def long_source(kinds: list[str], path: str, split: str, val_fraction: float) -> DocumentSource | None:
    """The long documents of `kinds` ("packages", "text") for one split; None for no kinds."""
    parts: list[DocumentSource] = []
    for kind in kinds:
        if kind == "packages":
            parts.append(package_documents(split, val_fraction))
        elif kind == "text":
            parts.append(text_source(path, split, val_fraction))
        else:
            raise ValueError(f"unknown long-document source {kind!r}; expected one of {LONG_SOURCES}")
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ConcatSource(parts)
