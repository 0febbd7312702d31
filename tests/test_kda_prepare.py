"""`titan_moe::kda_prepare` (L2 norm of q/k and the bounded gate as one op) against the
composite references `chunk_torch.l2norm` and `gate.kda_gate` differentiated by autograd.

Without CUDA the Triton kernels run under the interpreter (fp32 and fp16 inputs: the
interpreter is exact enough for elementwise maths and row sums); with CUDA they run compiled,
plus a bf16 check. Tolerances (relative error): the same fp32 maths in another order,
1e-6 (fp64: 1e-12); fp16/bf16 outputs are rounded once to their dtype, half an ulp
(fp16 ~5e-4, bf16 ~4e-3 relative per entry, norms ~half that).
"""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err
from triton_mode import interpret_without_gpu, kernel_test_setup, rerun_under_interpreter

CUDA = interpret_without_gpu()

from titan_moe.ops.kda import kda_gate, l2norm  # noqa: E402
from titan_moe.ops.kda import triton_prepare  # noqa: E402
from titan_moe.ops.kda.prepare import check_prepare_inputs, kda_prepare  # noqa: E402
from titan_moe.ops.kda.triton_fwd import _interpreted  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, _interpreted(), "test_in_fresh_interpreter_process")
LB = -5.0


def make_inputs(shape, dtype, seed, device="cpu", param_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    H, K = shape[-2], shape[-1]
    q, k, z = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    A_log = (torch.randn(H, generator=gen) * 0.5).to(device, param_dtype).requires_grad_()
    dt_bias = torch.randn(H * K, generator=gen).to(device, param_dtype).requires_grad_()
    return q, k, z, A_log, dt_bias


def reference(q, k, z, A_log, dt_bias):
    g_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    return l2norm(q), l2norm(k), kda_gate(z, A_log, dt_bias, LB, output_dtype=g_dtype)


def outputs_and_grads(fn, inputs, seed):
    outs = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=gen).to(o.device, torch.float64) for o in outs]
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights, strict=True))
    return outs, torch.autograd.grad(loss, inputs)


