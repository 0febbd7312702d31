"""Raw `torch._scaled_grouped_mm` against bf16 `torch._grouped_mm` on pre-quantized operands
(no quantization timed): forward (2d x 3d) with and without fast accumulation, dx (2d x 3d,
the weights transposed), the 2d x 2d weight gradient with flattened per-group scales, and
the cost of plain casts for comparison. Needs a CUDA GPU of compute capability >= 8.9.

    python profiling/probe_scaled_grouped_mm.py [--experts 64 --tokens 65536 --k 2048 --n 1408]

Prints one line per case: median ms of `triton.testing.do_bench` and TFLOP/s (GEMM rows).
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=1408)
    args = parser.parse_args(argv)
    import torch
    from triton.testing import do_bench

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("probe_scaled_grouped_mm: needs a CUDA GPU of compute capability >= 8.9")
    E, M, K, N = args.experts, args.tokens, args.k, args.n
    if M % (16 * E) or K % 16 or N % 16:
        raise SystemExit("probe_scaled_grouped_mm: tokens must split into equal groups of multiples of 16; k, n multiples of 16")
    torch.manual_seed(0)
    f8, dev = torch.float8_e4m3fn, "cuda"
    flop = 2 * M * K * N
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (M // E)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / K**0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    xq, dyq = x.to(f8), dy.to(f8)
    w_col = w.transpose(1, 2).contiguous().to(f8).transpose(1, 2)  # [E, K, N] column-major
    w_row = w.to(f8)  # row-major: .transpose(1, 2) is the dx operand
    xtq, dy_col = x.t().contiguous().to(f8), dy.t().contiguous().to(f8).t()
    ones = lambda *shape: torch.ones(*shape, device=dev)  # noqa: E731
    cases = [
        ("bf16 forward", True, lambda: torch._grouped_mm(x, w, offs=offs)),
        ("bf16 dx", True, lambda: torch._grouped_mm(dy, w.transpose(1, 2), offs=offs)),
        ("bf16 dw", True, lambda: torch._grouped_mm(x.t(), dy, offs=offs)),
        ("fp8 forward, exact accumulation", True,
         lambda: torch._scaled_grouped_mm(xq, w_col, ones(M), ones(E, N), offs=offs, out_dtype=torch.bfloat16)),
        ("fp8 forward, fast accumulation", True,
         lambda: torch._scaled_grouped_mm(xq, w_col, ones(M), ones(E, N), offs=offs, out_dtype=torch.bfloat16,
                                          use_fast_accum=True)),
        ("fp8 dx, fast accumulation", True,
         lambda: torch._scaled_grouped_mm(dyq, w_row.transpose(1, 2), ones(M), ones(E, K), offs=offs,
                                          out_dtype=torch.bfloat16, use_fast_accum=True)),
        ("fp8 dw (2d x 2d), fast accumulation", True,
         lambda: torch._scaled_grouped_mm(xtq, dy_col, ones(E * K), ones(E * N), offs=offs,
                                          out_dtype=torch.bfloat16, use_fast_accum=True)),
        ("x cast to fp8", False, lambda: x.to(f8)),
        ("x copy", False, lambda: x.clone()),
    ]
    print(f"E={E} M={M} K={K} N={N}, {flop / 1e9:.0f} GFLOP per GEMM, {torch.cuda.get_device_name()}")
    for name, is_gemm, fn in cases:
        ms = do_bench(fn, warmup=25, rep=100)
        print(f"{name:40s} {ms:8.3f} ms" + (f"  {flop / ms / 1e9:6.0f} TFLOP/s" if is_gemm else ""), flush=True)


if __name__ == "__main__":
    main()
