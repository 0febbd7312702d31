"""Fused fp8 (e4m3) quantization for the fp8 grouped GEMM: Triton kernels and their references.

Convention (shared bit for bit by the kernels and the PyTorch references):

    scale = max(amax, EPS) / 448          fp32, correctly rounded division
    inv   = 1 / scale                     fp32, correctly rounded division
    q     = e4m3(clamp(x * inv, -448, 448))   fp32 product, round to nearest even
    x    ~= q.float() * scale             (`scale` is the dequantization scale that
                                           `torch._scaled_grouped_mm` takes)

with amax the largest |x| over the reduced axis and ``EPS = 1e-12``: an all-zero row or
column gets a finite scale (``EPS / 448``) and zero codes. Inputs are bf16, fp16 or fp32;
infinities and NaNs are not handled (their rows or columns come out as NaN or garbage).

Five quantizations (each: ``<name>`` dispatches, ``<name>_reference`` is plain PyTorch,
``<name>_triton`` launches the kernel):

* :func:`quantize_rows` ``x [M, K] -> (q [M, K] row-major, scale [M])``, scale per row over K
  (the left operand of the forward and of dx). With ``dest_M`` it also pads: row m goes to
  row ``dest_M[m]`` of a zero-filled ``[P, K]`` output (scale ``[P]``, zero for rows nobody
  writes), so the 16-row group padding costs no extra pass over ``x``.
* :func:`quantize_situ_rows` ``z [M, 2K] -> (q [M, K], scale [M])``: the same for the SiTU-GLU
  activation of packed gate|up pre-activations, computed in fp32 inside the quantization
  kernel (the rows kernel with ``SITU``) and never written out. Not bit-exact against its
  reference: the kernel's tanh is a few fp32 ulp from torch's.
* :func:`quantize_weight` ``w [E, K, N] -> Fp8Weight``: both fp8 layouts of the weights from
  two reads of ``w`` by two kernels (see "Memory traffic" below): the forward operand
  ``[E, K, N]`` column-major per expert (strides ``(K*N, 1, K)``) with scales ``[E, N]`` over
  K, and the dx operand ``[E, K, N]`` row-major with scales ``[E, K]`` over N (used as its
  ``.transpose(1, 2)``, an ``[E, N, K]`` column-major operand).
* :func:`quantize_group_columns` ``t [M, C], offs [E] -> (q [M, C] column-major, scale [E*C])``:
  per group e and column c, the scale over that group's rows (``scale[e*C + c]``); used on
  ``x`` (giving ``x^T`` as ``q.t()``, a ``[K, M]`` row-major operand) and on ``dy`` for the fp8
  weight gradient. Empty groups are allowed (their scales are ``EPS / 448``); rows past
  ``offs[-1]`` belong to no group and are stored as zero codes. The column-major buffer has
  a leading dimension of M rounded up to 16 (16-byte aligned columns for the GEMM).
* :func:`requantize_group_columns` ``q [M, C] row codes, scale [M], offs -> (q [M, C]
  column-major, scale [E*C])``: row codes with power-of-two scales re-expressed per group
  (one scale per group), in ``quantize_group_columns``' layout, for ``wgrad="fp8_rows"``.

The references are exact on both devices (``quantize_situ_rows`` aside, above). (On CUDA, torch divides a tensor by a Python or
CPU scalar as a multiplication by the scalar's reciprocal, one ulp off the correctly rounded
quotient the kernels compute in 771 of 1307 row scales on the H200; so ``scale_from_amax``
divides by a tensor on the amax's own device, a true division there too.)

Dispatch: the Triton kernels run on CUDA, and on the CPU only when ``TRITON_INTERPRET=1`` was
set before this module was imported (the tests); otherwise the references run.

Triton interpreter (Triton 3.6): its fp32 -> fp8 cast rounds wrongly (it adds the rounding
bit to the 3-bit mantissa without carrying into the exponent, OR-ing the overflow into it:
-125.97 became -64 instead of -128; ties are not broken to even), but it converts values that are exactly
representable in e4m3 correctly, including subnormals and -0.0. So under the interpreter
the kernels first round in fp32 (:func:`_e4m3_round`, the add-and-subtract-a-power-of-two
trick) and then cast; compiled kernels cast directly (the hardware's round-to-nearest-even
``cvt.rn.satfinite.e4m3x2.f32`` on sm89+). Both were checked bit for bit against torch's
cast on every e4m3 value, every midpoint between neighbours and the fp32 values next to
those midpoints (the interpreter path here; the GPU path by the GPU test). Storing fp8
through a pointer works in both modes.

Memory traffic (bytes per element of the input; GPU tile sizes are unmeasured starting points):

* rows: read 2 (bf16) + write 1. When a row fits one tile (``K <= 4096`` on the GPU) the row
  is read once and quantized from registers; wider rows take two passes over the row block,
  the second from L2 (a block is ``BLOCK_M * K * 2`` bytes: 28 KiB at K = 7168). With
  ``dest_M`` add the zero fill of the ``[P, K]`` output: 1 byte per output element.
* SiTU rows: read 4 (bf16 gate and up) + write 1 per output element, where SiTU-GLU then
  rows cost 4 + 2 (the activation written) + 2 + 1 (read and quantized): 5 bytes against 9.
* weight: two kernels. ``_weight_amax_kernel`` (one program per expert and column block,
  looping over K) reads w once and writes the exact column scales plus per-(column block,
  row) partial row maxima ``[E, N/BLOCK_N, K]`` fp32; ``_weight_quant_kernel`` (one program
  per expert, K block and N block) reads w again, reduces the partials of its rows and
  writes both fp8 layouts: read 2 + 2, write 1 + 1, plus ``8 / BLOCK_N`` for the partials.
  A single read is impossible without a grid-wide barrier: a column scale needs all K rows
  of the expert and a row scale all N columns, i.e. the whole ``[K, N]`` expert matrix
  (5.8 MB at K=2048, N=1408) before any code of it can be written.
* group columns: one program per (column block, group) reads its group's rows twice (amax,
  then quantize); the slab is ``group rows * BLOCK_C * 2`` bytes (128 KiB for 1024 rows at
  the GPU default of 64 columns), meant to be re-read from L2. Read 2 (+2 on L2 misses),
  write 1. With ``offs_aligned`` (16-multiple offsets, what fp8_grouped_mm guarantees) the
  column-major codes go out as 16-byte vectors; without it byte by byte.
* group requantization (the ``fp8_rows`` weight gradient): ``_group_row_factors_kernel``
  (one program per group) reads the group's row scales and writes the group scale and one
  shift factor per row (M floats); ``_requant_tiles_kernel`` then reads the codes once in
  tiles of the whole [M, C], the same work per program however uneven the groups (the
  earlier one-program-per-(column block, group) form left a Zipf-heavy group to a few
  programs): read 1 (+8 / C for the scales and factors), write 1. The row scales must be
  powers of two (``quantize_rows(..., pow2=True)``), so a code changes only by an exact shift.

No kernel uses atomics or reads anything on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from titan_moe.ops.grouped_gemm.reference import group_bounds
from titan_moe.ops.situ.reference import situ_glu_forward_torch
from titan_moe.ops.situ.triton_kernel import situ_hidden
from titan_moe.ops.triton_runtime import cdiv, check_runs_on, is_interpreted, kernel_runs_on, next_power_of_2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-12  # floor of amax: all-zero rows/columns get scale EPS / 448 and zero codes
COLUMN_ALIGN = 16  # leading dimension of the column-major outputs: a multiple of 16 bytes
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Fp8Weight(NamedTuple):
    """Both fp8 layouts of a weight ``w [E, K, N]`` (see the module docstring)."""

    fwd_EKN: Tensor  # fp8 [E, K, N], strides (K*N, 1, K): forward right operand
    scale_fwd_EN: Tensor  # fp32 [E, N]: amax over K / 448
    dgrad_EKN: Tensor | None  # fp8 [E, K, N] row-major; `.transpose(1, 2)` is the dx operand
    scale_dgrad_EK: Tensor | None  # fp32 [E, K]: amax over N / 448


# ----------------------------------------------------------------------------------------
# PyTorch references
# ----------------------------------------------------------------------------------------
def scale_from_amax(amax: Tensor) -> Tensor:
    """Dequantization scale ``max(amax, EPS) / 448`` in fp32, correctly rounded on every
    device (module docstring: the divisor is a same-device tensor, not a scalar)."""
    amax_f32 = amax.float().clamp_min(EPS)
    return amax_f32 / torch.full_like(amax_f32, FP8_MAX)


def pow2_ceil(scale: Tensor) -> Tensor:
    """The smallest power of two >= each positive normal fp32 ``scale``, exactly (bitwise:
    the exponent, plus one where any mantissa bit is set)."""
    bits = scale.float().contiguous().view(torch.int32)
    base = (bits & 0x7F800000).view(torch.float32)
    return torch.where((bits & 0x007FFFFF) != 0, base * 2, base)


def quantize_with_scale(x: Tensor, scale: Tensor) -> Tensor:
    """``e4m3(clamp(x * (1 / scale), -448, 448))``; ``scale`` broadcasts against ``x``."""
    inv = torch.reciprocal(scale)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _column_major_buffer(rows: int, cols: int, device) -> tuple[Tensor, int]:
    """An fp8 ``[rows, cols]`` column-major view of a ``[cols, ld]`` buffer, ``ld`` = rows
    rounded up to COLUMN_ALIGN; returns (view, ld)."""
    ld = -(-rows // COLUMN_ALIGN) * COLUMN_ALIGN
    buf = torch.empty(cols, ld, dtype=FP8_DTYPE, device=device)
    return buf[:, :rows].t(), ld


def _weight_fwd_buffer(E: int, K: int, N: int, device) -> Tensor:
    return torch.empty_strided((E, K, N), (K * N, 1, K), dtype=FP8_DTYPE, device=device)


def quantize_rows_reference(x_MK: Tensor, dest_M: Tensor | None = None, num_rows: int | None = None,
                            pow2: bool = False):
    """Rowwise quantization in PyTorch; arguments and results as in :func:`quantize_rows`."""
    _check_rows_args(x_MK, dest_M, num_rows)
    scale_M = scale_from_amax(x_MK.float().abs().amax(dim=1))
    if pow2:
        scale_M = pow2_ceil(scale_M)
    q_MK = quantize_with_scale(x_MK, scale_M.unsqueeze(1))
    if dest_M is None:
        return q_MK, scale_M
    q_PK = torch.zeros(num_rows, x_MK.shape[1], dtype=FP8_DTYPE, device=x_MK.device)
    scale_P = torch.zeros(num_rows, dtype=torch.float32, device=x_MK.device)
    keep_M = (dest_M >= 0) & (dest_M < num_rows)
    q_PK.view(torch.uint8)[dest_M[keep_M]] = q_MK.view(torch.uint8)[keep_M]
    scale_P[dest_M[keep_M]] = scale_M[keep_M]
    return q_PK, scale_P


def quantize_situ_rows_reference(z_M2K: Tensor, beta1: float, beta2: float, pow2: bool = False):
    """:func:`quantize_situ_rows` in PyTorch: the hidden activation in fp32, then
    :func:`quantize_rows_reference`."""
    _check_situ_rows_args(z_M2K, beta1, beta2)
    K = z_M2K.shape[1] // 2
    hidden_MK = situ_glu_forward_torch(z_M2K[:, :K].float(), z_M2K[:, K:].float(), beta1, beta2)
    return quantize_rows_reference(hidden_MK, pow2=pow2)


def quantize_weight_reference(w_EKN: Tensor, dgrad: bool = True) -> Fp8Weight:
    """Both weight layouts in PyTorch; as in :func:`quantize_weight`."""
    _check_weight_args(w_EKN)
    E, K, N = w_EKN.shape
    a_EKN = w_EKN.float().abs()
    scale_EN = scale_from_amax(a_EKN.amax(dim=1))
    fwd_EKN = _weight_fwd_buffer(E, K, N, w_EKN.device)
    fwd_EKN.copy_(quantize_with_scale(w_EKN, scale_EN.unsqueeze(1)))
    if not dgrad:
        return Fp8Weight(fwd_EKN, scale_EN, None, None)
    scale_EK = scale_from_amax(a_EKN.amax(dim=2))
    dgrad_EKN = quantize_with_scale(w_EKN, scale_EK.unsqueeze(2)).contiguous()  # row-major whatever w's layout
    return Fp8Weight(fwd_EKN, scale_EN, dgrad_EKN, scale_EK)


def quantize_group_columns_reference(t_MC: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group column quantization in PyTorch (one host read of ``offs_E``); as in
    :func:`quantize_group_columns`."""
    _check_group_columns_args(t_MC, offs_E)
    M, C = t_MC.shape
    E = offs_E.shape[0]
    q_MC, _ = _column_major_buffer(M, C, t_MC.device)
    q_MC.view(torch.uint8).zero_()
    scale_EC = scale_from_amax(torch.zeros(E, C, device=t_MC.device))
    for e, (start, end) in enumerate(group_bounds(offs_E, M)):
        if end > start:
            rows_RC = t_MC[start:end]
            scale_EC[e] = scale_from_amax(rows_RC.float().abs().amax(dim=0))
            q_MC[start:end] = quantize_with_scale(rows_RC, scale_EC[e].unsqueeze(0))
    return q_MC, scale_EC.reshape(E * C)


