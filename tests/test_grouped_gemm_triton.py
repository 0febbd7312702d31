"""Triton grouped GEMM (`titan_moe.ops.grouped_gemm.triton_kernel`) and the op's "triton" backend.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set
before the kernel module is first imported (that is when `@triton.jit` chooses the
interpreter), so this module sets it at the top. If the kernel module was already imported
in this process without it (another test module first), the in-process tests skip and
`test_in_fresh_interpreter_process` runs this file again in a subprocess. The interpreter
computes bf16 `tl.dot` wrongly, so CPU tests use fp32 and fp16 inputs; bf16 runs on the GPU
only. The TMA-descriptor variant of the forward/dx kernel runs under the interpreter too
(emulated descriptors). `test_compiles_for_sm90` compiles the GPU code path (the `for`
loops the interpreter never takes, both load variants) for Hopper without a GPU; nothing
here has run on a GPU unless CUDA is present.

Oracle: the per-group loop of `reference.py` (one fp32 matmul per group, then one rounding
to the input dtype). Tolerances (relative error ||out - ref|| / ||ref||):
- fp32: 1e-5. Both sides are fp32 sums of <= 32 products (K, or the rows of one group for
  dw, <= 100) in different orders: a few ulps (~1e-7 relative) per element.
- fp16: 1e-3. Both accumulate in fp32 and round once to fp16; where the fp32 sums differ by
  an ulp the roundings can differ by one fp16 ulp (2^-11 ~ 4.9e-4 relative), rarely.
- bf16 on the GPU vs float64: 5e-3 (one bf16 rounding, 2^-9 relative per element).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
from triton_mode import (  # noqa: E402
    compiled_script_results,
    interpret_without_gpu,
    kernel_test_setup,
    rerun_under_interpreter,
    spy_on,
)
import torch
from numerics import rel_err

CUDA = interpret_without_gpu()

from titan_moe.ops import choices  # noqa: E402
from titan_moe.ops.grouped_gemm import grouped_mm, grouped_mm_dw_reference, grouped_mm_reference  # noqa: E402
from titan_moe.ops.grouped_gemm import op as gg_op  # noqa: E402
from titan_moe.ops.grouped_gemm import triton_kernel as tk  # noqa: E402
from titan_moe.ops.grouped_gemm.reference import group_bounds  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, tk.interpreted(), "test_in_fresh_interpreter_process")
TOL = {torch.float32: 1e-5, torch.float16: 1e-3}




def random_offsets(n_groups: int, m: int, gen: torch.Generator, owned_frac: float = 1.0) -> torch.Tensor:
    """int32 cumulative ends of random group sizes summing to round(owned_frac * m); group 1
    is always empty and about a third of the others too, so most sizes are not multiples of 16."""
    owned = round(owned_frac * m)
    weights = torch.rand(n_groups, generator=gen)
    weights[torch.rand(n_groups, generator=gen) < 0.33] = 0.0
    weights[1 % n_groups] = 0.0
    if weights.sum() == 0:
        weights[0] = 1.0
    cuts = torch.floor(torch.cumsum(weights, 0) / weights.sum() * owned).to(torch.int64)
    cuts[-1] = owned
    return cuts.to(torch.int32)


def make_case(m, k, n, e, frac, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(e, k, n, generator=gen).to(DEVICE, dtype)
    grad = torch.randn(m, n, generator=gen).to(DEVICE, dtype)
    offs = random_offsets(e, m, gen, frac).to(DEVICE)
    return x, w, grad, offs


# (M, K, N, E, owned fraction)
SHAPES = [
    (100, 32, 16, 4, 1.0),
    (77, 16, 32, 4, 0.8),  # rows past offs[-1]
    (45, 32, 32, 4, 1.0),
    (9, 16, 16, 4, 0.6),  # fewer rows than one tile
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,e,frac", SHAPES)
def test_kernels_match_loop_reference(m, k, n, e, frac, dtype):
    x, w, grad, offs = make_case(m, k, n, e, frac, dtype, seed=m * k + n)
    owned = int(offs[-1])
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes == 0).any() and (sizes % 16 != 0).any()

    out = tk.grouped_mm_triton(x, w, offs)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, grouped_mm_reference(x, w, offs)) < TOL[dtype]
    assert torch.all(out[owned:] == 0)  # written by the kernel: `out` starts as torch.empty

    dx = tk.grouped_mm_triton(grad, w.transpose(1, 2), offs)
    assert dx.shape == (m, k)
    assert rel_err(dx, grouped_mm_reference(grad, w.transpose(1, 2), offs)) < TOL[dtype]
    assert torch.all(dx[owned:] == 0)

    dw = tk.grouped_mm_dw_triton(x, grad, offs)
    assert dw.shape == (e, k, n) and dw.dtype == dtype
    assert rel_err(dw, grouped_mm_dw_reference(x, grad, offs)) < TOL[dtype]
    assert torch.all(dw[sizes == 0] == 0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,e,frac", [(100, 32, 16, 4, 1.0), (77, 40, 24, 4, 0.8)])
def test_tma_variant_matches_loop_reference(m, k, n, e, frac, dtype):
    """The TMA-descriptor loads of the forward / dx kernel (forced on; under the interpreter
    the descriptors are emulated), incl. a K that is not a multiple of the K tile and
    ragged N (zero-filled box edges)."""
    x, w, grad, offs = make_case(m, k, n, e, frac, dtype, seed=m + k)
    cfg = tk.default_config(dtype, x.device, "mk")
    assert tk._tma_operands(x, w, cfg) is not None and tk._tma_operands(grad, w.transpose(1, 2), cfg)[2]
    owned = int(offs[-1])
    out = tk.grouped_mm_triton(x, w, offs, tma=True)
    assert rel_err(out, grouped_mm_reference(x, w, offs)) < TOL[dtype]
    assert torch.all(out[owned:] == 0)
    dx = tk.grouped_mm_triton(grad, w.transpose(1, 2), offs, tma=True)
    assert rel_err(dx, grouped_mm_reference(grad, w.transpose(1, 2), offs)) < TOL[dtype]
    assert torch.all(dx[owned:] == 0)


@needs_kernels
@pytest.mark.parametrize("tma", [True, "group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,e,frac", [(100, 32, 16, 4, 1.0), (77, 40, 24, 5, 0.8)])
def test_dw_tma_variant_matches_loop_reference(m, k, n, e, frac, dtype, tma):
    """The dw kernel's TMA loads (opt-in), host descriptors (rows past the group masked in
    registers) or per-group device descriptors ("group": the copy engine zero-fills past the
    group's end): group ends inside a reduction step, rows past offs[-1], a K and N that are
    not multiples of the tiles; the rows a box reads past its group's end (the next group's)
    must not enter the sum; empty groups stay zero."""
    x, _, grad, offs = make_case(m, k, n, e, frac, dtype, seed=m + n)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    cfg = tk.default_config(dtype, x.device, "k")
    assert tk.row_major_descriptor(x, [cfg.block_m, cfg.block_k]) is not None
    assert any(int(s) % cfg.block_m for s in sizes)  # a group ends inside a reduction step
    dw = tk.grouped_mm_dw_triton(x, grad, offs, tma=tma)
    assert rel_err(dw, grouped_mm_dw_reference(x, grad, offs)) < TOL[dtype]
    assert torch.all(dw[sizes == 0] == 0)
    assert torch.equal(dw, tk.grouped_mm_dw_triton(x, grad, offs))  # the same sums as pointer loads


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("m,k,n,e,frac", [(100, 32, 16, 4, 1.0), (77, 40, 24, 5, 0.8),
                                          pytest.param(200, 48, 32, 9, 0.7, marks=pytest.mark.slow)])
def test_dw_flat_loop_matches_nested_loops(m, k, n, e, frac, tma):
    """``TileConfig.flat``: every tile's reduction steps in one loop (`_ragged_k_flat_kernel`)
    give the nested kernel's sums exactly (same steps, same order), with empty groups (one
    masked step, zeros stored), rows past offs[-1], several tiles per program (3 programs) and
    one program per tile."""
    x, _, grad, offs = make_case(m, k, n, e, frac, torch.float32, seed=m + 7 * n)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes == 0).any()
    cfg = tk.default_config(torch.float32, x.device, "k")
    nested = tk.grouped_mm_dw_triton(x, grad, offs, config=cfg, tma=tma)
    for programs in (3, None):
        flat = dataclasses.replace(cfg, flat=True, num_programs=programs)
        assert torch.equal(tk.grouped_mm_dw_triton(x, grad, offs, config=flat, tma=tma), nested)
    # "group" loads are not part of the flat loop: it takes pointer loads
    flat = dataclasses.replace(cfg, flat=True)
    assert torch.equal(tk.grouped_mm_dw_triton(x, grad, offs, config=flat, tma="group"), nested)
    assert rel_err(nested, grouped_mm_dw_reference(x, grad, offs)) < TOL[torch.float32]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k,n,e,frac", [(100, 32, 16, 4, 1.0), (77, 40, 24, 5, 0.8)])
def test_dw_tma_stores_match_pointer_stores(m, k, n, e, frac, dtype):
    """``TileConfig.store_tma``: the dw tiles written through a [1, BK, BN] box of dw
    [E, K, N], incl. a K and N that are not multiples of the tile (the box is clipped at K,
    not spilled into the next group's rows); the same values as pointer stores, empty groups
    zero."""
    x, _, grad, offs = make_case(m, k, n, e, frac, dtype, seed=m + 3 * n)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    cfg = tk.default_config(dtype, x.device, "k")
    store_cfg = dataclasses.replace(cfg, store_tma=True)
    dw = tk.grouped_mm_dw_triton(x, grad, offs, config=store_cfg)
    assert torch.equal(dw, tk.grouped_mm_dw_triton(x, grad, offs, config=cfg))
    assert rel_err(dw, grouped_mm_dw_reference(x, grad, offs)) < TOL[dtype]
    assert torch.all(dw[sizes == 0] == 0)
    # rows of N elements that TMA cannot describe (not a multiple of 16 bytes): pointer stores
    assert tk._dw_store_descriptor(dw.new_empty(e, k, 12 // dw.element_size()), store_cfg) is None
    assert tk._dw_store_descriptor(dw, cfg) is None  # off unless asked for


def tail_config():
    """Tail tiles of half the row tile: 16 of 32 rows under the interpreter; 32 of 64 on the
    GPU (64-deep steps: fp8 tensor cores take 32 at a time)."""
    if CUDA:
        return tk.TileConfig(64, 64, 64, num_warps=4, num_stages=2, tail_m=32)
    return tk.TileConfig(32, 16, 16, num_stages=1, tail_m=16)


def tail_offsets(device):
    """Group sizes whose remainders past 32-row tiles cover every case of 16-row tail tiles
    (none, under one tail tile, exactly one, between one and two; on the GPU's 64-row tiles:
    none, under one 32-row tail tile, between one and two); an empty group; a group smaller
    than one full tile; rows past offs[-1]."""
    sizes = [70, 0, 16, 33, 64, 5, 48, 31]
    return torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32), sum(sizes) + 7


def tail_case(dtype):
    """(offs, products) of the tail-tile tests over :func:`tail_offsets`: the forward (x
    [m, 40] by E weights [40, 24]) and dx (grad [m, 24] by the transposed weights)."""
    offs, m = tail_offsets(DEVICE)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, 40, generator=gen).to(DEVICE, dtype)
    w = torch.randn(offs.numel(), 40, 24, generator=gen).to(DEVICE, dtype)
    grad = torch.randn(m, 24, generator=gen).to(DEVICE, dtype)
    return offs, [(x, w), (grad, w.transpose(1, 2))]


_TAIL_RUNS: dict = {}


def tail_run(dtype, product: int, config, tma):
    """`grouped_mm_triton` of `tail_case(dtype)`'s product (0 forward, 1 dx) under `config`;
    cached, since the tail tests compare several configurations with the same ones (the
    interpreter is slow)."""
    key = (dtype, product, config, tma)
    if key not in _TAIL_RUNS:
        offs, products = tail_case(dtype)
        _TAIL_RUNS[key] = tk.grouped_mm_triton(*products[product], offs, config=config, tma=tma)
    return _TAIL_RUNS[key]


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tail_tiles_match_loop_reference(tma, dtype):
    """``TileConfig.tail_m``: the rows past a group's full tiles in 16-row tiles computed
    transposed, forward and dx (transposed weights), pointer and TMA loads; K and N not
    multiples of the tile; the same result as without tail tiles."""
    offs, products = tail_case(dtype)
    tail = tail_config()
    plain = dataclasses.replace(tail, tail_m=0)
    for product, (a, b) in enumerate(products):
        out = tail_run(dtype, product, tail, tma)
        assert rel_err(out, grouped_mm_reference(a, b, offs)) < TOL[dtype]
        assert torch.all(out[int(offs[-1]):] == 0)
        assert rel_err(out, tail_run(dtype, product, plain, tma)) < TOL[dtype]


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_upright_tail_tiles_match_loop_reference(tma, dtype):
    """``TileConfig.tail_upright``: the tail tiles as [tail_m, block_n] products (not
    transposed), forward and dx, every remainder case of :func:`tail_offsets`, with TMA stores
    of the full tiles (tail tiles through pointer stores); the same result as the transposed
    tail tiles and as no tail tiles."""
    offs, products = tail_case(dtype)
    upright = dataclasses.replace(tail_config(), tail_upright=True, store_tma=True)
    for product, (a, b) in enumerate(products):
        out = tk.grouped_mm_triton(a, b, offs, config=upright, tma=tma)
        assert rel_err(out, grouped_mm_reference(a, b, offs)) < TOL[dtype]
        assert torch.all(out[int(offs[-1]):] == 0)
        for other in (tail_config(), dataclasses.replace(tail_config(), tail_m=0)):
            assert rel_err(out, tail_run(dtype, product, other, tma)) < TOL[dtype]


@needs_kernels
def test_forward_and_dx_pick_their_tile_by_output_width(monkeypatch):
    """`grouped_mm_triton` asks `default_config` for the output width of the product it runs:
    N for the forward, K for dx (w transposed), so that sm90 takes 128x256 tiles exactly where
    that width is a multiple of 256."""
    widths = []
    real = tk.default_config

    def spy(*args, **kwargs):
        widths.append(kwargs.get("n_cols"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tk, "default_config", spy)
    offs, m = tail_offsets(DEVICE)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(m, 40, generator=gen).to(DEVICE, torch.float16)
    w = torch.randn(offs.numel(), 40, 24, generator=gen).to(DEVICE, torch.float16)
    out = tk.grouped_mm_triton(x, w, offs)
    dx = tk.grouped_mm_triton(out, w.transpose(1, 2), offs)
    assert widths == [24, 40] and out.shape == (m, 24) and dx.shape == (m, 40)


def test_upright_tail_rules():
    """Upright tails need tail tiles and 16-bit operands: the "u" spec suffix is refused for
    the fp8 kind, and the fp8 launcher refuses such a config."""
    assert tk.parse_tile("256x128x64x8x3r128ut", "mk") == tk.TileConfig(
        256, 128, 64, num_warps=8, num_stages=3, tail_m=128, tail_upright=True, store_tma=True)
    assert not tk.parse_tile("256x128x64x8x3r128t", "mk").tail_upright
    with pytest.raises(ValueError, match="upright"):
        tk.parse_tile("128x256x128x8x3r64u", "mk8")
    with pytest.raises(ValueError, match="BMxBNxBK"):
        tk.parse_tile("256x128x64x8x3u", "mk")  # no tail to keep upright
    with pytest.raises(ValueError, match="tail_upright"):
        tk.TileConfig(128, 128, 64, tail_upright=True)
    if tk.runs_on(torch.device(DEVICE)):
        offs, m = tail_offsets(DEVICE)
        a, b, scale_a, scale_b, _ = fp8_case(m, 48, 32, offs.numel(), 1.0, seed=21)
        with pytest.raises(ValueError, match="transposed"):
            tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs,
                                        config=dataclasses.replace(tail_config(), tail_upright=True))


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
def test_scaled_fp8_tail_tiles_match_dequantized_reference(tma):
    """The fp8 forward / dx kernel with tail tiles (K-major weights, both operands K-major in
    the transposed product), every remainder case of :func:`tail_offsets`."""
    offs, m = tail_offsets(DEVICE)
    a, b, scale_a, scale_b, _ = fp8_case(m, 48, 32, offs.numel(), 1.0, seed=21)
    ours = tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs, config=tail_config(), tma=tma)
    assert rel_err(ours.cpu(), scaled_reference(a, b, scale_a, scale_b, offs)) < 8e-3
    assert torch.all(ours[int(offs[-1]):] == 0)


@needs_kernels
@pytest.mark.parametrize("tail", [0, 1])
def test_forward_tma_stores_match_pointer_stores(tail):
    """``store_tma`` in the forward / dx kernel: full tiles through TMA boxes, a group's last
    partial tile (and tail tiles) through masked pointer stores, so that no box overwrites
    the next group's rows: the same output as pointer stores everywhere, rows past offs[-1]
    zero."""
    offs, products = tail_case(torch.float16)
    cfg = tail_config() if tail else dataclasses.replace(tail_config(), tail_m=0)
    stored = dataclasses.replace(cfg, store_tma=True)
    x = products[0][0]
    assert tk.row_major_descriptor(x.new_empty(x.shape[0], 24), [cfg.block_m, cfg.block_n]) is not None
    for product, (a, b) in enumerate(products):
        for tma in (False, True):
            out = tk.grouped_mm_triton(a, b, offs, config=stored, tma=tma)
            assert torch.equal(out, tail_run(torch.float16, product, cfg, tma))
            assert torch.all(out[int(offs[-1]):] == 0)


def test_tile_config_tail_rules():
    assert tk.TileConfig(128, 128, 128, tail_m=32).tail_m == 32
    for bad in (8, 24, 128, 256):
        with pytest.raises(ValueError, match="tail_m"):
            tk.TileConfig(128, 128, 128, tail_m=bad)
    assert tk.parse_tile("128x256x128x8x3r32", "mk8") == tk.TileConfig(128, 256, 128, num_warps=8, num_stages=3,
                                                                      tail_m=32)
    with pytest.raises(ValueError, match="forward / dx kinds"):
        tk.parse_tile("64x128x128x8x3r32", "k8")
    assert tk.parse_tile("128x256x128x8x3tf", "k8") == tk.TileConfig(128, 256, 128, num_warps=8, num_stages=3,
                                                                     store_tma=True, flat=True)
    with pytest.raises(ValueError, match="dw kinds"):
        tk.parse_tile("256x128x64x8x3f", "mk")


@needs_kernels
def test_dw_tma_loads_by_environment(monkeypatch):
    """``$TITAN_MOE_GROUPED_MM_DW_TMA=1`` turns the dw kernel's TMA loads on where the call
    leaves ``tma`` unset (the op's call); an explicit ``tma`` wins."""
    x, _, grad, offs = make_case(77, 40, 24, 5, 0.8, torch.float32, seed=5)
    described = []
    real = tk.row_major_descriptor
    monkeypatch.setattr(tk, "row_major_descriptor", lambda t, block: described.append(block) or real(t, block))
    monkeypatch.delenv(tk.DW_TMA_ENV, raising=False)
    plain = tk.grouped_mm_dw_triton(x, grad, offs)
    assert described == []
    monkeypatch.setenv(tk.DW_TMA_ENV, "1")
    assert torch.equal(tk.grouped_mm_dw_triton(x, grad, offs), plain) and len(described) == 2
    tk.grouped_mm_dw_triton(x, grad, offs, tma=False)
    assert len(described) == 2
    # "group": descriptors made in the kernel, none on the host
    allocators = spy_on(monkeypatch, tk, ["ensure_scratch_allocator"])  # the device descriptors' scratch
    monkeypatch.setenv(tk.DW_TMA_ENV, "group")
    assert torch.equal(tk.grouped_mm_dw_triton(x, grad, offs), plain) and len(described) == 2
    assert allocators == ["ensure_scratch_allocator"]
    with pytest.raises(ValueError, match="tma must be"):
        tk.grouped_mm_dw_triton(x, grad, offs, tma="groups")


@needs_kernels
def test_tma_falls_back_for_layouts_it_cannot_describe():
    x, w, _, offs = make_case(30, 20, 12, 3, 1.0, torch.float16, seed=9)  # rows of 40 bytes
    cfg = tk.default_config(torch.float16, x.device, "mk")
    assert tk._tma_operands(x, w, cfg) is None
    assert tk._tma_operands(x[:, :16], w[:, :16], cfg) is None  # row stride 40 bytes
    out = tk.grouped_mm_triton(x, w, offs, tma=True)
    assert rel_err(out, grouped_mm_reference(x, w, offs)) < TOL[torch.float16]
    assert tk.row_major_descriptor(x, [16, 16]) is None
    for tma in (True, "group"):  # both fall back to pointer loads
        dw = tk.grouped_mm_dw_triton(x, x, offs, tma=tma)
        assert rel_err(dw, grouped_mm_dw_reference(x, x, offs)) < TOL[torch.float16]


def fp8_case(m, k, n, e, frac, seed):
    """fp8 codes a [M, K] and b [E, K, N] K-major per expert (the layout of the fp8 experts'
    forward weights and of their dx weights' transpose), fp32 scales, random offsets."""
    gen = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    a = (torch.randn(m, k, generator=gen) * 16).to(fp8).to(DEVICE)
    b = (torch.randn(e, n, k, generator=gen) * 16).to(fp8).to(DEVICE).transpose(1, 2)
    scale_a = torch.rand(m, generator=gen).add(0.5).to(DEVICE)
    scale_b = torch.rand(e, n, generator=gen).add(0.5).to(DEVICE)
    return a, b, scale_a, scale_b, random_offsets(e, m, gen, frac).to(DEVICE)


def scaled_reference(a, b, scale_a, scale_b, offs):
    """The dequantized product per group in fp32, rounded once to bf16."""
    out = (grouped_mm_reference(a.float(), b.float(), offs) * scale_a[:, None]).cpu()
    for e, (start, end) in enumerate(group_bounds(offs.cpu(), a.shape[0])):
        out[start:end] *= scale_b[e].cpu()
    return out.bfloat16()


@needs_kernels
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("m,k,n,e,frac", [(100, 32, 16, 4, 1.0), (77, 48, 32, 5, 0.8), (9, 16, 16, 3, 0.6)])
def test_scaled_fp8_kernel_matches_dequantized_reference(m, k, n, e, frac, tma):
    """The fp8 form of the forward / dx kernel (``SCALED``): group sizes that are not
    multiples of 16, empty groups, rows past offs[-1] zero; pointer and TMA loads."""
    a, b, scale_a, scale_b, offs = fp8_case(m, k, n, e, frac, seed=m + n + tma)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes == 0).any() and (sizes % 16 != 0).any()
    if tma:
        assert tk._tma_operands(a, b, tk.default_config(a.dtype, a.device, "mk8"))[2]  # K-major b: [N, K] boxes
    out = tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs, tma=tma)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), scaled_reference(a, b, scale_a, scale_b, offs)) < 8e-3
    assert torch.all(out[int(offs[-1]):] == 0)


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n,e,frac", [(112, 32, 16, 4, 1.0), (80, 48, 32, 5, 0.8)])
def test_scaled_fp8_dw_kernel_matches_dequantized_reference(m, k, n, e, frac, out_dtype):
    """The fp8 form of the dw kernel: column-major fp8 codes (the contracted rows
    contiguous), per-group column scales; group ends (multiples of 16, its contract) inside a
    reduction step, empty groups, rows past offs[-1]."""
    gen = torch.Generator().manual_seed(m + k)
    fp8 = torch.float8_e4m3fn
    xq = (torch.randn(k, m, generator=gen) * 16).to(fp8).to(DEVICE).t()  # [M, K], stride(0) == 1
    gq = (torch.randn(n, m, generator=gen) * 16).to(fp8).to(DEVICE).t()
    scale_x = torch.rand(e * k, generator=gen).add(0.5).to(DEVICE)
    scale_g = torch.rand(e * n, generator=gen).add(0.5).to(DEVICE)
    offs = (random_offsets(e, m // 16, gen, frac) * 16).to(DEVICE)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert (sizes == 0).any()
    dw = tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x, scale_g, offs, out_dtype=out_dtype)
    assert dw.shape == (e, k, n) and dw.dtype == out_dtype
    # TMA stores (the GPU default for bf16 out) and pointer stores: the same values. The default
    # tile's fp32 staging buffer does not fit sm90's shared memory: there the stores are compared
    # at half its width, and the launcher's default must be the default tile's pointer-store form
    default = tk.default_config(fp8, xq.device, "k8")
    fits = tk.dw_shared_bytes(dataclasses.replace(default, store_tma=True), 1, out_dtype.itemsize) \
        <= tk.SM90_SHARED_BYTES
    tile = default if fits else dataclasses.replace(default, block_n=default.block_n // 2)
    stores = [tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x, scale_g, offs, out_dtype=out_dtype,
                                             config=dataclasses.replace(tile, store_tma=store_tma))
              for store_tma in (False, True)]
    assert torch.equal(stores[0], stores[1])
    # loads through per-group descriptors made in the kernel, and the flat loop over all tiles'
    # steps: the same sums as pointer loads
    assert tk.tma_describable(xq, column_major=True) and tk.tma_describable(gq, column_major=True)
    group = tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x, scale_g, offs, out_dtype=out_dtype,
                                           config=dataclasses.replace(tile, store_tma=False), tma="group")
    assert torch.equal(group, stores[0])
    flat = tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x, scale_g, offs, out_dtype=out_dtype,
                                          config=dataclasses.replace(tile, store_tma=False, flat=True, num_programs=3))
    assert torch.equal(flat, stores[0])
    if fits:
        assert torch.equal(dw, stores[CUDA])
    else:
        pointer = tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x, scale_g, offs, out_dtype=out_dtype,
                                                 config=dataclasses.replace(default, store_tma=False))
        assert torch.equal(dw, pointer)
    want = grouped_mm_dw_reference(xq.float(), gq.float(), offs).cpu()
    want *= scale_x.view(e, k, 1).cpu() * scale_g.view(e, 1, n).cpu()
    # fp32 out: exact sums under the interpreter; sm90's fp8 tensor cores accumulate with
    # fewer mantissa bits (Triton's default for fp8 dots there, like torch's use_fast_accum):
    # 5.7e-5 / 6.1e-5 measured on the H200
    fp32_tol = 3e-4 if CUDA else 1e-5
    assert rel_err(dw.float().cpu(), want) < (8e-3 if out_dtype == torch.bfloat16 else fp32_tol)
    assert torch.all(dw[sizes == 0] == 0)
    with pytest.raises(ValueError, match="scales of x"):
        tk.scaled_grouped_mm_dw_triton(xq, gq, scale_x[:-1], scale_g, offs)
    with pytest.raises(ValueError, match="multiple of 16"):
        tk.scaled_grouped_mm_dw_triton(xq[:-1], gq[:-1], scale_x, scale_g, offs)


