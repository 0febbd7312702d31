"""The step walk (torchtitan 0.2.2's `train_step`: `optimizers.zero_grad()`, i.e. set_to_none,
frees the previous step's gradients before the forward; forward and loss under AMP; `del
pred`; `loss.backward()`; `clip_grad_norm_` (foreach: one scalar norm per tensor, then in
place); `optimizers.step()`). AdamW creates its states in the first `step()`, so steps 1-3
peak in step 2 or 3 and every phase holds the optimizer states. Every phase holds parameters
+ optimizer states + buffers, and the FSDP working memory above (one bound for the whole
forward and backward, not split by phase) in all phases but the optimizer step. They add:
  forward layer i, i = 0 .. n-1: the held bytes of layers < i; the stream tensors of layers
    <= i (as below; layer i's own partial sums, also in its forward peak, counted twice: an
    upper bound); layer i's forward peak above its start (eager: measured, `LayerActivations.
    forward_at`: its kept tensors and forward temporaries, under full AC only the
    temporaries; fused: its kept set, nothing under full AC) plus, without full AC, its
    constant and autocast weight copies; no gradient (zero_grad freed them). These phases
    matter where the forward's temporaries outgrow what the backward adds: MLA's document
    mask, whose construction holds a bool `[T, T]` and its negation beside the bf16 bias.
  loss and head backward: every layer's held bytes, the whole stream, the head's kept tensors
    and autocast copies and the head transient (`V * 8`: the forward's fp32 logits and the
    backward's log-softmax gradients take the same budget, one phase for both; with
    `head_chunk_tokens` one chunk's `V * 12` and no kept log-softmax); no gradient.
  backward layer i, i = n-1 .. 0: the gradients of the head and of layers > i; the held bytes
    of layers <= i; the stream tensors of layers <= i (their partial sums; block mode: the
    initial buffer and those of closed blocks up to i's; full mode: the initial buffer and
    those pushed by layers <= i); the stream gradients `(S+1) D s` (2 D s without AttnRes);
    layer i's "in backward" bytes (activations.py's AC table: without AC its transient,
    under full AC its recompute and transient together, measured op by op for eager layers
    with the stream gradients already allocated, so they are not in the layer's bytes).
    Layer i's own gradients are not counted: they are written op by op during its backward,
    after its recompute (an approximation that leaves out at most one layer's gradients; the
    measured transients leave out the weight gradients' temporaries too).
  backward embedding: the gradients of the head and all layers, the stream gradients.
  optimizer step: all gradients and the optimizer's temporaries; no activations, no FSDP
    units gathered.
The step's peak (`total_*` in the JSON) is the largest phase; `activations_*` is the
activations' own high-water mark over the phases, so the table's columns do not add up to the
total. Not modelled: autocast's weight cache (each layer's bf16 weight copies, cached until the
forward's autocast region ends: under full AC every layer's copies at the end of the forward,
0.3 GiB for small_1gpu), the embedding's gradient while it is written, the clip's scalars.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import max_sources

from titan_moe.plan.activations import LayerActivations, _prologue, model_activations, with_moe_token_tiles
from titan_moe.plan.context_parallel import CPOptions
from titan_moe.plan.layout import (
    AC_MODES, GIB, MAX_SEARCH_GPUS, Layout, Phase, Precision, _powers_of_two, caches_expert_casts, enumerate_layouts,
)
from titan_moe.plan.params import ParamInventory, ParamMemory, param_memory

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
    only its input), plus the sources (block: b_0 and one `[T, D]` tensor per closed block,
    `attn_res.ResidualStream`; full: b_0 and every sub-layer's output).

    `upto`: only what layers 0..upto use, alive while layer `upto` runs backward (the partial
    sums of layers <= upto; block mode: the blocks closed before upto's; full mode: b_0 and
    the outputs of layers <= upto); None: all (the end of the forward; block mode: every
    closed block, the last one read by the final mixer).
    """
    D, L = args.dim, args.n_layers
    last = L - 1 if upto is None else upto
    per_layer = sum(2 if p == "none" else 1 for p in policies[: last + 1])
    if args.attn_res == "none":
        return per_layer * D * s
    if args.attn_res == "block":
        S = max_sources(args.attn_res, L, args.attn_res_block_size)
        closed = S - 1 if upto is None else min(upto // args.attn_res_block_size, S - 1)
        return (1 + closed) * D * s + per_layer * D * s
    return (1 + 2 * (last + 1)) * D * s  # full mode: b_0 and two pushed outputs a layer


def _head_kept_per_token(args: ModelArgs, s: int, a: int) -> float:
    """The head's prologue and, unless the loss runs in chunks (`head_chunk_tokens`), the fp32
    log-softmax the cross-entropy keeps for its backward."""
    logsoftmax = 0 if args.head_chunk_tokens else args.vocab_size * 4
    return sum(e.bytes for e in _prologue("head", args, s, a)) + logsoftmax


def _head_transient(args: ModelArgs, t: int) -> float:
    """Bytes of the head's transient at `t` local tokens: whole, `V * 8` a token (the forward's
    fp32 logits, then the backward's log-softmax gradient); in chunks (`titan_moe.model.head`),
    one chunk's recomputed logits, log-softmax and gradient, `V * 12` a token of the chunk."""
    if args.head_chunk_tokens:
        return args.vocab_size * 12 * min(args.head_chunk_tokens, t)
    return args.vocab_size * 8 * t


def autocast_weight_copies(inv: ParamInventory, layout: Layout, prec: Precision) -> tuple[list[float], float]:
    """Bytes of autocast's compute-dtype weight copies per decoder layer, and of the head.

    Only without FSDP and when the compute dtype differs from the parameter dtype (with FSDP
    the gathered weights are already in the compute dtype: `ParamMemory.fsdp_gathered`).
    Each matmul saves its cast weight for the input gradient, so a layer's copies live from
    its forward to its backward, like its activations: all layers without AC, only the layer
    being recomputed under full AC (measured on the H200, small_1gpu, 8K: counting every
    layer's copies under full AC over-estimated the peak by 2.5 GiB). With the routed experts'
    casts kept for the whole step (`caches_expert_casts`) their copies are not here but in
    `ParamMemory.compute_weight_cache`.
    """
    a = prec.compute
    if layout.fsdp_enabled or a == prec.param:
        return [0.0] * len(inv.layer_shapes), 0.0
    skip_experts = caches_expert_casts(layout, prec)
    numel = lambda shapes: sum(math.prod(shape) * n for (shape, expert), n in shapes.items()  # noqa: E731
                               if not (expert and skip_experts))
    return [float(numel(sh) * a) for sh in inv.layer_shapes], float(numel(inv.head_shapes) * a)


def activation_memory(
    args: ModelArgs, prec: Precision, layout: Layout, ac: str, local_batch: int, seq_len: int,
    layers: list[LayerActivations] | None = None, sac_option: str = "op",
    weight_copies: tuple[list[float], float] | None = None, cp_options: CPOptions = CPOptions(),
) -> ActivationMemory:
    """Activation bytes per GPU at `local_batch * seq_len / cp` local tokens, phase by phase over
    one training step (module docstring, "The step walk"); each phase names the gradients alive
    then, `ParamMemory.at` adds them with the other parameter-side bytes.

    `layers` (from `model_activations`) may be passed to reuse them across AC modes;
    `sac_option` is torchtitan's `selective_ac_option` ("op" or a layer frequency);
    `weight_copies` (from `autocast_weight_copies`) adds autocast's weight copies per layer;
    `cp_options`: how context-parallel layers are taken (`context_parallel.CPOptions`), for
    `layers` built here.
    """
    if seq_len % layout.cp:
        raise ValueError(f"seq_len ({seq_len}) must be divisible by cp ({layout.cp})")
    if local_batch < 0 or seq_len < 0:
        raise ValueError(f"local_batch and seq_len must be >= 0, got {local_batch}, {seq_len}")
    policies = layer_policies(ac, args.n_layers, sac_option)
    t = local_batch * seq_len // layout.cp
    a, s = prec.compute, prec.stream(layout.fsdp_enabled)
    D = args.dim
    if layers is None:
        layers = model_activations(args, prec, layout, cp_options=cp_options)

    layers = [with_moe_token_tiles(layer, args, t) for layer in layers]
    copies, head_copy = weight_copies or ([0.0] * len(layers), 0.0)
    held, during, forward = [], [], []  # per layer: forward to backward; extra in backward; forward's peak
    for layer, policy, copy in zip(layers, policies, copies):
        # sum over local sequences of T_local^2 (context-parallel layers: `LayerActivations.seq_sq`)
        seq_sq = layer.seq_sq(local_batch, seq_len // layout.cp)
        whole = layer.kept * t + layer.per_seq_sq * seq_sq + layer.constant + copy
        transient = layer.transient_at(t, seq_sq)
        if policy == "none":
            held.append(whole)
            during.append(transient)
        elif policy == "full":  # recompute + transient (measured together for eager layers)
            held.append(0.0)
            during.append(layer.full_ac_backward_at(t, seq_sq) + layer.constant + copy)
        else:  # op-level SAC: its saved set is held, the rest (and the copies) rematerialised
            held.append(layer.sac_kept * t)
            during.append(whole + (layer.sac_recompute - layer.kept) * t + transient)
        full = policy == "full"
        forward.append(layer.forward_at(full, t, seq_sq) + (0.0 if full else layer.constant + copy))
    L = len(layers)
    S = max_sources(args.attn_res, args.n_layers, args.attn_res_block_size)
    stream_grads = ((S + 1) if args.attn_res != "none" else 2) * D * s * t
    stream = _stream_bytes_per_token(args, s, policies) * t
    head_kept = _head_kept_per_token(args, s, a) * t
    head_transient = _head_transient(args, t)
    layers_kept = sum(held)
    kept = layers_kept + stream + head_kept + head_copy
    held_upto = list(accumulate(held))  # held bytes of layers 0..i
    phases = [
        Phase(f"forward layer {i}", (held_upto[i - 1] if i else 0.0) + forward[i]
              + _stream_bytes_per_token(args, s, policies, upto=i) * t, grad_units=0)
        for i in range(L)
    ]
    phases.append(Phase("loss and head backward", kept + head_transient, grad_units=0))
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
                "compute_weight_cache": p.compute_weight_cache / GIB,
                **{f"activations_{ac}": self.activations[ac].peak / GIB for ac in AC_MODES},
                **{f"total_{ac}": self.total(ac) / GIB for ac in AC_MODES},
            },
            "peak_phase": {ac: self.peak(ac)[0] for ac in AC_MODES},
            "fits": {ac: self.fits(ac, usable_bytes) for ac in AC_MODES},
        }


