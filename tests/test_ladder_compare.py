"""scripts/ladder_compare.py: the ladder beside its baselines, one table of stage-end evaluations."""

from __future__ import annotations

import importlib.util
import json

import pytest

from test_ladder import LADDER_TOML, _ladder_cli
from tiny import REPO, environment

spec = importlib.util.spec_from_file_location("ladder_compare", REPO / "scripts" / "ladder_compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _config(tmp_path) -> str:
    path = tmp_path / "ladder.toml"
    path.write_text(LADDER_TOML.format(dump=tmp_path / "unused"))
    return str(path)


def _write(folder, *records):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_held_out_loss_weights_buckets_by_width_within_the_stage():
    record = {"seq_len": 256, "eval/loss_by_pos/0-64": 5.0, "eval/loss_by_pos/64-128": 4.0,
              "eval/loss_by_pos/128-512": 3.0}  # the last bucket reaches past seq_len: cut to 128 wide
    mean, first, last = compare.held_out_loss(record)
    assert mean == pytest.approx((64 * 5 + 64 * 4 + 128 * 3) / 256) and (first, last) == (5.0, 3.0)
    assert all(v != v for v in compare.held_out_loss({"seq_len": 64}))


def test_table_rows_per_stage_and_the_ratio_to_no_synthetic(tmp_path):
    def stage(step, name, loss, passkey):
        return {"step": step, "seq_len": 64, "stage": name, "eval/passkey/64": passkey,
                "eval/passkey/64/d0.50": passkey, "eval/mqar/64": 0.5, "eval/loss_by_pos/0-64": loss}

    _write(tmp_path / "recipe", {"step": 1, "loss": 9.0}, stage(3, "64", 4.08, 1.0), stage(6, "128", 3.0, 0.5),
           stage(6, "128", 3.06, 0.75))  # a resumed run's record of the same step wins
    _write(tmp_path / "no_synthetic", stage(3, "64", 4.0, 0.0), stage(6, "128", 3.0, 0.0))
    text = compare.table(tmp_path, ["recipe", "no_synthetic", "all_mla"])  # all_mla: not run, no rows
    rows = [line for line in text.splitlines()[2:]]
    assert len(rows) == 4 and (tmp_path / "ladder.md").read_text() == text
    assert rows[0] == "| 64 (3) | recipe | 64 1.00 | 0.50 | 4.080 | 1.0200 | 4.080 / 4.080 |"
    assert rows[1].startswith("| 64 (3) | no_synthetic | 64 0.00 |") and "| 1.0000 |" in rows[1]
    assert rows[2] == "| 128 (6) | recipe | 64 0.75 | 0.50 | 3.060 | 1.0200 | 3.060 / 3.060 |"


def test_commands_per_variant_and_finished_variants_skipped(tmp_path, capsys):
    config = _config(tmp_path)
    out = tmp_path / "out"
    _write(out / "all_mla", {"step": 9, "seq_len": 256, "stage": "256"})  # its last stage is recorded
    compare.main(["--out", str(out), "--job.config_file", config, "--dry-run", "--exit-at-step", "3",
                  "--metrics.log_freq", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.endswith("--training.exit_at_step 3") for line in lines)
    assert f"--job.dump_folder {out / 'recipe'}" in lines[0] and "--metrics.log_freq 3" in lines[0]
    synthetic_off = " ".join(f"--ladder.stages.{i}.synthetic_fraction 0" for i in (1, 2, 3))
    assert synthetic_off in lines[1] and synthetic_off not in lines[0]
    assert compare.variant_overrides("all_mla", 3) == ["--model.mla_every", "1"]
    with pytest.raises(SystemExit, match="unknown variant 'bogus'"):
        compare.main(["--out", str(out), "--job.config_file", config, "--variants", "recipe,bogus", "--dry-run"])


@pytest.mark.slow
def test_two_tiny_ladders_side_by_side(tmp_path, monkeypatch):
    # the recipe and its no-synthetic baseline, at once, on the tiny model: a row per stage each
    for key, value in {**environment(), "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    shared = _ladder_cli(tmp_path)[3:]  # the tiny model's ladder config and overrides
    text = compare.main(["--out", str(out), "--variants", "recipe,no_synthetic", "--jobs", "2", *shared])
    rows = text.splitlines()[2:]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| 64 (3)", "recipe"], ["| 64 (3)", "no_synthetic"], ["| 128 (6)", "recipe"], ["| 128 (6)", "no_synthetic"],
        ["| 256 (9)", "recipe"], ["| 256 (9)", "no_synthetic"]]
    assert all("| 1.0000 |" in row for row in rows[1::2])
    assert (out / "recipe" / "train.log").is_file() and (out / "recipe" / "checkpoint").is_dir()
