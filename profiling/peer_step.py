"""Our training step beside torchtitan 0.2.2's DeepSeek-V3 at the same shapes, on the same tokens.

    python profiling/peer_step.py --seq-len 8192 --batch 4 --out OUT/peer_8k
    python profiling/peer_step.py --seq-len 32768 --batch 1 --rows builtin,long --out OUT/peer_32k
    python profiling/peer_step.py ... --runs ours,peer_doc -- --activation_checkpoint.mode full

Each run is its own `torchrun --nproc_per_node=1` training process on `--config` (default
configs/small_1gpu.toml) with `--compile.enable`, `--steps` steps (default 15), one metrics
record per step and no validation; arguments after `--` go to every run alike. Runs:

    ours          our model (`python -m titan_moe.train`), its document mask
    ours_all_mla  the same with MLA in every layer (`--model.mla_every 1`)
    peer_doc      DeepSeek-V3 (profiling/peer_spec.py) with FlexAttention `block_causal`
    peer_causal   DeepSeek-V3 with plain causal SDPA (documents ignored)
    peer_causal_flex  (not by default) DeepSeek-V3, FlexAttention with the causal mask only

Rows (`--rows`, comma-separated): `builtin` (the built-in corpus packed as usual, several
documents per row) and `long` (every row one document of exactly seq_len tokens, from
profiling/peer_long_docs.py, written to OUT/long_docs). Every run reads the rows through our
loader with the same seed, so all runs of one kind of rows see the same tokens.

Per run: tokens/s over the steps after `--warmup` (tokens / seconds over those steps, from
each step's `tokens_per_s` in `metrics.jsonl`), achieved TFLOP/s and MFU by the one formula
of profiling/step_flops.py (6 x active matmul parameters per token, plus the attention
pairs the run's mask leaves, computed here from the same rows: for document masks the sum
over documents of l (l + 1) / 2 per row, for plain causal T (T + 1) / 2 per row), GFLOP per
token, the attention share of the FLOPs, the peak memory (max over steps of torchtitan's
peak active and reserved GiB) and the last loss. MFU against `--peak-tflops` (default 989,
H100/H200 dense bf16).

Output: OUT/<rows>/<run>/ holds each run's dump folder (metrics.jsonl) and train.log;
OUT/table.md and OUT/summary.json are rewritten after every run (so a cut-off call keeps
what finished); at the end the table is printed, then the summary as one JSON line.
`--budget-s S` fits the whole command into S seconds (a run that would overrun is killed, later
ones are skipped, the table still prints); `--table-only` rebuilds the table from the existing
folders (e.g. after runs split over several calls into one OUT); `--dry-run` prints the commands.
The runs go model by model (a model's builtin rows, then its long rows), so the second compile
of a model finds Inductor's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from step_flops import H100_BF16_PEAK_TFLOPS  # noqa: E402

# Long-document rows: at most about this many tokens of distinct text (one pass over the
# stdlib); beyond it the loader repeats the documents written.
LONG_DOC_TOKEN_BUDGET = 4 << 20


@dataclass(frozen=True)
class RunKind:
    entry: tuple[str, ...]  # after `torchrun --nproc_per_node=1`
    args: tuple[str, ...]
    model: str  # "ours" | "peer"
    mask: str  # "doc" | "causal": which pairs the attention leaves
    attention: str  # label; "{mla_attention}" is filled from the run's kernels record


RUNS: dict[str, RunKind] = {
    "ours": RunKind(("-m", "titan_moe.train"), (), "ours", "doc", "MLA {mla_attention}, doc mask"),
    "ours_all_mla": RunKind(("-m", "titan_moe.train"), ("--model.mla_every", "1"), "ours", "doc",
                            "MLA {mla_attention}, doc mask"),
    "peer_doc": RunKind((str(HERE / "peer_train.py"),), ("--model.name", "titan_peer_dsv3"), "peer", "doc",
                        "flex block_causal (eos)"),
    "peer_causal": RunKind((str(HERE / "peer_train.py"),), ("--model.name", "titan_peer_dsv3_causal"), "peer",
                           "causal", "sdpa causal"),
    "peer_causal_flex": RunKind((str(HERE / "peer_train.py"),), ("--model.name", "titan_peer_dsv3_causal_flex"),
                                "peer", "causal", "flex causal"),
}
DEFAULT_RUNS = "ours,ours_all_mla,peer_doc,peer_causal"
_TABLE_MARGIN_S = 20  # what --budget-s keeps back for the FLOP counts and the table
ROWS = ("builtin", "long")


@dataclass
class Plan:
    seq_len: int
    batch: int
    steps: int
    warmup: int
    config: str
    out: Path
    extra: list[str] = field(default_factory=list)

    def long_dir(self) -> Path:
        return self.out / "long_docs"

    def long_count(self) -> int:
        return max(1, min(self.steps * self.batch, LONG_DOC_TOKEN_BUDGET // self.seq_len))

    def trainer_argv(self, run: str, rows: str) -> list[str]:
        """The trainer's arguments (config and overrides) of one run."""
        argv = [
            "--job.config_file", self.config,
            "--job.dump_folder", str(self.out / rows / run),
            "--training.seq_len", str(self.seq_len),
            "--training.local_batch_size", str(self.batch),
            "--training.global_batch_size", str(self.batch),
            "--training.steps", str(self.steps),
            "--metrics.log_freq", "1",
            "--validation.no_enable",
            "--checkpoint.no_enable",
            "--compile.enable",
        ]
        if rows == "long":
            argv += ["--training.dataset", "text", "--training.dataset_path", str(self.long_dir()),
                     "--data.val_fraction", "0"]
        return [*argv, *RUNS[run].args, *self.extra]

    def command(self, run: str, rows: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                *RUNS[run].entry, *self.trainer_argv(run, rows)]


