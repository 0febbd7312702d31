"""torchtitan's `StateDictAdapter` for our decoder: our own Hugging Face layout.

The layout is our state dict under Hugging Face's usual prefixes, tensor for tensor, so a
save and a load are bit-exact and work on sharded (DTensor) state dicts unchanged:

    tok_embeddings.weight, layers.N...., norm.weight   ->  model.<same name>
    output.weight                                       ->  lm_head.weight

Routed experts stay stacked (`model.layers.N.feed_forward.experts.w_gate_up`
[experts, latent, 2 * hidden], gate columns first). The public Kimi K3 layout (per-expert
names, MXFP4) is read by `titan_moe.hf.kimi_k3`, which converts into this one.

A save writes `model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes`
(counted at 4 bytes per value; whole layers per shard where they fit), their index
`model.safetensors.index.json` (torchtitan's consolidation writes it) and `config.json`
(`write_config`, called by the trainer's checkpointer after the save), which records the
model arguments so that a reader can rebuild the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_moe.model.args import ModelArgs

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MODEL_TYPE = "titan_moe"
MAX_SHARD_BYTES = 4 << 30
_OUTPUT = ("output.weight", "lm_head.weight")
_PREFIX = "model."


def to_hf_name(name: str) -> str:
    return _OUTPUT[1] if name == _OUTPUT[0] else _PREFIX + name


def from_hf_name(name: str) -> str:
    if name == _OUTPUT[1]:
        return _OUTPUT[0]
    if not name.startswith(_PREFIX):
        raise ValueError(f"{name!r} is not a tensor of the {MODEL_TYPE} layout (expected 'model.' or 'lm_head.weight')")
    return name[len(_PREFIX):]


def model_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Our state dict's names and shapes, from a model built on the meta device."""
    from titan_moe.model.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(args)
    return {name: t.shape for name, t in model.state_dict().items()}


def shard_plan(shapes: dict[str, torch.Size], max_shard_bytes: int = MAX_SHARD_BYTES,
               bytes_per_value: int = 4) -> dict[str, int]:
    """HF name -> shard number (from 1). Tensors keep the state dict's order; a new shard
    starts when the next layer (or loose tensor) would overflow the current one, and a single
    group larger than the limit gets a shard of its own."""
    groups: list[tuple[str, list[str], int]] = []  # (group key, names, bytes)
    for name, shape in shapes.items():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "layers" else name
        size = bytes_per_value * int(torch.Size(shape).numel())
        if groups and groups[-1][0] == key:
            groups[-1][1].append(name)
            groups[-1] = (key, groups[-1][1], groups[-1][2] + size)
        else:
            groups.append((key, [name], size))
    plan: dict[str, int] = {}
    shard, used = 1, 0
    for _, names, size in groups:
        if used and used + size > max_shard_bytes:
            shard, used = shard + 1, 0
        used += size
        for name in names:
            plan[to_hf_name(name)] = shard
    return plan


def config_dict(args: ModelArgs) -> dict[str, Any]:
    return {"architectures": ["TitanMoeForCausalLM"], "model_type": MODEL_TYPE,
            "model_args": dataclasses.asdict(args)}


def write_config(folder: str, args: ModelArgs) -> str:
    path = os.path.join(folder, CONFIG_FILE)
    with open(path, "w") as f:
        json.dump(config_dict(args), f, indent=2)
        f.write("\n")
    return path


def read_config(folder: str) -> ModelArgs:
    """The model arguments recorded in `folder/config.json` (ValueError: not our layout)."""
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path}: model_type is {config.get('model_type')!r}, not {MODEL_TYPE!r}")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in config["model_args"].items() if k in known})


def write_index(folder: str) -> None:
    """`model.safetensors.index.json` from the headers of the folder's `model-*.safetensors`
    (torchtitan's consolidation writes it only under torch.distributed)."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    for name in sorted(os.listdir(folder)):
        if name.startswith("model-") and name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    weight_map[key] = name
                    sl = f.get_slice(key)
                    total += int(torch.Size(sl.get_shape()).numel()) * _DTYPE_BYTES[sl.get_dtype()]
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def finish_save(folder: str, args: ModelArgs) -> None:
    """After torchtitan's HF save (rank 0): config.json, the index json if the save wrote
    none, and away with the per-rank parts in `folder/sharded` that the shards replace."""
    import shutil

    write_config(folder, args)
    if not os.path.isfile(os.path.join(folder, INDEX_FILE)):
        write_index(folder)
    parts = os.path.join(folder, "sharded")
    if os.path.isdir(parts):
        shutil.rmtree(parts)


class TitanStateDictAdapter(StateDictAdapter):
    """Registered in our train spec; torchtitan builds it as `(model_args, hf_assets_path)`."""

    def __init__(self, model_args: ModelArgs, hf_assets_path: str | None, *,
                 max_shard_bytes: int = MAX_SHARD_BYTES):
        # Not the base class's __init__: it would take the shard plan from an index json in
        # hf_assets_path (for us, the tokenizer folder); ours comes from the model's shapes.
        self.model_args = model_args
        self.hf_assets_path = hf_assets_path
        self.max_shard_bytes = max_shard_bytes
        self._plan: dict[str, int] | None = None

    @property
    def fqn_to_index_mapping(self) -> dict[str, int]:
        """HF name -> shard number; planned at the first HF save or load, not at start-up."""
        if self._plan is None:
            self._plan = shard_plan(model_shapes(self.model_args), self.max_shard_bytes)
        return self._plan

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = {to_hf_name(name): value for name, value in state_dict.items()}
        last = max(self.fqn_to_index_mapping.values(), default=1)
        for name in out:  # a tensor the plan has not seen (e.g. added by a converter): last shard
            self.fqn_to_index_mapping.setdefault(name, last)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {from_hf_name(name): value for name, value in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> HuggingFaceStorageReader:
        if from_quantized:
            raise ValueError("checkpoint.initial_load_in_hf_quantized: our layout is not quantized; convert a "
                             "quantized Kimi K3 checkpoint first (python -m titan_moe.hf import-k3 --help)")
        if not os.path.isfile(os.path.join(path, INDEX_FILE)) and not any(
                name.endswith(".safetensors") for name in os.listdir(path)):
            raise ValueError(f"{path} holds no safetensors files")
        return HuggingFaceStorageReader(path)
