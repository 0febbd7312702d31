"""Memory planner, eager transients (`titan_moe.plan.transient`): the live-bytes counter, the
KDA launchers' allocations, the GPU kernels' stand-ins, per-token profiles."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from titan_moe.ops.dispatch.op import _combine_op as unpermute_combine_op
from titan_moe.plan import (
    KDA_CHUNK,
    LayerPeaks,
    LiveBytes,
    PeakProfile,
    kda_bwd_allocations,
    kda_bwd_workspace_per_token,
    kda_fwd_allocations,
    measure_layer_peaks,
    peak_profiles,
)
from titan_moe.plan.eager import _EfficientAttentionSaves, _FusedRMSNormSaves
from titan_moe.plan.transient import TRANSIENT_TOKENS, _pareto, _peak

from test_plan import FP32_MASTER, _first_layer_of_each_kind, _tiny


# ----------------------------------------------------------------------------- the counter
def test_live_bytes_counts_fresh_storages_until_they_are_freed():
    """exp then a scaled sum of x [T, D] fp32 (one tensor: 4 T D bytes). Forward: z, the
    product (alive until the sum returns) and the scalar; a view counts nothing. Backward
    above its start: the root's scalar gradient, the product's gradient and exp's (the
    gradient of z and of x alive together); after it, x.grad; freed storages drop out."""
    T, D = 16, 8
    one = T * D * 4
    x = torch.zeros(T, D, requires_grad=True)
    with LiveBytes() as counter:
        counter.mark("forward")
        z = x.exp()
        view = z.view(-1)
        y = (z * 2).sum()
        assert (counter.current, counter.peak - counter.start) == (one + 4, 2 * one + 4)
        counter.mark("backward")
        y.backward()
        assert counter.peak - counter.start == 2 * one + 4
        assert counter.current - counter.start == one  # x.grad
        del z, view, y
        x.grad = None
        assert counter.current == 0
    assert counter.sizes == [one, one, 4, 4, one, one]


@torch.library.custom_op("titan_moe::plan_test_scaled_exp", mutates_args=())
def _scaled_exp(x: torch.Tensor) -> torch.Tensor:
    return (x.float().exp() * 2).to(x.dtype)


@_scaled_exp.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_ops_count_their_python_implementation_unless_listed():
    """A `titan_moe::` op not known to allocate only its outputs on CUDA is run through its
    Python implementation, temporaries included: x.float() and exp alive together (4 + 4 B
    per element of a bf16 x), then the bf16 result. Listed ops count their outputs only."""
    T, D = 32, 16
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    with LiveBytes() as counter:
        y = torch.ops.titan_moe.plan_test_scaled_exp(x)
    assert counter.peak == 8 * T * D and counter.current == 2 * T * D and y.dtype == torch.bfloat16
    y, pos, w = torch.zeros(2 * T, D, dtype=torch.bfloat16), torch.arange(2 * T).view(T, 2), torch.ones(T, 2)
    with LiveBytes() as counter:
        unpermute_combine_op(y, pos, w, True)
    assert counter.sizes == [T * D * 4]  # the fp32 output; not the CPU path's fp32 [T, 2, D] gathers


def test_situ_glu_counts_what_its_cuda_path_allocates():
    """SiTU-GLU on CUDA runs its Triton kernels under the default `[kernels] situ = "auto"`:
    one pass per direction that allocates its output only, so the counter counts the ops by
    their outputs (a layer's backward then adds dz alone, where the PyTorch path's fp32 copies
    once made the planner count 262 KiB per token more at small_1gpu's MoE layers). With
    `situ = "torch"` CUDA runs the PyTorch path, which is counted op by op."""
    from titan_moe.ops import choices

    rows, hidden = 32, 24
    z = torch.zeros(rows, 2 * hidden, dtype=torch.bfloat16)
    grad = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    peaks = {}
    for situ in ("auto", "torch"):
        with choices.using(situ=situ), LiveBytes() as counter:
            torch.ops.titan_moe.situ_glu_bwd(z, grad, 4.0, 25.0)
            torch.ops.titan_moe.situ_glu(z, 4.0, 25.0)
        peaks[situ] = counter.peak
        if situ == "auto":
            assert counter.sizes == [rows * 2 * hidden * 2, rows * hidden * 2]  # dz, then the output
    assert peaks["torch"] > 4 * peaks["auto"]


# ----------------------------------------------------------------------------- KDA launchers
class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` runs nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_kernels(monkeypatch) -> None:
    """Every `@triton.jit` kernel of the KDA launchers' modules (compiled or interpreted:
    both are launched as `kernel[grid](...)`) replaced by `_NoLaunch`."""
    pytest.importorskip("triton")
    from titan_moe.ops.kda import triton_bwd, triton_fwd, triton_scan

    for module in (triton_fwd, triton_bwd, triton_scan):
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(type(obj), "__getitem__"):
                monkeypatch.setattr(module, name, _NoLaunch())


def _kda_inputs(T: int, H: int, K: int):
    """Model-like operator inputs: bf16 q, k, do; v a slice of a q|k|v buffer (not
    contiguous, as the short convolution's output); fp32 g, beta; two documents whose chunk
    count is the bound `kda_*_allocations` assume (ceil(T / 64) + 1)."""
    qkv = torch.zeros(1, T, 3 * H * K, dtype=torch.bfloat16)
    q, k = (torch.zeros(1, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    v = qkv[..., 2 * H * K:].view(1, T, H, K)
    g, beta = torch.zeros(1, T, H, K), torch.zeros(1, T, H)
    do = torch.zeros(1, T, H, K, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 100, T], dtype=torch.int32)
    assert not v.is_contiguous() and -(-100 // KDA_CHUNK) + -(-(T - 100) // KDA_CHUNK) == T // KDA_CHUNK + 1
    return q, k, v, g, beta, do, cu_seqlens


_LAYOUT = ("cu_seqlens", "chunk_indices", "chunk_offsets")  # host lists turned into tensors: not dispatched


@pytest.mark.parametrize("K,g_cumsum", [(32, False), (128, True)], ids=["dk32", "dk128-g_cumsum"])
@pytest.mark.parametrize("direction", ["forward", "backward", "backward_kept"])
def test_kda_allocations_replay_the_triton_launchers(direction, K, g_cumsum, monkeypatch):
    """The launchers, run on CPU tensors with their kernels stubbed out, allocate exactly the
    tensors `kda_fwd_allocations` / `kda_bwd_allocations` list, in that order, and peak where
    they say (the chunk layout's int32 tensors come from host lists: not dispatched, not
    compared): bf16 walk tensors, the walk's precomputed factors, U and the backward walk's
    inputs freed early; and for the kept pair's backward (no recompute: its residuals are the
    forward's)."""
    _stub_kernels(monkeypatch)
    from titan_moe.ops.kda.triton_bwd import chunk_kda_bwd_triton
    from titan_moe.ops.kda.triton_fwd import chunk_kda_fwd_triton, kept_forward

    T, H = 256, 2  # dk = 128: the backward intra kernel's key split (dbeta shares summed after it)
    q, k, v, g, beta, do, cu_seqlens = _kda_inputs(T, H, K)
    # the kept pair's backward (the `kda_keep` choice) reads the forward's residuals
    kept = None
    if direction == "backward_kept":
        kept = kept_forward(q, k, v, g, beta, K**-0.5, cu_seqlens=cu_seqlens, g_cumsum=g_cumsum)[2]
    with LiveBytes() as counter:
        counter.mark("launch")
        if direction == "forward":
            outputs = chunk_kda_fwd_triton(q, k, v, g, beta, K**-0.5, cu_seqlens=cu_seqlens, g_cumsum=g_cumsum)
            events = kda_fwd_allocations(q, k, v, g, beta, K**-0.5, None, cu_seqlens, False, g_cumsum)
        else:
            outputs = chunk_kda_bwd_triton(q, k, v, g, beta, K**-0.5, do, cu_seqlens=cu_seqlens, kept=kept,
                                           g_cumsum=g_cumsum)
            events = kda_bwd_allocations(q, k, v, g, beta, K**-0.5, None, cu_seqlens, do, None, g_cumsum,
                                         kept=kept is not None)
        peak = counter.peak - counter.start
    events = [(name, n) for name, n in events if name not in _LAYOUT]
    assert counter.sizes == [n for _, n in events if n > 0]
    assert peak == _peak(events)
    kept = sum(t.untyped_storage().nbytes() for t in outputs if isinstance(t, torch.Tensor))
    assert kept == sum(n for _, n in events)  # what stays: the outputs


def test_kda_workspace_is_the_documented_formula():
    """Per token, the backward launcher's own tensors at its peak (plus the chunk layout's
    few int32s), bf16 inputs: `(4C + 3dk + dv + dk dv / C + 1 + s) * 4 * H`, small_1gpu
    32 KiB; s = dk / 64 where the backward intra kernel splits the key columns (dk > 64),
    else 0."""
    C = KDA_CHUNK
    for H, dk, dv in ((8, 128, 128), (4, 64, 32), (96, 128, 128)):
        split = dk // 64 if dk > 64 else 0
        formula = (4 * C + 3 * dk + dv + dk * dv / C + 1 + split) * 4 * H
        assert kda_bwd_workspace_per_token(H, dk, dv) == pytest.approx(formula, rel=1e-4, abs=0.1)
    assert round(kda_bwd_workspace_per_token(8, 128, 128) / 1024) == 32


# ----------------------------------------------------------------------------- GPU kernel stand-ins
def test_attention_stand_in_backward_allocates_what_the_cuda_kernel_does():
    """The memory-efficient backward at MLA's head dims (qk 192 > 128: 64 x 64 blocks, dK/dV
    accumulators): the output gradient made contiguous, dq, dk, dv in bf16, fp32 delta
    [B, H, T], the fp32 workspace; all but dq, dk, dv freed on return."""
    B, H, T, K, V = 1, 2, 256, 192, 128
    q, k = torch.zeros(B, H, T, K, dtype=torch.bfloat16), torch.zeros(B, H, T, K, dtype=torch.bfloat16)
    v = torch.zeros(B, H, T, V, dtype=torch.bfloat16)
    ctx = SimpleNamespace(saved_tensors=(q, k, v))
    grad_BHTV = torch.zeros(B, 1, T, V, dtype=torch.bfloat16).expand(B, H, T, V)  # not contiguous
    with LiveBytes() as counter:
        grads = _EfficientAttentionSaves.backward(ctx, grad_BHTV)
    dq_accumulator = -(-T // 64) * -(-K // 64) * (64 * 64 + 4)
    dkdv_accumulators = 200 // (B * H) * 64 * (K + V)  # split keys at their cap (long sequences)
    workspace = B * H * (dq_accumulator + dkdv_accumulators) * 4
    assert counter.sizes == [B * T * H * V * 2, B * T * H * K * 2, B * T * H * K * 2, B * T * H * V * 2,
                             B * H * T * 4, workspace]
    assert counter.current == 2 * (2 * B * T * H * K + B * T * H * V)
    assert [tuple(g.shape) for g in grads[:3]] == [(B, H, T, K), (B, H, T, K), (B, H, T, V)]


def test_rms_norm_stand_in_backward_allocates_the_input_and_weight_gradients():
    x, w = torch.zeros(3, 5, 16), torch.ones(16)
    ctx = SimpleNamespace(saved_tensors=(x, torch.zeros(3, 5, 1), w), needs_input_grad=(True, False, True))
    grad = torch.zeros_like(x)
    with LiveBytes() as counter:
        dx, _, dw, _, _ = _FusedRMSNormSaves.backward(ctx, grad)
    assert counter.sizes == [x.numel() * 4, w.numel() * 4]
    assert dx.shape == x.shape and dw.shape == w.shape


# ----------------------------------------------------------------------------- profiles
def _run(sizes: list[int], events: list[tuple[str, int | str]], spikes: list[int] = ()) -> LiveBytes:
    run = LiveBytes()
    run.sizes, run.events, run.spikes = list(sizes), list(events), list(spikes)
    return run


def test_peak_profiles_take_every_op_per_token_and_drop_constants():
    """Three runs at the measuring lengths: allocation 0 is a weight-sized constant (1000 B),
    1 a per-token tensor (10 T + 6), 2 a mask (2 T^2), the spike 7 T. After the mark: op a
    holds 0 and 1, op b 0, 1 and 2, the spike comes on top of 1 after 2 is freed."""
    tokens = TRANSIENT_TOKENS
    events = [("mark", "forward"), ("alloc", 0), ("alloc", 1), ("op", 0), ("alloc", 2), ("op", 0),
              ("free", 2), ("spike", 0), ("free", 1), ("free", 0), ("op", 0)]
    runs = [_run([1000, 10 * T + 6, 2 * T * T], events, [7 * T]) for T in tokens]
    profile = peak_profiles(runs, tokens)["forward"]
    assert profile.points == ((17.0, 0.0), (10.0, 2.0))  # (10, 0) and (0, 0) are dominated
    assert profile.at(1000, 1000**2) == 10 * 1000 + 2 * 1000**2
    assert profile.at(4, 4) == 17 * 4 and profile.per_token == 17.0
    with pytest.raises(RuntimeError, match="same tensors"):
        peak_profiles([runs[0], runs[1], _run([1000, 1], events[:-1], [1])], tokens)


def test_pareto_front_keeps_the_points_no_other_dominates():
    assert _pareto([(1.0, 0.0), (3.0, 0.0), (2.0, 1.0), (2.0, 0.5), (0.0, 4.0), (0.0, 3.0)]) == (
        (3.0, 0.0), (2.0, 1.0), (0.0, 4.0))
    assert PeakProfile().at(123, 456) == 0.0


def test_fake_tensors_measure_the_same_peaks_as_real_ones():
    """Every op's bytes are shapes and dtypes only: real CPU tensors (the kernels' values
    computed) and fake ones give identical profiles: KDA (its launchers' spikes), MLA (the
    attention stand-in, the mask), MoE, with AttnRes mode "full" (every sub-layer pushes a
    source buffer)."""
    args = _tiny(attn_res="full")
    for kind, i in _first_layer_of_each_kind(args).items():
        if kind == "kda+dense":
            continue  # the dense FFN adds nothing the MoE's shared experts do not have
        real = measure_layer_peaks(args, i, FP32_MASTER, False, fake=False)
        fake = measure_layer_peaks(args, i, FP32_MASTER, False, fake=True)
        assert isinstance(real, LayerPeaks) and real.kind == kind
        assert real == fake, kind


def test_profiles_do_not_depend_on_the_measuring_lengths():
    """Per-allocation coefficients are exact: lengths 2x longer give the same profiles, the
    dense path's T^2 terms (the mask, its recompute under full AC) included; the default path
    (varlen on CUDA) has none."""
    for choice in ("dense", "auto"):
        args = replace(_tiny(), mla_attention=choice)
        short = measure_layer_peaks(args, 3, FP32_MASTER, False)
        long = measure_layer_peaks(args, 3, FP32_MASTER, False, tokens=tuple(2 * T for T in TRANSIENT_TOKENS))
        assert short == long
        assert all(q == 0 for _, q in short.backward.points)  # without AC the bias is kept, not made
        if choice == "dense":
            assert max(q for _, q in short.full_backward.points) > 0  # the recomputed mask
        else:
            assert all(q == 0 for _, q in short.full_backward.points)
