"""Build the configured model on the meta device and print its parameter counts.

    python -m titan_moe.inspect --job.config_file configs/k3.toml

Prints per-component counts, then, as the last line, one JSON object with
`total_params`, `active_params`, `active_params_excluding_embedding`, the layer mix and
training FLOPs per token at the configured sequence length.
"""

from __future__ import annotations

import torch

from titan_moe.config import load_config, model_args_from_config, run_json_cli
from titan_moe.model.decoder import Decoder
from titan_moe.model.flops import count_params, flops_per_token


def inspect_model(argv: list[str] | None = None) -> dict:
    config = load_config(argv)
    args = model_args_from_config(config)
    with torch.device("meta"):
        model = Decoder(args)
    counts = count_params(model, args)
    kinds = args.layer_kinds()
    print(f"model: {config.model.name} flavor={config.model.flavor}  layers={args.n_layers} "
          f"(kda={kinds.count('kda')}, mla={kinds.count('mla')}, dense ffn={args.n_dense_layers})")
    width = max(len(k) for k in counts.by_component)
    for name, n in sorted(counts.by_component.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<{width}}  {n:>20,}  {100 * n / counts.total:6.2f}%")
    print(f"  {'total':<{width}}  {counts.total:>20,}")
    print(f"  {'active':<{width}}  {counts.active:>20,}")
    print(f"  {'active (no input embedding)':<{width}}  {counts.active_excluding_embedding:>20,}")
    flops = flops_per_token(args, config.training.seq_len)
    # Matmul FLOPs (6 x active matmul parameters) over all training FLOPs: how much of a step
    # float8 GEMMs can speed up at most (the output head and router included here).
    matmul_share = 6 * counts.active_excluding_embedding / flops
    print(f"  training FLOPs per token {flops:,} at seq_len {config.training.seq_len}; "
          f"matmul share {100 * matmul_share:.1f}%")
    return {
        "total_params": counts.total,
        "active_params": counts.active,
        "active_params_excluding_embedding": counts.active_excluding_embedding,
        "embedding_params": counts.embedding,
        "routed_expert_params": counts.routed_experts,
        "n_kda_layers": kinds.count("kda"),
        "n_mla_layers": kinds.count("mla"),
        "flops_per_token": flops,
        "matmul_flops_share": matmul_share,
        "seq_len": config.training.seq_len,
    }


def main(argv: list[str] | None = None) -> None:
    run_json_cli("titan_moe.inspect", inspect_model, argv)


if __name__ == "__main__":
    main()
