"""fp8 routed experts: the "titan_float8_experts" converter (needs a GPU).

    [model]
    converters = ["titan_float8", "titan_float8_experts"]
    [quantize.grouped_mm.float8]     # torchtitan's table
    fqns = ["experts"]               # substrings of RoutedExperts module names; empty: all of them
    wgrad = "bf16"                   # and the rest of the recipe: `titan_moe.float8.experts_recipe`

The converter swaps each matching `RoutedExperts` for a `Float8RoutedExperts` holding the
same Parameters (state dict and checkpoints unchanged). Its two expert GEMMs go through an
fp8 rowwise grouped GEMM (dynamic rowwise e4m3 scaling of tokens and weights, fp32
accumulation in `torch._scaled_grouped_mm`) instead of `titan_moe.ops.grouped_gemm.grouped_mm`:
ours (`titan_moe.float8.grouped_mm`, the default) or torchao's
`_to_fp8_rowwise_then_scaled_grouped_mm` (`gemm = "torchao"`).

Constraints and what this module does about them:
* `torch._scaled_grouped_mm` needs a CUDA GPU of compute capability >= 8.9. The converter
  raises ValueError at construction without one; on CPU there is no fp8 grouped GEMM (and
  no emulation of it), so the experts stay in high precision there.
* fp8 group sizes must be multiples of 16 (torchao's contract). torchao's own padding
  path (`pad_token_groups_for_grouped_mm=True`) is not implemented in 0.18 for this
  function, so we pass False and pad here instead: `pad_groups` scatters each group's rows
  into 16-aligned slots of a buffer with a static upper bound on its size (no host sync),
  `unpad_groups` gathers them back. Both are differentiable gathers/scatters.
* torchao's function wants the weight column-major per group (`[E, K, N]` with strides
  `(K*N, 1, K)`); ours are row-major `[E, K, N]`, so on that path each call makes a
  transposed copy of the (cast) weights.
* K and N (latent width, expert hidden width) must be multiples of 16: checked at conversion.

Why ours is the default (H200, BENCHMARKS.md): at the MoE benchmark shape (E = 64,
M = 65,536, K = 2048, N = 1408) forward+backward took 2.05 ms against 8.15 for the torchao
path (eager, same run; compiled, in an earlier run, 5.84); small_1gpu eager trains 11.9K
tokens/s with it against 10.7K with torchao's; it compiles with `fullgraph=True` (custom
ops), trained compiled on wide_1gpu, and trained 300 eager steps to bf16's loss. Ours is
fused Triton quantization with no weight re-layout copy, and on the CPU an fp32 emulation of
the fp8 GEMM, so this module's data flow is tested there.

What keeps its quantization cheap: in the model the token dispatch lays the groups out
16-aligned (`LatentMoE.route_and_sort`), so the expert block pads nothing (called with
packed groups, under expert parallelism or directly, it pads once per call: both GEMMs and
the SiTU-GLU between them run on the padded rows); and the weights are quantized once per
optimizer step where they are plain tensors (`Float8RoutedExperts`). Measured that way
(fifty-first to fifty-third GPU runs): the MoE layer's kernels take 0.98x of bf16's time
(plus 0.75 ms once per step), and the compiled width-4096 training step with tensorwise fp8
linears runs 1.14x bf16 against 1.08x with bf16 experts (1.16x in the fifty-seventh run,
after changes that sped up both paths: BENCHMARKS.md, "The width-4096 step").
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import has_cuda_capability

from titan_moe.float8.experts_recipe import ExpertsFp8Recipe
from titan_moe.model.moe import RoutedExperts
from titan_moe.model.situ import situ_glu_packed
from titan_moe.ops.dispatch.reference import aligned_group_shift, padded_rows

CONVERTER_NAME = "titan_float8_experts"
GROUP_ALIGNMENT = 16


def _fp8_rowwise_grouped_mm(x_MK: Tensor, w_t_EKN: Tensor, offs_E: Tensor, out_dtype: torch.dtype) -> Tensor:
    """torchao's differentiable fp8 rowwise grouped GEMM; offsets must be 16-aligned."""
    if x_MK.device.type != "cuda":
        raise RuntimeError(
            "Float8RoutedExperts: fp8 grouped GEMM needs a CUDA GPU with compute capability >= 8.9, "
            f"got a tensor on {x_MK.device}"
        )
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    # bf16 out is torchao's default and the case its kernels are built for; cast after.
    out_MN = _to_fp8_rowwise_then_scaled_grouped_mm(
        x_MK, w_t_EKN, offs_E, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )
    return out_MN.to(out_dtype)


