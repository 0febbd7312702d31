"""Gated NoPE multi-head latent attention (SPEC §2).

    c_q         = RMSNorm(W_dq x)                              [B, T, q_lora_rank]
    q           = W_uq c_q                                     [B, T, H, qk_nope + qk_shared]
    [c_kv, k_s] = W_dkv x                                      [B, T, kv_lora_rank], [B, T, qk_shared]
    [k_n, v]    = W_ukv RMSNorm(c_kv)                          [B, T, H, qk_nope], [B, T, H, v_head]
    k           = [k_n, k_s]                                   k_s shared by all heads
    o           = softmax(q k^T / sqrt(qk_nope + qk_shared) + causal) v
    y           = W_o [ sigmoid(W_g x) ⊙ o ]                   W_g: dim -> H * v_head (full rank)

No positional encoding anywhere (NoPE): scores depend on content and the causal/document mask
only, so context can grow between training stages without rescaling. No biases.

Packed documents. With ``doc_ids`` the attention is causal within each document; the path
is `ModelArgs.mla_attention` ("auto": varlen on CUDA, chunked elsewhere;
`resolve_attention`). All but ``dense`` avoid any T x T tensor:

* ``varlen`` (CUDA): one variable-length FlashAttention-2 call over all documents of the
  batch (`titan_moe.ops.attention.doc_attention_varlen`), driven by the decoder's
  ``cu_seqlens``: no host work per document.
* ``chunked`` (any device): `titan_moe.ops.attention.doc_attention_chunked`, exact, by query
  chunks, O(T * chunk) memory in forward and backward.
* ``dense``: SDPA with a dense ``[B, 1, T, T]`` boolean mask (T^2 bytes per row kept for
  the backward; the mask also keeps SDPA from skipping masked blocks).

The mask a path needs (`document_mask`) is built once per forward by the decoder, outside
the compiled and checkpointed layers, and shared by every MLA layer.

Precision. Projections and the attention itself (SDPA) run in the input dtype. The SDPA
output ``o`` is upcast to fp32; the gate ``sigmoid(W_g x)`` is computed in fp32 (from the
input-dtype logits ``W_g x``), and the product ``sigmoid(W_g x) ⊙ o`` is formed in fp32; that
product is cast back to the input dtype once, as the input of ``W_o``. In the cached decode
path the whole absorbed attention (scores, softmax, latent mix, ``W_uv``) is fp32.

Decode cache (`MLACache`): per token only the normalised latent ``RMSNorm(c_kv)``
(kv_lora_rank values) and the shared key ``k_s`` (qk_shared values), 512 + 64 = 576 at K3
scale. Decode uses the absorbed form: ``q_n^T k_n = q_n^T W_uk c = (W_uk^T q_n)^T c``, so
each head's query is moved into latent space and scored against the cached latents
directly; the attention-weighted latent is then expanded per head by ``W_uv``. ``W_uv``
cannot fold into ``W_o`` because the gate sits between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_moe.model.args import ModelArgs
from titan_moe.model.packing import cu_seqlens_from_doc_ids, same_doc_causal_mask
from titan_moe.ops.attention import (
    doc_attention_chunked,
    doc_attention_varlen,
    doc_starts,
)
from titan_moe.ops.nvtx import nvtx_wrap


def resolve_attention(choice: str, device: torch.device, compute_dtype: str | None = None) -> str:
    """The path "auto" stands for on `device` ("varlen" on CUDA: the fastest training step
    measured, docs/kernels.md; "chunked" elsewhere); other values unchanged. "varlen" needs
    CUDA, and FlashAttention-2 takes only bf16/fp16: with `compute_dtype` "float32" (the
    run's `training.mixed_precision_param`) it is a ValueError naming the way out."""
    path = choice
    if choice == "auto":
        path = "varlen" if device.type == "cuda" else "chunked"
    if path == "varlen" and device.type != "cuda":
        raise ValueError(f"model.mla_attention = {choice!r} needs a CUDA device, got {device.type}")
    if path == "varlen" and compute_dtype == "float32":
        raise ValueError(f"model.mla_attention = {choice!r} runs FlashAttention-2 (bf16/fp16 only) but "
                         "training.mixed_precision_param is 'float32': set model.mla_attention = 'chunked'")
    return path


def document_mask(path: str, doc_ids_BT: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
    """What `GatedMLA` needs for packed documents on `path`: the documents' starts [B, T]
    (chunked), the flattened stream's `cu_seqlens` (varlen; the given one, else computed)
    or the dense bool mask [B, 1, T, T] (dense)."""
    if path == "dense":
        return same_doc_causal_mask(doc_ids_BT)
    if path == "varlen":
        return cu_seqlens if cu_seqlens is not None else cu_seqlens_from_doc_ids(doc_ids_BT)
    return doc_starts(doc_ids_BT)


@dataclass
class MLACache:
    """Latent KV cache of one MLA layer for generation (no packing).

    Fields:
        c_kv: [B, L_max, kv_lora_rank], the normalised latent ``RMSNorm(c_kv)`` per token.
        k_shared: [B, L_max, qk_shared_dim], the head-shared key dims per token.
        length: number of filled positions (a Python int: generation runs eagerly).

    `GatedMLA.forward` writes new tokens at ``[length, length + T)`` in place and advances
    ``length``.
    """

    c_kv: torch.Tensor
    k_shared: torch.Tensor
    length: int = 0

    @classmethod
    def empty(
        cls,
        args: ModelArgs,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> MLACache:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size and max_len must be > 0, got {batch_size} and {max_len}")
        c_kv = torch.zeros(batch_size, max_len, args.mla_kv_lora_rank, device=device, dtype=dtype)
        k_shared = torch.zeros(batch_size, max_len, args.mla_qk_shared_dim, device=device, dtype=dtype)
        return cls(c_kv=c_kv, k_shared=k_shared, length=0)

    @property
    def max_len(self) -> int:
        return self.c_kv.shape[1]


class GatedMLA(nn.Module):
    """Gated NoPE MLA. ``forward(x_BTD, doc_ids_BT=None, cache=None) -> y_BTD``.

    * Training / no cache: causal SDPA; with packed documents, ``doc_mask`` (from
      `document_mask` on the resolved path, built once per forward) confines it to each
      document; ``doc_ids_BT`` alone also works (the mask is then built here). Traceable
      by ``torch.compile(fullgraph=True)``.
    * With a cache (generation, no packing): an empty cache and ``T > 1`` is a prefill (the
      same SDPA path, causal, fills the cache); otherwise (any T on a non-empty cache, or
      T == 1) the absorbed decode path attends to the cache plus the new tokens.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.mla_n_heads
        self.kv_lora_rank = args.mla_kv_lora_rank
        self.qk_nope_dim = args.mla_qk_nope_head_dim
        self.qk_shared_dim = args.mla_qk_shared_dim
        self.qk_head_dim = self.qk_nope_dim + self.qk_shared_dim
        self.v_head_dim = args.mla_v_head_dim
        self.scale = self.qk_head_dim**-0.5
        self.attention_choice = args.mla_attention
        H = self.n_heads

        self.w_dq = nn.Linear(args.dim, args.mla_q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(args.mla_q_lora_rank, eps=args.norm_eps)
        self.w_uq = nn.Linear(args.mla_q_lora_rank, H * self.qk_head_dim, bias=False)
        self.w_dkv = nn.Linear(args.dim, self.kv_lora_rank + self.qk_shared_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        # Rows per head: qk_nope rows of W_uk, then v_head rows of W_uv.
        self.w_ukv = nn.Linear(self.kv_lora_rank, H * (self.qk_nope_dim + self.v_head_dim), bias=False)
        self.w_g = nn.Linear(args.dim, H * self.v_head_dim, bias=False)
        self.w_o = nn.Linear(H * self.v_head_dim, args.dim, bias=False)

    # ------------------------------------------------------------------
    def _queries(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """[B, T, H, qk_nope + qk_shared]."""
        B, T, _ = x_BTD.shape
        return self.w_uq(self.q_norm(self.w_dq(x_BTD))).view(B, T, -1, self.qk_head_dim)

    def _latents(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised latent [B, T, kv_lora_rank] and shared key [B, T, qk_shared]."""
        c_kv_BTR, k_s_BTS = self.w_dkv(x_BTD).split([self.kv_lora_rank, self.qk_shared_dim], dim=-1)
        return self.kv_norm(c_kv_BTR), k_s_BTS

    @nvtx_wrap("mla.attend")
    def _attend(
        self,
        q_BTHK: torch.Tensor,
        c_kv_BTR: torch.Tensor,
        k_s_BTS: torch.Tensor,
        path: str,
        doc_mask,
    ) -> torch.Tensor:
        """Non-absorbed attention over the T tokens themselves; returns fp32 o [B, T, H, v_head].
        `doc_mask`: None (one causal sequence per row) or `document_mask(path, ...)`."""
        B, T, _ = c_kv_BTR.shape
        kv_BTHN = self.w_ukv(c_kv_BTR).view(B, T, -1, self.qk_nope_dim + self.v_head_dim)
        k_n_BTHN, v_BTHV = kv_BTHN.split([self.qk_nope_dim, self.v_head_dim], dim=-1)
        H = k_n_BTHN.shape[2]
        k_BTHK = torch.cat([k_n_BTHN, k_s_BTS[:, :, None, :].expand(B, T, H, self.qk_shared_dim)], dim=-1)
        if doc_mask is not None and path == "varlen":
            return doc_attention_varlen(q_BTHK, k_BTHK, v_BTHV, doc_mask, self.scale).float()
        q_BHTK, k_BHTK, v_BHTV = (t.transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV))
        if doc_mask is None:
            o_BHTV = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True, scale=self.scale)
        elif path == "chunked":
            o_BHTV = doc_attention_chunked(q_BHTK, k_BHTK, v_BHTV, doc_mask, self.scale)
        else:
            o_BHTV = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, attn_mask=doc_mask, scale=self.scale)
        return o_BHTV.transpose(1, 2).float()

    def _attend_absorbed(self, q_BTHK: torch.Tensor, cache: MLACache, start: int) -> torch.Tensor:
        """Absorbed attention of T new queries (absolute positions start..start+T-1) over the
        cache's first start+T tokens, all in fp32; returns o [B, T, H, v_head]."""
        T = q_BTHK.shape[1]
        end = start + T
        w_HNR = self.w_ukv.weight.float().view(-1, self.qk_nope_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk_HNR, w_uv_HVR = w_HNR.split([self.qk_nope_dim, self.v_head_dim], dim=1)
        q_n_BTHN, q_s_BTHS = q_BTHK.float().split([self.qk_nope_dim, self.qk_shared_dim], dim=-1)
        c_BLR = cache.c_kv[:, :end].float()
        k_s_BLS = cache.k_shared[:, :end].float()

        q_lat_BTHR = torch.einsum("bthn,hnr->bthr", q_n_BTHN, w_uk_HNR)
        s_BHTL = torch.einsum("bthr,blr->bhtl", q_lat_BTHR, c_BLR) + torch.einsum("bths,bls->bhtl", q_s_BTHS, k_s_BLS)
        pos_T = torch.arange(start, end, device=c_BLR.device)
        visible_TL = torch.arange(end, device=c_BLR.device)[None, :] <= pos_T[:, None]
        p_BHTL = torch.softmax((s_BHTL * self.scale).masked_fill(~visible_TL, float("-inf")), dim=-1)
        o_lat_BTHR = torch.einsum("bhtl,blr->bthr", p_BHTL, c_BLR)
        return torch.einsum("bthr,hvr->bthv", o_lat_BTHR, w_uv_HVR)

    def _gate_and_project(self, x_BTD: torch.Tensor, o_BTHV: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        gate_BTHV = torch.sigmoid(self.w_g(x_BTD).float()).view(B, T, -1, self.v_head_dim)
        return self.w_o((gate_BTHV * o_BTHV).reshape(B, T, -1).to(x_BTD.dtype))

    # ------------------------------------------------------------------
    def forward(
        self,
        x_BTD: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        cache: MLACache | None = None,
        doc_mask=None,
    ) -> torch.Tensor:
        if cache is not None and (doc_ids_BT is not None or doc_mask is not None):
            raise ValueError("GatedMLA: packed documents (doc_ids_BT) are not supported with a decode cache")
        q_BTHK = self._queries(x_BTD)
        c_kv_BTR, k_s_BTS = self._latents(x_BTD)
        if cache is None:
            path = resolve_attention(self.attention_choice, x_BTD.device)
            if doc_mask is None and doc_ids_BT is not None:
                doc_mask = document_mask(path, doc_ids_BT)
            o_BTHV = self._attend(q_BTHK, c_kv_BTR, k_s_BTS, path, doc_mask)
        else:
            T = x_BTD.shape[1]
            start = cache.length
            if start + T > cache.max_len:
                raise ValueError(f"MLACache overflow: {start} cached + {T} new > max_len {cache.max_len}")
            with torch.no_grad():
                cache.c_kv[:, start : start + T] = c_kv_BTR
                cache.k_shared[:, start : start + T] = k_s_BTS
            cache.length = start + T
            if start == 0 and T > 1:
                o_BTHV = self._attend(q_BTHK, c_kv_BTR, k_s_BTS, "dense", None)
            else:
                o_BTHV = self._attend_absorbed(q_BTHK, cache, start)
        return self._gate_and_project(x_BTD, o_BTHV)

    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        """Truncated normal (±3 std) for every projection, ones for both RMSNorm weights."""
        for linear in (self.w_dq, self.w_uq, self.w_dkv, self.w_ukv, self.w_g, self.w_o):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        for norm in (self.q_norm, self.kv_norm):
            nn.init.ones_(norm.weight)
