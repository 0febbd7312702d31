"""scripts/copy_probe.py: the copy probe detects learning where it happens and not where it cannot."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tiny import REPO

spec = importlib.util.spec_from_file_location("copy_probe", REPO / "scripts" / "copy_probe.py")
copy_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy_probe)


def test_copy_batch_repeats_its_first_half():
    g = torch.Generator().manual_seed(0)
    rows = copy_probe.copy_batch(g, 3, 5, 7, vocab=16)
    assert rows.shape == (3, 10) and torch.equal(rows[:, :5], rows[:, 5:])
    assert rows.min() >= 2 and rows.max() < 9  # the two special ids are never drawn
    with pytest.raises(ValueError, match="--symbols 20"):
        copy_probe.copy_batch(g, 1, 4, 20, vocab=16)


def test_copies_from_is_the_first_step_below_half_of_chance():
    chance = math.log(16)
    rows = [(50, chance, chance), (100, chance, 0.6 * chance), (150, chance, 0.4 * chance), (200, chance, 0.1)]
    assert copy_probe.copies_from(rows, 16) == 150
    assert copy_probe.copies_from(rows[:2], 16) is None


def test_a_positional_transformer_learns_to_copy_and_an_untrained_one_does_not():
    # 8 symbols, 6 tokens then their repeat: a plain transformer with positions copies within
    # a few hundred steps; after one step it cannot (the measurement can fail)
    model = copy_probe.build_model("transformer", ["--model.n_layers", "2", "--model.dim", "64"], max_len=12, seed=0)
    rows = copy_probe.probe(model, steps=300, batch=32, half=6, symbols=8, lr=3e-3, seed=0, every=50,
                            log=lambda _: None)
    step = copy_probe.copies_from(rows, 8)
    assert step is not None and rows[-1][2] < 0.2 * math.log(8), rows
    assert all(first > 0.8 * math.log(8) for _, first, _ in rows), rows  # the first half stays random
    model = copy_probe.build_model("transformer", ["--model.n_layers", "2", "--model.dim", "64"], max_len=12, seed=0)
    rows = copy_probe.probe(model, steps=1, batch=32, half=6, symbols=8, lr=3e-3, seed=0, every=1, log=lambda _: None)
    assert copy_probe.copies_from(rows, 8) is None


def test_our_flavor_runs_under_the_probe_and_bad_overrides_are_one_line_errors(capsys):
    assert copy_probe.main(["--model", "debug", "--steps", "2", "--every", "1", "--half", "8", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "step     2" in out and "debug: does not copy in 2 steps" in out
    assert copy_probe.main(["--model", "debug", "--model.no_such_field", "1", "--steps", "1"]) == 2
    assert "unknown key 'model.no_such_field'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        copy_probe.main(["--model", "debug", "--training.steps", "1"])


def test_muon_option_puts_matrices_under_muon_and_trains_our_flavor(capsys):
    model = copy_probe.build_model("debug", [], max_len=16, seed=0)
    optimizer = copy_probe.make_optimizer(model, "muon", 3e-3)
    muon = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    adamw = [p for g in optimizer.param_groups if not g["muon"] for p in g["params"]]
    assert muon and adamw and len(muon) + len(adamw) == len(list(model.parameters()))
    assert all(p.ndim >= 2 for p in muon) and any(p is model.output.weight for p in adamw)  # head: AdamW
    before = [p.detach().clone() for p in muon]
    assert copy_probe.main(["--model", "debug", "--optimizer", "muon", "--steps", "2", "--every", "1", "--half", "8",
                            "--batch", "2"]) == 0
    assert "debug --optimizer muon: does not copy in 2 steps" in capsys.readouterr().out
    rows = copy_probe.probe(model, steps=1, batch=2, half=8, symbols=8, lr=3e-3, seed=0, every=1,
                            optimizer="muon", log=lambda _: None)
    assert math.isfinite(rows[0][2]) and any(not torch.equal(b, p) for b, p in zip(before, muon))
