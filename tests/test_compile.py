"""Regional compile: each decoder layer is one fullgraph region with our ops inside it.

Checked with the aot_eager backend (Dynamo + AOTAutograd, no Inductor codegen), which
catches graph breaks and recompiles at a fraction of Inductor's CPU compile time.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from torch._dynamo.utils import counters

from titan_moe.flavors import FLAVORS
from titan_moe.model.decoder import Decoder
from titan_moe.parallelize import layer_graph_variants

ARGS = dataclasses.replace(FLAVORS["debug"], dim=64, kda_head_dim=16, mla_q_lora_rank=32, moe_latent_dim=32)


def _batch(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), generator=gen)
    doc_ids = torch.zeros(2, 64, dtype=torch.int32)
    for row in range(2):  # a different number of documents at every step
        for cut in torch.randint(5, 60, (step + 1,), generator=gen):
            doc_ids[row, cut:] += 1
    return tokens, doc_ids


def _seeded_pair(args) -> tuple[Decoder, Decoder]:
    """A seeded decoder and a deep copy of it; Dynamo's caches and counters are reset."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Decoder(args)
    eager.init_weights()
    return eager, copy.deepcopy(eager)


def _eager_and_compiled(args, wrap=lambda layer: layer) -> tuple[Decoder, Decoder]:
    """`_seeded_pair` with the copy's layers `wrap`ped, then compiled (aot_eager)."""
    eager, compiled = _seeded_pair(args)
    for name, layer in compiled.layers.named_children():
        compiled.layers.register_module(name, torch.compile(wrap(layer), backend="aot_eager", fullgraph=True))
    return eager, compiled


def _step_matches_eager(compiled: Decoder, eager: Decoder, tokens: torch.Tensor, doc_ids: torch.Tensor) -> None:
    """One forward and backward of each; no graph break, outputs equal to fp32 rounding."""
    out_c, out_e = compiled(tokens, doc_ids), eager(tokens, doc_ids)
    out_c.logsumexp(-1).mean().backward()
    out_e.logsumexp(-1).mean().backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert ((out_c - out_e).norm() / out_e.norm()).item() < 1e-5


def _assert_same_grads(compiled: Decoder, eager: Decoder) -> None:
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert p_c.grad is not None and p_e.grad is not None, name
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_layers_compile_fullgraph_without_breaks_or_recompiles():
    eager, compiled = _eager_and_compiled(ARGS)
    gen = torch.Generator().manual_seed(0)
    graphs_after_step = []
    for step in range(4):
        tokens, doc_ids = _batch(step, gen)
        out_c = compiled(tokens, doc_ids)
        out_e = eager(tokens, doc_ids)
        out_c.logsumexp(-1).mean().backward()
        out_e.logsumexp(-1).mean().backward()
        # Same graph of ops, only traced: equal up to fp32 reassociation in AOT's decompositions.
        assert ((out_c - out_e).norm() / out_e.norm()).item() < 1e-5
        graphs_after_step.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # One graph per (layer kind, AttnRes source count); the decoder marks the document count
    # (cu_seqlens length) dynamic, so a new count at every step recompiles nothing.
    assert graphs_after_step == [layer_graph_variants(ARGS)] * len(graphs_after_step)
    assert layer_graph_variants(ARGS) > len({(layer.kind, layer.is_moe) for layer in eager.layers.values()})
    _assert_same_grads(compiled, eager)


@pytest.mark.parametrize("batch_iters,stats", [(0, ("tokens_per_expert", "qb_counts")),
                                               (2, ("tokens_per_expert", "qb_batch_bias_sum", "qb_batch_count"))])
