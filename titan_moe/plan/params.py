"""Parameters, per GPU (from the model built on the meta device, `named_parameters`):
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
  * Muon (`optimizer.name = "Muon"`, titan_moe.optim): a momentum buffer `P * shard` for each
    matrix it updates (`muon_blocks`), AdamW's two moments for the rest. Its step runs one
    parameter at a time; the temporaries are the largest of: AdamW's for-loop pair of the
    largest AdamW shard, and for one Muon parameter its update (`P * shard`), the all-gathered
    update (`P * full`; experts sharded on dim 1: their E/ep expert-parallel experts) when its
    blocks are not whole on the rank (column and whole-matrix blocks, row blocks cut by the
    shard, experts sharded on dim 1), and the larger of the bf16 Newton-Schulz work (two
    copies of the blocks and two Gram matrices each) and the bf16 result beside its cast.
    Checked in one process on the CPU (the profiler's allocations over a step); the FSDP and
    EP cases follow the same code but are not measured.
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
    FSDP on one GPU (`Layout.one_device_fsdp`) has the same units; its reduce copies the
    `red`-dtype input into a second `red` buffer after freeing the unsharded gradients, so
    the gradient part is `max(a + red, 2 red)` (FSDP2's one-rank path).
    Without FSDP (one GPU): autocast's `a`-copies of the weights (when `a != P`), counted
    with the activations because they live like them: each layer's copies are saved by its
    matmuls from its forward to its backward (all layers without AC; under full AC only the
    layer being recomputed), the head's from the forward to the head's backward (autocast's
    cache is dropped when the forward's autocast region exits; the head matmul's saved copy
    goes with its backward).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

import torch

from titan_moe.model.args import ModelArgs
from titan_moe.optim.muon import COLS, EXPERTS, ROWS
from titan_moe.optim.param_groups import block_layout

from titan_moe.plan.layout import Layout, Phase, Precision, caches_expert_casts

# =========================================================================== parameters
ShapeCount = Counter  # Counter[(shape, is_expert)] -> number of parameters of that shape


@dataclass
class ParamInventory:
    """What the meta-device model holds, grouped for the sharding arithmetic.

    shapes: (shape, is_expert) -> count over all parameters.
    layer_shapes: the same per decoder layer (its FSDP unit, experts included).
    head_shapes: the `[norm, output]` FSDP unit.
    muon_blocks: (shape, is_expert, block_dim, block_size) -> count of the parameters per-head
        Muon updates (`titan_moe.optim.block_layout`), for `optimizer.name = "Muon"`.
    """

    total: int
    routed_experts: int
    shapes: ShapeCount
    layer_shapes: list[ShapeCount]
    head_shapes: ShapeCount
    buffer_bytes: int
    n_experts: int
    muon_blocks: Counter = field(default_factory=Counter)  # (shape, is_expert, block_dim, block_size) -> count

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts


def is_routed_expert(name: str) -> bool:
    return ".feed_forward.experts." in name


def inventory(model: torch.nn.Module, args: ModelArgs) -> ParamInventory:
    blocks = block_layout(model)
    muon_blocks: Counter = Counter()
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
        if blocks[name] is not None:
            muon_blocks[(*key, *blocks[name])] += 1
        parts = name.split(".")
        if parts[0] == "layers":
            layer_shapes[int(parts[1])][key] += 1
        elif parts[0] in ("norm", "output"):
            head_shapes[key] += 1
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    return ParamInventory(total, experts, shapes, layer_shapes, head_shapes, buffer_bytes, args.n_routed_experts,
                          muon_blocks)


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
OPTIMIZER_KINDS = (*OPTIMIZER_IMPLEMENTATIONS, "muon")  # "muon": optimizer.name = "Muon" (its own step)


def shard_numel(shape: tuple[int, ...], is_expert: bool, layout: Layout, n_experts: int) -> int:
    return expert_shard_numel(shape, layout, n_experts) if is_expert else fsdp_shard_numel(shape, layout.fsdp, 0)


def muon_blocks_local(shape: tuple[int, ...], is_expert: bool, block_dim: int, block_size: int, layout: Layout,
                      n_experts: int) -> bool:
    """Whether each rank's shard holds its Muon blocks whole (no all-gather of the update):
    `titan_moe.optim.muon._local_blocks_whole` on shapes. Shards are `torch.chunk`s on dim 0
    (experts: of the E/ep local ones, over efsdp; on dim 1 when efsdp * ep > E)."""
    if is_expert:
        degree = layout.fsdp if layout.ep == 1 else layout.efsdp
        on_dim1 = layout.ep > 1 and layout.efsdp * layout.ep > n_experts
        return degree == 1 or not on_dim1  # whole experts per rank: aligned to the blocks
    if layout.fsdp == 1:
        return True
    if block_dim != ROWS:
        return False
    return -(-shape[0] // layout.fsdp) % block_size == 0


def muon_step_bytes(shape: tuple[int, ...], is_expert: bool, block_dim: int, block_size: int, layout: Layout,
                    n_experts: int, P: int) -> float:
    """Temporaries of one Muon parameter's update (module docstring)."""
    local = shard_numel(shape, is_expert, layout, n_experts)
    whole = muon_blocks_local(shape, is_expert, block_dim, block_size, layout, n_experts)
    # cut experts gather over efsdp only: the rank's E/ep expert-parallel experts
    gathered = math.prod(shape) // (layout.ep if is_expert else 1)
    n = local if whole else gathered
    m, k = {EXPERTS: shape[-2:], ROWS: (block_size, shape[-1]), COLS: (shape[0], block_size)}.get(block_dim, shape)
    blocks = n // (m * k)
    # alive through the step: the update (and its gathered copy); then the larger of the
    # Newton-Schulz iteration (two bf16 copies of the blocks, the bf16 Gram matrices A and B)
    # and the scaled bf16 result beside its cast to the parameter's dtype
    newton_schulz = 2 * 2 * n + 2 * 2 * blocks * min(m, k) ** 2
    return P * local + (0 if whole else P * gathered) + max(newton_schulz, 2 * n + P * local)


