"""Ablation harness: the same config, seed, data and steps for every arm; one table, one loss plot.

    python scripts/ablate.py --out outputs/ablate_cpu --job.config_file configs/debug_cpu.toml
    python scripts/ablate.py --out OUT --arms qb,sign,muon --seeds 0,1 --job.config_file configs/small_1gpu.toml \\
        --training.steps 300          # any further --section.key value goes to every arm

Each arm is one `python -m titan_moe.train` run (its own dump folder OUT/ARM_sSEED) with the
arm's overrides added to the shared ones, `debug.seed` and `data.seed` set to the seed, and
validation once at the last step (held-out loss and load balance, routed with the frozen
expert bias). An arm whose folder already holds a record of the last step is not run again,
so a sweep can be spread over several sessions. Then OUT/ablation.md (a markdown table:
final and last-10% mean training loss, held-out loss, per-layer-mean max violation over the
second half of training and on the held-out batches, tokens/s; mean over seeds) and
OUT/loss.png (training loss per arm and seed).

Arms: recipe (the config as it is: the baseline to put first), qb (the bias fitted to one
step routes the next), qb_batch (each batch routed with the bias fitted to itself; the GPU
flavors' form), sign (DeepSeek-V3's sign rule), aux_loss (no bias: the Switch/GShard
auxiliary loss, `model.aux_loss_coef`), attn_res_full / attn_res_none (AttnRes variants),
adamw / muon (optimizers), swiglu (SwiGLU instead of SiTU-GLU in the experts) and
unbounded_gate (KDA's softplus gate with no lower bound; it runs the PyTorch KDA path, so
compare its loss, not its speed). `ARM@LR` runs an arm at another `optimizer.lr` (a
learning-rate sweep: `--arms adamw@1e-3,adamw@3e-3,muon@1e-3,muon@3e-3`; folder
OUT/ARM@LR_sSEED).

`--jobs N` runs N arms at once (on one GPU when they fit its memory: their compiles overlap;
their tokens/s are then not speeds), each run's output in OUT/ARM_sSEED/train.log. A run that
fails is named and left out of the table; the others still count.

`--eval-every N` validates every N steps, and the table gives the first validated step at
which each arm's held-out loss reaches the first arm's final one: how many steps an arm needs
for the baseline's result (an arm already run keeps the validations it had).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# arm name -> overrides of the shared config
ARMS: dict[str, list[str]] = {
    "recipe": [],  # the config as it is
    "qb": ["--model.balance_rule", "qb", "--model.qb_batch_iters", "0"],
    "qb_batch": ["--model.balance_rule", "qb", "--model.qb_batch_iters", "2"],
    "sign": ["--model.balance_rule", "sign"],
    "aux_loss": ["--model.balance_rule", "aux_loss"],
    "attn_res_full": ["--model.attn_res", "full"],
    "attn_res_none": ["--model.attn_res", "none"],
    "adamw": ["--optimizer.name", "AdamW"],
    "muon": ["--optimizer.name", "Muon"],
    "swiglu": ["--model.expert_activation", "swiglu"],
    "unbounded_gate": ["--model.kda_gate", "unbounded"],
}


def read_records(folder: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(training records by step, held-out records by step) of a run's metrics.jsonl; a
    held-out record merges ``eval_loss`` and the held-out balance (``eval/moe/*``)."""
    steps, evals = {}, {}
    path = folder / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            if "eval_loss" in record or any(key.startswith("eval/") for key in record):
                evals.setdefault(record["step"], {}).update(record)
            elif "loss" in record:
                steps[record["step"]] = record
    return steps, evals


def arm_overrides(arm: str) -> list[str]:
    """The overrides of `arm` ("name" or "name@lr"); ValueError for an unknown name or a bad lr."""
    name, _, lr = arm.partition("@")
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; known: {', '.join(ARMS)}")
    if not lr:
        return ARMS[name]
    try:
        positive = float(lr) > 0
    except ValueError:
        positive = False
    if not positive:
        raise ValueError(f"arm {arm!r}: the learning rate after '@' must be a number > 0")
    return [*ARMS[name], "--optimizer.lr", lr]


def run_arm(out: Path, arm: str, seed: int, shared: list[str], steps: int, eval_every: int = 0,
            log_to_file: bool = False) -> Path:
    """Train one arm and seed into OUT/ARM_sSEED (skipped when it already holds the last
    step); with `log_to_file` its output goes to train.log there instead of this stdout.
    CalledProcessError when the run fails."""
    dump = out / f"{arm}_s{seed}"
    if steps in read_records(dump)[0]:
        return dump
    cmd = [sys.executable, "-m", "titan_moe.train", *shared, *arm_overrides(arm),
           "--debug.seed", str(seed), "--data.seed", str(seed), "--job.dump_folder", str(dump),
           "--validation.enable", "--validation.freq", str(eval_every or steps), "--checkpoint.no_enable"]
    print(" ".join(cmd), flush=True)
    train(cmd, dump / "train.log" if log_to_file else None, mode="w")
    return dump


def train(cmd: list[str], log: Path | None, mode: str = "a") -> None:
    """One trainer run from the repository root; its output to `log` (opened with `mode`)
    when given, else to this stdout. CalledProcessError when it fails."""
    if log is None:
        subprocess.run(cmd, cwd=REPO, check=True)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, mode) as f:
        subprocess.run(cmd, cwd=REPO, check=True, stdout=f, stderr=subprocess.STDOUT)


