"""Benchmark: our KDA operator vs fla-core's `chunk_kda`, forward and forward+backward.

    python profiling/bench_kda.py                      # H200: the issue's shapes, bf16
    python profiling/bench_kda.py --device cpu --tiny  # plumbing check only, no speed claim

Both sides get the same raw inputs and the same semantics: q/k L2-normalised, the bounded
gate g = -5 * sigmoid(exp(A_log) * (z + dt_bias)) applied to raw z, beta given. fla fuses
norm and gate into its kernels (`use_qk_l2norm_in_kernel`, `use_gate_in_kernel`,
`safe_gate`, `lower_bound=-5`); ours runs them as the `titan_moe::kda_prepare` op before
the core op (eager). Our side uses the Triton kernels (the `[kernels] kda` choice is set to
triton by this script) unless `--backend torch`.

`--scan-configs 16x4,64x8` adds rows for ours with the sequential state walks run at those
columns-per-program x warps (`TITAN_MOE_KDA_SCAN_BV` / `_WARPS`; default: 4 warps, the widest
block that still gives every SM a program, see `sequential_scan_config`).
`--profile-once` times nothing: per row one warm call inside cudaProfilerStart/Stop, for
Nsight Compute (`gpu_suite.sh OUT kda_ncu`, `profiling/ncu_table.py`).
`--host-profile CALLS` times nothing either: per row, CALLS warm calls under cProfile, the
host time per call beside the wall time, and the functions that take it.
`--cuda-graphs` adds, per row, the same call replayed from a CUDA graph (`ours+graph`,
`fla+graph`): no host work between kernels, so the gap to the plain row is the host's share.
`--variants recompute:kernels.kda_keep=false,c64x32:TITAN_MOE_KDA_BWD_CHUNK=64x32x8x8,...` adds
rows for ours under other kernel choices (`kernels.FIELD=VALUE`, `titan_moe.ops.choices`) or
launch-tuning variables (read per call by our ops). `--kernels N` adds, per row, the N most expensive kernels of one call (torch.profiler), for
both sides: where the time goes, stage by stage. Reported per shape: median milliseconds (triton.testing.do_bench on CUDA, a timer loop on
CPU), tokens/s, and TFLOP/s by Kimi Linear's forward FLOP count per head
6*T*dk^2 + 3*T*C*dk + T*C^2 (C = 64), backward counted as twice the forward.
The last line is one JSON object with every row.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import time

SHAPES_GPU = [  # (B, T, H, dk)
    (1, 8192, 16, 128),
    (1, 32768, 16, 128),
    (1, 131072, 16, 128),
    (8, 4096, 16, 128),
]
SHAPES_TINY = [(1, 128, 2, 16), (2, 64, 2, 16)]
CHUNK = 64


def kda_flops(B: int, T: int, H: int, dk: int, backward: bool) -> float:
    forward = B * H * (6 * T * dk * dk + 3 * T * CHUNK * dk + T * CHUNK * CHUNK)
    return forward * (3 if backward else 1)


def make_inputs(B, T, H, dk, device, dtype, seed=0):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    return dict(
        q=randn(B, T, H, dk), k=randn(B, T, H, dk), v=randn(B, T, H, dk),
        z=randn(B, T, H, dk), beta=torch.rand(B, T, H, generator=gen).to(device=device, dtype=dtype),
        A_log=torch.zeros(H, device=device, dtype=torch.float32),
        dt_bias=(torch.randn(H * dk, generator=gen) * 0.5).to(device=device, dtype=torch.float32),
    )


def run_ours(inp, backward: bool):
    from titan_moe.ops.kda import chunk_kda

    o, _ = chunk_kda(inp["q"], inp["k"], inp["v"], inp["z"], inp["beta"], use_qk_l2norm=True,
                     gate_in_kernel=True, A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=-5.0)
    if backward:
        o.backward(inp["do"])
    return o


def run_fla(inp, backward: bool):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    o, _ = fla_chunk_kda(inp["q"], inp["k"], inp["v"], inp["z"], inp["beta"], A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         safe_gate=True, lower_bound=-5.0)
    if backward:
        o.backward(inp["do"])
    return o


def median_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=reps * 10, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def bench(args) -> list[dict]:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = SHAPES_TINY if args.tiny else SHAPES_GPU
    peers = {"ours": run_ours}
    from titan_moe.ops.kda.triton_fwd import SCAN_BV_ENV, SCAN_WARPS_ENV

    for config in filter(None, args.scan_configs.split(",")):
        bv, warps = (int(x) for x in config.split("x"))
        peers[f"ours_bv{bv}w{warps}"] = env_runner({SCAN_BV_ENV: str(bv), SCAN_WARPS_ENV: str(warps)})
    for name, env in parse_variants(args.variants).items():
        peers[f"ours_{name}"] = env_runner(env)
    if args.device == "cuda" and not args.no_fla:
        peers["fla"] = run_fla
    if args.shapes:
        wanted = {int(t) for t in args.shapes.split(",")}
        shapes = [s for s in shapes if s[1] in wanted]
    rows = []
    print(HEADER, flush=True)
    for B, T, H, dk in shapes:
        for backward in (False, True):
            for name, runner in peers.items():
                inp = make_inputs(B, T, H, dk, args.device, dtype)
                for key in ("q", "k", "v", "z", "beta"):
                    inp[key].requires_grad_(backward)
                inp["do"] = torch.randn_like(inp["v"])

                def step(runner=runner, inp=inp, backward=backward):
                    if backward:
                        for key in ("q", "k", "v", "z", "beta"):
                            inp[key].grad = None
                    return runner(inp, backward)

                if args.profile_once:
                    profile_once(step, args.device)
                    print(f"profiled one call: {name} {'fwd+bwd' if backward else 'fwd'} B={B} T={T}", flush=True)
                    continue
                if args.host_profile:
                    host_profile(step, args.device, args.host_profile, f"{name} {'fwd+bwd' if backward else 'fwd'} "
                                 f"B={B} T={T}")
                    continue
                direction = "fwd+bwd" if backward else "fwd"
                flops = kda_flops(B, T, H, dk, backward)

                def row(impl: str, ms: float) -> dict:
                    return dict(impl=impl, B=B, T=T, H=H, dk=dk, direction=direction, ms=ms,
                                tokens_per_s=B * T / (ms / 1e3), tflops=flops / (ms / 1e3) / 1e12)

                rows.append(row(name, median_ms(step, args.device, args.reps)))
                print(format_row(rows[-1]), flush=True)
                if args.kernels:
                    rows[-1]["kernels_ms"] = kernel_times(step, args.device)
                    for kernel, k_ms in list(rows[-1]["kernels_ms"].items())[: args.kernels]:
                        print(f"    {k_ms:9.3f} ms  {kernel[:100]}", flush=True)
                if args.cuda_graphs:
                    try:
                        replay = graph_replay(step)
                    except Exception as e:  # e.g. a peer that reads a device value on the host
                        print(f"{name} {direction} B={B} T={T}: CUDA graph capture failed: "
                              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                    else:
                        rows.append(row(f"{name}+graph", median_ms(replay, args.device, args.reps)))
                        print(format_row(rows[-1]), flush=True)
                        del replay  # frees the graph's memory pool before the next row
    return rows


def graph_replay(fn):
    """One call of `fn` captured into a CUDA graph; returns its replay. Replaying issues the
    captured kernels with no Python, launcher or dispatcher work, so its time is the GPU's
    alone: beside the plain row it shows how much of a call waits on the host. Warmed up on a
    side stream first (the CUDA-graph recipe: compilation, autotuning and first allocations
    outside the capture); the gradients `fn` produces live in the graph's own memory pool."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def profile_once(fn, device: str) -> None:
    """One warm call of `fn` between cudaProfilerStart and cudaProfilerStop, so that a
    profiler started with `--profile-from-start off` (Nsight Compute's `ncu`) sees exactly
    one call's kernels, compiled beforehand."""
    import torch

    fn()
    if device != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def host_profile(fn, device: str, calls: int, label: str, top: int = 25) -> None:
    """Where the host's time goes: `calls` warm calls of `fn` under cProfile, issued back to
    back and synchronized once at the end. Prints the host time per call (the Python loop
    alone, before the final synchronize; when it exceeds the GPU kernels' time the GPU waits on
    the host), the wall time per call, and the `top` functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    fn()
    sync()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    t_host = time.perf_counter()
    sync()
    t_end = time.perf_counter()
    print(f"host profile, {label}: host {(t_host - t0) / calls * 1e3:.3f} ms per call, wall "
          f"{(t_end - t0) / calls * 1e3:.3f} ms per call (under cProfile; {calls} calls)", flush=True)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(text.getvalue(), flush=True)


def parse_variants(spec: str) -> dict[str, dict[str, str]]:
    """`NAME:VAR=VALUE[+VAR=VALUE],...` -> {NAME: {VAR: VALUE}} (`--variants`; VAR a
    `TITAN_MOE_*` variable or `kernels.FIELD` of the kernel choices)."""
    variants = {}
    for item in filter(None, spec.split(",")):
        name, sep, settings = item.partition(":")
        pairs = [kv.partition("=") for kv in settings.split("+")]
        if not sep or not name or any(not k or not eq for k, eq, _ in pairs):
            raise SystemExit(f"bench_kda: --variants takes NAME:VAR=VALUE[+VAR=VALUE],..., got {item!r}")
        variants[name] = {k: v for k, _, v in pairs}
    return variants


def kernel_choices(settings: dict[str, str]) -> dict:
    """The `kernels.FIELD` entries of a variant as `KernelChoices` fields (bool fields from
    true/false/1/0); unknown fields raise."""
    import dataclasses

    from titan_moe.ops.choices import KernelChoices

    fields = {f.name: f for f in dataclasses.fields(KernelChoices)}
    out = {}
    for key, value in settings.items():
        name = key.removeprefix("kernels.")
        if name not in fields:
            raise SystemExit(f"bench_kda: {key} is not a kernel choice ({sorted(fields)})")
        default = getattr(KernelChoices(), name)
        out[name] = value.lower() in ("1", "true") if isinstance(default, bool) else value
    return out


@contextlib.contextmanager
def variant(settings: dict[str, str]):
    """A `--variants` entry in force: `kernels.FIELD` entries as kernel choices
    (`choices.using`, which checks them), the others as environment variables (launch tuning,
    read per call: the state walks' columns and warps, the backward's blocks, ...)."""
    from bench_moe import env_vars  # profiling/ is on the path when this runs as a script

    from titan_moe.ops import choices

    fields = kernel_choices({k: v for k, v in settings.items() if k.startswith("kernels.")})
    variables = {k: v for k, v in settings.items() if not k.startswith("kernels.")}
    with env_vars(variables), choices.using(**fields):
        yield


def env_runner(settings: dict[str, str]):
    """`run_ours` under a `--variants` entry (`variant`) around each call."""

    def run(inp, backward: bool):
        with variant(settings):
            return run_ours(inp, backward)

    return run


def kernel_times(fn, device: str, iters: int = 3) -> dict[str, float]:
    """Per-kernel time of one call of `fn` (mean over `iters` profiled calls), largest first:
    torch.profiler's device time on CUDA, its CPU time per op elsewhere."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    fn()  # compiled and warm before the window
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if us > 0 and (device != "cuda" or event.device_type.name == "CUDA"):
            times[event.key] = us / iters / 1e3
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


