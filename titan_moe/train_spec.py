"""The torchtitan train spec that ties our model to parallelism, optimizers and data.

Registered as "titan_moe"; selected by `[model] name = "titan_moe"` and `flavor` (a preset
from `titan_moe.flavors`, overridable field by field in the TOML `[model]` section).
"""

from __future__ import annotations

import copy

from titan_moe.runtime.optional_packages import provide_datasets_placeholder

provide_datasets_placeholder()  # torchtitan imports `datasets` at module level

from torchtitan.components.loss import build_cross_entropy_loss  # noqa: E402
from torchtitan.components.lr_scheduler import build_lr_schedulers  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers  # noqa: E402
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config  # noqa: E402
from titan_moe.flavors import FLAVORS  # noqa: E402
from titan_moe.hf.adapter import TitanStateDictAdapter  # noqa: E402
from titan_moe.metrics import build_titan_metrics_processor  # noqa: E402
from titan_moe.model.decoder import Decoder  # noqa: E402
from titan_moe.model.head import loss_from_prediction  # noqa: E402
from titan_moe.model.moe import LatentMoE, apply_expert_balance  # noqa: E402
from titan_moe.optim import Muon, muon_param_groups, no_weight_decay  # noqa: E402
from titan_moe.parallelize import parallelize_decoder  # noqa: E402
from titan_moe.validate import build_titan_validator  # noqa: E402

TRAIN_SPEC_NAME = "titan_moe"


def build_train_dataloader(*, dp_world_size: int, dp_rank: int, tokenizer, job_config):
    return dataloader_from_config(job_config, tokenizer=tokenizer, split="train", dp_rank=dp_rank,
                                  dp_world_size=dp_world_size)


def _split_weight_decay(optimizers, model_parts) -> None:
    """Move the no-decay parameters of each optimizer into a second group with weight_decay 0."""
    for optimizer, model in zip(optimizers, model_parts):
        exempt = {id(p) for name, p in model.named_parameters() if no_weight_decay(name, p)}
        (group,) = optimizer.param_groups
        kept = [p for p in group["params"] if id(p) not in exempt]
        moved = [p for p in group["params"] if id(p) in exempt]
        if moved:
            group["params"] = kept
            optimizer.add_param_group({"params": moved, "weight_decay": 0.0})


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's container holding one :class:`titan_moe.optim.Muon` per model part, its
    parameter groups from :func:`titan_moe.optim.muon_param_groups` (per-head / per-expert
    Muon blocks, AdamW for the rest). Checkpoints like the AdamW container (DCP, flattened
    optimizer state dict keyed by parameter name)."""

    def __init__(self, model_parts, optimizer_kwargs):
        all_params = []
        self.optimizers = []
        self.model_parts = model_parts
        for model in model_parts:
            groups = muon_param_groups(model, optimizer_kwargs["weight_decay"])
            self.optimizers.append(Muon(groups, **optimizer_kwargs))
            all_params.extend(p for g in groups for p in g["params"])
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)


def build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """`optimizer.name = "Muon"`: per-head Muon with AdamW for the rest, sharing `optimizer.lr`
    and `optimizer.weight_decay` (Muon's updates are RMS-matched to AdamW's, see
    titan_moe.optim.muon); `beta1`, `beta2`, `eps` are the AdamW groups'."""
    if optimizer_config.early_step_in_backward:
        raise ValueError("optimizer.name = 'Muon' does not support optimizer.early_step_in_backward")
    if ft_manager is not None and getattr(ft_manager, "enabled", False):
        raise ValueError("optimizer.name = 'Muon' does not support torchft")
    kwargs = {"lr": optimizer_config.lr, "weight_decay": optimizer_config.weight_decay,
              "betas": (optimizer_config.beta1, optimizer_config.beta2), "eps": optimizer_config.eps}
    return MuonOptimizersContainer(model_parts, kwargs)


def optimizer_summary(name: str, optimizers) -> str:
    """One start-up line: the optimizer, its lr and, per kind of group (Muon blocks, AdamW with
    and without weight decay), how many tensors and parameters it updates."""
    kinds: dict[str, list[int]] = {}
    lr = None
    for optimizer in optimizers.optimizers:
        for group in optimizer.param_groups:
            lr = group["lr"]
            kind = ("Muon" if group.get("muon") else "AdamW") + f" (weight decay {group['weight_decay']:g})"
            tensors, numel = kinds.setdefault(kind, [0, 0])
            kinds[kind] = [tensors + len(group["params"]), numel + sum(p.numel() for p in group["params"])]

    def count(n: int) -> str:
        return next((f"{n / size:.2f}{unit}" for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= size),
                    str(n))

    parts = [f"{kind}: {tensors} tensors, {count(numel)} parameters"
             for kind, (tensors, numel) in sorted(kinds.items(), key=lambda kv: not kv[0].startswith("Muon"))]
    return f"optimizer: {name}, lr {lr:g}; " + "; ".join(parts)


def build_optimizers_with_expert_balance(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's optimizers (no weight decay on the exempt parameters), or per-head Muon for
    `optimizer.name = "Muon"`, plus the expert-bias update (QB or sign rule) as a step pre-hook.

    The update runs once per optimizer step, after all microbatches of the step have
    accumulated their routing statistics; its counts are summed over every rank that routes
    distinct tokens: the data-parallel ranks and, under context parallelism, the cp ranks
    holding the rows' other segments (torchtitan's "loss" mesh, dp x cp).
    """
    if optimizer_config.name == "Muon":
        optimizers = build_muon_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    else:
        optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        _split_weight_decay(optimizers, model_parts)
    logger.info(optimizer_summary(optimizer_config.name, optimizers))
    group = None
    if parallel_dims.dp_cp_enabled:
        group = parallel_dims.get_mesh("loss").get_group()
    for part in model_parts:  # in-batch QB (model.qb_batch_iters > 0) balances over the same group
        for module in part.modules():
            if isinstance(module, LatentMoE):
                module.balance_group = group

    def _update(*args, **kwargs):
        # Kept on the device: the metrics processor reads them only on the steps it logs.
        stats = [apply_expert_balance(part, group=group) for part in model_parts]
        optimizers.expert_balance_stats = [s for s in stats if s is not None]

    optimizers.expert_balance_stats = []
    optimizers.register_step_pre_hook(_update)
    return optimizers


def build_loss(job_config, **kwargs):
    """torchtitan's cross-entropy (compiled when `compile.components` has "loss"), taking the
    model's own summed loss as it is when the model computed it (`model.head_chunk_tokens`)."""
    return loss_from_prediction(build_cross_entropy_loss(job_config, **kwargs))


def get_titan_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Decoder,
        # torchtitan mutates the chosen preset in place (update_from_config): hand it copies.
        model_args={name: copy.deepcopy(args) for name, args in FLAVORS.items()},
        parallelize_fn=parallelize_decoder,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_expert_balance,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_train_dataloader,
        build_tokenizer_fn=tokenizer_from_config,
        build_loss_fn=build_loss,
        build_validator_fn=build_titan_validator,
        build_metrics_processor_fn=build_titan_metrics_processor,
        state_dict_adapter=TitanStateDictAdapter,  # checkpoint.last_save_in_hf / initial_load_in_hf
    )


def register() -> None:
    """Register the spec and our model converters once (idempotent)."""
    from titan_moe import float8

    float8.register()
    try:
        get_train_spec(TRAIN_SPEC_NAME)
    except ValueError:
        register_train_spec(TRAIN_SPEC_NAME, get_titan_train_spec())


__all__ = ["register", "get_titan_train_spec", "TRAIN_SPEC_NAME"]
