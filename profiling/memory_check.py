"""Measured peak memory of short training runs beside `titan_moe.plan`'s estimate.

    python profiling/memory_check.py --job.config_file configs/small_1gpu.toml \
        --seq-lens 8192,32768 --ac none,full [--steps 3] [-- extra trainer args]

One rank of a larger layout, on one GPU (torchtitan's `--comm.mode fake_backend`):

    python profiling/memory_check.py --job.config_file configs/small_1gpu.toml \
        --seq-lens 131072 --ac none,full --fake-gpus 8 -- --parallelism.context_parallel_degree 8

For every (sequence length, activation-checkpointing mode) it runs the trainer for a few
steps in a subprocess (`torchrun --nproc_per_node=1 -m titan_moe.train`, validation and
checkpoints off, metrics every step), reads the peak allocated (`max_allocated_gib`,
`torch.cuda.max_memory_allocated`), active and reserved memory from the run's
`metrics.jsonl` (the maximum over the steps), and runs the planner on the same config for
the same layout. Prints a table of measured vs planned GiB and their ratio; the last line is
one JSON object. A run that fails (e.g. out of memory) is reported with the tail of its log
instead of numbers.

`--fake-gpus N`: the trainer plays rank 0 of an N-GPU layout (`NGPU=N`, `--comm.mode
fake_backend`: torch's fake process group, which moves no data), the layout being the
config's `[parallelism]` degrees (after `--`); the planner plans N GPUs and its row for that
layout is compared. Rank 0 holds what every rank holds (its share of the parameters and
optimizer states, its FSDP buffers, its `T / cp` tokens), but its losses are meaningless
and, under context parallelism, it is the one rank whose KDA segment never continues a
document from an earlier rank (no cross-rank basis call, `titan_moe.ops.kda.context_parallel`):
the planned number compared is then the planner's rank 0 (`--cp-rank 0`), the worst rank's
plan, the planner's default row, is reported beside it (`planned_worst_rank_gib`). Every
segment of a fake-backend run holds rank 0's document ids, so its documents are at most a
segment long unless rank 0's segment is one document; `--max-doc-len N` tells the planner
(default: one document fills each row, the largest attention score blocks). Compare with an
eager config: the planner's eager rows measure the layers as a context-parallel rank runs
them, while its compiled count under CP (layers compiled piecewise around the attention) has
not been checked against a run.

On a machine without a GPU the trainer runs on the CPU and "measured" is the process's peak
resident set (Python and libraries included): the plumbing runs, the numbers do not compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _trainer_cmd(config: str, seq_len: int, ac: str, steps: int, folder: Path, extra: list[str],
                 fake_gpus: int | None = None) -> list[str]:
    fake = ["--comm.mode", "fake_backend"] if fake_gpus else []
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone",
        "-m", "titan_moe.train", "--job.config_file", config,
        "--training.seq_len", str(seq_len), "--training.steps", str(steps),
        "--activation_checkpoint.mode", ac, "--validation.enable", "false",
        "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--job.dump_folder", str(folder),
        *fake, *extra,
    ]


def measure(config: str, seq_len: int, ac: str, steps: int, folder: Path, extra: list[str],
            fake_gpus: int | None = None) -> dict:
    """Run the trainer (rank 0 of `fake_gpus` fake ranks when given); peak memory (GiB) over
    its logged steps, or the failure."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NGPU": str(fake_gpus)} if fake_gpus else None
    started = time.perf_counter()
    proc = subprocess.run(_trainer_cmd(config, seq_len, ac, steps, folder, extra, fake_gpus),
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    metrics = folder / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps_logged = [r for r in records if "max_active_gib" in r]
    if proc.returncode != 0 or not steps_logged:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # The trainer's own error line (a config error, an out-of-memory), not torchrun's summary.
        errors = [line for line in lines if "titan_moe.train: error" in line or "OutOfMemoryError" in line]
        return {"ok": False, "wall_s": wall, "error": " | ".join(errors[-1:] or lines[-3:])}
    peak = {key: max(r.get(key, -1.0) for r in steps_logged)
            for key in ("max_allocated_gib", "max_active_gib", "max_reserved_gib")}
    return {"ok": True, "wall_s": wall, **peak, "tokens_per_s": steps_logged[-1].get("tokens_per_s")}


def trainer_layout(config: str, extra: list[str], gpus: int) -> dict[str, int]:
    """The trainer's layout on `gpus` GPUs from the config's `[parallelism]` degrees, as the
    planner names it (torchtitan's `ParallelDims`: dp_shard = -1 takes the ranks left)."""
    from titan_moe.config import load_config

    p = load_config(["--job.config_file", config, *extra]).parallelism
    rep, cp, ep = max(1, p.data_parallel_replicate_degree), max(1, p.context_parallel_degree), \
        max(1, p.expert_parallel_degree)
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else gpus // (rep * cp)
    if rep * shard * cp != gpus:
        raise SystemExit(f"memory_check: error: dp_replicate {rep} x dp_shard {shard} x cp {cp} != {gpus} GPUs")
    return {"dp_replicate": rep, "dp_shard": shard, "cp": cp, "ep": ep}


def planned(config: str, seq_len: int, extra: list[str], gpus: int = 1, max_doc_len: int | None = None,
            rank0: bool = False) -> dict[str, float]:
    """The planner's per-GPU total for the trainer's layout on `gpus` GPUs, per AC mode (GiB).
    Under context parallelism the planner's row is the worst rank of the group; `rank0`: rank
    0's plan instead (what a fake-backend run measures), the worst rank's under `worst_<ac>`.
    `max_doc_len`: the planner's `--max-doc-len` (the longest document of a row)."""
    from titan_moe.plan import run_plan

    import contextlib
    import io

    layout = trainer_layout(config, extra, gpus)
    hsdp = ["--hsdp"] if layout["dp_replicate"] > 1 else []
    docs = ["--max-doc-len", str(max_doc_len)] if max_doc_len else []
    with contextlib.redirect_stdout(io.StringIO()):
        summary = run_plan(["--job.config_file", config, "--gpus", str(gpus), "--gpu-mem-gib", "141",
                            "--seq-len", str(seq_len), *hsdp, *docs, *extra])
    (row,) = [r for r in summary["layouts"] if all(r[key] == value for key, value in layout.items())]
    worst = {ac: row["gib"][f"total_{ac}"] for ac in ("none", "selective", "full")}
    if not rank0 or "rank0_gib" not in row:
        return worst
    return {ac: row["rank0_gib"][f"total_{ac}"] for ac in worst} | {f"worst_{ac}": v for ac, v in worst.items()}


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
    parser.add_argument("--fake-gpus", type=int, default=None,
                        help="play rank 0 of this many GPUs (--comm.mode fake_backend) in the config's layout")
    parser.add_argument("--max-doc-len", type=int, default=None,
                        help="the planner's --max-doc-len: the longest document of a row (default: the row)")
    parser.add_argument("--out", default="outputs/memory_check")
    args = parser.parse_args(argv)
    if args.fake_gpus is not None and args.fake_gpus < 1:
        parser.error(f"--fake-gpus must be >= 1, got {args.fake_gpus}")
    gpus = args.fake_gpus or 1
    layout = trainer_layout(args.config, extra, gpus)
    import torch

    measured_what = "GPU memory" if torch.cuda.is_available() else "CPU: the process's peak RSS, not comparable"
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        plan = planned(args.config, seq_len, extra, gpus, args.max_doc_len, rank0=bool(args.fake_gpus))
        for ac in args.ac.split(","):
            print(f"memory_check: seq_len {seq_len} ac {ac} ...", flush=True)
            got = measure(args.config, seq_len, ac, args.steps, Path(args.out) / f"{seq_len}_{ac}", extra,
                          args.fake_gpus)
            row = {"seq_len": seq_len, "ac": ac, "planned_gib": plan[ac], **got}
            if f"worst_{ac}" in plan:
                row["planned_worst_rank_gib"] = plan[f"worst_{ac}"]
            if got["ok"]:
                row["planned_over_measured"] = plan[ac] / got["max_allocated_gib"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    fake = f", rank 0 of {gpus} (fake backend)" if args.fake_gpus else ""
    print(f"\nlayout {layout}{fake}; measured: {measured_what}")
    print(f"{'seq_len':>8} {'ac':>9} {'allocated':>9} {'active':>9} {'reserved':>9} {'planned':>8} {'ratio':>6}  (GiB)")
    for r in rows:
        if r["ok"]:
            print(f"{r['seq_len']:>8} {r['ac']:>9} {r['max_allocated_gib']:9.2f} {r['max_active_gib']:9.2f} "
                  f"{r['max_reserved_gib']:9.2f} {r['planned_gib']:8.2f} {r['planned_over_measured']:6.3f}")
        else:
            print(f"{r['seq_len']:>8} {r['ac']:>9}  failed: {r['error'][:200]}")
    print(json.dumps({"config": args.config, "extra": extra, "gpus": gpus, "fake_backend": bool(args.fake_gpus),
                      "layout": layout, "rows": rows}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