def pad_groups(x_MK: Tensor, offs_E: Tensor, alignment: int = GROUP_ALIGNMENT) -> tuple[Tensor, Tensor, Tensor]:
    """Copy each group's rows into slots whose starts are multiples of `alignment`.

    Args:
        x_MK: [M, K] rows sorted by group; rows at or past `offs_E[-1]` belong to no group.
        offs_E: [E] int32 cumulative group ends.

    Returns:
        x_PK: [P, K] with `P = M + 1 + E * (alignment - 1)` rounded up to `alignment` (a
            static bound, `titan_moe.ops.dispatch.reference.padded_rows`); padding rows are zero.
        offs_pad_E: [E] int32 cumulative ends of the padded groups (multiples of `alignment`).
        dest_M: [M] int64 row of `x_PK` that holds row m of `x_MK` (rows without a group
            go to the last row of `x_PK`, which no padded group reaches).
    """
    M, K = x_MK.shape
    E = offs_E.shape[0]
    P = padded_rows(M + 1, E, alignment)  # + 1: a last row that no padded group reaches
    offs = offs_E.long()
    shift_E, offs_pad = aligned_group_shift(torch.diff(offs, prepend=offs.new_zeros(1)), alignment)
    rows_M = torch.arange(M, device=x_MK.device)
    group_M = torch.searchsorted(offs, rows_M, right=True)  # E for rows past offs[-1]
    in_group_M = group_M < E
    dest_M = rows_M + shift_E[group_M.clamp(max=E - 1)]
    dest_M = torch.where(in_group_M, dest_M, torch.full_like(dest_M, P - 1))
    x_PK = x_MK.new_zeros(P, K).index_copy(0, dest_M, x_MK * in_group_M.unsqueeze(1).to(x_MK.dtype))
    return x_PK, offs_pad.to(torch.int32), dest_M


def unpad_groups(out_PN: Tensor, dest_M: Tensor, offs_E: Tensor) -> Tensor:
    """Inverse of `pad_groups` on a result: [P, N] -> [M, N], rows past `offs_E[-1]` zero."""
    out_MN = out_PN.index_select(0, dest_M)
    owned_M1 = (torch.arange(dest_M.shape[0], device=out_PN.device) < offs_E[-1]).unsqueeze(1)
    return out_MN * owned_M1.to(out_MN.dtype)


def fp8_grouped_mm_padded(x_PK: Tensor, w_EKN: Tensor, offs_pad_E: Tensor, w_fp8=None, situ=None,
                          recipe: ExpertsFp8Recipe | None = None) -> Tensor:
    """The recipe's fp8 rowwise grouped GEMM on groups that are already 16-aligned
    (`pad_groups`' layout): x_PK [P, K], w_EKN [E, K, N] in x's dtype, offs_pad_E [E] int32
    multiples of 16 -> [P, N] in x's dtype. `recipe` None: the default recipe. `w_fp8` (the fused GEMM only): `w` quantized beforehand
    (`titan_moe.float8.grouped_mm.fp8_grouped_mm`), `w` then in any dtype. `situ` (the fused
    GEMM only): x_PK is SiTU-GLU's packed input [P, 2K] (`fp8_grouped_mm`'s `situ`)."""
    recipe = recipe or ExpertsFp8Recipe()
    if recipe.gemm == "fused":
        from titan_moe.float8.grouped_mm import fp8_grouped_mm as fused_fp8_grouped_mm

        return fused_fp8_grouped_mm(x_PK, w_EKN, offs_pad_E, wgrad=recipe.wgrad, w_fp8=w_fp8, situ=situ,
                                    widen=recipe.widen, kernels=recipe.kernels)
    if w_fp8 is not None or situ is not None:
        raise ValueError("fp8_grouped_mm_padded: a pre-quantized weight or a fused SiTU-GLU needs the fused GEMM")
    w_t_EKN = w_EKN.transpose(1, 2).contiguous().transpose(1, 2)  # column-major per group
    return _fp8_rowwise_grouped_mm(x_PK, w_t_EKN, offs_pad_E, x_PK.dtype)


