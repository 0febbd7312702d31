"""Triton forward of ``titan_moe::router_topk``: sigmoid, bias, top-k, gather and
normalisation of a block of token rows in one pass over the logits.

One program per ``BLOCK_N`` rows. It loads the rows' logits once as a
``[BLOCK_N, BLOCK_E]`` register tile (``BLOCK_E`` = n rounded up to a power of two, padding
masked), computes ``s = sigmoid(x)`` and the biased scores, and turns each biased score into
the unique int64 ranking key of :func:`titan_moe.ops.router.reference.ranking_key`
(order-preserving fp32 bits in the high word, ``2^32-1-j`` in the low word: larger biased
score first, lower expert index on ties). Then ``k`` rounds of: one max-reduction of the
keys per row (the winner's index is decoded from the low word), one gathered load of the
winner's logit to recompute its unbiased score (the same sigmoid expression as the tile,
so the same value), and retiring the winner's key. The selected scores collect in a
``[BLOCK_N, BLOCK_K]`` register tile; the row sums, the normalised weights and all three
outputs are written at the end. Memory traffic: the logits once (``4 N n`` bytes), the
bias, and ``16 N k`` bytes of outputs; nothing ``[N, n]`` is written.

The backward is not a kernel: see :mod:`titan_moe.ops.router.op`.

Block sizes are starting points, not measured on a GPU: ``BLOCK_N * BLOCK_E`` = 2048 keys
per program (16 KB of int64 registers over 4 warps), at least one row, at most 16 rows.
Under ``TRITON_INTERPRET=1`` (tests) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_moe.ops.triton_runtime import cdiv, is_interpreted, kernel_runs_on, next_power_of_2

_KEYS_PER_PROGRAM = 2048
_MAX_BLOCK_N = 16


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _router_topk_fwd_kernel(
    logits_ptr, bias_ptr, idx_ptr, weights_ptr, scores_ptr,
    N, n, stride_row, routed_scale,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < N
    col_ok = cols < n
    row_base = rows.to(tl.int64) * stride_row

    x = tl.load(logits_ptr + row_base[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    v = _sigmoid(x.to(tl.float32)) + b[None, :]
    v = tl.where(v == 0.0, 0.0, v)  # -0.0 -> +0.0: the key compares them equal
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    low32 = tl.full([], 4294967295, tl.int64)  # 2^32 - 1 (explicit int64: a bare literal is uint32)
    key = (ordered << 32) | (low32 - cols.to(tl.int64))[None, :]
    retired = tl.full([BLOCK_N, BLOCK_E], -9223372036854775808, tl.int64)
    key = tl.where(col_ok[None, :], key, retired)  # padding columns never win

    slots = tl.arange(0, BLOCK_K)
    idx_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.int64)
    score_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in range(TOP_K):
        best = tl.max(key, axis=1)
        col = low32 - (best & low32)  # [BLOCK_N] int64, < n for every valid row
        col = tl.minimum(col, n - 1)  # only rows past N (masked) can decode garbage
        x_sel = tl.load(logits_ptr + row_base + col, mask=row_ok, other=0.0)
        s_sel = _sigmoid(x_sel.to(tl.float32))
        key = tl.where(cols[None, :].to(tl.int64) == col[:, None], retired, key)
        in_slot = slots[None, :] == j
        idx_acc = tl.where(in_slot, col[:, None], idx_acc)
        score_acc = tl.where(in_slot, s_sel[:, None], score_acc)

    total = tl.sum(score_acc, axis=1)
    weights = score_acc / total[:, None] * routed_scale
    out_off = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    out_mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(idx_ptr + out_off, idx_acc, mask=out_mask)
    tl.store(weights_ptr + out_off, weights, mask=out_mask)
    tl.store(scores_ptr + out_off, score_acc, mask=out_mask)


def interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_router_topk_fwd_kernel)


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return kernel_runs_on(_router_topk_fwd_kernel, device)


def block_sizes(n_experts: int, top_k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_E, BLOCK_K) for ``n_experts`` columns and ``top_k`` outputs per row."""
    block_e = next_power_of_2(n_experts)
    block_n = max(1, min(_MAX_BLOCK_N, _KEYS_PER_PROGRAM // block_e))
    return block_n, block_e, next_power_of_2(top_k)


def router_topk_triton(
    logits_Nn: torch.Tensor, bias_n: torch.Tensor, top_k: int, routed_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as :func:`titan_moe.ops.router.reference.router_topk_torch`.

    ``logits_Nn`` [N, n] fp32 with unit column stride (any row stride), ``bias_n`` [n].
    """
    if not runs_on(logits_Nn.device):
        raise ValueError(
            f"router_topk_triton: cannot run on {logits_Nn.device} "
            f"({'interpreted' if interpreted() else 'compiled'} kernel)"
        )
    if logits_Nn.stride(1) != 1:
        logits_Nn = logits_Nn.contiguous()
    bias_n = bias_n.contiguous()
    N, n = logits_Nn.shape
    expert_idx_Nk = torch.empty(N, top_k, dtype=torch.int64, device=logits_Nn.device)
    weights_Nk = torch.empty(N, top_k, dtype=torch.float32, device=logits_Nn.device)
    scores_Nk = torch.empty(N, top_k, dtype=torch.float32, device=logits_Nn.device)
    if N == 0:
        return weights_Nk, expert_idx_Nk, scores_Nk
    block_n, block_e, block_k = block_sizes(n, top_k)
    grid = (cdiv(N, block_n),)
    _router_topk_fwd_kernel[grid](
        logits_Nn, bias_n, expert_idx_Nk, weights_Nk, scores_Nk,
        N, n, logits_Nn.stride(0), float(routed_scale),
        TOP_K=top_k, BLOCK_N=block_n, BLOCK_E=block_e, BLOCK_K=block_k,
        num_warps=4 if block_e <= 1024 else 8,
    )
    return weights_Nk, expert_idx_Nk, scores_Nk
