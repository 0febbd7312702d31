"""Training under context parallelism (`parallelism.context_parallel_degree`) against one
process: the tiny debug model, the same rows, seed and global batch (4 rows of 256 tokens),
steps 1-3, on gloo CPU ranks.

Layouts: CP2, CP4, CP2 x FSDP2, CP2 x HSDP2 (replicated), CP2 x EP2 and CP2 x FSDP2 x
EP2, MLA's queries balanced ("headtail", the default) except under CP2 x EP2 (each rank
its own queries: `context_parallel_load_balancer = none`); a CP2 checkpoint resumed in one
process and a one-process checkpoint resumed under CP2 (CI runs CP2 and CP2 x FSDP2 x EP2,
the other layouts and the resumes are slow tests); the one-process run and the CI layouts
also validate at steps 1 and 2 (held-out loss and expert balance). The rows of those steps hold
documents crossing segment boundaries, documents longer than a segment and documents
starting inside a segment (checked below on the loader's own rows, so that the parity
runs cannot pass on rows without them).

Tolerance, as for the FSDP/EP layouts (tests/test_parallel.py): only the fp32 summation
order differs at step 1 (the loss summed over the ranks, the KDA state passed between
segments by the transition algebra instead of the whole row's chunks, MLA in latent
space); later steps add the gradients' reduction order and the clip. Measured: losses
within 2e-7 relative at steps 1-3. The gradient norm (of every parameter's gradient, the trainer's
check that they match) differs by up to 2e-5 relative already at step 1: the KDA decay
parameters' gradients (A_log, dt_bias) sum every token's contribution with cancellation,
and the cross-rank algebra reorders that sum (A_log's gradient: 1.2e-5 relative in fp32;
the whole decoder in float64, dense FFNs, the layers' own fp32 casts left in: 2e-7; the
KDA op alone in float64: 1e-10, tests/test_kda_context_parallel.py). configs/debug_cpu.toml
at seq 512 (batch 8): 4e-5 at CP4. 1e-4 leaves room.

Also one process as rank 0 of CP8 and of CP2 x FSDP2 x EP2 on torch's fake process group
(`--comm.mode fake_backend`): it trains to the end on its T / cp tokens (no numbers checked:
the fake group moves no data).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import CONFIG, REPO, TINY_CLI, environment, records, start_all, started_runs, train_command
from tiny import run_train as _run_train

STEPS = 3
SEQ = ["--training.seq_len", "256"]
STEP1_RTOL, LATER_RTOL = 1e-5, 1e-4
GRAD_NORM_RTOL = 1e-4


def cp(n: int) -> list[str]:
    return ["--parallelism.context_parallel_degree", str(n)]


EP2 = ["--parallelism.expert_parallel_degree", "2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2"]
VAL = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]  # at steps 1 and 2
LAYOUTS = {  # name: (arguments, processes)
    "CP2": ([*cp(2), *CKPT, *VAL], 2),
    "CP4": (cp(4), 4),
    "CP2xFSDP2": (cp(2), 4),
    "CP2xHSDP2": ([*cp(2), "--parallelism.data_parallel_replicate_degree", "2"], 4),
    "CP2xEP2": ([*cp(2), *EP2, "--parallelism.context_parallel_load_balancer", "none"], 2),
    "CP2xFSDP2xEP2": ([*cp(2), *EP2, *VAL], 4),
}


def run_train(dump: Path, *args: str, nproc: int = 1):
    proc = _run_train(dump, "--training.steps", str(STEPS), *SEQ, *args, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _assert_close(got: dict[int, dict], ref: dict[int, dict], steps, label: str) -> None:
    for step in steps:
        rtols = {"loss": STEP1_RTOL if step == 1 else LATER_RTOL, "grad_norm": GRAD_NORM_RTOL}
        for key, rtol in rtols.items():
            a, b = got[step][key], ref[step][key]
            assert abs(a - b) <= rtol * abs(b), (label, step, key, a, b)


CI_LAYOUTS = ("CP2", "CP2xFSDP2xEP2")  # the rest are slow tests


def _one(root: Path, name: str, *args: str, nproc: int = 1, seed: str | None = None) -> dict:
    """{run name: dump folder, "<run name> log": its log}."""
    dump = root / name
    if seed is not None:  # resume from another run's step-2 checkpoint
        shutil.copytree(seed / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    proc = run_train(dump, *args, nproc=nproc)
    return {name: dump, f"{name} log": proc.stdout + proc.stderr}


def start_runs(root: Path) -> dict:
    """Queue the runs of the CI tests (tests/tiny.py): name -> future of {run name: dump
    folder, "<run name> log": its log}; the fake-backend runs below ("fake <layout>") and the
    refused layout ("bad layout") too. The one-process run and CP2 also save step 2, which the
    slow resume tests resume."""
    chains = {"one process": lambda: _one(root, "one_process", *CKPT, *VAL)}
    for name in CI_LAYOUTS:
        args, nproc = LAYOUTS[name]
        chains[name] = lambda name=name, args=args, nproc=nproc: _one(root, name, *args, nproc=nproc)
    for name in FAKE_LAYOUTS:
        chains[f"fake {name}"] = lambda name=name: _fake_backend_run(root / f"fake_{name}", name)
    chains["bad layout"] = lambda: _run_train(root / "bad_layout", *cp(2), "--training.seq_len", "255")
    # validation's forwards right before the save that training.exit_at_step forces (step 2,
    # off the interval): FSDP2 over the cp ranks must have resharded the root by then
    chains["exit after validation"] = lambda: _run_train(
        root / "exit_after_validation", "--training.steps", str(STEPS), *SEQ, *cp(2), *VAL,
        "--training.exit_at_step", "2", "--checkpoint.enable", "--checkpoint.interval", "3", nproc=2)
    return start_all(chains)


def start_slow_runs(root: Path, ci_runs: dict) -> dict:
    """Queue the runs that only the slow tests read, as `start_runs`; the resumes wait on the
    CI runs whose checkpoints they read (queued before them)."""
    chains = {
        "resumed under CP2": lambda: _one(root, "resumed_under_cp2", *cp(2), *CKPT, nproc=2,
                                          seed=ci_runs["one process"].result()["one_process"]),
        "resumed in one process": lambda: _one(root, "resumed_in_one_process", *CKPT,
                                               seed=ci_runs["CP2"].result()["CP2"]),
    }
    for name, (args, nproc) in LAYOUTS.items():
        if name not in CI_LAYOUTS:
            chains[name] = lambda name=name, args=args, nproc=nproc: _one(root, name, *args, nproc=nproc)
    return start_all(chains)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return started_runs(start_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory) -> dict:
    return started_runs(start_slow_runs, tmp_path_factory, runs)


@pytest.fixture(scope="module")
def one_process(runs) -> Path:
    return runs["one process"].result()["one_process"]


def test_the_rows_cross_segments():
    """The rows of steps 1-3 (the loader's, as every layout reads them) hold documents
    that cross a segment boundary at cp 2 and 4, a document longer than a segment, and
    documents that start inside a segment (not at its first token)."""
    from titan_moe.config import load_config
    from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config

    config = load_config(["--job.config_file", CONFIG, *TINY_CLI, *SEQ])
    loader = dataloader_from_config(config, tokenizer=tokenizer_from_config(config), split="train", dp_rank=0,
                                    dp_world_size=1)
    batches = [batch for batch, _ in zip(loader, range(STEPS))]
    ids = torch.cat([input_dict["doc_ids"] for input_dict, _ in batches])
    T = ids.shape[1]
    for n in (2, 4):
        L = T // n
        crossing = (ids[:, L - 1 :: L][:, : n - 1] == ids[:, L::L]).any()
        starts = [(ids[b, 1:] != ids[b, :-1]).nonzero().flatten() + 1 for b in range(ids.shape[0])]
        inside = any(((s % L) != 0).any() for s in starts)
        lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in ids])
        assert crossing and inside and (lengths > L).any(), f"cp {n}: the rows lack a case"


@pytest.mark.parametrize("name", [name if name in CI_LAYOUTS else pytest.param(name, marks=pytest.mark.slow)
                                  for name in LAYOUTS])
def test_losses_match_one_process(name, runs, one_process, request):
    out = (runs if name in CI_LAYOUTS else request.getfixturevalue("slow_runs"))[name].result()
    log = out[f"{name} log"]
    assert f"Applied context parallelism over {name[2]} ranks" in log
    assert ("Applied expert parallelism over 2 ranks" in log) == ("EP2" in name)
    ref, got = records(one_process), records(out[name])
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    _assert_close(got, ref, range(1, STEPS + 1), name)
    # The balance statistics are counts summed over dp x cp: a sum over dp alone would
    # see half the tokens and set other biases from step 2 on.
    for step in ref:
        for key in ("moe/max_violation_max", "moe/max_violation_mean", "moe/dead_experts_total"):
            assert got[step][key] == pytest.approx(ref[step][key], abs=1e-9), (name, step, key)


def _eval_records(dump: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k.startswith("eval")})
    return {step: r for step, r in out.items() if r}


@pytest.mark.parametrize("name", CI_LAYOUTS)
def test_validation_matches_one_process(name, runs, one_process):
    """Validation under CP: each rank runs its segment of the held-out rows, the loss is
    normalised by the whole rows' tokens, so `eval_loss` and the held-out expert balance are
    one process's (up to the fp32 summation order, as the training loss at step 1)."""
    ref, got = _eval_records(one_process), _eval_records(runs[name].result()[name])
    assert sorted(ref) == sorted(got) == [1, 2], (sorted(ref), sorted(got))
    for step in ref:
        assert got[step]["eval_loss"] == pytest.approx(ref[step]["eval_loss"], rel=STEP1_RTOL), (name, step)
        for key in ("eval/moe/max_violation_max", "eval/moe/max_violation_mean", "eval/moe/dead_experts_total"):
            assert got[step][key] == pytest.approx(ref[step][key], abs=1e-9), (name, step, key)


@pytest.mark.slow
def test_cp2_checkpoint_resumes_in_one_process(slow_runs, one_process):
    got = records(slow_runs["resumed in one process"].result()["resumed_in_one_process"])
    assert sorted(got) == [3]
    _assert_close(got, records(one_process), [3], "CP2 checkpoint resumed in one process")


@pytest.mark.slow
def test_one_process_checkpoint_resumes_under_cp2(slow_runs, one_process):
    got = records(slow_runs["resumed under CP2"].result()["resumed_under_cp2"])
    assert sorted(got) == [3]
    _assert_close(got, records(one_process), [3], "one-process checkpoint resumed under CP2")


@pytest.mark.parametrize("args, needle", [
    ([*cp(2), "--training.seq_len", "255"], "training.seq_len = 255 is not divisible by"),
    ([*cp(4), "--training.seq_len", "128"], "shorter than a KDA chunk"),
    ([*cp(4), "--validation.enable", "--validation.seq_len", "128"], "validation.seq_len = 128 over"),
    ([*cp(2), "--parallelism.context_parallel_load_balancer", "ptrr"], "context_parallel_load_balancer = 'ptrr'"),
    ([*cp(2), "--training.seq_len", "130"], "not divisible by 2 x parallelism.context_parallel_degree"),
])
def test_bad_layouts_are_refused(args, needle):
    from titan_moe.config import ConfigError, load_config
    from titan_moe.context_parallel import check_context_parallel

    config = load_config(["--job.config_file", CONFIG, *TINY_CLI, *SEQ, *args])
    with pytest.raises(ConfigError, match=needle):
        check_context_parallel(config)


def test_a_save_right_after_validation_finds_the_parameters_resharded(runs):
    """Validation at step 2, then the save `training.exit_at_step` forces: it failed with a
    KeyError while validation's forwards left FSDP2's root unsharded."""
    proc = runs["exit after validation"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training.exit_at_step = 2: stopping after step 2" in proc.stdout + proc.stderr
    assert "validate step:  2" in proc.stdout + proc.stderr


def test_every_ladder_stage_length_is_checked():
    """The ladder's `training.seq_len` is its last stage's; a shorter stage must split too."""
    from titan_moe.config import ConfigError, load_config
    from titan_moe.context_parallel import check_context_parallel

    config = load_config(["--job.config_file", str(REPO / "configs" / "ladder_cpu.toml"), *cp(8)])
    assert config.training.seq_len // 8 >= 64  # the last stage alone would pass
    with pytest.raises(ConfigError, match="ladder.stages.1.seq_len = 256 over parallelism.context_parallel_degree = 8"):
        check_context_parallel(config)


def test_a_bad_layout_stops_the_trainer_with_one_line(runs):
    proc = runs["bad layout"].result()
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("titan_moe.train: error:")]
    assert len(lines) == 1 and "training.seq_len = 255" in lines[0] and "context_parallel_degree" in lines[0]
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------- fake backend
# One process plays rank 0 of a larger layout (`--comm.mode fake_backend`, NGPU ranks), with
# a forward pre-hook on every layer's mixer (as tests/test_context_parallel_model.py checks
# the ranks' token counts) recording what each call received.
_COUNT_MIXER_TOKENS = """
import json, sys
import titan_moe.train as train

seen = []
build = train.TitanTrainer.__init__

def init(self, job_config):
    build(self, job_config)
    for part in self.model_parts:
        for layer in part.layers.values():
            layer.attention.register_forward_pre_hook(
                lambda module, args: seen.append([type(module).__name__, args[0].shape[1]]))

train.TitanTrainer.__init__ = init
try:
    train.main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(seen, f)
"""

FAKE_LAYOUTS = {  # name: (arguments, NGPU, cp, ep)
    "CP8": (cp(8), 8, 8, 1),
    # EP8: at these seeds some MoE layer's local expert receives no rows while this rank
    # sends some (an empty input to the combine all-to-all, which the fake group refuses)
    "CP2xFSDP4xEP8": ([*cp(2), "--parallelism.expert_parallel_degree", "8"], 8, 2, 8),
}


FAKE_SEQ, FAKE_STEPS = 512, 2


def _fake_backend_run(dump: Path, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    """FAKE_STEPS steps as rank 0 of the layout on the fake backend: (the process, its dump
    folder), the mixer calls' token counts in the folder's mixer_tokens.json."""
    args, ngpu, _, _ = FAKE_LAYOUTS[name]
    dump.mkdir(parents=True)
    command = train_command(dump, "--training.seq_len", str(FAKE_SEQ), "--training.steps", str(FAKE_STEPS),
                            "--comm.mode", "fake_backend", *args)
    assert command[1:3] == ["-m", "titan_moe.train"]
    proc = subprocess.run([sys.executable, "-c", _COUNT_MIXER_TOKENS, str(dump / "mixer_tokens.json"), *command[3:]],
                          cwd=REPO, env={**environment(), "OMP_NUM_THREADS": "1", "NGPU": str(ngpu)},
                          capture_output=True, text=True, timeout=300)
    return proc, dump


@pytest.mark.parametrize("name", list(FAKE_LAYOUTS))
def test_fake_backend_rank_trains_on_its_segment(name, runs):
    """Two steps as rank 0 of the layout on torch's fake process group, in one process: it
    ends normally, says at start-up that its losses are meaningless, and every KDA and MLA
    call of both steps held T / cp tokens of each row. Under EP the token counts of the
    exchange are taken from this rank (the fake group's all-to-all is not read)."""
    _, ngpu, degree, ep = FAKE_LAYOUTS[name]
    proc, dump = runs[f"fake {name}"].result()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert f"comm.mode = 'fake_backend': this process plays rank 0 of {ngpu} ranks" in log
    assert f"Applied context parallelism over {degree} ranks" in log
    assert ("Applied expert parallelism over" in log) == (ep > 1)
    assert ep == 1 or f"Applied expert parallelism over {ep} ranks" in log
    assert sorted(records(dump)) == [1, 2]
    seen = json.loads((dump / "mixer_tokens.json").read_text())
    n_layers = 4  # configs/debug_cpu.toml: KDA, KDA, KDA, MLA
    assert sorted({kind for kind, _ in seen}) == ["ContextParallelKDA", "ContextParallelMLA"]
    assert len(seen) == FAKE_STEPS * n_layers and {tokens for _, tokens in seen} == {FAKE_SEQ // degree}, seen
