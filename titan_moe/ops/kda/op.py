"""`titan_moe::kda_chunk_fwd` / `titan_moe::kda_chunk_bwd` custom ops and `chunk_kda`.

The chunked KDA operator is registered with torch.library so that a model calling
`chunk_kda` compiles with `torch.compile(fullgraph=True)` without graph breaks and
survives `torch.export`: Dynamo sees one opaque op per direction, described to the
compiler by its fake (meta) implementation.

    kda_chunk_fwd(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, output_final_state,
                  g_cumsum=False)
        -> (o [B,T,H,dv] in v's dtype, final_state [N,H,dk,dv] fp32, or [0] if not asked)
    kda_chunk_bwd(q, k, v, g, beta, scale, initial_state?, cu_seqlens?, do, dht?, g_cumsum=False)
        -> (dq, dk, dv, dg, dbeta, dh0 [N,H,dk,dv], or [0] without initial_state)

With `g_cumsum`, g is the chunk-local cumsum G of the log decay (what `kda_prepare` emits
with `chunk_cumsum=True`) and dg is dG.

The plain-PyTorch implementations here (`kda_chunk_fwd_torch`, `kda_chunk_bwd_torch`)
serve every device. `triton_op.register_cuda_kernels` puts the Triton kernels under the
same names for CUDA tensors, with no change to the schemas, fake implementations, autograd
wiring or callers; they run when the `[kernels] kda` choice picks Triton (`choices`; "auto":
on CUDA), else the PyTorch path does.

The L2 norm of q/k and the bounded gate stay outside these ops, so their contract is the
bare recurrence of SPEC §1; `chunk_kda` applies them first (in eager mode as the
`titan_moe::kda_prepare` op, see `prepare`). When autograd records the call, `chunk_kda`
calls `titan_moe::kda_chunk_fwd_kept` instead, which also returns the forward's
intermediates for its backward (`kept`); the choice `kda_keep = false` makes the backward
recompute them instead (less memory, slower).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from titan_moe.ops import choices, launch_env
from titan_moe.ops.kda.chunk_torch import check_kda_inputs, chunk_kda_torch, prepare_qkg
from titan_moe.ops.kda.prepare import kda_prepare
from titan_moe.ops.nvtx import nvtx_range

FWD_OP = "titan_moe::kda_chunk_fwd"
BWD_OP = "titan_moe::kda_chunk_bwd"
DEBUG_ENV = "TITAN_MOE_DEBUG"


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------
# forward op
# ----------------------------------------------------------------------------------------
def kda_chunk_fwd_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    output_final_state: bool,
    g_cumsum: bool = False,
) -> tuple[Tensor, Tensor]:
    """Chunked KDA forward (plain-PyTorch implementation, `chunk_torch.chunk_kda_torch`).

    Inputs are the bare operator inputs (q/k already normalised if wanted, g already
    bounded; with `g_cumsum`, g is its chunk-local cumsum G, as `kda_prepare(chunk_cumsum=True)`
    emits it, and the backward returns dG). The final state is an empty `[0]` tensor when
    `output_final_state` is False (custom ops cannot return None).
    """
    with nvtx_range("op.kda_chunk_fwd"):
        o, final_state = chunk_kda_torch(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, g_cumsum=g_cumsum,
        )
    if final_state is None:
        final_state = q.new_empty(0, dtype=_state_dtype(q))
    return o, final_state


kda_chunk_fwd = torch.library.custom_op(FWD_OP, kda_chunk_fwd_torch, mutates_args=())


@kda_chunk_fwd.register_fake
def _kda_chunk_fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum=False):
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    o = v.new_empty(B, T, H, dv)
    if not output_final_state:
        return o, q.new_empty(0, dtype=_state_dtype(q))
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return o, q.new_empty(N, H, dk, dv, dtype=_state_dtype(q))


# ----------------------------------------------------------------------------------------
# backward op
# ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _autograd_below_dispatcher() -> Iterator[None]:
    """Re-enable autograd recording inside an op implementation.

    Op implementations run below the Autograd dispatch key (it is excluded in
    thread-local state), so tensors created there record no graph even under
    `torch.enable_grad()`. The interim backward differentiates the PyTorch forward, so
    it lifts that exclusion for its own body.
    """
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (
        torch._C.DispatchKey.AutogradFunctionality,
        torch._C.DispatchKey.AutogradOther,
        torch._C.DispatchKey.AutogradNestedTensor,
    ):
        excluded = excluded.remove(key)
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded), torch.enable_grad():
        yield


def kda_chunk_bwd_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    do: Tensor,
    dht: Tensor | None,
    g_cumsum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked KDA backward. INTERIM implementation until the Triton kernels land.

    It recomputes the plain-PyTorch chunked forward (`chunk_kda_torch`) under autograd
    and differentiates it with `torch.autograd.grad`: correct, but it stores the whole
    forward graph and costs several forward passes. `do` is `[B,T,H,dv]`; `dht`
    (`[N,H,dk,dv]` or None) is the gradient of the final state. Returns gradients in
    the dtypes of q, k, v, g, beta, initial_state; `dh0` is an empty `[0]` tensor when
    there is no initial state. With `g_cumsum` (see `kda_chunk_fwd_torch`) dg is dG.
    """
    inputs = [x.detach() for x in (q, k, v, g, beta)]
    if initial_state is not None:
        inputs.append(initial_state.detach())
    with nvtx_range("op.kda_chunk_bwd"), _autograd_below_dispatcher():
        leaves = [x.requires_grad_() for x in inputs]
        h0 = leaves[5] if initial_state is not None else None
        o, ht = chunk_kda_torch(
            *leaves[:5], scale=scale, initial_state=h0,
            output_final_state=dht is not None, cu_seqlens=cu_seqlens, g_cumsum=g_cumsum,
        )
        outputs, grads = [o], [do]
        if dht is not None:
            outputs.append(ht)
            grads.append(dht)
        d_inputs = torch.autograd.grad(outputs, leaves, grads)
    dq, dk, dv, dg, dbeta = d_inputs[:5]
    dh0 = d_inputs[5] if initial_state is not None else q.new_empty(0, dtype=_state_dtype(q))
    return dq, dk, dv, dg, dbeta, dh0


