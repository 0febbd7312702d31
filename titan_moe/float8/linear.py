"""float8 training of the model's nn.Linear layers with torchao: the "titan_float8" converter.

    [model]
    converters = ["titan_float8"]
    [quantize.linear.float8]            # torchtitan's table, plus our `min_features`
    recipe_name = "tensorwise"          # torchao recipe: tensorwise | rowwise | rowwise_with_gw_hp
    emulate = false                     # forced on when torch sees no CUDA device
    min_features = 64
    cache_weights = false               # true: weights cast to fp8 once per optimizer step
    filter_fqns = []                    # substrings of module names to keep in high precision
    enable_fsdp_float8_all_gather = true            # used with tensorwise + FSDP, else off
    precompute_float8_dynamic_scale_for_fsdp = true # with the all-gather

Which Linears convert (`float8_plan` lists every Linear with its reason to stay, if any):

* stay in high precision, by structure:
    - the output head (`Decoder.output`): its logits feed the loss directly;
    - KDA's decay projections `w_f_down`, `w_f_up` (rank dk) and beta projection `w_beta`
      (dim -> H): tiny GEMMs whose outputs go through exp/sigmoid into the recurrence,
      where a relative error compounds over the sequence;
    - anything inside the router (`TopKRouter`) or an AttnRes mixer. Neither holds an
      nn.Linear today (the router is an fp32 `F.linear` on a plain Parameter, the AttnRes
      pseudo-queries are vectors), so this only guards against a future refactor;
* stay by size: in or out features below `min_features`, or not divisible by 16 (an fp8
  GEMM requirement; torchtitan's own filter, reused);
* stay by name: any `filter_fqns` substring (torchtitan's rule), and with the flag
  "auto_filter_small_kn" in `filter_fqns` torchao's speed heuristic for the recipe;
* everything else converts: KDA `wq wk wv w_gate wo`, MLA `w_dq w_uq w_dkv w_ukv w_g w_o`,
  the dense FFN, the shared experts and the latent down/up projections of the MoE.

The output gates (KDA `w_gate`, MLA `w_g`, dim -> H*dv) convert: they are full-rank GEMMs
as large as `wq`, and their output goes through a sigmoid, whose slope is at most 1/4
and vanishes where gates saturate, so a logit error is damped rather than amplified.
To keep them in high precision anyway: `filter_fqns = ["attention.w_gate", "attention.w_g"]`.

The routed experts are not nn.Linear; their fp8 path is the "titan_float8_experts"
converter (`titan_moe.float8.experts`).

The converter subclasses torchtitan's `Float8LinearConverter` and keeps its
`post_optimizer_hook` (torchao's `precompute_float8_dynamic_scale_for_fsdp`, on when the fp8
all-gather is), adding the refresh of the once-per-step weight casts (`cache_weights`,
`titan_moe.float8.cached_linear`). It converts with torchao's `convert_to_float8_training`
and replaces the constructor because torchtitan's ignores `emulate` and refuses the FSDP
fp8 all-gather whenever `recipe_name` is set, even to "tensorwise".
"""

from __future__ import annotations

import dataclasses

import torch
import torch._inductor.config
from torch import nn
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.float8 import AUTO_FILTER_SMALL_KN_FLAG, Float8LinearConverter
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import has_cuda_capability

from titan_moe.model.attn_res import AttnResMixer
from titan_moe.model.decoder import Decoder
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.moe import TopKRouter

CONVERTER_NAME = "titan_float8"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's `Float8LinearRecipeName` values. Only tensorwise supports the FSDP fp8 all-gather."""

FP8_DIM_MULTIPLE = 16


def resolve_recipe(recipe_name: str | None) -> str:
    """The torchao recipe to use; None (torchtitan's default) means "tensorwise"."""
    recipe = "tensorwise" if recipe_name is None else recipe_name
    if recipe not in RECIPES:
        raise ValueError(
            f"quantize.linear.float8.recipe_name = {recipe_name!r} is not a torchao float8 recipe; "
            f"choose one of {list(RECIPES)}"
        )
    return recipe


