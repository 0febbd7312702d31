"""Context parallelism (SPEC §8): each rank of a `cp` group holds one contiguous segment of
every packed row (rank r: tokens [r * L, (r + 1) * L) of T = cp * L), and the layers that
mix tokens across the row reach the other segments through collectives. Installed from
outside the model by :func:`apply_context_parallel` (`titan_moe.parallelize`), as expert
parallelism is: the model stays single-device.

What crosses the ranks, per layer kind:

* KDA (`ContextParallelKDA`): the state scan across ranks,
  `titan_moe.ops.kda.context_parallel.kda_context_parallel` (each rank's transition and
  zero-start state all-gathered, documents cutting the chain), and the short convolution's
  halo (`conv_halo`: the previous segment's last `kda_conv_size - 1` projected inputs).
* MLA (`ContextParallelMLA`): the latent all-gather, below.
* Everything else (AttnRes, norms, MoE routing and experts, the head) is per token and runs
  on the rank's L tokens as it would on the whole row. The trainer normalises the loss by
  the global token count (counted on the whole rows, before slicing) and the expert-balance
  statistics are summed over every rank that routes distinct tokens (dp x cp, `train_spec`).

Documents: :func:`row_segments` all-gathers the rows' document ids once per forward (4
bytes a token, outside the layers) and derives, from the whole rows, every document fact a
rank needs: the KDA `SegmentLayout` and local `cu_seqlens` of each row, the global position
where each local token's document begins (MLA), and the document ids of the halo tokens
(short convolution). One source for both layer kinds, so they cannot disagree.

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

Load balance: contiguous segments keep KDA's chain one scan, but leave causal MLA work
growing with the rank. With `balance="headtail"` (`parallelism.context_parallel_load_balancer`,
torchtitan's default) MLA's queries are reassigned: each rank computes its own first
half-segment and its mirror rank's second one (`mla_context_parallel_headtail`), equal
work for a document filling the row; KDA's segments stay contiguous. docs/parallelism.md
measures both.

Fake backend (`--comm.mode fake_backend`, torch's fake process group: one process plays
one rank of a larger layout and no collective moves data): the document ids are not
all-gathered; the other segments are taken to hold this segment's ids, repeated along the
row. The ids decide host-side layouts and index tensors, and the fake group promises
nothing about its outputs (torch 2.13's all-gather happens to return that repetition; some
versions leave outputs uninitialised). Resolved once, from the group's backend, in
:func:`apply_context_parallel`. The layers' other collectives carry values only (states,
halos, latents, layer inputs and outputs), which the fake group leaves meaningless; shapes
and memory are the rank's own.

Where the collectives sit: in the context-parallel layers' forward, which runs eagerly also
under `compile.enable`: KDA's halo all-gather (after its input projections) and state
all-gather (in `kda_context_parallel`), MLA's latent all-gather (after its projections) and,
under "headtail", its two all-to-alls (the mirrored layer inputs before the queries, the
outputs after the gate and output projection); and in the root module's forward pre-hook
(the document ids). Their backward runs the reverse collectives (reduce-scatters,
all-to-alls) in the same order on every rank.

Compile (`titan_moe.parallelize.apply_compile`): a fullgraph region holding these layers
would see the batch's `RowSegments` (KDA's `SegmentLayout` per row: where the documents fall,
which pieces continue a document) as Python constants, guard on them and recompile at every
new layout. So under CP each layer is compiled piecewise: the AttnRes mixers, the norms and
the FFN or MoE are regions, and of the attention only the methods named in its
`compile_regions`, which see neither a collective nor a layout: KDA's `input_projections`
(q|k|v, gate and beta projections), `halo_conv` (short convolution over halo and segment,
masked by the ids as a tensor) and `output_projection`; MLA's `_queries`, `_latents` and
`_gate_and_project`. The layout reads, the collectives, KDA's cross-rank `chunk_kda` calls and
state scan and MLA's latent attention (`doc_attention_chunked`) run eagerly between them.
A layer, in order, [compiled regions] in brackets:

    [attention_mix] [attention_norm]
    KDA: [input_projections] halo all-gather [halo_conv]
         per row: chunk_kda (and the basis call), state all-gather, scan   [output_projection]
    MLA: [_latents] latent all-gather (headtail: all-to-all of the mirrored half's input)
         per query block: [_queries] latent attention [_gate_and_project]
         (headtail: all-to-all of the outputs back)
    [ffn_mix] [ffn_norm] [feed_forward]
        (under EP: [route_and_sort] all-to-all, routed experts, all-to-all [combine])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from titan_moe.config import ConfigError
from titan_moe.model.head import IGNORE_INDEX
from titan_moe.model.kda import KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.short_conv import short_conv_silu
from titan_moe.ops.attention import doc_attention_chunked, doc_starts
from titan_moe.ops.attention.reference import doc_start_mask
from titan_moe.ops.kda.chunk_torch import CHUNK as KDA_CHUNK
from titan_moe.ops.kda.context_parallel import (
    SegmentLayout,
    all_gather_ranks,
    conv_halo,
    kda_context_parallel,
    local_cu_seqlens,
    segment_layout,
)
from titan_moe.ops.nvtx import nvtx_range


# ----------------------------------------------------------------------------------------
# the batch: segments and their documents
# ----------------------------------------------------------------------------------------
BALANCES = (None, "headtail")  # `parallelism.context_parallel_load_balancer` values we run


def check_context_parallel(job_config) -> None:
    """A `ConfigError` (one line naming the keys) for a layout or option that context
    parallelism does not run with; nothing when `parallelism.context_parallel_degree` is 1."""
    cp = job_config.parallelism.context_parallel_degree
    if cp <= 1:
        return
    key = f"parallelism.context_parallel_degree = {cp}"
    balance = job_config.parallelism.context_parallel_load_balancer
    if balance not in BALANCES:
        raise ConfigError(f"parallelism.context_parallel_load_balancer = {balance!r} is not supported with {key} "
                          "(use 'headtail' or none)")
    lengths = {"training.seq_len": job_config.training.seq_len}
    ladder = getattr(job_config, "ladder", None)
    for i, stage in enumerate(ladder.stages if ladder is not None else []):
        lengths[f"ladder.stages.{i + 1}.seq_len"] = stage.seq_len
    if job_config.validation.enable:
        lengths["validation.seq_len"] = job_config.validation.seq_len
    for name, seq_len in lengths.items():
        if seq_len % cp:
            raise ConfigError(f"{name} = {seq_len} is not divisible by {key}")
        if balance == "headtail" and seq_len % (2 * cp):
            raise ConfigError(
                f"{name} = {seq_len} is not divisible by 2 x {key} (the 'headtail' "
                "parallelism.context_parallel_load_balancer halves each segment; or set it to none)"
            )
        if seq_len // cp < KDA_CHUNK:
            raise ConfigError(
                f"{name} = {seq_len} over {key} leaves segments of {seq_len // cp} tokens, shorter than "
                f"a KDA chunk ({KDA_CHUNK}): raise {name} or lower the degree"
            )
    if getattr(job_config.model, "kda_gate", None) == "unbounded":
        raise ConfigError(f"model.kda_gate = 'unbounded' is not supported with {key} (the context-parallel "
                          "KDA computes the bounded gate)")


def segment_of(x_BT: Tensor, rank: int, cp: int) -> Tensor:
    """Rank `rank`'s contiguous segment of `x_BT [B, T, ...]` along dim 1: [B, T / cp, ...]."""
    T = x_BT.shape[1]
    if T % cp:
        raise ValueError(f"a row of {T} tokens does not split into {cp} equal segments")
    L = T // cp
    return x_BT[:, rank * L : (rank + 1) * L].contiguous()


