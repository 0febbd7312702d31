"""`python -m titan_moe.report`: every plotted series is the run's metrics, read back from the
figures' line data."""

from __future__ import annotations

import json

import pytest

from tiny import call_main, run_train
from titan_moe.report import figures, main, read_metrics

pytest.importorskip("matplotlib")


def _lines(fig) -> dict[str, tuple[list[float], list[float]]]:
    """label -> (x, y) of every line of every axes (the expert-load figure: 'load:'/'dead:' prefixes)."""
    out = {}
    axes = fig.get_axes()
    for i, ax in enumerate(axes):
        prefix = "" if len(axes) == 1 else ("load:", "dead:")[i]
        for line in ax.get_lines():
            out[prefix + line.get_label()] = ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
    return out


def test_each_plot_holds_the_runs_metrics(tmp_path):
    run = tmp_path / "run"
    proc = run_train(run, "--training.steps", "4", "--validation.enable", "--validation.freq", "2",
                     "--validation.steps", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(train) == [1, 2, 3, 4] and {2, 4} <= set(evals)  # torchtitan also validates after step 1
    layers = sorted({k.split("/")[1] for k in train[1] if k.endswith("/max_violation")})
    assert layers == ["layers.1.feed_forward", "layers.2.feed_forward", "layers.3.feed_forward"]

    code, out, err = _main([str(run)])
    assert code == 0, err
    pngs = sorted((run / "report").glob("*.png"))
    assert [p.name for p in pngs] == ["expert_load.png", "loss.png", "qb_violation.png", "throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert out.split() == [str(run / "report" / p) for p in ("loss.png", "throughput.png", "expert_load.png",
                                                             "qb_violation.png")]

    steps = [1.0, 2.0, 3.0, 4.0]
    figs = figures(*read_metrics(str(run / "metrics.jsonl"))[:2])
    assert _lines(figs["loss"]) == {"train": (steps, [train[s]["loss"] for s in train]),
                                    "eval": ([float(s) for s in sorted(evals)], [evals[s] for s in sorted(evals)])}
    assert _lines(figs["throughput"]) == {"tokens_per_s": (steps, [train[s]["tokens_per_s"] for s in train])}
    expected = {}
    for layer in layers:
        expected["load:" + layer] = (steps, [1.0 + train[s][f"moe/{layer}/max_violation"] for s in train])
        expected["dead:" + layer] = (steps, [train[s][f"moe/{layer}/dead_experts"] for s in train])
    assert _lines(figs["expert_load"]) == expected
    assert _lines(figs["qb_violation"]) == {
        "max over layers": (steps, [train[s]["moe/max_violation_max"] for s in train]),
        "mean over layers": (steps, [train[s]["moe/max_violation_mean"] for s in train])}
    # the series are not all alike (a plot of the wrong key would be caught)
    assert len({tuple(v[1]) for v in expected.values()}) > 1


def _main(argv) -> tuple[int, str, str]:
    return call_main(main, argv)


def test_cut_lines_repeated_steps_and_a_run_without_moe(tmp_path):
    lines = [{"step": 0, "kernels": {}}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0},
             {"step": 2, "eval_loss": 4.5}, {"step": 2, "loss": 3.5}]  # step 2 logged again after a resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')
    code, _, err = _main([str(tmp_path), "--out", str(tmp_path / "plots")])
    assert code == 0 and "skipped 1 unreadable lines" in err
    assert sorted(p.name for p in (tmp_path / "plots").glob("*.png")) == ["loss.png"]  # no MoE, no tokens/s
    train, evals, skipped = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert _lines(figures(train, evals)["loss"]) == {"train": ([1.0, 2.0], [5.0, 3.5]), "eval": ([2.0], [4.5])}

    code, _, err = _main([str(tmp_path / "nowhere")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "metrics.jsonl not found" in err
