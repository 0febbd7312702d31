"""A sharded safetensors folder, read and written without DCP.

The same files as a trainer's `checkpoint.last_save_in_hf` save: `model-0000i-of-0000n.safetensors`,
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {name: file}}`)
and `config.json`. Used by the Kimi K3 importer (one layer in memory at a time) and by tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from titan_moe.hf.adapter import INDEX_FILE, shard_plan, to_hf_name, write_config
from titan_moe.model.args import ModelArgs


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def weight_map(folder: str) -> dict[str, str]:
    """HF name -> file name, from the index json (or the single `.safetensors` file's header)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    from safetensors import safe_open

    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if len(files) != 1:
        raise ValueError(f"{folder}: no {INDEX_FILE} and {len(files)} .safetensors files (need the index or one file)")
    with safe_open(os.path.join(folder, files[0]), framework="pt") as f:
        return {name: files[0] for name in f.keys()}


def read_tensors(folder: str, names=None) -> dict[str, torch.Tensor]:
    """The named tensors (default: all) of a safetensors folder, by HF name."""
    from safetensors import safe_open

    mapping = weight_map(folder)
    wanted = list(mapping) if names is None else list(names)
    missing = [n for n in wanted if n not in mapping]
    if missing:
        raise KeyError(f"{folder}: no tensor {missing[0]!r} ({len(missing)} missing)")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(mapping[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


class ShardWriter:
    """Writes tensors, given in our names, into the shards of a plan; each shard is written
    once all of its tensors have arrived, so a converter holds at most one shard in memory."""

    def __init__(self, folder: str, args: ModelArgs, plan: dict[str, int]):
        self.folder, self.args, self.plan = folder, args, plan
        self.count = max(plan.values())
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.left = {i: sum(1 for v in plan.values() if v == i) for i in set(plan.values())}
        self.total_size = 0
        os.makedirs(folder, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        hf_name = to_hf_name(name)
        if hf_name not in self.plan:
            raise KeyError(f"{name!r} is not a tensor of this model")
        shard = self.plan[hf_name]
        self.pending.setdefault(shard, {})[hf_name] = tensor.contiguous()
        self.total_size += tensor.numel() * tensor.element_size()
        self.left[shard] -= 1
        if self.left[shard] == 0:
            save_file(self.pending.pop(shard), os.path.join(self.folder, shard_file_name(shard, self.count)),
                      metadata={"format": "pt"})

    def close(self) -> None:
        unfinished = sorted(name for name, shard in self.plan.items() if self.left[shard] > 0)
        if unfinished:
            raise ValueError(f"{len(unfinished)} tensors were never written, e.g. {unfinished[0]!r}")
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": {name: shard_file_name(shard, self.count) for name, shard in sorted(self.plan.items())}}
        with open(os.path.join(self.folder, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        write_config(self.folder, self.args)


def write_state_dict(folder: str, args: ModelArgs, tensors: dict[str, torch.Tensor] | Iterator,
                     max_shard_bytes: int) -> None:
    """Write our state dict (name -> tensor, or an iterator of pairs) as a sharded folder."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    from titan_moe.hf.adapter import model_shapes

    writer = ShardWriter(folder, args, shard_plan(model_shapes(args), max_shard_bytes))
    for name, tensor in items:
        writer.add(name, tensor)
    writer.close()
