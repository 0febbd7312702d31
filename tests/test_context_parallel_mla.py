"""MLA across context-parallel ranks (titan_moe.context_parallel) against the unsharded layer.

Several CPU processes share a gloo group; each holds a contiguous slice of the packed rows.
Every rank's output slice and input gradient, and the parameter gradients summed over the
ranks (as data parallelism reduces them), must equal the one-process layer's. Inputs and
weights are float64, but the layer forms its attention output in fp32 (`GatedMLA._attend`
upcasts to fp32, which rounds float64), so the latent (absorbed) and the expanded form agree
to fp32 rounding, ~1e-7 relative; 1e-6 leaves room and still catches a wrong mask, offset or
a missing gradient (O(1e-1) errors).
"""

from __future__ import annotations

import math

import pytest
import torch
from gloo_ranks import spawn_gloo
from numerics import rel_err

from titan_moe.model.args import ModelArgs
from titan_moe.model.mla import GatedMLA

TOL = 1e-6
T = 96


def make_mla(seed: int = 0) -> GatedMLA:
    args = ModelArgs(dim=32, mla_n_heads=3, mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
                     mla_qk_shared_dim=4, mla_v_head_dim=6, mla_attention="chunked")
    torch.manual_seed(seed)
    m = GatedMLA(args).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 1.5 / math.sqrt(p.shape[-1])) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return m


ROWS = {  # document lengths per row (sum T)
    "crossing": [[10, 40, 1, 45], [96]],  # documents crossing slice bounds, longer than a slice
    "aligned": [[48, 24, 24], [1, 47, 48]],  # documents starting exactly at a slice's first token
}


def inputs(mix: str):
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(row)])
                       for row in ROWS[mix]])
    x = torch.randn(2, T, 32, generator=gen, dtype=torch.float64)
    g = torch.randn(2, T, 32, generator=gen, dtype=torch.float64)
    return ids, x, g


def reference(mix: str):
    m = make_mla()
    ids, x, g = inputs(mix)
    x = x.requires_grad_()
    y = m(x, doc_ids_BT=ids)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def _rank(rank: int, world: int, mix: str, want) -> None:
    import torch.distributed as dist

    from titan_moe.context_parallel import mla_context_parallel, row_segments
    from titan_moe.ops.attention import doc_starts

    y_ref, dx_ref, grads_ref = want
    ids, x, g = inputs(mix)
    L = T // world
    piece = slice(rank * L, (rank + 1) * L)
    starts = row_segments(ids[:, piece], ids[:, piece], dist.group.WORLD, conv_size=1).starts_BL
    assert torch.equal(starts, doc_starts(ids)[:, piece])
    m = make_mla()
    x_local = x[:, piece].clone().requires_grad_()
    y = mla_context_parallel(m, x_local, starts, group=dist.group.WORLD)
    (y * g[:, piece]).sum().backward()
    assert rel_err(y, y_ref[:, piece]) < TOL
    assert rel_err(x_local.grad, dx_ref[:, piece]) < TOL
    for name, p in m.named_parameters():
        dist.all_reduce(p.grad)
        assert rel_err(p.grad, grads_ref[name]) < TOL, name


@pytest.mark.parametrize("world,mix", [(2, "aligned"), (4, "crossing")])
def test_mla_context_parallel_matches_the_unsharded_layer(world, mix, tmp_path):
    spawn_gloo(_rank, world, tmp_path, mix, reference(mix))


def test_latent_attention_equals_the_layer_in_one_process():
    """The latent form over the whole row (one rank, offset 0) equals the layer's own path."""
    from titan_moe.context_parallel import mla_latent_attention
    from titan_moe.ops.attention import doc_starts

    m = make_mla(3)
    ids, x, _ = inputs("crossing")
    want = m._attend(m._queries(x), *m._latents(x), "chunked", doc_starts(ids))
    got = mla_latent_attention(m, m._queries(x), *m._latents(x), doc_starts(ids), q_offset=0)
    assert rel_err(got, want) < TOL