# ------------------------------------------------------------------------------------ FLOPs
def flop_model(run: str, trainer_argv: list[str]):
    """The FlopModel of a run's model, from the run's own config and overrides."""
    import step_flops
    from titan_moe.config import load_config, model_args_from_config

    ours = model_args_from_config(load_config(trainer_argv))
    if RUNS[run].model == "ours":
        return step_flops.flop_model_ours(ours)
    import peer_spec

    return step_flops.flop_model_dsv3(peer_spec.peer_args(ours))


def builtin_pairs(plan: Plan, rows: str, n_steps: int) -> list[dict[str, int]]:
    """Per step: the pairs left by a document mask and by a plain causal mask, and the tokens,
    for the rows the runs read (our loader, built from the same config)."""
    import step_flops

    if rows == "long":  # one document per row by construction (peer_long_docs)
        pairs = plan.batch * step_flops.causal_pairs([plan.seq_len])
        return [{"doc": pairs, "causal": pairs, "tokens": plan.batch * plan.seq_len, "docs": plan.batch}] * n_steps
    from titan_moe.config import load_config
    from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config

    job = load_config(plan.trainer_argv("ours", rows))
    loader = dataloader_from_config(job, tokenizer=tokenizer_from_config(job), split="train", dp_rank=0,
                                    dp_world_size=1)
    out = []
    for _, (input_dict, _labels) in zip(range(n_steps), loader):
        doc_ids = input_dict["doc_ids"]
        out.append({
            "doc": step_flops.doc_mask_pairs(doc_ids),
            "causal": step_flops.full_causal_pairs(*doc_ids.shape),
            "tokens": doc_ids.numel(),
            "docs": sum(len(step_flops.segment_lengths(row)) for row in doc_ids),
        })
    return out


# ---------------------------------------------------------------------------------- results
def read_metrics(dump: Path) -> tuple[dict[int, dict], dict]:
    """({step: training record}, the kernels record) from a run's metrics.jsonl."""
    steps, kernels = {}, {}
    path = dump / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if "kernels" in record:
                kernels = record["kernels"]
            elif "loss" in record:
                steps[record["step"]] = record
    return steps, kernels


