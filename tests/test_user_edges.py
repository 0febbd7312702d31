"""What a new user meets: help texts, one-line mistakes (exit 2), damaged inputs, the
start-up and progress lines, and the README's commands as written.

Most checks call the entry points in-process; two run the tiny trainer as a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tiny import CONFIG, REPO, TINY_CLI, records, run_train
from tiny import call_main as _exit  # (exit code, stdout, stderr) of a CLI main run in-process
from titan_moe.config import ConfigError, error_source, load_config
from titan_moe.runtime import checkpoint as intact


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# --------------------------------------------------------------------------- help texts
def test_plan_generate_export_help_list_their_flags():
    from titan_moe.export.cli import main as export_main
    from titan_moe.generate import main as generate_main
    from titan_moe.plan.cli import main as plan_main

    for main, flags in ((plan_main, ["--gpus", "--gpu-mem-gib", "--ac", "--seq-len", "--local-batch", "--headroom",
                                     "--hsdp", "--top", "--activations"]),
                        (generate_main, ["--checkpoint", "--prompt", "--max_new_tokens", "--temperature", "--top_k",
                                         "--seed"]),
                        (export_main, ["--out", "--checkpoint", "--what", "--capacity", "--device"])):
        code, out, _ = _exit(main, ["--help"])
        assert code == 0
        for flag in flags:
            assert flag in out, (main.__module__, flag)
        assert "python -m titan_moe.train --help" in out  # where the config keys are listed


# ------------------------------------------------------------------- one-line mistakes
def test_train_without_a_config_file_says_to_pass_one():
    from titan_moe.train import main

    code, _, err = _exit(main, [])
    _one_line_error(code, err, "--job.config_file")
    assert "debugmodel" not in err


def test_errors_name_where_the_bad_value_was_set(tmp_path):
    with pytest.raises(ConfigError, match=r"^command line: model.flavor 'nope'"):
        load_config(["--job.config_file", CONFIG, "--model.flavor", "nope"])
    with pytest.raises(ConfigError, match=r"^command line: model.dim must be > 0"):
        load_config(["--job.config_file", CONFIG, "--model.dim", "0"])
    toml = tmp_path / "bad.toml"
    toml.write_text('[model]\nname = "titan_moe"\nflavor = "nope"\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(toml))}: model.flavor 'nope'"):
        load_config(["--job.config_file", str(toml)])
    # errors found later (building the trainer) are placed by the key or the path they name
    config = load_config(["--job.config_file", CONFIG, "--training.dataset", "text",
                          "--training.dataset_path", "/no/corpus"])
    assert error_source(config, "text corpus at '/no/corpus': no such file or directory") == "command line"
    assert error_source(config, "training.seq_len too long") == CONFIG


def test_generate_without_the_checkpoint_is_one_line(tmp_path):
    from titan_moe.export.cli import main as export_main
    from titan_moe.generate import main as generate_main

    missing = str(tmp_path / "checkpoint" / "step-60")
    code, _, err = _exit(generate_main, ["--job.config_file", CONFIG, "--checkpoint", missing])
    _one_line_error(code, err, missing, "not found", "--checkpoint.enable")
    code, _, err = _exit(export_main, ["--job.config_file", CONFIG, "--checkpoint", missing, "--out", str(tmp_path)])
    _one_line_error(code, err, missing, "not found")


def test_corrupt_tokenizer_names_its_path(tmp_path):
    from titan_moe.data import load_tokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "trunc')
    with pytest.raises(ValueError, match=re.escape(str(bad))) as info:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(info.value) and "data.tokenizer" in str(info.value)


# --------------------------------------------------------------------------- corpora
def _loader(tmp_path, path, *extra):
    from titan_moe.data import load_tokenizer
    from titan_moe.data.from_config import dataloader_from_config

    config = load_config(["--job.config_file", CONFIG, "--training.dataset", "text", "--training.dataset_path",
                          str(path), *extra])
    return lambda split: dataloader_from_config(config, tokenizer=load_tokenizer(), split=split, dp_rank=0,
                                                dp_world_size=1)


def test_tiny_binary_and_unsplittable_corpora_stop_at_start_up(tmp_path):
    from titan_moe.data.corpus import CorpusError

    two = tmp_path / "two.txt"
    two.write_bytes(b"hi")
    with pytest.raises(CorpusError, match=r"two\.txt.*fewer than the 8 of one batch.*training\.local_batch_size"):
        _loader(tmp_path, two)("train")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(CorpusError, match=r"bin\.txt.*not a text file"):
        _loader(tmp_path, binary)("train")
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"d{i}.txt").write_text("hello world " * 400)
    build = _loader(tmp_path, folder)
    assert next(iter(build("train")))[1].shape == (8, 256)
    with pytest.raises(CorpusError, match=r"'val' split is empty.*validation\.enable = false"):
        build("val")


# ----------------------------------------------------------------- damaged checkpoints
def _save(folder: Path, step: int, value: float) -> Path:
    path = folder / f"step-{step}"
    dcp.save({"w": torch.full((64, 64), value)}, checkpoint_id=str(path))
    intact.write_manifest(str(path))
    return path


def _data_file(path: Path) -> Path:
    (data,) = [p for p in path.iterdir() if p.suffix == ".distcp"]
    return data


def test_damaged_checkpoints_are_skipped_never_deleted(tmp_path):
    from titan_moe.train import IntactCheckpointManager

    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        _save(folder, step, float(step))
    (folder / "step-8").mkdir()  # killed before .metadata: not a checkpoint at all
    assert intact.saved_steps(str(folder)) == [6, 4, 2]
    assert intact.damage(str(folder / "step-6")) is None
    # step 6 truncated to half (caught by the sizes the DCP metadata implies, manifest or not);
    # step 4 with one flipped byte (caught by the manifest's checksum)
    data6 = _data_file(folder / "step-6")
    os.truncate(data6, data6.stat().st_size // 2)
    (folder / "step-6" / intact.MANIFEST).unlink()
    data4 = _data_file(folder / "step-4")
    raw = bytearray(data4.read_bytes())
    raw[-1] ^= 0xFF
    data4.write_bytes(bytes(raw))
    warnings: list[str] = []
    assert intact.newest_intact_step(str(folder), warnings.append) == 2
    assert len(warnings) == 2 and "step-6" in warnings[0] and "metadata points" in warnings[0]
    assert "step-4" in warnings[1] and "checksum" in warnings[1]
    assert all((folder / f"step-{s}").is_dir() for s in (2, 4, 6, 8))  # nothing deleted
    # the trainer's checkpointer: the newest intact step; none intact is one line, exit 2
    manager = SimpleNamespace(folder=str(folder))
    assert IntactCheckpointManager._find_load_step(manager) == 2
    os.truncate(_data_file(folder / "step-2"), 10)
    with pytest.raises(ConfigError, match="every checkpoint in .* is damaged"):
        IntactCheckpointManager._find_load_step(manager)
    with pytest.raises(ValueError, match=r"step-6 is damaged: .*holds"):
        intact.check_loadable(str(folder / "step-6"))


@pytest.mark.slow
def test_resume_skips_a_truncated_checkpoint_and_logs_each_step_once(tmp_path):
    dump = tmp_path / "run"
    common = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    proc = run_train(dump, "--training.steps", "3", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert f"outputs: metrics {dump / 'metrics.jsonl'}, checkpoints {dump / 'checkpoint'}/step-N" in log
    assert re.search(r"step 2/3 \(66%\)  [\d.]+ steps/s  left 0:00:\d\d", log)
    for noise in ("lspci", "A100"):
        assert noise not in log
    first = records(dump)
    data = _data_file(dump / "checkpoint" / "step-3")
    os.truncate(data, data.stat().st_size // 2)

    proc = run_train(dump, "--training.steps", "4", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert f"checkpoint {dump / 'checkpoint' / 'step-3'} is damaged" in log
    assert f"Loading the checkpoint from {dump / 'checkpoint' / 'step-2'}" in log
    assert data.exists()
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s] == [1, 2, 3, 4]  # step 3 was logged again, not twice
    assert records(dump)[3]["loss"] == first[3]["loss"]  # the resumed run redid step 3 exactly


# ------------------------------------------------------------ settings and log lines
def test_settings_the_trainer_adjusts_are_said():
    from titan_moe.train import _reconcile

    config = load_config(["--job.config_file", CONFIG, "--training.mixed_precision_param", "bfloat16",
                          "--training.steps", "3", "--lr_scheduler.warmup_steps", "10"])
    notes = _reconcile(config, "cpu")
    assert config.training.mixed_precision_param == "float32"
    assert config.lr_scheduler.warmup_steps == 3
    assert any("bfloat16" in n and "float32" in n for n in notes)
    assert any("warmup_steps = 10 exceeds training.steps = 3" in n for n in notes)
    assert _reconcile(load_config(["--job.config_file", CONFIG]), "cpu") == []
    config = load_config(["--job.config_file", CONFIG, "--comm.mode", "fake_backend"])
    notes = _reconcile(config, "cpu")
    assert not config.checkpoint.enable  # a fake-backend save would hold rank 0's shards only
    assert any("checkpoint.enable with comm.mode = 'fake_backend'" in n for n in notes)


def test_outputs_line_progress_and_rank0_logging(monkeypatch, tmp_path):
    from torchtitan.tools import utils
    from torchtitan.tools.logging import logger

    from titan_moe.metrics import TitanMetricsProcessor
    from titan_moe.train import _outputs_line, _quiet_other_ranks

    config = load_config(["--job.config_file", CONFIG, "--profiling.enable_profiling"])
    line = _outputs_line(config)
    assert "outputs: metrics ./outputs/debug_cpu/metrics.jsonl" in line
    assert "checkpoints ./outputs/debug_cpu/checkpoint/step-N (every 30 steps and at the end)" in line
    assert "profiler traces ./outputs/debug_cpu/profile_trace" in line
    # progress: the rate since the last log and the time left at it
    proc = SimpleNamespace(job_config=config, _last_progress=None)
    TitanMetricsProcessor.start_progress(proc, 0)
    proc._last_progress = (0, 100.0)
    assert TitanMetricsProcessor.progress(proc, 10, 105.0) == "step 10/60 (16%)  2.00 steps/s  left 0:00:25"
    # a resume drops the records of the steps it redoes
    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    TitanMetricsProcessor.resumed_at(SimpleNamespace(_jsonl_path=str(jsonl)), 2)
    assert [json.loads(x)["step"] for x in jsonl.read_text().splitlines()] == [1, 2]
    # on the CPU no lspci and no A100 fallback behind MFU
    assert utils.get_peak_flops("CPU") == float("inf")
    # under torchrun, ranks other than 0 log warnings and errors only
    level = logger.level
    try:
        monkeypatch.setenv("RANK", "1")
        _quiet_other_ranks(config)
        assert logger.level == logging.WARNING
        logger.setLevel(logging.INFO)
        config.metrics.log_all_ranks = True
        _quiet_other_ranks(config)
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(level)


# ----------------------------------------------------------------------- the README
def _readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if not line.startswith("    "):  # commands sit in indented code blocks
            continue
        for part in line.split("&&"):
            words = shlex.split(part.strip(), comments=True)
            if "-m" in words and words[words.index("-m") + 1].startswith("titan_moe."):
                commands.append(words[words.index("-m") + 1:])
    return commands


def test_readme_commands_parse_and_name_the_quick_starts_checkpoint():
    """Every `python -m titan_moe.X` / `torchrun -m titan_moe.X` command of the README: its
    config and options are accepted; a checkpoint it reads is the one the quick start writes."""
    from titan_moe.plan.cli import parse_args

    commands = _readme_commands()
    modules = {c[0] for c in commands}
    assert {"titan_moe.train", "titan_moe.generate", "titan_moe.export", "titan_moe.plan",
            "titan_moe.inspect"} <= modules
    quick = load_config(["--job.config_file", CONFIG])
    assert quick.checkpoint.enable
    written = f"outputs/debug_cpu/{quick.checkpoint.folder}/step-{quick.training.steps}"
    assert os.path.normpath(os.path.join(quick.job.dump_folder, quick.checkpoint.folder,
                                         f"step-{quick.training.steps}")) == written
    for module, *args in commands:
        if module == "titan_moe.config_reference":
            continue
        if module == "titan_moe.plan":
            _, args = parse_args(args)
        for flag in ("--checkpoint", "--prompt", "--max_new_tokens", "--out"):
            if flag in args:
                i = args.index(flag)
                if flag == "--checkpoint":
                    assert args[i + 1] == written, args
                del args[i:i + 2]
        if "--help" not in args:
            load_config([a.replace("$HEAD", "head") for a in args])


@pytest.mark.slow
def test_quick_start_checkpoint_runs_through_generate_and_export(tmp_path, monkeypatch):
    """The export CLI loads the checkpoint and writes its manifest; torch.export itself (about
    a minute here) is stubbed: tests/test_export.py covers it on a DCP checkpoint."""
    from titan_moe.export import programs
    from titan_moe.export.cli import main as export_main
    from titan_moe.generate import main as generate_main

    dump = tmp_path / "debug_cpu"
    # the quick start's config (checkpointing on in the TOML), narrowed and shortened
    proc = run_train(dump, "--training.steps", "2", "--checkpoint.enable")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = dump / "checkpoint" / "step-2"
    assert intact.damage(str(ckpt)) is None and (ckpt / intact.MANIFEST).is_file()
    model_cli = TINY_CLI[:TINY_CLI.index("--training.seq_len")]
    code, out, err = _exit(generate_main, ["--job.config_file", CONFIG, *model_cli, "--checkpoint", str(ckpt),
                                           "--prompt", "def main(", "--max_new_tokens", "8"])
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith("def main(")
    exported = []
    monkeypatch.setattr(programs, "export_programs", lambda model, capacity: exported.append(model) or {})
    code, out, err = _exit(export_main, ["--job.config_file", CONFIG, *model_cli, "--checkpoint", str(ckpt),
                                         "--out", str(tmp_path / "exported"), "--what", "pt2", "--capacity", "16"])
    assert code == 0, err
    (model,) = exported
    state = {"tok_embeddings.weight": torch.empty_like(model.tok_embeddings.weight)}
    dcp.load(state, checkpoint_id=str(ckpt))
    assert torch.equal(model.tok_embeddings.weight, state["tok_embeddings.weight"])
    assert json.loads((tmp_path / "exported" / "manifest.json").read_text())["checkpoint"] == str(ckpt)
