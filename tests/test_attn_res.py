"""Attention residuals (SPEC §4): one mixing step against fla's `naive_attnres`, and whole toy
residual streams against a plain list-based reference written from SPEC §4's text.

Tolerances: the mixer and the references compute the same fp32/float64 sums in a different
order. One mixing step in fp32 is within a few ulps (rel ~1e-7; bound 1e-6). A toy stream
chains up to 27 mixes and 26 sub-layers of D-term dot products in fp32 against a float64
reference: ~1e-6 expected, bound 1e-5. Wrong source sets or block boundaries give O(1e-2)
or larger differences (checked below where cheap).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics import rel_err
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from titan_moe.model.attn_res import AttnResMixer, ResidualStream, max_sources, sources_before_layer

EPS = 1e-6


def fla_naive_attnres():
    """fla-core is a dev extra: the tests that use it as an oracle skip without it."""
    return pytest.importorskip("fla.ops.attnres.naive", reason="fla-core (dev extra) not installed").naive_attnres




def random_mixer(D: int, gen: torch.Generator) -> AttnResMixer:
    m = AttnResMixer(D, EPS)
    with torch.no_grad():
        m.query.copy_(torch.randn(D, generator=gen))
        m.key_norm.weight.copy_(torch.rand(D, generator=gen) + 0.5)
    return m


def random_sources(n: int, B: int, T: int, D: int, gen: torch.Generator) -> list[torch.Tensor]:
    # Different scales per source: RMSNorm of the keys must remove them.
    return [torch.randn(B, T, D, generator=gen) * (0.2 + 3 * torch.rand(1, generator=gen)) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# One mixing step vs fla
# ---------------------------------------------------------------------------------------------
MIX_CASES = [(n, layout) for n in (1, 2, 5) for layout in ("full", "block_closed")] + [(2, "block_partial"), (5, "block_partial")]


@pytest.mark.parametrize("n,layout", MIX_CASES)
def test_one_mix_matches_fla_naive(n, layout):
    """`layout`: full mode; block mode with n closed sources; block mode with n - 1 closed and b_cur."""
    B, T, D = 2, 3, 16
    gen = torch.Generator().manual_seed(n)
    srcs = random_sources(n, B, T, D, gen)
    mixer = random_mixer(D, gen)

    if layout == "full":  # n sources pushed one by one
        stream = ResidualStream.start(srcs[0], "full", n_layers=4, block_size=1)
        for s in srcs[1:]:
            stream = stream.add(s)
    else:
        n_closed = n - 1 if layout == "block_partial" else n
        stream = ResidualStream.start(srcs[0], "block", n_layers=8, block_size=1)
        for s in srcs[1:n_closed]:
            stream = stream.add(s).close_block()
        if layout == "block_partial":
            stream = stream.add(srcs[-1])  # b_cur, written once
    h = mixer(stream)
    ref = fla_naive_attnres()(mixer.query, srcs, mixer.key_norm.weight, rms_eps=EPS)
    assert rel_err(h, ref) < 1e-6


def test_one_mix_bf16_stream():
    """bf16 sources: both sides compute in fp32 and round once to bf16 (2^-8 relative)."""
    gen = torch.Generator().manual_seed(0)
    srcs = [s.bfloat16() for s in random_sources(3, 2, 4, 16, gen)]
    mixer = random_mixer(16, gen)
    stream = ResidualStream.start(srcs[0], "block", n_layers=4, block_size=1)
    stream = stream.add(srcs[1]).close_block().add(srcs[2])
    h = mixer(stream)
    assert h.dtype == torch.bfloat16
    assert rel_err(h, fla_naive_attnres()(mixer.query, srcs, mixer.key_norm.weight, rms_eps=EPS)) < 8e-3


def test_zero_init_mix_is_uniform_over_available_sources():
    gen = torch.Generator().manual_seed(0)
    e, a, b, c = random_sources(4, 2, 3, 8, gen)
    mixer = random_mixer(8, gen)
    mixer.init_weights()
    s = ResidualStream.start(e, "block", n_layers=4, block_size=1)
    assert rel_err(mixer(s), e) < 1e-6  # empty b_cur is not a source
    s = s.add(a)
    assert rel_err(mixer(s), (e + a) / 2) < 1e-6
    s = s.add(b)  # b_cur = a + b
    assert rel_err(mixer(s), (e + a + b) / 2) < 1e-6
    s = s.close_block()  # b_1 = a + b, b_cur empty again
    assert rel_err(mixer(s), (e + a + b) / 2) < 1e-6
    s = s.add(c)
    assert rel_err(mixer(s), (e + a + b + c) / 3) < 1e-6

    f = ResidualStream.start(e, "full", n_layers=2, block_size=1).add(a).add(b)
    assert rel_err(mixer(f), (e + a + b) / 3) < 1e-6


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every aten op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["block", "full"])
def test_mix_runs_no_matmul_forward_or_backward(mode):
    """The mix is a product-and-sum over D and over sources, never a (batched) matmul: as a
    matmul with batch B*T its backward kernels took 13% of a width-4096 step on the GPU."""
    gen = torch.Generator().manual_seed(0)
    srcs = [s.requires_grad_() for s in random_sources(3, 2, 4, 16, gen)]
    mixer = random_mixer(16, gen)
    stream = ResidualStream.start(srcs[0], mode, n_layers=4, block_size=1)
    stream = stream.add(srcs[1]).close_block().add(srcs[2]) if mode == "block" else stream.add(srcs[1]).add(srcs[2])
    with _OpNames() as ops:
        mixer(stream).square().sum().backward()
    assert ops.names & {"mm", "bmm", "mv", "addmm", "matmul", "dot"} == set()
    assert {"mul", "sum"} <= ops.names  # the mode saw the mix's ops
    assert all(s.grad is not None for s in srcs) and mixer.query.grad is not None


# ---------------------------------------------------------------------------------------------
# Whole toy residual streams vs a list-based reference
# ---------------------------------------------------------------------------------------------
class ToyModel(nn.Module):
    """n_layers x (attention-like, FFN-like) sub-layers f(x) = tanh(RMSNorm(x) @ W), each
    preceded by its own mixer; one final mixer. Uses the stream API as a decoder would."""

    def __init__(self, D: int, n_layers: int, gen: torch.Generator):
        super().__init__()
        self.n_layers = n_layers
        self.weights = nn.Parameter(torch.randn(2 * n_layers, D, D, generator=gen) / D**0.5 * 1.5)
        self.mixers = nn.ModuleList([random_mixer(D, gen) for _ in range(2 * n_layers + 1)])

    def sublayer(self, idx: int, h_BTD: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.rms_norm(h_BTD, (h_BTD.shape[-1],), eps=EPS) @ self.weights[idx])

    def forward(self, embed_BTD: torch.Tensor, mode: str, block_size: int) -> tuple[torch.Tensor, list]:
        stream = ResidualStream.start(embed_BTD, mode, self.n_layers, block_size)
        hs = []
        for layer in range(self.n_layers):
            for sub in (0, 1):
                idx = 2 * layer + sub
                hs.append(self.mixers[idx](stream))
                stream = stream.add(self.sublayer(idx, hs[-1]))
            stream = stream.end_layer(layer)
        hs.append(self.mixers[-1](stream))
        return hs[-1], hs


def reference_mix(sources: list[torch.Tensor], query: torch.Tensor, key_w: torch.Tensor) -> torch.Tensor:
    """alpha_i = softmax_i(w^T RMSNorm(v_i)); h = sum_i alpha_i v_i, one source at a time."""
    logits = []
    for v in sources:
        k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * key_w
        logits.append((k * query).sum(-1))
    alpha = torch.softmax(torch.stack(logits), dim=0)
    return sum(alpha[i, ..., None] * v for i, v in enumerate(sources))


def reference_stream(model: ToyModel, embed: torch.Tensor, mode: str, block_size: int) -> tuple[torch.Tensor, list]:
    """SPEC §4 read literally, in float64, with Python lists of sources."""
    q = [m.query.double() for m in model.mixers]
    kw = [m.key_norm.weight.double() for m in model.mixers]
    W = model.weights.double()
    f = lambda idx, h: torch.tanh(h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + EPS) @ W[idx])  # noqa: E731
    x = embed.double()
    hs = []
    if mode == "none":  # x <- x + f(norm(x))
        for idx in range(2 * model.n_layers):
            hs.append(x)
            x = x + f(idx, x)
        hs.append(x)
        return x, hs
    if mode == "full":  # every sub-layer output is its own source
        sources = [x]
        for idx in range(2 * model.n_layers):
            hs.append(reference_mix(sources, q[idx], kw[idx]))
            sources.append(f(idx, hs[-1]))
        hs.append(reference_mix(sources, q[-1], kw[-1]))
        return hs[-1], hs
    # block: b_0, finished blocks, and b_cur once a sub-layer of the block has written to it
    blocks, cur = [x], None
    for layer in range(model.n_layers):
        for sub in (0, 1):
            idx = 2 * layer + sub
            sources = blocks + ([cur] if cur is not None else [])
            hs.append(reference_mix(sources, q[idx], kw[idx]))
            out = f(idx, hs[-1])
            cur = out if cur is None else cur + out
        if (layer + 1) % block_size == 0:  # the block ends after the FFN of its last layer
            blocks.append(cur)
            cur = None
    hs.append(reference_mix(blocks + ([cur] if cur is not None else []), q[-1], kw[-1]))
    return hs[-1], hs


STREAM_CASES = [
    ("block", 4, 1),  # every layer a block
    ("block", 5, 2),  # last block partial (1 of 2 layers)
    ("block", 4, 2),  # last block closes at the last layer: final mix has no b_cur
    ("block", 13, 12),  # K3-style: a 12-layer block, then a 1-layer partial block
    ("full", 4, 1),
    ("none", 4, 1),
]


@pytest.mark.parametrize("mode,n_layers,block_size", STREAM_CASES)
def test_toy_stream_matches_list_reference(mode, n_layers, block_size):
    B, T, D = 2, 3, 16
    gen = torch.Generator().manual_seed(n_layers * 10 + block_size)
    model = ToyModel(D, n_layers, gen)
    embed = torch.randn(B, T, D, generator=gen)
    out, hs = model(embed, mode, block_size)
    ref, ref_hs = reference_stream(model, embed, mode, block_size)
    assert len(hs) == len(ref_hs) == 2 * n_layers + 1
    for i, (h, r) in enumerate(zip(hs, ref_hs)):
        assert rel_err(h, r) < 1e-5, f"mix {i}"
    assert out.dtype == torch.float32 and rel_err(out, ref) < 1e-5


def test_toy_stream_gradients_match_reference():
    """Backward through the closed blocks, the empty b_cur's masked logit and the b_cur flag."""
    gen = torch.Generator().manual_seed(5)
    model = ToyModel(8, 5, gen)
    embed = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    g = torch.randn(2, 3, 8, generator=gen)
    (model(embed, "block", 2)[0] * g).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [embed.grad.clone()]
    model.zero_grad()
    embed.grad = None
    (reference_stream(model, embed, "block", 2)[0] * g.double()).sum().backward()
    ref_grads = [p.grad for p in model.parameters()] + [embed.grad]
    for got, ref in zip(grads, ref_grads):
        # The first mixer sees b_0 alone: its parameter gradients are exactly zero on both sides.
        assert torch.isfinite(got).all() and (got.double() - ref).norm() <= 1e-5 * ref.norm()


