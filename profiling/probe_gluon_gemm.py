"""Grouped GEMM kernels written in Gluon (forward, dx, dw; warp-specialized), probed beside
``torch._grouped_mm`` and our Triton kernels on an sm90 GPU: a probe, not a backend of the op.

Why Gluon: Triton 3.6's automatic warp specialization acts on our forward / dx kernel only
in a form that hung on the H200 (BENCHMARKS.md, "Warp specialization tried ..."). Gluon, the
lower-level language shipped with the same Triton, states the partitions explicitly:

* a load partition (one warp, few registers) walks the persistent tile list and issues the
  TMA copies of each k step's A [BM, BK] and B [BK, BN] boxes into a ring of STAGES shared
  buffers, each guarded by a "ready" mbarrier (the copies' bytes arrive on it) and an
  "empty" one (the consumer releases the slot);
* the default partition (num_warps warps, the registers the load warp gives back) waits for
  each slot, issues an asynchronous wgmma on it, keeps one wgmma in flight, releases the slot
  of the one before, and at the end of a tile stores it: through a TMA box where all its rows
  belong to the tile's group, else through masked pointer stores.

Forward / dx schedules: cooperative (`_ws_grouped_mm_kernel`: all consumer warps on every
tile, the tensor cores idle during its epilogue); ping-pong (`_pingpong_grouped_mm_kernel`,
variants "pp...": two 4-warp consumers take the tiles in turn and hand the mainloop to each
other through a pair of mbarriers, so that one's epilogue overlaps the other's wgmmas, the
schedule of CUTLASS's "pingpong" Hopper kernels); and for comparison one kernel without
partitions (`_pipelined_grouped_mm_kernel`, variants "np..."): the same warps load and
multiply, pipelined by hand across tile boundaries.

The weight gradient (`_ws_grouped_dw_kernel`, variants "dw..."): dw[e] = x[rows of e]^T @
grad[rows of e] in [BK, BN] tiles of dw, each reducing over its group's rows in steps of BM;
the load partition makes a TMA descriptor of the group's rows per tile on the device (the
copy engine zero-fills past the group's end, as the op's Triton dw does), the consumer reads
x's [BM, BK] boxes transposed.

Scope (a probe): 16-bit operands; ``out[rows of e] = a[rows of e] @ b[e]`` for the forward
(b = w [E, K, N] row-major, read as an [E*K, N] matrix in [BK, BN] boxes) and dx (b =
w.transpose(1, 2), read from w as an [E*N, K] matrix in [BN, BK] boxes that the wgmma takes
transposed); the reduction a multiple of BK (so that a box never crosses into the next
expert); any group sizes (a group's last tile reads the next group's rows and never stores
them); rows past offs[-1] left unwritten (the op's kernel stores zeros there; the probe's
group sizes sum to M, so there are none). Each program walks the tiles of the same
group-ordered list as `_ragged_m_kernel` (row tiles never straddle a group).

    python profiling/probe_gluon_gemm.py [VARIANT,...]   # E = 64 balanced and Zipf, M 64K,
                                                         # K 2,048, N 1,408

Each variant runs in its own process under a time limit (a warp-specialized kernel that
deadlocks would hold the GPU), checks its outputs against ``torch._grouped_mm``'s (relative
error below 1e-2) and prints a row of a Markdown table per product.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {  # name: (BM, BN, BK, STAGES, consumer warps; "pp": two 4-warp ping-pong consumers; "np": no
    # warp specialization, the kernel's warps pipelined by hand)
    "128x256x64s3": (128, 256, 64, 3, 8),
    "256x128x64s3": (256, 128, 64, 3, 8),
    "128x128x64s4": (128, 128, 64, 4, 8),
    "pp128x128x64s4": (128, 128, 64, 4, "pp"),
    "pp128x128x64s5": (128, 128, 64, 5, "pp"),
    "pp64x256x64s4": (64, 256, 64, 4, "pp"),
    "np128x256x64s3": (128, 256, 64, 3, 8),
    "np256x128x64s3": (256, 128, 64, 3, 8),
}
PINGPONG_CONSUMER_REGS = 232  # the worker consumer's registers (the default partition gets the rest)
LOAD_REGS = gl.constexpr(40)  # the load partition's registers: its per-group schedule vectors spill at 24


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _schedule(offs_ptr, M, E, BM: gl.constexpr, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
    """The group-ordered row-tile list's bookkeeping, computed once per partition (WARPS: its
    warp count) from offs: per group (a [BLOCK_E] vector, groups >= E empty) its first row,
    its end, its first row tile and its row tiles' inclusive prefix sum; and the row tiles in
    all."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    e = gl.arange(0, BLOCK_E, layout=layout)
    ends = gl.minimum(gl.load(offs_ptr + e, mask=e < E, other=0), M)
    starts = gl.minimum(gl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0), M)
    m_tiles = gl.where(e < E, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0)
    incl = gl.associative_scan(m_tiles, 0, _add)
    return e, starts, ends, incl - m_tiles, incl, gl.sum(m_tiles, axis=0)


