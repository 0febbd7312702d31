"""fp8 quantization kernels (`titan_moe.float8.quantize`) and the fp8 grouped GEMM
(`titan_moe.float8.grouped_mm.fp8_grouped_mm`).

Kernels: without CUDA they run under the Triton interpreter (this module sets
TRITON_INTERPRET=1 before the kernel module is imported; if Triton was imported earlier
without it, `test_in_fresh_interpreter_process` reruns the file in a fresh process). The
interpreter's own fp8 cast rounds wrongly, so interpreted kernels round in fp32 first
(`_e4m3_round`); the compiled path's hardware cast is checked by `test_compiles_for_sm90`
(that it is the round-to-nearest-even instruction) and bit for bit by the GPU test.

Oracles and tolerances:
- Quantization kernels vs their PyTorch references: bit-identical codes (compared as
  bytes, so -0.0 and +0.0 differ) and scales. Both sides do the same correctly rounded fp32
  operations (amax is exact; scale = max(amax, 1e-12) / 448; 1 / scale; x * inv; clamp;
  round to nearest even), so there is no reason for a single bit to differ.
- fp8_grouped_mm vs a float64 per-group reference, relative error ||out - ref|| / ||ref||:
  e4m3 keeps 3 mantissa bits, so one rounding has a relative error of at most 2^-4 and an
  RMS of about 2.5e-2 on Gaussian data; a product of two rounded operands about
  sqrt(2) * 2.5e-2 = 3.5e-2, and a sum of independent such terms the same relative RMS
  (measured here: 3.4e-2 to 3.6e-2 for the forward, dx and the fp8 dw). Bound: 5e-2, and
  at least 1e-2, which shows that the operands really went through fp8 (a bf16 GEMM is at
  ~3e-3). The bf16 weight gradient is one bf16 rounding of x away from float64: 1e-2.
- The CPU path of the GEMM is an EMULATION (dequantize, fp32 matmul per group, round to
  bf16): `test_forward_and_dx_equal_their_quantized_pieces` checks the data flow exactly
  against that emulation fed with the reference quantizations. The GPU test compares the
  real `torch._scaled_grouped_mm` with the emulation: both round the same fp32-accumulated
  sums to bf16 (2^-9 relative), but in a different order and with fast accumulation, so
  1e-2.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_mode import compiled_script_results, interpret_without_gpu, kernel_test_setup, rerun_under_interpreter
import torch
from numerics import rel_err

CUDA = interpret_without_gpu()

from titan_moe.float8 import quantize as fq  # noqa: E402
from titan_moe.float8.grouped_mm import (  # noqa: E402
    _scaled_grouped_gemm,
    _scaled_grouped_gemm_emulated,
    fp8_grouped_mm,
)

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, fq.interpreted(), "test_in_fresh_interpreter_process")
FP8_TOL, FP8_FLOOR, BF16_WGRAD_TOL = 5e-2, 1e-2, 1e-2


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, strides and bytes (fp8 compared as uint8; scales as fp32 values)."""
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return False
    if a.dtype == fq.FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a.cpu(), b.cpu())


def group_offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def randn(*shape, gen, scale=1.0, dtype=torch.bfloat16, device=None):
    return (torch.randn(*shape, generator=gen) * scale).to(device or DEVICE, dtype)


