"""The ablation arms' model choices: the auxiliary balance loss (`model.balance_rule =
"aux_loss"`), SwiGLU experts (`model.expert_activation`) and the unbounded softplus KDA gate
(`model.kda_gate`).

Tolerances: fp32 throughout. The auxiliary-loss gradients are the same sums in another order
(1e-5 relative); SwiGLU against a per-expert loop differs by fp32 rounding of a few matmuls
(1e-5); the unbounded-gate layer against fla's token recurrence, as test_kda_layer.py's
bounded one (2e-5): a wrong gate form or a dropped term gives errors of 1e-2 or more.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from numerics import rel_err
from tiny import TINY_ARGS, records, run_train
from torch import nn

from titan_moe.config import load_config
from titan_moe.model.args import ModelArgs
from titan_moe.model.decoder import Decoder
from titan_moe.model.ffn import SiTUGLUFeedForward
from titan_moe.model.kda import KimiDeltaAttention, check_unbounded_gate_path
from titan_moe.model.moe import (
    LatentMoE,
    RoutedExperts,
    apply_expert_balance,
    balance_metrics,
    set_aux_loss_weight,
)
from titan_moe.ops import choices


MOE = dict(dim=24, n_routed_experts=8, top_k=2, n_shared_experts=1, moe_latent_dim=12, moe_expert_hidden=20,
           moe_shared_hidden=10)


def _moe(seed: int = 0, **overrides) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(ModelArgs(**{**MOE, **overrides}))
    moe.init_weights(init_std=0.3)
    return moe


def _explicit_aux(moe: LatentMoE, x_ND: torch.Tensor) -> torch.Tensor:
    """E * Σ_e f_e P_e written out from the router weight (f: share of the N*k routed copies)."""
    s = torch.sigmoid(x_ND @ moe.router.weight.T)
    idx = torch.topk(s, moe.top_k, dim=-1).indices
    f = F.one_hot(idx, moe.n_experts).sum((0, 1)).float() / (x_ND.shape[0] * moe.top_k)
    P = (s / s.sum(-1, keepdim=True)).mean(0)
    return moe.n_experts * (f * P).sum()


# --------------------------------------------------------------------------- auxiliary loss
def test_aux_loss_gradient_equals_the_explicit_loss_and_leaves_the_output():
    """The router (and everything else) gets the gradient of `out + coef * weight * aux`; the
    output, and so the loss the trainer computes, is the sign rule's (same weights, zero bias)."""
    coef, weight = 0.5, 40.0  # a large weight, so that the auxiliary part is not lost in rounding
    aux_moe = _moe(seed=1, balance_rule="aux_loss", aux_loss_coef=coef)
    plain = _moe(seed=1, balance_rule="sign")
    plain.load_state_dict(aux_moe.state_dict())
    set_aux_loss_weight([aux_moe], weight)
    x = torch.randn(3, 7, 24)
    r = 0.1 * torch.randn(3, 7, 24)

    y = aux_moe(x)
    (y * r).sum().backward()
    y_plain = plain(x)
    assert torch.equal(y, y_plain)
    aux = _explicit_aux(plain, x.view(-1, 24))
    only_out = torch.autograd.grad((y_plain * r).sum(), plain.router.weight, retain_graph=True)[0]
    only_aux = torch.autograd.grad(aux, plain.router.weight, retain_graph=True)[0]
    ((y_plain * r).sum() + coef * weight * aux).backward()

    for (name, a), b in zip(aux_moe.named_parameters(), plain.parameters()):
        assert rel_err(a.grad, b.grad) < 1e-5, name
    # the auxiliary part of the router's gradient on its own
    assert rel_err(aux_moe.router.weight.grad - only_out, coef * weight * only_aux) < 1e-4


def test_aux_loss_value_is_logged_and_the_bias_stays_zero():
    moe = _moe(seed=2, balance_rule="aux_loss")
    xs = [torch.randn(4, 9, 24) for _ in range(2)]
    for x in xs:  # two microbatches of one step
        moe(x).sum().backward()
    want = sum(_explicit_aux(moe, x.view(-1, 24)).item() for x in xs) / 2
    stats = apply_expert_balance(moe)
    metrics = balance_metrics([stats])
    assert metrics["moe/root/aux_loss"] == pytest.approx(want, rel=1e-5)
    assert metrics["moe/aux_loss_mean"] == pytest.approx(want, rel=1e-5)
    assert metrics["moe/max_violation_max"] > 0  # the load was uneven, yet:
    assert torch.equal(moe.expert_bias, torch.zeros(8))
    assert moe.aux_loss_count.item() == 0  # reset for the next step
    # the other rules log no auxiliary loss
    qb = _moe(seed=2, balance_rule="qb")
    qb(xs[0])
    assert not any("aux_loss" in key for key in balance_metrics([apply_expert_balance(qb)]))


