"""Triton KDA kernels (`titan_moe.ops.kda.triton_fwd` / `triton_bwd`) against the naive recurrence.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be
set before the kernel module is first imported (that is when `@triton.jit` chooses the
interpreter), so this module sets it at the top. If the kernel module was already
imported in this process without it (another test module first), the in-process tests
skip and `test_in_fresh_interpreter_process` runs this file again in a subprocess.
The interpreter computes bf16 `tl.dot` wrongly, so CPU tests use fp32 inputs only.
With CUDA the same tests run compiled on the GPU, plus the bf16 long-sequence check.

Oracles: our token-by-token `naive_recurrent_kda` in float64 (varlen aware; gradients by
torch.autograd through it) and fla-core's plain-PyTorch `naive_recurrent_kda` (independent
code) in float64.

Tolerances (relative error ||out - ref|| / ||ref||):
- fp32 kernels vs float64 recurrence: 1e-4. Every product in the kernels is an fp32
  product of bounded factors (the tile anchors keep each exponential below e^40, and an
  anchored product e^{G_i-c} e^{c-G_j} carries the same ~3 ulp relative error as
  e^{G_i-G_j}); sums run over at most 64 tokens or dk channels, the 16x16 inverses are
  forward substitutions, and the shapes here cross at most 3 chunk boundaries. That gives
  ~1e2 * 6e-8 ~ 1e-5 at worst (seen: ~1e-6). A wrong mask, anchor, decay or boundary
  gives errors of 1e-2 or more.
- fp32 dg: 2e-3. dg is the reverse cumsum of dG inside a chunk; every pair (i, j) adds
  +x at i and -x at j, which cancel exactly in dg_t for t <= j. Rounding leaves
  ~64 * 6e-8 * max|x|, and with g = g_min everywhere the true dg is up to e^5 ~ 150x
  smaller than max|x|: ~6e-4 relative (seen: 7e-5).
- bf16 (GPU only) vs float64 recurrence: 6e-3 (fla's bf16 `chunk_kda` measures ~4.7e-3 on
  the H200); if fla's Triton `chunk_kda` runs, no worse than 1.2x its error on the same
  inputs.
- fp16 (16-bit inputs the interpreter can run: its bf16 dots are wrong) vs float64
  recurrence: the bf16 bounds scaled by the ratio of the unit roundoffs, 2^-11 / 2^-8 = 1/8:
  o and final state 7.5e-4, dq/dk/dv/dh0 1e-3, dg/dbeta 2.5e-3. The state walks round W, U,
  K~, V~, h and their dot operands to the input dtype, so the error is a few roundings of
  that dtype (seen: <= 5e-4). Compiled on a GPU the fp32 tile dots of 16-bit inputs run in
  tf32 (unit roundoff 2^-11, fp16's own), which the interpreter computes exactly: twice the
  rounding sources, twice the bounds (`FP16_TOL_COMPILED`; the first compiled run exceeded
  the interpreter's bounds at o, and every quantity measured compiled since stays at least
  1.4x under the doubled ones).
"""

from __future__ import annotations

import os


import pytest
import torch
import torch.nn.functional as F
from numerics import rel_err
from triton_mode import interpret_without_gpu, kernel_test_setup, rerun_under_interpreter

CUDA = interpret_without_gpu()

from titan_moe.ops.kda import naive_recurrent_kda  # noqa: E402
from titan_moe.ops.kda import triton_fwd  # noqa: E402
from titan_moe.ops.kda import triton_bwd  # noqa: E402
from titan_moe.ops.kda.kept import RESIDUAL_NAMES, residual_specs  # noqa: E402
from titan_moe.ops.kda.triton_bwd import chunk_kda_bwd_triton  # noqa: E402
from titan_moe.ops.kda.triton_fwd import chunk_kda_fwd_triton, kda_fwd_states  # noqa: E402

try:
    from fla.ops.kda import naive as fla_naive
except ImportError:  # fla-core is a dev dependency: the independent oracle
    fla_naive = None
needs_fla = pytest.mark.skipif(fla_naive is None, reason="fla-core (the independent oracle) is not installed")


KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, triton_fwd._interpreted(), "test_in_fresh_interpreter_process")

FP32_TOL = 1e-4
FP32_DG_TOL = 2e-3
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
BF16_TOL = 6e-3
FLA_RATIO = 1.2
FP16_TOL = {"o": 7.5e-4, "ht": 7.5e-4, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3, "dh0": 1e-3,
            "dg": 2.5e-3, "dbeta": 2.5e-3}
FP16_TOL_COMPILED = {name: 2 * bound for name, bound in FP16_TOL.items()}  # tf32 tile dots, see above


def fp16_tolerances() -> dict[str, float]:
    """`FP16_TOL` under the interpreter (exact fp32 dots), `FP16_TOL_COMPILED` on a GPU."""
    return FP16_TOL if triton_fwd._interpreted() else FP16_TOL_COMPILED


FP32_TOL_BY_NAME = {"o": FP32_TOL, "ht": FP32_TOL, **{n: FP32_DG_TOL if n == "dg" else FP32_TOL for n in GRAD_NAMES}}




def make_inputs(
    B: int, T: int, H: int, dk: int, dv: int, gate: str, seed: int, dtype=torch.float32, device=DEVICE
) -> dict[str, torch.Tensor]:
    """q/k unit per head, g in [-5, 0), beta in (0, 1).

    gate: "rand" (uniform in [-5, 0)), "min" (g = -5 everywhere: every chunk at the
    bound), "slow" (uniform in [-0.05, 0): long memory, so chunk hops matter).
    """
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    u = torch.rand(B, T, H, dk, generator=gen)
    g = {"rand": -5.0 * u, "min": torch.full_like(u, -5.0), "slow": -0.05 * u}[gate]
    beta = torch.rand(B, T, H, generator=gen)
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    return {name: x.to(device=device, dtype=dtype if name in ("q", "k", "v") else torch.float32)
            for name, x in out.items()}


def reference(inp, scale, initial_state=None, cu_seqlens=None):
    """float64 token-by-token recurrence (ours; varlen aware)."""
    x64 = {name: t.double() for name, t in inp.items()}
    h0 = None if initial_state is None else initial_state.double()
    return naive_recurrent_kda(
        **x64, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens
    )