@needs_kernels
def test_scaled_fp8_kernel_argument_errors():
    a, b, scale_a, scale_b, offs = fp8_case(32, 16, 16, 2, 1.0, seed=5)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tk.scaled_grouped_mm_triton(a.float(), b, scale_a, scale_b, offs)
    with pytest.raises(ValueError, match="scales"):
        tk.scaled_grouped_mm_triton(a, b, scale_a[:-1], scale_b, offs)
    with pytest.raises(ValueError, match="scales"):
        tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b.t(), offs)
    with pytest.raises(ValueError, match="expected a"):
        tk.scaled_grouped_mm_triton(a[:, :8], b, scale_a, scale_b, offs)
    with pytest.raises(ValueError, match="int32"):
        tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs.long())


@needs_kernels
def test_all_groups_empty_and_all_rows_in_one_group():
    x, w, grad, _ = make_case(40, 16, 16, 3, 1.0, torch.float32, seed=1)
    zeros = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    assert torch.all(tk.grouped_mm_triton(x, w, zeros) == 0)
    assert torch.all(tk.grouped_mm_dw_triton(x, grad, zeros) == 0)
    last = torch.tensor([0, 0, 40], dtype=torch.int32, device=DEVICE)
    assert rel_err(tk.grouped_mm_triton(x, w, last), x @ w[2]) < TOL[torch.float32]
    assert rel_err(tk.grouped_mm_dw_triton(x, grad, last)[2], x.t() @ grad) < TOL[torch.float32]


