"""A warp-specialized grouped GEMM forward written in Gluon, probed beside ``torch._grouped_mm``
and our Triton kernel on an sm90 GPU (a probe, not a backend of the op).

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

Two consumer schedules: cooperative (`_ws_grouped_mm_kernel`: all consumer warps on every
tile, the tensor cores idle during its epilogue) and ping-pong (`_pingpong_grouped_mm_kernel`,
variants "pp...": two 4-warp consumers take the tiles in turn and hand the mainloop to each
other through a pair of mbarriers, so that one's epilogue overlaps the other's wgmmas, the
schedule of CUTLASS's "pingpong" Hopper kernels).

Scope (a probe): 16-bit operands, ``out[rows of e] = a[rows of e] @ b[e]`` for the forward
(b = w [E, K, N] row-major, read as an [E*K, N] matrix in [BK, BN] boxes) and dx (b =
w.transpose(1, 2), read from w as an [E*N, K] matrix in [BN, BK] boxes that the wgmma takes
transposed), the reduction a multiple of BK (so that a box never crosses into the next
expert), any group sizes (a group's last tile reads the next
group's rows and never stores them), rows past offs[-1] left unwritten (the op's kernel
stores zeros there; the probe's group sizes sum to M, so there are none). Each program walks
the tiles of the same group-ordered list as `_ragged_m_kernel` (row tiles never straddle a
group).

    python profiling/probe_gluon_gemm.py [VARIANT,...]   # E = 64 balanced and Zipf, M 64K, K 2,048,
                                                         # N 1,408: forward and dx

Each variant runs in its own process under a time limit (a warp-specialized kernel that
deadlocks would hold the GPU), checks its output against ``torch._grouped_mm`` (relative
error below 1e-2) and prints one row of a Markdown table.
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

VARIANTS = {  # name: (BM, BN, BK, STAGES, consumer warps; "pp": two 4-warp ping-pong consumers)
    "128x256x64s3": (128, 256, 64, 3, 8),
    "256x128x64s3": (256, 128, 64, 3, 8),
    "128x128x64s4": (128, 128, 64, 4, 8),
    "128x256x64s3w4": (128, 256, 64, 3, 4),
    "pp128x128x64s4": (128, 128, 64, 4, "pp"),
    "pp128x128x64s5": (128, 128, 64, 5, "pp"),
    "pp64x256x64s4": (64, 256, 64, 4, "pp"),
}
PINGPONG_CONSUMER_REGS = 232  # the worker consumer's registers (the default partition gets the rest)


@gluon.jit
def _tile_place(tile, offs_ptr, M, E, n_tiles, BM: gl.constexpr, BN: gl.constexpr, BLOCK_E: gl.constexpr,
                WARPS: gl.constexpr):
    """(row_start, row_end, group, col_start) of a tile of the group-ordered list, computed by
    any partition (WARPS: its warp count) from offs: the per-group row-tile counts, their
    inclusive prefix sums as a masked [BLOCK_E, BLOCK_E] reduction, the group = how many
    prefix entries are <= the tile's row-tile index."""
    layout_2d: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout_2d)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout_2d)
    e_c = gl.arange(0, BLOCK_E, layout=cols_l)
    m_tiles_c = _group_tiles(offs_ptr, e_c, M, E, BM)
    e_r = gl.arange(0, BLOCK_E, layout=rows_l)
    m_tiles_r = _group_tiles(offs_ptr, e_r, M, E, BM)
    incl_r = gl.sum(gl.where(e_c[None, :] <= e_r[:, None], m_tiles_c[None, :], 0), axis=1)
    m_tile = tile // n_tiles
    group = gl.sum((incl_r <= m_tile).to(gl.int32), axis=0)
    is_group = e_r == group
    first = gl.sum(gl.where(is_group, incl_r - m_tiles_r, 0), axis=0)
    starts_r = gl.minimum(gl.load(offs_ptr + e_r - 1, mask=(e_r > 0) & (e_r < E), other=0), M)
    group_start = gl.sum(gl.where(is_group, starts_r, 0), axis=0)
    row_end = gl.sum(gl.where(is_group, gl.minimum(gl.load(offs_ptr + e_r, mask=e_r < E, other=0), M), 0), axis=0)
    return group_start + (m_tile - first) * BM, row_end, group, (tile % n_tiles) * BN