def test_aux_loss_compiles_and_checkpoints_like_eager():
    """One fullgraph region with activation checkpointing gives eager's gradients and aux values."""
    eager = _moe(seed=3, balance_rule="aux_loss")
    moe = _moe(seed=3, balance_rule="aux_loss")
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 5, 24)
    torch.utils.checkpoint.checkpoint(compiled, x, use_reentrant=False).square().sum().backward()
    eager(x).square().sum().backward()
    assert rel_err(moe.router.weight.grad, eager.router.weight.grad) < 1e-5
    assert moe.step_aux_loss().item() == pytest.approx(eager.step_aux_loss().item(), rel=1e-6)


@pytest.mark.parametrize("coef", [0.0, -1e-2, 1.5, math.nan])
def test_bad_aux_loss_coefficient_is_refused(coef):
    with pytest.raises(ValueError, match="model.aux_loss_coef must lie in"):
        ModelArgs(balance_rule="aux_loss", aux_loss_coef=coef)


def test_bad_choice_values_name_the_key():
    for key, value in (("balance_rule", "aux"), ("expert_activation", "gelu"), ("kda_gate", "softplus")):
        with pytest.raises(ValueError, match=f"model.{key} must be"):
            ModelArgs(**{key: value})
    with pytest.raises(ValueError, match="model.aux_loss_coef"):
        load_config(["--job.config_file", "configs/debug_cpu.toml", "--model.aux_loss_coef", "-1"])


# --------------------------------------------------------------------------- SwiGLU experts
def _swiglu(x, w_gate_up, w_down):
    h = w_down.shape[0]
    z = x @ w_gate_up
    return (F.silu(z[..., :h]) * z[..., h:]) @ w_down


def test_swiglu_experts_match_a_per_expert_loop():
    torch.manual_seed(0)
    experts = RoutedExperts(4, 12, 20, 4.0, 25.0, activation="swiglu")
    experts.init_weights(init_std=0.5)  # pre-activations far outside SiTU's near-linear range
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(int(counts.sum()), 12)
    y = experts(x, torch.cumsum(counts, 0).to(torch.int32))
    rows = torch.split(x, counts.tolist())
    ref = torch.cat([_swiglu(r, experts.w_gate_up[e], experts.w_down[e]) for e, r in enumerate(rows)])
    assert rel_err(y, ref) < 1e-5
    situ = RoutedExperts(4, 12, 20, 4.0, 25.0)
    situ.load_state_dict(experts.state_dict())
    assert rel_err(situ(x, torch.cumsum(counts, 0).to(torch.int32)), ref) > 1e-2  # a different function


def test_expert_activation_reaches_routed_and_shared_experts_only():
    moe = _moe(expert_activation="swiglu")
    assert moe.experts.activation == "swiglu" and moe.shared_experts.activation == "swiglu"
    ffn = SiTUGLUFeedForward(24, 10, activation="swiglu")
    x = torch.randn(5, 24)
    assert rel_err(ffn(x), _swiglu(x, ffn.w_gate_up.weight.T, ffn.w_down.weight.T)) < 1e-5

    with torch.device("meta"):
        model = Decoder(dataclasses.replace(TINY_ARGS, expert_activation="swiglu"))
    assert model.layers["0"].feed_forward.activation == "situ"  # the dense first layer
    with pytest.raises(ValueError, match="situ\\|swiglu"):
        RoutedExperts(2, 4, 4, 4.0, 25.0, activation="relu")


def test_float8_experts_refuse_swiglu():
    from titan_moe.float8.experts import Float8RoutedExperts

    with pytest.raises(ValueError, match="SiTU-GLU experts only"):
        Float8RoutedExperts.from_experts(RoutedExperts(2, 16, 16, 4.0, 25.0, activation="swiglu"))


