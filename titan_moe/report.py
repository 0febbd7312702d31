"""Plots of a training run from its `metrics.jsonl` (`titan_moe.metrics`).

    python -m titan_moe.report outputs/debug_cpu            # PNGs into outputs/debug_cpu/report/

writes

    loss.png          training loss per logged step, eval loss per validation
    throughput.png    tokens/s per logged step (per device, as the trainer logs it)
    expert_load.png   per MoE layer, max expert load / mean load (1 + max_violation) and the
                      experts that received no token, per optimizer step
    qb_violation.png  max_violation (max load / mean load - 1): the largest and the mean over layers

A run without MoE layers (or logged before the balance metrics existed) gets no
expert_load.png or qb_violation.png. A record cut short (a run killed mid-write) is skipped;
where a step was logged twice the later record wins.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

_LAYER_METRIC = re.compile(r"moe/(.+)/(max_violation|dead_experts)$")


def read_metrics(path: str) -> tuple[dict[int, dict], dict[int, float], int]:
    """(training records by step, eval loss by step, lines skipped)."""
    train: dict[int, dict] = {}
    evals: dict[int, float] = {}
    skipped = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            if "loss" in record:
                train[step] = record
            if "eval_loss" in record:
                evals[step] = float(record["eval_loss"])
    return dict(sorted(train.items())), dict(sorted(evals.items())), skipped


def _series(train: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = [s for s, r in train.items() if key in r]
    return steps, [float(train[s][key]) for s in steps]


def figures(train: dict[int, dict], evals: dict[int, float]) -> dict[str, object]:
    """Name -> matplotlib Figure; each line carries its series name as label."""
    from matplotlib.figure import Figure

    out = {}
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(*_series(train, "loss"), label="train")
    if evals:
        ax.plot(list(evals), list(evals.values()), "o-", label="eval")
    ax.set(xlabel="step", ylabel="loss", title="Loss")
    ax.legend()
    out["loss"] = fig

    steps, tps = _series(train, "tokens_per_s")
    if steps:
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        ax.plot(steps, tps, label="tokens_per_s")
        ax.set(xlabel="step", ylabel="tokens/s", title="Throughput", ylim=(0, None))
        out["throughput"] = fig

    layers: dict[str, set[str]] = defaultdict(set)
    for record in train.values():
        for key in record:
            match = _LAYER_METRIC.match(key)
            if match:
                layers[match.group(1)].add(match.group(2))
    if layers:
        names = sorted(layers, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
        fig = Figure(figsize=(8, 6), layout="constrained")
        load, dead = fig.subplots(2, 1, sharex=True)
        for name in names:
            steps, violation = _series(train, f"moe/{name}/max_violation")
            load.plot(steps, [1.0 + v for v in violation], label=name)
            dead.plot(*_series(train, f"moe/{name}/dead_experts"), label=name)
        load.set(ylabel="max load / mean load", title="Expert load per MoE layer")
        dead.set(xlabel="step", ylabel="experts without tokens", ylim=(-0.5, None))
        dead.yaxis.get_major_locator().set_params(integer=True)
        load.legend(fontsize="small", ncol=max(1, len(names) // 12))
        out["expert_load"] = fig

        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.add_subplot()
        ax.plot(*_series(train, "moe/max_violation_max"), label="max over layers")
        ax.plot(*_series(train, "moe/max_violation_mean"), label="mean over layers")
        ax.set(xlabel="step", ylabel="max load / mean load - 1", title="QB balance: max_violation")
        ax.legend()
        out["qb_violation"] = fig
    return out


def write_report(run_dir: str, out_dir: str | None = None) -> list[str]:
    """The PNGs of `run_dir/metrics.jsonl`, written to `out_dir` (default `run_dir/report`)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found (the trainer writes it into --job.dump_folder)")
    train, evals, skipped = read_metrics(path)
    if not train:
        raise ValueError(f"{path} holds no training records (a run logs one every metrics.log_freq steps)")
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fig in figures(train, evals).items():
        written.append(os.path.join(out_dir, f"{name}.png"))
        fig.savefig(written[-1], dpi=100)
    if skipped:
        print(f"titan_moe.report: skipped {skipped} unreadable lines of {path}", file=sys.stderr)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m titan_moe.report",
                                description="PNG plots of a run: loss and eval loss, tokens/s, expert load per MoE "
                                            "layer, QB max_violation; from RUN_DIR/metrics.jsonl.")
    p.add_argument("run_dir", help="the run's --job.dump_folder (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        written = write_report(args.run_dir, args.out)
    except (ValueError, OSError) as e:
        print(f"titan_moe.report: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
