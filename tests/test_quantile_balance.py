"""Tests for quantile balancing (SPEC §5): cutoffs, exact and histogram quantiles,
convergence against the DeepSeek-V3 sign rule, and the cross-rank histogram."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import spawn_gloo
from titan_moe.model.args import ModelArgs
from titan_moe.model.moe import (
    LatentMoE,
    cutoff_margins,
    exact_quantiles,
    histogram_quantiles,
    qb_bin_range,
    qb_histogram,
    quantile_balance,
    recording_eval_load,
    sign_balance,
    update_expert_biases,
)


def _load(scores, bias, k):
    """Tokens per expert when routing with top-k of scores + bias (independent of the module)."""
    idx = torch.topk(scores + bias, k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=scores.shape[1])


def _violation(scores, bias, k):
    load = _load(scores, bias, k).double()
    return (load.max() / load.mean() - 1).item()


def _skewed_scores(m=4096, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(-2, 2, n))


@pytest.mark.parametrize("m,n,k", [(30, 7, 3), (25, 5, 1), (20, 6, 5)])
def test_cutoff_margins_brute_force(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    scores = torch.rand(m, n, generator=gen)
    bias = 0.3 * torch.randn(n, generator=gen)
    r = cutoff_margins(scores, bias, k)
    biased = scores + bias
    ref = torch.empty(m, n)
    for i in range(m):
        for j in range(n):
            others = torch.cat([biased[i, :j], biased[i, j + 1 :]])
            alpha = torch.sort(others, descending=True).values[k - 1]
            ref[i, j] = alpha - scores[i, j]
    assert torch.equal(r, ref)  # same fp32 values picked and subtracted
    # meaning: expert j is in token i's top-k exactly when its bias beats r_ij
    selected = torch.zeros(m, n, dtype=torch.bool).scatter_(1, torch.topk(biased, k, -1).indices, True)
    assert torch.equal(selected, bias > r)


def test_exact_quantile_gives_each_expert_its_share():
    m, n, k = 600, 12, 3
    gen = torch.Generator().manual_seed(4)
    scores = torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(-1, 1, n))
    bias = 0.1 * torch.randn(n, generator=gen)
    b = exact_quantiles(cutoff_margins(scores, bias, k), k)
    q = m * k // n
    for j in range(n):
        trial = bias.clone()
        trial[j] = b[j]  # others' biases fixed: expert j now wins exactly q tokens
        assert _load(scores, trial, k)[j].item() == q
    centred = quantile_balance(scores, bias, k)
    assert torch.allclose(centred, b - b.mean(), atol=1e-7)
    assert abs(centred.mean().item()) < 1e-6


def test_qb_converges_in_three_updates_sign_rule_does_not():
    m, n, k = 4096, 64, 4
    scores = _skewed_scores(m, n)
    assert _violation(scores, torch.zeros(n), k) > 3.0  # strongly skewed to start with

    bias = torch.zeros(n)
    for _ in range(3):
        bias = quantile_balance(scores, bias, k)
    # SPEC: QB reaches balance in a few steps; 3% of the mean load (256) is ~8 tokens.
    assert _violation(scores, bias, k) <= 0.03

    bias = torch.zeros(n)
    for step in range(100):
        bias = sign_balance(_load(scores, bias, k), bias, gamma=1e-3)
        if step == 2:
            assert _violation(scores, bias, k) > 3.0  # after 3 updates: barely moved
    # after 100 updates the bias has moved at most 0.1, still far from the ~0.5 spread needed
    assert _violation(scores, bias, k) > 0.5


@pytest.mark.parametrize("bins", [64, 1000])
def test_histogram_within_one_bin_of_exact(bins):
    m, n, k = 2048, 32, 4
    gen = torch.Generator().manual_seed(bins)
    scores = torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(-1.5, 1.5, n))
    bias = 0.2 * torch.randn(n, generator=gen)
    counts = qb_histogram(scores, bias, k, bins)
    assert counts.shape == (n, bins) and counts.dtype == torch.int64
    assert torch.all(counts.sum(-1) == m)

    lo, hi = qb_bin_range(bias)
    width = ((hi - lo) / bins).item()
    r = cutoff_margins(scores, bias, k)
    edges = torch.linspace(lo.item(), hi.item(), bins + 1, dtype=torch.float64)
    ref = torch.stack([torch.histogram(r[:, j].double(), bins=edges).hist for j in range(n)]).long()
    # binning differs from torch.histogram only for values within rounding of an edge
    assert (counts - ref).abs().sum().item() <= 4

    exact = exact_quantiles(r, k)
    approx = histogram_quantiles(counts, bias, k)
    assert (approx - exact).abs().max().item() <= width
    # after centring each error moves by the mean error as well: at most two widths
    centred = quantile_balance(scores, bias, k, bins=bins)
    assert (centred - (exact - exact.mean())).abs().max().item() <= 2 * width


def test_histogram_invariant_to_double_counting():
    scores, bias = _skewed_scores(512, 16, seed=3), torch.zeros(16)
    counts = qb_histogram(scores, bias, 2, 100)
    assert torch.equal(histogram_quantiles(counts, bias, 2), histogram_quantiles(2 * counts, bias, 2))


def test_histogram_counts_nan_margins_in_range():
    """NaN scores (a diverged router, or a fake-backend run's meaningless weights) and a NaN
    bias are counted in bin 0 instead of casting NaN to an index out of the histogram."""
    m, n, k, bins = 64, 8, 2, 100
    scores = _skewed_scores(m, n, seed=4)
    scores[::3, 1] = float("nan")
    counts = qb_histogram(scores, torch.zeros(n), k, bins)
    assert counts.shape == (n, bins) and torch.all(counts.sum(-1) == m)
    counts = qb_histogram(scores, torch.full((n,), float("nan")), k, bins)
    assert torch.all(counts[:, 0] == m)  # under a NaN bias every margin is NaN


def test_sign_rule_and_edge_cases():
    bias = torch.tensor([0.0, 0.1, -0.1])
    new = sign_balance(torch.tensor([10, 5, 0]), bias, gamma=0.01)
    assert torch.allclose(new, torch.tensor([-0.01, 0.1, -0.09]))
    scores = torch.rand(10, 3)
    assert torch.equal(quantile_balance(scores, bias, top_k=3), torch.zeros(3))  # k == n: nothing to balance
    with pytest.raises(ValueError):
        quantile_balance(scores, torch.zeros(4), 1)
    with pytest.raises(ValueError):
        qb_histogram(scores, bias, 1, 0)
    with pytest.raises(ValueError, match="not initialized"):
        quantile_balance(scores, bias, 1, group=object())


# --------------------------------------------------------------------------- two gloo ranks
_DIST_ARGS = dict(
    dim=16, n_routed_experts=8, top_k=2, n_shared_experts=1, moe_latent_dim=8,
    moe_expert_hidden=16, moe_shared_hidden=16, balance_rule="qb", qb_bins=50,
)


def _DIST_RULES(bins):
    """(balance_rule, qb_bins, qb_batch_iters): lag and in-batch QB, histogram and exact, sign."""
    return (("qb", bins, 0), ("qb", 0, 0), ("sign", 0, 0), ("qb", bins, 2), ("qb", 0, 2))


def _dist_worker(rank, world, out_dir, scores, bias, k, bins, x_BTD, moe_state):
    part = scores.chunk(world)[rank]
    counts = qb_histogram(part, bias, k, bins)
    dist.all_reduce(counts)
    result = {
        "counts": counts,
        "hist_bias": quantile_balance(part, bias, k, bins=bins, group=dist.group.WORLD),
        "exact_bias": quantile_balance(part, bias, k, group=dist.group.WORLD),
    }
    for rule, qb_bins, iters in _DIST_RULES(bins):
        moe = LatentMoE(ModelArgs(**{**_DIST_ARGS, "balance_rule": rule, "qb_bins": qb_bins,
                                     "qb_batch_iters": iters}))
        moe.load_state_dict(moe_state)
        moe.balance_group = dist.group.WORLD  # as the train spec sets it
        moe.train()
        moe(x_BTD.chunk(world)[rank])
        metrics = update_expert_biases(moe, group=dist.group.WORLD)
        result[f"moe_{rule}{qb_bins}_{iters}"] = (moe.expert_bias.clone(), metrics)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_gloo_ranks_match_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    m, n, k, bins = 1024, 16, 2, 100
    scores = _skewed_scores(m, n, seed=5)
    bias = 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(7)
    moe = LatentMoE(ModelArgs(**_DIST_ARGS))
    moe.init_weights(0.3)
    moe.expert_bias.copy_(0.02 * torch.randn(8))
    state = moe.state_dict()
    x_BTD = torch.randn(4, 6, 16)

    spawn_gloo(_dist_worker, 2, tmp_path, str(tmp_path), scores, bias, k, bins, x_BTD, state)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    single_counts = qb_histogram(scores, bias, k, bins)
    single_hist = quantile_balance(scores, bias, k, bins=bins)
    single_exact = quantile_balance(scores, bias, k)
    for res in results:
        assert torch.equal(res["counts"], single_counts)  # integer counts: exact
        # same counts, same arithmetic afterwards
        assert torch.allclose(res["hist_bias"], single_hist, atol=1e-7)
        assert torch.allclose(res["exact_bias"], single_exact, atol=1e-7)

    for rule, qb_bins, iters in _DIST_RULES(bins):
        ref = LatentMoE(ModelArgs(**{**_DIST_ARGS, "balance_rule": rule, "qb_bins": qb_bins,
                                     "qb_batch_iters": iters}))
        ref.load_state_dict(state)
        ref.train()
        ref(x_BTD)
        ref_metrics = update_expert_biases(ref)
        for res in results:
            got_bias, got_metrics = res[f"moe_{rule}{qb_bins}_{iters}"]
            # every rank derives the same bias from all-reduced statistics of the whole batch
            # (in-batch QB: the same routing bias as well, so the same load metrics)
            assert torch.allclose(got_bias, ref.expert_bias, atol=1e-6), (rule, qb_bins, iters)
            assert got_metrics == pytest.approx(ref_metrics)


def test_in_batch_qb_routes_each_batch_balanced_and_keeps_an_ema_for_inference():
    args = ModelArgs(**{**_DIST_ARGS, "qb_bins": 0, "qb_batch_iters": 3, "qb_ema": 0.5})
    torch.manual_seed(3)
    moe = LatentMoE(args)
    moe.init_weights(0.3)
    with torch.no_grad():  # a router that prefers the first experts
        moe.router.weight.add_(torch.linspace(0.1, -0.1, 8)[:, None] * torch.ones(16))
    x_BTD = torch.randn(4, 64, 16) + 0.5  # 256 tokens, mean load 64 per expert
    moe.eval()
    moe(x_BTD)
    assert moe.tokens_per_expert.sum() == 0  # eval: nothing accumulated, frozen bias
    frozen = _load(moe.router.scores(x_BTD.reshape(-1, 16)).detach(), moe.expert_bias, 2)
    assert (frozen.max() / frozen.float().mean() - 1) > 0.5  # skewed without balancing

    moe.train()
    moe(x_BTD)
    load = moe.tokens_per_expert.clone()
    # routed with its own bias: within 6 tokens of 64 each (each pass fits every expert with
    # the others' biases fixed, not jointly, so 3 passes leave a few tokens over)
    assert (load.max() / load.float().mean() - 1) < 0.1, load
    batch_bias = moe.qb_batch_bias_sum.clone()
    metrics = update_expert_biases(moe)
    assert metrics["moe/root/max_violation"] < 0.1
    # the inference bias moves halfway (qb_ema 0.5) from 0 to the batch's bias
    assert torch.allclose(moe.expert_bias, 0.5 * batch_bias, atol=1e-6)
    assert moe.qb_batch_count == 0 and moe.qb_batch_bias_sum.abs().sum() == 0


@pytest.mark.parametrize("token_tile", [0, 64])
def test_eval_load_is_the_frozen_bias_routing_and_leaves_training_stats(token_tile):
    args = ModelArgs(**{**_DIST_ARGS, "qb_bins": 16, "moe_token_tile": token_tile})
    torch.manual_seed(4)
    moe = LatentMoE(args)
    moe.init_weights(0.3)
    with torch.no_grad():
        moe.expert_bias.normal_(0.0, 0.1)
    x_BTD = torch.randn(4, 64, 16)
    moe(x_BTD)  # training statistics of a microbatch, kept aside during the eval
    training_tokens, training_hist = moe.tokens_per_expert.clone(), moe.qb_counts.clone()
    assert training_tokens.sum() == 256 * 2

    held_out_BTD = torch.randn(2, 64, 16) + 0.3
    moe.eval()
    with torch.no_grad(), recording_eval_load(moe) as balance:
        moe(held_out_BTD)
        moe(held_out_BTD)
    moe.train()
    load = 2 * _load(moe.router.scores(held_out_BTD.reshape(-1, 16)).detach(), moe.expert_bias, 2).double()
    expected = (load.max() / load.mean() - 1).item()
    assert balance["eval/moe/max_violation_max"] == pytest.approx(expected)
    assert balance["eval/moe/max_violation_mean"] == pytest.approx(expected)  # one layer
    assert balance["eval/moe/dead_experts_total"] == (load == 0).sum().item()
    assert torch.equal(moe.tokens_per_expert, training_tokens) and torch.equal(moe.qb_counts, training_hist)
    assert not moe.record_eval_load
    moe.eval()
    moe(held_out_BTD)  # outside the context: nothing counted
    assert torch.equal(moe.tokens_per_expert, training_tokens)
    with recording_eval_load(torch.nn.Linear(2, 2)) as none:  # no MoE layer: no metrics
        pass
    assert none == {}
