"""NVTX ranges: free when off, the documented names in eager and compiled mode, no effect on
training numerics, and the trainer's step/forward/backward/optimizer ranges.

Ranges are observed through `nvtx.record_ranges()` (no GPU profiler here).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest
import torch

from titan_moe.model.decoder import Decoder
from titan_moe.ops import nvtx

from tiny import CONFIG, REPO, TINY_ARGS, TINY_CLI


# ops that eager layers call and compiled ones replace by the composite Inductor fuses (the
# SiTU-GLU backward stays our op in both: `titan_moe.model.situ._SiTUGLUCompiled`)
EAGER_ONLY_OP_RANGES = {"op.situ_glu", "op.kda_prepare", "op.kda_prepare_bwd"}
OP_RANGES = EAGER_ONLY_OP_RANGES | {"op.situ_glu_bwd", "op.kda_chunk_fwd", "op.kda_chunk_bwd", "op.grouped_mm",
             "op.grouped_mm_dx", "op.grouped_mm_dw",
             "op.moe_permute", "op.moe_unpermute_combine", "op.moe_unpermute_combine_backward",
             "op.doc_attention_fwd", "op.doc_attention_bwd"}
IN_LAYER_RANGES = {"kda", "mla", "moe", "ffn", "kda.inputs", "kda.output", "mla.attend",
                   "moe.router", "moe.dispatch", "moe.experts", "moe.combine", "moe.shared"}




@pytest.fixture
def ranges_on():
    nvtx.enable(True)
    try:
        yield
    finally:
        nvtx.enable(False)


def _model() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(TINY_ARGS)
    model.init_weights()
    return model.train()


def _forward_backward(model: Decoder, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY_ARGS.vocab_size, (2, 24), generator=gen)
    doc_ids = torch.cat([torch.zeros(2, 10, dtype=torch.int32), torch.ones(2, 14, dtype=torch.int32)], dim=1)
    model.zero_grad()
    logits = model(tokens, doc_ids)
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _expected_counts(args) -> Counter:
    """Ranges of one forward+backward of the whole decoder in eager mode, from the layer layout."""
    kinds = args.layer_kinds()
    moe = [args.is_moe_layer(i) for i in range(args.n_layers)]
    n_kda, n_mla, n_moe = kinds.count("kda"), kinds.count("mla"), sum(moe)
    n_situ = args.n_layers - n_moe + n_moe * (2 if args.n_shared_experts else 1)
    expected = Counter({f"layer{i}.{kind}": 1 for i, kind in enumerate(kinds)})
    expected.update({
        "head": 1, "attn_res.mix": 2 * args.n_layers + 1,
        "kda": n_kda, "kda.inputs": n_kda, "kda.output": n_kda, "op.kda_chunk_fwd": n_kda, "op.kda_chunk_bwd": n_kda,
        "op.kda_prepare": n_kda, "op.kda_prepare_bwd": n_kda,  # q/k norm and gate, eager
        # SiTU-GLU: each dense FFN, each MoE layer's routed experts and its shared experts (one module)
        "op.situ_glu": n_situ, "op.situ_glu_bwd": n_situ,
        "mla": n_mla, "mla.attend": n_mla,
        # MLA over packed documents on the CPU: the chunked attention op
        "op.doc_attention_fwd": n_mla, "op.doc_attention_bwd": n_mla,
        "ffn": args.n_layers - n_moe, "moe": n_moe, "moe.router": n_moe, "moe.dispatch": n_moe,
        "moe.experts": n_moe, "moe.combine": n_moe, "moe.shared": n_moe if args.n_shared_experts else 0,
        # two grouped GEMMs per MoE layer (gate|up, down), each with a dx and a dw in backward
        "op.grouped_mm": 2 * n_moe, "op.grouped_mm_dx": 2 * n_moe, "op.grouped_mm_dw": 2 * n_moe,
        # dispatch: the permute's backward is an unweighted unpermute-combine
        "op.moe_permute": n_moe, "op.moe_unpermute_combine": 2 * n_moe, "op.moe_unpermute_combine_backward": n_moe,
    })
    return +expected


# ---------------------------------------------------------------------------------------------- off / on


def test_off_returns_the_shared_null_context():
    assert not nvtx.is_enabled()
    first, second = nvtx.nvtx_range("a"), nvtx.nvtx_range("b")
    assert first is nvtx.NULL_RANGE and second is nvtx.NULL_RANGE
    assert isinstance(nvtx.NULL_RANGE, contextlib.nullcontext)

    @nvtx.nvtx_wrap("wrapped")
    def double(x):
        return 2 * x

    with nvtx.record_ranges() as names:
        with nvtx.nvtx_range("a"):
            assert double(3) == 6
    assert names == []


def test_on_records_nested_ranges_in_order(ranges_on):
    @nvtx.nvtx_wrap("wrapped")
    def inner():
        assert nvtx.innermost() == "wrapped"

    with nvtx.record_ranges() as names:
        assert nvtx.nvtx_range("x") is not nvtx.NULL_RANGE
        with nvtx.nvtx_range("outer"):
            inner()
            with nvtx.nvtx_range("second"):
                assert nvtx.innermost() == "second"
            assert nvtx.innermost() == "outer"
    assert names == ["outer", "wrapped", "second"]
    assert nvtx.innermost() is None


def test_enabled_ranges_are_also_record_functions_under_torch_profiler(ranges_on):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with nvtx.nvtx_range("outer"):
            with nvtx.nvtx_range("inner"):
                torch.ones(3).sum()
    names = [e.name for e in prof.events()]
    assert "outer" in names and "inner" in names


# ---------------------------------------------------------------------------------------------- model


def test_eager_decoder_emits_every_documented_range_without_changing_numerics(ranges_on):
    model = _model()
    with nvtx.record_ranges() as names:
        logits_on, grads_on = _forward_backward(model)
    assert Counter(names) == _expected_counts(TINY_ARGS)
    # layer ranges come in layer order, each before its own sub-layer ranges
    layer_positions = [names.index(f"layer{i}.{k}") for i, k in enumerate(TINY_ARGS.layer_kinds())]
    assert layer_positions == sorted(layer_positions)
    assert names.index("op.kda_chunk_fwd") > names.index("layer0.kda")
    assert min(names.index(n) for n in ("op.kda_chunk_bwd", "op.grouped_mm_dx")) > names.index("head")

    nvtx.enable(False)
    logits_off, grads_off = _forward_backward(model)
    assert torch.equal(logits_on, logits_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off, strict=True))


def test_compiled_layers_keep_boundary_and_op_ranges_without_graph_breaks(ranges_on):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _model()
    eager_logits, _ = _forward_backward(model)
    try:
        # torchtitan's regional compile: one fullgraph region per decoder layer
        for name, layer in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(layer, fullgraph=True, backend="eager"))
        with nvtx.record_ranges() as names:
            logits, _ = _forward_backward(model)
        assert not torch._dynamo.utils.counters["graph_break"]
    finally:
        torch._dynamo.reset()
    assert torch.equal(logits, eager_logits)
    expected = _expected_counts(TINY_ARGS)
    dropped = IN_LAYER_RANGES | EAGER_ONLY_OP_RANGES | {"attn_res.mix"}
    kept = {n: c for n, c in expected.items() if n not in dropped}
    # in-layer ranges vanish from the compiled regions; the final AttnRes mix runs outside them
    assert Counter(names) == Counter({**kept, "attn_res.mix": 1})
    assert set(kept) >= (OP_RANGES - EAGER_ONLY_OP_RANGES) | {"head", "layer0.kda", "layer3.mla"}


# ---------------------------------------------------------------------------------------------- trainer

_RECORDING_DRIVER = """
import json, sys
from titan_moe.ops import nvtx
from titan_moe.train import main
with nvtx.record_ranges() as names:
    main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(names, f)
