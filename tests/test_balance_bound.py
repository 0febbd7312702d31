"""scripts/balance_bound.py: what fixed expert biases give on held-out batches."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import torch

from tiny import REPO, environment

spec = importlib.util.spec_from_file_location("balance_bound", REPO / "scripts" / "balance_bound.py")
bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bound)


def _batches(gen, n_batches, m=512, n=8, skew=None):
    """Sigmoid scores [m, n] per batch; `skew` [n] shifts every token's logits alike."""
    skew = torch.zeros(n) if skew is None else skew
    return [torch.sigmoid(torch.randn(m, n, generator=gen) + skew) for _ in range(n_batches)]


def test_violation_counts_the_pooled_load():
    scores = [torch.tensor([[0.9, 0.1, 0.2, 0.3]] * 6)]  # every token picks expert 0 first, 3 second
    assert bound.violation(scores, torch.zeros(4), 1) == 3.0  # load [6, 0, 0, 0]: 6 / 1.5 - 1
    assert bound.violation(scores, torch.zeros(4), 2) == 1.0  # load [6, 0, 0, 6]: 6 / 3 - 1
    assert bound.violation(scores, torch.tensor([0.0, 1.0, 0.0, 0.0]), 1) == 3.0  # now all to expert 1


def test_fitted_biases_balance_their_batches_and_transfer_to_like_ones():
    gen = torch.Generator().manual_seed(0)
    skew = torch.linspace(-1.5, 1.5, 8)
    train, val = _batches(gen, 4, skew=skew), _batches(gen, 4, skew=skew)
    frozen = torch.zeros(8)  # a bias that ignores the skew
    bounds = bound.layer_bounds(train, val, frozen, top_k=2)
    assert set(bounds) == set(bound.CONDITIONS)
    assert bounds["frozen"]["pooled"] > 1.0  # the skewed experts take most tokens
    assert bounds["oracle"]["pooled"] < 0.02  # the exact fit of B's own tokens
    # batches drawn alike: a bias fitted on other batches nearly balances B, far below frozen
    for name in ("train_fit", "cross_fit"):
        assert bounds[name]["pooled"] < 0.15 < bounds["frozen"]["pooled"]
        assert bounds[name]["per_batch"] >= bounds[name]["pooled"] - 1e-9  # fewer tokens, more spread
    # batches of different content: a bias fitted on training text does not transfer
    shifted = _batches(gen, 4, skew=-skew)
    assert bound.layer_bounds(train, shifted, frozen, top_k=2)["train_fit"]["pooled"] > 1.0


def test_command_prints_the_table(tmp_path):
    out = tmp_path / "bound.json"
    proc = subprocess.run([sys.executable, "scripts/balance_bound.py", "--job.config_file", "configs/debug_cpu.toml",
                           "--val-batches", "2", "--train-batches", "1", "--json", str(out)],
                          cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| frozen |" in proc.stdout and "| oracle |" in proc.stdout and "(initial weights)" in proc.stdout

    record = json.loads(out.read_text())
    assert set(record["table"]) == set(bound.CONDITIONS) and len(record["layers"]) >= 1
    bad = subprocess.run([sys.executable, "scripts/balance_bound.py", "--job.config_file", "configs/debug_cpu.toml",
                          "--val-batches", "1"],
                         cwd=REPO, env=environment(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--val-batches must be >= 2" in bad.stderr


def test_the_model_computes_in_the_evaluation_dtype(tmp_path, monkeypatch):
    # on CUDA the varlen MLA attention takes only bf16 / fp16: the bound must load the model as
    # the evaluator does (an fp32 model failed there); here the dtype is forced to bf16 on the CPU
    import titan_moe.evaluate as evaluate

    asked = []

    def bf16_dtype(config, device):
        asked.append(device)
        return torch.bfloat16

    monkeypatch.setattr(evaluate, "evaluation_dtype", bf16_dtype)
    seen = []
    original = bound.collect_scores
    monkeypatch.setattr(bound, "collect_scores", lambda model, batches, device: (
        seen.append({p.dtype for p in model.parameters()}), original(model, batches, device))[1])
    out = tmp_path / "bound.json"
    bound.main(["--job.config_file", str(REPO / "configs" / "debug_cpu.toml"), "--val-batches", "2",
                "--train-batches", "1", "--json", str(out)])
    assert asked == ["cpu"] and seen and all(dtypes == {torch.bfloat16} for dtypes in seen)
    assert set(json.loads(out.read_text())["table"]) == set(bound.CONDITIONS)
