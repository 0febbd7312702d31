"""Tensor-in / tensor-out wrappers of `Decoder` for `torch.export`.

    Prefill()(tokens [B, T]) -> (logits [B, T, V] fp32, state)
    PackedPrefill()(tokens [B, T], doc_ids [B, T] int32) -> (logits, state)
    DecodeStep()(tokens [B, 1], state) -> (logits [B, 1, V] fp32, new state)

``state`` is the flat tuple of `titan_moe.export.state` (returned contiguous). The
wrappers run the decoder's own submodules (embedding, AttnRes mixers, norms, FFN/MoE, head)
in `Decoder.forward`'s order, and the attention layers through the functions below:

* KDA: prefill uses the layer's `attention_inputs` / `output_projection` around the
  `titan_moe::kda_chunk_fwd` op, asking it for the final state; a decode step calls the
  layer itself with a `KDACache` built from the state tensors (the eager decode path).
* MLA: `MLACache` counts its tokens in a Python int, which an exported program would bake
  in. Here the cache is a fixed-capacity buffer plus the ``pos`` / ``doc_start`` tensors:
  a decode step writes its latent at slot ``pos`` (an out-of-place ``index_copy``) and
  attends, in the absorbed form of `GatedMLA._attend_absorbed` (fp32), to the slots
  ``doc_start <= l <= pos`` by masking the rest. It uses the layer's own weights and
  projections, so no model code changes.

Packed prefill: documents never see each other (as in training), and the returned state
continues each row's LAST document: its KDA state is that document's final state, the
conv state keeps only that document's tokens, and ``doc_start`` is where it begins.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_moe.model.attn_res import ResidualStream
from titan_moe.model.decoder import Decoder
from titan_moe.model.kda import KDACache, KimiDeltaAttention
from titan_moe.model.mla import GatedMLA
from titan_moe.model.packing import cu_seqlens_from_doc_ids, same_doc_causal_mask
from titan_moe.ops.kda import chunk_kda

Tensor = torch.Tensor


# =========================================================================== KDA
def kda_prefill(
    attn: KimiDeltaAttention, x_BTD: Tensor, doc_ids_BT: Tensor | None, cu_seqlens: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """KDA over a fresh prompt: ``(y [B,T,D], conv_state, recurrent_state [B,H,dk,dv] fp32)``.

    With packing (`doc_ids_BT` and its `cu_seqlens`), the states continue each row's last
    document.
    """
    B, T, _ = x_BTD.shape
    q, k, v, z, beta, conv_BKC = attn.attention_inputs(x_BTD, doc_ids_BT, None)
    z, gate_args = attn.gate_inputs(z)
    if cu_seqlens is None:
        o, state_BHKV = chunk_kda(q, k, v, z, beta, output_final_state=True, **gate_args)
        return attn.output_projection(o, x_BTD), conv_BKC, state_BHKV
    q, k, v, z, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, z, beta))
    # The number of documents is data-dependent (an unbacked size under export): state its range.
    torch._check(cu_seqlens.shape[0] >= 2)
    torch._check(cu_seqlens.shape[0] <= B * T + 1)
    o, state_NHKV = chunk_kda(q, k, v, z, beta, cu_seqlens=cu_seqlens, output_final_state=True, **gate_args)
    # Row b's last document is the one that ends at (b + 1) * T.
    row_ends_B = torch.arange(1, B + 1, device=x_BTD.device, dtype=cu_seqlens.dtype) * T
    last_doc_B = torch.searchsorted(cu_seqlens[1:].contiguous(), row_ends_B)
    state_BHKV = state_NHKV.index_select(0, last_doc_B)
    # Conv-state slots holding tokens of an earlier document (or the zero left padding) are zeroed.
    K1 = conv_BKC.shape[1]
    pad_BK = doc_ids_BT.new_full((B, K1), -1)
    tail_BK = torch.cat([pad_BK, doc_ids_BT], dim=1)[:, -K1:]
    keep_BK1 = (tail_BK == doc_ids_BT[:, -1:])[..., None]
    conv_BKC = conv_BKC * keep_BK1.to(conv_BKC.dtype)
    return attn.output_projection(o.view(B, T, *o.shape[2:]), x_BTD), conv_BKC, state_BHKV


def kda_step(
    attn: KimiDeltaAttention, x_B1D: Tensor, conv_BKC: Tensor, state_BHKV: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One token through the layer's eager decode path: ``(y [B,1,D], conv_state, recurrent_state)``."""
    cache = KDACache(conv_state=conv_BKC, recurrent_state=state_BHKV)
    y_B1D = attn(x_B1D, cache=cache)
    return y_B1D, cache.conv_state, cache.recurrent_state


