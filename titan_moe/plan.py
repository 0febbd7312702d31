"""Plan per-GPU memory for FSDP2 + expert parallelism (EP) + context parallelism (CP) layouts.

    python -m titan_moe.plan --job.config_file configs/k3.toml --gpus 2048 --gpu-mem-gib 141 \
        [--ac none|selective|full] [--seq-len S] [--local-batch B] [--headroom 0.1] [--hsdp] [--top 5] \
        [--activations eager|compiled]

Any other `--section.key value` overrides the config, as for training (e.g.
`--training.dtype float32` for fp32 master weights). `--activations` picks the activation
model: "compiled" counts what fused (compiled) layers keep, "eager" measures what eager
PyTorch keeps (below); the default follows the config (`[compile] enable` with "model" in
`components`: compiled, else eager). Prints a table of layouts for the given GPU count
(memory per GPU with each activation-checkpointing mode), the smallest fitting layouts, the
fewest GPUs (powers of two up to 4096) at which any layout fits, and, as the last line, one
JSON object; each layout's entry names the phase of the step where each AC mode peaks
(`peak_phase`, see "The step walk"). Memory is a model, not a measurement. Checked against the
peak allocated memory of eager `small_1gpu` runs on one H200 (the maximum over steps 1-3;
`profiling/memory_check.py`, table in BENCHMARKS.md), planned with the eager model: AC none
8K 51.2 GiB vs 52.45 measured (-2%), 32K 159 GiB where the run ran out of memory (> 138 GiB
allocated); full AC 8K 22.8 vs 22.43 (+2%), 32K 32.8 vs 31.11 (+5%). The plans are on the
model code of this revision, the runs on an earlier MoE layer (for which the activation
model gave up to 1 GiB more); the constants were not fitted to these runs. Before the step
walk the planner added all gradients, the whole AttnRes stream and the largest transient at
once: +9% (8K) and +23% (32K) over the full-AC runs. The compiled model and multi-GPU layouts
are not checked against compiled runs yet.

Layouts (torchtitan 0.2.2's `ParallelDims`): `N = dp_replicate * dp_shard * cp` GPUs (no TP,
no PP). FSDP shards over `fsdp = dp_shard * cp`; HSDP replicas (`dp_replicate`) hold full
copies of the shards and reduce no memory. EP takes its degree from the FSDP ranks:
`ep | dp_shard * cp` and `ep | n_routed_experts`; the routed experts are split over EP on
dim 0 and then FSDP-sharded over the remaining `efsdp = dp_shard * cp / ep` ranks. Enumerated:
`cp in {1, 2, 4, 8}` dividing N and seq_len, `dp_replicate = 1` (with `--hsdp`: every power of
two leaving `dp_shard * cp > 1`), every such `ep`. (Our `parallelize.py` does not wire EP or
CP yet; the plan describes the torchtitan layouts they are meant to follow.)

Bytes. `P` = bytes of `training.dtype` (what parameters, gradients and optimizer states are
stored in: torchtitan builds the model under that default dtype; bf16 means no fp32 master
copy), `a` = bytes of `training.mixed_precision_param` (the compute dtype: FSDP all-gathers
in it, matmuls produce it), reduce dtype fp32 (4 B). Stream dtype `s` = `a` under FSDP (the
embedding weight is gathered in `a`), `P` without FSDP (one GPU: autocast leaves the
embedding, so the AttnRes stream, in the parameter dtype).

Parameters, per GPU (from the model built on the meta device, `named_parameters`):
  * classes: routed experts (`*.feed_forward.experts.*`, stacked `[E, ...]`) and all others.
  * FSDP2 shards each parameter on dim 0 with `torch.chunk` and pads every shard to the first
    chunk: `shard(p, w) = ceil(p.shape[0] / w) * prod(p.shape[1:])`.
  * non-expert: `shard(p, dp_shard * cp)`.
  * experts, `ep = 1`: `shard(p, dp_shard * cp)` (they live in their layer's FSDP unit).
  * experts, `ep > 1`: `E/ep` local experts, FSDP over `efsdp`; on dim 0, or on dim 1 when
    `efsdp * ep > E` (torchtitan's rule): `(E/ep) * ceil(shape[1] / efsdp) * shape[2]`.
    Without padding this is `expert_params / (dp_shard * cp)` whatever `ep` is: EP moves
    experts between GPUs but, when `ep | dp_shard * cp`, not the per-GPU total.
  * parameters `P * shard`, gradients `P * shard` (FSDP reduces in fp32 and stores the
    sharded gradient in the parameter dtype), AdamW `exp_avg + exp_avg_sq = 2 * P * shard`:
    `4 P` per sharded parameter (16 B with fp32 training, 8 B with bf16 training) once the
    backward is over; during it only the finished units' gradients exist (the step walk).
  * the optimizer step's temporaries (`optimizer.implementation`, torch 2.13's Adam/AdamW):
    fused (torchtitan's default) none, one kernel updating in place; foreach `P * shard` over
    all parameters (the `_foreach_sqrt(exp_avg_sq)` list; the per-group split into decay and
    no-decay groups is not credited); for-loop `2 P` times the largest parameter shard
    (`exp_avg_sq.sqrt()` and its quotient).
  * buffers (expert bias, token counts, QB histograms) are not sharded: full size on every GPU.
  * FSDP working memory (gathered units). Units: the embedding, each decoder layer (with
    `ep > 1` its routed experts are a second unit of `E/ep` local experts gathered over
    `efsdp`; with `ep = 1` all `E` experts are in the layer unit), `[norm, output]` (not
    resharded after forward, torchtitan's default) and the root. `U` = the largest layer's
    gathered parameter count (non-expert + local experts), `Uh` = the head unit. Peak of:
      layer backward: `U * (2a + a + 4)`: the current and the prefetched unit in `a`, the
        unsharded gradient in `a` and the fp32 reduce-scatter input;
      head backward:  `Uh * (a + a + 4) + U_last * a` (head gathered since the end of the
        forward plus its gradients, the last layer prefetched).
    Without FSDP (one GPU): autocast's `a`-copies of the weights (when `a != P`), counted
    with the activations because they live like them: each layer's copies are saved by its
    matmuls from its forward to its backward (all layers without AC; under full AC only the
    layer being recomputed), the head's from the forward to the head's backward (autocast's
    cache is dropped when the forward's autocast region exits; the head matmul's saved copy
    goes with its backward).

Activations, per GPU. Local tokens `t = local_batch * seq_len / cp`. Everything is bytes per
local token times `t`, plus one per-layer constant (the router's fp32 weight copy) and, for
eager MLA layers, a term in the squared local sequence length (see "Eager activations").
Compiled model. Counting rule ("kept" = held from the forward until the backward uses it):
every matmul's input in the dtype it is fed; the custom ops' saved inputs (KDA op: q, k, v,
g, beta; grouped GEMM: its input); SDPA's q, k, v, output and fp32 logsumexp; each chain of
elementwise ops (casts, gates, SiLU, SiTU, conv taps) keeps its input once; norms keep input
+ fp32 rstd; a tensor used twice counts once. Dtypes as the code produces them. This is what
fused (compiled) layers need to keep; Inductor's partitioner may keep somewhat less. Eager
PyTorch keeps 2-3x more (measured, below). Per token (D = dim, I = H*dk, S = AttnRes source
slots = `attn_res.max_sources`):
  sub-layer prologue (x2 per layer): mixer softmax + key-norm stats `2 (S+1) * 4`; mixer
    output h (pre-norm input) `D s`; rstd 4; normed x (projection input) `D a`.
  KDA: projections wq|wk|wv concatenated, the conv input `3I a`; q, k after L2 norm and v
    (op inputs) `3I a`; L2 rstd `2H * 4`; w_f_down output `dk a`; z (gate input) `I a`;
    g (op input, fp32) `I * 4`; w_beta output `H a`; beta (fp32) `H * 4`; o (op output,
    head-norm input) `I a`; head-norm rstd `H * 4`; w_gate output `I a`; wo input `I a`.
    The chunk states `[T/64, H, dk, dv]` fp32 are not kept (the op saves only its inputs and
    recomputes them): they are in the op's workspace, below.
  MLA (r_q, r_kv, n = nope, r = shared, v head dims): w_dq output `r_q a` + rstd;
    normed c_q `r_q a`; q `H(n+r) a`; w_dkv output `(r_kv+r) a` + rstd; normed c_kv
    `r_kv a`; w_ukv output (k_n | v) `H(n+v) a`; k = [k_n, k_s] `H(n+r) a`; SDPA output
    `H v a` and logsumexp `H * 4`; o in fp32 (gate product input) `H v * 4`; w_g output
    `H v a`; w_o input `H v a`.
  dense FFN (hidden F): w_gate_up output `2F a`; hidden `F a`.
  LatentMoE (n experts, top-k, latent L, expert hidden h, shared hidden F_s = n_shared *
    moe_shared_hidden): router input x in fp32 `D * 4`; router scores fp32 `n * 4`; top-k ids
    int64 and weights fp32 `k (8+4)`; sort order + inverse int64 `2k * 8`; dispatched latent
    copies `k L a`; expert gate|up pre-activations `k 2h a`; expert hidden `k h a`; expert
    outputs, unsorted (combine input) `k L a`; u fp32 `L * 4` + rstd; w_latent_up input
    `L a`; shared experts `2 F_s a + F_s a`. Per layer constant: the router weight cast to
    fp32, `n D * 4` (when the weight is not already fp32).
  AttnRes stream: block mode keeps S distinct source buffers `[S, D] s` (one more each time a
    block closes) and the partial sum b_cur after each sub-layer `2 D s` per layer (1 per
    layer under AC: only each layer's input); full mode pushes a new `[S, D]` buffer per
    sub-layer; none mode keeps the running sum `2 D s` per layer.
  head: a prologue (final mix + norm) and the log-softmax output of the loss `V * 4`.
  transient peaks: head `V * 8`, two more fp32 `[T, V]` tensors (forward: the fp32 logits
    next to the `a` ones; backward: the gradients into and out of log-softmax); one layer
    in backward `2 * largest kept tensor` (the gradients of the op being differentiated)
    plus workspaces: KDA op (Triton launchers, fp32 per head, C = 64):
    `(5C + 5dk + 3dv + 2 dk dv / C + 1) * 4 * H` (recomputed forward states G, A_qk, A_kk,
    A_inv, W, U, v_new, chunk states h, plus dh, dv_new, dA_qk, dA_kk, dq/dk partials, dG,
    dbeta); QB histogram `32 n` (fp32 margins + temporary, three int64 [T, n] index tensors);
    EP all-to-all send + receive buffers `2 k L a` (ep > 1); MLA ring-attention K/V double
    buffer `2 H (n + r + v) a` (cp > 1); AttnRes stream gradients `(S+1) D s`.
Eager activations (`measure_eager_layer`, the kept bytes per token of each layer kind for
`[compile] enable = false`; they replace the compiled count as the layer's `kept`):
  * what runs: the first layer of each kind (KDA/MLA x dense/MoE), built at the configured
    widths with zero weights, forward in training mode as the Decoder runs it: an AttnRes
    stream started from a `[1, T, D]` embedding, one packed document (`doc_ids` and
    `cu_seqlens` given, as the loader always does: MLA builds its dense `[B, 1, T, T]` mask,
    the short convolution masks its taps). Precision as training: without FSDP weights and
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
    `q * local_batch * (seq_len / cp)^2` (ring attention's masks under CP are not modelled).
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
  * small_1gpu (fp32 weights, bf16 autocast), KiB per token, eager vs compiled: kda+dense 194
    vs 60, kda+moe 267 vs 105, mla+moe 218 (+ 2 B x T^2) vs 104 (8 KiB more for the MoE kinds
    before the combine became one op). The extra: each AttnRes mixer
    keeps two bf16 copies of the `[S, T, D]` sources (autocast casts them separately for the
    logit matmul and for the weighted sum); autocast makes a separate bf16 copy of x for every
    projection; SiTU keeps seven `[rows, hidden]` intermediates (84 KiB for the routed
    experts alone); the short convolution keeps fp32 taps; KDA's output norm and gates keep
    fp32 intermediates.
  * AC accounting unchanged: op-level SAC keeps the same op outputs as the compiled count (it
    chooses by op) and recomputes the rest of the measured set; the transient is the compiled
    one (2 x the largest kept entry + workspace). Not modelled: the mask construction's
    `[T, T]` bool temporaries (forward only) and the head's eager extras (its final mixer).
AC modes (torchtitan's `apply_ac`, one checkpoint per decoder layer). Per layer, what it
holds from its forward to its backward ("held") and what it adds while it runs backward
("in backward"); "whole" = its kept tensors + T^2 term + per-layer constant + autocast copies:
  none:      held = whole; in backward = its transient.
  full:      held = nothing (its input is a stream tensor, counted with the stream);
             in backward = whole (recomputed) + its transient.
  selective: follows the config's `activation_checkpoint.selective_ac_option`.
             "op" (op-level SAC with torchtitan's save list): held = the outputs of every
             other `aten.mm` in forward order (1st, 3rd, ...) and the SDPA outputs; in
             backward = the recomputed rest of the kept tensors (custom ops, KDA and grouped
             GEMM, included) + T^2 term + constant + copies + its transient.
             An integer k (torchtitan's default "2"): every k-th layer fully checkpointed,
             the others not at all.
The step walk (torchtitan 0.2.2's `train_step`: `optimizers.zero_grad()`, i.e. set_to_none,
frees the previous step's gradients before the forward; forward and loss under AMP; `del
pred`; `loss.backward()`; `clip_grad_norm_` (foreach: one scalar norm per tensor, then in
place); `optimizers.step()`). AdamW creates its states in the first `step()`, so steps 1-3
peak in step 2 or 3 and every phase holds the optimizer states. Every phase holds parameters
+ optimizer states + buffers, and the FSDP working memory above (one bound for the whole
forward and backward, not split by phase) in all phases but the optimizer step. They add:
  loss and head backward: every layer's held bytes, the whole stream, the head's kept tensors
    and autocast copies and the head transient (`V * 8`: the forward's fp32 logits and the
    backward's log-softmax gradients take the same budget, one phase for both); no gradient.
  backward layer i, i = n-1 .. 0: the gradients of the head and of layers > i; the held bytes
    of layers <= i; the stream tensors of layers <= i (their partial sums; block mode: the
    initial buffer and those of closed blocks up to i's; full mode: the initial buffer and
    those pushed by layers <= i); the stream gradients `(S+1) D s` (2 D s without AttnRes);
    layer i's "in backward" bytes. Layer i's own gradients are not counted: they are written
    op by op during its backward, after its recompute (an approximation that leaves out at
    most one layer's gradients).
  backward embedding: the gradients of the head and all layers, the stream gradients.
  optimizer step: all gradients and the optimizer's temporaries; no activations, no FSDP
    units gathered.
The step's peak (`total_*` in the JSON) is the largest phase; `activations_*` is the
activations' own high-water mark over the phases, so the table's columns do not add up to the
total. Not modelled: the forward's transients inside a layer (the held bytes of the layers
before it plus a few ops' outputs, a fraction of one layer's kept set: below the loss phase
without AC, below a recompute under full AC), the embedding's gradient while it is written,
the clip's scalars.
Fit: `total <= (1 - headroom) * gpu_mem`; the default 10% headroom stands in for what is not
modelled (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation); it is a guess.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_moe.config import ConfigError, load_config, model_args_from_config
from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import ResidualStream, max_sources
from titan_moe.model.decoder import Decoder, DecoderLayer
from titan_moe.model.flops import count_params

GIB = 2**30
AC_MODES = ("none", "selective", "full")
ACTIVATION_MODELS = ("compiled", "eager")
CP_DEGREES = (1, 2, 4, 8)
MAX_SEARCH_GPUS = 4096
KDA_CHUNK = 64  # chunk length of the KDA op (SPEC §1)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# =========================================================================== layouts
@dataclass(frozen=True)
class Layout:
    """One parallel layout: `n_gpus = dp_replicate * dp_shard * cp`, `ep | dp_shard * cp`."""

    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fsdp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp_shard * cp ({self.fsdp})")

    @property
    def n_gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def fsdp(self) -> int:
        """Ranks one FSDP shard group spans (torchtitan's `fsdp` mesh: dp_shard * cp)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """FSDP ranks of the routed experts after EP took its share."""
        return self.fsdp // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp > 1


def enumerate_layouts(
    n_gpus: int, n_experts: int, seq_len: int, hsdp: bool = False
) -> list[Layout]:
    """All layouts for `n_gpus` (see the module docstring), in a stable order."""
    if n_gpus < 1:
        raise ValueError(f"the GPU count must be >= 1, got {n_gpus}")
    layouts = []
    for cp in CP_DEGREES:
        if n_gpus % cp or seq_len % cp:
            continue
        replicas = [1]
        if hsdp:
            replicas += [r for r in _powers_of_two(n_gpus // cp) if r > 1 and n_gpus // (cp * r) * cp > 1]
        for r in replicas:
            if (n_gpus // cp) % r:
                continue
            dp_shard = n_gpus // (cp * r)
            for ep in range(1, dp_shard * cp + 1):
                if (dp_shard * cp) % ep == 0 and n_experts % ep == 0:
                    layouts.append(Layout(r, dp_shard, cp, ep))
    return layouts


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


# =========================================================================== precision
@dataclass(frozen=True)
class Precision:
    """Byte widths: `param` (training.dtype: params, grads, optimizer states), `compute`
    (mixed_precision_param), `reduce` (FSDP reduce-scatter, fp32)."""

    param: int
    compute: int
    reduce: int = 4

    @classmethod
    def from_config(cls, config) -> Precision:
        return cls(
            param=_DTYPE_BYTES[config.training.dtype],
            compute=_DTYPE_BYTES[config.training.mixed_precision_param],
            reduce=_DTYPE_BYTES[config.training.mixed_precision_reduce],
        )

    def stream(self, fsdp_enabled: bool) -> int:
        return self.compute if fsdp_enabled else self.param


# =========================================================================== parameters
ShapeCount = Counter  # Counter[(shape, is_expert)] -> number of parameters of that shape


@dataclass
class ParamInventory:
    """What the meta-device model holds, grouped for the sharding arithmetic.

    shapes: (shape, is_expert) -> count over all parameters.
    layer_shapes: the same per decoder layer (its FSDP unit, experts included).
    head_shapes: the `[norm, output]` FSDP unit.
    """

    total: int
    routed_experts: int
    shapes: ShapeCount
    layer_shapes: list[ShapeCount]
    head_shapes: ShapeCount
    buffer_bytes: int
    n_experts: int

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts


def is_routed_expert(name: str) -> bool:
    return ".feed_forward.experts." in name


def inventory(model: torch.nn.Module, args: ModelArgs) -> ParamInventory:
    shapes: ShapeCount = Counter()
    layer_shapes = [Counter() for _ in range(args.n_layers)]
    head_shapes: ShapeCount = Counter()
    total = experts = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        expert = is_routed_expert(name)
        experts += n if expert else 0
        key = (tuple(p.shape), expert)
        shapes[key] += 1
        parts = name.split(".")
        if parts[0] == "layers":
            layer_shapes[int(parts[1])][key] += 1
        elif parts[0] in ("norm", "output"):
            head_shapes[key] += 1
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return ParamInventory(total, experts, shapes, layer_shapes, head_shapes, buffer_bytes, args.n_routed_experts)


def fsdp_shard_numel(shape: tuple[int, ...], degree: int, dim: int = 0) -> int:
    """Elements of one FSDP2 shard: `torch.chunk` on `dim`, padded to the first chunk."""
    if not shape:
        return 1
    rest = math.prod(shape) // shape[dim]
    return -(-shape[dim] // degree) * rest


def expert_shard_numel(shape: tuple[int, ...], layout: Layout, n_experts: int) -> int:
    """Elements per GPU of one stacked routed-expert parameter `[E, ...]`."""
    if layout.ep == 1:
        return fsdp_shard_numel(shape, layout.fsdp, 0)
    local = (shape[0] // layout.ep, *shape[1:])
    dim = 1 if layout.efsdp * layout.ep > n_experts and len(shape) > 1 else 0
    return fsdp_shard_numel(local, layout.efsdp, dim)


def sharded_numel(shapes: ShapeCount, layout: Layout, n_experts: int) -> tuple[int, int]:
    """Padded elements per GPU of (routed experts, everything else) in `shapes`."""
    expert = other = 0
    for (shape, is_expert), count in shapes.items():
        if is_expert:
            expert += count * expert_shard_numel(shape, layout, n_experts)
        else:
            other += count * fsdp_shard_numel(shape, layout.fsdp, 0)
    return expert, other


def gathered_numel(shapes: ShapeCount, layout: Layout, n_experts: int) -> int:
    """Elements one GPU holds while a unit is all-gathered: padded shards times the group size
    (all experts with ep = 1, the E/ep local ones with ep > 1)."""
    expert, other = sharded_numel(shapes, layout, n_experts)
    return other * layout.fsdp + expert * (layout.efsdp if layout.ep > 1 else layout.fsdp)


OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")  # torchtitan's optimizer.implementation


@dataclass
class ParamMemory:
    """Per-GPU bytes of parameters, gradients, optimizer states, buffers and FSDP buffers.

    `layer_grads` (per decoder layer) and `head_grads` (`[norm, output]`) split `grads` by the
    order backward creates them; the rest (embedding, final AttnRes mixer) comes last.
    `optimizer_temp`: the optimizer step's temporaries (AdamW, by `optimizer.implementation`).
    """

    sharded_expert_numel: int  # padded
    sharded_other_numel: int  # padded
    params: float
    grads: float
    optimizer: float
    buffers: float
    fsdp_gathered: float
    largest_unit: int  # gathered elements of the largest decoder-layer unit
    layer_grads: list[float] = field(default_factory=list)
    head_grads: float = 0.0
    optimizer_temp: float = 0.0

    @cached_property
    def grads_by_units(self) -> list[float]:
        """Gradient bytes alive after `k` backward units, k = 0 .. n_layers + 2, the units in
        backward order: head, layer n-1, ..., layer 0, the rest (embedding, final mixer)."""
        done = [0.0, self.head_grads]
        for g in reversed(self.layer_grads):
            done.append(done[-1] + g)
        done.append(self.grads)
        assert done[-2] <= self.grads * (1 + 1e-12), "the units' gradients exceed the total"
        return done

    def at(self, phase: Phase) -> float:
        """Bytes of parameters, optimizer states, buffers, the gradients that exist and the FSDP
        working memory (not in the optimizer step: units are resharded) during `phase`."""
        states = self.params + self.optimizer + self.buffers + self.grads_by_units[phase.grad_units]
        if phase.optimizer_step:
            return states + self.optimizer_temp
        return states + self.fsdp_gathered


def param_memory(inv: ParamInventory, layout: Layout, prec: Precision, optimizer_impl: str = "fused") -> ParamMemory:
    if optimizer_impl not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_IMPLEMENTATIONS}, got {optimizer_impl!r}")
    expert, other = sharded_numel(inv.shapes, layout, inv.n_experts)
    sharded = expert + other
    a, red, P = prec.compute, prec.reduce, prec.param
    unit_cache: dict[tuple, tuple[int, int]] = {}
    units, layer_grads = [], []
    for shapes in inv.layer_shapes:  # layers of one kind share a signature
        key = tuple(sorted(shapes.items()))
        if key not in unit_cache:
            unit_cache[key] = (gathered_numel(shapes, layout, inv.n_experts),
                               sum(sharded_numel(shapes, layout, inv.n_experts)))
        units.append(unit_cache[key][0])
        layer_grads.append(float(unit_cache[key][1] * P))
    largest = max(units, default=0)
    if layout.fsdp_enabled:
        layer_peak = largest * (2 * a + a + red)
        head = gathered_numel(inv.head_shapes, layout, inv.n_experts)
        head_peak = head * (a + a + red) + (units[-1] if units else 0) * a
        gathered = float(max(layer_peak, head_peak))
    else:
        gathered = 0.0  # one GPU: autocast's weight copies are counted with the activations
    if optimizer_impl == "foreach":  # one list of temporaries over all parameters at a time
        temp = float(sharded * P)
    elif optimizer_impl == "for-loop":  # sqrt(exp_avg_sq) and its quotient, of one parameter
        largest_shard = max((expert_shard_numel(shape, layout, inv.n_experts) if is_expert
                             else fsdp_shard_numel(shape, layout.fsdp, 0)
                             for shape, is_expert in inv.shapes), default=0)
        temp = float(2 * largest_shard * P)
    else:
        temp = 0.0  # fused: one kernel updating in place
    return ParamMemory(
        sharded_expert_numel=expert,
        sharded_other_numel=other,
        params=float(sharded * P),
        grads=float(sharded * P),
        optimizer=float(2 * sharded * P),
        buffers=float(inv.buffer_bytes),
        fsdp_gathered=gathered,
        largest_unit=largest,
        layer_grads=layer_grads,
        head_grads=float(sum(sharded_numel(inv.head_shapes, layout, inv.n_experts)) * P),
        optimizer_temp=temp,
    )


def sharding_checks(inv: ParamInventory, layout: Layout) -> dict[str, bool]:
    """Unpadded per-GPU shares times the sharding degrees give back the totals.

    Experts take the two-step path (EP on dim 0, then FSDP over efsdp); the check is that it
    lands on `expert_params / (dp_shard * cp)` and that the classes add up to the total.
    """
    ep_share = inv.routed_experts / layout.ep
    expert_per_gpu = ep_share / layout.efsdp
    other_per_gpu = inv.non_expert / layout.fsdp
    return {
        "experts": math.isclose(expert_per_gpu * layout.ep * layout.efsdp, inv.routed_experts, rel_tol=1e-12)
        and math.isclose(expert_per_gpu, inv.routed_experts / layout.fsdp, rel_tol=1e-12),
        "non_experts": math.isclose(other_per_gpu * layout.fsdp, inv.non_expert, rel_tol=1e-12),
        "classes_sum_to_total": inv.routed_experts + inv.non_expert == inv.total,
    }


# =========================================================================== activations
@dataclass(frozen=True)
class Entry:
    """One tensor of a layer's forward, in bytes per local token.

    kept: held until backward with AC off. mm: produced by an `aten.mm` (order matters for
    op-level SAC). sdpa: an SDPA output (always kept by op-level SAC).
    """

    name: str
    bytes: float
    kept: bool = True
    mm: bool = False
    sdpa: bool = False


@dataclass
class LayerActivations:
    """One decoder layer: its tensors in forward order, its transient workspace, constants.

    `measured` (eager model): bytes per token eager autograd saves, measured by
    `measure_eager_layer`; it replaces the entries' sum as `kept` (the entries still decide
    what op-level SAC keeps and the transient). `per_seq_sq`: bytes per sequence per squared
    local sequence length, kept like `kept` (eager MLA: the additive document mask).
    """

    kind: str
    entries: list[Entry]
    workspace: float  # bytes per token, alive only while the layer runs backward
    constant: float = 0.0  # bytes per layer, independent of tokens (kept like `kept` tensors)
    measured: float | None = None
    per_seq_sq: float = 0.0

    @cached_property
    def kept(self) -> float:
        if self.measured is not None:
            return self.measured
        return sum(e.bytes for e in self.entries if e.kept)

    @cached_property
    def _sac_saved(self) -> list[bool]:
        """Op-level SAC's choice per entry: every other mm output (1st, 3rd, ...), SDPA outputs."""
        saved, n_mm = [], 0
        for e in self.entries:
            n_mm += e.mm
            saved.append((e.mm and n_mm % 2 == 1) or e.sdpa)
        return saved

    @cached_property
    def sac_kept(self) -> float:
        """Bytes per token op-level SAC keeps for this layer."""
        return sum(e.bytes for e, keep in zip(self.entries, self._sac_saved) if keep)

    @cached_property
    def sac_recompute(self) -> float:
        """Bytes per token a SAC backward rematerialises: the kept tensors SAC did not keep."""
        return self.kept - sum(e.bytes for e, keep in zip(self.entries, self._sac_saved) if e.kept and keep)

    @cached_property
    def transient(self) -> float:
        largest = max((e.bytes for e in self.entries if e.kept), default=0.0)
        return 2 * largest + self.workspace


def _prologue(prefix: str, args: ModelArgs, s: int, a: int) -> list[Entry]:
    D = args.dim
    out = []
    if args.attn_res != "none":
        S = max_sources(args.attn_res, args.n_layers, args.attn_res_block_size)
        out.append(Entry(f"{prefix}.mix_stats", 2 * (S + 1) * 4))
        out.append(Entry(f"{prefix}.mix_out", D * s))
    out.append(Entry(f"{prefix}.norm_rstd", 4))
    out.append(Entry(f"{prefix}.norm_out", D * a))
    return out


def _kda(args: ModelArgs, a: int) -> tuple[list[Entry], float]:
    H, dk = args.kda_n_heads, args.kda_head_dim
    dv, I, D, C = dk, H * dk, args.dim, KDA_CHUNK
    e = [
        Entry("kda.wq", I * a, kept=False, mm=True),
        Entry("kda.wk", I * a, kept=False, mm=True),
        Entry("kda.wv", I * a, kept=False, mm=True),
        Entry("kda.qkv_conv_in", 3 * I * a),
        Entry("kda.qkv_op_in", 3 * I * a),
        Entry("kda.l2_rstd", 2 * H * 4),
        Entry("kda.w_f_down", dk * a, mm=True),
        Entry("kda.w_f_up", I * a, mm=True),
        Entry("kda.g_fp32", I * 4),
        Entry("kda.w_beta", H * a, mm=True),
        Entry("kda.beta_fp32", H * 4),
        Entry("kda.o", I * a),
        Entry("kda.head_rstd", H * 4),
        Entry("kda.w_gate", I * a, mm=True),
        Entry("kda.wo_in", I * a),
        Entry("kda.wo", D * a, kept=False, mm=True),
    ]
    workspace = (5 * C + 5 * dk + 3 * dv + 2 * dk * dv / C + 1) * 4 * H
    return e, workspace


def _mla(args: ModelArgs, a: int, cp: int) -> tuple[list[Entry], float]:
    H, D = args.mla_n_heads, args.dim
    rq, rkv = args.mla_q_lora_rank, args.mla_kv_lora_rank
    n, r, v = args.mla_qk_nope_head_dim, args.mla_qk_shared_dim, args.mla_v_head_dim
    e = [
        Entry("mla.w_dq", rq * a, mm=True),
        Entry("mla.q_norm_rstd", 4),
        Entry("mla.c_q", rq * a),
        Entry("mla.w_uq", H * (n + r) * a, mm=True),
        Entry("mla.w_dkv", (rkv + r) * a, mm=True),
        Entry("mla.kv_norm_rstd", 4),
        Entry("mla.c_kv", rkv * a),
        Entry("mla.w_ukv", H * (n + v) * a, mm=True),
        Entry("mla.k", H * (n + r) * a),
        Entry("mla.sdpa_out", H * v * a, sdpa=True),
        Entry("mla.sdpa_lse", H * 4, sdpa=True),
        Entry("mla.o_fp32", H * v * 4),
        Entry("mla.w_g", H * v * a, mm=True),
        Entry("mla.w_o_in", H * v * a),
        Entry("mla.w_o", D * a, kept=False, mm=True),
    ]
    workspace = 2 * H * (n + r + v) * a if cp > 1 else 0.0
    return e, workspace


def _dense_ffn(args: ModelArgs, a: int) -> list[Entry]:
    F, D = args.dense_hidden, args.dim
    return [
        Entry("ffn.w_gate_up", 2 * F * a, mm=True),
        Entry("ffn.hidden", F * a),
        Entry("ffn.w_down", D * a, kept=False, mm=True),
    ]


def _moe(args: ModelArgs, a: int, ep: int) -> tuple[list[Entry], float]:
    D, n, k = args.dim, args.n_routed_experts, args.top_k
    L, h = args.moe_latent_dim, args.moe_expert_hidden
    e = [
        Entry("moe.router_in_fp32", D * 4),
        Entry("moe.router_scores", n * 4, mm=True),
        Entry("moe.topk_ids_weights", k * (8 + 4)),
        Entry("moe.w_latent_down", L * a, kept=False, mm=True),
        Entry("moe.sort_order_inverse", 2 * k * 8),
        Entry("moe.dispatched", k * L * a),
        Entry("moe.expert_gate_up", k * 2 * h * a),
        Entry("moe.expert_hidden", k * h * a),
        Entry("moe.expert_out", k * L * a),
        Entry("moe.u_fp32", L * 4 + 4),
        Entry("moe.w_latent_up_in", L * a),
        Entry("moe.w_latent_up", D * a, kept=False, mm=True),
    ]
    if args.n_shared_experts > 0:
        Fs = args.n_shared_experts * args.moe_shared_hidden
        e += [
            Entry("moe.shared_gate_up", 2 * Fs * a, mm=True),
            Entry("moe.shared_hidden", Fs * a),
            Entry("moe.shared_down", D * a, kept=False, mm=True),
        ]
    workspace = 0.0
    if args.balance_rule == "qb" and args.qb_bins > 0 and k < n:
        workspace += 32 * n
    if ep > 1:
        workspace += 2 * k * L * a
    return e, workspace


def layer_activations(
    args: ModelArgs, layer_idx: int, prec: Precision, layout: Layout
) -> LayerActivations:
    """The tensors of decoder layer `layer_idx` in forward order (bytes per local token)."""
    a, s = prec.compute, prec.stream(layout.fsdp_enabled)
    kind = args.layer_kinds()[layer_idx]
    entries = _prologue("attn", args, s, a)
    if kind == "kda":
        attn, workspace = _kda(args, a)
    else:
        attn, workspace = _mla(args, a, layout.cp)
    entries += attn
    entries += _prologue("ffn", args, s, a)
    constant = 0.0
    if args.is_moe_layer(layer_idx):
        moe, moe_ws = _moe(args, a, layout.ep)
        entries += moe
        workspace += moe_ws
        weight_bytes = a if layout.fsdp_enabled else prec.param
        if weight_bytes != 4:
            constant = args.n_routed_experts * args.dim * 4
        kind += "+moe"
    else:
        entries += _dense_ffn(args, a)
        kind += "+dense"
    return LayerActivations(kind, entries, workspace, constant)


def model_activations(
    args: ModelArgs, prec: Precision, layout: Layout, activations: str = "compiled"
) -> list[LayerActivations]:
    """Every layer's `LayerActivations`; layers of one kind share one object.

    `activations`: "compiled" counts what fused layers keep (the entries); "eager" puts the
    bytes eager autograd saves, measured once per layer kind (`eager_profiles`), in `measured`.
    """
    if activations not in ACTIVATION_MODELS:
        raise ValueError(f"activations must be one of {ACTIVATION_MODELS}, got {activations!r}")
    profiles = eager_profiles(args, prec, layout.fsdp_enabled) if activations == "eager" else {}
    by_kind: dict[tuple[str, bool], LayerActivations] = {}
    layers = []
    for i, kind in enumerate(args.layer_kinds()):
        key = (kind, args.is_moe_layer(i))
        if key not in by_kind:
            layer = layer_activations(args, i, prec, layout)
            if key in profiles:
                layer = replace(layer, measured=profiles[key].per_token, per_seq_sq=profiles[key].per_seq_sq)
            by_kind[key] = layer
        layers.append(by_kind[key])
    return layers


# =========================================================================== eager activations
EAGER_TOKENS = (64, 128, 192)  # measuring lengths: equally spaced multiples of the KDA chunk
EAGER_EXTRA_EXPERTS = (2, 4)  # MoE layers are built with top_k + these routed experts
EAGER_CPU_BUDGET = 2 * GIB  # a layer whose weights (+ autocast copies) need more is measured on fake tensors
_MEASURE_DTYPES = {4: torch.float32, 2: torch.bfloat16}  # activation bytes only depend on the width


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class _EfficientAttentionSaves(torch.autograd.Function):
    """SDPA that saves what the GPU's memory-efficient kernel saves for its backward.

    A measuring device, forward only. CPU SDPA takes the math path for our shapes (fp32
    upcasts, `[B, H, T, T]` probabilities saved), which the GPU kernel does not. This one
    computes the values with any backend under no_grad and saves q, k, v (the callers'
    tensors), the output (written `[B, T, H, v]` by the kernel), the fp32 logsumexp
    `[B, H, ceil32(T)]` and, for a boolean mask, the additive bias in q's dtype that
    `scaled_dot_product_attention` converts it to (last dim padded to 16).
    """

    @staticmethod
    def forward(ctx, q_BHTK, k_BHTK, v_BHTV, mask, scale, is_causal):
        with torch.no_grad():
            o_BHTV = torch.nn.functional.scaled_dot_product_attention(
                q_BHTK, k_BHTK, v_BHTV, attn_mask=mask, is_causal=is_causal, scale=scale
            )
        B, H, T, _ = q_BHTK.shape
        out_BHTV = o_BHTV.transpose(1, 2).contiguous().transpose(1, 2)
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
    def backward(ctx, *grads):
        raise RuntimeError("the eager-activation measuring stand-in has no backward")


class _FusedRMSNormSaves(torch.autograd.Function):
    """RMSNorm that saves what CUDA's fused `_fused_rms_norm` saves: input, fp32 rstd `[..., 1]`
    and the weight. A measuring device, forward only (the CPU build decomposes rms_norm and
    also saves the normalised input)."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        with torch.no_grad():
            y = torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
            dims = tuple(range(-len(normalized_shape), 0))
            eps = torch.finfo(x.dtype).eps if eps is None else eps
            rstd = torch.rsqrt(x.float().square().mean(dims, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the eager-activation measuring stand-in has no backward")


def _sdpa_saves(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p or enable_gqa:
        raise ValueError("the eager-activation measurement models SDPA without dropout or GQA")
    if torch.is_autocast_enabled("cpu"):  # SDPA is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return _EfficientAttentionSaves.apply(query, key, value, attn_mask, scale, is_causal)


class GpuKernelSaves(torch.overrides.TorchFunctionMode):
    """Routes SDPA and (matching-dtype) RMSNorm to stand-ins that save what their CUDA kernels
    save; every other op runs as is. RMSNorm with an input dtype other than the weight's
    falls back to the composite on CUDA too, so it is left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _sdpa_saves(*args, **kwargs)
        if func is torch.nn.functional.rms_norm:
            names = ("input", "normalized_shape", "weight", "eps")
            bound = dict(zip(names, args)) | kwargs
            x, weight = bound["input"], bound.get("weight")
            if weight is None or weight.dtype == x.dtype:
                shape = tuple(bound["normalized_shape"])
                return _FusedRMSNormSaves.apply(x, shape, weight, bound.get("eps"))
        return func(*args, **kwargs)


def _storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of a storage: its data pointer (fake tensors have none: the StorageImpl)."""
    return storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def zero_layer(args: ModelArgs, layer_idx: int, param_dtype: torch.dtype) -> DecoderLayer:
    """Decoder layer `layer_idx` with zero parameters in `param_dtype` (buffers keep their
    dtypes), in training mode. Under a FakeTensorMode its tensors are fake (no storage)."""
    with torch.device("meta"):
        layer = DecoderLayer(layer_idx, args)
    for module in layer.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.zeros(p.shape, dtype=param_dtype)))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.zeros(b.shape, dtype=b.dtype))
    return layer.train()


def eager_saved_bytes(
    layer: DecoderLayer, args: ModelArgs, T: int, stream_dtype: torch.dtype, autocast_dtype: torch.dtype | None
) -> int:
    """Bytes of the distinct storages eager autograd saves in one forward of `layer` over one
    packed row of T tokens (one document: `doc_ids` and `cu_seqlens` given, as in training).

    The input is an AttnRes stream started from a `[1, T, dim]` embedding in `stream_dtype`,
    as the Decoder builds it; `autocast_dtype` (or None) is the CPU autocast dtype. SDPA and
    RMSNorm save what their CUDA kernels save (`GpuKernelSaves`). Not counted: parameters
    and the stream's own tensors (both sub-layers' input streams: `_stream_bytes_per_token`
    counts them). Storages are deduplicated by identity and held until counted.
    """
    excluded = {_storage_key(p.untyped_storage()) for p in layer.parameters()}

    def exclude_stream(module, inputs):
        stream = inputs[0]
        excluded.update(_storage_key(t.untyped_storage()) for t in (stream.sources_SBTD, stream.partial_BTD))

    saved: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[_storage_key(storage)] = storage
        return t

    embed_BTD = torch.zeros(1, T, args.dim, dtype=stream_dtype, requires_grad=True)
    stream = ResidualStream.start(embed_BTD, args.attn_res, args.n_layers, args.attn_res_block_size)
    doc_ids_BT = torch.zeros(1, T, dtype=torch.int32)
    cu_seqlens = torch.tensor([0, T], dtype=torch.int32)
    amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    hooks = [mix.register_forward_pre_hook(exclude_stream) for mix in (layer.attention_mix, layer.ffn_mix)]
    try:
        with warnings.catch_warnings(), GpuKernelSaves(), amp:
            warnings.simplefilter("ignore")  # rms_norm's "cannot dispatch to fused" dtype notes
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = layer(stream.tensors(), doc_ids_BT=doc_ids_BT, cu_seqlens=cu_seqlens)
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
    tokens: tuple[int, int, int] = EAGER_TOKENS, fake: bool | None = None,
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
    ops, dtypes, autocast and saved tensors, no storage or arithmetic).
    """
    if any(T % KDA_CHUNK for T in tokens):
        raise ValueError(f"measuring lengths must be multiples of {KDA_CHUNK}, got {tokens}")
    P, a = _MEASURE_DTYPES[prec.param], _MEASURE_DTYPES[prec.compute]
    param_dtype = stream_dtype = a if fsdp_enabled else P
    autocast_dtype = None if fsdp_enabled or prec.compute == 4 else a
    n, k = args.n_routed_experts, args.top_k
    moe = args.is_moe_layer(layer_idx)
    counts = tuple(k + e for e in EAGER_EXTRA_EXPERTS) if moe and n > k + max(EAGER_EXTRA_EXPERTS) else (n,)
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
            lengths = tokens if quad is None else tokens[:2]
            measured = [eager_saved_bytes(layer, args, T, stream_dtype, autocast_dtype) for T in lengths]
            line, quad = _fit_tokens(measured, tokens, quad)
            per_token.append(line)
            del layer
    if len(counts) == 2:
        slope = (per_token[1] - per_token[0]) / (counts[1] - counts[0])
        per_token = [per_token[0] + slope * (n - counts[0])]
    kind = args.layer_kinds()[layer_idx] + ("+moe" if moe else "+dense")
    return EagerProfile(kind, per_token[0], quad, fake, counts if moe else ())


_EAGER_CACHE: dict[tuple, dict[tuple[str, bool], EagerProfile]] = {}


def eager_profiles(args: ModelArgs, prec: Precision, fsdp_enabled: bool) -> dict[tuple[str, bool], EagerProfile]:
    """`measure_eager_layer` for the first layer of each (kind, is_moe), cached per model and
    precision setting (the layouts of one plan share two settings: with and without FSDP)."""
    key = (repr(args), prec.param, prec.compute, fsdp_enabled)
    if key not in _EAGER_CACHE:
        profiles = {}
        for i, kind in enumerate(args.layer_kinds()):
            kind_key = (kind, args.is_moe_layer(i))
            if kind_key not in profiles:
                profiles[kind_key] = measure_eager_layer(args, i, prec, fsdp_enabled)
        _EAGER_CACHE[key] = profiles
    return _EAGER_CACHE[key]


@dataclass(frozen=True)
class Phase:
    """One moment of a training step and what is alive then.

    activations: activation bytes per GPU (kept tensors, stream, recompute, transients,
    autocast weight copies). grad_units: how many backward units have finished and hold
    their gradients, in backward order (head, layer n-1, ..., layer 0, the rest: see
    `ParamMemory.grads_by_units`). optimizer_step: the optimizer's phase (no FSDP units
    gathered; the optimizer's temporaries instead).
    """

    name: str
    activations: float
    grad_units: int
    optimizer_step: bool = False


@dataclass
class ActivationMemory:
    """Per-GPU activation bytes for one AC mode, as a walk over the step's `phases` (module
    docstring, "The step walk"); `kept` = what the forward leaves for the backward."""

    ac: str
    tokens: int
    kept: float
    phases: list[Phase]
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        """The activations' high-water mark over the phases (not necessarily where the
        step's total peaks: that adds the gradients alive in each phase)."""
        return max(ph.activations for ph in self.phases)


def layer_policies(ac: str, n_layers: int, sac_option: str = "op") -> list[str]:
    """Per layer "none" | "full" | "op" for an AC mode, as torchtitan 0.2.2's `apply_ac` wraps them.

    selective with `sac_option` "op": op-level SAC on every layer; with an integer k: layer-level
    SAC, every k-th layer (1-based count) fully checkpointed and the others not at all.
    """
    if ac not in AC_MODES:
        raise ValueError(f"ac must be one of {AC_MODES}, got {ac!r}")
    if ac != "selective":
        return [ac] * n_layers
    if sac_option == "op":
        return ["op"] * n_layers
    if not sac_option.isdigit():
        raise ValueError(f"selective_ac_option must be 'op' or an integer, got {sac_option!r}")
    k = int(sac_option)
    return ["full" if k == 0 or (i + 1) % k == 0 else "none" for i in range(n_layers)]


def _stream_bytes_per_token(args: ModelArgs, s: int, policies: list[str], upto: int | None = None) -> float:
    """AttnRes stream tensors kept: per layer 2 partial sums (1 when the layer is checkpointed:
    only its input), plus the source buffers (block: one per closed block; full: one per push).

    `upto`: only what layers 0..upto use, alive while layer `upto` runs backward (the partial
    sums of layers <= upto; block mode: the buffers of the blocks up to upto's, the initial one
    included; full mode: the initial buffer and those pushed by layers <= upto); None: all
    (the end of the forward; block mode: all S buffers, the last one read by the final mixer).
    """
    D, L = args.dim, args.n_layers
    last = L - 1 if upto is None else upto
    per_layer = sum(2 if p == "none" else 1 for p in policies[: last + 1])
    if args.attn_res == "none":
        return per_layer * D * s
    S = max_sources(args.attn_res, L, args.attn_res_block_size)
    if args.attn_res == "block":
        buffers = S if upto is None else min(upto // args.attn_res_block_size + 1, S)
        return buffers * S * D * s + per_layer * D * s
    return (1 + per_layer) * S * D * s  # full mode: every sub-layer pushes a new [S, D] buffer


def _head_kept_per_token(args: ModelArgs, s: int, a: int) -> float:
    return sum(e.bytes for e in _prologue("head", args, s, a)) + args.vocab_size * 4


def autocast_weight_copies(inv: ParamInventory, layout: Layout, prec: Precision) -> tuple[list[float], float]:
    """Bytes of autocast's compute-dtype weight copies per decoder layer, and of the head.

    Only without FSDP and when the compute dtype differs from the parameter dtype (with FSDP
    the gathered weights are already in the compute dtype: `ParamMemory.fsdp_gathered`).
    Each matmul saves its cast weight for the input gradient, so a layer's copies live from
    its forward to its backward, like its activations: all layers without AC, only the layer
    being recomputed under full AC (measured on the H200, small_1gpu, 8K: counting every
    layer's copies under full AC over-estimated the peak by 2.5 GiB).
    """
    a = prec.compute
    if layout.fsdp_enabled or a == prec.param:
        return [0.0] * len(inv.layer_shapes), 0.0
    numel = lambda shapes: sum(math.prod(shape) * n for (shape, _), n in shapes.items())  # noqa: E731
    return [float(numel(sh) * a) for sh in inv.layer_shapes], float(numel(inv.head_shapes) * a)


def activation_memory(
    args: ModelArgs, prec: Precision, layout: Layout, ac: str, local_batch: int, seq_len: int,
    layers: list[LayerActivations] | None = None, sac_option: str = "op",
    weight_copies: tuple[list[float], float] | None = None,
) -> ActivationMemory:
    """Activation bytes per GPU at `local_batch * seq_len / cp` local tokens, phase by phase over
    one training step (module docstring, "The step walk"); each phase names the gradients alive
    then, `ParamMemory.at` adds them with the other parameter-side bytes.

    `layers` (from `model_activations`) may be passed to reuse them across AC modes;
    `sac_option` is torchtitan's `selective_ac_option` ("op" or a layer frequency);
    `weight_copies` (from `autocast_weight_copies`) adds autocast's weight copies per layer.
    """
    if seq_len % layout.cp:
        raise ValueError(f"seq_len ({seq_len}) must be divisible by cp ({layout.cp})")
    if local_batch < 0 or seq_len < 0:
        raise ValueError(f"local_batch and seq_len must be >= 0, got {local_batch}, {seq_len}")
    policies = layer_policies(ac, args.n_layers, sac_option)
    t = local_batch * seq_len // layout.cp
    seq_sq = local_batch * (seq_len // layout.cp) ** 2  # sum over local sequences of T_local^2
    a, s = prec.compute, prec.stream(layout.fsdp_enabled)
    D = args.dim
    if layers is None:
        layers = model_activations(args, prec, layout)

    copies, head_copy = weight_copies or ([0.0] * len(layers), 0.0)
    held, during = [], []  # per layer: bytes from its forward to its backward; extra while in backward
    for layer, policy, copy in zip(layers, policies, copies):
        whole = layer.kept * t + layer.per_seq_sq * seq_sq + layer.constant + copy
        if policy == "none":
            held.append(whole)
            during.append(layer.transient * t)
        elif policy == "full":
            held.append(0.0)
            during.append(whole + layer.transient * t)
        else:  # op-level SAC: its saved set is held, the rest (and the copies) rematerialised
            held.append(layer.sac_kept * t)
            during.append(whole + (layer.sac_recompute - layer.kept + layer.transient) * t)
    L = len(layers)
    S = max_sources(args.attn_res, args.n_layers, args.attn_res_block_size)
    stream_grads = ((S + 1) if args.attn_res != "none" else 2) * D * s * t
    stream = _stream_bytes_per_token(args, s, policies) * t
    head_kept = _head_kept_per_token(args, s, a) * t
    head_transient = args.vocab_size * 8 * t
    layers_kept = sum(held)
    kept = layers_kept + stream + head_kept + head_copy
    phases = [Phase("loss and head backward", kept + head_transient, grad_units=0)]
    held_upto = list(accumulate(held))  # held bytes of layers 0..i
    for i in reversed(range(L)):
        stream_i = _stream_bytes_per_token(args, s, policies, upto=i) * t
        acts = held_upto[i] + during[i] + stream_i + stream_grads
        phases.append(Phase(f"backward layer {i}", acts, grad_units=L - i))  # head + layers > i
    phases.append(Phase("backward embedding", stream_grads, grad_units=L + 1))
    phases.append(Phase("optimizer step", 0.0, grad_units=L + 2, optimizer_step=True))
    detail = {"layers_kept": layers_kept, "stream_kept": stream, "head_kept": head_kept,
              "head_weight_copies": head_copy}
    return ActivationMemory(ac, t, kept, phases, detail)


# =========================================================================== evaluation
@dataclass
class LayoutPlan:
    layout: Layout
    params: ParamMemory
    activations: dict[str, ActivationMemory]

    def phase_totals(self, ac: str) -> list[tuple[str, float]]:
        """(phase, bytes per GPU) over the step's walk for one AC mode."""
        return [(ph.name, self.params.at(ph) + ph.activations) for ph in self.activations[ac].phases]

    def peak(self, ac: str) -> tuple[str, float]:
        """The phase where the step peaks and its bytes (the first one on a tie)."""
        return max(self.phase_totals(ac), key=lambda named: named[1])

    def total(self, ac: str) -> float:
        return self.peak(ac)[1]

    def fits(self, ac: str, usable_bytes: float) -> bool:
        return self.total(ac) <= usable_bytes

    def summary(self, usable_bytes: float) -> dict:
        p = self.params
        return {
            "dp_replicate": self.layout.dp_replicate,
            "dp_shard": self.layout.dp_shard,
            "cp": self.layout.cp,
            "ep": self.layout.ep,
            "local_tokens": self.activations["none"].tokens,
            "gib": {
                "params": p.params / GIB,
                "grads": p.grads / GIB,
                "optimizer": p.optimizer / GIB,
                "buffers": p.buffers / GIB,
                "fsdp_gathered": p.fsdp_gathered / GIB,
                "optimizer_temp": p.optimizer_temp / GIB,
                **{f"activations_{ac}": self.activations[ac].peak / GIB for ac in AC_MODES},
                **{f"total_{ac}": self.total(ac) / GIB for ac in AC_MODES},
            },
            "peak_phase": {ac: self.peak(ac)[0] for ac in AC_MODES},
            "fits": {ac: self.fits(ac, usable_bytes) for ac in AC_MODES},
        }


def plan_layout(
    args: ModelArgs, inv: ParamInventory, prec: Precision, layout: Layout, local_batch: int, seq_len: int,
    sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
) -> LayoutPlan:
    layers = model_activations(args, prec, layout, activations)
    copies = autocast_weight_copies(inv, layout, prec)
    acts = {
        ac: activation_memory(args, prec, layout, ac, local_batch, seq_len, layers, sac_option, copies)
        for ac in AC_MODES
    }
    return LayoutPlan(layout, param_memory(inv, layout, prec, optimizer_impl), acts)


def plan_gpus(
    args: ModelArgs, inv: ParamInventory, prec: Precision, n_gpus: int, local_batch: int, seq_len: int,
    hsdp: bool = False, sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
) -> list[LayoutPlan]:
    layouts = enumerate_layouts(n_gpus, args.n_routed_experts, seq_len, hsdp)
    return [plan_layout(args, inv, prec, lay, local_batch, seq_len, sac_option, activations, optimizer_impl)
            for lay in layouts]


def min_gpus(
    args: ModelArgs, inv: ParamInventory, prec: Precision, local_batch: int, seq_len: int, usable_bytes: float,
    sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
) -> dict[str, int | None]:
    """Fewest GPUs (powers of two up to MAX_SEARCH_GPUS) with a fitting layout, per AC mode."""
    found: dict[str, int | None] = {ac: None for ac in AC_MODES}
    for n in _powers_of_two(MAX_SEARCH_GPUS):
        plans = plan_gpus(args, inv, prec, n, local_batch, seq_len, sac_option=sac_option, activations=activations,
                          optimizer_impl=optimizer_impl)
        for ac in AC_MODES:
            if found[ac] is None and any(p.fits(ac, usable_bytes) for p in plans):
                found[ac] = n
        if all(v is not None for v in found.values()):
            break
    return found


# =========================================================================== CLI
@dataclass
class PlanOptions:
    gpus: int | None = None
    gpu_mem_gib: float = 141.0
    ac: str | None = None
    seq_len: int | None = None
    local_batch: int | None = None
    headroom: float = 0.10
    hsdp: bool = False
    top: int = 5
    activations: str | None = None  # None: "compiled" when [compile] covers the model, else "eager"


_OPTIONS = {
    "--gpus": ("gpus", int),
    "--gpu-mem-gib": ("gpu_mem_gib", float),
    "--ac": ("ac", str),
    "--seq-len": ("seq_len", int),
    "--local-batch": ("local_batch", int),
    "--headroom": ("headroom", float),
    "--top": ("top", int),
    "--activations": ("activations", str),
}


def parse_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Split our options from the config arguments; raise ConfigError (one line) on a mistake."""
    opts = PlanOptions()
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key == "--hsdp":
            opts = replace(opts, hsdp=True)
            i += 1
            continue
        if key not in _OPTIONS:
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        name, tp = _OPTIONS[key]
        try:
            parsed = tp(value)
        except ValueError:
            raise ConfigError(f"command line: bad value for {key} {value!r}: expected {tp.__name__}") from None
        opts = replace(opts, **{name: parsed})
    if opts.gpus is None:
        raise ConfigError("command line: --gpus N is required")
    checks = [
        (opts.gpus >= 1, f"--gpus must be >= 1, got {opts.gpus}"),
        (opts.gpu_mem_gib > 0, f"--gpu-mem-gib must be > 0, got {opts.gpu_mem_gib}"),
        (opts.ac is None or opts.ac in AC_MODES, f"--ac must be one of {'|'.join(AC_MODES)}, got {opts.ac!r}"),
        (opts.seq_len is None or opts.seq_len >= 1, f"--seq-len must be >= 1, got {opts.seq_len}"),
        (opts.local_batch is None or opts.local_batch >= 1, f"--local-batch must be >= 1, got {opts.local_batch}"),
        (0 <= opts.headroom < 1, f"--headroom must lie in [0, 1), got {opts.headroom}"),
        (opts.top >= 1, f"--top must be >= 1, got {opts.top}"),
        (opts.activations is None or opts.activations in ACTIVATION_MODELS,
         f"--activations must be one of {'|'.join(ACTIVATION_MODELS)}, got {opts.activations!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"command line: {message}")
    return opts, rest


def _gib(x: float) -> str:
    return f"{x / GIB:8.1f}"


def _print_table(plans: list[LayoutPlan], usable: float, ac: str) -> None:
    print(f"  {'rep':>4} {'shard':>6} {'cp':>3} {'ep':>4} {'tokens':>7} | {'params':>8} {'grads':>8} {'optim':>8} "
          f"{'buffers':>8} {'gathered':>8} | {'act:none':>8} {'sel':>8} {'full':>8} | "
          f"{'tot:none':>8} {'sel':>8} {'full':>8}")
    for p in plans:
        lay, m = p.layout, p.params
        marks = "".join("*" if p.fits(mode, usable) else "." for mode in AC_MODES)
        print(f"  {lay.dp_replicate:>4} {lay.dp_shard:>6} {lay.cp:>3} {lay.ep:>4} {p.activations[ac].tokens:>7} | "
              f"{_gib(m.params)} {_gib(m.grads)} {_gib(m.optimizer)} {_gib(m.buffers)} {_gib(m.fsdp_gathered)} | "
              + " ".join(_gib(p.activations[mode].peak) for mode in AC_MODES) + " | "
              + " ".join(_gib(p.total(mode)) for mode in AC_MODES) + f"  {marks}")


def _print_activation_summary(args: ModelArgs, prec: Precision, layout: Layout, activations: str) -> None:
    """Bytes per local token of each layer kind (the layout only matters through its flags)."""
    seen: dict[str, LayerActivations] = {}
    for layer in model_activations(args, prec, layout, activations):
        seen.setdefault(layer.kind, layer)
    parts = [
        f"{kind} kept {l.kept / 1024:.0f}" + (f" + {l.per_seq_sq:g} B x T^2" if l.per_seq_sq else "")
        + f" / SAC {l.sac_kept / 1024:.0f} / transient {l.transient / 1024:.0f}"
        for kind, l in seen.items()
    ]
    s = prec.stream(layout.fsdp_enabled)
    stream = _stream_bytes_per_token(args, s, ["none"] * args.n_layers) / 1024
    head = _head_kept_per_token(args, s, prec.compute) / 1024
    print(f"  {activations} activations, KiB per local token (ep={layout.ep}, cp={layout.cp}): " + "; ".join(parts)
          + f"; AttnRes stream {stream:.0f} (all layers); head {head:.0f}")


def _eager_summary(args: ModelArgs, prec: Precision, plans: list[LayoutPlan]) -> dict[str, dict]:
    """The eager profiles the plans used, per FSDP setting and layer kind (JSON-ready)."""
    out: dict[str, dict] = {}
    for fsdp in sorted({p.layout.fsdp_enabled for p in plans}):
        profiles = eager_profiles(args, prec, fsdp)
        out["fsdp" if fsdp else "no_fsdp"] = {
            p.kind: {"kib_per_token": p.per_token / 1024, "bytes_per_seq_sq": p.per_seq_sq,
                     "measured_on": "fake" if p.fake else "cpu", "experts_built": list(p.experts)}
            for p in profiles.values()
        }
    return out


def run_plan(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = parse_args(argv)
    config = load_config(rest)
    args = model_args_from_config(config)
    seq_len = opts.seq_len or config.training.seq_len
    local_batch = opts.local_batch or config.training.local_batch_size
    ac = opts.ac or config.activation_checkpoint.mode
    if ac not in AC_MODES:
        raise ConfigError(f"activation_checkpoint.mode {ac!r} is not modelled; pass --ac none|selective|full")
    prec = Precision.from_config(config)
    usable = (1 - opts.headroom) * opts.gpu_mem_gib * GIB

    with torch.device("meta"):
        model = Decoder(args)
    counts = count_params(model, args)
    inv = inventory(model, args)
    sac_option = config.activation_checkpoint.selective_ac_option
    if sac_option != "op" and not sac_option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or an integer, got {sac_option!r}")
    compiled = config.compile.enable and "model" in config.compile.components
    activations = opts.activations or ("compiled" if compiled else "eager")
    optimizer_impl = config.optimizer.implementation
    if optimizer_impl not in OPTIMIZER_IMPLEMENTATIONS:
        raise ConfigError(f"optimizer.implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}, "
                          f"got {optimizer_impl!r}")
    plans = plan_gpus(args, inv, prec, opts.gpus, local_batch, seq_len, opts.hsdp, sac_option, activations,
                      optimizer_impl)
    assert plans, "dp_shard = N, cp = ep = 1 is always a layout"
    checks = {"params_match_inspect": counts.total == inv.total and counts.routed_experts == inv.routed_experts}
    shard_ok = all(all(sharding_checks(inv, p.layout).values()) for p in plans)
    checks["shard_sums_match_totals"] = shard_ok

    print(f"titan_moe.plan: {config.job.config_file}  flavor={config.model.flavor}  "
          f"params {inv.total:,} (routed experts {inv.routed_experts:,}, other {inv.non_expert:,}); "
          f"buffers {inv.buffer_bytes / GIB:.2f} GiB")
    training = config.training
    print(f"  bytes: params/grads/optimizer in {training.dtype} ({4 * prec.param} B per sharded param "
          f"with AdamW, {optimizer_impl} step), compute {training.mixed_precision_param}, "
          f"reduce {training.mixed_precision_reduce}")
    print(f"  tokens per GPU = local_batch {local_batch} x seq_len {seq_len} / cp;  fit: total <= "
          f"{1 - opts.headroom:.2f} x {opts.gpu_mem_gib:g} GiB = {usable / GIB:.1f} GiB "
          f"({opts.headroom:.0%} headroom for CUDA context, NCCL, fragmentation: a guess, not measured)")
    sac_text = "op-level SAC" if sac_option == "op" else f"layer SAC, 1 layer in {sac_option} checkpointed"
    print(f"  AC: one checkpoint per decoder layer; selective = {sac_text} "
          f"(activation_checkpoint.selective_ac_option = {sac_option!r})")
    print(f"  sanity: total params == inspect's total: {checks['params_match_inspect']};  "
          f"per-GPU shards x degrees == totals: {checks['shard_sums_match_totals']}")
    _print_activation_summary(args, prec, plans[0].layout, activations)
    if activations == "eager":
        print("  eager activations: measured per layer kind with saved-tensor hooks on CPU (fake tensors for "
              "large layers), SDPA and RMSNorm saving what their CUDA kernels save (see the module docstring)")
    elif not compiled:
        print("  note: [compile] is off but --activations compiled: the counts assume fused layers, and eager "
              "PyTorch keeps about twice as much per layer (--activations eager measures it)")
    print(f"\n{opts.gpus} GPUs, {len(plans)} layouts (GiB per GPU; act: the activations' high-water mark; tot: the "
          "step's peak over its phases, not the row's sum; marks: fits with AC none/selective/full):")
    _print_table(plans, usable, ac)

    fitting = sorted((p for p in plans if p.fits(ac, usable)), key=lambda p: p.total(ac))
    print(f"\nsmallest fitting layouts, ac={ac}:" if fitting else f"\nno layout fits on {opts.gpus} GPUs with ac={ac}")
    for p in fitting[: opts.top]:
        lay = p.layout
        phase, total = p.peak(ac)
        print(f"  dp_replicate={lay.dp_replicate} dp_shard={lay.dp_shard} cp={lay.cp} ep={lay.ep}: "
              f"{total / GIB:.1f} GiB (peak: {phase})")
    fewest = min_gpus(args, inv, prec, local_batch, seq_len, usable, sac_option, activations, optimizer_impl)
    print(f"fewest GPUs (powers of two <= {MAX_SEARCH_GPUS}) with a fitting layout: "
          + ", ".join(f"{mode}={fewest[mode] if fewest[mode] is not None else 'none'}" for mode in AC_MODES))
    return {
        "config": config.job.config_file,
        "flavor": config.model.flavor,
        "gpus": opts.gpus,
        "gpu_mem_gib": opts.gpu_mem_gib,
        "headroom": opts.headroom,
        "usable_gib": usable / GIB,
        "ac": ac,
        "selective_ac_option": sac_option,
        "activations": activations,
        "optimizer_implementation": optimizer_impl,
        **({"eager_profiles": _eager_summary(args, prec, plans)} if activations == "eager" else {}),
        "seq_len": seq_len,
        "local_batch": local_batch,
        "precision": {"param": config.training.dtype, "compute": config.training.mixed_precision_param,
                      "reduce": config.training.mixed_precision_reduce},
        "total_params": inv.total,
        "routed_expert_params": inv.routed_experts,
        "other_params": inv.non_expert,
        "fits": bool(fitting),
        "best": [p.summary(usable) for p in fitting[: opts.top]],
        "layouts": [p.summary(usable) for p in plans],
        "min_gpus": fewest,
        "sanity": checks,
    }


def main(argv: list[str] | None = None) -> None:
    try:
        summary = run_plan(argv)
    except ConfigError as e:
        print(f"titan_moe.plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