# ---------------------------------------------------------------------------- kernels vs references
@needs_kernels
def test_e4m3_rounding_of_every_code_and_midpoint():
    """Rows whose amax is 448 have scale 1, so the kernel's codes are the plain e4m3
    rounding of the inputs: every finite e4m3 value, every midpoint between neighbours and
    the fp32 values just above and below each midpoint (ties to even, carries into the next
    binade, subnormals, signed zeros)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    values = torch.cat([codes, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0**-10, -(2.0**-10)])])
    values = torch.cat([values, values.new_zeros(-values.numel() % 63)])
    x = torch.cat([values.view(-1, 63), torch.full((values.numel() // 63, 1), 448.0)], 1).to(DEVICE)
    q, scale = fq.quantize_rows_triton(x, block_m=16, block_k=64)
    assert torch.all(scale == 1.0)
    assert same_bits(q, x.clamp(-448, 448).to(fq.FP8_DTYPE))
    assert same_bits(q, fq.quantize_rows_reference(x)[0])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,block_k", [(37, 32, None), (37, 48, None), (9, 16, None), (21, 64, 16)])
def test_rows_kernel_matches_reference(m, k, block_k, dtype):
    """One-pass (K fits a tile) and two-pass (K over several tiles, incl. a partial one)
    variants, M not a multiple of the row block, an all-zero row and huge/tiny rows."""
    gen = torch.Generator().manual_seed(m * k)
    x = randn(m, k, gen=gen, scale=3.0, dtype=dtype)
    x[2] = 0
    x[3] *= 1e-6
    x[4] *= 1e3 if dtype != torch.float16 else 10
    q, scale = fq.quantize_rows_triton(x, block_k=block_k)
    q_ref, scale_ref = fq.quantize_rows_reference(x)
    assert same_bits(q, q_ref) and same_bits(scale, scale_ref)
    assert torch.isfinite(scale).all() and torch.all(q[2].view(torch.uint8) == 0)
    assert scale[2] == fq.EPS / fq.FP8_MAX


@needs_kernels
def test_rows_kernel_scatters_into_padded_rows():
    """dest_M: rows land at their destinations; negative and out-of-range destinations are
    skipped; rows nobody writes stay zero (codes and scales)."""
    gen = torch.Generator().manual_seed(3)
    m, k, p = 29, 48, 45
    x = randn(m, k, gen=gen)
    dest = torch.randperm(p, generator=gen)[:m].to(DEVICE)
    dest[5], dest[6] = -1, p + 3
    q, scale = fq.quantize_rows_triton(x, dest, p)
    q_ref, scale_ref = fq.quantize_rows_reference(x, dest, p)
    assert same_bits(q, q_ref) and same_bits(scale, scale_ref)
    q_plain, scale_plain = fq.quantize_rows_reference(x)
    kept = torch.ones(m, dtype=torch.bool, device=DEVICE)
    kept[5:7] = False
    assert same_bits(q[dest[kept]], q_plain[kept]) and torch.equal(scale[dest[kept]], scale_plain[kept])
    unwritten = torch.ones(p, dtype=torch.bool, device=DEVICE)
    unwritten[dest[kept]] = False
    assert torch.all(q[unwritten].view(torch.uint8) == 0) and torch.all(scale[unwritten] == 0)


@needs_kernels
@pytest.mark.parametrize("e,k,n,layout", [(3, 48, 32, "row"), (2, 20, 37, "row"), (2, 32, 48, "col"), (1, 16, 16, "row")])
def test_weight_kernels_match_reference(e, k, n, layout):
    """Both layouts and scale sets; K and N not multiples of the tiles; an all-zero row and
    an all-zero column; a column-major input read through its strides."""
    gen = torch.Generator().manual_seed(e * k + n)
    w = randn(e, k, n, gen=gen)
    w[0, 1] = 0
    w[-1, :, 2] = 0
    if layout == "col":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    got = fq.quantize_weight_triton(w)
    ref = fq.quantize_weight_reference(w)
    for name, a, b in zip(fq.Fp8Weight._fields, got, ref):
        assert same_bits(a, b), name
    assert got.fwd_EKN.stride() == (k * n, 1, k) and got.dgrad_EKN.is_contiguous()
    assert torch.isfinite(got.scale_fwd_EN).all() and torch.isfinite(got.scale_dgrad_EK).all()
    no_dgrad = fq.quantize_weight_triton(w, dgrad=False)
    assert no_dgrad.dgrad_EKN is None and same_bits(no_dgrad.fwd_EKN, ref.fwd_EKN)


@needs_kernels
@pytest.mark.parametrize("sizes,tail,c,aligned", [
    ([0, 16, 0, 21, 9], 7, 40, False),
    ([5, 30], 0, 16, False),
    ([0, 0], 13, 24, False),
    ([0, 32, 0, 16, 48], 9, 40, True),  # the 16-aligned variant fp8_grouped_mm uses
])
def test_group_columns_kernel_matches_reference(sizes, tail, c, aligned):
    """Empty groups (first, middle, all), group sizes that are not multiples of the row
    block, rows past offs[-1] (zero codes), an all-zero column within a group."""
    gen = torch.Generator().manual_seed(sum(sizes) + c)
    offs = group_offsets(sizes).to(DEVICE)
    m = int(offs[-1]) + tail
    t = randn(m, c, gen=gen, scale=2.0)
    if sizes[-1]:
        t[int(offs[-2]) if len(sizes) > 1 else 0:, 3] = 0
    q, scale = fq.quantize_group_columns_triton(t, offs, offs_aligned=aligned)
    q_ref, scale_ref = fq.quantize_group_columns_reference(t, offs)
    assert same_bits(q, q_ref) and same_bits(scale, scale_ref)
    assert q.stride(0) == 1 and q.stride(1) % 16 == 0 and q.stride(1) >= m
    assert torch.all(q[int(offs[-1]):].view(torch.uint8) == 0)
    assert torch.isfinite(scale).all() and scale.shape == (len(sizes) * c,)


def test_quantize_argument_errors():
    """User mistakes raise ValueError; so does a kernel launcher given a device its kernels
    cannot run on (the meta device never is one)."""
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="dtype"):
        fq.quantize_rows(x.double())
    with pytest.raises(ValueError, match="together"):
        fq.quantize_rows(x, dest_M=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        fq.quantize_rows(x, dest_M=torch.zeros(8, dtype=torch.int32), num_rows=9)
    with pytest.raises(ValueError, match="int32"):
        fq.quantize_group_columns(x, torch.tensor([8]))
    with pytest.raises(ValueError, match=r"\[E, K, N\]"):
        fq.quantize_weight(x)
    with pytest.raises(ValueError, match="run on CUDA"):
        fq.quantize_rows_triton(x.to("meta"))


# ---------------------------------------------------------------------------- the autograd function
def make_case(sizes, tail, k, n, dtype=torch.bfloat16, seed=0, device="cpu"):
    """x [M, K], w [E, K, N] (unit-variance outputs), dy [M, N], offs; M = sum(sizes) + tail.
    The CPU by default: there the GEMM is the emulation (the GPU test covers CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    offs = group_offsets(sizes).to(device)
    m = int(offs[-1]) + tail
    x = randn(m, k, gen=gen, dtype=dtype, device=device)
    w = randn(len(sizes), k, n, gen=gen, scale=k ** -0.5, dtype=dtype, device=device)
    dy = randn(m, n, gen=gen, dtype=dtype, device=device)
    return x, w, dy, offs


def float64_reference(x, w, dy, offs):
    """Per-group float64 forward and its gradients."""
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = w.detach().cpu().double().requires_grad_()
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x64[start:end] @ w64[e]
        start = end
    out.backward(dy.cpu().double())
    return out.detach(), x64.grad, w64.grad


def run_fp8(x, w, dy, offs, wgrad, kernels=None):
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(xl, wl, offs, wgrad=wgrad, kernels=kernels)
    out.backward(dy)
    return out.detach(), xl.grad, wl.grad


@pytest.fixture
def torch_quantization(monkeypatch):
    """The PyTorch references instead of the kernels on the CPU (bit-identical to them, see
    above, and much faster than the interpreter)."""
    monkeypatch.setattr(fq, "kernels_run_on", lambda device: device.type == "cuda" and not fq.interpreted())


# groups of multiples of 16 incl. empty ones, rows past offs[-1]
CASES = [([32, 0, 48, 16, 64, 0, 32, 16], 7, 64, 48), ([16, 0, 64, 32], 0, 32, 96)]


@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_rows"])
@pytest.mark.parametrize("sizes,tail,k,n", CASES)
def test_fp8_grouped_mm_vs_float64(sizes, tail, k, n, wgrad, torch_quantization):
    x, w, dy, offs = make_case(sizes, tail, k, n, seed=k + n)
    out, dx, dw = run_fp8(x, w, dy, offs, wgrad)
    ref, dx_ref, dw_ref = float64_reference(x, w, dy, offs)
    assert out.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert FP8_FLOOR < rel_err(out, ref) < FP8_TOL
    assert FP8_FLOOR < rel_err(dx, dx_ref) < FP8_TOL
    if wgrad != "bf16":
        assert FP8_FLOOR < rel_err(dw, dw_ref) < FP8_TOL
    else:
        assert rel_err(dw, dw_ref) < BF16_WGRAD_TOL
    owned = int(offs[-1])
    assert torch.all(out[owned:] == 0) and torch.all(dx[owned:] == 0)
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    assert torch.all(dw[empty] == 0)


def test_auto_weight_gradient_by_mean_group_size(monkeypatch, torch_quantization):
    """wgrad="auto": exactly "bf16"'s results for groups of at most WGRAD_AUTO_MAX_ROWS rows on
    average, exactly "fp8_rows"' above; the recipe accepts it."""
    from titan_moe.float8 import grouped_mm as fgm
    from titan_moe.float8.experts_recipe import WGRAD_MODES

    assert "auto" in WGRAD_MODES
    assert fgm.resolve_wgrad("auto", 146 * 112, 112) == "bf16"
    assert fgm.resolve_wgrad("auto", fgm.WGRAD_AUTO_MAX_ROWS * 4 + 1, 4) == "fp8_rows"
    assert fgm.resolve_wgrad("fp8", 10, 4) == "fp8"
    x, w, dy, offs = make_case([32, 0, 48, 16], 7, 32, 48, seed=4)  # 103 rows over 4 groups
    for max_rows, want in ((fgm.WGRAD_AUTO_MAX_ROWS, "bf16"), (16, "fp8_rows")):
        monkeypatch.setattr(fgm, "WGRAD_AUTO_MAX_ROWS", max_rows)
        got, expected = run_fp8(x, w, dy, offs, "auto"), run_fp8(x, w, dy, offs, want)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), want
    assert not torch.equal(run_fp8(x, w, dy, offs, "bf16")[2], run_fp8(x, w, dy, offs, "fp8_rows")[2])


def test_fp32_inputs_and_partial_grads(torch_quantization):
    """fp32 x/w (output through bf16, cast back); only x or only w requiring grad."""
    x, w, dy, offs = make_case([16, 32, 0], 5, 32, 16, dtype=torch.float32, seed=1)
    ref, dx_ref, dw_ref = float64_reference(x, w, dy, offs)
    out, dx, dw = run_fp8(x, w, dy, offs, "fp8")
    assert out.dtype == torch.float32 and rel_err(out, ref) < FP8_TOL and rel_err(dw, dw_ref) < FP8_TOL
    xl = x.clone().requires_grad_()
    fp8_grouped_mm(xl, w, offs).backward(dy)
    assert torch.equal(xl.grad, dx)
    wl = w.clone().requires_grad_()
    fp8_grouped_mm(x, wl, offs, wgrad="fp8").backward(dy)
    assert torch.equal(wl.grad, dw)


def test_forward_and_dx_equal_their_quantized_pieces(torch_quantization):
    """The data flow, exactly: forward = GEMM(rows(x), weight fwd layout), dx = GEMM(rows(dy),
    weight dgrad layout^T), fp8 dw = GEMM(group columns(x)^T, group columns(dy))."""
    x, w, dy, offs = make_case([32, 0, 16], 3, 32, 48, seed=2)
    out, dx, dw = run_fp8(x, w, dy, offs, "fp8")
    xq, sx = fq.quantize_rows_reference(x)
    wq = fq.quantize_weight_reference(w)
    dyq, sdy = fq.quantize_rows_reference(dy)
    assert torch.equal(out, _scaled_grouped_gemm_emulated(xq, wq.fwd_EKN, sx, wq.scale_fwd_EN, offs, x.dtype))
    dx_want = _scaled_grouped_gemm_emulated(dyq, wq.dgrad_EKN.transpose(1, 2), sdy, wq.scale_dgrad_EK, offs, x.dtype)
    assert torch.equal(dx, dx_want)
    xc, sxc = fq.quantize_group_columns_reference(x, offs)
    dyc, sdyc = fq.quantize_group_columns_reference(dy, offs)
    assert torch.equal(dw, _scaled_grouped_gemm_emulated(xc.t(), dyc, sxc, sdyc, offs, w.dtype))