def assert_matches_reference(fn, inputs, out_tol, grad_tol, seed=0):
    got, got_grads = outputs_and_grads(fn, inputs, seed)
    want, want_grads = outputs_and_grads(reference, inputs, seed)
    for name, g, w in zip(("q_hat", "k_hat", "g"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert rel_err(g, w) < out_tol, (name, rel_err(g, w))
    for name, g, w, x in zip(("dq", "dk", "dz", "dA_log", "ddt_bias"), got_grads, want_grads, inputs, strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert rel_err(g, w) < grad_tol, (name, rel_err(g, w))


def _op(q, k, z, A_log, dt_bias):
    return kda_prepare(q, k, z, A_log, dt_bias, LB)


# ---------------------------------------------------------------------------------------
# the op (PyTorch implementation on CPU)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape,dtype,tol",
    [((2, 37, 3, 16), torch.float32, 1e-6), ((2, 37, 3, 16), torch.float64, 1e-12), ((5, 2, 64), torch.float32, 1e-6)],
)
def test_op_matches_composite(shape, dtype, tol):
    """Any leading dims (`[B, T, H, dk]` in training, `[B, H, dk]` in a decode step)."""
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert_matches_reference(_op, make_inputs(shape, dtype, seed=1, param_dtype=param_dtype), tol, tol)


def test_op_bf16_is_the_composite_rounded_once():
    inputs = make_inputs((2, 20, 2, 32), torch.bfloat16, seed=2)
    assert_matches_reference(_op, inputs, 1e-6, 1e-6)  # same fp32 maths, same single rounding


def test_opcheck():
    q, k, z, A_log, dt_bias = make_inputs((1, 9, 2, 16), torch.float32, seed=3)
    torch.library.opcheck(torch.ops.titan_moe.kda_prepare.default, (q, k, z, A_log, dt_bias, LB))
    d = [torch.randn(1, 9, 2, 16) for _ in range(3)]
    saved = [x.detach() for x in (q, k, z, A_log, dt_bias)]  # no double backward
    torch.library.opcheck(torch.ops.titan_moe.kda_prepare_bwd.default, (*saved, LB, *d))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.titan_moe.kda_prepare.default, (q, k, z, A_log, dt_bias, LB, cu, True))
    torch.library.opcheck(torch.ops.titan_moe.kda_prepare_bwd.default, (*saved, LB, *d, cu, True))


def test_bad_inputs_are_rejected():
    q, k, z, A_log, dt_bias = make_inputs((1, 4, 2, 8), torch.float32, seed=4)
    with pytest.raises(ValueError, match="share one"):
        check_prepare_inputs(q, k[..., :4], z, A_log, dt_bias, LB)
    with pytest.raises(ValueError, match="A_log"):
        check_prepare_inputs(q, k, z, A_log[:1], dt_bias, LB)
    with pytest.raises(ValueError, match="dt_bias"):
        check_prepare_inputs(q, k, z, A_log, dt_bias[:3], LB)
    with pytest.raises(ValueError, match="lower_bound"):
        check_prepare_inputs(q, k, z, A_log, dt_bias, -6.0)


def test_chunk_kda_calls_the_op_in_eager_mode(monkeypatch):
    """In eager mode chunk_kda(use_qk_l2norm=True, gate_in_kernel=True) goes through
    kda_prepare, with the same result as the composite path (what compiled layers run)."""
    from titan_moe.ops.kda import chunk_kda
    from titan_moe.ops.kda import op as kda_op

    q, k, z, A_log, dt_bias = make_inputs((1, 40, 2, 16), torch.float32, seed=5)
    v = torch.randn(1, 40, 2, 16)
    beta = torch.rand(1, 40, 2)
    calls = []
    monkeypatch.setattr(kda_op, "kda_prepare", lambda *a, **kw: calls.append(kw) or kda_prepare(*a, **kw))
    o, _ = chunk_kda(q, k, v, z, beta, use_qk_l2norm=True, gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert calls == [{"cu_seqlens": None, "chunk_cumsum": True}]
    q_n, k_n, g = reference(q, k, z, A_log, dt_bias)
    o_ref, _ = chunk_kda(q_n, k_n, v, g, beta)
    assert rel_err(o, o_ref) < 1e-6


def test_chunk_kda_with_the_cumsum_in_the_op_has_the_composites_gradients():
    """The eager path hands the core op G (`g_cumsum`) and gets dG back, which kda_prepare's
    backward reverse-sums: every input's gradient equals the composite path's (the maps of
    `chunk_torch.prepare_qkg`, then the core op on g, as compiled layers run it), packed
    sequences and a final state included."""
    from titan_moe.ops.kda import chunk_kda
    from titan_moe.ops.kda.chunk_torch import prepare_qkg

    gen = torch.Generator().manual_seed(11)
    q, k, z, A_log, dt_bias = make_inputs((1, 150, 2, 16), torch.float64, seed=11, param_dtype=torch.float64)
    v = torch.randn(1, 150, 2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    beta = torch.rand(1, 150, 2, generator=gen, dtype=torch.float64).requires_grad_()
    h0 = torch.randn(3, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
    cu = torch.tensor([0, 10, 75, 150])
    w_o = torch.randn(1, 150, 2, 8, generator=gen, dtype=torch.float64)
    w_ht = torch.randn(3, 2, 16, 8, generator=gen, dtype=torch.float64)
    leaves = (q, k, v, z, beta, A_log, dt_bias, h0)
    results = {}
    for mode in ("fused", "composite"):
        if mode == "fused":
            o, ht = chunk_kda(q, k, v, z, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                              use_qk_l2norm=True, gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        else:
            q_n, k_n, g = prepare_qkg(q, k, z, use_qk_l2norm=True, gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, lower_bound=-5.0)
            o, ht = chunk_kda(q_n, k_n, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        results[mode] = (o, ht, torch.autograd.grad((o * w_o).sum() + (ht * w_ht).sum(), leaves))
    for name, got, want in zip(("o", "ht"), results["fused"][:2], results["composite"][:2]):
        assert rel_err(got, want) < 1e-12, name
    names = ("dq", "dk", "dv", "dz", "dbeta", "dA_log", "ddt_bias", "dh0")
    for name, got, want in zip(names, results["fused"][2], results["composite"][2], strict=True):
        assert rel_err(got, want) < 1e-10, (name, rel_err(got, want))


def _chunk_cumsum_reference(x, bounds, reverse=False, C=64):
    """Per sequence of the flattened `[tokens, ...]` x, per chunk of C tokens, a Python loop."""
    flat = x.reshape(-1, *x.shape[2:]).double()
    out = torch.zeros_like(flat)
    for start, end in zip(bounds[:-1], bounds[1:]):
        for c0 in range(start, end, C):
            block = flat[c0:min(c0 + C, end)]
            out[c0:c0 + len(block)] = block.flip(0).cumsum(0).flip(0) if reverse else block.cumsum(0)
    return out.view(x.shape)


@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_local_cumsum_matches_a_loop(reverse):
    from titan_moe.ops.kda.chunk_torch import chunk_local_cumsum

    x = torch.randn(2, 130, 3, 4, generator=torch.Generator().manual_seed(12))
    want = _chunk_cumsum_reference(x, [0, 130, 260], reverse)
    assert rel_err(chunk_local_cumsum(x, reverse=reverse), want) < 1e-6
    packed = x.reshape(1, 260, 3, 4)
    cu = torch.tensor([0, 3, 3, 200, 260])
    want = _chunk_cumsum_reference(packed, cu.tolist(), reverse)
    assert rel_err(chunk_local_cumsum(packed, cu, reverse=reverse), want) < 1e-6


def _chunked_reference(cu_seqlens):
    def fn(q, k, z, A_log, dt_bias):
        q_n, k_n, g = reference(q, k, z, A_log, dt_bias)
        from titan_moe.ops.kda.chunk_torch import chunk_local_cumsum

        return q_n, k_n, chunk_local_cumsum(g, cu_seqlens)

    return fn


@pytest.mark.parametrize("shape,cu", [((2, 70, 3, 16), None), ((1, 150, 2, 32), [0, 5, 70, 150])])
def test_op_chunk_cumsum_matches_composite(shape, cu):
    """`chunk_cumsum=True`: G = chunk-local cumsum of the gate (chunks from each sequence
    start), its backward reverse-sums dG: the composite's outputs and gradients."""
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    inputs = make_inputs(shape, torch.float32, seed=13)
    got, got_grads = outputs_and_grads(lambda *a: kda_prepare(*a, LB, cu_seqlens=cu_t, chunk_cumsum=True), inputs, 31)
    want, want_grads = outputs_and_grads(_chunked_reference(cu_t), inputs, 31)
    for name, g, w in zip(("q_hat", "k_hat", "G", "dq", "dk", "dz", "dA_log", "ddt_bias"),
                          (*got, *got_grads), (*want, *want_grads), strict=True):
        assert rel_err(g, w) < 1e-5, (name, rel_err(g, w))
    with pytest.raises(ValueError, match="chunk_cumsum needs"):
        kda_prepare(*(x[0] for x in inputs[:3]), *inputs[3:], LB, chunk_cumsum=True)
    with pytest.raises(ValueError, match="only used with chunk_cumsum"):
        kda_prepare(*inputs, LB, cu_seqlens=torch.tensor([0, shape[1]]))
    if shape[0] == 1:
        with pytest.raises(ValueError, match="int32/int64"):
            kda_prepare(*inputs, LB, cu_seqlens=torch.tensor([0.0, shape[1]]), chunk_cumsum=True)


# ---------------------------------------------------------------------------------------
# the Triton kernels (interpreted on CPU, compiled on CUDA)
# ---------------------------------------------------------------------------------------
def _triton_fn(cu_seqlens=None, chunk_cumsum=False):
    """Forward and backward through the Triton launchers (the op's autograd wiring, with the
    launchers standing in for the registered kernels)."""
    extra = (cu_seqlens, chunk_cumsum)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, z, A_log, dt_bias):
            ctx.save_for_backward(q, k, z, A_log, dt_bias)
            return triton_prepare.kda_prepare_triton(q, k, z, A_log, dt_bias, LB, *extra)

        @staticmethod
        def backward(ctx, dq_hat, dk_hat, dg):
            return triton_prepare.kda_prepare_bwd_triton(*ctx.saved_tensors, LB, dq_hat, dk_hat, dg, *extra)

    return Fn.apply


@needs_kernels
@pytest.mark.parametrize(
    "shape,dtype,out_tol,grad_tol",
    [
        ((2, 45, 3, 32), torch.float32, 1e-6, 1e-6),  # tokens not a multiple of the 32-token block
        ((1, 33, 2, 24), torch.float32, 1e-6, 1e-6),  # dk not a power of two (masked channels)
        ((3, 2, 64), torch.float32, 1e-6, 1e-6),  # decode-step shape [B, H, dk]
        ((1, 40, 2, 64), torch.float16, 1e-3, 1e-3),
    ],
)
def test_triton_kernels_match_composite(shape, dtype, out_tol, grad_tol):
    inputs = make_inputs(shape, dtype, seed=6, device=DEVICE)
    assert_matches_reference(_triton_fn(), inputs, out_tol, grad_tol)


@needs_kernels
@pytest.mark.parametrize("shape,cu", [((2, 70, 3, 32), None), ((1, 150, 2, 24), [0, 5, 70, 150])])
def test_triton_kernels_chunk_cumsum_match_composite(shape, cu, monkeypatch):
    """Chunk mode: the forward's norms in token blocks, then the gate and its cumsum G per
    chunk (cut at sequence ends) and 64 channels (dk 24: one masked block); the backward's
    one program per chunk reverse-sums dG in registers; at 1 and 2 warps too (tuning)."""
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    inputs = make_inputs(shape, torch.float32, seed=14, device=DEVICE)
    got, got_grads = outputs_and_grads(_triton_fn(cu_t, True), inputs, 41)
    want, want_grads = outputs_and_grads(_chunked_reference(cu_t), inputs, 41)
    for name, g, w in zip(("q_hat", "k_hat", "G", "dq", "dk", "dz", "dA_log", "ddt_bias"),
                          (*got, *got_grads), (*want, *want_grads), strict=True):
        assert rel_err(g, w) < 1e-5, (name, rel_err(g, w))
    monkeypatch.setenv(triton_prepare.CHUNK_WARPS_ENV, "2")
    assert triton_prepare.chunk_warps() == 2
    grads_2 = outputs_and_grads(_triton_fn(cu_t, True), inputs, 41)[1]
    for g, w in zip(grads_2, got_grads, strict=True):
        assert rel_err(g, w) < 1e-6


def test_chunk_warps_switch(monkeypatch):
    """The backward's chunk-mode warps: default 8, a power of two <= 16, else refused."""
    monkeypatch.delenv(triton_prepare.CHUNK_WARPS_ENV, raising=False)
    assert triton_prepare.chunk_warps() == 8
    for bad in ("3", "32", "8x8"):
        monkeypatch.setenv(triton_prepare.CHUNK_WARPS_ENV, bad)
        with pytest.raises(ValueError, match=triton_prepare.CHUNK_WARPS_ENV):
            triton_prepare.chunk_warps()


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_registered_op_bf16():
    """The registered CUDA kernels behind `kda_prepare`, bf16 at the small_1gpu head shape."""
    inputs = make_inputs((1, 4096, 8, 128), torch.bfloat16, seed=7, device="cuda")
    assert_matches_reference(_op, inputs, 4e-3, 4e-3)
