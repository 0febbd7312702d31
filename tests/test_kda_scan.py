"""The segment scan (`titan_moe.ops.kda.triton_scan`: SPEC §8's context-parallel algebra,
per-segment state transitions combined) against the sequential scan and the token-by-token
recurrence.

Two layers:
- the algebra, in float64 plain PyTorch (no Triton): chunk maps against the token
  product of SPEC §8, and `segment_scan_torch` (transitions, combine, re-walk) on chunk
  factors built here from SPEC §1's dense chunked form, against `naive_recurrent_kda`;
- the kernels (Triton interpreter on CPU, compiled on a GPU), fp32: the segment scan's
  per-chunk states h, V~ and final states (the forward with `scan="segments"`) against the
  sequential `_state_scan_kernel`'s on the same inputs, and its outputs against the float64
  recurrence.

TRITON_INTERPRET=1 must be set before the kernel modules are imported; see
tests/test_kda_triton.py for the subprocess fallback used here too.

Tolerances (relative error ||out - ref|| / ||ref||):
- float64 algebra: 1e-10. Float64 rounding is ~1e-16 per operation; the shapes here take
  at most ~300 tokens, 5 chunks and 64-term sums, and exponents reach e^320 only inside
  masked-out entries of the dense reference (finite in float64).
- fp32 segment vs sequential scan: 2e-5. Both are fp32 with the same chunk factors; they
  differ in association: a later segment's initial state comes from A_s S + B_s (two
  extra products of dk-term sums per segment) instead of the walk, and the walk splits
  W S into K halves. Each route carries ~(64 + 2 dk) * 6e-8 ~ 1e-5 relative error at worst
  over these few chunks; a wrong transition, boundary or segment start gives errors of
  1e-2 or more. (Seen: ~1e-7.)
- fp32 outputs and final states vs the float64 recurrence: 1e-4, as in test_kda_triton.
- fp16 (W, U, h, V~ in fp16): outputs and final states vs the float64 recurrence 7.5e-4
  (test_kda_triton's fp16 bound), segment vs sequential 2e-3 (see `test_segment_scan_fp16`).
"""

from __future__ import annotations

import pytest
from triton_mode import interpret_without_gpu, kernel_test_setup, rerun_under_interpreter  # noqa: E402
import torch
import torch.nn.functional as F
from numerics import rel_err

CUDA = interpret_without_gpu()

from titan_moe.ops.kda import naive_recurrent_kda  # noqa: E402
from titan_moe.ops.kda import triton_fwd, triton_scan  # noqa: E402
from titan_moe.ops.kda.triton_fwd import CHUNK, kda_fwd_output, kda_fwd_states  # noqa: E402
from titan_moe.ops.kda.triton_scan import (  # noqa: E402
    chunk_map_torch,
    default_segment_chunks,
    modeled_scan_time,
    segment_scan_torch,
)

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, triton_fwd._interpreted(), "test_in_fresh_interpreter_process")

F64_TOL = 1e-10
SCAN_TOL = 2e-5
FP32_TOL = 1e-4
VARLEN = [5, 0, 260, 64, 70, 1]  # empty, shorter than a chunk, 5 chunks, exactly one, 2




def make_inputs(TT: int, H: int, dk: int, dv: int, gate: str, seed: int, n_seqs: int, device=DEVICE):
    """Flat-token inputs `[1, TT, H, ·]` fp32 (q/k unit, beta in (0, 1)) and an initial state.

    gate: "slow" (g in [-0.05, 0): states persist across many chunks, so segment starts
    matter), "rand" (g in [-5, 0)) or "min" (g = -5 everywhere, whole chunks at the bound).
    """
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, TT, H, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, TT, H, dk, generator=gen), dim=-1)
    v = torch.randn(1, TT, H, dv, generator=gen)
    u = torch.rand(1, TT, H, dk, generator=gen)
    g = {"slow": -0.05 * u, "rand": -5.0 * u, "min": torch.full_like(u, -5.0)}[gate]
    beta = torch.rand(1, TT, H, generator=gen)
    h0 = torch.randn(n_seqs, H, dk, dv, generator=gen)
    inp = dict(q=q, k=k, v=v, g=g, beta=beta)
    return {n: x.to(device) for n, x in inp.items()}, h0.to(device)


