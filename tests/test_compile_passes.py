"""Router fusion: the ``titan_moe::router_topk`` op (PyTorch and Triton implementations) and
the FX pass that puts it into compiled graphs (`titan_moe.compile_passes`).

Without CUDA the Triton kernel runs under the interpreter: TRITON_INTERPRET=1 must be set
before the kernel module is first imported, so this module sets it at the top. If the kernel
module was already imported in this process without it, the in-process Triton tests skip and
`test_triton_in_fresh_interpreter_process` runs them again in a subprocess.

Oracles: the model's own `route` on `torch.sigmoid(logits)` (eager autograd for gradients),
and for ties a stable descending sort (documented to keep equal values in index order).
Inputs for value comparisons have distinct biased scores at least 7e-4 apart (far above
fp32 rounding), so every implementation must select the same experts in the same order.

Tolerances (relative error ||out - ref|| / ||ref||):
- op vs `route`, compiled-with-pass vs compiled-without: 1e-6. The PyTorch implementation
  does route's fp32 ops in route's order; the gradient formula differs from autograd's
  chain of ops only in the order of a few fp32 operations per element (a few ulps, ~1e-7).
- Triton (interpreter, fp32) vs PyTorch implementation: 1e-6. The kernel's sigmoid is
  1/(1+exp(-x)) in numpy, torch's differs by an ulp at most; sums over k <= 16 in a
  different order.
- Inductor test: 1e-5. Inductor's C++ sigmoid/exp (vectorised) differs from ATen's by ulps,
  and the backward sums two gradient paths in its own order.
A wrong index, a missing normalisation, scale or sigmoid' factor gives errors of 1e-1 or more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numerics import rel_err
from triton_mode import interpret_without_gpu, kernel_test_setup, rerun_under_interpreter  # noqa: E402

CUDA = interpret_without_gpu()

from torch._dynamo.utils import counters  # noqa: E402

from titan_moe import compile_passes  # noqa: E402
from titan_moe.model.moe import TopKRouter, route  # noqa: E402
from titan_moe.ops import choices  # noqa: E402
from titan_moe.ops.router import router_topk, router_topk_torch  # noqa: E402
from titan_moe.ops.router import op as router_op  # noqa: E402
from titan_moe.ops.router import triton_kernel as tk  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, tk.interpreted(), "test_triton_in_fresh_interpreter_process")
REPO = Path(__file__).resolve().parents[1]
TOL = 1e-6
INDUCTOR_TOL = 1e-5
SHAPES = [(37, 64, 4), (5, 896, 16), (9, 7, 7), (1, 100, 1), (300, 8, 2)]  # (N, n, k), k == n included


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------- inputs
def distinct_inputs(N: int, n: int, seed: int, device: str = "cpu"):
    """Logits and bias whose biased scores are a shuffled grid over [0.15, 0.85] per row
    (spacing >= 0.7 / (n - 1)), so the ranking is unambiguous."""
    gen = torch.Generator().manual_seed(seed)
    bias_n = 0.1 * (2 * torch.rand(n, generator=gen) - 1)
    ranks_Nn = torch.argsort(torch.rand(N, n, generator=gen), dim=-1).double()
    biased_Nn = 0.15 + 0.7 * ranks_Nn / max(n - 1, 1)
    scores_Nn = biased_Nn - bias_n.double()
    logits_Nn = torch.log(scores_Nn / (1 - scores_Nn)).float()
    return logits_Nn.to(device), bias_n.to(device)


def tied_inputs(N: int, n: int, seed: int, device: str = "cpu"):
    """Few distinct logits and bias levels: most rows have tied biased scores across the top-k cut."""
    gen = torch.Generator().manual_seed(seed)
    logits_Nn = torch.randint(-2, 3, (N, n), generator=gen).float()
    bias_n = 0.25 * torch.randint(0, 2, (n,), generator=gen).float()
    return logits_Nn.to(device), bias_n.to(device)


def stable_topk_indices(logits_Nn, bias_n, k):
    biased_Nn = torch.sigmoid(logits_Nn) + bias_n
    return torch.sort(biased_Nn, dim=-1, descending=True, stable=True).indices[:, :k]


def route_reference(logits_Nn, bias_n, k, scale):
    return route(torch.sigmoid(logits_Nn), bias_n, k, scale)


# ---------------------------------------------------------------------------- the op (PyTorch implementation)
@pytest.mark.parametrize("N,n,k", SHAPES)
def test_op_matches_route_values_and_gradient(N, n, k):
    logits, bias = distinct_inputs(N, n, seed=N + n)
    scale = 0.5 + N % 3
    grad_w = torch.randn(N, k, generator=torch.Generator().manual_seed(k))
    l_op, l_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    idx, w = router_topk(l_op, bias, k, scale)
    ref_idx, ref_w = route_reference(l_ref, bias, k, scale)
    assert torch.equal(idx, ref_idx)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == (N, k)
    assert rel_err(w, ref_w) < TOL
    (g_op,) = torch.autograd.grad(w, l_op, grad_w)
    (g_ref,) = torch.autograd.grad(ref_w, l_ref, grad_w)
    assert rel_err(g_op, g_ref) < TOL
    assert torch.count_nonzero(g_op) <= N * k  # gradient only at the selected experts


def test_op_scores_output_and_its_gradient():
    """The third output is the selected unbiased scores; gradients through it and the weights add."""
    N, n, k = 20, 12, 3
    logits, bias = distinct_inputs(N, n, seed=3)
    gw, gs = torch.randn(N, k), torch.randn(N, k)
    l_op, l_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, idx, s = torch.ops.titan_moe.router_topk(l_op, bias, k, 1.5)
    scores_ref = torch.sigmoid(l_ref)
    ref_idx, ref_w = route(scores_ref, bias, k, 1.5)
    ref_s = scores_ref.gather(-1, ref_idx)
    assert torch.equal(idx, ref_idx) and rel_err(s, ref_s) < TOL
    (g_op,) = torch.autograd.grad((w * gw).sum() + (s * gs).sum(), l_op)
    (g_ref,) = torch.autograd.grad((ref_w * gw).sum() + (ref_s * gs).sum(), l_ref)
    assert rel_err(g_op, g_ref) < TOL


def test_op_ties_go_to_the_lower_expert_index():
    """Both ranking paths of the PyTorch implementation (CPU: topk + repair of straddled rows;
    elsewhere: topk of the int64 keys) against a stable sort, on inputs full of ties."""
    from titan_moe.ops.router import ranking_key, topk_indices

    logits, bias = tied_inputs(64, 40, seed=1)
    biased = torch.sigmoid(logits) + bias
    for k in (1, 6, 40):
        expected = stable_topk_indices(logits, bias, k)
        assert torch.equal(router_topk_torch(logits, bias, k)[1], expected)
        assert torch.equal(topk_indices(biased, k), expected)
        assert torch.equal(torch.topk(ranking_key(biased), k, dim=-1).indices, expected)


def test_ranking_key_orders_like_a_stable_descending_sort():
    """Signs, zeros of both signs (equal), infinities, subnormals, ties: key order == value order,
    lower index first among equal values."""
    from titan_moe.ops.router import ranking_key

    values = torch.tensor([[0.5, -0.0, 0.0, -1.0, float("inf"), -float("inf"), 1e-40, -1e-40, 0.5, -1.0, 2.0, 0.0]])
    by_key = torch.argsort(ranking_key(values), dim=-1, descending=True)
    by_value = torch.sort(values, dim=-1, descending=True, stable=True).indices
    assert torch.equal(by_key, by_value)
    assert torch.unique(ranking_key(values)).numel() == values.numel()


def test_opcheck():
    logits, bias = distinct_inputs(11, 16, seed=5)
    torch.library.opcheck(torch.ops.titan_moe.router_topk.default, (logits.requires_grad_(), bias, 3, 2.0))


@pytest.mark.parametrize(
    "logits,bias,k,match",
    [
        (torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8), 2, "fp32"),
        (torch.zeros(4, 8), torch.zeros(7), 2, "bias"),
        (torch.zeros(4, 8), torch.zeros(8), 9, "top_k"),
        (torch.zeros(4, 8), torch.zeros(8), 0, "top_k"),
        (torch.zeros(2, 4, 8), torch.zeros(8), 2, r"\[N, n\]"),
    ],
)
def test_op_rejects_bad_arguments(logits, bias, k, match):
    with pytest.raises(ValueError, match=match):
        router_topk(logits, bias, k)


def test_backend_choice_is_validated():
    with pytest.raises(ValueError, match="kernels.router_topk must be one of"):
        with choices.using(router_topk="cuda-please"):
            router_op.resolve_backend(torch.device("cpu"))
    with choices.using(router_topk="torch"):
        assert router_op.resolve_backend(torch.device("cuda")) == "torch"


# ---------------------------------------------------------------------------- the Triton kernel
@needs_kernels
@pytest.mark.parametrize("N,n,k", SHAPES)
def test_triton_kernel_matches_torch_implementation(N, n, k):
    logits, bias = distinct_inputs(N, n, seed=7 * N + n, device=DEVICE)
    w, idx, s = tk.router_topk_triton(logits, bias, k, 1.7)
    ref_w, ref_idx, ref_s = router_topk_torch(logits, bias, k, 1.7)
    assert torch.equal(idx, ref_idx)
    assert rel_err(w, ref_w) < TOL and rel_err(s, ref_s) < TOL


@needs_kernels
@pytest.mark.parametrize("N,n,k", [(50, 40, 6), (7, 40, 40), (33, 17, 1)])
def test_triton_kernel_ties_go_to_the_lower_expert_index(N, n, k):
    logits, bias = tied_inputs(N, n, seed=N, device=DEVICE)
    _, idx, _ = tk.router_topk_triton(logits, bias, k)
    assert torch.equal(idx.cpu(), stable_topk_indices(logits.cpu(), bias.cpu(), k))


@needs_kernels
def test_triton_kernel_strided_logits_and_low_precision_bias():
    """A row-strided view of wider logits and a bf16 bias (used in fp32, as route's .float())."""
    wide, bias = distinct_inputs(19, 48, seed=2, device=DEVICE)
    logits = wide[:, :40]
    bias16 = bias[:40].bfloat16()
    w, idx, _ = tk.router_topk_triton(logits, bias16, 5)
    ref_w, ref_idx, _ = router_topk_torch(logits.contiguous(), bias16, 5)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL


@needs_kernels
def test_triton_op_forward_and_backward():
    """The op with the Triton backend selected, through autograd, against route."""
    with choices.using(router_topk="triton"):
        logits, bias = distinct_inputs(45, 24, seed=9, device=DEVICE)
        grad_w = torch.randn(45, 3, device=DEVICE)
        l_op, l_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        idx, w = router_topk(l_op, bias, 3, 2.0)
        ref_idx, ref_w = route_reference(l_ref, bias, 3, 2.0)
        assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL
        (g_op,) = torch.autograd.grad(w, l_op, grad_w)
        (g_ref,) = torch.autograd.grad(ref_w, l_ref, grad_w)
        assert rel_err(g_op, g_ref) < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("N,n,k", [(8192, 64, 4), (8192, 896, 16)])
def test_cuda_op_at_model_shapes(N, n, k):
    """The op on CUDA (Triton forward, PyTorch backward) against route on the CPU."""
    logits, bias = distinct_inputs(N, n, seed=n)
    grad_w = torch.randn(N, k, generator=torch.Generator().manual_seed(k))
    l_gpu = logits.cuda().requires_grad_()
    idx, w = router_topk(l_gpu, bias.cuda(), k, 2.5)
    (g_gpu,) = torch.autograd.grad(w, l_gpu, grad_w.cuda())
    l_ref = logits.clone().requires_grad_()
    ref_idx, ref_w = route_reference(l_ref, bias, k, 2.5)
    (g_ref,) = torch.autograd.grad(ref_w, l_ref, grad_w)
    assert torch.equal(idx.cpu(), ref_idx)
    assert rel_err(w, ref_w) < TOL and rel_err(g_gpu, g_ref) < TOL


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_triton_in_fresh_interpreter_process():
    """Runs this file's Triton tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__, also_deselect="not triton")


_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from titan_moe.ops.router import triton_kernel as tk
sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64", "weights_ptr": "*fp32",
       "scores_ptr": "*fp32", "N": "i32", "n": "i32", "stride_row": "i32", "routed_scale": "fp32",
       "TOP_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
for n, k in ((64, 4), (896, 16)):
    bn, be, bk = tk.block_sizes(n, k)
    src = ASTSource(fn=tk._router_topk_fwd_kernel, signature=sig,
                    constexprs={"TOP_K": k, "BLOCK_N": bn, "BLOCK_E": be, "BLOCK_K": bk})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in kernel.asm, list(kernel.asm)
print("OK")
"""


def test_kernel_compiles_for_sm90():
    """The compiled (non-interpreted) kernel builds to a Hopper cubin at both model shapes."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


# ---------------------------------------------------------------------------- the pass
def capture_graphs(passes: bool):
    """A backend that records the Dynamo graph's code before (and after) the pass and runs it
    with aot_eager. Returns (backend, records) with records = [(before, after, count)]."""
    records = []

    def backend(gm, example_inputs):
        before = gm.code
        count = compile_passes.apply_pass(gm, "router_fusion") if passes else 0
        records.append((before, gm.code, count))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    return backend, records


def _has_topk(code: str) -> bool:
    return "topk" in code.replace("router_topk", "")


def test_pass_rewrites_the_router_and_keeps_outputs_and_gradients():
    """TopKRouter forward+backward under fullgraph compile: the graph before has sigmoid and
    topk, after it has the op and no topk; scores, indices, weights and the gradients of the
    input and router weight equal the un-passed compiled graph."""
    torch.manual_seed(0)
    router = TopKRouter(dim=32, n_experts=16, top_k=4, routed_scale=2.5)
    router.init_weights(init_std=0.5)
    bias = 0.05 * torch.randn(16)
    x = torch.randn(40, 32)
    grads = (torch.randn(40, 16), torch.randn(40, 4))
    results = {}
    for passes in (False, True):
        torch._dynamo.reset()
        backend, records = capture_graphs(passes)
        compiled = torch.compile(router, backend=backend, fullgraph=True)
        xg = x.clone().requires_grad_()
        scores, idx, w = compiled(xg, bias)
        loss = (scores * grads[0]).sum() + (w * grads[1]).sum()
        results[passes] = (scores, idx, w, *torch.autograd.grad(loss, (xg, router.weight)), records)
    *plain, plain_records = results[False]
    *fused, fused_records = results[True]
    (before, after, count), = fused_records
    assert count == 1 and counters["titan_moe"]["router_fusion"] == 1
    assert "sigmoid" in before and _has_topk(before) and "router_topk" not in before
    assert "titan_moe.router_topk" in after and not _has_topk(after)
    assert plain_records[0][0] == plain_records[0][1]  # the un-passed graph really was not rewritten
    assert torch.equal(fused[1], plain[1])
    for a, b in zip(fused[:1] + fused[2:], plain[:1] + plain[2:]):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("batch_iters,stat", [(0, "qb_counts"), (2, "qb_batch_bias_sum")])
def test_pass_inside_activation_checkpoint_of_the_moe_layer(batch_iters, stat):
    """The MoE layer in training (QB histogram on; lag and in-batch forms), checkpoint-wrapped
    as the trainer does: the router inside the checkpoint body is rewritten, outputs, gradients
    and balancing statistics equal the un-passed compiled layer."""
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from titan_moe.model.args import ModelArgs
    from titan_moe.model.moe import LatentMoE

    args = ModelArgs(dim=24, n_routed_experts=8, top_k=2, n_shared_experts=1, moe_latent_dim=12,
                     moe_expert_hidden=20, moe_shared_hidden=10, routed_scale=1.0, qb_bins=16,
                     qb_batch_iters=batch_iters)
    torch.manual_seed(0)
    base = LatentMoE(args)
    base.init_weights(init_std=0.3)
    base.expert_bias.copy_(0.05 * torch.randn(8))
    x = torch.randn(2, 9, 24)
    outs = {}
    for passes in (False, True):
        torch._dynamo.reset()
        moe = copy.deepcopy(base).train()
        backend, records = capture_graphs(passes)
        compiled = torch.compile(checkpoint_wrapper(moe), backend=backend, fullgraph=True)
        xg = x.clone().requires_grad_()
        y = compiled(xg)
        grads = torch.autograd.grad(y.square().sum(), (xg, *moe.parameters()))
        outs[passes] = (y, grads, moe.tokens_per_expert.clone(), getattr(moe, stat).clone(), records)
    assert outs[True][4][0][2] == 1 and "wrap_body" in outs[True][4][0][0]  # rewritten inside the HOP body
    assert rel_err(outs[True][0], outs[False][0]) < TOL
    for a, b in zip(outs[True][1], outs[False][1]):
        assert rel_err(a, b) < TOL
    assert torch.equal(outs[True][2], outs[False][2]) and torch.equal(outs[True][3], outs[False][3])


def _scaled_functional_router(logits, bias):
    """The same maths in other spellings: bias first, dim=1, torch.* functions, scale on the left."""
    s = torch.sigmoid(logits)
    idx = torch.topk(bias + s, 3, dim=1).indices
    sel = torch.gather(s, 1, idx)
    return idx, 2.0 * torch.div(sel, torch.sum(sel, dim=-1, keepdim=True))


def _unscaled_router(logits, bias):
    """routed_scale 1 written without the multiplication."""
    s = logits.sigmoid()
    _, idx = (s + bias).topk(3)
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


@pytest.mark.parametrize("fn,scale", [(_scaled_functional_router, 2.0), (_unscaled_router, 1.0)])
def test_pass_matches_other_spellings(fn, scale):
    logits, bias = distinct_inputs(30, 10, seed=4)
    backend, records = capture_graphs(True)
    idx, w = torch.compile(fn, backend=backend, fullgraph=True)(logits, bias)
    assert records[0][2] == 1
    ref_idx, ref_w = route_reference(logits, bias, 3, scale)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL


def test_pass_with_dynamic_token_count():
    """With a symbolic token count the pass still applies; one graph serves every N."""
    torch.manual_seed(2)
    router = TopKRouter(dim=8, n_experts=10, top_k=3)
    router.init_weights(init_std=0.5)
    bias = 0.05 * torch.randn(10)
    backend, records = capture_graphs(True)
    compiled = torch.compile(router, backend=backend, fullgraph=True, dynamic=True)
    for N in (7, 19):
        x = torch.randn(N, 8)
        _, idx, w = compiled(x, bias)
        _, ref_idx, ref_w = router(x, bias)
        assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL
    assert [r[2] for r in records] == [1]


def test_op_survives_torch_export():
    class Fused(torch.nn.Module):
        def forward(self, logits, bias):
            return router_topk(logits, bias, 4, 2.0)

    logits, bias = distinct_inputs(13, 16, seed=11)
    exported = torch.export.export(Fused(), (logits, bias))
    assert "titan_moe.router_topk" in str(exported.graph)
    idx, w = exported.module()(logits, bias)
    ref_idx, ref_w = route_reference(logits, bias, 4, 2.0)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL


def test_pass_on_an_aten_graph():
    """A make_fx (ATen) graph with `val` meta is rewritten too; the result is unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    logits, bias = distinct_inputs(21, 12, seed=6)
    gm = make_fx(lambda lg, b: route_reference(lg, b, 4, 1.5), tracing_mode="fake")(logits, bias)
    assert "aten.topk" in gm.code
    assert compile_passes.apply_pass(gm) == 1
    assert "titan_moe.router_topk" in gm.code and "aten.topk" not in gm.code
    idx, w = gm(logits, bias)
    ref_idx, ref_w = route_reference(logits, bias, 4, 1.5)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL


def test_pass_on_a_symbolic_trace_needs_example_inputs():
    """torch.fx.symbolic_trace records no tensor metadata: nothing is rewritten without
    example inputs (dtypes and shapes cannot be checked), one rewrite with them."""

    class Routed(torch.nn.Module):
        def forward(self, logits, bias):
            return route_reference(logits, bias, 3, 2.0)

    logits, bias = distinct_inputs(17, 9, seed=12)
    gm = torch.fx.symbolic_trace(Routed())
    assert compile_passes.apply_pass(gm) == 0
    assert compile_passes.apply_pass(gm, example_inputs=(logits, bias)) == 1
    idx, w = gm(logits, bias)
    ref_idx, ref_w = route_reference(logits, bias, 3, 2.0)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < TOL


def _softmax_router(logits, bias):
    s = torch.softmax(logits, dim=-1)
    idx = torch.topk(s + bias, 3, dim=-1).indices
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


def _values_used(logits, bias):
    s = torch.sigmoid(logits)
    vals, idx = torch.topk(s + bias, 3, dim=-1)
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True) + vals


