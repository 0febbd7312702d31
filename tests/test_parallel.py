"""Expert parallelism over DTensor, composed with FSDP2: the parallel style on its own, then
whole training runs in several layouts (CPU, gloo).

Layouts, all at the same global batch (4 rows) and the same initial weights (`debug.seed`):
1 process; 2 processes FSDP; 2 processes FSDP + EP2 (experts sharded over both ranks, their
FSDP over the remaining "efsdp" size 1); 4 processes FSDP x EP2 ("efsdp" 2 x "ep" 2). CI runs
the FSDP+EP2 layout against one process; the other layouts, the cross-layout resume and the
compiled run are slow tests.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gloo_ranks import spawn_gloo
from tiny import CONFIG, TINY_CLI, records, start_all, started_runs
from tiny import run_train as _run_train

TINY = TINY_CLI
EP2 = ["--parallelism.expert_parallel_degree", "2"]
STEPS = 3


def run_train(dump: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    proc = _run_train(dump, *args, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


# Same initial weights and global batch in every layout, so only the fp32 summation order
# differs: of the loss over ranks and of the grouped GEMM rows at step 1 (forward only),
# plus the order in which gradients are summed (reduce-scatter, all-to-all backward) and
# the grad-norm clip afterwards. Measured: <= 2e-7 relative at steps 1-3.
STEP1_RTOL, LATER_RTOL = 1e-5, 1e-4


def _assert_losses_close(got: dict[int, dict], ref: dict[int, dict], steps, label: str) -> None:
    for step in steps:
        rtol = STEP1_RTOL if step == 1 else LATER_RTOL
        a, b = got[step]["loss"], ref[step]["loss"]
        assert abs(a - b) <= rtol * abs(b), (label, step, a, b)


# =========================================================================== the style alone
# (E, latent, hidden, rows per expert on rank 0, on rank 1). In each case a rank receives rows
# from both ranks for several of its experts (so the regrouping by expert matters), one
# expert gets no row at all, and one rank sends nothing to one of the two ranks.
STYLE_CASES = [
    (4, 8, 8, [3, 2, 0, 1], [2, 4, 0, 0]),
    (6, 12, 4, [0, 0, 0, 7, 1, 2], [1, 0, 3, 2, 0, 5]),
    (8, 16, 8, [5, 1, 0, 2, 6, 3, 1, 4], [2, 7, 0, 3, 1, 1, 5, 0]),
]


def _style_worker(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from titan_moe.model.moe import RoutedExperts
    from titan_moe.parallelize import LatentExpertParallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    for n_experts, latent, hidden, *counts in STYLE_CASES:
        torch.manual_seed(0)  # the same full experts on every rank
        full = RoutedExperts(n_experts, latent, hidden, beta1=1.0, beta2=1.0)
        full.init_weights(0.5)
        sharded = parallelize_module(copy.deepcopy(full), mesh, LatentExpertParallel())
        n_local = n_experts // world
        assert isinstance(sharded.w_gate_up, DTensor)
        assert sharded.w_gate_up.to_local().shape[0] == n_local

        gen = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
        offs_E = torch.cumsum(torch.tensor(counts[rank]), 0).to(torch.int32)
        x_ML = torch.randn(int(offs_E[-1]), latent, generator=gen, requires_grad=True)
        grad_ML = torch.randn(x_ML.shape[0], latent, generator=gen)
        x_ref = x_ML.detach().clone().requires_grad_(True)

        out_ML = sharded(x_ML, offs_E)
        ref_ML = full(x_ref, offs_E)
        assert out_ML.shape == ref_ML.shape
        # Each output row is the same fp32 arithmetic on the same weights: only the GEMM
        # blocking over a different set of rows can change the rounding.
        torch.testing.assert_close(out_ML, ref_ML, rtol=1e-6, atol=1e-6)

        (out_ML * grad_ML).sum().backward()
        (ref_ML * grad_ML).sum().backward()
        torch.testing.assert_close(x_ML.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        # A local expert's gradient sums the rows of every rank; so does the all-reduced
        # reference (in another order: fp32 reassociation).
        for name in ("w_gate_up", "w_down"):
            ref_grad = getattr(full, name).grad.clone()
            dist.all_reduce(ref_grad)
            local = getattr(sharded, name).grad.to_local()
            torch.testing.assert_close(local, ref_grad[rank * n_local:(rank + 1) * n_local],
                                       rtol=1e-5, atol=1e-6)

    with pytest.raises(ValueError, match="not divisible"):
        parallelize_module(RoutedExperts(3, 8, 8, 1.0, 1.0), mesh, LatentExpertParallel())


@pytest.mark.slow
def test_expert_parallel_style_matches_unsharded_experts(tmp_path):
    spawn_gloo(_style_worker, 2, tmp_path)


def _failing_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    # Both ranks connected, then both fail with no collective after, so whichever the parent
    # reports names this check (a rank left waiting in gloo would fail there, with a gloo error).
    dist.barrier()
    raise AssertionError(f"rank {rank} fails its check")


def test_a_failing_rank_fails_the_spawning_test(tmp_path):
    """The harness above leaves early after its checks; a failed check must still surface (CI
    keeps this: its own tests spawn gloo ranks with the same harness)."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException, match="fails its check"):
        spawn_gloo(_failing_worker, 2, tmp_path)


