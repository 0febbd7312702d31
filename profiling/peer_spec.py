"""torchtitan 0.2.2's DeepSeek-V3 as a matched peer of our model: torchtitan train specs.

Two specs, the same model class (`torchtitan.models.deepseek_v3.DeepSeekV3Model`) and its
own parallelize function (`parallelize_deepseekv3`: activation checkpointing, per-block
`torch.compile`, FSDP), its own optimizer builder with the aux-loss-free expert-bias update
(`build_optimizers_with_moe_load_balancing`) and torchtitan's loss and LR schedule:

    titan_peer_dsv3          FlexAttention with torchtitan's `block_causal` mask
    titan_peer_dsv3_causal   SDPA, plain causal (torchtitan's default attention)
    titan_peer_dsv3_causal_flex  FlexAttention, plain causal (the mask cost apart from documents)

Tokens: our tokenizer and our packed-row loader (`titan_moe.data`, the same `[data]` seed,
`training.dataset`, seq_len and batch), so a peer run and our run see the same rows. The
loader's `doc_ids` are dropped before the model (DeepSeek-V3's forward takes tokens only);
the peer finds the same documents from the eos id instead: our packing writes every document
as `[bos] text [eos]` (text that spells the eos token stays text), and torchtitan's
`get_document_mask_mod` starts a new document after every eos, which is exactly where our
doc ids step (tests/test_peer_harness.py checks this on real rows).

The flavors are ours (`--model.flavor small_1gpu`, and any `[model]` override) mapped field by
field when torchtitan calls `update_from_config`:

    ours                                  DeepSeek-V3
    vocab_size, dim, n_layers,            the same names
      n_dense_layers, norm_eps
    mla_n_heads                           n_heads
    mla_q_lora_rank, mla_kv_lora_rank     q_lora_rank, kv_lora_rank
    mla_qk_nope_head_dim                  qk_nope_head_dim
    mla_qk_shared_dim                     qk_rope_head_dim (rotated there, NoPE here)
    mla_v_head_dim                        v_head_dim
    dense_hidden                          inter_dim (the dense first layers' FFN)
    moe_expert_hidden                     moe_inter_dim
    n_routed_experts, top_k               moe_args.num_experts, moe_args.top_k
    n_shared_experts x moe_shared_hidden  moe_args.num_shared_experts x moe_inter_dim
                                          (the shared FFN's total width; must divide)
    routed_scale                          moe_args.route_scale
    sign_gamma                            moe_args.load_balance_coeff (bias step)

What cannot match (so the models differ beyond the layer mix):
  * experts: ours work in a latent width (`moe_latent_dim`, with a down and an up projection
    per MoE layer) with SiTU-GLU; DeepSeek-V3's routed and shared experts are full-width
    SwiGLU (at small_1gpu: 2x the active routed-expert parameters of ours).
  * no KDA (`kda_*`, `mla_every`, `mla_layers`): every peer layer is MLA.
  * no AttnRes (`attn_res*`): plain residual stream.
  * MLA: ours is gated (an output gate `w_g`) and NoPE; DeepSeek-V3 rotates its
    qk_rope_head_dim (RoPE/YaRN with torchtitan's defaults).
  * routing: sigmoid scores with route_norm (as DeepSeek-V3 671B) and the sign rule for the
    bias; ours balances with QB (`balance_rule`, `qb_*`). Scores apply after the experts.
  * weight decay: torchtitan's optimizer decays every parameter; ours exempts vectors.
  * `mla_attention`, `situ_*`, `init_std`, `kda_conv_size`: no counterpart.
The FLOP formula of the harness (profiling/step_flops.py) counts each model's own work.

Validation must be off (`--validation.no_enable`): the spec has no validator.
Used by profiling/peer_train.py (the entry point) and profiling/peer_step.py (the harness);
not imported by the package.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

from titan_moe.runtime.optional_packages import provide_datasets_placeholder

provide_datasets_placeholder()  # torchtitan imports `datasets` at module level

import torch  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import build_cross_entropy_loss  # noqa: E402
from torchtitan.components.lr_scheduler import build_lr_schedulers  # noqa: E402
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, parallelize_deepseekv3  # noqa: E402
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs  # noqa: E402
from torchtitan.models.moe import MoEArgs  # noqa: E402
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec  # noqa: E402

from titan_moe.config import model_args_from_config  # noqa: E402
from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config  # noqa: E402
from titan_moe.flavors import FLAVORS  # noqa: E402
from titan_moe.metrics import build_titan_metrics_processor  # noqa: E402
from titan_moe.model.args import ModelArgs  # noqa: E402

# spec name -> (attn_type, attn_mask_type) of DeepSeekV3ModelArgs
PEER_SPECS: dict[str, tuple[str, str]] = {
    "titan_peer_dsv3": ("flex", "block_causal"),
    "titan_peer_dsv3_causal": ("sdpa", "causal"),
    "titan_peer_dsv3_causal_flex": ("flex", "causal"),
}


def peer_args(ours: ModelArgs, *, attn_type: str = "flex", attn_mask_type: str = "block_causal") -> DeepSeekV3ModelArgs:
    """DeepSeek-V3 args matching `ours` wherever a field has a counterpart (module docstring)."""
    shared_width = ours.n_shared_experts * ours.moe_shared_hidden
    if shared_width % ours.moe_expert_hidden:
        raise ValueError(
            f"peer: the shared experts' width n_shared_experts x moe_shared_hidden = {shared_width} is not a "
            f"multiple of moe_expert_hidden = {ours.moe_expert_hidden} (DeepSeek-V3's shared FFN is "
            "num_shared_experts x moe_inter_dim wide)"
        )
    args = DeepSeekV3ModelArgs(
        vocab_size=ours.vocab_size,
        dim=ours.dim,
        inter_dim=ours.dense_hidden,
        moe_inter_dim=ours.moe_expert_hidden,
        n_layers=ours.n_layers,
        n_dense_layers=ours.n_dense_layers,
        n_heads=ours.mla_n_heads,
        norm_eps=ours.norm_eps,
        moe_args=MoEArgs(
            num_experts=ours.n_routed_experts,
            num_shared_experts=shared_width // ours.moe_expert_hidden,
            top_k=ours.top_k,
            score_func="sigmoid",
            route_norm=True,
            route_scale=ours.routed_scale,
            score_before_experts=False,
            load_balance_coeff=ours.sign_gamma,
        ),
        q_lora_rank=ours.mla_q_lora_rank,
        kv_lora_rank=ours.mla_kv_lora_rank,
        qk_nope_head_dim=ours.mla_qk_nope_head_dim,
        qk_rope_head_dim=ours.mla_qk_shared_dim,
        v_head_dim=ours.mla_v_head_dim,
        attn_type=attn_type,
        attn_mask_type=attn_mask_type,
    )
    # set by DeepSeekV3ModelArgs.update_from_config; needed to build the model without it
    args.moe_impl = "standard"
    return args


@dataclass
class PeerArgs(DeepSeekV3ModelArgs):
    """DeepSeekV3ModelArgs that take their fields from our `[model]` section (flavor and
    overrides, mapped by `peer_args`) when torchtitan applies the job config; the attention
    type and mask stay the spec's."""

    def update_from_config(self, job_config, **kwargs) -> None:
        mapped = peer_args(model_args_from_config(job_config), attn_type=self.attn_type,
                           attn_mask_type=self.attn_mask_type)
        for f in dataclasses.fields(mapped):
            setattr(self, f.name, copy.deepcopy(getattr(mapped, f.name)))
        super().update_from_config(job_config, **kwargs)


