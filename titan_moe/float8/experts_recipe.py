"""How the fp8 routed experts compute: keys of the `[quantize.grouped_mm.float8]` table.

    [quantize.grouped_mm.float8]   # torchtitan's table (fqns) plus these keys of ours
    gemm = "fused"           # "fused": our quantization kernels around torch._scaled_grouped_mm;
                             # "torchao": torchao's _to_fp8_rowwise_then_scaled_grouped_mm
    wgrad = "bf16"           # the fused GEMM's weight gradient: "bf16", "fp8", "fp8_rows", or "auto"
                             # (per call: "bf16" for small groups, else "fp8_rows")
    situ_quant = false       # SiTU-GLU computed inside the down GEMM's row quantization
    cache_weights = true     # expert weights quantized once per optimizer step
    widen = "torch"          # bf16 -> fp32 of the weight gradients: "torch" (.float()) or "triton"
    kernels = "auto"         # the fp8 GEMMs on torch._scaled_grouped_mm ("torch") or on our Triton
                             # kernels: "triton" (forward and dx), "triton_dw" (fp8 dw), "triton_all";
                             # "auto": "triton" on sm90 (H100/H200), else "torch"

The table is the one place for these choices: no environment variable overrides them (the
benchmarks pass an `ExpertsFp8Recipe` instead).

Why these defaults (docs/kernels.md has the measurements): "fused" is faster than torchao's
GEMM and compiles fullgraph; "bf16" is the weight gradient of the long loss check; the weight
cache is what made the fp8 experts faster than bf16 in the step. `wgrad = "fp8_rows"`,
`situ_quant = true` and `widen = "triton"` were measured only together (with tensorwise fp8
linears), so none of them is a default. `kernels = "auto"` puts the forward and dx products on
our Triton fp8 kernel on sm90 (faster than `torch._scaled_grouped_mm` at every benchmark shape);
our fp8 weight-gradient kernel was slower than torch's there, so it is opt-in ("triton_dw",
"triton_all"). `wgrad = "auto"` picks per call by the mean rows per group (M / E, known on the
host): "bf16" up to `titan_moe.float8.grouped_mm.WGRAD_AUTO_MAX_ROWS`, where the fp8 weight
gradient gains nothing, "fp8_rows" above.
"""

from __future__ import annotations

import dataclasses

from titan_moe.float8.widen import BACKENDS as WIDENS

GEMMS = ("torchao", "fused")
WGRAD_MODES = ("bf16", "fp8", "fp8_rows", "auto")  # fp8_grouped_mm's `wgrad` (titan_moe.float8.grouped_mm imports it)
KERNELS = ("auto", "torch", "triton", "triton_dw", "triton_all")  # fp8_grouped_mm's `kernels`
TABLE = "quantize.grouped_mm.float8"


@dataclasses.dataclass(frozen=True)
class ExpertsFp8Recipe:
    """The fp8 experts' choices (module docstring). Raises ValueError, naming the TOML keys,
    for an unknown value or a combination that does not exist."""

    gemm: str = "fused"
    wgrad: str = "bf16"
    situ_quant: bool = False
    cache_weights: bool = True
    widen: str = "torch"
    kernels: str = "auto"

    def __post_init__(self):
        if self.gemm not in GEMMS:
            raise ValueError(f"{TABLE}.gemm must be one of {GEMMS}, got {self.gemm!r}")
        if self.wgrad not in WGRAD_MODES:
            raise ValueError(f"{TABLE}.wgrad must be one of {WGRAD_MODES}, got {self.wgrad!r}")
        if self.widen not in WIDENS:
            raise ValueError(f"{TABLE}.widen must be one of {WIDENS}, got {self.widen!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"{TABLE}.kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.situ_quant and self.wgrad == "fp8":
            raise ValueError(f'{TABLE}.situ_quant needs wgrad "bf16" or "fp8_rows", not "fp8" '
                             "(which quantizes the activation by group columns from its bf16 copy)")
        if self.gemm == "torchao" and (self.situ_quant or self.wgrad != "bf16" or self.widen != "torch"
                                       or self.kernels not in ("auto", "torch")):
            raise ValueError(f'{TABLE}: wgrad, situ_quant, widen and kernels apply to gemm = "fused" only (got gemm '
                             f'"torchao", wgrad {self.wgrad!r}, situ_quant {self.situ_quant}, widen {self.widen!r}, '
                             f'kernels {self.kernels!r})')

    @classmethod
    def from_config(cls, table) -> ExpertsFp8Recipe:
        """From the `[quantize.grouped_mm.float8]` config table (missing keys: the defaults)."""
        defaults = cls()
        return cls(**{f.name: getattr(table, f.name, getattr(defaults, f.name)) for f in dataclasses.fields(cls)})

    def describe(self) -> str:
        return (f"gemm {self.gemm}, wgrad {self.wgrad}, SiTU-GLU in the quantization {self.situ_quant}, "
                f"weights quantized once per step {self.cache_weights}, fp32 widening {self.widen}, "
                f"fp8 GEMM kernels {self.kernels}")
