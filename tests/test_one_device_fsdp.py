"""`training.one_device_mixed_precision = "fsdp"`: FSDP2 on a one-rank mesh, for the numerics
of a run on several GPUs (bf16 parameters in compute, bf16 stream, fp32 master weights and
gradients), in place of autocast over fp32 parameters.

The dtypes are checked on `parallelize_decoder` directly (the CPU trainer computes in fp32);
the trainer is checked in fp32, where the two modes must train alike, and across them by
resuming each mode's checkpoint in the other.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gloo_ranks import spawn_gloo
from tiny import CONFIG, TINY_CLI, records, run_train, start_all, started_runs

FSDP = ["--training.one_device_mixed_precision", "fsdp"]
STEPS = 3
CHECKPOINT = ["--checkpoint.enable", "--checkpoint.interval", "2"]


# =========================================================================== parallelize alone
def _dtypes_worker(rank: int, world: int, mode: str, compiled: bool) -> None:
    """Build the tiny model as the trainer does (meta, parallelize, materialise), run a forward
    and backward, and check the dtypes `mode` should give."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed import ParallelDims

    from titan_moe.runtime.device import configure_torchtitan_device

    configure_torchtitan_device()  # torchtitan's meshes on the CPU, as the trainer makes them
    from titan_moe.config import load_config, model_args_from_config
    from titan_moe.model.decoder import Decoder
    from titan_moe.model.moe import LatentMoE
    from titan_moe.parallelize import fsdp_on_one_device, parallelize_decoder

    extra = ["--activation_checkpoint.mode", "full", "--compile.enable", "--compile.backend", "aot_eager",
             "--model.qb_bins", "64"] if compiled else []  # exact QB does not compile with AC
    config = load_config(["--job.config_file", CONFIG, *TINY_CLI, "--training.mixed_precision_param", "bfloat16",
                          "--training.one_device_mixed_precision", mode, *extra])
    assert fsdp_on_one_device(config, 1) == (mode == "fsdp") and not fsdp_on_one_device(config, 2)
    args = model_args_from_config(config)
    with torch.device("meta"):
        model = Decoder(args)
    dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = parallelize_decoder(model, dims, config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model.train()

    layer = model.layers["0"]
    assert isinstance(layer, FSDPModule) == (mode == "fsdp")
    if compiled:  # the multi-GPU order: checkpoint, then compile, then FSDP around the compiled layer
        assert isinstance(layer, torch._dynamo.eval_frame.OptimizedModule)
        assert isinstance(layer._orig_mod, CheckpointWrapper)

    seen: dict[str, torch.dtype] = {}  # (hooks must return None: a value would replace the output)

    def embedding(m, i, out):
        seen["embedding"] = out.dtype
        out.register_hook(lambda g: seen.__setitem__("stream_grad", g.dtype))

    model.tok_embeddings.register_forward_hook(embedding)
    model.norm.register_forward_pre_hook(lambda m, i: seen.__setitem__("stream", i[0].dtype))
    layer.register_forward_hook(lambda m, i, out: seen.__setitem__("layer_out", _one_dtype(out)))
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else torch.autocast("cpu", enabled=False)
    with amp:
        logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()

    compute = torch.bfloat16 if mode == "fsdp" else torch.float32  # autocast leaves the stream in fp32
    assert seen == {"embedding": compute, "stream": compute, "layer_out": compute, "stream_grad": compute}, seen
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) == (mode == "fsdp"), name
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).all(), name
    # torchtitan's clip and AdamW over the (DTensor) parameters: a finite norm, every parameter
    # with a gradient updated in place, still fp32 (layer 0's AttnRes query has none: one source).
    from torchtitan.distributed.utils import clip_grad_norm_

    norm = clip_grad_norm_(list(model.parameters()), max_norm=1e-3, foreach=True)
    assert torch.isfinite(norm) and norm > 1e-3
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.grad.abs().max() > 0}
    assert len(before) > len(list(model.parameters())) // 2
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and (name not in before or not torch.equal(p.detach(), before[name])), name
    # The expert biases are buffers: FSDP neither shards nor casts them.
    for moe in (m for m in model.modules() if isinstance(m, LatentMoE)):
        assert type(moe.expert_bias) is torch.Tensor and moe.expert_bias.dtype == torch.float32


