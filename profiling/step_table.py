"""Training runs side by side, from their dump folders' `metrics.jsonl` (`titan_moe.metrics`).

    python profiling/step_table.py OUT/fp8_all_bf16 OUT/fp8_all_fp8       # first run = baseline
    python profiling/step_table.py RUN ... --baseline NAME --steps 8,12 [--mean-after 4]

Prints a markdown table: per run (named by its folder), tokens/s at the chosen steps (default:
the last two logged steps every run has), the ratio of each to the baseline's at the same step,
the training loss and the last validation loss, and the peak memory (max over logged steps,
GiB). With ``--mean-after N``, also each run's mean tokens/s over its logged steps after N and
its ratio to the baseline's: the harmonic mean of the logged rates, which is tokens over time
when every logged window holds the same number of steps (a constant ``log_freq``). Then one JSON line with the same numbers. A run with no metrics file is listed as missing
(its training failed or never started) instead of stopping the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_run(folder: Path) -> dict | None:
    """{"steps": {step: record}, "eval": {step: loss}} from ``folder/metrics.jsonl``, or None."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return None
    steps, evals = {}, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "eval_loss" in record:
            evals[record["step"]] = record["eval_loss"]
        else:
            steps[record["step"]] = record
    return {"steps": steps, "eval": evals}


def mean_rate(run: dict, after: int) -> tuple[float, list[int]] | None:
    """(harmonic mean of tokens/s over the steps logged after ``after``, those steps), or None."""
    steps = sorted(s for s, r in run["steps"].items() if s > after and r.get("tokens_per_s"))
    if not steps:
        return None
    return len(steps) / sum(1.0 / run["steps"][s]["tokens_per_s"] for s in steps), steps


def table(runs: dict[str, dict | None], baseline: str, steps: list[int] | None,
          mean_after: int | None = None) -> tuple[str, dict]:
    """(markdown table, summary dict) for ``runs`` ({name: read_run result})."""
    present = {name: run for name, run in runs.items() if run is not None}
    if baseline not in present:
        raise ValueError(f"step_table: the baseline {baseline!r} has no metrics")
    if steps is None:
        common = set.intersection(*(
            {s for s, r in run["steps"].items() if "tokens_per_s" in r} for run in present.values()))
        steps = sorted(common)[-2:]
    base = present[baseline]["steps"]
    header = ["run"] + [f"tokens/s @ {s}" for s in steps] + [f"/ {baseline} @ {s}" for s in steps]
    base_mean = mean_rate(present[baseline], mean_after) if mean_after is not None else None
    if mean_after is not None:
        header += [f"mean tokens/s after step {mean_after}", f"/ {baseline} (mean)"]
    header += ["loss (last step)", "validation loss (last)", "peak memory GiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    summary: dict = {"baseline": baseline, "steps": steps, "runs": {}}
    for name, run in runs.items():
        if run is None:
            lines.append(f"| {name} | missing (no metrics.jsonl) |" + " |" * (len(header) - 2))
            summary["runs"][name] = None
            continue
        tps = [run["steps"].get(s, {}).get("tokens_per_s") for s in steps]
        ratios = [t / base[s]["tokens_per_s"] if t and base.get(s, {}).get("tokens_per_s") else None
                  for t, s in zip(tps, steps)]
        last = run["steps"][max(run["steps"])] if run["steps"] else {}
        val = run["eval"][max(run["eval"])] if run["eval"] else None
        memory = max((r.get("max_reserved_gib", 0.0) for r in run["steps"].values()), default=None)
        cells = [name] + [_fmt(t, "{:,.0f}") for t in tps] + [_fmt(r, "{:.3f}x") for r in ratios]
        if mean_after is not None:
            mean = mean_rate(run, mean_after)
            mean_ratio = mean[0] / base_mean[0] if mean and base_mean else None
            cells += [_fmt(mean and mean[0], "{:,.0f}") + (f" (steps {mean[1][0]}-{mean[1][-1]})" if mean else ""),
                      _fmt(mean_ratio, "{:.3f}x")]
        cells += [_fmt(last.get("loss"), "{:.5f}"), _fmt(val, "{:.4f}"), _fmt(memory, "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
        summary["runs"][name] = {"tokens_per_s": dict(zip(steps, tps)), "ratio": dict(zip(steps, ratios)),
                                 "loss": last.get("loss"), "last_step": max(run["steps"], default=None),
                                 "validation_loss": val, "peak_reserved_gib": memory}
        if mean_after is not None:
            summary["runs"][name]["mean_tokens_per_s"] = mean and mean[0]
            summary["runs"][name]["mean_ratio"] = mean_ratio
    return "\n".join(lines), summary


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="dump folders (the first is the baseline by default)")
    parser.add_argument("--baseline", help="folder name of the baseline run")
    parser.add_argument("--steps", help="comma-separated steps (default: the last two every run logged)")
    parser.add_argument("--mean-after", type=int, metavar="N",
                        help="add each run's mean tokens/s over the steps logged after step N, and its ratio")
    args = parser.parse_args(argv)
    runs = {folder.name: read_run(folder) for folder in args.folders}
    if len(runs) != len(args.folders):
        parser.error("step_table: two folders with the same name")
    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    try:
        text, summary = table(runs, args.baseline or args.folders[0].name, steps, args.mean_after)
    except ValueError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None
    print(text)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