def fp8_grouped_mm(x_MK: Tensor, w_EKN: Tensor, offs_E: Tensor) -> Tensor:
    """Same contract as `titan_moe.ops.grouped_gemm.grouped_mm`, through the fp8 rowwise GEMM.

    x_MK [M, K] (bf16 or fp32), w_EKN [E, K, N] same dtype, offs_E [E] int32 -> [M, N] in x's dtype.
    """
    x_PK, offs_pad_E, dest_M = pad_groups(x_MK, offs_E)
    return unpad_groups(fp8_grouped_mm_padded(x_PK, w_EKN, offs_pad_E), dest_M, offs_E)


class Float8RoutedExperts(RoutedExperts):
    """`RoutedExperts` whose two grouped GEMMs run in fp8 (CUDA, compute capability >= 8.9).

    Its groups must start at multiples of 16: `LatentMoE` lays its sorted copies out so
    (`group_alignment`) and says so with `groups_aligned=True`; otherwise (expert
    parallelism, or a direct call) `forward` pads the groups itself.

    Weights: quantized per call, or once per optimizer step. :meth:`refresh_fp8_weights`
    (the converter's `post_optimizer_hook` calls it after every step) quantizes both weights
    into both fp8 layouts, from the parameters in their own dtype (fp32 under autocast:
    no bf16 copy); the forwards until the next step (activation-checkpoint recomputes and
    gradient-accumulation microbatches included) read those and quantize only activations,
    and the backward reads their dx layout instead of a per-call saved copy. Made only for
    plain-tensor weights on the fused GEMM (under FSDP or EP the forward sees gathered or
    exchanged tensors, not the parameters; the recipe's `cache_weights = false` turns it off).
    The cache's validity rules are `titan_moe.model.weight_cache`'s."""

    group_alignment = GROUP_ALIGNMENT
    recipe = ExpertsFp8Recipe()  # the converter sets the TOML's

    def refresh_fp8_weights(self) -> bool:
        """Quantize both weights now for the forwards until the weights change (class
        docstring). Returns whether a cache was made (False, with no cache kept, for the
        torchao GEMM, DTensor or meta weights, or a recipe with `cache_weights` off)."""
        self._store_weight_cache(None)
        weights = self._cache_sources()
        recipe = self.recipe
        if (recipe.gemm != "fused" or not recipe.cache_weights
                or any(isinstance(w, DTensor) or w.device.type == "meta" for w in weights)):
            return False
        from titan_moe.float8.quantize import quantize_weight

        with torch.no_grad():
            self._store_weight_cache(tuple(quantize_weight(w.detach()) for w in weights))
        return True

    def current_fp8_weights(self) -> tuple | None:
        """The cached (gate_up, down) `Fp8Weight`s if they still match the weights, else None."""
        return self._valid_weight_cache()

    def refresh_compute_weights(self, dtype: torch.dtype) -> bool:
        """No high-precision copies here: the weights' cache holds fp8 codes (`refresh_fp8_weights`)."""
        return False

    @classmethod
    def from_experts(cls, experts: RoutedExperts) -> Float8RoutedExperts:
        """A Float8RoutedExperts sharing `experts`' Parameters (works on the meta device)."""
        if experts.activation != "situ":
            raise ValueError(f"the titan_float8_experts converter runs SiTU-GLU experts only, not "
                             f"model.expert_activation = {experts.activation!r}")
        E, latent, _ = experts.w_gate_up.shape
        with torch.device("meta"):
            new = cls(E, latent, experts.hidden, experts.beta1, experts.beta2)
        new.w_gate_up = experts.w_gate_up
        new.w_down = experts.w_down
        return new

    def forward(self, x_ML: Tensor, offs_E: Tensor, groups_aligned: bool = False) -> Tensor:
        """x_ML [M, latent] sorted by expert, offs_E [E] int32 cumulative ends -> [M, latent].

        With ``groups_aligned`` every ``offs_E[e]`` is a multiple of 16 (the caller's
        promise, not checked on CUDA: a host sync) and the rows between groups are zero;
        the GEMMs run on the rows as given. Otherwise the groups are padded once: both
        GEMMs and the SiTU-GLU between them run on the padded rows P. A padding row stays
        zero through all three (zero input rows give z = 0, and SiTU-GLU multiplies by the
        zero up half), and gets a zero gradient (from the unpad, or from the caller's
        combine), so it adds nothing to the weight gradients."""
        w_gate_up, w_down = self.local_weights()  # this rank's experts under expert parallelism
        if groups_aligned:
            x_PL, offs_pad_E = x_ML, offs_E
        else:
            x_PL, offs_pad_E, dest_M = pad_groups(x_ML, offs_E)
        recipe = self.recipe
        cached = self.current_fp8_weights()
        if cached is None:
            w_gate_up, w_down, cached = w_gate_up.to(x_ML.dtype), w_down.to(x_ML.dtype), (None, None)
        z_P2H = fp8_grouped_mm_padded(x_PL, w_gate_up, offs_pad_E, cached[0], recipe=recipe)
        if recipe.situ_quant:
            out_PL = fp8_grouped_mm_padded(z_P2H, w_down, offs_pad_E, cached[1], situ=(self.beta1, self.beta2),
                                           recipe=recipe)
        else:
            hidden_PH = situ_glu_packed(z_P2H, self.beta1, self.beta2)
            out_PL = fp8_grouped_mm_padded(hidden_PH, w_down, offs_pad_E, cached[1], recipe=recipe)
        return out_PL if groups_aligned else unpad_groups(out_PL, dest_M, offs_E)