def test_block_boundaries_matter():
    """The reference separates block layouts: a wrong boundary would not pass the test above."""
    gen = torch.Generator().manual_seed(0)
    model = ToyModel(16, 5, gen)
    embed = torch.randn(2, 3, 16, generator=gen)
    out_2 = model(embed, "block", 2)[0]
    assert rel_err(out_2, reference_stream(model, embed, "block", 3)[0]) > 1e-2
    assert rel_err(out_2, reference_stream(model, embed, "full", 1)[0]) > 1e-2


def test_buffer_sizes_and_user_errors():
    assert max_sources("block", 93, 12) == 8  # b_0 + 7 full blocks; the 8th (9 layers) stays in b_cur
    assert max_sources("block", 13, 12) == 2
    assert max_sources("block", 4, 2) == 3
    assert max_sources("full", 4, 2) == 9
    assert [sources_before_layer("block", i, 12) for i in (0, 11, 12, 92)] == [1, 1, 2, 8]
    assert [sources_before_layer("full", i, 1) for i in (0, 1, 3)] == [1, 3, 7]
    assert sources_before_layer("none", 5, 1) == 0
    e = torch.zeros(1, 2, 4)
    s = ResidualStream.start(e, "block", n_layers=3, block_size=2)
    assert s.sources == (e,) and s.n_sources == 1 and not bool(s.partial_used)
    assert s.partial_BTD.shape == (1, 2, 4) and s.partial_BTD is not e
    with pytest.raises(ValueError):
        ResidualStream.start(e, "blocks", n_layers=3, block_size=2)
    with pytest.raises(ValueError):
        ResidualStream.start(e, "block", n_layers=3, block_size=0)
    with pytest.raises(ValueError):
        ResidualStream.start(e[0], "block", n_layers=3, block_size=1)
    with pytest.raises(ValueError):
        ResidualStream.start(e, "full", n_layers=3, block_size=1).close_block()