# --------------------------------------------------------------------------- unbounded KDA gate
def test_unbounded_gate_layer_matches_the_softplus_reference():
    fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="fla-core provides the independent oracle")
    args = ModelArgs(dim=48, kda_n_heads=2, kda_head_dim=16, kda_gate="unbounded")
    torch.manual_seed(0)
    m = KimiDeltaAttention(args)
    with torch.no_grad():
        for p in (m.wq.weight, m.wk.weight, m.wv.weight, m.w_f_down.weight, m.w_f_up.weight, m.w_beta.weight):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        m.A_log.fill_(math.log(3.0))  # decays past the bounded form's -5 in places
        m.dt_bias.normal_(0.0, 1.0)
    x = torch.randn(2, 100, 48)
    with torch.no_grad():
        q, k, v, z, beta, _ = m.attention_inputs(x)
        g = -m.A_log.exp().view(2, 1) * F.softplus(z + m.dt_bias.view(2, 16))  # fla's naive_kda_gate
        assert g.min() < -5.0
        o, _ = fla_naive.naive_recurrent_kda(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6),
                                             v, g, beta)
        y = m(x)
        y_ref = m.output_projection(o, x)
        bounded = KimiDeltaAttention(ModelArgs(dim=48, kda_n_heads=2, kda_head_dim=16))
        bounded.load_state_dict(m.state_dict())
        assert rel_err(bounded(x), y_ref) > 1e-2  # the gate form matters for these inputs
    assert rel_err(y, y_ref) < 2e-5


def test_unbounded_gate_resolves_kda_to_torch_or_refuses_triton():
    auto = choices.resolve(choices.KernelChoices(), "cuda", kda_gate_bounded=False)
    assert auto.kda == "torch" and auto.situ == "triton"
    with pytest.raises(ValueError, match="kernels.kda = 'triton' cannot run model.kda_gate = 'unbounded'"):
        choices.resolve(choices.KernelChoices(kda="triton"), "cuda", kda_gate_bounded=False)
    # a layer called directly (no trainer) refuses to hand unbounded gates to the Triton kernels
    with choices.using(kda="triton"), pytest.raises(ValueError, match="kernels.kda = 'torch'"):
        check_unbounded_gate_path(torch.device("cuda"))
    with choices.using(kda="torch"):
        check_unbounded_gate_path(torch.device("cuda"))
    check_unbounded_gate_path(torch.device("cpu"))


def test_start_up_line_records_the_model_choices(caplog):
    from torchtitan.tools.logging import logger

    from titan_moe.train import _activate_kernel_choices

    previous = choices.current()
    logger.propagate, propagate = True, logger.propagate
    try:
        with caplog.at_level("INFO"):
            record = _activate_kernel_choices(load_config([
                "--job.config_file", "configs/debug_cpu.toml", "--model.balance_rule", "aux_loss",
                "--model.expert_activation", "swiglu", "--model.kda_gate", "unbounded"]))
    finally:
        logger.propagate = propagate
        choices.activate(previous)
    assert record["kda"] == "torch" and record["aux_loss_coef"] == 1e-2
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    for part in ("balance_rule=aux_loss", "aux_loss_coef=0.01", "expert_activation=swiglu", "kda_gate=unbounded"):
        assert part in line


def test_unbounded_gate_is_refused_under_context_parallelism():
    from titan_moe.config import ConfigError
    from titan_moe.context_parallel import check_context_parallel

    config = load_config(["--job.config_file", "configs/debug_cpu.toml", "--parallelism.context_parallel_degree",
                          "2", "--validation.no_enable", "--model.kda_gate", "unbounded"])
    with pytest.raises(ConfigError, match="kda_gate = 'unbounded' is not supported"):
        check_context_parallel(config)


def test_no_choice_changes_a_default_model():
    """Defaults keep the shipped model: SiTU-GLU experts, bounded gate, QB (nothing registered
    for the auxiliary loss)."""
    args = ModelArgs()
    assert (args.expert_activation, args.kda_gate, args.balance_rule) == ("situ", "bounded", "qb")
    moe = LatentMoE(ModelArgs(**MOE))
    assert "aux_loss_weight" not in dict(moe.named_buffers())
    assert isinstance(moe.experts, nn.Module) and moe.experts.activation == "situ"


def test_a_training_run_with_the_three_choices_logs_them_and_the_aux_loss(tmp_path):
    """Two steps of the tiny model, two microbatches a step, with all three choices."""
    proc = run_train(tmp_path, "--training.steps", "2", "--training.local_batch_size", "2",
                     "--model.balance_rule", "aux_loss", "--model.expert_activation", "swiglu",
                     "--model.kda_gate", "unbounded")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "aux_loss 1." in proc.stderr + proc.stdout  # the experts line (1 for uniform routing)
    last = records(tmp_path)[2]
    assert math.isfinite(last["loss"]) and 1.0 <= last["moe/aux_loss_mean"] < 8.0
    (kernels,) = [r["kernels"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
                  if "kernels" in r]
    assert (kernels["balance_rule"], kernels["expert_activation"], kernels["kda_gate"], kernels["kda"]) == (
        "aux_loss", "swiglu", "unbounded", "torch")
