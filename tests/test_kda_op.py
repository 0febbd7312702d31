"""KDA operator (SPEC §1): references, chunked op, custom-op registration, validation.

Oracles: fla-core's plain-PyTorch `naive_recurrent_kda` and `naive_kda_lowerbound_gate`
(independent code), and our own token-by-token `naive_recurrent_kda` in float64 once it is
shown to agree with fla's.

Tolerances (relative error ||out - ref|| / ||ref||):
- float64 vs float64 (same maths, different evaluation order): 1e-11. fp64 unit roundoff
  is 1e-16; chunk sums of 64 terms, a 64x64 triangular solve and a few chunk hops grow it
  by at most ~1e3.
- fp32 op vs float64 reference, outputs, state and dq/dk/dv/dbeta/dh0: 2e-5. fp32 unit
  roundoff 6e-8 with the same ~1e2 growth gives ~1e-6; 2e-5 leaves margin, while any
  wrong mask, decay, boundary or chunk hop gives errors of order 1e-2 or more.
- fp32 dg: 2e-3. dg is the reverse cumulative sum of dG inside a chunk; each pair (i, j)
  adds +X at i and -X at j, which cancel exactly in dg_t for t <= j. Rounding leaves
  ~C * eps * max|X| = 64 * 6e-8 * max|X|, and with g = g_min everywhere the true dg is
  up to e^{|g_min|} ~ 150x smaller than max|X|: ~6e-4 relative. (fla's test ratio is 2e-2.)
- bf16 q/k/v, output rounded to bf16: fla's own test ratios (o 5e-3, dq/dk/dv/dh0 8e-3,
  dg/dbeta 2e-2); a bf16 rounding alone is up to 2^-9 ~ 2e-3.
- fp32 reference vs fla's fp32 reference: 1e-5 (two fp32 recurrences, ~1e-7 each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import rel_err

from titan_moe.ops.kda import chunk_kda, chunk_kda_torch, kda_decode_step, kda_gate, naive_recurrent_kda

fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="fla-core provides the independent oracle")
fla_gate = pytest.importorskip("fla.ops.kda.gate", reason="fla-core provides the independent oracle")

FP64_TOL = 1e-11
FP32_TOL = 2e-5
FP32_DG_TOL = 2e-3
FLA_RATIOS = dict(o=5e-3, ht=5e-3, dq=8e-3, dk=8e-3, dv=8e-3, dh0=8e-3, dg=2e-2, dbeta=2e-2)
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def make_inputs(
    B: int, T: int, H: int, dk: int, dv: int, n_seq: int, gate: str, seed: int
) -> dict[str, torch.Tensor]:
    """float64 operator inputs: unit q/k per head, g in [-5, 0), beta in (0, 1).

    gate: "rand" (uniform in [-5, 0)), "min" (g = -5 everywhere: whole chunks at the bound),
    "slow" (uniform in [-0.05, 0): long memory, so chunk hops matter).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if gate == "rand":
        g = -5.0 * torch.rand(B, T, H, dk, generator=gen, dtype=torch.float64)
    elif gate == "min":
        g = torch.full((B, T, H, dk), -5.0, dtype=torch.float64)
    else:
        g = -0.05 * torch.rand(B, T, H, dk, generator=gen, dtype=torch.float64)
    return dict(
        q=F.normalize(randn(B, T, H, dk), dim=-1),
        k=F.normalize(randn(B, T, H, dk), dim=-1),
        v=randn(B, T, H, dv),
        g=g,
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        h0=randn(n_seq, H, dk, dv),
        do=randn(B, T, H, dv),
        dht=randn(n_seq, H, dk, dv),
    )


