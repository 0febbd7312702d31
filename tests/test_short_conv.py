"""KDA's short convolution: the training form (recomputing autograd) against the plain one."""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err

from titan_moe.model.short_conv import short_conv_silu, short_conv_silu_reference


def _doc_ids(B: int, T: int, cuts: list[int]) -> torch.Tensor:
    doc_ids = torch.zeros(B, T, dtype=torch.int32)
    for cut in cuts:
        doc_ids[:, cut:] += 1
    return doc_ids


@pytest.mark.parametrize("T, K, cuts", [(9, 4, []), (9, 4, [3, 4]), (2, 4, [1]), (17, 3, [5, 11]), (6, 1, [])])
def test_matches_the_plain_form_float64(T, K, cuts):
    gen = torch.Generator().manual_seed(T * 10 + K)
    x = torch.randn(2, T, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, K, generator=gen, dtype=torch.float64, requires_grad=True)
    doc_ids = _doc_ids(2, T, cuts) if cuts else None
    g = torch.randn(2, T, 6, generator=gen, dtype=torch.float64)
    got = short_conv_silu(x, w, doc_ids)
    got.backward(g)
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want, _ = short_conv_silu_reference(x, w, doc_ids, None)
    want.backward(g)
    assert rel_err(got, want) < 1e-12
    assert rel_err(dx, x.grad) < 1e-12 and rel_err(dw, w.grad) < 1e-12
    assert torch.autograd.gradcheck(lambda a, b: short_conv_silu(a, b, doc_ids), (x, w))


def test_keeps_only_the_input_and_taps_for_backward():
    x = torch.randn(1, 64, 96, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 4, requires_grad=True)
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = short_conv_silu(x, w, _doc_ids(1, 64, [20]))
    assert y.dtype == torch.bfloat16
    assert {x.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()} <= saved and len(saved) == 3  # + doc ids
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("with_docs", [False, True])
def test_compiled_gradients_equal_eager(with_docs):
    """Traced by Dynamo (aot_eager), the autograd function gives the eager gradients (torch
    2.11 once gave zeros here: a no-op cast at the end of the forward)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 12, 6, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, requires_grad=True)
    doc_ids = _doc_ids(2, 12, [5]) if with_docs else None
    g = torch.randn(2, 12, 6, generator=gen)
    want = torch.autograd.grad(short_conv_silu(x, w, doc_ids), (x, w), g)
    torch._dynamo.reset()
    compiled = torch.compile(short_conv_silu, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x, w, doc_ids), (x, w), g)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-6
