"""Parameter and FLOP counts (total vs active) for the decoder, on any device including meta."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_moe.model.args import ModelArgs


@dataclass
class ParamCounts:
    total: int
    active: int  # what one token touches: routed experts count top_k / n_routed_experts
    embedding: int
    routed_experts: int  # all routed expert weights, all layers
    by_component: dict[str, int]

    @property
    def active_excluding_embedding(self) -> int:
        return self.active - self.embedding


def _component(name: str) -> str:
    parts = name.split(".")
    if parts[0] != "layers":
        return parts[0]
    sub = parts[2]
    if sub == "feed_forward" and len(parts) > 3:
        return f"layers.feed_forward.{parts[3]}"
    return f"layers.{sub}"


def count_params(model: nn.Module, args: ModelArgs) -> ParamCounts:
    """Count parameters by name. Routed expert weights are the 3-D parameters under
    `feed_forward.experts` (stacked `[E, ...]`); each token uses top_k of them."""
    total = embedding = routed = 0
    by_component: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.startswith("tok_embeddings."):
            embedding += n
        if ".feed_forward.experts." in name:
            routed += n
        key = _component(name)
        by_component[key] = by_component.get(key, 0) + n
    active = total - routed + routed * args.top_k // args.n_routed_experts
    return ParamCounts(total, active, embedding, routed, by_component)


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: 6 x active matmul parameters, plus attention.

    Matmul parameters are counted from the shapes (no model needed). Attention adds, per
    MLA layer, 6 * H * (d_qk + d_v) * T / 2 on average over a causal sequence (forward QK^T
    and PV, twice that backward), and per KDA layer Kimi Linear's chunk cost
    6 * H * (3 * C * dk + C^2 ... ) simplified to 6 * H * (2 * dk * dv + C * (dk + dv)) with C = 64.
    """
    from titan_moe.model.decoder import Decoder  # local import: shapes only
    import torch

    with torch.device("meta"):
        model = Decoder(args)
    counts = count_params(model, args)
    dense_matmul = counts.active_excluding_embedding
    kinds = args.layer_kinds()
    attention = 0
    for kind in kinds:
        if kind == "mla":
            d_qk = args.mla_qk_nope_head_dim + args.mla_qk_shared_dim
            attention += 6 * args.mla_n_heads * (d_qk + args.mla_v_head_dim) * seq_len // 2
        else:
            dk = args.kda_head_dim
            attention += 6 * args.kda_n_heads * (2 * dk * dk + 64 * 2 * dk)
    return 6 * dense_matmul + attention
