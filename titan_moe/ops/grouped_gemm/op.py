"""Grouped expert GEMM as ``torch.library`` custom ops (namespace ``titan_moe``).

``grouped_mm(x_MK, w_EKN, offs_E) -> out_MN`` multiplies each group of rows of ``x`` by
its own weight matrix; the contract (sorted rows, int32 cumulative ends, zero rows past
``offs[-1]``) is stated in :mod:`titan_moe.ops.grouped_gemm.reference`.

Three ops are registered so that ``torch.compile(fullgraph=True)`` sees them as opaque
nodes in both the forward and the backward graph:

* ``titan_moe::grouped_mm``    (x [M,K], w [E,K,N], offs [E]) -> [M,N]
* ``titan_moe::grouped_mm_dx`` (grad [M,N], w [E,K,N], offs [E]) -> [M,K] = grad @ w[e]^T per group
* ``titan_moe::grouped_mm_dw`` (x [M,K], grad [M,N], offs [E]) -> [E,K,N] = x^T @ grad per group

Backends, chosen per call by the ``backend`` argument of the ops, else the ``[kernels]
grouped_mm`` choice (`titan_moe.ops.choices`, default ``"auto"``); either names one backend
for the three products, or one per product, ``"fwd=triton,dx=triton,dw=native"`` (a product not
named takes ``"native"``), so that each product can run where it was measured fastest:

* ``"native"``: ``torch._grouped_mm`` where it supports the case (below), else the per-group
  loop.
* ``"triton"``: our persistent Triton kernels (:mod:`.triton_kernel`; any dtype, width and
  alignment) on CUDA, or on CPU when ``TRITON_INTERPRET=1`` was set before the kernel
  module was first imported (tests); elsewhere a ``ValueError``.
* ``"gluon"``: our warp-specialized Gluon kernels on sm90 (:mod:`.gluon_kernel`: ping-pong
  forward / dx, dw) where their scope covers the call (16-bit, TMA-describable, reductions a
  multiple of 64), else the Triton kernels on CUDA and ``"native"`` elsewhere.
* ``"loop"``: always the per-group loop of the reference.
* ``"auto"`` (default): per call from the shapes (`auto_backend`): on sm90 the Gluon kernels
  where the groups are large, the Triton TMA kernels where they are midsize, ``"native"``
  otherwise (every other device and dtype: CPU, fp32, GPUs other than sm90).

``"native"`` in detail:

* ``torch._grouped_mm`` (fp32 accumulation inside) when it supports the case: bf16 on a
  CUDA device of compute capability >= 9.0, or fp32/bf16 on CPU with torch >= 2.13.
  It needs 16-byte aligned operands, i.e. ``K`` and ``N`` multiples of
  ``16 / element_size`` (8 for bf16, 4 for fp32) and 16-byte aligned data pointers.
  It places no constraint on group sizes: empty groups and sizes that are not
  multiples of 16 gave correct results on CPU (torch 2.13) and on an H200 (torch
  2.11). The rows past ``offs[-1]`` and the weight gradient of empty groups are not
  guaranteed to be written (on CPU the rows past ``offs[-1]`` hold garbage), so both
  are zeroed explicitly here, on CUDA by kernels that touch only those elements
  (:mod:`.zero_fill`).
* otherwise the per-group loop of the reference (fp32 matmuls, one host read of
  ``offs``). We fall back rather than pad: padding ``K``/``N`` would copy the weights
  on every call, and the model's widths are multiples of 8 anyway.

The offsets contract is checked on the host in the loop path and on CPU; on CUDA the
native and Triton paths do not check it (that would cost a device sync) and violating it
is undefined behaviour (the Triton kernels clamp group bounds into ``[0, M]``, so at least
they never access memory out of bounds).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from titan_moe.ops import choices
from titan_moe.ops.eager_path import direct_autograd, takes_direct_path
from titan_moe.ops.grouped_gemm.reference import (
    group_bounds,
    grouped_mm_dw_reference,
    grouped_mm_reference,
)
from titan_moe.ops.nvtx import nvtx_range

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = choices.GROUPED_MM_BACKENDS
PRODUCTS = choices.GROUPED_MM_PRODUCTS


def resolve_backend(backend: str | None = None, product: str = "fwd") -> str:
    """The backend ``product`` ("fwd", "dx" or "dw") uses: from ``backend`` if given, else the
    ``[kernels] grouped_mm`` choice (`titan_moe.ops.choices.grouped_mm_backends` reads the spec)."""
    if backend:
        return choices.grouped_mm_backends(backend, "grouped_mm: backend argument")[product]
    return choices.grouped_mm_backends(choices.current().grouped_mm)[product]


# "auto": our TMA kernel for the forward and dx where the groups average at least this many
# rows, else torch._grouped_mm: on the H200 our TMA forward led torch._grouped_mm's at 1,024
# rows per group (E = 64) and trailed at 256 and at 146 (K3's 112 local experts); at 512 it led
# slightly.
AUTO_MIN_GROUP_ROWS = 512
# "auto" for dw: our dw kernel (on sm90: per-group TMA descriptors, TMA stores) where the groups
# average at least this many rows: on the H200 it led torch._grouped_mm's dw at E = 64's 1,024
# rows per group and trailed at K3's 146; nothing between was measured
AUTO_DW_MIN_GROUP_ROWS = 1024
# "auto": the Gluon kernels (which fall back to the Triton ones outside their scope) for all
# three products where the groups average at least this many rows: on the H200 they led the
# Triton kernels at E = 64's 1,024 rows per group (balanced and Zipf 1.1) and at the MoE layer
# benchmark's expert shapes; fewer rows per group were not measured
AUTO_GLUON_MIN_GROUP_ROWS = 1024


def auto_backend(product: str, x_MK: Tensor, offs_E: Tensor) -> str:
    """The backend "auto" picks for ``product`` on this call, from shapes only (no sync), on
    sm90 with 16-bit operands: "gluon" with at least ``AUTO_GLUON_MIN_GROUP_ROWS`` rows per
    group on average, else "triton" with at least ``AUTO_MIN_GROUP_ROWS`` for the forward and
    dx (``AUTO_DW_MIN_GROUP_ROWS`` for dw); "native" otherwise and elsewhere. Measured on the
    GPU alone (CUDA-graph replays): each of our launches costs the host more than
    ``torch._grouped_mm``'s, which an eager layer waiting on the host feels."""
    min_rows = AUTO_DW_MIN_GROUP_ROWS if product == "dw" else AUTO_MIN_GROUP_ROWS
    rows, groups = x_MK.shape[0], offs_E.shape[0]
    if x_MK.device.type != "cuda" or x_MK.dtype == torch.float32 or rows < min_rows * groups:
        return "native"
    if not _triton_kernels()._is_sm90(x_MK.device):
        return "native"
    return "gluon" if rows >= AUTO_GLUON_MIN_GROUP_ROWS * groups else "triton"