def shard_batch(input_dict, labels_BT: Tensor, group) -> tuple[dict[str, Tensor], Tensor]:
    """This rank's segment of every row of a batch: of each [B, T] entry of `input_dict`
    ("input", "doc_ids") and of the labels. Every rank of `group` holds the same rows."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    sliced = {key: segment_of(value, rank, cp) for key, value in input_dict.items()}
    return sliced, segment_of(labels_BT, rank, cp)


def whole_row_length(T: int, cp: int) -> int:
    """The length a row of T tokens is padded to before it is split over `cp` ranks: a
    multiple of 2 cp (so either balance halves each segment) with segments of at least one
    KDA chunk, as `check_context_parallel` asks of training rows."""
    step = 2 * cp
    return max(-(-T // step) * step, cp * KDA_CHUNK)


def context_parallel_scores_fn(model: nn.Module, device: torch.device | str, group):
    """The evaluations' scores (`titan_moe.evaluate.ScoresFn`: each token's argmax and
    cross-entropy) of whole rows from a model made context-parallel (`apply_context_parallel`):
    `(tokens_BT, doc_ids_BT, targets_BT) -> (pred_BT, loss_BT)` on the CPU, on every rank of
    `group`, the same as the one-device model's.

    Every rank passes the same rows, together (collectives). A row is padded at its end to
    `whole_row_length` (the padding is a document of its own with ignored targets, and causal
    attention never reads later tokens, so it changes nothing of the row), each rank scores
    its segment (its head a chunk of logits at a time) and the segments' scores, 12 bytes a
    token, are all-gathered along T and cut back to T."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)

    def scores(tokens_BT: Tensor, doc_ids_BT: Tensor, targets_BT: Tensor) -> tuple[Tensor, Tensor]:
        B, T = tokens_BT.shape
        pad = whole_row_length(T, cp) - T
        tokens_BT, doc_ids_BT, targets_BT = (t.to(device) for t in (tokens_BT, doc_ids_BT, targets_BT))
        if pad:
            tokens_BT = F.pad(tokens_BT, (0, pad))
            doc_ids_BT = torch.cat([doc_ids_BT, (doc_ids_BT[:, -1:] + 1).expand(B, pad)], dim=1)
            targets_BT = F.pad(targets_BT, (0, pad), value=IGNORE_INDEX)
        pred_BL, loss_BL = model(segment_of(tokens_BT, rank, cp), segment_of(doc_ids_BT, rank, cp),
                                 labels=segment_of(targets_BT, rank, cp), token_scores=True)
        out = []
        for local in (pred_BL.contiguous(), loss_BL.float().contiguous()):
            parts = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(parts, local, group=group)
            out.append(torch.cat(parts, dim=1)[:, :T].cpu())
        return out[0], out[1]

    return scores


