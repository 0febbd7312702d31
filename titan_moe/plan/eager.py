"""Eager activations (`measure_eager_layer`, the kept bytes per token of each layer kind for
`[compile] enable = false`; they replace the compiled count as the layer's `kept`):
  * what runs: the first layer of each kind (KDA/MLA x dense/MoE), built at the configured
    widths with zero weights, forward in training mode as the Decoder runs it: an AttnRes
    stream started from a `[1, T, D]` embedding, one packed document (`doc_ids` and
    `cu_seqlens` given, as the loader always does: MLA attends on the CPU stand-in of its
    CUDA path (`planned_attention`: the dense `[B, 1, T, T]` mask for `dense`, none
    otherwise), the short convolution masks its taps). Precision as training: without FSDP weights and
    stream in `training.dtype` under CPU autocast to the compute dtype (torchtitan's AMP);
    with FSDP both in the compute dtype, no autocast (FSDP's mixed precision).
  * what is counted: `torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd
    saves; the bytes of the distinct storages (deduplicated by data pointer) are summed,
    minus the parameters and the stream's own tensors (the two sub-layers' input streams:
    the AttnRes stream term counts those). At T = 64, 128, 192 this gives `c + l T + q T^2`:
    `l` is the layer's kept bytes per token; the constant `c` (autocast's weight copies,
    counted by `autocast_weight_copies`; fp32 weight casts, the router's one being the
    per-layer constant) drops out.
  * GPU kernels, handled explicitly: for these shapes CPU SDPA takes the math path (fp32
    upcasts, `[H, T, T]` probabilities saved: 32 B per T^2 per sequence at the small_1gpu
    widths) and the CPU build decomposes RMSNorm (also saving the normalised input), where
    CUDA runs the memory-efficient attention kernel and the fused `_fused_rms_norm`. While
    measuring, a TorchFunctionMode routes both to stand-ins that save what the CUDA kernels
    save: SDPA q, k, v, output, fp32 logsumexp `[B, H, ceil32(T)]` and the boolean mask as
    the additive bias `scaled_dot_product_attention` converts it to, in the compute dtype;
    RMSNorm (only when the weight dtype matches the input's, which the fused kernel needs;
    otherwise CUDA runs the same composite) its input and fp32 rstd. So `q` is the bias,
    `a` bytes per T^2 per sequence in each MLA layer, and 0 elsewhere; it is counted as
    `q * local_batch * (seq_len / cp)^2`. Under CP (`context_parallel`) a layer is measured as
    one rank of the group runs it (on torch's fake process group, fake tensors), per local
    token: nothing of size T^2 is kept there (the chunked latent attention saves no mask).
    Under the `kda_keep` choice (on by default) the kept KDA forward returns zero residuals of
    the shapes its CUDA kernels keep (`kda.kept.cuda_shaped_residuals`), so they are counted
    as saved.
    CUDA autocast also runs softmax, sum, exp, ... in fp32 where CPU autocast does not; here
    that only touches tensors of a few bytes per token and is not corrected.
  * routed experts: a MoE layer with `n > top_k + 4` is built with `top_k + 2` and `top_k + 4`
    experts and `l` extrapolated linearly to n (the router's `[T, n]` scores are the only
    per-token terms in n; the tests check the extrapolation against a full build).
  * cost: real CPU tensors when the layer's weights and their autocast copies fit 2 GiB
    (small_1gpu: about 8 s per precision setting on two cores); otherwise fake tensors
    (`FakeTensorMode`: the same Python, ops, dtypes, autocast and saved tensors, with no
    storage or arithmetic; k3 at dim 7168: seconds and under 0.5 GB), which agree byte for
    byte with the CPU run on the test config. Cached per model and precision setting.
  * small_1gpu (fp32 weights, bf16 autocast), KiB per token, eager vs compiled: kda+dense 91
    vs 60, kda+moe 133 vs 105, mla+moe 108 (+ 2 B x T^2) vs 104. Before four changes they
    were 194, 267 and 218: SiTU-GLU kept seven `[rows, hidden]` intermediates (now its two
    pre-activations), the short convolution its fp32 padded input and pre-activation (now
    its bf16 input), each AttnRes mixer kept two bf16 copies of the `[S, T, D]` sources (now
    fp32 with no normalised copy), and autocast made a bf16 copy of a sub-layer's input for
    every projection (now one cast). What remains: KDA's gate, L2 norm, output norm and
    output gate keep fp32 intermediates; the MLA mask.
  * AC accounting: op-level SAC keeps the same op outputs as the compiled count (it chooses by
    op) and recomputes the rest of the measured set. What the backward adds ("transient") and,
    under full AC, the recompute and backward together are measured too, op by op
    (`transient.measure_layer_peaks`, with the stand-ins above allocating in their backward
    what the CUDA kernels do); fused layers keep the heuristic (2 x the largest kept entry +
    workspace). Not modelled: the head's eager extras (its final mixer).
AC modes (torchtitan's `apply_ac`, one checkpoint per decoder layer). Per layer, what it
holds from its forward to its backward ("held") and what it adds while it runs backward
("in backward"); "whole" = its kept tensors + T^2 term + per-layer constant + autocast copies:
  none:      held = whole; in backward = its transient (eager: measured, `transient_at`).
  full:      held = nothing (its input is a stream tensor, counted with the stream);
             in backward = whole (recomputed) + its transient; eager: the measured
             recompute and backward (`full_ac_backward_at`) + constant + copies.
  selective: follows the config's `activation_checkpoint.selective_ac_option`.
             "op" (op-level SAC with torchtitan's save list): held = the outputs of every
             other `aten.mm` in forward order (1st, 3rd, ...) and the SDPA outputs; in
             backward = the recomputed rest of the kept tensors (custom ops, KDA and grouped
             GEMM, included) + T^2 term + constant + copies + its transient (no AC's).
             An integer k (torchtitan's default "2"): every k-th layer fully checkpointed,
             the others not at all.
The step walk (`step.py`) also has a phase per layer's forward, with its measured forward peak.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import ResidualStream
from titan_moe.model.decoder import DecoderLayer
from titan_moe.ops.kda.kept import cuda_shaped_residuals

from titan_moe.plan.context_parallel import CPOptions, RankSetting, fake_group
from titan_moe.plan.layout import GIB, KDA_CHUNK, Precision

# =========================================================================== eager activations
EAGER_TOKENS = (64, 128, 192)  # measuring lengths: equally spaced multiples of the KDA chunk
EAGER_EXTRA_EXPERTS = (2, 4)  # MoE layers are built with top_k + these routed experts
EAGER_CPU_BUDGET = 2 * GIB  # a layer whose weights (+ autocast copies) need more is measured on fake tensors
_MEASURE_DTYPES = {4: torch.float32, 2: torch.bfloat16}  # activation bytes only depend on the width


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class _EfficientAttentionSaves(torch.autograd.Function):
    """SDPA that saves, and in its backward allocates, what the GPU's memory-efficient kernel
    does (`_scaled_dot_product_efficient_attention` and its backward, torch 2.11).

    A measuring device. CPU SDPA takes the math path for our shapes (fp32 upcasts, `[B, H, T,
    T]` probabilities saved), which the GPU kernel does not. Forward: the values come from
    any backend under no_grad when `values` is set, else the output is zeros (only bytes
    wanted: then no CPU temporaries either); it saves q, k, v (the
    callers' tensors), the output (written `[B, T, H, v]` by the kernel), the fp32 logsumexp
    `[B, H, ceil32(T)]` and, for a boolean mask, the additive bias in q's dtype that
    `scaled_dot_product_attention` converts it to (last dim padded to 16).

    Backward (values are zeros; `_efficient_attention_backward` in
    aten/src/ATen/native/transformers/cuda/attention_backward.cu): the gradient of the output
    made contiguous in `[B, T, H, v]`, dq, dk, dv in the input dtype and `[B, T, H, ·]`
    layout, fp32 `delta` `[B, H, T]`, and the kernel's fp32 workspace
    (`mem_eff_attention/kernel_backward.h`, `Params::workspace_size`): the dQ accumulator,
    `ceil(T / BI) * ceil(dqk / BJ) * (BI * BJ + 4)` floats per (batch, head), plus dK/dV
    accumulators of `splits * BJ * (ceil_BI(dqk) + ceil_BI(dv))` floats when the head dim
    exceeds the block (`kOutputInRF` false), `splits = min(ceil(T / BJ), 200 // (B H))`, taken
    at its cap (training lengths: T >= 1600 at 8 heads).
    Blocks: 64 x 64 for head dims over 128 (the `k65536` kernels), 128 x 64 otherwise (the
    `k128` kernels of sm80+; an assumption, not read from a GPU). dQ: `dqk * 4` bytes per
    token and head; the dK/dV part does not grow with T (16 MiB at small_1gpu's 8 heads).
    """

    @staticmethod
    def forward(ctx, q_BHTK, k_BHTK, v_BHTV, mask, scale, is_causal, values):
        B, H, T, _ = q_BHTK.shape
        if values:
            with torch.no_grad():
                o_BHTV = torch.nn.functional.scaled_dot_product_attention(
                    q_BHTK, k_BHTK, v_BHTV, attn_mask=mask, is_causal=is_causal, scale=scale
                )
            out_BHTV = o_BHTV.transpose(1, 2).contiguous().transpose(1, 2)
        else:
            out_BHTV = v_BHTV.new_zeros(B, T, H, v_BHTV.shape[-1]).transpose(1, 2)
        lse_BHT = q_BHTK.new_empty(B, H, _round_up(T, 32), dtype=torch.float32)
        saved = [q_BHTK, k_BHTK, v_BHTV, out_BHTV, lse_BHT]
        if mask is not None:
            if mask.dtype == torch.bool:
                Tk = k_BHTK.shape[2]
                bias = q_BHTK.new_zeros(*mask.shape[:-1], _round_up(Tk, 16))[..., :Tk]
                mask = bias.masked_fill_(~mask, float("-inf"))
            saved.append(mask)
        ctx.save_for_backward(*saved)
        return out_BHTV

    @staticmethod
    def backward(ctx, grad_BHTV):
        q_BHTK, k_BHTK, v_BHTV = ctx.saved_tensors[:3]
        B, H, T, K = q_BHTK.shape
        Tk, V = k_BHTK.shape[2], v_BHTV.shape[3]
        grad_BTHV = grad_BHTV.transpose(1, 2).contiguous()
        dq_BHTK = q_BHTK.new_zeros(B, T, H, K).transpose(1, 2)
        dk_BHTK = k_BHTK.new_zeros(B, Tk, H, K).transpose(1, 2)
        dv_BHTV = v_BHTV.new_zeros(B, Tk, H, V).transpose(1, 2)
        delta_BHT = q_BHTK.new_zeros(B, H, T, dtype=torch.float32)
        block_i, block_j = (64, 64) if max(K, V) > 128 else (128, 64)
        floats = -(-T // block_i) * -(-K // block_j) * (block_i * block_j + 4)
        if max(K, V) > block_i:  # key splits at their cap, which training lengths reach
            floats += max(1, 200 // (B * H)) * block_j * (_round_up(K, block_i) + _round_up(V, block_i))
        workspace = q_BHTK.new_zeros(B * H * _round_up(floats, 4) * 4, dtype=torch.uint8)
        del grad_BTHV, delta_BHT, workspace
        return dq_BHTK, dk_BHTK, dv_BHTV, None, None, None, None


class _FusedRMSNormSaves(torch.autograd.Function):
    """RMSNorm that saves what CUDA's fused `_fused_rms_norm` saves: input, fp32 rstd `[..., 1]`
    and the weight. A measuring device (the CPU build decomposes rms_norm and also saves the
    normalised input): the values come from the composite when `values` is set, else the
    output is zeros; the backward allocates what `_fused_rms_norm_backward` returns,
    the input gradient and the weight gradient (values: zeros)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps, values):
        dims = tuple(range(-len(normalized_shape), 0))
        if values:
            with torch.no_grad():
                y = torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
                eps = torch.finfo(x.dtype).eps if eps is None else eps
                rstd = torch.rsqrt(x.float().square().mean(dims, keepdim=True) + eps)
        else:
            y = torch.zeros_like(x)
            rstd = x.new_zeros(*x.shape[: x.dim() - len(dims)], *(1,) * len(dims), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, _, weight = ctx.saved_tensors
        dx = torch.zeros_like(x)
        dweight = torch.zeros_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        return dx, None, dweight, None, None


def _sdpa_saves(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                *, values: bool = True):
    if dropout_p or enable_gqa:
        raise ValueError("the eager-activation measurement models SDPA without dropout or GQA")
    if torch.is_autocast_enabled("cpu"):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return _EfficientAttentionSaves.apply(query, key, value, attn_mask, scale, is_causal, values)


class GpuKernelSaves(torch.overrides.TorchFunctionMode):
    """Routes SDPA and (matching-dtype) RMSNorm to stand-ins that save, and allocate in their
    backward, what their CUDA kernels do, and has the kept KDA forward return the CUDA
    kernels' residuals (`kda.kept.cuda_shaped_residuals`); every other op runs as is. RMSNorm with an input
    dtype other than the weight's falls back to the composite on CUDA too, so it is left
    alone. `values=False`: the stand-ins return zeros (only bytes are measured; no CPU-only
    temporaries)."""

    def __init__(self, values: bool = True):
        super().__init__()
        self.values = values
        self._kda_residuals = None

    def __enter__(self):
        # the kept KDA forward (the `kda_keep` choice) returns the CUDA kernels' residuals
        self._kda_residuals = cuda_shaped_residuals()
        self._kda_residuals.__enter__()
        return super().__enter__()

    def __exit__(self, *exc_info):
        try:
            return super().__exit__(*exc_info)
        finally:
            self._kda_residuals.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _sdpa_saves(*args, **kwargs, values=self.values)
        if func is torch.nn.functional.rms_norm:
            names = ("input", "normalized_shape", "weight", "eps")
            bound = dict(zip(names, args)) | kwargs
            x, weight = bound["input"], bound.get("weight")
            if weight is None or weight.dtype == x.dtype:
                shape = tuple(bound["normalized_shape"])
                return _FusedRMSNormSaves.apply(x, shape, weight, bound.get("eps"), self.values)
        return func(*args, **kwargs)


def _storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of a storage: its data pointer (fake tensors have none: the StorageImpl)."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def planned_attention(choice: str) -> str:
    """The CPU stand-in for the MLA attention path a CUDA run of `model.mla_attention = choice`
    takes: "dense" for dense (the SDPA stand-in then saves the mask as CUDA does); "chunked"
    for auto (varlen on CUDA), varlen and chunked, which all save q, k, v, the output and an
    fp32 log-sum-exp [B, H, T] and nothing of size T^2 (varlen's v and output are padded to
    the qk head dim: slightly more)."""
    return "dense" if choice == "dense" else "chunked"


def zero_layer(args: ModelArgs, layer_idx: int, param_dtype: torch.dtype) -> DecoderLayer:
    """Decoder layer `layer_idx` with zero parameters in `param_dtype` (buffers keep their
    dtypes), in training mode, its MLA attention on the CPU stand-in of the CUDA path
    (`planned_attention`). Under a FakeTensorMode its tensors are fake (no storage)."""
    args = replace(args, mla_attention=planned_attention(args.mla_attention))
    with torch.device("meta"):
        layer = DecoderLayer(layer_idx, args)
    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.zeros(p.shape, dtype=param_dtype)))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.zeros(b.shape, dtype=b.dtype))
    return layer.train()


