"""Grouped GEMM kernels written in Gluon for sm90 (Hopper): the op's "gluon" backend.

Gluon, the lower-level language shipped with Triton 3.6, states warp specialization
explicitly (Triton's automatic pass hung on our kernels on the H200, BENCHMARKS.md "Warp
specialization tried ..."). Every kernel here is persistent (one program per SM) and split
into partitions that share a ring of STAGES shared-memory buffers, each guarded by a "ready"
mbarrier (the TMA copies' bytes arrive on it) and an "empty" one (the consumer is done):

* a load partition (one warp, `LOAD_REGS` registers) walks the program's tiles and issues
  the TMA copies of each reduction step's operand boxes into the ring;
* two 4-warp consumers (ping-pong, the schedule of CUTLASS's "pingpong" Hopper kernels)
  take the program's tiles in turn: each waits for its ring slots, issues asynchronous
  wgmmas with one in flight, releases the slot of the one before, and stores its tile while
  the other consumer's wgmmas run. A consumer enters its tile's mainloop only once the other
  has left the previous tile's (a pair of "turn" mbarriers). The forward / dx take these;
  the dw also has a cooperative form (one 8-warp consumer on [256, 128] or [128, 256] tiles),
  faster while each dw tile made its own device descriptors (BENCHMARKS.md, "Grouped GEMM in
  Gluon ..."); with the host's descriptors (tiles ending in "h") ping-pong is the faster dw.

Tiles leave through a shared-memory staging buffer and a TMA store, or, for tile names ending
in "d", from the registers through pointer stores, the staging buffers' shared memory then
going to one more ring stage (an experiment, not the default).

Products (the op's; `grouped_mm_gluon`, `grouped_mm_dw_gluon`):

* forward ``out[rows of e] = a[rows of e] @ b[e]`` with b = w [E, K, N] row-major, read as an
  [E*K, N] matrix in [BK, BN] boxes; dx with b = ``w.transpose(1, 2)`` of a row-major w, read
  from w as an [E*N, K] matrix in [BN, BK] boxes that the wgmma takes transposed. Row tiles
  never straddle a group (`_schedule`, the group-ordered list of the Triton kernel's
  `_ragged_m_kernel`); a group's last, partial row tile reads the next group's rows and never
  stores them (masked pointer stores). Rows past ``offs[-1]`` are zeroed by the kernel's
  first consumer after its tiles (`_zero_rows_past`).
* dw ``dw[e] = x[rows of e]^T @ grad[rows of e]`` in [BK, BN] tiles of dw, each reducing over
  its group's rows in steps of BM; the consumer reads x's [BM, BK] boxes transposed. A step
  must not read the next group's rows: the load partition reads a group's partial last block
  through TMA descriptors of the group's rows alone, made on the device per tile (the copy
  engine zero-fills past the group's end), and, for tiles ending in "h", the whole blocks
  through the host's descriptors of all of x and grad (for the others, through the device-made
  ones too: making two descriptors per tile cost the H200 up to 0.09 ms of a 0.7 ms dw at E = 64).
  Empty groups store zeros.

Scope (`gluon_supported`, checked on the host; the op falls back to the Triton kernels
elsewhere): CUDA sm90, 16-bit operands, row-major operands TMA can describe (16-byte aligned
rows and base), the reduction and the weight's K a multiple of 64 (a box never crosses into
the next expert; for dw, of the dw tile's 128 or 256 rows), at most `MAX_GROUPS` groups (the schedule keeps a per-group vector in the
load warp's few registers). Gluon has no interpreter: these kernels are checked on the GPU
(tests/test_grouped_gemm_gluon.py) and, on the CPU, by building them for sm90.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from titan_moe.ops import launch_env
from titan_moe.ops.triton_runtime import (
    cuda_capability,
    ensure_cuda_context,
    ensure_scratch_allocator,
    next_power_of_2,
    sm_count,
    tma_describable,
)

# "FWD,DX,DW" tile names (`MM_TILES`, `DW_TILES`; empty: the default) for tuning, see `tiles`
TILES_ENV = "TITAN_MOE_GLUON_GEMM_TILES"
# forward / dx: name -> (BM, BN, BK, STAGES) of the ping-pong kernel (each consumer a BM x BN tile;
# a name ending in "d" stores tiles from registers)
MM_TILES = {
    "pp128x128x64s5": (128, 128, 64, 5),
    "pp128x128x64s4": (128, 128, 64, 4),
    "pp64x256x64s4": (64, 256, 64, 4),
    # "d": tiles stored from registers, the staging buffers' shared memory given to the ring
    "pp128x128x64s6d": (128, 128, 64, 6),
    "pp64x256x64s5d": (64, 256, 64, 5),
}
# dw: name -> (BM rows per step, BK, BN (the dw tile), STAGES, schedule: "pp" ping-pong, or the
# number of warps of one cooperative consumer)
DW_TILES = {
    "ppdw128x128x64s5": (64, 128, 128, 5, "pp"),
    "ppdw128x128x64s4": (64, 128, 128, 4, "pp"),
    "ppdw128x128x128s2": (128, 128, 128, 2, "pp"),
    "dw256x128x64s3": (64, 256, 128, 3, 8),
    "dw128x256x64s3": (64, 128, 256, 3, 8),
    "dw128x128x64s4": (64, 128, 128, 4, 8),
    # "d": tiles stored from registers, the staging buffer's shared memory given to the ring
    "dw256x128x64s4d": (64, 256, 128, 4, 8),
    "dw128x256x64s4d": (64, 128, 256, 4, 8),
    # "h": whole BM-row blocks through the host's descriptors of x and grad, only a group's last,
    # partial block through descriptors made on the device
    "dw256x128x64s3h": (64, 256, 128, 3, 8),
    "dw128x256x64s3h": (64, 128, 256, 3, 8),
    "dw256x128x64s4dh": (64, 256, 128, 4, 8),
    "ppdw128x128x64s5h": (64, 128, 128, 5, "pp"),
}
# On the H200 at E = 64, M 64K, K 2,048, N 1,408 (BENCHMARKS.md, "Grouped GEMM in Gluon"):
# pp128x128x64s5 1.10x / 1.16x torch._grouped_mm's forward balanced / Zipf 1.1, dx 1.06x / 1.11x
# dw: the ping-pong 128 x 128 tiles with the whole row blocks through the host's descriptors,
# forward+backward 1.12x / 1.11x torch._grouped_mm's there (BENCHMARKS.md, "the dw's row blocks
# through the host's descriptors"), and at the MoE layer's K 1,024 and 1,408 the fastest dw too
DEFAULT_TILES = ("pp128x128x64s5", "pp128x128x64s5", "ppdw128x128x64s5h")
# dw by K: the first whose 128 rows of dw per tile divide K
DEFAULT_DW_TILES = ("ppdw128x128x64s5h",)
PINGPONG_CONSUMER_REGS = 232  # the worker consumer's registers (the default partition gets the rest)
LOAD_REGS = gl.constexpr(40)  # the load partition's registers: its per-group schedule vectors spill at 24
MAX_GROUPS = 255  # BLOCK_E = next_power_of_2(E + 1) <= 256: 8 schedule registers per vector in the load warp
REDUCTION_MULTIPLE = 64


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
def staging_shape(block, direct):
    """The ping-pong kernels' two staging buffers: [2, BM, BN], or [2, 8, BN] stand-ins when
    tiles are stored from registers."""
    return [2, 8 if direct else block[0], block[1]]


@gluon.constexpr_function
def staging_block(block, direct):
    """A cooperative kernel's staging buffer: [BM, BN], or an [8, BN] stand-in when tiles are
    stored from registers."""
    return [8 if direct else block[0], block[1]]


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
def _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout: gl.constexpr,
              DIRECT: gl.constexpr = False):
    """Store a finished tile: through a TMA box where all its rows belong to its group (after
    the staging buffer's previous box has left), else through masked pointer stores (the
    group's last, partial tile: its rows past row_end belong to the next group). DIRECT: every
    tile through pointer stores from the registers (no staging buffer)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    out = acc.to(c_desc.dtype)
    if not DIRECT and row_start + BM <= row_end:
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
def _pingpong_partition(a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M, N, E,
                        K, n_tiles, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr, DIRECT: gl.constexpr,
                        ME: gl.constexpr):
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
            _epilogue(acc, c_smem, c_desc, c_ptr, stride_cm, row_start, row_end, col, N, mma_layout, DIRECT)
        j += 1
    if ME == 0:
        _zero_rows_past(c_ptr, stride_cm, offs_ptr, M, N, E, BM, BN, mma_layout)
    tma.store_wait(pendings=0)


@gluon.jit
def _zero_rows_past(c_ptr, stride_cm, offs_ptr, M, N, E, BM: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """Rows [offs[-1], M) of the output set to zero, in BM-row blocks spread over the
    programs (the op's contract; no tile covers them, so no other store races these). With
    every row owned, training's usual case, a program loads one scalar and is done."""
    owned = gl.minimum(gl.maximum(gl.load(offs_ptr + E - 1), 0), M)
    zeros = gl.zeros((BM, BN), c_ptr.dtype.element_ty, layout=layout)
    for row0 in range(owned + gl.program_id(0) * BM, M, gl.num_programs(0) * BM):
        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        for col0 in range(0, N, BN):
            cols = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
            gl.store(ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])


@gluon.jit
def _pingpong_grouped_mm_kernel(a_desc, b_desc, c_desc, c_ptr, offs_ptr, M, N, E, K, stride_cm,
                                STAGES: gl.constexpr, BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr,
                                DIRECT: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Ping-pong: consumer 0 is the default partition (num_warps = 4), consumer 1 a 4-warp
    worker with CONSUMER_REGS registers, the load partition a 1-warp worker. DIRECT: tiles
    stored from registers, the two staging buffers' shared memory left to the ring (their
    8-row stand-ins are never used)."""
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smems = gl.allocate_shared_memory(c_desc.dtype, staging_shape(c_desc.block_type.shape, DIRECT), c_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    n_tiles = (N + BN - 1) // BN
    gl.warp_specialize([  # (the argument tuples written out: a tuple built in the kernel loses constexprs)
        (_pingpong_partition, (a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M,
                               N, E, K, n_tiles, BLOCK_E, B_TRANSPOSED, DIRECT, 0)),
        (_pingpong_partition, (a_bufs, b_bufs, ready, empty, turns, c_smems, c_desc, c_ptr, stride_cm, offs_ptr, M,
                               N, E, K, n_tiles, BLOCK_E, B_TRANSPOSED, DIRECT, 1)),
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
def _group_rows_descriptors(x_ptr, g_ptr, row_start, row_end, K, N, stride_xm, stride_gm, BM: gl.constexpr,
                            BK: gl.constexpr, BN: gl.constexpr):
    """TMA descriptors of x [rows, K] and grad [rows, N] over one group's rows alone, made on
    the device (the copy engine zero-fills past the group's end)."""
    rows = gl.maximum(row_end - row_start, 1)  # an empty group's descriptor is never read
    x_desc = tma.make_tensor_descriptor(x_ptr + row_start.to(gl.int64) * stride_xm, shape=[rows, K],
                                        strides=[stride_xm, 1], block_shape=[BM, BK],
                                        layout=shared_layout_of([BM, BK], 16))
    g_desc = tma.make_tensor_descriptor(g_ptr + row_start.to(gl.int64) * stride_gm, shape=[rows, N],
                                        strides=[stride_gm, 1], block_shape=[BM, BN],
                                        layout=shared_layout_of([BM, BN], 16))
    return x_desc, g_desc


@gluon.jit
def _dw_issue_step(x_desc, g_desc, x_bufs, g_bufs, ready, empty, it, row, k0, n0):
    """One reduction step's x [BM, BK] and grad [BM, BN] boxes from ``row`` into ring slot
    ``it % STAGES`` once it is empty; returns it + 1."""
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + g_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [row, k0], ready.index(s), x_bufs.index(s))
    tma.async_copy_global_to_shared(g_desc, [row, n0], ready.index(s), g_bufs.index(s))
    return it + 1


@gluon.jit
def _dw_load_partition(x_desc, g_desc, x_ptr, g_ptr, x_bufs, g_bufs, ready, empty, offs_ptr, M, K, N, E,
                       stride_xm, stride_gm, HOST_DESCS: gl.constexpr):
    """Per tile, its steps of BM rows: x [BM, BK] and grad [BM, BN] boxes into the ring.
    Without HOST_DESCS every box comes through descriptors of the group's rows made on the
    device per tile (`_group_rows_descriptors`); with it the whole BM-row blocks come through
    the host's descriptors of all of x and grad (x_desc, g_desc) and only a group's last,
    partial block through device-made ones, which zero-fill the next group's rows."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[2]
    total = E * (K // BK) * ((N + BN - 1) // BN)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        group, k0, n0, row_start, row_end = _dw_tile_place(tile, offs_ptr, M, K, N, BK, BN)
        rows = row_end - row_start
        if HOST_DESCS:
            whole = rows // BM * BM
            for m in range(0, whole, BM):
                it = _dw_issue_step(x_desc, g_desc, x_bufs, g_bufs, ready, empty, it, row_start + m, k0, n0)
            if whole < rows:
                x_tail, g_tail = _group_rows_descriptors(x_ptr, g_ptr, row_start, row_end, K, N, stride_xm,
                                                         stride_gm, BM, BK, BN)
                it = _dw_issue_step(x_tail, g_tail, x_bufs, g_bufs, ready, empty, it, whole, k0, n0)
        else:
            x_group, g_group = _group_rows_descriptors(x_ptr, g_ptr, row_start, row_end, K, N, stride_xm,
                                                       stride_gm, BM, BK, BN)
            for m in range(0, rows, BM):
                it = _dw_issue_step(x_group, g_group, x_bufs, g_bufs, ready, empty, it, m, k0, n0)


@gluon.jit
def _dw_mma_partition(x_bufs, g_bufs, ready, empty, c_smem, dw_desc, dw_ptr, offs_ptr, M, K, N, E,
                      DIRECT: gl.constexpr, num_warps: gl.constexpr):
    """The cooperative consumer of the dw: dw[group][k0:k0+BK, n0:n0+BN] = x^T grad over the
    group's rows (x's [BM, BK] boxes read transposed), stored through a TMA box of dw, or with
    DIRECT from the registers through pointer stores into dw [E*K, N] (row-major)."""
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
        if DIRECT:
            rows = group * K + k0 + gl.arange(0, BK, layout=gl.SliceLayout(1, mma_layout))
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma_layout))
            ptrs = dw_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :]
            gl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(cols < N)[None, :])
        else:
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dw_desc, [group * K + k0, n0], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_grouped_dw_kernel(x_desc, g_desc, x_ptr, g_ptr, dw_desc, dw_ptr, offs_ptr, M, K, N, E, stride_xm, stride_gm,
                          BM: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, HOST_DESCS: gl.constexpr,
                          num_warps: gl.constexpr):
    """dw[e] = x[rows of e]^T @ grad[rows of e] (dw [E*K, N] in [BK, BN] boxes, K a multiple
    of BK; empty groups store zeros), warp-specialized as the forward. DIRECT: tiles stored
    from registers, the staging buffer (an 8-row stand-in) left to the ring."""
    BK: gl.constexpr = dw_desc.block_type.shape[0]
    BN: gl.constexpr = dw_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BM, BK], shared_layout_of([BM, BK], 16))
    g_bufs = gl.allocate_shared_memory(g_ptr.dtype.element_ty, [STAGES, BM, BN], shared_layout_of([BM, BN], 16))
    c_smem = gl.allocate_shared_memory(dw_desc.dtype, staging_block(dw_desc.block_type.shape, DIRECT),
                                       dw_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_dw_mma_partition, (x_bufs, g_bufs, ready, empty, c_smem, dw_desc, dw_ptr, offs_ptr, M, K, N, E, DIRECT,
                             num_warps)),
        (_dw_load_partition, (x_desc, g_desc, x_ptr, g_ptr, x_bufs, g_bufs, ready, empty, offs_ptr, M, K, N, E,
                              stride_xm, stride_gm, HOST_DESCS)),
    ], [1], [LOAD_REGS])


@gluon.jit
def _dw_pingpong_partition(x_bufs, g_bufs, ready, empty, turns, c_smems, dw_desc, offs_ptr, M, K, N, E,
                           ME: gl.constexpr):
    """One of two 4-warp dw consumers taking this program's tiles in turn (ME: 0 the even
    ones, 1 the odd ones), as `_pingpong_partition`; tiles have as many steps as their
    group has BM-row blocks, so each consumer counts the ring steps of every tile, its
    own and the other's."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BK: gl.constexpr = x_bufs.type.shape[2]
    BN: gl.constexpr = g_bufs.type.shape[2]
    mma_layout: gl.constexpr = mma_layout_of(BN, 4)
    c_smem = c_smems.index(ME)
    total = E * (K // BK) * ((N + BN - 1) // BN)
    it = 0  # ring steps of this program's tiles before this one
    j = 0  # this program's tile count so far
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        group, k0, n0, row_start, row_end = _dw_tile_place(tile, offs_ptr, M, K, N, BK, BN)
        steps = (row_end - row_start + BM - 1) // BM
        if j % 2 == ME:
            mbarrier.wait(turns.index(ME), ((j // 2) & 1) ^ (1 - ME))
            acc = gl.zeros((BK, BN), gl.float32, layout=mma_layout)
            acc, _ = _mainloop(acc, x_bufs, g_bufs, ready, empty, it, steps, True, False)
            mbarrier.arrive(turns.index(1 - ME), count=1)
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dw_desc, [group * K + k0, n0], c_smem)
        it += steps
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_grouped_dw_kernel(x_desc, g_desc, x_ptr, g_ptr, dw_desc, offs_ptr, M, K, N, E, stride_xm, stride_gm,
                                BM: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                HOST_DESCS: gl.constexpr, num_warps: gl.constexpr):
    """The dw as `_ws_grouped_dw_kernel` with two ping-pong consumers of [BK, BN] tiles
    (num_warps = 4: consumer 0 is the default partition, consumer 1 a 4-warp worker with
    CONSUMER_REGS registers), so that a tile's epilogue runs under the next tile's wgmmas:
    a dw tile reduces over one group's rows only (16 steps of 64 at 1,024 rows per group)."""
    BK: gl.constexpr = dw_desc.block_type.shape[0]
    BN: gl.constexpr = dw_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BM, BK], shared_layout_of([BM, BK], 16))
    g_bufs = gl.allocate_shared_memory(g_ptr.dtype.element_ty, [STAGES, BM, BN], shared_layout_of([BM, BN], 16))
    c_smems = gl.allocate_shared_memory(dw_desc.dtype, [2] + dw_desc.block_type.shape, dw_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    gl.warp_specialize([
        (_dw_pingpong_partition, (x_bufs, g_bufs, ready, empty, turns, c_smems, dw_desc, offs_ptr, M, K, N, E, 0)),
        (_dw_pingpong_partition, (x_bufs, g_bufs, ready, empty, turns, c_smems, dw_desc, offs_ptr, M, K, N, E, 1)),
        (_dw_load_partition, (x_desc, g_desc, x_ptr, g_ptr, x_bufs, g_bufs, ready, empty, offs_ptr, M, K, N, E,
                              stride_xm, stride_gm, HOST_DESCS)),
    ], [4, 1], [CONSUMER_REGS, LOAD_REGS])


# ---------------------------------------------------------------------------------------- host
def tiles(product: str, K: int | None = None) -> str:
    """The tile name ``product`` ("fwd", "dx" or "dw") uses: from ``$TITAN_MOE_GLUON_GEMM_TILES``
    ("FWD,DX,DW", read per call; an empty entry keeps that product's default), else
    `DEFAULT_TILES`; the default dw with ``K`` given is the first of `DEFAULT_DW_TILES` whose BK
    divides K."""
    text = launch_env.read(TILES_ENV)
    names = tuple(text.split(",")) if text else ("", "", "")
    if (len(names) != 3 or any(n not in MM_TILES for n in names[:2] if n) or (names[2] and names[2] not in DW_TILES)):
        raise ValueError(f"{TILES_ENV} must be FWD,DX,DW with FWD, DX of {sorted(MM_TILES)} and DW of "
                         f"{sorted(DW_TILES)} (an empty entry: the default), got {text!r}")
    index = ("fwd", "dx", "dw").index(product)
    if names[index]:
        return names[index]
    if product == "dw" and K is not None:
        return next((n for n in DEFAULT_DW_TILES if K % DW_TILES[n][1] == 0), DEFAULT_TILES[2])
    return DEFAULT_TILES[index]


def tile_flags(name: str) -> tuple[bool, bool]:
    """(direct, host_descs) of a tile name's suffix after its stages: "d", tiles stored from
    the registers; "h", the dw's whole row blocks through the host's descriptors."""
    suffix = name[name.rindex("s") + 1:].lstrip("0123456789")
    return "d" in suffix, "h" in suffix


def _on_sm90(t: torch.Tensor) -> bool:
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return t.dtype in (torch.bfloat16, torch.float16) and cuda_capability(index)[0] == 9


def gluon_supported(a_MK: torch.Tensor, b_EKN: torch.Tensor) -> bool:
    """Whether `grouped_mm_gluon` takes these operands (b_EKN: w, or ``w.transpose(1, 2)``
    for dx): the scope in the module docstring, with the reduction a multiple of the
    product's tile's BK."""
    if a_MK.device.type != "cuda" or b_EKN.dtype != a_MK.dtype or not _on_sm90(a_MK):
        return False
    E, K, N = b_EKN.shape
    weight = b_EKN.transpose(1, 2) if b_EKN.stride(2) != 1 else b_EKN
    bk = MM_TILES[tiles("dx" if weight is not b_EKN else "fwd")][2]
    return (E <= MAX_GROUPS and K % bk == 0 and weight.is_contiguous() and tma_describable(a_MK)
            and (N * a_MK.element_size()) % 16 == 0 and (weight.shape[2] * a_MK.element_size()) % 16 == 0)


def gluon_dw_supported(x_MK: torch.Tensor, grad_MN: torch.Tensor) -> bool:
    """Whether `grouped_mm_dw_gluon` takes these operands: the scope in the module docstring,
    with K a multiple of the dw tile's BK."""
    if x_MK.device.type != "cuda" or grad_MN.dtype != x_MK.dtype or not _on_sm90(x_MK):
        return False
    K = x_MK.shape[1]
    return (K % DW_TILES[tiles("dw", K)][1] == 0 and tma_describable(x_MK) and tma_describable(grad_MN)
            and (grad_MN.shape[1] * grad_MN.element_size()) % 16 == 0)


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a box (made once: building one costs the host about
    as much as a bare ``torch._grouped_mm`` launch, measured on the H200's host)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon host TMA descriptor of the 2-D row-major ``t``; on CUDA after
    `ensure_cuda_context` (its encoding needs a current context, which autograd's device thread
    may lack at its first backward, as for the Triton kernels' descriptors)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if t.is_cuda:
        ensure_cuda_context(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _shared_layout(tuple(block), t.dtype))


def mm_descriptors(a_MK: torch.Tensor, b_EKN: torch.Tensor, out_MN: torch.Tensor, bm: int, bn: int, bk: int):
    """Host TMA descriptors (Gluon's, with their shared-memory layouts) and whether b is a
    transposed view: a in [bm, bk] boxes; b [E, K, N] row-major as an [E*K, N] matrix in
    [bk, bn] boxes, or a transposed view of a row-major w [E, N, K] (the dx product) as an
    [E*N, K] matrix in [bn, bk] boxes; out in [bm, bn] boxes."""
    E, K, N = b_EKN.shape
    transposed = b_EKN.stride(2) != 1
    if transposed:
        b_2d, b_box = b_EKN.transpose(1, 2).reshape(E * N, K), [bn, bk]
    else:
        b_2d, b_box = b_EKN.reshape(E * K, N), [bk, bn]
    return _descriptor(a_MK, [bm, bk]), _descriptor(b_2d, b_box), _descriptor(out_MN, [bm, bn]), transposed


def _programs(device: torch.device) -> int:
    return sm_count(device.index)


def grouped_mm_gluon(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, tile: str | None = None,
                     programs: int | None = None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]`` -> [M, N] through `_pingpong_grouped_mm_kernel`;
    rows past ``offs[-1]`` are zero (stored by the kernel: no second launch).

    Args:
        a_MK: [M, K] rows sorted by group, row-major.
        b_EKN: [E, K, N]: w row-major (the forward) or ``w.transpose(1, 2)`` of a row-major w
            (dx); see `gluon_supported` for the scope (the caller checks it).
        offs_E: [E] int32 cumulative group ends (read on the device only).
        tile: a name of `MM_TILES` (default: `tiles` of the product).
        programs: persistent programs (default one per SM).
    """
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    transposed = b_EKN.stride(2) != 1
    name = tile or tiles("dx" if transposed else "fwd")
    bm, bn, bk, stages = MM_TILES[name]
    if K % bk:
        raise ValueError(f"grouped_mm_gluon: the reduction K ({K}) must be a multiple of {bk}")
    out_MN = torch.empty(M, N, device=a_MK.device, dtype=a_MK.dtype)
    if M == 0 or N == 0:
        return out_MN
    if K == 0:
        return out_MN.zero_()
    a_desc, b_desc, c_desc, transposed = mm_descriptors(a_MK, b_EKN, out_MN, bm, bn, bk)
    _pingpong_grouped_mm_kernel[(programs or _programs(a_MK.device),)](
        a_desc, b_desc, c_desc, out_MN, offs_E, M, N, E, K, out_MN.stride(0),
        STAGES=stages, BLOCK_E=next_power_of_2(E + 1), B_TRANSPOSED=transposed, DIRECT=tile_flags(name)[0],
        CONSUMER_REGS=PINGPONG_CONSUMER_REGS, num_warps=4)
    return out_MN


def grouped_mm_dw_gluon(x_MK: torch.Tensor, grad_MN: torch.Tensor, offs_E: torch.Tensor,
                        tile: str | None = None) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ grad[rows of e]`` -> [E, K, N] (zero for empty groups)
    through `_pingpong_grouped_dw_kernel` or, for cooperative tiles, `_ws_grouped_dw_kernel`.

    Args:
        x_MK: [M, K], grad_MN: [M, N], rows sorted by group, row-major, same 16-bit dtype, K a
            multiple of the tile's BK (`gluon_supported`).
        offs_E: [E] int32 cumulative group ends (read on the device only).
        tile: a name of `DW_TILES` (default: `tiles("dw", K)`).
    """
    M, K = x_MK.shape
    name = tile or tiles("dw", K)
    bm, bk, bn, stages, schedule = DW_TILES[name]
    N, E = grad_MN.shape[1], offs_E.shape[0]
    if K % bk:
        raise ValueError(f"grouped_mm_dw_gluon: K ({K}) must be a multiple of the dw tile's rows ({bk})")
    dw_EKN = torch.empty(E, K, N, device=x_MK.device, dtype=x_MK.dtype)
    if M == 0 or K == 0 or N == 0:
        return dw_EKN.zero_()
    dw_desc = _descriptor(dw_EKN.view(E * K, N), [bk, bn])
    direct, host_descs = tile_flags(name)
    # x and grad whole (read by the host-described form only; the other takes them as a stand-in)
    x_desc, g_desc = _descriptor(x_MK, [bm, bk]), _descriptor(grad_MN, [bm, bn])
    ensure_scratch_allocator(x_MK.device)  # the device-made descriptors' global scratch
    args = (x_desc, g_desc, x_MK, grad_MN, dw_desc)
    shape_args = (offs_E, M, K, N, E, x_MK.stride(0), grad_MN.stride(0))
    grid = (_programs(x_MK.device),)
    if schedule == "pp":
        _pingpong_grouped_dw_kernel[grid](*args, *shape_args, BM=bm, STAGES=stages,
                                          CONSUMER_REGS=PINGPONG_CONSUMER_REGS, HOST_DESCS=host_descs, num_warps=4)
    else:
        _ws_grouped_dw_kernel[grid](*args, dw_EKN, *shape_args, BM=bm, STAGES=stages,
                                    DIRECT=direct, HOST_DESCS=host_descs,
                                    num_warps=schedule)
    return dw_EKN
