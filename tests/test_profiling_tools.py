"""profiling/nsys_launch.py (the command line, and a run through torchrun with a stand-in
nsys) and profiling/summarize_trace.py (synthetic traces and a real torch.profiler trace)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from titan_moe.flavors import FLAVORS
from titan_moe.model.decoder import Decoder
from titan_moe.ops import nvtx
from tiny import side_by_side

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "profiling" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch = _load("nsys_launch")
summary_tool = _load("summarize_trace")


# ---------------------------------------------------------------------------------------------- launcher


def test_build_command_runs_one_nsys_per_rank_with_a_capture_window():
    cmd = launch.build_command(
        "configs/small_1gpu.toml", output_dir="out/nsys", nproc_per_node=2, start_step=4, stop_step=6,
        train_args=["--training.steps", "6"], torchrun_args=["--nnodes=1"], python="py",
    )
    assert cmd == [
        "py", "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--no-python",
        "nsys", "profile", "-t", "cuda,nvtx,osrt", "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
        "--force-overwrite=true", "-o", os.path.join("out/nsys", "rank%q{RANK}"),
        "py", "-m", "titan_moe.train", "--job.config_file", "configs/small_1gpu.toml", "--profiling.nvtx",
        "--profiling.nvtx_start_step", "4", "--profiling.nvtx_stop_step", "6", "--training.steps", "6",
    ]
    assert launch.report_paths("out/nsys", 2) == [os.path.join("out/nsys", "rank0.nsys-rep"),
                                                  os.path.join("out/nsys", "rank1.nsys-rep")]


@pytest.mark.parametrize("kwargs", [dict(start_step=0), dict(start_step=5, stop_step=4), dict(nproc_per_node=0)])
def test_build_command_rejects_bad_windows(kwargs):
    with pytest.raises(ValueError):
        launch.build_command("c.toml", output_dir="o", **kwargs)


# Stands in for nsys: writes its own options, RANK and the command it would profile to the
# file named by -o (with %q{RANK} expanded as nsys does), then exits without running it.
_FAKE_NSYS = """#!{python}
import json, os, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1].replace("%q{{RANK}}", os.environ["RANK"])
profiled = args.index("-m") - 1
with open(out + ".json", "w") as f:
    json.dump({{"nsys": args[:profiled], "rank": os.environ["RANK"], "command": args[profiled:]}}, f)
