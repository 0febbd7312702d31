"""The KDA op's host cost without a GPU: our launchers, the ops' dispatch and autograd, with
every Triton launch replaced by a no-op.

    python profiling/kda_host_cost.py                     # B=1 T=8192 H=16 dk=128, bf16
    python profiling/kda_host_cost.py --profile 20        # and where the time goes (cProfile)

On the GPU a small call waits on the host (`bench_kda.py --host-profile`: at T = 8K the
forward+backward's kernels take about half its wall time). This script measures the part of
that host time that is ours, on any machine: it registers the CUDA adapters of the four KDA
ops (`triton_op`, `kept`, `triton_prepare`) for `meta` tensors (or, `--device cpu`, CPU
tensors), in this process only, and replaces every Triton kernel of the KDA modules by
`kernel_resources.recording`'s recorder, which counts the launches and runs nothing. Meta
tensors hold no data, so no arithmetic is timed: what remains is Python (the
public function, the `custom_op` layers, autograd, our launchers' argument handling and
allocations) and the ATen ops' dispatch (some of their meta kernels are Python, slower than
CUDA's). Triton's own launch cost (binding, cache lookup, the driver call) is not in it; it
is measured on the GPU.

The times are a CPU's and vary from run to run (on a shared virtual machine the median of
100 calls moved by a third between runs); the launch and op counts do not.

Printed: per direction, the median host time per call over `--reps` calls, the Triton
launches per call, the ATen ops dispatched per call (those inside the custom ops and nested
ones included: on the GPU each is a dispatch), and the top-level ones by name (at B=1 T=8K
forward+backward mostly allocations, reshapes and views; few launch a kernel). The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter


_adapters_lib = None  # the registrations live as long as this Library object


def register_adapters(device: str) -> None:
    """The CUDA registrations of `triton_op.register_cuda_kernels`, for ``device``'s key
    ("meta" or "cpu"), in this process. Through `Library.impl(..., allow_override=True)`:
    on the Meta key they replace the ops' fake implementations, which torch 2.11's
    `register_kernel` refuses to do."""
    global _adapters_lib
    import torch

    from titan_moe.ops.kda import kept, prepare, triton_op, triton_prepare
    from titan_moe.ops.kda import op as kda_op

    _adapters_lib = torch.library.Library("titan_moe", "IMPL")
    key = {"meta": "Meta", "cpu": "CPU"}[device]
    for op_name, fn in ((kda_op.FWD_OP, triton_op.kda_chunk_fwd_triton), (kda_op.BWD_OP, triton_op.kda_chunk_bwd_triton),
                        (kept.FWD_OP, kept.kda_chunk_fwd_kept_triton), (kept.BWD_OP, kept.kda_chunk_bwd_kept_triton),
                        (prepare.FWD_OP, triton_prepare.kda_prepare_triton),
                        (prepare.BWD_OP, triton_prepare.kda_prepare_bwd_triton)):
        _adapters_lib.impl(op_name.split("::")[1], fn, key, allow_override=True)


def _aten_ops_per_call(fn) -> tuple[int, dict[str, int]]:
    """ATen ops dispatched by one call of ``fn``: (all of them, those inside the custom ops and
    nested ones included; {name: count} of the top-level ones, those not called by another
    ATen op), the second largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [event for event in prof.events() if event.name.startswith("aten::")]
    top = Counter(event.name for event in events
                  if event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))
    return len(events), dict(top.most_common())


def measure(B: int, T: int, H: int, dk: int, device: str, reps: int, profile_calls: int) -> list[dict]:
    import torch

    from bench_kda import host_profile, make_inputs, run_ours
    from kernel_resources import recording  # every `*_kernel` of the modules replaced by a recorder

    from titan_moe.ops.kda import triton_bwd, triton_fwd, triton_prepare, triton_scan

    rows = []
    for backward in (False, True):
        inp = make_inputs(B, T, H, dk, device, torch.bfloat16)
        for key in ("q", "k", "v", "z", "beta"):
            inp[key].requires_grad_(backward)
        inp["do"] = torch.randn_like(inp["v"])

        def step(inp=inp, backward=backward):
            if backward:
                for key in ("q", "k", "v", "z", "beta"):
                    inp[key].grad = None
            return run_ours(inp, backward)

        with recording((triton_fwd, triton_bwd, triton_scan, triton_prepare)) as launched:
            step()
            step()
            launched.clear()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
            launches = {name: n / reps for name, n in Counter(fn.__name__ for fn, _, _ in launched).items()}
            launched.clear()
            aten_ops, top_ops = _aten_ops_per_call(step)
            if profile_calls:
                host_profile(step, device, profile_calls, f"{'fwd+bwd' if backward else 'fwd'} B={B} T={T}")
        row = dict(B=B, T=T, H=H, dk=dk, direction="fwd+bwd" if backward else "fwd",
                   host_ms=sorted(times)[len(times) // 2], triton_launches=sum(launches.values()),
                   aten_ops=aten_ops, top_level_aten_ops=top_ops, launches=launches)
        rows.append(row)
        print(f"{row['direction']:8s} B={B} T={T} H={H} dk={dk}: host {row['host_ms']:.3f} ms per call "
              f"(median of {reps}), {row['triton_launches']:.0f} Triton launches, {aten_ops} ATen ops", flush=True)
        print(f"    top-level ATen ops ({sum(top_ops.values())}): "
              + ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in top_ops.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,8192,16,128", help="B,T,H,dk (default: %(default)s)")
    parser.add_argument("--device", choices=("meta", "cpu"), default="meta",
                        help="meta (default): no tensor data, every ATen op a shape computation; cpu: "
                        "real CPU arithmetic in the ATen ops around the kernels (not a GPU's host cost)")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per direction (median)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also print the top functions of CALLS calls under cProfile")
    args = parser.parse_args(argv)
    try:
        B, T, H, dk = (int(x) for x in args.shape.split(","))
    except ValueError:
        raise SystemExit(f"kda_host_cost: --shape takes B,T,H,dk, got {args.shape!r}") from None
    if args.reps < 1:
        raise SystemExit("kda_host_cost: --reps must be >= 1")
    if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels are not JIT functions: not replaced
        raise SystemExit("kda_host_cost: run without TRITON_INTERPRET=1 (it stubs compiled launches)")

    import torch

    torch.set_num_threads(1)
    register_adapters(args.device)
    rows = measure(B, T, H, dk, args.device, args.reps, args.profile)
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