def test_fp8_rows_weight_gradient_equals_its_quantized_pieces(torch_quantization):
    """wgrad="fp8_rows", exactly: forward and dx from power-of-two row quantizations, dw =
    GEMM(requantized rows(x)^T, requantized rows(dy)); x is not kept, only the forward's
    own row codes and scales (requantized in the backward)."""
    x, w, dy, offs = make_case([32, 0, 16], 3, 32, 48, seed=2)
    out, dx, dw = run_fp8(x, w, dy, offs, "fp8_rows")
    xq, sx = fq.quantize_rows_reference(x, pow2=True)
    wq = fq.quantize_weight_reference(w)
    dyq, sdy = fq.quantize_rows_reference(dy, pow2=True)
    assert torch.equal(out, _scaled_grouped_gemm_emulated(xq, wq.fwd_EKN, sx, wq.scale_fwd_EN, offs, x.dtype))
    dx_want = _scaled_grouped_gemm_emulated(dyq, wq.dgrad_EKN.transpose(1, 2), sdy, wq.scale_dgrad_EK, offs, x.dtype)
    assert torch.equal(dx, dx_want)
    xc, sxc = fq.requantize_group_columns_reference(xq, sx, offs)
    dyc, sdyc = fq.requantize_group_columns_reference(dyq, sdy, offs)
    assert torch.equal(dw, _scaled_grouped_gemm_emulated(xc.t(), dyc, sxc, sdyc, offs, w.dtype))
    _, _, _, xq_saved, sx_saved = torch.ops.titan_moe.fp8_grouped_mm_fwd(x, w, offs, "fp8_rows", True, True)
    assert torch.equal(xq_saved, xq.view(torch.uint8)) and torch.equal(sx_saved, sx)


@pytest.mark.parametrize("wgrad", ["fp8", "fp8_rows"])
def test_backward_fills_no_zero_gradients_for_the_residuals(wgrad, monkeypatch, torch_quantization):
    """The forward's residual outputs (x's fp8 codes, as uint8, and their scales) are not
    differentiable: autograd hands the backward None for them, not zero tensors it fills
    per call (for "fp8_rows" an [M, K] fill: 0.04 ms at the MoE benchmark's shape), through
    the custom ops and through the eager path alike."""
    import titan_moe.float8.grouped_mm as fgm
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordZeros(TorchDispatchMode):  # sees the ops' calls, not what runs inside them
        def __init__(self):
            super().__init__()
            self.uint8_zeros = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and "zero" in str(func):
                self.uint8_zeros.append((str(func), tuple(out.shape)))
            return out

    x, w, dy, offs = make_case([32, 0, 48], 16, 64, 32, seed=3)
    x.requires_grad_(), w.requires_grad_()
    with monkeypatch.context() as patch:  # the op path, as under torch.compile
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        out = fp8_grouped_mm(x, w, offs, wgrad=wgrad)
    with RecordZeros() as mode:
        out.backward(dy)
    assert mode.uint8_zeros == []
    op_grads = x.grad.clone(), w.grad.clone()

    received = []
    backward = fgm._backward

    def recording_backward(ctx, dy_MN, *unused):
        received.append(unused)
        return backward(ctx, dy_MN, *unused)

    from titan_moe.ops.eager_path import direct_autograd

    monkeypatch.setattr(fgm, "_EagerFp8GroupedMM",
                        direct_autograd("Recording", fgm._fwd_impl, fgm._setup_context, recording_backward))
    x.grad = w.grad = None
    fp8_grouped_mm(x, w, offs, wgrad=wgrad).backward(dy)  # the eager path
    assert received == [(None, None, None, None)]
    assert torch.equal(x.grad, op_grads[0]) and torch.equal(w.grad, op_grads[1])
    # an output that takes no part in the loss: no gradient for it, no error
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    unused = fp8_grouped_mm(x2, w2, offs, wgrad=wgrad)
    (unused[:0].sum() + x2.sum() + 0 * w2.sum()).backward()
    assert torch.equal(x2.grad, torch.ones_like(x2)) and torch.equal(w2.grad, torch.zeros_like(w2))


@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_rows"])
@pytest.mark.parametrize("situ", [None, (4.0, 25.0)])
def test_eager_path_equals_the_ops(wgrad, situ, monkeypatch, torch_quantization):
    """Eager calls run the ops' functions without the custom-op dispatch: output and both
    gradients bit for bit those of the custom ops (the path under torch.compile), with the
    weight quantized in the call or beforehand."""
    if situ is not None and wgrad == "fp8":
        pytest.skip("SiTU-GLU fused needs wgrad bf16 or fp8_rows")
    k = 32
    x, w, dy, offs = make_case([32, 0, 16], 5, k, 48, seed=4)
    if situ is not None:
        x = torch.cat([x, x.flip(0)], dim=1)  # z [M, 2K]
    for w_fp8 in (None, fq.quantize_weight(w)):
        results = []
        for compiling in (True, False):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            with monkeypatch.context() as patch:
                patch.setattr(torch.compiler, "is_compiling", lambda c=compiling: c)
                out = fp8_grouped_mm(xl, wl, offs, wgrad=wgrad, w_fp8=w_fp8, situ=situ)
            out.backward(dy)
            results.append((out.detach(), xl.grad, wl.grad))
        for op_tensor, eager_tensor in zip(*results):
            assert torch.equal(op_tensor, eager_tensor)


def test_no_grad_forward_skips_the_residuals(torch_quantization):
    """Under no_grad the output is the training forward's; the forward op told that no
    gradient is needed builds no dx operand and no fp8 copy of x (empty residuals)."""
    x, w, _, offs = make_case([16, 0, 32], 5, 32, 48, seed=7)
    with torch.no_grad():
        out = fp8_grouped_mm(x, w, offs, wgrad="fp8")
    assert torch.equal(out, run_fp8(x, w, torch.zeros_like(out), offs, "fp8")[0])
    residuals = torch.ops.titan_moe.fp8_grouped_mm_fwd(x, w, offs, "fp8", False, False)[1:]
    assert all(r.numel() == 0 for r in residuals)


