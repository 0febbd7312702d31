"""profiling/bench_kda.py runs end to end (CPU, tiny shapes: a plumbing check, no speed claim).

The CPU runs are processes started together when the first test asks (tests/tiny.py: two at
a time, each mostly one busy core)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import environment, start_all, started_runs

REPO = Path(__file__).resolve().parents[1]
GRAD_ERRORS = ["profiling/kda_grad_errors.py", "--device", "cpu", "--T", "70", "--H", "1", "--dk", "32",
               "--variants", "recompute:kernels.kda_keep=false,bad:kernels.kda=cutlass"]


def _script(*argv: str, timeout: int = 300):
    """A run of `python *argv`, on the shared threads."""
    return lambda: subprocess.run([sys.executable, *argv], cwd=REPO, env=environment(), capture_output=True,
                                  text=True, timeout=timeout)


def start_runs(root):
    """Queue this file's CPU runs: name -> future of its CompletedProcess."""
    bench = ["profiling/bench_kda.py", "--device", "cpu", "--tiny"]
    return start_all({
        "grad errors": _script(*GRAD_ERRORS),
        "grad errors gate-min": _script(*GRAD_ERRORS, "--gate-min"),
        "tiny": _script(*bench, "--reps", "2", "--scan-configs", "16x4"),
        "profile once": _script(*bench, "--profile-once"),
        "host profile": _script(*bench, "--shapes", "128", "--host-profile", "2"),
        "cuda graphs": _script(*bench, "--cuda-graphs", timeout=120),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


def test_bench_kda_tiny_cpu_reports_every_row(runs):
    proc = runs["tiny"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = report["rows"]
    shapes = {(1, 128, "fwd"), (1, 128, "fwd+bwd"), (2, 64, "fwd"), (2, 64, "fwd+bwd")}
    assert {(r["impl"], r["B"], r["T"], r["direction"]) for r in rows} == {
        (impl, *shape) for impl in ("ours", "ours_bv16w4") for shape in shapes}
    for r in rows:
        assert r["ms"] > 0 and r["tokens_per_s"] == r["B"] * r["T"] / (r["ms"] / 1e3)


def test_bench_kda_profile_once_runs_each_row_without_timing(runs):
    proc = runs["profile once"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    profiled = [line for line in proc.stdout.splitlines() if line.startswith("profiled one call:")]
    assert profiled == [f"profiled one call: ours {d} B={b} T={t}"
                        for b, t in ((1, 128), (2, 64)) for d in ("fwd", "fwd+bwd")]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows"] == []


def test_bench_kda_host_profile_reports_host_time_and_callers(runs):
    """`--host-profile N`: per row a host/wall line and the cProfile tables (own, then
    cumulative time) naming our functions; nothing timed."""
    proc = runs["host profile"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("host profile, ")]
    assert [line.split(":")[0] for line in lines] == [f"host profile, ours {d} B=1 T=128" for d in ("fwd", "fwd+bwd")]
    for line in lines:
        host, wall = (float(part.split(" ms")[0].rsplit(" ", 1)[1]) for part in line.split(",")[1:3])
        assert 0 < host <= wall
    assert proc.stdout.count("Ordered by: internal time") == 2 and proc.stdout.count("Ordered by: cumulative time") == 2
    assert "titan_moe/ops/kda/op.py" in proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["rows"] == []


def test_bench_kda_cuda_graphs_needs_cuda(runs):
    proc = runs["cuda graphs"].result()
    assert proc.returncode == 2 and "--cuda-graphs needs --device cuda" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_kda_cuda_graphs_capture_our_op():
    """Our op, forward and forward+backward, captures into a CUDA graph (no host sync in it):
    every plain row has its `+graph` row."""
    proc = subprocess.run([sys.executable, "profiling/bench_kda.py", "--tiny", "--no-fla", "--reps", "2",
                           "--cuda-graphs"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "capture failed" not in proc.stdout, proc.stdout[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    plain = {(r["B"], r["T"], r["direction"]) for r in rows if r["impl"] == "ours"}
    graphed = {(r["B"], r["T"], r["direction"]) for r in rows if r["impl"] == "ours+graph"}
    assert len(plain) == 4 and graphed == plain
    assert all(r["ms"] > 0 for r in rows)


def test_kda_grad_errors_cpu_reports_each_setting(runs):
    """profiling/kda_grad_errors.py on the CPU (the PyTorch path in bf16 against itself in
    fp32): a row per setting with every quantity near bf16's rounding of the outputs and
    gradients (~3e-3 seen), the gate-min inputs too; a setting that raises prints its error
    and a row of dashes instead of stopping the others."""
    for run in ("grad errors", "grad errors gate-min"):
        proc = runs[run].result()
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert any(line.startswith("bad: ValueError") for line in lines), lines
        table = lines[lines.index(next(line for line in lines if line.startswith("impl"))) + 1:]
        rows = {line.split()[0]: line.split()[1:] for line in table}
        assert list(rows) == ["ours", "recompute", "bad"] and rows["bad"] == ["-"] * 6
        for name in ("ours", "recompute"):
            errs = [float(x) for x in rows[name]]
            assert len(errs) == 6 and all(0 < e < 1e-2 for e in errs), (name, errs)