def test_init_weights_after_meta_to_empty():
    with torch.device("meta"):
        m = AttnResMixer(8, EPS)
    m.to_empty(device="cpu")
    m.init_weights(0.02)
    assert torch.equal(m.query, torch.zeros(8)) and torch.equal(m.key_norm.weight, torch.ones(8))


# ---------------------------------------------------------------------------------------------
# Compile: one graph for every layer position
# ---------------------------------------------------------------------------------------------
class ToyLayer(nn.Module):
    """mix -> f -> add, twice, as a decoder layer does (block closing happens outside)."""

    def __init__(self, D: int, gen: torch.Generator):
        super().__init__()
        self.mix_a, self.mix_f = random_mixer(D, gen), random_mixer(D, gen)
        self.w_a = nn.Parameter(torch.randn(D, D, generator=gen) / D**0.5)
        self.w_f = nn.Parameter(torch.randn(D, D, generator=gen) / D**0.5)

    def forward(self, stream: ResidualStream) -> ResidualStream:
        stream = stream.add(torch.tanh(self.mix_a(stream) @ self.w_a))
        return stream.add(torch.tanh(self.mix_f(stream) @ self.w_f))


@pytest.mark.parametrize("mode,block_size", [("block", 3), ("block", 1), ("full", 1), ("none", 1)])
def test_compiled_layers_one_graph_per_source_count(mode, block_size):
    """12 layers, each compiled on its own (as regional compile does), see streams with 1 to
    25 sources and empty or written b_cur: one graph per source count (block mode: per
    block; the b_cur flag is a tensor, not a recompile), no graph break, and the same
    values and gradients as eager."""
    L, D = 12, 8
    gen = torch.Generator().manual_seed(0)
    layers = [ToyLayer(D, gen) for _ in range(L)]
    final = random_mixer(D, gen)
    embed = torch.randn(2, 3, D, generator=gen)

    def run(blocks):
        x = embed.clone().requires_grad_(True)
        stream = ResidualStream.start(x, mode, L, block_size)
        for i, layer in enumerate(blocks):
            stream = layer(stream).end_layer(i)
        out = final(stream)
        out.pow(2).sum().backward()
        return out, x.grad

    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = [torch.compile(layer, backend=cnt, fullgraph=True) for layer in layers]
    with torch._dynamo.config.patch(recompile_limit=64):  # as parallelize.apply_compile sets it
        out_c, grad_c = run(compiled)
    out_e, grad_e = run(layers)
    assert cnt.frame_count == len({sources_before_layer(mode, i, block_size) for i in range(L)})
    assert not counters["graph_break"]
    # fp32 through 12 layers; aot_eager's decompositions reorder a few sums (seen: 1.1e-6 on
    # the gradient). A wrong source set is off by orders of magnitude more.
    assert rel_err(out_c, out_e) < 1e-6 and rel_err(grad_c, grad_e) < 2e-6


