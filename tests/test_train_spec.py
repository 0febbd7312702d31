"""The train spec's optimizer: weight-decay groups and the expert-bias step hook."""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from titan_moe.flavors import FLAVORS
from titan_moe.model.decoder import Decoder
from titan_moe.model.moe import balance_metrics
from titan_moe.train_spec import build_optimizers_with_expert_balance, optimizer_summary


def _model() -> Decoder:
    args = dataclasses.replace(FLAVORS["debug"], dim=64, kda_head_dim=16, mla_q_lora_rank=32, moe_latent_dim=32)
    torch.manual_seed(0)
    model = Decoder(args)
    model.init_weights()
    return model


def test_no_weight_decay_on_kda_decay_params_and_vectors():
    model = _model()
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers_with_expert_balance([model], OptimizerConfig(weight_decay=0.1), dims)
    (opt,) = optimizers.optimizers
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    exempt = {names[id(p)] for p in no_decay["params"]}
    assert any(n.endswith("A_log") for n in exempt) and any(n.endswith("dt_bias") for n in exempt)
    assert all(p.ndim >= 2 for p in decay["params"])
    assert not any(names[id(p)].endswith(("A_log", "dt_bias")) for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_step_updates_expert_bias_and_reports_balance():
    model = _model()
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers_with_expert_balance([model], OptimizerConfig(lr=1e-3), dims)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert biases
    logits = model(torch.randint(0, 4096, (2, 64)))
    logits.logsumexp(-1).mean().backward()
    optimizers.step()
    after = dict(model.named_buffers())
    assert any(not torch.equal(after[n], b) for n, b in biases.items())
    (stats,) = optimizers.expert_balance_stats  # kept as tensors until a log step reads them
    assert isinstance(stats.stats_L2, torch.Tensor) and len(stats.names) == stats.stats_L2.shape[0]
    assert "moe/max_violation_max" in balance_metrics(optimizers.expert_balance_stats)


def test_start_up_line_names_the_optimizer_and_its_groups():
    model = _model()
    dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    adamw = build_optimizers_with_expert_balance([model], OptimizerConfig(lr=1e-3, weight_decay=0.1), dims)
    line = optimizer_summary("AdamW", adamw)
    assert "K parameters" in line  # the vectors without weight decay
    assert line.startswith("optimizer: AdamW, lr 0.001; AdamW (weight decay 0.1): ") and "AdamW (weight decay 0)" in line
    muon = build_optimizers_with_expert_balance([model], OptimizerConfig(name="Muon", lr=3e-3, weight_decay=0.1), dims)
    line = optimizer_summary("Muon", muon)
    assert line.startswith("optimizer: Muon, lr 0.003; ") and "Muon (weight decay 0.1): " in line
    scale = {"K": 1e-3, "M": 1.0}
    counts = [float(c[:-1]) * scale[c[-1]] for c in (part.split(", ")[1].split()[0] for part in line.split("; ")[1:])]
    assert abs(sum(counts) - n) < 0.01 * len(counts)  # every parameter in one group (rounded)
