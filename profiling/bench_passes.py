"""Benchmark: what the router-fusion compile pass changes in the compiled router region.

    python profiling/bench_passes.py                  # CUDA if available, else CPU; the shapes below
    python profiling/bench_passes.py --device cpu
    python profiling/bench_passes.py --tiny           # plumbing check: one tiny shape, few repeats

Region: ``logits [N, n] fp32 -> scores = sigmoid(logits) -> route(scores, bias, k, scale)``
(:func:`titan_moe.model.moe.route`, what ``TopKRouter`` does after its matmul), returning
the expert indices and weights; the backward takes a fixed random gradient of the weights
to the logits. The matmul before it is left out: the pass does not change it.

Variants, same inputs:

* ``eager``: plain PyTorch;
* ``inductor``: ``torch.compile(backend="inductor", fullgraph=True)``;
* ``inductor+router_fusion``: the same through
  ``titan_moe.compile_passes.make_backend("inductor")``, so the region becomes one
  ``titan_moe::router_topk`` call (the Triton kernel on CUDA, the PyTorch implementation
  on CPU) and its backward.

Columns:

* ``kernels``: kernels Inductor generated for forward and backward, counted as kernel
  definitions in its output code (``torch._inductor.metrics.generated_kernel_count`` is in
  the JSON too; on CPU with torch 2.13 it exceeds the kernels in the code, e.g. 6 or 9 for
  3, depending on the shape);
* ``extern``: calls of ATen fallbacks, extern kernels and our op in the same code (not
  generated kernels, but launches all the same);
* ``saved_MB``: bytes of the tensors autograd keeps for the backward;
* ``fwd_ms`` / ``fwd_bwd_ms``: medians (CUDA: ``triton.testing.do_bench``; CPU: wall clock
  over ``--reps`` runs after a warm-up; the JSON also has the minima, ``*_min_ms``);
* ``idx=`` / ``w_err`` / ``grad_err``: indices equal to eager's, and relative errors
  ``||a - b|| / ||b||`` of the weights and of the logits' gradient against eager.

Inputs: standard normal logits and a bias of std 0.01, so that tied biased scores are
vanishingly rare (the fused op breaks ties by index, ``topk`` leaves them unspecified).
On a shared CPU, ``--threads 1`` gives steadier numbers: with several OpenMP threads a
busy core stalls every parallel region.

All variants of a shape are compiled first, then timed round-robin (CPU: one call of each
variant per round). Inductor's FX-graph and AOTAutograd caches are off while compiling,
so every variant compiles and its kernels are counted. The last line of stdout is one JSON object with everything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from collections.abc import Callable

import torch

SHAPES = [(8192, 64, 4), (8192, 896, 16)]
TINY_SHAPES = [(64, 16, 2)]
ROUTED_SCALE = 2.5
VARIANTS = ("eager", "inductor", "inductor+router_fusion")


def router_region(logits_Nn: torch.Tensor, bias_n: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from titan_moe.model.moe import route

    return route(torch.sigmoid(logits_Nn), bias_n, top_k, ROUTED_SCALE)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(N: int, n: int, k: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, n, generator=gen).to(device)
    bias = (0.01 * torch.randn(n, generator=gen)).to(device)
    grad_w = torch.randn(N, k, generator=gen).to(device)
    return logits, bias, grad_w


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


_CALL = re.compile(r"^(?:\w+ = )?(?:torch\.ops\.)?((?:aten|titan_moe)\.\w+|extern_kernels\.\w+)")


_KERNEL_DEF = re.compile(r"= async_compile\.(?:triton|cpp|cpp_pybinding)\(")


def kernel_definitions(codes: list[str]) -> int:
    """Kernels defined in Inductor's output code (Triton on CUDA, C++ on CPU)."""
    return sum(len(_KERNEL_DEF.findall(code)) for code in codes)


def extern_calls(codes: list[str]) -> list[str]:
    """Calls of ATen fallbacks, extern kernels and our custom ops in Inductor's output code."""
    calls = []
    for code in codes:
        for line in code.splitlines():
            match = _CALL.match(line.strip())
            if match and not match.group(1).startswith("aten.empty"):
                calls.append(match.group(1))
    return sorted(calls)