# ----------------------------------------------------------------------------------------
# fp32: accuracy on small shapes (interpreter on CPU, compiled on GPU)
# ----------------------------------------------------------------------------------------
@needs_kernels
@needs_fla
@pytest.mark.parametrize(
    "B, T, dk, dv, gate",
    [
        (1, 1, 16, 16, "rand"),
        (2, 20, 32, 16, "rand"),
        (1, 64, 16, 32, "rand"),
        (1, 100, 32, 32, "slow"),
        (1, 130, 16, 16, "rand"),
        (1, 130, 32, 16, "min"),
    ],
)
def test_fwd_matches_fla_naive(B, T, dk, dv, gate):
    """Fixed-length batches vs fla's independent recurrence, with an initial state."""
    H = 2
    inp = make_inputs(B, T, H, dk, dv, gate, seed=T + dk)
    scale = dk**-0.5
    h0 = torch.randn(B, H, dk, dv, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    o, ht = chunk_kda_fwd_triton(**inp, scale=scale, initial_state=h0, output_final_state=True)
    x64 = {name: t.double() for name, t in inp.items()}
    o_ref, ht_ref = fla_naive.naive_recurrent_kda(
        **x64, scale=scale, initial_state=h0.double(), output_final_state=True
    )
    assert o.dtype == inp["v"].dtype and ht.dtype == torch.float32
    assert o.shape == inp["v"].shape and ht.shape == h0.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(ht, ht_ref) < FP32_TOL


@needs_kernels
@pytest.mark.parametrize("gate", ["rand", "min"])
def test_fwd_varlen(gate):
    """Packed sequences (one empty, one shorter than a 16-token tile, one crossing two
    chunk boundaries): the state restarts from initial_state[n] at each boundary."""
    lens = [5, 0, 70, 16, 139]
    cu_seqlens = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    T, H, dk, dv = sum(lens), 2, 32, 16
    inp = make_inputs(1, T, H, dk, dv, gate, seed=11)
    h0 = torch.randn(len(lens), H, dk, dv, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    scale = dk**-0.5
    o, ht = chunk_kda_fwd_triton(
        **inp, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens, output_final_state=True
    )
    o_ref, ht_ref = reference(inp, scale, initial_state=h0, cu_seqlens=cu_seqlens)
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(ht, ht_ref) < FP32_TOL
    assert torch.equal(ht[1], h0[1])  # the empty sequence passes its state through


@needs_kernels
def test_fwd_no_initial_state_no_final_state():
    inp = make_inputs(1, 100, 2, 16, 16, "rand", seed=5)
    o, ht = chunk_kda_fwd_triton(**inp, scale=0.3)
    o_ref, _ = reference(inp, 0.3)
    assert ht is None
    assert rel_err(o, o_ref) < FP32_TOL


@needs_kernels
def test_fwd_min_gate_large_keys_stays_finite():
    """g = g_min across whole chunks with keys far from unit norm: the diagonal tiles'
    discarded upper halves reach e^75 * |q||k| before masking; nothing may leak."""
    inp = make_inputs(1, 64, 2, 32, 16, "min", seed=9)
    inp["q"] = inp["q"] * 30.0
    inp["k"] = inp["k"] * 3.0
    inp["beta"] = inp["beta"] / 9.0  # keeps (I - beta k k^T) a contraction
    o, ht = chunk_kda_fwd_triton(**inp, scale=1.0, output_final_state=True)
    o_ref, ht_ref = reference(inp, 1.0)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(ht, ht_ref) < FP32_TOL


@needs_kernels
def test_intermediates_are_the_chunked_form():
    """The WY factors satisfy their defining equation (I + A_kk) X = I and W = X beta e^G K,
    checked on the intermediates against a float64 evaluation of SPEC §1's chunked form."""
    T, H, dk, dv = 64, 1, 16, 16
    inp = make_inputs(1, T, H, dk, dv, "rand", seed=21)
    st = kda_fwd_states(**inp, scale=1.0)
    q, k, g, beta = (inp[n][0, :, 0].double().cpu() for n in ("q", "k", "g", "beta"))
    G = g.cumsum(0)
    decay = torch.exp(G[:, None, :] - G[None, :, :])  # [i, j, c], only used where j <= i
    A_kk = (beta[:, None] * torch.einsum("ic,jc,ijc->ij", k, k, decay)).tril(-1)
    A_qk = torch.einsum("ic,jc,ijc->ij", q, k, decay).tril()
    X = torch.linalg.inv(torch.eye(T, dtype=torch.float64) + A_kk)
    W = X @ (beta[:, None] * torch.exp(G) * k)
    got = {name: getattr(st, name)[:, 0].double().cpu() for name in ("G", "Aqk", "Ainv", "W", "q_decay")}
    assert rel_err(got["G"], G) < 1e-6
    assert rel_err(got["Aqk"].tril(), A_qk) < FP32_TOL
    assert rel_err(got["Ainv"].tril(), X) < FP32_TOL
    assert rel_err(got["W"], W) < FP32_TOL
    assert rel_err(got["q_decay"], q * torch.exp(G)) < FP32_TOL  # the output's operand, scale 1
    # the backward's recompute skips that operand; the output stage then refuses the state
    st_bwd = kda_fwd_states(**inp, scale=1.0, output_q_decay=False)
    assert st_bwd.q_decay is None
    with pytest.raises(ValueError, match="q_decay"):
        triton_fwd.kda_fwd_output(inp["q"], inp["v"], st_bwd)


@needs_kernels
def test_rejects_bad_inputs():
    inp = make_inputs(1, 20, 2, 16, 16, "rand", seed=1)
    bad_dim = dict(inp, q=inp["q"][..., :8], k=inp["k"][..., :8], g=inp["g"][..., :8])
    with pytest.raises(ValueError, match="dk and dv"):
        chunk_kda_fwd_triton(**bad_dim, scale=1.0)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        chunk_kda_fwd_triton(**{n: t.double() for n, t in inp.items()}, scale=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda_fwd_triton(**inp, scale=1.0, cu_seqlens=torch.tensor([0, 5, 19], dtype=torch.int32).to(DEVICE))


# ----------------------------------------------------------------------------------------
# backward (fp32) against autograd through the float64 recurrence
# ----------------------------------------------------------------------------------------
def reference_grads(inp, scale, do, initial_state=None, dht=None, cu_seqlens=None):
    """float64 autograd of <o, do> + <final_state, dht> through `naive_recurrent_kda`."""
    leaves = [inp[n].double().cpu().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    h0 = None if initial_state is None else initial_state.double().cpu().requires_grad_()
    o, ht = naive_recurrent_kda(
        *leaves, scale=scale, initial_state=h0, output_final_state=True,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu(),
    )
    loss = (o * do.double().cpu()).sum()
    if dht is not None:
        loss = loss + (ht * dht.double().cpu()).sum()
    grads = torch.autograd.grad(loss, leaves + ([h0] if h0 is not None else []))
    return list(grads) + ([None] if h0 is None else [])


@needs_kernels
@pytest.mark.parametrize(
    "lens, varlen, dk, dv, gate, with_states",
    [
        ([64], False, 16, 16, "rand", True),
        ([130], False, 32, 16, "slow", True),
        ([100], False, 16, 32, "min", False),
        ([5, 0, 70, 16, 139], True, 32, 16, "rand", True),
    ],
)
def test_bwd_matches_autograd(lens, varlen, dk, dv, gate, with_states):
    """All six gradients, with/without initial state and final-state gradient, packed
    sequences (one empty, one shorter than a tile), g = g_min across whole chunks."""
    T, H, N = sum(lens), 2, len(lens)
    inp = make_inputs(1, T, H, dk, dv, gate, seed=T + dv)
    gen = torch.Generator().manual_seed(T)
    do = torch.randn(1, T, H, dv, generator=gen).to(DEVICE)
    h0 = torch.randn(N, H, dk, dv, generator=gen).to(DEVICE) if with_states else None
    dht = torch.randn(N, H, dk, dv, generator=gen).to(DEVICE) if with_states else None
    cu_seqlens = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEVICE) if varlen else None
    scale = dk**-0.5
    got = chunk_kda_bwd_triton(**inp, scale=scale, do=do, initial_state=h0, cu_seqlens=cu_seqlens, dht=dht)
    ref = reference_grads(inp, scale, do, initial_state=h0, dht=dht, cu_seqlens=cu_seqlens)
    for name, x, x_ref in zip(GRAD_NAMES, got, ref):
        if x_ref is None:
            assert x is None, name
            continue
        assert x.shape == x_ref.shape and torch.isfinite(x).all(), name
        tol = FP32_DG_TOL if name == "dg" else FP32_TOL
        assert rel_err(x, x_ref) < tol, (name, rel_err(x, x_ref))


@needs_kernels
def test_scan_config_override_keeps_results(monkeypatch):
    """The tuning knobs of the sequential walks (columns per program, warps) change the
    grid, not the maths: forward and all gradients agree with the default configuration."""
    inp = make_inputs(1, 100, 2, 16, 32, "rand", seed=5)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, 100, 2, 32, generator=gen).to(DEVICE)
    h0 = torch.randn(1, 2, 16, 32, generator=gen).to(DEVICE)

    def run():
        o, ht = chunk_kda_fwd_triton(**inp, scale=0.25, initial_state=h0, output_final_state=True)
        return (o, ht, *chunk_kda_bwd_triton(**inp, scale=0.25, do=do, initial_state=h0))

    default = run()
    monkeypatch.setenv(triton_fwd.SCAN_BV_ENV, "16")
    monkeypatch.setenv(triton_fwd.SCAN_WARPS_ENV, "2")
    assert triton_fwd.sequential_scan_config(16, 32) == (16, 2)
    for name, got, want in zip(("o", "ht", *GRAD_NAMES), run(), default, strict=True):
        assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))


