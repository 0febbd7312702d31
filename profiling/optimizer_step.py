"""Benchmark: one optimizer step of a config's model, per-head Muon against AdamW.

    python profiling/optimizer_step.py --job.config_file configs/ladder_1gpu.toml
    python profiling/optimizer_step.py --job.config_file configs/small_1gpu.toml --steps 30
    python profiling/optimizer_step.py --job.config_file configs/debug_cpu.toml --steps 2   # CPU plumbing

The model of the config (its flavor and model keys) on one device with fp32 parameters, as
one-device training holds them, and fresh random gradients; each optimizer is built as the
trainer builds it (`titan_moe.train_spec.build_optimizers_with_expert_balance`: Muon with its
AdamW groups for `optimizer.name = "Muon"`, torchtitan's AdamW with the config's
`optimizer.implementation` otherwise, the expert-balance pre-hook in both) and stepped
`--warmup` times, then `--steps` timed steps (device synchronized around each); the two run
in alternating rounds so that clocks and caches treat them alike. Prints the median and
minimum ms per step and the optimizer's state bytes. What the step costs beside the training
step is the comparison to make: the same config's step time comes from the trainer's log.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def build(config, name: str, device: str):
    """(model, optimizers) for optimizer `name` ("AdamW" or "Muon") on `device`."""
    from torchtitan.distributed import ParallelDims

    from titan_moe.config import model_args_from_config
    from titan_moe.model.decoder import Decoder
    from titan_moe.train_spec import build_optimizers_with_expert_balance

    with torch.device("meta"):
        model = Decoder(model_args_from_config(config))
    model.to_empty(device=device)
    model.init_weights()
    config.optimizer.name = name
    if device == "cpu" and config.optimizer.implementation == "fused":
        config.optimizer.implementation = "foreach"  # torch's fused AdamW is CUDA-only
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return model, build_optimizers_with_expert_balance([model], config.optimizer, dims)


def state_bytes(optimizers) -> int:
    return sum(t.numel() * t.element_size() for opt in optimizers.optimizers for s in opt.state.values()
               for t in s.values() if isinstance(t, torch.Tensor))


def main(argv: list[str] | None = None) -> None:
    from titan_moe.config import ConfigError, load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per optimizer (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--optimizers", default="AdamW,Muon", help="comma-separated, from AdamW, Muon")
    ours, rest = parser.parse_known_args(argv)
    names = [n for n in ours.optimizers.split(",") if n]
    try:
        if ours.steps < 1 or ours.warmup < 0:
            raise ValueError("--steps must be >= 1 and --warmup >= 0")
        if not names or any(n not in ("AdamW", "Muon") for n in names):
            raise ValueError(f"--optimizers takes AdamW and/or Muon, got {ours.optimizers!r}")
        configs = {n: load_config(rest) for n in names}
    except (ConfigError, ValueError) as e:
        print(f"optimizer_step: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    runs = {n: build(configs[n], n, device) for n in names}
    gen = torch.Generator(device=device).manual_seed(0)
    for model, _ in runs.values():
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-3
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(ours.warmup + ours.steps):
        for n in names:
            optimizers = runs[n][1]
            sync()
            t0 = time.perf_counter()
            optimizers.step()
            sync()
            if i >= ours.warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
    params = sum(p.numel() for p in next(iter(runs.values()))[0].parameters())
    print(f"{configs[names[0]].model.flavor}: {params / 1e6:.1f}M parameters, fp32, {device}"
          + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
          + f"; {ours.steps} timed steps after {ours.warmup}")
    print("| optimizer | median ms | min ms | state MiB |")
    print("| --- | --- | --- | --- |")
    for n in names:
        print(f"| {n} | {statistics.median(times[n]):.2f} | {min(times[n]):.2f} | "
              f"{state_bytes(runs[n][1]) / 2**20:.1f} |")


if __name__ == "__main__":
    main()
