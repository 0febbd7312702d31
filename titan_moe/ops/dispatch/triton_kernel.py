"""Triton kernels of the token dispatch ops (contract: :mod:`titan_moe.ops.dispatch.reference`).

All three are token-major: a program owns ``BLOCK_N`` tokens and reads or writes their
``k`` sorted rows through ``pos_Nk``; rows are contiguous ``L``-vectors, so every access
is a full, vectorised row segment (``L`` is a compile-time constant, so the compiler knows
the row stride and its alignment).

``_permute_kernel``       grid (N / BLOCK_N, L / BLOCK_L). Loads the token tile once and
    stores it to its k destination rows: ``N L`` elements read, ``M L`` written (a gather
    by sorted row would read ``M L``, each token k times).
``_gather_sum_kernel``    grid (N / BLOCK_N, L / BLOCK_L). For each of the k copies, loads
    the rows ``pos[n, j]`` and accumulates ``w[n, j] * y`` (or ``y``) in fp32; one store in
    the output dtype. Reads ``M L``, writes ``N L``. The combine forward, and the gradient
    of permute (no weights).
``_combine_bwd_kernel``   grid (N / BLOCK_N,). The weight gradient is a dot product over
    the whole row, so one program walks all of L for its tokens (no split of L, hence no
    atomics and a deterministic result): per L block it loads ``grad`` once, and for each
    copy stores ``dy[pos] = w * grad`` and adds ``<grad, y[pos]>`` into an fp32
    ``[BLOCK_N, BLOCK_K]`` accumulator. Reads ``N L + M L``, writes ``M L``.

Positions outside ``[0, M)`` are masked (never an out-of-bounds access; the rows they
should have filled stay unwritten). Outputs are allocated with ``torch.empty``: with
positions that form a permutation every row is written exactly once.

Under ``TRITON_INTERPRET=1`` (set before this module is first imported) the kernels run
on CPU tensors (tests). Only builtins and our own jit helpers are used (``tl.reduce``
with ``_add``, ``tl.full``): triton.language.standard's jit functions stay compiled-only
when Triton was imported before the variable was set.

Block sizes are starting points chosen from register budgets, not measured on a GPU
(``profiling/bench_moe.py --dispatch`` times them): ``BLOCK_L`` is the largest power of
two <= 1024 that divides ``L`` (>= 128), else ``min(1024, next_pow2(L))``; ``BLOCK_N``
fills a tile of 4096 elements (e.g. L = 3584: 8 x 512; L = 1024: 4 x 1024).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from titan_moe.ops.dispatch.reference import sorted_rows, sorted_rows_buffer
from titan_moe.ops.triton_runtime import cdiv, check_runs_on, is_interpreted, kernel_runs_on, next_power_of_2

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TILE_ELEMENTS = 4096


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _permute_kernel(
    x_ptr, pos_ptr, out_ptr, N, M,
    L: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    col_ok = cols < L
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * L + cols[None, :], mask=row_ok[:, None] & col_ok[None, :])
    for j in tl.static_range(K):
        dst = tl.load(pos_ptr + rows64 * K + j, mask=row_ok, other=-1).to(tl.int64)
        ok = row_ok & (dst >= 0) & (dst < M)
        tl.store(out_ptr + dst[:, None] * L + cols[None, :], x, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_sum_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, N, M,
    L: tl.constexpr, K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    row_ok = rows < N
    col_ok = cols < L
    rows64 = rows.to(tl.int64)
    acc = tl.full((BLOCK_N, BLOCK_L), 0.0, tl.float32)
    for j in tl.static_range(K):
        src = tl.load(pos_ptr + rows64 * K + j, mask=row_ok, other=-1).to(tl.int64)
        ok = row_ok & (src >= 0) & (src < M)
        y = tl.load(y_ptr + src[:, None] * L + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + rows64 * K + j, mask=row_ok, other=0.0).to(tl.float32)
            acc += w[:, None] * y.to(tl.float32)
        else:
            acc += y.to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * L + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_bwd_kernel(
    g_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, N, M,
    L: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    dw = tl.full((BLOCK_N, BLOCK_K), 0.0, tl.float32)
    for l0 in range(0, L, BLOCK_L):
        cols = l0 + tl.arange(0, BLOCK_L)
        col_ok = cols < L
        g = tl.load(g_ptr + rows64[:, None] * L + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            p = tl.load(pos_ptr + rows64 * K + j, mask=row_ok, other=-1).to(tl.int64)
            ok = row_ok & (p >= 0) & (p < M)
            mask = ok[:, None] & col_ok[None, :]
            w = tl.load(w_ptr + rows64 * K + j, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(dy_ptr + p[:, None] * L + cols[None, :], (w[:, None] * g).to(dy_ptr.dtype.element_ty), mask=mask)
            y = tl.load(y_ptr + p[:, None] * L + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            part = tl.reduce(g * y, 1, _add)
            dw = tl.where(slots[None, :] == j, dw + part[:, None], dw)
    tl.store(dw_ptr + rows64[:, None] * K + slots[None, :], dw.to(dw_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (slots[None, :] < K))


# ----------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockConfig:
    """Tile of one launch: ``block_n`` tokens x ``block_l`` columns (powers of two)."""

    block_n: int
    block_l: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_l"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"BlockConfig.{name} must be a power of two >= 1, got {v}")


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_permute_kernel)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return kernel_runs_on(_permute_kernel, device)


def default_config(latent: int, device: torch.device) -> BlockConfig:
    """Module docstring; under the interpreter 4 x 16 tiles, so small tests cross tile edges."""
    if device.type != "cuda":
        return BlockConfig(4, 16)
    block_l = 1024
    while block_l > 128 and latent % block_l:
        block_l //= 2
    if latent % block_l:
        block_l = min(1024, next_power_of_2(latent))
    return BlockConfig(max(1, _TILE_ELEMENTS // block_l), block_l)


def _check(name: str, rows: torch.Tensor, pos_Nk: torch.Tensor, *others: torch.Tensor) -> None:
    if rows.dtype not in _DTYPES:
        raise ValueError(f"{name}: activations must be one of {_DTYPES}, got {rows.dtype}")
    if pos_Nk.dtype not in (torch.int32, torch.int64) or pos_Nk.dim() != 2:
        raise ValueError(f"{name}: pos must be a 2-D int32/int64 tensor, got {pos_Nk.dtype} {tuple(pos_Nk.shape)}")
    devices = {t.device for t in (rows, pos_Nk, *others)}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors must share a device, got {sorted(map(str, devices))}")
    check_runs_on(_permute_kernel, rows.device, name, "titan_moe.ops.dispatch.triton_kernel")


def permute_triton(x_NL: torch.Tensor, pos_Nk: torch.Tensor, config: BlockConfig | None = None,
                   rows: int | None = None) -> torch.Tensor:
    """``out[pos[n, j]] = x[n]`` -> [rows (default N*k), L] contiguous, ``x_NL.dtype``; rows
    that no copy owns (an aligned layout, ``rows > N*k``) are zero."""
    _check("permute_triton", x_NL, pos_Nk)
    x_NL, pos_Nk = x_NL.contiguous(), pos_Nk.contiguous()
    (n, k), latent = pos_Nk.shape, x_NL.shape[1]
    if x_NL.shape[0] != n:
        raise ValueError(f"permute_triton: x has {x_NL.shape[0]} rows, pos {n}")
    rows = sorted_rows("permute_triton", rows, n * k)
    out_RL = sorted_rows_buffer(x_NL, rows, n * k)
    if n == 0 or latent == 0:
        return out_RL
    cfg = config or default_config(latent, x_NL.device)
    grid = (cdiv(n, cfg.block_n), cdiv(latent, cfg.block_l))
    _permute_kernel[grid](x_NL, pos_Nk, out_RL, n, rows, L=latent, K=k, BLOCK_N=cfg.block_n,
                          BLOCK_L=cfg.block_l, num_warps=cfg.num_warps)
    return out_RL


def gather_sum_triton(
    y_ML: torch.Tensor,
    pos_Nk: torch.Tensor,
    weights_Nk: torch.Tensor | None,
    out_dtype: torch.dtype | None = None,
    config: BlockConfig | None = None,
) -> torch.Tensor:
    """``out[n] = sum_j w[n, j] * y[pos[n, j]]`` (``w = None``: plain sum) -> [N, L] contiguous.

    ``y_ML`` has N*k rows, or more in an aligned layout. fp32 accumulation; one rounding to
    ``out_dtype`` (default ``y_ML.dtype``).
    """
    others = () if weights_Nk is None else (weights_Nk,)
    _check("gather_sum_triton", y_ML, pos_Nk, *others)
    y_ML, pos_Nk = y_ML.contiguous(), pos_Nk.contiguous()
    (n, k), latent = pos_Nk.shape, y_ML.shape[1]
    if y_ML.shape[0] < n * k or (weights_Nk is not None and weights_Nk.shape != pos_Nk.shape):
        raise ValueError(f"gather_sum_triton: y {tuple(y_ML.shape)}, pos {tuple(pos_Nk.shape)} and weights "
                         f"{None if weights_Nk is None else tuple(weights_Nk.shape)} do not match")
    out_NL = y_ML.new_empty(n, latent, dtype=out_dtype or y_ML.dtype)
    if out_NL.numel() == 0:
        return out_NL
    w_arg = pos_Nk if weights_Nk is None else weights_Nk.contiguous()  # unused pointer when no weights
    cfg = config or default_config(latent, y_ML.device)
    grid = (cdiv(n, cfg.block_n), cdiv(latent, cfg.block_l))
    _gather_sum_kernel[grid](y_ML, pos_Nk, w_arg, out_NL, n, y_ML.shape[0], L=latent, K=k,
                             HAS_WEIGHTS=weights_Nk is not None, BLOCK_N=cfg.block_n, BLOCK_L=cfg.block_l,
                             num_warps=cfg.num_warps)
    return out_NL


def combine_backward_triton(
    grad_NL: torch.Tensor,
    y_ML: torch.Tensor,
    pos_Nk: torch.Tensor,
    weights_Nk: torch.Tensor,
    config: BlockConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dy[pos[n, j]] = w[n, j] * grad[n]`` ([rows of y, L], ``y_ML.dtype``, rows no copy
    owns zero) and ``dw[n, j] = <grad[n], y[pos[n, j]]>`` ([N, k], ``weights_Nk.dtype``),
    fp32 arithmetic."""
    _check("combine_backward_triton", y_ML, pos_Nk, grad_NL, weights_Nk)
    grad_NL, y_ML = grad_NL.contiguous(), y_ML.contiguous()
    pos_Nk, weights_Nk = pos_Nk.contiguous(), weights_Nk.contiguous()
    (n, k), latent = pos_Nk.shape, y_ML.shape[1]
    if y_ML.shape[0] < n * k or weights_Nk.shape != pos_Nk.shape or grad_NL.shape != (n, latent):
        raise ValueError(f"combine_backward_triton: grad {tuple(grad_NL.shape)}, y {tuple(y_ML.shape)}, pos "
                         f"{tuple(pos_Nk.shape)}, weights {tuple(weights_Nk.shape)} do not match")
    dy_ML = sorted_rows_buffer(y_ML, y_ML.shape[0], n * k)
    dw_Nk = torch.empty_like(weights_Nk)
    if n == 0:
        return dy_ML, dw_Nk
    if latent == 0:
        return dy_ML, dw_Nk.zero_()
    cfg = config or default_config(latent, y_ML.device)
    _combine_bwd_kernel[(cdiv(n, cfg.block_n),)](
        grad_NL, y_ML, pos_Nk, weights_Nk, dy_ML, dw_Nk, n, y_ML.shape[0], L=latent, K=k,
        BLOCK_N=cfg.block_n, BLOCK_L=cfg.block_l, BLOCK_K=next_power_of_2(k), num_warps=cfg.num_warps,
    )
    return dy_ML, dw_Nk