def forward_backward(fn, x: dict, qkv_dtype: torch.dtype, cu_seqlens=None) -> dict[str, torch.Tensor]:
    """Output, final state and the gradients of <o, do> + <ht, dht> w.r.t. all six inputs."""
    other_dtype = torch.float64 if qkv_dtype == torch.float64 else torch.float32
    leaves = [x[n].to(qkv_dtype).requires_grad_() for n in ("q", "k", "v")]
    leaves += [x[n].to(other_dtype).requires_grad_() for n in ("g", "beta", "h0")]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens)
    grads = torch.autograd.grad((o, ht), leaves, (x["do"].to(o.dtype), x["dht"].to(ht.dtype)))
    return dict(zip(NAMES, (o, ht, *grads)))


def reference(x: dict, qkv_dtype: torch.dtype, cu_seqlens=None) -> dict[str, torch.Tensor]:
    """float64 naive recurrence on the inputs as rounded to the op's dtypes."""
    other_dtype = torch.float64 if qkv_dtype == torch.float64 else torch.float32
    rounded = {n: x[n].to(qkv_dtype).double() for n in ("q", "k", "v", "do")}
    rounded |= {n: x[n].to(other_dtype).double() for n in ("g", "beta", "h0", "dht")}
    return forward_backward(naive_recurrent_kda, rounded, torch.float64, cu_seqlens)


# ----------------------------------------------------------------------------------------
# the naive reference against fla's
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 37, 100])
def test_naive_matches_fla(dtype, T):
    x = make_inputs(2, T, 3, 16, 24, n_seq=2, gate="rand", seed=T)
    args = [x[n].to(dtype) for n in ("q", "k", "v", "g", "beta")]
    o, ht = naive_recurrent_kda(*args, initial_state=x["h0"].to(dtype), output_final_state=True)
    # fla computes in fp32 whatever the input dtype
    o_ref, ht_ref = fla_naive.naive_recurrent_kda(*args, initial_state=x["h0"].to(dtype), output_final_state=True)
    assert o.dtype == dtype and ht.dtype == dtype
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(ht, ht_ref) < 1e-5
    # no initial state, no final state
    o2, ht2 = naive_recurrent_kda(*args)
    o2_ref, _ = fla_naive.naive_recurrent_kda(*args)
    assert ht2 is None and rel_err(o2, o2_ref) < 1e-5


