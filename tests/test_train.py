"""End-to-end training through the entry point: exact resume, crash during save, text corpora,
generation from a checkpoint, the profiler (FSDP parity: tests/test_parallel.py).

Each test launches real training processes on CPU (gloo) with a tiny model; losses are read
from the run's `metrics.jsonl`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tiny import CONFIG, REPO, TINY_CLI, environment, losses, run_train, start_all, started_runs


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _chain(root, *steps):
    """A function running `steps` (name, dump folder, arguments, environment) one after the
    other: {run name: CompletedProcess, with `.after`: the run's folder right after it}."""

    def run():
        out = {}
        for name, dump, args, env in steps:  # args None: generate from the run's checkpoint
            out[name] = _generate(root / dump) if args is None else run_train(root / dump, *args, env=env)
            out[name].after = _state(root / dump)  # before the next run of the chain changes it
        return out
    return run


RESUME = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
CRASH = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2"]


def start_runs(root):
    """Queue the runs of the resume test, the one CI runs (tests/tiny.py): (root folder, chain
    name -> future of {run name: CompletedProcess, with `.after`})."""
    return root, start_all({
        "split": _chain(root, ("stopped", "split", [*RESUME, "--training.exit_at_step", "3"], None),
                        ("resumed", "split", RESUME, None),  # resumes from step 3
                        ("other kernels", "split",
                         ["--training.steps", "7", *RESUME[2:], "--kernels.grouped_mm", "loop"], None)),
        # the uninterrupted reference of both resumes: the same 6 steps (the LR schedule depends on
        # the step count; where it saves does not change what it computes)
        "full": _chain(root, ("full", "full", CRASH, None)),
    })


def start_slow_runs(root, ci_runs):
    """Queue the runs that only the slow tests read, as `start_runs` (`ci_runs`, what `start_runs`
    returned, is not read here: conftest.py passes it to every file's)."""
    return root, start_all({
        # SIGKILLed inside the save of step 4, then run again
        "crashed": _chain(root, ("killed", "crashed", CRASH, {"TITAN_MOE_KILL_DURING_SAVE_STEP": "4"}),
                          ("resumed", "crashed", CRASH, None)),
        "two steps": _chain(root, ("train", "run", ["--training.steps", "2", *CRASH[2:]], None),
                            ("generate", "run", None, None)),
        "text": _chain(root, ("train", "text_run", [
            "--training.steps", "2", "--training.dataset", "text", "--training.dataset_path", str(_corpus(root)),
            "--metrics.enable_tensorboard", "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
            "--validation.local_batch_size", "1", "--validation.seq_len", "64", "--data.val_fraction", "0.2"], None)),
        # stopped by exit_at_step with checkpoints off: nothing to save, a clean stop
        "profiler": _chain(root, ("train", "profiled", ["--training.steps", "5", "--training.exit_at_step", "3",
                                                        "--profiling.enable_profiling",
                                                        "--profiling.profile_freq", "2", "--profiling.profiler_warmup",
                                                        "0", "--profiling.profiler_active", "1"], None)),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory):  # after `runs`: the slow chains queue behind the CI ones
    return started_runs(start_slow_runs, tmp_path_factory, runs)


def _state(dump):
    """What a run left in its folder: its losses so far, its metrics.jsonl and the paths in its
    checkpoint folder (folders end with "/")."""
    ckpt = dump / "checkpoint"
    return SimpleNamespace(
        losses=losses(dump) if (dump / "metrics.jsonl").exists() else {},
        metrics=(dump / "metrics.jsonl").read_text() if (dump / "metrics.jsonl").exists() else "",
        checkpoint={str(p.relative_to(ckpt)) + "/" * p.is_dir() for p in ckpt.rglob("*")} if ckpt.exists() else set())


def _corpus(root):
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 20)
    return corpus


def _generate(dump) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_moe.generate", "--job.config_file", CONFIG, *TINY_CLI,
         "--checkpoint", str(dump / "checkpoint" / "step-2"), "--prompt", "import os", "--max_new_tokens", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**environment(), "OMP_NUM_THREADS": "1"})


def _get(runs, chain: str):
    root, futures = runs
    return root, futures[chain].result()


