"""profiling/bench_moe.py: runs end to end on CPU with tiny shapes (a plumbing check, no speed
claim), and its group sizes and FLOP counts are right.

The CPU runs of the scripts are processes started together when the first test asks
(tests/tiny.py: two at a time, each mostly one busy core)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import environment, start_all, started_runs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "profiling" / "bench_moe.py"


def _script(script: Path, *argv: str):
    """A run of `script` on the CPU at tiny shapes, on the shared threads."""
    return lambda: subprocess.run([sys.executable, str(script), "--device", "cpu", "--tiny", *argv], cwd=REPO,
                                  env=environment(), capture_output=True, text=True, timeout=300)


def start_runs(root):
    """Queue this file's script runs: name -> future of its CompletedProcess."""
    return start_all({
        "tiny": _script(SCRIPT),
        "step parts": _script(REPO / "profiling" / "bench_step_parts.py"),
        "dispatch": _script(SCRIPT, "--skip-gemm", "--skip-layer", "--dispatch"),
        "tile sweep": _script(SCRIPT, "--skip-layer", "--sweep-tiles", "--gemm-providers", "triton"),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return started_runs(start_runs, tmp_path_factory)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_reports_every_row_without_times(runs):
    proc = runs["tiny"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"date", "command", "device", "device_name", "torch", "triton", "dtype", "timed", "gemm",
            "moe_layer"} <= report.keys()
    assert report["device"] == "cpu" and report["timed"] is False and report["dtype"] == "fp32"
    assert report["timing"] == "do_bench_host_launch"  # --cuda-graph switches it to graph replays

    providers = ("triton", "native", "auto", "torch")
    timings = {f"{p}_{d}" for p in providers for d in ("fwd", "fwd_bwd")}
    assert [r["case"] for r in report["gemm"]] == ["tiny_balanced", "tiny_zipf1.1"]
    for row in report["gemm"]:
        assert {"E", "M", "K", "N", "dist", "group_min", "group_max", "flops_fwd", "flops_fwd_bwd", "ms",
                "tflops", "rel_err"} <= row.keys()
        assert row["flops_fwd"] == 2 * row["M"] * row["K"] * row["N"]
        assert row["flops_fwd_bwd"] == 3 * row["flops_fwd"]
        assert row["ms"].keys() == timings and row["tflops"].keys() == timings
        assert all(v is None for v in (*row["ms"].values(), *row["tflops"].values()))  # no speed claim
        # fp32 interpreter kernels vs torch._grouped_mm: a few fp32 ulps (K <= 32, <= 96 rows)
        assert set(row["rel_err"]) == {f"{name}_vs_torch_{p}" for name in ("triton", "auto") for p in ("out", "dx", "dw")}
        assert all(0 <= e < 1e-5 for e in row["rel_err"].values()), row["rel_err"]

    layer = report["moe_layer"]
    assert set(layer["providers"]) == {"ours_native", "ours_native_situ_triton", "ours_triton", "ours_auto",
                                       "ours_fp8_experts", "ours_fp8_cached", "ours_fp8_rows_situ", "torchtitan"}
    assert "fp8_weight_refresh_ms" in layer and layer["fp8_weight_refresh_ms"] is None  # measured, not timed
    for name, p in layer["providers"].items():
        assert p["flops_fwd"] > 0 and p["flops_fwd_bwd"] == 3 * p["flops_fwd"]
        assert p["ms_fwd"] is None and p["ms_fwd_bwd"] is None and p["tflops_fwd_bwd"] is None, name
    # fp32: the Triton and native backends (GEMM, SiTU-GLU) differ by fp32 rounding only; the
    # fp8 experts (emulated e4m3 operands) by a few percent: they did quantize, and stay close
    errors = layer["rel_err_ours_vs_native"]
    assert set(errors) == {"ours_native_situ_triton", "ours_triton", "ours_auto", "ours_fp8_experts", "ours_fp8_cached",
                           "ours_fp8_rows_situ"}
    for name in ("ours_native_situ_triton", "ours_triton", "ours_auto"):
        assert all(0 <= e < 1e-5 for e in errors[name].values()), errors
    for name in ("ours_fp8_experts", "ours_fp8_cached", "ours_fp8_rows_situ"):
        assert all(1e-3 < e < 0.1 for e in errors[name].values()), errors


def test_tiny_cpu_dispatch_run(runs):
    """--dispatch alone: every provider that runs on CPU fills its rows (no times), and ours agree
    with the plain gathers to fp32 rounding (sums of <= 8 products; dw: dot products over L <= 40)."""
    proc = runs["dispatch"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["gemm"] == [] and report["moe_layer"] is None
    directions = {"permute_fwd", "permute_fwd_bwd", "combine_fwd", "combine_fwd_bwd"}
    assert [r["case"] for r in report["dispatch"]] == ["tiny_k2", "tiny_k8"]
    for row in report["dispatch"]:
        assert set(row["ms"]) == {"ours_triton", "ours_torch", "gather"} and set(row["skipped"]) == {"gather_compiled"}
        assert all(set(ms) == directions and all(v is None for v in ms.values()) for ms in row["ms"].values())
        n, k, latent = row["N"], row["k"], row["L"]
        assert row["min_bytes"]["permute_fwd"] == (n + n * k) * latent * 4
        parts = {"permute", "dx", "combine", "dy", "dw"}
        assert set(row["rel_err"]) == {f"{p}_vs_gather_{q}" for p in ("ours_triton", "ours_torch") for q in parts}
        assert all(0 <= e < 1e-6 for e in row["rel_err"].values()), row["rel_err"]


@pytest.mark.parametrize("m,e", [(65536, 64), (16384, 112), (96, 4)])
def test_group_sizes(m, e):
    bench = _load_bench()
    for dist in ("balanced", "zipf"):
        sizes = bench.group_sizes(m, e, dist)
        assert len(sizes) == e and sum(sizes) == m and all(s >= 0 and s % 16 == 0 for s in sizes)
    balanced = bench.group_sizes(m, e, "balanced")
    assert max(balanced) - min(balanced) <= 16
    if m >= 16 * 1024:
        # Zipf(1.1): largest / smallest share is e^1.1 before rounding (rounding moves the
        # smallest group by < 16 rows)
        zipf = sorted(bench.group_sizes(m, e, "zipf"))
        assert zipf[-1] / (zipf[0] + 16) < e**1.1 < zipf[-1] / max(zipf[0], 1) * 1.5
    assert bench.K3_ROWS_PER_RANK == 16384


def test_flop_counts_match_parameter_shapes():
    """Forward matmul FLOPs = 2 x tokens x (matmul weights a token touches), counted here from
    the parameters of the real modules (routed experts at top_k / n of their size)."""
    from torchtitan.models.moe import MoE, MoEArgs

    from titan_moe.model.args import ModelArgs
    from titan_moe.model.moe import LatentMoE

    bench = _load_bench()
    tokens, dim, n, k, hidden, shared, latent = 10, 96, 8, 3, 40, 2, 48
    with torch.device("meta"):
        ours = LatentMoE(ModelArgs(dim=dim, n_routed_experts=n, top_k=k, n_shared_experts=shared,
                                   moe_latent_dim=latent, moe_expert_hidden=hidden, moe_shared_hidden=hidden))
        theirs = MoE(MoEArgs(num_experts=n, num_shared_experts=shared, top_k=k), dim=dim, hidden_dim=hidden)

    def touched(module) -> float:
        total = 0.0
        for name, p in module.named_parameters():
            if p.dim() < 2:  # norm weights: no matmul
                continue
            total += p.numel() * (k / n if name.startswith("experts.") else 1)
        return total

    assert bench.latent_moe_flops(tokens, dim, n, k, hidden, shared, latent) == 2 * tokens * touched(ours)
    assert bench.torchtitan_moe_flops(tokens, dim, n, k, hidden, shared) == 2 * tokens * touched(theirs)


def test_tile_sweep_runs_every_product_and_checks_each_configuration(monkeypatch, runs):
    """`--sweep-tiles` on the CPU (untimed): forward, dx and dw over the tiny candidates, each
    result against the op's native path; the CPU has no TMA rows. `--gemm-providers` keeps
    the named providers (and torch._grouped_mm, the errors' reference) only."""
    proc = runs["tile sweep"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = _load_bench()
    tiles = {"x".join(map(str, t)) for t in bench.TINY_SWEEP}
    for row in json.loads(proc.stdout.strip().splitlines()[-1])["gemm"]:
        assert set(row["ms"]) == {f"{p}_{d}" for p in ("triton", "torch") for d in ("fwd", "fwd_bwd")}
        sweep = row["tile_sweep"]
        assert set(sweep) == {"fwd", "dx", "dw"}
        for product, result in sweep.items():
            assert set(result["ms"]) == {"peer", *tiles} and all(v is None for v in result["ms"].values())
            assert 0 <= result["max_rel_err"] < 1e-5, (row["case"], product, result)
    # the GPU candidates are valid tiles, the generic defaults first, sm90's among them
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    for sweep, kind in ((bench.MK_SWEEP, "mk"), (bench.K_SWEEP, "k")):
        configs = [bench.sweep_config(t)[0] for t in sweep]
        assert configs[0] == tk.default_config(torch.bfloat16, torch.device("cuda"), kind)  # no GPU here
        # the sweep tiles store through pointers; sm90's default forward / dx tile adds TMA
        # stores (`t`), timed apart with --mk-tiles
        assert dataclasses.replace(tk.SM90_TILES[kind], store_tma=False) in configs
        assert len(set(configs)) == len(configs)
        for t in sweep:  # each key reads back through the tile override as its own configuration
            cfg, key = bench.sweep_config(t)
            monkeypatch.setenv(tk.TILES_ENV, f"{kind}={key}")
            assert tk.tile_overrides()[kind] == cfg


def test_best_tiles_sums_each_kind_over_cases_and_drops_failed_candidates(tmp_path):
    """`--best-tiles`: "mk" minimizes forward (TMA where swept) + dx over every case, "k" dw;
    a candidate that failed in one case is out even where it was fastest elsewhere."""
    def sweep(fwd, fwd_tma, dx, dw):
        return {"fwd": {"ms": fwd}, "fwd_tma": {"ms": fwd_tma}, "dx": {"ms": dx}, "dw": {"ms": dw}}

    rows = [
        {"case": "a", "tile_sweep": sweep({"peer": 1.0, "A": 0.1, "B": 9.0}, {"peer": 1.0, "A": 1.0, "B": 0.5},
                                          {"peer": 1.0, "A": 1.0, "B": 0.9}, {"peer": 2.0, "K1": 1.0, "K2": 0.1})},
        {"case": "b", "tile_sweep": sweep({"peer": 1.0, "A": 0.1, "B": 9.0}, {"peer": 1.0, "A": 1.0, "B": 0.5},
                                          {"peer": 1.0, "A": 1.0, "B": 0.9},
                                          {"peer": 2.0, "K1": 1.5, "K2": "failed: OutOfResources"})},
    ]
    report = {"timed": True, "gemm": [{"case": "no sweep"}, *rows]}
    bench = _load_bench()
    best = bench.best_tiles(report)
    assert best["env"] == "mk=B,k=K1"  # B wins on fwd_tma + dx (the plain forward is not counted)
    assert best["mk"]["ms"] == pytest.approx(2.8) and best["mk"]["peer_ms"] == pytest.approx(4.0)
    assert best["k"]["ms"] == pytest.approx(2.5) and best["k"]["peer_ms"] == pytest.approx(4.0)
    saved = tmp_path / "sweep.txt"
    saved.write_text("table lines\n" + json.dumps(report) + "\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--best-tiles", str(saved)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "mk=B,k=K1"
    with pytest.raises(ValueError, match="timed"):
        bench.best_tiles({**report, "timed": False})


def test_speedups_against_native_and_auto(capsys):
    """The goal ratios: each provider's forward+backward median against native's and auto's
    (only the bases the row has), printed per case."""
    bench = _load_bench()
    row = {"case": "k3", "ms": {"native_fwd": 1.0, "native_fwd_bwd": 6.0, "auto_fwd_bwd": 5.0,
                                "fp8_fwd_bwd": 4.0, "fp8_fwd": 0.5}}
    ratios = bench.speedups(row)
    assert ratios["fp8"] == pytest.approx({"native": 1.5, "auto": 1.25})
    assert ratios["native"]["native"] == 1.0 and set(ratios) == {"native", "auto", "fp8"}
    assert bench.speedups({"ms": {"fp8_fwd_bwd": 4.0, "native_fwd_bwd": 6.0}})["fp8"] == {"native": 1.5}
    bench.print_speedup_table([row])
    assert "fp8 1.500x/1.250x" in capsys.readouterr().out


def test_step_parts_tiny_cpu_run_compares_each_part_with_its_earlier_form(runs):
    """profiling/bench_step_parts.py on CPU, tiny shapes (plumbing, no times): every provider
    runs compiled, and each new form equals its earlier one (the SiTU forms and the cached fp8
    linears bit for bit, the AttnRes mix to fp32 rounding of a different summation order)."""
    proc = runs["step parts"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # (the weight refresh and dw rows join where the Triton kernels run: under the interpreter here)
    assert set(report["ms"]) >= {"situ_packed", "situ_halves", "situ_op", "attn_res_mixer", "attn_res_einsum",
                                 "linears_bf16", "linears_fp8_per_call", "linears_fp8_cached"}
    assert all(v is None for v in report["ms"].values())
    assert report["situ_max_abs_diff"] == 0.0 and report["attn_res_max_abs_diff"] < 1e-5
    assert report["linear_cache_same_output"] is True


def test_fp8_rows_situ_layer_copy_carries_its_recipe():
    """The ``ours_fp8_rows_situ`` provider's experts compute by its recipe (the Triton
    widening included); the other fp8 copies by the default recipe."""
    from titan_moe.float8.experts import Float8RoutedExperts
    from titan_moe.float8.experts_recipe import ExpertsFp8Recipe
    from titan_moe.model.moe import RoutedExperts

    bench = _load_bench()
    layer = bench.fp8_experts_copy(torch.nn.Sequential(RoutedExperts(2, 16, 32, 1.0, 1.0)),
                                   **bench.FP8_ROWS_SITU_RECIPE)
    assert isinstance(layer[0], Float8RoutedExperts)
    assert layer[0].recipe == ExpertsFp8Recipe(wgrad="fp8_rows", situ_quant=True, widen="triton")
    assert bench.fp8_experts_copy(torch.nn.Sequential(RoutedExperts(2, 16, 32, 1.0, 1.0)))[0].recipe == ExpertsFp8Recipe()


def test_rounds_flag_sets_the_interleaved_rounds_and_refuses_zero(monkeypatch):
    bench = _load_bench()
    assert bench.parse_args([]).rounds == bench.ROUNDS
    assert bench.parse_args(["--rounds", "21"]).rounds == 21
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    # measure_rounds takes the module's ROUNDS at call time (main sets it from --rounds)
    monkeypatch.setattr(bench, "ROUNDS", 3)
    calls = []
    monkeypatch.setattr(bench, "_bench_once", lambda fn, grad_to_none: calls.append(fn) or 1.0)
    medians, _ = bench.measure_rounds({"a": lambda: None, "b": lambda: None}, timed=True)
    assert medians == {"a": 1.0, "b": 1.0} and len(calls) == 6


def test_run_settings_split_choices_from_launch_variables(monkeypatch):
    """A provider's settings: `KernelChoices` fields through `choices.using`, the rest
    (launch tuning) as environment variables, both restored after the block."""
    from titan_moe.ops import choices

    bench = _load_bench()
    monkeypatch.delenv("TITAN_MOE_GROUPED_MM_TMA", raising=False)
    with bench.env_vars({"grouped_mm": "loop", "situ": "torch", "TITAN_MOE_GROUPED_MM_TMA": "0"}):
        assert choices.current().grouped_mm == "loop" and choices.current().situ == "torch"
        assert os.environ["TITAN_MOE_GROUPED_MM_TMA"] == "0"
    assert choices.current() == choices.KernelChoices() and "TITAN_MOE_GROUPED_MM_TMA" not in os.environ