@dataclass
class ParamMemory:
    """Per-GPU bytes of parameters, gradients, optimizer states, buffers and FSDP buffers.

    `layer_grads` (per decoder layer) and `head_grads` (`[norm, output]`) split `grads` by the
    order backward creates them; the rest (embedding, final AttnRes mixer) comes last.
    `optimizer_temp`: the optimizer step's temporaries (AdamW, by `optimizer.implementation`).
    `compute_weight_cache`: the routed experts' weights in the compute dtype, kept from one
    optimizer step to the next (`caches_expert_casts`), alive in every phase.
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
    compute_weight_cache: float = 0.0

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
        states = (self.params + self.optimizer + self.buffers + self.compute_weight_cache
                  + self.grads_by_units[phase.grad_units])
        if phase.optimizer_step:
            return states + self.optimizer_temp
        return states + self.fsdp_gathered


def param_memory(inv: ParamInventory, layout: Layout, prec: Precision, optimizer_impl: str = "fused") -> ParamMemory:
    if optimizer_impl not in OPTIMIZER_KINDS:
        raise ValueError(f"optimizer_impl must be one of {OPTIMIZER_KINDS}, got {optimizer_impl!r}")
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
        # unsharded gradients + the reduce input; one rank copies that input into a second
        # reduce-dtype buffer (once the gradients are freed) instead of reduce-scattering it
        grad_bytes = a + red if layout.fsdp > 1 else max(a + red, 2 * red)
        layer_peak = largest * (2 * a + grad_bytes)
        head = gathered_numel(inv.head_shapes, layout, inv.n_experts)
        head_peak = head * (a + grad_bytes) + (units[-1] if units else 0) * a
        gathered = float(max(layer_peak, head_peak))
    else:
        gathered = 0.0  # one GPU: autocast's weight copies are counted with the activations
    muon_sharded = 0
    if optimizer_impl == "muon":
        muon_sharded = sum(count * shard_numel(shape, is_expert, layout, inv.n_experts)
                           for (shape, is_expert, _, _), count in inv.muon_blocks.items())
        adamw = inv.shapes - Counter({(shape, is_expert): count
                                      for (shape, is_expert, _, _), count in inv.muon_blocks.items()})
        temp = float(max([2 * P * shard_numel(shape, is_expert, layout, inv.n_experts) for shape, is_expert in adamw]
                         + [muon_step_bytes(*key, layout, inv.n_experts, P) for key in inv.muon_blocks], default=0))
    elif optimizer_impl == "foreach":  # one list of temporaries over all parameters at a time
        temp = float(sharded * P)
    elif optimizer_impl == "for-loop":  # sqrt(exp_avg_sq) and its quotient, of one parameter
        largest_shard = max((shard_numel(shape, is_expert, layout, inv.n_experts) for shape, is_expert in inv.shapes),
                            default=0)
        temp = float(2 * largest_shard * P)
    else:
        temp = 0.0  # fused: one kernel updating in place
    return ParamMemory(
        sharded_expert_numel=expert,
        sharded_other_numel=other,
        params=float(sharded * P),
        grads=float(sharded * P),
        optimizer=float((2 * sharded - muon_sharded) * P),  # Muon: one buffer, AdamW: two moments
        buffers=float(inv.buffer_bytes),
        fsdp_gathered=gathered,
        largest_unit=largest,
        layer_grads=layer_grads,
        head_grads=float(sum(sharded_numel(inv.head_shapes, layout, inv.n_experts)) * P),
        optimizer_temp=temp,
        compute_weight_cache=float(inv.routed_experts * a) if caches_expert_casts(layout, prec) else 0.0,
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
