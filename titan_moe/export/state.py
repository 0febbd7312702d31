"""The decode state of the exported programs as a flat tuple of tensors.

`torch.export` programs take and return tensors only, so the per-layer cache objects of
eager generation (`KDACache`, `MLACache` with its Python-int ``length``) become one tuple,
in this order:

    pos                      int64 []          tokens already in the state (same for every row)
    doc_start                int64 [B]         first cache slot the next token may attend to: 0,
                                               or the start of the row's last document after a
                                               packed prefill
    then per layer i, in layer order:
      KDA: layer{i}.conv_state       [B, conv_size-1, 3*H*dk]   model dtype
           layer{i}.recurrent_state  [B, H, dk, dv]             fp32
      MLA: layer{i}.c_kv             [B, L, kv_lora_rank]       model dtype (normalised latent)
           layer{i}.k_shared         [B, L, qk_shared_dim]      model dtype

``L`` is the capacity of the MLA buffers (fixed when the state is created, any value in
the decode program); slots ``[doc_start, pos)`` of each row hold the tokens the next token
attends to, later slots are zeros. `state_specs` names every entry with its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_moe.model.args import ModelArgs
from titan_moe.model.kda import KDACache
from titan_moe.model.mla import MLACache

# symbolic sizes used in `StateSpec.shape`
BATCH = "B"
CAPACITY = "L"


@dataclass(frozen=True)
class StateSpec:
    """One entry of the flat decode state: its name, shape (ints, or BATCH / CAPACITY) and dtype."""

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}


def state_specs(args: ModelArgs, dtype: torch.dtype) -> list[StateSpec]:
    """The entries of the decode state, in order, for a model whose activations are `dtype`."""
    specs = [StateSpec("pos", (), torch.int64), StateSpec("doc_start", (BATCH,), torch.int64)]
    H, d = args.kda_n_heads, args.kda_head_dim
    for i, kind in enumerate(args.layer_kinds()):
        if kind == "kda":
            specs.append(StateSpec(f"layer{i}.conv_state", (BATCH, args.kda_conv_size - 1, 3 * H * d), dtype))
            specs.append(StateSpec(f"layer{i}.recurrent_state", (BATCH, H, d, d), torch.float32))
        else:
            specs.append(StateSpec(f"layer{i}.c_kv", (BATCH, CAPACITY, args.mla_kv_lora_rank), dtype))
            specs.append(StateSpec(f"layer{i}.k_shared", (BATCH, CAPACITY, args.mla_qk_shared_dim), dtype))
    return specs


def empty_state(
    args: ModelArgs,
    batch_size: int,
    capacity: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """A state holding no token: zeros everywhere (``pos = 0``, ``doc_start = 0``)."""
    if batch_size <= 0 or capacity <= 0:
        raise ValueError(f"batch_size and capacity must be > 0, got {batch_size} and {capacity}")
    sizes = {BATCH: batch_size, CAPACITY: capacity}
    return tuple(
        torch.zeros([sizes.get(s, s) for s in spec.shape], dtype=spec.dtype, device=device)
        for spec in state_specs(args, dtype)
    )


def state_from_caches(caches: list[KDACache | MLACache]) -> tuple[torch.Tensor, ...]:
    """The flat state equivalent to eager decode caches (`Decoder.new_caches`, after use).

    Every MLA cache must hold the same number of tokens (they do after eager generation).
    The tensors are contiguous copies where the caches hold views (AOTInductor programs
    assume contiguous inputs).
    """
    lengths = {c.length for c in caches if isinstance(c, MLACache)}
    if len(lengths) > 1:
        raise ValueError(f"MLA caches hold different numbers of tokens: {sorted(lengths)}")
    if not caches:
        raise ValueError("no caches given")
    first = caches[0]
    B = first.conv_state.shape[0] if isinstance(first, KDACache) else first.c_kv.shape[0]
    device = first.conv_state.device if isinstance(first, KDACache) else first.c_kv.device
    pos = lengths.pop() if lengths else 0
    flat = [torch.tensor(pos, dtype=torch.int64, device=device), torch.zeros(B, dtype=torch.int64, device=device)]
    for cache in caches:
        if isinstance(cache, KDACache):
            flat += [cache.conv_state, cache.recurrent_state]
        else:
            flat += [cache.c_kv, cache.k_shared]
    return tuple(t.contiguous() for t in flat)
