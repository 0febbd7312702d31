"""Intact checkpoints: a manifest written at save time, checked before any load.

A DCP checkpoint folder `step-N` counts once its `.metadata` is written (a process killed
during the save leaves none). Data files can still be damaged afterwards (a disk that
fills, a copy cut short). So, after the save, rank 0 writes `manifest.json` next to
`.metadata`: the size and CRC-32 of every file of the folder. Before loading, a folder is

    damaged   when `.metadata` does not read, when a file the DCP metadata points into is
              shorter than the bytes it points at, or when a file listed in the manifest is
              missing or differs in size or checksum;
    intact    otherwise (a folder without a manifest, e.g. one saved by another tool or
              killed between `.metadata` and the manifest, is judged by the metadata alone).

The trainer resumes from the newest intact checkpoint and warns, naming each damaged newer
one; nothing is deleted. `generate` and `export` refuse a damaged checkpoint in one line.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import zlib

MANIFEST = "manifest.json"
METADATA = ".metadata"
_CHUNK = 1 << 24


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(folder: str) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: str) -> None:
    """Record the size and checksum of every file in the checkpoint folder (after the save)."""
    entries = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        entries[rel] = {"bytes": os.path.getsize(path), "crc32": _crc32(path)}
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": entries}, f, indent=1)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def _bytes_metadata_needs(folder: str) -> dict[str, int]:
    """Per data file, the end of the furthest byte range the DCP metadata points at."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(folder).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(info.offset) + int(info.length)
        needed[rel] = max(needed.get(rel, 0), end)
    return needed


def _file_damage(folder: str, rel: str, *, min_bytes: int = 0, entry: dict | None = None) -> str | None:
    """Why file `rel` is damaged: missing, shorter than `min_bytes` (what the metadata points
    at), or unlike its manifest `entry` (size, then checksum); None if it is not."""
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return f"{rel} is missing"
    size = os.path.getsize(path)
    if size < min_bytes:
        return f"{rel} holds {size} bytes, the metadata points up to byte {min_bytes}"
    if entry is not None and size != entry["bytes"]:
        return f"{rel} holds {size} bytes, {entry['bytes']} were saved"
    if entry is not None and _crc32(path) != entry["crc32"]:
        return f"{rel} differs from the saved checksum"
    return None


def damage(folder: str) -> str | None:
    """None for an intact checkpoint folder, else a short reason it is damaged."""
    if not os.path.isdir(folder):
        return "not found"
    if not os.path.isfile(os.path.join(folder, METADATA)):
        return f"no {METADATA} (the save did not finish)"
    try:
        needed = _bytes_metadata_needs(folder)
    except Exception as e:  # a truncated or garbled pickle raises anything
        return f"{METADATA} does not read ({type(e).__name__})"
    problems = (_file_damage(folder, rel, min_bytes=end) for rel, end in sorted(needed.items()))
    manifest_path = os.path.join(folder, MANIFEST)
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path) as f:
                files = json.load(f)["files"]
        except (ValueError, KeyError, TypeError, OSError) as e:
            return f"{MANIFEST} does not read ({type(e).__name__})"
        problems = itertools.chain(problems, (_file_damage(folder, rel, entry=entry)
                                              for rel, entry in sorted(files.items())))
    return next((p for p in problems if p is not None), None)


def saved_steps(folder: str) -> list[int]:
    """The steps of the `step-N` folders holding a `.metadata` file, newest first."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = re.fullmatch(r"step-(\d+)", name)
        if match and os.path.isfile(os.path.join(folder, name, METADATA)):
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def newest_intact_step(folder: str, warn) -> int:
    """The newest step whose checkpoint is intact (-1: none); `warn(message)` for each
    damaged newer one, which stays on disk."""
    for step in saved_steps(folder):
        path = os.path.join(folder, f"step-{step}")
        reason = damage(path)
        if reason is None:
            return step
        warn(f"checkpoint {path} is damaged ({reason}); trying the previous one (nothing deleted)")
    return -1


def check_loadable(path: str) -> None:
    """Raise ValueError (one line, naming the folder) unless `path` is an intact checkpoint."""
    reason = damage(path)
    if reason == "not found":
        raise ValueError(f"checkpoint folder not found: {path} (train with --checkpoint.enable to write one)")
    if reason is not None:
        raise ValueError(f"checkpoint {path} is damaged: {reason}")
