"""MoE token dispatch (`titan_moe.ops.dispatch`): `permute` / `unpermute_combine`, their custom
ops and Triton kernels, and their use in `LatentMoE`.

Oracle: a loop over sorted rows / tokens / copies in float64 that reads `order` directly
(no inverse permutation, no gathers), on fresh random routings of several shapes: token
counts that are not multiples of the kernels' block (4 under the interpreter), k = 1, 2, 8,
empty experts, and widths L that are not multiples of the column block (16).

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET=1 must be set
before the kernel module is first imported, so this module sets it at the top. If Triton
was imported in this process without it (another test module first), the in-process kernel
tests skip and `test_in_fresh_interpreter_process` runs this file again in a subprocess.

Tolerances (relative error ||out - ref|| / ||ref|| against float64):
- permute and its kernel copy values: exact.
- fp32 sums of <= 8 products (forward, dx) and dot products over L <= 64 (dw): a few fp32
  ulps per element, so 1e-6 (2^-23 ~ 1.2e-7 is one ulp).
- bf16 inputs, fp32 accumulation, bf16 output: one bf16 rounding of each result, at most
  2^-9 ~ 2e-3 relative per element: 4e-3. With `out_dtype=float32` the bf16 values are
  summed and kept in fp32: 1e-6 again (a bf16 accumulation would be ~1e-2 off).
- Triton (interpreter, fp32) vs the PyTorch path: both fp32, sums in different orders: 1e-6.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_mode import (  # noqa: E402
    compiled_script_results,
    interpret_without_gpu,
    interpreter_ready,
    kernel_test_setup,
    rerun_under_interpreter,
    spy_on,
)
import torch
from numerics import rel_err

CUDA = interpret_without_gpu()

import torch._dynamo.testing  # noqa: E402  (imports Triton: after TRITON_INTERPRET is set)

from titan_moe.ops import choices  # noqa: E402
from titan_moe.ops.dispatch import op as dispatch_op  # noqa: E402
from titan_moe.ops.dispatch import (  # noqa: E402
    aligned_positions,
    combine_copies,
    padded_rows,
    permute,
    permute_torch,
    scatter_copies,
    sorted_positions,
    unpermute_combine,
)
from titan_moe.ops.dispatch import triton_kernel as tk  # noqa: E402

KERNELS_RUN_HERE, DEVICE, needs_kernels = kernel_test_setup(CUDA, tk.interpreted(), "test_in_fresh_interpreter_process")
FP32_TOL = 1e-6

# (N tokens, k, L, experts)
SHAPES = [(1, 1, 8, 3), (13, 2, 40, 5), (37, 8, 24, 12), (50, 1, 64, 4), (6, 8, 16, 9)]


def make_routing(n, k, n_experts, seed, device="cpu", with_experts=False):
    """order [N*k] as LatentMoE builds it (stable argsort of the flat expert ids, k distinct
    experts per token), random fp32 weights [N, k]; expert 0 gets no token. With
    `with_experts`, also the experts [N, k]."""
    assert k < n_experts
    gen = torch.Generator().manual_seed(seed)
    expert_idx = torch.stack([torch.randperm(n_experts - 1, generator=gen)[:k] + 1 for _ in range(n)])
    order = torch.argsort(expert_idx.reshape(-1), stable=True)
    weights = torch.rand(n, k, generator=gen) + 0.1
    if with_experts:
        return order.to(device), weights.to(device), expert_idx.to(device)
    return order.to(device), weights.to(device)


def rand(*shape, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------- loop reference
def loop_permute(x, order, k):
    out = torch.empty(order.numel(), x.shape[1], dtype=torch.float64)
    for m, copy in enumerate(order.tolist()):
        out[m] = x[copy // k].double()
    return out


def loop_permute_grad(grad_sorted, order, k, n):
    dx = torch.zeros(n, grad_sorted.shape[1], dtype=torch.float64)
    for m, copy in enumerate(order.tolist()):
        dx[copy // k] += grad_sorted[m].double()
    return dx


def loop_combine(y_sorted, order, weights):
    """out[n] = sum_j w[n, j] y_sorted[m] over the rows m with order[m] == n*k + j; and the
    gradients (dy, dw) for an upstream gradient given later."""
    n, k = weights.shape
    out = torch.zeros(n, y_sorted.shape[1], dtype=torch.float64)
    for m, copy in enumerate(order.tolist()):
        out[copy // k] += weights[copy // k, copy % k].double() * y_sorted[m].double()
    return out


def loop_combine_grads(grad, y_sorted, order, weights):
    n, k = weights.shape
    dy = torch.empty(y_sorted.shape, dtype=torch.float64)
    dw = torch.empty(n, k, dtype=torch.float64)
    for m, copy in enumerate(order.tolist()):
        token, slot = divmod(copy, k)
        dy[m] = weights[token, slot].double() * grad[token].double()
        dw[token, slot] = grad[token].double() @ y_sorted[m].double()
    return dy, dw


# ---------------------------------------------------------------------------- PyTorch path
@pytest.mark.parametrize("n,k,latent,n_experts", SHAPES)
def test_torch_path_matches_loop_reference(n, k, latent, n_experts):
    with choices.using(dispatch="torch"):
        order, weights = make_routing(n, k, n_experts, seed=n * k + latent)
        x = rand(n, latent, seed=1).requires_grad_()
        y = rand(n * k, latent, seed=2).requires_grad_()
        w = weights.clone().requires_grad_()
        g_sorted, g_out = rand(n * k, latent, seed=3), rand(n, latent, seed=4)

        x_sorted = permute(x, order, k)
        assert x_sorted.shape == (n * k, latent) and x_sorted.dtype == torch.float32
        assert torch.equal(x_sorted.double(), loop_permute(x.detach(), order, k))
        x_sorted.backward(g_sorted)
        assert rel_err(x.grad, loop_permute_grad(g_sorted, order, k, n)) < FP32_TOL

        out = unpermute_combine(y, order, w)
        assert out.shape == (n, latent) and out.dtype == torch.float32
        assert rel_err(out, loop_combine(y.detach(), order, weights)) < FP32_TOL
        out.backward(g_out)
        dy_ref, dw_ref = loop_combine_grads(g_out, y.detach(), order, weights)
        assert rel_err(y.grad, dy_ref) < FP32_TOL
        assert rel_err(w.grad, dw_ref) < FP32_TOL


def test_sorted_positions_invert_order():
    order, _ = make_routing(11, 3, 6, seed=0)
    pos = sorted_positions(order, 3)
    assert pos.shape == (11, 3)
    for m, copy in enumerate(order.tolist()):
        assert pos[copy // 3, copy % 3] == m
    assert torch.equal(sorted_positions(order.int(), 3), pos)
    x = rand(11, 8, seed=1)
    assert torch.equal(permute(x, order.int(), 3), permute(x, order, 3))


def test_bf16_accumulates_in_fp32():
    n, k, latent = 24, 8, 32
    order, weights = make_routing(n, k, 10, seed=5)
    y = rand(n * k, latent, seed=6, dtype=torch.bfloat16)
    ref = loop_combine(y, order, weights)
    out_bf16 = unpermute_combine(y, order, weights)
    assert out_bf16.dtype == torch.bfloat16 and rel_err(out_bf16, ref) < 4e-3
    out_fp32 = unpermute_combine(y, order, weights, out_dtype=torch.float32)
    assert out_fp32.dtype == torch.float32 and rel_err(out_fp32, ref) < FP32_TOL


def test_weights_without_grad_and_inputs_without_grad():
    n, k, latent = 9, 2, 16
    order, weights = make_routing(n, k, 4, seed=7)
    y = rand(n * k, latent, seed=8).requires_grad_()
    unpermute_combine(y, order, weights).sum().backward()  # weights need no grad
    assert rel_err(y.grad, loop_combine_grads(torch.ones(n, latent), y.detach(), order, weights)[0]) < FP32_TOL
    w = weights.clone().requires_grad_()
    unpermute_combine(y.detach(), order, w).sum().backward()  # y needs no grad
    assert rel_err(w.grad, loop_combine_grads(torch.ones(n, latent), y.detach(), order, weights)[1]) < FP32_TOL
    with torch.no_grad():
        assert not unpermute_combine(y, order, w).requires_grad


def test_argument_errors():
    order, weights = make_routing(5, 2, 4, seed=9)
    x, y = rand(5, 8, seed=1), rand(10, 8, seed=2)
    with pytest.raises(ValueError, match="N\\*k"):
        permute(x, order, 3)
    with pytest.raises(ValueError, match="order"):
        permute(x, order.view(5, 2), 2)
    with pytest.raises(ValueError, match="2-D"):
        permute(x.int(), order, 2)
    with pytest.raises(ValueError, match="rows"):
        unpermute_combine(y[:8], order, weights)
    with pytest.raises(ValueError, match="N\\*k"):
        unpermute_combine(y, order, weights[:4])
    with pytest.raises(ValueError, match="out_dtype"):
        unpermute_combine(y, order, weights, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="kernels.dispatch must be one of"):
        with choices.using(dispatch="cuda"):
            permute(x, order, 2)


# ---------------------------------------------------------------------------- op contracts
def _op_args(n, k, latent, seed, device="cpu"):
    order, weights = make_routing(n, k, k + 4, seed=seed, device=device)
    pos = sorted_positions(order, k)
    x = rand(n, latent, seed=seed + 1, device=device).requires_grad_()
    y = rand(n * k, latent, seed=seed + 2, device=device).requires_grad_()
    grad = rand(n, latent, seed=seed + 3, device=device)
    return pos, x, y, weights.requires_grad_(), grad


def _aligned_args(n, k, seed, device="cpu", alignment=4):
    """Positions of an aligned layout for `_op_args`' routing: (pos [N, k], offs [E], rows)."""
    order, _, expert_idx = make_routing(n, k, k + 4, seed=seed, device=device, with_experts=True)
    counts = torch.bincount(expert_idx.reshape(-1), minlength=k + 4)
    return aligned_positions(sorted_positions(order, k), expert_idx, counts, alignment)


