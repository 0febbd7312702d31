"""Probes of the grouped GEMM's forward / dx kernel on an sm90 GPU (not a benchmark of the op).

Two modes, each printing a Markdown table:

``tiles CASES SPECS``: the forward and the dx product (``dy @ w[e]^T``) of each case through
`grouped_mm_triton` with each tile spec (``""`` = the default, else
``BMxBNxBKxWARPSxSTAGES[t]`` as `parse_tile` reads it; ``@P`` after either: exactly P persistent
programs, e.g. ``@128`` or ``256x128x64x8x3t@96``) beside ``torch._grouped_mm``, CUDA-graph
replays in interleaved rounds (`bench_moe.measure_rounds`), every output checked against the peer.

    python profiling/probe_mk_kernel.py tiles e64_bal,e64_zipf,layer_gate_up ,128x256x64x8x3t,@128

``ws``: Triton 3.6's Hopper warp specialization (``tl.range(..., warp_specialize=True)``) on a
minimal persistent grouped GEMM (`_ws_probe_kernel`: balanced groups only, one group lookup per
tile, pointer stores), beside the same kernel without it. Each variant runs in its own process
under a time limit, because a warp-specialized launch can hang.

    python profiling/probe_mk_kernel.py ws

What the compiler accepts, found by compiling for sm90 on the CPU (Triton 3.6.0): the pass acts
only at 4 warps (it then runs 12: one producer and two consumer warp groups), and gives up or
fails on an ``else`` branch, a ``tl.associative_scan`` anywhere in the kernel, a reduction whose
result the consumers use, a loop bound computed from loaded data, or a reduction loop whose bound
the tile computes: all of which `_ragged_m_kernel` has.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = {  # name: (E, M, K, N, group sizes)
    "e64_bal": (64, 65536, 2048, 1408, "balanced"), "e64_zipf": (64, 65536, 2048, 1408, "zipf"),
    "e64_m32k_bal": (64, 32768, 2048, 1408, "balanced"), "e64_m32k_zipf": (64, 32768, 2048, 1408, "zipf"),
    "layer_gate_up": (64, 65536, 1024, 2816, "balanced"), "layer_down": (64, 65536, 1408, 1024, "balanced"),
}
WS_VARIANTS = ["128 256 64 0 8 3", "128 256 64 1 4 3", "128 256 64 2 4 3", "256 128 64 1 4 3",
               "128 256 64 1 4 4", "128 128 64 1 4 4"]  # BM BN BK WS(0 off, 1 tile loop, 2 k loop) WARPS STAGES


def probe_config(spec: str, n_cols: int):
    """The TileConfig of a probe spec (``[TILE][@PROGRAMS]``) for an output of ``n_cols``
    columns; None for the op's own default."""
    from dataclasses import replace

    from titan_moe.ops.grouped_gemm.triton_kernel import default_config, parse_tile

    tile, _, programs = spec.partition("@")
    if not programs:
        return parse_tile(tile, "mk") if tile else None
    cfg = parse_tile(tile, "mk") if tile else default_config(torch.bfloat16, torch.device("cuda"), "mk",
                                                                 n_cols=n_cols)
    return replace(cfg, num_programs=int(programs))