@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@needs_kernels
def test_bwd_chunk_config_override_keeps_results(monkeypatch):
    """Stage 2's launch knob (key and value blocks, warps) changes the grid, not the maths:
    at dk = dv = 64, 16 x 16 blocks (four key blocks sharing dX and dbeta) agree with the
    default's single key block."""
    inp = make_inputs(1, 100, 2, 64, 64, "rand", seed=6)
    do = torch.randn(1, 100, 2, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    assert triton_bwd.bwd_chunk_config(64, 64) == (64, 64, 8, 8)  # the default
    assert triton_bwd.bwd_chunk_config(128, 128) == (64, 64, 8, 8)
    assert triton_bwd.bwd_chunk_config(32, 16) == (32, 16, 8, 8)  # clipped to dk and dv
    default = chunk_kda_bwd_triton(**inp, scale=0.25, do=do)
    monkeypatch.setenv(triton_bwd.BWD_CHUNK_ENV, "16x16x2x4")
    assert triton_bwd.bwd_chunk_config(64, 64) == (16, 16, 2, 4)
    for name, got, want in zip(GRAD_NAMES, chunk_kda_bwd_triton(**inp, scale=0.25, do=do), default):
        if want is not None:  # fp32 sums of the key blocks' shares in another order: ~1e-6
            assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))
    for bad, match in (("64x32x8", "BKxBV"), ("48x32x8x8", "16, 32, 64 or 128"), ("64x32x3x8", "powers of two")):
        monkeypatch.setenv(triton_bwd.BWD_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=match):
            triton_bwd.bwd_chunk_config(128, 128)


@needs_kernels
@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@pytest.mark.parametrize("lens, dk, dv", [([5, 0, 70, 16], 32, 16), ([100], 16, 32), ([5, 0, 70, 16, 139], 32, 16)])
def test_bwd_tma_loads_keep_results(monkeypatch, lens, dk, dv):
    """The values kernel's TMA loads (the default where TMA can describe the operands) read,
    for a sequence's last chunk, the next sequence's rows where the pointer loads (the
    fallback) read zeros: every gradient still equals the pointer loads' (packed sequences,
    one empty, one shorter than a tile, initial and final states)."""
    T, H, N = sum(lens), 2, len(lens)
    inp = make_inputs(1, T, H, dk, dv, "rand", seed=T + 1)
    gen = torch.Generator().manual_seed(T + 1)
    do = torch.randn(1, T, H, dv, generator=gen).to(DEVICE)
    h0, dht = (torch.randn(N, H, dk, dv, generator=gen).to(DEVICE) for _ in range(2))
    cu_seqlens = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEVICE) if N > 1 else None
    args = dict(scale=dk**-0.5, do=do, initial_state=h0, cu_seqlens=cu_seqlens, dht=dht)
    assert triton_bwd._row_descriptors([(triton_bwd._token_rows(inp["v"]), [64, min(dv, 64)])]) is not None
    tma = chunk_kda_bwd_triton(**inp, **args)
    monkeypatch.setattr(triton_bwd, "_row_descriptors", lambda views: None)  # the pointer loads
    pointers = chunk_kda_bwd_triton(**inp, **args)
    for name, got, want in zip(GRAD_NAMES, tma, pointers):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))