def _opcheck_all(n, k, latent, seed, device="cpu"):
    pos, x, y, w, grad = _op_args(n, k, latent, seed, device)
    ops = torch.ops.titan_moe
    torch.library.opcheck(ops.moe_permute.default, (x, pos, 0))
    aligned, _, rows = _aligned_args(n, k, seed, device)
    y_rows = rand(rows, latent, seed=seed + 5, device=device).requires_grad_()
    torch.library.opcheck(ops.moe_permute.default, (x, aligned, rows))
    torch.library.opcheck(ops.moe_unpermute_combine.default, (y_rows, aligned, w, True))
    torch.library.opcheck(ops.moe_unpermute_combine_backward.default, (grad, y_rows.detach(), aligned, w.detach()))
    torch.library.opcheck(ops.moe_unpermute_combine.default, (y, pos, w, False))
    torch.library.opcheck(ops.moe_unpermute_combine.default, (y, pos, None, True))
    torch.library.opcheck(ops.moe_unpermute_combine_backward.default, (grad, y.detach(), pos, w.detach()))


@pytest.mark.parametrize("n,k,latent", [(7, 2, 12), (5, 8, 16)])
def test_opcheck(n, k, latent):
    _opcheck_all(n, k, latent, seed=n)


def _moe_like(x, order, weights, w_mix):
    """permute -> a stand-in for the experts -> unpermute_combine -> scalar."""
    k = weights.shape[1]
    h = torch.tanh(permute(x, order, k) @ w_mix)
    return unpermute_combine(h, order, weights, out_dtype=torch.float32).square().sum()


