"""Grouped GEMM kernels written in Gluon (forward, dx, dw; warp-specialized), probed beside
``torch._grouped_mm`` and our Triton kernels on an sm90 GPU. The ping-pong kernels and the dw
kernels, with the helpers all share, are the op's "gluon" backend
(:mod:`titan_moe.ops.grouped_gemm.gluon_kernel`); this probe adds the schedules that lost
there (cooperative, unpartitioned) and times any of them at E = 64.

The load partition, ring, mainloop and epilogue are the backend's (its module docstring).
The schedules only here: cooperative (`_ws_grouped_mm_kernel`: all 8 consumer warps on every
tile, so the tensor cores idle during its epilogue; variants "128x256...", "256x128...") and
one kernel without partitions (`_pipelined_grouped_mm_kernel`, variants "np..."): the same
warps load and multiply, pipelined by hand across tile boundaries. Their scope: the reduction
a multiple of BK; rows past offs[-1] left unwritten (the probe's group sizes sum to M). The
backend's ping-pong forward / dx tiles ("pp...") and dw tiles ("dw...", "ppdw...") run
through `grouped_mm_gluon` / `grouped_mm_dw_gluon`.

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
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_moe.ops.grouped_gemm.gluon_kernel import (  # noqa: E402
    DW_TILES,
    LOAD_REGS,
    MM_TILES,
    _epilogue,
    _issue_step,
    _load_partition,
    _mainloop,
    _ring_barriers,
    _schedule,
    _tile_place,
    c_block_n,
    grouped_mm_dw_gluon,
    grouped_mm_gluon,
    mm_descriptors,
    mma_layout_of,
)

VARIANTS = {  # name: (BM, BN, BK, STAGES, consumer warps; "np": no warp specialization, the
    # kernel's warps pipelined by hand), beside the backend's ping-pong tiles ("pp...", MM_TILES)
    "128x256x64s3": (128, 256, 64, 3, 8),
    "256x128x64s3": (256, 128, 64, 3, 8),
    "128x128x64s4": (128, 128, 64, 4, 8),
    "np128x256x64s3": (128, 256, 64, 3, 8),
    "np256x128x64s3": (256, 128, 64, 3, 8),
    **{name: (*tile, "pp") for name, tile in MM_TILES.items()},
}
DW_VARIANTS = DW_TILES  # name: (BM (rows per step), BK x BN (the dw tile), STAGES, "pp" or consumer warps)


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


def ws_grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offs_E: torch.Tensor, variant: str,
                  programs: int | None = None) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ b[e]`` through `_ws_grouped_mm_kernel` (or, for "pp"
    variants, the backend's `grouped_mm_gluon`, for "np" ones `_pipelined_grouped_mm_kernel`):
    b [E, K, N] row-major (the forward, b = w) or ``w.transpose(1, 2)`` of a contiguous w (dx);
    rows past offs[-1] unwritten except through the backend."""
    if variant in MM_TILES:
        return grouped_mm_gluon(a_MK, b_EKN, offs_E, variant, programs)
    bm, bn, bk, stages, warps = VARIANTS[variant]
    M, K = a_MK.shape
    E, _, N = b_EKN.shape
    if K % bk or K // bk < stages - 1:
        raise ValueError(f"ws_grouped_mm: the reduction K ({K}) must be a multiple of BK ({bk}), "
                         f"at least {stages - 1} steps")
    out_MN = torch.empty(M, N, device=a_MK.device, dtype=a_MK.dtype)
    a_desc, b_desc, c_desc, transposed = mm_descriptors(a_MK, b_EKN, out_MN, bm, bn, bk)
    n = programs or torch.cuda.get_device_properties(a_MK.device).multi_processor_count
    args = (a_desc, b_desc, c_desc, out_MN, offs_E, M, N, E, K, out_MN.stride(0))
    consts = dict(STAGES=stages, BLOCK_E=triton.next_power_of_2(E + 1), B_TRANSPOSED=transposed)
    if variant.startswith("np"):
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
                           lambda: grouped_mm_dw_gluon(x, dy, offs, variant))}
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
