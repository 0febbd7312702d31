"""What a layer's forward and backward allocate, measured op by op (`measure_layer_peaks`,
`layer_peaks`): the eager model's transient and full-AC recompute (they replace the fused
heuristic `2 x largest kept entry + workspace`, `activations.LayerActivations`).

What is measured. Bytes alive above the start of a stretch of one layer's step, at every op:
its forward, and its backward ("transient": without AC the kept tensors are freed as the
backward consumes them, gradients, temporaries and workspaces come and go), without AC and
with the layer under non-reentrant `torch.utils.checkpoint` (torchtitan's full AC: its
backward then holds the recompute of the forward too). The layer runs as training runs it:
the first layer of each kind with zero weights and all its routed experts, one packed row of
T tokens (one document), precision as `eager.measure_eager_layer` (without FSDP weights and
stream in `training.dtype` under CPU autocast to the compute dtype, with FSDP both in the
compute dtype), the AttnRes stream as leaf tensors. The backward starts where the model's
backward enters the layer: the gradients of its output stream tensors (`(S+1) D s` per token,
the step walk's "stream gradients") are allocated first, then the start is marked; the
gradients of its input stream tensors accumulate into them in place, as in the model.
Parameter gradients are freed as they are accumulated, and weight-sized tensors drop out
anyway (below): the step walk counts gradients per layer.

How. `LiveBytes`, a TorchDispatchMode, sees every op (forward, backward, recompute) and keeps
the bytes of the storages alive: a storage that an op returns and that none of its inputs
shares counts from then on, until the storage is freed (a weakref finalizer: a storage keeps
its Python object while C++ holds it, whoever holds it: autograd's saved variables, the
engine's input buffers). The high-water mark is taken after every op (its inputs and outputs
alive together). Only the op's outputs are seen, never a CPU kernel's own temporaries.

GPU kernels, whose CPU counterparts allocate differently:
  * SDPA and fused RMSNorm: the stand-ins of `eager.GpuKernelSaves` (values off), which save
    and, in their backward, allocate what the CUDA kernels do (memory-efficient attention:
    dq, dk, dv, fp32 delta and the kernel's fp32 dQ accumulator; see
    `eager._EfficientAttentionSaves`).
  * The KDA ops (`titan_moe::kda_chunk_fwd/bwd`): their outputs as the CPU (or fake)
    implementation returns them; the Triton launchers' own tensors are added as a spike while
    the op runs, from `kda_fwd_allocations` / `kda_bwd_allocations`, which replay the
    launchers' `torch.empty` calls in order (`triton_fwd.kda_fwd_states`, `kda_fwd_output`,
    `triton_bwd.chunk_kda_bwd_triton`; the op's sequential state scan; a test runs the
    launchers with their kernels stubbed out and compares). The backward's peak, per token
    and head (C = 64, K = dk, V = dv): fp32 G K, A_qk C, A_inv C, dA_qk C, dA_kk C, dG K and
    dbeta partial 1; h, v_new, dh, dv_new (K V / C, V, K V / C, V) and the dq / dk partials
    (K each, `triton_bwd.bwd_parts_dtype`) in bf16 for bf16 inputs; W and the walk's
    precomputed factors are freed before stage 2: `4C + 3K + V + KV/C + 1` fp32 words, then
    the outputs dq, dk, dv in the input dtype, dg fp32 K and dbeta fp32, and a contiguous copy
    of v (a slice of the short convolution's q|k|v output). small_1gpu (H 8, K = V = 128):
    32 KiB per token.
  * Grouped GEMM and token dispatch ops: their outputs are what the CUDA paths allocate
    (`torch._grouped_mm` and the Triton kernels need no workspace beyond cuBLAS's constant).
    SiTU-GLU (`titan_moe::situ_glu`, `situ_glu_bwd`): its outputs too when CUDA runs its Triton
    kernels (`[kernels] situ = "auto"`, the default, or "triton": one elementwise pass per
    direction); under "torch" its PyTorch path, op by op (about 17 ops over fp32 copies: 262
    KiB per token more in a small_1gpu MoE layer's backward).
    Any other custom op (`titan_moe::*`) is counted through the Python function it was defined
    with, run op by op: what its CUDA path runs unless it registers a CUDA kernel (the
    context-parallel MLA's chunked attention, `titan_moe::doc_attention_fwd/bwd`, is PyTorch
    on CUDA too; a measured context-parallel layer splits each call into
    `context_parallel.CP_ATTENTION_CHUNKS` query chunks: `LiveBytes.attention_chunks`).
  * Autocast: CPU autocast stands in for CUDA's. Both cast matmul inputs to bf16; CUDA's
    also runs rms_norm, exp, sum, softmax, ... in fp32. The layers do their norms, gates and
    mixers in fp32 explicitly; what differs is MLA's two latent RMSNorms (bf16 inputs,
    composite on the CPU, fp32 fused on CUDA): a few KiB per token, not corrected.

Per token, not fitted. The same ops run at three lengths T (128, 256, 384: `TRANSIENT_TOKENS`),
so allocation i is the same tensor in each run; its three sizes give `c + L T + Q T^2` exactly
(shapes are affine in T over multiples of 128, or quadratic for MLA's `[T, T]` mask). The constant c is dropped (weights' autocast
copies and gradients, scalars: the step walk counts those), and every op of a stretch gives a
point (L, Q): the bytes per token and per T^2 alive above the stretch's start. The stretch's
high-water mark at any length is the largest `L t + Q sum(T^2)` over the points
(`PeakProfile`): where the peak falls may move with T (the recomputed mask's bool `[T, T]`
temporaries outgrow the per-token tensors at long T). Real CPU tensors for small layers, fake
ones (`FakeTensorMode`: no storage, no arithmetic) for large ones: the same bytes, a test
checks it. Cached per model and precision setting; about 1.5 s per layer kind.

Checked against the H200 (torch 2.11, the model code of commit 9d1e05e,
`profiling/layer_memory.py`, which measures from `backward()` with only the output partial
sum given a gradient; `layer_counter(..., model_stream=False)` reproduces that harness, all
allocations counted). small_1gpu, KiB per token at 8K / 32K, H200 vs this measurement:
backward kda+dense 199.0 / 195.8 vs 195.0 / 195.8, kda+moe 266.7 / 272.1 vs 266.7 / 272.1,
mla+moe 266.7 / 272.1 vs 266.7 / 272.1; full-AC backward kda+dense 293.8 / 291.4 vs 293.8 /
291.4, kda+moe 424.3 / 414.2 vs 424.3 / 414.2, mla+moe 415.2 / 453.3 vs 415.1 / 453.3. Per
token, the planner's numbers (model stream, constants out): transient 192, 270, 270; full-AC
backward 287, 407, 382 + 2 B x T^2. The fused heuristic says transient 90, 108, 50. SiTU-GLU
ran its PyTorch path on CUDA at that commit; with its Triton kernels, CUDA's default since,
the planner says (2026-12-06 model code, no FSDP): transient 22, 8, 8; full-AC backward 116,
147, 122 (not yet checked on a GPU).

Not modelled: head dims the KDA kernels do not cover (the op then runs its PyTorch backward, far larger),
EP's all-to-all buffers (added by `activations.layer_activations`),
the SDPA kernel's dK/dV accumulators (16 MiB, constant), allocator rounding (512 B blocks).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import ResidualStream, sources_before_layer
from titan_moe.model.decoder import DecoderLayer

from titan_moe.plan.context_parallel import CP_ATTENTION_CHUNKS, CPOptions, RankSetting
from titan_moe.plan.eager import GpuKernelSaves, _fit_tokens, per_layer_kind, planned_attention, zero_layer
from titan_moe.plan.layout import KDA_CHUNK, Precision

_DTYPES = {4: torch.float32, 2: torch.bfloat16}
# Measuring lengths: multiples of 128, so that every size is affine in T (or T^2) over them
# (`ceil(T / 128)` blocks of the attention backward's dQ accumulator, 64-token KDA chunks).
TRANSIENT_TOKENS = (128, 256, 384)
REAL_TENSOR_BUDGET = 64 * 2**20  # real CPU tensors are faster than fake ones only for small layers


# =========================================================================== live bytes
class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive (`current`) and their high-water mark since the
    last mark (`peak`; `start`: the bytes at that mark), op by op (module docstring, "How").
    Only storages created while the mode is active count. Custom ops (module docstring, "GPU
    kernels"): the KDA chunk ops add their launchers' tensors as a spike while they run
    (`kda_fwd_allocations`, `kda_bwd_allocations`), grouped GEMM and token dispatch count
    their outputs, any other `titan_moe::` op runs its Python implementation op by op.

    Everything is also logged in `events`, in order: ("alloc", i) and ("free", i) for
    allocation number i (`sizes[i]` bytes), ("spike", j) (`spikes[j]` bytes above the
    current ones), ("op", 0) after every op, ("mark", name).
    """

    def __init__(self, attention_chunks: int | None = None) -> None:
        super().__init__()
        self.attention_chunks = attention_chunks
        self.live: dict[int, int] = {}  # storage key -> allocation number
        self.sizes: list[int] = []
        self.spikes: list[int] = []
        self.events: list[tuple[str, int | str]] = []
        self.current = self.peak = self.start = 0
        self._finalizers: list[weakref.finalize] = []
        self.opaque = _opaque_ops()  # the custom ops counted by their outputs

    def mark(self, name: str) -> int:
        self.events.append(("mark", name))
        self.peak = self.start = self.current
        return self.current

    def _free(self, key: int) -> None:
        number = self.live.pop(key)
        self.events.append(("free", number))
        self.current -= self.sizes[number]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._name in _MIRRORED_OPS:
            spike = _peak(_MIRRORED_OPS[func._name](*args, **kwargs))
            self.events.append(("spike", len(self.spikes)))
            self.spikes.append(spike)
            self.peak = max(self.peak, self.current + spike)
        elif func.namespace == "titan_moe" and func._name not in self.opaque:
            implementation = _python_implementation(func)
            if implementation is not None:  # what CUDA runs too: count its ops (with this mode on again)
                if func._name in _ATTENTION_CHUNK_ARG and self.attention_chunks:
                    args = _split_queries(args, *_ATTENTION_CHUNK_ARG[func._name], self.attention_chunks)
                with self:
                    return implementation(*args, **kwargs)
        out = func(*args, **kwargs)
        # not by the schema: `to`, `reshape`, `_unsafe_view` may or may not return an input's storage
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self.live:
                continue
            self.live[key] = len(self.sizes)
            self.events.append(("alloc", len(self.sizes)))
            self.sizes.append(storage.nbytes())
            self.current += self.sizes[-1]
            self._finalizers.append(weakref.finalize(storage, self._free, key))
        self.events.append(("op", 0))
        self.peak = max(self.peak, self.current)
        return out

    def __enter__(self):
        self._depth = getattr(self, "_depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:  # the last exit (custom ops re-enter the mode): stop counting frees
            for fin in self._finalizers:
                fin.detach()
        return super().__exit__(*exc)


# Custom ops whose CUDA kernels allocate their outputs and nothing that grows with T: counted
# by their outputs (the CPU or fake implementation's). The KDA chunk ops add their launchers'
# tensors (`_MIRRORED_OPS`); any other custom op is counted through its Python implementation.
_OPAQUE_OPS = frozenset(f"titan_moe::{name}" for name in (
    "grouped_mm", "grouped_mm_dx", "grouped_mm_dw",  # torch._grouped_mm / Triton: outputs
    "moe_permute", "moe_unpermute_combine", "moe_unpermute_combine_backward",  # Triton: outputs
    "kda_prepare", "kda_prepare_bwd",  # Triton: outputs (and the backward's few per-block partial sums)
))
# The chunked attention ops (`ops.attention.chunked`): (position of q, of the chunk size) in
# their arguments. A context-parallel layer is measured with every call in
# `LiveBytes.attention_chunks` query chunks (module `context_parallel`, "How the measurement maps").
_ATTENTION_CHUNK_ARG = {"titan_moe::doc_attention_fwd": (0, 5), "titan_moe::doc_attention_bwd": (1, 8)}


def _split_queries(args: tuple, q_at: int, chunk_at: int, chunks: int) -> tuple:
    """`args` of a chunked attention op with its chunk size set to make `chunks` query chunks."""
    rows = args[q_at].shape[2]
    return (*args[:chunk_at], -(-rows // chunks), *args[chunk_at + 1:])


# SiTU-GLU: its Triton kernels (one elementwise pass per direction) allocate their outputs;
# its PyTorch path runs about 17 ops over fp32 copies. Opaque when CUDA takes the kernels.
_SITU_OPS = frozenset(("titan_moe::situ_glu", "titan_moe::situ_glu_bwd"))


def _opaque_ops() -> frozenset[str]:
    """`_OPAQUE_OPS`, and SiTU-GLU's ops when the `[kernels] situ` choice runs its Triton
    kernels on CUDA (`auto`, the default, does)."""
    from titan_moe.ops import choices

    return _OPAQUE_OPS | _SITU_OPS if choices.pick_backend(choices.current().situ, "cuda") == "triton" else _OPAQUE_OPS


@functools.cache
def _python_implementation(func):
    """The Python function a `torch.library.custom_op` was defined with (None for other ops)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(func._name)
    return None if opdef is None else opdef._init_fn


# =========================================================================== KDA launchers
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _peak(events: list[tuple[str, int]]) -> int:
    """High-water mark of a list of (name, +bytes allocated / -bytes freed) events."""
    now = top = 0
    for _, delta in events:
        now += delta
        top = max(top, now)
    return top


def _chunk_counts(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[int, int]:
    """(sequences N, chunks): the launchers' chunk layout. With `cu_seqlens` the chunk count
    depends on the document lengths, unknown to shapes alone: the bound `ceil(TT/C) + N - 1`
    (exact for one document)."""
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return B, B * -(-T // KDA_CHUNK)
    N = cu_seqlens.shape[0] - 1
    return N, -(-B * T // KDA_CHUNK) + N - 1


def _G_copy_bytes(g: torch.Tensor) -> int:
    """Under `g_cumsum` the launchers read G from g itself: a copy only if g is not fp32."""
    return 0 if g.dtype == torch.float32 else g.numel() * 4


def _fwd_states(events, q, k, v, g, beta, cu_seqlens, output_final_state, output_q_decay=True,
                g_cumsum=False) -> list[str]:
    """`triton_fwd.kda_fwd_states`: appends its allocations and frees to `events`, returns
    the names of what it returns (the `KDAForwardState`)."""
    B, T, H, K = q.shape
    V, TT, C, f32 = v.shape[-1], B * T, KDA_CHUNK, 4
    w = q.element_size()  # the walks' tensors are in the input dtype
    N, chunks = _chunk_counts(q, cu_seqlens)
    layout = [("cu_seqlens", (N + 1) * 4), ("chunk_indices", chunks * 2 * 4), ("chunk_offsets", (N + 1) * 4)]
    copies = [(f"{name}_contiguous", _nbytes(x)) for name, x in zip("qkvg", (q, k, v, g)) if not x.is_contiguous()]
    if not beta.is_contiguous():
        copies.append(("beta_contiguous", _nbytes(beta)))
    G_bytes = _G_copy_bytes(g) if g_cumsum else TT * H * K * f32
    states = [
        *([("G", G_bytes)] if G_bytes else []),
        ("Aqk", TT * H * C * f32), ("Akk", TT * H * C * f32), ("Ainv", TT * H * C * f32),
        *([("q_decay_out", TT * H * K * w)] if output_q_decay else []),  # scale Q e^G for the output
        ("W", TT * H * K * w), ("U", TT * H * V * w), ("h", chunks * H * K * V * w), ("v_new", TT * H * V * w),
    ]
    if output_final_state:
        states.append(("ht", N * H * K * V * f32))
    states += [("k_to_end", TT * H * K * w), ("decay", chunks * H * K * f32)]  # the walk's factors K~, e^{G_last}
    events += layout + copies + states
    # A_kk dies after the WY kernel, U after the walk; nothing is allocated in between, so
    # freeing them here gives the same peak
    freed = dict(copies + [s for s in states if s[0] in ("Akk", "U")])
    events += [(name, -n) for name, n in freed.items()]
    return [name for name, _ in layout + states if name not in freed]


def kda_fwd_allocations(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state, g_cumsum=False):
    """The tensors `triton_op.kda_chunk_fwd_triton` allocates, in order, as (name, bytes)
    events (negative: freed); its output `o` stays. Arguments as the op's (shapes, dtypes
    and contiguity are read, never values)."""
    events: list[tuple[str, int]] = []
    states = _fwd_states(events, q, k, v, g, beta, cu_seqlens, output_final_state, g_cumsum=g_cumsum)
    sizes = dict(events)
    events += [("o", q.shape[0] * q.shape[1] * q.shape[2] * v.shape[-1] * v.element_size())]
    events += [(name, -sizes[name]) for name in states if name != "ht"]
    return events


def kda_bwd_allocations(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum: bool = False, kept: bool = False
):
    """The tensors `triton_op.kda_chunk_bwd_triton` allocates (the forward recompute of
    `kda_fwd_states`, then `chunk_kda_bwd_triton`'s own), in order, as (name, bytes) events
    (negative: freed); its outputs dq, dk, dv, dg, dbeta (and dh0) stay. `kept`: the kept
    pair's backward (`kda.kept`), which reads the forward's residuals (autograd holds them)
    instead of recomputing them: only the chunk layout is built (counted per call here;
    `triton_fwd._chunk_layout` keeps it after its first build, a few KiB). `g_cumsum`: g is
    G (no G of its own; dG is returned as dg)."""
    B, T, H, K = q.shape
    V, TT, C, f32 = v.shape[-1], B * T, KDA_CHUNK, 4
    N, chunks = _chunk_counts(q, cu_seqlens)
    events: list[tuple[str, int]] = []
    if kept:
        states = ["cu_seqlens", "chunk_indices", "chunk_offsets"]
        events += [("cu_seqlens", (N + 1) * 4), ("chunk_indices", chunks * 2 * 4), ("chunk_offsets", (N + 1) * 4)]
        if g_cumsum and _G_copy_bytes(g):
            states.append("G")
            events.append(("G", _G_copy_bytes(g)))
    else:
        states = _fwd_states(events, q, k, v, g, beta, cu_seqlens, output_final_state=False, output_q_decay=False,
                             g_cumsum=g_cumsum)
    copies = [(f"{name}_contiguous", _nbytes(x)) for name, x in
              (("q", q), ("k", k), ("v", v), ("beta", beta), ("do", do)) if not x.is_contiguous()]
    w = q.element_size()  # the walks' tensors are in the input dtype
    scan = [("dh", chunks * H * K * V * w), ("dv_new", TT * H * V * w)]  # stage 1
    if initial_state is not None:
        scan.append(("dh0", N * H * K * V * f32))
    # scale Q e^G for the walk; after it, the walk's inputs are freed (before stage 2)
    scan.append(("q_decay", TT * H * K * w))
    walk_only = ["q_decay"] if kept else ["q_decay", "W", "k_to_end", "decay"]
    # imported here: importing Triton decides interpreted vs compiled kernels for the process
    from titan_moe.ops.kda.triton_bwd import bwd_chunk_config, bwd_intra_bk, bwd_parts_dtype

    NK = K // bwd_chunk_config(K, V)[0]  # stage 2's key blocks: their dbeta shares
    shares = [("dbeta_keys", NK * TT * H * f32)]
    part = TT * H * K * bwd_parts_dtype(q.dtype).itemsize
    chunk = [("dq_part", part), ("dk_part", part), ("dG", TT * H * K * f32), *shares,
             ("dAqk", TT * H * C * f32), ("dAkk", TT * H * C * f32), ("dbeta_part", TT * H * f32), ("dv", _nbytes(v)),
             *[(name, -n) for name, n in shares]]  # stage 2
    intra = [("dq", _nbytes(q)), ("dk", _nbytes(k))]  # stage 3
    NK_intra = K // bwd_intra_bk(K)
    if NK_intra == 1:
        intra.append(("dbeta", _nbytes(beta)))
    else:  # the key blocks' dbeta shares, summed onto dbeta_part by PyTorch
        sum_bytes = TT * H * f32
        intra += [("dbeta_intra_keys", NK_intra * sum_bytes), ("dbeta_keys_sum", sum_bytes)]
        if beta.dtype == torch.float32:  # the sum is dbeta
            intra += [("dbeta", sum_bytes), ("dbeta_keys_sum", -sum_bytes)]
        else:
            intra += [("dbeta_f32", sum_bytes), ("dbeta_keys_sum", -sum_bytes), ("dbeta", _nbytes(beta)),
                      ("dbeta_f32", -sum_bytes)]
    events += copies + scan
    sizes = dict(events)
    events += [(name, -sizes[name]) for name in walk_only]
    dG_returned = g_cumsum and g.dtype == torch.float32
    events += chunk + intra + ([] if dG_returned else [("dg", _nbytes(g))])  # stage 4: dg
    sizes = dict(events)
    work = copies + [(name, n) for name, n in scan + chunk
                     if n > 0 and name not in ("dh0", "dv", "dbeta_keys", *walk_only)
                     and not (dG_returned and name == "dG")]  # dG is dg
    work += [(name, n) for name, n in intra if name == "dbeta_intra_keys"]
    events += [(name, -sizes[name]) for name in states if name not in walk_only] + [(name, -n) for name, n in work]
    return events


def _kda_bwd_kept_allocations(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, *residuals_and_g_cumsum):
    residuals = residuals_and_g_cumsum[:8]
    g_cumsum = bool(residuals_and_g_cumsum[8]) if len(residuals_and_g_cumsum) > 8 else False
    kept = residuals[1].numel() > 0  # empty A_qk: a forward that kept nothing, the backward recomputes
    return kda_bwd_allocations(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, g_cumsum, kept=kept)


_MIRRORED_OPS = {
    "titan_moe::kda_chunk_fwd": kda_fwd_allocations, "titan_moe::kda_chunk_bwd": kda_bwd_allocations,
    "titan_moe::kda_chunk_fwd_kept": kda_fwd_allocations, "titan_moe::kda_chunk_bwd_kept": _kda_bwd_kept_allocations,
}


# =========================================================================== measurement
class _StreamGradients(torch.autograd.Function):
    """Identity on a layer's output stream tensors. Its backward is where the model's
    backward enters the layer: it allocates the gradients of those tensors (as the later
    layers would have left them), marks the counter ("backward") and hands them on."""

    @staticmethod
    def forward(ctx, counter, *tensors):
        ctx.counter = counter
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        fresh = tuple(torch.zeros_like(g) for g in grads)
        ctx.counter.mark("backward")
        return (None, *fresh)


def _leaf_stream(args: ModelArgs, layer_idx: int, T: int, dtype: torch.dtype) -> ResidualStream:
    """The AttnRes stream as layer `layer_idx` receives it, with leaf tensors (zeros)."""
    D, bs = args.dim, args.attn_res_block_size
    n = sources_before_layer(args.attn_res, layer_idx, bs)
    sources = tuple(torch.zeros(1, T, D, dtype=dtype, requires_grad=True) for _ in range(n))
    partial = torch.zeros(1, T, D, dtype=dtype, requires_grad=True)
    used = args.attn_res == "none" or (args.attn_res == "block" and layer_idx % bs != 0)
    return ResidualStream(sources, partial, torch.full((), used), args.attn_res, bs)


def layer_counter(
    layer, args: ModelArgs, layer_idx: int, T: int, stream_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
    full_ac: bool, model_stream: bool = True, rank: RankSetting | None = None,
    attention_chunks: int | None = CP_ATTENTION_CHUNKS,
) -> LiveBytes:
    """One forward and backward of `layer` (a `zero_layer`) over one packed row of T tokens
    (one document) under a `LiveBytes`, marked "forward" where its forward starts and
    "backward" where its backward does; returns the counter (`peak - start`: what the
    backward adds at its high-water mark). `full_ac`: the layer under non-reentrant
    `torch.utils.checkpoint`. Run it under a FakeTensorMode (or on small real tensors).

    `model_stream=True` (the planner's): stream inputs are leaves, every output stream tensor
    receives a gradient, allocated before the backward's start (module docstring). False:
    what `profiling/layer_memory.py` measures on the GPU: the stream started from a
    `[1, T, D]` embedding, only the output partial sum given a gradient (by
    `(out * probe).sum()`), the start at `backward()`: the incoming gradient, the stream's
    input gradients and the embedding's are then part of the transient.

    `rank`: `layer` is installed as that rank of a context-parallel group
    (`context_parallel.RankSetting`; run inside `context_parallel.fake_group`) and T is its
    segment of a row of `cp T` tokens, one document; its attention calls are then split into
    `attention_chunks` query chunks each (None: the layer's own chunk size).
    """
    hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in layer.parameters()]
    if rank is not None:  # the batch's document facts, made before the counter: not the layer's
        rank.set_rows(layer, args, T)
        documents = {}
    else:
        doc_ids_BT = torch.zeros(1, T, dtype=torch.int32)
        if args.layer_kinds()[layer_idx] == "mla" and planned_attention(args.mla_attention) == "chunked":
            # One document: the mask-free paths (varlen on CUDA) attend causally over the whole row,
            # which plain causal SDPA does with the same O(T) allocations at every T (the chunked
            # stand-in's query loop allocates per chunk, not as an affine function of T).
            doc_ids_BT = None
        documents = dict(doc_ids_BT=doc_ids_BT, cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    if model_stream:
        stream = _leaf_stream(args, layer_idx, T, stream_dtype)
    else:
        embed_BTD = torch.zeros(1, T, args.dim, dtype=stream_dtype, requires_grad=True)
        stream = ResidualStream.start(embed_BTD, args.attn_res, args.n_layers, args.attn_res_block_size)
        probe_BTD = torch.zeros(1, T, args.dim, dtype=stream_dtype)
    counter = LiveBytes(attention_chunks=attention_chunks if rank is not None else None)
    amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()

    def run(*tensors):
        return layer(tensors, **documents)

    try:
        with warnings.catch_warnings(), GpuKernelSaves(values=False), counter:
            warnings.simplefilter("ignore")  # rms_norm's "cannot dispatch to fused" dtype notes
            counter.mark("forward")
            with amp:
                if full_ac:  # the recompute runs in backward, outside this block: re-enter the stand-ins
                    out = checkpoint(run, *stream.tensors(), use_reentrant=False, preserve_rng_state=False,
                                     context_fn=lambda: (contextlib.nullcontext(), GpuKernelSaves(values=False)))
                else:
                    out = run(*stream.tensors())
            if model_stream:
                floats = [t for t in torch.utils._pytree.tree_leaves(out) if t.is_floating_point() and t.requires_grad]
                loss = sum(t.sum() for t in _StreamGradients.apply(counter, *floats))
                del floats, out
            else:  # layer_memory.py holds `out` through the backward
                loss = (out[2] * probe_BTD).sum()
            counter.mark("loss" if model_stream else "backward")
            loss.backward()
        return counter
    finally:
        for hook in hooks:
            hook.remove()


def backward_peak(*args, **kwargs) -> int:
    """Bytes the backward adds at its high-water mark, every allocation counted (arguments
    as `layer_counter`)."""
    counter = layer_counter(*args, **kwargs)
    return counter.peak - counter.start


@dataclass(frozen=True)
class PeakProfile:
    """The high-water mark of one stretch of a layer's step (its forward, or its backward),
    above the bytes at its start, as a function of the local tokens `t` and the sum over
    sequences of `T^2`: `max((L t + Q seq_sq) for (L, Q) in points)`, each point the bytes
    per token `L` and per sequence per T^2 `Q` alive at one op (only the Pareto-optimal
    ones are kept). One pair per op, not one fit of the peak: where the peak falls may move
    with T (a T^2 mask outgrowing the per-token tensors)."""

    points: tuple[tuple[float, float], ...] = ((0.0, 0.0),)

    def at(self, tokens: float, seq_sq: float) -> float:
        return max(l * tokens + q * seq_sq for l, q in self.points)

    @property
    def per_token(self) -> float:
        """The largest per-token term (the peak per token where T^2 terms do not matter)."""
        return max(l for l, _ in self.points)


def _pareto(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    front: list[tuple[float, float]] = []
    for l, q in sorted(set(points), key=lambda p: (-p[0], -p[1])):
        if not front or q > front[-1][1]:
            front.append((l, q))
    return tuple(front)


def peak_profiles(runs: list[LiveBytes], tokens: tuple[int, int, int]) -> dict[str, PeakProfile]:
    """`PeakProfile` of every marked stretch of three runs of the same ops at the equally
    spaced lengths `tokens`: allocation i (and spike j) is the same tensor in each run, its
    sizes give `c + L T + Q T^2` (exact: shapes are affine in T, or T^2 for the mask), the
    constant c is dropped (weights' casts and gradients, scalars: module docstring, "Fit").
    Keyed by mark name (the last stretch of a name)."""
    if len({tuple(kind for kind, _ in run.events) for run in runs}) != 1 or len({len(r.sizes) for r in runs}) != 1:
        raise RuntimeError("the measuring runs did not allocate the same tensors in the same order")
    alloc = [_fit_tokens(list(sizes), tokens) for sizes in zip(*(run.sizes for run in runs))]
    spike = [_fit_tokens(list(sizes), tokens) for sizes in zip(*(run.spikes for run in runs))]
    profiles: dict[str, PeakProfile] = {}
    L = Q = L0 = Q0 = 0.0
    name, points = None, [(0.0, 0.0)]
    for kind, value in runs[0].events + [("mark", None)]:
        if kind == "alloc" or kind == "free":
            sign = 1 if kind == "alloc" else -1
            L, Q = L + sign * alloc[value][0], Q + sign * alloc[value][1]
        elif kind == "op":
            points.append((L - L0, Q - Q0))
        elif kind == "spike":
            points.append((L - L0 + spike[value][0], Q - Q0 + spike[value][1]))
        else:
            if name is not None:
                profiles[name] = PeakProfile(_pareto(points))
            name, points, L0, Q0 = value, [(0.0, 0.0)], L, Q
    return profiles


@dataclass(frozen=True)
class LayerPeaks:
    """What one layer kind's step allocates above the bytes alive at the start of its
    forward (`forward`) and of its backward (`backward`), without AC and under full AC
    (`full_forward`; `full_backward`: recompute and backward together)."""

    kind: str
    forward: PeakProfile
    backward: PeakProfile
    full_forward: PeakProfile
    full_backward: PeakProfile


def measure_layer_peaks(
    args: ModelArgs, layer_idx: int, prec: Precision, fsdp_enabled: bool,
    tokens: tuple[int, int, int] = TRANSIENT_TOKENS, model_stream: bool = True, fake: bool | None = None,
    rank: RankSetting | None = None,
) -> LayerPeaks:
    """`layer_counter` runs of decoder layer `layer_idx` without AC and under full AC at three
    lengths, turned into `PeakProfile`s (module docstring, "Fit"). Precision as
    `eager.measure_eager_layer`; with all `n_routed_experts` experts. `fake=None`: real CPU
    tensors when the layer's weights and their autocast copies fit `REAL_TENSOR_BUDGET`, else
    fake ones (the same bytes: a test checks it). `rank`: the layer as that rank of a
    context-parallel group runs it, `tokens` its local lengths (`layer_counter`; the `Q` terms
    are then its attention's score blocks: `context_parallel`, "How the measurement maps").
    """
    if any(T % KDA_CHUNK for T in tokens) or tokens[2] - tokens[1] != tokens[1] - tokens[0]:
        raise ValueError(f"measuring lengths must be equally spaced multiples of {KDA_CHUNK}, got {tokens}")
    P, a = _DTYPES[prec.param], _DTYPES[prec.compute]
    param_dtype = stream_dtype = a if fsdp_enabled else P
    autocast_dtype = None if fsdp_enabled or prec.compute == 4 else a
    if fake is None and rank is not None:
        fake = True  # context-parallel layers: shapes only (the fake group's collectives move no data)
    if fake is None:
        with torch.device("meta"):
            numel = sum(p.numel() for p in DecoderLayer(layer_idx, args).parameters())
        fake = numel * (param_dtype.itemsize + (prec.compute if autocast_dtype is not None else 0)) > REAL_TENSOR_BUDGET
    with FakeTensorMode(allow_non_fake_inputs=False) if fake else _one_thread():
        layer = zero_layer(args, layer_idx, param_dtype)
        if rank is not None:
            rank.install(layer)
        none, full = (
            peak_profiles([layer_counter(layer, args, layer_idx, T, stream_dtype, autocast_dtype, full_ac, model_stream,
                                         rank) for T in tokens], tokens)
            for full_ac in (False, True)
        )
    kind = args.layer_kinds()[layer_idx] + ("+moe" if args.is_moe_layer(layer_idx) else "+dense")
    return LayerPeaks(kind, none["forward"], none["backward"], full["forward"], full["backward"])


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread while small real tensors are measured: their ops take microseconds,
    and a second thread only adds contention (seconds on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_PEAKS_CACHE: dict[tuple, LayerPeaks] = {}


def layer_peaks(args: ModelArgs, prec: Precision, fsdp_enabled: bool, cp: int = 1,
                options: CPOptions = CPOptions()) -> dict[tuple[str, bool], LayerPeaks]:
    """`measure_layer_peaks` per layer kind, cached per model, precision setting and
    context-parallel degree (`eager.per_layer_kind`)."""
    return per_layer_kind(_PEAKS_CACHE, args, prec, fsdp_enabled, measure_layer_peaks, cp, options)