@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@needs_kernels
def test_bwd_register_caps_keep_results(monkeypatch):
    """The register caps of stage 2, of the backward intra kernel and of the forward's A-tile
    kernel (run by the backward's recompute) are launch options (the interpreter ignores
    them), so results are equal; their parsing and their bounds. One head: a cap changes no
    index."""
    assert triton_bwd.bwd_register_caps() == ({"maxnreg": 128}, {"maxnreg": 128})  # the default
    assert triton_bwd.bwd_intra_register_cap() == {"maxnreg": 96}
    assert triton_fwd.intra_register_cap() == {"maxnreg": 96}
    inp = make_inputs(1, 70, 1, 32, 32, "rand", seed=8)
    do = torch.randn(1, 70, 1, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    default = chunk_kda_bwd_triton(**inp, scale=0.25, do=do)
    monkeypatch.setenv(triton_bwd.BWD_MAXNREG_ENV, "0x0")
    monkeypatch.setenv(triton_bwd.BWD_INTRA_MAXNREG_ENV, "0")
    monkeypatch.setenv(triton_fwd.INTRA_MAXNREG_ENV, "0")
    assert triton_bwd.bwd_register_caps() == ({}, {}) and triton_bwd.bwd_intra_register_cap() == {}
    assert triton_fwd.intra_register_cap() == {}
    for name, got, want in zip(GRAD_NAMES, chunk_kda_bwd_triton(**inp, scale=0.25, do=do), default):
        if want is not None:
            assert torch.equal(got, want), name
    for bad, match in (("128x128x168", "KEYSxVALUES"), ("0x16", "32 to 255"), ("0x256", "32 to 255")):
        monkeypatch.setenv(triton_bwd.BWD_MAXNREG_ENV, bad)
        with pytest.raises(ValueError, match=match):
            triton_bwd.bwd_register_caps()
    for bad, match in (("128x128", "1 integers"), ("16", "32 to 255"), ("256", "32 to 255")):
        for env, cap in ((triton_bwd.BWD_INTRA_MAXNREG_ENV, triton_bwd.bwd_intra_register_cap),
                         (triton_fwd.INTRA_MAXNREG_ENV, triton_fwd.intra_register_cap)):
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValueError, match=match):
                cap()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_bwd_at_gate_min_packed(dtype):
    """The backward's intra kernel where dg cancels most (g = g_min on whole chunks: dg up to
    e^5 times smaller than its pairwise terms), over packed sequences (an empty one, tiles
    past a sequence's end) and an initial state, against float64 autograd. fp16 takes tf32
    dots compiled, where the kernel rounds each cancelling pair's operands alike
    (`triton_bwd`'s docstring); bounds per dtype as `test_walks_vs_float64`'s."""
    inp = make_inputs(1, 150, 2, 32, 32, "min", seed=14, dtype=dtype)
    cu_seqlens = torch.tensor([0, 5, 5, 70, 150], dtype=torch.int32).to(DEVICE)
    gen = torch.Generator().manual_seed(14)
    do = torch.randn(1, 150, 2, 32, generator=gen).to(DEVICE, dtype)
    h0 = torch.randn(4, 2, 32, 32, generator=gen).to(DEVICE)
    got = chunk_kda_bwd_triton(**inp, scale=0.25, do=do, initial_state=h0, cu_seqlens=cu_seqlens)
    ref = reference_grads(inp, 0.25, do, initial_state=h0, cu_seqlens=cu_seqlens)
    tol = fp16_tolerances() if dtype == torch.float16 else FP32_TOL_BY_NAME
    for name, x, x_ref in zip(GRAD_NAMES, got, ref):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, x_ref) < tol[name], (name, rel_err(x, x_ref))


@needs_kernels
def test_bf16_partials_stay_close_to_fp32(monkeypatch):
    """bf16 inputs hand dq / dk's state terms to the intra kernel in bf16 (`bwd_parts_dtype`),
    fp16 and fp32 inputs in fp32. The interpreter computes bf16 dots wrongly, so fp16 inputs
    take the bf16 partials here (the function patched): one more rounding (2^-9 of those
    terms) than fp32."""
    assert triton_bwd.bwd_parts_dtype(torch.bfloat16) == torch.bfloat16
    assert triton_bwd.bwd_parts_dtype(torch.float16) == torch.float32
    assert triton_bwd.bwd_parts_dtype(torch.float32) == torch.float32
    inp = make_inputs(1, 150, 2, 32, 32, "rand", seed=13, dtype=torch.float16)
    do = torch.randn(1, 150, 2, 32, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.float16)
    want = chunk_kda_bwd_triton(**inp, scale=0.25, do=do)
    monkeypatch.setattr(triton_bwd, "bwd_parts_dtype", lambda dtype: torch.bfloat16)
    got = chunk_kda_bwd_triton(**inp, scale=0.25, do=do)
    for name, x, x_want in zip(GRAD_NAMES, got, want):
        if x_want is None:
            continue
        err = rel_err(x.float(), x_want.float())
        assert err <= 4e-3, (name, err)
        if name in ("dq", "dk"):
            assert err > 0, name  # the partials did go through bf16


_KEY_SPLIT_DEFAULT: list = []