@needs_kernels
@pytest.mark.parametrize("num_programs", [1, 3, 1000])
def test_persistent_schedule_and_tile_shapes(num_programs):
    """One program walking every tile, a few programs, and more programs than tiles (capped)
    give the same result; so do non-square tiles."""
    x, w, grad, offs = make_case(70, 32, 32, 5, 0.9, torch.float32, seed=num_programs)
    cfg = tk.TileConfig(16, 32, 16, num_programs=num_programs)
    dw_cfg = tk.TileConfig(32, 16, 16, num_programs=num_programs)
    assert rel_err(tk.grouped_mm_triton(x, w, offs, cfg), grouped_mm_reference(x, w, offs)) < 1e-5
    assert rel_err(tk.grouped_mm_dw_triton(x, grad, offs, dw_cfg), grouped_mm_dw_reference(x, grad, offs)) < 1e-5


@needs_kernels
def test_strided_inputs():
    """Non-contiguous operands are read through their strides (no copies are made)."""
    x, w, grad, offs = make_case(50, 16, 32, 4, 1.0, torch.float32, seed=3)
    x_t = x.t().contiguous().t()  # column-major [M, K]
    w_p = w.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # [E, K, N] with stride(1) == 1
    grad_s = torch.cat([grad, grad], 1)[:, ::2]  # row stride 2N, column stride 2
    assert rel_err(tk.grouped_mm_triton(x_t, w_p, offs), grouped_mm_reference(x, w, offs)) < 1e-5
    assert rel_err(tk.grouped_mm_dw_triton(x_t, grad_s, offs), grouped_mm_dw_reference(x, grad_s, offs)) < 1e-5


