"""Inductor compiles one decoder layer of every kind: (KDA | MLA) x (dense FFN | MoE).

`test_compile.py` checks the whole model's regional compile with the cheap `aot_eager`
backend. Here each layer kind goes once through the backend that training uses,
`torch.compile(layer, backend="inductor", fullgraph=True)`, on the inputs the decoder gives
that layer: its AttnRes residual stream (stacked sources, count, partial block), the
packed-document ids and their `cu_seqlens`. One training step (forward and backward) must:

* compile without a graph break, into one forward and one backward graph;
* match eager in the output stream, every parameter gradient, the gradients of the stream
  inputs and (MoE) the routing statistics that the forward writes into the module;
* keep our custom ops (`titan_moe::kda_chunk_fwd/bwd`, `titan_moe::grouped_mm{,_dx,_dw}`)
  as opaque calls in Inductor's generated code: not decomposed, not re-implemented;
* recompile at most once when the number of documents changes (`cu_seqlens` gets a
  dynamic length), and not again for a third count.

Inductor's CPU code generation (a C++ kernel per fused group, built by g++) dominates the
run time; the `inductor_settings` fixture holds the settings that shorten it.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from numerics import rel_err
from tiny import TINY_ARGS
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from titan_moe.model.attn_res import ResidualStream
from titan_moe.model.decoder import Decoder, run_layer
from titan_moe.model.packing import cu_seqlens_from_doc_ids

# One layer of each kind, in two AttnRes blocks of two layers: layers 0 and 2 open a block
# (b_cur empty; one, then two finished sources), layers 1 and 3 continue one (b_cur in use).
ARGS = dataclasses.replace(TINY_ARGS, n_layers=4, mla_layers=[1, 3], n_dense_layers=2, vocab_size=64)
KINDS = {0: ("kda", False), 1: ("mla", False), 2: ("kda", True), 3: ("mla", True)}
B, T = 2, 32

KDA_OPS = {"kda_chunk_fwd_kept", "kda_chunk_bwd_kept"}  # the default (TITAN_MOE_KDA_KEEP=1) under autograd
MOE_OPS = {"grouped_mm", "grouped_mm_dx", "grouped_mm_dw"}


@pytest.fixture(scope="module")
def inductor_settings(tmp_path_factory):
    """Settings that cut Inductor's CPU compile time; none changes what the code computes.

    * `cpp.vec_isa_ok=False`: scalar C++ kernels. Skips the probe builds of AVX2/AVX-512
      test programs and makes each kernel cheaper for g++ and for Inductor's vectorising
      code generator; measured here, it halved the compile time of a layer.
    * `TORCH_WARM_POOL=0`: do not start the subprocess pool that Inductor warms up for
      Triton kernels (importing torch in worker processes costs CPU on two cores and
      serves no CPU kernel). The C++ kernels still build `compile_threads` at a time, on
      threads (default: one per core; one at a time measured slower).
    * `max_autotune=False`: no benchmarking of GEMM templates.
    * a local FX graph cache in a fresh folder for this module: the run starts cold (a stale
      cache cannot hide a code generation failure) and kernels that recur across graphs are
      built once.

    g++'s precompiled header of Inductor's C++ prelude is not covered: Inductor keeps it in
    its global cache folder, and a cold machine builds it once (a few seconds).
    """
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with (
        pytest.MonkeyPatch.context() as mp,
        temporary_cache_dir(str(tmp_path_factory.mktemp("inductor_cache"))),
        torch._inductor.config.patch({"cpp.vec_isa_ok": False, "max_autotune": False, "fx_graph_cache": True}),
    ):
        mp.setenv("TORCH_WARM_POOL", "0")
        yield


@pytest.fixture(scope="module")
def model() -> Decoder:
    torch.manual_seed(0)
    m = Decoder(ARGS)
    m.init_weights()
    # Random AttnRes pseudo-queries: their zero init mixes the sources uniformly, which
    # would hide a wrong source mask or a wrong source count.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mix.query"):
                p.normal_()
    return m


def _doc_ids(docs_per_row: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, T] ids of `docs_per_row` packed documents in each row, at random boundaries."""
    doc_ids_BT = torch.zeros(B, T, dtype=torch.int32)
    for row in range(B):
        for cut in (torch.randperm(T - 1, generator=gen)[: docs_per_row - 1] + 1).tolist():
            doc_ids_BT[row, cut:] += 1
    return doc_ids_BT


def _stream_before(model: Decoder, layer_idx: int, tokens_BT: torch.Tensor, doc_ids_BT: torch.Tensor, device: str):
    """The residual stream that `Decoder.forward` passes to layer `layer_idx`, as fresh
    grad-requiring leaves on `device` (computed on the CPU with the eager layers before it)."""
    cu_seqlens = cu_seqlens_from_doc_ids(doc_ids_BT)
    with torch.no_grad():
        stream = ResidualStream.start(
            model.tok_embeddings(tokens_BT), ARGS.attn_res, ARGS.n_layers, ARGS.attn_res_block_size
        )
        for i in range(layer_idx):
            stream = run_layer(model.layers[str(i)], stream, doc_ids_BT=doc_ids_BT, cu_seqlens=cu_seqlens).end_layer(i)
    # All stream tensors on `device`, as the Decoder keeps them: the partial-block flag is a
    # 0-dim tensor that masks the mixer's logit for b_cur.
    return dataclasses.replace(
        stream,
        sources=tuple(v.detach().to(device).requires_grad_() for v in stream.sources),
        partial_BTD=stream.partial_BTD.detach().to(device).requires_grad_(),
        partial_used=stream.partial_used.to(device),
    )