def _bf16_scores(logits, bias):
    return route(torch.sigmoid(logits.bfloat16()), bias, 3)


def _unnormalised(logits, bias):
    s = torch.sigmoid(logits)
    idx = torch.topk(s + bias, 3, dim=-1).indices
    return idx, s.gather(-1, idx) * 2.0


def _smallest(logits, bias):
    s = torch.sigmoid(logits)
    idx = torch.topk(s + bias, 3, dim=-1, largest=False).indices
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


def _per_token_bias(logits, bias):
    return route(torch.sigmoid(logits), bias + 0.01 * logits, 3)


def _scores_mutated_after_topk(logits, bias):
    s = torch.sigmoid(logits)
    idx = torch.topk(s + bias, 3, dim=-1).indices
    s.mul_(2.0)
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


def _view_of_scores_mutated(logits, bias):
    s = torch.sigmoid(logits)
    idx = torch.topk(s + bias, 3, dim=-1).indices
    s[:, :2].zero_()
    sel = s.gather(-1, idx)
    return idx, sel / sel.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "fn", [_softmax_router, _values_used, _bf16_scores, _unnormalised, _smallest, _per_token_bias,
           _scores_mutated_after_topk, _view_of_scores_mutated],
)
def test_pass_leaves_other_graphs_unchanged(fn):
    logits, bias = distinct_inputs(16, 10, seed=8)
    backend, records = capture_graphs(True)
    out = torch.compile(fn, backend=backend, fullgraph=True)(logits, bias)
    (before, after, count), = records
    assert count == 0 and before == after and _has_topk(before)
    ref = fn(logits, bias)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_make_backend_is_one_object_per_configuration():
    """Regional compile of many identical layers: one backend object, so one graph for all
    layers (a backend per layer would recompile per layer and hit Dynamo's recompile limit)."""
    assert compile_passes.make_backend("aot_eager") is compile_passes.make_backend("aot_eager", ["router_fusion"])
    assert compile_passes.make_backend("aot_eager") is not compile_passes.make_backend("eager")
    layers = [TopKRouter(dim=8, n_experts=6, top_k=2) for _ in range(10)]
    x, bias = torch.randn(5, 8), torch.zeros(6)
    for layer in layers:
        layer.init_weights()
        torch.compile(layer, backend=compile_passes.make_backend("aot_eager"), fullgraph=True)(x, bias)
    assert counters["stats"]["unique_graphs"] == 1 and counters["titan_moe"]["router_fusion"] == 1
    with pytest.raises(ValueError, match="unknown compile pass"):
        compile_passes.make_backend("aot_eager", ("no_such_pass",))