def _triton_kernels():
    # Imported on first use: the module decides at import time whether its kernels are
    # compiled or interpreted (TRITON_INTERPRET), and the other backends never need it.
    from titan_moe.ops.grouped_gemm import triton_kernel

    return triton_kernel


def _gluon_kernels():
    # Imported on first use, as `_triton_kernels`: Gluon needs a Triton with its experimental
    # frontend, and only this backend needs it.
    from titan_moe.ops.grouped_gemm import gluon_kernel

    return gluon_kernel


@functools.cache
def _gluon_importable() -> bool:
    """Whether the installed Triton has the Gluon frontend our Gluon kernels are written in
    (Triton 3.6 has; an older one makes the "gluon" backend, hence "auto", take the Triton
    kernels instead of failing on import)."""
    try:
        _gluon_kernels()
    except ImportError:
        return False
    return True


def _resolve_gluon(product: str, a: Tensor, b: Tensor) -> str:
    """What the "gluon" backend runs for this call: "gluon" where its kernels' scope covers it
    (product "fwd"/"dx": a = x or grad, b = w or its transposed view; "dw": a = x, b = grad)
    and the installed Triton has Gluon, else "triton" on CUDA, "native" elsewhere."""
    if a.device.type != "cuda":
        return "native"
    if not _gluon_importable():
        return "triton"
    gk = _gluon_kernels()
    ok = gk.gluon_dw_supported(a, b) if product == "dw" else gk.gluon_supported(a, b)
    return "gluon" if ok else "triton"


def _check_args(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> None:
    """Shape/dtype checks that need no data (safe under tracing and in fake impls)."""
    if x_MK.dim() != 2 or w_EKN.dim() != 3 or offs_E.dim() != 1:
        raise ValueError(
            "grouped_mm expects x [M,K], w [E,K,N], offs [E]; got "
            f"x {tuple(x_MK.shape)}, w {tuple(w_EKN.shape)}, offs {tuple(offs_E.shape)}"
        )
    if x_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"grouped_mm: K mismatch, x {tuple(x_MK.shape)} vs w {tuple(w_EKN.shape)}")
    if offs_E.shape[0] != w_EKN.shape[0] or w_EKN.shape[0] == 0:
        raise ValueError(
            f"grouped_mm: offs must have one entry per group (E={w_EKN.shape[0]} >= 1), got {tuple(offs_E.shape)}"
        )
    if offs_E.dtype != torch.int32:
        raise ValueError(f"grouped_mm: offs must be int32, got {offs_E.dtype}")
    if x_MK.dtype != w_EKN.dtype or x_MK.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"grouped_mm: x and w must share a dtype in {_SUPPORTED_DTYPES}, got {x_MK.dtype} and {w_EKN.dtype}"
        )
    if not (x_MK.device == w_EKN.device == offs_E.device):
        raise ValueError(
            f"grouped_mm: x, w, offs must be on one device, got {x_MK.device}, {w_EKN.device}, {offs_E.device}"
        )


