"""Tests for the grouped expert GEMM custom ops (``titan_moe::grouped_mm`` and its backward ops)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from titan_moe.ops.grouped_gemm import grouped_mm, grouped_mm_dw_reference, grouped_mm_reference


def _random_offsets(n_groups: int, m: int, gen: torch.Generator, owned_frac: float = 1.0) -> torch.Tensor:
    """int32 cumulative ends for random group sizes that sum to round(owned_frac * m).

    About a third of the groups are forced empty; the rest get random sizes, so most are
    not multiples of 16.
    """
    owned = round(owned_frac * m)
    weights = torch.rand(n_groups, generator=gen)
    weights[torch.rand(n_groups, generator=gen) < 0.33] = 0.0
    if weights.sum() == 0:
        weights[0] = 1.0
    cuts = torch.floor(torch.cumsum(weights, 0) / weights.sum() * owned).to(torch.int64)
    cuts[-1] = owned
    return cuts.to(torch.int32)


def _gather_reference(x_MK, w_EKN, offs_E):
    """Independent formulation: each row picks its group's matrix by index, in float64.

    Rows past offs[-1] are masked to zero. Differentiable in x and w (the gather's
    backward is an index_add, unrelated to the op under test).
    """
    m = x_MK.shape[0]
    rows = torch.arange(m)
    group_of_row = torch.searchsorted(offs_E.to(torch.int64), rows, right=True)
    owned = group_of_row < w_EKN.shape[0]
    w_MKN = w_EKN.double()[group_of_row.clamp(max=w_EKN.shape[0] - 1)]
    out = torch.einsum("mk,mkn->mn", x_MK.double(), w_MKN)
    return out * owned.unsqueeze(1)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# (M, K, N, E, owned fraction): aligned K/N take torch._grouped_mm on CPU, the others the loop.
SHAPES = [
    (64, 16, 32, 4, 1.0),
    (53, 24, 8, 7, 1.0),
    (37, 5, 7, 5, 1.0),  # K, N not 16-byte aligned -> per-group loop
    (70, 16, 12, 6, 0.8),  # trailing rows owned by no group
    (1, 8, 4, 3, 1.0),
]


@pytest.mark.parametrize("m,k,n,e,frac", SHAPES)
def test_forward_and_grads_fp32(m, k, n, e, frac):
    gen = torch.Generator().manual_seed(1000 * m + k)
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(e, k, n, generator=gen, requires_grad=True)
    offs = _random_offsets(e, m, gen, frac)
    out = grouped_mm(x, w, offs)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    ref = _gather_reference(x_ref, w_ref, offs)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # fp32 vs float64 with K <= 24 terms: a few ulps of fp32.
    assert _rel(out, ref) < 1e-6
    assert torch.all(out[int(offs[-1]):] == 0)

    grad = torch.randn(m, n, generator=gen)
    out.backward(grad)
    ref.backward(grad.double())
    assert _rel(x.grad, x_ref.grad) < 1e-6
    assert _rel(w.grad, w_ref.grad) < 1e-6
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert torch.all(w.grad[sizes == 0] == 0)
    assert torch.all(x.grad[int(offs[-1]):] == 0)


@pytest.mark.skipif(torch.__version__ < "2.13", reason="torch._grouped_mm runs on CPU from torch 2.13")
def test_cpu_backend_selection():
    """The shapes above exercise both backends: aligned fp32 takes torch._grouped_mm for the
    forward, dx and dw calls; widths that are not multiples of 4 fp32 elements take the loop."""
    from titan_moe.ops.grouped_gemm.op import _native_ok

    x, w, g = torch.randn(10, 16), torch.randn(3, 16, 32), torch.randn(10, 32)
    assert _native_ok(x, w) and _native_ok(g, w.transpose(1, 2)) and _native_ok(x.t(), g)
    x, w, g = torch.randn(10, 5), torch.randn(3, 5, 7), torch.randn(10, 7)
    assert not _native_ok(x, w) and not _native_ok(g, w.transpose(1, 2)) and not _native_ok(x.t(), g)
    assert not _native_ok(x.double(), w.double())


def test_loop_reference_matches_gather_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(41, 6, generator=gen)
    w = torch.randn(5, 6, 3, generator=gen)
    offs = _random_offsets(5, 41, gen, 0.9)
    assert _rel(grouped_mm_reference(x, w, offs), _gather_reference(x, w, offs)) < 1e-6
    g = torch.randn(41, 3, generator=gen)
    w_ref = w.double().requires_grad_()
    _gather_reference(x, w_ref, offs).backward(g.double())
    assert _rel(grouped_mm_dw_reference(x, g, offs), w_ref.grad) < 1e-6


@pytest.mark.parametrize("k,n", [(16, 32), (12, 20)])
def test_bf16_forward(k, n):
    gen = torch.Generator().manual_seed(k * n)
    m, e = 90, 6
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(e, k, n, generator=gen).bfloat16()
    offs = _random_offsets(e, m, gen)
    out = grouped_mm(x, w, offs)
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, then one bf16 rounding of the output (relative 2^-9 per element).
    assert _rel(out, _gather_reference(x, w, offs)) < 5e-3


def test_empty_inputs():
    w = torch.randn(3, 8, 4, requires_grad=True)
    x = torch.randn(0, 8, requires_grad=True)
    out = grouped_mm(x, w, torch.zeros(3, dtype=torch.int32))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.all(w.grad == 0)
    # rows present but owned by no group
    x = torch.randn(5, 8)
    assert torch.all(grouped_mm(x, w.detach(), torch.zeros(3, dtype=torch.int32)) == 0)


def test_invalid_arguments():
    x, w = torch.randn(10, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(x, w, torch.tensor([4, 10]))
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_mm(torch.randn(10, 6), w, torch.tensor([4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        grouped_mm(x.double(), w.double(), torch.tensor([4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="one entry per group"):
        grouped_mm(x, w, torch.tensor([10], dtype=torch.int32))
    for bad in ([6, 4], [4, 11]):  # decreasing / past M
        for xx, ww in ((x, w), (torch.randn(10, 5), torch.randn(2, 5, 3))):  # native and loop paths
            with pytest.raises(ValueError, match="non-decreasing"):
                grouped_mm(xx, ww, torch.tensor(bad, dtype=torch.int32))


@pytest.mark.parametrize("k,n", [(16, 8), (5, 3)])
def test_opcheck(k, n):
    gen = torch.Generator().manual_seed(7)
    m, e = 29, 4
    x = torch.randn(m, k, generator=gen, requires_grad=True)
    w = torch.randn(e, k, n, generator=gen, requires_grad=True)
    g = torch.randn(m, n, generator=gen)
    offs = _random_offsets(e, m, gen, 0.9)
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm.default, (x, w, offs))
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm_dx.default, (g, w.detach(), offs))
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm_dw.default, (x.detach(), g, offs))


def test_compile_fullgraph_no_graph_break():
    """Offsets computed in-graph from expert ids, as in the MoE layer; forward and backward."""

    def f(x, w, expert_ids):
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.zeros(w.shape[0], dtype=torch.int64).scatter_add_(
            0, expert_ids, torch.ones_like(expert_ids)
        )
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return grouped_mm(x[order], w, offs)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(33, 8, generator=gen, requires_grad=True)
    w = torch.randn(5, 8, 12, generator=gen, requires_grad=True)
    ids = torch.randint(0, 4, (33,), generator=gen)  # expert 4 stays empty
    out = compiled(x, w, ids)
    out.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    f(x, w, ids).square().sum().backward()
    assert counter.frame_count == 1
    assert _rel(gx, x.grad) < 1e-6 and _rel(gw, w.grad) < 1e-6


def test_export():
    class M(torch.nn.Module):
        def forward(self, x, w, offs):
            return grouped_mm(x, w, offs)

    x, w = torch.randn(12, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([3, 3, 12], dtype=torch.int32)
    ep = torch.export.export(M(), (x, w, offs))
    assert any("titan_moe.grouped_mm" in str(n.target) for n in ep.graph.nodes)
    assert torch.allclose(ep.module()(x, w, offs), grouped_mm(x, w, offs))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(64, 128), (24, 40), (20, 36)])
def test_cuda_bf16(k, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(5)
    m, e = 300, 9
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(e, k, n, generator=gen).bfloat16()
    g = torch.randn(m, n, generator=gen).bfloat16()
    offs = _random_offsets(e, m, gen, 0.9)
    xc = x.cuda().requires_grad_()
    wc = w.cuda().requires_grad_()
    out = grouped_mm(xc, wc, offs.cuda())
    out.backward(g.cuda())
    x_ref = x.double().requires_grad_()
    w_ref = w.double().requires_grad_()
    ref = _gather_reference(x_ref, w_ref, offs)
    ref.backward(g.double())
    # fp32 accumulation, one bf16 rounding of each output (relative 2^-9 per element).
    assert _rel(out.cpu(), ref) < 5e-3
    assert _rel(xc.grad.cpu(), x_ref.grad) < 5e-3
    assert _rel(wc.grad.cpu(), w_ref.grad) < 5e-3
    assert torch.all(out[int(offs[-1]):] == 0)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert torch.all(wc.grad.cpu()[sizes == 0] == 0)


@pytest.mark.parametrize("backend", [None, "loop", "fwd=native,dx=loop,dw=native"])
def test_eager_path_equals_the_op(backend, monkeypatch):
    """Eager calls run the ops' functions without the custom-op dispatch: output and both
    gradients equal those through the op (the path under torch.compile)."""
    gen = torch.Generator().manual_seed(11)
    offs = _random_offsets(5, 90, gen, 0.9)
    x = torch.randn(90, 24, generator=gen)
    w = torch.randn(5, 24, 40, generator=gen)
    grad = torch.randn(90, 40, generator=gen)
    results = []
    for compiling in (True, False):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
            out = grouped_mm(xl, wl, offs, backend)
        out.backward(grad)
        results.append((out.detach(), xl.grad, wl.grad))
    for op_tensor, eager_tensor in zip(*results):
        assert torch.equal(op_tensor, eager_tensor)
    only_w = w.clone().requires_grad_()
    grouped_mm(x, only_w, offs, backend).backward(grad)  # x needs no gradient: dw alone
    assert torch.equal(only_w.grad, results[1][2])
