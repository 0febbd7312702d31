"""Shared by the test files: a tiny model with every feature on, and training runs of it.

The debug flavor, narrowed so that a training process takes seconds: both layer kinds, a
dense FFN and MoE FFNs (8 experts, top-2, QB), block AttnRes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from titan_moe.flavors import FLAVORS

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "debug_cpu.toml")

TINY_ARGS = dataclasses.replace(
    FLAVORS["debug"], dim=64, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, mla_q_lora_rank=32,
    mla_kv_lora_rank=16, mla_qk_nope_head_dim=16, mla_qk_shared_dim=8, mla_v_head_dim=16,
    moe_latent_dim=32, moe_expert_hidden=32, moe_shared_hidden=32, dense_hidden=96, vocab_size=512,
)

# The same widths for the trainer (vocabulary: the shipped tokenizer's), batch 4 x 64 tokens.
TINY_CLI = [
    "--model.dim", "64", "--model.kda_n_heads", "2", "--model.kda_head_dim", "16",
    "--model.mla_n_heads", "2", "--model.mla_q_lora_rank", "32", "--model.mla_kv_lora_rank", "16",
    "--model.mla_qk_nope_head_dim", "16", "--model.mla_qk_shared_dim", "8", "--model.mla_v_head_dim", "16",
    "--model.moe_latent_dim", "32", "--model.moe_expert_hidden", "32", "--model.moe_shared_hidden", "32",
    "--model.dense_hidden", "96",
    "--training.seq_len", "64", "--training.global_batch_size", "4", "--training.local_batch_size", "4",
    "--metrics.log_freq", "1", "--validation.no_enable", "--checkpoint.no_enable", "--debug.deterministic",
]


def train_command(dump: Path, *args: str, nproc: int = 1) -> list[str]:
    """The command line of a tiny training run writing to `dump` (torchrun when nproc > 1)."""
    launcher = [sys.executable, "-m", "titan_moe.train"]
    if nproc > 1:
        # --standalone: torchrun binds its own free port (no pick-then-bind race between runs)
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                    "-m", "titan_moe.train"]
    return [*launcher, "--job.config_file", CONFIG, *TINY_CLI, "--job.dump_folder", str(dump), *args]


def run_train(dump: Path, *args: str, nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(train_command(dump, *args, nproc=nproc), cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


# Training runs that tests read later: chains of subprocesses, run by two threads shared by
# the test files. A one-process training run is mostly one busy core (its imports, a tiny
# model) while the test process waits on it: two at a
# time take about the time of one on a two-core machine.
_POOL: ThreadPoolExecutor | None = None
_STARTED: dict[str, object] = {}


def start_all(chains: dict) -> dict[str, Future]:
    """Queue independent chains of runs (name -> function of no arguments) on the shared
    threads: name -> the future of the chain's result. A chain that failed raises its error
    from `result()`, in the test that reads it."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(2, thread_name_prefix="training-runs")
    return {name: _POOL.submit(fn) for name, fn in chains.items()}


def started_runs(start_runs, tmp_path_factory):
    """What `start_runs(root)` of a test file returned (it queues the file's runs, writing
    under `root`), called once, when a test first asks."""
    key = start_runs.__module__
    if key not in _STARTED:
        _STARTED[key] = start_runs(tmp_path_factory.mktemp(key.replace("test_", "runs_")))
    return _STARTED[key]


def records(dump: Path) -> dict[int, dict]:
    """step -> that step's training record; a later record of a step (after a resume) wins."""
    out: dict[int, dict] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record
    return out


def losses(dump: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in records(dump).items()}


def call_main(main, argv) -> tuple[int, str, str]:
    """Run a CLI's main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()