@gluon.jit
def _tile_place(tile, e, starts, ends, first, incl, n_tiles, BM: gl.constexpr, BN: gl.constexpr):
    """(row_start, row_end, group, col_start) of a tile: its group is the number of groups
    whose row tiles all come before its row tile."""
    m_tile = tile // n_tiles
    group = gl.sum((incl <= m_tile).to(gl.int32), axis=0)
    is_group = e == group
    row_start = gl.sum(gl.where(is_group, starts + (m_tile - first) * BM, 0), axis=0)
    row_end = gl.sum(gl.where(is_group, ends, 0), axis=0)
    return row_start, row_end, group, (tile % n_tiles) * BN


@gluon.constexpr_function
def c_block_n(b_desc, b_transposed):
    """The output tile's width BN from b's box: [BN, BK] transposed, else [BK, BN]."""
    return b_desc.block_type.shape[0 if b_transposed else 1]


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The ring's "ready" (the copies' bytes arrive) and "empty" (the consumer is done with the
    slot) mbarriers, one of each per stage."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _issue_step(a_desc, b_desc, a_buf, b_buf, ready_bar, row_start, group, col, k, N, K, B_TRANSPOSED: gl.constexpr):
    """TMA copies of one k step's A [BM, BK] and B boxes into a ring slot, their bytes
    arriving on its ready barrier."""
    mbarrier.expect(ready_bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row_start, k], ready_bar, a_buf)
    if B_TRANSPOSED:  # b is w [E*N, K]: boxes [BN, BK]
        tma.async_copy_global_to_shared(b_desc, [group * N + col, k], ready_bar, b_buf)
    else:  # b is w [E*K, N]: boxes [BK, BN]
        tma.async_copy_global_to_shared(b_desc, [group * K + k, col], ready_bar, b_buf)


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, E, K, n_tiles,
                    BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    e, starts, ends, first, incl, row_tiles = _schedule(offs_ptr, M, E, BM, BLOCK_E, 1)
    it = 0
    for tile in range(gl.program_id(0), row_tiles * n_tiles, gl.num_programs(0)):
        row_start, row_end, group, col = _tile_place(tile, e, starts, ends, first, incl, n_tiles, BM, BN)
        for k in range(0, K, BK):
            s = it % STAGES
            # slots start free: the first pass waits on the phase before the barrier's first
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            _issue_step(a_desc, b_desc, a_bufs.index(s), b_bufs.index(s), ready.index(s), row_start, group, col, k,
                        N, K, B_TRANSPOSED)
            it += 1


@gluon.constexpr_function
def mma_layout_of(bn, warps):
    """The wgmma accumulator layout of a [*, bn] tile over ``warps`` warps stacked along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bn, 16])


@gluon.jit
def _mainloop(acc, a_bufs, b_bufs, ready, empty, it, steps, A_TRANSPOSED: gl.constexpr,
              B_TRANSPOSED: gl.constexpr):
    """acc += the tile's ``steps`` ring slots from step ``it`` on: wait for each slot, issue
    its wgmma asynchronously, keep one in flight, release the slot of the one before. A box
    stored transposed (A_TRANSPOSED: [BK, BM], B_TRANSPOSED: [BN, BK]) is handed to the wgmma
    as a permuted view (16-bit wgmma reads either major order from shared memory). Returns
    (acc, the step after the tile's last)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    prev = 0
    for i in range(0, steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a_tile = a_bufs.index(s)
        if A_TRANSPOSED:
            a_tile = a_tile.permute((1, 0))
        b_tile = b_bufs.index(s)
        if B_TRANSPOSED:
            b_tile = b_tile.permute((1, 0))
        acc = warpgroup_mma(a_tile, b_tile, acc, is_async=True)
        # one wgmma in flight: the one before this is done, and its slot can be refilled
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)
        prev = s
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(prev), count=1, pred=steps > 0)
    return acc, it