def _check_compiles(device="cpu", seed=0):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_moe_like, backend=counter, fullgraph=True)
    order, weights = make_routing(11, 2, 5, seed=seed, device=device)
    x = rand(11, 24, seed=seed + 1, device=device).requires_grad_()
    w_mix = rand(24, 24, seed=seed + 2, device=device).requires_grad_()
    weights.requires_grad_()
    got = torch.autograd.grad(compiled(x, order, weights, w_mix), (x, weights, w_mix))
    ref = torch.autograd.grad(_moe_like(x, order, weights, w_mix), (x, weights, w_mix))
    assert counter.frame_count == 1
    for a, b in zip(got, ref):
        assert rel_err(a, b) < FP32_TOL


def test_compile_fullgraph_aot_eager():
    with choices.using(dispatch="torch"):
        _check_compiles()


# ---------------------------------------------------------------------------- in LatentMoE
def _latent_moe(**overrides):
    from titan_moe.model.args import ModelArgs
    from titan_moe.model.moe import LatentMoE

    base = dict(dim=24, n_routed_experts=6, top_k=2, n_shared_experts=1, moe_latent_dim=20,
                moe_expert_hidden=16, moe_shared_hidden=8)
    torch.manual_seed(0)
    moe = LatentMoE(ModelArgs(**{**base, **overrides}))
    moe.init_weights(0.3)
    return moe