def test_unsupported_layouts_are_refused():
    from torchtitan.distributed import ParallelDims

    from titan_moe.config import load_config
    from titan_moe.parallelize import _check_supported

    def dims(**degrees):
        base = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=4)
        return ParallelDims(**{**base, **degrees})

    config = load_config(["--job.config_file", CONFIG])
    _check_supported(dims(ep=2), config)  # EP is supported
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        _check_supported(dims(tp=2), config)
    op_sac = load_config(["--job.config_file", CONFIG, "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_ac_option", "op"])
    _check_supported(dims(), op_sac)
    with pytest.raises(ValueError, match="expert parallelism"):
        _check_supported(dims(ep=2), op_sac)


# =========================================================================== training runs
LAYOUTS = {  # name: (arguments, processes)
    "1 process": ([], 1),
    "2 FSDP": ([], 2),
    # Also saves step 2 for the resume test (and step 3, the last).
    "2 FSDP+EP2": ([*EP2, "--checkpoint.enable", "--checkpoint.interval", "2"], 2),
    "4 FSDP2xEP2": (EP2, 4),
}


def _one(root: Path, name: str, *args: str, nproc: int = 1) -> tuple[Path, str]:
    """A run of STEPS steps: (dump folder, log text)."""
    dump = root / name.replace(" ", "_").replace("+", "_")
    proc = run_train(dump, "--training.steps", str(STEPS), *args, nproc=nproc)
    return dump, proc.stdout + proc.stderr


def start_runs(root: Path) -> dict:
    """Queue the runs of the layout CI checks (tests/tiny.py): name -> future of (dump folder,
    log text)."""
    return start_all({name: lambda name=name: _one(root, name, *LAYOUTS[name][0], nproc=LAYOUTS[name][1])
                      for name in ("1 process", "2 FSDP+EP2")})


def start_slow_runs(root: Path, ci_runs: dict) -> dict:
    """Queue the runs that only the slow tests read, as `start_runs`; `ci_runs`: the futures
    of `start_runs` (queued before these, so a chain here may wait on one of them)."""

    def resume():
        # Written by 2 ranks with the experts sharded over EP: DCP reshards it for 1 process.
        resumed = root / "resumed"
        shutil.copytree(ci_runs["2 FSDP+EP2"].result()[0] / "checkpoint" / "step-2",
                        resumed / "checkpoint" / "step-2")
        return _one(root, "resumed", "--checkpoint.enable", "--checkpoint.interval", "2")

    chains = {name: lambda name=name: _one(root, name, *LAYOUTS[name][0], nproc=LAYOUTS[name][1])
              for name in ("2 FSDP", "4 FSDP2xEP2")}
    chains["resumed"] = resume
    # Regional compile with EP; the same step count as the reference (the LR schedule depends on it).
    chains["compiled"] = lambda: _one(root, "compiled", *EP2, "--compile.enable", "--compile.backend", "aot_eager",
                                      nproc=2)
    return start_all(chains)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return started_runs(start_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory) -> dict:
    return started_runs(start_slow_runs, tmp_path_factory, runs)


@pytest.mark.parametrize("name", [
    "2 FSDP+EP2",  # CI's check: FSDP and EP together
    pytest.param("2 FSDP", marks=pytest.mark.slow),
    pytest.param("4 FSDP2xEP2", marks=pytest.mark.slow),
])
def test_loss_and_expert_balance_match_one_process(name, runs, request):
    ref_dump, _ = runs["1 process"].result()
    dump, log = (runs if name == "2 FSDP+EP2" else request.getfixturevalue("slow_runs"))[name].result()
    assert ("Applied expert parallelism over 2 ranks" in log) == ("EP2" in name)
    if name == "4 FSDP2xEP2":
        assert "'efsdp'" in log  # the experts' FSDP dim has 2 ranks there
    ref, got = records(ref_dump), records(dump)
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert sorted(got) == sorted(ref), name
    _assert_losses_close(got, ref, range(1, STEPS + 1), name)
    # The balance statistics are integer counts summed over the "batch" mesh (every rank
    # holding its own tokens); a group missing ranks (e.g. only "ep" in the 4-process
    # layout) would see other loads and set other biases from step 2 on.
    for step in ref:
        for key in ("moe/max_violation_max", "moe/max_violation_mean", "moe/dead_experts_total"):
            assert got[step][key] == pytest.approx(ref[step][key], abs=1e-9), (name, step, key)


@pytest.mark.slow
def test_expert_parallel_checkpoint_resumes_in_one_process(runs, slow_runs):
    ep_dump = runs["2 FSDP+EP2"].result()[0]
    # Written by 2 ranks with the experts sharded over EP: DCP reshards it for 1 process.
    resumed, log = slow_runs["resumed"].result()
    assert "Loading the checkpoint from" in log and "step-2" in log
    got = records(resumed)
    assert sorted(got) == [3]
    _assert_losses_close(got, records(runs["1 process"].result()[0]), [3], "resumed vs 1 process")
    _assert_losses_close(got, records(ep_dump), [3], "resumed vs 2 FSDP+EP2")


@pytest.mark.slow
def test_compiled_expert_parallel_matches_eager(runs, slow_runs):
    """Regional compile with EP: MoE layers compiled piecewise around the experts' exchange
    (aot_eager: Dynamo + AOTAutograd, fullgraph, without Inductor's CPU compile time)."""
    dump, _ = slow_runs["compiled"].result()
    _assert_losses_close(records(dump), records(runs["1 process"].result()[0]), range(1, STEPS + 1), "compiled EP2")
