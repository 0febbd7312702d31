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


def test_chunk_kda_calls_the_op_when_selected(monkeypatch):
    """By default (and with TITAN_MOE_KDA_PREPARE=fused) chunk_kda(use_qk_l2norm=True,
    gate_in_kernel=True) goes through kda_prepare, with the same result as the composite
    path; with `composite` it does not."""
    from titan_moe.ops.kda import chunk_kda
    from titan_moe.ops.kda import op as kda_op
    from titan_moe.ops.kda.prepare import PREPARE_ENV, fused_prepare_selected

    monkeypatch.delenv(PREPARE_ENV, raising=False)
    assert fused_prepare_selected()
    monkeypatch.setenv(PREPARE_ENV, "composite")
    assert not fused_prepare_selected()
    monkeypatch.setenv(PREPARE_ENV, "single")
    with pytest.raises(ValueError, match=PREPARE_ENV):
        fused_prepare_selected()
    monkeypatch.setenv(PREPARE_ENV, "fused")

    q, k, z, A_log, dt_bias = make_inputs((1, 40, 2, 16), torch.float32, seed=5)
    v = torch.randn(1, 40, 2, 16)
    beta = torch.rand(1, 40, 2)
    calls = []
    monkeypatch.setattr(kda_op, "kda_prepare", lambda *a: calls.append(1) or kda_prepare(*a))
    o, _ = chunk_kda(q, k, v, z, beta, use_qk_l2norm=True, gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert calls == [1]
    q_n, k_n, g = reference(q, k, z, A_log, dt_bias)
    o_ref, _ = chunk_kda(q_n, k_n, v, g, beta)
    assert rel_err(o, o_ref) < 1e-6


# ---------------------------------------------------------------------------------------
# the Triton kernels (interpreted on CPU, compiled on CUDA)
# ---------------------------------------------------------------------------------------
def _triton_fn():
    """Forward and backward through the Triton launchers (the op's autograd wiring, with the
    launchers standing in for the registered kernels)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, z, A_log, dt_bias):
            ctx.save_for_backward(q, k, z, A_log, dt_bias)
            return triton_prepare.kda_prepare_triton(q, k, z, A_log, dt_bias, LB)

        @staticmethod
        def backward(ctx, dq_hat, dk_hat, dg):
            return triton_prepare.kda_prepare_bwd_triton(*ctx.saved_tensors, LB, dq_hat, dk_hat, dg)

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
