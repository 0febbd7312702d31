"""Layouts (torchtitan 0.2.2's `ParallelDims`): `N = dp_replicate * dp_shard * cp` GPUs (no TP,
no PP). FSDP shards over `fsdp = dp_shard * cp`; HSDP replicas (`dp_replicate`) hold full
copies of the shards and reduce no memory. EP takes its degree from the FSDP ranks:
`ep | dp_shard * cp` and `ep | n_routed_experts`; the routed experts are split over EP on
dim 0 and then FSDP-sharded over the remaining `efsdp = dp_shard * cp / ep` ranks. Enumerated:
`cp in {1, 2, 4, 8}` dividing N and seq_len, `dp_replicate = 1` (with `--hsdp`: every power of
two leaving `dp_shard * cp > 1`), every such `ep`. (`parallelize.py` wires both; under CP
each layer is counted as one rank of the group runs it, the worst rank by default:
`context_parallel`, docs/planner.md "Limits".)

Bytes. `P` = bytes of `training.dtype` (what parameters, gradients and optimizer states are
stored in: torchtitan builds the model under that default dtype; bf16 means no fp32 master
copy), `a` = bytes of `training.mixed_precision_param` (the compute dtype: FSDP all-gathers
in it, matmuls produce it), reduce dtype fp32 (4 B). Stream dtype `s` = `a` under FSDP (the
embedding weight is gathered in `a`), `P` without FSDP (one GPU under autocast, which leaves
the embedding, so the AttnRes stream, in the parameter dtype). One GPU runs FSDP too with
`training.one_device_mixed_precision = "fsdp"` (`Layout.one_device_fsdp`): `s` = `a` there.
"""

from __future__ import annotations

from dataclasses import dataclass






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
    one_device_fsdp: bool = False  # one GPU wrapped in FSDP2 (training.one_device_mixed_precision = "fsdp")

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fsdp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp_shard * cp ({self.fsdp})")
        if self.one_device_fsdp and self.n_gpus != 1:
            raise ValueError(f"one_device_fsdp applies to one GPU, not {self.n_gpus}")

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
        """FSDP2 wraps the model: sharding over `fsdp` > 1 ranks, or on one GPU for its mixed
        precision (`one_device_fsdp`)."""
        return self.fsdp > 1 or self.one_device_fsdp


def enumerate_layouts(
    n_gpus: int, n_experts: int, seq_len: int, hsdp: bool = False, one_device_fsdp: bool = False
) -> list[Layout]:
    """All layouts for `n_gpus` (see the module docstring), in a stable order; with
    `one_device_fsdp` the one-GPU layout runs FSDP2 (`Layout.one_device_fsdp`)."""
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
                    layouts.append(Layout(r, dp_shard, cp, ep, one_device_fsdp and n_gpus == 1))
    return layouts


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


# =========================================================================== precision
@dataclass(frozen=True)
class Precision:
    """Byte widths: `param` (training.dtype: params, grads, optimizer states), `compute`
    (mixed_precision_param), `reduce` (FSDP reduce-scatter, fp32); `cached_expert_casts`
    (training.cache_compute_weights): under autocast the routed experts' compute-dtype copies
    are kept for the whole step (`caches_expert_casts`)."""

    param: int
    compute: int
    reduce: int = 4
    cached_expert_casts: bool = False

    @classmethod
    def from_config(cls, config) -> Precision:
        return cls(
            param=_DTYPE_BYTES[config.training.dtype],
            compute=_DTYPE_BYTES[config.training.mixed_precision_param],
            reduce=_DTYPE_BYTES[config.training.mixed_precision_reduce],
            cached_expert_casts=bool(getattr(config.training, "cache_compute_weights", False)),
        )

    def stream(self, fsdp_enabled: bool) -> int:
        return self.compute if fsdp_enabled else self.param


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


def caches_expert_casts(layout: Layout, prec: Precision) -> bool:
    """Whether the trainer keeps the routed experts' weights cast once per step: asked for,
    under autocast (compute dtype below the parameters', no FSDP) and with the experts'
    weights plain tensors (no expert parallelism)."""
    return prec.cached_expert_casts and not layout.fsdp_enabled and layout.ep == 1 and prec.compute != prec.param