def time_cpu(fns: dict[str, Callable], reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) ms per function, timed round-robin (one call of each per round) so that
    load changes on a shared machine hit every variant alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def time_cuda(fns: dict[str, Callable], reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) ms per function from ``triton.testing.do_bench``."""
    import triton.testing

    return {name: tuple(triton.testing.do_bench(fn, warmup=10, rep=max(reps, 20), quantiles=[0.5, 0.0]))
            for name, fn in fns.items()}


def prepare_variant(variant: str, N: int, n: int, k: int, device: torch.device) -> tuple[dict, dict, tuple]:
    """Compile one variant and run it once: its row (kernels, extern calls, saved bytes), its
    timed closures {"fwd", "fwd_bwd"} and its (indices, weights, logits gradient)."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    from titan_moe import compile_passes

    logits, bias, grad_w = make_inputs(N, n, k, device)
    logits.requires_grad_()
    row = {"kernels": None, "extern": None}
    fn = router_region
    if variant != "eager":
        backend = compile_passes.make_backend("inductor") if variant == "inductor+router_fusion" else "inductor"
        fn = torch.compile(router_region, backend=backend, fullgraph=True)

    def fwd():  # the training forward (records the autograd graph)
        return fn(logits, bias, k)

    def fwd_bwd():
        idx, w = fwd()
        (grad,) = torch.autograd.grad(w, logits, grad_w)
        return idx, w, grad

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        metrics.reset()
        out, codes = run_and_get_code(fwd_bwd)
    if variant != "eager":
        row["kernels"] = kernel_definitions(codes)
        row["metrics_kernel_count"] = metrics.generated_kernel_count
        row["extern"] = extern_calls(codes)
    row["saved_MB"] = saved_bytes(fwd) / 2**20
    return row, {"fwd": fwd, "fwd_bwd": fwd_bwd}, out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--tiny", action="store_true", help="one tiny shape, 3 repeats: a plumbing check")
    parser.add_argument("--reps", type=int, default=None, help="timed repeats per measurement")
    parser.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    reps = args.reps or (3 if args.tiny else (100 if device.type == "cuda" else 10))

    import triton

    report = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "routed_scale": ROUTED_SCALE,
        "reps": reps,
        "cases": [],
    }
    print(f"{'N':>6} {'n':>5} {'k':>3}  {'variant':<24} {'kernels':>7} {'saved_MB':>9} {'fwd_ms':>9} "
          f"{'fwd_bwd_ms':>10}  {'idx=':>4} {'w_err':>8} {'grad_err':>8}  extern")
    time_fns = time_cuda if device.type == "cuda" else time_cpu
    for N, n, k in shapes:
        torch._dynamo.reset()
        case = {"N": N, "n": n, "k": k, "variants": {}}
        closures, outs = {}, {}
        for variant in VARIANTS:
            case["variants"][variant], closures[variant], outs[variant] = prepare_variant(variant, N, n, k, device)
        for what in ("fwd", "fwd_bwd"):
            timed = time_fns({variant: closures[variant][what] for variant in VARIANTS}, reps)
            for variant, (median, low) in timed.items():
                case["variants"][variant].update({f"{what}_ms": median, f"{what}_min_ms": low})
        ref_idx, ref_w, ref_grad = outs["eager"]
        for variant in VARIANTS:
            idx, w, grad = outs[variant]
            row = case["variants"][variant]
            row.update(idx_equal=bool(torch.equal(idx, ref_idx)), w_err=rel_err(w, ref_w),
                       grad_err=rel_err(grad, ref_grad))
            kernels = "-" if row["kernels"] is None else str(row["kernels"])
            extern = "" if row["extern"] is None else ", ".join(row["extern"])
            print(f"{N:>6} {n:>5} {k:>3}  {variant:<24} {kernels:>7} {row['saved_MB']:>9.3f} {row['fwd_ms']:>9.3f} "
                  f"{row['fwd_bwd_ms']:>10.3f}  {str(row['idx_equal'])[0]:>4} {row['w_err']:>8.1e} "
                  f"{row['grad_err']:>8.1e}  {extern}", flush=True)
        base, fused = case["variants"]["inductor"], case["variants"]["inductor+router_fusion"]
        case["fused_over_inductor"] = {
            "fwd": fused["fwd_ms"] / base["fwd_ms"],
            "fwd_bwd": fused["fwd_bwd_ms"] / base["fwd_bwd_ms"],
            "kernels": [base["kernels"], fused["kernels"]],
        }
        report["cases"].append(case)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