@dataclass
class RowSegments:
    """The document facts of this rank's segments of one batch (B rows, L tokens a segment).

    kda: per row, its `SegmentLayout` and local `cu_seqlens` for `kda_context_parallel`;
        one entry for all rows when the rows are not packed (each row one sequence).
    starts_BT: int32 [B, cp * L], for every token of the whole rows, the position where its
        document begins (MLA's document mask; zeros when not packed); `starts_BL` is this
        rank's segment of it.
    conv_ids_BX: int32 [B, conv_size - 1 + L], the document ids of the halo and the local
        tokens (-1 before the row's start); None when not packed.
    """

    group: dist.ProcessGroup
    rank: int
    cp: int
    kda: tuple[tuple[SegmentLayout, Tensor | None], ...]
    starts_BT: Tensor
    conv_ids_BX: Tensor | None

    @property
    def packed(self) -> bool:
        return self.conv_ids_BX is not None

    @property
    def starts_BL(self) -> Tensor:
        return segment_of(self.starts_BT, self.rank, self.cp)


def row_segments(tokens_BL: Tensor, doc_ids_BL: Tensor | None, group, conv_size: int,
                 fake_backend: bool = False) -> RowSegments:
    """This rank's `RowSegments` from its segment of the document ids (numbered along the
    whole row, as the loader numbers them). All ranks of `group` call it together (an
    all-gather of the ids); it reads the document starts on the host once: call it once
    per forward, outside compiled code. `fake_backend`: `group` runs no collective (module
    docstring): every segment is taken to hold this segment's ids."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    B, L = tokens_BL.shape
    if L < conv_size - 1:
        raise ValueError(f"a segment of {L} tokens is shorter than the short convolution's halo ({conv_size - 1})")
    if doc_ids_BL is None:
        layout = segment_layout([0, cp * L], rank, cp, L, varlen=False)
        starts_BT = torch.zeros(B, cp * L, dtype=torch.int32, device=tokens_BL.device)
        return RowSegments(group, rank, cp, ((layout, None),), starts_BT, None)
    if fake_backend:
        ids_BT = doc_ids_BL.repeat(1, cp)
    else:
        parts = [torch.empty_like(doc_ids_BL) for _ in range(cp)]
        dist.all_gather(parts, doc_ids_BL.contiguous(), group=group)
        ids_BT = torch.cat(parts, dim=1)
    rows, cols = (t.tolist() for t in doc_start_mask(ids_BT).nonzero(as_tuple=True))  # one host read
    bounds: list[list[int]] = [[] for _ in range(B)]
    for b, t in zip(rows, cols):
        bounds[b].append(t)
    kda = []
    for row in bounds:
        layout = segment_layout(row + [cp * L], rank, cp, L)
        kda.append((layout, local_cu_seqlens(layout.local_bounds, tokens_BL.device)))
    lo, hi = rank * L, (rank + 1) * L
    width = conv_size - 1
    conv_ids_BX = F.pad(ids_BT, (width, 0), value=-1)[:, lo : hi + width].contiguous()
    return RowSegments(group, rank, cp, tuple(kda), doc_starts(ids_BT), conv_ids_BX)


# ----------------------------------------------------------------------------------------
# MLA across ranks
# ----------------------------------------------------------------------------------------
def gather_sequence(x_BL: Tensor, group) -> Tensor:
    """The ranks' slices [B, L, ...] concatenated along dim 1 -> [B, cp * L, ...];
    differentiable (the backward reduce-scatters: each slice's gradient, summed over the
    ranks, returns to its rank). A functional collective, which `torch.compile` traces."""
    parts = all_gather_ranks(x_BL, group, dist.get_world_size(group))  # [cp, B, L, ...]
    return parts.movedim(0, 1).flatten(1, 2)


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
    (`starts_BL`: `RowSegments.starts_BL`); equal to the unsharded layer's output on the
    same tokens. One all-gather of [c_kv | k_s], R + S values a token."""
    rank = dist.get_rank(group)
    L = x_BLD.shape[1]
    q_BLHK = attn._queries(x_BLD)
    c_kv_BLR, k_s_BLS = attn._latents(x_BLD)
    end = (rank + 1) * L
    latents_BTX = gather_sequence(torch.cat([c_kv_BLR, k_s_BLS], dim=-1), group)[:, :end]
    c_kv_BTR, k_s_BTS = latents_BTX.split([attn.kv_lora_rank, attn.qk_shared_dim], dim=-1)
    o_BLHV = mla_latent_attention(attn, q_BLHK, c_kv_BTR, k_s_BTS, starts_BL, q_offset=rank * L)
    return attn._gate_and_project(x_BLD, o_BLHV)


