"""The trainer without the Hugging Face `datasets` package (titan_moe.runtime.optional_packages).

torchtitan 0.2.2 imports `datasets` at module level; the placeholder lets the built-in corpus
train without it, and a Hugging Face corpus then fails with a message naming the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import REPO, environment, losses, run_train, start_all, started_runs

from titan_moe.runtime.optional_packages import is_placeholder, provide_datasets_placeholder


def _hide_datasets(tmp_path: Path) -> dict:
    """Environment whose `import datasets` raises ImportError: a shadowing package first on the path."""
    shadow = tmp_path / "shadow" / "datasets"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('datasets hidden for this test')\n")
    path = os.pathsep.join(p for p in (str(shadow.parent), str(REPO), environment().get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def test_installed_datasets_is_left_alone():
    pytest.importorskip("datasets")
    import datasets

    assert provide_datasets_placeholder() is False
    assert sys.modules["datasets"] is datasets and not is_placeholder(datasets)


def _placeholder_run(tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "saved").mkdir(parents=True)
    script = f"""
import sys
import titan_moe.train_spec, titan_moe.validate  # these install the placeholder
import torchtitan.train  # which imports `datasets` at module level
import datasets, datasets.distributed
from titan_moe.runtime.optional_packages import is_placeholder
from titan_moe.data.corpus import hf_disk_source
assert is_placeholder(datasets), datasets
for call in (lambda: datasets.load_dataset("c4"), lambda: datasets.Dataset(),
             lambda: datasets.distributed.split_dataset_by_node(None, rank=0, world_size=1)):
    try:
        call()
    except ImportError as e:
        assert "pip install datasets" in str(e), e
    else:
        raise AssertionError("the placeholder did not raise")
try:
    hf_disk_source({str(tmp_path / "saved")!r})
except ValueError as e:
    assert "`datasets` package is not installed" in str(e), e
else:
    raise AssertionError("hf_disk_source did not refuse")
print("placeholder ok")
"""
    env = {**environment(), **_hide_datasets(tmp_path)}
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def start_runs(root: Path):
    """Queue this file's two processes, started together when a test first asks (tests/tiny.py):
    (root folder, name -> future of its CompletedProcess)."""
    return root, start_all({
        "placeholder": lambda: _placeholder_run(root / "placeholder"),
        "train": lambda: run_train(root / "train" / "run", "--training.steps", "2",
                                   env=_hide_datasets(root / "train")),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


def test_placeholder_imports_and_refuses_use(runs):
    """Without `datasets`: torchtitan's trainer and our train spec import; the placeholder
    raises on use; an hf_disk corpus says the package is missing."""
    proc = runs[1]["placeholder"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "placeholder ok" in proc.stdout


def test_trains_the_builtin_corpus_without_datasets(runs):
    root, futures = runs
    proc = futures["train"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the `datasets` package is not installed" in proc.stderr + proc.stdout
    assert sorted(losses(root / "train" / "run")) == [1, 2]