def _one_dtype(tensors) -> torch.dtype:
    """The dtype shared by every floating-point tensor of a (nested) tuple."""
    (dtype,) = {t.dtype for t in torch.utils._pytree.tree_leaves(tensors) if t.is_floating_point()}
    return dtype


@pytest.mark.parametrize("mode,compiled", [
    ("fsdp", False), ("autocast", False), pytest.param("fsdp", True, marks=pytest.mark.slow)])
def test_fsdp_on_one_device_makes_the_stream_bf16_and_keeps_fp32_masters(tmp_path, mode, compiled):
    """One gloo rank: with "fsdp" the embedding output, every layer's stream and the stream's
    gradient are bf16 while the parameters and their gradients stay fp32 (DTensors); with
    "autocast" the stream stays fp32, which is what the mode is for. Compiled (aot_eager: no
    Inductor compile time) with full AC: the layers keep the multi-GPU wrapping order."""
    spawn_gloo(_dtypes_worker, 1, tmp_path, mode, compiled)


# =========================================================================== trainer, fp32
def start_runs(root: Path) -> dict:
    """Each mode trains STEPS steps (checkpoint at step 2), then resumes the other mode's step-2
    checkpoint: name -> future of {run: (dump, log)}."""

    def one(name: str, *args: str) -> tuple[Path, str]:
        dump = root / name
        proc = run_train(dump, "--training.steps", str(STEPS), *args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return dump, proc.stdout + proc.stderr

    def then_resume_in_the_other(mode: str, other: str) -> dict:
        flags = {"autocast": [], "fsdp": FSDP}
        first = one(mode, *flags[mode], *CHECKPOINT)
        resumed = root / f"{mode}_resumed_as_{other}"
        shutil.copytree(first[0] / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
        return {mode: first, "resumed": one(resumed.name, *flags[other], *CHECKPOINT)}

    return start_all({mode: lambda mode=mode, other=other: then_resume_in_the_other(mode, other)
                      for mode, other in (("autocast", "fsdp"), ("fsdp", "autocast"))})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return started_runs(start_runs, tmp_path_factory)


# Both modes compute in fp32 on the CPU, with the same initial weights (`debug.seed`) and data:
# FSDP on one rank copies each gradient into its reduce buffer instead of reducing it, so the
# only differences are the order of sums (the grad-norm clip over DTensors). 1e-6 relative is
# ten times fp32's epsilon, far below what any change of numerics would move a loss of ~8.
RTOL = 1e-6


@pytest.mark.slow
def test_fsdp_on_one_device_trains_like_autocast_in_fp32(runs):
    (autocast, autocast_log), (fsdp, fsdp_log) = runs["autocast"].result()["autocast"], runs["fsdp"].result()["fsdp"]
    assert "Applied FSDP on one device" in fsdp_log and "Applied FSDP on one device" not in autocast_log
    assert "one_device_mixed_precision=fsdp" in fsdp_log and "one_device_mixed_precision=autocast" in autocast_log
    ref, got = records(autocast), records(fsdp)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=RTOL), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=RTOL), step
        # The expert-balance counts (QB biases set from step 1's routing on) are integers.
        for key in ("moe/max_violation_max", "moe/dead_experts_total"):
            assert got[step][key] == ref[step][key], (step, key)


@pytest.mark.slow
@pytest.mark.parametrize("saved_by,resumed_as", [("autocast", "fsdp"), ("fsdp", "autocast")])
def test_a_checkpoint_resumes_in_the_other_mode(runs, saved_by, resumed_as):
    """Plain-tensor state (autocast) loads into FSDP's DTensors and back: step 3 after the resume
    equals step 3 of the run that saved the checkpoint; the resume says the mode changed."""
    chain = runs[saved_by].result()
    (saved, _), (resumed, log) = chain[saved_by], chain["resumed"]
    assert "Loading the checkpoint from" in log and "step-2" in log
    assert f"one_device_mixed_precision: '{saved_by}' -> '{resumed_as}'" in log
    got = records(resumed)
    assert sorted(got) == [3]
    assert got[3]["loss"] == pytest.approx(records(saved)[3]["loss"], rel=RTOL)