def headtail_blocks(rank: int, cp: int) -> tuple[int, int]:
    """The half-segments (blocks of L / 2 tokens, 0 .. 2 cp - 1 along the row) whose MLA
    queries rank `rank` computes under the "headtail" balance: its own first half (block
    2 r) and the second half of its mirror rank cp - 1 - r (block 2 cp - 1 - 2 r). A block
    j of one long document costs j + 1/2 (in units of its first block's), so every rank's
    pair costs 2 cp; only second halves move, each between a rank and its mirror."""
    return 2 * rank, 2 * cp - 1 - 2 * rank


def _headtail_computer(j: int, cp: int) -> int:
    """The rank that computes half-segment j (the inverse of `headtail_blocks`)."""
    return j // 2 if j % 2 == 0 else cp - 1 - j // 2


def _all_to_all(x_NBD: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x_NBD.contiguous(), out_splits, in_splits, group))


def mla_context_parallel_headtail(attn: GatedMLA, x_BLD: Tensor, starts_BT: Tensor, group) -> Tensor:
    """`mla_context_parallel` with the causal work balanced over the ranks: rank r computes
    the layer for its first half-segment and its mirror rank's second one
    (`headtail_blocks`), whose attention work sums to the same on every rank for a document
    filling the row. The second half's layer input goes to the mirror rank and the layer's
    output comes back (all-to-alls of D values a token for L / 2 tokens, autograd through
    both; a rank's own first half passes as a local copy); the latents are all-gathered as
    in `mla_context_parallel`. Equal to the unsharded layer's output on
    the rank's own tokens. `starts_BT`: `RowSegments.starts_BT`; L must be even."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    B, L, D = x_BLD.shape
    h = L // 2
    c_kv_BLR, k_s_BLS = attn._latents(x_BLD)
    latents_BTX = gather_sequence(torch.cat([c_kv_BLR, k_s_BLS], dim=-1), group)
    c_kv_BTR, k_s_BTS = latents_BTX.split([attn.kv_lora_rank, attn.qk_shared_dim], dim=-1)

    own = (2 * rank, 2 * rank + 1)  # this rank's blocks, sent in the order of their computers
    sent = sorted(own, key=lambda j: (_headtail_computer(j, cp), j))
    todo = sorted(headtail_blocks(rank, cp), key=lambda j: (j // 2, j))  # received by source rank
    send_splits = [h * sum(_headtail_computer(j, cp) == d for j in sent) for d in range(cp)]
    recv_splits = [h * sum(j // 2 == s for j in todo) for s in range(cp)]
    x_own = dict(zip(own, x_BLD.split(h, dim=1)))
    x_NBD = torch.cat([x_own[j] for j in sent], dim=1).transpose(0, 1)
    x_todo_BND = _all_to_all(x_NBD, recv_splits, send_splits, group).transpose(0, 1)
    y_todo = []
    for i, j in enumerate(todo):
        x_BhD = x_todo_BND[:, i * h : (i + 1) * h]
        end = (j + 1) * h
        o_BhHV = mla_latent_attention(attn, attn._queries(x_BhD), c_kv_BTR[:, :end], k_s_BTS[:, :end],
                                      starts_BT[:, j * h : end], q_offset=j * h)
        y_todo.append(attn._gate_and_project(x_BhD, o_BhHV))
    y_NBD = _all_to_all(torch.cat(y_todo, dim=1).transpose(0, 1), send_splits, recv_splits, group)
    y_own = dict(zip(sent, y_NBD.transpose(0, 1).split(h, dim=1)))
    return torch.cat([y_own[j] for j in own], dim=1)


# ----------------------------------------------------------------------------------------
# the layers, installed by class swap
# ----------------------------------------------------------------------------------------
class RowsSlot:
    """The current batch's `RowSegments`, shared by the model's context-parallel layers and
    set by the root module's forward pre-hook (read again by an activation-checkpoint
    recompute, which runs before the next batch's forward)."""

    rows: RowSegments | None = None

    def current(self) -> RowSegments:
        if self.rows is None:
            raise RuntimeError("context-parallel layer called outside the model's forward (no batch facts)")
        return self.rows