def test_naive_varlen_matches_fla_per_sequence():
    bounds = [0, 5, 40, 41, 90]
    x = make_inputs(1, 90, 2, 16, 16, n_seq=4, gate="rand", seed=1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = naive_recurrent_kda(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        o_n, ht_n = fla_naive.naive_recurrent_kda(
            *(a[:, s:e] for a in args), initial_state=x["h0"][n : n + 1], output_final_state=True
        )
        assert rel_err(o[:, s:e], o_n) < 1e-5
        assert rel_err(ht[n : n + 1], ht_n) < 1e-5


# ----------------------------------------------------------------------------------------
# chunked op against the recurrence
# ----------------------------------------------------------------------------------------
CASES = {
    # name: (B, T, cu_seqlens bounds or None, gate)
    "T1": (2, 1, None, "rand"),
    "T63": (2, 63, None, "rand"),
    "T100": (1, 100, None, "rand"),
    "T130_slow": (2, 130, None, "slow"),
    "T130_gmin": (1, 130, None, "min"),
    "varlen": (1, 150, [0, 9, 80, 81, 150], "rand"),
    "varlen_slow": (1, 200, [0, 70, 77, 200], "slow"),
    "varlen_gmin": (1, 150, [0, 9, 80, 81, 150], "min"),
}


def _case(name: str, seed: int):
    B, T, bounds, gate = CASES[name]
    n_seq = B if bounds is None else len(bounds) - 1
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    return make_inputs(B, T, 2, 16, 32, n_seq=n_seq, gate=gate, seed=seed), cu


@pytest.mark.parametrize("name", ["T1", "T63", "T130_slow", "varlen", "varlen_gmin"])
def test_chunk_float64_matches_naive(name):
    """Algebraic check of the chunked form (chunk 64 and 16-token tiles) in float64."""
    x, cu = _case(name, seed=11)
    out = forward_backward(chunk_kda, x, torch.float64, cu)
    ref = reference(x, torch.float64, cu)
    for n in NAMES:
        assert out[n].dtype == torch.float64
        assert rel_err(out[n], ref[n]) < FP64_TOL, n


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_torch_other_chunk_sizes(chunk_size):
    x, cu = _case("varlen", seed=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = chunk_kda_torch(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size)
    o_ref, ht_ref = naive_recurrent_kda(*args, initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_ref) < FP64_TOL and rel_err(ht, ht_ref) < FP64_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_kda_fp32_forward_and_grads(name):
    x, cu = _case(name, seed=5)
    out = forward_backward(chunk_kda, x, torch.float32, cu)
    ref = reference(x, torch.float32, cu)
    for n in NAMES:
        assert torch.isfinite(out[n]).all(), n
        assert out[n].dtype == torch.float32
        tol = FP32_DG_TOL if n == "dg" else FP32_TOL
        assert rel_err(out[n], ref[n]) < tol, (n, rel_err(out[n], ref[n]))


@pytest.mark.parametrize("name", ["T130_slow", "varlen_gmin"])
def test_chunk_kda_bf16_within_fla_ratios(name):
    x, cu = _case(name, seed=7)
    out = forward_backward(chunk_kda, x, torch.bfloat16, cu)
    ref = reference(x, torch.bfloat16, cu)
    assert out["o"].dtype == torch.bfloat16 and out["ht"].dtype == torch.float32
    for n in NAMES:
        assert torch.isfinite(out[n]).all(), n
        assert rel_err(out[n], ref[n]) < FLA_RATIOS[n], (n, rel_err(out[n], ref[n]))


def test_chunk_kda_without_state_arguments():
    x, _ = _case("T100", seed=2)
    args = [x[n].float() for n in ("q", "k", "v", "g", "beta")]
    o, ht = chunk_kda(*args)
    o_ref, _ = fla_naive.naive_recurrent_kda(*args)
    assert ht is None
    assert rel_err(o, o_ref) < FP32_TOL


def test_gate_in_kernel_and_l2norm_match_fla_gate():
    """Raw gate input through chunk_kda vs fla's lower-bound gate + fla's recurrence."""
    B, T, H, dk, dv, lb = 1, 100, 2, 16, 16, -4.0
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(2, B, T, H, dk, generator=gen)  # not normalised: the op does it
    v = torch.randn(B, T, H, dv, generator=gen)
    z = 3.0 * torch.randn(B, T, H, dk, generator=gen)  # wide enough to saturate sigmoid
    beta = torch.rand(B, T, H, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * dk, generator=gen)

    g_ref = fla_gate.naive_kda_lowerbound_gate(z, A_log, dt_bias, lower_bound=lb)
    assert rel_err(kda_gate(z, A_log, dt_bias, lb), g_ref) < 1e-6
    assert g_ref.min() >= lb and g_ref.max() <= 0

    leaves = [t.clone().requires_grad_() for t in (q, k, v, z, beta, A_log, dt_bias)]
    o, _ = chunk_kda(
        *leaves[:5], use_qk_l2norm=True, gate_in_kernel=True, A_log=leaves[5], dt_bias=leaves[6], lower_bound=lb
    )
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v, z, beta, A_log, dt_bias)]
    q_r, k_r, v_r, z_r, b_r, a_r, dt_r = leaves_ref
    g_r = fla_gate.naive_kda_lowerbound_gate(z_r, a_r, dt_r, lower_bound=lb)
    o_ref, _ = fla_naive.naive_recurrent_kda(
        F.normalize(q_r, dim=-1, eps=1e-6), F.normalize(k_r, dim=-1, eps=1e-6), v_r, g_r, b_r
    )
    assert rel_err(o, o_ref) < FP32_TOL
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    grads_ref = torch.autograd.grad(o_ref, leaves_ref, do)
    for name, a, b in zip(("q", "k", "v", "z", "beta", "A_log", "dt_bias"), grads, grads_ref):
        tol = FP32_DG_TOL if name in ("z", "A_log", "dt_bias") else FP32_TOL  # these pass through dg
        assert rel_err(a, b) < tol, name


def test_decode_steps_match_naive():
    x = make_inputs(2, 20, 2, 16, 8, n_seq=2, gate="rand", seed=4)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_ref, ht_ref = naive_recurrent_kda(*args, initial_state=x["h0"], output_final_state=True)
    state = x["h0"].clone()
    outs = []
    for t in range(20):
        o_t, state_next = kda_decode_step(*(a[:, t] for a in args), state)
        outs.append(o_t)
        state = state_next
    assert rel_err(torch.stack(outs, 1), o_ref) < FP64_TOL
    assert rel_err(state, ht_ref) < FP64_TOL


# ----------------------------------------------------------------------------------------
# custom-op registration
# ----------------------------------------------------------------------------------------
def _op_inputs(with_state: bool, varlen: bool, requires_grad: bool):
    x = make_inputs(1, 70, 2, 16, 8, n_seq=2 if varlen else 1, gate="rand", seed=8)
    t = [x[n].float().requires_grad_(requires_grad) for n in ("q", "k", "v", "g", "beta")]
    h0 = x["h0"].float().requires_grad_(requires_grad) if with_state else None
    cu = torch.tensor([0, 20, 70], dtype=torch.int32) if varlen else None
    return t, h0, cu, x


@pytest.mark.parametrize(
    "with_state,varlen,final,g_cumsum",
    [(True, True, True, False), (False, False, False, False), (True, False, False, False), (True, True, True, True)],
)
def test_opcheck_forward(with_state, varlen, final, g_cumsum):
    t, h0, cu, _ = _op_inputs(with_state, varlen, requires_grad=True)
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_fwd, (*t, 0.25, h0, cu, final, g_cumsum))


