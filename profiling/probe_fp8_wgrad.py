"""One fp8 grouped GEMM call, forward+backward, with the bf16 weight gradient against
``wgrad="fp8_rows"``, and the bf16 grouped GEMM op (``backend="native"``, mode
``bf16_native``) beside them: kernel time per call by kernel (torch.profiler) and wall time
per call.

    python profiling/probe_fp8_wgrad.py                                   # wide_1gpu's two expert GEMMs
    python profiling/probe_fp8_wgrad.py --shapes 64,2048,1408 --weights bf16   # the MoE issue's shape
    python profiling/probe_fp8_wgrad.py --situ --shapes 16,4096,2048      # the down GEMM with SiTU-GLU
    python profiling/probe_fp8_wgrad.py --shapes 64,2048,1408 --weights bf16 --host-profile 15   # and the host

With ``--situ`` each shape is the experts' down projection fed by SiTU-GLU: x is the packed
pre-activation z [M, 2K], and the modes are SiTU-GLU (``situ_glu_packed``, its op in both
directions) then the GEMM against the GEMM with SiTU-GLU fused into its row quantization
(``fp8_grouped_mm(situ=...)``), both with ``wgrad="fp8_rows"``.

Inputs as in training: x [M, K] bf16 with balanced 16-aligned groups, w [E, K, N] in
``--weights`` (fp32: the parameters under autocast) quantized once beforehand
(`quantize_weight`, as the weight cache does), a bf16 upstream gradient; grads reset before
each call. Three warm-up calls, five profiled, ten timed with CUDA events. Needs a CUDA GPU of
compute capability >= 8.9. A diagnostic: it prints, it does not compare against a target.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import group_sizes  # noqa: E402

from titan_moe.float8.grouped_mm import fp8_grouped_mm  # noqa: E402
from titan_moe.float8.quantize import quantize_weight  # noqa: E402
from titan_moe.model.situ import situ_glu_packed  # noqa: E402
from titan_moe.ops.grouped_gemm import grouped_mm  # noqa: E402


SITU = (4.0, 25.0)


def probe(E: int, M: int, K: int, N: int, w_dtype: torch.dtype, wgrad: str, situ_mode: str | None = None,
          host_profile: int = 0) -> str:
    """One line: ``wgrad``'s (or, with ``situ_mode`` "unfused" / "fused", that SiTU-GLU
    arrangement's) kernel and wall time per forward+backward call; with ``host_profile`` N,
    also the host's time per call and its N most expensive Python functions (cProfile over
    ten calls, by own time), for where a wall time above the kernel time goes."""
    offs = torch.tensor(group_sizes(M, E, "balanced"), device="cuda").cumsum(0).to(torch.int32)
    x_cols = 2 * K if situ_mode else K
    x = (torch.randn(M, x_cols, device="cuda") * (3.0 if situ_mode else K**-0.5)).bfloat16().requires_grad_()
    w = (torch.randn(E, K, N, device="cuda") / K**0.5).to(w_dtype).requires_grad_()
    dy = torch.randn(M, N, device="cuda").bfloat16()
    wq = quantize_weight(w.detach())

    def forward():
        if wgrad == "bf16_native":  # the bf16 grouped GEMM op the fp8 path replaces
            return grouped_mm(x, w.to(x.dtype), offs, backend="native")
        if situ_mode == "fused":
            return fp8_grouped_mm(x, w, offs, wgrad=wgrad, w_fp8=wq, situ=SITU)
        lhs = situ_glu_packed(x, *SITU) if situ_mode == "unfused" else x
        return fp8_grouped_mm(lhs, w, offs, wgrad=wgrad, w_fp8=wq)

    def call():
        x.grad = w.grad = None
        forward().backward(dy)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 5 / 1000
    top = sorted(((e.self_device_time_total / 5 / 1000, e.key[:60]) for e in events if e.self_device_time_total > 0),
                 reverse=True)[:12]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        call()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 10
    label = wgrad if situ_mode is None else f"{wgrad} situ {situ_mode}"
    host = _host_profile(call, host_profile) if host_profile else ""
    return (f"E{E} K{K} N{N} {label}: kernels {total:.3f} ms/call, wall {wall:.3f} ms/call; "
            + "; ".join(f"{name} {ms:.3f}" for ms, name in top) + host)


def _host_profile(call, top: int, calls: int = 10) -> str:
    """cProfile over ``calls`` calls (then one synchronize): the host's time per call and the
    ``top`` functions by own time, as extra lines."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    total = sum(own for _, _, own, _, _ in stats.values())
    rows = sorted(((own, n, f"{os.path.basename(file)}:{line}({name})") for (file, line, name), (n, _, own, _, _)
                   in stats.items()), reverse=True)[:top]
    lines = [f"\n  host {total / calls * 1e3:.3f} ms/call (cProfile's own times; the profiler inflates them)"]
    lines += [f"\n    {own / calls * 1e3:7.3f} ms/call  {n // calls:4d} calls  {where}" for own, n, where in rows]
    return "".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16,2048,8192;16,4096,2048", help="E,K,N;... (M = --tokens)")
    parser.add_argument("--tokens", type=int, default=65_536)
    parser.add_argument("--weights", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--situ", action="store_true", help="the down GEMM fed by SiTU-GLU, unfused against fused")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also cProfile the host side of each mode: its N most expensive Python functions")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("probe_fp8_wgrad: needs a CUDA GPU of compute capability >= 8.9")
    w_dtype = torch.float32 if args.weights == "fp32" else torch.bfloat16
    for shape in args.shapes.split(";"):
        E, K, N = (int(v) for v in shape.split(","))
        if args.situ:
            for mode in ("unfused", "fused"):
                print(probe(E, args.tokens, K, N, w_dtype, "fp8_rows", mode, args.host_profile), flush=True)
        else:
            for wgrad in ("bf16_native", "bf16", "fp8_rows"):
                print(probe(E, args.tokens, K, N, w_dtype, wgrad, host_profile=args.host_profile), flush=True)


if __name__ == "__main__":
    main()