def structural_keep_reasons(model: nn.Module) -> dict[str, str]:
    """fqn -> reason, for the Linears that stay in high precision because of what they are."""
    reasons: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, Decoder):
            reasons[prefix + "output"] = "output head"
        elif isinstance(module, KimiDeltaAttention):
            reasons[prefix + "w_f_down"] = "KDA decay projection"
            reasons[prefix + "w_f_up"] = "KDA decay projection"
            reasons[prefix + "w_beta"] = "KDA beta projection"
        elif isinstance(module, (TopKRouter, AttnResMixer)):
            what = "router" if isinstance(module, TopKRouter) else "AttnRes mixer"
            for sub, child in module.named_modules():
                if isinstance(child, nn.Linear):
                    reasons[prefix + sub] = what
    return reasons


def float8_plan(
    model: nn.Module,
    min_features: int = 64,
    filter_fqns: list[str] | tuple[str, ...] = (),
    extra_filter=None,
) -> dict[str, str | None]:
    """Every nn.Linear of `model` (by fqn) -> None if it converts to float8, else the reason it stays.

    `extra_filter(module, fqn) -> bool` (optional) must also accept a module for it to
    convert; the converter passes torchtitan's filter here (dims divisible by 16,
    `filter_fqns`, optionally torchao's auto filter).
    """
    if min_features < 0:
        raise ValueError(f"quantize.linear.float8.min_features must be >= 0, got {min_features}")
    structural = structural_keep_reasons(model)
    plan: dict[str, str | None] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_features, in_features = module.weight.shape
        if fqn in structural:
            plan[fqn] = structural[fqn]
        elif any(f in fqn for f in filter_fqns):
            plan[fqn] = "filter_fqns"
        elif in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
            plan[fqn] = f"width not divisible by {FP8_DIM_MULTIPLE}"
        elif min(in_features, out_features) < min_features:
            plan[fqn] = f"width below min_features = {min_features}"
        elif extra_filter is not None and not extra_filter(module, fqn):
            plan[fqn] = "torchtitan filter"
        else:
            plan[fqn] = None
    return plan