class TokensOnlyLoader(BaseDataLoader):
    """Our packed-row loader with `doc_ids` dropped: yields ({"input": [B, T]}, labels [B, T])."""

    def __init__(self, inner: BaseDataLoader):
        self.inner = inner

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for input_dict, labels in self.inner:
            yield {"input": input_dict["input"]}, labels

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def build_peer_dataloader(*, dp_world_size: int, dp_rank: int, tokenizer, job_config) -> TokensOnlyLoader:
    return TokensOnlyLoader(dataloader_from_config(job_config, tokenizer=tokenizer, split="train",
                                                   dp_rank=dp_rank, dp_world_size=dp_world_size))


def get_peer_train_spec(attn_type: str, attn_mask_type: str) -> TrainSpec:
    # one placeholder per flavor name of ours (our config loader checks model.flavor against
    # FLAVORS); update_from_config fills in the mapped fields
    flavors = {name: PeerArgs(attn_type=attn_type, attn_mask_type=attn_mask_type) for name in FLAVORS}
    return TrainSpec(
        model_cls=DeepSeekV3Model,
        model_args=flavors,
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers_with_moe_load_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_peer_dataloader,
        build_tokenizer_fn=tokenizer_from_config,
        build_loss_fn=build_cross_entropy_loss,
        build_metrics_processor_fn=build_titan_metrics_processor,
    )


def register() -> None:
    """Register both peer specs once (idempotent)."""
    for name, (attn_type, attn_mask_type) in PEER_SPECS.items():
        try:
            get_train_spec(name)
        except ValueError:
            register_train_spec(name, get_peer_train_spec(attn_type, attn_mask_type))