def probe_tiles(case_names: str, specs: str) -> None:
    import bench_moe
    from titan_moe.ops.grouped_gemm.triton_kernel import grouped_mm_triton

    bench_moe.GRAPH_TIMING = True
    print("| case | tile | fwd ms | dx ms | fwd x native | dx x native |\n| --- | --- | --- | --- | --- | --- |")
    for name in case_names.split(","):
        E, M, K, N, dist = CASES[name]
        offs = torch.tensor(bench_moe.group_sizes(M, E, dist), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        products = {"fwd": (x, w), "dx": (dy, w.transpose(1, 2))}
        fns = {("native", p): (lambda a=a, b=b: torch._grouped_mm(a, b, offs)) for p, (a, b) in products.items()}
        for spec in specs.split(","):
            for p, (a, b) in products.items():
                cfg = probe_config(spec, b.shape[2])
                fns[(spec or "default", p)] = lambda a=a, b=b, cfg=cfg: grouped_mm_triton(a, b, offs, config=cfg)
        for (tile, p), fn in fns.items():
            ref = torch._grouped_mm(*products[p], offs).float()
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (name, tile, p, err)
        ms, _ = bench_moe.measure_rounds(fns, timed=True)
        for tile in dict.fromkeys(t for t, _ in fns):
            f, d = ms[(tile, "fwd")], ms[(tile, "dx")]
            print(f"| {name} | {tile} | {f:.4f} | {d:.4f} | {ms[('native', 'fwd')] / f:.3f} | "
                  f"{ms[('native', 'dx')] / d:.3f} |", flush=True)


@triton.jit
def _ws_add(a, b):
    return a + b


@triton.jit
def _ws_probe_kernel(a_desc, b_desc, c_ptr, offs_ptr, M, N, K, E, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, WS: tl.constexpr):
    """c = a @ w[group] per row tile, groups of a multiple of BM rows (the tile count is
    cdiv(M, BM) * n_tiles); WS 1 warp-specializes the persistent tile loop, 2 the k loop."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    e_idx = tl.arange(0, 128)
    ends = tl.minimum(tl.where(e_idx < E, tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0), M), M)
    starts = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx <= E), other=0)
    m_tiles = (tl.maximum(ends - starts, 0) + BM - 1) // BM
    # prefix sums as a masked reduction: the pass cannot place a scan
    incl = tl.reduce(tl.where(e_idx[None, :] <= e_idx[:, None], m_tiles[None, :], 0), 1, _ws_add)
    for tile in tl.range(pid, tl.cdiv(M, BM) * n_tiles, tl.num_programs(0), warp_specialize=WS == 1):
        m_tile = tile // n_tiles
        group = tl.reduce((incl <= m_tile).to(tl.int32), 0, _ws_add)
        m0 = m_tile * BM
        n0 = (tile % n_tiles) * BN
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in tl.range(0, K, BK, warp_specialize=WS == 2):
            acc = tl.dot(a_desc.load([m0, k0]), b_desc.load([group, k0, n0]).reshape(BK, BN), acc)
        rows = m0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def probe_ws_variant(bm: int, bn: int, bk: int, ws: int, warps: int, stages: int) -> None:
    import bench_moe
    from triton.tools.tensor_descriptor import TensorDescriptor

    from titan_moe.ops.triton_runtime import ensure_scratch_allocator

    bench_moe.GRAPH_TIMING = True
    ensure_scratch_allocator(torch.device("cuda"))
    E, M, K, N, _ = CASES["e64_bal"]
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (M // E)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    a_desc, b_desc = TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, [1, bk, bn])
    programs = torch.cuda.get_device_properties(0).multi_processor_count

    def ours():
        _ws_probe_kernel[(programs,)](a_desc, b_desc, out, offs, M, N, K, E, BM=bm, BN=bn, BK=bk, WS=ws,
                                      num_warps=warps, num_stages=stages)

    ours()
    ref = torch._grouped_mm(a, w, offs).float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-2:  # a wrong product's time means nothing
        print(f"| {bm}x{bn}x{bk} | {ws} | {warps} | {stages} | wrong result: relative error {err:.3g} |", flush=True)
        return
    ms, _ = bench_moe.measure_rounds({"native": lambda: torch._grouped_mm(a, w, offs), "ours": ours}, timed=True)
    print(f"| {bm}x{bn}x{bk} | {ws} | {warps} | {stages} | {ms['ours']:.4f} | {ms['native']:.4f} | "
          f"{ms['native'] / ms['ours']:.3f} | {err:.3g} |", flush=True)


def probe_ws(limit_s: int = 45) -> None:
    print("| tile | warp specialization | warps | stages | ms | native ms | x native | relative error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for variant in WS_VARIANTS:
        try:
            proc = subprocess.run([sys.executable, __file__, "ws-one", *variant.split()], capture_output=True,
                                  text=True, timeout=limit_s)
            rows = [line for line in proc.stdout.splitlines() if line.startswith("|")]
            print(rows[-1] if rows else f"| {variant} | failed (rc {proc.returncode}) |", flush=True)
        except subprocess.TimeoutExpired:
            print(f"| {variant} | no result within {limit_s} s (hung) |", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "tiles" and len(sys.argv) == 4:
        probe_tiles(sys.argv[2], sys.argv[3])
    elif mode == "ws":
        probe_ws()
    elif mode == "ws-one" and len(sys.argv) == 8:
        probe_ws_variant(*(int(v) for v in sys.argv[2:8]))
    else:
        sys.exit("usage: probe_mk_kernel.py tiles CASES SPECS | ws")