@needs_kernels
@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@pytest.mark.parametrize("bk", ["32", "16"])
def test_bwd_intra_key_split_keeps_results(monkeypatch, bk):
    """`TITAN_MOE_KDA_BWD_INTRA_BK` splits each tile's key columns over adjacent programs
    (BK = 32: two at dk = 64, CI's case; BK = 16, four, is the same split kernel with another
    constant): dq, dk, dg are the same sums column by column, dbeta sums its key shares in
    another order: equal up to fp32 rounding (the interpreter gives dq, dk, dg bit-equal);
    packed sequences cover a tile cut short. The knob's parsing and clipping."""
    inp = make_inputs(1, 150, 2, 64, 32, "rand", seed=9)
    inp["cu_seqlens"] = torch.tensor([0, 5, 70, 150], dtype=torch.int32).to(DEVICE)
    do = torch.randn(1, 150, 2, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    assert triton_bwd.bwd_intra_bk(64) == 64 and triton_bwd.bwd_intra_bk(128) == 64  # the default
    assert triton_bwd.bwd_intra_bk(32) == 32  # clipped to dk
    if not _KEY_SPLIT_DEFAULT:  # one program per tile at dk = 64; cached (the interpreter is slow)
        _KEY_SPLIT_DEFAULT.append(chunk_kda_bwd_triton(**inp, scale=0.25, do=do))
    monkeypatch.setenv(triton_bwd.BWD_INTRA_BK_ENV, bk)
    assert triton_bwd.bwd_intra_bk(64) == int(bk) and triton_bwd.bwd_intra_bk(16) == 16  # clipped to dk
    for name, got, want in zip(GRAD_NAMES, chunk_kda_bwd_triton(**inp, scale=0.25, do=do), _KEY_SPLIT_DEFAULT[0]):
        if want is None:
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"BK={bk} {name}")
    monkeypatch.setenv(triton_bwd.BWD_INTRA_BK_ENV, "128")
    assert triton_bwd.bwd_intra_bk(64) == 64  # clipped to dk
    monkeypatch.setenv(triton_bwd.BWD_INTRA_BK_ENV, "48")
    with pytest.raises(ValueError, match="16, 32, 64 or 128"):
        triton_bwd.bwd_intra_bk(64)


@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@needs_kernels
def test_output_config_override_keeps_results(monkeypatch):
    """The output kernel's launch knob: 16 value columns per program (four programs per chunk
    and head) give the default's output (up to the order of fp32 sums inside the dots)."""
    inp = make_inputs(1, 100, 2, 16, 64, "rand", seed=7)
    default, _ = chunk_kda_fwd_triton(**inp, scale=0.25)
    monkeypatch.setenv(triton_fwd.OUTPUT_ENV, "16x2")
    assert triton_fwd.output_config(64) == (16, 2)
    assert rel_err(chunk_kda_fwd_triton(**inp, scale=0.25)[0], default) < 1e-6
    for bad in ("64", "48x4", "64x3"):
        monkeypatch.setenv(triton_fwd.OUTPUT_ENV, bad)
        with pytest.raises(ValueError, match=triton_fwd.OUTPUT_ENV):
            triton_fwd.output_config(128)


@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@needs_kernels
@pytest.mark.parametrize("gate", ["rand", "min"])
def test_intra_config_override_keeps_results(monkeypatch, gate):
    """The A-tile kernel's launch knob (key columns per step, warps) changes the grid, not the
    maths: A_qk, the inverse (I + A_kk)^-1, q_decay, the output and the final state equal the
    default's up to the order of fp32 sums, over packed sequences with a tile cut short and one
    shorter than a tile, g at its bound over whole chunks (finite) and an initial state; the
    knob's parsing."""
    lens = [5, 70, 83]
    T, H, N = sum(lens), 2, len(lens)
    inp = make_inputs(1, T, H, 32, 16, gate, seed=11)
    cu_seqlens = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEVICE)
    h0 = torch.randn(N, H, 32, 16, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    runs = {}
    for spec in (None, "16x2"):
        if spec is None:
            monkeypatch.delenv(triton_fwd.INTRA_ENV, raising=False)
            assert triton_fwd.intra_config(128) == (32, 4)  # the default
        else:
            monkeypatch.setenv(triton_fwd.INTRA_ENV, spec)
            assert triton_fwd.intra_config(128) == (16, 2)
        st = kda_fwd_states(**inp, scale=0.25, initial_state=h0, cu_seqlens=cu_seqlens, output_final_state=True)
        o = triton_fwd.kda_fwd_output(inp["q"], inp["v"], st)
        runs[spec] = dict(Aqk=st.Aqk, Ainv=st.Ainv, q_decay=st.q_decay, o=o, ht=st.final_state)
    # the kernels write only tiles (I, J <= I) and valid rows: compare those
    rows = torch.arange(T, device=DEVICE) - torch.repeat_interleave(cu_seqlens[:-1], torch.tensor(lens).to(DEVICE))
    lower_tiles = (torch.arange(64, device=DEVICE)[None, :] // 16 <= (rows % 64)[:, None] // 16)[:, None, :]
    for name, want in runs[None].items():
        got = runs["16x2"][name]
        if name in ("Aqk", "Ainv"):
            got, want = torch.where(lower_tiles, got, 0.0), torch.where(lower_tiles, want, 0.0)
        assert torch.isfinite(got).all(), name
        assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))
    monkeypatch.setenv(triton_fwd.INTRA_ENV, "128x4")
    assert triton_fwd.intra_config(32) == (32, 4)  # clipped to dk
    for bad in ("columns32x4", "48x4", "64x3", "32"):
        monkeypatch.setenv(triton_fwd.INTRA_ENV, bad)
        with pytest.raises(ValueError, match=triton_fwd.INTRA_ENV):
            triton_fwd.intra_config(128)