def test_install_sets_and_restores_the_inductor_hook():
    from torch._inductor import config as inductor_config

    before = inductor_config.pre_grad_custom_pass
    with compile_passes.install() as first:
        hook = inductor_config.pre_grad_custom_pass
        assert isinstance(hook, compile_passes.PreGradPasses) and hook.passes == ("router_fusion",)
        assert hook.previous is before
        if before is None:
            assert isinstance(hook.uuid(), bytes)
            assert hook.uuid() == compile_passes.PreGradPasses(("router_fusion",)).uuid()
        second = compile_passes.install()  # replaces ours instead of stacking on it
        assert inductor_config.pre_grad_custom_pass.previous is before
        second.uninstall()
        assert inductor_config.pre_grad_custom_pass is hook
    assert inductor_config.pre_grad_custom_pass is before and first.installed is hook
    with pytest.raises(ValueError, match="unknown compile pass"):
        compile_passes.install(("no_such_pass",))


def test_inductor_with_installed_pass():
    """The one Inductor compile: TopKRouter forward+backward with the pass installed. The
    output code calls the op and no aten topk; results match eager."""
    import torch._functorch.config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(1)
    router = TopKRouter(dim=16, n_experts=12, top_k=3, routed_scale=1.5)
    router.init_weights(init_std=0.5)
    bias = 0.05 * torch.randn(12)
    x = torch.randn(24, 16)
    gs, gw = torch.randn(24, 12), torch.randn(24, 3)

    def step(module):
        xg = x.clone().requires_grad_()
        scores, idx, w = module(xg, bias)
        grads = torch.autograd.grad((scores * gs).sum() + (w * gw).sum(), (xg, router.weight))
        return scores, idx, w, *grads

    # caches off: a cache hit would skip the pre-grad pass (and this check)
    with compile_passes.install(), inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        out, codes = run_and_get_code(step, torch.compile(router, backend="inductor", fullgraph=True))
    assert counters["titan_moe"]["router_fusion"] == 1
    code = "\n".join(codes)
    assert "titan_moe.router_topk" in code and "aten.topk" not in code
    ref = step(router)
    assert torch.equal(out[1], ref[1])
    for a, b in zip(out[:1] + out[2:], ref[:1] + ref[2:]):
        assert rel_err(a, b) < INDUCTOR_TOL


