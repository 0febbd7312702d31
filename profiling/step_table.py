"""Training runs side by side, from their dump folders' `metrics.jsonl` (`titan_moe.metrics`).

    python profiling/step_table.py OUT/fp8_all_bf16 OUT/fp8_all_fp8       # first run = baseline
    python profiling/step_table.py RUN ... --baseline NAME --steps 8,12

Prints a markdown table: per run (named by its folder), tokens/s at the chosen steps (default:
the last two logged steps every run has), the ratio of each to the baseline's at the same step,
the training loss and the last validation loss, and the peak memory (max over logged steps,
GiB). Then one JSON line with the same numbers. A run with no metrics file is listed as missing
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


def table(runs: dict[str, dict | None], baseline: str, steps: list[int] | None) -> tuple[str, dict]:
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
        cells += [_fmt(last.get("loss"), "{:.5f}"), _fmt(val, "{:.4f}"), _fmt(memory, "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
        summary["runs"][name] = {"tokens_per_s": dict(zip(steps, tps)), "ratio": dict(zip(steps, ratios)),
                                 "loss": last.get("loss"), "last_step": max(run["steps"], default=None),
                                 "validation_loss": val, "peak_reserved_gib": memory}
    return "\n".join(lines), summary


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="dump folders (the first is the baseline by default)")
    parser.add_argument("--baseline", help="folder name of the baseline run")
    parser.add_argument("--steps", help="comma-separated steps (default: the last two every run logged)")
    args = parser.parse_args(argv)
    runs = {folder.name: read_run(folder) for folder in args.folders}
    if len(runs) != len(args.folders):
        parser.error("step_table: two folders with the same name")
    steps = [int(s) for s in args.steps.split(",")] if args.steps else None
    try:
        text, summary = table(runs, args.baseline or args.folders[0].name, steps)
    except ValueError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None
    print(text)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
