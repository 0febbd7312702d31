"""The one-GPU long-context levers together, in the trainer, on the tiny model (CPU, fp32):
full activation checkpointing, FSDP2 on the one device, MoE token tiles and the chunked head
loss change memory, not training. The same path a million-token row takes on one GPU, at a
length a CPU test affords (4 tiles and 4 head chunks a row)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny import records, run_train, start_all, started_runs

SHAPE = ["--training.seq_len", "1024", "--training.global_batch_size", "1", "--training.local_batch_size", "1",
         "--training.steps", "3"]
LEVERS = ["--activation_checkpoint.mode", "full", "--training.one_device_mixed_precision", "fsdp",
          "--model.moe_token_tile", "256", "--model.head_chunk_tokens", "256"]


def start_runs(root: Path) -> dict:
    def one(name: str, *args: str):
        proc = run_train(root / name, *SHAPE, "--debug.seed", "0", *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return root / name, proc.stdout + proc.stderr

    return start_all({"plain": lambda: one("plain"), "levers": lambda: one("levers", *LEVERS)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return started_runs(start_runs, tmp_path_factory)


def test_levers_together_train_like_the_plain_step(runs):
    (plain, _), (levers, log) = runs["plain"].result(), runs["levers"].result()
    assert "moe_token_tile=256 head_chunk_tokens=256 one_device_mixed_precision=fsdp" in log
    ref, got = records(plain), records(levers)
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    for step in ref:
        # fp32 throughout: only the order of sums differs (tiles, head chunks, FSDP's reduce buffer)
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        assert got[step]["moe/max_violation_max"] == ref[step]["moe/max_violation_max"], step