kda_chunk_bwd = torch.library.custom_op(BWD_OP, kda_chunk_bwd_torch, mutates_args=())


@kda_chunk_bwd.register_fake
def _kda_chunk_bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum=False):
    dh0 = q.new_empty(0, dtype=_state_dtype(q)) if initial_state is None else torch.empty_like(initial_state)
    return (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
        torch.empty_like(g), torch.empty_like(beta), dh0,
    )


# ----------------------------------------------------------------------------------------
# autograd: forward op -> backward op
# ----------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.g_cumsum = g_cumsum


def _backward(ctx, do: Tensor | None, dht: Tensor | None):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.titan_moe.kda_chunk_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do, dht, ctx.g_cumsum
    )
    if initial_state is None:
        dh0 = None
    return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


kda_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------
def keep_selected() -> bool:
    """Whether `chunk_kda` under autograd keeps the forward's intermediates for the backward
    (the `titan_moe::kda_chunk_fwd_kept` op, see `kept`): the `kda_keep` choice, read per call."""
    return choices.current().kda_keep


def _debug_check_gate(g: Tensor, lower_bound: float) -> None:
    """With TITAN_MOE_DEBUG=1, outside compiled code: g must lie in [lower_bound, 0]."""
    if torch.compiler.is_compiling() or launch_env.read(DEBUG_ENV) != "1":
        return
    g_min, g_max = g.detach().aminmax()
    if bool(g_min < lower_bound) or bool(g_max > 0):
        raise ValueError(
            f"g must lie in [lower_bound={lower_bound}, 0), got values in [{g_min.item()}, {g_max.item()}]"
        )


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = False,
    gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float = -5.0,
) -> tuple[Tensor, Tensor | None]:
    """Bounded-decay delta attention, chunked (SPEC §1). Differentiable in every input.

    Args:
        q, k: `[B, T, H, dk]`.
        v: `[B, T, H, dv]`; q, k, v share one dtype (fp16/bf16/fp32; fp64 for tests).
        g: `[B, T, H, dk]` log-space decay. With `gate_in_kernel=False` the CALLER
            GUARANTEES `lower_bound <= g <= 0` (checked only when the environment sets
            TITAN_MOE_DEBUG=1, outside compiled code): the chunked evaluation relies on
            it to keep its exponentials finite. With `gate_in_kernel=True`, g is the raw
            gate input and `g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))` is
            applied first (see `gate.kda_gate`).
        beta: `[B, T, H]`, the delta-rule write strength (usually in (0, 1)).
        scale: query scale, default `dk ** -0.5`.
        initial_state: `[N, H, dk, dv]` fp32 state before the first token of each
            sequence, or None (zeros).
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: int32/int64 `[N+1]` boundaries of N packed sequences along T (B must
            be 1); the state restarts (from `initial_state[n]`) at each boundary.
        use_qk_l2norm: L2-normalise q and k per head (eps 1e-6) first.
        gate_in_kernel: see g; needs `A_log [H]` and `dt_bias [H * dk]`.
        lower_bound: the gate's lower bound, in [-5, 0).

    Returns:
        `o [B, T, H, dv]` in v's dtype, and `final_state [N, H, dk, dv]` fp32 (float64
        for float64 inputs) if `output_final_state`, else None.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    both = use_qk_l2norm and gate_in_kernel and A_log is not None and dt_bias is not None
    g_cumsum = both and not torch.compiler.is_compiling()
    if g_cumsum:
        # eager: both maps as one op (`prepare`; one Triton pass per direction on CUDA), which
        # also takes over the chunk-local cumsum of g and its reverse in the backward from the
        # core op. Compiled: the composite below, same maths, which Inductor fuses.
        q, k, g = kda_prepare(q, k, g, A_log, dt_bias, lower_bound, cu_seqlens=cu_seqlens, chunk_cumsum=True)
    else:
        q, k, g = prepare_qkg(
            q, k, g, use_qk_l2norm=use_qk_l2norm, gate_in_kernel=gate_in_kernel,
            A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        )
    if not gate_in_kernel:
        _debug_check_gate(g, lower_bound)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    args = (q, k, v, g, beta, float(scale), initial_state, cu_seqlens, output_final_state, g_cumsum)
    records = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    if records and keep_selected():  # the forward's intermediates kept for the backward (`kept`)
        o, final_state = torch.ops.titan_moe.kda_chunk_fwd_kept(*args)[:2]
    else:
        o, final_state = torch.ops.titan_moe.kda_chunk_fwd(*args)
    return o, (final_state if output_final_state else None)