@gluon.constexpr_function
def c_block_n(b_desc, b_transposed):
    """The output tile's width BN from b's box: [BN, BK] transposed, else [BK, BN]."""
    return b_desc.block_type.shape[0 if b_transposed else 1]


@gluon.jit
def _group_tiles(offs_ptr, e, M, E, BM: gl.constexpr):
    """Row tiles of the groups e (0 for e >= E), in e's layout."""
    ends = gl.minimum(gl.load(offs_ptr + e, mask=e < E, other=0), M)
    starts = gl.minimum(gl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0), M)
    return gl.where(e < E, (gl.maximum(ends - starts, 0) + BM - 1) // BM, 0)


@gluon.jit
def _total_tiles(offs_ptr, M, E, n_tiles, BM: gl.constexpr, BLOCK_E: gl.constexpr, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    e = gl.arange(0, BLOCK_E, layout=layout)
    return gl.sum(_group_tiles(offs_ptr, e, M, E, BM), axis=0) * n_tiles


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, E, K, n_tiles,
                    BLOCK_E: gl.constexpr, B_TRANSPOSED: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = c_block_n(b_desc, B_TRANSPOSED)
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    total = _total_tiles(offs_ptr, M, E, n_tiles, BM, BLOCK_E, 1)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        row_start, row_end, group, col = _tile_place(tile, offs_ptr, M, E, n_tiles, BM, BN, BLOCK_E, 1)
        for k in range(0, K, BK):
            s = it % STAGES
            # slots start free: the first pass waits on the phase before the barrier's first
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row_start, k], ready.index(s), a_bufs.index(s))
            if B_TRANSPOSED:  # b is w [E*N, K]: boxes [BN, BK]
                tma.async_copy_global_to_shared(b_desc, [group * N + col, k], ready.index(s), b_bufs.index(s))
            else:  # b is w [E*K, N]: boxes [BK, BN]
                tma.async_copy_global_to_shared(b_desc, [group * K + k, col], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.constexpr_function
def mma_layout_of(bn, warps):
    """The wgmma accumulator layout of a [*, bn] tile over ``warps`` warps stacked along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bn, 16])


@gluon.jit
def _mainloop(acc, a_bufs, b_bufs, ready, empty, it, K, B_TRANSPOSED: gl.constexpr):
    """acc += the tile's K // BK ring slots from step ``it`` on: wait for each slot, issue its
    wgmma asynchronously, keep one in flight, release the slot of the one before. Returns
    (acc, the step after the tile's last)."""
    BK: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    prev = 0
    for k in range(0, K, BK):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        b_tile = b_bufs.index(s)
        if B_TRANSPOSED:  # a [BK, BN] view of the [BN, BK] box: wgmma reads B either way
            b_tile = b_tile.permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(s), b_tile, acc, is_async=True)
        # one wgmma in flight: the one before this is done, and its slot can be refilled
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1, pred=k > 0)
        prev = s
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(prev), count=1)
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
    total = _total_tiles(offs_ptr, M, E, n_tiles, BM, BLOCK_E, num_warps)
    it = 0
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        row_start, row_end, group, col = _tile_place(tile, offs_ptr, M, E, n_tiles, BM, BN, BLOCK_E, num_warps)
        acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
        acc, it = _mainloop(acc, a_bufs, b_bufs, ready, empty, it, K, B_TRANSPOSED)
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
    total = _total_tiles(offs_ptr, M, E, n_tiles, BM, BLOCK_E, 4)
    j = 0  # this program's tile count so far
    for tile in range(gl.program_id(0), total, gl.num_programs(0)):
        if j % 2 == ME:
            row_start, row_end, group, col = _tile_place(tile, offs_ptr, M, E, n_tiles, BM, BN, BLOCK_E, 4)
            # my n-th turn (n = j // 2): consumer 0's first passes at once (a fresh barrier
            # counts as having completed the phase before its first)
            mbarrier.wait(turns.index(ME), ((j // 2) & 1) ^ (1 - ME))
            acc = gl.zeros((BM, BN), gl.float32, layout=mma_layout)
            acc, _ = _mainloop(acc, a_bufs, b_bufs, ready, empty, j * steps, K, B_TRANSPOSED)
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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    n_tiles = (N + BN - 1) // BN
    gl.warp_specialize([
        (_mma_partition, (a_bufs, b_bufs, ready, empty, c_smem, c_desc, c_ptr, stride_cm, offs_ptr, M, N, E, K,
                          n_tiles, BLOCK_E, B_TRANSPOSED, num_warps)),
        (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, M, N, E, K, n_tiles, BLOCK_E,
                           B_TRANSPOSED)),
    ], [1], [24])


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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
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
    ], [4, 1], [CONSUMER_REGS, 24])


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
    """``out[rows of e] = a[rows of e] @ b[e]`` through `_ws_grouped_mm_kernel` or, for "pp"
    variants, `_pingpong_grouped_mm_kernel` (rows past offs[-1] unwritten): b [E, K, N] row-major (the forward, b = w) or ``w.transpose(1, 2)``
    of a contiguous w (dx); the scope of the module docstring."""
    bm, bn, bk, stages, warps = VARIANTS[variant]
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    if K % bk:
        raise ValueError(f"ws_grouped_mm: the reduction K ({K}) must be a multiple of BK ({bk})")
    out_MN = torch.empty(M, N, device=a_MK.device, dtype=a_MK.dtype)
    a_desc, b_desc, c_desc, transposed = descriptors(a_MK, b_EKN, out_MN, bm, bn, bk)
    n = programs or torch.cuda.get_device_properties(a_MK.device).multi_processor_count
    args = (a_desc, b_desc, c_desc, out_MN, offs_E, M, N, E, K, out_MN.stride(0))
    consts = dict(STAGES=stages, BLOCK_E=triton.next_power_of_2(E + 1), B_TRANSPOSED=transposed)
    if warps == "pp":
        _pingpong_grouped_mm_kernel[(n,)](*args, **consts, CONSUMER_REGS=PINGPONG_CONSUMER_REGS, num_warps=4)
    else:
        _ws_grouped_mm_kernel[(n,)](*args, **consts, num_warps=warps)
    return out_MN


