"""The routed experts' weights cast to autocast's dtype once per optimizer step.

`RoutedExperts.refresh_compute_weights` keeps bf16 copies of the fp32 weights; forwards
read them instead of casting. The copies are the casts the forward would make, so outputs
and gradients must be bit-equal to the per-call path.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from titan_moe.model.moe import RoutedExperts, refresh_compute_weights


def _experts(seed: int = 0) -> RoutedExperts:
    torch.manual_seed(seed)
    experts = RoutedExperts(3, 32, 48, 1.0, 1.0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return experts


X_MK = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
OFFS_E = torch.tensor([10, 10, 37], dtype=torch.int32)  # an empty group, rows past the end


def _fwd_bwd(module, x_MK: torch.Tensor = X_MK, offs_E: torch.Tensor = OFFS_E) -> list[torch.Tensor]:
    """[output, dx, d(each weight)] of ``module`` (the experts or their compiled wrapper)."""
    x = x_MK.clone().requires_grad_()
    out = module(x, offs_E)
    out.float().square().sum().backward()
    result = [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return result


def test_cached_casts_are_read_and_give_bit_equal_results():
    experts = _experts()
    per_call = _fwd_bwd(experts)
    assert refresh_compute_weights([torch.nn.Sequential(experts)], torch.bfloat16) == 1
    assert [w.dtype for w in experts._valid_weight_cache()] == [torch.bfloat16, torch.bfloat16]
    cached = _fwd_bwd(experts)
    for got, want in zip(cached, per_call):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert cached[2].dtype == torch.float32  # the weights' gradients in their own dtype
    with torch.no_grad():
        experts._valid_weight_cache()[0].zero_()  # the forward reads the copy: a zero gate|up, a zero output
    assert not _fwd_bwd(experts)[0].any()
    experts.refresh_compute_weights(torch.bfloat16)
    with torch.no_grad():
        experts.w_down.mul_(2.0)  # an optimizer step without the hook: the cache is dropped
    assert experts._valid_weight_cache() is None
    assert not experts.refresh_compute_weights(torch.float32)  # already the weights' dtype: nothing to cache


def test_under_compile_like_eager():
    experts = _experts(seed=2)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(compiled), _fwd_bwd(experts)))
    for _ in range(2):
        with torch.no_grad():
            experts.w_gate_up.add_(0.01)
        experts.refresh_compute_weights(torch.bfloat16)
        assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(compiled), _fwd_bwd(experts)))
    assert counter.frame_count == 2  # once per call, once with the cache


def test_float8_experts_keep_their_own_cache():
    from titan_moe.float8.experts import Float8RoutedExperts

    fp8 = Float8RoutedExperts.from_experts(_experts())
    assert not fp8.refresh_compute_weights(torch.bfloat16) and fp8.current_fp8_weights() is None


def test_trainer_hook_refreshes_after_every_optimizer_step(caplog):
    """`TitanTrainer._cache_compute_weights` registers a post-step hook: after each
    `optimizer.step()` the experts hold fresh bf16 casts (the first refresh is logged), and
    training under CPU bf16 autocast takes the same steps as without the cache. (The trainer's
    CPU runs compute in fp32, `titan_moe.train.main`, so the hook is driven here directly.)"""
    import logging
    import types

    from titan_moe.train import TitanTrainer

    def train(cache: bool) -> list[torch.Tensor]:
        model = torch.nn.Sequential(_experts(seed=3))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if cache:
            TitanTrainer._cache_compute_weights(types.SimpleNamespace(model_parts=[model], optimizers=opt),
                                                torch.bfloat16)
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model[0](X_MK, OFFS_E).float().square().mean()  # bf16 activations, as autocast's layers give
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            assert (model[0]._valid_weight_cache() is not None) == cache
            if cache:  # fresh: the casts of the weights as the step left them
                assert torch.equal(model[0]._valid_weight_cache()[1], model[0].w_down.detach().bfloat16())
        return losses

    with caplog.at_level(logging.INFO):
        cached = train(cache=True)
    assert sum("cache_compute_weights: 1 routed-expert modules" in r.message for r in caplog.records) == 1
    assert all(torch.equal(a, b) for a, b in zip(cached, train(cache=False)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cached_casts_under_inductor_equal_per_call():
    """On the GPU (the native grouped GEMM, Inductor): the cached casts give the per-call
    path's output and gradients exactly, eager and compiled."""
    experts = _experts(seed=4).cuda()
    x, offs = X_MK.cuda(), OFFS_E.cuda()
    per_call = _fwd_bwd(experts, x, offs)
    compiled = torch.compile(experts, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(compiled, x, offs), per_call))
    assert experts.refresh_compute_weights(torch.bfloat16)
    for got in (_fwd_bwd(experts, x, offs), _fwd_bwd(compiled, x, offs)):
        assert all(torch.equal(a, b) for a, b in zip(got, per_call))


@pytest.mark.parametrize("primed", [True, False])
def test_cache_made_before_the_first_step_compiles_once(primed):
    """The trainer makes the cache before the first training forward
    (`_prime_compute_weight_cache`): a compiled layer then compiles once, not again at step 2
    when the post-step hook's cache first appears (a whole recompile of every layer kind)."""
    import types

    from titan_moe.train import TitanTrainer

    torch._dynamo.reset()
    experts = _experts(seed=5)
    opt = torch.optim.AdamW(experts.parameters(), lr=1e-2)
    trainer = types.SimpleNamespace(model_parts=[torch.nn.Sequential(experts)], optimizers=opt)
    TitanTrainer._cache_compute_weights(trainer, torch.bfloat16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    for step in range(3):
        if primed:
            TitanTrainer._prime_compute_weight_cache(trainer)  # what train_step does first
        compiled(X_MK, OFFS_E).float().square().sum().backward()
        before = experts.w_down.detach().clone()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(before, experts.w_down)  # a real step, then a fresh cache
        assert torch.equal(experts._valid_weight_cache()[1], experts.w_down.detach().bfloat16())
    assert counter.frame_count == (1 if primed else 2)