"""


def test_launcher_runs_each_rank_under_its_own_nsys(tmp_path, capsys):
    fake = tmp_path / "nsys"
    fake.write_text(_FAKE_NSYS.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "reports"
    rc = launch.main(["--config", "configs/debug_cpu.toml", "--nproc-per-node", "2", "--output-dir", str(out),
                      "--start-step", "2", "--stop-step", "3", "--nsys", str(fake),
                      "--torchrun-args", "--master-addr=127.0.0.1 --master-port=0",
                      "--", "--training.steps", "3"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out / "rank0.nsys-rep") in printed and str(out / "rank1.nsys-rep") in printed
    for rank in ("0", "1"):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["rank"] == rank
        assert seen["nsys"][0] == "profile" and "--capture-range=cudaProfilerApi" in seen["nsys"]
        assert seen["command"][:3] == [sys.executable, "-m", "titan_moe.train"]
        assert seen["command"][-6:] == ["--profiling.nvtx_start_step", "2", "--profiling.nvtx_stop_step", "3",
                                        "--training.steps", "3"]


def test_launcher_dry_run_prints_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert launch.main(["--config", "c.toml", "--output-dir", str(out), "--dry-run", "--nsys", "no-such-nsys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "no-such-nsys profile" in lines[0] and "--profiling.nvtx" in lines[0]
    assert not out.exists()


# ---------------------------------------------------------------------------------------------- summary


def _x(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def _synthetic_trace():
    """Two profiler steps of 100 and 120 us; nested ranges; noise of other kinds."""
    events = [{"ph": "M", "name": "process_name", "pid": 7}, {"ph": "i", "name": "mark", "ts": 3}]
    durations = {}
    for step, (t0, length) in enumerate([(0.0, 100.0), (200.0, 120.0)]):
        fwd, layer, op, bwd = 0.4 * length, 0.25 * length, 0.1 * length, 0.5 * length
        events += [
            _x(f"ProfilerStep#{step}", t0, length),
            _x("forward", t0 + 1, fwd),
            _x("layer0.kda", t0 + 2, layer),
            _x("op.kda_chunk_fwd", t0 + 3, op),
            _x("backward", t0 + 1 + fwd, bwd),
            _x("op.kda_chunk_bwd", t0 + 2 + fwd, op, tid=2),  # another thread: not a child of backward
            _x("aten::mm", t0 + 3, 1.0, cat="cpu_op"),
        ]
        for name, d in [("forward", fwd), ("layer0.kda", layer), ("op.kda_chunk_fwd", op), ("backward", bwd),
                        ("op.kda_chunk_bwd", op), ("ProfilerStep", length)]:
            durations.setdefault(name, []).append(d)
    return events, durations


def test_summary_of_a_synthetic_trace():
    events, durations = _synthetic_trace()
    summary = summary_tool.summarize(events, top=0)
    step_us = sum(durations["ProfilerStep"])
    assert summary["step_source"] == "ProfilerStep" and summary["n_steps"] == 2
    assert summary["step_time_ms"] == pytest.approx(step_us / 1e3)
    rows = {r["name"]: r for r in summary["ranges"]}
    assert set(rows) == set(durations)  # cpu_op and non-'X' events left out
    children = {"ProfilerStep": ["forward", "backward"], "forward": ["layer0.kda"], "layer0.kda": ["op.kda_chunk_fwd"]}
    for name, ds in durations.items():
        total = sum(ds)
        nested = sum(sum(durations[c]) for c in children.get(name, []))
        assert rows[name]["count"] == len(ds)
        assert rows[name]["total_ms"] == pytest.approx(total / 1e3)
        assert rows[name]["self_ms"] == pytest.approx((total - nested) / 1e3)
        assert rows[name]["mean_ms"] == pytest.approx(total / len(ds) / 1e3)
        assert rows[name]["pct_of_step"] == pytest.approx(100 * total / step_us)
    totals = [r["total_ms"] for r in summary["ranges"]]
    assert totals == sorted(totals, reverse=True)
    top_two = summary_tool.summarize(events, top=2)["ranges"]
    assert [r["name"] for r in top_two] == [r["name"] for r in summary["ranges"][:2]]


def test_summary_step_time_fallbacks():
    events, durations = _synthetic_trace()
    without_markers = [e for e in events if not e["name"].startswith("ProfilerStep")]
    spans = [e for e in without_markers if e.get("ph") == "X"]
    span_us = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    summary = summary_tool.summarize(without_markers)
    assert summary["step_source"] == "trace span" and summary["step_time_ms"] == pytest.approx(span_us / 1e3)
    with_train_step = without_markers + [_x("train_step", 0, 90), _x("train_step", 200, 110)]
    summary = summary_tool.summarize(with_train_step)
    assert summary["step_source"] == "train_step" and summary["step_time_ms"] == pytest.approx(0.2)
    summary = summary_tool.summarize(events, step_name="forward")
    assert summary["step_time_ms"] == pytest.approx(sum(durations["forward"]) / 1e3)
    with pytest.raises(ValueError, match="no-such-range"):
        summary_tool.summarize(events, step_name="no-such-range")


def test_summary_of_a_real_torch_profiler_trace_of_the_decoder(tmp_path, capsys):
    args = dataclasses.replace(
        FLAVORS["debug"], dim=64, kda_n_heads=2, kda_head_dim=16, mla_n_heads=2, mla_q_lora_rank=32,
        mla_kv_lora_rank=16, mla_qk_nope_head_dim=16, mla_qk_shared_dim=8, mla_v_head_dim=16,
        moe_latent_dim=32, moe_expert_hidden=32, moe_shared_hidden=32, dense_hidden=96, vocab_size=512,
    )
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    trace = tmp_path / "rank0_trace.json"
    averages = {}

    def on_trace_ready(prof):  # as torchtitan's trace handler does
        prof.export_chrome_trace(str(trace))
        averages.update({e.key: e for e in prof.key_averages()})

    # one warm-up step (recorded, not traced), then two traced steps: torchtitan's schedule
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2)
    nvtx.enable(True)
    try:
        with torch.no_grad(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule, on_trace_ready=on_trace_ready
        ) as prof:
            with nvtx.record_ranges() as names:
                model(tokens)
            prof.step()
            for _ in range(2):
                model(tokens)
                prof.step()
    finally:
        nvtx.enable(False)
    per_forward = Counter(names)

    assert summary_tool.main([str(tmp_path), "--top", "0"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["files"] == [str(trace)] and summary["step_source"] == "ProfilerStep"
    assert summary["n_steps"] == 2
    rows = {r["name"]: r for r in summary["ranges"]}
    # every range the model enters is in the trace, twice as often as in one forward
    assert {name: rows[name]["count"] for name in per_forward} == {n: 2 * c for n, c in per_forward.items()}
    assert {"layer0.kda", "layer3.mla", "moe.router", "moe.dispatch", "op.grouped_mm", "head"} <= set(per_forward)
    # totals agree with torch.profiler's own aggregation of the same events
    for name in ("layer0.kda", "moe.experts", "head"):
        assert rows[name]["total_ms"] == pytest.approx(averages[name].cpu_time_total / 1e3, rel=1e-3)
    for r in summary["ranges"]:
        assert 0 <= r["self_ms"] <= r["total_ms"] + 1e-9
        assert r["total_ms"] <= summary["step_time_ms"] * (1 + 1e-6)


def test_summary_cli_reports_a_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "profiling" / "summarize_trace.py"), str(tmp_path / "nope.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "summarize_trace: error:" in proc.stderr


# ---------------------------------------------------------------------------------------------- memory snapshot


def _frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def test_memory_snapshot_groups_blocks_by_the_code_that_allocated_them(tmp_path, capsys):
    snapshot_tool = _load("memory_snapshot")
    gib = 1 << 30
    moe = _frames(("/x/torch/nn/modules/module.py", 1, "_call_impl"), ("/r/titan_moe/model/moe.py", 600, "forward"),
                  ("/r/titan_moe/model/decoder.py", 90, "forward"))
    inductor = _frames(("/tmp/torchinductor_u/ab/cabc.py", 77, "call"), ("/x/torch/_dynamo/eval_frame.py", 5, "f"))
    snapshot = {"segments": [
        {"total_size": 5 * gib, "blocks": [{"size": 2 * gib, "state": "active_allocated", "frames": moe},
                                           {"size": gib, "state": "active_allocated", "frames": moe},
                                           {"size": gib, "state": "inactive", "frames": moe},
                                           {"size": gib, "state": "active_allocated", "frames": inductor}]},
        {"total_size": gib, "blocks": [{"size": gib // 2, "state": "active_pending_free", "frames": []},
                                       {"size": gib // 2, "state": "inactive", "frames": []}]}]}
    path = tmp_path / "rank0_memory_snapshot.pickle"
    path.write_bytes(__import__("pickle").dumps(snapshot))
    summary = snapshot_tool.main([str(path)])
    assert summary["reserved_gib"] == 6 and summary["allocated_gib"] == 4.5
    assert summary["free_in_segments_gib"] == 1.5 and summary["segments"] == 2
    sites = {row["site"]: (row["gib"], row["blocks"]) for row in summary["sites"]}
    assert sites == {"model/moe.py:600 forward < model/decoder.py:90 forward": (3.0, 2),
                     "ab/cabc.py:77 call": (1.0, 1), "(no frames)": (0.5, 1)}
    assert list(sites)[0].startswith("model/moe.py") and summary["largest_blocks"][0]["gib"] == 2.0
    out = capsys.readouterr().out
    assert "reserved 6.00 GiB in 2 segments; in use 4.50; reserved but free 1.50" in out
    with pytest.raises(SystemExit, match="no file"):
        snapshot_tool.main([str(tmp_path / "missing.pickle")])


def test_memory_snapshot_finds_the_trace_peak_and_what_was_live_then():
    snapshot_tool = _load("memory_snapshot")
    gib = 1 << 30
    stream = _frames(("/r/titan_moe/model/decoder.py", 150, "forward"))
    moe = _frames(("/r/titan_moe/model/moe.py", 600, "forward"))
    head = _frames(("/r/titan_moe/model/head.py", 40, "loss"))
    # at the snapshot: the stream (allocated before the trace) and the head's logits
    snapshot = {"segments": [{"total_size": 8 * gib, "blocks": [
        {"address": 0, "size": gib, "state": "active_allocated", "frames": stream},
        {"address": 5 * gib, "size": gib, "state": "active_allocated", "frames": head}]}],
        "device_traces": [[
            {"action": "alloc", "addr": gib, "size": 2 * gib, "frames": moe},      # the MoE's workspace
            {"action": "alloc", "addr": 3 * gib, "size": 2 * gib, "frames": moe},
            {"action": "free_requested", "addr": gib, "size": 2 * gib, "frames": []},
            {"action": "free_completed", "addr": gib, "size": 2 * gib, "frames": []},
            {"action": "free_completed", "addr": 3 * gib, "size": 2 * gib, "frames": []},
            {"action": "alloc", "addr": 5 * gib, "size": gib, "frames": head},
            {"action": "free_completed", "addr": 7 * gib, "size": gib // 2, "frames": []},  # allocated before
        ]]}
    peak = snapshot_tool.trace_peak(snapshot)
    # before event 3 (the first free completed): the stream, both MoE blocks and the half GiB
    # allocated before the trace
    assert peak["peak_allocated_gib"] == 5.5 and peak["event_index"] == 3 and peak["events"] == 7
    assert {row["site"]: (row["gib"], row["blocks"]) for row in peak["sites"]} == {
        "model/moe.py:600 forward": (4.0, 2), "model/decoder.py:150 forward": (1.0, 1),
        "(allocated before the trace)": (0.5, 1)}
    assert snapshot_tool.trace_peak({"segments": []}) is None


# ---------------------------------------------------------------------------------------------- memory check


def test_memory_check_runs_the_trainer_and_the_planner(tmp_path, capsys):
    """Two AC modes of the tiny model (CPU: 'memory' is the process's peak RSS, so only the
    plumbing is checked here, not the planner's accuracy): one row per mode with a measured
    and a planned number, a failed run reported as such, JSON last."""
    import tiny

    memory_check = _load("memory_check")
    cut = tiny.TINY_CLI.index("--training.seq_len")  # the script sets the length itself
    extra = tiny.TINY_CLI[:cut] + tiny.TINY_CLI[cut + 2:]
    # the failing run beside the script's two (each process mostly one busy core)
    _, bad = side_by_side(
        lambda: memory_check.main(["--job.config_file", tiny.CONFIG, "--seq-lens", "64", "--ac", "none,full",
                                   "--steps", "2", "--out", str(tmp_path), "--", *extra]),
        lambda: memory_check.measure(tiny.CONFIG, 64, "nonsense", 1, tmp_path / "bad", extra))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = summary["rows"]
    assert [(r["seq_len"], r["ac"], r["ok"]) for r in rows] == [(64, "none", True), (64, "full", True)]
    for r in rows:
        assert r["max_active_gib"] > 0 and r["planned_gib"] > 0 and r["tokens_per_s"] > 0
    assert rows[0]["planned_gib"] > rows[1]["planned_gib"]  # AC lowers the plan
    assert not bad["ok"] and "activation_checkpoint.mode" in bad["error"]


@pytest.mark.slow  # the planner's CP8 row: tests/test_plan.py plans that layout in CI
def test_memory_check_plans_the_layout_of_the_rank_it_plays():
    """`--fake-gpus 8` with context parallelism 8, without running the trainer (the slow test
    below runs it; tests/test_context_parallel_train.py runs the trainer as rank 0 of CP8 on
    the fake backend): the trainer's command plays rank 0 on the fake backend, and the plan
    compared is the planner's row for that layout (dp_shard 1, cp 8, ep 1 on 8 GPUs), below
    its one-GPU plan (T / 8 a rank)."""
    import tiny

    memory_check = _load("memory_check")
    cut = tiny.TINY_CLI.index("--training.seq_len")
    extra = [*tiny.TINY_CLI[:cut], *tiny.TINY_CLI[cut + 2:], "--parallelism.context_parallel_degree", "8"]
    assert memory_check.trainer_layout(tiny.CONFIG, extra, 8) == {"dp_replicate": 1, "dp_shard": 1, "cp": 8, "ep": 1}
    command = memory_check._trainer_cmd(tiny.CONFIG, 512, "none", 2, Path("out"), extra, fake_gpus=8)
    assert command[command.index("--comm.mode") + 1] == "fake_backend"
    assert memory_check.planned(tiny.CONFIG, 512, extra, gpus=8)["none"] < \
        memory_check.planned(tiny.CONFIG, 512, extra[:-2], gpus=1)["none"]


@pytest.mark.slow  # CI: the test above and the fake-backend CP8 run of test_context_parallel_train.py
def test_memory_check_plays_one_rank_of_a_cp8_layout(tmp_path, capsys):
    """`--fake-gpus 8` with context parallelism 8: the trainer runs as rank 0 of 8 on the fake
    backend and the plan compared is the planner's rank 0 of that layout (dp_shard 1, cp 8,
    ep 1 on 8 GPUs), not its one-GPU plan; the worst rank's plan (the planner's row) beside it."""
    import tiny

    memory_check = _load("memory_check")
    cut = tiny.TINY_CLI.index("--training.seq_len")
    extra = [*tiny.TINY_CLI[:cut], *tiny.TINY_CLI[cut + 2:], "--parallelism.context_parallel_degree", "8"]
    memory_check.main(["--job.config_file", tiny.CONFIG, "--seq-lens", "512", "--ac", "none", "--steps", "2",
                       "--fake-gpus", "8", "--out", str(tmp_path), "--", *extra])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["fake_backend"] and summary["gpus"] == 8
    assert summary["layout"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 8, "ep": 1}
    (row,) = summary["rows"]
    assert row["ok"] and row["max_allocated_gib"] > 0, row
    plan = memory_check.planned(tiny.CONFIG, 512, extra, gpus=8, rank0=True)
    assert (row["planned_gib"], row["planned_worst_rank_gib"]) == (plan["none"], plan["worst_none"])
    assert plan["none"] < plan["worst_none"]  # rank 0 never runs KDA's basis call
    assert plan["worst_none"] == memory_check.planned(tiny.CONFIG, 512, extra, gpus=8)["none"]
    assert row["planned_gib"] < memory_check.planned(tiny.CONFIG, 512, extra[:-2], gpus=1)["none"]  # T / 8 a rank
    log = (tmp_path / "512_none" / "metrics.jsonl").read_text()
    assert '"loss"' in log


def test_fp8_host_cost_runs_both_paths_on_the_cpu():
    """profiling/fp8_host_cost.py (a subprocess: it stubs module internals) times the ops path
    and the eager path for two fp8 weight-gradient modes (and fp8_rows with its two
    requantizations launched one at a time) and the bf16 grouped GEMM op."""
    proc = subprocess.run([sys.executable, "profiling/fp8_host_cost.py", "--calls", "3", "--rounds", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.endswith(" us")]
    assert [row[:2] for row in rows] == [["ops", "fp8_rows"], ["eager", "fp8_rows"], ["ops", "fp8"], ["eager", "fp8"],
                                         ["eager", "fp8_rows/single_requants"], ["ops", "bf16"], ["eager", "bf16"]]
    assert all(float(row[2]) > 0 for row in rows)


def test_optimizer_step_times_both_optimizers_built_as_the_trainer_builds_them(capsys):
    bench = _load("optimizer_step")
    bench.main(["--job.config_file", str(REPO / "configs" / "debug_cpu.toml"), "--steps", "1", "--warmup", "0"])
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:5]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| AdamW") or line.startswith("| Muon")}
    assert set(rows) == {"AdamW", "Muon"} and all(ms > 0 for r in rows.values() for ms in r[:2])
    # Muon keeps one momentum buffer per matrix where AdamW keeps two moments
    assert 0 < rows["Muon"][2] < rows["AdamW"][2]
    with pytest.raises(SystemExit):
        bench.main(["--job.config_file", str(REPO / "configs" / "debug_cpu.toml"), "--optimizers", "SGD"])


def _gpu_suite(tmp_path, *sections, gpus: str | None = None, dry: bool = True, **env_extra: str):
    env = {**os.environ, "SUITE_DRY_RUN": "1" if dry else "0", **env_extra}
    if gpus is not None:
        env["SUITE_GPUS"] = gpus
    return subprocess.run(["bash", "profiling/gpu_suite.sh", str(tmp_path / "out"), *sections],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_suite_plans_every_section_for_two_gpus(tmp_path):
    proc = _gpu_suite(tmp_path, gpus="2")
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    names = [line.split(":", 1)[0] for line in lines]
    assert names == ["tests_kernels", "tests_compile", "kda", "moe", "train_eager", "train_compiled", "fp8", "train_ep"]
    commands = dict(line.split(": ", 1) for line in lines)
    compile_files = ["tests/test_compile_inductor.py", "tests/test_export.py"]
    assert commands["tests_kernels"].endswith(" tests " + " ".join(f"--ignore={f}" for f in compile_files))
    assert commands["tests_compile"].endswith(" ".join(compile_files)) and "-m gpu" in commands["tests_compile"]
    assert "--nproc_per_node=2" in commands["train_ep"] and "--parallelism.expert_parallel_degree 2" in commands["train_ep"]
    assert "--compile.enable" in commands["train_compiled"] and "--compile.enable" not in commands["train_eager"]
    for command in commands.values():  # every config file it names exists
        for path in (word for word in command.split() if word.endswith(".toml")):
            assert (REPO / path).is_file(), path


def test_gpu_suite_plans_the_ladder_balance_and_long_step_sections(tmp_path):
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # `python` with torch
    proc = _gpu_suite(tmp_path, "ladder", "ablate_balance", "long_step", "long_memory", "ladder_compare",
                      "ablate_recipe", "step_profile", gpus="1", PATH=path,
                      SUITE_LADDER_ARGS="--ladder.stages.1.steps 9")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["ladder", "ablate_balance", "long_step", "long_memory", "long_memory_summary",
                              "long_memory_plan", "long_memory_nokeep", "long_memory_table", "ladder_compare",
                              "ablate_recipe", "step_profile", "step_profile_gpu"]
    assert "--profiling.profile_freq 12" in commands["step_profile"]
    assert "summarize_trace.py --gpu" in commands["step_profile_gpu"]
    assert commands["step_profile_gpu"].endswith("step_profile/profile_traces")
    ablate = commands["ablate_recipe"]
    assert "--arms recipe,qb,sign,aux_loss,attn_res_full,attn_res_none,swiglu,unbounded_gate,muon," in ablate
    assert "--seeds 0,1 --jobs 4" in ablate and "--model.flavor ladder_1gpu" in ablate  # no GPU here: four at once
    assert "--jobs 2" in commands["ladder_compare"] and commands["ladder_compare"].endswith("--ladder.stages.1.steps 9")
    torch_source = os.path.dirname(torch.__file__)
    assert f"--ladder.eval_packages_path {torch_source}" in commands["ladder"]
    assert commands["ladder"].endswith("--ladder.stages.1.steps 9")
    assert "--arms qb,sign,qb_batch" in commands["ablate_balance"] and "--jobs 1" in commands["ablate_balance"]
    assert "--seq-len 131072" in commands["long_step"] and "--model.moe_token_tile 65536" in commands["long_step"]
    assert "--model.head_chunk_tokens 16384" in commands["long_step"]
    assert "--profiling.enable_memory_snapshot" in commands["long_memory"]
    assert "iteration_2/rank0_memory_snapshot.pickle" in commands["long_memory_summary"]
    assert "--kernels.kda_keep False" in commands["long_memory_nokeep"]
    for command in commands.values():
        for path in (word for word in command.split() if word.endswith((".toml", ".py"))):
            assert (REPO / path).is_file(), path


def test_gpu_suite_deadline_skips_commands_that_would_overrun_it(tmp_path):
    """With SUITE_DEADLINE reached, every command of a section is skipped (rc 124, nothing
    started, no output file) instead of starting a run the outer time limit would cut."""
    proc = _gpu_suite(tmp_path, "fp8_all_b8", gpus="1", dry=False, SUITE_DEADLINE="5",
                      TRITON_CACHE_DIR=str(tmp_path / "no_cache"), SUITE_AUTOTUNE_IN="")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["fp8_all_b8_bf16", "fp8_all_b8_fp8", "fp8_all_b8_table"]
    assert all("rc=124 seconds=0 skipped" in line for line in lines), lines
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt"]


def test_gpu_suite_copies_the_autotuning_results_out(tmp_path):
    """After its sections the suite packs Triton's autotuning results (and nothing else of
    its cache) into OUT/triton_autotune.tar.gz, each under its cache folder, for a later
    machine (one file: few files come back from a run); with none there, no archive."""
    import tarfile

    cache = tmp_path / "cache"
    (cache / "k1").mkdir(parents=True)
    (cache / "k1" / "_kernel.autotune.json").write_text('{"configs_timings": []}')
    (cache / "k1" / "_kernel.cubin").write_bytes(b"\0")
    (cache / "k2").mkdir()
    (cache / "k2" / "_other.json").write_text("{}")
    (cache / "k3").mkdir()
    (cache / "k3" / "_third.autotune.json").write_text("[]")
    proc = _gpu_suite(tmp_path, "kda_fla_all", gpus="1", TRITON_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["summary.txt", "triton_autotune.tar.gz"]
    restored = tmp_path / "restored"
    with tarfile.open(out / "triton_autotune.tar.gz") as archive:
        archive.extractall(restored, filter="data")
    files = sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file())
    assert files == ["k1/_kernel.autotune.json", "k3/_third.autotune.json"]
    assert (restored / "k1" / "_kernel.autotune.json").read_text() == '{"configs_timings": []}'
    for name in ("k1/_kernel.autotune.json", "k3/_third.autotune.json"):
        (cache / name).unlink()
    proc = _gpu_suite(tmp_path / "again", "kda_fla_all", gpus="1", TRITON_CACHE_DIR=str(cache))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "again" / "out").iterdir()) == ["summary.txt"]


def test_gpu_suite_puts_the_stored_autotuning_results_in_the_cache(tmp_path):
    """Before its sections the suite unpacks $SUITE_AUTOTUNE_IN (an earlier run's archive;
    none by default) into Triton's cache, keeping files already there; not in a dry run."""
    import tarfile

    stored = tmp_path / "stored"
    (stored / "k1").mkdir(parents=True)
    (stored / "k1" / "_fla.autotune.json").write_text('{"key": [1]}')
    (stored / "k2").mkdir()
    (stored / "k2" / "_kept.autotune.json").write_text('{"key": "stored"}')
    archive = tmp_path / "in.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(stored, arcname=".")
    cache = tmp_path / "cache"
    (cache / "k2").mkdir(parents=True)
    (cache / "k2" / "_kept.autotune.json").write_text('{"key": "newer"}')
    proc = _gpu_suite(tmp_path, "fp8_all_b8", gpus="1", dry=False, SUITE_DEADLINE="5", TRITON_CACHE_DIR=str(cache),
                      SUITE_AUTOTUNE_IN=str(archive))
    assert proc.returncode == 0, proc.stderr
    assert (cache / "k1" / "_fla.autotune.json").read_text() == '{"key": [1]}'
    assert (cache / "k2" / "_kept.autotune.json").read_text() == '{"key": "newer"}'
    dry = tmp_path / "dry_cache"
    proc = _gpu_suite(tmp_path / "dry", "kda_fla_all", gpus="1", TRITON_CACHE_DIR=str(dry))
    assert proc.returncode == 0, proc.stderr
    assert not dry.exists()


