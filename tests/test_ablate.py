"""The ablation harness (scripts/ablate.py): two arms of the tiny model, a table and a plot."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import pytest

from tiny import CONFIG, REPO, TINY_CLI

from titan_moe.config import load_config, model_args_from_config


def _ablate_module():
    spec = importlib.util.spec_from_file_location("ablate", REPO / "scripts" / "ablate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arm,field,value", [
    ("aux_loss", "balance_rule", "aux_loss"), ("swiglu", "expert_activation", "swiglu"),
    ("unbounded_gate", "kda_gate", "unbounded"), ("attn_res_none", "attn_res", "none"),
    ("attn_res_full", "attn_res", "full"),
])
def test_arm_overrides_parse_through_the_trainer_config(arm, field, value):
    arms = _ablate_module().ARMS
    args = model_args_from_config(load_config(["--job.config_file", CONFIG, *TINY_CLI, *arms[arm]]))
    assert getattr(args, field) == value
    # every arm parses (a renamed key would stop the sweep only when its turn came)
    for overrides in arms.values():
        load_config(["--job.config_file", CONFIG, *overrides])


def test_arm_at_lr_adds_the_learning_rate_and_bad_arms_are_refused():
    module = _ablate_module()
    overrides = module.arm_overrides("muon@1e-3")
    assert overrides[:len(module.ARMS["muon"])] == module.ARMS["muon"]
    cfg = load_config(["--job.config_file", CONFIG, *overrides])
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.name == "Muon"
    assert module.arm_overrides("muon@") == module.ARMS["muon"]
    for bad in ("muonn", "muon@fast", "muon@-1"):
        with pytest.raises(ValueError, match="arm"):
            module.arm_overrides(bad)


def _fake_run(folder, eval_losses: dict[int, float]) -> None:
    """A metrics.jsonl as the trainer writes it: training records, then held-out ones."""
    import json

    folder.mkdir(parents=True)
    lines = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 1000.0, "moe/max_violation_mean": 0.2}
             for s in range(1, 11)]
    lines += [{"step": s, "eval_loss": v} for s, v in eval_losses.items()]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


def test_steps_to_reach_the_first_arms_held_out_loss(tmp_path):
    module = _ablate_module()
    _fake_run(tmp_path / "base", {5: 4.0, 10: 3.5})
    _fake_run(tmp_path / "fast", {5: 3.4, 10: 3.0})
    _fake_run(tmp_path / "slow", {5: 3.9, 10: 3.6})
    assert module.steps_to_reach(tmp_path / "fast", 3.5) == 5.0
    assert module.steps_to_reach(tmp_path / "base", 3.5) == 10.0
    assert module.steps_to_reach(tmp_path / "slow", 3.5) != module.steps_to_reach(tmp_path / "slow", 3.5)  # nan
    results = {}
    for arm in ("base", "fast", "slow"):
        result = module.summarize(tmp_path / arm, 10)
        result["reach"] = module.steps_to_reach(tmp_path / arm, 3.5)
        results[arm] = [result]
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip()
            for line in module.write_table(tmp_path, results, "h").splitlines() if line.startswith("| ")}
    assert rows["base"] == "10" and rows["fast"] == "5" and rows["slow"] == "never"
    assert "steps to base's held-out loss" in rows["arm"]


def test_eval_every_must_divide_the_steps(tmp_path):
    with pytest.raises(SystemExit):
        _ablate_module().main(["--out", str(tmp_path), "--eval-every", "7", "--training.steps", "20"])


def test_run_all_runs_arms_at_once_and_leaves_a_failed_one_out(tmp_path, monkeypatch):
    ablate = _ablate_module()
    together = threading.Barrier(2, timeout=30)  # broken unless two runs wait at the same time

    def fake_run_arm(out, arm, seed, shared, steps, eval_every, log_to_file):
        assert log_to_file
        together.wait()
        if arm == "sign":
            raise subprocess.CalledProcessError(3, ["train"])
        return out / f"{arm}_s{seed}"

    monkeypatch.setattr(ablate, "run_arm", fake_run_arm)
    done = ablate.run_all(tmp_path, [("qb", 0), ("sign", 0)], [], 2, 0, jobs=2)
    assert done == {("qb", 0): tmp_path / "qb_s0"}
    with pytest.raises(SystemExit):
        ablate.main(["--out", str(tmp_path), "--jobs", "0"])


@pytest.mark.slow
def test_two_arms_give_a_table_and_a_loss_plot(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "ablate.py"), "--out", str(tmp_path), "--arms", "qb,sign",
           "--jobs", "2", "--job.config_file", CONFIG, *TINY_CLI, "--training.steps", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line for line in (tmp_path / "ablation.md").read_text().splitlines() if line.startswith("| qb")
            or line.startswith("| sign")]
    assert len(rows) == 2 and "nan" not in rows[0].split("|")[5]  # held-out loss of the last step
    assert "nan" not in rows[0].split("|")[7]  # held-out balance, frozen bias
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "step" in (tmp_path / "qb_s0" / "train.log").read_text()  # --jobs 2: each run's own log
    # an arm already run is not run again
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "titan_moe.train" not in again.stdout