def device_name(log: Path) -> str | None:
    """The device torchtitan reports in a run's log ("CUDA capacity: NAME with ...")."""
    if not log.is_file():
        return None
    m = re.search(r"[A-Z]+ capacity: (.+?) with [\d.]+ ?GiB memory", log.read_text(errors="replace"))
    return m.group(1).strip() if m else None


def summarize(plan: Plan, run: str, rows: str, pairs: list[dict[str, int]], fm, peak_tflops: float,
              status: str, wall_s: float | None) -> dict:
    steps, kernels = read_metrics(plan.out / rows / run)
    kind = RUNS[run]
    row = {"run": run, "rows": rows, "status": status, "wall_s": wall_s,
           "attention": kind.attention.format(mla_attention=kernels.get("mla_attention", "?"))}
    window = [s for s in sorted(steps) if s > plan.warmup and steps[s].get("tokens_per_s") and s <= len(pairs)]
    if steps:
        row["loss_last"] = steps[max(steps)]["loss"]
        row["peak_active_gib"] = max(r.get("max_active_gib", 0.0) for r in steps.values())
        row["peak_reserved_gib"] = max(r.get("max_reserved_gib", 0.0) for r in steps.values())
    if not window:
        return row
    seconds = sum(pairs[s - 1]["tokens"] / steps[s]["tokens_per_s"] for s in window)
    tokens = sum(pairs[s - 1]["tokens"] for s in window)
    attn_pairs = sum(pairs[s - 1][kind.mask] for s in window)
    flops = fm.step_flops(tokens, attn_pairs)
    tflops = flops / seconds / 1e12
    row.update({
        "steps_measured": window,
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / peak_tflops,
        "gflop_per_token": flops / tokens / 1e9,
        "attention_share": fm.attention_flops(attn_pairs) / flops,
        "docs_per_row": sum(pairs[s - 1]["docs"] for s in window) / (len(window) * plan.batch),
        "active_matmul_params": fm.active_matmul_params,
    })
    if kind.mask == "causal":
        row["docs_per_row"] = 1.0  # what the mask sees
    return row


def _fmt(value, spec: str) -> str:
    return "" if value is None else spec.format(value)


