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
import threading
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
    full_env = {**environment(), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(train_command(dump, *args, nproc=nproc), cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=600)


# Processes that tests read later (training runs, scripts): chains of subprocesses, run by two
# threads shared by the test files. Such a process is mostly one busy core (its imports, a
# tiny model) while the test process waits on it or runs other tests: two at a time use a
# two-core machine. When the session starts (conftest.py), each selected file's `start_runs`
# (read through its `runs` fixture) is queued, then its `start_slow_runs` where a selected
# test reads `slow_runs`, in the order of the files, so that the processes run beside the
# in-process tests of the files before them.
_POOL: ThreadPoolExecutor | None = None
_STARTED: dict[str, object] = {}
_QUEUED_ENV = threading.local()


def environment() -> dict[str, str]:
    """A copy of the environment for a process started now. On the shared threads: the
    environment of when its chain was queued, so that a variable that a test sets meanwhile
    (monkeypatch: RANK, WORLD_SIZE, kernel knobs) does not reach it."""
    return dict(getattr(_QUEUED_ENV, "env", None) or os.environ)


def start_all(chains: dict) -> dict[str, Future]:
    """Queue chains of runs (name -> function of no arguments) on the shared threads: name ->
    the future of the chain's result. A chain that failed raises its error from `result()`, in
    the test that reads it. A chain may wait on the result of a chain queued before it (the
    threads take chains in order, so that one is running or done), never on a later one.
    Processes that a chain starts take `environment()`: the environment of now."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(2, thread_name_prefix="training-runs")
    queued_env = dict(os.environ)

    def in_queued_env(fn):
        def run():
            _QUEUED_ENV.env = queued_env
            try:
                return fn()
            finally:
                _QUEUED_ENV.env = None
        return run

    return {name: _POOL.submit(in_queued_env(fn)) for name, fn in chains.items()}


def cancel_queued() -> None:
    """Drop the chains that have not started (the session is ending: a test failed early, or
    the run was interrupted); those running finish."""
    if _POOL is not None:
        _POOL.shutdown(wait=False, cancel_futures=True)


def side_by_side(*calls):
    """The results of `calls` (functions of no arguments, e.g. processes to run), called two
    at a time on threads of their own: the test waits on them now, so they do not queue
    behind the shared threads' chains. Processes they start take the environment of now
    (the test's, monkeypatched variables included)."""
    with ThreadPoolExecutor(2, thread_name_prefix="side-by-side") as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def started_runs(start_runs, tmp_path_factory, *args):
    """What `start_runs(root, *args)` of a test file returned (it queues the file's runs,
    writing under `root`), called once: when the session starts (conftest.py) or when a test
    first asks. A file may have a second such function, `start_slow_runs(root, ci_runs)`
    (`ci_runs`: what its `start_runs` returned), for the runs that only its slow tests read
    (through its `slow_runs` fixture), so that `-m "not slow"` starts none of them."""
    key = f"{start_runs.__module__}.{start_runs.__name__}"
    if key not in _STARTED:
        name = start_runs.__module__.replace("test_", "runs_")
        if start_runs.__name__ != "start_runs":
            name += "_" + start_runs.__name__.replace("start_", "")
        _STARTED[key] = start_runs(tmp_path_factory.mktemp(name), *args)
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