# =========================================================================== MLA
def mla_prefill(
    attn: GatedMLA, x_BTD: Tensor, doc_ids_BT: Tensor | None, capacity: int
) -> tuple[Tensor, Tensor, Tensor]:
    """MLA over a fresh prompt (SDPA, causal, document-masked when packed).

    Returns ``y [B,T,D]`` and the latent buffers ``c_kv [B, capacity, R]``,
    ``k_shared [B, capacity, S]`` holding the T tokens in slots ``[0, T)``.
    """
    B, T, _ = x_BTD.shape
    q_BTHK = attn._queries(x_BTD)
    c_kv_BTR, k_s_BTS = attn._latents(x_BTD)
    # The dense document mask: a prompt is short, and the exported graph stays plain aten.
    mask_B1TT = same_doc_causal_mask(doc_ids_BT) if doc_ids_BT is not None else None
    o_BTHV = attn._attend(q_BTHK, c_kv_BTR, k_s_BTS, "dense", mask_B1TT)
    y_BTD = attn._gate_and_project(x_BTD, o_BTHV)
    # Written into zero buffers (not concatenated with `capacity - T` zeros, whose size
    # would make export guard on T).
    c_kv_BLR = c_kv_BTR.new_zeros(B, capacity, c_kv_BTR.shape[-1]).slice_scatter(c_kv_BTR, dim=1, start=0, end=T)
    k_s_BLS = k_s_BTS.new_zeros(B, capacity, k_s_BTS.shape[-1]).slice_scatter(k_s_BTS, dim=1, start=0, end=T)
    return y_BTD, c_kv_BLR, k_s_BLS