@needs_kernels
def test_bad_offsets_stay_in_bounds():
    """Offsets that break the contract (decreasing, past M) give wrong numbers but no
    out-of-bounds access: the kernels clamp group bounds into [0, M]."""
    x, w, grad, _ = make_case(20, 16, 16, 3, 1.0, torch.float32, seed=4)
    bad = torch.tensor([15, 5, 1000], dtype=torch.int32, device=DEVICE)
    assert torch.isfinite(tk.grouped_mm_triton(x, w, bad)).all()
    assert torch.isfinite(tk.grouped_mm_dw_triton(x, grad, bad)).all()


@needs_kernels
@pytest.mark.parametrize("m,n,e,frac", [(100, 16, 4, 1.0), (77, 200, 5, 0.8), (150, 130, 6, 0.3), (9, 8, 3, 0.0),
                                         (300, 24, 3, 0.0)])
def test_zero_fill_kernels_touch_only_what_the_native_gemm_leaves_unwritten(m, n, e, frac):
    """The native backend's clean-up kernels against masked_fill: rows past offs[-1] and the
    weight gradients of empty groups become zero, every other element keeps its value
    (bit for bit: the kernels only store zeros)."""
    from titan_moe.ops.grouped_gemm.zero_fill import zero_empty_groups_, zero_rows_past_

    gen = torch.Generator().manual_seed(m + n + e)
    offs = random_offsets(e, m, gen, frac).to(DEVICE)
    out = torch.randn(m, n, generator=gen).to(DEVICE)
    want = out.masked_fill((torch.arange(m, device=DEVICE) >= offs[-1]).unsqueeze(1), 0)
    assert torch.equal(zero_rows_past_(out.clone(), offs, programs=1), want)  # one program loops over the tail
    assert torch.equal(zero_rows_past_(out, offs), want)
    for bad_end, rows_kept in ((-5, 0), (m + 40, m)):  # offs[-1] past either end: clamped into [0, M]
        bad = offs.clone()
        bad[-1] = bad_end
        assert torch.equal(zero_rows_past_(out.clone(), bad), out.masked_fill(
            (torch.arange(m, device=DEVICE) >= rows_kept).unsqueeze(1), 0))
    dw = torch.randn(e, 24, n, generator=gen).to(DEVICE)
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    assert empty.any()  # random_offsets always empties group 1
    want = dw.masked_fill(empty.view(-1, 1, 1), 0)
    assert torch.equal(zero_empty_groups_(dw, offs), want)


@needs_kernels
def test_kernel_argument_errors():
    x, w, grad, offs = make_case(20, 16, 16, 3, 1.0, torch.float32, seed=5)
    with pytest.raises(ValueError, match="dtype"):
        tk.grouped_mm_triton(x.half(), w, offs)
    with pytest.raises(ValueError, match="int32"):
        tk.grouped_mm_triton(x, w, offs.long())
    with pytest.raises(ValueError, match="expected"):
        tk.grouped_mm_triton(x[:, :8], w, offs)
    with pytest.raises(ValueError, match="power of two"):
        tk.TileConfig(16, 24, 16)
    meta = torch.empty(20, 16, device="meta")
    with pytest.raises(ValueError, match="run on CUDA"):
        tk.grouped_mm_triton(meta, w.to("meta"), offs.to("meta"))


# ---------------------------------------------------------------------------- the op backend
def run_backend(x, w, grad, offs, backend=None):
    """(out, dx, dw) of `grouped_mm(..., backend=backend)` through autograd, on fresh leaves."""
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = grouped_mm(xl, wl, offs, backend=backend)
    out.backward(grad)
    return out.detach(), xl.grad, wl.grad


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_op_triton_backend_forward_backward(dtype):
    """`grouped_mm(..., backend="triton")` against the loop backend, through autograd."""
    x, w, grad, offs = make_case(60, 16, 32, 4, 0.9, dtype, seed=6)
    grads = {backend: run_backend(x, w, grad, offs, backend) for backend in ("triton", "loop")}
    for got, ref in zip(grads["triton"], grads["loop"]):
        assert rel_err(got, ref) < TOL[dtype]


@needs_kernels
def test_choice_selects_triton(monkeypatch):
    calls = spy_on(monkeypatch, tk, ("grouped_mm_triton", "grouped_mm_dw_triton"))
    x, w, grad, offs = make_case(30, 16, 16, 3, 1.0, torch.float32, seed=7)
    x.requires_grad_()
    w.requires_grad_()
    with choices.using(grouped_mm="triton"):
        grouped_mm(x, w, offs).backward(grad)
        assert calls == ["grouped_mm_triton", "grouped_mm_triton", "grouped_mm_dw_triton"]
    with choices.using(grouped_mm="loop"):
        grouped_mm(x, w, offs).backward(grad)
        assert len(calls) == 3
    with pytest.raises(ValueError, match="kernels.grouped_mm must name backends"):
        with choices.using(grouped_mm="cutlass"):
            grouped_mm(x, w, offs)


@needs_kernels
def test_backend_per_product(monkeypatch):
    """`fwd=...,dx=...,dw=...` runs each product on its own backend (unnamed: native), with
    the results of the single-backend runs; a bad product or name is refused."""
    calls = spy_on(monkeypatch, tk, ("grouped_mm_triton", "grouped_mm_dw_triton"))
    x, w, grad, offs = make_case(30, 16, 16, 3, 1.0, torch.float32, seed=9)
    runs = {}
    for spec in ("loop", "fwd=triton,dx=loop,dw=triton", "dx=triton"):
        with choices.using(grouped_mm=spec):
            runs[spec] = run_backend(x, w, grad, offs)
    assert calls == ["grouped_mm_triton", "grouped_mm_dw_triton", "grouped_mm_triton"]
    for spec in ("fwd=triton,dx=loop,dw=triton", "dx=triton"):
        for got, ref in zip(runs[spec], runs["loop"]):
            assert rel_err(got, ref) < TOL[torch.float32], spec
    assert [gg_op.resolve_backend("dx=triton", p) for p in gg_op.PRODUCTS] == ["native", "triton", "native"]
    for bad, match in (("fwd=triton,dgrad=loop", "products are"), ("dw=cutlass", "must name backends")):
        with pytest.raises(ValueError, match=match):
            gg_op.resolve_backend(bad)
        with pytest.raises(ValueError, match="backend argument"):
            grouped_mm(x, w, offs, backend=bad)