def test_checkpointed_layers_compile_with_histogram_qb(batch_iters, stats):
    """Compile over activation checkpointing (torchtitan wraps each layer, then compiles the
    wrapper): the MoE's balance statistics are buffer updates inside the checkpointed region,
    counted once per forward, as in eager without checkpointing; for in-batch QB (the GPU
    flavors' form) also the batch bias it routes with. On torch 2.11 this also guards the
    layer's tensor-tuple boundary (`DecoderLayer.forward`): a `ResidualStream` returned from
    the checkpointed region made Dynamo emit a broken graph."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    eager, compiled = _eager_and_compiled(
        dataclasses.replace(ARGS, qb_bins=16, qb_batch_iters=batch_iters),
        lambda layer: checkpoint_wrapper(layer, preserve_rng_state=False),
    )
    tokens, doc_ids = _batch(0, torch.Generator().manual_seed(1))
    _step_matches_eager(compiled, eager, tokens, doc_ids)
    unwrapped = re.compile(r"(_orig_mod|_checkpoint_wrapped_module)\.")
    stats_c = {unwrapped.sub("", n): b for n, b in compiled.named_buffers()}
    stats_e = dict(eager.named_buffers())
    assert stats_c.keys() == stats_e.keys()
    for key in stats:
        names = [n for n in stats_e if n.endswith(key)]
        assert names, key
        for n in names:
            assert torch.equal(stats_c[n], stats_e[n]), n
    _assert_same_grads(compiled, eager)


def test_layers_compile_under_autocast():
    """One-GPU training runs the compiled layers under autocast (fp32 parameters, bf16
    compute): the autocast queries inside a layer (`to_autocast_dtype`) and the mixers'
    autocast-off region trace without a graph break."""
    eager, compiled = _eager_and_compiled(ARGS)
    tokens, doc_ids = _batch(1, torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_c, out_e = compiled(tokens, doc_ids), eager(tokens, doc_ids)
    out_c.logsumexp(-1).mean().backward()
    out_e.logsumexp(-1).mean().backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert ((out_c - out_e).norm() / out_e.norm()).item() < 1e-2  # bf16 matmuls, other op orders
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert p_c.grad is not None and p_e.grad is not None, name


def test_piecewise_moe_regions_match_eager():
    """`[compile] moe_regions = "piecewise"` (torchtitan's way for MoE blocks, here without EP):
    the MoE layers become child regions plus `route_and_sort` / `combine`, experts eager; the
    dense layers stay one region. Same loss and gradients as eager, no graph break."""
    from types import SimpleNamespace

    from titan_moe.model.moe import LatentMoE
    from titan_moe.parallelize import apply_compile

    eager, compiled = _seeded_pair(ARGS)
    apply_compile(compiled, SimpleNamespace(backend="aot_eager", passes=[], moe_regions="piecewise"), ep_enabled=False)
    for layer in compiled.layers.values():
        moe = [m for m in layer.modules() if isinstance(m, LatentMoE)]
        if layer.is_moe:  # the layer itself stays a plain module; its pieces are compiled
            assert not hasattr(layer, "_orig_mod") and moe and hasattr(moe[0].route_and_sort, "_torchdynamo_orig_callable")
        else:
            assert hasattr(layer, "_orig_mod")
    tokens, doc_ids = _batch(0, torch.Generator().manual_seed(2))
    _step_matches_eager(compiled, eager, tokens, doc_ids)
    _assert_same_grads(compiled, eager)


def test_moe_regions_config_is_checked(tmp_path):
    from titan_moe.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    path.write_text('[model]\nname = "titan_moe"\nflavor = "debug"\n')
    assert load_config(["--job.config_file", str(path)]).compile.moe_regions == "auto"
    assert load_config(["--job.config_file", str(path), "--compile.moe_regions", "piecewise"]).compile.moe_regions == "piecewise"
    with pytest.raises(ConfigError, match="moe_regions"):
        load_config(["--job.config_file", str(path), "--compile.moe_regions", "whole"])


@pytest.mark.parametrize("limit", [None, pytest.param(8, marks=pytest.mark.slow)])
def test_regions_take_training_evaluation_and_new_lengths(monkeypatch, limit):
    """The layer regions share one code object, so layer kinds x AttnRes source counts x
    training / evaluation x new sequence lengths (a ladder's stages and its evaluations) all
    count against one Dynamo recompile limit; `apply_compile` raises it (at torch's default
    of 8, the run stops)."""
    import types

    from titan_moe import parallelize

    if limit is not None:
        monkeypatch.setattr(parallelize, "REGION_RECOMPILE_LIMIT", limit)
        monkeypatch.setattr(parallelize, "layer_graph_variants", lambda args: 1)
    _, model = _seeded_pair(ARGS)

    def run_all_lengths():
        gen = torch.Generator().manual_seed(3)
        for T in (32, 64, 96):
            tokens = torch.randint(0, ARGS.vocab_size, (1, T), generator=gen)
            doc_ids = torch.zeros(1, T, dtype=torch.int32)
            model.train()
            model(tokens, doc_ids).logsumexp(-1).mean().backward()
            model.eval()
            with torch.no_grad():
                model(tokens, doc_ids)

    with torch._dynamo.config.patch(recompile_limit=8):  # torch's default; restored after
        parallelize.apply_compile(model, types.SimpleNamespace(backend="aot_eager", passes=[], moe_regions="auto"),
                                  ep_enabled=False)
        if limit is None:
            run_all_lengths()
            assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        else:
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
                run_all_lengths()
