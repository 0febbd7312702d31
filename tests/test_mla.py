"""Gated NoPE MLA (SPEC §2) against an independent float64 reference.

Tolerances: fp32 has unit roundoff 6e-8. The module chains about ten reductions of at most
a few hundred terms (projections, two RMSNorms, scores, softmax, weighted sum, gate, output),
so its error against float64 is ~1e-6 relative; 1e-5 leaves a 10x margin and would still
catch any wrong mask, scale, split or layout (those give O(1e-1) errors). The same bound
applies between two fp32 evaluation orders (absorbed vs expanded, packed vs separate).
"""

from __future__ import annotations

import math

import pytest
import torch
from numerics import rel_err
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from titan_moe.model.args import ModelArgs
from titan_moe.model.mla import GatedMLA, MLACache

FP32_TOL = 1e-5




def small_args(**overrides) -> ModelArgs:
    # qk head dim (8 + 4) differs from v head dim (6) on purpose.
    kw = dict(
        dim=32,
        mla_n_heads=3,
        mla_q_lora_rank=24,
        mla_kv_lora_rank=16,
        mla_qk_nope_head_dim=8,
        mla_qk_shared_dim=4,
        mla_v_head_dim=6,
    )
    kw.update(overrides)
    return ModelArgs(**kw)


def make_mla(args: ModelArgs, seed: int = 0) -> GatedMLA:
    """Weights ~ N(0, 1/fan_in) so activations are O(1) and attention is far from uniform;
    norm weights random too, so a missing norm weight would show."""
    torch.manual_seed(seed)
    m = GatedMLA(args)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.5 / math.sqrt(p.shape[1]))
            else:
                p.uniform_(0.5, 1.5)
    return m


def random_doc_ids(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [B, T], non-decreasing per row, random boundaries."""
    starts_BT = torch.rand(B, T, generator=gen) < 0.25
    starts_BT[:, 0] = False
    return starts_BT.cumsum(dim=1).to(torch.int32)


def reference_mla(m: GatedMLA, x_BTD: torch.Tensor, doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """SPEC §2 in float64 with an explicit masked softmax, from the module's weights."""
    W = {name: p.double() for name, p in m.named_parameters()}
    x = x_BTD.double()
    B, T, _ = x.shape
    H, R, N, S, V = m.n_heads, m.kv_lora_rank, m.qk_nope_dim, m.qk_shared_dim, m.v_head_dim
    eps = m.q_norm.eps

    def rms(z, w):
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w

    q = (rms(x @ W["w_dq.weight"].T, W["q_norm.weight"]) @ W["w_uq.weight"].T).view(B, T, H, N + S)
    lat = x @ W["w_dkv.weight"].T
    c, k_s = rms(lat[..., :R], W["kv_norm.weight"]), lat[..., R:]
    kv = (c @ W["w_ukv.weight"].T).view(B, T, H, N + V)
    k = torch.cat([kv[..., :N], k_s[:, :, None, :].expand(B, T, H, S)], dim=-1)
    v = kv[..., N:]

    scores = torch.einsum("bihk,bjhk->bhij", q, k) / math.sqrt(N + S)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = (j <= i)[None].expand(B, T, T)
    if doc_ids_BT is not None:
        allowed = allowed & (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    o = torch.einsum("bhij,bjhv->bihv", p, v)
    gate = torch.sigmoid(x @ W["w_g.weight"].T).view(B, T, H, V)
    return (gate * o).reshape(B, T, H * V) @ W["w_o.weight"].T


@pytest.mark.parametrize("B,T", [(1, 1), (2, 7), (3, 33)])
@pytest.mark.parametrize("packed", [False, True])
def test_matches_float64_reference(B, T, packed):
    args = small_args()
    m = make_mla(args, seed=B * 100 + T)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, args.dim, generator=gen)
    doc_ids = random_doc_ids(B, T, gen) if packed else None
    y = m(x, doc_ids_BT=doc_ids)
    assert y.shape == (B, T, args.dim) and y.dtype == torch.float32
    assert rel_err(y, reference_mla(m, x, doc_ids)) < FP32_TOL


def test_gradients_match_float64_reference():
    args = small_args()
    m = make_mla(args, seed=3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 19, args.dim, generator=gen)
    doc_ids = random_doc_ids(2, 19, gen)
    g = torch.randn(2, 19, args.dim, generator=gen)

    (m(x, doc_ids_BT=doc_ids) * g).sum().backward()
    m64 = make_mla(args, seed=3).double()
    (reference_mla(m64, x.double(), doc_ids) * g.double()).sum().backward()
    # Reference weights are float64 leaves of a second module built from the same seed.
    for (name, p), (_, p64) in zip(m.named_parameters(), m64.named_parameters()):
        assert rel_err(p.grad, p64.grad) < 1e-4, name  # backward chains twice as many ops


def test_packed_documents_equal_separate_documents():
    args = small_args()
    m = make_mla(args, seed=1)
    lengths = [5, 9, 1, 4]
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randn(1, n, args.dim, generator=gen) for n in lengths]
    doc_ids = torch.cat([torch.full((1, n), i, dtype=torch.int32) for i, n in enumerate(lengths)], dim=1)
    y_packed = m(torch.cat(docs, dim=1), doc_ids_BT=doc_ids)
    y_alone = torch.cat([m(d) for d in docs], dim=1)
    assert rel_err(y_packed, y_alone) < FP32_TOL
    # The mask matters: without doc ids later documents see earlier ones.
    assert rel_err(m(torch.cat(docs, dim=1)), y_alone) > 1e-2