def _refuse_local_documents(name: str, cache, *local) -> None:
    if cache is not None:
        raise ValueError(f"{name}: decode caches are not supported under context parallelism")
    if any(x is not None for x in local):
        raise ValueError(f"{name}: under context parallelism the documents come from the model's forward pre-hook")


class ContextParallelKDA(KimiDeltaAttention):
    """`KimiDeltaAttention` over this rank's segment of the rows: the short convolution
    reads the previous segment's halo, the state runs across the ranks.

    `compile_regions`: the methods that see neither a collective nor the batch's document
    layout, which `titan_moe.parallelize.apply_compile` compiles one by one; the rest of
    `forward` (the halo and state all-gathers, the per-row layouts) runs eagerly."""

    cp_slot: RowsSlot
    compile_regions = ("input_projections", "halo_conv", "output_projection")

    def halo_conv(self, halo_BWC: Tensor, qkv_BLC: Tensor, conv_ids_BX: Tensor | None) -> tuple[Tensor, ...]:
        """q, k, v `[B, L, H, d]`: the short convolution and SiLU of the segment's q|k|v
        channels `qkv_BLC` read after the previous segment's halo `halo_BWC` (`conv_halo`),
        masked by the extended tokens' document ids (`RowSegments.conv_ids_BX`)."""
        w_CK = torch.cat([self.q_conv_weight, self.k_conv_weight, self.v_conv_weight])
        x_ext = torch.cat([halo_BWC, qkv_BLC], dim=1)
        return self.split_heads(short_conv_silu(x_ext, w_CK, conv_ids_BX)[:, self.conv_size - 1 :])

    def forward(self, x_BTD: Tensor, doc_ids_BT=None, cu_seqlens=None, cache=None) -> Tensor:
        _refuse_local_documents("KDA", cache, doc_ids_BT, cu_seqlens)
        rows = self.cp_slot.current()
        with nvtx_range("kda.inputs"):
            qkv_BTC, z, beta = self.input_projections(x_BTD)
            q, k, v = self.halo_conv(conv_halo(qkv_BTC, self.conv_size, rows.group), qkv_BTC, rows.conv_ids_BX)
        op_args = dict(
            group=rows.group, use_qk_l2norm=True, gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            lower_bound=self.g_min,
        )
        if not rows.packed:
            ((layout, _),) = rows.kda
            o = kda_context_parallel(q, k, v, z, beta, layout, None, **op_args)
        else:  # one packed row at a time: its own layout, one all-gather of states each
            o = torch.cat([
                kda_context_parallel(q[b : b + 1], k[b : b + 1], v[b : b + 1], z[b : b + 1], beta[b : b + 1],
                                     layout, local_cu, **op_args)
                for b, (layout, local_cu) in enumerate(rows.kda)
            ])
        return self.output_projection(o, x_BTD)


