"""Context parallelism (SPEC §8), MLA side: each rank of a `cp` group holds one contiguous
slice of every packed row (rank r: tokens [r * L, (r + 1) * L) of T = cp * L).

MLA across ranks attends in latent space, the form decode uses: every rank all-gathers the
normalised latent ``c_kv`` [B, L, R] and the shared key ``k_s`` [B, L, S] (R + S values a
token: 576 at K3 width), never per-head keys and values, and scores its own queries
against the latents of the tokens before and within its slice:

    q_lat = W_uk^T q_n                            [B, L, H, R]   (per head, absorbed)
    o_lat = softmax(([q_lat, q_s] . [c, k_s]) * scale + document mask) c    [B, L, H, R]
    o     = W_uv o_lat                            [B, L, H, V]

``q_lat . c = q_n . (W_uk c) = q_n . k_n``, so this is the layer's attention exactly, at
(2 (R + S) + 2 R) / (2 (qk + v)) times its score FLOPs (3.4x at K3's dims) and with no
full-sequence per-head tensor on any rank. The keys and values are shared by the heads, so
`titan_moe.ops.attention.doc_attention_chunked` runs it with one key head; the all-gather is
differentiable (its backward reduce-scatters the latents' gradients to their ranks).

Documents: `context_parallel_starts` gives each token the global position where its document
begins, also when the document began on an earlier rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from titan_moe.model.mla import GatedMLA
from titan_moe.ops.attention import doc_attention_chunked, doc_starts


def gather_sequence(x_BL: Tensor, group) -> Tensor:
    """The ranks' slices [B, L, ...] concatenated along dim 1 -> [B, cp * L, ...];
    differentiable (the gradient of each slice returns to its rank, summed over ranks)."""
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x_BL.contiguous(), group=group), dim=1)


def context_parallel_starts(doc_ids_BL: Tensor, group) -> Tensor:
    """int32 [B, L]: for each token of this rank's slice, the global position where its
    document begins. `doc_ids_BL` is the rank's slice of the row's document ids (numbered
    along the whole row, so a document continuing from the previous rank keeps its id)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, L = doc_ids_BL.shape
    local_BL = doc_starts(doc_ids_BL) + rank * L
    # per rank and row: first id, last id, start of the last document (global)
    edge_B3 = torch.stack([doc_ids_BL[:, 0].long(), doc_ids_BL[:, -1].long(), local_BL[:, -1].long()], dim=1)
    edges = [torch.empty_like(edge_B3) for _ in range(world)]
    dist.all_gather(edges, edge_B3, group=group)
    inherited_B = torch.full((B,), rank * L, dtype=torch.long, device=doc_ids_BL.device)
    for b in range(B):
        r = rank
        while r > 0 and edges[r][b, 0] == edges[r - 1][b, 1]:  # the first document began earlier
            inherited_B[b] = edges[r - 1][b, 2]
            if edges[r - 1][b, 2] != (r - 1) * L:  # it began inside rank r - 1
                break
            r -= 1
    continues_BL = local_BL == rank * L
    return torch.where(continues_BL, inherited_B[:, None].to(local_BL.dtype), local_BL).to(torch.int32)


def mla_latent_attention(
    attn: GatedMLA, q_BLHK: Tensor, c_kv_BTR: Tensor, k_s_BTS: Tensor, starts_BL: Tensor, q_offset: int
) -> Tensor:
    """fp32 o [B, L, H, v_head] of `attn`'s attention for queries at positions q_offset.. over
    the latents of positions 0..T-1 (module docstring); exact up to the accumulation dtype."""
    H, N, V, R = attn.n_heads, attn.qk_nope_dim, attn.v_head_dim, attn.kv_lora_rank
    w_HNR = attn.w_ukv.weight.view(H, N + V, R)
    w_uk_HNR, w_uv_HVR = w_HNR.split([N, V], dim=1)
    q_n_BLHN, q_s_BLHS = q_BLHK.split([N, attn.qk_shared_dim], dim=-1)
    q_lat_BLHR = torch.einsum("blhn,hnr->blhr", q_n_BLHN, w_uk_HNR.to(q_BLHK.dtype))
    q_BHLK = torch.cat([q_lat_BLHR, q_s_BLHS], dim=-1).transpose(1, 2)
    k_B1TK = torch.cat([c_kv_BTR, k_s_BTS], dim=-1)[:, None]
    o_lat_BHLR = doc_attention_chunked(q_BHLK, k_B1TK, c_kv_BTR[:, None], starts_BL, attn.scale, q_offset=q_offset)
    return torch.einsum("bhlr,hvr->blhv", o_lat_BHLR.float(), w_uv_HVR.float())


def mla_context_parallel(attn: GatedMLA, x_BLD: Tensor, starts_BL: Tensor, group) -> Tensor:
    """y [B, L, D] of the MLA layer `attn` for this rank's slice `x_BLD` of the packed rows
    (`starts_BL` from `context_parallel_starts`); equal to the unsharded layer's output on
    the same tokens."""
    rank = dist.get_rank(group)
    L = x_BLD.shape[1]
    q_BLHK = attn._queries(x_BLD)
    c_kv_BLR, k_s_BLS = attn._latents(x_BLD)
    end = (rank + 1) * L
    c_kv_BTR = gather_sequence(c_kv_BLR, group)[:, :end]
    k_s_BTS = gather_sequence(k_s_BLS, group)[:, :end]
    o_BLHV = mla_latent_attention(attn, q_BLHK, c_kv_BTR, k_s_BTS, starts_BL, q_offset=rank * L)
    return attn._gate_and_project(x_BLD, o_BLHV)