def test_backend_names():
    assert gg_op.resolve_backend("loop") == "loop"
    assert choices.KernelChoices().grouped_mm == "auto" and "auto" in gg_op.BACKENDS
    with pytest.raises(ValueError, match="backend argument"):
        grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 4), torch.tensor([2, 4], dtype=torch.int32), backend="cuda")


@needs_kernels
def test_opcheck_triton_backend():
    x, w, grad, offs = make_case(29, 16, 16, 3, 0.9, torch.float32, seed=8)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm.default, (x, w, offs, "triton"))
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm_dx.default, (grad, w.detach(), offs, "triton"))
    torch.library.opcheck(torch.ops.titan_moe.grouped_mm_dw.default, (x.detach(), grad, offs, "triton"))


@needs_kernels
def test_compile_fullgraph_with_backend_argument():
    import torch._dynamo.testing

    def f(x, w, offs):
        return grouped_mm(x, w, offs, backend="triton").square().sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    x, w, _, offs = make_case(33, 16, 16, 3, 1.0, torch.float32, seed=10)
    x.requires_grad_()
    w.requires_grad_()
    gx, gw = torch.autograd.grad(compiled(x, w, offs), (x, w))
    rx, rw = torch.autograd.grad(f(x, w, offs), (x, w))
    assert counter.frame_count == 1
    assert rel_err(gx, rx) < 1e-6 and rel_err(gw, rw) < 1e-6


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__, also_deselect="compiles_for_sm90")