@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_rows"])
def test_ops_pass_opcheck(wgrad, torch_quantization):
    """The forward and backward ops: schemas, fake implementations, autograd registration.
    (opcheck's AOT-dispatch check sums every output, which fp8 tensors cannot do on the CPU;
    `test_compiles_fullgraph_like_eager` runs the forward op through AOT autograd instead.)"""
    x, w, dy, offs = make_case([16, 0, 32], 5, 32, 48, seed=5)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.library.opcheck(torch.ops.titan_moe.fp8_grouped_mm_fwd, (xl, wl, offs, wgrad, True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    _, w_dgrad, sw_dgrad, xq_buffer, sx = torch.ops.titan_moe.fp8_grouped_mm_fwd(x, w, offs, wgrad, True, True)
    x_kept = x if wgrad == "bf16" else None
    torch.library.opcheck(torch.ops.titan_moe.fp8_grouped_mm_bwd,
                          (dy, w_dgrad, sw_dgrad, x_kept, xq_buffer, sx, offs, wgrad, True, True, 32, x.dtype, w.dtype))


@pytest.mark.parametrize("wgrad", ["bf16", "fp8"])
def test_prequantized_weight_same_as_per_call(wgrad, torch_quantization):
    """`w_fp8` (the weight quantized beforehand): output, dx and dw bit-equal to quantizing it
    in the call; the weight is then not quantized in the call (counted), opcheck passes on
    the op with the extra operands, and a gradient-free call needs no dx layout."""
    x, w, dy, offs = make_case([16, 0, 32], 5, 32, 48, seed=7)
    want = run_fp8(x, w, dy, offs, wgrad)
    w_fp8 = fq.quantize_weight(w)
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fq, "quantize_weight_reference", lambda *a, **k: calls.append(1))  # must not run
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8_grouped_mm(xl, wl, offs, wgrad=wgrad, w_fp8=w_fp8)
        out.backward(dy)
    assert not calls
    for got, ref in zip((out.detach(), xl.grad, wl.grad), want):
        assert torch.equal(got, ref)
    codes = torch.uint8
    operands = (w_fp8.fwd_EKN.view(codes), w_fp8.scale_fwd_EN, w_fp8.dgrad_EKN.view(codes), w_fp8.scale_dgrad_EK)
    torch.library.opcheck(torch.ops.titan_moe.fp8_grouped_mm_fwd,
                          (x.clone().requires_grad_(), w.clone().requires_grad_(), offs, wgrad, True, True, *operands),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with torch.no_grad():
        assert torch.equal(fp8_grouped_mm(x, w, offs, w_fp8=fq.quantize_weight(w, dgrad=False)), want[0])


@pytest.mark.parametrize("widen_backend", ["torch", "triton"])
def test_prequantized_fp32_weight_with_bf16_activations(widen_backend, torch_quantization):
    """With `w_fp8` the weight may keep its own dtype (fp32 master weights under autocast):
    its gradient comes back in fp32, equal to the bf16 weight gradient cast up (by torch or
    by the widening kernel, the recipe's `widen`), and the output matches the all-bf16 call
    up to the quantization of the unrounded weight."""
    x, w, dy, offs = make_case([32, 16], 0, 32, 16, seed=8)
    w32 = w.float() + 1e-3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(9))
    xl, wl = x.clone().requires_grad_(), w32.clone().requires_grad_()
    out = fp8_grouped_mm(xl, wl, offs, w_fp8=fq.quantize_weight(w32), widen=widen_backend)
    out.backward(dy)
    ref_out, ref_dx, ref_dw = run_fp8(x, w32.bfloat16(), dy, offs, "bf16")
    assert out.dtype == torch.bfloat16 and wl.grad.dtype == torch.float32
    assert torch.equal(wl.grad, ref_dw.float())  # dw reads x and dy only
    assert rel_err(out.detach(), ref_out) < 0.02 and rel_err(xl.grad, ref_dx) < 0.02


def test_widen_argument_chooses_the_fp32_widening(monkeypatch, torch_quantization):
    """`widen` picks the bf16 -> fp32 backend of the fp32 weight's gradient; None leaves it to
    `widen_to_fp32`'s default ("torch"); an unknown name is refused."""
    import titan_moe.float8.grouped_mm as fgm

    seen = []

    def recording_widen(t, backend=None):
        seen.append(backend)
        return t.float()

    monkeypatch.setattr(fgm, "widen_to_fp32", recording_widen)
    x, w, dy, offs = make_case([32, 16], 0, 32, 16, seed=8)
    w32 = w.float()
    for widen, want in (("triton", "triton"), ("torch", "torch"), (None, None)):
        seen.clear()
        wl = w32.clone().requires_grad_()
        fp8_grouped_mm(x, wl, offs, w_fp8=fq.quantize_weight(w32), widen=widen).backward(dy)
        assert seen == [want] and wl.grad.dtype == torch.float32
    with pytest.raises(ValueError, match="widen must be None or one of"):
        fp8_grouped_mm(x, w, offs, widen="cuda")


def test_kernels_argument(monkeypatch):
    """`kernels` names which fp8 GEMMs leave torch._scaled_grouped_mm; None means "auto"
    ("triton" on sm90, else "torch"); unknown names are refused. On the CPU every choice runs
    the emulation (the GPU test compares the kernels)."""
    import titan_moe.float8.grouped_mm as fgm
    from titan_moe.ops import backend

    assert fgm.kernels_choice() == "torch" and fgm.kernels_choice("triton_dw") == "triton_dw"  # "auto" off sm90
    assert fgm.kernels_choice("auto", torch.device("cpu")) == "torch"
    for capability, want in (((9, 0), "triton"), ((8, 9), "torch"), ((10, 0), "torch")):  # measured on sm90 only
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(backend, "_capability", lambda index, c=capability: c)
        assert fgm.kernels_choice("auto", torch.device("cuda", 0)) == want
        assert fgm.kernels_choice("torch", torch.device("cuda", 0)) == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        fgm.kernels_choice("cutlass")
    x, w, _, offs = make_case([16, 16], 0, 32, 16)
    with pytest.raises(ValueError, match="kernels must be None or one of"):
        fp8_grouped_mm(x, w, offs, kernels="cutlass")
    assert fp8_grouped_mm(x, w, offs, kernels="triton_all").shape == (32, 16)  # the emulation on the CPU


def test_prequantized_weight_argument_errors(torch_quantization):
    x, w, _, offs = make_case([16, 16], 0, 32, 16)
    with pytest.raises(ValueError, match="does not belong"):
        fp8_grouped_mm(x, w[:, :, :0].new_zeros(2, 32, 32), offs, w_fp8=fq.quantize_weight(w))
    with pytest.raises(ValueError, match="dx layout"):
        fp8_grouped_mm(x.requires_grad_(), w, offs, w_fp8=fq.quantize_weight(w, dgrad=False))
    with pytest.raises(ValueError, match="share a dtype"):
        fp8_grouped_mm(x, w.float(), offs)


@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_rows"])
def test_compiles_fullgraph_like_eager(wgrad, torch_quantization):
    """`torch.compile(fullgraph=True)` over the fp8 GEMM (the ops are opaque to dynamo): no graph
    break, and output and gradients equal eager's exactly."""
    x, w, dy, offs = make_case([32, 0, 16], 3, 32, 48, seed=6)

    def step(x_MK, w_EKN):
        return fp8_grouped_mm(x_MK, w_EKN, offs, wgrad=wgrad) * 2.0

    assert_compiled_equals_eager(step, x, w, dy)


def assert_compiled_equals_eager(step, x, w, dy):
    """``step(x, w)`` under ``torch.compile(fullgraph=True, backend="aot_eager")`` and eagerly:
    the same output and gradients of x and w, bit for bit."""
    def run(fn):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl)
        out.backward(dy)
        return out.detach(), xl.grad, wl.grad

    torch._dynamo.reset()
    for got, want in zip(run(torch.compile(step, backend="aot_eager", fullgraph=True)), run(step)):
        assert torch.equal(got, want)


SITU = (4.0, 25.0)


def run_fp8_situ(z, w, dy, offs, wgrad):
    zl, wl = z.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(zl, wl, offs, wgrad=wgrad, situ=SITU)
    out.backward(dy)
    return out.detach(), zl.grad, wl.grad


def situ_case(seed):
    """z [M, 2K] (pre-activations of spread 3), w, dy, offs at K = 32, N = 48, a 3-row tail."""
    x, w, dy, offs = make_case([32, 0, 16], 3, 64, 48, seed=seed)
    z = (x.float() * 3).to(x.dtype)
    return z, w[:, :32].contiguous(), dy, offs


@pytest.mark.parametrize("wgrad", ["bf16", "fp8_rows"])
def test_situ_fused_vs_float64(wgrad, torch_quantization):
    """fp8_grouped_mm(z, w, offs, situ=...) = SiTU-GLU(z) @ w: output and both gradients
    within the fp8 tolerance of float64 autograd through SiTU-GLU and the GEMM; z's gradient
    zero on the rows past offs[-1]."""
    from titan_moe.ops.situ import situ_glu_forward_torch

    z, w, dy, offs = situ_case(seed=3)
    out, dz, dw = run_fp8_situ(z, w, dy, offs, wgrad)
    z64 = z.double().requires_grad_()
    hidden64 = situ_glu_forward_torch(z64[:, :32], z64[:, 32:], *SITU)
    ref, dhidden, dw_ref = float64_reference(hidden64, w, dy, offs)  # the GEMM's part
    hidden64.backward(dhidden)  # and SiTU-GLU's: z64.grad
    assert out.dtype == z.dtype and dz.shape == z.shape and dw.dtype == w.dtype
    assert FP8_FLOOR < rel_err(out, ref) < FP8_TOL
    assert FP8_FLOOR < rel_err(dz, z64.grad) < FP8_TOL
    assert rel_err(dw, dw_ref) < (FP8_TOL if wgrad == "fp8_rows" else BF16_WGRAD_TOL)
    assert torch.all(dz[int(offs[-1]):] == 0)


