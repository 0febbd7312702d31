"""End-to-end training through the entry point: FSDP parity, exact resume, crash during save.

Each test launches real training processes on CPU (gloo) with a tiny model; losses are read
from the run's `metrics.jsonl`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiny import CONFIG, REPO, TINY_CLI, losses, run_train


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.mark.slow
def test_fsdp_two_ranks_matches_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _ok(run_train(one, "--training.steps", "2"))
    _ok(run_train(two, "--training.steps", "2", nproc=2))
    l1, l2 = losses(one), losses(two)
    # Same global batch (4 rows: 2 per rank) and same initial weights: only the summation
    # order of the loss and of the reduce-scattered gradients differs (fp32 rounding).
    assert abs(l1[1] - l2[1]) <= 1e-5 * abs(l1[1])
    assert abs(l1[2] - l2[2]) <= 1e-4 * abs(l1[2])


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    common = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]
    _ok(run_train(full, *common))
    _ok(run_train(split, *common, "--training.exit_at_step", "3"))
    assert sorted(losses(split)) == [1, 2, 3]
    proc = run_train(split, *common)  # resumes from step 3
    _ok(proc)
    reference, resumed = losses(full), losses(split)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    # [kernels]: one start-up line, a record per run in metrics.jsonl, kept with the checkpoint;
    # a resume under other choices runs with them and says what changed
    log = proc.stdout + proc.stderr
    assert log.count("kernels: situ=torch dispatch=torch router_topk=torch grouped_mm=native") == 1
    kernels = [json.loads(line)["kernels"] for line in (split / "metrics.jsonl").read_text().splitlines()
               if "kernels" in line]
    assert len(kernels) == 2 and kernels[0]["grouped_mm"] == "native" and kernels[0]["mla_attention"] == "chunked"
    assert log.count("kda_keep=True mla_attention=chunked") == 1
    proc = run_train(split, "--training.steps", "7", *common[2:], "--kernels.grouped_mm", "loop")
    _ok(proc)
    assert "kernels differ from the checkpoint's run" in proc.stdout + proc.stderr
    assert "grouped_mm: 'native' -> 'loop'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_killed_during_save_resumes_from_previous_checkpoint(tmp_path):
    full, crashed = tmp_path / "full", tmp_path / "crashed"
    common = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2"]
    _ok(run_train(full, *common))
    proc = run_train(crashed, *common, env={"TITAN_MOE_KILL_DURING_SAVE_STEP": "4"})
    assert proc.returncode != 0  # SIGKILLed inside the save of step 4
    ckpt = crashed / "checkpoint"
    assert (ckpt / "step-2" / ".metadata").is_file()
    assert (ckpt / "step-4").is_dir() and not (ckpt / "step-4" / ".metadata").exists()
    proc = run_train(crashed, *common)
    _ok(proc)
    assert "Loading the checkpoint from" in proc.stdout + proc.stderr and "step-2" in proc.stdout + proc.stderr
    reference, resumed = losses(full), losses(crashed)
    for step in (3, 4, 5, 6):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


@pytest.mark.slow
def test_trains_on_user_text_files_with_tensorboard(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"doc{i}.txt").write_text(f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 20)
    dump = tmp_path / "run"
    proc = run_train(dump, "--training.steps", "2", "--training.dataset", "text",
                     "--training.dataset_path", str(corpus), "--metrics.enable_tensorboard",
                     "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
                     "--validation.local_batch_size", "1", "--validation.seq_len", "64",
                     "--data.val_fraction", "0.2")
    _ok(proc)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval_loss" in r for r in records)
    assert list(dump.rglob("events.out.tfevents.*")), "no TensorBoard event file written"


@pytest.mark.slow
def test_generate_cli_samples_from_a_training_checkpoint(tmp_path):
    import torch

    from titan_moe.config import load_config
    from titan_moe.generate import load_model

    dump = tmp_path / "run"
    _ok(run_train(dump, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"))
    ckpt = dump / "checkpoint" / "step-2"
    config = load_config(["--job.config_file", CONFIG, *TINY_CLI])
    torch.manual_seed(0)
    fresh = load_model(config, None, "cpu")
    torch.manual_seed(0)
    trained = load_model(config, str(ckpt), "cpu")
    # Two optimizer steps moved every routed expert weight away from the same-seed init.
    name = "layers.1.feed_forward.experts.w_gate_up"
    assert not torch.equal(fresh.state_dict()[name], trained.state_dict()[name])

    proc = subprocess.run(
        [sys.executable, "-m", "titan_moe.generate", "--job.config_file", CONFIG, *TINY_CLI,
         "--checkpoint", str(ckpt), "--prompt", "import os", "--max_new_tokens", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("import os")


@pytest.mark.slow
def test_torch_profiler_traces_on_cpu(tmp_path):
    dump = tmp_path / "run"
    _ok(run_train(dump, "--training.steps", "3", "--profiling.enable_profiling", "--profiling.profile_freq", "2",
                  "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"))
    traces = list(dump.rglob("rank0_trace.json"))
    assert traces, "torchtitan's profiler wrote no trace"
    assert json.loads(traces[0].read_text())["traceEvents"]
