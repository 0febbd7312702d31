"""Regional compile: each decoder layer is one fullgraph region with our ops inside it.

Checked with the aot_eager backend (Dynamo + AOTAutograd, no Inductor codegen), which
catches graph breaks and recompiles at a fraction of Inductor's CPU compile time.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch._dynamo.utils import counters

from titan_moe.flavors import FLAVORS
from titan_moe.model.decoder import Decoder

ARGS = dataclasses.replace(FLAVORS["debug"], dim=64, kda_head_dim=16, mla_q_lora_rank=32, moe_latent_dim=32)


def _batch(step: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), generator=gen)
    doc_ids = torch.zeros(2, 64, dtype=torch.int32)
    for row in range(2):  # a different number of documents at every step
        for cut in torch.randint(5, 60, (step + 1,), generator=gen):
            doc_ids[row, cut:] += 1
    return tokens, doc_ids


def test_layers_compile_fullgraph_without_breaks_or_unbounded_recompiles():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Decoder(ARGS)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    for name, layer in compiled.layers.named_children():
        compiled.layers.register_module(name, torch.compile(layer, backend="aot_eager", fullgraph=True))
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
    kinds = {(layer.kind, layer.is_moe) for layer in eager.layers.values()}
    # One graph per layer kind, then one dynamic-shape recompile per kind when the number of
    # documents (cu_seqlens length) first changes; none after that.
    assert graphs_after_step[0] == len(kinds)
    assert graphs_after_step[-1] == graphs_after_step[1] <= 2 * len(kinds)
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters()):
        assert p_c.grad is not None and p_e.grad is not None, name
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)