# ---------------------------------------------------------------------------- the benchmark script
def start_runs(root):
    """Queue this file's processes, started together when a test first asks (tests/tiny.py:
    two at a time, each mostly one busy core): (root folder, name -> future of its
    CompletedProcess). Three steps of the tiny model compiled (aot_eager) with and without the
    pass; profiling/bench_passes.py at a tiny shape."""
    from tiny import environment, run_train, start_all

    common = ("--training.steps", "3", "--compile.enable", "--compile.backend", "aot_eager")
    bench = [sys.executable, str(REPO / "profiling" / "bench_passes.py"), "--tiny", "--device", "cpu", "--threads", "1"]

    def run_bench():
        env = {k: v for k, v in environment().items() if k != "TRITON_INTERPRET"}
        return subprocess.run(bench, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    return root, start_all({
        "bench": run_bench,
        "with": lambda: run_train(root / "with", *common, "--compile.passes", "router_fusion"),
        "without": lambda: run_train(root / "without", *common),
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tiny import started_runs

    return started_runs(start_runs, tmp_path_factory)


def test_bench_passes_tiny_cpu_run(runs):
    """profiling/bench_passes.py end to end at a tiny shape: the fused variant has fewer generated
    kernels, calls the op instead of aten.topk, saves less for the backward and agrees with eager."""
    proc = runs[1]["bench"].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and len(report["cases"]) == 1
    variants = report["cases"][0]["variants"]
    assert set(variants) == {"eager", "inductor", "inductor+router_fusion"}
    base, fused = variants["inductor"], variants["inductor+router_fusion"]
    assert "aten.topk" in base["extern"] and "titan_moe.router_topk" not in base["extern"]
    assert "titan_moe.router_topk" in fused["extern"] and "aten.topk" not in fused["extern"]
    assert 0 < fused["kernels"] < base["kernels"]
    assert fused["saved_MB"] < base["saved_MB"]
    for row in variants.values():
        assert row["idx_equal"] and row["w_err"] < TOL and row["grad_err"] < TOL
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0


# ---------------------------------------------------------------------------------------
# the trainer: `[compile] passes`
def test_trainer_runs_the_pass_in_every_compiled_moe_layer(runs):
    """`--compile.passes router_fusion` with regional compile (aot_eager): the log reports one
    rewrite per compiled MoE layer kind and the losses of three steps equal the compiled run
    without the pass (same graphs up to the router; fp32 sums reassociated: 1e-5)."""
    from tiny import losses

    root, futures = runs
    with_pass, without = futures["with"].result(), futures["without"].result()
    for proc in (with_pass, without):
        assert proc.returncode == 0, proc.stderr[-3000:]
    log = with_pass.stdout + with_pass.stderr
    assert "with passes ['router_fusion']" in log
    rewrites = [int(line.split("router_fusion: ")[1].split()[0]) for line in log.splitlines()
                if "compile pass router_fusion:" in line]
    assert rewrites and max(rewrites) == 1 and min(rewrites) == 0  # MoE layers 1, dense layers 0
    got, want = losses(root / "with"), losses(root / "without")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
