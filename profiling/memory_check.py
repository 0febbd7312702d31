"""Measured peak memory of short training runs beside `titan_moe.plan`'s estimate.

    python profiling/memory_check.py --job.config_file configs/small_1gpu.toml \
        --seq-lens 8192,32768 --ac none,full [--steps 3] [-- extra trainer args]

For every (sequence length, activation-checkpointing mode) it runs the trainer for a few
steps in a subprocess (`torchrun --nproc_per_node=1 -m titan_moe.train`, validation and
checkpoints off, metrics every step), reads the peak allocated (`max_active_gib`) and reserved
memory from the run's `metrics.jsonl` (the maximum over the steps), and runs the planner on the
same config for one GPU. Prints a table of measured vs planned GiB and their ratio; the last
line is one JSON object. A run that fails (e.g. out of memory) is reported with the tail of
its log instead of numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _trainer_cmd(config: str, seq_len: int, ac: str, steps: int, folder: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
        "-m", "titan_moe.train", "--job.config_file", config,
        "--training.seq_len", str(seq_len), "--training.steps", str(steps),
        "--activation_checkpoint.mode", ac, "--validation.enable", "false",
        "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
        *extra,
    ]


def measure(config: str, seq_len: int, ac: str, steps: int, folder: Path, extra: list[str]) -> dict:
    """Run the trainer; peak memory (GiB) over its logged steps, or the failure."""
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(_trainer_cmd(config, seq_len, ac, steps, folder, extra),
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    metrics = folder / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps_logged = [r for r in records if "max_active_gib" in r]
    if proc.returncode != 0 or not steps_logged:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # The trainer's own error line (a config error, an out-of-memory), not torchrun's summary.
        errors = [line for line in lines if "titan_moe.train: error" in line or "OutOfMemoryError" in line]
        return {"ok": False, "wall_s": wall, "error": " | ".join(errors[-1:] or lines[-3:])}
    return {
        "ok": True,
        "wall_s": wall,
        "max_active_gib": max(r["max_active_gib"] for r in steps_logged),
        "max_reserved_gib": max(r["max_reserved_gib"] for r in steps_logged),
        "tokens_per_s": steps_logged[-1].get("tokens_per_s"),
    }


def planned(config: str, seq_len: int, extra: list[str]) -> dict[str, float]:
    """The planner's per-GPU total for one GPU, per AC mode (GiB)."""
    from titan_moe.plan import run_plan

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        summary = run_plan(["--job.config_file", config, "--gpus", "1", "--gpu-mem-gib", "141",
                            "--seq-len", str(seq_len), *extra])
    gib = summary["layouts"][0]["gib"]
    return {ac: gib[f"total_{ac}"] for ac in ("none", "selective", "full")}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job.config_file", dest="config", required=True)
    parser.add_argument("--seq-lens", default="8192")
    parser.add_argument("--ac", default="none,full", help="comma-separated activation_checkpoint.mode values")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="outputs/memory_check")
    args = parser.parse_args(argv)
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        plan = planned(args.config, seq_len, extra)
        for ac in args.ac.split(","):
            print(f"memory_check: seq_len {seq_len} ac {ac} ...", flush=True)
            got = measure(args.config, seq_len, ac, args.steps, Path(args.out) / f"{seq_len}_{ac}", extra)
            row = {"seq_len": seq_len, "ac": ac, "planned_gib": plan[ac], **got}
            if got["ok"]:
                row["planned_over_measured"] = plan[ac] / got["max_active_gib"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'seq_len':>8} {'ac':>9} {'measured':>9} {'reserved':>9} {'planned':>8} {'ratio':>6}  (GiB)")
    for r in rows:
        if r["ok"]:
            print(f"{r['seq_len']:>8} {r['ac']:>9} {r['max_active_gib']:9.2f} {r['max_reserved_gib']:9.2f} "
                  f"{r['planned_gib']:8.2f} {r['planned_over_measured']:6.3f}")
        else:
            print(f"{r['seq_len']:>8} {r['ac']:>9}  failed: {r['error'][:200]}")
    print(json.dumps({"config": args.config, "extra": extra, "rows": rows}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
