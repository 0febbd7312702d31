"""The hybrid decoder: KDA and gated MLA layers (3:1), dense-then-MoE FFNs, AttnRes stream.

    tokens [B, T] -> embedding -> layers -> AttnRes final mix -> RMSNorm -> head -> logits [B, T, V]

Each `DecoderLayer` has two sub-layers, attention then FFN. Before each, the layer's
`AttnResMixer` turns the residual stream (SPEC §4) into the sub-layer's input; its output is
added back to the stream. `layers` is an `nn.ModuleDict` keyed by layer index (as in
torchtitan), so that parallelism and compile can wrap each layer on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_moe.model.args import ModelArgs
from titan_moe.model.attn_res import AttnResMixer, ResidualStream, StreamTensors
from titan_moe.model.ffn import SiTUGLUFeedForward
from titan_moe.model.head import OutputHead
from titan_moe.model.kda import KDACache, KimiDeltaAttention
from titan_moe.model.mla import GatedMLA, MLACache, document_mask, resolve_attention
from titan_moe.model.moe import LatentMoE
from titan_moe.model.packing import cu_seqlens_from_doc_ids
from titan_moe.ops.nvtx import nvtx_range

LayerCache = KDACache | MLACache


def to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in the enclosing autocast's compute dtype (unchanged outside autocast).

    A sub-layer's input feeds several projections (KDA: six); autocast would cast it once per
    matmul, and each matmul keeps its own copy for the backward. Cast once, share one copy.
    Without autocast (FSDP's mixed precision) the input is already in the compute dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def run_layer(layer: nn.Module, stream: ResidualStream, **kwargs) -> ResidualStream:
    """Call `layer` (a `DecoderLayer`, maybe wrapped by checkpointing, compile or FSDP) on
    `stream`; keyword arguments as `DecoderLayer.forward`. Returns the updated stream."""
    return stream.with_tensors(layer(stream.tensors(), **kwargs))


class DecoderLayer(nn.Module):
    """One layer: AttnRes mix -> RMSNorm -> attention (KDA or MLA); mix -> RMSNorm -> FFN."""

    def __init__(self, layer_idx: int, args: ModelArgs):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_res_mode, self.attn_res_block_size = args.attn_res, args.attn_res_block_size
        self.kind = args.layer_kinds()[layer_idx]
        self.attention = KimiDeltaAttention(args) if self.kind == "kda" else GatedMLA(args)
        self.is_moe = args.is_moe_layer(layer_idx)
        self.ffn_range = "moe" if self.is_moe else "ffn"
        if self.is_moe:
            self.feed_forward = LatentMoE(args)
        else:
            self.feed_forward = SiTUGLUFeedForward(args.dim, args.dense_hidden, args.situ_beta1, args.situ_beta2)
        self.attention_mix = AttnResMixer(args.dim, args.norm_eps)
        self.ffn_mix = AttnResMixer(args.dim, args.norm_eps)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self,
        stream_tensors: StreamTensors,
        doc_ids_BT: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mla_doc_mask=None,
    ) -> StreamTensors:
        """The stream's tensors in (`ResidualStream.tensors()`), the updated ones out; call it
        through :func:`run_layer` to pass a `ResidualStream`.

        Plain tensors at the module boundary, not the `ResidualStream` object: torch 2.11's
        Dynamo builds a broken graph for a checkpointed layer (activation checkpointing, then
        compile, as training applies them) that returns a custom pytree object ("Node output
        referenced nonexistent value"); a tuple of tensors compiles.
        """
        stream = ResidualStream(*stream_tensors, self.attn_res_mode, self.attn_res_block_size)
        x_BTD = to_autocast_dtype(self.attention_norm(self.attention_mix(stream)))
        with nvtx_range(self.kind):
            if self.kind == "kda":
                out_BTD = self.attention(x_BTD, doc_ids_BT=doc_ids_BT, cu_seqlens=cu_seqlens, cache=cache)
            else:
                out_BTD = self.attention(x_BTD, doc_ids_BT=doc_ids_BT, cache=cache, doc_mask=mla_doc_mask)
        stream = stream.add(out_BTD)
        x_BTD = to_autocast_dtype(self.ffn_norm(self.ffn_mix(stream)))
        with nvtx_range(self.ffn_range):
            out_BTD = self.feed_forward(x_BTD)
        return stream.add(out_BTD).tensors()

    def init_weights(self, init_std: float) -> None:
        self.attention.init_weights(init_std)
        self.feed_forward.init_weights(init_std)
        for module in (self.attention_mix, self.ffn_mix):
            module.init_weights(init_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Decoder(nn.Module):
    """The whole model. `forward(tokens [B,T], doc_ids [B,T] | None) -> logits [B,T,V]` (fp32);
    given `labels [B,T]` it returns the 0-d fp32 sum of the cross-entropy instead, the head run
    in chunks of `head_chunk_tokens` (`titan_moe.model.head`), never the whole logits; with
    `token_scores=True` as well, each token's argmax and cross-entropy `([B,T], [B,T])`, the
    evaluations' view of the logits (`OutputHead.token_scores`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(i, args) for i in range(args.n_layers)})
        self.final_mix = AttnResMixer(args.dim, args.norm_eps)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputHead(args.dim, args.vocab_size)
        # NVTX range names (titan_moe.ops.nvtx), built once rather than in every forward.
        self.layer_ranges = tuple(f"layer{i}.{kind}" for i, kind in enumerate(args.layer_kinds()))

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        caches: list[LayerCache] | None = None,
        labels: torch.Tensor | None = None,
        token_scores: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if doc_ids is not None and doc_ids.shape != tokens.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} != tokens shape {tuple(tokens.shape)}")
        if caches is not None and doc_ids is not None:
            raise ValueError("packed documents (doc_ids) are not supported with decode caches")
        cu_seqlens = cu_seqlens_from_doc_ids(doc_ids) if doc_ids is not None else None
        if cu_seqlens is not None and not torch.compiler.is_compiling():
            # The document count changes from batch to batch: the compiled layers take it as
            # a dynamic size from the first call instead of recompiling at the second count.
            torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        # The MLA layers' document mask, once per forward and outside the (compiled,
        # checkpointed) layers.
        mla_doc_mask = None
        if doc_ids is not None and "mla" in self.args.layer_kinds():
            path = resolve_attention(self.args.mla_attention, tokens.device)
            mla_doc_mask = document_mask(path, doc_ids, cu_seqlens)
        x_BTD = self.tok_embeddings(tokens)
        stream = ResidualStream.start(x_BTD, self.args.attn_res, self.args.n_layers, self.args.attn_res_block_size)
        for i, layer in enumerate(self.layers.values()):
            cache = caches[i] if caches is not None else None
            # Closing an AttnRes block depends on the layer index, so it happens here, between
            # the (separately compiled) layers, not inside them.
            with nvtx_range(self.layer_ranges[i]):
                stream = run_layer(
                    layer, stream, doc_ids_BT=doc_ids, cu_seqlens=cu_seqlens, cache=cache, mla_doc_mask=mla_doc_mask
                ).end_layer(i)
        with nvtx_range("head"):
            h_BTD = self.norm(self.final_mix(stream))
            return self.output(h_BTD, labels, self.args.head_chunk_tokens, token_scores)

    def new_caches(self, batch_size: int, max_len: int) -> list[LayerCache]:
        """Empty decode caches, one per layer (constant size for KDA, `max_len` tokens for MLA)."""
        device = self.output.weight.device
        dtype = self.output.weight.dtype
        caches: list[LayerCache] = []
        for layer in self.layers.values():
            if layer.kind == "kda":
                caches.append(KDACache.empty(self.args, batch_size, device=device, dtype=dtype))
            else:
                caches.append(MLACache.empty(self.args, batch_size, max_len, device=device, dtype=dtype))
        return caches

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        std = self.args.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for layer in self.layers.values():
            layer.init_weights(std)
        self.final_mix.init_weights(std)
        self.norm.reset_parameters()
        final_std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=final_std, a=-3 * final_std, b=3 * final_std)
