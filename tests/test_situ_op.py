"""`titan_moe::situ_glu` (SiTU-GLU of a fused gate|up projection) and its Triton kernels
against the elementwise reference `situ_glu(z_gate, z_up)` (itself checked against the closed
form in test_situ.py).

Without CUDA the kernels run under the Triton interpreter (fp32 and fp16); with CUDA they
run compiled, plus a bf16 check. Tolerances (relative error): fp32, 1e-6 (the kernels'
tanh is a few ulp from torch.tanh, small arguments included); fp16/bf16 outputs
are the fp32 values rounded once (fp16 5e-4 relative per entry against the fp16 composite;
bf16 against the fp32 reference, 3e-3: one rounding is at most 2^-9 per entry, while the
bf16 composite itself rounds after every op and sits ~4e-3 from both).
"""

from __future__ import annotations

import pytest
import torch
from numerics import rel_err
from triton_mode import interpret_without_gpu, kernel_test_setup, rerun_under_interpreter

CUDA = interpret_without_gpu()

from titan_moe.model.situ import situ_glu, situ_glu_packed  # noqa: E402
from titan_moe.ops import choices  # noqa: E402
from titan_moe.ops.situ import op as situ_op  # noqa: E402
from titan_moe.ops.situ import triton_kernel  # noqa: E402
from titan_moe.ops.triton_runtime import is_interpreted  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(
    CUDA, is_interpreted(triton_kernel._situ_fwd_kernel), "test_in_fresh_interpreter_process"
)
B1, B2 = 4.0, 25.0


def _z(shape, dtype, seed, device="cpu", scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()


def _reference(z):
    hidden = z.shape[-1] // 2
    return situ_glu(z[..., :hidden], z[..., hidden:], B1, B2)


def _check(z, out_tol, grad_tol, seed=0, reference_dtype=None):
    """Output and dz of the op against `_reference` run on z in `reference_dtype` (default
    z's own: the same roundings; fp32 for a bf16 z, whose composite rounds after every op)."""
    gen = torch.Generator().manual_seed(seed)
    z_ref = z.detach().to(reference_dtype or z.dtype).requires_grad_()
    out = situ_glu_packed(z, B1, B2)
    want = _reference(z_ref)
    assert out.dtype == z.dtype and out.shape == want.shape
    assert rel_err(out, want) < out_tol, rel_err(out, want)
    w = torch.randn(out.shape, generator=gen).to(z.device, z.dtype)
    (dz,) = torch.autograd.grad((out * w).sum(), z)
    (dz_ref,) = torch.autograd.grad((want * w.to(want.dtype)).sum(), z_ref)
    assert dz.dtype == z.dtype and dz.shape == z.shape
    assert rel_err(dz, dz_ref) < grad_tol, rel_err(dz, dz_ref)


@pytest.mark.parametrize("shape", [(7, 26), (2, 3, 34)])
def test_op_torch_backend_matches_reference(shape):
    with choices.using(situ="torch"):
        _check(_z(shape, torch.float64, seed=1), 1e-15, 1e-15)


def test_opcheck():
    with choices.using(situ="torch"):
        z = _z((5, 12), torch.float32, seed=2)
        torch.library.opcheck(torch.ops.titan_moe.situ_glu.default, (z, B1, B2))
        torch.library.opcheck(torch.ops.titan_moe.situ_glu_bwd.default, (z.detach(), torch.randn(5, 6), B1, B2))


def test_bad_inputs_and_backend_are_rejected():
    with pytest.raises(ValueError, match="2 \\* hidden"):
        situ_glu_packed(torch.randn(3, 5), B1, B2)
    with pytest.raises(ValueError, match="beta1 and beta2"):
        situ_glu_packed(torch.randn(3, 4), 0.0, B2)
    with pytest.raises(ValueError, match="kernels.situ must be one of"):
        with choices.using(situ="cuda"):
            situ_glu_packed(torch.randn(3, 4), B1, B2)


def test_auto_backend_is_triton_on_cuda_only():
    assert choices.current().situ == "auto"
    assert situ_op.resolve_backend(torch.device("cpu")) == "torch"
    assert situ_op.resolve_backend(torch.device("cuda")) == "triton"
    with choices.using(situ="torch"):
        assert situ_op.resolve_backend(torch.device("cuda")) == "torch"


def test_compiled_layer_path_keeps_eager_results():
    """Under torch.compile `situ_glu_packed` takes the fusible composite; same numbers."""
    z = _z((6, 20), torch.float32, seed=3)
    compiled = torch.compile(lambda t: situ_glu_packed(t, B1, B2), backend="aot_eager", fullgraph=True)
    out_c, out_e = compiled(z), situ_glu_packed(z, B1, B2)
    assert torch.allclose(out_c, out_e, rtol=1e-6, atol=1e-6)
    (g_c,) = torch.autograd.grad(out_c.sum(), z)
    (g_e,) = torch.autograd.grad(out_e.sum(), z)
    assert torch.allclose(g_c, g_e, rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    "shape,dtype,tol",
    [((33, 40), torch.float32, 1e-6), ((3, 5, 130), torch.float32, 1e-6), ((17, 64), torch.float16, 1e-3)],
)
def test_triton_kernels_match_reference(shape, dtype, tol):
    """Element counts not a multiple of the 1024-element block; a [.., 2H] with H = 65."""
    with choices.using(situ="triton"):
        _check(_z(shape, dtype, seed=4, device=DEVICE), tol, tol)


@needs_kernels
def test_triton_kernels_are_accurate_for_small_inputs():
    """|z| ~ 1e-2: tanh(z / 25) ~ 4e-4, where an exponential-form tanh loses ~4 digits."""
    with choices.using(situ="triton"):
        _check(_z((8, 64), torch.float32, seed=7, device=DEVICE, scale=1e-2), 1e-6, 1e-6)


@needs_kernels
def test_triton_kernels_take_large_inputs():
    """Saturated tanh/sigmoid (|z| up to ~100) give finite, exact-limit results."""
    with choices.using(situ="triton"):
        _check(_z((8, 32), torch.float32, seed=5, device=DEVICE, scale=40.0), 1e-6, 1e-6)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_bf16_at_expert_shape():
    with choices.using(situ="triton"):
        _check(_z((8192, 2 * 768), torch.bfloat16, seed=6, device="cuda"), 3e-3, 3e-3, reference_dtype=torch.float32)
