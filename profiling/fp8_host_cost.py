"""Host time of one fp8 grouped GEMM call (forward+backward) without its GPU work, on the CPU.

    python profiling/fp8_host_cost.py                 # both paths: fp8 (wgrad fp8_rows, fp8), bf16 op
    python profiling/fp8_host_cost.py --calls 2000

What a call costs the host decides whether the GPU waits for it: at the MoE benchmark's
shape the fp8 path issued its work more slowly than the H200 ran it (BENCHMARKS.md, "fp8
expert GEMM at E = 64 timed three ways"). Here every Triton launch is replaced by a no-op
and ``torch._scaled_grouped_mm`` by an empty result, so what is timed is our Python, torch's
op dispatch and autograd: the part of the host time that does not depend on the GPU's
driver. Two paths, interleaved in rounds: ``ops`` (the custom ops, as under torch.compile)
and ``eager`` (the same functions without the custom-op dispatch, what an eager call runs).
The same two paths of the bf16 ``grouped_mm`` op ("bf16" rows) run its real CPU GEMMs
(fp32, [128, 32] x [8, 32, 32]): there the dispatch is the difference, not the whole time.
The row "eager fp8_rows/single_requants" runs the fp8_rows backward's two requantizations
one tensor at a time (four launches, the form before the pair kernels): with the launches
stubbed out it shows only the Python around them (the same within 1-2%), not the two
launches the pair saves, which only a GPU run can time.
A diagnostic on tiny tensors: it prints medians, it does not compare against a target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def stub_gpu_work() -> None:
    """Triton launches become no-ops, the fp8 GEMM returns an empty result, and the kernels
    are taken to run on the CPU (so the launchers, not the references, are called)."""
    import titan_moe.float8.grouped_mm as fgm
    import titan_moe.float8.quantize as fq
    import titan_moe.ops.grouped_gemm.zero_fill as zf

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for module, names in ((fq, ["_rows_kernel", "_group_row_factors_kernel", "_requant_tiles_kernel",
                                "_group_row_factors_pair_kernel", "_requant_tiles_pair_kernel",
                                "_weight_amax_kernel", "_weight_quant_kernel", "_group_cols_kernel"]),
                          (zf, ["_zero_rows_past_kernel", "_zero_empty_groups_kernel"])):
        for name in names:
            setattr(module, name, NoLaunch())
    fq.kernels_run_on = lambda device: True
    fq.check_runs_on = lambda *args, **kwargs: None
    fq.interpreted = lambda: False

    def scaled_gemm(a, b, scale_a, scale_b, offs_E, out_dtype, widen="", kernels=""):
        if b.dim() == 3:
            out = torch.empty(a.shape[0], b.shape[2], dtype=torch.bfloat16)
        else:
            out = torch.empty(offs_E.shape[0], a.shape[0], b.shape[1], dtype=torch.bfloat16)
        return fgm.to_dtype(fgm._zero_unwritten(out, offs_E), out_dtype, widen)

    fgm._scaled_grouped_gemm = scaled_gemm


def measure(calls: int, rounds: int) -> dict[str, float]:
    """Median microseconds per forward+backward of each (path, wgrad) over interleaved rounds."""
    import titan_moe.float8.quantize as fq
    from titan_moe.float8.grouped_mm import fp8_grouped_mm

    E, K, N = 64, 64, 32
    offs = torch.arange(1, E + 1, dtype=torch.int32) * 16
    x = torch.randn(E * 16, K, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, K, N, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(E * 16, N, dtype=torch.bfloat16)
    w_fp8 = fq.quantize_weight_reference(w.detach())
    is_compiling = torch.compiler.is_compiling

    def call(path: str, wgrad: str):
        def run():
            x.grad = w.grad = None
            torch.compiler.is_compiling = (lambda: True) if path == "ops" else is_compiling
            try:
                fp8_grouped_mm(x, w, offs, wgrad=wgrad, w_fp8=w_fp8).backward(dy)
            finally:
                torch.compiler.is_compiling = is_compiling
        return run

    runs = {f"{path} {wgrad}": call(path, wgrad) for wgrad in ("fp8_rows", "fp8") for path in ("ops", "eager")}
    runs["eager fp8_rows/single_requants"] = _with_single_requants(call("eager", "fp8_rows"))
    runs.update({f"{path} bf16": _bf16_call(path) for path in ("ops", "eager")})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        for _ in range(10):
            fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(v) for name, v in times.items()}


def _with_single_requants(run):
    """``run`` with the fp8_rows backward's two requantizations launched one tensor at a time
    (two launches each, the form before ``requantize_group_columns_pair``)."""
    import titan_moe.float8.grouped_mm as fgm
    import titan_moe.float8.quantize as fq

    def two_single_calls(qa, sa, qb, sb, offs):
        return fq.requantize_group_columns(qa, sa, offs), fq.requantize_group_columns(qb, sb, offs)

    def wrapped():
        pair = fgm.requantize_group_columns_pair
        fgm.requantize_group_columns_pair = two_single_calls
        try:
            run()
        finally:
            fgm.requantize_group_columns_pair = pair
    return wrapped


def _bf16_call(path: str):
    """One forward+backward of the bf16 grouped GEMM op (native backend, CPU GEMMs) through
    ``path``: "ops" (the custom op, as under torch.compile) or "eager"."""
    from titan_moe.ops.grouped_gemm import grouped_mm

    E, K, N = 8, 32, 32
    offs = torch.arange(1, E + 1, dtype=torch.int32) * 16
    x = torch.randn(E * 16, K, requires_grad=True)
    w = torch.randn(E, K, N, requires_grad=True)
    dy = torch.randn(E * 16, N)
    is_compiling = torch.compiler.is_compiling

    def run():
        x.grad = w.grad = None
        torch.compiler.is_compiling = (lambda: True) if path == "ops" else is_compiling
        try:
            grouped_mm(x, w, offs, "native").backward(dy)
        finally:
            torch.compiler.is_compiling = is_compiling
    return run


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per round and path")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    stub_gpu_work()
    medians = measure(args.calls, args.rounds)
    print("# grouped GEMM host time per forward+backward (fp8: GPU work stubbed out; bf16: real CPU GEMMs); "
          f"torch {torch.__version__}")
    for name, us in medians.items():
        print(f"{name:28s} {us:8.1f} us")
    for kind in ("fp8_rows", "fp8", "bf16"):
        print(f"eager / ops ({kind}): {medians[f'eager {kind}'] / medians[f'ops {kind}']:.2f}")
    sys.stdout.flush()
    return medians


if __name__ == "__main__":
    main()