def _cuda_native_ok(device_index: int) -> bool:
    from titan_moe.ops.triton_runtime import cuda_capability  # imports Triton: on first use, as _triton_kernels

    return cuda_capability(device_index) >= (9, 0)


def _aligned(t: Tensor, align: int) -> bool:
    """Row- or column-major in the last two dims with 16-byte aligned strides and data pointer."""
    rows, cols = t.shape[-2], t.shape[-1]
    if t.stride(-1) == 1 and t.stride(-2) >= max(1, cols):
        lead = t.stride(-2)
    elif t.stride(-2) == 1 and t.stride(-1) >= max(1, rows):
        lead = t.stride(-1)
    else:
        return False
    batch_ok = t.dim() == 2 or t.stride(0) % align == 0
    return lead % align == 0 and batch_ok and t.data_ptr() % 16 == 0


def _native_ok(a: Tensor, b: Tensor) -> bool:
    """Whether ``torch._grouped_mm(a, b, offs=...)`` handles this call (see the module docstring)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtype, device = a.dtype, a.device
    if device.type == "cuda":
        if dtype != torch.bfloat16 or not _cuda_native_ok(device.index or 0):
            return False
    elif device.type == "cpu":
        if dtype not in (torch.float32, torch.bfloat16) or torch.__version__ < "2.13":
            return False
    else:
        return False
    align = 16 // a.element_size()
    return _aligned(a, align) and _aligned(b, align)


def _zero_unwritten_rows(out_MN: Tensor, offs_E: Tensor) -> Tensor:
    """Rows past ``offs[-1]`` set to zero (``torch._grouped_mm`` leaves them unwritten)."""
    if out_MN.is_cuda and out_MN.stride(1) == 1:
        from titan_moe.ops.grouped_gemm.zero_fill import zero_rows_past_

        return zero_rows_past_(out_MN, offs_E)
    owned_M1 = (torch.arange(out_MN.shape[0], device=out_MN.device) < offs_E[-1]).unsqueeze(1)
    return out_MN.masked_fill_(~owned_M1, 0)


def _zero_empty_groups(dw_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """``dw[e] = 0`` for empty groups (``torch._grouped_mm`` does not write them)."""
    if dw_EKN.is_cuda and dw_EKN.is_contiguous():
        from titan_moe.ops.grouped_gemm.zero_fill import zero_empty_groups_

        return zero_empty_groups_(dw_EKN, offs_E)
    empty_E11 = (torch.diff(offs_E, prepend=offs_E.new_zeros(1)) == 0).view(-1, 1, 1)
    return dw_EKN.masked_fill_(empty_E11, 0)


# --------------------------------------------------------------------------- forward
def _forward_impl(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None, product: str) -> Tensor:
    """``w_EKN`` may be row-major or a transposed (column-major) view; every backend takes both."""
    name = resolve_backend(backend, product)
    if name == "auto":
        name = auto_backend(product, x_MK, offs_E)
    if name == "gluon":
        name = _resolve_gluon(product, x_MK, w_EKN)
        if name == "gluon":
            return _gluon_kernels().grouped_mm_gluon(x_MK, w_EKN, offs_E)
    m = x_MK.shape[0]
    if name == "triton":
        if x_MK.device.type == "cpu":
            group_bounds(offs_E, m)
        return _triton_kernels().grouped_mm_triton(x_MK, w_EKN, offs_E)
    x_MK = x_MK.contiguous()
    if w_EKN.stride(2) != 1 and w_EKN.stride(1) != 1:
        w_EKN = w_EKN.contiguous()
    if name == "loop" or not _native_ok(x_MK, w_EKN):
        return grouped_mm_reference(x_MK, w_EKN, offs_E)
    if x_MK.device.type == "cpu":
        group_bounds(offs_E, m)
    return _zero_unwritten_rows(torch._grouped_mm(x_MK, w_EKN, offs=offs_E), offs_E)


def _grouped_mm_impl(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    with nvtx_range("op.grouped_mm"):
        return _forward_impl(x_MK, w_EKN, offs_E, backend, "fwd")


_grouped_mm_op = torch.library.custom_op("titan_moe::grouped_mm", mutates_args=())(_grouped_mm_impl)


@_grouped_mm_op.register_fake
def _(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    _check_args(x_MK, w_EKN, offs_E)
    return x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])


# --------------------------------------------------------------------------- backward: dx
def _grouped_mm_dx_impl(grad_MN: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    # dx[rows of e] = grad[rows of e] @ w[e]^T: the forward op on the transposed weights.
    with nvtx_range("op.grouped_mm_dx"):
        return _forward_impl(grad_MN, w_EKN.transpose(1, 2), offs_E, backend, "dx")


_grouped_mm_dx_op = torch.library.custom_op("titan_moe::grouped_mm_dx", mutates_args=())(_grouped_mm_dx_impl)


@_grouped_mm_dx_op.register_fake
def _(grad_MN: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    return grad_MN.new_empty(grad_MN.shape[0], w_EKN.shape[1])


# --------------------------------------------------------------------------- backward: dw
def _grouped_mm_dw_impl(x_MK: Tensor, grad_MN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    with nvtx_range("op.grouped_mm_dw"):
        name = resolve_backend(backend, "dw")
        if name == "auto":
            name = auto_backend("dw", x_MK, offs_E)
        if name == "gluon":
            name = _resolve_gluon("dw", x_MK, grad_MN)
            if name == "gluon":
                return _gluon_kernels().grouped_mm_dw_gluon(x_MK, grad_MN, offs_E)
        if name == "triton":
            if x_MK.device.type == "cpu":
                group_bounds(offs_E, x_MK.shape[0])
            return _triton_kernels().grouped_mm_dw_triton(x_MK, grad_MN, offs_E)
        x_MK, grad_MN = x_MK.contiguous(), grad_MN.contiguous()
        if name == "loop" or not _native_ok(x_MK.t(), grad_MN):
            return grouped_mm_dw_reference(x_MK, grad_MN, offs_E)
        if x_MK.device.type == "cpu":
            group_bounds(offs_E, x_MK.shape[0])
        return _zero_empty_groups(torch._grouped_mm(x_MK.t(), grad_MN, offs=offs_E), offs_E)


_grouped_mm_dw_op = torch.library.custom_op("titan_moe::grouped_mm_dw", mutates_args=())(_grouped_mm_dw_impl)


@_grouped_mm_dw_op.register_fake
def _(x_MK: Tensor, grad_MN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    return x_MK.new_empty(offs_E.shape[0], x_MK.shape[1], grad_MN.shape[1])


# --------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output) -> None:
    x_MK, w_EKN, offs_E, backend = inputs
    ctx.save_for_backward(x_MK, w_EKN, offs_E)
    ctx.backend = backend


def _backward(ctx, grad_MN: Tensor):
    x_MK, w_EKN, offs_E = ctx.saved_tensors
    grad_MN = grad_MN.contiguous()
    eager = getattr(ctx, "eager_impl", False)
    dx, dw = (_grouped_mm_dx_impl, _grouped_mm_dw_impl) if eager else (_grouped_mm_dx_op, _grouped_mm_dw_op)
    dx_MK = dx(grad_MN, w_EKN, offs_E, ctx.backend) if ctx.needs_input_grad[0] else None
    dw_EKN = dw(x_MK, grad_MN, offs_E, ctx.backend) if ctx.needs_input_grad[1] else None
    return dx_MK, dw_EKN, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# eager calls: the same functions without the custom-op dispatch (titan_moe.ops.eager_path)
_EagerGroupedMM = direct_autograd("_EagerGroupedMM", _grouped_mm_impl, _setup_context, _backward)


def grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor, backend: str | None = None) -> Tensor:
    """Grouped GEMM ``out[rows of e] = x[rows of e] @ w[e]``, differentiable in ``x`` and ``w``.

    Args:
        x_MK: [M, K] rows sorted by group.
        w_EKN: [E, K, N] per-group weights, same dtype as ``x_MK`` (fp32, bf16 or fp16).
        offs_E: [E] int32 cumulative group ends, non-decreasing, ``offs[-1] <= M``.
        backend: "auto", "native", "triton", "gluon" or "loop" (module docstring) for the
            forward and both backward products, or one per product
            ("fwd=triton,dx=triton,dw=native"); None: the ``[kernels] grouped_mm`` choice in
            force at run time (`titan_moe.ops.choices.current`).

    Returns:
        [M, N] in ``x_MK.dtype`` (fp32 accumulation); rows ``offs[-1]:`` are zero and
        receive zero gradient.
    """
    _check_args(x_MK, w_EKN, offs_E)
    if backend is not None:
        resolve_backend(backend)  # a bad name fails here, not inside the op
    if takes_direct_path(x_MK, w_EKN, offs_E):  # an eager call on real tensors
        return _EagerGroupedMM.apply(x_MK, w_EKN, offs_E, backend)
    return torch.ops.titan_moe.grouped_mm(x_MK, w_EKN, offs_E, backend)  # opaque to a traced graph
