"""Named model presets (`model.flavor`); a TOML `[model]` section overrides single fields."""

from __future__ import annotations

from titan_moe.model.args import ModelArgs

FLAVORS: dict[str, ModelArgs] = {
    # Trains on two CPU cores in minutes; every feature on (KDA, MLA, AttnRes, QB, latent MoE, SiTU).
    "debug": ModelArgs(
        vocab_size=4096, dim=128, n_layers=4, n_dense_layers=1,
        kda_n_heads=4, kda_head_dim=32,
        mla_n_heads=4, mla_q_lora_rank=64, mla_kv_lora_rank=32, mla_qk_nope_head_dim=32,
        mla_qk_shared_dim=16, mla_v_head_dim=32,
        attn_res="block", attn_res_block_size=2,
        n_routed_experts=8, top_k=2, n_shared_experts=1,
        moe_latent_dim=64, moe_expert_hidden=128, moe_shared_hidden=128, dense_hidden=384,
        # Each debug step routes only 2K tokens from one or two documents, so the best bias
        # for one batch over-fits it; averaging the QB bias over steps halves that noise.
        qb_ema=0.5,
    ),
    # About 1B total parameters; 8K context on one H200.
    "small_1gpu": ModelArgs(
        vocab_size=4096, dim=1024, n_layers=16, n_dense_layers=1,
        kda_n_heads=8, kda_head_dim=128,
        mla_n_heads=8, mla_q_lora_rank=512, mla_kv_lora_rank=256, mla_qk_nope_head_dim=128,
        mla_qk_shared_dim=64, mla_v_head_dim=128,
        attn_res="block", attn_res_block_size=4,
        n_routed_experts=64, top_k=8, n_shared_experts=1,
        moe_latent_dim=512, moe_expert_hidden=768, moe_shared_hidden=1536, dense_hidden=4096,
        qb_ema=0.5, qb_bins=1000, qb_batch_iters=2,
    ),
    # About 150M parameters (16 experts, top-2): the one-GPU context ladder 8K -> 32K -> 128K
    # (configs/ladder_1gpu.toml).
    "ladder_1gpu": ModelArgs(
        vocab_size=4096, dim=640, n_layers=12, n_dense_layers=1,
        kda_n_heads=5, kda_head_dim=128,
        mla_n_heads=5, mla_q_lora_rank=384, mla_kv_lora_rank=256, mla_qk_nope_head_dim=128,
        mla_qk_shared_dim=64, mla_v_head_dim=128,
        attn_res="block", attn_res_block_size=4,
        n_routed_experts=16, top_k=2, n_shared_experts=1,
        moe_latent_dim=320, moe_expert_hidden=512, moe_shared_hidden=1280, dense_hidden=2560,
        qb_ema=0.5, qb_bins=1000, qb_batch_iters=2,
    ),
    # Width 4096 on one H200: a model whose step is mostly expert and linear GEMMs, for
    # measuring float8 training speed (configs/wide_1gpu.toml).
    "wide_1gpu": ModelArgs(
        vocab_size=4096, dim=4096, n_layers=8, n_dense_layers=1,
        kda_n_heads=16, kda_head_dim=128,
        mla_n_heads=16, mla_q_lora_rank=1024, mla_kv_lora_rank=512, mla_qk_nope_head_dim=128,
        mla_qk_shared_dim=64, mla_v_head_dim=128,
        attn_res="block", attn_res_block_size=4,
        n_routed_experts=16, top_k=4, n_shared_experts=1,
        moe_latent_dim=2048, moe_expert_hidden=4096, moe_shared_hidden=4096, dense_hidden=11264,
        qb_ema=0.5, qb_bins=1000, qb_batch_iters=2,
    ),
    # Kimi K3 at paper scale (SPEC §7). Build it on the meta device only.
    "k3": ModelArgs(
        vocab_size=163_840, dim=7168, n_layers=93, n_dense_layers=1,
        kda_n_heads=96, kda_head_dim=128,
        mla_n_heads=96, mla_q_lora_rank=1536, mla_kv_lora_rank=512, mla_qk_nope_head_dim=128,
        mla_qk_shared_dim=64, mla_v_head_dim=128,
        attn_res="block", attn_res_block_size=12,
        n_routed_experts=896, top_k=16, n_shared_experts=2,
        moe_latent_dim=3584, moe_expert_hidden=3072, moe_shared_hidden=3072, dense_hidden=33792,
        qb_bins=1000, qb_batch_iters=2,
    ),
}