@pytest.mark.parametrize("with_state,varlen,g_cumsum", [(True, True, False), (False, False, False), (True, True, True)])
def test_opcheck_backward(with_state, varlen, g_cumsum):
    t, h0, cu, x = _op_inputs(with_state, varlen, requires_grad=False)
    dht = x["dht"].float() if with_state else None
    torch.library.opcheck(torch.ops.titan_moe.kda_chunk_bwd, (*t, 0.25, h0, cu, x["do"].float(), dht, g_cumsum))


def test_g_cumsum_takes_the_chunk_local_cumsum():
    """`g_cumsum=True` with G = chunk-local cumsum of g gives the same output and state as g
    (padding slots of a sequence's last chunk hold its last token's G, not 0), and dG
    reverse-summed per chunk is dg."""
    from titan_moe.ops.kda.chunk_torch import chunk_local_cumsum

    t, h0, cu, x = _op_inputs(True, True, requires_grad=True)
    G = chunk_local_cumsum(t[3].detach(), cu).requires_grad_()
    o, ht = torch.ops.titan_moe.kda_chunk_fwd(*t, 0.25, h0, cu, True)
    o_G, ht_G = torch.ops.titan_moe.kda_chunk_fwd(*t[:3], G, t[4], 0.25, h0, cu, True, True)
    assert rel_err(o_G, o) < 1e-6 and rel_err(ht_G, ht) < 1e-6
    w = torch.randn_like(o)
    (dg,) = torch.autograd.grad((o * w).sum() + ht.sum(), t[3])
    (dG,) = torch.autograd.grad((o_G * w).sum() + ht_G.sum(), G)
    assert rel_err(chunk_local_cumsum(dG, cu, reverse=True), dg) < 1e-5


def test_compiled_op_has_no_graph_break():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    t, h0, cu, x = _op_inputs(True, True, requires_grad=True)

    def f(q, k, v, g, beta, h0, cu):
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return o.square().sum() + ht.square().sum()

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(*t, h0, cu)
    loss.backward()
    loss_ref = f(*[a.detach() for a in t], h0.detach(), cu)
    assert not counters["graph_break"]
    assert torch.allclose(loss, loss_ref)
    assert all(a.grad is not None for a in (*t, h0))