def test_no_positional_encoding():
    """NoPE: a query's output depends on the set of keys it sees, not on their positions.

    Permuting the tokens before the last one leaves the last token's output unchanged (with
    RoPE, or any position signal, it would change); the token itself also gives the same
    output whatever its absolute position inside a packed row.
    """
    args = small_args()
    m = make_mla(args, seed=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 12, args.dim, generator=gen)
    perm = torch.cat([torch.randperm(11, generator=gen), torch.tensor([11])])
    y = m(x)
    y_perm = m(x[:, perm])
    assert rel_err(y_perm[:, -1], y[:, -1]) < FP32_TOL
    assert rel_err(y_perm[:, :-1], y[:, :-1]) > 1e-2  # earlier queries see different prefixes

    # The same document placed at offset 0 and at offset 7 of a packed row.
    doc = torch.randn(1, 6, args.dim, generator=gen)
    filler = torch.randn(1, 7, args.dim, generator=gen)
    ids = torch.tensor([[0] * 7 + [1] * 6], dtype=torch.int32)
    y_shifted = m(torch.cat([filler, doc], dim=1), doc_ids_BT=ids)[:, 7:]
    assert rel_err(y_shifted, m(doc)) < FP32_TOL


@pytest.mark.parametrize("prefill", [0, 1, 6])
def test_absorbed_decode_matches_full_attention(prefill):
    """Prefill, then decode token by token and one 3-token chunk on the absorbed path;
    every step equals the non-absorbed full forward at those positions."""
    args = small_args()
    m = make_mla(args, seed=4)
    gen = torch.Generator().manual_seed(4)
    B, T = 2, 14
    x = torch.randn(B, T, args.dim, generator=gen)
    y_full = m(x)

    expanded_calls = []
    hook = m.w_ukv.register_forward_hook(lambda *_: expanded_calls.append("expanded"))
    cache = MLACache.empty(args, B, max_len=16)
    outs = []
    if prefill:
        outs.append(m(x[:, :prefill], cache=cache))
    n_expanded_after_prefill = len(expanded_calls)
    t = prefill
    while t < T:
        step = 3 if t == 8 else 1
        outs.append(m(x[:, t : t + step], cache=cache))
        t += step
    hook.remove()

    assert cache.length == T
    # Decode never expands keys/values through the W_ukv module: W_uk/W_uv are absorbed.
    assert len(expanded_calls) == n_expanded_after_prefill == (1 if prefill > 1 else 0)
    assert rel_err(torch.cat(outs, dim=1), y_full) < FP32_TOL
    assert rel_err(outs[-1], y_full[:, -outs[-1].shape[1] :]) < FP32_TOL