def plan_layout(
    args: ModelArgs, inv: ParamInventory, prec: Precision, layout: Layout, local_batch: int, seq_len: int,
    sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
    cp_options: CPOptions = CPOptions(),
) -> LayoutPlan:
    """Per-GPU memory of one layout; with `layout.cp > 1` at the rank `cp_options` names (the
    worst one by default: `context_parallel`)."""
    layers = model_activations(args, prec, layout, activations, cp_options)
    copies = autocast_weight_copies(inv, layout, prec)
    acts = {
        ac: activation_memory(args, prec, layout, ac, local_batch, seq_len, layers, sac_option, copies)
        for ac in AC_MODES
    }
    return LayoutPlan(layout, param_memory(inv, layout, prec, optimizer_impl), acts)


def plan_gpus(
    args: ModelArgs, inv: ParamInventory, prec: Precision, n_gpus: int, local_batch: int, seq_len: int,
    hsdp: bool = False, sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
    one_device_fsdp: bool = False, cp_options: CPOptions = CPOptions(),
) -> list[LayoutPlan]:
    layouts = enumerate_layouts(n_gpus, args.n_routed_experts, seq_len, hsdp, one_device_fsdp)
    return [plan_layout(args, inv, prec, lay, local_batch, seq_len, sac_option, activations, optimizer_impl,
                        cp_options) for lay in layouts]


def min_gpus(
    args: ModelArgs, inv: ParamInventory, prec: Precision, local_batch: int, seq_len: int, usable_bytes: float,
    sac_option: str = "op", activations: str = "compiled", optimizer_impl: str = "fused",
    one_device_fsdp: bool = False, cp_options: CPOptions = CPOptions(),
) -> dict[str, int | None]:
    """Fewest GPUs (powers of two up to MAX_SEARCH_GPUS) with a fitting layout, per AC mode."""
    found: dict[str, int | None] = {ac: None for ac in AC_MODES}
    for n in _powers_of_two(MAX_SEARCH_GPUS):
        plans = plan_gpus(args, inv, prec, n, local_batch, seq_len, sac_option=sac_option, activations=activations,
                          optimizer_impl=optimizer_impl, one_device_fsdp=one_device_fsdp, cp_options=cp_options)
        for ac in AC_MODES:
            if found[ac] is None and any(p.fits(ac, usable_bytes) for p in plans):
                found[ac] = n
        if all(v is not None for v in found.values()):
            break
    return found