# ----------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------
def _valid(B=1, T=10, H=2, dk=8, dv=8):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, H, dk, generator=gen),
        k=torch.randn(B, T, H, dk, generator=gen),
        v=torch.randn(B, T, H, dv, generator=gen),
        g=-torch.rand(B, T, H, dk, generator=gen),
        beta=torch.rand(B, T, H, generator=gen),
    )


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(lower_bound=-6.0), "lower_bound"),
        (dict(lower_bound=0.0), "lower_bound"),
        (dict(q=torch.randn(10, 2, 8)), "q must be"),
        (dict(k=torch.randn(1, 10, 2, 4)), "k must"),
        (dict(v=torch.randn(1, 9, 2, 8)), "v must"),
        (dict(g=torch.randn(1, 10, 2, 4)), "g must"),
        (dict(beta=torch.rand(1, 10, 3)), "beta must"),
        (dict(v=torch.randn(1, 10, 2, 8, dtype=torch.float64)), "share one dtype"),
        (dict(g=torch.zeros(1, 10, 2, 8, dtype=torch.int32)), "float"),
        (dict(initial_state=torch.zeros(2, 2, 8, 8)), "initial_state"),
        (dict(initial_state=torch.zeros(1, 2, 8, 8, dtype=torch.bfloat16)), "initial_state"),
        (dict(cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.float32)), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32)), "cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "cu_seqlens"),
        (dict(gate_in_kernel=True, A_log=torch.zeros(2)), "A_log"),
        (dict(A_log=torch.zeros(2), dt_bias=torch.zeros(16)), "gate_in_kernel"),
        (dict(gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(16)), "A_log"),
    ],
)
@pytest.mark.parametrize("fn", [chunk_kda, naive_recurrent_kda])
def test_invalid_inputs_raise(fn, change, match):
    kw = _valid() | change
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_varlen_needs_batch_one():
    kw = _valid(B=2)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_kda(*kw.values(), cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32))


def test_debug_env_checks_gate_range(monkeypatch):
    kw = _valid()
    kw["g"] = kw["g"] - 5.5  # below the bound
    monkeypatch.delenv("TITAN_MOE_DEBUG", raising=False)
    chunk_kda(*kw.values())  # caller's guarantee, unchecked by default
    monkeypatch.setenv("TITAN_MOE_DEBUG", "1")
    with pytest.raises(ValueError, match="g must lie in"):
        chunk_kda(*kw.values())
    kw["g"] = -kw["g"]  # positive
    with pytest.raises(ValueError, match="g must lie in"):
        chunk_kda(*kw.values(), lower_bound=-5.0)
    ok = _valid()
    chunk_kda(*ok.values())


def test_decode_step_validation():
    q = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="state"):
        kda_decode_step(q, q, torch.randn(2, 3, 4), -torch.rand(2, 3, 8), torch.rand(2, 3), torch.zeros(2, 3, 8, 5))
    with pytest.raises(ValueError, match="beta"):
        kda_decode_step(q, q, torch.randn(2, 3, 4), -torch.rand(2, 3, 8), torch.rand(2, 4), torch.zeros(2, 3, 8, 4))


def test_seqlens_bounds_reads_each_tensor_once(monkeypatch):
    """cu_seqlens is read on the host once per tensor (a CUDA read waits for the GPU), again
    after an in-place change; a bad tensor is refused every time."""
    from titan_moe.ops.kda.chunk_torch import seqlens_bounds

    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert seqlens_bounds(cu, 10) == [0, 3, 10] and seqlens_bounds(cu, 10) == [0, 3, 10]
    assert len(reads) == 1
    seqlens_bounds(cu, 10).append(99)  # callers get their own list
    assert seqlens_bounds(cu, 10) == [0, 3, 10]
    cu[1] = 4
    assert seqlens_bounds(cu, 10) == [0, 4, 10] and len(reads) == 2
    with pytest.raises(ValueError, match="non-decreasing"):
        seqlens_bounds(cu, 12)
    assert seqlens_bounds(torch.tensor([0, 3, 10]), 10) == [0, 3, 10] and len(reads) == 3