def table(rows: list[dict]) -> str:
    header = ["run", "rows", "attention", "docs/row (mask)", "tokens/s", "TFLOP/s", "MFU", "GFLOP/token",
              "attention FLOPs", "peak active GiB", "peak reserved GiB", "loss (last)", "wall s", "status"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        cells = [r["run"], r["rows"], r["attention"], _fmt(r.get("docs_per_row"), "{:.2f}"),
                 _fmt(r.get("tokens_per_s"), "{:,.0f}"), _fmt(r.get("tflops"), "{:.1f}"),
                 _fmt(r.get("mfu"), "{:.1%}"), _fmt(r.get("gflop_per_token"), "{:.3f}"),
                 _fmt(r.get("attention_share"), "{:.1%}"), _fmt(r.get("peak_active_gib"), "{:.1f}"),
                 _fmt(r.get("peak_reserved_gib"), "{:.1f}"), _fmt(r.get("loss_last"), "{:.3f}"),
                 _fmt(r.get("wall_s"), "{:.0f}"), r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- runs
def run_one(command: list[str], log: Path, timeout_s: float | None) -> tuple[str, float]:
    """Run a training process (its own process group), output to `log`; (status, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timeout after {timeout_s:.0f} s", time.perf_counter() - start
    return ("ok" if rc == 0 else f"exit {rc}"), time.perf_counter() - start


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="rows per step (local = global batch)")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the means (compile, autotune)")
    p.add_argument("--rows", default="builtin", help="comma-separated: builtin, long")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated, of {', '.join(RUNS)}")
    p.add_argument("--config", default="configs/small_1gpu.toml")
    p.add_argument("--out", required=True)
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS)
    p.add_argument("--run-timeout-s", type=float, default=None, help="kill a run after this long")
    p.add_argument("--budget-s", type=float, default=None,
                   help="the whole command's time: a run is killed when it would overrun it (leaving time for "
                        "the table), and runs that cannot start with a minute left are skipped")
    p.add_argument("--table-only", action="store_true", help="no runs: the table of the existing folders")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    runs, rows = args.runs.split(","), args.rows.split(",")
    for name, allowed, values in (("--runs", RUNS, runs), ("--rows", ROWS, rows)):
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad[0]!r}; choose from {', '.join(allowed)}")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no measured step of --steps {args.steps}")
    args.runs, args.rows = runs, rows
    return args, extra


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    args, extra = parse_args(argv)
    out = Path(args.out).resolve()
    config = Path(args.config) if Path(args.config).is_file() else REPO / args.config
    plan = Plan(args.seq_len, args.batch, args.steps, args.warmup, str(config.resolve()), out, extra)
    order = [(run, rows) for run in args.runs for rows in args.rows]  # a model's compile cache, reused
    if args.dry_run:
        for run, rows in order:
            print(" ".join(plan.command(run, rows)))
        return {}
    out.mkdir(parents=True, exist_ok=True)
    if "long" in args.rows and not args.table_only:
        import peer_long_docs

        t0 = time.perf_counter()
        manifest = peer_long_docs.write_long_documents(str(plan.long_dir()), seq_len=plan.seq_len,
                                                       count=plan.long_count())
        print(f"peer_step: long documents {manifest} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    pairs = {rows: builtin_pairs(plan, rows, args.steps) for rows in args.rows}
    models = {run: flop_model(run, plan.trainer_argv(run, args.rows[0])) for run in args.runs}
    results: dict[tuple[str, str], dict] = {}
    summary: dict = {}

    def record(run: str, rows: str, status: str, wall_s: float | None) -> None:
        results[(run, rows)] = summarize(plan, run, rows, pairs[rows], models[run], args.peak_tflops, status,
                                         wall_s)
        logs = [out / r / n / "train.log" for n, r in results]
        summary.update({
            "seq_len": plan.seq_len, "batch": plan.batch, "steps": plan.steps, "warmup": plan.warmup,
            "peak_tflops": args.peak_tflops, "config": plan.config, "extra_args": plan.extra,
            "device": next((d for d in map(device_name, logs) if d), None),
            "rows": [results[k] for k in order if k in results],
        })
        (out / "table.md").write_text(table(summary["rows"]) + "\n")
        (out / "summary.json").write_text(json.dumps(summary) + "\n")

    for run, rows in order:
        if args.table_only:
            has_metrics = (out / rows / run / "metrics.jsonl").is_file()
            record(run, rows, "ok" if has_metrics else "missing", None)
            continue
        timeout_s = args.run_timeout_s
        if args.budget_s is not None:
            left = args.budget_s - (time.perf_counter() - started) - _TABLE_MARGIN_S
            if left < 60:
                record(run, rows, "skipped (budget)", None)
                continue
            timeout_s = left if timeout_s is None else min(timeout_s, left)
        dump = out / rows / run
        if (dump / "metrics.jsonl").exists():
            (dump / "metrics.jsonl").unlink()  # metrics append: start this run's file afresh
        status, wall_s = run_one(plan.command(run, rows), dump / "train.log", timeout_s)
        print(f"peer_step: {run} [{rows}]: {status} ({wall_s:.0f} s)", file=sys.stderr)
        record(run, rows, status, wall_s)
    print(f"\n{plan.seq_len} x {plan.batch}, {summary.get('device') or 'device unknown'}, "
          f"steps {plan.warmup + 1}-{plan.steps} measured\n")
    print(table(summary["rows"]))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