@pytest.mark.slow  # a launch-tuning override: the numerics tests above cover the defaults
@needs_kernels
def test_tile_warps_override_keeps_results(monkeypatch):
    """The per-tile kernels' warps knob changes launches only: results stay the default's,
    forward and backward (one head: warps change no index); malformed values are refused
    with the variable's name."""
    inp = make_inputs(1, 100, 1, 16, 64, "rand", seed=8)
    do = torch.randn(1, 100, 1, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    default_o, _ = chunk_kda_fwd_triton(**inp, scale=0.25)
    default_grads = chunk_kda_bwd_triton(**inp, scale=0.25, do=do)
    monkeypatch.setenv(triton_fwd.TILE_WARPS_ENV, "2x8x1")
    assert triton_fwd.tile_warps() == (2, 8, 1)
    assert rel_err(chunk_kda_fwd_triton(**inp, scale=0.25)[0], default_o) < 1e-6
    for name, got, want in zip(GRAD_NAMES, chunk_kda_bwd_triton(**inp, scale=0.25, do=do), default_grads):
        if want is not None:
            assert rel_err(got, want) < 1e-6, (name, rel_err(got, want))
    for bad in ("4x1x4x4", "1x4x3", "axbxc"):
        monkeypatch.setenv(triton_fwd.TILE_WARPS_ENV, bad)
        with pytest.raises(ValueError, match=triton_fwd.TILE_WARPS_ENV):
            triton_fwd.tile_warps()


def test_chunk_layout_is_built_once_per_bounds():
    """The chunk layout tables are built once per (bounds, device) and shared: no host-to-device
    copy (a host sync) per call once a shape has been seen."""
    first = triton_fwd._chunk_layout([0, 100, 164], torch.device(DEVICE))
    again = triton_fwd._chunk_layout([0, 100, 164], torch.device(DEVICE))
    assert all(a is b for a, b in zip(first, again))
    cu, indices, offsets = (t.cpu().tolist() for t in first)
    assert cu == [0, 100, 164] and indices == [[0, 0], [0, 1], [1, 0]] and offsets == [0, 2, 3]
    assert triton_fwd._chunk_layout([0, 100], torch.device(DEVICE))[0] is not first[0]


def test_scan_config_default_rule(monkeypatch):
    """Default walk launch: 4 warps, the widest column block that still gives every SM a
    program, else 16 columns (a walk is latency bound: idle SMs cost more than narrow programs)."""
    monkeypatch.delenv(triton_fwd.SCAN_BV_ENV, raising=False)
    monkeypatch.delenv(triton_fwd.SCAN_WARPS_ENV, raising=False)
    assert triton_fwd.sequential_scan_config(128, 128, walks=16, n_sms=132) == (16, 4)  # B*H = 16
    assert triton_fwd.sequential_scan_config(128, 128, walks=128, n_sms=132) == (64, 4)  # B*H = 128
    assert triton_fwd.sequential_scan_config(128, 128, walks=132, n_sms=132) == (128, 4)
    assert triton_fwd.sequential_scan_config(16, 32, walks=1000, n_sms=132) == (32, 4)  # clipped to dv


def test_scan_config_rejects_bad_values(monkeypatch):
    monkeypatch.setenv(triton_fwd.SCAN_BV_ENV, "64")
    with pytest.raises(ValueError, match="at most dv = 32"):
        triton_fwd.sequential_scan_config(16, 32)
    monkeypatch.setenv(triton_fwd.SCAN_BV_ENV, "16")
    monkeypatch.setenv(triton_fwd.SCAN_WARPS_ENV, "3")
    with pytest.raises(ValueError, match="power of two"):
        triton_fwd.sequential_scan_config(16, 32)
    monkeypatch.setenv(triton_fwd.SCAN_WARPS_ENV, "8")  # crashes the backward walk on an H200
    with pytest.raises(ValueError, match="16 x 8"):
        triton_fwd.sequential_scan_config(128, 128)


def test_scan_stages_rule(monkeypatch):
    """Walk pipeline stages: 3 at 16 columns, 2 wider, fp32 tiles at dk > 64 at 2 forward and
    1 backward (what fits sm_90's shared memory); the knob overrides and is checked."""
    monkeypatch.delenv(triton_fwd.SCAN_STAGES_ENV, raising=False)
    assert triton_fwd.scan_stages(16, wide_tiles=False) == (3, 3)
    assert triton_fwd.scan_stages(64, wide_tiles=False) == (2, 2)
    assert triton_fwd.scan_stages(16, wide_tiles=True) == (2, 1)
    assert triton_fwd.walk_tiles_wide(128, torch.bfloat16) is False
    assert triton_fwd.walk_tiles_wide(128, torch.float32) is True
    assert triton_fwd.walk_tiles_wide(64, torch.float32) is False
    monkeypatch.setenv(triton_fwd.SCAN_STAGES_ENV, "4x1")
    assert triton_fwd.scan_stages(16, wide_tiles=False) == (4, 1)
    monkeypatch.setenv(triton_fwd.SCAN_STAGES_ENV, "5x1")
    with pytest.raises(ValueError, match="1 to 4"):
        triton_fwd.scan_stages(16, wide_tiles=False)
    monkeypatch.setenv(triton_fwd.SCAN_STAGES_ENV, "3")
    with pytest.raises(ValueError, match="FWDxBWD"):
        triton_fwd.scan_stages(16, wide_tiles=False)


# ----------------------------------------------------------------------------------------
# the state walks on packed sequences
# ----------------------------------------------------------------------------------------
WALK_LENS = [5, 0, 100]  # shorter than a tile, empty, a chunk and 36 tokens
_WALK_RUNS: dict[torch.dtype, tuple] = {}


def walk_inputs(dtype: torch.dtype):
    """(inputs, do, h0, dht, cu_seqlens, scale) of `walk_run`: H = 2, dk = 32, dv = 64 over
    the packed `WALK_LENS`, slow decay."""
    T, H, N, dk, dv = sum(WALK_LENS), 2, len(WALK_LENS), 32, 64
    inp = make_inputs(1, T, H, dk, dv, "slow", seed=17, dtype=dtype)
    gen = torch.Generator().manual_seed(17)
    do = torch.randn(1, T, H, dv, generator=gen).to(DEVICE, dtype)
    h0 = torch.randn(N, H, dk, dv, generator=gen).to(DEVICE)
    dht = torch.randn(N, H, dk, dv, generator=gen).to(DEVICE)
    cu_seqlens = torch.tensor([0] + WALK_LENS).cumsum(0).to(torch.int32).to(DEVICE)
    return inp, do, h0, dht, cu_seqlens, dk**-0.5


def walk_run(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward (o, final state) and all six gradients on packed sequences with initial states
    and a final-state gradient, and the float64 references; cached per dtype (the
    interpreter is slow)."""
    if dtype not in _WALK_RUNS:
        inp, do, h0, dht, cu_seqlens, scale = walk_inputs(dtype)
        o, ht = chunk_kda_fwd_triton(**inp, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                                     output_final_state=True)
        grads = chunk_kda_bwd_triton(**inp, scale=scale, do=do, initial_state=h0, cu_seqlens=cu_seqlens, dht=dht)
        o_ref, ht_ref = reference(inp, scale, initial_state=h0, cu_seqlens=cu_seqlens)
        grads_ref = reference_grads(inp, scale, do, initial_state=h0, dht=dht, cu_seqlens=cu_seqlens)
        _WALK_RUNS[dtype] = [o, ht, *grads], [o_ref, ht_ref, *grads_ref]
    return _WALK_RUNS[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_walks_vs_float64(dtype):
    """Forward outputs, final states and all gradients against the float64 recurrence, with
    initial states, packed sequences (empty, shorter than a chunk, not a multiple of 64) and
    slow decay (states carried across chunks); bounds per dtype (module docstring: fp16 is
    the bf16 bound scaled by the unit roundoffs)."""
    got, ref = walk_run(dtype)
    tol = fp16_tolerances() if dtype == torch.float16 else FP32_TOL_BY_NAME
    errors = {}
    for name, x, x_ref in zip(("o", "ht", *GRAD_NAMES), got, ref, strict=True):
        assert x.dtype == (torch.float32 if name in ("ht", "dg", "dbeta", "dh0") else dtype), name
        assert torch.isfinite(x).all(), name
        errors[name] = rel_err(x, x_ref)
    assert all(errors[name] < tol[name] for name in errors), errors
    assert torch.equal(got[1][1], ref[1][1].float())  # the empty sequence passes its state through


@needs_kernels
def test_walk_storage():
    """What the forward keeps: W, K~, V~ and h in the input dtype (fp32 for fp32 inputs),
    e^{G_last} in fp32, and U dropped after the walk."""
    for dtype in (torch.float16, torch.float32):
        inp = make_inputs(1, 70, 1, 16, 32, "rand", seed=2, dtype=dtype)
        st = kda_fwd_states(**inp, scale=0.25)
        assert not hasattr(st, "U")
        for name in ("W", "k_to_end", "v_new", "h"):
            assert getattr(st, name).dtype == dtype, name
        assert st.decay.dtype == torch.float32 and st.decay.shape == (2, 1, 16)
        G_last = st.G[[63, 69], 0]  # the last valid token of each chunk
        assert torch.allclose(st.decay[:, 0], torch.exp(G_last), rtol=1e-6, atol=0)


def test_dot_precision():
    """fp32 (and wider) inputs take ieee dots, 16-bit inputs tf32."""
    assert triton_fwd.dot_precision(torch.float32) == "ieee"
    assert triton_fwd.dot_precision(torch.float64) == "ieee"
    assert triton_fwd.dot_precision(torch.bfloat16) == "tf32"
    assert triton_fwd.dot_precision(torch.float16) == "tf32"


# ----------------------------------------------------------------------------------------
# the kept forward (the `kda_keep` choice: the backward reads the forward's intermediates)
# ----------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_kept_forward_backward_equals_recomputing(dtype):
    """`kept_forward` + `chunk_kda_bwd_triton(kept=...)` run the same kernels on the same
    values as the recomputing pair, so every output and gradient is bit-identical; the
    residuals have `residual_specs`' shapes (h and decay padded to `max_chunk_rows`: here 4
    rows for 3 chunks, the packed sequences of `walk_run`)."""
    got_recompute, _ = walk_run(dtype)
    inp, do, h0, dht, cu_seqlens, scale = walk_inputs(dtype)
    o, ht, residuals = triton_fwd.kept_forward(**inp, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                                               output_final_state=True)
    specs = residual_specs(inp["q"], inp["v"], len(WALK_LENS), True)
    assert len(residuals) == len(RESIDUAL_NAMES) == 8
    assert [(tuple(r.shape), r.dtype) for r in residuals] == specs
    assert residuals[RESIDUAL_NAMES.index("h")].shape[0] == 4
    # the kept op returns these: none may alias an input or another return (missing
    # residuals must be distinct empty tensors, which the op checks)
    torch._library.utils._c_check_aliasing_constraint(
        "kept_forward", (*inp.values(), h0, cu_seqlens), {}, (o, ht, *residuals))
    grads = chunk_kda_bwd_triton(**inp, scale=scale, do=do, initial_state=h0, cu_seqlens=cu_seqlens, dht=dht,
                                 kept=residuals)
    for name, x, y in zip(("o", "ht", *GRAD_NAMES), [o, ht, *grads], got_recompute, strict=True):
        assert torch.equal(x, y), (name, rel_err(x, y))


@needs_kernels
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_g_cumsum_input_skips_the_cumsums(kept):
    """`g_cumsum`: the launchers take G (the chunk-local cumsum, as `kda_prepare` emits it)
    and return dG: the same output and state, and dG reverse-summed per chunk is the default's
    dg; kept, the G residual is empty (the input is G)."""
    from titan_moe.ops.kda.chunk_torch import chunk_local_cumsum

    inp, do, h0, dht, cu_seqlens, scale = walk_inputs(torch.float32)
    G = chunk_local_cumsum(inp["g"], cu_seqlens)
    args = dict(scale=scale, initial_state=h0, cu_seqlens=cu_seqlens)
    want_o, want_ht, *want = walk_run(torch.float32)[0]  # the default launchers on these inputs
    inp_G = dict(inp, g=G)
    residuals = None
    if kept:
        o, ht, residuals = triton_fwd.kept_forward(**inp_G, **args, output_final_state=True, g_cumsum=True)
        assert residuals[0].shape == (0,) and residuals[1].numel()
    else:
        o, ht = chunk_kda_fwd_triton(**inp_G, **args, output_final_state=True, g_cumsum=True)
    assert rel_err(o, want_o) < 1e-6 and rel_err(ht, want_ht) < 1e-6
    got = list(chunk_kda_bwd_triton(**inp_G, **args, do=do, dht=dht, kept=residuals, g_cumsum=True))
    got[3] = chunk_local_cumsum(got[3], cu_seqlens, reverse=True)
    for name, x, y in zip(GRAD_NAMES, got, want, strict=True):
        assert rel_err(x, y) < (1e-5 if name == "dg" else 1e-6), (name, rel_err(x, y))


def test_kept_residuals_are_checked():
    """A residual list of the wrong length, shape or dtype is refused before any kernel runs."""
    inp = make_inputs(1, 70, 2, 16, 32, "rand", seed=3)
    specs = residual_specs(inp["q"], inp["v"], 1, False)
    residuals = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    assert residuals[RESIDUAL_NAMES.index("h")].shape == (2, 2, 16, 32)
    do = torch.zeros_like(inp["v"])
    with pytest.raises(ValueError, match="expected 8 residuals"):
        chunk_kda_bwd_triton(**inp, scale=1.0, do=do, kept=residuals[:-1])
    residuals[0] = torch.empty(70, 2, 15)
    with pytest.raises(ValueError, match="residual G"):
        chunk_kda_bwd_triton(**inp, scale=1.0, do=do, kept=residuals)


class _StageLimitedKernel:
    """Stands in for a `@triton.jit` kernel that only compiles with <= `fits` pipeline stages."""

    __name__ = "stage_limited"

    def __init__(self, fits: int):
        self.fits, self.stages_tried = fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.stages_tried.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(300_000, 232_448, "shared memory")

        return launch


def test_launch_falls_back_to_fewer_stages():
    """The backward walk's stages are an estimate: if they do not fit, fewer are used."""
    import logging

    from titan_moe.ops import triton_runtime

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    triton_runtime.logger.addHandler(handler)
    try:
        kernel = _StageLimitedKernel(fits=1)
        triton_runtime.launch_with_fewer_stages_if_needed(kernel, (1,), "arg", num_stages=3, BV=32)
    finally:
        triton_runtime.logger.removeHandler(handler)
    assert kernel.stages_tried == [3, 2, 1]
    assert any("stage_limited: 3 pipeline stages do not fit" in m for m in messages), messages
    launch_with_fewer_stages_if_needed = triton_runtime.launch_with_fewer_stages_if_needed
    hopeless = _StageLimitedKernel(fits=0)
    with pytest.raises(Exception, match="shared memory"):
        launch_with_fewer_stages_if_needed(hopeless, (1,), num_stages=2)
    assert hopeless.stages_tried == [2, 1]


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__)


