"""The CUDA registration adapters of the KDA ops, run under the Triton interpreter.

The adapters translate between the custom ops' contract and the Triton launchers'; here
they are called directly on CPU tensors with TRITON_INTERPRET=1 (in a subprocess, since
the variable must be set before Triton is first imported) and compared with the ops'
PyTorch implementations.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHECK = textwrap.dedent(
    """
    import torch
    from titan_moe.ops.kda import op
    from titan_moe.ops.kda.triton_op import kda_chunk_bwd_triton, kda_chunk_fwd_triton
    torch.manual_seed(0)
    B, T, H, D = 1, 40, 2, 16
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    v, beta = torch.randn(B, T, H, D), torch.rand(B, T, H)
    g = -5 * torch.rand(B, T, H, D)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    do = torch.randn(B, T, H, D)

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    for h0, cu_seqlens, want_state in [(None, None, False), (torch.randn(2, H, D, D), cu, True)]:
        o_t, s_t = kda_chunk_fwd_triton(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, want_state)
        o_r, s_r = op.kda_chunk_fwd_torch(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, want_state)
        assert s_t.shape == s_r.shape and s_t.dtype == s_r.dtype, (s_t.shape, s_r.shape)
        assert rel(o_t, o_r) < 1e-4, rel(o_t, o_r)
        if want_state:
            assert rel(s_t, s_r) < 1e-4
        dht = torch.randn_like(s_r) if want_state else None
        grads_t = kda_chunk_bwd_triton(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, do, dht)
        grads_r = op.kda_chunk_bwd_torch(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, do, dht)
        for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads_t, grads_r):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if b.numel():
                # fp32 both ways; dg sums many cancelling terms (see test_kda_triton.py)
                assert rel(a, b) < (2e-3 if name == "dg" else 1e-4), (name, rel(a, b))

        # the kept pair (the `kda_keep` choice): the same outputs and, reading the residuals, the
        # same gradients bit for bit
        from titan_moe.ops.kda.kept import kda_chunk_bwd_kept_triton, kda_chunk_fwd_kept_triton

        o_k, s_k, *residuals = kda_chunk_fwd_kept_triton(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, want_state)
        assert torch.equal(o_k, o_t) and torch.equal(s_k, s_t) and len(residuals) == 8
        grads_k = kda_chunk_bwd_kept_triton(q, k, v, g, beta, D**-0.5, h0, cu_seqlens, do, dht, *residuals)
        for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], grads_k, grads_t):
            assert torch.equal(a, b), name

    # float64 is outside the kernels: the adapter hands it to the PyTorch implementation.
    o64, _ = kda_chunk_fwd_triton(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                  D**-0.5, None, None, False)
    assert o64.dtype == torch.float64
    out64 = kda_chunk_fwd_kept_triton(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                      D**-0.5, None, None, False)
    assert out64[0].dtype == torch.float64 and all(r.numel() == 0 for r in out64[2:])
    print("adapters ok")
    """
)


def test_triton_adapters_match_torch_ops_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "adapters ok" in proc.stdout


def test_registered_kernels_follow_the_choice():
    """The CUDA registrations run the kernels only where the `[kernels] kda` choice picks them
    (per call): "auto" and "triton" on CUDA, never off it; "torch" keeps PyTorch on CUDA."""
    import torch

    from titan_moe.ops import choices
    from titan_moe.ops.kda.triton_op import kernels_selected, when_selected

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kernels_selected(cuda) and not kernels_selected(cpu)  # the default, auto
    pick = when_selected(lambda x: "kernel", lambda x: "fallback")
    assert pick(torch.empty(1, device="meta")) == "fallback"
    with choices.using(kda="torch"):
        assert not kernels_selected(cuda)
    with choices.using(kda="triton"):
        assert kernels_selected(cuda) and kernels_selected(cpu)
        assert pick(torch.empty(1)) == "kernel"