class ContextParallelMLA(GatedMLA):
    """`GatedMLA` over this rank's segment of the rows, attending in latent space to the
    all-gathered latents of the row: for its own queries (`mla_context_parallel`) or, with
    `cp_headtail`, for an early and a late half-segment (`mla_context_parallel_headtail`).

    `compile_regions`: as for `ContextParallelKDA`, the projections before the latent
    all-gather and the gate and output projection after the attention."""

    cp_slot: RowsSlot
    cp_headtail: bool
    compile_regions = ("_queries", "_latents", "_gate_and_project")

    def forward(self, x_BTD: Tensor, doc_ids_BT=None, cache=None, doc_mask=None) -> Tensor:
        _refuse_local_documents("MLA", cache, doc_ids_BT, doc_mask)
        rows = self.cp_slot.current()
        if self.cp_headtail:
            return mla_context_parallel_headtail(self, x_BTD, rows.starts_BT, rows.group)
        return mla_context_parallel(self, x_BTD, rows.starts_BL, rows.group)


def apply_context_parallel(model: nn.Module, group, balance: str | None = None) -> None:
    """Make `model` (a `Decoder`, before activation checkpointing, compile and FSDP) run on
    this rank's segments: its KDA and MLA layers become `ContextParallelKDA` and
    `ContextParallelMLA` (class swap; parameters and names unchanged, so checkpoints stay
    layout-independent), and a forward pre-hook turns the `doc_ids` segment the model is
    called with into the batch's `RowSegments`, read by those layers (the decoder itself
    then runs as for unpacked rows: no local `cu_seqlens` or document mask).

    balance: how MLA's queries are assigned to the ranks: None, each rank its own segment's;
    "headtail", an early and a late half-segment per rank (`mla_context_parallel_headtail`).
    KDA's segments stay contiguous either way.

    A `group` of torch's fake backend makes the pre-hook take every segment's document ids
    to be this rank's (`row_segments`, module docstring)."""
    if balance not in BALANCES:
        raise ValueError(f"context-parallel balance must be one of {BALANCES}, got {balance!r}")
    slot = RowsSlot()
    conv_size = model.args.kda_conv_size
    fake_backend = dist.get_backend(group) == "fake"
    for layer in model.layers.values():
        attention = layer.attention
        if isinstance(attention, KimiDeltaAttention):
            attention.__class__ = ContextParallelKDA
        elif isinstance(attention, GatedMLA):
            attention.__class__ = ContextParallelMLA
            attention.cp_headtail = balance == "headtail"
        else:
            raise ValueError(f"context parallelism does not know the mixer {type(attention).__name__}")
        attention.cp_slot = slot

    def set_rows(module, args, kwargs):
        tokens, *rest = args
        doc_ids = rest.pop(0) if rest else kwargs.pop("doc_ids", None)
        if rest or kwargs.get("caches") is not None:
            raise ValueError("decode caches are not supported under context parallelism")
        slot.rows = row_segments(tokens, doc_ids, group, conv_size, fake_backend)
        return (tokens,), kwargs

    model.register_forward_pre_hook(set_rows, with_kwargs=True)