@gluon.jit
def _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout: gl.constexpr):
    """Store a finished tile: through a TMA box where all its rows belong to its group (after
    the staging buffer's previous box has left), else through masked pointer stores (the
    group's last, partial tile: its rows past row_end belong to the next group)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    out = acc.to(c_desc.dtype)
    if row_start + BM <= row_end:
        tma.store_wait(pendings=0)
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row_start, col], c_smem)
    else:
        rows = row_start + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        cols = col + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
        gl.store(ptrs, out, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, c_smem, c_desc, c_ptr, stride_cm, offs_ptr, M, N, E, K, n_tiles,
                   BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr, num_warps: gl.constexpr):
    """The cooperative consumer: all num_warps warps on every tile (BM / num_warps rows each)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    mma_layout: gl.constexpr = mma_layout_of(BN, num_warps)
    e, starts, ends, first, incl, row_tiles = _schedule(offs_ptr, M, E, BM, BLOCK_E, num_warps)
    it = 0
    for tile in range(gl.program_id(0), row_tiles * n_tiles, gl.num_programs(0)):
        row_start, row_end, group, col = _tile_place(tile, e, starts, ends, first, incl, n_tiles, BM, BN)
        acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
        acc, it = _mainloop(acc, a_bufs, b_bufs, ready, empty, it, K // a_bufs.type.shape[2], False, B_TRANSPOSED)
        _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout)
    tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_partition(a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M, N, E,
                        K, n_tiles, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr, ME: gl.constexpr):
    """One of two 4-warp consumers that take this program's tiles in turn (ME: 0 the even
    ones, 1 the odd ones), each on its own tile and staging buffer, so that one's epilogue
    runs while the other's wgmmas run. The ring is filled in tile order; a consumer enters its
    tile's mainloop only once the other has left the previous tile's (``turns``: ME's
    barrier is the one it waits on, the other's the one it arrives on), so that it never
    waits on a ring slot more than one phase ahead of the producer."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    mma_layout: gl.constexpr = mma_layout_of(BN, 4)
    c_smem = c_smems.index(ME)
    steps = K // a_bufs.type.shape[2]
    e, starts, ends, first, incl, row_tiles = _schedule(offs_ptr, M, E, BM, BLOCK_E, 4)
    j = 0  # this program's tile count so far
    for tile in range(gl.program_id(0), row_tiles * n_tiles, gl.num_programs(0)):
        if j % 2 == ME:
            row_start, row_end, group, col = _tile_place(tile, e, starts, ends, first, incl, n_tiles, BM, BN)
            # my n-th turn (n = j // 2): consumer 0's first passes at once (a fresh barrier
            # counts as having completed the phase before its first)
            mbarrier.wait(turns.index(ME), ((j // 2) & 1) ^ (1 - ME))
            acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
            acc, _ = _mainloop(acc, a_bufs, b_bufs, ready, empty, j * steps, steps, False, B_TRANSPOSED)
            mbarrier.arrive(turns.index(1 - ME), count=1)
            _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout)
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_grouped_mm_kernel(a_desc, b_desc, c_desc, c_ptr, offs_ptr, M, N, E, K, stride_cm,
                          STAGES: gl.constexpr, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                          num_warps: gl.constexpr):
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    n_tiles = (N + BN - 1) // BN
    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready, empty, c_smem, c_desc, c_ptr, stride_cm, offs_ptr, M, N, E, K,
                          n_tiles, BLOCK_E, B_TRANSPOSED, num_warps)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, E, K, n_tiles, BLOCK_E,
                           B_TRANSPOSED)),
    ], [1], [LOAD_REGS])


@gluon.jit
def _pipelined_grouped_mm_kernel(a_desc, b_desc, c_desc, c_ptr, offs_ptr, M, N, E, K, stride_cm,
                                 STAGES: gl.constexpr, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                 num_warps: gl.constexpr):
    """No warp specialization: the same warps issue the loads and the wgmmas, software-
    pipelined by hand over one flat loop of all this program's k steps (every tile has K // BK
    of them), the loads STAGES - 1 steps ahead, across tile boundaries: after step i's wgmma
    is issued and step i - 1's has finished, step i + STAGES - 1 is loaded into i - 1's slot.
    The variants "np..." (a comparison point for the partitioned kernels, and what is left if
    they do not run)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    mma_layout: gl.constexpr = mma_layout_of(BN, num_warps)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, _ = _ring_barriers(STAGES)
    e, starts, ends, first, incl, row_tiles = _schedule(offs_ptr, M, E, BM, BLOCK_E, num_warps)
    n_tiles = (N + BN - 1) // BN
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    k_steps = K // BK
    steps = gl.maximum(row_tiles * n_tiles - pid + programs - 1, 0) // programs * k_steps
    # the load cursor: the tile of the next step to load
    ld_row, ld_end, ld_group, ld_col = _tile_place(pid, e, starts, ends, first, incl, n_tiles, BM, BN)
    for j in gl.static_range(STAGES - 1):
        if j < steps:
            _issue_step(a_desc, b_desc, a_bufs.index(j), b_bufs.index(j), ready.index(j), ld_row, ld_group, ld_col,
                        j * BK, N, K, B_TRANSPOSED)  # (K // BK >= STAGES - 1: the first tile's steps)
    acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
    for i in range(0, steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if i % k_steps == 0:
            acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
        b_tile = b_bufs.index(s)
        if B_TRANSPOSED:
            b_tile = b_tile.permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(s), b_tile, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        nxt = i + STAGES - 1  # into step i - 1's slot, whose wgmma has finished
        if nxt < steps:
            if nxt % k_steps == 0:
                ld_row, ld_end, ld_group, ld_col = _tile_place(pid + (nxt // k_steps) * programs, e, starts, ends,
                                                               first, incl, n_tiles, BM, BN)
            t = nxt % STAGES
            _issue_step(a_desc, b_desc, a_bufs.index(t), b_bufs.index(t), ready.index(t), ld_row, ld_group, ld_col,
                        (nxt % k_steps) * BK, N, K, B_TRANSPOSED)
        if i % k_steps == k_steps - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            row_start, row_end, group, col = _tile_place(pid + (i // k_steps) * programs, e, starts, ends, first,
                                                         incl, n_tiles, BM, BN)
            _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout)
    tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_grouped_mm_kernel(a_desc, b_desc, c_desc, c_ptr, offs_ptr, M, N, E, K, stride_cm,
                                STAGES: gl.constexpr, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Ping-pong: consumer 0 is the default partition (num_warps = 4), consumer 1 a 4-warp
    worker with CONSUMER_REGS registers, the load partition a 1-warp worker."""
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smems = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    n_tiles = (N + BN - 1) // BN
    gl.warp_specialize([  # (the argument tuples written out: a tuple built in the kernel loses constexprs)
        (_pingpong_partition, (a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M,
                               N, E, K, n_tiles, BLOCK_E, B_TRANSPOSED, 0)),
        (_pingpong_partition, (a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M,
                               N, E, K, n_tiles, BLOCK_E, B_TRANSPOSED, 1)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, E, K, n_tiles, BLOCK_E,
                           B_TRANSPOSED)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])


# ---------------------------------------------------------------------------------------- dw
@gluon.constexpr_function
def shared_layout_of(block, bitwidth):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if bitwidth == 16 else gl.float32)


@gluon.jit
def _dw_tile_place(tile, offs_ptr, M, K, N, BK: gl.constexpr, BN: gl.constexpr):
    """(group, k0, n0, row_start, row_end) of dw tile ``tile``: tiles ordered by group, then
    [BK, BN] output tiles of dw[group] row by row; the group's rows clamped into [0, M]."""
    k_tiles = K // BK
    n_tiles = (N + BN - 1) // BN
    group = tile // (k_tiles * n_tiles)
    r = tile % (k_tiles * n_tiles)
    row_start = gl.minimum(gl.maximum(gl.load(offs_ptr + group - 1, mask=group > 0, other=0), 0), M)
    row_end = gl.maximum(gl.minimum(gl.load(offs_ptr + group), M), row_start)
    return group, (r // n_tiles) * BK, (r % n_tiles) * BN, row_start, row_end


@gluon.jit
def _dw_load_partition(x_ptr, g_ptr, x_bufs, g_bufs, ready, empty, offs_ptr, M, K, N, E, stride_xm, stride_gm):
    """Per tile, TMA descriptors of the group's rows alone (made on the device: the copy
    engine zero-fills past the group's end), then its steps of BM rows: x [BM, BK] and
    grad [BM, BN] boxes into the ring."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[2]
    total = E * (K // BK) * ((N + BN - 1) // BN)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        group, k0, n0, row_start, row_end = _dw_tile_place(tile, offs_ptr, M, K, N, BK, BN)
        rows = gl.maximum(row_end - row_start, 1)  # an empty group's descriptor is never read
        x_desc = tma.make_tensor_descriptor(x_ptr + row_start.to(gl.int64) * stride_xm, shape=[rows, K],
                                            strides=[stride_xm, 1], block_shape=[BM, BK],
                                            layout=shared_layout_of([BM, BK], 16))
        g_desc = tma.make_tensor_descriptor(g_ptr + row_start.to(gl.int64) * stride_gm, shape=[rows, N],
                                            strides=[stride_gm, 1], block_shape=[BM, BN],
                                            layout=shared_layout_of([BM, BN], 16))
        for m in range(0, row_end - row_start, BM):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + g_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [m, k0], ready.index(s), x_bufs.index(s))
            tma.async_copy_global_to_shared(g_desc, [m, n0], ready.index(s), g_bufs.index(s))
            it += 1


@gluon.jit
def _dw_mma_partition(x_bufs, g_bufs, ready, empty, c_smem, dw_desc, offs_ptr, M, K, N, E,
                      num_warps: gl.constexpr):
    """The cooperative consumer of the dw: dw[group][k0:k0+BK, n0:n0+BN] = x^T grad over the
    group's rows (x's [BM, BK] boxes read transposed), stored through a TMA box of dw."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[2]
    mma_layout: gl.constexpr = mma_layout_of(BN, num_warps)
    total = E * (K // BK) * ((N + BN - 1) // BN)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        group, k0, n0, row_start, row_end = _dw_tile_place(tile, offs_ptr, M, K, N, BK, BN)
        acc = gl.zeros((BK, BN), gl.float32, layout=mma_layout)
        steps = (row_end - row_start + BM - 1) // BM
        acc, it = _mainloop(acc, x_bufs, g_bufs, ready, empty, it, steps, True, False)
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(dw_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dw_desc, [group * K + k0, n0], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_grouped_dw_kernel(x_ptr, g_ptr, dw_desc, offs_ptr, M, K, N, E, stride_xm, stride_gm,
                          BM: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """dw[e] = x[rows of e]^T @ grad[rows of e] (dw [E*K, N] in [BK, BN] boxes, K a multiple
    of BK; empty groups store zeros), warp-specialized as the forward."""
    BK: gl.constexpr = dw_desc.block_type.shape[0]
    BN: gl.constexpr = dw_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BM, BK], shared_layout_of([BM, BK], 16))
    g_bufs = gl.allocate_shared_memory(g_ptr.dtype.element_ty, [STAGES, BM, BN], shared_layout_of([BM, BN], 16))
    c_smem = gl.allocate_shared_memory(dw_desc.dtype, dw_desc.block_type.shape, dw_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_dw_mma_partition, (x_bufs, g_bufs, ready, empty, c_smem, dw_desc, offs_ptr, M, K, N, E, num_warps)),
        (_dw_load_partition, (x_ptr, g_ptr, x_bufs, g_bufs, ready, empty, offs_ptr, M, K, N, E, stride_xm,
                              stride_gm)),
    ], [1], [LOAD_REGS])


DW_VARIANTS = {  # name: (BM (rows per step), BK x BN (the dw tile), STAGES, consumer warps)
    "dw256x128x64s3": (64, 256, 128, 3, 8),
    "dw128x256x64s3": (64, 128, 256, 3, 8),
    "dw128x128x64s4": (64, 128, 128, 4, 8),
}


def ws_grouped_dw(x_MK: torch.Tensor, g_MN: torch.Tensor, offs_E: torch.Tensor, variant: str) -> torch.Tensor:
    """dw [E, K, N] bf16 through `_ws_grouped_dw_kernel` (x, grad row-major, 16-bit)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from titan_moe.ops.triton_runtime import ensure_scratch_allocator

    bm, bk, bn, stages, warps = DW_VARIANTS[variant]
    M, K = x_MK.shape
    N, E = g_MN.shape[1], offs_E.shape[0]
    if K % bk:
        raise ValueError(f"ws_grouped_dw: K ({K}) must be a multiple of the dw tile's rows ({bk})")
    dw = torch.empty(E, K, N, device=x_MK.device, dtype=x_MK.dtype)
    dw_2d = dw.view(E * K, N)
    dw_desc = TensorDescriptor(dw_2d, [E * K, N], [N, 1], [bk, bn],
                               gl.NVMMASharedLayout.get_default_for([bk, bn], gl.bfloat16))
    ensure_scratch_allocator(x_MK.device)  # the device-made descriptors' global scratch
    n = torch.cuda.get_device_properties(x_MK.device).multi_processor_count
    _ws_grouped_dw_kernel[(n,)](x_MK, g_MN, dw_desc, offs_E, M, K, N, E, x_MK.stride(0), g_MN.stride(0),
                                BM=bm, STAGES=stages, num_warps=warps)
    return dw


def descriptors(a_MK: torch.Tensor, b_EKN: torch.Tensor, out_MN: torch.Tensor, bm: int, bn: int, bk: int):
    """Host TMA descriptors (Gluon's, with their shared-memory layouts) and whether b is a
    transposed view: a in [bm, bk] boxes; b [E, K, N] row-major as an [E*K, N] matrix in
    [bk, bn] boxes, or a transposed view of a row-major w [E, N, K] (the dx product) as an
    [E*N, K] matrix in [bn, bk] boxes; out in [bm, bn] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = gl.bfloat16 if a_MK.dtype == torch.bfloat16 else gl.float16
    E, K, N = b_EKN.shape
    transposed = b_EKN.stride(2) != 1
    if transposed:
        b_2d, b_box = b_EKN.transpose(1, 2).reshape(E * N, K), [bn, bk]
    else:
        b_2d, b_box = b_EKN.reshape(E * K, N), [bk, bn]

    def make(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, dt))

    return make(a_MK, [bm, bk]), make(b_2d, b_box), make(out_MN, [bm, bn]), transposed


def ws_grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, variant: str,
                  programs: int | None = None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]`` through `_ws_grouped_mm_kernel` (or, for "pp"
    variants, `_pingpong_grouped_mm_kernel`, for "np" ones `_pipelined_grouped_mm_kernel`),
    rows past offs[-1] unwritten: b [E, K, N] row-major (the forward, b = w) or
    ``w.transpose(1, 2)`` of a contiguous w (dx); the scope of the module docstring."""
    bm, bn, bk, stages, warps = VARIANTS[variant]
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    if K % bk or K // bk < stages - 1:
        raise ValueError(f"ws_grouped_mm: the reduction K ({K}) must be a multiple of BK ({bk}), "
                         f"at least {stages - 1} steps")
    out_MN = torch.empty(M, N, device=a_MK.device, dtype=a_MK.dtype)
    a_desc, b_desc, c_desc, transposed = descriptors(a_MK, b_EKN, out_MN, bm, bn, bk)
    n = programs or torch.cuda.get_device_properties(a_MK.device).multi_processor_count
    args = (a_desc, b_desc, c_desc, out_MN, offs_E, M, N, E, K, out_MN.stride(0))
    consts = dict(STAGES=stages, BLOCK_E=triton.next_power_of_2(E + 1), B_TRANSPOSED=transposed)
    if warps == "pp":
        _pingpong_grouped_mm_kernel[(n,)](*args, **consts, CONSUMER_REGS=PINGPONG_CONSUMER_REGS, num_warps=4)
    elif variant.startswith("np"):
        _pipelined_grouped_mm_kernel[(n,)](*args, **consts, num_warps=warps)
    else:
        _ws_grouped_mm_kernel[(n,)](*args, **consts, num_warps=warps)
    return out_MN


def run_variant(case: str, variant: str) -> None:
    """One variant at one case (E = 64, M 64K, K 2,048, N 1,408): a forward / dx variant
    runs both products, a dw variant the weight gradient; each output checked against
    torch._grouped_mm's, then timed beside the peer and our Triton kernel (CUDA-graph
    replays, interleaved rounds); prints a table row per product."""
    import bench_moe
    from titan_moe.ops.grouped_gemm.triton_kernel import grouped_mm_dw_triton, grouped_mm_triton

    bench_moe.GRAPH_TIMING = True
    E, M, K, N = 64, 65536, 2048, 1408
    offs = torch.tensor(bench_moe.group_sizes(M, E, case), device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    if variant in DW_VARIANTS:
        products = {"dw": (lambda: torch._grouped_mm(x.t(), dy, offs=offs), lambda: grouped_mm_dw_triton(x, dy, offs),
                           lambda: ws_grouped_dw(x, dy, offs, variant))}
    else:
        products = {p: (lambda a=a, b=b: torch._grouped_mm(a, b, offs), lambda a=a, b=b: grouped_mm_triton(a, b, offs),
                        lambda a=a, b=b: ws_grouped_mm(a, b, offs, variant))
                    for p, (a, b) in {"fwd": (x, w), "dx": (dy, w.transpose(1, 2))}.items()}
    fns, errors = {}, {}
    for p, (native, ours, ws) in products.items():
        ref = native().float()
        errors[p] = ((ws().float() - ref).abs().max() / ref.abs().max()).item()
        if not errors[p] < 1e-2:
            print(f"| {case} | {p} | {variant} | wrong: relative error {errors[p]:.3e} | | | | |", flush=True)
            continue
        fns.update({(p, "native"): native, (p, "triton"): ours, (p, "gluon"): ws})
    if not fns:
        return
    ms, _ = bench_moe.measure_rounds(fns, timed=True)
    for p in dict.fromkeys(p for p, _ in fns):
        native, ours, ws = ms[(p, "native")], ms[(p, "triton")], ms[(p, "gluon")]
        print(f"| {case} | {p} | {variant} | {native:.4f} | {ours:.4f} | {ws:.4f} | {native / ws:.3f} | "
              f"{errors[p]:.1e} |", flush=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "one":
        run_variant(sys.argv[2], sys.argv[3])
        return
    known = {**VARIANTS, **DW_VARIANTS}
    names = sys.argv[1].split(",") if len(sys.argv) == 2 else list(known)
    if len(sys.argv) > 2 or any(n not in known for n in names):
        sys.exit(f"usage: probe_gluon_gemm.py [VARIANT,...]   (default all of {', '.join(known)}; "
                 "each at E = 64 balanced and Zipf: forward and dx, or dw)")
    limit = float(os.environ.get("PROBE_LIMIT_S", "60"))
    print("| groups | product | variant | native ms | triton ms | gluon ms | gluon x native | rel err |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    hung = set()  # a variant that gave no result at balanced groups is not run again
    for case in ("balanced", "zipf"):
        for variant in names:
            if variant in hung:
                continue
            try:
                subprocess.run([sys.executable, __file__, "one", case, variant], timeout=limit, check=False)
            except subprocess.TimeoutExpired:
                hung.add(variant)
                print(f"| {case} | | {variant} | no result within {limit:.0f} s | | | | |", flush=True)


if __name__ == "__main__":
    main()
