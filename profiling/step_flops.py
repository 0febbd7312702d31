"""One FLOP count for a training step, the same for every model the peer harness compares.

    flops(step) = 6 * N_active * tokens                                      (matmuls)
                + 6 * H * (d_qk + d_v) * pairs * L_softmax                    (softmax attention)
                + 6 * H_lin * (2 * d_k * d_v + C * (d_k + d_v)) * tokens * L_linear   (KDA)

Every term counts multiply-adds (MACs) once per token or per attended pair and multiplies
by 6: 2 FLOPs per MAC in the forward pass and twice the forward in the backward (the
gradients of the input and of the weight, or of both attention operands). Recomputation
(activation checkpointing, FlashAttention's backward) is not counted: this is the model's
work, not what a particular run executes.

N_active: the matmul parameters one token touches, counted from the instantiated model
(meta device is enough): every parameter of two or more dimensions (linear weights, stacked
expert weights, the router, the depthwise short-convolution kernels), except the token
embedding (a lookup); routed experts (parameters under a module named `experts`, not
`shared_experts`) count top_k / n_experts of their size. Vectors (norm weights, biases,
decay parameters, AttnRes queries) and element-wise work (activations, RoPE, softmax,
norms) are left out.

pairs: the (query, key) pairs that the attention mask leaves, summed over the step's rows:
a document of l tokens under a causal mask leaves l * (l + 1) / 2 pairs (the diagonal
included; l^2 / 2 up to it), so a row of documents l_1..l_n leaves sum_i l_i (l_i + 1) / 2,
not T (T + 1) / 2. A run whose mask ignores documents (plain causal) attends over the whole
row: one segment of T. The constant 6 * H * (d_qk + d_v) per pair: QK^T (d_qk MACs) and PV
(d_v MACs) per head.

KDA (linear attention in chunks of C = 64 tokens), per token and head: the state readout and
update (d_k * d_v MACs each) and the intra-chunk products over C keys (C * (d_k + d_v)
MACs); the same constant as `titan_moe.model.flops`.

MFU = achieved FLOP/s / peak; the harness's default peak is the H100 SXM's dense bf16
989 TFLOP/s (the H200 has the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

H100_BF16_PEAK_TFLOPS = 989.0
KDA_CHUNK = 64


@dataclass(frozen=True)
class FlopModel:
    """What the FLOP formula needs to know about one model."""

    active_matmul_params: int  # N_active, per token
    softmax_layers: int  # layers with softmax attention (MLA)
    heads: int
    qk_head_dim: int
    v_head_dim: int
    linear_layers: int = 0  # KDA layers
    linear_heads: int = 0
    linear_head_dim: int = 0  # d_k = d_v

    def matmul_flops(self, tokens: int) -> int:
        return 6 * self.active_matmul_params * tokens

    def attention_flops(self, pairs: int) -> int:
        return 6 * self.heads * (self.qk_head_dim + self.v_head_dim) * pairs * self.softmax_layers

    def linear_attention_flops(self, tokens: int) -> int:
        d = self.linear_head_dim
        return 6 * self.linear_heads * (2 * d * d + KDA_CHUNK * 2 * d) * tokens * self.linear_layers

    def step_flops(self, tokens: int, pairs: int) -> int:
        return self.matmul_flops(tokens) + self.attention_flops(pairs) + self.linear_attention_flops(tokens)


def is_routed_expert(name: str) -> bool:
    """A parameter of the routed experts: one under a module named `experts` (ours:
    `layers.i.feed_forward.experts.w_gate_up`; torchtitan's: `layers.i.moe.experts.w1`)."""
    return "experts" in name.split(".")[:-1]


def active_matmul_params(model: nn.Module, *, top_k: int, n_experts: int) -> int:
    """N_active of the module docstring: >= 2-D parameters without the token embedding,
    routed experts scaled by top_k / n_experts (exactly: summed, then multiplied)."""
    dense = routed = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or name.startswith("tok_embeddings."):
            continue
        if is_routed_expert(name):
            routed += p.numel()
        else:
            dense += p.numel()
    return dense + routed * top_k // n_experts


def causal_pairs(segment_lengths: Iterable[int]) -> int:
    """Pairs a causal mask leaves inside each segment (document), summed."""
    return sum(l * (l + 1) // 2 for l in segment_lengths)


def segment_lengths(doc_ids_T: Sequence[int] | torch.Tensor) -> list[int]:
    """Lengths of the documents of one row, from its doc ids (a new id starts a document)."""
    ids = torch.as_tensor(doc_ids_T).flatten()
    if ids.numel() == 0:
        return []
    starts = torch.nonzero(torch.diff(ids) != 0).flatten() + 1
    bounds = [0, *starts.tolist(), ids.numel()]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def doc_mask_pairs(doc_ids_BT: torch.Tensor) -> int:
    """Pairs of a batch under a causal document mask."""
    return sum(causal_pairs(segment_lengths(row)) for row in doc_ids_BT)


def full_causal_pairs(batch: int, seq_len: int) -> int:
    """Pairs of a batch under a plain causal mask (each row one segment of T)."""
    return batch * causal_pairs([seq_len])


def flop_model_ours(args) -> FlopModel:
    """Our decoder (titan_moe ModelArgs), counted from the model built on the meta device."""
    from titan_moe.model.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(args)
    kinds = args.layer_kinds()
    return FlopModel(
        active_matmul_params=active_matmul_params(model, top_k=args.top_k, n_experts=args.n_routed_experts),
        softmax_layers=kinds.count("mla"),
        heads=args.mla_n_heads,
        qk_head_dim=args.mla_qk_nope_head_dim + args.mla_qk_shared_dim,
        v_head_dim=args.mla_v_head_dim,
        linear_layers=kinds.count("kda"),
        linear_heads=args.kda_n_heads,
        linear_head_dim=args.kda_head_dim,
    )


def flop_model_dsv3(args) -> FlopModel:
    """torchtitan's DeepSeek-V3 (DeepSeekV3ModelArgs), counted from the model on meta."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    return FlopModel(
        active_matmul_params=active_matmul_params(model, top_k=args.moe_args.top_k,
                                                  n_experts=args.moe_args.num_experts),
        softmax_layers=args.n_layers,
        heads=args.n_heads,
        qk_head_dim=args.qk_nope_head_dim + args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
    )
