"""Tests for the SiTU-GLU activation and the dense SiTU-GLU feed-forward."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

from titan_moe.model.ffn import SiTUGLUFeedForward
from titan_moe.model.situ import situ_glu


def _closed_form(zg, zu, b1, b2):
    """SPEC §6 written with exponentials only (independent of torch.tanh / torch.sigmoid)."""
    tanh = lambda a: (1 - torch.exp(-2 * a)) / (1 + torch.exp(-2 * a))  # noqa: E731
    sig = 1 / (1 + torch.exp(-zg))
    return b1 * tanh(zg / b1) * sig * (b2 * tanh(zu / b2))


def _closed_form_grads(zg, zu, b1, b2):
    """Hand-derived partial derivatives of the hidden activation."""
    sig = torch.sigmoid(zg)
    tg, tu = torch.tanh(zg / b1), torch.tanh(zu / b2)
    d_gate = (1 - tg**2) * sig + b1 * tg * sig * (1 - sig)
    return d_gate * b2 * tu, b1 * tg * sig * (1 - tu**2)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    "shape,scale,b1,b2", [((7, 13), 3.0, 4.0, 25.0), ((2, 3, 17), 30.0, 4.0, 25.0), ((64,), 5.0, 1.5, 2.0)]
)
def test_matches_closed_form_float64(shape, scale, b1, b2):
    gen = torch.Generator().manual_seed(len(shape) * 100 + int(scale))
    zg = (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    zu = (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    out = situ_glu(zg, zu, b1, b2)
    # float64 throughout; the two formulas differ only by rounding (exp form loses a few ulps).
    assert _rel(out, _closed_form(zg.detach(), zu.detach(), b1, b2)) < 1e-12
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    out.backward(g)
    dg, du = _closed_form_grads(zg.detach(), zu.detach(), b1, b2)
    assert _rel(zg.grad, g * dg) < 1e-12
    assert _rel(zu.grad, g * du) < 1e-12


def test_gradcheck():
    gen = torch.Generator().manual_seed(0)
    zg = (4 * torch.randn(5, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    zu = (40 * torch.randn(5, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (zg, zu))
    assert torch.autograd.gradgradcheck(lambda a, b: situ_glu(a, b, 2.0, 3.0), (zg, zu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bounded_by_beta_product(dtype):
    gen = torch.Generator().manual_seed(1)
    extremes = torch.tensor([0.0, 1e-3, -1e-3, 1.0, -1.0, 50.0, -50.0, 1e4, -1e4, 1e30, -1e30, math.inf, -math.inf])
    zg = torch.cat([extremes.repeat_interleave(len(extremes)), 1e3 * torch.randn(4000, generator=gen)]).to(dtype)
    zu = torch.cat([extremes.repeat(len(extremes)), 1e3 * torch.randn(4000, generator=gen)]).to(dtype)
    for b1, b2 in ((4.0, 25.0), (1.0, 1.0), (0.5, 8.0)):
        out = situ_glu(zg, zu, b1, b2)
        assert torch.isfinite(out).all()
        assert out.abs().max().item() <= b1 * b2
    # the bound is approached: large positive gate and large |up|
    big = situ_glu(torch.tensor([200.0]), torch.tensor([-1e3]))
    assert math.isclose(big.item(), -100.0, rel_tol=1e-6)


def test_close_to_swiglu_for_small_inputs():
    gen = torch.Generator().manual_seed(2)
    zg = 0.1 * torch.rand(1000, generator=gen, dtype=torch.float64) * 2 - 0.1
    zu = 0.1 * torch.rand(1000, generator=gen, dtype=torch.float64) * 2 - 0.1
    swiglu = F.silu(zg) * zu
    # beta*tanh(z/beta) = z (1 - (z/beta)^2/3 + ...): |z| <= 0.1, beta1 = 4 gives <= 2.1e-4 relative.
    assert _rel(situ_glu(zg, zu), swiglu) < 2.5e-4
    # and the gap shrinks as beta grows (same inputs, order 1).
    zg = 3 * torch.randn(1000, generator=gen, dtype=torch.float64)
    zu = 3 * torch.randn(1000, generator=gen, dtype=torch.float64)
    swiglu = F.silu(zg) * zu
    errs = [_rel(situ_glu(zg, zu, b, b), swiglu) for b in (10.0, 100.0, 1e4)]
    assert errs[0] > errs[1] > errs[2]
    # (z/beta)^2/3 with |z| up to ~12 and beta = 1e4: about 1e-6.
    assert errs[2] < 1e-5


def test_invalid_beta():
    with pytest.raises(ValueError):
        situ_glu(torch.ones(2), torch.ones(2), beta1=0.0)
    with pytest.raises(ValueError):
        situ_glu(torch.ones(2), torch.ones(3))
    with pytest.raises(ValueError):
        SiTUGLUFeedForward(8, 16, beta2=-1.0)


# --------------------------------------------------------------------------- dense FFN
@pytest.mark.parametrize("shape,dim,hidden", [((3, 5), 16, 24), ((2, 4, 7), 8, 40)])
def test_ffn_matches_manual(shape, dim, hidden):
    torch.manual_seed(3)
    ffn = SiTUGLUFeedForward(dim, hidden, beta1=2.0, beta2=5.0)
    ffn.init_weights(0.5)
    x = torch.randn(*shape, dim)
    wg = ffn.w_gate_up.weight[:hidden]
    wu = ffn.w_gate_up.weight[hidden:]
    ref = _closed_form(x.double() @ wg.double().T, x.double() @ wu.double().T, 2.0, 5.0) @ ffn.w_down.weight.double().T
    out = ffn(x)
    assert out.shape == x.shape
    # fp32 matmuls of width <= 40 against float64.
    assert _rel(out.double(), ref) < 1e-5


def test_ffn_init_on_meta_and_compile():
    with torch.device("meta"):
        ffn = SiTUGLUFeedForward(32, 64)
    ffn.to_empty(device="cpu")
    ffn.init_weights(init_std=0.02)
    for p in ffn.parameters():
        assert torch.isfinite(p).all()
        assert p.abs().max().item() <= 3 * 0.02 + 1e-7
        assert 0.015 < p.std().item() < 0.025  # truncation at 3 sigma keeps the std near 0.02
    x = torch.randn(2, 9, 32, requires_grad=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    out = torch.compile(ffn, backend=counter, fullgraph=True)(x)
    out.sum().backward()
    assert counter.frame_count == 1
    assert torch.allclose(out, ffn(x))


def test_autograd_keeps_only_the_two_pre_activations():
    z = torch.randn(64, 2 * 48, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = situ_glu(z[:, :48], z[:, 48:], 4.0, 25.0)
    assert saved == {z.untyped_storage().data_ptr(): z.untyped_storage().nbytes()}  # the slices' storage
    out.float().square().sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


def test_bf16_gradients_match_float64():
    """The backward recomputes in fp32, so bf16 gradients are the float64 ones rounded once."""
    gen = torch.Generator().manual_seed(3)
    zg64, zu64 = (6 * torch.randn(4096, generator=gen, dtype=torch.float64) for _ in range(2))
    g64 = torch.randn(4096, generator=gen, dtype=torch.float64)
    zg, zu = (x.bfloat16().requires_grad_() for x in (zg64, zu64))
    situ_glu(zg, zu).backward(g64.bfloat16())
    dg, du = _closed_form_grads(zg.detach().double(), zu.detach().double(), 4.0, 25.0)
    g = g64.bfloat16().double()
    assert _rel(zg.grad.double(), g * dg) < 4e-3  # bf16 output rounding: 2^-9 relative
    assert _rel(zu.grad.double(), g * du) < 4e-3


def test_compiled_gradients_equal_eager():
    gen = torch.Generator().manual_seed(5)
    zg, zu = (3 * torch.randn(64, generator=gen) for _ in range(2))
    zg.requires_grad_(), zu.requires_grad_()
    g = torch.randn(64, generator=gen)
    want = torch.autograd.grad(situ_glu(zg, zu), (zg, zu), g)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(situ_glu, backend="aot_eager", fullgraph=True)(zg, zu), (zg, zu), g)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 1e-6


def test_compiled_packed_uses_the_op_backward_and_matches_eager():
    """Compiled `situ_glu_packed`: no graph break, the forward in the graph (Inductor fuses it),
    the backward graph calls `titan_moe::situ_glu_bwd` (one pass; autograd through the two
    slices fused into a kernel that evaluates both branches per element), and the values
    and gradient equal eager's."""
    from torch._dynamo.backends.common import aot_autograd

    from titan_moe.model.situ import situ_glu_packed

    gen = torch.Generator().manual_seed(6)
    z = (3 * torch.randn(8, 2 * 24, generator=gen)).requires_grad_()
    g = torch.randn(8, 24, generator=gen)
    want_out = situ_glu_packed(z)
    (want,) = torch.autograd.grad(want_out, z, g)
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    counter = torch._dynamo.testing.CompileCounterWithBackend(aot_autograd(fw_compiler=capture, bw_compiler=capture))
    got_out = torch.compile(situ_glu_packed, backend=counter, fullgraph=True)(z)
    (got,) = torch.autograd.grad(got_out, z, g)
    assert counter.frame_count == 1 and len(graphs) == 2
    assert _rel(got_out, want_out) < 1e-6 and _rel(got, want) < 1e-6

    def targets(gm):
        return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}

    assert not any("situ" in t for t in targets(graphs[0]))  # forward: plain ops
    assert "titan_moe.situ_glu_bwd.default" in targets(graphs[1])
