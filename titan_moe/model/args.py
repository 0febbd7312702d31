"""Model hyper-parameters for the hybrid KDA/MLA sparse MoE decoder (SPEC §1-§7).

`ModelArgs` is the single source of truth for every layer's shapes. It is a plain
dataclass so that the model folder stays importable without the trainer; the trainer
fills it from the TOML `[titan_model]` section (see `titan_moe.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

AttnResMode = Literal["block", "full", "none"]
BalanceRule = Literal["qb", "sign", "aux_loss"]
ExpertActivation = Literal["situ", "swiglu"]
KDAGate = Literal["bounded", "unbounded"]
MLAAttention = Literal["auto", "varlen", "chunked", "dense"]


@dataclass
class ModelArgs:
    # --- trunk ---
    vocab_size: int = 4096
    dim: int = 256
    n_layers: int = 8
    norm_eps: float = 1e-6
    init_std: float = 0.02

    # --- layer schedule (SPEC §3) ---
    # 0-based indices of MLA layers. Empty list: use `mla_every` (every k-th layer,
    # 1-based positions k, 2k, ...) and always make the last layer MLA.
    mla_layers: list[int] = field(default_factory=list)
    mla_every: int = 4
    n_dense_layers: int = 1  # the first n layers use the dense SiTU-GLU FFN

    # --- KDA (SPEC §1) ---
    kda_n_heads: int = 4
    kda_head_dim: int = 64  # dk = dv
    kda_conv_size: int = 4
    kda_g_min: float = -5.0
    # "bounded": g = kda_g_min * sigmoid(exp(A_log) * (z + dt_bias)), in [kda_g_min, 0) (SPEC §1);
    # "unbounded": g = -exp(A_log) * softplus(z + dt_bias), no lower bound (the older form, for
    # ablation): runs the PyTorch KDA path only (kernels.kda = torch; "auto" is set to it), whose
    # fp32 exponentials stay finite while the decay averages under about 11 per token over 8 tokens
    kda_gate: KDAGate = "bounded"

    # --- gated NoPE MLA (SPEC §2) ---
    mla_n_heads: int = 4
    mla_q_lora_rank: int = 128
    mla_kv_lora_rank: int = 64
    mla_qk_nope_head_dim: int = 32
    mla_qk_shared_dim: int = 16  # K3: 64 shared, unrotated key dims (the "rope" dims of DeepSeek)
    mla_v_head_dim: int = 32
    # How MLA attends over packed documents (`titan_moe.model.mla`): "auto" (varlen on CUDA,
    # chunked elsewhere), "varlen" (one variable-length FlashAttention-2 call, CUDA),
    # "chunked" (exact query-chunked op, any device), "dense" (SDPA with a [B, 1, T, T] mask;
    # T^2 memory).
    mla_attention: MLAAttention = "auto"

    # --- AttnRes (SPEC §4) ---
    attn_res: AttnResMode = "block"
    attn_res_block_size: int = 2  # layers per block (K3: 12)

    # --- MoE (SPEC §5, §6) ---
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    moe_latent_dim: int = 128  # K3: d/2
    moe_expert_hidden: int = 256  # routed expert hidden width (K3: 3072)
    moe_shared_hidden: int = 256  # shared expert hidden width (K3: 3072)
    dense_hidden: int = 768  # dense first-layer FFN hidden width (K3: 33792)
    routed_scale: float = 1.0
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0
    # GLU activation of the routed and shared experts: "situ" (SiTU-GLU, SPEC §6) or "swiglu"
    # (silu(z_g) * z_u, plain PyTorch on every device; for ablation). The dense first layer keeps SiTU-GLU.
    expert_activation: ExpertActivation = "situ"
    # 0: off. N > 0: each MoE layer processes its flattened tokens in tiles of at most N tokens,
    # each tile (routing, dispatch, routed and shared experts, combine) under its own activation
    # checkpoint while grad is enabled, so a layer's backward holds one tile's MoE activations
    # instead of all tokens'. Same outputs, gradients and balance statistics as untiled (routing is
    # per token given the bias). Cost: the MoE forward is computed once more in the backward, on
    # top of the layer's own activation-checkpoint recompute (eager; in a compiled layer the two
    # recomputes merge into one: the expert GEMMs ran once per tile in the backward, as untiled
    # under full AC); the router runs once more over all tokens for balance_rule = "aux_loss" or
    # qb_batch_iters > 0 (their whole-batch statistics come before the tiles); a compiled layer
    # traces the MoE once per tile (compile time grows with the tile count). Not with expert
    # parallelism or compile.moe_regions = "piecewise".
    moe_token_tile: int = 0
    # Tokens per chunk of the output head and its loss in training (0: the whole logits at once).
    # The trainer then hands the labels to the model, which returns the summed cross-entropy
    # without ever holding [T, vocab] logits: fp32 logits, log-softmax and gradient cost about
    # 12 * vocab bytes a token whole (48 GiB at 1M tokens, vocab 4096), one chunk's when set.
    # Cost: the head's matmul once more in the backward.
    head_chunk_tokens: int = 0

    # --- balancing (SPEC §5) ---
    # "qb" (quantile balancing), "sign" (DeepSeek-V3's bias rule) or "aux_loss" (no bias: the
    # Switch/GShard auxiliary loss, weighted by aux_loss_coef; for ablation)
    balance_rule: BalanceRule = "qb"
    qb_bins: int = 0  # 0: exact per-expert quantile; >0: histogram with this many bins
    qb_ema: float = 0.0  # 0: no EMA; else b <- ema*b_old + (1-ema)*b_new
    # 0: the bias fitted to one step routes the next (the lag form); >0: in training, each batch
    # is routed with the bias fitted to itself by this many QB passes (expert_bias: their EMA,
    # frozen at inference). The GPU flavors use 2: the lag form does not hold balance in
    # training at 32K tokens a step (SPEC §5, BENCHMARKS.md "Ablations"); the debug flavor and
    # bare ModelArgs keep 0.
    qb_batch_iters: int = 0
    sign_gamma: float = 1e-3  # DeepSeek-V3 sign rule step size
    # balance_rule = "aux_loss": weight of each MoE layer's auxiliary loss E * Σ_e f_e P_e in the
    # training objective (`titan_moe.model.moe.aux_balance_loss`). 1e-2 is Switch Transformer's
    # value, chosen there as balancing without hurting quality; with no bias rule beside it the loss
    # must balance on its own (DeepSeek-V3's 1e-4 only complements its bias rule).
    aux_loss_coef: float = 1e-2

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the offending field for inconsistent settings."""
        positive = [
            "vocab_size", "dim", "n_layers", "kda_n_heads", "kda_head_dim", "kda_conv_size",
            "mla_n_heads", "mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_nope_head_dim",
            "mla_v_head_dim", "n_routed_experts", "top_k", "moe_latent_dim",
            "moe_expert_hidden", "dense_hidden", "mla_every", "attn_res_block_size",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if not -5.0 <= self.kda_g_min < 0.0:
            raise ValueError(f"model.kda_g_min must lie in [-5, 0), got {self.kda_g_min}")
        if self.top_k > self.n_routed_experts:
            raise ValueError(
                f"model.top_k ({self.top_k}) exceeds model.n_routed_experts ({self.n_routed_experts})"
            )
        if self.attn_res not in ("block", "full", "none"):
            raise ValueError(f"model.attn_res must be block|full|none, got {self.attn_res!r}")
        if self.mla_attention not in ("auto", "varlen", "chunked", "dense"):
            raise ValueError(f"model.mla_attention must be auto|varlen|chunked|dense, got {self.mla_attention!r}")
        if self.balance_rule not in ("qb", "sign", "aux_loss"):
            raise ValueError(f"model.balance_rule must be qb|sign|aux_loss, got {self.balance_rule!r}")
        if not 0.0 < self.aux_loss_coef <= 1.0:
            raise ValueError(f"model.aux_loss_coef must lie in (0, 1], got {self.aux_loss_coef}")
        if self.expert_activation not in ("situ", "swiglu"):
            raise ValueError(f"model.expert_activation must be situ|swiglu, got {self.expert_activation!r}")
        if self.kda_gate not in ("bounded", "unbounded"):
            raise ValueError(f"model.kda_gate must be bounded|unbounded, got {self.kda_gate!r}")
        if self.qb_bins < 0:
            raise ValueError(f"model.qb_bins must be >= 0, got {self.qb_bins}")
        if self.moe_token_tile < 0:
            raise ValueError(f"model.moe_token_tile must be >= 0 (0: off), got {self.moe_token_tile}")
        if self.head_chunk_tokens < 0:
            raise ValueError(f"model.head_chunk_tokens must be >= 0 (0: off), got {self.head_chunk_tokens}")
        if self.qb_batch_iters < 0:
            raise ValueError(f"model.qb_batch_iters must be >= 0, got {self.qb_batch_iters}")
        if not 0.0 <= self.qb_ema < 1.0:
            raise ValueError(f"model.qb_ema must lie in [0, 1), got {self.qb_ema}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"model.n_dense_layers must lie in [0, n_layers], got {self.n_dense_layers}")
        bad = [i for i in self.mla_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"model.mla_layers has indices outside [0, {self.n_layers}): {bad}")

    def layer_kinds(self) -> list[str]:
        """'kda' or 'mla' per layer (0-based), following SPEC §3."""
        if self.mla_layers:
            mla = set(self.mla_layers)
        else:
            mla = {i for i in range(self.n_layers) if (i + 1) % self.mla_every == 0}
            mla.add(self.n_layers - 1)
        return ["mla" if i in mla else "kda" for i in range(self.n_layers)]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.n_dense_layers

    # --- torchtitan BaseModelArgs protocol (duck-typed: the model folder does not import
    # the trainer) ---
    def update_from_config(self, job_config, **kwargs) -> None:
        """Apply the `[model]` fields that the job config sets (None means: keep)."""
        for f in fields(self):
            value = getattr(job_config.model, f.name, None)
            if value is not None:
                setattr(self, f.name, value)
        self.validate()

    def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
        from titan_moe.model.flops import count_params, flops_per_token

        return count_params(model, self).total, flops_per_token(self, seq_len)