"""


def _start_training(dump: Path, *args: str, record_to: Path | None = None) -> subprocess.Popen:
    entry = ["-m", "titan_moe.train"] if record_to is None else ["-c", _RECORDING_DRIVER, str(record_to)]
    cmd = [sys.executable, *entry, "--job.config_file", CONFIG, *TINY_CLI, "--job.dump_folder", str(dump),
           "--training.steps", "3", *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _losses(proc: subprocess.Popen, dump: Path) -> list[float]:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_training_with_nvtx_on_has_identical_losses_and_step_ranges(tmp_path):
    ranges_file = tmp_path / "ranges.json"
    # the two runs side by side (one thread each)
    off = _start_training(tmp_path / "off")
    on = _start_training(tmp_path / "on", "--profiling.nvtx", "--profiling.nvtx_start_step", "2",
                         "--profiling.nvtx_stop_step", "2", record_to=ranges_file)
    losses_off, losses_on = _losses(off, tmp_path / "off"), _losses(on, tmp_path / "on")
    assert len(losses_off) == 3
    assert losses_on == losses_off  # bit for bit: the ranges do not touch the computation
    names = json.loads(ranges_file.read_text())
    phases = [n for n in names if n in ("train_step", "forward", "backward", "optimizer")]
    assert phases == ["train_step", "forward", "backward", "optimizer"] * 3
    # per step: the model's ranges inside forward, the backward ops inside backward
    first_step = names[: names.index("train_step", 1)]
    forward, backward = first_step.index("forward"), first_step.index("backward")
    assert forward < first_step.index("layer0.kda") < first_step.index("head") < backward
    assert backward < first_step.index("op.kda_chunk_bwd") < first_step.index("optimizer")


class _FakeCudaProfiler:
    def __init__(self):
        self.calls: list[str] = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")


@pytest.mark.parametrize("start, stop, resume_at, expected", [
    (2, 3, 0, ["start@2", "stop@3"]),
    (2, 0, 0, ["start@2"]),            # capture to the end of the run
    (4, 4, 0, ["start@4", "stop@4"]),
    (2, 3, 2, ["start@3", "stop@3"]),  # resumed inside the window
    (2, 3, 4, []),                     # resumed after it
    (0, 0, 0, []),                     # no window
])
def test_cuda_profiler_window(monkeypatch, start, stop, resume_at, expected):
    from titan_moe.train import TitanTrainer, _check_capture_window

    _check_capture_window(types.SimpleNamespace(nvtx_start_step=start, nvtx_stop_step=stop))
    fake = _FakeCudaProfiler()
    monkeypatch.setattr(torch.cuda, "profiler", fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    trainer = types.SimpleNamespace(
        job_config=types.SimpleNamespace(profiling=types.SimpleNamespace(nvtx_start_step=start, nvtx_stop_step=stop)),
        device=torch.device("cuda"), step=resume_at, _cuda_capturing=False,
    )
    trainer._stop_cuda_profiler = lambda: TitanTrainer._stop_cuda_profiler(trainer)
    events = []
    for _ in range(5):
        trainer.step += 1
        n = len(fake.calls)
        TitanTrainer._cuda_profiler_window(trainer, before_step=True)
        TitanTrainer._cuda_profiler_window(trainer, before_step=False)
        events += [f"{call}@{trainer.step}" for call in fake.calls[n:]]
    assert events == expected
    trainer.device = torch.device("cpu")  # on CPU: never calls the CUDA profiler
    trainer.step, trainer._cuda_capturing, fake.calls = 0, False, []
    for _ in range(5):
        trainer.step += 1
        TitanTrainer._cuda_profiler_window(trainer, before_step=True)
    assert fake.calls == []


@pytest.mark.parametrize("start, stop", [(-1, 0), (0, 3), (5, 2), (2, -1)])
def test_bad_capture_window_is_a_value_error(start, stop):
    from titan_moe.train import _check_capture_window

    with pytest.raises(ValueError, match="nvtx_start_step"):
        _check_capture_window(types.SimpleNamespace(nvtx_start_step=start, nvtx_stop_step=stop))