def requantize_group_columns_reference(q_MC: Tensor, scale_M: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor]:
    """Row-quantized codes re-expressed per group in PyTorch (one host read of ``offs_E``);
    as in :func:`requantize_group_columns`."""
    _check_requant_args(q_MC, scale_M, offs_E)
    M, C = q_MC.shape
    E = offs_E.shape[0]
    out_MC, _ = _column_major_buffer(M, C, q_MC.device)
    out_MC.view(torch.uint8).zero_()
    floor = pow2_ceil(scale_from_amax(torch.zeros(1, device=q_MC.device)))
    group_scale_E = floor.expand(E).clone()
    for e, (start, end) in enumerate(group_bounds(offs_E, M)):
        if end > start:
            group_scale_E[e] = torch.maximum(scale_M[start:end].max(), floor[0])
            values_RC = q_MC[start:end].float() * scale_M[start:end, None]  # exact: powers of two
            out_MC[start:end] = quantize_with_scale(values_RC, group_scale_E[e])
    return out_MC, group_scale_E.repeat_interleave(C)


# ----------------------------------------------------------------------------------------
# argument checks (shapes and dtypes only: nothing is read on the host)
# ----------------------------------------------------------------------------------------
def _check_dtype(name: str, t: Tensor) -> None:
    if t.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: input dtype must be one of {_INPUT_DTYPES}, got {t.dtype}")


