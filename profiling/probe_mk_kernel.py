"""Probes of the grouped GEMM's forward / dx kernel on an sm90 GPU (not a benchmark of the op).

``tiles CASES SPECS``, printing a Markdown table: the forward and the dx product
(``dy @ w[e]^T``) of each case through `grouped_mm_triton` with each tile spec (``""`` = the default, else
``BMxBNxBKxWARPSxSTAGES[t]`` as `parse_tile` reads it; ``@P`` after either: exactly P persistent
programs, e.g. ``@128`` or ``256x128x64x8x3t@96``) beside ``torch._grouped_mm``, CUDA-graph
replays in interleaved rounds (`bench_moe.measure_rounds`), every output checked against the peer.

    python profiling/probe_mk_kernel.py tiles e64_bal,e64_zipf,layer_gate_up ,128x256x64x8x3t,@128
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CASES = {  # name: (E, M, K, N, group sizes)
    "e64_bal": (64, 65536, 2048, 1408, "balanced"), "e64_zipf": (64, 65536, 2048, 1408, "zipf"),
    "e64_m32k_bal": (64, 32768, 2048, 1408, "balanced"), "e64_m32k_zipf": (64, 32768, 2048, 1408, "zipf"),
    "layer_gate_up": (64, 65536, 1024, 2816, "balanced"), "layer_down": (64, 65536, 1408, 1024, "balanced"),
}


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


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "tiles" and len(sys.argv) == 4:
        probe_tiles(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: probe_mk_kernel.py tiles CASES SPECS")