def test_cache_holds_normalised_latent_and_shared_key_only():
    args = small_args()
    m = make_mla(args, seed=5)
    B, P = 2, 5
    cache = MLACache.empty(args, B, max_len=8)
    tensors = {k: v for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {"c_kv", "k_shared"}
    per_token = sum(t.shape[-1] for t in tensors.values())
    assert per_token == args.mla_kv_lora_rank + args.mla_qk_shared_dim
    assert all(t.shape[:2] == (B, 8) for t in tensors.values())

    x = torch.randn(B, P, args.dim)
    m(x, cache=cache)
    assert cache.length == P
    lat = x.double() @ m.w_dkv.weight.detach().double().T
    R = args.mla_kv_lora_rank
    c = lat[..., :R]
    c_ref = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + args.norm_eps) * m.kv_norm.weight.detach().double()
    assert rel_err(cache.c_kv[:, :P], c_ref) < FP32_TOL
    assert rel_err(cache.k_shared[:, :P], lat[..., R:]) < FP32_TOL
    assert cache.c_kv[:, P:].abs().max() == 0


def test_user_errors():
    args = small_args()
    m = make_mla(args)
    cache = MLACache.empty(args, 1, max_len=4)
    with pytest.raises(ValueError, match="overflow"):
        m(torch.randn(1, 5, args.dim), cache=cache)
    with pytest.raises(ValueError, match="doc_ids"):
        m(torch.randn(1, 2, args.dim), doc_ids_BT=torch.zeros(1, 2, dtype=torch.int32), cache=cache)


def test_compile_fullgraph_no_graph_breaks():
    args = small_args()
    m = make_mla(args, seed=6)
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounter()
    compiled = torch.compile(m, backend=cnt, fullgraph=True)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 9, args.dim, generator=gen, requires_grad=True)
    for doc_ids in (None, random_doc_ids(2, 9, gen), random_doc_ids(2, 9, gen)):
        y = compiled(x, doc_ids_BT=doc_ids)
        assert rel_err(y, m(x, doc_ids_BT=doc_ids)) < FP32_TOL
        y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert cnt.frame_count == 2  # one graph without and one with doc ids; new doc ids reuse it
    assert not counters["graph_break"]


def test_bf16_close_to_float64_reference():
    """bf16 params and input: unit roundoff 2^-9 = 2e-3 and ~10 chained roundings bound the
    error by ~2e-2; the fp32 gate product keeps it there."""
    args = small_args()
    m = make_mla(args, seed=7).to(torch.bfloat16)
    x = torch.randn(2, 11, args.dim).to(torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, reference_mla(m, x)) < 2e-2