def _check_rows_args(x_MK: Tensor, dest_M: Tensor | None, num_rows: int | None) -> None:
    _check_dtype("quantize_rows", x_MK)
    if x_MK.dim() != 2 or x_MK.shape[1] == 0:
        raise ValueError(f"quantize_rows: expected x [M, K >= 1], got shape {tuple(x_MK.shape)}")
    if (dest_M is None) != (num_rows is None):
        raise ValueError("quantize_rows: dest_M and num_rows go together (both or neither)")
    if dest_M is not None:
        if dest_M.dtype != torch.int64 or dest_M.shape != (x_MK.shape[0],) or dest_M.device != x_MK.device:
            raise ValueError(
                f"quantize_rows: dest_M must be int64 [M={x_MK.shape[0]}] on {x_MK.device}, got "
                f"{dest_M.dtype} {tuple(dest_M.shape)} on {dest_M.device}"
            )
        if num_rows < 0:
            raise ValueError(f"quantize_rows: num_rows must be >= 0, got {num_rows}")


def _check_situ_rows_args(z_M2K: Tensor, beta1: float, beta2: float) -> None:
    _check_dtype("quantize_situ_rows", z_M2K)
    if z_M2K.dim() != 2 or z_M2K.shape[1] == 0 or z_M2K.shape[1] % 2:
        raise ValueError(f"quantize_situ_rows: expected packed gate|up z [M, 2K >= 2], got shape {tuple(z_M2K.shape)}")
    if not (beta1 > 0 and beta2 > 0):
        raise ValueError(f"quantize_situ_rows: beta1 and beta2 must be > 0, got {beta1}, {beta2}")


def _check_weight_args(w_EKN: Tensor) -> None:
    _check_dtype("quantize_weight", w_EKN)
    if w_EKN.dim() != 3 or 0 in w_EKN.shape:
        raise ValueError(f"quantize_weight: expected w [E, K, N], all >= 1, got shape {tuple(w_EKN.shape)}")


def _check_group_columns_args(t_MC: Tensor, offs_E: Tensor) -> None:
    _check_dtype("quantize_group_columns", t_MC)
    if t_MC.dim() != 2 or t_MC.shape[1] == 0:
        raise ValueError(f"quantize_group_columns: expected t [M, C >= 1], got shape {tuple(t_MC.shape)}")
    if offs_E.dim() != 1 or offs_E.dtype != torch.int32 or offs_E.shape[0] == 0:
        raise ValueError(
            f"quantize_group_columns: offs must be a non-empty 1-D int32 tensor, got {offs_E.dtype} "
            f"{tuple(offs_E.shape)}"
        )
    if offs_E.device != t_MC.device:
        raise ValueError(f"quantize_group_columns: t on {t_MC.device}, offs on {offs_E.device}")


def _check_requant_args(q_MC: Tensor, scale_M: Tensor, offs_E: Tensor) -> None:
    if q_MC.dtype != FP8_DTYPE or q_MC.dim() != 2 or q_MC.shape[1] == 0:
        raise ValueError(f"requantize_group_columns: expected fp8 e4m3 codes [M, C >= 1], got {q_MC.dtype} "
                         f"{tuple(q_MC.shape)}")
    if scale_M.dtype != torch.float32 or scale_M.shape != (q_MC.shape[0],) or scale_M.device != q_MC.device:
        raise ValueError(f"requantize_group_columns: scales must be fp32 [M={q_MC.shape[0]}] on {q_MC.device}, "
                         f"got {scale_M.dtype} {tuple(scale_M.shape)} on {scale_M.device}")
    _check_group_columns_args(scale_M[:, None], offs_E)


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------
# Under the interpreter, loops whose bounds are read from memory are while loops (its range()
# cannot take them), for loops when compiled (titan_moe.ops.grouped_gemm.triton_kernel's
# convention). Reductions use tl.max, which the interpreter maps to numpy (a custom combine
# function runs element by element in Python, ~100x slower); tl.max is a
# triton.language.standard jit function, so interpreted runs need Triton itself imported with
# TRITON_INTERPRET=1 (tests/triton_mode.py checks that). Integer adds are avoided in the
# interpreter-only rounding: the interpreter checks every one for overflow, slowly.


@triton.jit
def _e4m3_round(y):
    """fp32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32.

    Adding and subtracting ``c``, a power of two whose fp32 ulp is the e4m3 spacing at ``y``
    (``2^(e-3)`` for ``2^e <= |y| < 2^(e+1)``, ``e >= -6``; ``2^-9`` in the subnormal range),
    makes the fp32 adder round |y| to that spacing; a carry into the next binade is exact.
    The sign is copied back bitwise so that -0.0 stays -0.0 (as in torch's cast).
    """
    bits = y.to(tl.uint32, bitcast=True)
    binade = (bits & 0x7F800000).to(tl.float32, bitcast=True)  # 2^e; 0 for zero and fp32 subnormals
    c = tl.maximum(binade * 1048576.0, 16384.0)  # 2^(e+20), at least 2^(-9+23)
    r = (tl.abs(y) + c) - c
    return (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(v, inv, INTERPRETED: tl.constexpr):
    """fp32 ``v * inv`` clamped to +-448 and cast to e4m3 (round to nearest even)."""
    y = tl.clamp(v * inv, -448.0, 448.0)
    if INTERPRETED:  # the interpreter's cast rounds wrongly but converts exact values right
        return _e4m3_round(y).to(tl.float8e4nv)
    else:
        return y.to(tl.float8e4nv)


@triton.jit
def _scale_of(amax, EPS: tl.constexpr):
    """``max(amax, EPS) / 448`` (correctly rounded, like torch's division)."""
    return tl.math.div_rn(tl.maximum(amax, EPS), tl.full(amax.shape, 448.0, tl.float32))


@triton.jit
def _pow2_ceil(scale):
    """The smallest power of two >= positive normal fp32 ``scale`` (as :func:`pow2_ceil`)."""
    bits = scale.to(tl.uint32, bitcast=True)
    base = (bits & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x007FFFFF) != 0, base * 2.0, base)


