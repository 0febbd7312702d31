"""Zero what ``torch._grouped_mm`` leaves unwritten, without touching what it wrote.

The native backend must return zero rows past ``offs[-1]`` and a zero weight gradient for
empty groups (the contract in :mod:`.reference`); ``torch._grouped_mm`` writes neither. A
``masked_fill`` over the whole output reads and writes every element (at the benchmark
shape, M=65536 x N=1408 bf16, about 0.37 GB of traffic per call) to change, in training,
nothing: every row belongs to a group and empty groups are rare. These kernels read
``offs`` on the device, so no host sync, and most programs exit after one scalar load:

* ``zero_rows_past_(out_MN, offs_E)``: rows ``[offs[-1], M)`` of ``out_MN`` set to zero.
* ``zero_empty_groups_(dw_EKN, offs_E)``: ``dw[e] = 0`` for every ``e`` with an empty group.

Both return their argument. They run on CUDA tensors (or on CPU under the Triton
interpreter, for tests); the op's CPU path zeroes with ``masked_fill`` instead
(:func:`titan_moe.ops.grouped_gemm.op._zero_unwritten_rows`). This module imports Triton, so
the op imports it only when a CUDA tensor needs it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.triton_runtime import is_interpreted

_ROWS, _COLS = 64, 128  # rows x columns per program of the row kernel
_SPLITS = 64  # programs per group of the empty-group kernel
_BLOCK = 1024  # elements per store of the empty-group kernel


# Builtins only (tl.full, integer division), no triton.language.standard jit functions, and a
# while loop under the interpreter: the conventions of `.triton_kernel`, for the same reasons.
@triton.jit
def _zero_rows_past_kernel(out, offs, M, N, stride_m, E: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    owned = tl.load(offs + E - 1).to(tl.int64)
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    if row0 + ROWS > owned:  # else every row of this program is owned: nothing to do
        rows = row0 + tl.arange(0, ROWS)
        cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
        mask = ((rows >= owned) & (rows < M))[:, None] & (cols < N)[None, :]
        zeros = tl.full((ROWS, COLS), 0, out.dtype.element_ty)
        tl.store(out + rows[:, None] * stride_m + cols[None, :], zeros, mask=mask)


@triton.jit
def _zero_empty_groups_kernel(dw, offs, numel_per_group, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                              INTERPRETED: tl.constexpr):
    e = tl.program_id(0)
    end = tl.load(offs + e)
    start = tl.load(offs + e - 1, mask=e > 0, other=0)
    if end <= start:  # an empty group: this program zeroes its share of dw[e]
        share = (numel_per_group + SPLITS - 1) // SPLITS
        lo = tl.program_id(1).to(tl.int64) * share
        hi = lo + share
        base = dw + e.to(tl.int64) * numel_per_group
        zeros = tl.full((BLOCK,), 0, dw.dtype.element_ty)
        if INTERPRETED:
            i = lo
            while i < hi:
                idx = i + tl.arange(0, BLOCK)
                tl.store(base + idx, zeros, mask=(idx < hi) & (idx < numel_per_group))
                i += BLOCK
        else:
            for i in tl.range(lo, hi, BLOCK):
                idx = i + tl.arange(0, BLOCK)
                tl.store(base + idx, zeros, mask=(idx < hi) & (idx < numel_per_group))


def zero_rows_past_(out_MN: Tensor, offs_E: Tensor) -> Tensor:
    """Zero rows ``[offs[-1], M)`` of ``out_MN`` [M, N] (row-major) in place; returns it."""
    M, N = out_MN.shape
    if M == 0 or N == 0:
        return out_MN
    assert out_MN.stride(1) == 1, "zero_rows_past_ takes a row-major output"
    grid = (triton.cdiv(M, _ROWS), triton.cdiv(N, _COLS))
    _zero_rows_past_kernel[grid](out_MN, offs_E, M, N, out_MN.stride(0), E=offs_E.shape[0], ROWS=_ROWS, COLS=_COLS)
    return out_MN


def zero_empty_groups_(dw_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """Set ``dw[e] = 0`` in place for every empty group ``e`` of ``offs_E``; returns ``dw_EKN``
    (contiguous [E, K, N])."""
    E = dw_EKN.shape[0]
    if dw_EKN.numel() == 0:
        return dw_EKN
    assert dw_EKN.is_contiguous(), "zero_empty_groups_ takes a contiguous weight gradient"
    per_group = dw_EKN.numel() // E
    _zero_empty_groups_kernel[(E, _SPLITS)](dw_EKN, offs_E, per_group, SPLITS=_SPLITS, BLOCK=_BLOCK,
                                            INTERPRETED=is_interpreted(_zero_empty_groups_kernel))
    return dw_EKN
