"""Host time per call of the grouped GEMM op's backends: what a call costs the CPU (argument
checks, descriptors, the launcher), which the GPU waits for wherever the kernels are shorter
than the host's work or the host falls behind (an eager MoE layer).

    python profiling/host_cost_gemm.py [CALLS]   # default 300 calls per backend and product

Per backend and product (fwd, dx, dw) at E = 64, 16 rows per group, K 2,048, N 1,408 (bf16):
the mean wall time of CALLS back-to-back calls with no synchronization inside (the launch
queue absorbs them, so the loop measures the host alone), after warm-up calls; also the
same for a bare ``torch._grouped_mm`` call, the floor.
"""

from __future__ import annotations

import sys
import time

import torch

from titan_moe.ops.grouped_gemm.op import _grouped_mm_dw_impl, _grouped_mm_dx_impl, _grouped_mm_impl


def host_ms(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def main() -> None:
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
        sys.exit("usage: host_cost_gemm.py [CALLS]")
    if not torch.cuda.is_available():
        sys.exit("host_cost_gemm.py: needs a CUDA GPU (it times the host's side of GPU launches)")
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    E, K, N, rows = 64, 2048, 1408, 16
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows
    x = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(E * rows, N, device="cuda", dtype=torch.bfloat16)
    print("| backend | fwd us | dx us | dw us |\n| --- | --- | --- | --- |")
    print(f"| torch._grouped_mm (bare) | {host_ms(lambda: torch._grouped_mm(x, w, offs=offs), calls) * 1e3:.1f} | "
          f"{host_ms(lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offs), calls) * 1e3:.1f} | "
          f"{host_ms(lambda: torch._grouped_mm(x.t(), dy, offs=offs), calls) * 1e3:.1f} |")
    for backend in ("native", "triton", "gluon"):
        fwd = host_ms(lambda: _grouped_mm_impl(x, w, offs, backend), calls)
        dx = host_ms(lambda: _grouped_mm_dx_impl(dy, w, offs, backend), calls)
        dw = host_ms(lambda: _grouped_mm_dw_impl(x, dy, offs, backend), calls)
        print(f"| {backend} | {fwd * 1e3:.1f} | {dx * 1e3:.1f} | {dw * 1e3:.1f} |", flush=True)


if __name__ == "__main__":
    main()