@pytest.mark.parametrize("top_k", [1, 3])
@pytest.mark.parametrize("alignment", [1, 4])
def test_latent_moe_dispatch_contract(top_k, alignment):
    """route_and_sort's sorted rows are w_latent_down(x) at the positions it returns (token i's
    copy j in row pos[i, j]), grouped by expert in order with groups starting at multiples of
    `alignment` and zero rows between them; combine equals the plain gather, weight and sum
    it replaced."""
    import torch.nn.functional as F

    moe = _latent_moe(top_k=top_k)
    x = rand(19, 24, seed=top_k)
    latent_sorted, offs, pos, weights = moe.route_and_sort(x, alignment)
    latent = moe.w_latent_down(x)
    assert torch.equal(latent_sorted[pos], latent.unsqueeze(1).expand(-1, top_k, -1))
    assert torch.equal(offs % alignment, torch.zeros_like(offs))
    _, expert_idx, _ = moe.router(x, moe.expert_bias)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]]).long()
    counts = torch.bincount(expert_idx.reshape(-1), minlength=moe.n_experts)
    assert torch.equal(offs.long() - starts, (counts + alignment - 1) // alignment * alignment)
    assert ((pos >= starts[expert_idx]) & (pos < starts[expert_idx] + counts[expert_idx])).all()
    owned = torch.zeros(latent_sorted.shape[0], dtype=torch.bool)
    owned[pos.reshape(-1)] = True
    assert not latent_sorted[~owned].any()
    out_sorted = rand(*latent_sorted.shape, seed=10)
    u = (out_sorted[pos].double() * weights.double().unsqueeze(-1)).sum(1)
    u = F.rms_norm(u, (moe.latent,), moe.latent_norm.weight.double(), moe.norm_eps)
    y = moe.w_latent_up(u.float()) + moe.shared_experts(x)
    assert rel_err(moe.combine(x, out_sorted, pos, weights), y) < 1e-5  # fp32 through two matmuls


def test_latent_moe_aligned_groups_same_result():
    """Experts that ask for aligned groups (as the fp8 experts do) get them, with
    `groups_aligned=True`, and the layer's output and every gradient stay what they are
    with packed groups (padding rows are zero and get no gradient)."""
    moe = _latent_moe(top_k=3)
    x0 = rand(2, 9, 24, seed=5)
    seen, results = [], {}
    original_forward = type(moe.experts).forward

    def spy(self, x_RL, offs_E, groups_aligned=False):
        seen.append((x_RL.shape[0], groups_aligned))
        return original_forward(self, x_RL, offs_E, groups_aligned)

    for alignment in (1, 16):
        moe.experts.group_alignment = alignment
        moe.experts.forward = spy.__get__(moe.experts)
        x = x0.clone().requires_grad_()
        moe.zero_grad()
        y = moe(x)
        y.square().sum().backward()
        results[alignment] = [y.detach(), x.grad] + [p.grad.clone() for p in moe.parameters()]
    assert seen == [(18 * 3, False), (padded_rows(18 * 3, 6, 16), True)]
    for a, b in zip(results[16], results[1]):
        assert rel_err(a, b) < 1e-6
    moe.experts.expert_parallel = True  # the exchange regroups rows: packed groups then
    moe(x0)
    assert seen[-1] == (18 * 3, False)


# ---------------------------------------------------------------------------- aligned layouts
def loop_aligned_rows(order, expert_idx, k, n_experts, alignment):
    """Sorted row of each copy when every expert's group starts at a multiple of `alignment`
    (a cursor per group), and the padded groups' cumulative ends."""
    counts = [int((expert_idx == e).sum()) for e in range(n_experts)]
    starts, offs, end = [], [], 0
    for c in counts:
        starts.append(end)
        end += -(-c // alignment) * alignment
        offs.append(end)
    cursor, rows = list(starts), {}
    for copy in order.tolist():
        e = int(expert_idx.reshape(-1)[copy])
        rows[copy] = cursor[e]
        cursor[e] += 1
    pos = torch.tensor([rows[c] for c in range(order.numel())]).view(-1, k)
    return pos, torch.tensor(offs, dtype=torch.int32)


@pytest.mark.parametrize("n,k,latent,n_experts", SHAPES)
@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_aligned_positions_match_loop(n, k, latent, n_experts, alignment):
    order, _, expert_idx = make_routing(n, k, n_experts, seed=n + k, with_experts=True)
    counts = torch.bincount(expert_idx.reshape(-1), minlength=n_experts)
    pos, offs, rows = aligned_positions(sorted_positions(order, k), expert_idx, counts, alignment)
    ref_pos, ref_offs = loop_aligned_rows(order, expert_idx, k, n_experts, alignment)
    assert torch.equal(pos, ref_pos) and torch.equal(offs, ref_offs)
    assert rows == padded_rows(n * k, n_experts, alignment) >= int(offs[-1]) and rows % alignment == 0
    if alignment == 1:
        assert rows == n * k and torch.equal(pos, sorted_positions(order, k))


def _aligned_round_trip(n, k, latent, n_experts, seed, device, alignment=4):
    """scatter_copies / combine_copies on an aligned layout and on the plain one, forward and
    backward, from the same inputs."""
    order, weights, expert_idx = make_routing(n, k, n_experts, seed=seed, device=device, with_experts=True)
    counts = torch.bincount(expert_idx.reshape(-1), minlength=n_experts)
    plain = sorted_positions(order, k)
    aligned, _, rows = aligned_positions(plain, expert_idx, counts, alignment)
    x0 = rand(n, latent, seed=seed + 1, device=device)
    y_plain0 = rand(n * k, latent, seed=seed + 2, device=device)
    y_aligned0 = rand(rows, latent, seed=seed + 3, device=device)  # padding rows hold noise
    y_aligned0[aligned.reshape(-1)] = y_plain0[plain.reshape(-1)]
    g_out = rand(n, latent, seed=seed + 4, device=device)
    results = {}
    for name, pos, y0, n_rows in (("plain", plain, y_plain0, None), ("aligned", aligned, y_aligned0, rows)):
        x, y, w = x0.clone().requires_grad_(), y0.clone().requires_grad_(), weights.clone().requires_grad_()
        x_sorted = scatter_copies(x, pos, n_rows)
        x_sorted.backward(x_sorted.detach() * 2)  # d/dx of sum(x_sorted^2): the k copies summed
        out = combine_copies(y, pos, w, out_dtype=torch.float32)
        out.backward(g_out)
        results[name] = (pos, x_sorted.detach(), x.grad, out.detach(), y.grad, w.grad)
    return results, rows


def _check_aligned_round_trip(results, rows):
    (p_pos, p_xs, p_dx, p_out, p_dy, p_dw), (a_pos, a_xs, a_dx, a_out, a_dy, a_dw) = results["plain"], results["aligned"]
    owned = torch.zeros(rows, dtype=torch.bool, device=a_xs.device)
    owned[a_pos.reshape(-1)] = True
    assert a_xs.shape[0] == rows
    assert torch.equal(a_xs[a_pos.reshape(-1)], p_xs[p_pos.reshape(-1)])
    assert not a_xs[~owned].any()  # padding rows zero
    assert torch.equal(a_dy[a_pos.reshape(-1)], p_dy[p_pos.reshape(-1)])
    assert not a_dy[~owned].any()  # the noise in y's padding rows gets no gradient
    for a, b in ((a_dx, p_dx), (a_out, p_out), (a_dw, p_dw)):
        assert rel_err(a, b) < FP32_TOL


@pytest.mark.parametrize("n,k,latent,n_experts", SHAPES[1:3])
def test_aligned_layout_round_trip_torch(n, k, latent, n_experts):
    with choices.using(dispatch="torch"):
        _check_aligned_round_trip(*_aligned_round_trip(n, k, latent, n_experts, seed=n, device="cpu"))


def test_aligned_layout_rejects_too_few_rows():
    order, _ = make_routing(5, 2, 4, seed=0)
    with pytest.raises(ValueError, match="at least N\\*k"):
        scatter_copies(rand(5, 8, seed=1), sorted_positions(order, 2), rows=9)
    with pytest.raises(ValueError, match="at least N\\*k"):
        combine_copies(rand(9, 8, seed=1), sorted_positions(order, 2), torch.ones(5, 2))
    # the backends' own entry points refuse it too (one shared check)
    with pytest.raises(ValueError, match="cannot hold N\\*k = 10"):
        permute_torch(rand(5, 8, seed=1), sorted_positions(order, 2), rows=9)
    with pytest.raises(ValueError, match="cannot hold N\\*k = 10"):
        dispatch_op._sorted_rows(sorted_positions(order, 2), 9)


# ---------------------------------------------------------------------------- Triton kernels
def _both_paths(n, k, latent, n_experts, dtype, seed, device):
    """Forward and gradients of permute and unpermute_combine under each backend."""
    order, weights = make_routing(n, k, n_experts, seed=seed, device=device)
    x0 = rand(n, latent, seed=seed + 1, dtype=dtype, device=device)
    y0 = rand(n * k, latent, seed=seed + 2, dtype=dtype, device=device)
    g_sorted = rand(n * k, latent, seed=seed + 3, dtype=dtype, device=device)
    g_out = rand(n, latent, seed=seed + 4, dtype=dtype, device=device)
    results = {}
    for backend in ("triton", "torch"):
        with choices.using(dispatch=backend):
            x, y, w = x0.clone().requires_grad_(), y0.clone().requires_grad_(), weights.clone().requires_grad_()
            x_sorted = permute(x, order, k)
            x_sorted.backward(g_sorted)
            out = unpermute_combine(y, order, w)
            out.backward(g_out)
            results[backend] = (x_sorted.detach(), x.grad, out.detach(), y.grad, w.grad)
    return results


@needs_kernels
@pytest.mark.parametrize("n,k,latent,n_experts", SHAPES)
def test_triton_matches_torch_path(n, k, latent, n_experts):
    res = _both_paths(n, k, latent, n_experts, torch.float32, seed=n + k + latent, device=DEVICE)
    tri, ref = res["triton"], res["torch"]
    assert torch.equal(tri[0], ref[0])  # permute: copies
    for name, a, b in zip(("dx", "out", "dy", "dw"), tri[1:], ref[1:]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < FP32_TOL, name


@needs_kernels
def test_triton_fp16_and_fp32_output():
    """fp16 rows: the kernels accumulate in fp32 and round once, like the PyTorch path (the
    roundings can differ by one fp16 ulp where the fp32 sums differ: 1e-3)."""
    res = _both_paths(21, 4, 48, 7, torch.float16, seed=3, device=DEVICE)
    for a, b in zip(res["triton"], res["torch"]):
        assert a.dtype == b.dtype and rel_err(a, b) < 1e-3
    order, weights = make_routing(21, 4, 7, seed=3, device=DEVICE)
    pos = sorted_positions(order, 4)
    y = rand(84, 48, seed=5, dtype=torch.float16, device=DEVICE)
    out = tk.gather_sum_triton(y, pos, weights, torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, loop_combine(y.cpu(), order.cpu(), weights.cpu())) < FP32_TOL


@needs_kernels
@pytest.mark.parametrize("block_n,block_l", [(1, 16), (2, 64), (8, 32), (16, 128)])
def test_triton_block_shapes(block_n, block_l):
    n, k, latent = 19, 3, 40
    order, weights = make_routing(n, k, 6, seed=block_n, device=DEVICE)
    pos = sorted_positions(order, k)
    cfg = tk.BlockConfig(block_n, block_l)
    x, y = rand(n, latent, seed=1, device=DEVICE), rand(n * k, latent, seed=2, device=DEVICE)
    g = rand(n, latent, seed=3, device=DEVICE)
    assert torch.equal(tk.permute_triton(x, pos, cfg).cpu().double(), loop_permute(x.cpu(), order.cpu(), k))
    out = tk.gather_sum_triton(y, pos, weights, None, cfg)
    assert rel_err(out, loop_combine(y.cpu(), order.cpu(), weights.cpu())) < FP32_TOL
    dy, dw = tk.combine_backward_triton(g, y, pos, weights, cfg)
    dy_ref, dw_ref = loop_combine_grads(g.cpu(), y.cpu(), order.cpu(), weights.cpu())
    assert rel_err(dy, dy_ref) < FP32_TOL and rel_err(dw, dw_ref) < FP32_TOL


@needs_kernels
def test_triton_masks_positions_out_of_range():
    """Positions outside [0, M) are never dereferenced: the gather skips those copies."""
    n, k, latent = 10, 3, 20
    order, weights = make_routing(n, k, 5, seed=2, device=DEVICE)
    pos = sorted_positions(order, k)
    bad = pos.clone()
    bad[1, 0], bad[4, 2], bad[7, 1] = -5, n * k, 10**12
    y = rand(n * k, latent, seed=4, device=DEVICE)
    kept = torch.ones(n, k, device=DEVICE)
    kept[1, 0] = kept[4, 2] = kept[7, 1] = 0
    out = tk.gather_sum_triton(y, bad, weights)
    assert rel_err(out, tk.gather_sum_triton(y, pos, weights * kept)) < FP32_TOL
    tk.permute_triton(rand(n, latent, seed=1, device=DEVICE), bad)  # runs, stores nothing out of range
    tk.combine_backward_triton(rand(n, latent, seed=3, device=DEVICE), y, bad, weights)


@needs_kernels
def test_empty_inputs():
    pos = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert tk.permute_triton(torch.empty(0, 8, device=DEVICE), pos).shape == (0, 8)
    assert tk.gather_sum_triton(torch.empty(0, 8, device=DEVICE), pos, None).shape == (0, 8)
    dy, dw = tk.combine_backward_triton(torch.empty(0, 8, device=DEVICE), torch.empty(0, 8, device=DEVICE), pos,
                                        torch.empty(0, 2, device=DEVICE))
    assert dy.shape == (0, 8) and dw.shape == (0, 2)


@needs_kernels
def test_choice_selects_kernels(monkeypatch):
    calls = spy_on(monkeypatch, tk, ("permute_triton", "gather_sum_triton", "combine_backward_triton"))
    order, weights = make_routing(8, 2, 4, seed=1, device=DEVICE)
    x = rand(8, 16, seed=2, device=DEVICE).requires_grad_()
    weights.requires_grad_()
    with choices.using(dispatch="triton"):
        unpermute_combine(permute(x, order, 2), order, weights).sum().backward()
        assert calls == ["permute_triton", "gather_sum_triton", "combine_backward_triton", "gather_sum_triton"]
    with choices.using(dispatch="torch"):
        unpermute_combine(permute(x, order, 2), order, weights).sum().backward()
        assert len(calls) == 4


@needs_kernels
def test_opcheck_and_compile_triton_backend():
    with choices.using(dispatch="triton"):
        _opcheck_all(9, 2, 20, seed=3, device=DEVICE)
        _check_compiles(device=DEVICE, seed=4)


@needs_kernels
@pytest.mark.parametrize("n,k,latent,n_experts", SHAPES[1:3])
def test_aligned_layout_round_trip_triton(n, k, latent, n_experts):
    with choices.using(dispatch="triton"):
        _check_aligned_round_trip(*_aligned_round_trip(n, k, latent, n_experts, seed=n, device=DEVICE))


@needs_kernels
def test_latent_moe_triton_matches_torch():
    """One LatentMoE training forward and backward under each backend (the routing is the same
    in both: only the dispatch implementation differs)."""
    moe = _latent_moe(top_k=3).to(DEVICE)
    x0 = rand(2, 9, 24, seed=5, device=DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        with choices.using(dispatch=backend):
            x = x0.clone().requires_grad_()
            moe.zero_grad()
            y = moe(x)
            y.square().sum().backward()
            results[backend] = [y.detach(), x.grad] + [p.grad.clone() for p in moe.parameters()]
    for a, b in zip(results["triton"], results["torch"]):
        assert rel_err(a, b) < 1e-5  # fp32; the sums' orders differ, amplified by the RMSNorm backward


@pytest.mark.skipif(KERNELS_RUN_HERE, reason="the kernels already run in this process")
def test_in_fresh_interpreter_process():
    """Runs this file's tests under the interpreter in a fresh process."""
    rerun_under_interpreter(__file__, also_deselect="compiles_for_sm90")


def test_runs_on_and_block_config_rules():
    """Where the kernels run, and the default tile rule of the module docstring."""
    # on the CPU: interpreted kernels, and Triton's own library interpreted too (not so when
    # this process imported Triton before TRITON_INTERPRET=1 was set)
    assert tk.runs_on(torch.device("cpu")) == (tk.interpreted() and interpreter_ready())
    with pytest.raises(ValueError, match="power of two"):
        tk.BlockConfig(3, 16)
    cfg = tk.default_config(3584, torch.device("cuda"))
    assert (cfg.block_n, cfg.block_l) == (8, 512)
    assert tk.default_config(1024, torch.device("cuda")).block_l == 1024
    assert tk.default_config(100, torch.device("cuda")).block_l == 128  # no power-of-two divisor >= 128


# ---------------------------------------------------------------------------- GPU code path
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from titan_moe.ops.dispatch import triton_kernel as tk

    # As a real launch specialises: pointers 16-byte aligned, the token and row counts plain i32.
    def build(fn, ptrs, consts, cfg):
        names = list(fn.arg_names)
        sig = {n: ptrs.get(n, "i32") for n in names}
        sig.update({n: "constexpr" for n in consts})
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
        ptx = k.asm["ptx"]
        return "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx, "st.global.v4" in ptx

    results = {}
    for L, K in ((1024, 8), (3584, 16)):
        cfg = tk.default_config(L, torch.device("cuda"))
        tiles = dict(L=L, K=K, BLOCK_N=cfg.block_n, BLOCK_L=cfg.block_l)
        results[f"permute_{L}"] = build(tk._permute_kernel, {"x_ptr": "*bf16", "pos_ptr": "*i64", "out_ptr": "*bf16"},
                                        tiles, cfg)
        results[f"combine_{L}"] = build(
            tk._gather_sum_kernel, {"y_ptr": "*bf16", "pos_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": "*fp32"},
            dict(tiles, HAS_WEIGHTS=True), cfg)
        results[f"combine_bwd_{L}"] = build(
            tk._combine_bwd_kernel, {"g_ptr": "*fp32", "y_ptr": "*bf16", "pos_ptr": "*i64", "w_ptr": "*fp32",
                                     "dy_ptr": "*bf16", "dw_ptr": "*fp32"},
            dict(tiles, BLOCK_K=triton.next_power_of_2(K)), cfg)
    print("RESULT", repr(results))
    """
)


def test_compiles_for_sm90():
    """The compiled code path (the interpreter never takes it) builds for an sm90 target with no
    GPU present, for the model's bf16 rows at both benchmark widths, and every kernel moves rows
    with 16-byte vector loads and stores."""
    results = compiled_script_results(_COMPILE_SCRIPT)  # name -> (vector loads, vector stores)
    assert len(results) == 6
    assert all(vec_load and vec_store for vec_load, vec_store in results.values()), results


# ---------------------------------------------------------------------------- bf16 on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("n,k,latent", [(4096, 8, 1024), (1000, 16, 3584)])
def test_cuda_bf16_vs_float64(n, k, latent):
    """bf16 rows on the GPU, both backends, against float64 (one bf16 rounding: 4e-3)."""
    order, weights = make_routing(n, k, 64, seed=n, device="cpu")
    x = rand(n, latent, seed=1, dtype=torch.bfloat16)
    y = rand(n * k, latent, seed=2, dtype=torch.bfloat16)
    g = rand(n, latent, seed=3, dtype=torch.bfloat16)
    idx = sorted_positions(order, k).reshape(-1)
    y64, w64 = y.double(), weights.double()
    out_ref = (y64[idx].view(n, k, latent) * w64[..., None]).sum(1)
    dw_ref = (y64[idx].view(n, k, latent) * g.double()[:, None]).sum(-1)
    for backend in ("triton", "torch"):
        with choices.using(dispatch=backend):
            yc, wc = y.cuda().requires_grad_(), weights.cuda().requires_grad_()
            out = unpermute_combine(yc, order.cuda(), wc)
            out.backward(g.cuda())
            assert rel_err(out, out_ref) < 4e-3, backend
            assert rel_err(wc.grad, dw_ref) < 1e-5, backend  # fp32 dot products of bf16 values
            assert torch.equal(permute(x.cuda(), order.cuda(), k).cpu(), x[order // k]), backend
            del out, yc
            torch.cuda.empty_cache()
