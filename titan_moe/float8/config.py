"""Our additions to torchtitan's `[quantize.linear.float8]` TOML table.

torchtitan 0.2.2 already defines `[quantize.linear.float8]` (`recipe_name`, `emulate`,
`filter_fqns`, `enable_fsdp_float8_all_gather`, `precompute_float8_dynamic_scale_for_fsdp`)
and `[quantize.grouped_mm.float8]` (`fqns`); our converters read those keys. The one key
torchtitan lacks are the width floor below which a Linear stays in high precision, the
once-per-step weight cast, and the fp8 experts' recipe. These
dataclasses mirror torchtitan's nesting so that its config merge (`_merge_configs`, which
merges dataclass fields recursively) adds the key to the same table:

    [quantize.linear.float8]
    recipe_name = "tensorwise"
    min_features = 64
    cache_weights = true

    [quantize.grouped_mm.float8]
    wgrad = "fp8_rows"
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
    unsharded weights only; off by default: no whole-step gain measured at width 4096
    (BENCHMARKS.md, "every fp8 option at once")."""


@dataclass
class QuantizedLinearExtras:
    float8: Float8LinearExtras = field(default_factory=Float8LinearExtras)


@dataclass
class Float8GroupedMMExtras:
    """The fp8 routed experts' recipe (converter "titan_float8_experts"); what each key does,
    the allowed combinations and the environment overrides: `titan_moe.float8.experts_recipe`."""

    gemm: str = "fused"
    """"fused" (our quantization kernels around torch._scaled_grouped_mm) or "torchao"."""
    wgrad: str = "bf16"
    """The fused GEMM's weight gradient: "bf16", "fp8", "fp8_rows", or "auto" (per call: "bf16" for
    groups of at most 256 rows on average, else "fp8_rows")."""
    situ_quant: bool = False
    """SiTU-GLU computed inside the down GEMM's row quantization (fused GEMM, wgrad bf16/fp8_rows)."""
    cache_weights: bool = True
    """Expert weights quantized once per optimizer step (fused GEMM, unsharded weights)."""
    widen: str = "torch"
    """bf16 -> fp32 of the fused GEMM's results for fp32 weights: "torch" (.float()) or "triton"."""
    kernels: str = "auto"
    """The fused GEMM's fp8 products on torch._scaled_grouped_mm ("torch") or on our Triton kernels:
    "triton" (forward and dx), "triton_dw" (the fp8 weight gradient), "triton_all"; "auto": "triton"
    on sm90, else "torch"."""


@dataclass
class QuantizedGroupedMMExtras:
    float8: Float8GroupedMMExtras = field(default_factory=Float8GroupedMMExtras)


@dataclass
class QuantizeExtras:
    linear: QuantizedLinearExtras = field(default_factory=QuantizedLinearExtras)
    grouped_mm: QuantizedGroupedMMExtras = field(default_factory=QuantizedGroupedMMExtras)