# ----------------------------------------------------------------------------------------
# bf16 on the GPU: long sequences against a float64 recurrence (and fla, if it runs)
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1024, 4096, 8192])
def test_bf16_long_sequence_vs_float64(T):
    B, H, dk, dv = 1, 4, 128, 128
    gen = torch.Generator().manual_seed(T)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, dk, generator=gen) - 2.0)  # in (-5, 0), mostly slow
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, dk, dv, generator=gen) * 0.1
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    g, beta, h0 = g.cuda(), beta.to("cuda", torch.bfloat16), h0.cuda()
    scale = dk**-0.5

    o, ht = chunk_kda_fwd_triton(q, k, v, g, beta, scale, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=scale,
        initial_state=h0.double(), output_final_state=True,
    )
    err_o, err_ht = rel_err(o, o_ref), rel_err(ht, ht_ref)
    assert err_o < BF16_TOL and err_ht < BF16_TOL, (err_o, err_ht)
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return
    o_fla, ht_fla = fla_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
        safe_gate=True, lower_bound=-5.0,
    )
    print(f"T={T}: o error {err_o:.2e} (fla {rel_err(o_fla, o_ref):.2e}), "
          f"final state {err_ht:.2e} (fla {rel_err(ht_fla, ht_ref):.2e})")
    assert err_o <= FLA_RATIO * rel_err(o_fla, o_ref), (err_o, rel_err(o_fla, o_ref))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("T", [1024])