def convert_routed_experts(model: nn.Module, fqns: list[str] | tuple[str, ...] = (),
                           recipe: ExpertsFp8Recipe | None = None) -> list[str]:
    """Swap the `RoutedExperts` of `model` whose name contains one of `fqns` (all when empty)
    for `Float8RoutedExperts` computing by `recipe` (None: the defaults), in place. Returns
    the swapped names. No device check here.

    Raises ValueError when a swapped module's widths are not multiples of 16.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is RoutedExperts and (not fqns or any(f in name for f in fqns))
    ]
    for name, module in targets:
        _, latent, two_hidden = module.w_gate_up.shape
        if latent % 16 or module.hidden % 16:
            raise ValueError(
                f"{name}: fp8 grouped GEMM needs the latent width ({latent}) and expert hidden width "
                f"({module.hidden}) to be multiples of 16"
            )
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        fp8_experts = Float8RoutedExperts.from_experts(module)
        if recipe is not None:
            fp8_experts.recipe = recipe
        setattr(parent, child, fp8_experts)
    return [name for name, _ in targets]


class TitanFloat8ExpertsConverter:
    """torchtitan model converter "titan_float8_experts" (reads `[quantize.grouped_mm.float8]`: `fqns`
    and the recipe, `titan_moe.float8.experts_recipe`)."""

    def __init__(self, job_config, parallel_dims):
        table = job_config.quantize.grouped_mm.float8
        self.fqns = [table.fqns] if isinstance(table.fqns, str) else list(table.fqns)
        self.recipe = ExpertsFp8Recipe.from_config(table)  # a config error first, on any machine
        if not has_cuda_capability(8, 9):
            found = (
                f"compute capability {torch.cuda.get_device_capability()}"
                if torch.cuda.is_available()
                else "no CUDA device"
            )
            raise ValueError(
                f"model.converters: {CONVERTER_NAME!r}: fp8 grouped GEMM for the routed experts needs a CUDA GPU "
                f"with compute capability >= 8.9 ({found}); remove it to keep the experts in high precision"
            )

    def convert(self, model: nn.Module) -> None:
        names = convert_routed_experts(model, self.fqns, self.recipe)
        if not names:
            raise ValueError(
                f"quantize.grouped_mm.float8.fqns = {self.fqns} matches no routed experts of the model"
            )
        logger.info("float8: %d routed-expert modules use the fp8 rowwise grouped GEMM (%s)", len(names),
                    self.recipe.describe())

    def post_optimizer_hook(self, model) -> None:
        """After every optimizer step: the fp8 weights for the next step's forwards."""
        refresh_fp8_expert_weights(model)


def refresh_fp8_expert_weights(model: nn.Module | list[nn.Module]) -> int:
    """`Float8RoutedExperts.refresh_fp8_weights` on every such module of `model` (or of each
    model part); returns how many made a cache."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    return sum(m.refresh_fp8_weights() for part in parts for m in part.modules() if isinstance(m, Float8RoutedExperts))
