"""torchao float8 training for titan_moe, as torchtitan model converters.

    [model]
    converters = ["titan_float8"]                           # nn.Linear layers (CPU: emulated)
    converters = ["titan_float8", "titan_float8_experts"]  # plus the routed experts (GPU only)

* "titan_float8" (`linear.TitanFloat8LinearConverter`): chosen nn.Linear -> torchao
  Float8Linear, configured by torchtitan's `[quantize.linear.float8]` table plus our
  `min_features` (`config.Float8LinearExtras`).
* "titan_float8_experts" (`experts.TitanFloat8ExpertsConverter`): the routed experts' grouped
  GEMMs through torchao's fp8 rowwise grouped GEMM; `[quantize.grouped_mm.float8] fqns`.

Importing this package registers both names with torchtitan (`register()`, idempotent);
`titan_moe.config` imports it, so every trainer run has them.
"""

from torchtitan.protocols import model_converter

from titan_moe.float8.experts import (
    CONVERTER_NAME as EXPERTS_CONVERTER_NAME,
    Float8RoutedExperts,
    TitanFloat8ExpertsConverter,
    convert_routed_experts,
)
from titan_moe.float8.linear import (
    CONVERTER_NAME as LINEAR_CONVERTER_NAME,
    RECIPES,
    TitanFloat8LinearConverter,
    float8_plan,
    resolve_recipe,
)


def register() -> None:
    """Register "titan_float8" and "titan_float8_experts" with torchtitan (once)."""
    registry = model_converter._registry_model_converter_cls
    for name, cls in ((LINEAR_CONVERTER_NAME, TitanFloat8LinearConverter),
                      (EXPERTS_CONVERTER_NAME, TitanFloat8ExpertsConverter)):
        if name not in registry:
            model_converter.register_model_converter(cls, name)


register()

__all__ = [
    "register", "RECIPES", "resolve_recipe", "float8_plan", "TitanFloat8LinearConverter",
    "TitanFloat8ExpertsConverter", "Float8RoutedExperts", "convert_routed_experts",
    "LINEAR_CONVERTER_NAME", "EXPERTS_CONVERTER_NAME",
]
