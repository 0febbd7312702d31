"""Packed causal attention through FlexAttention (CUDA), with a block mask built from the
documents' starts without any T x T tensor.

`doc_block_mask` is built once per forward, outside the compiled and checkpointed layers,
and passed to every MLA layer. For query block i and key block j (`block_size` tokens each):

* no key of j is visible to any query of i when ``j > i`` or when j ends before the
  earliest document start among i's queries: the block is skipped;
* every key of j is visible to every query of i when ``j < i`` and j begins at or after the
  latest start among i's queries (``j * block_size >= starts[last query of i]``): a full
  block, computed without calling the mask;
* otherwise the block is partial and the kernel applies ``starts[q] <= kv <= q``.

The block tables are [B, T / block, T / block] int32 (4 MiB per row at 128K tokens).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_BLOCK = 128


def _ordered_blocks(blocks_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """(count [B, 1, Q], indices [B, 1, Q, K]) of a boolean block table, the True blocks first."""
    count_BQ = blocks_BQK.sum(dim=-1, dtype=torch.int32)
    order_BQK = torch.argsort(blocks_BQK.to(torch.int8), dim=-1, descending=True, stable=True)
    return count_BQ[:, None], order_BQK.to(torch.int32)[:, None]


def doc_block_mask(starts_BT: Tensor, block_size: int = DEFAULT_BLOCK):
    """A `BlockMask` for queries and keys of one packed batch (module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = starts_BT.shape
    n_blocks = -(-T // block_size)
    padded_BP = torch.nn.functional.pad(starts_BT, (0, n_blocks * block_size - T), mode="replicate") \
        if n_blocks * block_size != T else starts_BT
    first_start_BQ = padded_BP[:, ::block_size]
    last_start_BQ = starts_BT[:, torch.clamp(torch.arange(1, n_blocks + 1, device=starts_BT.device) * block_size - 1, max=T - 1)]
    q_Q1 = torch.arange(n_blocks, device=starts_BT.device)[:, None]
    k_1K = torch.arange(n_blocks, device=starts_BT.device)[None, :]
    touched_BQK = (k_1K <= q_Q1) & (k_1K >= (first_start_BQ // block_size)[..., None])
    full_BQK = (k_1K < q_Q1) & (k_1K * block_size >= last_start_BQ[..., None])
    partial_BQK = touched_BQK & ~full_BQK

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= padded_BP[b, q_idx])

    kv_num, kv_idx = _ordered_blocks(partial_BQK)
    full_num, full_idx = _ordered_blocks(full_BQK)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=same_doc_causal, seq_lengths=(T, T)
    )


def _compile_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# Made at import (compiling itself waits for the first call): a module global assigned
# lazily inside a checkpointed, compiled layer is a side effect Dynamo refuses.
_compiled_flex_attention = _compile_flex()


def flex_doc_attention(q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, block_mask, scale: float) -> Tensor:
    """o [B, H, T, V] of FlexAttention under `block_mask` (from `doc_block_mask`). The kernel
    is compiled once per process (inlined when the caller is itself compiled)."""
    # fp32 at K3's head dims (qk 192, v 128): the default forward tiles need more shared
    # memory than an H100/H200 SM has; one pipeline stage fits. bf16 keeps the defaults.
    options = {"fwd_num_stages": 1} if q_BHTK.dtype == torch.float32 else None
    return _compiled_flex_attention(q_BHTK, k_BHTK, v_BHTV, block_mask=block_mask, scale=scale, kernel_options=options)