def _train_step(layer, stream: ResidualStream, doc_ids_BT: torch.Tensor, probe_BTD: torch.Tensor):
    """Forward and backward of one layer as the decoder calls it (loss: the new b_cur
    projected on `probe_BTD`). Returns the output b_cur and the gradients of both stream
    inputs; parameter gradients are left in `.grad`."""
    for p in layer.parameters():
        p.grad = None
    out = run_layer(layer, stream, doc_ids_BT=doc_ids_BT, cu_seqlens=cu_seqlens_from_doc_ids(doc_ids_BT))
    (out.partial_BTD * probe_BTD).sum().backward()
    return out.partial_BTD.detach(), torch.stack([v.grad for v in stream.sources]), stream.partial_BTD.grad


def _check_step_matches_eager(
    compiled, eager, model: Decoder, layer_idx: int, docs_per_row: int, seed: int, device: str = "cpu"
):
    gen = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, ARGS.vocab_size, (B, T), generator=gen)
    doc_ids_BT = _doc_ids(docs_per_row, gen)
    probe_BTD = torch.randn(B, T, ARGS.dim, generator=gen).to(device)
    stream_c = _stream_before(model, layer_idx, tokens_BT, doc_ids_BT, device)
    stream_e = _stream_before(model, layer_idx, tokens_BT, doc_ids_BT, device)
    doc_ids_BT = doc_ids_BT.to(device)
    got = _train_step(compiled, stream_c, doc_ids_BT, probe_BTD)
    want = _train_step(eager, stream_e, doc_ids_BT, probe_BTD)
    # The same maths in fp32, and our custom ops run the very same code in both; but
    # Inductor decomposes SDPA, the norms and the softmaxes into its own fused loops, which
    # sum in other orders, and adds the backward's partial gradients in another order.
    # Seen: at most 3e-6 for the stream and 7e-6 for a parameter gradient (the AttnRes
    # query and key-norm weights: sums over all tokens of softmax terms that nearly cancel).
    # A real lowering bug (a lost mask, a wrong gradient) is off by 1e-2 or more.
    for name, g, w in zip(("output b_cur", "grad sources", "grad b_cur"), got, want, strict=True):
        assert g is not None and w is not None, name
        assert rel_err(g, w) < 3e-5, (name, rel_err(g, w))
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        assert p_c.grad is not None and p_e.grad is not None, name
        assert rel_err(p_c.grad, p_e.grad) < 1e-4, (name, rel_err(p_c.grad, p_e.grad))


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


# CI compiles two kinds, which between them hold both mixers and both FFNs (every custom op
# of a layer): KDA with MoE and MLA with the dense FFN; the other two are slow tests.
CI_KINDS = (2, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer_idx", [i if i in CI_KINDS else pytest.param(i, marks=pytest.mark.slow) for i in KINDS],
                         ids=[f"{a}-{'moe' if m else 'dense'}" for a, m in KINDS.values()])
def test_layer_kind_compiles_with_inductor(inductor_settings, model, layer_idx, device):
    """fp32 on both devices (CUDA: Triton kernels from Inductor, TF32 off as by default)."""
    kind, is_moe = KINDS[layer_idx]
    layer = model.layers[str(layer_idx)]
    assert (layer.kind, layer.is_moe) == (kind, is_moe)
    eager = copy.deepcopy(layer).to(device)
    compiled = torch.compile(copy.deepcopy(layer).to(device), backend="inductor", fullgraph=True)

    counters.clear()
    # run_and_get_code resets Dynamo, then returns the code of every graph Inductor generates.
    _, codes = run_and_get_code(
        _check_step_matches_eager, compiled, eager, model, layer_idx, 2, seed=layer_idx, device=device
    )
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert len(codes) == 2, "expected one forward and one backward graph"
    called = {op for code in codes for op in re.findall(r"torch\.ops\.titan_moe\.(\w+)", code)}
    expected = (KDA_OPS if kind == "kda" else set()) | (MOE_OPS if is_moe else set())
    assert expected <= called, f"not called as opaque ops: {sorted(expected - called)}"

    # Another number of documents: at most one recompile (to a graph with a dynamic
    # `cu_seqlens` length); a third count reuses that graph, so it must be dynamic.
    _check_step_matches_eager(compiled, eager, model, layer_idx, 3, seed=10 + layer_idx, device=device)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2
    _check_step_matches_eager(compiled, eager, model, layer_idx, 5, seed=20 + layer_idx, device=device)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])

    if is_moe:  # written by the forward outside autograd: a buffer updated in place, an attribute
        moe_c, moe_e = compiled.feed_forward, eager.feed_forward
        assert moe_e.tokens_per_expert.sum() == 3 * B * T * ARGS.top_k
        assert torch.equal(moe_c.tokens_per_expert, moe_e.tokens_per_expert)
        assert rel_err(moe_c.step_scores, moe_e.step_scores) < 1e-5