def test_resume_is_bit_identical(runs):
    _, procs = _get(runs, "split")
    _, full = _get(runs, "full")
    _ok(full["full"])
    _ok(procs["stopped"])
    assert sorted(procs["stopped"].after.losses) == [1, 2, 3]
    proc = procs["resumed"]  # resumes from step 3
    _ok(proc)
    reference, resumed = full["full"].after.losses, proc.after.losses
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    # [kernels]: one start-up line, a record per run in metrics.jsonl, kept with the checkpoint;
    # a resume under other choices runs with them and says what changed
    log = proc.stdout + proc.stderr
    assert log.count("kernels: situ=torch dispatch=torch router_topk=torch grouped_mm=native") == 1
    kernels = [json.loads(line)["kernels"] for line in proc.after.metrics.splitlines() if "kernels" in line]
    assert len(kernels) == 2 and kernels[0]["grouped_mm"] == "native" and kernels[0]["mla_attention"] == "chunked"
    assert log.count("kda_keep=True mla_attention=chunked balance_rule=qb qb_batch_iters=0") == 1
    assert kernels[0]["qb_batch_iters"] == 0  # the debug flavor's QB form (the lag form)
    proc = procs["other kernels"]
    _ok(proc)
    assert "kernels differ from the checkpoint's run" in proc.stdout + proc.stderr
    assert "grouped_mm: 'native' -> 'loop'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_killed_during_save_resumes_from_previous_checkpoint(runs, slow_runs):
    _, procs = _get(slow_runs, "crashed")
    _, full = _get(runs, "full")
    _ok(full["full"])
    proc = procs["killed"]
    assert proc.returncode != 0  # SIGKILLed inside the save of step 4
    ckpt = proc.after.checkpoint
    assert "step-2/.metadata" in ckpt  # a file
    assert "step-4/" in ckpt and "step-4/.metadata" not in ckpt  # a folder, without its metadata
    proc = procs["resumed"]
    _ok(proc)
    assert "Loading the checkpoint from" in proc.stdout + proc.stderr and "step-2" in proc.stdout + proc.stderr
    reference, resumed = full["full"].after.losses, proc.after.losses
    for step in (3, 4, 5, 6):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


@pytest.mark.slow
def test_trains_on_user_text_files_with_tensorboard(slow_runs):
    root, procs = _get(slow_runs, "text")
    _ok(procs["train"])
    dump = root / "text_run"
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval_loss" in r for r in records)
    assert list(dump.rglob("events.out.tfevents.*")), "no TensorBoard event file written"


@pytest.mark.slow
def test_generate_cli_samples_from_a_training_checkpoint(slow_runs):
    import torch

    from titan_moe.config import load_config
    from titan_moe.generate import load_model

    root, procs = _get(slow_runs, "two steps")
    _ok(procs["train"])
    ckpt = root / "run" / "checkpoint" / "step-2"
    config = load_config(["--job.config_file", CONFIG, *TINY_CLI])
    torch.manual_seed(0)
    fresh = load_model(config, None, "cpu")
    torch.manual_seed(0)
    trained = load_model(config, str(ckpt), "cpu")
    # Two optimizer steps moved every routed expert weight away from the same-seed init.
    name = "layers.1.feed_forward.experts.w_gate_up"
    assert not torch.equal(fresh.state_dict()[name], trained.state_dict()[name])

    proc = procs["generate"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("import os")


@pytest.mark.slow
def test_torch_profiler_traces_on_cpu(slow_runs):
    root, procs = _get(slow_runs, "profiler")
    _ok(procs["train"])
    assert sorted(procs["train"].after.losses) == [1, 2, 3]
    traces = list((root / "profiled").rglob("rank0_trace.json"))
    assert traces, "torchtitan's profiler wrote no trace"
    assert json.loads(traces[0].read_text())["traceEvents"]


def test_the_final_sleep_is_skipped_only_inside_the_training_loop():
    import time

    import torchtitan.train as titan_train

    from titan_moe.train import _without_final_sleep

    with _without_final_sleep():
        start = time.perf_counter()
        titan_train.time.sleep(5)
        assert time.perf_counter() - start < 1
        assert titan_train.time.perf_counter() > 0  # everything else is the real module
    assert titan_train.time is time
