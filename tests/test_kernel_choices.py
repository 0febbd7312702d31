"""`titan_moe.ops.choices` (the `[kernels]` section resolved once) and `titan_moe.ops.launch_env`
(the one reader of TITAN_MOE_* variables): resolution per device, the start-up line, and that
no environment variable changes what the model computes on the CPU."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from titan_moe.ops import choices, launch_env
from titan_moe.ops.choices import KernelChoices

REPO = Path(__file__).resolve().parents[1]

# The behaviour switches that used to be read from the environment (now config keys): setting
# them must change nothing.
FORMER_VARIABLES = {
    "TITAN_MOE_SITU_BACKEND": "triton", "TITAN_MOE_DISPATCH_BACKEND": "triton",
    "TITAN_MOE_ROUTER_TOPK_BACKEND": "triton", "TITAN_MOE_GROUPED_MM_BACKEND": "loop",
    "TITAN_MOE_FP8_EXPERTS_GEMM": "torchao", "TITAN_MOE_FP8_EXPERTS_WGRAD": "fp8",
    "TITAN_MOE_FP8_SITU_QUANT": "1", "TITAN_MOE_FP8_WEIGHT_CACHE": "0", "TITAN_MOE_FP8_WIDEN": "triton",
    "TITAN_MOE_FP8_KERNELS": "triton_all",
}


def test_resolve_on_cpu_names_every_path():
    resolved = choices.resolve(KernelChoices(), "cpu")
    assert (resolved.situ, resolved.dispatch, resolved.router_topk, resolved.grouped_mm) == (
        "torch", "torch", "torch", "native")
    assert choices.resolve(KernelChoices(grouped_mm="fwd=auto,dw=loop"), "cpu").grouped_mm == "fwd=native,dx=native,dw=loop"
    assert choices.resolve(KernelChoices(grouped_mm="loop", situ="torch"), "cpu").grouped_mm == "loop"


def test_resolve_on_cuda_keeps_the_per_call_grouped_gemm_rule():
    resolved = choices.resolve(KernelChoices(), "cuda")
    assert (resolved.situ, resolved.dispatch, resolved.router_topk) == ("triton", "triton", "triton")
    assert resolved.grouped_mm == "auto"  # picked per call from the shapes
    assert choices.resolve(KernelChoices(situ="torch", grouped_mm="gluon"), "cuda").situ == "torch"


def test_values_the_device_cannot_run_name_the_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for fields, key in (({"situ": "triton"}, "kernels.situ"), ({"grouped_mm": "dw=triton"}, "kernels.grouped_mm"),
                        ({"grouped_mm": "gluon"}, "kernels.grouped_mm"), ({"dispatch": "cuda"}, "kernels.dispatch")):
        with pytest.raises(ValueError, match=re.escape(key)):
            choices.resolve(KernelChoices(**fields), "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's interpreter: the kernels run on the CPU
    assert choices.resolve(KernelChoices(situ="triton"), "cpu").situ == "triton"


def test_summary_is_one_line_with_every_field():
    line = choices.summary(choices.resolve(KernelChoices(), "cpu"))
    assert "\n" not in line and line.startswith("kernels: situ=torch dispatch=torch router_topk=torch grouped_mm=native")
    assert all(f"{f.name}=" in line for f in dataclasses.fields(KernelChoices))


def test_using_restores_and_activate_checks():
    before = choices.current()
    with choices.using(situ="torch") as chosen:
        assert choices.current() is chosen and chosen.situ == "torch"
    assert choices.current() is before
    with pytest.raises(ValueError, match="kernels.router_topk"):
        choices.activate(KernelChoices(router_topk="fast"))
    assert choices.current() is before


def test_every_field_has_a_docstring():
    """The generated config reference reads the fields' docstrings."""
    source = (REPO / "titan_moe" / "ops" / "choices.py").read_text()
    for f in dataclasses.fields(KernelChoices):
        assert re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", source), f.name


def test_launch_env_reads_only_listed_names(monkeypatch):
    monkeypatch.setenv("TITAN_MOE_GROUPED_MM_TILES", "")
    assert launch_env.read("TITAN_MOE_GROUPED_MM_TILES") is None  # empty counts as unset
    with pytest.raises(KeyError, match="TITAN_MOE_SITU_BACKEND"):
        launch_env.read("TITAN_MOE_SITU_BACKEND")
    assert not set(FORMER_VARIABLES) & set(launch_env.VARIABLES)


def test_no_module_reads_titan_moe_variables_but_launch_env():
    """Every TITAN_MOE_* read goes through `launch_env.read`; os.environ appears only there and
    in the trainer's launch variables (torchrun's rendezvous, torchtitan's NGPU for the fake
    backend)."""
    for path in (REPO / "titan_moe").rglob("*.py"):
        if path.name == "launch_env.py":
            continue
        for line in path.read_text().splitlines():
            if "os.environ" in line or "getenv(" in line:
                assert "TITAN_MOE" not in line and "_ENV" not in line, f"{path}: {line.strip()}"


def _odd_value(name: str) -> str:
    """A value unlike the default for each variable (tiles and caps the CPU path never reads)."""
    odd = {"TITAN_MOE_GROUPED_MM_TILES": "mk=16x16x16x4x1", "TITAN_MOE_GLUON_GEMM_TILES": "pp64x256x64s4,,",
           "TITAN_MOE_GROUPED_MM_TMA": "0", "TITAN_MOE_GROUPED_MM_DW_TMA": "group",
           "TITAN_MOE_FP8_CHECK_OFFSETS": "1", "TITAN_MOE_KILL_DURING_SAVE_STEP": "1000000"}
    return odd.get(name, "1")


def _forward_backward():
    from tiny import TINY_ARGS

    from titan_moe.model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(TINY_ARGS)
    model.init_weights()
    tokens = torch.randint(0, TINY_ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    out.float().square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_environment_variables_do_not_change_the_cpu_model(monkeypatch):
    """The debug model's forward and backward on the CPU, bit for bit the same with every
    listed launch variable and every former behaviour switch set to an odd value."""
    reference = _forward_backward()
    for name in list(launch_env.VARIABLES) + list(FORMER_VARIABLES):
        monkeypatch.setenv(name, FORMER_VARIABLES.get(name) or _odd_value(name))
    for got, want in zip(_forward_backward(), reference, strict=True):
        assert torch.equal(got, want)


def test_start_up_record_names_every_choice(caplog):
    """The trainer's one start-up line and record: [kernels] resolved, the MLA attention path,
    and with the fp8 experts converter its recipe."""
    from torchtitan.tools.logging import logger

    from titan_moe.config import load_config
    from titan_moe.train import _activate_kernel_choices

    previous = choices.current()
    try:
        plain = _activate_kernel_choices(load_config(["--job.config_file", "configs/debug_cpu.toml"]))
        assert plain["mla_attention"] == "chunked" and plain["situ"] == "torch" and "float8_experts" not in plain
        logger.propagate, propagate = True, logger.propagate
        with caplog.at_level("INFO"):
            fp8 = _activate_kernel_choices(load_config([
                "--job.config_file", "configs/debug_cpu.toml", "--model.converters", "titan_float8_experts",
                "--quantize.grouped_mm.float8.wgrad", "fp8_rows"]))
        logger.propagate = propagate
    finally:
        choices.activate(previous)
    assert fp8["float8_experts"]["wgrad"] == "fp8_rows"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert "mla_attention=chunked" in line and "float8_experts=" in line
    assert all(f"{k}:{v}" in line for k, v in (("gemm", "fused"), ("wgrad", "fp8_rows"), ("kernels", "auto")))