HEADER = (f"{'impl':12} {'pass':8} {'B':>3} {'T':>7} {'H':>3} {'dk':>4} {'ms':>9} {'Mtok/s':>8} {'TFLOP/s':>8} "
          f"{'kernels ms':>10}")


def format_row(r: dict) -> str:
    """One table row; `kernels ms` (with --kernels) is the sum of the profiled times: on CUDA
    the device kernels, so well below `ms` means the call waits on the host (launches, glue);
    on the CPU nested operator times (not comparable with `ms`)."""
    kernels = f"{sum(r['kernels_ms'].values()):10.3f}" if "kernels_ms" in r else f"{'-':>10}"
    return (f"{r['impl']:12} {r['direction']:8} {r['B']:>3} {r['T']:>7} {r['H']:>3} {r['dk']:>4} "
            f"{r['ms']:9.3f} {r['tokens_per_s'] / 1e6:8.3f} {r['tflops']:8.2f} {kernels}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (plumbing check)")
    parser.add_argument("--backend", default="triton", choices=["triton", "torch"])
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also profile one call per row and print its N most expensive kernels")
    parser.add_argument("--shapes", default="", help="comma-separated sequence lengths to keep, e.g. 8192,32768")
    parser.add_argument("--scan-configs", default="", metavar="BVxWARPS,...",
                        help="also time ours with these state-walk configurations, e.g. 16x4,32x4,64x8")
    parser.add_argument("--variants", default="", metavar="NAME:VAR=VALUE[+VAR=VALUE],...",
                        help="also time ours with these kernel choices or tuning variables, e.g. "
                        "recompute:kernels.kda_keep=false,c64:TITAN_MOE_KDA_BWD_CHUNK=64x32x8x8")
    parser.add_argument("--profile-once", action="store_true",
                        help="no timing: one warm call per row inside cudaProfilerStart/Stop (for ncu "
                        "--profile-from-start off, `profiling/ncu_table.py`)")
    parser.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                        help="no timing: per row, CALLS warm calls under cProfile (where the host's time goes, "
                        "for shapes whose calls wait on the host)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time each row replayed from a CUDA graph (`<impl>+graph` rows: the GPU's "
                        "time without the host's launches)")
    parser.add_argument("--watchdog", type=float, default=0.0,
                        help="dump every thread's stack every this many seconds (finding hangs)")
    args = parser.parse_args()
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    if args.watchdog > 0:
        faulthandler.dump_traceback_later(args.watchdog, repeat=True)
    from titan_moe.ops import choices

    backend = args.backend if args.device == "cuda" else "torch"
    choices.activate(choices.KernelChoices(kda=backend))
    rows = bench(args)
    print("\n" + HEADER)
    for r in rows:
        print(format_row(r))
    print(json.dumps({"device": args.device, "backend": backend, "rows": rows}))


if __name__ == "__main__":
    main()