class TitanFloat8LinearConverter(Float8LinearConverter):
    """torchtitan model converter "titan_float8": chosen nn.Linear -> torchao Float8Linear.

    Reads `job_config.quantize.linear.float8` (see the module docstring). Raises ValueError
    for an unknown recipe, emulation under torch.compile, or real fp8 without a GPU of
    compute capability >= 8.9. The FSDP fp8 all-gather is used where the recipe allows it
    (tensorwise, with FSDP sharding on); otherwise it is off, with a warning for rowwise.
    """

    def __init__(self, job_config, parallel_dims):
        QuantizationConverter.__init__(self, job_config, parallel_dims)
        from torchao.float8 import Float8LinearConfig

        cfg = job_config.quantize.linear.float8
        self.recipe = resolve_recipe(cfg.recipe_name)
        self.emulate = bool(cfg.emulate) or not torch.cuda.is_available()
        compile_cfg = job_config.compile
        if self.emulate and compile_cfg.enable and "model" in compile_cfg.components:
            raise ValueError(
                "quantize.linear.float8: emulated float8 is not supported under torch.compile (torchtitan's rule); "
                "turn off compile.enable (or train on a GPU with compute capability >= 8.9)"
            )
        if not self.emulate and not has_cuda_capability(8, 9):
            raise ValueError(
                "quantize.linear.float8: float8 GEMMs need a CUDA GPU with compute capability >= 8.9; "
                "set quantize.linear.float8.emulate = true to emulate them (slow, for testing)"
            )
        all_gather = bool(cfg.enable_fsdp_float8_all_gather)
        if all_gather and self.recipe != "tensorwise":
            logger.warning(
                "quantize.linear.float8.enable_fsdp_float8_all_gather applies to the tensorwise recipe only; "
                "recipe %s all-gathers weights in high precision", self.recipe,
            )
            all_gather = False
        all_gather = all_gather and parallel_dims.dp_shard_enabled
        if self.recipe == "rowwise_with_gw_hp" and AUTO_FILTER_SMALL_KN_FLAG in cfg.filter_fqns:
            raise ValueError(
                f"quantize.linear.float8.filter_fqns: {AUTO_FILTER_SMALL_KN_FLAG!r} has no torchao heuristic "
                "for recipe rowwise_with_gw_hp; use min_features instead"
            )
        self.config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=self.emulate,
            enable_fsdp_float8_all_gather=all_gather,
        )
        self.precompute_scale = all_gather and bool(cfg.precompute_float8_dynamic_scale_for_fsdp)
        self.min_features = getattr(cfg, "min_features", 64)
        if self.min_features < 0:
            raise ValueError(f"quantize.linear.float8.min_features must be >= 0, got {self.min_features}")
        self.cache_weights = bool(getattr(cfg, "cache_weights", False))
        self._cache_reported = False
        if self.cache_weights and self.recipe != "tensorwise":
            raise ValueError(
                f"quantize.linear.float8.cache_weights needs recipe_name = 'tensorwise' (got {self.recipe!r}: "
                "its weight casts differ between the GEMMs); set cache_weights = false"
            )
        if self.cache_weights and all_gather:
            logger.warning("quantize.linear.float8.cache_weights: weights are FSDP-sharded and gathered in fp8; "
                           "the precomputed scales of the fp8 all-gather stand in for the cache")
        self.filter_fqns = [f for f in cfg.filter_fqns if f != AUTO_FILTER_SMALL_KN_FLAG]
        # torchtitan's filter (dims % 16, filter_fqns, optional torchao auto filter); it edits
        # the list it is given, so hand it a copy.
        self.filter_fn = self._init_filter_fn(
            dataclasses.replace(cfg, recipe_name=self.recipe, filter_fqns=list(cfg.filter_fqns))
        )
        if self.recipe != "tensorwise":
            # as torchtitan does for rowwise: pytorch/pytorch#150859
            torch._inductor.config.emulate_precision_casts = True
        self.enabled = True
        logger.info(
            "float8 linears: recipe %s, emulate %s, FSDP fp8 all-gather %s, precomputed scales %s, "
            "weights cast once per step %s",
            self.recipe, self.emulate, all_gather, self.precompute_scale, self.cache_weights,
        )

    def plan(self, model: nn.Module) -> dict[str, str | None]:
        """What `convert` will do to `model` (see `float8_plan`)."""
        return float8_plan(model, self.min_features, self.filter_fqns, self.filter_fn)

    def convert(self, model: nn.Module) -> None:
        """Swap the planned nn.Linear modules of `model` to Float8Linear, in place."""
        from torchao.float8 import convert_to_float8_training

        plan = self.plan(model)
        convert_to_float8_training(
            model, config=self.config, module_filter_fn=lambda module, fqn: plan.get(fqn, "") is None
        )
        if self.cache_weights:
            from titan_moe.float8.cached_linear import use_cached_weights

            use_cached_weights(model)
        kept = {fqn: why for fqn, why in plan.items() if why is not None}
        logger.info(
            "float8: %d nn.Linear converted, %d kept in high precision (%s)",
            len(plan) - len(kept), len(kept), ", ".join(sorted(set(kept.values()))) or "none",
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """After every optimizer step: torchtitan's (FSDP fp8 scales), then the weight casts."""
        super().post_optimizer_hook(model)
        if self.cache_weights:
            from titan_moe.float8.cached_linear import refresh_fp8_linear_weights  # torchao: imported on use

            cached = refresh_fp8_linear_weights(model)
            if not self._cache_reported:
                logger.info("float8: %d linear weights cast to fp8 once per optimizer step", cached)
                self._cache_reported = True