def mla_step(
    attn: GatedMLA, x_B1D: Tensor, c_kv_BLR: Tensor, k_s_BLS: Tensor, pos: Tensor, doc_start_B: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One token at slot ``pos`` attending to slots ``[doc_start, pos]`` (absorbed form, fp32).

    Same maths as `GatedMLA._attend_absorbed` for one query, with the visible prefix given
    by a mask instead of a Python-int slice. Returns ``y [B,1,D]`` and the updated buffers.
    """
    q_B1HK = attn._queries(x_B1D)
    c_new_B1R, k_s_new_B1S = attn._latents(x_B1D)
    slot_1 = pos.reshape(1)
    c_kv_BLR = c_kv_BLR.index_copy(1, slot_1, c_new_B1R.to(c_kv_BLR.dtype))
    k_s_BLS = k_s_BLS.index_copy(1, slot_1, k_s_new_B1S.to(k_s_BLS.dtype))

    n_nope, n_v = attn.qk_nope_dim, attn.v_head_dim
    w_HNR = attn.w_ukv.weight.float().view(-1, n_nope + n_v, attn.kv_lora_rank)
    w_uk_HNR, w_uv_HVR = w_HNR.split([n_nope, n_v], dim=1)
    q_n_B1HN, q_s_B1HS = q_B1HK.float().split([n_nope, attn.qk_shared_dim], dim=-1)
    c_BLR, k_s_f_BLS = c_kv_BLR.float(), k_s_BLS.float()
    q_lat_B1HR = torch.einsum("bthn,hnr->bthr", q_n_B1HN, w_uk_HNR)
    s_BH1L = torch.einsum("bthr,blr->bhtl", q_lat_B1HR, c_BLR) + torch.einsum("bths,bls->bhtl", q_s_B1HS, k_s_f_BLS)
    slots_L = torch.arange(c_kv_BLR.shape[1], device=c_kv_BLR.device)
    visible_BL = (slots_L[None, :] >= doc_start_B[:, None]) & (slots_L[None, :] <= pos)
    s_BH1L = (s_BH1L * attn.scale).masked_fill(~visible_BL[:, None, None, :], float("-inf"))
    p_BH1L = torch.softmax(s_BH1L, dim=-1)
    o_lat_B1HR = torch.einsum("bhtl,blr->bthr", p_BH1L, c_BLR)
    o_B1HV = torch.einsum("bthr,hvr->bthv", o_lat_B1HR, w_uv_HVR)
    return attn._gate_and_project(x_B1D, o_B1HV), c_kv_BLR, k_s_BLS


# =========================================================================== decoder
def _run_decoder(model: Decoder, tokens_BT: Tensor, attend) -> Tensor:
    """`Decoder.forward` with the attention sub-layer replaced by ``attend(i, attention, x)``."""
    args = model.args
    x_BTD = model.tok_embeddings(tokens_BT)
    stream = ResidualStream.start(x_BTD, args.attn_res, args.n_layers, args.attn_res_block_size)
    for i, layer in enumerate(model.layers.values()):
        stream = stream.add(attend(i, layer.attention, layer.attention_norm(layer.attention_mix(stream))))
        stream = stream.add(layer.feed_forward(layer.ffn_norm(layer.ffn_mix(stream)))).end_layer(i)
    return model.output(model.norm(model.final_mix(stream))).float()


def _contiguous(*state: Tensor) -> tuple[Tensor, ...]:
    """The state as contiguous tensors. Some are views (the conv state is the tail of a longer
    tensor); an AOTInductor program assumes the strides it was compiled for (contiguous) and
    reads a strided view wrongly without checking."""
    return tuple(t.contiguous() for t in state)


class _ExportWrapper(nn.Module):
    """Holds the decoder (in eval mode: the MoE keeps no balancing statistics)."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model
        self.kinds = tuple(model.args.layer_kinds())

    def init_weights(self, init_std: float = 0.02) -> None:
        """Re-initialises the wrapped decoder (which uses its own `ModelArgs.init_std`)."""
        self.model.init_weights()


class _PrefillBase(_ExportWrapper):
    def __init__(self, model: Decoder, capacity: int):
        super().__init__(model)
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity

    def _prefill(self, tokens_BT: Tensor, doc_ids_BT: Tensor | None) -> tuple[Tensor, tuple[Tensor, ...]]:
        B, T = tokens_BT.shape
        torch._check(T <= self.capacity, lambda: f"prompt of {T} tokens > state capacity {self.capacity}")
        cu_seqlens = None if doc_ids_BT is None else cu_seqlens_from_doc_ids(doc_ids_BT)
        layer_states: list[tuple[Tensor, Tensor]] = []

        def attend(i: int, attn: nn.Module, x_BTD: Tensor) -> Tensor:
            if self.kinds[i] == "kda":
                y_BTD, a, b = kda_prefill(attn, x_BTD, doc_ids_BT, cu_seqlens)
            else:
                y_BTD, a, b = mla_prefill(attn, x_BTD, doc_ids_BT, self.capacity)
            layer_states.append((a, b))
            return y_BTD

        logits_BTV = _run_decoder(self.model, tokens_BT, attend)
        pos = torch.full((), T, dtype=torch.int64, device=tokens_BT.device)
        if doc_ids_BT is None:
            doc_start_B = torch.zeros(B, dtype=torch.int64, device=tokens_BT.device)
        else:  # doc ids are non-decreasing along a row: count the tokens before the last document
            doc_start_B = (doc_ids_BT != doc_ids_BT[:, -1:]).sum(dim=1, dtype=torch.int64)
        return logits_BTV, _contiguous(pos, doc_start_B, *(t for pair in layer_states for t in pair))


class Prefill(_PrefillBase):
    """``forward(tokens [B, T]) -> (logits [B, T, V] fp32, state)``; 1 <= T <= capacity.

    The state's MLA buffers have `capacity` slots, the first T filled.
    """

    def forward(self, tokens: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return self._prefill(tokens, None)


class PackedPrefill(_PrefillBase):
    """``forward(tokens [B, T], doc_ids [B, T] int32) -> (logits, state)`` for packed rows.

    Documents are isolated as in training; the state continues each row's last document.
    """

    def forward(self, tokens: Tensor, doc_ids: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return self._prefill(tokens, doc_ids)


class DecodeStep(_ExportWrapper):
    """``forward(tokens [B, 1], state) -> (logits [B, 1, V] fp32, new state)``.

    Works from any state of the same layout: a prefill's, or `state.empty_state` (a
    prompt of one token). Needs ``pos < L`` (the buffers' capacity).
    """

    def forward(self, tokens: Tensor, state: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        pos, doc_start_B, *layer_state = state
        new_layer_state: list[Tensor] = []

        def attend(i: int, attn: nn.Module, x_B1D: Tensor) -> Tensor:
            a, b = layer_state[2 * i], layer_state[2 * i + 1]
            if self.kinds[i] == "kda":
                y_B1D, a, b = kda_step(attn, x_B1D, a, b)
            else:
                y_B1D, a, b = mla_step(attn, x_B1D, a, b, pos, doc_start_B)
            new_layer_state.extend((a, b))
            return y_B1D

        logits_B1V = _run_decoder(self.model, tokens, attend)
        return logits_B1V, _contiguous(pos + 1, doc_start_B, *new_layer_state)
