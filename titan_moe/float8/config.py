"""Our additions to torchtitan's `[quantize.linear.float8]` TOML table.

torchtitan 0.2.2 already defines `[quantize.linear.float8]` (`recipe_name`, `emulate`,
`filter_fqns`, `enable_fsdp_float8_all_gather`, `precompute_float8_dynamic_scale_for_fsdp`)
and `[quantize.grouped_mm.float8]` (`fqns`); our converters read those keys. The one key
torchtitan lacks are the width floor below which a Linear stays in high precision and the
once-per-step weight cast. These
dataclasses mirror torchtitan's nesting so that its config merge (`_merge_configs`, which
merges dataclass fields recursively) adds the key to the same table:

    [quantize.linear.float8]
    recipe_name = "tensorwise"
    min_features = 64
    cache_weights = true
"""

# No `from __future__ import annotations`: torchtitan's merge reads field types as objects.

from dataclasses import dataclass, field


@dataclass
class Float8LinearExtras:
    min_features: int = 64
    """An nn.Linear whose in_features or out_features is below this stays in high precision
    (converter "titan_float8"). Widths not divisible by 16 always stay (fp8 GEMM requirement)."""
    cache_weights: bool = False
    """Cast each converted weight to fp8 once per optimizer step instead of in every GEMM
    (`titan_moe.float8.cached_linear`; bit-identical results). Recipe "tensorwise" with
    unsharded weights only; off by default until its whole-step speed is measured."""


@dataclass
class QuantizedLinearExtras:
    float8: Float8LinearExtras = field(default_factory=Float8LinearExtras)


@dataclass
class QuantizeExtras:
    linear: QuantizedLinearExtras = field(default_factory=QuantizedLinearExtras)