def test_stream_is_a_pytree_of_its_tensors():
    """FSDP2 hooks the tensors it finds in a unit's outputs; a decoder layer returns a stream,
    so the stream must flatten to its tensors (and back, keeping mode and block size)."""
    import torch.utils._pytree as pytree

    stream = ResidualStream.start(torch.randn(2, 3, 8), "block", n_layers=4, block_size=1)
    stream = stream.add(torch.randn(2, 3, 8)).end_layer(0)
    leaves, spec = pytree.tree_flatten(stream)
    assert len(leaves) == 2 + 2 and all(isinstance(t, torch.Tensor) for t in leaves)
    assert all(a is b for a, b in zip(leaves[:2], stream.sources)) and leaves[2] is stream.partial_BTD
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, ResidualStream) and (back.mode, back.block_size) == ("block", 1)
    assert len(back.sources) == 2 and back.partial_BTD is stream.partial_BTD


def test_closing_a_block_copies_nothing_and_aliases_nothing():
    """A closed block joins the sources as it is (no copy of the other sources), and no
    source shares storage with another or with b_cur (the compiled layers of a block see
    one aliasing pattern)."""
    e = torch.randn(1, 3, 4, requires_grad=True)
    stream = ResidualStream.start(e, "block", n_layers=4, block_size=1)
    written = stream.add(torch.randn(1, 3, 4, requires_grad=True) * 1.0)
    stream = written.end_layer(0)
    assert stream.sources[0] is e and stream.sources[1] is written.partial_BTD
    assert stream.n_sources == 2 and not bool(stream.partial_used)
    ptrs = [v.untyped_storage().data_ptr() for v in (*stream.sources, stream.partial_BTD)]
    assert len(set(ptrs)) == len(ptrs)
    assert all(v.requires_grad for v in (*stream.sources, stream.partial_BTD))
