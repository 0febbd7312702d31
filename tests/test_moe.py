"""Tests for the router (SPEC §5) and the Stable LatentMoE block (SPEC §6)."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
from torch import nn

from titan_moe.model.args import ModelArgs
from titan_moe.model.moe import LatentMoE, TopKRouter, qb_histogram, quantile_balance, update_expert_biases


def _args(**overrides) -> ModelArgs:
    base = dict(
        dim=24, n_routed_experts=8, top_k=2, n_shared_experts=2, moe_latent_dim=12,
        moe_expert_hidden=20, moe_shared_hidden=10, situ_beta1=4.0, situ_beta2=25.0, routed_scale=1.0,
    )
    return ModelArgs(**{**base, **overrides})


def _make_moe(seed: int = 0, bias_std: float = 0.05, **overrides) -> LatentMoE:
    torch.manual_seed(seed)
    moe = LatentMoE(_args(**overrides))
    moe.init_weights(init_std=0.3)  # large enough that expert outputs are far from linear
    moe.expert_bias.copy_(bias_std * torch.randn(moe.n_experts))
    return moe


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _situ(zg, zu, b1, b2):
    tanh = lambda a: (1 - torch.exp(-2 * a)) / (1 + torch.exp(-2 * a))  # noqa: E731
    return b1 * tanh(zg / b1) * (1 / (1 + torch.exp(-zg))) * b2 * tanh(zu / b2)


def _loop_reference(params: dict[str, torch.Tensor], bias, x_ND, a: ModelArgs):
    """Token by token, expert by expert, in whatever dtype ``params`` hold (float64 here)."""
    n, k, hidden, eps = a.n_routed_experts, a.top_k, a.moe_expert_hidden, a.norm_eps
    outs = []
    for x in x_ND:
        s = torch.sigmoid(params["router.weight"] @ x)
        chosen = sorted(range(n), key=lambda j: -(s[j] + bias[j]).item())[:k]
        denom = sum(s[j] for j in chosen)
        h = params["w_latent_down.weight"] @ x
        u = torch.zeros_like(h)
        for j in chosen:
            z = h @ params["experts.w_gate_up"][j]
            act = _situ(z[:hidden], z[hidden:], a.situ_beta1, a.situ_beta2)
            u = u + a.routed_scale * s[j] / denom * (act @ params["experts.w_down"][j])
        u = u / torch.sqrt(u.square().mean() + eps) * params["latent_norm.weight"]
        y = params["w_latent_up.weight"] @ u
        hs = a.moe_shared_hidden
        for e in range(a.n_shared_experts):  # each shared expert separately
            wgu = params["shared_experts.w_gate_up.weight"]
            gate = wgu[e * hs : (e + 1) * hs] @ x
            up = wgu[a.n_shared_experts * hs + e * hs : a.n_shared_experts * hs + (e + 1) * hs] @ x
            w_down = params["shared_experts.w_down.weight"][:, e * hs : (e + 1) * hs]
            y = y + w_down @ _situ(gate, up, a.situ_beta1, a.situ_beta2)
        outs.append(y)
    return torch.stack(outs)


def _double_params(moe):
    return {name: p.detach().double().requires_grad_() for name, p in moe.named_parameters()}


# --------------------------------------------------------------------------- router
@pytest.mark.parametrize("n,k,scale", [(8, 2, 1.0), (6, 3, 2.5), (5, 5, 1.0)])
def test_router_matches_direct_reference(n, k, scale):
    torch.manual_seed(n * k)
    router = TopKRouter(16, n, k, routed_scale=scale)
    router.init_weights(0.5)
    x = torch.randn(20, 16, requires_grad=True)
    bias = 0.2 * torch.randn(n)
    scores, idx, weights = router(x, bias)
    assert scores.dtype == weights.dtype == torch.float32 and idx.shape == (20, k)
    for i in range(20):
        s = torch.sigmoid(router.weight.detach().double() @ x[i].detach().double())
        chosen = sorted(range(n), key=lambda j: -(s[j] + bias[j]).item())[:k]
        assert idx[i].tolist() == chosen
        expected = torch.stack([s[j] for j in chosen]) / sum(s[j] for j in chosen) * scale
        assert torch.allclose(weights[i].double(), expected, rtol=1e-6)  # fp32 vs fp64 logits
    assert torch.allclose(weights.sum(-1), torch.full((20,), scale))


def test_router_bias_is_a_buffer_outside_autograd():
    moe = _make_moe()
    assert "expert_bias" not in dict(moe.named_parameters())
    assert "expert_bias" in moe.state_dict() and moe.expert_bias.dtype == torch.float32
    assert "tokens_per_expert" not in moe.state_dict()  # per-step accumulator, not checkpointed
    moe(torch.randn(2, 3, 24)).sum().backward()
    assert not moe.expert_bias.requires_grad and moe.expert_bias.grad is None
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- LatentMoE numerics
CONFIGS = [
    dict(),  # widths 12 / 20: not 16-byte aligned, grouped GEMM takes the loop
    dict(moe_latent_dim=16, moe_expert_hidden=32, n_shared_experts=1),  # aligned: torch._grouped_mm on CPU
    dict(n_routed_experts=6, top_k=3, n_shared_experts=0, routed_scale=2.0),
    dict(n_routed_experts=16, top_k=1),  # most experts idle
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_forward_and_grads_match_loop_reference(overrides):
    moe = _make_moe(seed=len(overrides), **overrides)
    a = _args(**overrides)
    x = torch.randn(2, 7, a.dim, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype

    params = _double_params(moe)
    x_ref = x.detach().double().reshape(-1, a.dim).requires_grad_()
    ref = _loop_reference(params, moe.expert_bias.double(), x_ref, a).view(x.shape)
    # fp32 module vs float64 loop: widths <= 32, a few ulps per op
    assert _rel(y, ref) < 1e-5

    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g.double())
    assert _rel(x.grad, x_ref.grad.view(x.shape)) < 1e-5
    for name, p in moe.named_parameters():
        if name == "router.weight" and a.top_k == 1:
            # p = s/s = routed_scale: the router gets no gradient (rounding noise only)
            assert p.grad.abs().max() < 1e-6 and params[name].grad.abs().max() < 1e-12
            continue
        assert _rel(p.grad, params[name].grad) < 1e-5, name

    # expert weights get gradient exactly when the expert received tokens
    load = moe.tokens_per_expert
    for w in (moe.experts.w_gate_up, moe.experts.w_down):
        got_grad = w.grad.flatten(1).abs().sum(1) > 0
        assert torch.equal(got_grad, load > 0)
    if a.n_routed_experts > 2 * 7 * a.top_k:  # fewer token copies than experts: some stay idle
        assert (load == 0).any()


# --------------------------------------------------------------------------- balancing state
def test_train_mode_accumulates_eval_mode_does_not():
    moe = _make_moe(qb_bins=40)
    bias0 = moe.expert_bias.clone()
    x1, x2 = torch.randn(2, 5, 24), torch.randn(3, 4, 24)
    moe.eval()
    moe(x1)
    assert torch.equal(moe.expert_bias, bias0)
    assert moe.tokens_per_expert.sum() == 0 and moe.qb_counts.sum() == 0 and moe.step_scores is None

    moe.train()
    hist = torch.zeros(8, 40, dtype=torch.int64)
    for x in (x1, x2):
        moe(x)
        scores = torch.sigmoid(x.reshape(-1, 24) @ moe.router.weight.detach().T)
        hist += qb_histogram(scores, moe.expert_bias, 2, 40)
    assert moe.tokens_per_expert.sum().item() == (10 + 12) * 2
    assert torch.equal(moe.qb_counts, hist)
    assert torch.equal(moe.expert_bias, bias0)  # forward never moves the bias

    load = moe.tokens_per_expert.double()
    metrics = update_expert_biases(moe)
    assert metrics["moe/root/max_violation"] == pytest.approx((load.max() / load.mean() - 1).item())
    assert metrics["moe/root/dead_experts"] == (load == 0).sum().item()
    assert not torch.equal(moe.expert_bias, bias0)
    assert abs(moe.expert_bias.mean().item()) < 1e-6
    assert moe.tokens_per_expert.sum() == 0 and moe.qb_counts.sum() == 0


def test_exact_qb_uses_latest_microbatch_and_ema():
    moe = _make_moe(qb_bins=0, qb_ema=0.25)
    bias0 = moe.expert_bias.clone()
    moe(torch.randn(2, 5, 24))
    x = torch.randn(3, 6, 24)
    moe(x)
    scores = torch.sigmoid(x.reshape(-1, 24) @ moe.router.weight.detach().T)
    assert torch.allclose(moe.step_scores, scores, atol=1e-6)
    update_expert_biases(moe)
    expected = 0.25 * bias0 + 0.75 * quantile_balance(scores, bias0, 2)
    assert torch.allclose(moe.expert_bias, expected, atol=1e-6)
    assert moe.step_scores is None


def test_sign_rule_and_metrics_over_layers():
    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_make_moe(1, balance_rule="sign", sign_gamma=0.01), _make_moe(2)])

    model = TwoLayers()
    x = torch.randn(4, 6, 24)
    model.layers[0](x)
    load = model.layers[0].tokens_per_expert.double()
    bias0 = [layer.expert_bias.clone() for layer in model.layers]
    metrics = update_expert_biases(model)
    expected = bias0[0] + 0.01 * torch.sign(load.mean() - load).float()
    assert torch.allclose(model.layers[0].expert_bias, expected)
    # layer 1 saw no token this step: bias kept, metrics zero
    assert torch.equal(model.layers[1].expert_bias, bias0[1])
    assert metrics["moe/layers.1/max_violation"] == 0.0
    viol0 = (load.max() / load.mean() - 1).item()
    assert metrics["moe/layers.0/max_violation"] == pytest.approx(viol0)
    assert metrics["moe/max_violation_max"] == pytest.approx(viol0)
    assert metrics["moe/max_violation_mean"] == pytest.approx(viol0 / 2)
    assert metrics["moe/dead_experts_total"] == (load == 0).sum().item()
    assert update_expert_biases(nn.Linear(2, 2)) == {}


# --------------------------------------------------------------------------- compile / init
@pytest.mark.parametrize("rule,bins", [("qb", 32), ("qb", 0), ("sign", 0)])
def test_compile_fullgraph_train_mode(rule, bins):
    moe = _make_moe(seed=3, balance_rule=rule, qb_bins=bins)
    eager = _make_moe(seed=3, balance_rule=rule, qb_bins=bins)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe, backend=counter, fullgraph=True)
    for step in range(2):
        x = torch.randn(2, 5, 24, requires_grad=True)
        y = compiled(x)
        y.square().sum().backward()
        gx = x.grad.clone()
        x.grad = None
        y_ref = eager(x)
        y_ref.square().sum().backward()
        assert _rel(y, y_ref) < 1e-6 and _rel(gx, x.grad) < 1e-6
        assert torch.equal(moe.tokens_per_expert, eager.tokens_per_expert)
        if bins:
            assert torch.equal(moe.qb_counts, eager.qb_counts)
        if rule == "qb" and not bins:
            assert torch.equal(moe.step_scores, eager.step_scores)
        update_expert_biases(moe)
        update_expert_biases(eager)
        assert torch.allclose(moe.expert_bias, eager.expert_bias, atol=1e-7)
    # one graph, no break, and a new bias value does not recompile
    assert counter.frame_count == 1


def test_init_weights_on_meta_device():
    with torch.device("meta"):
        moe = LatentMoE(_args(qb_bins=16))
    moe.to_empty(device="cpu")
    moe.init_weights(init_std=0.02)
    for name, p in moe.named_parameters():
        assert torch.isfinite(p).all(), name
        if name == "latent_norm.weight":
            assert torch.all(p == 1)
        else:
            assert p.abs().max().item() <= 0.06 + 1e-7, name
    for name, b in moe.named_buffers():
        assert torch.all(b == 0), name
    y = moe(torch.randn(1, 3, 24))
    assert torch.isfinite(y).all()
    assert math.isclose(moe.tokens_per_expert.sum().item(), 6)


@pytest.mark.gpu
@pytest.mark.parametrize("latent,hidden", [(32, 64), (12, 20)])  # torch._grouped_mm and the loop
def test_cuda_bf16_matches_fp32(latent, hidden):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    moe = _make_moe(seed=9, moe_latent_dim=latent, moe_expert_hidden=hidden, qb_bins=64)
    with torch.no_grad():  # the fp32 reference gets the same bf16-representable weights and inputs
        for p in moe.parameters():
            p.copy_(p.bfloat16().float())
    x = torch.randn(4, 33, 24).bfloat16()
    ref = moe(x.float())
    ref_load = moe.tokens_per_expert.clone()
    moe.reset_balance_stats()
    moe_gpu = moe.to("cuda")
    for p in moe_gpu.parameters():
        p.data = p.data.bfloat16()
    y = moe_gpu(x.cuda())
    y.float().square().sum().backward()
    # same routing (fp32 router on identical values); bf16 activations round at ~6 points (2^-9 each)
    assert _rel(y.float().cpu(), ref) < 2e-2
    assert moe_gpu.expert_bias.dtype == torch.float32
    assert (moe_gpu.tokens_per_expert.cpu() - ref_load).abs().sum() <= 2  # GPU/CPU fp32 near-ties only
    assert all(torch.isfinite(p.grad).all() for p in moe_gpu.parameters() if p.grad is not None)
    update_expert_biases(moe_gpu)
    assert torch.isfinite(moe_gpu.expert_bias).all()