def eager_saved_bytes(
    layer: DecoderLayer, args: ModelArgs, T: int, stream_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
    rank: RankSetting | None = None,
) -> int:
    """Bytes of the distinct storages eager autograd saves in one forward of `layer` over one
    packed row of T tokens (one document: `doc_ids` and `cu_seqlens` given, as in training).

    The input is an AttnRes stream started from a `[1, T, dim]` embedding in `stream_dtype`,
    as the Decoder builds it; `autocast_dtype` (or None) is the CPU autocast dtype. SDPA and
    RMSNorm save what their CUDA kernels save (`GpuKernelSaves`). Not counted: parameters
    and the stream's own tensors (both sub-layers' input streams: `_stream_bytes_per_token`
    counts them). Storages are deduplicated by identity and held until counted.
    `rank`: the layer is installed as that rank of a context-parallel group (run it inside
    `context_parallel.fake_group`); T is then its segment of a row of `cp T` tokens, one
    document, and the batch's document facts are not counted (one set for all layers).
    """
    excluded = {_storage_key(p.untyped_storage()) for p in layer.parameters()}
    documents: dict = {}
    if rank is not None:
        excluded.update(_storage_key(t.untyped_storage()) for t in rank.set_rows(layer, args, T))

    def exclude_stream(module, inputs):
        stream = inputs[0]
        excluded.update(_storage_key(t.untyped_storage()) for t in (*stream.sources, stream.partial_BTD))

    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[_storage_key(storage)] = storage
        return t

    embed_BTD = torch.zeros(1, T, args.dim, dtype=stream_dtype, requires_grad=True)
    stream = ResidualStream.start(embed_BTD, args.attn_res, args.n_layers, args.attn_res_block_size)
    if rank is None:  # one packed document; under CP the rows come from the layer's slot
        documents = dict(doc_ids_BT=torch.zeros(1, T, dtype=torch.int32),
                         cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    hooks = [mix.register_forward_pre_hook(exclude_stream) for mix in (layer.attention_mix, layer.ffn_mix)]
    try:
        with warnings.catch_warnings(), GpuKernelSaves(), amp:
            warnings.simplefilter("ignore")  # rms_norm's "cannot dispatch to fused" dtype notes
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(stream.tensors(), **documents)
    finally:
        for hook in hooks:
            hook.remove()
    del out
    return sum(st.nbytes() for key, st in saved.items() if key not in excluded)


@dataclass(frozen=True)
class EagerProfile:
    """What eager autograd keeps of one layer kind: `per_token` bytes per token plus
    `per_seq_sq` bytes per sequence per T^2 (the MLA document mask), with how it was measured:
    on `fake` tensors or real CPU ones, and with which routed-expert counts (`experts`, empty
    for a dense layer)."""

    kind: str
    per_token: float
    per_seq_sq: float
    fake: bool
    experts: tuple[int, ...]


def _fit_tokens(bytes_T: list[int], tokens: tuple[int, ...], quad: float | None = None) -> tuple[float, float]:
    """(per token, per T^2) of `c + l T + q T^2` through the first two or all three points
    (equally spaced T); with two points `quad` must be given."""
    h = tokens[1] - tokens[0]
    if quad is None:
        assert len(bytes_T) == 3 and tokens[2] - tokens[1] == h, "three equally spaced lengths"
        quad = (bytes_T[2] - 2 * bytes_T[1] + bytes_T[0]) / (2 * h * h)
    return (bytes_T[1] - bytes_T[0]) / h - quad * (tokens[0] + tokens[1]), quad


def measure_eager_layer(
    args: ModelArgs, layer_idx: int, prec: Precision, fsdp_enabled: bool,
    tokens: tuple[int, int, int] = EAGER_TOKENS, fake: bool | None = None, rank: RankSetting | None = None,
) -> EagerProfile:
    """Measure the bytes eager autograd keeps per token of decoder layer `layer_idx`.

    Precision as training runs it: without FSDP the parameters and the stream are in
    `training.dtype` under CPU autocast to the compute dtype (torchtitan's AMP); with FSDP
    both are in the compute dtype and there is no autocast (FSDP's mixed precision). Saved
    bytes at three lengths give `c + l T + q T^2`: `l` per token, `q` per T^2; the constant
    (autocast weight copies, fp32 weight casts) drops out. A MoE layer with more than
    `top_k + 4` routed experts is built with `top_k + 2` and `top_k + 4` and `l` is
    extrapolated linearly to `n_routed_experts` (the router's `[T, n]` tensors are the only
    per-token terms in n). `fake=None` measures on the CPU when the layer's weights and their
    autocast copies fit `EAGER_CPU_BUDGET`, else on fake tensors (FakeTensorMode: the same
    ops, dtypes, autocast and saved tensors, no storage or arithmetic). `rank`: the layer as
    that rank of a context-parallel group runs it, per local token (`eager_saved_bytes`;
    inside `context_parallel.fake_group`).
    """
    if any(T % KDA_CHUNK for T in tokens):
        raise ValueError(f"measuring lengths must be multiples of {KDA_CHUNK}, got {tokens}")
    P, a = _MEASURE_DTYPES[prec.param], _MEASURE_DTYPES[prec.compute]
    param_dtype = stream_dtype = a if fsdp_enabled else P
    autocast_dtype = None if fsdp_enabled or prec.compute == 4 else a
    n, k = args.n_routed_experts, args.top_k
    moe = args.is_moe_layer(layer_idx)
    counts = tuple(k + e for e in EAGER_EXTRA_EXPERTS) if moe and n > k + max(EAGER_EXTRA_EXPERTS) else (n,)
    if fake is None and rank is not None:
        fake = True  # context-parallel layers: shapes only (the fake group's collectives move no data)
    if fake is None:
        with torch.device("meta"):
            largest = DecoderLayer(layer_idx, replace(args, n_routed_experts=max(counts)))
        numel = sum(p.numel() for p in largest.parameters())
        copy_bytes = prec.compute if autocast_dtype is not None else 0
        fake = numel * (param_dtype.itemsize + copy_bytes) > EAGER_CPU_BUDGET
    mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else contextlib.nullcontext()
    per_token: list[float] = []
    quad = None
    with mode:
        for count in counts:
            layer = zero_layer(replace(args, n_routed_experts=count), layer_idx, param_dtype)
            if rank is not None:
                rank.install(layer)
            lengths = tokens if quad is None else tokens[:2]
            measured = [eager_saved_bytes(layer, args, T, stream_dtype, autocast_dtype, rank) for T in lengths]
            line, quad = _fit_tokens(measured, tokens, quad)
            per_token.append(line)
            del layer
    if len(counts) == 2:
        slope = (per_token[1] - per_token[0]) / (counts[1] - counts[0])
        per_token = [per_token[0] + slope * (n - counts[0])]
    kind = args.layer_kinds()[layer_idx] + ("+moe" if moe else "+dense")
    return EagerProfile(kind, per_token[0], quad, fake, counts if moe else ())


_EAGER_CACHE: dict[tuple, EagerProfile] = {}


def _kernel_switches() -> tuple[bool, str]:
    """(kept KDA forward, SiTU-GLU's CUDA path): the kernel choices that change what a layer
    keeps or allocates, read per call like the ops read them."""
    from titan_moe.ops import choices
    from titan_moe.ops.kda import keep_selected

    return (keep_selected(), choices.pick_backend(choices.current().situ, "cuda"))


def per_layer_kind(cache: dict, args: ModelArgs, prec: Precision, fsdp_enabled: bool, measure, cp: int = 1,
                   options: CPOptions = CPOptions()) -> dict:
    """`measure(args, layer_idx, prec, fsdp_enabled)` for the first layer of each (kind,
    is_moe), as {(kind, is_moe): result}, kept in `cache` per model, precision setting and
    the kernel switches that change what a layer keeps (`_kernel_switches`). `cp > 1`: each
    kind as the rank `options` names (`CPOptions.measured_rank`) of a context-parallel group
    of `cp` runs it, measured on torch's fake process group (`measure(..., rank=...)`)."""
    key = (repr(args), prec.param, prec.compute, fsdp_enabled, _kernel_switches())
    results = {}
    for i, kind in enumerate(args.layer_kinds()):
        kind_key = (kind, args.is_moe_layer(i))
        if kind_key in results:
            continue
        rank = RankSetting(options.measured_rank(kind, cp), cp, options.balance) if cp > 1 else None
        if (key, kind_key, rank) not in cache:  # one measurement per kind and rank
            if rank is None:
                cache[key, kind_key, rank] = measure(args, i, prec, fsdp_enabled)
            else:
                with fake_group(rank.rank, cp):
                    cache[key, kind_key, rank] = measure(args, i, prec, fsdp_enabled, rank=rank)
        results[kind_key] = cache[key, kind_key, rank]
    return results


def eager_profiles(args: ModelArgs, prec: Precision, fsdp_enabled: bool, cp: int = 1,
                   options: CPOptions = CPOptions()) -> dict[tuple[str, bool], EagerProfile]:
    """`measure_eager_layer` per layer kind, cached (the layouts of one plan share two
    precision settings, with and without FSDP, and one set per context-parallel degree)."""
    return per_layer_kind(_EAGER_CACHE, args, prec, fsdp_enabled, measure_eager_layer, cp, options)

