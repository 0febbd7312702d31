"""Zero what ``torch._grouped_mm`` leaves unwritten, without touching what it wrote.

The native backend must return zero rows past ``offs[-1]`` and a zero weight gradient for
empty groups (the contract in :mod:`.reference`); ``torch._grouped_mm`` writes neither. A
``masked_fill`` over the whole output reads and writes every element (at the benchmark
shape, M=65536 x N=1408 bf16, about 0.37 GB of traffic per call) to change, in training,
nothing: every row belongs to a group and empty groups are rare. These kernels read
``offs`` on the device, so no host sync, and most programs exit after one scalar load
(the row kernel's grid is bounded, its programs loop over the tail):

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

from titan_moe.ops.triton_runtime import cdiv, is_interpreted

_ROWS, _COLS = 64, 128  # rows x columns per store of the row kernel
_ROW_PROGRAMS = 64  # its programs per column block (a tail of up to 4096 rows in one step)
_SPLITS = 64  # programs per group of the empty-group kernel
_BLOCK = 1024  # elements per store of the empty-group kernel


# Builtins only (tl.full, integer division), no triton.language.standard jit functions, and a
# while loop under the interpreter: the conventions of `.triton_kernel`, for the same reasons.
@triton.jit
def _zero_rows_past_kernel(out, offs, M, N, stride_m, programs, E: tl.constexpr, ROWS: tl.constexpr,
                           COLS: tl.constexpr, INTERPRETED: tl.constexpr):
    """``programs`` programs per column block stride over the row blocks from the one holding
    offs[-1] to M: with no rows past offs[-1] (training's usual case) each program loads one
    scalar and ends, so the kernel costs the same at any M (a program per row block of the
    whole output took 0.019 ms on the H200 at M = 65,536, N = 1408, zeroing nothing).
    offs[-1] is clamped into [0, M]: offsets that break the contract write nothing outside."""
    owned = tl.minimum(tl.maximum(tl.load(offs + E - 1).to(tl.int64), 0), M)
    first = (owned // ROWS) * ROWS + tl.program_id(0).to(tl.int64) * ROWS
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    zeros = tl.full((ROWS, COLS), 0, out.dtype.element_ty)
    if INTERPRETED:
        row0 = first
        while row0 < M:
            _zero_rows(out, row0, owned, M, N, stride_m, cols, zeros, ROWS)
            row0 += programs * ROWS
    else:
        for row0 in tl.range(first, M, programs * ROWS):
            _zero_rows(out, row0, owned, M, N, stride_m, cols, zeros, ROWS)


@triton.jit
def _zero_rows(out, row0, owned, M, N, stride_m, cols, zeros, ROWS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    mask = ((rows >= owned) & (rows < M))[:, None] & (cols < N)[None, :]
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


def zero_rows_past_(out_MN: Tensor, offs_E: Tensor, programs: int = _ROW_PROGRAMS) -> Tensor:
    """Zero rows ``[offs[-1], M)`` of ``out_MN`` [M, N] (row-major) in place; returns it.
    ``programs``: programs per column block (fewer than the row blocks: they loop)."""
    M, N = out_MN.shape
    if M == 0 or N == 0:
        return out_MN
    assert out_MN.stride(1) == 1, "zero_rows_past_ takes a row-major output"
    programs = max(1, min(programs, cdiv(M, _ROWS)))
    grid = (programs, cdiv(N, _COLS))
    _zero_rows_past_kernel[grid](out_MN, offs_E, M, N, out_MN.stride(0), programs, E=offs_E.shape[0], ROWS=_ROWS,
                                 COLS=_COLS, INTERPRETED=is_interpreted(_zero_rows_past_kernel))
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
