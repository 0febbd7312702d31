"""`titan_moe::kda_chunk_fwd_kept` / `kda_chunk_bwd_kept` and `chunk_kda` under the
`kda_keep` choice (the backward reads the forward's intermediates).

On the CPU the ops' PyTorch implementations return empty residuals and recompute, so here
the checks are the op contract (opcheck), the choice, the wiring in `chunk_kda` and compile;
the kernels' kept pair is checked bit for bit against the recomputing pair in
test_kda_triton.py (interpreter) and test_kda_triton_op.py (adapters), and on the GPU below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_moe.ops import choices
from titan_moe.ops.kda import chunk_kda, keep_selected

CUDA = torch.cuda.is_available()


def _inputs(T=70, H=2, dk=16, dv=8, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(1, T, H, dv, generator=gen)
    g = -5 * torch.rand(1, T, H, dk, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(2, H, dk, dv, generator=gen)
    out = [x.to(device, dtype if i < 3 else torch.float32) for i, x in enumerate((q, k, v, g, beta, h0))]
    return [x.requires_grad_() for x in out]


def _loss_and_grads(leaves, cu, keep: bool):
    q, k, v, g, beta, h0 = leaves
    with choices.using(kda_keep=keep):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    loss = o.float().square().sum() + ht.square().sum()
    return loss, torch.autograd.grad(loss, leaves)


def test_keep_choice():
    assert keep_selected()  # the default
    with choices.using(kda_keep=False):
        assert not keep_selected()
    assert keep_selected()


def test_chunk_kda_calls_the_kept_op_only_when_recording(monkeypatch):
    """kda_keep and grad recorded: the kept op (its backward gives the recomputing op's
    gradients); under no_grad: the plain op, as for inference and export."""
    calls = []
    for name in ("kda_chunk_fwd", "kda_chunk_fwd_kept"):
        real = getattr(torch.ops.titan_moe, name)
        monkeypatch.setattr(torch.ops.titan_moe, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    leaves = _inputs()
    cu = torch.tensor([0, 20, 70], dtype=torch.int32)
    loss_keep, grads_keep = _loss_and_grads(leaves, cu, True)
    loss_plain, grads_plain = _loss_and_grads(leaves, cu, False)
    assert calls == ["kda_chunk_fwd_kept", "kda_chunk_fwd"]
    assert torch.equal(loss_keep, loss_plain)
    for a, b in zip(grads_keep, grads_plain, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        chunk_kda(*(x.detach() for x in leaves[:5]))
    assert calls[-1] == "kda_chunk_fwd"


def test_opcheck():
    q, k, v, g, beta, h0 = _inputs()
    cu = torch.tensor([0, 20, 70], dtype=torch.int32)
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_fwd_kept, (q, k, v, g, beta, 0.25, h0, cu, True))
    outs = torch.ops.titan_moe.kda_chunk_fwd_kept(*(x.detach() for x in (q, k, v, g, beta)), 0.25, None, None, False)
    assert len(outs) == 10 and all(r.numel() == 0 for r in outs[2:])  # the CPU keeps nothing
    args = [x.detach() for x in (q, k, v, g, beta)]
    do, dht = torch.randn_like(v), torch.randn(2, *h0.shape[1:])
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_bwd_kept,
                          (*args, 0.25, h0.detach(), cu, do.detach(), dht, *outs[2:]))
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_fwd_kept, (q, k, v, g, beta, 0.25, h0, cu, True, True))
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_bwd_kept,
                          (*args, 0.25, h0.detach(), cu, do.detach(), dht, *outs[2:], True))


def test_compiles_without_graph_break():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    leaves = _inputs(seed=1)
    cu = torch.tensor([0, 33, 70], dtype=torch.int32)

    def f(q, k, v, g, beta, h0):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return o.square().sum() + ht.square().sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    assert not counters["graph_break"]
    loss_ref, grads_ref = _loss_and_grads(leaves, cu, False)
    assert torch.allclose(loss, loss_ref, rtol=1e-6)
    for a, b in zip(grads, grads_ref, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_cuda_bf16_kept_equals_recomputing(compiled):
    """bf16 at dk = dv = 128 over packed sequences: the kept forward's residuals (shapes
    from the fake implementation when compiled) give the recomputing backward's gradients."""
    leaves = _inputs(T=1000, H=4, dk=128, dv=128, seed=2, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32, device="cuda")
    loss_ref, grads_ref = _loss_and_grads(leaves, cu, False)
    if compiled:
        torch._dynamo.reset()

        def f(q, k, v, g, beta, h0):
            o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
            return o.float().square().sum() + ht.square().sum()

        loss = torch.compile(f, fullgraph=True)(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        tol = dict(rtol=1e-3, atol=1e-3)  # Inductor's own reductions around the op
        assert torch.allclose(loss, loss_ref, **tol)
        for a, b in zip(grads, grads_ref, strict=True):
            assert torch.allclose(a.float(), b.float(), **tol)
    else:
        loss, grads = _loss_and_grads(leaves, cu, True)
        assert torch.equal(loss, loss_ref)
        for a, b in zip(grads, grads_ref, strict=True):
            assert torch.equal(a, b)
