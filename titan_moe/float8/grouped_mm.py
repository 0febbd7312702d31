"""Differentiable fp8 (e4m3, rowwise-scaled) grouped GEMM around ``torch._scaled_grouped_mm``.

``fp8_grouped_mm(x_MK, w_EKN, offs_E, *, wgrad="bf16") -> out_MN`` has the contract of
:func:`titan_moe.ops.grouped_gemm.grouped_mm`: x [M, K] rows sorted by group, w [E, K, N],
offs_E [E] int32 cumulative group ends, ``out[rows of e] = x[rows of e] @ w[e]``, rows at or
past ``offs[-1]`` zero (and their gradient zero), output in x's dtype. On top of that:

* every ``offs[e]`` must be a multiple of 16 (``torch._scaled_grouped_mm``'s rule; callers
  pad, e.g. with :func:`titan_moe.float8.experts.pad_groups`). Checked with a ValueError on
  the CPU, where the emulation reads ``offs`` anyway; on CUDA not checked (a host sync),
  unless the debug variable ``TITAN_MOE_FP8_CHECK_OFFSETS=1`` adds a device-side assert
  (no sync; a violation aborts the CUDA context at the next synchronizing call);
* K and N multiples of 16, x and w of one dtype in bf16 / fp16 / fp32.

Data flow (quantization kernels in :mod:`titan_moe.float8.quantize`, all fused, no host sync):

* forward: ``xq, sx = quantize_rows(x)`` (scale per row over K); the weight is quantized
  once, by one pair of kernels, into the forward operand (column-major per expert, scales
  [E, N] over K) and the dx operand (row-major, scales [E, K] over N);
  ``out = scaled_gemm(xq, w_fwd, sx, sw_fwd)``.
  Saved for the backward: the dx operand and its scales (fp8: 1 byte per weight), and for
  the weight gradient either x itself (``wgrad="bf16"``), x quantized per group and
  column (``wgrad="fp8"``: 1 byte per element instead of 2; the row-quantized x is not
  kept), or (``wgrad="fp8_rows"``) the row-quantized x, whose scales are then powers of
  two, re-expressed per group with one scale per group (a pass over its 1-byte codes).
* backward: ``dyq, sdy = quantize_rows(dy)``; ``dx = scaled_gemm(dyq, w_dgrad^T, sdy, sw_dgrad)``.
  ``wgrad="bf16"``: ``dw[e] = x[rows of e]^T @ dy[rows of e]`` in x's dtype with fp32
  accumulation (``torch.ops.titan_moe.grouped_mm_dw``: ``torch._grouped_mm`` on CUDA, the
  reference loop on the CPU). ``wgrad="fp8"``: x and dy quantized per (group, column), then
  the 2d x 2d scaled grouped GEMM ``x^T [K, M] @ dy [M, N] -> [E, K, N]``.
  ``wgrad="fp8_rows"``: the same GEMM on dyq and x's saved codes re-expressed per group.
* ``situ=(beta1, beta2)`` (the experts' down projection): x is SiTU-GLU's packed input
  ``z [M, 2K]``; the forward quantizes the activation by rows straight from z
  (``quantize_situ_rows``: the bf16 activation is neither written nor read), the backward
  turns dx into z's gradient with SiTU-GLU's backward (z is saved) and, for
  ``wgrad="bf16"``, recomputes the activation for dw.

The GEMM itself is :func:`_scaled_grouped_gemm`: on CUDA our Triton fp8 kernels or
``torch._scaled_grouped_mm`` per product (``kernels``, :func:`kernels_choice`; by default ours
for the forward and dx on sm90, torch's for the weight gradient; bf16 output, fast
accumulation); on the CPU an EMULATION (dequantize to fp32, one fp32 matmul per
group, round to bf16 like the GPU's output) so the whole function runs and is tested on the
CPU. The CPU numbers therefore check the quantization and the data flow, not the GPU GEMM.

Memory: the saved dx operand costs ``E*K*N`` bytes per call (kept from the forward instead
of quantizing ``w`` again in the backward, which would cost a read of 2 and a write of 1
byte per weight). Forward and backward are ``torch.library`` ops (``titan_moe::fp8_grouped_mm_fwd``
/ ``_bwd``, fake implementations, ``register_autograd``): ``torch.compile`` calls them as
opaque nodes (tracing into the Triton launches failed under dynamo). Eager calls run the same
two functions and autograd wiring without the custom-op dispatch (``_EagerFp8GroupedMM``),
which cuts the host's Python time per call.

Status: the CUDA path matches the emulation (``test_cuda_matches_emulation``, every
weight-gradient mode), the quantization kernels match their references bit for bit. With the
weights quantized in the call, the per-call weight quantization costs about what fp8 saves on
the GEMMs; with ``w_fp8`` (quantized once per optimizer step) the call is faster than bf16.
``Float8RoutedExperts`` uses it by default (:mod:`titan_moe.float8.experts`; ``gemm = "fused"``
in :mod:`titan_moe.float8.experts_recipe`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from titan_moe.float8.experts_recipe import KERNELS, WGRAD_MODES
from titan_moe.float8.quantize import (
    Fp8Weight,
    quantize_group_columns,
    quantize_rows,
    quantize_situ_rows,
    quantize_weight,
    requantize_group_columns_pair,
)
from titan_moe.float8.widen import BACKENDS as WIDEN_BACKENDS
from titan_moe.float8.widen import widen_to_fp32
from titan_moe.ops import launch_env
from titan_moe.ops.backend import is_sm90
from titan_moe.ops.eager_path import direct_autograd, takes_direct_path
from titan_moe.ops.triton_runtime import cuda_capability
from titan_moe.ops.grouped_gemm.reference import group_bounds
from titan_moe.ops.situ.op import situ_glu_bwd_op, situ_glu_op

ALIGNMENT = 16  # group sizes, K and N: multiples of this
FP8 = torch.float8_e4m3fn
CHECK_OFFSETS_ENV = "TITAN_MOE_FP8_CHECK_OFFSETS"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------
# the scaled grouped GEMM: one place for the torch._scaled_grouped_mm contract
# ----------------------------------------------------------------------------------------
def _scaled_grouped_gemm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs_E: Tensor,
                         out_dtype: torch.dtype, widen: str = "", kernels: str = "") -> Tensor:
    """Grouped GEMM of fp8 operands with dequantization scales, fp32 accumulation.

    Two cases (``out`` in ``out_dtype``, computed in bf16 and cast):

    * 2d x 3d (forward, dx): a [M, K] row-major, b [E, K, N] column-major per group,
      scale_a [M], scale_b [E, N]: ``out[rows of e] = (a * sa)[rows of e] @ (b[e] * sb[e])``,
      [M, N], rows past ``offs[-1]`` zero.
    * 2d x 2d (fp8 weight gradient): a [K, M] row-major, b [M, N] column-major, scale_a
      [E*K], scale_b [E*N] (flattened per group):
      ``out[e] = (a[:, rows of e] * sa[e]) @ (b[rows of e] * sb[e])``, [E, K, N], empty
      groups zero. The flattened scale layout follows torchao 0.18's call; torch 2.11 on the
      H200 accepts it and matches the emulation (``test_cuda_matches_emulation``). The
      contracted M must be a multiple of 16 there (callers pass the buffers' padded rows).

    CUDA: ``torch._scaled_grouped_mm(..., out_dtype=torch.bfloat16, use_fast_accum=True)``
    plus zeroing of what it leaves unwritten, then :func:`to_dtype` (``widen``: its fp32
    widening backend). ``kernels`` (:func:`kernels_choice`) moves products to our Triton
    kernels: :func:`titan_moe.ops.grouped_gemm.triton_kernel.scaled_grouped_mm_triton` (2d x
    3d) and ``scaled_grouped_mm_dw_triton`` (2d x 2d), which write every row and group
    themselves, the latter fp32 directly. CPU: :func:`_scaled_grouped_gemm_emulated`.
    """
    if a.device.type != "cuda":
        return _scaled_grouped_gemm_emulated(a, b, scale_a, scale_b, offs_E, out_dtype)
    triton_products = kernels_choice(kernels, a.device)
    if triton_products != "torch":
        from titan_moe.ops.grouped_gemm import triton_kernel as tk

        if b.dim() == 3 and triton_products in ("triton", "triton_all"):
            return to_dtype(tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b.contiguous(), offs_E), out_dtype, widen)
        if b.dim() == 2 and triton_products in ("triton_dw", "triton_all"):
            direct = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
            dw = tk.scaled_grouped_mm_dw_triton(a.t(), b, scale_a, scale_b, offs_E, out_dtype=direct)
            return dw.to(out_dtype)
    out = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs_E, out_dtype=torch.bfloat16,
                                   use_fast_accum=True)
    return to_dtype(_zero_unwritten(out, offs_E), out_dtype, widen)


def kernels_choice(kernels: str = "", device: torch.device | None = None) -> str:
    """Which fp8 GEMMs run on our Triton kernels instead of ``torch._scaled_grouped_mm``:
    ``kernels`` if given, else "auto". One of :data:`titan_moe.float8.experts_recipe.KERNELS`:
    "torch" (none), "triton" (forward and dx), "triton_dw" (the fp8 weight gradient),
    "triton_all"; "auto" resolves to "triton" on an sm90 ``device`` (measured faster there at
    every benchmark shape), else "torch" (not measured elsewhere)."""
    choice = kernels or "auto"
    if choice not in KERNELS:
        raise ValueError(f"fp8_grouped_mm: kernels must be one of {KERNELS}, got {choice!r}")
    if choice == "auto":
        # the rule of the kernels' own sm90 defaults (tiles and TMA loads were measured there)
        return "triton" if device is not None and is_sm90(device) else "torch"
    return choice


def to_dtype(t_bf16: Tensor, dtype: torch.dtype, widen: str = "") -> Tensor:
    """A GEMM's bf16 result in ``dtype``: bf16 -> fp32 (the fp32 expert weights' gradients)
    through :func:`titan_moe.float8.widen.widen_to_fp32` with backend ``widen`` ("": "torch";
    "triton": one vectorized pass instead of ATen's casting copy); other casts through ``.to``."""
    if t_bf16.dtype == dtype:
        return t_bf16
    if t_bf16.dtype == torch.bfloat16 and dtype == torch.float32:
        return widen_to_fp32(t_bf16, widen or None)
    return t_bf16.to(dtype)


def _zero_unwritten(out: Tensor, offs_E: Tensor) -> Tensor:
    """Rows past ``offs[-1]`` (2d result) or empty groups' matrices (3d result) set to zero,
    by kernels that touch only those (the grouped GEMMs leave them unwritten)."""
    from titan_moe.ops.grouped_gemm.zero_fill import zero_empty_groups_, zero_rows_past_

    out = out.contiguous()
    return zero_rows_past_(out, offs_E) if out.dim() == 2 else zero_empty_groups_(out, offs_E)


def _scaled_grouped_gemm_emulated(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs_E: Tensor,
                                  out_dtype: torch.dtype) -> Tensor:
    """CPU EMULATION of :func:`_scaled_grouped_gemm` (same arguments and result): operands
    dequantized to fp32 (``q.float() * scale``), one fp32 matmul per group, rounded to bf16
    (the GPU path's output dtype), then cast to ``out_dtype``. Reads ``offs`` on the host."""
    E = offs_E.shape[0]
    if b.dim() == 3:
        M, N = a.shape[0], b.shape[2]
        a32 = a.float() * scale_a.unsqueeze(1)
        out = torch.zeros(M, N, dtype=torch.float32, device=a.device)
        for e, (start, end) in enumerate(group_bounds(offs_E, M)):
            if end > start:
                out[start:end] = a32[start:end] @ (b[e].float() * scale_b[e].unsqueeze(0))
    else:
        K, M, N = a.shape[0], a.shape[1], b.shape[1]
        sa_EK, sb_EN = scale_a.view(E, K), scale_b.view(E, N)
        out = torch.zeros(E, K, N, dtype=torch.float32, device=a.device)
        for e, (start, end) in enumerate(group_bounds(offs_E, M)):
            if end > start:
                a_e = a[:, start:end].float() * sa_EK[e].unsqueeze(1)
                out[e] = a_e @ (b[start:end].float() * sb_EN[e].unsqueeze(0))
    return out.to(torch.bfloat16).to(out_dtype)


# ----------------------------------------------------------------------------------------
# weight gradient
# ----------------------------------------------------------------------------------------
def _wgrad_high_precision(x_MK: Tensor, dy_MN: Tensor, offs_E: Tensor) -> Tensor:
    """``dw[e] = x[rows of e]^T @ dy[rows of e]`` in x's dtype, fp32 accumulation: the
    grouped GEMM op's dw (``torch._grouped_mm`` on CUDA; the reference loop on the CPU)."""
    # registered by titan_moe.ops.grouped_gemm (imported with its `reference` module above)
    backend = None if x_MK.is_cuda else "loop"
    return torch.ops.titan_moe.grouped_mm_dw(x_MK, dy_MN.to(x_MK.dtype), offs_E, backend)


def _wgrad_fp8(xq_MK: Tensor, sx_EK: Tensor, dyq_MN: Tensor, sdy_EN: Tensor, offs_E: Tensor,
               out_dtype: torch.dtype, widen: str = "", kernels: str = "") -> Tensor:
    """fp8 weight gradient from x and dy quantized per group (column-major ``[M, C]`` codes,
    scales ``[E*C]``, as :func:`quantize_group_columns` and :func:`requantize_group_columns`
    return them): a 2d x 2d scaled grouped GEMM."""
    return _scaled_grouped_gemm(_all_buffer_rows(xq_MK).t(), _all_buffer_rows(dyq_MN), sx_EK, sdy_EN, offs_E, out_dtype,
                                widen, kernels)


def _all_buffer_rows(q_MC: Tensor) -> Tensor:
    """The column-major ``[M, C]`` fp8 view widened to its buffer's ``ld`` rows (M rounded up
    to 16): ``torch._scaled_grouped_mm`` wants the contracted dimension of a 2d x 2d product
    divisible by 16. Rows at or past ``offs_E[-1]`` (the widened ones included) belong to no
    group, so the GEMM never reads them."""
    return _column_buffer(q_MC).t()


# ----------------------------------------------------------------------------------------
# the op pair and its autograd (custom ops, so torch.compile treats them as opaque calls)
# ----------------------------------------------------------------------------------------
def _none_to_empty(t: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """Custom ops return tensors only: an absent output is an empty [0] tensor."""
    return like.new_empty(0, dtype=dtype) if t is None else t


def _column_buffer(q_MC: Tensor) -> Tensor:
    """The whole ``[C, ld]`` buffer behind a column-major fp8 ``[M, C]`` view (strides
    ``(1, ld)``, ``ld`` = M rounded up to 16, as ``quantize_group_columns`` returns)."""
    ld = q_MC.stride(1)
    return q_MC.as_strided((q_MC.shape[1], ld), (ld, 1))


def _padded_rows(m):
    return -(-m // ALIGNMENT) * ALIGNMENT


def _fwd_impl(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, wgrad: str, needs_dx: bool,
              needs_dw: bool, wq_fwd_EKN: Tensor | None = None, sw_fwd_EN: Tensor | None = None,
              wq_dgrad_EKN: Tensor | None = None, sw_dgrad_EK: Tensor | None = None, situ_beta1: float = 0.0,
              situ_beta2: float = 0.0, widen: str = "",
              kernels: str = "") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward of :func:`fp8_grouped_mm`. Returns ``(out [M, N], w_dgrad [E, K, N],
    sw_dgrad [E, K] fp32, xq, sx)``: the output and what the backward needs (the weight's dx
    operand if ``needs_dx``; if ``needs_dw``, x's fp8 codes for the weight gradient: with
    ``wgrad`` "fp8", quantized per group and column, ``xq`` the ``[K, ld]`` column buffer and
    ``sx`` ``[E*K]``; with "fp8_rows", the forward's own row codes ``[M, K]`` and their power-of-two
    scales ``[M]``, which the backward re-expresses per group: once per backward, not again in
    an activation-checkpoint recompute), empty ``[0]`` tensors where not needed.
    With ``wq_*`` / ``sw_*`` (a weight quantized beforehand, :func:`fp8_grouped_mm`'s
    ``w_fp8``, both layouts) the weight is not quantized here and no dx operand is returned:
    the backward reads the given one (``wq_dgrad_EKN``, ``sw_dgrad_EK``, needed with ``needs_dx``).
    The fp8 codes cross the op boundary as uint8 (the same bytes): generic checks and
    tooling that touch outputs (opcheck, AOT autograd) have no fp8 kernels on the CPU.
    With ``situ_beta1 > 0`` x_MK is the packed SiTU-GLU pre-activation ``z [M, 2K]`` and the
    GEMM's left operand is its activation, quantized by rows straight from z. ``widen``:
    the bf16 -> fp32 widening backend (:func:`to_dtype`; "" the environment's default);
    ``kernels``: which products run on our Triton kernels (:func:`kernels_choice`)."""
    _check_offsets(offs_E, x_MK.shape[0])
    if situ_beta1 > 0 and wgrad == "fp8":
        raise ValueError('fp8_grouped_mm_fwd: SiTU-GLU fused needs wgrad "bf16" or "fp8_rows"')
    if situ_beta1 > 0:
        xq_MK, sx_M = quantize_situ_rows(x_MK, situ_beta1, situ_beta2, pow2=wgrad == "fp8_rows")
    else:
        xq_MK, sx_M = quantize_rows(x_MK, pow2=wgrad == "fp8_rows")
    if wq_fwd_EKN is None:
        wq: Fp8Weight = quantize_weight(w_EKN, dgrad=needs_dx)
    else:
        wq = Fp8Weight(wq_fwd_EKN.view(FP8), sw_fwd_EN, None, None)
    out_MN = _scaled_grouped_gemm(xq_MK, wq.fwd_EKN, sx_M, wq.scale_fwd_EN, offs_E, x_MK.dtype, widen, kernels)
    xq_buffer = sx_EK = None
    if needs_dw and wgrad == "fp8":
        del xq_MK, sx_M
        xq_col_MK, sx_EK = quantize_group_columns(x_MK, offs_E, offs_aligned=True)
        xq_buffer = _column_buffer(xq_col_MK)
    elif needs_dw and wgrad == "fp8_rows":
        xq_buffer, sx_EK = xq_MK, sx_M  # re-expressed per group in the backward
    codes, f32 = torch.uint8, torch.float32
    w_dgrad = None if wq.dgrad_EKN is None else wq.dgrad_EKN.view(codes)
    xq_buffer = None if xq_buffer is None else xq_buffer.view(codes)
    return (out_MN, _none_to_empty(w_dgrad, x_MK, codes), _none_to_empty(wq.scale_dgrad_EK, x_MK, f32),
            _none_to_empty(xq_buffer, x_MK, codes), _none_to_empty(sx_EK, x_MK, f32))


_fwd_op = torch.library.custom_op("titan_moe::fp8_grouped_mm_fwd", mutates_args=())(_fwd_impl)


@_fwd_op.register_fake
def _(x_MK, w_EKN, offs_E, wgrad, needs_dx, needs_dw, wq_fwd_EKN=None, sw_fwd_EN=None, wq_dgrad_EKN=None,
      sw_dgrad_EK=None, situ_beta1=0.0, situ_beta2=0.0, widen="", kernels=""):
    M, (E, K, N) = x_MK.shape[0], w_EKN.shape
    fp8, f32 = torch.uint8, torch.float32  # fp8 codes as uint8
    empty = functools.partial(x_MK.new_empty, 0)
    dgrad_out = needs_dx and wq_fwd_EKN is None
    if needs_dw and wgrad == "fp8":
        xq, sx = x_MK.new_empty(K, _padded_rows(M), dtype=fp8), x_MK.new_empty(E * K, dtype=f32)
    elif needs_dw and wgrad == "fp8_rows":
        xq, sx = x_MK.new_empty(M, K, dtype=fp8), x_MK.new_empty(M, dtype=f32)
    else:
        xq, sx = empty(dtype=fp8), empty(dtype=f32)
    return (
        x_MK.new_empty(M, N),
        x_MK.new_empty(E, K, N, dtype=fp8) if dgrad_out else empty(dtype=fp8),
        x_MK.new_empty(E, K, dtype=f32) if dgrad_out else empty(dtype=f32),
        xq,
        sx,
    )


def _bwd_impl(dy_MN: Tensor, w_dgrad_EKN: Tensor, sw_dgrad_EK: Tensor, x_MK: Tensor | None, xq_buffer: Tensor,
              sx_EK: Tensor, offs_E: Tensor, wgrad: str, needs_dx: bool, needs_dw: bool, K: int,
              x_dtype: torch.dtype, w_dtype: torch.dtype, situ_beta1: float = 0.0,
              situ_beta2: float = 0.0, widen: str = "", kernels: str = "") -> tuple[Tensor, Tensor]:
    """Backward of :func:`fp8_grouped_mm` from ``_fwd_op``'s residuals (x itself for
    ``wgrad == "bf16"`` or with SiTU-GLU). Returns ``(dx [M, K], dw [E, K, N])``, empty ``[0]``
    where not needed; with ``situ_beta1 > 0`` dx is the gradient of z, ``[M, 2K]``: the
    activation's gradient through SiTU-GLU's backward, and the bf16 weight gradient reads
    the activation recomputed from z."""
    w_dgrad_EKN, xq_buffer = w_dgrad_EKN.view(FP8), xq_buffer.view(FP8)
    dy_MN = dy_MN.to(x_dtype).contiguous()
    dx_MK = dw_EKN = None
    from_rows = needs_dw and wgrad == "fp8_rows"
    if needs_dx or from_rows:
        dyq_MN, sdy_M = quantize_rows(dy_MN, pow2=wgrad == "fp8_rows")
    situ = (situ_beta1, situ_beta2) if situ_beta1 > 0 else None
    if needs_dx:
        dx_MK = _scaled_grouped_gemm(dyq_MN, w_dgrad_EKN.transpose(1, 2), sdy_M, sw_dgrad_EK, offs_E, x_dtype, widen,
                                     kernels)
        if situ:
            dx_MK = situ_glu_bwd_op(x_MK, dx_MK, *situ)
    if needs_dw:
        if from_rows:  # xq_buffer: x's row codes [M, K], sx_EK: their row scales [M]
            (xq_MK, sx_EK), (dyq_col_MN, sdy_EN) = requantize_group_columns_pair(xq_buffer, sx_EK, dyq_MN, sdy_M,
                                                                                 offs_E)
            dw_EKN = _wgrad_fp8(xq_MK, sx_EK, dyq_col_MN, sdy_EN, offs_E, w_dtype, widen, kernels)
        elif wgrad == "fp8":
            xq_MK = xq_buffer[:, : dy_MN.shape[0]].t()
            dyq_col_MN, sdy_EN = quantize_group_columns(dy_MN, offs_E, offs_aligned=True)
            dw_EKN = _wgrad_fp8(xq_MK, sx_EK, dyq_col_MN, sdy_EN, offs_E, w_dtype, widen, kernels)
        else:
            lhs_MK = situ_glu_op(x_MK, *situ) if situ else x_MK
            dw_EKN = to_dtype(_wgrad_high_precision(lhs_MK, dy_MN, offs_E), w_dtype, widen)
    return _none_to_empty(dx_MK, dy_MN, x_dtype), _none_to_empty(dw_EKN, dy_MN, w_dtype)


_bwd_op = torch.library.custom_op("titan_moe::fp8_grouped_mm_bwd", mutates_args=())(_bwd_impl)


@_bwd_op.register_fake
def _(dy_MN, w_dgrad_EKN, sw_dgrad_EK, x_MK, xq_buffer, sx_EK, offs_E, wgrad, needs_dx, needs_dw, K, x_dtype,
      w_dtype, situ_beta1=0.0, situ_beta2=0.0, widen="", kernels=""):
    (M, N), E = dy_MN.shape, offs_E.shape[0]
    dx_cols = 2 * K if situ_beta1 > 0 else K
    return (dy_MN.new_empty(M, dx_cols, dtype=x_dtype) if needs_dx else dy_MN.new_empty(0, dtype=x_dtype),
            dy_MN.new_empty(E, K, N, dtype=w_dtype) if needs_dw else dy_MN.new_empty(0, dtype=w_dtype))


def _setup_context(ctx, inputs, output):
    # all 14 arguments: the op fills in its defaults, the eager path is given every one
    (x_MK, w_EKN, offs_E, wgrad, needs_dx, needs_dw, wq_fwd_EKN, _, wq_dgrad_EKN, sw_dgrad_given_EK,
     situ_beta1, situ_beta2, widen, kernels) = inputs
    _, w_dgrad_EKN, sw_dgrad_EK, xq_buffer, sx_EK = output
    ctx.mark_non_differentiable(*output[1:])
    # no zero-filled gradients for the residual outputs: with "fp8_rows" x's codes alone are
    # [M, K] (a 134 MB fill, 0.04 ms per call on the H200 at M = 65,536, K = 2048)
    ctx.set_materialize_grads(False)
    if wq_fwd_EKN is not None:  # a weight quantized by the caller: the backward reads its dx operand
        w_dgrad_EKN, sw_dgrad_EK = wq_dgrad_EKN, sw_dgrad_given_EK
    situ = situ_beta1 > 0
    keep_x = (needs_dw and wgrad == "bf16") or (situ and needs_dx)  # SiTU-GLU's backward reads z
    ctx.save_for_backward(w_dgrad_EKN, sw_dgrad_EK, x_MK if keep_x else None, xq_buffer, sx_EK, offs_E)
    ctx.wgrad, ctx.needs, ctx.betas = wgrad, (needs_dx, needs_dw), (situ_beta1, situ_beta2) if situ else (0.0, 0.0)
    ctx.widen, ctx.kernels = widen, kernels
    ctx.K, ctx.x_dtype, ctx.w_dtype = w_EKN.shape[1], x_MK.dtype, w_EKN.dtype


def _backward(ctx, dy_MN, *_unused_grads):
    if dy_MN is None:  # the output took no part in the loss (gradients are not materialized)
        return (None,) * 14
    w_dgrad_EKN, sw_dgrad_EK, x_MK, xq_buffer, sx_EK, offs_E = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs
    backward = _bwd_impl if getattr(ctx, "eager_impl", False) else _bwd_op
    dx_MK, dw_EKN = backward(dy_MN, w_dgrad_EKN, sw_dgrad_EK, x_MK, xq_buffer, sx_EK, offs_E, ctx.wgrad,
                             needs_dx, needs_dw, ctx.K, ctx.x_dtype, ctx.w_dtype, *ctx.betas, ctx.widen, ctx.kernels)
    return (dx_MK if needs_dx else None, dw_EKN if needs_dw else None, *([None] * 12))


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# eager calls: the same functions without the custom-op dispatch (0.28 against 0.46 ms of
# host time per fp8_rows forward+backward, titan_moe.ops.eager_path); torch.compile sees the ops
_EagerFp8GroupedMM = direct_autograd("_EagerFp8GroupedMM", _fwd_impl, _setup_context, _backward)


# ----------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------
def _cuda_fp8_ok(device_index: int) -> bool:
    return cuda_capability(device_index) >= (8, 9)


def _check_quantized_weight(w_EKN: Tensor, w_fp8: Fp8Weight) -> None:
    E, K, N = w_EKN.shape
    if w_fp8.fwd_EKN.shape != (E, K, N) or w_fp8.fwd_EKN.stride() != (K * N, 1, K) \
            or w_fp8.scale_fwd_EN.shape != (E, N) or w_fp8.fwd_EKN.device != w_EKN.device:
        raise ValueError(
            f"fp8_grouped_mm: w_fp8 does not belong to w {tuple(w_EKN.shape)} on {w_EKN.device}: forward layout "
            f"{tuple(w_fp8.fwd_EKN.shape)} strides {w_fp8.fwd_EKN.stride()} on {w_fp8.fwd_EKN.device}, "
            f"scales {tuple(w_fp8.scale_fwd_EN.shape)}"
        )
    if w_fp8.dgrad_EKN is not None and (w_fp8.dgrad_EKN.shape != (E, K, N) or not w_fp8.dgrad_EKN.is_contiguous()
                                        or w_fp8.scale_dgrad_EK.shape != (E, K)):
        raise ValueError(f"fp8_grouped_mm: w_fp8's dx layout does not belong to w {tuple(w_EKN.shape)}")


WGRAD_AUTO_MAX_ROWS = 256
"""``wgrad="auto"``: "bf16" up to this many rows per group on average, "fp8_rows" above. On the
H200 the bf16 weight gradient was faster at K3's 146-row groups, fp8_rows at E = 64's 1,024
rows; nothing between the two points was timed."""


def resolve_wgrad(wgrad: str, rows: int, groups: int) -> str:
    """``wgrad``, with "auto" resolved by the mean group size ``rows / groups``."""
    if wgrad != "auto":
        return wgrad
    return "bf16" if rows <= WGRAD_AUTO_MAX_ROWS * max(groups, 1) else "fp8_rows"


def _check_args(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, wgrad: str, w_fp8: Fp8Weight | None = None,
                situ: tuple[float, float] | None = None) -> None:
    """Shape, dtype and device checks; reads no data."""
    if wgrad not in WGRAD_MODES:
        raise ValueError(f"fp8_grouped_mm: wgrad must be one of {WGRAD_MODES}, got {wgrad!r}")
    if situ is not None:
        if len(situ) != 2 or not (situ[0] > 0 and situ[1] > 0):
            raise ValueError(f"fp8_grouped_mm: situ must be (beta1 > 0, beta2 > 0), got {situ}")
        if wgrad == "fp8":
            raise ValueError('fp8_grouped_mm: situ needs wgrad "bf16" or "fp8_rows" ("fp8" quantizes x by columns)')
    if x_MK.dim() != 2 or w_EKN.dim() != 3 or offs_E.dim() != 1:
        raise ValueError(
            "fp8_grouped_mm expects x [M, K], w [E, K, N], offs [E]; got "
            f"x {tuple(x_MK.shape)}, w {tuple(w_EKN.shape)}, offs {tuple(offs_E.shape)}"
        )
    E, K, N = w_EKN.shape
    x_cols = 2 * K if situ is not None else K
    if x_MK.shape[1] != x_cols or offs_E.shape[0] != E or E == 0:
        need = "z [M, 2K]" if situ is not None else "x [M, K]"
        raise ValueError(
            f"fp8_grouped_mm: shapes do not match: x {tuple(x_MK.shape)}, w {tuple(w_EKN.shape)}, "
            f"offs {tuple(offs_E.shape)} (need {need}, w [E >= 1, K, N], offs [E])"
        )
    if K % ALIGNMENT or N % ALIGNMENT or K == 0 or N == 0:
        raise ValueError(f"fp8_grouped_mm: K ({K}) and N ({N}) must be positive multiples of {ALIGNMENT}")
    if offs_E.dtype != torch.int32:
        raise ValueError(f"fp8_grouped_mm: offs must be int32, got {offs_E.dtype}")
    if x_MK.dtype not in _DTYPES or w_EKN.dtype not in _DTYPES or (w_fp8 is None and x_MK.dtype != w_EKN.dtype):
        raise ValueError(f"fp8_grouped_mm: x and w must share a dtype in {_DTYPES} (w may differ with w_fp8), "
                         f"got {x_MK.dtype}, {w_EKN.dtype}")
    if w_fp8 is not None:
        _check_quantized_weight(w_EKN, w_fp8)
    if not (x_MK.device == w_EKN.device == offs_E.device):
        raise ValueError(
            f"fp8_grouped_mm: x, w, offs must be on one device, got {x_MK.device}, {w_EKN.device}, {offs_E.device}"
        )
    device = x_MK.device
    if device.type == "cuda":
        # a cached host query: asked in eager calls only (Dynamo would trace through the cache)
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not torch.compiler.is_compiling() and not _cuda_fp8_ok(index):
            raise ValueError("fp8_grouped_mm: torch._scaled_grouped_mm needs a GPU of compute capability >= 8.9")
    elif device.type != "cpu":
        raise ValueError(f"fp8_grouped_mm: runs on CUDA (fp8 GEMM) or CPU (emulation), got {device}")


def _check_offsets(offs_E: Tensor, m: int) -> None:
    """The 16-multiple rule for ``offs``: a ValueError on the CPU (a host read, free there);
    on CUDA a device-side assert only when the debug variable ``$TITAN_MOE_FP8_CHECK_OFFSETS``
    is "1" (`titan_moe.ops.launch_env`)."""
    if offs_E.device.type == "cpu":
        group_bounds(offs_E, m)  # non-decreasing, <= M
        bad = offs_E[offs_E % ALIGNMENT != 0]
        if bad.numel():
            raise ValueError(
                f"fp8_grouped_mm: every offs entry must be a multiple of {ALIGNMENT} (pad the groups), "
                f"got {offs_E.tolist()}"
            )
    elif launch_env.read(CHECK_OFFSETS_ENV) == "1":
        torch._assert_async((offs_E % ALIGNMENT == 0).all(), "fp8_grouped_mm: offs must be multiples of 16")


def fp8_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, *, wgrad: str = "bf16",
                   w_fp8: Fp8Weight | None = None, situ: tuple[float, float] | None = None,
                   widen: str | None = None, kernels: str | None = None) -> Tensor:
    """fp8 grouped GEMM ``out[rows of e] = x[rows of e] @ w[e]``, differentiable in x and w.

    Args:
        x_MK: [M, K] rows sorted by group (bf16, fp16 or fp32; K a multiple of 16).
        w_EKN: [E, K, N] same dtype as x, any strides (N a multiple of 16).
        offs_E: [E] int32 cumulative group ends, each a multiple of 16 (the caller pads the
            groups); empty groups allowed; rows at or past ``offs[-1]`` belong to no group.
        wgrad: "bf16": weight gradient in x's dtype from the saved x (fp32 accumulation);
            "fp8": from x and dy quantized per (group, column), with x saved in fp8;
            "fp8_rows": from the codes the forward and dx GEMMs use, quantized by rows with
            power-of-two scales and re-expressed per group (one scale per group,
            :func:`titan_moe.float8.quantize.requantize_group_columns`: a pass over 1-byte
            codes instead of two over x and dy), with x's row codes saved and
            re-expressed in the backward (it gains on large groups; on small ones the
            requantization spends what the fp8 GEMM saves).
            "auto": "bf16" for groups of at most ``WGRAD_AUTO_MAX_ROWS`` rows on average (M / E),
            else "fp8_rows" (:func:`resolve_wgrad`).
        w_fp8: ``w`` already quantized (:func:`titan_moe.float8.quantize.quantize_weight`,
            with the dx layout when x needs a gradient), e.g. once per optimizer step: the
            call then quantizes only the activations, ``w`` only receives the gradient (in
            its own dtype, which may then differ from x's) and the backward reads
            ``w_fp8``'s dx layout instead of a saved copy. The caller keeps ``w_fp8`` in step
            with ``w`` (nothing checks it).
        situ: ``(beta1, beta2)``: x_MK is the packed gate|up pre-activation ``z [M, 2K]`` and
            the product is ``SiTU-GLU(z) @ w`` (the experts' down projection): the activation
            is quantized by rows straight from z (:func:`titan_moe.float8.quantize.quantize_situ_rows`,
            computed in fp32, never written in x's dtype) and x's gradient is z's, through
            SiTU-GLU's backward (z is kept for it). With wgrad "bf16" the backward recomputes
            the activation for the weight gradient; "fp8" is not supported ("fp8_rows" keeps
            the codes instead).
        widen: how a bf16 GEMM result becomes fp32 (the weight gradient of fp32 weights):
            "torch" (``.float()``) or "triton" (:mod:`titan_moe.float8.widen`'s kernel); None:
            "torch".
        kernels: which fp8 GEMMs run on our Triton kernels instead of
            ``torch._scaled_grouped_mm``: "torch" (none), "triton" (forward and dx),
            "triton_dw" (the weight gradient of wgrad "fp8" / "fp8_rows"), "triton_all",
            "auto" ("triton" on sm90, else "torch"); None: "auto".

    Returns:
        [M, N] in x's dtype (through bf16: the fp8 GEMM's output); rows past ``offs[-1]``
        zero. Forward and dx use rowwise e4m3 scaling of both operands (module docstring).

    Raises:
        ValueError: bad shapes, dtypes, devices, ``wgrad``, ``widen`` or ``kernels``; offsets that are not
            multiples of 16 (checked on the CPU only, see the module docstring).
    """
    _check_args(x_MK, w_EKN, offs_E, wgrad, w_fp8, situ)  # metadata only; the op checks offs' values
    wgrad = resolve_wgrad(wgrad, x_MK.shape[0], offs_E.shape[0])
    if widen not in (None, *WIDEN_BACKENDS):
        raise ValueError(f"fp8_grouped_mm: widen must be None or one of {WIDEN_BACKENDS}, got {widen!r}")
    if kernels not in (None, *KERNELS):
        raise ValueError(f"fp8_grouped_mm: kernels must be None or one of {KERNELS}, got {kernels!r}")
    grad = torch.is_grad_enabled()
    needs_dx = grad and x_MK.requires_grad
    quantized = ()
    if w_fp8 is not None:
        if needs_dx and w_fp8.dgrad_EKN is None:
            raise ValueError("fp8_grouped_mm: x needs a gradient, so w_fp8 needs its dx layout (dgrad=True)")
        codes = torch.uint8  # fp8 codes cross the op boundary as uint8
        dgrad = (w_fp8.dgrad_EKN.view(codes), w_fp8.scale_dgrad_EK) if w_fp8.dgrad_EKN is not None else (None, None)
        quantized = (w_fp8.fwd_EKN.view(codes), w_fp8.scale_fwd_EN, *dgrad)
    if not quantized:
        quantized = (None, None, None, None)
    betas = (0.0, 0.0) if situ is None else (float(situ[0]), float(situ[1]))
    args = (x_MK, w_EKN, offs_E, wgrad, needs_dx, grad and w_EKN.requires_grad, *quantized, *betas, widen or "",
            kernels or "")
    # the same functions, undispatched, in eager calls; the ops where a graph is traced or tensors are fake
    forward = _EagerFp8GroupedMM.apply if takes_direct_path(x_MK, w_EKN, offs_E, *quantized) else _fwd_op
    out_MN, *_residuals = forward(*args)
    return out_MN