# ---------------------------------------------------------------------------- GPU code path
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    # Mirror the JIT's specialisation of a real launch: unit strides become constants,
    # pointers and the other strides/sizes (multiples of 16 in the model) are 16-aligned.
    def compile_kernel(fn, types, ints, unit, consts, cfg):
        names = list(fn.arg_names)
        sig = dict(types)
        sig.update({n: "i32" for n in ints})
        sig.update({n: "constexpr" for n in list(unit) + list(consts)})
        sig = {n: sig[n] for n in names}
        aligned = [n for n in names if sig[n].startswith("*") or (n in ints and n not in ("M", "E"))]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn=fn, signature=sig, constexprs={**{n: 1 for n in unit}, **consts}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        ptx = k.asm["ptx"]
        plain_async = "cp.async.cg" in ptx or "cp.async.ca" in ptx
        if consts.get("TAIL_M") and not consts.get("TAIL_UPRIGHT"):  # transposed tails: the rows are the wgmma's N
            assert f"m64n{consts['TAIL_M']}k32" in ptx
        return "wgmma" in ptx, plain_async, "cp.async.bulk.tensor" in ptx, k.metadata.shared

    mk, kk = tk.SM90_TILES["mk"], tk.SM90_TILES["k"]  # the tiles sm90 runs by default
    bm, bn, bk = mk.block_m, mk.block_n, mk.block_k
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=128, PRECISION="tf32",
                  INTERPRETED=False, sa_ptr=None, sb_ptr=None, SCALED=False, a_tail=None, TAIL_M=0, c_desc=None,
                  STORE_TMA=False, TAIL_UPRIGHT=False)
    mk_ints = ["M", "N", "K", "E", "stride_am", "stride_be", "stride_cm"]
    ptrs = {"a": "*bf16", "b": "*bf16", "c_ptr": "*bf16", "offs_ptr": "*i32"}
    results = {}
    results["fwd"] = compile_kernel(tk._ragged_m_kernel, ptrs, mk_ints + ["stride_bk"],
                                    ["stride_ak", "stride_bn", "stride_cn"],
                                    dict(common, USE_TMA=False, B_TRANSPOSED=False), mk)
    results["dx"] = compile_kernel(tk._ragged_m_kernel, ptrs, mk_ints + ["stride_bn"],
                                   ["stride_ak", "stride_bk", "stride_cn"],
                                   dict(common, USE_TMA=False, B_TRANSPOSED=False), mk)
    for name, transposed, b_box in (("fwd_tma", False, [1, bk, bn]), ("dx_tma", True, [1, bn, bk])):
        descs = dict(ptrs, a=f"tensordesc<bf16[{bm},{bk}]>",
                     b="tensordesc<bf16[" + ",".join(map(str, b_box)) + "]>")
        results[name] = compile_kernel(tk._ragged_m_kernel, descs, mk_ints + ["stride_bk"],
                                       ["stride_ak", "stride_bn", "stride_cn"],
                                       dict(common, USE_TMA=True, B_TRANSPOSED=transposed), mk)
    def forward_tma_store(cfg):  # TMA loads, full tiles stored through TMA boxes of c, tail tiles if cfg has them
        descs = dict(ptrs, a=f"tensordesc<bf16[{cfg.block_m},{cfg.block_k}]>",
                     b=f"tensordesc<bf16[1,{cfg.block_k},{cfg.block_n}]>",
                     c_desc=f"tensordesc<bf16[{cfg.block_m},{cfg.block_n}]>")
        if cfg.tail_m:
            descs["a_tail"] = f"tensordesc<bf16[{cfg.tail_m},{cfg.block_k}]>"
        consts = dict({n: v for n, v in common.items() if n not in descs}, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, USE_TMA=True, B_TRANSPOSED=False, STORE_TMA=True, TAIL_M=cfg.tail_m,
                      TAIL_UPRIGHT=cfg.tail_upright)
        return compile_kernel(tk._ragged_m_kernel, descs, mk_ints + ["stride_bk"],
                              ["stride_ak", "stride_bn", "stride_cn"], consts, cfg)

    # a group's partial tile through pointer stores; the default tile, the one of output widths
    # that are multiples of 256, and 16-bit upright tail tiles (128-row tails of 256-row tiles)
    results["fwd_tma_store"] = forward_tma_store(mk)
    results["fwd_n256_tma_store"] = forward_tma_store(tk.SM90_TILES["mk_n256"])
    results["fwd_upright_tail"] = forward_tma_store(tk.parse_tile("256x128x64x8x3r128ut", "mk"))
    m8 = tk.SM90_TILES["mk8"]  # the fp8 form: K-major b through TMA, scales in the epilogue
    descs8 = dict(ptrs, a=f"tensordesc<fp8e4nv[{m8.block_m},{m8.block_k}]>",
                  b=f"tensordesc<fp8e4nv[1,{m8.block_n},{m8.block_k}]>", sa_ptr="*fp32", sb_ptr="*fp32")
    results["fp8_tma"] = compile_kernel(tk._ragged_m_kernel, descs8, mk_ints + ["stride_bk"],
                                        ["stride_ak", "stride_bn", "stride_cn"],
                                        {**{n: v for n, v in common.items() if not n.endswith("_ptr")},
                                         "BLOCK_M": m8.block_m, "BLOCK_N": m8.block_n, "BLOCK_K": m8.block_k,
                                         "USE_TMA": True, "B_TRANSPOSED": True, "SCALED": True}, m8)
    # small groups (K3's 144-160 rows): the tail tiles' 32-row tiles computed transposed
    s8 = tk.SM90_TILES["mk8_small"]
    descs8_tail = dict(descs8, a=f"tensordesc<fp8e4nv[{s8.block_m},{s8.block_k}]>",
                       b=f"tensordesc<fp8e4nv[1,{s8.block_n},{s8.block_k}]>",
                       a_tail=f"tensordesc<fp8e4nv[{s8.tail_m},{s8.block_k}]>")
    results["fp8_tma_tail"] = compile_kernel(tk._ragged_m_kernel, descs8_tail, mk_ints + ["stride_bk"],
                                             ["stride_ak", "stride_bn", "stride_cn"],
                                             {**{n: v for n, v in common.items() if not n.endswith(("_ptr", "_tail"))},
                                              "BLOCK_M": s8.block_m, "BLOCK_N": s8.block_n, "BLOCK_K": s8.block_k,
                                              "USE_TMA": True, "B_TRANSPOSED": True, "SCALED": True,
                                              "TAIL_M": s8.tail_m}, s8)
    # the pointer-load fallback (layouts TMA cannot describe): b K-major, unit stride_bk
    ptrs8 = dict(ptrs, a="*fp8e4nv", b="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32")
    results["fp8"] = compile_kernel(tk._ragged_m_kernel, ptrs8, mk_ints + ["stride_bn"],
                                    ["stride_ak", "stride_bk", "stride_cn"],
                                    {**{n: v for n, v in common.items() if not n.endswith("_ptr")},
                                     "BLOCK_M": m8.block_m, "BLOCK_N": m8.block_n, "BLOCK_K": m8.block_k,
                                     "USE_TMA": False, "B_TRANSPOSED": False, "SCALED": True}, m8)
    results["dw"] = compile_kernel(
        tk._ragged_k_kernel, {"x_ptr": "*bf16", "g_ptr": "*bf16", "dw_ptr": "*bf16", "offs_ptr": "*i32"},
        ["M", "N", "K", "E", "stride_xm", "stride_gm", "stride_we", "stride_wk"],
        ["stride_xk", "stride_gn", "stride_wn"],
        dict(BLOCK_M=kk.block_m, BLOCK_N=kk.block_n, BLOCK_K=kk.block_k,
             PRECISION="tf32", INTERPRETED=False, USE_TMA=False, sx_ptr=None, sg_ptr=None, SCALED=False, STORE_TMA=False, GROUP_TMA=False, COLUMN_MAJOR=False), kk)
    k8 = tk.SM90_TILES["k8"]  # the fp8 dw: column-major codes (unit row stride), per-group scales
    results["fp8_dw"] = compile_kernel(
        tk._ragged_k_kernel, {"x_ptr": "*fp8e4nv", "g_ptr": "*fp8e4nv", "dw_ptr": "*fp32", "offs_ptr": "*i32",
                              "sx_ptr": "*fp32", "sg_ptr": "*fp32"},
        ["M", "N", "K", "E", "stride_xk", "stride_gn", "stride_we", "stride_wk"],
        ["stride_xm", "stride_gm", "stride_wn"],
        dict(BLOCK_M=k8.block_m, BLOCK_N=k8.block_n, BLOCK_K=k8.block_k,
             PRECISION="tf32", INTERPRETED=False, USE_TMA=False, SCALED=True, STORE_TMA=False, GROUP_TMA=False, COLUMN_MAJOR=False), k8)
    results["fp8_dw_store"] = compile_kernel(  # the same with TMA stores of dw
        tk._ragged_k_kernel, {"x_ptr": "*fp8e4nv", "g_ptr": "*fp8e4nv",
                              "dw_ptr": f"tensordesc<bf16[1,{k8.block_k},{k8.block_n}]>", "offs_ptr": "*i32",
                              "sx_ptr": "*fp32", "sg_ptr": "*fp32"},
        ["M", "N", "K", "E", "stride_xk", "stride_gn", "stride_we", "stride_wk"],
        ["stride_xm", "stride_gm", "stride_wn"],
        dict(BLOCK_M=k8.block_m, BLOCK_N=k8.block_n, BLOCK_K=k8.block_k,
             PRECISION="tf32", INTERPRETED=False, USE_TMA=False, SCALED=True, STORE_TMA=True, GROUP_TMA=False, COLUMN_MAJOR=False), k8)
    results["dw_tma"] = compile_kernel(
        tk._ragged_k_kernel, {"x_ptr": f"tensordesc<bf16[{kk.block_m},{kk.block_k}]>",
                              "g_ptr": f"tensordesc<bf16[{kk.block_m},{kk.block_n}]>", "dw_ptr": "*bf16",
                              "offs_ptr": "*i32"},
        ["M", "N", "K", "E", "stride_xm", "stride_gm", "stride_we", "stride_wk"],
        ["stride_xk", "stride_gn", "stride_wn"],
        dict(BLOCK_M=kk.block_m, BLOCK_N=kk.block_n, BLOCK_K=kk.block_k,
             PRECISION="tf32", INTERPRETED=False, USE_TMA=True, sx_ptr=None, sg_ptr=None, SCALED=False, STORE_TMA=False, GROUP_TMA=False, COLUMN_MAJOR=False), kk)
    results["dw_tma_store"] = compile_kernel(  # TMA loads and stores
        tk._ragged_k_kernel, {"x_ptr": f"tensordesc<bf16[{kk.block_m},{kk.block_k}]>",
                              "g_ptr": f"tensordesc<bf16[{kk.block_m},{kk.block_n}]>",
                              "dw_ptr": f"tensordesc<bf16[1,{kk.block_k},{kk.block_n}]>", "offs_ptr": "*i32"},
        ["M", "N", "K", "E", "stride_xm", "stride_gm", "stride_we", "stride_wk"],
        ["stride_xk", "stride_gn", "stride_wn"],
        dict(BLOCK_M=kk.block_m, BLOCK_N=kk.block_n, BLOCK_K=kk.block_k,
             PRECISION="tf32", INTERPRETED=False, USE_TMA=True, sx_ptr=None, sg_ptr=None, SCALED=False, STORE_TMA=True, GROUP_TMA=False, COLUMN_MAJOR=False), kk)
    results["dw_group_tma_store"] = compile_kernel(  # per-group descriptors made in the kernel, TMA stores
        tk._ragged_k_kernel, {"x_ptr": "*bf16", "g_ptr": "*bf16",
                              "dw_ptr": f"tensordesc<bf16[1,{kk.block_k},{kk.block_n}]>", "offs_ptr": "*i32"},
        ["M", "N", "K", "E", "stride_xm", "stride_gm", "stride_we", "stride_wk"],
        ["stride_xk", "stride_gn", "stride_wn"],
        dict(BLOCK_M=kk.block_m, BLOCK_N=kk.block_n, BLOCK_K=kk.block_k, PRECISION="tf32", INTERPRETED=False,
             USE_TMA=False, sx_ptr=None, sg_ptr=None, SCALED=False, STORE_TMA=True, GROUP_TMA=True, COLUMN_MAJOR=False), kk)
    results["fp8_dw_group_tma_store"] = compile_kernel(  # the same over the fp8 codes' column buffers
        tk._ragged_k_kernel, {"x_ptr": "*fp8e4nv", "g_ptr": "*fp8e4nv",
                              "dw_ptr": f"tensordesc<bf16[1,{k8.block_k},{k8.block_n}]>", "offs_ptr": "*i32",
                              "sx_ptr": "*fp32", "sg_ptr": "*fp32"},
        ["M", "N", "K", "E", "stride_xk", "stride_gn", "stride_we", "stride_wk"],
        ["stride_xm", "stride_gm", "stride_wn"],
        dict(BLOCK_M=k8.block_m, BLOCK_N=k8.block_n, BLOCK_K=k8.block_k, PRECISION="tf32", INTERPRETED=False,
             USE_TMA=False, SCALED=True, STORE_TMA=True, GROUP_TMA=True, COLUMN_MAJOR=True), k8)
    # the flat loop (one loop over every tile's reduction steps): pointer loads, TMA stores
    flat_args = dict(BLOCK_E=128, PRECISION="tf32", INTERPRETED=False, USE_TMA=False, STORE_TMA=True)
    results["dw_flat_store"] = compile_kernel(
        tk._ragged_k_flat_kernel, {"x_ptr": "*bf16", "g_ptr": "*bf16",
                                   "dw_ptr": f"tensordesc<bf16[1,{kk.block_k},{kk.block_n}]>", "offs_ptr": "*i32"},
        ["M", "N", "K", "E", "stride_xm", "stride_gm", "stride_we", "stride_wk"],
        ["stride_xk", "stride_gn", "stride_wn"],
        dict(flat_args, BLOCK_M=kk.block_m, BLOCK_N=kk.block_n, BLOCK_K=kk.block_k, sx_ptr=None, sg_ptr=None,
             SCALED=False), kk)
    results["fp8_dw_flat_store"] = compile_kernel(
        tk._ragged_k_flat_kernel, {"x_ptr": "*fp8e4nv", "g_ptr": "*fp8e4nv",
                                   "dw_ptr": f"tensordesc<bf16[1,{k8.block_k},{k8.block_n}]>", "offs_ptr": "*i32",
                                   "sx_ptr": "*fp32", "sg_ptr": "*fp32"},
        ["M", "N", "K", "E", "stride_xk", "stride_gn", "stride_we", "stride_wk"],
        ["stride_xm", "stride_gm", "stride_wn"],
        dict(flat_args, BLOCK_M=k8.block_m, BLOCK_N=k8.block_n, BLOCK_K=k8.block_k, SCALED=True), k8)
    print("RESULT", repr(results))
    """
)


def test_compiles_for_sm90():
    """The compiled code path (for loops, not the interpreter's while loops) builds for an
    sm90 target with no GPU present: bf16 forward, dx (transposed weights) and dw kernels and
    the fp8 forward / dx kernel use wgmma and an async-copy software pipeline (cp.async, or TMA bulk copies for the TMA
    variant) within the shared-memory budget."""
    # name -> (wgmma, cp.async copies, TMA bulk copies, shared bytes)
    results = compiled_script_results(_COMPILE_SCRIPT)
    assert set(results) == {"fwd", "dx", "fwd_tma", "dx_tma", "fwd_tma_store", "fwd_n256_tma_store",
                            "fwd_upright_tail", "fp8_tma", "fp8_tma_tail", "fp8", "dw",
                            "fp8_dw", "fp8_dw_store", "dw_tma", "dw_tma_store", "dw_group_tma_store",
                            "fp8_dw_group_tma_store", "dw_flat_store", "fp8_dw_flat_store"}
    for name, (wgmma, cp_async, tma_copies, shared) in results.items():
        assert wgmma, (name, results)
        # fp8_dw_store: pointer loads through cp.async, the dw tiles stored by TMA bulk copies
        expected = (False, True) if name.endswith(("_tma", "_tail", "_tma_store")) else (True, name.endswith("_store"))
        assert (cp_async, tma_copies) == expected, (name, results)
        assert 0 < shared <= 228 * 1024, (name, results)


_ZERO_FILL_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from titan_moe.ops.grouped_gemm import zero_fill as zf

    def build(fn, signature, constexprs):
        sig = dict(signature, **{n: "constexpr" for n in constexprs})
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

    rows = build(zf._zero_rows_past_kernel, {"out": "*bf16", "offs": "*i32", "M": "i32", "N": "i32", "stride_m": "i32",
                                             "programs": "i32"},
                 {"E": 64, "ROWS": zf._ROWS, "COLS": zf._COLS, "INTERPRETED": False})
    groups = build(zf._zero_empty_groups_kernel, {"dw": "*bf16", "offs": "*i32", "numel_per_group": "i64"},
                   {"SPLITS": zf._SPLITS, "BLOCK": zf._BLOCK, "INTERPRETED": False})
    print("RESULT", all("st.global" in k.asm["ptx"] for k in (rows, groups)))
    """
)