def run_jobs(tasks: dict, jobs: int, label) -> dict:
    """Call every task (key -> zero-argument callable), `jobs` at a time; key -> result of
    those that finished. A task whose run fails (CalledProcessError) is printed with
    `label(key)` and its return code, and left out."""
    done = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(task): key for key, task in tasks.items()}
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            try:
                done[key] = future.result()
            except subprocess.CalledProcessError as e:
                print(f"{label(key)} failed (exit code {e.returncode}); left out of the table",
                      file=sys.stderr, flush=True)
    return done


def run_all(out: Path, runs: list[tuple[str, int]], shared: list[str], steps: int, eval_every: int,
            jobs: int) -> dict[tuple[str, int], Path]:
    """Every (arm, seed) run, `jobs` at a time; the ones that finished (a failure is printed
    with its return code and left out)."""
    tasks = {(arm, seed): (lambda arm=arm, seed=seed: run_arm(out, arm, seed, shared, steps, eval_every, jobs > 1))
             for arm, seed in runs}
    return run_jobs(tasks, jobs, lambda key: f"ablate: arm {key[0]} seed {key[1]}")


def summarize(dump: Path, steps: int) -> dict[str, float]:
    records, evals = read_records(dump)
    nan = float("nan")
    logged = sorted(records)
    tail = [s for s in logged if s > 0.9 * steps] or logged[-1:]
    second_half = [s for s in logged if s > steps / 2 and "moe/max_violation_mean" in records[s]]
    rates = [records[s]["tokens_per_s"] for s in logged[1:] if "tokens_per_s" in records[s]]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "loss": records[logged[-1]]["loss"],
        "loss_tail": mean([records[s]["loss"] for s in tail]),
        "eval_loss": evals[max(evals)].get("eval_loss", nan) if evals else nan,
        "eval_violation": evals[max(evals)].get("eval/moe/max_violation_mean", nan) if evals else nan,
        "violation": mean([records[s]["moe/max_violation_mean"] for s in second_half]),
        "tokens_per_s": mean(rates),
    }


def steps_to_reach(dump: Path, target: float) -> float:
    """The first validated step whose held-out loss is at most `target` (nan: none is)."""
    evals = read_records(dump)[1]
    return next((float(s) for s in sorted(evals) if evals[s].get("eval_loss", float("inf")) <= target), float("nan"))


def write_table(out: Path, results: dict[str, list[dict]], header: str) -> str:
    """The markdown table of `results` (arm -> one `summarize` dict per seed, each with
    ``reach``: `steps_to_reach` of the first arm's final held-out loss, same seed)."""
    cols = ["loss", "loss_tail", "eval_loss", "violation", "eval_violation", "tokens_per_s", "reach"]
    first = next(iter(results), "")
    lines = [header, "", "| arm | seeds | final loss | loss, last 10% | held-out loss | violation, 2nd half "
             f"| held-out violation | tokens/s | steps to {first}'s held-out loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, runs in results.items():
        means = [sum(r[c] for r in runs) / len(runs) for c in cols]
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(
            ("never" if v != v else f"{v:.0f}") if c == "reach" else f"{v:.0f}" if c == "tokens_per_s" else f"{v:.3f}"
            for c, v in zip(cols, means)) + " |")
    text = "\n".join(lines) + "\n"
    (out / "ablation.md").write_text(text)
    return text


def plot(out: Path, dumps: dict[str, list[Path]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (arm, folders) in enumerate(dumps.items()):
        for j, folder in enumerate(folders):
            records, _ = read_records(folder)
            xs = sorted(records)
            ax.plot(xs, [records[s]["loss"] for s in xs], color=f"C{i}", alpha=1.0 if j == 0 else 0.5,
                    label=arm if j == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", default="qb,qb_batch,sign,adamw,muon", help=f"from {', '.join(ARMS)}; ARM@LR at optimizer.lr LR")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--jobs", type=int, default=1, help="arms run at once (default 1)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="validate every N steps (N divides the step count; 0: at the last step only)")
    args, shared = parser.parse_known_args(argv)
    arms = args.arms.split(",")
    for arm in arms:
        try:
            arm_overrides(arm)
        except ValueError as e:
            parser.error(str(e))
    if "--training.steps" in shared:
        steps = int(shared[shared.index("--training.steps") + 1])
    else:
        steps = 60
        shared += ["--training.steps", str(steps)]
    if args.eval_every < 0 or (args.eval_every and steps % args.eval_every):
        parser.error(f"--eval-every {args.eval_every} must be >= 0 and divide the step count {steps}")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs} must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    done = run_all(args.out, [(arm, seed) for arm in arms for seed in seeds], shared, steps, args.eval_every,
                   args.jobs)
    seeds_done = {arm: [s for s in seeds if (arm, s) in done] for arm in arms}
    arms = [arm for arm in arms if seeds_done[arm]]
    if not arms:
        raise SystemExit("ablate: every run failed")
    dumps = {arm: [done[(arm, s)] for s in seeds_done[arm]] for arm in arms}
    results = {arm: [summarize(d, steps) for d in folders] for arm, folders in dumps.items()}
    # the first arm's final held-out loss, seed by seed
    targets = {s: r["eval_loss"] for s, r in zip(seeds_done[arms[0]], results[arms[0]])}
    for arm, folders in dumps.items():
        for seed, result, folder in zip(seeds_done[arm], results[arm], folders):
            result["reach"] = steps_to_reach(folder, targets.get(seed, float("nan")))
    header = f"{steps} steps, seeds {args.seeds}, shared overrides: `{' '.join(shared)}`"
    print(write_table(args.out, results, header))
    plot(args.out, dumps)


if __name__ == "__main__":
    main()