def test_bf16_backward_vs_float64(T):
    """bf16 gradients against float64 autograd through the recurrence (bf16 partials,
    `triton_bwd.bwd_parts_dtype`); bounds are fla's own bf16 test ratios (dq/dk/dv/dh0 8e-3,
    dg/dbeta 2e-2). Our errors are
    printed (``-s``), and fla's on the same inputs beside them when fla's Triton kernels run
    and `TITAN_MOE_TEST_FLA_BWD=1` (fla's backward autotunes its kernels over minutes on a
    fresh machine; the bounds do not need it)."""
    B, H, dk, dv = 1, 4, 128, 128
    gen = torch.Generator().manual_seed(T + 1)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to("cuda", torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to("cuda", torch.bfloat16)
    v = torch.randn(B, T, H, dv, generator=gen).to("cuda", torch.bfloat16)
    g = (-5.0 * torch.sigmoid(torch.randn(B, T, H, dk, generator=gen) - 2.0)).cuda()
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to("cuda", torch.bfloat16)
    h0 = (torch.randn(B, H, dk, dv, generator=gen) * 0.1).cuda()
    do = torch.randn(B, T, H, dv, generator=gen).to("cuda", torch.bfloat16)
    dht = (torch.randn(B, H, dk, dv, generator=gen) * 0.1).cuda()
    scale = dk**-0.5
    got = chunk_kda_bwd_triton(q, k, v, g, beta, scale, do, initial_state=h0, dht=dht)

    leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = naive_recurrent_kda(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True)
    ref = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), leaves)
    errs = {name: rel_err(x, x_ref) for name, x, x_ref in zip(GRAD_NAMES, got, ref)}
    fla_chunk_kda = None
    if os.environ.get("TITAN_MOE_TEST_FLA_BWD") == "1":
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
        except ImportError:
            pass
    if fla_chunk_kda is not None:
        fla_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o_f, ht_f = fla_chunk_kda(*fla_leaves[:5], scale=scale, initial_state=fla_leaves[5],
                                  output_final_state=True, safe_gate=True, lower_bound=-5.0)
        fla_grads = torch.autograd.grad((o_f.float() * do.float()).sum() + (ht_f * dht).sum(), fla_leaves)
        fla_errs = {name: rel_err(x, x_ref) for name, x, x_ref in zip(GRAD_NAMES, fla_grads, ref)}
        print(f"T={T}: " + ", ".join(f"{n} {errs[n]:.2e} (fla {fla_errs[n]:.2e})" for n in GRAD_NAMES))
    else:
        print(f"T={T}: " + ", ".join(f"{n} {errs[n]:.2e}" for n in GRAD_NAMES))
    for name, err in errs.items():
        assert err < (2e-2 if name in ("dg", "dbeta") else 8e-3), (name, err)