def test_zero_fill_kernels_compile_for_sm90():
    """The compiled (for-loop) path of the clean-up kernels builds for sm90 and stores to
    global memory; the interpreter test above covers their results."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _ZERO_FILL_COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "RESULT True" in proc.stdout


# ---------------------------------------------------------------------------- bf16 on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dw_tma", ["0", "1", ""])
@pytest.mark.parametrize("m,k,n,e", [(4096, 256, 384, 8), (3000, 136, 200, 7)])
def test_cuda_bf16_vs_float64(m, k, n, e, dw_tma, monkeypatch):
    """The op's "triton" backend, forward and both gradients (dw from autograd's device
    thread) with each dw load form: pointer loads, host TMA descriptors, and the default
    (per-group device descriptors on sm90)."""
    monkeypatch.setenv(tk.DW_TMA_ENV, dw_tma)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(e, k, n, generator=gen).bfloat16()
    grad = torch.randn(m, n, generator=gen).bfloat16()
    offs = random_offsets(e, m, gen, 0.95)
    xc, wc, gc, oc = x.cuda().requires_grad_(), w.cuda().requires_grad_(), grad.cuda(), offs.cuda()
    out = grouped_mm(xc, wc, oc, backend="triton")
    out.backward(gc)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.zeros(m, n, dtype=torch.float64)
    start = 0
    for i, end in enumerate(offs.tolist()):
        ref[start:end] = x64[start:end] @ w64[i]
        start = end
    ref.backward(grad.double())
    assert rel_err(out, ref) < 5e-3
    assert rel_err(xc.grad, x64.grad) < 5e-3
    assert rel_err(wc.grad, w64.grad) < 5e-3
    assert torch.all(out[int(offs[-1]):] == 0)



@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (9, 0)),
                    reason="needs an sm90 CUDA device (fp8 wgmma)")
@pytest.mark.parametrize("m,k,n,e,sizes", [(4096, 256, 384, 8, "balanced"), (2336, 512, 256, 7, "ragged")])
def test_cuda_scaled_fp8_kernel_vs_torch(m, k, n, e, sizes):
    """The Triton fp8 kernel against torch._scaled_grouped_mm (16-row groups, its rule) and
    against the dequantized fp32 product (any group sizes)."""
    a, b, scale_a, scale_b, _ = fp8_case(m, k, n, e, 1.0, seed=m)
    a, b, scale_a, scale_b = a.cuda(), b.cuda(), scale_a.cuda(), scale_b.cuda()
    if sizes == "balanced":
        offs = torch.arange(1, e + 1, dtype=torch.int32, device="cuda") * (m // e // 16 * 16)
        ours = tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs)
        theirs = torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                          use_fast_accum=True)
        owned = int(offs[-1])
        assert rel_err(ours[:owned].float(), theirs[:owned].float()) < 8e-3
    else:
        offs = random_offsets(e, m, torch.Generator().manual_seed(e), 0.9).cuda()
        ours = tk.scaled_grouped_mm_triton(a, b, scale_a, scale_b, offs)
    assert rel_err(ours.cpu(), scaled_reference(a, b, scale_a, scale_b, offs)) < 8e-3
    assert torch.all(ours[int(offs[-1]):] == 0)


def test_tile_override_env_replaces_the_gpu_defaults(monkeypatch):
    """`$TITAN_MOE_GROUPED_MM_TILES` sets any kernel's GPU tiles (a sweep's winner timed
    through the whole op), optionally with persistent programs per SM; the CPU keeps its
    interpreter tiles; malformed values are refused."""
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(tk.TILES_ENV, raising=False)
    default_mk = tk.default_config(torch.bfloat16, cuda, "mk")
    monkeypatch.setenv(tk.TILES_ENV, "k=32x128x256x4x3")
    assert tk.default_config(torch.bfloat16, cuda, "mk") == default_mk
    assert tk.default_config(torch.bfloat16, cuda, "k") == tk.TileConfig(32, 128, 256, num_warps=4, num_stages=3)
    monkeypatch.setenv(tk.TILES_ENV, "mk=128x256x64x8x3,k=64x128x128x8x4")
    assert tk.default_config(torch.float32, cuda, "mk") == tk.TileConfig(128, 256, 64, num_warps=8, num_stages=3)
    assert tk.default_config(torch.float32, cpu, "mk") == tk.TileConfig(16, 16, 16, num_warps=4, num_stages=1)
    monkeypatch.setenv(tk.TILES_ENV, "k8=64x128x128x4x3x2")
    k8 = tk.default_config(torch.float8_e4m3fn, cuda, "k8")
    assert k8 == tk.TileConfig(64, 128, 128, num_warps=4, num_stages=3, programs_per_sm=2)
    if torch.cuda.is_available():
        sms = tk.sm_count(torch.cuda.current_device())
        assert tk._num_programs(k8, torch.device("cuda"), 10**9) == 2 * sms
    assert tk._num_programs(k8, cpu, 10**9) == 4  # the interpreter's count
    monkeypatch.setenv(tk.TILES_ENV, "k=64x128x128x8x3t,k8=128x128x128x8x4x2t")
    assert tk.default_config(torch.bfloat16, cuda, "k") == tk.TileConfig(64, 128, 128, num_warps=8, num_stages=3,
                                                                          store_tma=True)
    assert tk.default_config(torch.float8_e4m3fn, cuda, "k8") == tk.TileConfig(
        128, 128, 128, num_warps=8, num_stages=4, programs_per_sm=2, store_tma=True)
    for bad, match in (("mk=128x256x64x8", "BMxBNxBKxWARPSxSTAGES"), ("dw=64x64x64x4x3", "KIND"),
                       ("mk=128x256x64x6x3", "power of two"), ("mk=96x128x64x4x3", "power of two >= 16"),
                       ("k8=64x128x128x4x3x0", "programs >= 1"), ("k8=64x128x128x4x3x2x2", "PROGRAMS"),
                       ("k=64x128x128x4x3r32", "forward / dx kinds"), ("k=64x128x128x4x3tt", "BMxBNxBKxWARPSxSTAGES")):
        monkeypatch.setenv(tk.TILES_ENV, bad)
        with pytest.raises(ValueError, match=match):
            tk.default_config(torch.bfloat16, cuda, "mk")


def test_sm90_defaults_swept_tiles_and_tma(monkeypatch):
    """On sm90 the 16-bit kernels default to the sweep's tiles and to TMA loads (off with
    `$TITAN_MOE_GROUPED_MM_TMA=0`); other GPUs keep the generic tiles and pointer loads; an
    explicit `tma=` or tile override wins over both."""
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    cuda = torch.device("cuda")
    monkeypatch.delenv(tk.TILES_ENV, raising=False)
    monkeypatch.delenv(tk.TMA_ENV, raising=False)
    monkeypatch.setattr(tk, "_is_sm90", lambda device: False)
    generic = {kind: tk.default_config(torch.bfloat16, cuda, kind) for kind in ("mk", "k")}
    monkeypatch.setenv(tk.TMA_ENV, "1")
    assert not tk._use_tma(None, cuda)
    monkeypatch.setattr(tk, "_is_sm90", lambda device: device.type == "cuda")
    for kind in ("mk", "k"):
        assert tk.default_config(torch.bfloat16, cuda, kind) == tk.SM90_TILES[kind] != generic[kind]
        assert tk.default_config(torch.float16, cuda, kind) == tk.SM90_TILES[kind]
    # the forward / dx tile by output width: 128x256 where N is a multiple of 256, else 256x128
    for n_cols, tile in ((1408, "mk"), (1024, "mk_n256"), (2816, "mk_n256"), (2048, "mk_n256"), (1664, "mk")):
        assert tk.default_config(torch.bfloat16, cuda, "mk", n_cols=n_cols) == tk.SM90_TILES[tile], n_cols
    assert tk.SM90_TILES["mk_n256"].block_n == 256 != tk.SM90_TILES["mk"].block_n
    assert tk.default_config(torch.bfloat16, cuda, "k", n_cols=1024) == tk.SM90_TILES["k"]  # dw: unchanged
    monkeypatch.setattr(tk, "_is_sm90", lambda device: False)
    assert tk.default_config(torch.bfloat16, cuda, "mk", n_cols=1024) == generic["mk"]  # other GPUs: unmeasured
    monkeypatch.setattr(tk, "_is_sm90", lambda device: device.type == "cuda")
    assert tk.default_config(torch.float32, cuda, "mk") == tk.TileConfig(64, 64, 32, num_warps=4, num_stages=3)
    assert tk._use_tma(None, cuda) and not tk._use_tma(False, cuda)
    monkeypatch.delenv(tk.TMA_ENV)
    assert tk._use_tma(None, cuda) and not tk._use_tma(False, cuda)
    monkeypatch.setenv(tk.TMA_ENV, "0")
    assert not tk._use_tma(None, cuda) and tk._use_tma(True, cuda)
    monkeypatch.setenv(tk.TILES_ENV, "mk=128x128x64x8x4")
    assert tk.default_config(torch.bfloat16, cuda, "mk") == tk.TileConfig(128, 128, 64, num_warps=8, num_stages=4)


def test_fp8_small_groups_take_tail_tiles_on_sm90(monkeypatch):
    """The fp8 forward / dx tile by mean group size: tail tiles up to SMALL_GROUP_ROWS rows per
    group on sm90 (K3's latent experts), the large-group tile above it and without the
    count; other GPUs and the override are unaffected."""
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    cuda, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    monkeypatch.delenv(tk.TILES_ENV, raising=False)
    monkeypatch.setattr(tk, "_is_sm90", lambda device: device.type == "cuda")
    small, large = tk.SM90_TILES["mk8_small"], tk.SM90_TILES["mk8"]
    assert small.tail_m and not large.tail_m
    assert tk.default_config(fp8, cuda, "mk8", rows_per_group=16384 / 112) == small
    assert tk.default_config(fp8, cuda, "mk8", rows_per_group=tk.SMALL_GROUP_ROWS) == small
    assert tk.default_config(fp8, cuda, "mk8", rows_per_group=tk.SMALL_GROUP_ROWS + 1) == large
    assert tk.default_config(fp8, cuda, "mk8") == large
    assert tk.default_config(fp8, cuda, "k8", rows_per_group=100) == tk.SM90_TILES["k8"]
    monkeypatch.setenv(tk.TILES_ENV, "mk8=128x128x128x8x3")
    assert tk.default_config(fp8, cuda, "mk8", rows_per_group=100) == tk.TileConfig(128, 128, 128, num_warps=8,
                                                                                   num_stages=3)
    monkeypatch.delenv(tk.TILES_ENV)
    monkeypatch.setattr(tk, "_is_sm90", lambda device: False)
    assert tk.default_config(fp8, cuda, "mk8", rows_per_group=100) == large


def test_fp8_dw_default_tile_shared_memory():
    """The fp8 dw's default tile fits an sm90 SM with bf16 output and TMA stores; with fp32
    output its staging buffer does not (Triton 3.6 on the H200 refused 278,528 bytes), and the
    pointer-store form of the same tile fits again: what the launcher falls back to."""
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    k8 = tk.SM90_TILES["k8"]
    assert k8.store_tma
    assert tk.dw_shared_bytes(k8, 1, 2) == 212_992 <= tk.SM90_SHARED_BYTES
    assert tk.dw_shared_bytes(k8, 1, 4) == 278_528 > tk.SM90_SHARED_BYTES
    assert tk.dw_shared_bytes(dataclasses.replace(k8, store_tma=False), 1, 4) <= tk.SM90_SHARED_BYTES


def test_auto_backend_rule_and_routing(monkeypatch):
    """"auto": our kernels only on sm90, 16-bit, with at least AUTO_MIN_GROUP_ROWS rows per
    group on average for the forward and dx, AUTO_DW_MIN_GROUP_ROWS for dw, the Gluon ones from
    AUTO_GLUON_MIN_GROUP_ROWS; native for fp32, small groups, other devices. The op routes each
    product through the rule's choice."""
    from types import SimpleNamespace

    def operand(rows, dtype=torch.bfloat16, device="cuda"):
        return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(rows, 64))

    E = 8
    offs = torch.zeros(E, dtype=torch.int32)
    big, small = gg_op.AUTO_MIN_GROUP_ROWS * E, gg_op.AUTO_MIN_GROUP_ROWS * E - 1
    monkeypatch.setattr(tk, "_is_sm90", lambda device: device.type == "cuda")
    assert [gg_op.auto_backend(p, operand(big), offs) for p in gg_op.PRODUCTS] == ["triton", "triton", "native"]
    dw_big = gg_op.AUTO_DW_MIN_GROUP_ROWS * E
    assert gg_op.AUTO_GLUON_MIN_GROUP_ROWS == gg_op.AUTO_DW_MIN_GROUP_ROWS > gg_op.AUTO_MIN_GROUP_ROWS
    assert [gg_op.auto_backend(p, operand(dw_big), offs) for p in gg_op.PRODUCTS] == ["gluon"] * 3
    assert [gg_op.auto_backend(p, operand(dw_big - 1), offs) for p in gg_op.PRODUCTS] == ["triton", "triton", "native"]
    assert gg_op.auto_backend("fwd", operand(big, torch.float16), offs) == "triton"
    for args in ((operand(small),), (operand(big, torch.float32),), (operand(big, device="cpu"),)):
        assert gg_op.auto_backend("fwd", *args, offs) == "native", args
    monkeypatch.setattr(tk, "_is_sm90", lambda device: False)
    assert gg_op.auto_backend("fwd", operand(big), offs) == "native"

    calls = spy_on(monkeypatch, tk, ("grouped_mm_triton", "grouped_mm_dw_triton"))
    x, w, grad, offs = make_case(30, 16, 16, 3, 1.0, torch.float32, seed=4)
    runs = {name: run_backend(x, w, grad, offs, name) for name in ("loop", "auto")}
    assert calls == []  # on the CPU auto is native
    monkeypatch.setattr(gg_op, "auto_backend", lambda product, x, offs: "triton" if product == "dx" else "loop")
    routed = run_backend(x, w, grad, offs, "auto")
    assert calls == ["grouped_mm_triton"]  # dx only
    assert choices.current().grouped_mm == "auto"
    default = run_backend(x, w, grad, offs)  # the default backend is auto: dx on triton again
    assert calls == ["grouped_mm_triton"] * 2
    for got, ref in zip(default, routed):
        assert torch.equal(got, ref)
    for got, ref in zip(routed, runs["loop"]):
        assert rel_err(got, ref) < TOL[torch.float32]
    for got, ref in zip(runs["auto"], runs["loop"]):
        assert rel_err(got, ref) < TOL[torch.float32]