@pytest.mark.parametrize("wgrad", ["bf16", "fp8_rows"])
def test_situ_fused_equals_its_pieces(wgrad, torch_quantization):
    """Exactly: the output is the fp8 GEMM of quantize_situ_rows(z); z's gradient is SiTU-GLU's
    backward of the dx GEMM; the bf16 weight gradient reads the activation recomputed in z's
    dtype, the fp8_rows one the requantized codes of the forward."""
    from titan_moe.ops.situ.op import situ_glu_bwd_op, situ_glu_op

    z, w, dy, offs = situ_case(seed=4)
    out, dz, dw = run_fp8_situ(z, w, dy, offs, wgrad)
    pow2 = wgrad == "fp8_rows"
    hq, sh = fq.quantize_situ_rows_reference(z, *SITU, pow2=pow2)
    wq = fq.quantize_weight_reference(w)
    dyq, sdy = fq.quantize_rows_reference(dy, pow2=pow2)
    assert torch.equal(out, _scaled_grouped_gemm_emulated(hq, wq.fwd_EKN, sh, wq.scale_fwd_EN, offs, z.dtype))
    dh = _scaled_grouped_gemm_emulated(dyq, wq.dgrad_EKN.transpose(1, 2), sdy, wq.scale_dgrad_EK, offs, z.dtype)
    assert torch.equal(dz, situ_glu_bwd_op(z, dh, *SITU))
    if wgrad == "bf16":
        hidden = situ_glu_op(z, *SITU)
        assert torch.equal(dw, torch.ops.titan_moe.grouped_mm_dw(hidden, dy, offs, "loop"))
    else:
        hc, shc = fq.requantize_group_columns_reference(hq, sh, offs)
        dyc, sdyc = fq.requantize_group_columns_reference(dyq, sdy, offs)
        assert torch.equal(dw, _scaled_grouped_gemm_emulated(hc.t(), dyc, shc, sdyc, offs, w.dtype))


