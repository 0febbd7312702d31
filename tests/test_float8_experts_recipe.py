"""The fp8 experts' recipe: TOML keys, and the module following it (CPU)."""

from __future__ import annotations

import pytest
import torch

import titan_moe.float8.quantize as fq
from titan_moe.config import load_config
from titan_moe.float8 import EXPERTS_CONVERTER_NAME, TitanFloat8ExpertsConverter
from titan_moe.float8.experts import Float8RoutedExperts, convert_routed_experts
from titan_moe.float8.experts_recipe import ExpertsFp8Recipe
from titan_moe.model.moe import RoutedExperts

from test_float8 import CONFIG, single_process

def table(*args: str):
    cfg = load_config(["--job.config_file", CONFIG, "--model.converters", EXPERTS_CONVERTER_NAME, *args])
    return cfg.quantize.grouped_mm.float8


def test_toml_keys_reach_the_recipe():
    assert ExpertsFp8Recipe.from_config(table()) == ExpertsFp8Recipe()
    assert ExpertsFp8Recipe() == ExpertsFp8Recipe("fused", "bf16", False, True, "torch", "auto")  # documented defaults
    got = ExpertsFp8Recipe.from_config(table("--quantize.grouped_mm.float8.wgrad", "fp8_rows",
                                             "--quantize.grouped_mm.float8.situ_quant",
                                             "--quantize.grouped_mm.float8.no-cache-weights",
                                             "--quantize.grouped_mm.float8.widen", "triton",
                                             "--quantize.grouped_mm.float8.kernels", "triton_all"))
    assert got == ExpertsFp8Recipe(wgrad="fp8_rows", situ_quant=True, cache_weights=False, widen="triton",
                                   kernels="triton_all")


@pytest.mark.parametrize("args, match", [
    ({"gemm": "cutlass"}, r"quantize.grouped_mm.float8.gemm must be one of"),
    ({"wgrad": "int8"}, r"quantize.grouped_mm.float8.wgrad must be one of"),
    ({"wgrad": "fp8", "situ_quant": True}, r"situ_quant needs wgrad"),
    ({"gemm": "torchao", "wgrad": "fp8_rows"}, r'apply to gemm = "fused" only'),
    ({"widen": "cuda"}, r"quantize.grouped_mm.float8.widen must be one of"),
    ({"gemm": "torchao", "widen": "triton"}, r'apply to gemm = "fused" only'),
    ({"kernels": "cutlass"}, r"quantize.grouped_mm.float8.kernels must be one of"),
    ({"gemm": "torchao", "kernels": "triton"}, r'apply to gemm = "fused" only'),
])
def test_impossible_recipes_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        ExpertsFp8Recipe(**args)


def test_a_bad_toml_value_is_reported_before_the_missing_gpu():
    """The converter names the config key on any machine, not only where an fp8 GPU exists."""
    cfg = load_config(["--job.config_file", CONFIG, "--model.converters", EXPERTS_CONVERTER_NAME,
                       "--quantize.grouped_mm.float8.wgrad", "fp4"])
    with pytest.raises(ValueError, match="quantize.grouped_mm.float8.wgrad"):
        TitanFloat8ExpertsConverter(cfg, single_process())


def test_converted_experts_follow_their_recipe(monkeypatch):
    """`convert_routed_experts(recipe=)` hands each module the recipe; its forward then fuses
    SiTU-GLU into the quantization, computes the fp8_rows weight gradient and makes a weight
    cache exactly when the recipe says so."""
    monkeypatch.setattr(fq, "kernels_run_on", lambda device: device.type == "cuda" and not fq.interpreted())
    calls = {"situ": 0, "requant": 0}
    situ_rows, requant = fq.quantize_situ_rows_reference, fq.requantize_group_columns_reference

    def count(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    monkeypatch.setattr(fq, "quantize_situ_rows_reference", count("situ", situ_rows))
    monkeypatch.setattr(fq, "requantize_group_columns_reference", count("requant", requant))
    torch.manual_seed(0)
    model = torch.nn.Sequential(RoutedExperts(2, 32, 48, 1.0, 1.0))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(32, 32)
    offs = torch.tensor([16, 32], dtype=torch.int32)

    def step(module):
        calls.update(situ=0, requant=0)
        module(x.clone().requires_grad_(), offs, groups_aligned=True).square().sum().backward()
        return dict(calls)

    recipe = ExpertsFp8Recipe(wgrad="fp8_rows", situ_quant=True, cache_weights=False)
    assert convert_routed_experts(model, recipe=recipe) == ["0"]
    experts = model[0]
    assert isinstance(experts, Float8RoutedExperts) and experts.recipe == recipe
    assert step(experts) == {"situ": 1, "requant": 4}  # x and dy of both GEMMs re-expressed per group
    assert not experts.refresh_fp8_weights()
    experts.recipe = ExpertsFp8Recipe()
    assert step(experts) == {"situ": 0, "requant": 0}
    assert experts.refresh_fp8_weights()


def test_converted_experts_pass_the_widening_to_both_gemms(monkeypatch):
    """The recipe's `widen` and `kernels` reach both fused GEMM calls of a converted module."""
    import titan_moe.float8.grouped_mm as fgm

    monkeypatch.setattr(fq, "kernels_run_on", lambda device: device.type == "cuda" and not fq.interpreted())
    original, widens = fgm.fp8_grouped_mm, []

    def recording(*args, **kwargs):
        widens.append((kwargs.get("widen"), kwargs.get("kernels")))
        return original(*args, **kwargs)

    monkeypatch.setattr(fgm, "fp8_grouped_mm", recording)
    model = torch.nn.Sequential(RoutedExperts(2, 32, 48, 1.0, 1.0))
    convert_routed_experts(model, recipe=ExpertsFp8Recipe(widen="triton", kernels="triton_dw"))
    offs = torch.tensor([16, 32], dtype=torch.int32)
    model[0](torch.randn(32, 32), offs, groups_aligned=True)
    assert widens == [("triton", "triton_dw")] * 2
