"""The ablation harness (scripts/ablate.py): two arms of the tiny model, a table and a plot."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiny import CONFIG, REPO, TINY_CLI


@pytest.mark.slow
def test_two_arms_give_a_table_and_a_loss_plot(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "ablate.py"), "--out", str(tmp_path), "--arms", "qb,sign",
           "--job.config_file", CONFIG, *TINY_CLI, "--training.steps", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [line for line in (tmp_path / "ablation.md").read_text().splitlines() if line.startswith("| qb")
            or line.startswith("| sign")]
    assert len(rows) == 2 and "nan" not in rows[0].split("|")[5]  # held-out loss of the last step
    assert (tmp_path / "loss.png").stat().st_size > 1000
    # an arm already run is not run again
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "titan_moe.train" not in again.stdout
