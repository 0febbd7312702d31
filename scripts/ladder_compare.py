"""The context ladder beside its baselines: the same stages, seed and data; one table of the stage-end evaluations.

    python scripts/ladder_compare.py --out OUT --job.config_file configs/ladder_1gpu.toml \\
        [--variants recipe,no_synthetic,all_mla] [--jobs 3] [--exit-at-step N] [--dry-run] \\
        [--section.key value ...]     # any further override goes to every variant

Variants: `recipe` (the config as it is), `no_synthetic` (every stage's synthetic_fraction 0:
the baseline the recipe's held-out loss is judged against) and `all_mla` (MLA in every layer,
`--model.mla_every 1`). Each trains with `python -m titan_moe.train` into OUT/VARIANT, its
checkpoints on as the config has them; `--jobs N` runs N at once (a ~150M ladder takes under
20 GB, so three fit one 80 GB GPU: their compiles overlap; their tokens/s are then not
speeds), each run's output then in OUT/VARIANT/train.log. A variant whose metrics already
hold the last stage's evaluations is not run again; one stopped part way resumes from its
newest checkpoint when the command is run again, so `--exit-at-step N` (each run stops after
step N) splits a ladder over several calls.

OUT/ladder.md, rewritten at the end (also with `--table-only`): one row per stage end and
variant: passkey accuracy at every length so far, MQAR at the stage's length, the held-out loss
over the stage's length (the loss-by-position buckets weighted by their widths: the mean
per-token loss over the first seq_len tokens of the held-out documents), its ratio to
`no_synthetic`'s at the same stage (the acceptance: at most 1.02), and the loss in the first
and the last bucket (falling with position: the context is used). A failed variant is named
and left out; the others still count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script, also when loaded by path
from ablate import run_jobs, train  # noqa: E402

BASELINE = "no_synthetic"
VARIANTS = ("recipe", BASELINE, "all_mla")


def variant_overrides(variant: str, n_stages: int) -> list[str]:
    """The trainer overrides of one variant of a ladder of `n_stages` stages."""
    if variant == "recipe":
        return []
    if variant == BASELINE:
        return [arg for i in range(1, n_stages + 1) for arg in (f"--ladder.stages.{i}.synthetic_fraction", "0")]
    if variant == "all_mla":
        return ["--model.mla_every", "1"]
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def stage_records(folder: Path) -> list[dict]:
    """The stage-end evaluation records of a run (those with a "stage"), by step; a later
    record of the same step (a resumed run) wins."""
    path = folder / "metrics.jsonl"
    by_step: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "stage" in record:
                by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def held_out_loss(record: dict) -> tuple[float, float, float]:
    """(width-weighted mean, first bucket, last bucket) of a record's loss by position within
    its seq_len; nan without buckets."""
    buckets = []
    for key, value in record.items():
        if key.startswith("eval/loss_by_pos/"):
            lo, hi = (int(x) for x in key.rsplit("/", 1)[1].split("-"))
            hi = min(hi, record["seq_len"])
            if hi > lo:
                buckets.append((lo, hi, value))
    if not buckets:
        nan = float("nan")
        return nan, nan, nan
    buckets.sort()
    mean = sum((hi - lo) * v for lo, hi, v in buckets) / sum(hi - lo for lo, hi, _ in buckets)
    return mean, buckets[0][2], buckets[-1][2]


def _fmt(value: float, spec: str = ".3f") -> str:
    return "-" if value != value else format(value, spec)


def table(out: Path, variants: list[str]) -> str:
    """The markdown table of the variants' stage ends (module docstring), written to OUT/ladder.md."""
    records = {v: stage_records(out / v) for v in variants}
    baseline = {r["stage"]: held_out_loss(r)[0] for r in records.get(BASELINE, [])}
    lines = ["| stage (step) | variant | passkey by length | MQAR | held-out loss | vs no_synthetic | "
             "first / last bucket |", "| --- | --- | --- | --- | --- | --- | --- |"]
    stages = sorted({(r["step"], r["stage"]) for rs in records.values() for r in rs})
    for step, stage in stages:
        for variant in variants:
            record = next((r for r in records[variant] if r["stage"] == stage), None)
            if record is None:
                continue
            passkey = " / ".join(f"{key.split('/')[2]} {value:.2f}" for key, value in record.items()
                                 if key.startswith("eval/passkey/") and key.count("/") == 2)
            mqar = [v for k, v in record.items() if k.startswith("eval/mqar/")]
            mean, first, last = held_out_loss(record)
            ratio = mean / baseline[stage] if stage in baseline and baseline[stage] == baseline[stage] else float("nan")
            lines.append(f"| {stage} ({record['step']}) | {variant} | {passkey or '-'} | "
                         f"{_fmt(mqar[-1], '.2f') if mqar else '-'} | {_fmt(mean)} | {_fmt(ratio, '.4f')} | "
                         f"{_fmt(first)} / {_fmt(last)} |")
    text = "\n".join(lines) + "\n"
    (out / "ladder.md").write_text(text)
    return text


def command(out: Path, variant: str, shared: list[str], n_stages: int, exit_at_step: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "titan_moe.train", *shared, *variant_overrides(variant, n_stages),
           "--job.dump_folder", str(out / variant)]
    return cmd + (["--training.exit_at_step", str(exit_at_step)] if exit_at_step else [])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--jobs", type=int, default=1, help="variants run at once (default 1)")
    parser.add_argument("--exit-at-step", type=int, default=None, help="each run stops after this step")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--table-only", action="store_true", help="rebuild OUT/ladder.md from the folders")
    args, shared = parser.parse_known_args(argv)
    variants = args.variants.split(",")
    from titan_moe.config import load_config
    from titan_moe.ladder import resolve_stages

    config = load_config(shared)
    if not config.ladder.stages:
        sys.exit("ladder_compare: the config has no [[ladder.stages]]")
    stages = resolve_stages(config.ladder, config.training, config.optimizer, config.lr_scheduler)
    n_stages = len(stages)
    for variant in variants:
        try:
            variant_overrides(variant, n_stages)  # an unknown name fails before anything runs
        except ValueError as e:
            sys.exit(f"ladder_compare: {e}")
    last_stage = stages[-1].name
    todo = [v for v in variants if not any(r["stage"] == last_stage for r in stage_records(args.out / v))]
    if args.dry_run:
        for variant in todo:
            print(" ".join(command(args.out, variant, shared, n_stages, args.exit_at_step)))
        return ""
    if not args.table_only:
        tasks = {v: (lambda v=v: train(command(args.out, v, shared, n_stages, args.exit_at_step),
                                       args.out / v / "train.log" if args.jobs > 1 else None)) for v in todo}
        run_jobs(tasks, args.jobs, lambda v: f"ladder_compare: {v}")
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(args.out, variants)
    print(text)
    return text


if __name__ == "__main__":
    main()
