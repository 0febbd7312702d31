"""Tensorwise fp8 linears whose weight is cast to fp8 once per optimizer step.

torchao's tensorwise `Float8Linear` casts its high-precision weight to e4m3 in every forward
(a max-abs reduction over the whole weight, then the cast) and again in the backward for the
input gradient; with full activation checkpointing the forward runs twice per step, and once
more per gradient-accumulation microbatch. `CachedFloat8Linear` casts it once, in
`refresh_fp8_weight` (the "titan_float8" converter's post-optimizer hook calls it after every
step), with torchao's own function, and every GEMM until the next step reads those codes.
The per-call cast would have produced the same codes and scale from the same weight, so the
outputs and gradients are bit-for-bit those of `Float8Linear` (tested).

Made only where the per-call cast would be tensorwise from a plain tensor: the "tensorwise"
recipe (the rowwise recipes scale the weight along a different axis for each GEMM), weights
that are not DTensors (under FSDP, torchao's fp8 all-gather with precomputed scales does the
equivalent job). Otherwise, and before the first refresh, it is a plain `Float8Linear`.
Cache validity: `titan_moe.model.weight_cache`.

Switch: `[quantize.linear.float8] cache_weights = true` (`titan_moe.float8.config`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

from titan_moe.model.weight_cache import WeightCacheMixin


def cacheable(config) -> bool:
    """Whether a torchao `Float8LinearConfig` casts the weight the same way (dynamic,
    tensorwise) for the output and the input-gradient GEMMs, so that one cast serves both,
    from a plain weight (not FSDP's fp8 all-gather tensor)."""
    casts = (config.cast_config_weight, config.cast_config_weight_for_grad_input)
    return (not config.enable_fsdp_float8_all_gather  # FSDP's fp8 weights: torchao's precomputed scales
            and config.cast_config_weight == config.cast_config_weight_for_grad_input
            and all(c.scaling_type is ScalingType.DYNAMIC and c.scaling_granularity is ScalingGranularity.TENSORWISE
                    for c in casts))


class _CachedFp8Weight(torch.autograd.Function):
    """Forward: the cached codes standing for `weight` as a Float8TrainingTensor (no cast).
    Backward: the gradient reaches `weight` unchanged (as through torchao's casting function)."""

    @staticmethod
    def forward(ctx, weight_NK: Tensor, codes_NK: Tensor, scale: Tensor, linear_mm_config: LinearMMConfig):
        return Float8TrainingTensor(codes_NK, scale, weight_NK.dtype, linear_mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad_NK: Tensor):
        return grad_NK, None, None, None


class CachedFloat8Linear(WeightCacheMixin, Float8Linear):
    """`Float8Linear` reading its weight's fp8 codes from a once-per-step cache (module docstring).

    Shapes as nn.Linear: input [..., K] -> [..., N], weight [N, K]. The cache is
    (codes [N, K] e4m3, scale [] fp32), made by `refresh_fp8_weight`.
    """

    def _cache_sources(self) -> tuple[Tensor]:
        return (self.weight,)

    @classmethod
    def from_float8_linear(cls, module: Float8Linear) -> CachedFloat8Linear:
        """A CachedFloat8Linear sharing `module`'s Parameters and config (works on meta)."""
        with torch.device("meta"):
            new = cls(module.in_features, module.out_features, bias=False, config=module.config)
        new.weight = module.weight
        new.bias = module.bias
        return new

    def refresh_fp8_weight(self) -> bool:
        """Cast the weight now for the GEMMs until it changes. Returns whether a cache was
        made (False, with none kept, for a DTensor or meta weight or a config that is not
        `cacheable`)."""
        self._store_weight_cache(None)
        weight = self.weight
        if isinstance(weight, DTensor) or weight.device.type == "meta" or not cacheable(self.config):
            return False
        with torch.no_grad():
            fp8 = hp_tensor_to_float8_dynamic(
                weight.detach(), self.config.cast_config_weight.target_dtype, self.linear_mm_config,
                gemm_input_role=GemmInputRole.WEIGHT, round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
            )
        self._store_weight_cache((fp8._data, fp8._scale))
        return True

    def current_fp8_weight(self) -> tuple[Tensor, Tensor] | None:
        """(codes [N, K], scale) if they still match the weight, else None."""
        return self._valid_weight_cache()

    def forward(self, input: Tensor) -> Tensor:
        cached = self.current_fp8_weight()
        if cached is None:
            return super().forward(input)
        if torch.is_autocast_enabled():  # CUDA autocast, as in Float8Linear.forward
            input = input.to(torch.get_autocast_dtype("cuda"))
        weight_fp8_NK = _CachedFp8Weight.apply(self.weight, cached[0], cached[1], self.linear_mm_config)
        output = matmul_with_hp_or_float8_args.apply(input, weight_fp8_NK.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def use_cached_weights(model: nn.Module) -> list[str]:
    """Swap every `Float8Linear` of `model` for a `CachedFloat8Linear`, in place; returns their names."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is Float8Linear]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, CachedFloat8Linear.from_float8_linear(module))
    return [name for name, _ in targets]


def refresh_fp8_linear_weights(model: nn.Module | list[nn.Module]) -> int:
    """`CachedFloat8Linear.refresh_fp8_weight` on every such module of `model` (or of each
    model part); returns how many made a cache."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    return sum(m.refresh_fp8_weight() for part in parts for m in part.modules() if isinstance(m, CachedFloat8Linear))
