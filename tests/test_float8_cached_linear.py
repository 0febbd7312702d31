"""fp8 linear weights cast once per optimizer step (`titan_moe.float8.cached_linear`), on CPU.

torchao's emulate mode runs the fp8 casts for real and the GEMMs in fp32, so the claim under
test, that the cached codes are the ones every per-call cast would make, shows as bit-equal
outputs and gradients.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo.testing
import torchao.float8.float8_linear as torchao_linear
from numerics import rel_err
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import GemmInputRole

from titan_moe.float8 import TitanFloat8LinearConverter
from titan_moe.float8.cached_linear import (
    CachedFloat8Linear,
    cacheable,
    refresh_fp8_linear_weights,
    use_cached_weights,
)

from test_float8 import job_config, single_process


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.GELU(), nn.Linear(48, 16, bias=True))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    convert_to_float8_training(model, config=config)
    assert [type(m) for m in model] == [Float8Linear, nn.GELU, Float8Linear]
    return model


@pytest.fixture
def weight_casts(monkeypatch):
    """Counts the weight casts torchao's linear makes per call."""
    roles = []
    real = torchao_linear.hp_tensor_to_float8_dynamic

    def counting(*args, **kwargs):
        roles.append(kwargs.get("gemm_input_role"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torchao_linear, "hp_tensor_to_float8_dynamic", counting)
    return lambda: sum(r is GemmInputRole.WEIGHT for r in roles)


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    result = [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return result


def test_cached_weights_give_bit_equal_results_without_weight_casts(weight_casts):
    """Before a refresh the module is torchao's (two weight casts per linear per step);
    after it, no weight cast and the same bits; an in-place weight change drops the cache
    (per-call casts again, matching the new weight); `to()` and `load_state_dict` drop it."""
    model = _model()
    assert use_cached_weights(model) == ["0", "2"]
    assert all(isinstance(model[i], CachedFloat8Linear) for i in (0, 2))
    x = torch.randn(4, 8, 32)
    per_call = _fwd_bwd(model, x)
    assert weight_casts() == 4  # two linears x (forward, input gradient)
    assert refresh_fp8_linear_weights([model]) == 2
    cached = _fwd_bwd(model, x)
    assert weight_casts() == 4
    for got, want in zip(cached, per_call):
        assert torch.equal(got, want)
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    assert model[0].current_fp8_weight() is None and model[2].current_fp8_weight() is not None
    changed = _fwd_bwd(model, x)
    assert weight_casts() == 6 and not torch.equal(changed[0], per_call[0])
    refresh_fp8_linear_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(model, x), changed))
    model.load_state_dict(model.state_dict())
    assert model[0].current_fp8_weight() is None
    refresh_fp8_linear_weights(model)
    model.to(torch.float64).to(torch.float32)
    assert model[2].current_fp8_weight() is None


def test_same_as_torchao_under_autocast_shaped_inputs():
    """fp32 weights with bf16 activations (the trainer's autocast case on the GPU): the
    cached path and torchao's give the same bits."""
    ref, model = _model(seed=1), _model(seed=1)
    use_cached_weights(model)
    refresh_fp8_linear_weights(model)
    x = torch.randn(6, 32).bfloat16()
    for got, want in zip(_fwd_bwd(model, x), _fwd_bwd(ref, x)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_under_compile_like_eager():
    """A compiled forward+backward reads the refreshed cache without a graph break (one
    recompile when it appears, none when a refresh replaces it) and equals eager."""
    model = _model(seed=2)
    use_cached_weights(model)
    x = torch.randn(16, 32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(compiled, x), _fwd_bwd(model, x)))
    for _ in range(2):
        with torch.no_grad():
            model[2].weight.add_(0.05)
        refresh_fp8_linear_weights(model)
        assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(compiled, x), _fwd_bwd(model, x)))
    assert counter.frame_count == 2


def test_no_cache_where_one_cast_cannot_serve_every_gemm():
    rowwise = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    tensorwise = Float8LinearConfig.from_recipe_name("tensorwise")
    assert cacheable(tensorwise) and not cacheable(rowwise)
    assert not cacheable(dataclasses.replace(tensorwise, enable_fsdp_float8_all_gather=True))
    model = nn.Sequential(nn.Linear(32, 16, bias=False))
    convert_to_float8_training(model, config=rowwise)
    use_cached_weights(model)
    assert refresh_fp8_linear_weights(model) == 0 and model[0].current_fp8_weight() is None
    with torch.device("meta"):
        meta = _model()
    use_cached_weights(meta)
    assert refresh_fp8_linear_weights(meta) == 0


def test_converter_switch():
    """`cache_weights` swaps the converted linears and its post-optimizer hook refreshes them;
    off by default; refused with a rowwise recipe."""
    from titan_moe.flavors import FLAVORS
    from titan_moe.model.decoder import Decoder

    model = Decoder(dataclasses.replace(FLAVORS["debug"], n_layers=2))
    model.init_weights()
    converter = TitanFloat8LinearConverter(job_config("--quantize.linear.float8.cache_weights"), single_process())
    converter.convert(model)
    cached = [m for m in model.modules() if isinstance(m, CachedFloat8Linear)]
    assert cached and not any(type(m) is Float8Linear for m in model.modules())
    converter.post_optimizer_hook([model])
    assert all(m.current_fp8_weight() is not None for m in cached)

    plain = TitanFloat8LinearConverter(job_config(), single_process())
    assert not plain.cache_weights
    with pytest.raises(ValueError, match="cache_weights needs recipe_name = 'tensorwise'"):
        TitanFloat8LinearConverter(job_config("--quantize.linear.float8.cache_weights",
                                              "--quantize.linear.float8.recipe_name", "rowwise"), single_process())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with fp8 (compute capability >= 8.9)")
def test_cuda_real_fp8_cached_equals_per_call_eager_and_compiled():
    """Real fp8 GEMMs (cuBLAS `_scaled_mm`), fp32 weights and bf16 activations as under the
    trainer's autocast: the cached path equals torchao's per-call path, eagerly and under
    Inductor (fullgraph; there the per-call cast is Inductor's and the cached one eager's, so
equal up to the rounding of the scale)."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(), nn.Linear(512, 128, bias=False)).cuda()
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    model = copy.deepcopy(ref)
    use_cached_weights(model)
    assert refresh_fp8_linear_weights(model) == 2
    x = torch.randn(1024, 256, device="cuda").bfloat16()
    want = _fwd_bwd(ref, x)
    assert all(torch.equal(a, b) for a, b in zip(_fwd_bwd(model, x), want))
    got = _fwd_bwd(torch.compile(model, fullgraph=True), x)
    want_compiled = _fwd_bwd(torch.compile(ref, fullgraph=True), x)
    for a, b in zip(got, want_compiled):
        # Inductor may round the per-call scale's division differently from eager by an ulp
        assert rel_err(a.float(), b.float()) < 1e-3