def test_ensure_cuda_context_binds_the_primary_context_once_per_thread(monkeypatch):
    """Before a TMA descriptor is encoded, a thread with no current CUDA context gets the
    device's primary context (as Triton's launcher does before a launch); a thread that has
    one keeps it; each thread checks once."""
    import threading

    from titan_moe.ops import triton_runtime as rt

    class FakeDriver:
        def __init__(self, current):
            self.current, self.calls = current, []

        def cuCtxGetCurrent(self, ptr):
            self.calls.append("get")
            ptr._obj.value = self.current
            return 0

        def cuDeviceGet(self, ptr, index):
            self.calls.append(("device", index))
            ptr._obj.value = 10 + index
            return 0

        def cuDevicePrimaryCtxRetain(self, ptr, device):
            self.calls.append(("retain", device.value))
            ptr._obj.value = 1234
            return 0

        def cuCtxSetCurrent(self, ctx):
            self.calls.append(("set", ctx.value))
            return 0

    def in_new_thread(driver, index):
        monkeypatch.setattr(rt, "_libcuda", lambda: driver)
        worker = threading.Thread(target=lambda: [rt.ensure_cuda_context(index), rt.ensure_cuda_context(index)])
        worker.start()
        worker.join()
        return driver.calls

    assert in_new_thread(FakeDriver(None), 1) == ["get", ("device", 1), ("retain", 11), ("set", 1234)]
    assert in_new_thread(FakeDriver(99), 0) == ["get"]
    failing = FakeDriver(None)
    failing.cuDevicePrimaryCtxRetain = lambda ptr, device: 201
    monkeypatch.setattr(rt, "_libcuda", lambda: failing)
    errors = []

    def run():
        try:
            rt.ensure_cuda_context(0)
        except RuntimeError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert errors and "cuDevicePrimaryCtxRetain" in errors[0] and "201" in errors[0]