@triton.jit
def _inverse(scale):
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _row_values(x_rows, ks, mask, beta1, beta2, K: tl.constexpr, SITU: tl.constexpr):
    """fp32 values of columns ``ks`` of a row block: x itself, or with SITU the SiTU-GLU hidden
    activation of the packed pre-activations (gate at column k, up at column K + k; 0 where
    masked)."""
    if SITU:
        z_g = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        z_u = tl.load(x_rows + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        return situ_hidden(z_g, z_u, beta1, beta2)
    else:
        return tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rows_kernel(
    x_ptr, q_ptr, s_ptr, dest_ptr,
    M, P, stride_xm, stride_qm, beta1, beta2,
    K: tl.constexpr, EPS: tl.constexpr, HAS_DEST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr, POW2: tl.constexpr = False,
    SITU: tl.constexpr = False,
):
    """Program: BLOCK_M rows of x [M, K] (SITU: of SiTU-GLU(z), z [M, 2K] the packed gate|up
    pre-activations, never written out); scale per row (POW2: rounded up to a power of two);
    writes q rows (dest rows with HAS_DEST)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    if HAS_DEST:
        out_rows = tl.load(dest_ptr + rows, mask=row_ok, other=-1)
        out_ok = row_ok & (out_rows >= 0) & (out_rows < P)
    else:
        out_rows = rows.to(tl.int64)
        out_ok = row_ok
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + out_rows.to(tl.int64)[:, None] * stride_qm
    cols = tl.arange(0, BLOCK_K)
    if K <= BLOCK_K:  # whole rows in one tile: one read, quantized from registers
        v = _row_values(x_rows, cols, row_ok[:, None] & (cols < K)[None, :], beta1, beta2, K, SITU)
        scale = _scale_of(tl.max(tl.abs(v), 1), EPS)
        if POW2:
            scale = _pow2_ceil(scale)
        inv = _inverse(scale)
        tl.store(q_rows + cols[None, :], _quantize(v, inv[:, None], INTERPRETED),
                 mask=out_ok[:, None] & (cols < K)[None, :])
    else:  # two passes over the row block: amax, then quantize (re-read from L2)
        amax = tl.full((BLOCK_M,), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + cols
            v = _row_values(x_rows, ks, row_ok[:, None] & (ks < K)[None, :], beta1, beta2, K, SITU)
            amax = tl.maximum(amax, tl.max(tl.abs(v), 1))
        scale = _scale_of(amax, EPS)
        if POW2:
            scale = _pow2_ceil(scale)
        inv = _inverse(scale)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + cols
            v = _row_values(x_rows, ks, row_ok[:, None] & (ks < K)[None, :], beta1, beta2, K, SITU)
            tl.store(q_rows + ks[None, :], _quantize(v, inv[:, None], INTERPRETED),
                     mask=out_ok[:, None] & (ks < K)[None, :])
    tl.store(s_ptr + out_rows, scale, mask=out_ok)


@triton.jit
def _weight_amax_kernel(
    w_ptr, scale_col_ptr, row_part_ptr,
    stride_we, stride_wk, stride_wn,
    K: tl.constexpr, N: tl.constexpr, EPS: tl.constexpr, DGRAD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (e, n-block): column scales over all K (final), and with DGRAD the row maxima
    over this n-block's columns -> row_part [E, NB, K] (NB = the grid's second size)."""
    e = tl.program_id(0)
    nb = tl.program_id(1)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_e = w_ptr + e.to(tl.int64) * stride_we
    part_e = row_part_ptr + (e.to(tl.int64) * tl.num_programs(1) + nb) * K
    col_amax = tl.full((BLOCK_N,), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        v = tl.load(w_e + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a = tl.abs(v.to(tl.float32))
        col_amax = tl.maximum(col_amax, tl.max(a, 0))
        if DGRAD:
            tl.store(part_e + ks, tl.max(a, 1), mask=k_ok)
    tl.store(scale_col_ptr + e.to(tl.int64) * N + cols, _scale_of(col_amax, EPS), mask=col_ok)


@triton.jit
def _weight_quant_kernel(
    w_ptr, scale_col_ptr, row_part_ptr, fwd_ptr, dgrad_ptr, scale_row_ptr,
    stride_we, stride_wk, stride_wn,
    K: tl.constexpr, N: tl.constexpr, EPS: tl.constexpr, DGRAD: tl.constexpr,
    NUM_PARTS: tl.constexpr, BLOCK_PARTS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (e, k-block, n-block): one tile of w in both fp8 layouts (fwd column-major
    with column scales; dgrad row-major with row scales from the partial maxima)."""
    e = tl.program_id(0)
    kb = tl.program_id(1)
    nb = tl.program_id(2)
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < N
    mask = k_ok[:, None] & col_ok[None, :]
    e64 = e.to(tl.int64)
    v = tl.load(w_ptr + e64 * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=mask, other=0.0).to(tl.float32)

    scale_col = tl.load(scale_col_ptr + e64 * N + cols, mask=col_ok, other=1.0)
    inv_col = _inverse(scale_col)
    tl.store(fwd_ptr + e64 * (K * N) + cols[None, :] * K + ks[:, None],
             _quantize(v, inv_col[None, :], INTERPRETED), mask=mask)
    if DGRAD:
        parts = tl.arange(0, BLOCK_PARTS)
        part = tl.load(row_part_ptr + (e64 * NUM_PARTS + parts[:, None]) * K + ks[None, :],
                       mask=(parts < NUM_PARTS)[:, None] & k_ok[None, :], other=0.0)
        scale_row = _scale_of(tl.max(part, 0), EPS)
        inv_row = _inverse(scale_row)
        tl.store(dgrad_ptr + e64 * (K * N) + ks[:, None] * N + cols[None, :],
                 _quantize(v, inv_row[:, None], INTERPRETED), mask=mask)
        tl.store(scale_row_ptr + e64 * K + ks, scale_row, mask=k_ok & (nb == 0))


@triton.jit
def _col_amax_step(t_ptr, amax, m0, end, cols, col_ok, stride_tm, BLOCK_M: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    v = tl.load(t_ptr + rows.to(tl.int64)[:, None] * stride_tm + cols[None, :],
                mask=(rows < end)[:, None] & col_ok[None, :], other=0.0)
    return tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), 0))


@triton.jit
def _col_quant_step(t_ptr, q_ptr, inv, keep, m0, end, store_end, cols, col_ok, stride_tm, ld_q,
                    BLOCK_M: tl.constexpr, INTERPRETED: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    v = tl.load(t_ptr + rows.to(tl.int64)[:, None] * stride_tm + cols[None, :],
                mask=(rows < end)[:, None] & col_ok[None, :], other=0.0)
    v = tl.where(keep, v.to(tl.float32), 0.0)  # rows past offs[-1] become +0 codes
    tl.store(q_ptr + cols.to(tl.int64)[None, :] * ld_q + rows[:, None],
             _quantize(v, inv[None, :], INTERPRETED), mask=(rows < store_end)[:, None] & col_ok[None, :])


@triton.jit
def _group_cols_kernel(
    t_ptr, q_ptr, s_ptr, offs_ptr,
    M, E, stride_tm, ld_q,
    C: tl.constexpr, EPS: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (c-block, g): group g's rows of t [M, C] (g == E: the rows past offs[-1],
    stored as zeros), column scales over the group, column-major q [M, C] (leading dim ld_q).
    ALIGNED: the offsets are multiples of 16, so each column's codes go out in 16-byte
    vector stores (without the hint the compiler must store byte by byte)."""
    cb = tl.program_id(0)
    g = tl.program_id(1)
    is_group = g < E
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.load(offs_ptr + g, mask=is_group, other=0)
    end = tl.maximum(tl.minimum(end, M), start)
    if ALIGNED:
        # Groups start and end on multiples of 16; the tail's zero codes are written up to M
        # rounded up to 16 (into the buffer's padding), so every store mask is constant over
        # 16 rows and the compiler can store 16-byte vectors.
        start = tl.multiple_of(start, 16)
        store_end = tl.where(is_group, tl.multiple_of(end, 16), (M + 15) // 16 * 16)
    else:
        store_end = tl.where(is_group, end, M)
    end = tl.where(is_group, end, M)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C

    amax = tl.full((BLOCK_C,), 0.0, tl.float32)
    if INTERPRETED:
        m0 = start
        while m0 < end:
            amax = _col_amax_step(t_ptr, amax, m0, end, cols, col_ok, stride_tm, BLOCK_M)
            m0 += BLOCK_M
    else:
        for m0 in tl.range(start, end, BLOCK_M):
            amax = _col_amax_step(t_ptr, amax, m0, end, cols, col_ok, stride_tm, BLOCK_M)
    scale = _scale_of(amax, EPS)
    inv = _inverse(scale)
    tl.store(s_ptr + g.to(tl.int64) * C + cols, scale, mask=col_ok & is_group)

    if INTERPRETED:
        m0 = start
        while m0 < store_end:
            _col_quant_step(t_ptr, q_ptr, inv, is_group, m0, end, store_end, cols, col_ok, stride_tm, ld_q,
                            BLOCK_M, INTERPRETED)
            m0 += BLOCK_M
    else:
        # a step counter, not `range(start, store_end, BLOCK_M)`: the compiler derives the
        # alignment of `start + i * BLOCK_M` but not that of a loop variable
        for i in tl.range(0, (store_end - start + BLOCK_M - 1) // BLOCK_M):
            _col_quant_step(t_ptr, q_ptr, inv, is_group, start + i * BLOCK_M, end, store_end, cols, col_ok,
                            stride_tm, ld_q, BLOCK_M, INTERPRETED)


@triton.jit
def _row_factor(s_ptr, rows, end, inv_g, is_group):
    """s[rows] / group scale for a group's rows (exact: powers of two); 0 past offs[-1]."""
    scale = tl.load(s_ptr + rows, mask=(rows < end) & is_group, other=0.0)
    return tl.where(is_group, scale * inv_g, 0.0)


@triton.jit
def _group_row_factors_kernel(
    s_ptr, f_ptr, group_scale_ptr, offs_ptr,
    M, E,
    C: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program g: ``_group_row_factors`` of group g."""
    _group_row_factors(tl.program_id(0), s_ptr, f_ptr, group_scale_ptr, offs_ptr, M, E, C, EPS, BLOCK_M, BLOCK_C,
                       INTERPRETED)


@triton.jit
def _group_row_factors_pair_kernel(
    sa_ptr, fa_ptr, group_scale_a_ptr, sb_ptr, fb_ptr, group_scale_b_ptr, offs_ptr,
    M, E,
    C_A: tl.constexpr, C_B: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (g, 0): ``_group_row_factors`` of group g for tensor a; (g, 1): for tensor b
    (two tensors with the same rows and groups, one launch)."""
    if tl.program_id(1) == 0:
        _group_row_factors(tl.program_id(0), sa_ptr, fa_ptr, group_scale_a_ptr, offs_ptr, M, E, C_A, EPS, BLOCK_M,
                           BLOCK_C, INTERPRETED)
    else:
        _group_row_factors(tl.program_id(0), sb_ptr, fb_ptr, group_scale_b_ptr, offs_ptr, M, E, C_B, EPS, BLOCK_M,
                           BLOCK_C, INTERPRETED)


@triton.jit
def _group_row_factors(
    g, s_ptr, f_ptr, group_scale_ptr, offs_ptr, M, E,
    C: tl.constexpr, EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Group g's scale, the largest of its rows' power-of-two scales s [M] (at least the scale
    of an all-zero row), written C times into group_scale [E*C]; and each of its rows' factor
    f[m] = s[m] / group scale (a power of two <= 1). g == E: the rows past offs[-1] get factor
    0 (their codes become +0)."""
    is_group = g < E
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.load(offs_ptr + g, mask=is_group, other=0)
    end = tl.where(is_group, tl.maximum(tl.minimum(end, M), start), M)
    scan_end = tl.where(is_group, end, start)  # the tail's scales are not needed

    group_scale = _pow2_ceil(_scale_of(tl.full((BLOCK_M,), 0.0, tl.float32), EPS))
    if INTERPRETED:
        m0 = start
        while m0 < scan_end:
            rows = m0 + tl.arange(0, BLOCK_M)
            group_scale = tl.maximum(group_scale, tl.load(s_ptr + rows, mask=rows < end, other=0.0))
            m0 += BLOCK_M
    else:
        for m0 in tl.range(start, scan_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            group_scale = tl.maximum(group_scale, tl.load(s_ptr + rows, mask=rows < end, other=0.0))
    g_scale = tl.max(group_scale, 0)
    inv_g = _inverse(g_scale)
    for c0 in tl.static_range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        tl.store(group_scale_ptr + g.to(tl.int64) * C + cols, tl.full((BLOCK_C,), 0.0, tl.float32) + g_scale,
                 mask=(cols < C) & is_group)
    if INTERPRETED:
        m0 = start
        while m0 < end:
            rows = m0 + tl.arange(0, BLOCK_M)
            tl.store(f_ptr + rows, _row_factor(s_ptr, rows, end, inv_g, is_group), mask=rows < end)
            m0 += BLOCK_M
    else:
        for m0 in tl.range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            tl.store(f_ptr + rows, _row_factor(s_ptr, rows, end, inv_g, is_group), mask=rows < end)


@triton.jit
def _requant_tiles_kernel(
    q_ptr, f_ptr, out_ptr,
    M, M_STORE, stride_qm, ld_out,
    C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Program (m-block, c-block): ``_requant_tile`` of that tile."""
    _requant_tile(tl.program_id(0), tl.program_id(1), q_ptr, f_ptr, out_ptr, M, M_STORE, stride_qm, ld_out, C,
                  BLOCK_M, BLOCK_C, INTERPRETED)


@triton.jit
def _requant_tiles_pair_kernel(
    qa_ptr, fa_ptr, out_a_ptr, qb_ptr, fb_ptr, out_b_ptr,
    M, M_STORE, stride_qam, stride_qbm, ld_out,
    C_A: tl.constexpr, C_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (m-block, c-block): ``_requant_tile`` of tensor a's column blocks first, then
    of tensor b's (one launch for both; same rows and output leading dimension)."""
    c_block = tl.program_id(1)
    a_blocks: tl.constexpr = (C_A + BLOCK_C - 1) // BLOCK_C
    if c_block < a_blocks:
        _requant_tile(tl.program_id(0), c_block, qa_ptr, fa_ptr, out_a_ptr, M, M_STORE, stride_qam, ld_out, C_A,
                      BLOCK_M, BLOCK_C, INTERPRETED)
    else:
        _requant_tile(tl.program_id(0), c_block - a_blocks, qb_ptr, fb_ptr, out_b_ptr, M, M_STORE, stride_qbm, ld_out,
                      C_B, BLOCK_M, BLOCK_C, INTERPRETED)


@triton.jit
def _requant_tile(
    m_block, c_block, q_ptr, f_ptr, out_ptr,
    M, M_STORE, stride_qm, ld_out,
    C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """A BLOCK_M x BLOCK_C tile of the row-quantized codes q [M, C] (uint8 view), each row
    shifted by its factor f[m] (``_group_row_factors``; 0: a row past offs[-1], stored as
    +0), into column-major out [M, C] (leading dim ld_out). Every tile is the same work
    whatever the group sizes. M_STORE (M rounded up to 16) and ld_out are multiples of 16,
    which the compiler specializes on: the column stores go out in 16-byte vectors."""
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < M
    col_ok = cols < C
    codes = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0)
    factor = tl.load(f_ptr + rows, mask=row_ok, other=0.0)
    # fp8 -> fp32 exactly (the codes cross as uint8; NaN codes never occur), then a power of two
    v = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * factor[:, None]
    v = tl.where((factor > 0.0)[:, None], v, 0.0)  # +0, also for a negative code times 0
    tl.store(out_ptr + cols.to(tl.int64)[None, :] * ld_out + rows[:, None],
             _quantize(v, 1.0, INTERPRETED), mask=(rows < M_STORE)[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------
def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_rows_kernel)


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA when compiled, CPU when interpreted."""
    return kernel_runs_on(_rows_kernel, device)


def _small_tiles(device: torch.device) -> bool:
    return device.type != "cuda"  # interpreter: small tiles, so test shapes cross tile edges


def quantize_rows_triton(x_MK: Tensor, dest_M: Tensor | None = None, num_rows: int | None = None,
                         block_m: int | None = None, block_k: int | None = None, pow2: bool = False):
    """:func:`quantize_rows` through ``_rows_kernel``. ``block_m``/``block_k`` override the tiles
    (powers of two; GPU default: a tile of 8192 elements, BLOCK_K = next_pow2(K) up to 4096)."""
    _check_rows_args(x_MK, dest_M, num_rows)
    check_runs_on(_rows_kernel, x_MK.device, "quantize_rows_triton", __name__)
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    if dest_M is None:
        P = M
        q_PK = torch.empty(M, K, dtype=FP8_DTYPE, device=x_MK.device)
        scale_P = torch.empty(M, dtype=torch.float32, device=x_MK.device)
    else:
        P = num_rows
        q_PK = torch.zeros(P, K, dtype=FP8_DTYPE, device=x_MK.device)
        scale_P = torch.zeros(P, dtype=torch.float32, device=x_MK.device)
    _rows_launch(x_MK, q_PK, scale_P, dest_M, P, K, block_m, block_k, pow2)
    return q_PK, scale_P


def quantize_situ_rows_triton(z_M2K: Tensor, beta1: float, beta2: float, pow2: bool = False,
                              block_m: int | None = None, block_k: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`quantize_situ_rows` through ``_rows_kernel`` with SITU (tiles as
    :func:`quantize_rows_triton`'s for K = z's width / 2)."""
    _check_situ_rows_args(z_M2K, beta1, beta2)
    check_runs_on(_rows_kernel, z_M2K.device, "quantize_situ_rows_triton", __name__)
    if z_M2K.stride(1) != 1:
        z_M2K = z_M2K.contiguous()
    M, K = z_M2K.shape[0], z_M2K.shape[1] // 2
    q_MK = torch.empty(M, K, dtype=FP8_DTYPE, device=z_M2K.device)
    scale_M = torch.empty(M, dtype=torch.float32, device=z_M2K.device)
    _rows_launch(z_M2K, q_MK, scale_M, None, M, K, block_m, block_k, pow2, (beta1, beta2))
    return q_MK, scale_M


def _rows_launch(x, q, scale, dest_M, P, K, block_m, block_k, pow2, situ=None) -> None:
    """``_rows_kernel`` over x's rows into ``q`` [P, K] / ``scale`` [P] (module docstring's
    tiles: GPU default a tile of 8192 elements, BLOCK_K = next_pow2(K) up to 4096)."""
    M = x.shape[0]
    if M == 0:
        return
    if block_k is None:
        block_k = min(next_power_of_2(K), 32 if _small_tiles(x.device) else 4096)
    if block_m is None:
        block_m = 8 if _small_tiles(x.device) else max(1, 8192 // block_k)
    beta1, beta2 = situ or (1.0, 1.0)
    _rows_kernel[(cdiv(M, block_m),)](
        x, q, scale, dest_M if dest_M is not None else scale,
        M, P, x.stride(0), K, float(beta1), float(beta2),
        K=K, EPS=EPS, HAS_DEST=dest_M is not None, BLOCK_M=block_m, BLOCK_K=block_k,
        INTERPRETED=interpreted(), POW2=pow2, SITU=situ is not None,
        num_warps=8 if block_m * block_k >= 8192 else 4,
    )


def quantize_weight_triton(w_EKN: Tensor, dgrad: bool = True, block_k: int | None = None,
                           block_n: int | None = None, amax_warps: int | None = None,
                           quant_warps: int | None = None) -> Fp8Weight:
    """:func:`quantize_weight` through ``_weight_amax_kernel`` + ``_weight_quant_kernel``
    (tiles [block_k, block_n] for both; GPU default 32 x 256, 4 and 8 warps, the best of ten
    settings timed on the H200 for wide_1gpu's expert weights, BENCHMARKS.md). ``w`` may
    have any strides."""
    _check_weight_args(w_EKN)
    check_runs_on(_rows_kernel, w_EKN.device, "quantize_weight_triton", __name__)
    E, K, N = w_EKN.shape
    dev = w_EKN.device
    small = _small_tiles(dev)
    block_k = block_k or (16 if small else 32)
    block_n = block_n or (32 if small else 256)
    fwd_EKN = _weight_fwd_buffer(E, K, N, dev)
    scale_EN = torch.empty(E, N, dtype=torch.float32, device=dev)
    dgrad_EKN = torch.empty(E, K, N, dtype=FP8_DTYPE, device=dev) if dgrad else None
    scale_EK = torch.empty(E, K, dtype=torch.float32, device=dev) if dgrad else None
    num_parts = cdiv(N, block_n)
    row_part = torch.empty(E, num_parts, K, dtype=torch.float32, device=dev) if dgrad else scale_EN
    strides = (w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2))
    _weight_amax_kernel[(E, num_parts)](
        w_EKN, scale_EN, row_part, *strides,
        K=K, N=N, EPS=EPS, DGRAD=dgrad, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=amax_warps or 4,
    )
    _weight_quant_kernel[(E, cdiv(K, block_k), num_parts)](
        w_EKN, scale_EN, row_part, fwd_EKN, dgrad_EKN if dgrad else fwd_EKN, scale_EK if dgrad else scale_EN,
        *strides,
        K=K, N=N, EPS=EPS, DGRAD=dgrad, NUM_PARTS=num_parts, BLOCK_PARTS=next_power_of_2(num_parts),
        BLOCK_K=block_k, BLOCK_N=block_n, INTERPRETED=interpreted(),
        num_warps=quant_warps or (8 if not small else 4),
    )
    return Fp8Weight(fwd_EKN, scale_EN, dgrad_EKN, scale_EK)


def _per_group_columns_output(t_MC: Tensor, offs_E: Tensor, name: str) -> tuple[Tensor, Tensor, int, Tensor]:
    """What both per-group column launchers start from: the kernels' device check, the input
    with unit column stride, the column-major fp8 output ``[M, C]`` (leading dim ``ld``, M
    rounded up to 16) and its fp32 ``[E*C]`` scales. Returns (input, output, ld, scales)."""
    check_runs_on(_rows_kernel, t_MC.device, name, __name__)
    if t_MC.stride(1) != 1:
        t_MC = t_MC.contiguous()
    M, C = t_MC.shape
    q_MC, ld = _column_major_buffer(M, C, t_MC.device)
    return t_MC, q_MC, ld, torch.empty(offs_E.shape[0] * C, dtype=torch.float32, device=t_MC.device)


def quantize_group_columns_triton(t_MC: Tensor, offs_E: Tensor, offs_aligned: bool = False,
                                  block_m: int | None = None, block_c: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`quantize_group_columns` through ``_group_cols_kernel`` (grid: column blocks x
    (E + 1) groups; GPU default tile 128 rows x 64 columns)."""
    _check_group_columns_args(t_MC, offs_E)
    t_MC, q_MC, ld, scale_EC = _per_group_columns_output(t_MC, offs_E, "quantize_group_columns_triton")
    (M, C), E = t_MC.shape, offs_E.shape[0]
    small = _small_tiles(t_MC.device)
    block_m = block_m or (16 if small else 128)
    block_c = block_c or (16 if small else 64)
    _group_cols_kernel[(cdiv(C, block_c), E + 1)](
        t_MC, q_MC, scale_EC, offs_E, M, E, t_MC.stride(0), ld,
        C=C, EPS=EPS, ALIGNED=offs_aligned, BLOCK_M=block_m, BLOCK_C=block_c, INTERPRETED=interpreted(),
        num_warps=4,
    )
    return q_MC, scale_EC


def requantize_group_columns_pair_triton(qa_MA: Tensor, scale_a_M: Tensor, qb_MB: Tensor, scale_b_M: Tensor,
                                         offs_E: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """:func:`requantize_group_columns_pair` in two launches (the pair kernels of
    :func:`requantize_group_columns_triton`'s two; the same tiles)."""
    _check_requant_args(qa_MA, scale_a_M, offs_E)
    _check_requant_args(qb_MB, scale_b_M, offs_E)
    if qa_MA.shape[0] != qb_MB.shape[0]:
        raise ValueError(f"requantize_group_columns_pair: the two tensors need the same rows, got "
                         f"{tuple(qa_MA.shape)} and {tuple(qb_MB.shape)}")
    name = "requantize_group_columns_pair_triton"
    qa_MA, out_a, ld, scale_a_EC = _per_group_columns_output(qa_MA, offs_E, name)
    qb_MB, out_b, _, scale_b_EC = _per_group_columns_output(qb_MB, offs_E, name)
    (M, C_A), C_B, E = qa_MA.shape, qb_MB.shape[1], offs_E.shape[0]
    small = _small_tiles(qa_MA.device)
    block = 16 if small else 128
    factors = torch.empty(2, M, dtype=torch.float32, device=qa_MA.device)
    _group_row_factors_pair_kernel[(E + 1, 2)](
        scale_a_M, factors[0], scale_a_EC, scale_b_M, factors[1], scale_b_EC, offs_E, M, E,
        C_A=C_A, C_B=C_B, EPS=EPS, BLOCK_M=16 if small else 1024, BLOCK_C=16 if small else 1024,
        INTERPRETED=interpreted(), num_warps=4,
    )
    _requant_tiles_pair_kernel[(cdiv(ld, block), cdiv(C_A, block) + cdiv(C_B, block))](
        qa_MA.view(torch.uint8), factors[0], out_a, qb_MB.view(torch.uint8), factors[1], out_b,
        M, ld, qa_MA.stride(0), qb_MB.stride(0), ld,
        C_A=C_A, C_B=C_B, BLOCK_M=block, BLOCK_C=block, INTERPRETED=interpreted(), num_warps=4,
    )
    return (out_a, scale_a_EC), (out_b, scale_b_EC)


def requantize_group_columns_triton(q_MC: Tensor, scale_M: Tensor, offs_E: Tensor, block_m: int | None = None,
                                    block_c: int | None = None, num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`requantize_group_columns` in two kernels: ``_group_row_factors_kernel`` (grid
    E + 1: group scales and per-row shift factors, M floats of traffic) then
    ``_requant_tiles_kernel`` over [M, C] in tiles (GPU default 128 x 128, 4 warps: the best
    of six settings on the H200, 0.083 ms at [65,536, 2048], 3.2 TB/s), so a large group is
    spread over as many programs as its rows fill."""
    _check_requant_args(q_MC, scale_M, offs_E)
    q_MC, out_MC, ld, scale_EC = _per_group_columns_output(q_MC, offs_E, "requantize_group_columns_triton")
    (M, C), E = q_MC.shape, offs_E.shape[0]
    small = _small_tiles(q_MC.device)
    block_m = block_m or (16 if small else 128)
    block_c = block_c or (16 if small else 128)
    factor_M = torch.empty(M, dtype=torch.float32, device=q_MC.device)
    _group_row_factors_kernel[(E + 1,)](
        scale_M, factor_M, scale_EC, offs_E, M, E,
        C=C, EPS=EPS, BLOCK_M=16 if small else 1024, BLOCK_C=16 if small else 1024, INTERPRETED=interpreted(),
        num_warps=4,
    )
    _requant_tiles_kernel[(cdiv(ld, block_m), cdiv(C, block_c))](
        q_MC.view(torch.uint8), factor_M, out_MC, M, ld, q_MC.stride(0), ld,
        C=C, BLOCK_M=block_m, BLOCK_C=block_c, INTERPRETED=interpreted(),
        num_warps=num_warps or 4,
    )
    return out_MC, scale_EC


# ----------------------------------------------------------------------------------------
# dispatch: kernels where they run (CUDA; CPU under the interpreter), else the references
# ----------------------------------------------------------------------------------------
def quantize_rows(x_MK: Tensor, dest_M: Tensor | None = None, num_rows: int | None = None,
                  pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Rowwise e4m3 quantization, optionally scattering rows into a padded output.

    Args:
        x_MK: [M, K] bf16/fp16/fp32 (row-major is read in place; other layouts are copied).
        dest_M: optional int64 [M]: row m is written to row ``dest_M[m]`` of the output;
            entries outside ``[0, num_rows)`` are skipped. Entries must be distinct (two
            rows sent to one destination race). Not read on the host.
        num_rows: P, the number of output rows (with ``dest_M`` only).
        pow2: round each scale up to a power of two (``amax / scale`` in (224, 448]), as
            :func:`requantize_group_columns` needs.

    Returns:
        (q, scale): fp8 [M, K] and fp32 [M] (``x[m] ~= q[m].float() * scale[m]``); with
        ``dest_M``, [P, K] and [P] whose rows nobody writes are zero (codes and scale).
    """
    if kernels_run_on(x_MK.device):
        return quantize_rows_triton(x_MK, dest_M, num_rows, pow2=pow2)
    return quantize_rows_reference(x_MK, dest_M, num_rows, pow2=pow2)


def quantize_situ_rows(z_M2K: Tensor, beta1: float, beta2: float, pow2: bool = False) -> tuple[Tensor, Tensor]:
    """Rowwise e4m3 quantization of the SiTU-GLU activation of packed pre-activations, without
    writing the activation out (the fp8 down projection's input, `fp8_grouped_mm(situ=...)`).

    Args:
        z_M2K: [M, 2K] bf16/fp16/fp32, gate in columns [0, K), up in [K, 2K) (the layout of
            `titan_moe.model.situ.situ_glu_packed`).
        beta1, beta2: SiTU-GLU's clip scales (> 0).
        pow2: as in :func:`quantize_rows`.

    Returns:
        (q, scale): fp8 [M, K] and fp32 [M], as ``quantize_rows(hidden)`` for the hidden
        activation computed in fp32 (not rounded to z's dtype first). The kernel's tanh
        differs from torch's by a few fp32 ulp, so a code can differ from the reference's by
        one step where the value sits on a rounding boundary.
    """
    if kernels_run_on(z_M2K.device):
        return quantize_situ_rows_triton(z_M2K, beta1, beta2, pow2)
    return quantize_situ_rows_reference(z_M2K, beta1, beta2, pow2)


def quantize_weight(w_EKN: Tensor, dgrad: bool = True) -> Fp8Weight:
    """Both fp8 layouts of the expert weights ``w_EKN [E, K, N]`` (any strides), see
    :class:`Fp8Weight`; ``dgrad=False`` skips the dx layout (inference)."""
    if kernels_run_on(w_EKN.device):
        return quantize_weight_triton(w_EKN, dgrad)
    return quantize_weight_reference(w_EKN, dgrad)


def quantize_group_columns(t_MC: Tensor, offs_E: Tensor, offs_aligned: bool = False) -> tuple[Tensor, Tensor]:
    """Per-group, per-column e4m3 quantization for the fp8 weight gradient.

    Args:
        t_MC: [M, C] bf16/fp16/fp32, rows sorted by group.
        offs_E: [E] int32 cumulative group ends (empty groups allowed; rows past
            ``offs[-1]`` belong to no group). Read on the host only by the reference.
        offs_aligned: promise that every ``offs`` entry is a multiple of 16 (not checked):
            the kernel then writes 16-byte vectors. A broken promise gives misaligned
            stores on the GPU (a CUDA error or wrong codes).

    Returns:
        (q, scale): fp8 [M, C] column-major (strides ``(1, ld)``, ``ld`` = M rounded up to
        16), rows past ``offs[-1]`` zero; fp32 [E*C] with ``scale[e*C + c]`` the scale of
        column c over group e's rows (``EPS / 448`` for empty groups).
    """
    if kernels_run_on(t_MC.device):
        return quantize_group_columns_triton(t_MC, offs_E, offs_aligned)
    return quantize_group_columns_reference(t_MC, offs_E)


def requantize_group_columns_pair(qa_MA: Tensor, scale_a_M: Tensor, qb_MB: Tensor, scale_b_M: Tensor,
                                  offs_E: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """:func:`requantize_group_columns` of two tensors with the same rows and groups (the
    fp8_rows weight gradient's x and dy codes) in one pair of launches instead of two: the
    same results, bit for bit. Returns ``((qa, scale_a), (qb, scale_b))``."""
    if kernels_run_on(qa_MA.device):
        return requantize_group_columns_pair_triton(qa_MA, scale_a_M, qb_MB, scale_b_M, offs_E)
    return (requantize_group_columns_reference(qa_MA, scale_a_M, offs_E),
            requantize_group_columns_reference(qb_MB, scale_b_M, offs_E))


def requantize_group_columns(q_MC: Tensor, scale_M: Tensor, offs_E: Tensor) -> tuple[Tensor, Tensor]:
    """Row-quantized codes re-expressed per group, in the layout of :func:`quantize_group_columns`.

    For the fp8 weight gradient from the operands the forward and dx GEMMs already
    quantized by rows: reads 1 byte per element instead of :func:`quantize_group_columns`'
    2 + 2 (two passes over bf16), and needs no pass over the 16-bit tensor at all.

    Args:
        q_MC: fp8 e4m3 [M, C] row-major codes, rows sorted by group, from
            ``quantize_rows(t, pow2=True)``.
        scale_M: their fp32 [M] row scales, powers of two (not checked: other scales make
            the re-expression a second rounding instead of an exact shift).
        offs_E: [E] int32 cumulative group ends, multiples of 16 (``fp8_grouped_mm``'s rule;
            not checked on the GPU, misaligned offsets give misaligned stores).

    Returns:
        (q, scale): fp8 [M, C] column-major (strides ``(1, ld)``, ``ld`` = M rounded up to
        16), rows past ``offs[-1]`` zero; fp32 [E*C] where ``scale[e*C + c]`` is group e's
        scale for every column c: the largest row scale of the group (at least the scale of
        an all-zero row). Each code is ``q[m, c] * scale[m] / group scale``: a power-of-two
        shift, exact unless the result falls below 2^-6 into e4m3's subnormals, where it
        rounds to nearest even (small entries of rows whose scale is far below the group's).
    """
    if kernels_run_on(q_MC.device):
        return requantize_group_columns_triton(q_MC, scale_M, offs_E)
    return requantize_group_columns_reference(q_MC, scale_M, offs_E)
