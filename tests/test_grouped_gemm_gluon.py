"""The grouped GEMM op's "gluon" backend (titan_moe/ops/grouped_gemm/gluon_kernel.py).

Gluon has no interpreter, so on the CPU its kernels are built for sm90 (warps per partition,
register moves, wgmma, TMA, shared memory, no spills) and the backend's host logic is
checked (tile names, scope, the fallback off sm90). Their results are checked on an sm90 GPU
against the per-group loop, through the op's autograd, each tile in a process under a time
limit (a warp-specialized kernel that deadlocks fails the test instead of holding the suite).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from gluon_builds import build_results, check_builds

from titan_moe.ops.grouped_gemm import grouped_mm
from titan_moe.ops.grouped_gemm import gluon_kernel as gk
from titan_moe.ops.grouped_gemm import op as gg_op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def test_backend_kernels_build_warp_specialized_for_sm90():
    """The ping-pong forward (both tiles' shapes) and dx (staged and from registers), the
    ping-pong dw (BM 64 and 128 rows per step) and the cooperative dw (staged and from
    registers) build with 12 warps (two 4-warp consumers and the load
    warp's group) or 8 + 4, register moves, wgmma, TMA, mbarriers, no spills."""
    results = build_results([("pp128x128x64s5", "fwd"), ("pp128x128x64s5", "dx"), ("pp64x256x64s4", "fwd"),
                                        ("pp128x128x64s6d", "dx")],
                            ["ppdw128x128x64s5", "ppdw128x128x128s2", "dw256x128x64s3", "dw128x256x64s4d",
                             "dw256x128x64s3h", "ppdw128x128x64s5h"])
    assert len(results) == 10, results
    check_builds(results)
    assert [results[n][2] for n in ("ppdw128x128x64s5", "dw256x128x64s3")] == [12, 12]


def test_tiles_from_the_environment(monkeypatch):
    monkeypatch.delenv(gk.TILES_ENV, raising=False)
    assert [gk.tiles(p) for p in ("fwd", "dx", "dw")] == list(gk.DEFAULT_TILES)
    # dw by K: 128 rows of dw per tile, which divide the MoE layer's K 1,024 and 1,408; not K 64
    # (the default named, which `gluon_dw_supported` refuses: the Triton dw runs)
    assert [gk.tiles("dw", k) for k in (2048, 1024, 1408, 64)] == ["ppdw128x128x64s5h"] * 4
    monkeypatch.setenv(gk.TILES_ENV, "pp64x256x64s4,pp128x128x64s4,ppdw128x128x128s2")
    assert [gk.tiles(p) for p in ("fwd", "dx", "dw")] == ["pp64x256x64s4", "pp128x128x64s4", "ppdw128x128x128s2"]
    assert gk.tiles("dw", 1408) == "ppdw128x128x128s2"  # the environment's choice holds at any K
    monkeypatch.setenv(gk.TILES_ENV, ",pp64x256x64s4,")  # empty entries keep the defaults
    assert [gk.tiles("fwd"), gk.tiles("dx"), gk.tiles("dw", 1408)] == ["pp128x128x64s5", "pp64x256x64s4",
                                                                         "ppdw128x128x64s5h"]
    for bad in ("pp128x128x64s5", "pp128x128x64s5,pp128x128x64s5,pp128x128x64s5", "x,pp128x128x64s5,dw256x128x64s3",
                ",,,"):
        monkeypatch.setenv(gk.TILES_ENV, bad)
        with pytest.raises(ValueError, match=gk.TILES_ENV):
            gk.tiles("fwd")


def test_tile_flags_read_the_suffix_after_the_stages():
    """(direct, host_descs): "d" stores from registers, "h" the dw's host descriptors; the
    letters of the name before the stages ("pp", "dw") are not flags."""
    assert [gk.tile_flags(n) for n in ("pp128x128x64s5", "pp128x128x64s6d", "ppdw128x128x64s5h", "dw256x128x64s4dh",
                                       "dw256x128x64s3")] == [(False, False), (True, False), (False, True),
                                                              (True, True), (False, False)]


def test_every_tile_fits_sm90_shared_memory():
    """Ring stages plus the staging buffers (two for ping-pong) within sm90's 227 KiB."""
    for name, (bm, bn, bk, stages) in gk.MM_TILES.items():
        staging_rows = 8 if gk.tile_flags(name)[0] else bm  # "d": stored from registers, 8-row stand-ins
        assert stages * (bm * bk + bk * bn) * 2 + 2 * staging_rows * bn * 2 <= 232448, name
    for name, (bm, bk, bn, stages, schedule) in gk.DW_TILES.items():
        staging_rows = 8 if gk.tile_flags(name)[0] else bk
        assert stages * (bm * bk + bm * bn) * 2 + (2 if schedule == "pp" else 1) * staging_rows * bn * 2 <= 232448


def test_off_sm90_the_backend_falls_back_with_the_same_results():
    """On the CPU "gluon" is the native backend (the kernels' scope is sm90): outputs and
    gradients equal the loop's, and the scope checks say no."""
    gen = torch.Generator().manual_seed(3)
    offs = torch.tensor([5, 5, 17, 30], dtype=torch.int32)
    x = torch.randn(32, 64, generator=gen, requires_grad=True)
    w = torch.randn(4, 64, 16, generator=gen, requires_grad=True)
    grad = torch.randn(32, 16, generator=gen)
    assert not gk.gluon_supported(x, w) and not gk.gluon_dw_supported(x, grad)
    assert gg_op._resolve_gluon("fwd", x, w) == "native"
    results = {}
    for backend in ("gluon", "loop"):
        out = grouped_mm(x, w, offs, backend=backend)
        dx, dw = torch.autograd.grad(out, (x, w), grad)
        results[backend] = (out, dx, dw)
    for got, want in zip(results["gluon"], results["loop"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "gluon" in gg_op.BACKENDS and gg_op.resolve_backend("dw=gluon", "dw") == "gluon"


def test_a_triton_without_gluon_takes_the_triton_kernels(monkeypatch):
    """Where the installed Triton lacks Gluon, "gluon" (and so "auto", the default, on sm90)
    takes the Triton kernels instead of failing on import; with Gluon it asks the kernels'
    scope."""
    from types import SimpleNamespace

    cuda_operand = SimpleNamespace(device=torch.device("cuda"))

    def no_gluon():
        raise ImportError("no triton.experimental.gluon")

    monkeypatch.setattr(gg_op, "_gluon_kernels", no_gluon)
    gg_op._gluon_importable.cache_clear()
    try:
        assert not gg_op._gluon_importable()
        assert gg_op._resolve_gluon("fwd", cuda_operand, cuda_operand) == "triton"
        assert gg_op._resolve_gluon("dw", cuda_operand, cuda_operand) == "triton"
        scope = SimpleNamespace(gluon_supported=lambda a, b: True, gluon_dw_supported=lambda a, b: False)
        monkeypatch.setattr(gg_op, "_gluon_kernels", lambda: scope)
        gg_op._gluon_importable.cache_clear()
        assert gg_op._resolve_gluon("fwd", cuda_operand, cuda_operand) == "gluon"
        assert gg_op._resolve_gluon("dw", cuda_operand, cuda_operand) == "triton"
    finally:
        gg_op._gluon_importable.cache_clear()


def test_reductions_the_tiles_cannot_step_are_refused_on_the_host():
    offs = torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 64"):
        gk.grouped_mm_gluon(torch.zeros(5, 40, dtype=torch.bfloat16), torch.zeros(2, 40, 256, dtype=torch.bfloat16),
                            offs, "pp128x128x64s5")
    with pytest.raises(ValueError, match="multiple of the dw tile"):
        gk.grouped_mm_dw_gluon(torch.zeros(5, 192, dtype=torch.bfloat16), torch.zeros(5, 128, dtype=torch.bfloat16),
                               offs, "dw256x128x64s3")


_GPU_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from titan_moe.ops.grouped_gemm import grouped_mm, gluon_kernel as gk, op as gg_op

    if sys.argv[1]:  # else the defaults (dw by K)
        os.environ[gk.TILES_ENV] = sys.argv[1]
    dtype = getattr(torch, sys.argv[2])
    gen = torch.Generator(device="cuda").manual_seed(11)
    worst = 0.0
    # empty groups, partial tiles, a one-row group, a group inside one tile; rows past offs[-1]
    for sizes, extra, K, N in (([0, 300, 37, 0, 512, 129, 1, 200], 45, 256, 384), ([64] * 3, 0, 128, 136),
                               ([0, 0, 0], 10, 64, 64)):
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        M = sum(sizes) + extra
        x = torch.randn(M, K, device="cuda", generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(len(sizes), K, N, device="cuda", generator=gen) / K ** 0.5).to(dtype).requires_grad_()
        grad = torch.randn(M, N, device="cuda", generator=gen).to(dtype)
        # outside the kernels' scope the op falls back to the Triton kernels, also checked here
        assert gk.gluon_supported(x, w) and gk.gluon_supported(grad, w.transpose(1, 2)) == (N % 64 == 0)
        assert gk.gluon_dw_supported(x, grad) == (K % gk.DW_TILES[gk.tiles("dw", K)][1] == 0)
        junk = torch.full((4 * M * max(K, N),), float("nan"), device="cuda", dtype=dtype)
        del junk  # the outputs' memory, reused by the allocator, starts as NaN: every element must be stored
        got = grouped_mm(x, w, offs, backend="gluon")
        got_grads = torch.autograd.grad(got, (x, w), grad)
        want = grouped_mm(x.float(), w.float(), offs, backend="loop")
        want_grads = torch.autograd.grad(want, (x, w), grad.float())
        assert torch.equal(got[sum(sizes):], torch.zeros_like(got[sum(sizes):]))  # rows past offs[-1]
        for g, r in zip((got,) + got_grads, (want,) + want_grads):
            worst = max(worst, ((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
        empty = torch.tensor(sizes, device="cuda") == 0
        assert not got_grads[1][empty].any()  # empty groups' dw is zero
    print("RESULT", worst)
    """
)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm90 (Hopper) GPU: Gluon's kernels are written for it")
@pytest.mark.parametrize("tiles, dtype", [
    ("", "bfloat16"),
    ("pp128x128x64s4,pp64x256x64s4,ppdw128x128x64s5", "bfloat16"),
    ("pp64x256x64s4,pp128x128x64s5,ppdw128x128x128s2", "float16"),
    ("pp128x128x64s5,pp128x128x64s4,dw128x128x64s4", "bfloat16"),
    ("pp128x128x64s6d,pp64x256x64s5d,ppdw128x128x64s4", "bfloat16"),
    ("pp128x128x64s5,pp128x128x64s5,dw128x256x64s3", "bfloat16"),
    ("pp128x128x64s5,pp128x128x64s5,dw256x128x64s4d", "bfloat16"),
    ("pp128x128x64s5,pp128x128x64s5,dw128x256x64s4d", "float16"),
    ("pp128x128x64s5,pp128x128x64s5,dw256x128x64s3h", "bfloat16"),
    ("pp128x128x64s5,pp128x128x64s5,dw128x256x64s3h", "float16"),
    ("pp128x128x64s5,pp128x128x64s5,dw256x128x64s4dh", "bfloat16"),
    ("pp128x128x64s5,pp128x128x64s5,ppdw128x128x64s5h", "bfloat16"),
])
def test_gluon_backend_matches_the_loop_through_autograd(tiles, dtype):
    """The op with backend="gluon" (forward, dx, dw) against the fp32 loop on random ragged
    groups, the default tiles ("") and every other tile: relative error below 1e-2 (16-bit
    outputs of fp32 sums); rows past offs[-1] and empty groups' dw exactly zero, in outputs
    whose memory held NaNs."""
    try:
        proc = subprocess.run([sys.executable, "-c", _GPU_SCRIPT, tiles, dtype], capture_output=True, text=True,
                              timeout=240, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tiles}: no result within 240 s (a hang)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = float(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")).split()[1])
    assert error < 1e-2, (tiles, error)