def test_init_weights_after_meta_to_empty():
    args = small_args()
    with torch.device("meta"):
        m = GatedMLA(args)
    m.to_empty(device="cpu")
    m.init_weights(init_std=0.02)
    for name, p in m.named_parameters():
        assert torch.isfinite(p).all(), name
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert 0.015 < p.std().item() < 0.025 and p.abs().max() <= 0.06 + 1e-7, name
    assert torch.isfinite(m(torch.randn(1, 4, args.dim))).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_sdpa_with_document_mask_and_decode():
    """The CUDA SDPA backends with K3 head dims (qk 128 + 64, v 128), a boolean document mask
    and bf16; and absorbed decode on the GPU. Tolerance as in the CPU bf16 test."""
    args = small_args(
        dim=256, mla_n_heads=2, mla_q_lora_rank=96, mla_kv_lora_rank=64,
        mla_qk_nope_head_dim=128, mla_qk_shared_dim=64, mla_v_head_dim=128,
    )
    m = make_mla(args, seed=8).cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 200, args.dim, generator=gen).to("cuda", torch.bfloat16)
    doc_ids = random_doc_ids(2, 200, gen).cuda()
    y = m(x, doc_ids_BT=doc_ids)
    assert rel_err(y.cpu(), reference_mla(m.cpu().float(), x.cpu().float(), doc_ids.cpu())) < 2e-2
    m = m.cuda().to(torch.bfloat16)
    cache = MLACache.empty(args, 2, 64, device="cuda", dtype=torch.bfloat16)
    outs = [m(x[:, :40], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(40, 48)]
    assert rel_err(torch.cat(outs, dim=1).cpu(), reference_mla(m.cpu().float(), x[:, :48].cpu().float())) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_document_attention_matches_the_dense_mask_cuda(compiled):
    """mla_attention = "varlen" (eager, and inside a compiled layer) equals "dense"
    (SDPA with the [B, 1, T, T] mask), outputs and gradients, bf16, K3's head dims (qk 128 +
    64, v 128); both in bf16, so the bound is bf16's, as in the CPU bf16 test."""
    kw = dict(dim=256, mla_n_heads=2, mla_q_lora_rank=96, mla_kv_lora_rank=64,
              mla_qk_nope_head_dim=128, mla_qk_shared_dim=64, mla_v_head_dim=128)
    m_varlen = make_mla(small_args(mla_attention="varlen", **kw), seed=9).cuda().to(torch.bfloat16)
    m_dense = make_mla(small_args(mla_attention="dense", **kw), seed=9).cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 300, kw["dim"], generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    doc_ids = random_doc_ids(2, 300, gen).cuda()
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(m_varlen, backend="inductor", fullgraph=True) if compiled else m_varlen
    y_c = run(x, doc_ids_BT=doc_ids)
    (g_c,) = torch.autograd.grad(y_c.float().square().sum(), x)
    y_d = m_dense(x, doc_ids_BT=doc_ids)
    (g_d,) = torch.autograd.grad(y_d.float().square().sum(), x)
    assert not counters["graph_break"]
    assert rel_err(y_c, y_d) < 2e-2 and rel_err(g_c, g_d) < 4e-2


@pytest.mark.parametrize("path", ["chunked", "dense"])
def test_attention_paths_agree_on_cpu(path):
    """Every CPU path against the float64 reference, outputs and gradients (auto = chunked)."""
    args = small_args(mla_attention=path)
    m = make_mla(args, seed=10)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(2, 37, args.dim, generator=gen)
    doc_ids = random_doc_ids(2, 37, gen)
    assert rel_err(m(x, doc_ids_BT=doc_ids), reference_mla(m, x, doc_ids)) < FP32_TOL


def test_attention_choice_is_validated_and_resolved():
    from titan_moe.model.mla import resolve_attention

    with pytest.raises(ValueError, match="mla_attention"):
        small_args(mla_attention="ring")
    assert resolve_attention("auto", torch.device("cpu")) == "chunked"
    assert resolve_attention("auto", torch.device("cuda")) == "varlen"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_attention("varlen", torch.device("cpu"))
    # FlashAttention-2 takes bf16/fp16 only: an fp32 run on CUDA is told to pick the chunked path
    assert resolve_attention("auto", torch.device("cuda"), "bfloat16") == "varlen"
    assert resolve_attention("chunked", torch.device("cuda"), "float32") == "chunked"
    assert resolve_attention("auto", torch.device("cpu"), "float32") == "chunked"
    for choice in ("auto", "varlen"):
        with pytest.raises(ValueError, match="set model.mla_attention = 'chunked'"):
            resolve_attention(choice, torch.device("cuda"), "float32")