def bounds_of(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def reference(inp, scale, h0, bounds):
    """float64 token-by-token recurrence (o `[1, TT, H, dv]`, final state `[N, H, dk, dv]`)."""
    x64 = {n: t.double().cpu() for n, t in inp.items()}
    cu = torch.tensor(bounds, dtype=torch.int32)
    return naive_recurrent_kda(**x64, scale=scale, initial_state=h0.double().cpu(), output_final_state=True,
                               cu_seqlens=cu)


# ----------------------------------------------------------------------------------------
# the algebra in float64, no Triton
# ----------------------------------------------------------------------------------------
def chunk_factors_f64(inp, bounds, scale):
    """G, W, U `[TT, H, ·]` and A_qk `[TT, H, C]` from SPEC §1's chunked form, evaluated
    densely per chunk in float64 (e^{G_i - G_j} taken directly, masked after)."""
    q, k, v, g = (inp[n][0].double().cpu() for n in ("q", "k", "v", "g"))
    beta = inp["beta"][0].double().cpu()
    TT, H, dk = q.shape
    G, W, U = torch.zeros_like(g), torch.zeros_like(k), torch.zeros_like(v)
    Aqk = torch.zeros(TT, H, CHUNK, dtype=torch.float64)
    for s_seq, e_seq in zip(bounds[:-1], bounds[1:]):
        for s in range(s_seq, e_seq, CHUNK):
            e = min(s + CHUNK, e_seq)
            c = e - s
            Gc = g[s:e].cumsum(0)  # [c, H, dk]
            decay = torch.exp(Gc[:, None] - Gc[None, :])  # [i, j, H, dk]
            kk = torch.einsum("ihd,jhd,ijhd->hij", k[s:e], k[s:e], decay)
            qk = torch.einsum("ihd,jhd,ijhd->hij", q[s:e], k[s:e], decay)
            b = beta[s:e].T  # [H, c]
            A_kk = (b[:, :, None] * kk).tril(-1)
            X = torch.linalg.inv(torch.eye(c, dtype=torch.float64) + A_kk)  # [H, c, c]
            G[s:e] = Gc
            W[s:e] = (X @ (b[..., None] * (torch.exp(Gc) * k[s:e]).transpose(0, 1))).transpose(0, 1)
            U[s:e] = (X @ (b[..., None] * v[s:e].transpose(0, 1))).transpose(0, 1)
            Aqk[s:e, :, :c] = (scale * qk.tril()).transpose(0, 1)
    return G, W, U, Aqk


def outputs_f64(inp, bounds, scale, G, Aqk, h, v_new):
    """O = scale (Q ⊙ e^G) S + A_qk V~ per chunk, float64 `[TT, H, dv]`."""
    q = inp["q"][0].double().cpu()
    o = torch.zeros_like(v_new)
    i_c = 0
    for s_seq, e_seq in zip(bounds[:-1], bounds[1:]):
        for s in range(s_seq, e_seq, CHUNK):
            e = min(s + CHUNK, e_seq)
            qg = (scale * q[s:e] * torch.exp(G[s:e])).transpose(0, 1)  # [H, c, dk]
            A = Aqk[s:e, :, : e - s].transpose(0, 1)  # [H, c, c]
            o[s:e] = (qg @ h[i_c] + A @ v_new[s:e].transpose(0, 1)).transpose(0, 1)
            i_c += 1
    return o


def test_chunk_and_segment_maps_are_the_token_products():
    """A_c = Diag(e^{G_last}) - K~^T W is SPEC §8's Π_t (I - beta_t k_t k_t^T) Diag(e^{g_t})
    over the chunk's tokens and B_c its state from zero; a segment's (A_s, B_s) composed
    from chunk maps equals the token product over the whole segment (incl. a short chunk)."""
    T, H, dk, dv = 150, 2, 16, 32
    inp, _ = make_inputs(T, H, dk, dv, "rand", seed=1, n_seqs=1, device="cpu")
    bounds = [0, T]
    G, W, U, _ = chunk_factors_f64(inp, bounds, 1.0)
    k, v, g = (inp[n][0].double() for n in ("k", "v", "g"))
    beta = inp["beta"][0].double()

    def token_map(s, e):
        M = torch.eye(dk, dtype=torch.float64).repeat(H, 1, 1)
        S = torch.zeros(H, dk, dv, dtype=torch.float64)
        for t in range(s, e):
            P = torch.eye(dk, dtype=torch.float64) - beta[t, :, None, None] * k[t, :, :, None] * k[t, :, None, :]
            M = P @ (torch.exp(g[t])[..., None] * M)
            S = P @ (torch.exp(g[t])[..., None] * S) + beta[t, :, None, None] * k[t, :, :, None] * v[t, :, None, :]
        return M, S

    A_s, B_s = torch.eye(dk, dtype=torch.float64).repeat(H, 1, 1), torch.zeros(H, dk, dv, dtype=torch.float64)
    for s in range(0, T, CHUNK):
        e = min(s + CHUNK, T)
        A_c, B_c, _ = chunk_map_torch(k, W, U, G, s, e)
        M, S = token_map(s, e)
        assert rel_err(A_c, M) < F64_TOL and rel_err(B_c, S) < F64_TOL
        A_s, B_s = A_c @ A_s, A_c @ B_s + B_c
    M, S = token_map(0, T)
    assert rel_err(A_s, M) < F64_TOL and rel_err(B_s, S) < F64_TOL


@pytest.mark.parametrize("gate", ["slow", "min"])
def test_segment_decomposition_float64(gate):
    """`segment_scan_torch` for several segment lengths (1 chunk, 2, 3, whole sequences)
    gives the recurrence's outputs and final states, and the same per-chunk states."""
    H, dk, dv, scale = 2, 16, 32, 0.25
    bounds = bounds_of(VARLEN)
    inp, h0 = make_inputs(bounds[-1], H, dk, dv, gate, seed=2, n_seqs=len(VARLEN), device="cpu")
    o_ref, ht_ref = reference(inp, scale, h0, bounds)
    G, W, U, Aqk = chunk_factors_f64(inp, bounds, scale)
    k = inp["k"][0].double()
    h_one, _, _ = segment_scan_torch(k, W, U, G, bounds, 100, h0.double())  # one segment per sequence
    for L in (1, 2, 3):
        h, v_new, ht = segment_scan_torch(k, W, U, G, bounds, L, h0.double())
        o = outputs_f64(inp, bounds, scale, G, Aqk, h, v_new)
        assert rel_err(o, o_ref[0]) < F64_TOL, L
        assert rel_err(ht, ht_ref) < F64_TOL, L
        assert rel_err(h, h_one) < F64_TOL, L
        assert torch.equal(ht[1], h0[1].double())  # the empty sequence passes its state through


# ----------------------------------------------------------------------------------------
# the kernels: segment vs sequential scan on the same inputs
# ----------------------------------------------------------------------------------------
class Case:
    """Inputs, the sequential forward's intermediates and the float64 reference, computed once."""

    def __init__(self, lens, H, dk, dv, gate, seed, varlen):
        self.bounds = bounds_of(lens)
        TT = self.bounds[-1]
        self.inp, self.h0 = make_inputs(TT, H, dk, dv, gate, seed, n_seqs=len(lens))
        self.scale = dk**-0.5
        if varlen:
            cu = torch.tensor(self.bounds, dtype=torch.int32, device=DEVICE)
            args = self.inp
            self.B = 1
        else:  # fixed-length batch: B rows of one length
            cu, self.B = None, len(lens)
            args = {n: x.view(self.B, lens[0], *x.shape[2:]) for n, x in self.inp.items()}
        self.args, self.cu = args, cu
        self.st = kda_fwd_states(**args, scale=self.scale, initial_state=self.h0, cu_seqlens=cu,
                                 output_final_state=True, scan="sequential")
        self.o_seq = kda_fwd_output(args["q"], args["v"], self.st)
        self.o_ref, self.ht_ref = reference(self.inp, self.scale, self.h0, self.bounds)

    def segments(self, L):
        """The forward with the segment scan (`scan="segments"`, L chunks per segment; None:
        the wave model's choice), its h, V~ and final states NaN-filled before the scan runs,
        so anything left unwritten shows; (state, L used)."""
        return forward_by_segments(self.args, self.scale, self.h0, self.cu, L)


def forward_by_segments(args, scale, h0, cu_seqlens, L):
    """`kda_fwd_states(scan="segments")` with the scan's outputs NaN-filled first; (state, L used)."""
    real, used = triton_scan.segment_scan, []

    def nan_filled(k, W, U, G, h, v_new, h0, ht, *rest):
        for x in (h, v_new) if ht is None else (h, v_new, ht):
            x.fill_(float("nan"))
        used.append(real(k, W, U, G, h, v_new, h0, ht, *rest))
        return used[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_scan, "segment_scan", nan_filled)
        st = kda_fwd_states(**args, scale=scale, initial_state=h0, cu_seqlens=cu_seqlens,
                            output_final_state=h0 is not None, scan="segments", segment_chunks=L)
    assert len(used) == 1
    return st, used[0]


_CASES: dict[str, Case] = {}


def get_case(name: str) -> Case:
    if name not in _CASES:
        if name == "varlen_slow":
            _CASES[name] = Case(VARLEN, H=2, dk=16, dv=32, gate="slow", seed=3, varlen=True)
        elif name == "batch_min":  # B = 2 rows of 150 tokens: 3 chunks each, g = -5 throughout
            _CASES[name] = Case([150, 150], H=2, dk=32, dv=32, gate="min", seed=4, varlen=False)
        elif name == "wide_k":  # dk = 128: the walks keep the state as two row halves of 64
            _CASES[name] = Case([20, 150], H=2, dk=128, dv=16, gate="slow", seed=6, varlen=True)
    return _CASES[name]


@needs_kernels
@pytest.mark.parametrize("case, L", [("varlen_slow", 1), ("varlen_slow", 2), ("batch_min", 1), ("wide_k", 1),
                                     pytest.param("varlen_slow", 3, marks=pytest.mark.slow),
                                     pytest.param("varlen_slow", None, marks=pytest.mark.slow)])
def test_segment_scan_matches_sequential(case, L):
    """h, V~ and final states of the segment scan equal the sequential scan's (fp32
    rounding), outputs from them match the float64 recurrence; every entry is written.
    L = 1: every chunk its own segment (middle segments of one chunk); L = 2 on the 5-chunk
    sequence: a middle segment of two chunks and a short last one (CI); L = 3 and L = None
    (the wave model's choice; CI: `test_scan_argument`) are slow tests."""
    c = get_case(case)
    st_seg, L_used = c.segments(L)
    h, v_new, ht = st_seg.h, st_seg.v_new, st_seg.final_state
    assert L is None or L_used == L
    for name, x in (("h", h), ("v_new", v_new), ("ht", ht)):
        assert torch.isfinite(x).all(), name
    assert rel_err(h, c.st.h) < SCAN_TOL
    assert rel_err(v_new, c.st.v_new) < SCAN_TOL
    assert rel_err(ht, c.st.final_state) < SCAN_TOL
    assert rel_err(ht, c.ht_ref) < FP32_TOL
    o = kda_fwd_output(c.args["q"], c.args["v"], st_seg)
    assert rel_err(o, c.o_seq) < SCAN_TOL
    assert rel_err(o.reshape(c.o_ref.shape), c.o_ref) < FP32_TOL
    if case == "varlen_slow":
        assert torch.equal(ht[1], c.h0[1])  # the empty sequence passes its state through


@needs_kernels
def test_scan_argument(monkeypatch):
    """`scan=` picks the path (default sequential: the op's), with and without initial /
    final states (3 chunks in 3 segments); other values raise. Without `segment_chunks` the
    wave model picks L (spied on, to pick 2: segments of 2 and 1 chunks)."""
    inp, h0 = make_inputs(130, 2, 16, 16, "slow", seed=5, n_seqs=1)
    seq = kda_fwd_states(**inp, scale=0.25, initial_state=h0, output_final_state=True)
    seg, L = forward_by_segments(inp, 0.25, h0, None, 1)
    assert L == 1
    assert rel_err(seg.h, seq.h) < SCAN_TOL and rel_err(seg.final_state, seq.final_state) < SCAN_TOL
    asked = []
    monkeypatch.setattr(triton_scan, "default_segment_chunks", lambda *args: asked.append(args) or 2)
    seg, L = forward_by_segments(inp, 0.25, h0, None, None)
    assert L == 2 and asked == [([3], 2, 16, 16)]
    assert rel_err(seg.h, seq.h) < SCAN_TOL and rel_err(seg.final_state, seq.final_state) < SCAN_TOL
    seg0, _ = forward_by_segments(inp, 0.25, None, None, 1)
    seq0 = kda_fwd_states(**inp, scale=0.25, scan="sequential")
    assert seg0.final_state is None
    assert rel_err(seg0.h, seq0.h) < SCAN_TOL and rel_err(seg0.v_new, seq0.v_new) < SCAN_TOL
    with pytest.raises(ValueError, match="sequential"):
        kda_fwd_states(**inp, scale=0.25, scan="parallel")


@needs_kernels
def test_segment_scan_fp16():
    """fp16 inputs store W, U, h and V~ in fp16: the segment scan reads and writes them so
    (its walks upcast W and U; segment starts stay fp32, in AB), meets the fp16 bound against
    the float64 recurrence (7.5e-4 interpreted, 1.5e-3 compiled: tf32 tile dots, see
    test_kda_triton) and agrees with the sequential walk to fp16 rounding (2e-3: the
    sequential walk rounds S and V~ at its dots, the segment scan does not; seen ~3e-4).
    Segments of one chunk: a middle segment ([A | B] walk) in the 200-token sequence."""
    lens = [5, 0, 200, 70]
    bounds = bounds_of(lens)
    inp, h0 = make_inputs(bounds[-1], 2, 16, 32, "slow", seed=8, n_seqs=len(lens))
    inp = {n: x.half() if n in ("q", "k", "v") else x for n, x in inp.items()}
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    scale = 0.25
    o_ref, ht_ref = reference(inp, scale, h0, bounds)
    runs = {}
    for scan, L in (("sequential", None), ("segments", 1)):
        st = kda_fwd_states(**inp, scale=scale, initial_state=h0, cu_seqlens=cu, output_final_state=True,
                            scan=scan, segment_chunks=L)
        assert st.h.dtype == st.v_new.dtype == torch.float16
        o = kda_fwd_output(inp["q"], inp["v"], st)
        bound = 7.5e-4 if triton_fwd._interpreted() else 1.5e-3
        assert rel_err(o, o_ref) < bound, (scan, rel_err(o, o_ref))
        assert rel_err(st.final_state, ht_ref) < bound, (scan, rel_err(st.final_state, ht_ref))
        runs[scan] = st
    for name in ("h", "v_new", "final_state"):
        err = rel_err(getattr(runs["segments"], name), getattr(runs["sequential"], name))
        assert err < 2e-3, (name, err)


# ----------------------------------------------------------------------------------------
# the choice of the segment length
# ----------------------------------------------------------------------------------------
def test_segment_choice(monkeypatch):
    """The wave model splits only where it pays: many heads (programs fill the SMs) keep one
    segment per sequence; few heads on a long sequence split into >= 3 segments whose
    modeled time beats the sequential walk's; the environment variable overrides."""
    monkeypatch.delenv(triton_scan.SEGMENT_ENV, raising=False)
    n = 8192 // CHUNK
    assert default_segment_chunks([n], H=96, K=128, V=128, n_sms=132) == n
    assert default_segment_chunks([1, 2], H=2, K=16, V=16, n_sms=132) == 2
    L = default_segment_chunks([n], H=16, K=128, V=128, n_sms=132)
    assert -(-n // L) >= 3
    capacity = 132 * triton_scan._PROGRAMS_PER_SM[128]
    assert modeled_scan_time([n], L, 16, 128, 128, capacity) < modeled_scan_time([n], n, 16, 128, 128, capacity)
    monkeypatch.setenv(triton_scan.SEGMENT_ENV, "7")
    assert default_segment_chunks([n], H=16, K=128, V=128, n_sms=132) == 7
    monkeypatch.setenv(triton_scan.SEGMENT_ENV, "0")
    with pytest.raises(ValueError, match=triton_scan.SEGMENT_ENV):
        default_segment_chunks([n], H=16, K=128, V=128)


def test_segment_layout_is_built_once_per_arguments():
    """The segment scan's segment tables: ceil(chunks / L) segments per sequence (none for an
    empty one), built once per (bounds, L, device) and shared, so a repeated shape costs no
    host-to-device copy; bad L is refused."""
    cpu = torch.device("cpu")
    bounds = [0, 3 * CHUNK + 1, 3 * CHUNK + 1, 5 * CHUNK + 1]  # 4 chunks, empty, 2 chunks
    indices, offsets = triton_scan.segment_layout(bounds, 3, cpu)
    assert indices.tolist() == [[0, 0], [0, 1], [2, 0]] and offsets.tolist() == [0, 2, 2, 3]
    again = triton_scan.segment_layout(list(bounds), 3, cpu)
    assert again[0] is indices and again[1] is offsets
    assert triton_scan.segment_layout(bounds, 2, cpu)[0] is not indices
    with pytest.raises(ValueError, match="segment_chunks"):
        triton_scan.segment_layout(bounds, 0, cpu)


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__)


# ----------------------------------------------------------------------------------------
# bf16 on the GPU
# ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("L", [None, 8, 43])
def test_bf16_segment_scan_long_sequence(L):
    """T = 8192, H = 16, dk = dv = 128 in bf16 (the benchmark shape): the segment scan's
    outputs agree with the sequential scan's to tf32 rounding (3e-3: both paths share the
    bf16 inputs and differ only in the association of tf32 products, ~5e-4 relative each;
    a wrong segment start gives 1e-2 or more) and meet test_kda_triton's bf16 bound
    against a float64 recurrence (6e-3)."""
    from titan_moe.ops.kda.triton_fwd import chunk_kda_fwd_triton

    B, T, H, dk, dv = 1, 8192, 16, 128, 128
    gen = torch.Generator().manual_seed(T)
    q = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to("cuda", torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1).to("cuda", torch.bfloat16)
    v = torch.randn(B, T, H, dv, generator=gen).to("cuda", torch.bfloat16)
    g = (-5.0 * torch.sigmoid(torch.randn(B, T, H, dk, generator=gen) - 2.0)).cuda()
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).to("cuda", torch.bfloat16)
    h0 = (torch.randn(B, H, dk, dv, generator=gen) * 0.1).cuda()
    kw = dict(initial_state=h0, output_final_state=True)
    o_seq, ht_seq = chunk_kda_fwd_triton(q, k, v, g, beta, dk**-0.5, scan="sequential", **kw)
    o_par, ht_par = chunk_kda_fwd_triton(q, k, v, g, beta, dk**-0.5, scan="segments", segment_chunks=L, **kw)
    assert rel_err(o_par, o_seq) < 3e-3 and rel_err(ht_par, ht_seq) < 3e-3
    o_ref, _ = naive_recurrent_kda(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                   scale=dk**-0.5, initial_state=h0.double())
    assert rel_err(o_par, o_ref) < 6e-3