def run_variant(case: str, variant: str) -> None:
    """One variant at one case, the forward and the dx product: each output checked against
    torch._grouped_mm's, then timed beside the peer and our Triton kernel (CUDA-graph replays,
    interleaved rounds); prints a table row per product."""
    import bench_moe
    from titan_moe.ops.grouped_gemm.triton_kernel import grouped_mm_triton

    bench_moe.GRAPH_TIMING = True
    E, M, K, N = 64, 65536, 2048, 1408
    offs = torch.tensor(bench_moe.group_sizes(M, E, case), device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    products = {"fwd": (x, w), "dx": (dy, w.transpose(1, 2))}
    fns, errors = {}, {}
    for p, (a, b) in products.items():
        ref = torch._grouped_mm(a, b, offs).float()
        out = ws_grouped_mm(a, b, offs, variant).float()
        errors[p] = ((out - ref).abs().max() / ref.abs().max()).item()
        if not errors[p] < 1e-2:
            print(f"| {case} | {p} | {variant} | wrong: relative error {errors[p]:.3e} | | | | |", flush=True)
            continue
        fns[(p, "native")] = lambda a=a, b=b: torch._grouped_mm(a, b, offs)
        fns[(p, "triton")] = lambda a=a, b=b: grouped_mm_triton(a, b, offs)
        fns[(p, "gluon")] = lambda a=a, b=b: ws_grouped_mm(a, b, offs, variant)
    if not fns:
        return
    ms, _ = bench_moe.measure_rounds(fns, timed=True)
    for p in dict.fromkeys(p for p, _ in fns):
        native, ours, gluon = ms[(p, "native")], ms[(p, "triton")], ms[(p, "gluon")]
        print(f"| {case} | {p} | {variant} | {native:.4f} | {ours:.4f} | {gluon:.4f} | {native / gluon:.3f} | "
              f"{errors[p]:.1e} |", flush=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "one":
        run_variant(sys.argv[2], sys.argv[3])
        return
    names = sys.argv[1].split(",") if len(sys.argv) == 2 else list(VARIANTS)
    if len(sys.argv) > 2 or any(n not in VARIANTS for n in names):
        sys.exit(f"usage: probe_gluon_gemm.py [VARIANT,...]   (default all of {', '.join(VARIANTS)}; "
                 "each at E = 64 balanced and Zipf, forward and dx)")
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