@pytest.mark.parametrize("wgrad", ["bf16", "fp8_rows"])
def test_situ_fused_ops_opcheck_and_compile(wgrad, torch_quantization):
    """The op pair with SiTU-GLU fused: opcheck (schema, fake shapes: dx is [M, 2K]) and a
    fullgraph compile equal to eager."""
    z, w, dy, offs = situ_case(seed=5)
    zl, wl = z.clone().requires_grad_(), w.clone().requires_grad_()
    torch.library.opcheck(torch.ops.titan_moe.fp8_grouped_mm_fwd, (zl, wl, offs, wgrad, True, True),
                          dict(situ_beta1=SITU[0], situ_beta2=SITU[1]),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    _, w_dgrad, sw_dgrad, xq, sx = torch.ops.titan_moe.fp8_grouped_mm_fwd(
        z, w, offs, wgrad, True, True, situ_beta1=SITU[0], situ_beta2=SITU[1])
    torch.library.opcheck(torch.ops.titan_moe.fp8_grouped_mm_bwd,
                          (dy, w_dgrad, sw_dgrad, z, xq, sx, offs, wgrad, True, True, 32, z.dtype, w.dtype, *SITU))

    def step(z_M2K, w_EKN):
        return fp8_grouped_mm(z_M2K, w_EKN, offs, wgrad=wgrad, situ=SITU) * 2.0

    assert_compiled_equals_eager(step, z, w, dy)


def test_situ_fused_argument_errors(torch_quantization):
    z, w, _, offs = situ_case(seed=6)
    with pytest.raises(ValueError, match="fp8_rows"):
        fp8_grouped_mm(z, w, offs, wgrad="fp8", situ=SITU)
    with pytest.raises(ValueError, match=r"z \[M, 2K\]"):
        fp8_grouped_mm(z[:, :32], w, offs, situ=SITU)
    with pytest.raises(ValueError, match="beta1 > 0"):
        fp8_grouped_mm(z, w, offs, situ=(0.0, 25.0))


@pytest.mark.parametrize("situ_quant,wgrad", [("0", "bf16"), ("1", "bf16"), ("1", "fp8_rows")])
def test_fused_experts_compile_fullgraph(situ_quant, wgrad, monkeypatch, torch_quantization):
    """`Float8RoutedExperts` on the fused GEMM (recipe gemm "fused": padding, two fp8 GEMMs,
    SiTU-GLU between them or, with `situ_quant`, inside the down GEMM's quantization) under `torch.compile(fullgraph=True)`: eager's output and
    gradients exactly; with fp32 activations (as here) the fused SiTU-GLU gives the unfused
    layer's results exactly too."""
    from titan_moe.float8.experts import Float8RoutedExperts
    from titan_moe.float8.experts_recipe import ExpertsFp8Recipe
    from titan_moe.model.moe import RoutedExperts

    fused_calls = []
    situ_rows = fq.quantize_situ_rows_reference
    monkeypatch.setattr(fq, "quantize_situ_rows_reference", lambda *a, **k: fused_calls.append(1) or situ_rows(*a, **k))
    torch.manual_seed(0)
    experts = RoutedExperts(4, 32, 48, 1.0, 1.0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    fp8_experts = Float8RoutedExperts.from_experts(experts)
    fp8_experts.recipe = ExpertsFp8Recipe(gemm="fused", wgrad=wgrad, situ_quant=situ_quant == "1")
    x = torch.randn(40, 32)
    offs = torch.tensor([10, 10, 25, 37], dtype=torch.int32)  # an empty group, rows past the end

    def run(module):
        xl = x.clone().requires_grad_()
        out = module(xl, offs)
        out.square().sum().backward()
        grads = [xl.grad] + [p.grad.clone() for p in fp8_experts.parameters()]
        fp8_experts.zero_grad(set_to_none=True)
        return [out.detach()] + grads

    torch._dynamo.reset()
    compiled = run(torch.compile(fp8_experts, backend="aot_eager", fullgraph=True))
    eager = run(fp8_experts)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert bool(fused_calls) == (situ_quant == "1")
    fp8_experts.recipe = ExpertsFp8Recipe(gemm="fused", wgrad=wgrad)  # fp32 here: the unfused activation too
    for fused, unfused in zip(eager, run(fp8_experts)):
        assert torch.equal(fused, unfused)


def test_fused_experts_in_latent_moe_aligned_dispatch(monkeypatch, torch_quantization):
    """A LatentMoE with fp8 experts lays its groups out 16-aligned, so the experts pad
    nothing (`groups_aligned=True`); output and every gradient equal those of the same layer
    with packed groups that the experts pad themselves (the same rows of each group go
    through the same fp8 arithmetic)."""
    from titan_moe.float8.experts import Float8RoutedExperts, convert_routed_experts
    from titan_moe.model.args import ModelArgs
    from titan_moe.model.moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(ModelArgs(dim=48, n_routed_experts=5, top_k=2, n_shared_experts=1, moe_latent_dim=32,
                              moe_expert_hidden=16, moe_shared_hidden=16))
    moe.init_weights(0.1)
    convert_routed_experts(moe)
    assert isinstance(moe.experts, Float8RoutedExperts) and moe.experts.group_alignment == 16
    x0 = torch.randn(3, 7, 48)
    calls, results = [], {}
    original = Float8RoutedExperts.forward

    def spy(self, x_RL, offs_E, groups_aligned=False):
        calls.append(groups_aligned)
        return original(self, x_RL, offs_E, groups_aligned)

    monkeypatch.setattr(Float8RoutedExperts, "forward", spy)
    for alignment in (16, 1):
        monkeypatch.setattr(Float8RoutedExperts, "group_alignment", alignment)
        x = x0.clone().requires_grad_()
        moe.zero_grad()
        y = moe(x)
        y.square().sum().backward()
        results[alignment] = [y.detach(), x.grad] + [p.grad.clone() for p in moe.parameters()]
    assert calls == [True, False]
    for got, want in zip(results[16], results[1]):
        assert rel_err(got, want) < 1e-6


def _fp8_experts(seed=0, dtype=torch.float32):
    from titan_moe.float8.experts import Float8RoutedExperts
    from titan_moe.model.moe import RoutedExperts

    torch.manual_seed(seed)
    experts = RoutedExperts(3, 32, 16, 1.0, 1.0)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return Float8RoutedExperts.from_experts(experts.to(dtype))


def test_experts_weight_cache_refresh_use_and_invalidation(monkeypatch, torch_quantization):
    """`refresh_fp8_weights` quantizes both weights once; later forwards quantize none and give
    what per-call quantization gives (bf16 weights: bit-equal); an in-place change of a
    weight (an optimizer step without the hook) drops the cache, as do `to()` and
    `load_state_dict`; the recipe's `cache_weights = false` and the torchao GEMM make none;
    `refresh_fp8_expert_weights` (the converter's post-optimizer hook) finds the modules."""
    from titan_moe.float8.experts import refresh_fp8_expert_weights
    from titan_moe.float8.experts_recipe import ExpertsFp8Recipe

    experts = _fp8_experts(dtype=torch.bfloat16)
    x = torch.randn(48, 32).bfloat16()
    offs = torch.tensor([16, 16, 48], dtype=torch.int32)
    quantized = []
    real = fq.quantize_weight_reference
    monkeypatch.setattr(fq, "quantize_weight_reference", lambda w, dgrad=True: quantized.append(w.shape) or real(w, dgrad))

    def fwd_bwd():
        xl = x.clone().requires_grad_()
        out = experts(xl, offs, groups_aligned=True)
        out.square().sum().backward()
        result = [out.detach(), xl.grad] + [p.grad.clone() for p in experts.parameters()]
        experts.zero_grad(set_to_none=True)
        return result

    per_call = fwd_bwd()
    assert len(quantized) == 2
    assert refresh_fp8_expert_weights([torch.nn.Sequential(experts)]) == 1 and len(quantized) == 4
    for got, want in zip(fwd_bwd(), per_call):
        assert torch.equal(got, want)
    assert len(quantized) == 4  # the cached weights served the forward and the backward
    with torch.no_grad():
        experts.w_down.mul_(1.5)  # bumps the version counter
    fwd_bwd()
    assert len(quantized) == 6 and experts.current_fp8_weights() is None
    experts.refresh_fp8_weights()
    experts.load_state_dict(experts.state_dict())
    assert experts.current_fp8_weights() is None
    experts.refresh_fp8_weights()
    experts.to(torch.float32)
    assert experts.current_fp8_weights() is None
    experts.recipe = ExpertsFp8Recipe(cache_weights=False)
    assert not experts.refresh_fp8_weights() and experts.current_fp8_weights() is None
    experts.recipe = ExpertsFp8Recipe(gemm="torchao")
    assert not experts.refresh_fp8_weights()


def test_experts_weight_cache_under_compile(monkeypatch, torch_quantization):
    """A compiled forward reads the refreshed cache (no graph break, one recompile when the
    cache appears, none when a refresh replaces it) and gives eager's results. fp32 weights
    with bf16 activations (autocast's case) tell the two paths apart: per call the weight is
    quantized from its bf16 copy, from the cache it is quantized from fp32."""
    experts = _fp8_experts(seed=1)
    x = torch.randn(32, 32).bfloat16()
    offs = torch.tensor([16, 16, 32], dtype=torch.int32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=counter, fullgraph=True)
    per_call = compiled(x, offs, groups_aligned=True)
    assert torch.equal(per_call, experts(x, offs, groups_aligned=True))
    for _ in range(2):
        with torch.no_grad():
            experts.w_gate_up.add_(0.1)
        per_call = experts(x, offs, groups_aligned=True)
        experts.refresh_fp8_weights()
        got = compiled(x, offs, groups_aligned=True)
        assert torch.equal(got, experts(x, offs, groups_aligned=True)) and not torch.equal(got, per_call)
    assert counter.frame_count == 2


def test_experts_weight_gradient_switch(monkeypatch, torch_quantization):
    """The recipe's `wgrad` reaches the fused GEMM: the fp8 weight gradients differ from the
    bf16 one by fp8 rounding only (same forward), an unknown value is refused."""
    from titan_moe.float8.experts_recipe import ExpertsFp8Recipe

    x = torch.randn(32, 32).bfloat16()
    offs = torch.tensor([16, 16, 32], dtype=torch.int32)
    grads, outs = {}, {}
    for mode in ("bf16", "fp8", "fp8_rows"):
        experts = _fp8_experts(seed=1)
        experts.recipe = ExpertsFp8Recipe(wgrad=mode)
        outs[mode] = experts(x, offs, groups_aligned=True)
        outs[mode].float().square().sum().backward()
        grads[mode] = experts.w_gate_up.grad
    assert torch.equal(outs["bf16"], outs["fp8"])
    for mode in ("fp8", "fp8_rows"):
        assert not torch.equal(grads[mode], grads["bf16"])
        assert rel_err(grads[mode], grads["bf16"]) < 2 * FP8_TOL
    with pytest.raises(ValueError, match="quantize.grouped_mm.float8.wgrad must be one of"):
        ExpertsFp8Recipe(wgrad="int8")


@needs_kernels
def test_fp8_grouped_mm_through_the_kernels():
    """The autograd function with the Triton kernels doing every quantization (interpreted
    on the CPU): the same results, bit for bit, as with the references."""
    x, w, dy, offs = make_case([16, 0, 32], 5, 32, 32, seed=4, device=DEVICE)
    for wgrad in ("bf16", "fp8", "fp8_rows"):
        got = run_fp8(x, w, dy, offs, wgrad)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fq, "kernels_run_on", lambda device: False)
            want = run_fp8(x, w, dy, offs, wgrad)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_argument_errors():
    x, w, _, offs = make_case([16, 16], 0, 32, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_grouped_mm(x, w, torch.tensor([8, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_grouped_mm(x[:, :24], w[:, :24], offs)
    with pytest.raises(ValueError, match="wgrad"):
        fp8_grouped_mm(x, w, offs, wgrad="fp16")
    with pytest.raises(ValueError, match="share a dtype"):
        fp8_grouped_mm(x.float(), w, offs)
    with pytest.raises(ValueError, match="int32"):
        fp8_grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match="shapes"):
        fp8_grouped_mm(x, w, offs[:1])


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__, also_deselect="compiles_for_sm90")


# ---------------------------------------------------------------------------- GPU code path
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from titan_moe.float8 import quantize as fq

    # Mirror the JIT's specialisation of a real launch: unit strides become constants,
    # pointers and the other strides (multiples of 16 in the model) are 16-aligned.
    def build(fn, types, consts):
        sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
        sig.update({n: "i32" for n in fn.arg_names if n not in types and n not in consts})
        aligned = [n for n in fn.arg_names
                   if sig[n].startswith("*") or (sig[n] == "i32" and n.startswith(("stride", "ld", "M_STORE")))]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        return ("cvt.rn.satfinite.e4m3x2.f32" in ptx, "div.rn.f32" in ptx, "st.global.v4.b32" in ptx,
                "st.global.b8" in ptx)

    common = dict(EPS=fq.EPS, INTERPRETED=False)
    rows = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", dest_ptr="*i64", beta1="fp32", beta2="fp32")
    results = {
        "rows_one_pass": build(fq._rows_kernel, rows, dict(common, K=2048, HAS_DEST=True, BLOCK_M=4, BLOCK_K=2048,
                                                                SITU=False)),
        "rows_two_pass": build(fq._rows_kernel, rows, dict(common, K=7168, HAS_DEST=False, BLOCK_M=2, BLOCK_K=4096,
                                                                SITU=False)),
        "weight_amax": build(fq._weight_amax_kernel, dict(w_ptr="*bf16", scale_col_ptr="*fp32", row_part_ptr="*fp32"),
                             dict(EPS=fq.EPS, K=2048, N=1408, DGRAD=True, BLOCK_K=64, BLOCK_N=128, stride_wn=1)),
        "weight_quant": build(fq._weight_quant_kernel,
                              dict(w_ptr="*bf16", scale_col_ptr="*fp32", row_part_ptr="*fp32", fwd_ptr="*fp8e4nv",
                                   dgrad_ptr="*fp8e4nv", scale_row_ptr="*fp32"),
                              dict(common, K=2048, N=1408, DGRAD=True, NUM_PARTS=11, BLOCK_PARTS=16, BLOCK_K=64,
                                   BLOCK_N=128, stride_wn=1)),
        "group_cols": build(fq._group_cols_kernel,
                            dict(t_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", offs_ptr="*i32"),
                            dict(common, C=2048, ALIGNED=True, BLOCK_M=128, BLOCK_C=64)),
        "rows_pow2": build(fq._rows_kernel, rows, dict(common, K=2048, HAS_DEST=False, BLOCK_M=4, BLOCK_K=2048,
                                                       POW2=True, SITU=False)),
        "rows_situ": build(fq._rows_kernel, rows, dict(common, K=4096, HAS_DEST=False, BLOCK_M=2, BLOCK_K=4096,
                                                       POW2=True, SITU=True)),
        "row_factors": build(fq._group_row_factors_kernel,
                             dict(s_ptr="*fp32", f_ptr="*fp32", group_scale_ptr="*fp32", offs_ptr="*i32"),
                             dict(common, C=2048, BLOCK_M=1024, BLOCK_C=1024)),
        "requant_tiles": build(fq._requant_tiles_kernel, dict(q_ptr="*u8", f_ptr="*fp32", out_ptr="*fp8e4nv"),
                               dict(INTERPRETED=False, C=2048, BLOCK_M=128, BLOCK_C=128)),
        "row_factors_pair": build(fq._group_row_factors_pair_kernel,
                                  dict(sa_ptr="*fp32", fa_ptr="*fp32", group_scale_a_ptr="*fp32", sb_ptr="*fp32",
                                       fb_ptr="*fp32", group_scale_b_ptr="*fp32", offs_ptr="*i32"),
                                  dict(common, C_A=2048, C_B=1408, BLOCK_M=1024, BLOCK_C=1024)),
        "requant_tiles_pair": build(fq._requant_tiles_pair_kernel,
                                    dict(qa_ptr="*u8", fa_ptr="*fp32", out_a_ptr="*fp8e4nv", qb_ptr="*u8",
                                         fb_ptr="*fp32", out_b_ptr="*fp8e4nv"),
                                    dict(INTERPRETED=False, C_A=2048, C_B=1408, BLOCK_M=128, BLOCK_C=128)),
    }
    print("RESULT", repr(results))
    """
)


def test_compiles_for_sm90():
    """The compiled code path (the for loops and the hardware fp8 cast the interpreter never
    takes) builds for sm90 without a GPU, converts with the round-to-nearest-even
    instruction, divides with the correctly rounded one (what the references compute) and
    writes the fp8 codes in 16-byte vectors, never byte by byte (the column-major output of
    the group-column kernel needs its 16-row alignment hint for that)."""
    # name -> (e4m3 RNE cast, div.rn, 16-byte stores, byte stores)
    results = compiled_script_results(_COMPILE_SCRIPT)
    no_codes = ("weight_amax", "row_factors", "row_factors_pair")  # these write none
    codes = {name: r for name, r in results.items() if name not in no_codes}
    assert all(cast and vec and not byte for cast, _, vec, byte in codes.values()), results
    # every kernel that computes scales divides correctly rounded (the requant tiles only shift)
    assert all(div for name, (_, div, _, _) in results.items() if not name.startswith("requant_tiles")), results


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("wgrad", ["bf16", "fp8", "fp8_rows"])
def test_cuda_matches_emulation(wgrad):
    """On the GPU: every quantization kernel bit-identical to its reference (torch's CUDA fp8
    cast rounds to nearest even too), and fp8_grouped_mm (torch._scaled_grouped_mm) against
    the CPU emulation fed with the same fp8 operands, at E=8 with empty groups and a tail."""
    sizes = [256, 0, 128, 512, 64, 0, 320, 16]
    x, w, dy, offs = make_case(sizes, 11, 256, 384, seed=5, device="cuda")
    # references on the CPU: on CUDA torch divides by a Python scalar as a multiply by its
    # reciprocal, one ulp off the correctly rounded amax / 448 (seen on the H200)
    for got, want in zip(fq.quantize_rows_triton(x), fq.quantize_rows_reference(x.cpu())):
        assert same_bits(got, want)
    for got, want in zip(fq.quantize_weight_triton(w), fq.quantize_weight_reference(w.cpu())):
        assert same_bits(got, want)
    for got, want in zip(fq.quantize_group_columns_triton(dy, offs), fq.quantize_group_columns_reference(dy.cpu(), offs.cpu())):
        assert same_bits(got, want)
    dyq, sdy = fq.quantize_rows_triton(dy, pow2=True)
    for got, want in zip((dyq, sdy), fq.quantize_rows_reference(dy.cpu(), pow2=True)):
        assert same_bits(got, want)
    requantized = fq.requantize_group_columns_reference(dyq.cpu(), sdy.cpu(), offs.cpu())
    for got, want in zip(fq.requantize_group_columns_triton(dyq, sdy, offs), requantized):
        assert same_bits(got, want)

    out, dx, dw = run_fp8(x, w, dy, offs, wgrad)
    cpu = [t.cpu() for t in (x, w, dy, offs)]
    out_e, dx_e, dw_e = run_fp8(*cpu, wgrad)  # CPU: references + emulated GEMM
    assert rel_err(out, out_e) < 1e-2 and rel_err(dx, dx_e) < 1e-2 and rel_err(dw, dw_e) < 1e-2
    ref, dx_ref, dw_ref = float64_reference(*cpu)
    assert rel_err(out, ref) < FP8_TOL and rel_err(dx, dx_ref) < FP8_TOL and rel_err(dw, dw_ref) < FP8_TOL
    owned = int(offs[-1])
    assert torch.all(out[owned:] == 0) and torch.all(dx[owned:] == 0)
    assert torch.all(dw[torch.diff(offs, prepend=offs.new_zeros(1)) == 0] == 0)
    # the GEMM wrapper alone, 2d x 3d
    xq, sx = fq.quantize_rows_triton(x)
    wq = fq.quantize_weight_triton(w)
    got = _scaled_grouped_gemm(xq, wq.fwd_EKN, sx, wq.scale_fwd_EN, offs, torch.bfloat16)
    want = _scaled_grouped_gemm_emulated(xq.cpu(), wq.fwd_EKN.cpu(), sx.cpu(), wq.scale_fwd_EN.cpu(), offs.cpu(),
                                         torch.bfloat16)
    assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (9, 0)), reason="needs an sm90 CUDA device")
@pytest.mark.parametrize("wgrad,products", [("bf16", "triton"), ("fp8_rows", "triton"), ("fp8_rows", "triton_dw"),
                                            ("fp8_rows", "triton_all"), ("fp8", "triton_all")])
def test_cuda_triton_fp8_gemm_matches_torch(wgrad, products, monkeypatch):
    """`kernels` (forward and dx, or dw, or all on our fp8 kernels) against
    torch._scaled_grouped_mm: the same fp8 operands, fp32 sums in another order."""
    sizes = [256, 0, 128, 512, 64, 0, 320, 16]
    x, w, dy, offs = make_case(sizes, 11, 256, 384, seed=6, device="cuda")
    want = run_fp8(x, w, dy, offs, wgrad, kernels="torch")
    got = run_fp8(x, w, dy, offs, wgrad, kernels=products)
    for g, t in zip(got, want):
        assert rel_err(g, t) < 5e-3
    owned = int(offs[-1])
    assert torch.all(got[0][owned:] == 0) and torch.all(got[1][owned:] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("wgrad", ["bf16", "fp8_rows"])
def test_cuda_situ_fused_matches_emulation(wgrad):
    """On the GPU, SiTU-GLU fused into the row quantization: the kernel against its reference
    (scales equal with power-of-two rounding, codes within one step), and the whole op against
    the CPU emulation."""
    z, w, dy, offs = situ_case(seed=8)
    q, s = fq.quantize_situ_rows_triton(z.cuda(), *SITU, pow2=True)
    q_ref, s_ref = fq.quantize_situ_rows_reference(z, *SITU, pow2=True)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.all((q.float().cpu() - q_ref.float()).abs() <= q_ref.float().abs() * 2.0 ** -2 + 2.0 ** -9)
    got = run_fp8_situ(z.cuda(), w.cuda(), dy.cuda(), offs.cuda(), wgrad)
    want = run_fp8_situ(z, w, dy, offs, wgrad)
    for g, e in zip(got, want):
        assert rel_err(g, e) < 1e-2


def test_a_process_that_imported_triton_first_takes_the_reference():
    """Triton imported without the interpreter, then TRITON_INTERPRET=1 set, then this module
    imported (what a test session can do): its kernels are interpreted but Triton's tl.max is
    not, so the kernels cannot run on the CPU; the dispatch must take the references (it
    crashed inside the interpreter before `kernel_runs_on` checked Triton's library)."""
    import os
    import subprocess
    import sys

    script = textwrap.dedent(
        """
        import os
        import triton  # noqa: F401  (imported before the variable is set)
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from titan_moe.float8 import quantize as fq
        from titan_moe.ops.triton_runtime import is_interpreted
        x = torch.randn(20, 32)
        assert is_interpreted(fq._rows_kernel) and not fq.kernels_run_on(torch.device("cpu"))
        q, s = fq.quantize_rows(x)
        q_ref, s_ref = fq.quantize_rows_reference(x)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------------------------- SiTU-GLU fused into the row quantization
@needs_kernels
@pytest.mark.parametrize("m,k,block_k,pow2", [(37, 48, None, False), (21, 64, None, True), (9, 80, 32, True)])
def test_situ_rows_kernel_matches_reference(m, k, block_k, pow2):
    """quantize_situ_rows' kernel (SiTU-GLU computed in the quantization, the activation never
    written) against quantize_rows of the fp32 activation: scales equal with power-of-two
    rounding (a few ulp apart without), and codes equal except where the kernel's tanh (a few fp32 ulp from torch's) puts a value on the other
    side of a rounding boundary: then one e4m3 step apart. Rows wider than a tile (two passes)
    and pre-activations large enough to saturate both tanh branches."""
    gen = torch.Generator().manual_seed(m + k)
    z = randn(m, 2 * k, gen=gen, scale=6.0)
    z[3, :k] = 200.0  # gate saturated: |hidden| near beta1 * beta2 * tanh(z_u / beta2)
    z[4] = 0  # an all-zero row: the EPS scale
    beta1, beta2 = 4.0, 25.0
    q, scale = fq.quantize_situ_rows_triton(z, beta1, beta2, pow2=pow2, block_k=block_k)
    q_ref, scale_ref = fq.quantize_situ_rows_reference(z.cpu(), beta1, beta2, pow2=pow2)
    assert q.shape == (m, k) and scale.shape == (m,)
    if pow2:
        assert torch.equal(scale.cpu(), scale_ref) and torch.all(scale_ref == fq.pow2_ceil(scale_ref))
    else:
        torch.testing.assert_close(scale.cpu(), scale_ref, rtol=1e-5, atol=0)
    got, want = q.float().cpu(), q_ref.float()
    differ = got != want
    assert differ.float().mean() < 0.01
    assert torch.all((got - want).abs()[differ] <= want.abs()[differ] * 2.0 ** -2 + 2.0 ** -9)


def test_situ_rows_argument_errors():
    z = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="packed gate"):
        fq.quantize_situ_rows(torch.zeros(4, 5), 4.0, 25.0)
    with pytest.raises(ValueError, match="beta1 and beta2"):
        fq.quantize_situ_rows(z, 0.0, 25.0)
    with pytest.raises(ValueError, match="input dtype"):
        fq.quantize_situ_rows(z.int(), 4.0, 25.0)


# ---------------------------------------------------------------------------- weight gradient from the rows
@needs_kernels
@pytest.mark.parametrize("m,k", [(37, 48), (21, 64)])
def test_rows_kernel_power_of_two_scales(m, k):
    """pow2: the kernel equals the reference bit for bit, every scale is a power of two and
    the largest |code| of each row lies in [224, 448] (zero rows aside; amax / scale is in
    (224, 448], and e4m3 rounds values just above 224 down to it)."""
    gen = torch.Generator().manual_seed(m + k)
    x = randn(m, k, gen=gen, scale=3.0)
    x[2] = 0
    x[3] *= 1e-6
    q, scale = fq.quantize_rows_triton(x, pow2=True, block_k=32)
    q_ref, scale_ref = fq.quantize_rows_reference(x, pow2=True)
    assert same_bits(q, q_ref) and same_bits(scale, scale_ref)
    mantissa, _ = torch.frexp(scale.cpu())
    assert torch.all(mantissa == 0.5)
    top = q.float().abs().amax(1).cpu()
    nonzero = x.float().abs().amax(1).cpu() > 0
    assert torch.all((top[nonzero] >= 224) & (top[nonzero] <= 448))
    assert torch.equal(fq.pow2_ceil(torch.tensor([1.0, 1.5, 2.0, 3.0e-9])),
                       torch.tensor([1.0, 2.0, 2.0, 2.0 ** -28]))


@needs_kernels
@pytest.mark.parametrize("sizes,tail,c,tiles", [([0, 32, 0, 16, 48], 9, 40, None), ([16, 0], 13, 24, None),
                                                 ([64], 0, 16, None), ([0, 32, 0, 16, 48], 9, 40, (64, 32))])
def test_requantize_group_columns_matches_reference_and_bf16_columns(sizes, tail, c, tiles):
    """The requantization kernel against its reference, bit for bit: empty groups, rows past
    offs[-1] (zero codes), rows whose scales differ by 2^12 within a group (their small
    entries land in e4m3's subnormals); with 64-row tiles, tiles that hold rows of several
    groups and of the tail (as the GPU's 128-row tiles do). And its dequantized values
    against the input: each code within one e4m3 rounding of the group-scaled value (half an
    ulp, 2^-4 relative, in the normal range; 2^-10 of the group scale absolute among the
    subnormals, plus the first rounding by rows)."""
    gen = torch.Generator().manual_seed(sum(sizes) + c)
    offs = group_offsets(sizes).to(DEVICE)
    m = int(offs[-1]) + tail
    t = randn(m, c, gen=gen, scale=2.0)
    t[1] *= 2.0 ** -12
    t[5] = 0
    q_rows, s_rows = fq.quantize_rows_reference(t, pow2=True)
    block_m, block_c = tiles or (None, None)
    q, scale = fq.requantize_group_columns_triton(q_rows, s_rows, offs, block_m, block_c)
    q_ref, scale_ref = fq.requantize_group_columns_reference(q_rows, s_rows, offs)
    assert same_bits(q, q_ref) and same_bits(scale, scale_ref)
    assert q.stride(0) == 1 and q.stride(1) % 16 == 0
    assert torch.all(q[int(offs[-1]):].view(torch.uint8) == 0)
    scale_EC = scale.view(len(sizes), c).cpu()
    assert torch.all(scale_EC == scale_EC[:, :1])  # one scale per group
    bounds = torch.cat([offs.new_zeros(1), offs]).tolist()
    for e in range(len(sizes)):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        g = scale_EC[e, 0]
        assert g == s_rows[lo:hi].max().cpu()
        got = q[lo:hi].float().cpu() * g
        want = t[lo:hi].float().cpu()
        assert torch.all((got - want).abs() <= want.abs() * 2.0 ** -3 + g * 2.0 ** -9)


@needs_kernels
@pytest.mark.parametrize("sizes,tail,c_a,c_b", [([0, 32, 0, 16, 48], 9, 40, 24), ([16, 0], 13, 16, 48)])
def test_requantize_pair_equals_two_single_calls(sizes, tail, c_a, c_b):
    """The pair launch (x's and dy's codes of the fp8_rows weight gradient in one pair of
    kernels) gives exactly what two single calls give, and the dispatcher's reference path
    the same."""
    gen = torch.Generator().manual_seed(c_a + c_b)
    offs = group_offsets(sizes).to(DEVICE)
    m = int(offs[-1]) + tail
    a = randn(m, c_a, gen=gen, scale=2.0)
    b = randn(m, c_b, gen=gen, scale=0.5)
    a[3] *= 2.0 ** -10
    qa, sa = fq.quantize_rows_reference(a, pow2=True)
    qb, sb = fq.quantize_rows_reference(b, pow2=True)
    (pa, psa), (pb, psb) = fq.requantize_group_columns_pair_triton(qa, sa, qb, sb, offs)
    for got, want in zip((pa, psa, pb, psb), (*fq.requantize_group_columns_triton(qa, sa, offs),
                                              *fq.requantize_group_columns_triton(qb, sb, offs))):
        assert same_bits(got, want) and got.stride() == want.stride()
    (ra, rsa), (rb, rsb) = fq.requantize_group_columns_pair(qa.cpu(), sa.cpu(), qb.cpu(), sb.cpu(), offs.cpu())
    for got, want in zip((pa, psa, pb, psb), (ra, rsa, rb, rsb)):
        assert same_bits(got, want)
    with pytest.raises(ValueError, match="same rows"):
        fq.requantize_group_columns_pair_triton(qa, sa, qb[:-1], sb[:-1], offs)


def test_requantize_argument_errors():
    q = torch.zeros(8, 16, dtype=fq.FP8_DTYPE)
    offs = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8"):
        fq.requantize_group_columns(q.float(), torch.ones(8), offs)
    with pytest.raises(ValueError, match="fp32"):
        fq.requantize_group_columns(q, torch.ones(7), offs)
    with pytest.raises(ValueError, match="int32"):
        fq.requantize_group_columns(q, torch.ones(8), offs.long())