def test_gpu_suite_parts_section(tmp_path):
    """parts: the step-parts benchmark."""
    proc = _gpu_suite(tmp_path, "parts", gpus="1")
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    commands = dict(line.split(": ", 1) for line in lines)
    assert list(commands) == ["parts"]
    assert "profiling/bench_step_parts.py" in commands["parts"]


def test_gpu_suite_fp8_all_b8_section(tmp_path):
    """fp8_all_b8: bf16 and the all-options fp8 recipe (every choice a config key, the Triton
    widening included) on wide_1gpu at local batch 8, then their table."""
    proc = _gpu_suite(tmp_path, "fp8_all_b8", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["fp8_all_b8_bf16", "fp8_all_b8_fp8", "fp8_all_b8_table"]
    assert commands["fp8_all_b8_table"].endswith(
        "step_table.py OUT/fp8_all_b8_bf16 OUT/fp8_all_b8_fp8 --mean-after 4".replace("OUT", str(tmp_path / "out")))
    widen, cache = "--quantize.grouped_mm.float8.widen triton", "--quantize.linear.float8.cache_weights"
    rows, situ = "--quantize.grouped_mm.float8.wgrad fp8_rows", "--quantize.grouped_mm.float8.situ_quant"
    assert all(part in commands["fp8_all_b8_fp8"] for part in (widen, cache, rows, situ, "recipe_name tensorwise"))
    for name in ("fp8_all_b8_bf16", "fp8_all_b8_fp8"):
        assert "--training.steps 24" in commands[name] and "configs/wide_1gpu.toml" in commands[name]
        assert "--training.local_batch_size 8" in commands[name] and "TITAN_MOE" not in commands[name]
    assert "titan_float8" not in commands["fp8_all_b8_bf16"]


def test_gpu_suite_fp8_all_small_then_wide(tmp_path):
    """fp8_all_small: the bf16 / fp8_all pair on small_1gpu compiled; a wide pair after it is
    back on wide_1gpu."""
    proc = _gpu_suite(tmp_path, "fp8_all_small", "fp8_all_b8", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands)[:3] == ["fp8_all_small_bf16", "fp8_all_small_fp8", "fp8_all_small_table"]
    for name in ("fp8_all_small_bf16", "fp8_all_small_fp8"):
        assert "configs/small_1gpu.toml --compile.enable --training.steps 40" in commands[name]
    assert "--quantize.grouped_mm.float8.situ_quant" in commands["fp8_all_small_fp8"]
    assert "--quantize.grouped_mm.float8.situ_quant" not in commands["fp8_all_small_bf16"]
    assert "configs/wide_1gpu.toml" in commands["fp8_all_b8_bf16"]


def test_gpu_suite_fp8_all_loss_runs_both_300_step_runs(tmp_path):
    proc = _gpu_suite(tmp_path, "fp8_all_loss", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert commands.pop("fp8_all_loss_table").endswith("--steps 100,200,300")
    assert sorted(commands) == ["fp8_all_loss_bf16", "fp8_all_loss_fp8"]
    assert all("configs/small_1gpu.toml" in c and "--compile.enable" in c and "--training.steps" not in c
               for c in commands.values())
    assert "titan_float8" not in commands["fp8_all_loss_bf16"]
    assert "--quantize.grouped_mm.float8.situ_quant" in commands["fp8_all_loss_fp8"]
    assert "--quantize.linear.float8.cache_weights" in commands["fp8_all_loss_fp8"]


def test_gpu_suite_keep_section_runs_the_eager_trainer_with_and_without_the_switch(tmp_path):
    proc = _gpu_suite(tmp_path, "keep", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["keep_on", "keep_off"]
    assert "--kernels.kda_keep False" in commands["keep_off"] and "kda_keep" not in commands["keep_on"]
    assert all("--compile.enable" not in c and "small_1gpu.toml" in c for c in commands.values())


def test_gpu_suite_mla_sections_time_every_attention_path(tmp_path):
    proc = _gpu_suite(tmp_path, "mla_attention", "mla_step", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["mla_attention", "mla_attention_rows", "mla_step_dense", "mla_step_varlen",
                              "mla_step_table"]
    assert "bench_attention.py" in commands["mla_attention"] and "varlen" in commands["mla_attention"]
    assert "--fresh-rows" in commands["mla_attention_rows"]
    for path in ("dense", "varlen"):
        command = commands[f"mla_step_{path}"]
        assert f"--model.mla_attention {path}" in command and "--compile.enable" in command and "32768" in command
    assert commands["mla_step_table"].count("mla_step_") == 2


def test_gpu_suite_refuses_no_gpu_and_unknown_sections(tmp_path):
    one_gpu = _gpu_suite(tmp_path, gpus="1")
    assert one_gpu.returncode == 0
    assert "train_ep" not in (tmp_path / "out" / "summary.txt").read_text()
    assert _gpu_suite(tmp_path, "warp_drive", gpus="1").returncode == 2
    no_gpu = _gpu_suite(tmp_path, gpus="0", dry=False)
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr


# ---------------------------------------------------------------------------------------
# profiling/aoti_isolate.py
# ---------------------------------------------------------------------------------------
def _aoti_isolate(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "profiling/aoti_isolate.py", *argv], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)


def test_aoti_isolate_rejects_unknown_cases():
    proc = _aoti_isolate("--device", "cpu", "--cases", "linear,mla_sparse")
    assert proc.returncode == 2 and "unknown cases ['mla_sparse']" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TITAN_MOE_TEST_AOTI") != "1",
                    reason="AOTInductor's C++ build costs ~20 s per case on 2 cores; set TITAN_MOE_TEST_AOTI=1 to run")
def test_aoti_isolate_runs_a_model_case_on_cpu():
    proc = _aoti_isolate("--device", "cpu", "--cases", "mla_dense")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert row["case"] == "mla_dense" and row["ok"] and row["rel_err"] < 1e-5


def _kernel_resources(tmp_path, *argv: str, interpret: bool = False, **env_extra: str) -> subprocess.CompletedProcess:
    """profiling/kernel_resources.py run in `tmp_path`, compiling for real unless `interpret`;
    `env_extra`: variables set for it alone (runs side by side cannot share os.environ)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(env_extra)
    return subprocess.run([sys.executable, str(REPO / "profiling" / "kernel_resources.py"), *argv],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_every_kda_launch_compiles_for_the_h200(tmp_path):
    """The KDA launchers (both directions, bf16 at dk = dv = 128; the input maps) and
    SiTU-GLU's, recorded on
    CPU tensors and compiled for sm_90 without a GPU: every kernel builds, fits the H200's
    shared memory per block, and reports its registers and stack from the cubin; the state
    walk keeps the launcher's 4 warps and 3 stages. Catches a launch configuration that
    would fail to compile on the GPU before it gets there."""
    pytest.importorskip("triton")
    out = tmp_path / "rows.json"
    proc = _kernel_resources(tmp_path, "--cases", "kda_fwd,kda_bwd,kda_prepare,situ", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    kernels = {r["kernel"] for r in rows}
    assert kernels >= {"_chunk_cumsum_kernel", "_intra_columns_kernel", "_wy_kernel", "_state_scan_kernel",
                       "_output_kernel", "_bwd_walk_prep_kernel", "_bwd_state_scan_kernel", "_bwd_chunk_keys_kernel", "_bwd_chunk_values_kernel",
                       "_bwd_intra_kernel", "_bwd_reverse_cumsum_kernel", "_prepare_fwd_kernel",
                       "_prepare_bwd_kernel", "_situ_fwd_kernel", "_situ_bwd_kernel"}
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] >= 0, r
        assert 0 <= r["shared_bytes"] <= 227 * 1024, r
        assert r["blocks_per_sm"] >= 1, r  # every launch fits an SM
    walk = next(r for r in rows if r["kernel"] == "_state_scan_kernel" and r["case"] == "kda_fwd")
    assert (walk["num_warps"], walk["num_stages"]) == (4, 3)  # 16 columns at B*H = 16: 3 stages
    # the walks' per-chunk loads are pipelined or prefetched by hand: no chunk waits on one
    walks = [r for r in rows if r["kernel"].endswith("state_scan_kernel")]
    assert len(walks) == 2 and all(r["loop_loads_waited"] == 0 for r in walks), walks
    assert "_bwd_chunk_keys_kernel" in proc.stdout


def test_bwd_intra_key_split_compiles_for_the_h200(tmp_path):
    """The backward intra kernel at 32 key columns per program (`TITAN_MOE_KDA_BWD_INTRA_BK`,
    the tuning sweep's main case) builds for sm_90 with fewer registers than at 128; the
    default (64 columns, capped at 96 registers, `bwd_intra_register_cap`) fits five
    4-warp blocks per SM."""
    pytest.importorskip("triton")
    widths = ("128", "32", "64")
    procs = side_by_side(*(
        lambda bk=bk: _kernel_resources(tmp_path, "--cases", "kda_bwd", "--kernels", "_bwd_intra_kernel",
                                        "--json", str(tmp_path / f"rows{bk}.json"), TITAN_MOE_KDA_BWD_INTRA_BK=bk)
        for bk in widths))
    rows = {}
    for bk, proc in zip(widths, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        (rows[bk],) = json.loads((tmp_path / f"rows{bk}.json").read_text())
    assert rows["32"]["registers"] < rows["128"]["registers"] and rows["32"]["stack_bytes"] == 0, rows
    assert rows["64"]["registers"] <= 96 and rows["64"]["blocks_per_sm"] == 5, rows["64"]


def test_kernel_resources_sass_shows_whether_the_code_changed(tmp_path):
    """`--sass DIR`: the same launch compiled twice writes the same instruction text (no
    addresses or encodings), and different code (32 key columns per program instead of 64)
    a different one."""
    pytest.importorskip("triton")
    argv = ("--cases", "kda_bwd", "--kernels", "_bwd_intra_kernel")
    runs = (("first", "64"), ("again", "64"), ("bk32", "32"))
    procs = side_by_side(*(
        lambda name=name, bk=bk: _kernel_resources(tmp_path, *argv, "--sass", str(tmp_path / name),
                                                   TITAN_MOE_KDA_BWD_INTRA_BK=bk)
        for name, bk in runs))
    texts = {}
    for (name, _), proc in zip(runs, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts[name] = (tmp_path / name / "kda_bwd._bwd_intra_kernel.sass").read_text()
    assert texts["first"] == texts["again"] and texts["first"] != texts["bk32"]
    lines = texts["first"].splitlines()
    assert len(lines) > 100 and not any("/*" in line for line in lines)
    assert any(line.startswith(("HMMA", "LDG", "EXIT")) for line in lines)


def test_blocks_per_sm_follows_the_sm90_limits():
    """Occupancy from registers, shared memory and warps (sm_90: 64K registers allocated per
    warp in units of 256, 228 KiB shared plus 1 KiB reserved per block, 64 warps, 32 blocks)."""
    blocks_per_sm = _load("kernel_resources").blocks_per_sm
    assert blocks_per_sm(128, 8, 0) == 2  # 128 x 256 threads = 32K registers per block
    assert blocks_per_sm(129, 8, 0) == 1  # rounds up to 136: 34,816 registers, one block
    assert blocks_per_sm(212, 8, 96 * 1024) == 1
    assert blocks_per_sm(64, 4, 106 * 1024) == 2  # shared memory decides: 228 // (106 + 1)
    assert blocks_per_sm(32, 1, 0) == 32  # the block limit
    assert blocks_per_sm(16, 4, 0) == 16  # the warp limit: 64 // 4
    assert blocks_per_sm(64, 4, 228 * 1024) == 0  # more shared memory than a block may have
    assert blocks_per_sm(-1, 4, 0) == 0  # registers unknown


def test_kernel_resources_refuses_the_interpreter_and_unknown_cases(tmp_path):
    proc = _kernel_resources(tmp_path, "--cases", "kda_fwd", interpret=True)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
    proc = _kernel_resources(tmp_path, "--cases", "mla_fwd")
    assert proc.returncode == 2 and "unknown cases" in proc.stderr


def test_gpu_suite_kda_sections_time_ours_and_fla(tmp_path):
    """kda: our op, and with the recomputing backward (a kernel choice); kda_fla_all: fla in
    the same run at bench_kda's four shapes."""
    proc = _gpu_suite(tmp_path, "kda", "kda_fla_all", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["kda", "kda_fla_all"]
    variants = _load("bench_kda").parse_variants(commands["kda"].split("--variants ", 1)[1])
    assert variants == {"recompute": {"kernels.kda_keep": "false"}}
    assert "--no-fla" not in commands["kda_fla_all"]
    assert commands["kda_fla_all"].endswith("--shapes 8192,32768,131072,4096")  # bench_kda's four shapes


def test_gpu_suite_kda_verify_section_runs_the_kda_gpu_tests(tmp_path):
    proc = _gpu_suite(tmp_path, "kda_verify", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["kda_verify_tests", "kda_verify_kernels", "kda_long"]
    assert commands["kda_long"].endswith("-m gpu -q -s -rsx -p no:cacheprovider tests/test_kda_long_context.py")
    files = [word for word in commands["kda_verify_tests"].split() if word.startswith("tests/")]
    assert files and all((REPO / f).is_file() for f in files) and "-m gpu" in commands["kda_verify_tests"]
    assert "-m gpu" not in commands["kda_verify_kernels"] and "gate_min or partials" in commands["kda_verify_kernels"]


def test_gpu_suite_kda_ncu_section_profiles_one_call_and_tabulates_it(tmp_path):
    proc = _gpu_suite(tmp_path, "kda_ncu", gpus="1")
    assert proc.returncode == 0, proc.stderr
    commands = dict(line.split(": ", 1) for line in (tmp_path / "out" / "summary.txt").read_text().splitlines())
    assert list(commands) == ["kda_ncu", "kda_ncu_table"]
    assert "--profile-from-start off" in commands["kda_ncu"] and "--clock-control none" in commands["kda_ncu"]
    assert "profiling/bench_kda.py --no-fla --profile-once --shapes 32768" in commands["kda_ncu"]
    assert commands["kda_ncu_table"].startswith("python profiling/ncu_table.py")


_NCU_DETAILS = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","_walk_kernel(float *, int)","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","msecond","1.25"
"0","1","python","h","_walk_kernel(float *, int)","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","12.5"
"0","1","python","h","_walk_kernel(float *, int)","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","168"
"0","1","python","h","_walk_kernel(float *, int)","1","7","(128, 1, 1)","(8, 16, 1)","0","9.0","Occupancy","Achieved Occupancy","%","6.20"
"1","1","python","h","_tiles_kernel","1","7","(256, 1, 1)","(2048, 16, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","usecond","1,234.5"
"1","1","python","h","_tiles_kernel","1","7","(256, 1, 1)","(2048, 16, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","40.0"
"1","1","python","h","_tiles_kernel","1","7","(256, 1, 1)","(2048, 16, 1)","0","9.0","Warp State Statistics","Warp Cycles Per Issued Instruction","cycle","22.75"
'''
_NCU_RAW = '''"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","dram__bytes.sum.per_second","gpu__time_duration.sum","derived__local_spilling_requests"
"","","Mbyte","Kbyte","ratio","ratio","ratio","ratio","Tbyte/s","ms",""
"0","_walk_kernel","250","500","1.5","9.25","0.5","0.25","4.0","1.0","0"
"1","_tiles_kernel","1,000","0","4.0","2.0","3.0","1.0","4.0","1.0","17,825,792"
"2","_rate_only_kernel","","","0","0","0","0","2.5","0.5",""
'''


def test_ncu_table_reads_details_and_raw_pages(tmp_path):
    sys.path.insert(0, str(REPO / "profiling"))
    import ncu_table

    (tmp_path / "d.csv").write_text(_NCU_DETAILS)
    (tmp_path / "r.csv").write_text(_NCU_RAW)
    launches = ncu_table.read_details(str(tmp_path / "d.csv"))
    assert [launch["kernel"] for launch in launches] == ["_walk_kernel(float *, int)", "_tiles_kernel"]
    walk, tiles = launches
    assert walk["duration"] == 1250.0 and tiles["duration"] == 1234.5  # microseconds, both units
    assert walk["dram_pct"] == 12.5 and walk["regs"] == 168 and walk["occ_achieved_pct"] == 6.2
    assert tiles["sm_pct"] == 40.0 and tiles["cycles_per_issue"] == 22.75 and "dram_pct" not in tiles
    raw = ncu_table.read_raw(str(tmp_path / "r.csv"))
    assert raw["0"]["dram_bytes"] == 250e6 + 500e3 and raw["1"]["dram_bytes"] == 1e9  # counts win over the rate
    assert raw["2"]["dram_bytes"] == pytest.approx(2.5e12 * 0.5e-3)  # no counts: rate x duration
    assert raw["1"]["stalls"] == {"barrier": 4.0, "long_scoreboard": 2.0, "wait": 3.0, "math_pipe_throttle": 1.0}
    assert raw["1"]["spill_requests"] == 17825792 and "spill_requests" not in raw["2"]
    table = ncu_table.format_table(launches, raw).splitlines()
    assert table[1].split()[:4] == ["_walk_kernel", "1250.0", "12.5", "0.251"]
    assert "17825792" in table[2].split() and table[1].split()[9] == "0"
    assert table[1].endswith("long_scoreboard 9.2 barrier 1.5 wait 0.5")
    assert table[2].endswith("barrier 4.0 wait 3.0 long_scoreboard 2.0")
    assert table[-1].split() == ["total", "2484.5"]
    (tmp_path / "bad.csv").write_text(_NCU_DETAILS.replace('"msecond"', '"fortnight"'))
    with pytest.raises(ValueError, match="unknown time unit"):
        ncu_table.read_details(str(tmp_path / "bad.csv"))


_TTGIR = '''module {
  tt.func public @k(%p: !tt.ptr<f32>) {
    %before = tt.load %p0 : tensor<128x!tt.ptr<f32>, #blocked>
    %r:3 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z, %next = %first) -> (tensor<128xf32>, tensor<128xf32>) : i64 {
      %copied = ttg.async_copy_global_to_local %p1, %buf mask %m {contiguity = 8 : i32} : tensor<64x!tt.ptr<bf16>> -> <64xbf16>
      %ahead = tt.load %p2, %m, %cst : tensor<128x!tt.ptr<f32>, #blocked>
      %now = tt.load %p3 : tensor<128x!tt.ptr<f32>, #blocked>
      %sum = arith.addf %acc, %now : tensor<128xf32>
      %inner = scf.if %c -> (tensor<128xf32>) {
        %cond = tt.load %p4 : tensor<128x!tt.ptr<f32>, #blocked>
        scf.yield %cond : tensor<128xf32>
      } else {
        scf.yield %z : tensor<128xf32>
      } loc(#loc1)
      scf.yield %sum, %ahead : tensor<128xf32>, tensor<128xf32>
    } loc(#loc2)
    tt.return
  } loc(#loc3)
} loc(#loc4)
'''


def test_kernel_resources_counts_loads_a_loop_waits_for():
    """A load handed to the next iteration through scf.yield (a prefetch) and loads outside
    loops do not count; a load the iteration consumes does, also inside an scf.if."""
    loads_waited_in_loops = _load("kernel_resources").loads_waited_in_loops
    assert loads_waited_in_loops(_TTGIR) == 2
    assert loads_waited_in_loops(_TTGIR.replace("scf.yield %sum, %ahead", "scf.yield %sum, %now")) == 2
    assert loads_waited_in_loops(_TTGIR.replace("      %now = tt.load %p3", "      %now = arith.constant")) == 1
    assert loads_waited_in_loops("%x = tt.load %p : tensor<4x!tt.ptr<f32>>\n") == 0


def _kda_host_cost(*argv: str, **env: str) -> list[dict]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TITAN_MOE_KDA")}
    environ.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(REPO / "profiling" / "kda_host_cost.py"), *argv], cwd=REPO,
                          env={**environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kda_host_cost_counts_the_launches_of_each_direction():
    """The host-cost tool runs the real launchers with the launches stubbed: the forward's
    kernels once each, the backward's on top."""
    fwd, both = _kda_host_cost("--shape", "1,128,2,16", "--reps", "2")
    assert (fwd["direction"], both["direction"]) == ("fwd", "fwd+bwd")
    assert set(fwd["launches"]) < set(both["launches"])
    assert set(fwd["launches"].values()) == set(both["launches"].values()) == {1.0}  # each kernel once
    assert {"_wy_kernel", "_state_scan_kernel", "_bwd_chunk_keys_kernel", "_bwd_chunk_values_kernel"} <= set(both["launches"])
    assert "_bwd_dAkk_kernel" not in both["launches"]  # dA_kk formed in the values kernel
    assert both["triton_launches"] == len(both["launches"]) and both["aten_ops"] > fwd["aten_ops"] > 0
    for row in (fwd, both):  # the top-level ops by name: a subset of all, allocations among them
        top = row["top_level_aten_ops"]
        assert 0 < sum(top.values()) <= row["aten_ops"] and "aten::empty" in top
    assert both["host_ms"] > fwd["host_ms"] > 0


def test_kda_host_cost_rejects_a_bad_shape():
    proc = subprocess.run([sys.executable, str(REPO / "profiling" / "kda_host_cost.py"), "--shape", "1,2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "B,T,H,dk" in proc.stderr


def _metrics(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_step_table_ratios_losses_memory_and_a_missing_run(tmp_path, capsys):
    """profiling/step_table.py: tokens/s at the last two common steps, each run's ratio to the
    baseline at the same step, the last loss and validation loss, the peak memory; a run that
    left no metrics is listed as missing."""
    step_table = _load("step_table")
    bf16 = _metrics(tmp_path / "bf16", [
        {"step": 4, "loss": 9.0, "tokens_per_s": 1000.0, "max_reserved_gib": 60.0},
        {"step": 8, "loss": 8.0, "tokens_per_s": 2000.0, "max_reserved_gib": 66.0},
        {"step": 12, "loss": 7.5, "tokens_per_s": 2500.0, "max_reserved_gib": 65.0},
        {"step": 12, "eval_loss": 7.75}])
    fp8 = _metrics(tmp_path / "fp8", [
        {"step": 4, "loss": 9.1, "tokens_per_s": 1100.0, "max_reserved_gib": 70.0},
        {"step": 8, "loss": 8.1, "tokens_per_s": 2400.0, "max_reserved_gib": 71.0},
        {"step": 12, "loss": 7.6, "tokens_per_s": 3000.0, "max_reserved_gib": 71.5}])
    summary = step_table.main([str(bf16), str(fp8), str(tmp_path / "crashed")])
    assert summary["steps"] == [8, 12] and summary["baseline"] == "bf16"
    assert summary["runs"]["fp8"]["ratio"] == {8: pytest.approx(1.2), 12: pytest.approx(1.2)}
    assert summary["runs"]["bf16"]["validation_loss"] == 7.75 and summary["runs"]["fp8"]["validation_loss"] is None
    assert summary["runs"]["fp8"]["loss"] == 7.6 and summary["runs"]["fp8"]["peak_reserved_gib"] == 71.5
    assert summary["runs"]["crashed"] is None
    out = capsys.readouterr().out
    assert "| fp8 | 2,400 | 3,000 | 1.200x | 1.200x | 7.60000 | - | 71.50 |" in out
    assert "| crashed | missing" in out
    assert step_table.main([str(bf16), str(fp8), "--baseline", "fp8", "--steps", "4"])["runs"]["bf16"]["ratio"] == {
        4: pytest.approx(1000 / 1100)}
    with pytest.raises(SystemExit):
        step_table.main([str(tmp_path / "crashed"), str(bf16)])  # the baseline has no metrics


def test_step_table_mean_after_a_warmup_step(tmp_path, capsys):
    """--mean-after N: the harmonic mean of the rates logged after step N (tokens over time for
    windows of equal steps) and its ratio to the baseline's; a run that logged nothing after N
    shows no mean instead of failing."""
    step_table = _load("step_table")
    bf16 = _metrics(tmp_path / "bf16", [{"step": s, "loss": 1.0, "tokens_per_s": t}
                                        for s, t in ((4, 100.0), (8, 1000.0), (12, 3000.0))])
    fp8 = _metrics(tmp_path / "fp8", [{"step": s, "loss": 1.0, "tokens_per_s": t}
                                      for s, t in ((4, 100.0), (8, 1200.0), (12, 3600.0))])
    short = _metrics(tmp_path / "short", [{"step": 4, "loss": 1.0, "tokens_per_s": 100.0}])
    summary = step_table.main([str(bf16), str(fp8), str(short), "--mean-after", "4", "--steps", "4"])
    assert summary["runs"]["bf16"]["mean_tokens_per_s"] == pytest.approx(1500.0)  # 2 / (1/1000 + 1/3000)
    assert summary["runs"]["fp8"]["mean_ratio"] == pytest.approx(1.2)
    assert summary["runs"]["short"]["mean_tokens_per_s"] is None and summary["runs"]["short"]["mean_ratio"] is None
    out = capsys.readouterr().out
    assert "mean tokens/s after step 4" in out and "| 1,800 (steps 8-12) | 1.200x |" in out


# ---------------------------------------------------------------------------------------------- host cost
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_host_cost_tool_refuses_bad_arguments_and_a_machine_without_cuda():
    def run(*args):
        return subprocess.run([sys.executable, str(REPO / "profiling" / "host_cost_gemm.py"), *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    bad = run("many")
    assert bad.returncode != 0 and "usage" in bad.stderr
    no_gpu = run("10")
    assert no_gpu.returncode != 0 and "needs a CUDA GPU" in no_gpu.stderr


def test_gpu_summary_counts_overlapping_kernels_once_and_groups_by_category():
    def ev(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000, "pid": 1, "tid": 1},
        ev("cudnn_fmha_fwd", 100, 200),        # attention
        ev("nvjet_tst_128x256", 250, 100),     # gemm, overlaps the attention kernel by 50 us
        ev("triton_poi_fused_add_0", 500, 50),  # inductor elementwise
        ev("Memcpy HtoD", 600, 10, cat="gpu_memcpy"),
        ev("triton_poi_fused_add_7", 700, 30),  # the same fusion in another layer graph
        ev("triton_per_fused_sum_2", 800, 5),
    ]
    s = summary_tool.gpu_summary(events)
    assert s["step_ms"] == pytest.approx(1.0)
    assert s["busy_ms"] == pytest.approx(0.345)  # 100..350 once, 500..550, 600..610, 700..730, 800..805
    assert s["idle_pct"] == pytest.approx(65.5)
    cats = {r["name"]: r["ms"] for r in s["categories"]}
    assert cats == pytest.approx({"attention": 0.2, "gemm": 0.1, "triton": 0.085, "gpu_memcpy": 0.01})
    families = [(r["name"], r["count"], r["ms"]) for r in s["inductor_families"]]
    assert families == [("triton_poi_fused_add", 2, pytest.approx(0.08)),
                        ("triton_per_fused_sum", 1, pytest.approx(0.005))]
    assert "triton_poi_fused_add" in summary_tool.format_gpu_table(s).split("Inductor kernels by fusion")[1]
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summary_tool.gpu_summary(events[:1])
