"""Triton grouped GEMM: the forward and both backward products of ``grouped_mm``.

Contract as in :mod:`titan_moe.ops.grouped_gemm.reference`: rows of ``x`` sorted by group,
``offs_E`` int32 cumulative group ends (``offs[e-1]:offs[e]`` are group ``e``'s rows,
``offs[-1] := 0``), empty groups and any group size allowed, fp32 accumulation.

Two kernels:

``_ragged_m_kernel``  ``c[rows of e] = a[rows of e] @ b[e]``, a [M, K], b [E, K, N] (any
    strides), c [M, N]. The forward (``b = w``) and ``dx`` (``b = w^T``, a strided view of
    ``w``, no copy). The row range of ``c`` is cut into output tiles of BLOCK_M rows x
    BLOCK_N columns that never straddle a group boundary. The rows past ``offs[-1]`` form
    one more pseudo-group, E, whose tiles store zeros: the kernel writes every row of ``c``
    exactly once, so ``c`` is allocated with ``torch.empty``.

``_ragged_k_kernel``  ``dw[e] = x[rows of e]^T @ grad[rows of e]``, x [M, K], grad [M, N],
    dw [E, K, N]. Output tiles are fixed (E x K-tiles x N-tiles); each one reduces over its
    group's rows in steps of BLOCK_M. Empty groups store zeros.

fp8 forms (``SCALED``): the same two kernels with float8_e4m3fn operands and the
dequantization in the epilogue, for the fp8 experts (``titan_moe.float8.grouped_mm``'s
``kernels``). ``scaled_grouped_mm_triton``: ``c = (a @ b[e]) * sa[rows] * sb[e, cols]``, b
K-major per expert (TMA [N, K] boxes on sm90), bf16 out; faster than
``torch._scaled_grouped_mm`` at every benchmark shape on the H200 (1.07x forward at E = 64,
1.6x at K3's 146-row groups, whose 128-row CUTLASS tiles run half empty).
``scaled_grouped_mm_dw_triton``: ``dw[e] = (x^T g)[e] * sx[e, :, None] * sg[e, None, :]``
from column-major codes, bf16 or fp32 out; with TMA stores and two programs per SM level
with torch's at K3, behind it under Zipf at E = 64 (opt-in).

Tail tiles (``TileConfig.tail_m``, forward / dx): a group's rows past its last full
BLOCK_M tile run in TAIL_M-row tiles whose product is computed transposed
(``(a @ b)^T = b^T a^T``: the few rows are the tensor cores' N side, which may be as small
as 8, and the weight columns their 64-row M side; both operands stay K-major, as fp8 wgmma
needs). K3's 144-160-row groups then compute 160 rows where a 256-row tile computed 256.
The fp8 forward / dx take them on sm90 for groups of at most ``SMALL_GROUP_ROWS`` rows on
average (11% faster forward at K3's latent shapes on the H200). 16-bit operands may instead
keep the tail tiles upright (``TileConfig.tail_upright``, opt-in: a [TAIL_M, BLOCK_N] tile
like any other, meant for tails of 64 rows or more, where the transposed product's 64-row M
side would be the weight columns and its N side the rows). Timed at E = 64 on the H200
(128- and 64-row tails of 256- and 128-row tiles): slower than the default at E = 64's
balanced and Zipf groups, forward and dx; untimed at K3's small groups.

TMA stores (``TileConfig.store_tma``): each output tile leaves through a TMA box, and the
compiler waits for it only before the next tile's epilogue refills the staging buffer (one
buffer outside the persistent loop, checked in the sm90 TTGIR), so a tile's stores overlap
the program's next loads and dots. In the dw kernel every tile (the box is clipped at K and
N); in the forward / dx kernel only tiles whose rows all belong to their group (a box would
overwrite the next group's rows), the others through masked pointer stores. The sm90
default of both kernels, 16-bit and fp8 (0-2% faster forward / dx at the four benchmark shapes).

Tile scheduling (persistent): ``num_programs`` programs (the SM count on a GPU) walk the
tile list with stride ``num_programs`` (read in-kernel, so no recompilation per grid size).
The list is ordered by group, so all tiles that read ``b[e]`` are adjacent and that matrix
stays in L2 while they run. For the ragged-M kernel the list depends on the group sizes:
every program loads ``offs`` once, computes the per-group tile counts
``ceil(size_e / BLOCK_M)`` and their inclusive prefix sum, and maps a tile index to its
group by counting the prefix entries <= the tile's row-tile index. Nothing is read on the
host and nothing is launched besides the kernel, so the launch is CUDA-graph and
``torch.compile`` friendly (the op is opaque to the compiler). The number of row tiles is
bounded by ``ceil(M / BLOCK_M) + E + 1``, which sizes the grid without reading ``offs``.

Loads: masked pointer loads by default (any strides; on sm90 the compiler turns them into
a cp.async pipeline feeding wgmma). The ragged-M kernel has a TMA variant
(``USE_TMA``: host tensor descriptors for ``a`` and ``b``, zero-filled box edges; output
rows past the group's end are computed from the next group's rows and never stored),
the default on sm90 (``TITAN_MOE_GROUPED_MM_TMA=0`` turns it off; ``grouped_mm_triton(tma=...)``
forces either): it led the pointer loads at every swept tile. A first GPU test run with it on
failed in the backward (Triton encodes host descriptors before binding a CUDA context, and
autograd's device thread had none); ``ensure_cuda_context`` binds the primary context per
thread, and the grouped-GEMM and MoE GPU tests then passed with TMA on (forty-ninth run).

GPU status (H200, BENCHMARKS.md "Grouped GEMM" sections): outputs, dx and dw bit-identical to
``torch._grouped_mm``'s. Timed in interleaved rounds (the fair comparison, forty-eighth run)
at E = 64: the TMA forward 1.02-1.03x the peer, dx 0.93-0.97x, dw 0.77-0.86x; at K3's small
groups the forward trails too; so ``native`` is the op's default. (Earlier runs, timed one
provider after another, showed the TMA forward 1.13-1.26x ahead on imbalanced groups.)
Tested: results under the interpreter (fp32/fp16, both load variants), the compiled code
path builds for sm90 with wgmma and a software pipeline, and bf16 against float64 on CUDA
(``tests/test_grouped_gemm_triton.py``).

Robustness: group bounds are clamped into ``[0, M]`` in-kernel, so offsets that violate
the contract give wrong numbers but never an out-of-bounds access. The host checks the
contract only where that costs no device sync (see ``op.py``).

Precision: fp32 inputs use ``ieee`` fp32 dots (matches the fp32 reference); bf16/fp16
inputs use tensor-core dots with fp32 accumulators. Outputs are cast to the input dtype
once, at the store. Under ``TRITON_INTERPRET=1`` (CPU tests) bf16 ``tl.dot`` is computed
wrongly by the interpreter; fp32 and fp16 are exact there.

Tile sizes: on sm90 the winners of a tile sweep (``SM90_TILES``); elsewhere starting points
chosen from the shared-memory budget of an H100/H200 (228 KB per SM), not tuned.
``profiling/bench_moe.py --sweep-tiles`` times each product over candidate tiles beside
``torch._grouped_mm``, and ``$TITAN_MOE_GROUPED_MM_TILES`` (``tile_overrides``) runs the whole
op with other tiles before they become defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from titan_moe.ops import launch_env
from titan_moe.ops.backend import is_sm90
from titan_moe.ops.triton_runtime import (
    cdiv,
    check_runs_on,
    ensure_cuda_context,
    ensure_scratch_allocator,
    is_interpreted,
    kernel_runs_on,
    next_power_of_2,
    row_major_descriptor,
    sm_count,
    tma_describable,
)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TMA_ENV = "TITAN_MOE_GROUPED_MM_TMA"  # "0": pointer loads on sm90 too (default: TMA on sm90)
# the dw kernels' loads: "0" pointers, "1" host TMA descriptors (16-bit only), "group" per-group
# descriptors made in the kernel (default: "group" for 16-bit on sm90, else pointers), see
# `grouped_mm_dw_triton`, `scaled_grouped_mm_dw_triton`
DW_TMA_ENV = "TITAN_MOE_GROUPED_MM_DW_TMA"
# GPU tile overrides, e.g. "mk=128x256x64x8x3,k=64x128x128x8x4", see `default_config`
TILES_ENV = "TITAN_MOE_GROUPED_MM_TILES"
_KINDS = ("mk", "k", "mk8", "k8")  # "mk8", "k8": the fp8 kernels (scaled_grouped_mm_triton, _dw_triton)


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------
# Triton 3.6's interpreter cannot take a runtime bound in range() (it calls int() on a
# 1-element array), so under INTERPRETED the loops are while loops; compiled, they are for
# loops, which the compiler software-pipelines (the next step's loads overlap this dot).
# The loop bodies are shared helpers.
#
# Only builtins and our own jit functions are used (tl.reduce / tl.associative_scan with
# `_add`, tl.full, integer division), not triton.language.standard's jit functions
# (tl.sum, tl.cumsum, tl.cdiv, tl.zeros): those stay compiled-only when triton was
# imported before TRITON_INTERPRET=1 was set, and the interpreter then refuses them.


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _mk_step(acc, a, b, rows, cols, row_ok, col_ok, group, row_start, col_start, k0, K,
             stride_am, stride_ak, stride_be, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PRECISION: tl.constexpr, USE_TMA: tl.constexpr, B_TRANSPOSED: tl.constexpr,
             SWAPPED: tl.constexpr):
    """acc += a[rows, k0:k0+BLOCK_K] @ b[group, k0:k0+BLOCK_K, cols], or with SWAPPED its
    transpose (acc [BLOCK_N, BLOCK_M]): the few rows of a tail tile become the tensor cores'
    N side (any multiple of 8) and the weight columns their M side (64 per warp group); both
    operands stay K-major, as fp8 tensor cores need."""
    if USE_TMA:
        # Box loads; out-of-range rows/columns read as zero. Rows past the group's end
        # belong to the next group: they only feed output rows that are never stored.
        a_tile = a.load([row_start, k0])
        if B_TRANSPOSED:  # b is w [E, N, K] (dx): load [BLOCK_N, BLOCK_K] and transpose
            b_tile = tl.trans(b.load([group, col_start, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            b_tile = b.load([group, k0, col_start]).reshape(BLOCK_K, BLOCK_N)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a_tile = tl.load(a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak,
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_tile = tl.load(b + group.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    if SWAPPED:
        acc = tl.dot(tl.trans(b_tile), tl.trans(a_tile), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mk_store(acc, c_ptr, c_desc, sa_ptr, sb_ptr, rows, cols, row_ok, col_ok, group, row_start, row_end, col_start,
              N, E, stride_cm, stride_cn, BLOCK_M: tl.constexpr, SCALED: tl.constexpr, STORE_TMA: tl.constexpr):
    """Dequantize (fp8) and store one [rows, cols] tile of the output. With STORE_TMA, a tile
    whose BLOCK_M rows all belong to its group leaves through the [BLOCK_M, BLOCK_N] boxes of
    ``c_desc`` (asynchronously, see ``TileConfig.store_tma``); a group's last, partial tile
    through masked pointer stores (a box would overwrite the next group's rows)."""
    if SCALED:  # a's row scales sa [M], b's column scales sb [E, N] (none for the tail)
        scale_a = tl.load(sa_ptr + rows, mask=row_ok, other=0.0)
        scale_b = tl.load(sb_ptr + group.to(tl.int64) * N + cols, mask=col_ok & (group < E), other=0.0)
        acc = acc * scale_a[:, None] * scale_b[None, :]
    out = acc.to(c_ptr.dtype.element_ty)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    if STORE_TMA:
        if row_start + BLOCK_M <= row_end:
            c_desc.store([row_start, col_start], out)
        else:
            tl.store(c, out, mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(c, out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _mk_block(
    a, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E, group, row_start, row_end, n_tile,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    SCALED: tl.constexpr, SWAPPED: tl.constexpr, STORE_TMA: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile from row_start (rows from row_end on not stored);
    with SWAPPED (tail tiles) computed transposed."""
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N

    if SWAPPED:
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    else:
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_stop = tl.where(group < E, K, 0)  # the tail pseudo-group (rows past offs[-1]) stores zeros
    if INTERPRETED:
        k0 = tl.full([], 0, tl.int32)
        while k0 < k_stop:
            acc = _mk_step(acc, a, b, rows, cols, row_ok, col_ok, group, row_start, n_tile * BLOCK_N, k0, K,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, USE_TMA, B_TRANSPOSED, SWAPPED)
            k0 += BLOCK_K
    else:
        for k0 in tl.range(0, k_stop, BLOCK_K):
            acc = _mk_step(acc, a, b, rows, cols, row_ok, col_ok, group, row_start, n_tile * BLOCK_N, k0, K,
                           stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, USE_TMA, B_TRANSPOSED, SWAPPED)
    if SWAPPED:
        acc = tl.trans(acc)
    _mk_store(acc, c_ptr, c_desc, sa_ptr, sb_ptr, rows, cols, row_ok, col_ok, group, row_start, row_end,
              n_tile * BLOCK_N, N, E, stride_cm, stride_cn, BLOCK_M, SCALED, STORE_TMA and not SWAPPED)


@triton.jit
def _mk_tile(
    tile, a, a_tail, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    e_idx, starts, ends, m_tiles, m_tiles_incl, n_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    SCALED: tl.constexpr, TAIL_M: tl.constexpr, STORE_TMA: tl.constexpr, TAIL_UPRIGHT: tl.constexpr = False,
):
    m_tile = tile // n_tiles
    n_tile = tile % n_tiles
    # group = the number of groups whose row tiles all come before this one
    group = tl.reduce((m_tiles_incl <= m_tile).to(tl.int32), 0, _add)
    is_group = e_idx == group
    first_tile = tl.reduce(tl.where(is_group, m_tiles_incl - m_tiles, 0), 0, _add)
    group_start = tl.reduce(tl.where(is_group, starts, 0), 0, _add)
    row_end = tl.reduce(tl.where(is_group, ends, 0), 0, _add)
    j = m_tile - first_tile  # the row tile within its group
    if TAIL_M > 0:
        # a group's rows: full BLOCK_M tiles, then what is left in TAIL_M tiles
        full = (row_end - group_start) // BLOCK_M
        if j >= full:
            # `a_tail` describes boxes of [TAIL_M, BLOCK_K] (the same tensor as `a`)
            _mk_block(a_tail, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E, group,
                      group_start + full * BLOCK_M + (j - full) * TAIL_M, row_end, n_tile,
                      stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                      TAIL_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, B_TRANSPOSED, SCALED,
                      not TAIL_UPRIGHT, False)  # c_desc's boxes are BLOCK_M rows: pointer stores
        else:
            _mk_block(a, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E, group, group_start + j * BLOCK_M, row_end,
                      n_tile, stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                      BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, B_TRANSPOSED, SCALED, False,
                      STORE_TMA)
    else:
        _mk_block(a, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E, group, group_start + j * BLOCK_M, row_end, n_tile,
                  stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, B_TRANSPOSED, SCALED, False, STORE_TMA)


@triton.jit
def _ragged_m_kernel(
    a, b, c_ptr, offs_ptr,
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= E + 1 (the real groups plus the tail)
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr = False,  # a, b are tensor descriptors (see grouped_mm_triton)
    B_TRANSPOSED: tl.constexpr = False,  # with USE_TMA: b describes w [E, N, K] (the dx product)
    sa_ptr=None, sb_ptr=None,  # with SCALED: fp32 row scales of a [M] and column scales of b [E, N]
    SCALED: tl.constexpr = False,  # fp8 operands: c = (a @ b[e]) * sa[:, None] * sb[e][None, :]
    a_tail=None,  # with TAIL_M: a again (with USE_TMA: a descriptor of [TAIL_M, BLOCK_K] boxes)
    TAIL_M: tl.constexpr = 0,  # > 0: each group's last rows (past its full BLOCK_M tiles) in TAIL_M-row tiles
    TAIL_UPRIGHT: tl.constexpr = False,  # 16-bit only: tail tiles as [TAIL_M, BLOCK_N] products, not transposed
    c_desc=None,  # with STORE_TMA: a descriptor of c [M, N], boxes [BLOCK_M, BLOCK_N]
    STORE_TMA: tl.constexpr = False,  # full tiles stored through c_desc
):
    # Schedule: per-group row ranges (clamped into [0, M]) and row-tile prefix sums.
    e_idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
    ends = tl.minimum(tl.where(e_idx < E, ends, M), M)  # entry E (the tail) and padding end at M
    starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx <= E), other=0)
    starts = tl.maximum(tl.minimum(tl.where(e_idx > E, M, starts), M), 0)
    sizes = tl.maximum(ends - starts, 0)
    if TAIL_M > 0:
        m_tiles = sizes // BLOCK_M + (sizes % BLOCK_M + TAIL_M - 1) // TAIL_M
    else:
        m_tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    m_tiles_incl = tl.associative_scan(m_tiles, 0, _add)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    total = tl.reduce(m_tiles, 0, _add) * n_tiles

    pid = tl.program_id(0)
    if INTERPRETED:
        tile = pid
        while tile < total:
            _mk_tile(tile, a, a_tail, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E,
                     stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                     e_idx, starts, ends, m_tiles, m_tiles_incl, n_tiles,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, B_TRANSPOSED, SCALED, TAIL_M,
                     STORE_TMA, TAIL_UPRIGHT)
            tile += tl.num_programs(0)
    else:
        for tile in tl.range(pid, total, tl.num_programs(0)):
            _mk_tile(tile, a, a_tail, b, c_ptr, c_desc, sa_ptr, sb_ptr, N, K, E,
                     stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                     e_idx, starts, ends, m_tiles, m_tiles_incl, n_tiles,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, B_TRANSPOSED, SCALED, TAIL_M,
                     STORE_TMA, TAIL_UPRIGHT)


@triton.jit
def _k_step(acc, x_ptr, g_ptr, ks, cols, k_ok, col_ok, k_start, n_start, m0, row_start, row_end,
            stride_xm, stride_xk, stride_gm, stride_gn,
            BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, GROUP_TMA: tl.constexpr,
            COLUMN_MAJOR: tl.constexpr):
    """acc += x[m0:m0+BLOCK_M, ks]^T @ g[m0:m0+BLOCK_M, cols], rows from row_end on excluded."""
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    if GROUP_TMA:
        # descriptors of this group's rows alone (row 0 = row_start): the copy engine reads the
        # rows past the group's end as zeros, so both operands go from shared memory to the
        # tensor cores untouched (transposed shared-memory operands where the layout needs it)
        if COLUMN_MAJOR:  # descriptors of x^T [K, rows], g^T [N, rows]: the reduction contiguous
            x_t = x_ptr.load([k_start, m0 - row_start])
            g = tl.trans(g_ptr.load([n_start, m0 - row_start]))
        else:
            x_t = tl.trans(x_ptr.load([m0 - row_start, k_start]))
            g = g_ptr.load([m0 - row_start, n_start])
    elif USE_TMA:
        # Box loads (columns past K or N read as zero). The rows past the group's end belong
        # to the next group and would enter the sum: zeroed in x^T, the dot's A operand,
        # which the tensor cores take from registers.
        x_t = tl.where(row_ok[None, :], tl.trans(x_ptr.load([m0, k_start])), 0.0)
        g = g_ptr.load([m0, n_start])
    else:
        rows64 = rows.to(tl.int64)
        x_t = tl.load(  # [BLOCK_K, BLOCK_M]: a tile of x^T
            x_ptr + rows64[None, :] * stride_xm + ks[:, None] * stride_xk,
            mask=k_ok[:, None] & row_ok[None, :], other=0.0,
        )
        g = tl.load(
            g_ptr + rows64[:, None] * stride_gm + cols[None, :] * stride_gn,
            mask=row_ok[:, None] & col_ok[None, :], other=0.0,
        )
    return tl.dot(x_t, g, acc, input_precision=PRECISION)


@triton.jit
def _k_tile_place(tile, n_tiles, tiles_per_group, K, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Where dw tile ``tile`` lies: its group, output rows ``ks`` and columns ``cols`` (and
    their masks)."""
    group = tile // tiles_per_group
    within = tile % tiles_per_group
    k_start = within // n_tiles * BLOCK_K
    n_start = within % n_tiles * BLOCK_N
    ks = k_start + tl.arange(0, BLOCK_K)
    cols = n_start + tl.arange(0, BLOCK_N)
    return group, k_start, n_start, ks, cols, ks < K, cols < N


@triton.jit
def _k_store(acc, dw_ptr, sx_ptr, sg_ptr, group, k_start, n_start, ks, cols, k_ok, col_ok, N, K,
             stride_we, stride_wk, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SCALED: tl.constexpr, STORE_TMA: tl.constexpr):
    """A finished dw tile: dequantized (SCALED) and stored."""
    if SCALED:  # dequantize: per-group column scales of x, sx [E*K], and of g, sg [E*N]
        scale_x = tl.load(sx_ptr + group.to(tl.int64) * K + ks, mask=k_ok, other=0.0)
        scale_g = tl.load(sg_ptr + group.to(tl.int64) * N + cols, mask=col_ok, other=0.0)
        acc = acc * scale_x[:, None] * scale_g[None, :]
    if STORE_TMA:
        # a [1, BLOCK_K, BLOCK_N] box of dw [E, K, N]: the copy engine clips rows past K and
        # columns past N, and the store is asynchronous (the next tile's loads and dots run
        # while it drains)
        dw_ptr.store([group, k_start, n_start], tl.reshape(acc.to(dw_ptr.dtype), [1, BLOCK_K, BLOCK_N]))
    else:
        dw = dw_ptr + group.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
        tl.store(dw, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


@triton.jit
def _k_tile(
    tile, x_ptr, g_ptr, dw_ptr, offs_ptr, sx_ptr, sg_ptr, M, N, K,
    stride_xm, stride_xk, stride_gm, stride_gn, stride_we, stride_wk, stride_wn,
    n_tiles, tiles_per_group,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr, SCALED: tl.constexpr,
    STORE_TMA: tl.constexpr, GROUP_TMA: tl.constexpr, COLUMN_MAJOR: tl.constexpr,
):
    group, k_start, n_start, ks, cols, k_ok, col_ok = _k_tile_place(tile, n_tiles, tiles_per_group, K, N,
                                                                    BLOCK_N, BLOCK_K)
    row_start = tl.load(offs_ptr + group - 1, mask=group > 0, other=0)
    row_start = tl.minimum(tl.maximum(row_start, 0), M)
    row_end = tl.maximum(tl.minimum(tl.load(offs_ptr + group), M), row_start)
    if SCALED:
        # fp8 groups start and end at multiples of 16 rows (the caller's contract): the row
        # masks of the column-major operands are then uniform over 16-byte vectors, which the
        # compiler needs for asynchronous copies of 1-byte elements
        row_start = tl.multiple_of(row_start, 16)
        row_end = tl.multiple_of(row_end, 16)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    x_src, g_src = x_ptr, g_ptr
    if GROUP_TMA:  # x_ptr, g_ptr are pointers; at least one row (an empty group loads nothing)
        rows_in_group = tl.maximum(row_end - row_start, 1)
        if COLUMN_MAJOR:  # unit row strides (the fp8 codes' column buffers)
            x_src = tl.make_tensor_descriptor(x_ptr + row_start, shape=[K, rows_in_group], strides=[stride_xk, 1],
                                              block_shape=[BLOCK_K, BLOCK_M])
            g_src = tl.make_tensor_descriptor(g_ptr + row_start, shape=[N, rows_in_group], strides=[stride_gn, 1],
                                              block_shape=[BLOCK_N, BLOCK_M])
        else:  # unit column strides
            x_src = tl.make_tensor_descriptor(x_ptr + row_start.to(tl.int64) * stride_xm,
                                              shape=[rows_in_group, K], strides=[stride_xm, 1],
                                              block_shape=[BLOCK_M, BLOCK_K])
            g_src = tl.make_tensor_descriptor(g_ptr + row_start.to(tl.int64) * stride_gm,
                                              shape=[rows_in_group, N], strides=[stride_gm, 1],
                                              block_shape=[BLOCK_M, BLOCK_N])
    if INTERPRETED:
        m0 = row_start
        while m0 < row_end:
            acc = _k_step(acc, x_src, g_src, ks, cols, k_ok, col_ok, k_start, n_start, m0, row_start, row_end,
                          stride_xm, stride_xk, stride_gm, stride_gn, BLOCK_M, PRECISION, USE_TMA, GROUP_TMA,
                          COLUMN_MAJOR)
            m0 += BLOCK_M
    else:
        for m0 in tl.range(row_start, row_end, BLOCK_M):
            acc = _k_step(acc, x_src, g_src, ks, cols, k_ok, col_ok, k_start, n_start, m0, row_start, row_end,
                          stride_xm, stride_xk, stride_gm, stride_gn, BLOCK_M, PRECISION, USE_TMA, GROUP_TMA,
                          COLUMN_MAJOR)
    _k_store(acc, dw_ptr, sx_ptr, sg_ptr, group, k_start, n_start, ks, cols, k_ok, col_ok, N, K,
             stride_we, stride_wk, stride_wn, BLOCK_N, BLOCK_K, SCALED, STORE_TMA)


@triton.jit
def _ragged_k_kernel(
    x_ptr, g_ptr, dw_ptr, offs_ptr,
    M, N, K, E,
    stride_xm, stride_xk,
    stride_gm, stride_gn,
    stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr = False,  # x_ptr, g_ptr are tensor descriptors (see grouped_mm_dw_triton)
    sx_ptr=None, sg_ptr=None,  # with SCALED: fp32 per-group column scales of x [E*K] and g [E*N]
    SCALED: tl.constexpr = False,  # fp8 operands: dw[e] = (x^T g)[e] * sx[e][:, None] * sg[e][None, :]
    STORE_TMA: tl.constexpr = False,  # dw_ptr is a tensor descriptor of dw [E, K, N], boxes [1, BLOCK_K, BLOCK_N]
    GROUP_TMA: tl.constexpr = False,  # x_ptr, g_ptr loaded through per-group device-side descriptors
    COLUMN_MAJOR: tl.constexpr = False,  # with GROUP_TMA: x, g have unit row strides (else unit column strides)
):
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = (K + BLOCK_K - 1) // BLOCK_K * n_tiles
    total = E * tiles_per_group
    pid = tl.program_id(0)
    if INTERPRETED:
        tile = pid
        while tile < total:
            _k_tile(tile, x_ptr, g_ptr, dw_ptr, offs_ptr, sx_ptr, sg_ptr, M, N, K,
                    stride_xm, stride_xk, stride_gm, stride_gn, stride_we, stride_wk, stride_wn,
                    n_tiles, tiles_per_group, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, SCALED,
                    STORE_TMA, GROUP_TMA, COLUMN_MAJOR)
            tile += tl.num_programs(0)
    else:
        for tile in tl.range(pid, total, tl.num_programs(0)):
            _k_tile(tile, x_ptr, g_ptr, dw_ptr, offs_ptr, sx_ptr, sg_ptr, M, N, K,
                    stride_xm, stride_xk, stride_gm, stride_gn, stride_we, stride_wk, stride_wn,
                    n_tiles, tiles_per_group, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, INTERPRETED, USE_TMA, SCALED,
                    STORE_TMA, GROUP_TMA, COLUMN_MAJOR)


@triton.jit
def _group_row_ranges(offs_ptr, M, E, BLOCK_E: tl.constexpr):
    """Lanes ``e < E`` of [BLOCK_E]: group e's rows [starts, ends), clamped into [0, M] (as
    `_k_tile` clamps them); other lanes empty."""
    e_idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
    starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx < E), other=0)
    starts = tl.minimum(tl.maximum(starts, 0), M)
    ends = tl.maximum(tl.minimum(ends, M), starts)
    return e_idx, starts, ends


@triton.jit
def _ragged_k_flat_kernel(
    x_ptr, g_ptr, dw_ptr, offs_ptr,
    M, N, K, E,
    stride_xm, stride_xk,
    stride_gm, stride_gn,
    stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= E
    PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr = False,
    sx_ptr=None, sg_ptr=None,
    SCALED: tl.constexpr = False,
    STORE_TMA: tl.constexpr = False,
):
    """`_ragged_k_kernel`'s tiles and arguments (but per-group descriptors) in one flat loop:
    each iteration is one reduction step of the program's current tile, and a tile's last
    step stores it and moves to the program's next tile. The compiler's software pipeline
    then spans tiles: the first steps of the next tile load while this tile finishes, where
    the nested loops drain and refill the pipeline at every tile (K3's groups of 144-160
    rows are two or three steps per tile). The tile state (group, row range) comes from all
    groups' row ranges held in registers, so the next step's addresses need no load. An
    empty group's tile runs one step with every row masked, and stores zeros."""
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = (K + BLOCK_K - 1) // BLOCK_K * n_tiles
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e_idx, starts, ends = _group_row_ranges(offs_ptr, M, E, BLOCK_E)
    # this program's steps: its tiles of group e are those t = pid + j * programs in
    # [e * tiles_per_group, (e + 1) * tiles_per_group), each max(1, cdiv(rows, BLOCK_M)) steps
    first = e_idx * tiles_per_group
    mine = (tl.maximum(first + tiles_per_group - pid + programs - 1, 0) // programs
            - tl.maximum(first - pid + programs - 1, 0) // programs)
    steps = tl.maximum((ends - starts + BLOCK_M - 1) // BLOCK_M, 1)
    total_steps = tl.reduce(tl.where(e_idx < E, mine * steps, 0), 0, _add)

    tile = pid
    step = pid * 0  # the step within the tile
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    if INTERPRETED:
        it = pid * 0
        while it < total_steps:
            acc, tile, step = _k_flat_step(acc, tile, step, programs, x_ptr, g_ptr, dw_ptr, sx_ptr, sg_ptr,
                                           e_idx, starts, ends, N, K, stride_xm, stride_xk, stride_gm, stride_gn,
                                           stride_we, stride_wk, stride_wn, n_tiles, tiles_per_group,
                                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, USE_TMA, SCALED, STORE_TMA)
            it += 1
    else:
        for _ in tl.range(0, total_steps):
            acc, tile, step = _k_flat_step(acc, tile, step, programs, x_ptr, g_ptr, dw_ptr, sx_ptr, sg_ptr,
                                           e_idx, starts, ends, N, K, stride_xm, stride_xk, stride_gm, stride_gn,
                                           stride_we, stride_wk, stride_wn, n_tiles, tiles_per_group,
                                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, USE_TMA, SCALED, STORE_TMA)


@triton.jit
def _k_flat_step(acc, tile, step, programs, x_ptr, g_ptr, dw_ptr, sx_ptr, sg_ptr, e_idx, starts, ends, N, K,
                 stride_xm, stride_xk, stride_gm, stride_gn, stride_we, stride_wk, stride_wn,
                 n_tiles, tiles_per_group, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCALED: tl.constexpr, STORE_TMA: tl.constexpr):
    """One reduction step of `_ragged_k_flat_kernel`; returns (acc, tile, step) for the next."""
    is_group = e_idx == tile // tiles_per_group
    row_start = tl.reduce(tl.where(is_group, starts, 0), 0, _add)
    row_end = tl.reduce(tl.where(is_group, ends, 0), 0, _add)
    if SCALED:  # 16-row multiples (the caller's contract, see `_k_tile`) in a form the compiler
        # can see: it drops a divisibility hint on a reduction's result
        row_start = row_start // 16 * 16
        row_end = row_end // 16 * 16
    group, k_start, n_start, ks, cols, k_ok, col_ok = _k_tile_place(tile, n_tiles, tiles_per_group, K, N,
                                                                    BLOCK_N, BLOCK_K)
    m0 = row_start + step * BLOCK_M
    acc = _k_step(acc, x_ptr, g_ptr, ks, cols, k_ok, col_ok, k_start, n_start, m0, row_start, row_end,
                  stride_xm, stride_xk, stride_gm, stride_gn, BLOCK_M, PRECISION, USE_TMA, False, False)
    last = m0 + BLOCK_M >= row_end
    if last:
        _k_store(acc, dw_ptr, sx_ptr, sg_ptr, group, k_start, n_start, ks, cols, k_ok, col_ok, N, K,
                 stride_we, stride_wk, stride_wn, BLOCK_N, BLOCK_K, SCALED, STORE_TMA)
        acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    tile = tl.where(last, tile + programs, tile)
    step = tl.where(last, 0, step + 1)
    return acc, tile, step


# ----------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel call.

    ``block_m`` is the row tile (the reduction step for ``dw``), ``block_n`` the output
    column tile, ``block_k`` the reduction step (the output row tile for ``dw``). All three
    must be powers of two >= 16 (``tl.dot``). ``num_programs=None`` means
    ``programs_per_sm`` programs per SM on a GPU (more than one lets one program's stores and
    epilogue overlap another's loads and dots, where shared memory and registers let them
    share an SM: the weight gradient of small groups, whose tiles run only two or three
    reduction steps each) and 4 under the interpreter (so the persistent loop runs several
    tiles per program in the CPU tests). ``store_tma``: write the output tiles through TMA,
    asynchronously, so that a tile's store drains while the same program loads and multiplies
    its next tile (the compiler waits for it only before the next store reuses the staging
    buffer); in the forward / dx kernel only tiles whose rows all belong to their group (a
    group's last, partial tile, and tail tiles, keep masked pointer stores); pointer stores
    wherever TMA cannot describe the output. ``tail_m``
    (forward / dx kernels only; 0 = off): each group's rows past its last full ``block_m``
    tile run in ``tail_m``-row tiles, computed transposed (the rows on the tensor cores' N
    side), so that groups of a few hundred rows do not fill most of a ``block_m`` tile with
    the next group's rows: K3's 144-160-row groups in 256-row tiles compute 1.7x their FLOPs.
    ``tail_upright`` (16-bit forward / dx only): the tail tiles computed as [tail_m, block_n]
    products like the full tiles, not transposed; meant for tails of 64 rows or more (one
    warp group's wgmma rows), e.g. 128-row tails of 256-row tiles under skewed group sizes.
    ``flat`` (dw kernels only): the tiles' reduction steps in one loop
    (`_ragged_k_flat_kernel`), so that the software pipeline runs across tiles.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    num_programs: int | None = None
    programs_per_sm: int = 1
    store_tma: bool = False
    tail_m: int = 0
    flat: bool = False
    tail_upright: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_programs is not None and self.num_programs < 1:
            raise ValueError(f"TileConfig.num_programs must be >= 1, got {self.num_programs}")
        if self.programs_per_sm < 1:
            raise ValueError(f"TileConfig.programs_per_sm must be >= 1, got {self.programs_per_sm}")
        t = self.tail_m
        if t and (t < 16 or t & (t - 1) or t >= self.block_m):
            raise ValueError(f"TileConfig.tail_m must be 0 or a power of two >= 16 below block_m "
                             f"({self.block_m}), got {t}")
        if self.tail_upright and not t:
            raise ValueError("TileConfig.tail_upright needs tail tiles (tail_m > 0)")


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_ragged_m_kernel)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return kernel_runs_on(_ragged_m_kernel, device)


def _num_programs(cfg: TileConfig, device: torch.device, max_tiles: int) -> int:
    if cfg.num_programs is not None:
        n = cfg.num_programs
    elif device.type == "cuda":
        n = sm_count(device.index) * cfg.programs_per_sm
    else:
        n = 4
    return max(1, min(n, max_tiles))


def tile_overrides() -> dict[str, TileConfig]:
    """`$TITAN_MOE_GROUPED_MM_TILES` (read per call), "KIND=SPEC,...", KIND "mk" (the forward
    and dx kernel), "k" (the dw kernel), "mk8" / "k8" (their fp8 forms), SPEC as
    :func:`parse_tile` reads it: the GPU tiles of that kernel in place of `default_config`'s
    (to time a tile sweep's winner through the whole op before it becomes a default)."""
    text = launch_env.read(TILES_ENV) or ""
    out: dict[str, TileConfig] = {}
    for item in filter(None, text.split(",")):
        kind, _, spec = item.partition("=")
        if kind not in _KINDS:
            raise ValueError(f"{TILES_ENV}: KIND must be one of {_KINDS}, got {kind!r}")
        out[kind] = parse_tile(spec, kind, f"{TILES_ENV}: {item!r}")
    return out


_TILE_SPEC = re.compile(r"(\d+(?:x\d+){4,5})(?:r(\d+)(u?))?(t?)(f?)")


def parse_tile(spec: str, kind: str, where: str = "tile") -> TileConfig:
    """``BMxBNxBKxWARPSxSTAGES[xPROGRAMS][rTAIL[u]][t][f]`` of a ``kind`` kernel as a TileConfig:
    PROGRAMS persistent programs per SM (default 1), rTAIL ``tail_m`` (forward / dx kinds "mk",
    "mk8"), "u" after it ``tail_upright`` (16-bit kind "mk" only), "t" ``store_tma``, "f"
    ``flat`` (dw kinds "k", "k8")."""
    match = _TILE_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"{where}: expected BMxBNxBKxWARPSxSTAGES[xPROGRAMS][rTAIL[u]][t][f], got {spec!r}")
    bm, bn, bk, warps, stages, *programs = (int(v) for v in match[1].split("x"))
    tail, upright, store_tma, flat = int(match[2] or 0), bool(match[3]), bool(match[4]), bool(match[5])
    if tail and kind not in ("mk", "mk8"):
        raise ValueError(f"{where}: tail tiles (rTAIL) are for the forward / dx kinds mk and mk8")
    if upright and kind != "mk":
        raise ValueError(f"{where}: upright tail tiles (u) are for the 16-bit forward / dx kind mk "
                         "(fp8 tensor cores need the transposed product's K-major operands)")
    if flat and kind not in ("k", "k8"):
        raise ValueError(f"{where}: the flat loop (f) is for the dw kinds k and k8")
    if warps < 1 or warps & (warps - 1) or stages < 1 or (programs and programs[0] < 1):
        raise ValueError(f"{where}: warps must be a power of two, stages and programs >= 1")
    return TileConfig(bm, bn, bk, num_warps=warps, num_stages=stages, programs_per_sm=programs[0] if programs else 1,
                      store_tma=store_tma, tail_m=tail, flat=flat, tail_upright=upright)


# 16-bit tiles on sm90, the winners of the H200 tile sweep (BENCHMARKS.md, "Grouped GEMM: the
# tile sweep per product, ..."): summed over E = 64 balanced and Zipf(1.1), the TMA forward plus
# dx 2.658 ms at 256x128x64 against 2.850 at the old 128x128x64 (peer 2.752), dw 1.755 against
# 1.866; timed again in interleaved rounds, still ahead of the old tiles by 1-8% per product.
# TMA stores (``t``) in the forward / dx kernels, bf16 and fp8: 0-2% faster at all four benchmark
# shapes, slower at none (BENCHMARKS.md, "fp8 at K3's latent shapes ...", 80th run).
# The bf16 dw: TMA stores, and on sm90 loads through per-group descriptors (`grouped_mm_dw_triton`):
# forward+backward 2-3% ahead of torch._grouped_mm's dw at E = 64 and 7% ahead of pointer loads,
# 3% behind torch's and level with pointer loads at K3's down projection (BENCHMARKS.md, "The dw
# kernels' load forms ...").
# The forward / dx tile for outputs whose width is a multiple of 256 ("mk_n256"): 128x256 keeps
# the widest wgmma (N = 256) with no wasted columns; at other widths (E = 64's 1,408) its last
# column tile would be half empty, and 256x128 stays. Same run, CUDA-graph replays against the
# default (BENCHMARKS.md, "Warp specialization tried; the forward / dx tile by output width"):
# ahead or level at all seven products of width 1,024, 2,048 and 2,816 (+3% to +19%, dx at
# E = 64 balanced -0.3%); at width 1,408 256x128 led or tied in four of five products (the
# exception: the forward under Zipf groups at M = 32K), and the rule keeps it there.
SM90_TILES = {"mk": TileConfig(256, 128, 64, num_warps=8, num_stages=3, store_tma=True),
              "mk_n256": TileConfig(128, 256, 64, num_warps=8, num_stages=3, store_tma=True),
              "k": TileConfig(64, 128, 256, num_warps=8, num_stages=3, store_tma=True),
              # fp8 forward / dx: the best of five tiles at E = 64 and K3's latent shapes (BENCHMARKS.md,
              # "fp8 grouped GEMM on our Triton kernels"); fp8 dw (opt-in: torch's stays the default):
              # with TMA stores, ahead of the earlier 128x128x128x8x4 pointer-store tile at all four
              # benchmark shapes in one run (BENCHMARKS.md, "fp8 at K3's latent shapes ...", 75th run)
              "mk8": TileConfig(256, 128, 128, num_warps=8, num_stages=3, store_tma=True),
              "k8": TileConfig(128, 256, 128, num_warps=8, num_stages=3, store_tma=True),
              # fp8 forward / dx for groups of <= SMALL_GROUP_ROWS rows on average: 128-row tiles and
              # 32-row tail tiles (BENCHMARKS.md, "fp8 at K3's latent shapes ..."): at K3's 144-160-row
              # groups the forward took 1.178 ms against 1.322 for "mk8"; under E = 64's Zipf(1.1)
              # (1,024 rows on average) it lost, 0.529 against 0.501
              "mk8_small": TileConfig(128, 256, 128, num_warps=8, num_stages=3, tail_m=32, store_tma=True)}
SMALL_GROUP_ROWS = 256
"""The mean rows per group up to which the fp8 forward / dx take ``SM90_TILES["mk8_small"]``.
Measured at two points only (146 rows: tail tiles win; 1,024: they lose); 256 is where a
256-row tile holds at most one group on average."""


def _is_sm90(device: torch.device) -> bool:
    """`titan_moe.ops.backend.is_sm90` with compiled kernels (the sm90 launch rules)."""
    return not interpreted() and is_sm90(device)


SM90_SHARED_BYTES = 232448  # shared memory one program may take on an sm90 SM (227 KiB)


def dw_shared_bytes(cfg: TileConfig, operand_bytes: int, out_bytes: int) -> int:
    """Shared memory of the dw kernel (`_ragged_k_kernel`) with tile ``cfg``: its pipeline
    stages of a [BLOCK_M, BLOCK_K] and a [BLOCK_M, BLOCK_N] operand tile, plus, with TMA
    stores, one [BLOCK_K, BLOCK_N] staging buffer of the output. Equal to what Triton 3.6
    reports on sm90 for the fp8 tile 128x256x128x8x3t: 212,992 bytes with bf16 output,
    278,528 with fp32 (which does not fit)."""
    stages = cfg.num_stages * cfg.block_m * (cfg.block_k + cfg.block_n) * operand_bytes
    return stages + (cfg.block_k * cfg.block_n * out_bytes if cfg.store_tma else 0)


def default_config(dtype: torch.dtype, device: torch.device, kind: str,
                   rows_per_group: float | None = None, n_cols: int | None = None) -> TileConfig:
    """Tile defaults per dtype and kernel ("mk" forward/dx, "k" dw, "mk8" / "k8" their fp8
    forms). ``rows_per_group`` (M / E, known on the host): "mk8" on sm90 takes the small-group
    tiles at or below `SMALL_GROUP_ROWS`. ``n_cols`` (the output width N): 16-bit "mk" on sm90
    takes ``SM90_TILES["mk_n256"]`` where N is a multiple of 256.

    16-bit on sm90: `SM90_TILES`, measured. 16-bit on other GPUs (unmeasured starting points):
    128x128 output tiles, 64-deep steps, 4 stages: (128*64 + 64*128) * 2 B = 32 KB of shared
    memory per stage, 128 KB in all. fp32: half the tile edge and 3 stages.
    Under the interpreter the smallest tiles, so that small test shapes cross tile edges.
    On the GPU `$TITAN_MOE_GROUPED_MM_TILES` overrides either kind (`tile_overrides`).
    """
    if device.type != "cuda":
        return TileConfig(16, 16, 16, num_warps=4, num_stages=1)
    override = tile_overrides().get(kind)
    if override is not None:
        return override
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, num_warps=4, num_stages=3)
    if kind == "mk8" and rows_per_group is not None and rows_per_group <= SMALL_GROUP_ROWS and _is_sm90(device):
        return SM90_TILES["mk8_small"]
    if kind in ("mk8", "k8"):
        return SM90_TILES[kind]
    if _is_sm90(device):
        if kind == "mk" and n_cols is not None and n_cols % 256 == 0:
            return SM90_TILES["mk_n256"]
        return SM90_TILES[kind]
    if kind == "k":
        return TileConfig(64, 128, 128, num_warps=8, num_stages=4)
    return TileConfig(128, 128, 64, num_warps=8, num_stages=4)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # the precision only matters for fp32 operands


def _check(name: str, a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"{name}: operands must share a dtype in {_DTYPES}, got {a.dtype} and {b.dtype}")
    if offs_E.dtype != torch.int32 or offs_E.dim() != 1:
        raise ValueError(f"{name}: offs must be a 1-D int32 tensor, got {offs_E.dtype} {tuple(offs_E.shape)}")
    if not (a.device == b.device == offs_E.device):
        raise ValueError(f"{name}: tensors must share a device, got {a.device}, {b.device}, {offs_E.device}")
    check_runs_on(_ragged_m_kernel, a.device, name, "titan_moe.ops.grouped_gemm.triton_kernel")


def _tma_operands(a_MK: torch.Tensor, b_EKN: torch.Tensor, cfg: TileConfig):
    """Host tensor descriptors for the TMA path, or None when the layout does not allow TMA.

    TMA needs a unit last stride, 16-byte aligned other strides and base pointers. ``a`` must
    be row-major; ``b`` may be row-major ([E, K, N] boxes of [1, BK, BN]) or a transposed view
    of a row-major ``w`` [E, N, K] (the dx product: boxes of [1, BN, BK], transposed in-kernel).
    Returns (a_desc, b_desc, b_transposed).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    es = a_MK.element_size()
    K = a_MK.shape[1]
    E, _, N = b_EKN.shape
    a_desc = row_major_descriptor(a_MK, [cfg.block_m, cfg.block_k])
    if a_desc is None or min(E, N) == 0 or b_EKN.data_ptr() % 16:
        return None
    if b_EKN.stride(2) == 1:
        b_view, shape, block, transposed = b_EKN, [E, K, N], [1, cfg.block_k, cfg.block_n], False
    elif b_EKN.stride(1) == 1:
        b_view, shape, block, transposed = b_EKN.transpose(1, 2), [E, N, K], [1, cfg.block_n, cfg.block_k], True
    else:
        return None
    if (b_view.stride(0) * es) % 16 or (b_view.stride(1) * es) % 16:
        return None
    b_desc = TensorDescriptor(b_view, shape, [b_view.stride(0), b_view.stride(1), 1], block)
    return a_desc, b_desc, transposed


def _dw_store_descriptor(dw_EKN: torch.Tensor, cfg: TileConfig):
    """With ``cfg.store_tma``, a TMA descriptor of the contiguous ``dw_EKN`` [E, K, N] with
    boxes of [1, block_k, block_n] (the copy engine clips each box at K and N, so a box never
    spills into the next group), else None (pointer stores): also where TMA cannot describe
    it (a row of N elements not a multiple of 16 bytes)."""
    if not cfg.store_tma or (dw_EKN.shape[2] * dw_EKN.element_size()) % 16 or dw_EKN.data_ptr() % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    if dw_EKN.is_cuda:
        ensure_cuda_context(dw_EKN.device.index if dw_EKN.device.index is not None else torch.cuda.current_device())
    E, K, N = dw_EKN.shape
    return TensorDescriptor(dw_EKN, [E, K, N], [K * N, N, 1], [1, cfg.block_k, cfg.block_n])


def _use_tma(tma: bool | None, device: torch.device) -> bool:
    if tma is not None:
        return tma
    return launch_env.read(TMA_ENV) != "0" and _is_sm90(device)


def grouped_mm_triton(
    a_MK: torch.Tensor,
    b_EKN: torch.Tensor,
    offs_E: torch.Tensor,
    config: TileConfig | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]``; rows past ``offs[-1]`` are zero.

    Args:
        a_MK: [M, K] rows sorted by group, any strides.
        b_EKN: [E, K, N] any strides (``w.transpose(1, 2)`` gives the ``dx`` product).
        offs_E: [E] int32 cumulative group ends (not read on the host).
        config: tile override (default :func:`default_config`, which on sm90 picks the tile
            by the output width N).
        tma: load ``a`` and ``b`` through TMA tensor descriptors. None: on sm90 (Hopper)
            unless ``$TITAN_MOE_GROUPED_MM_TMA`` is "0" (measured faster than pointer loads
            at every swept tile on the H200). True forces it (the interpreter runs it too);
            layouts TMA cannot describe fall back to pointer loads.

    Returns:
        [M, N] contiguous, dtype of ``a_MK``, fp32 accumulation.
    """
    _check("grouped_mm_triton", a_MK, b_EKN, offs_E)
    if a_MK.dim() != 2 or b_EKN.dim() != 3 or a_MK.shape[1] != b_EKN.shape[1] or b_EKN.shape[0] != offs_E.shape[0]:
        raise ValueError(
            f"grouped_mm_triton: expected a [M,K], b [E,K,N], offs [E]; got {tuple(a_MK.shape)}, "
            f"{tuple(b_EKN.shape)}, {tuple(offs_E.shape)}"
        )
    out_MN = a_MK.new_empty(a_MK.shape[0], b_EKN.shape[2])
    cfg = config or default_config(a_MK.dtype, a_MK.device, "mk", n_cols=b_EKN.shape[2])
    _launch_ragged_m(a_MK, b_EKN, offs_E, out_MN, cfg, tma)
    return out_MN


def _launch_ragged_m(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, out_MN: torch.Tensor,
                     cfg: TileConfig, tma: bool | None, scale_a_M: torch.Tensor | None = None,
                     scale_b_EN: torch.Tensor | None = None) -> None:
    """``_ragged_m_kernel`` into ``out_MN`` [M, N]; with scales, the fp8 form (``SCALED``)."""
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    if M == 0 or N == 0:
        return
    # each group adds at most one partial tile, or with tail tiles block_m / tail_m of them
    partial = cdiv(cfg.block_m, cfg.tail_m) if cfg.tail_m else 1
    max_tiles = (cdiv(M, cfg.block_m) + (E + 1) * partial) * cdiv(N, cfg.block_n)
    n_prog = _num_programs(cfg, a_MK.device, max_tiles)
    descriptors = _tma_operands(a_MK, b_EKN, cfg) if _use_tma(tma, a_MK.device) else None
    if descriptors is None:
        a_arg, b_arg, b_transposed = a_MK, b_EKN, False
        a_tail = a_MK
    else:
        a_arg, b_arg, b_transposed = descriptors
        # the same layout as a_arg's (already checked), in boxes of the tail tiles' rows
        a_tail = row_major_descriptor(a_MK, [cfg.tail_m, cfg.block_k]) if cfg.tail_m else a_arg
    # full tiles' stores through TMA where asked for and out_MN allows (None: pointer stores)
    c_desc = row_major_descriptor(out_MN, [cfg.block_m, cfg.block_n]) if cfg.store_tma else None
    _ragged_m_kernel[(n_prog,)](
        a_arg, b_arg, out_MN, offs_E,
        M, N, K, E,
        a_MK.stride(0), a_MK.stride(1),
        b_EKN.stride(0), b_EKN.stride(1), b_EKN.stride(2),
        out_MN.stride(0), out_MN.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_E=next_power_of_2(E + 1),
        PRECISION=_precision(a_MK.dtype), INTERPRETED=interpreted(),
        USE_TMA=descriptors is not None, B_TRANSPOSED=b_transposed,
        sa_ptr=scale_a_M, sb_ptr=scale_b_EN, SCALED=scale_a_M is not None,
        a_tail=a_tail, TAIL_M=cfg.tail_m, c_desc=c_desc, STORE_TMA=c_desc is not None,
        TAIL_UPRIGHT=cfg.tail_upright,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def scaled_grouped_mm_triton(
    a_MK: torch.Tensor,
    b_EKN: torch.Tensor,
    scale_a_M: torch.Tensor,
    scale_b_EN: torch.Tensor,
    offs_E: torch.Tensor,
    config: TileConfig | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """fp8 grouped GEMM with row and column dequantization scales, fp32 accumulation:
    ``out[rows of e] = (a[rows of e] @ b[e]) * scale_a[rows of e, None] * scale_b[e][None, :]``,
    rows past ``offs[-1]`` zero, bf16 output. The contract of ``torch._scaled_grouped_mm``'s
    2d x 3d case (forward and dx of the fp8 experts) without its 16-row rule: any group sizes.

    Args:
        a_MK: [M, K] float8_e4m3fn, rows sorted by group (row-major for the TMA loads).
        b_EKN: [E, K, N] float8_e4m3fn, any strides; on sm90 the tensor cores want it K-major
            per expert (``stride(1) == 1``: the fp8 experts' forward layout, or the dx
            layout's transpose), which the TMA path loads as [N, K] boxes.
        scale_a_M: fp32 [M]; scale_b_EN: fp32 [E, N] contiguous.
        offs_E: [E] int32 cumulative group ends (not read on the host).
        config: tile override (default ``default_config(..., "mk8", rows_per_group=M / E)``: on
            sm90, tail tiles for groups of at most ``SMALL_GROUP_ROWS`` rows on average).
        tma: as :func:`grouped_mm_triton`.

    Returns:
        [M, N] bf16, contiguous.
    """
    fp8 = torch.float8_e4m3fn
    if a_MK.dtype != fp8 or b_EKN.dtype != fp8:
        raise ValueError(f"scaled_grouped_mm_triton: operands must be float8_e4m3fn, got {a_MK.dtype}, {b_EKN.dtype}")
    if a_MK.dim() != 2 or b_EKN.dim() != 3 or a_MK.shape[1] != b_EKN.shape[1] or b_EKN.shape[0] != offs_E.shape[0]:
        raise ValueError(
            f"scaled_grouped_mm_triton: expected a [M,K], b [E,K,N], offs [E]; got {tuple(a_MK.shape)}, "
            f"{tuple(b_EKN.shape)}, {tuple(offs_E.shape)}"
        )
    M, (E, _, N) = a_MK.shape[0], b_EKN.shape
    if scale_a_M.shape != (M,) or scale_b_EN.shape != (E, N) or not scale_b_EN.is_contiguous() \
            or scale_a_M.dtype != torch.float32 or scale_b_EN.dtype != torch.float32:
        raise ValueError(
            f"scaled_grouped_mm_triton: expected fp32 scales a [{M}] and b [{E}, {N}] contiguous, got "
            f"{scale_a_M.dtype} {tuple(scale_a_M.shape)} and {scale_b_EN.dtype} {tuple(scale_b_EN.shape)}"
        )
    if offs_E.dtype != torch.int32 or offs_E.dim() != 1:
        raise ValueError(f"scaled_grouped_mm_triton: offs must be a 1-D int32 tensor, got {offs_E.dtype}")
    if not (a_MK.device == b_EKN.device == offs_E.device == scale_a_M.device == scale_b_EN.device):
        raise ValueError("scaled_grouped_mm_triton: tensors must share a device")
    check_runs_on(_ragged_m_kernel, a_MK.device, "scaled_grouped_mm_triton", "titan_moe.ops.grouped_gemm.triton_kernel")
    out_MN = a_MK.new_empty(M, N, dtype=torch.bfloat16)
    cfg = config or default_config(a_MK.dtype, a_MK.device, "mk8", rows_per_group=M / max(E, 1))
    if cfg.tail_upright:
        raise ValueError("scaled_grouped_mm_triton: fp8 tail tiles must be transposed (tail_upright=False): "
                         "fp8 tensor cores need both operands K-major")
    _launch_ragged_m(a_MK, b_EKN, offs_E, out_MN, cfg, tma,
                     scale_a_M, scale_b_EN)
    return out_MN


def _dw_tma_mode(tma: bool | str | None, default: bool | str = False) -> bool | str:
    """The dw kernels' load form from a launcher's ``tma`` argument, else `DW_TMA_ENV` ("0",
    "1", "group"), else ``default``."""
    if tma is None:
        tma = {"0": False, "1": True, "group": "group"}.get(launch_env.read(DW_TMA_ENV) or "", default)
    if tma not in (True, False, "group"):
        raise ValueError(f'grouped_mm_dw_triton: tma must be None, a bool or "group", got {tma!r}')
    return tma


def grouped_mm_dw_triton(
    x_MK: torch.Tensor, grad_MN: torch.Tensor, offs_E: torch.Tensor, config: TileConfig | None = None,
    tma: bool | str | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ grad[rows of e]`` -> [E, K, N] (zero for empty groups).

    Args:
        x_MK: [M, K], grad_MN: [M, N], rows sorted by group, any strides, same dtype.
        offs_E: [E] int32 cumulative group ends (not read on the host).
        config: tile override; here ``block_k`` x ``block_n`` is the output tile and
            ``block_m`` the reduction step.
        tma: load x and grad through TMA descriptors (boxes of [block_m, block_k] and
            [block_m, block_n]), where their layouts allow, else pointer loads. True: one
            descriptor per operand made on the host; the rows past a group's end are zeroed
            in registers, so x^T reaches the tensor cores from registers. "group": two
            descriptors per tile made on the device over the group's rows alone
            (`tl.make_tensor_descriptor`, 128 bytes of global scratch each, see
            `ensure_scratch_allocator`): the copy engine zero-fills past the group's end and
            both operands stay in shared memory. None: ``$TITAN_MOE_GROUPED_MM_DW_TMA``
            ("0" pointer loads, "1", "group"), else "group" for 16-bit operands on sm90 and
            pointer loads elsewhere (fp32 was not timed): on the H200 the group form with TMA stores led pointer loads by 7%
            and the host form by 11% (forward+backward at E = 64, the bf16 dw's first lead
            over torch._grouped_mm's), level with pointer loads and 4% ahead of the host
            form at K3's down projection (BENCHMARKS.md, "The dw kernels' load forms ...").
        out_dtype: dtype of dw (default x's): fp32 stores the fp32 accumulator itself, for
            fp32 weights, where a 16-bit dw would need a conversion pass.

    Returns:
        [E, K, N] contiguous, ``out_dtype``, fp32 accumulation.
    """
    _check("grouped_mm_dw_triton", x_MK, grad_MN, offs_E)
    if x_MK.dim() != 2 or grad_MN.dim() != 2 or x_MK.shape[0] != grad_MN.shape[0] or offs_E.shape[0] == 0:
        raise ValueError(
            f"grouped_mm_dw_triton: expected x [M,K], grad [M,N], offs [E>=1]; got {tuple(x_MK.shape)}, "
            f"{tuple(grad_MN.shape)}, {tuple(offs_E.shape)}"
        )
    M, K = x_MK.shape
    N = grad_MN.shape[1]
    E = offs_E.shape[0]
    dw_EKN = x_MK.new_empty(E, K, N, dtype=out_dtype or x_MK.dtype)
    if K == 0 or N == 0:
        return dw_EKN
    cfg = config or default_config(x_MK.dtype, x_MK.device, "k")
    max_tiles = E * cdiv(K, cfg.block_k) * cdiv(N, cfg.block_n)
    n_prog = _num_programs(cfg, x_MK.device, max_tiles)
    x_arg, g_arg = x_MK, grad_MN
    tma = _dw_tma_mode(tma, "group" if x_MK.dtype != torch.float32 and _is_sm90(x_MK.device) else False)
    if cfg.flat and tma == "group":  # the flat loop keeps no per-group descriptors
        tma = False
    group_tma = tma == "group" and tma_describable(x_MK) and tma_describable(grad_MN)
    if group_tma:
        ensure_scratch_allocator(x_MK.device)
        tma = False
    elif tma:
        x_desc = row_major_descriptor(x_MK, [cfg.block_m, cfg.block_k])
        g_desc = row_major_descriptor(grad_MN, [cfg.block_m, cfg.block_n])
        tma = x_desc is not None and g_desc is not None
        if tma:
            x_arg, g_arg = x_desc, g_desc
    dw_desc = _dw_store_descriptor(dw_EKN, cfg)
    kernel, extra = _dw_kernel(cfg, E, GROUP_TMA=group_tma)
    kernel[(n_prog,)](
        x_arg, g_arg, dw_EKN if dw_desc is None else dw_desc, offs_E,
        M, N, K, E,
        x_MK.stride(0), x_MK.stride(1),
        grad_MN.stride(0), grad_MN.stride(1),
        dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=_precision(x_MK.dtype), INTERPRETED=interpreted(), USE_TMA=tma, STORE_TMA=dw_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    return dw_EKN


def _dw_kernel(cfg: TileConfig, E: int, **nested_only):
    """The dw kernel of ``cfg`` and its extra arguments: `_ragged_k_flat_kernel` (flat), which
    takes the group count's power of two and none of ``nested_only``, else `_ragged_k_kernel`."""
    if cfg.flat:
        return _ragged_k_flat_kernel, dict(BLOCK_E=next_power_of_2(max(E, 2)))
    return _ragged_k_kernel, nested_only


def scaled_grouped_mm_dw_triton(
    xq_MK: torch.Tensor,
    gq_MN: torch.Tensor,
    scale_x_EK: torch.Tensor,
    scale_g_EN: torch.Tensor,
    offs_E: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: TileConfig | None = None,
    tma: bool | str | None = None,
) -> torch.Tensor:
    """fp8 weight gradient with per-group column scales, fp32 accumulation:
    ``dw[e] = (xq[rows of e]^T @ gq[rows of e]) * scale_x[e][:, None] * scale_g[e][None, :]``
    -> [E, K, N] in ``out_dtype`` (zero for empty groups). The contract of
    ``torch._scaled_grouped_mm``'s 2d x 2d case, with fp32 output without a widening pass.

    Args:
        xq_MK: [M, K] float8_e4m3fn, gq_MN: [M, N] float8_e4m3fn, rows sorted by group; the
            tensor cores want both column-major (``stride(0) == 1``: the contracted rows
            contiguous, as :func:`titan_moe.float8.quantize.requantize_group_columns` returns).
        scale_x_EK: fp32 [E*K] (or [E, K]); scale_g_EN: fp32 [E*N] (or [E, N]), contiguous.
        offs_E: [E] int32 cumulative group ends, multiples of 16 (not read on the host; other
            ends give wrong sums: the kernel loads rows in 16-row vectors), M a multiple of 16.
        out_dtype: bf16 or fp32.
        config: tile override (default ``default_config(..., "k8")``, with TMA stores on the GPU
            for bf16 output, pointer stores for fp32 output).
        tma: "group": load through per-group descriptors made in the kernel (as
            :func:`grouped_mm_dw_triton`'s; the rows past a group's end zero-filled by the copy
            engine), where the layouts allow; anything else (False, True): pointer loads.
            None: "group" if ``$TITAN_MOE_GROUPED_MM_DW_TMA`` is "group" (opt-in).
    """
    fp8 = torch.float8_e4m3fn
    if xq_MK.dtype != fp8 or gq_MN.dtype != fp8:
        raise ValueError(f"scaled_grouped_mm_dw_triton: operands must be float8_e4m3fn, got {xq_MK.dtype}, "
                         f"{gq_MN.dtype}")
    if xq_MK.dim() != 2 or gq_MN.dim() != 2 or xq_MK.shape[0] != gq_MN.shape[0] or offs_E.dim() != 1 \
            or offs_E.shape[0] == 0:
        raise ValueError(f"scaled_grouped_mm_dw_triton: expected x [M,K], g [M,N], offs [E>=1]; got "
                         f"{tuple(xq_MK.shape)}, {tuple(gq_MN.shape)}, {tuple(offs_E.shape)}")
    (M, K), N, E = xq_MK.shape, gq_MN.shape[1], offs_E.shape[0]
    if M % 16:  # the kernel loads rows in 16-row vectors (see _k_tile): a partial one would read past M
        raise ValueError(f"scaled_grouped_mm_dw_triton: M must be a multiple of 16 (the fp8 buffers' rows), got {M}")
    for name, scale, cols in (("x", scale_x_EK, K), ("g", scale_g_EN, N)):
        if scale.dtype != torch.float32 or scale.numel() != E * cols or not scale.is_contiguous():
            raise ValueError(f"scaled_grouped_mm_dw_triton: scales of {name} must be fp32 [E*{cols}] contiguous, "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    if offs_E.dtype != torch.int32:
        raise ValueError(f"scaled_grouped_mm_dw_triton: offs must be int32, got {offs_E.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"scaled_grouped_mm_dw_triton: out_dtype must be bf16 or fp32, got {out_dtype}")
    check_runs_on(_ragged_k_kernel, xq_MK.device, "scaled_grouped_mm_dw_triton",
                  "titan_moe.ops.grouped_gemm.triton_kernel")
    dw_EKN = xq_MK.new_empty(E, K, N, dtype=out_dtype)
    if K == 0 or N == 0:
        return dw_EKN
    cfg = config or default_config(fp8, xq_MK.device, "k8")
    if config is None and dw_shared_bytes(cfg, 1, out_dtype.itemsize) > SM90_SHARED_BYTES:
        cfg = replace(cfg, store_tma=False)  # fp32 out: the staging buffer alone is 128 KiB
    max_tiles = E * cdiv(K, cfg.block_k) * cdiv(N, cfg.block_n)
    dw_desc = _dw_store_descriptor(dw_EKN, cfg)
    group_tma = (_dw_tma_mode(tma) == "group" and not cfg.flat and tma_describable(xq_MK, True)
                 and tma_describable(gq_MN, True))
    if group_tma:
        ensure_scratch_allocator(xq_MK.device)
    kernel, extra = _dw_kernel(cfg, E, GROUP_TMA=group_tma, COLUMN_MAJOR=True)
    kernel[(_num_programs(cfg, xq_MK.device, max_tiles),)](
        xq_MK, gq_MN, dw_EKN if dw_desc is None else dw_desc, offs_E,
        M, N, K, E,
        xq_MK.stride(0), xq_MK.stride(1),
        gq_MN.stride(0), gq_MN.stride(1),
        dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="tf32", INTERPRETED=interpreted(), USE_TMA=False,
        sx_ptr=scale_x_EK, sg_ptr=scale_g_EN, SCALED=True, STORE_TMA=dw_desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    return dw_EKN
