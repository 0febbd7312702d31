"""How well can any frozen expert bias balance held-out batches? A trained model's bound.

    python scripts/balance_bound.py --job.config_file configs/debug_cpu.toml \\
        --checkpoint outputs/debug_cpu/checkpoint/step-60 [--val-batches 8] [--train-batches 8]

At inference the expert bias is frozen (SPEC §5), so the load of a held-out batch depends on
what its documents hold. This routes held-out batches (the validation split, as validation
reads it) and training batches through the model in eval mode with its frozen bias, keeps
every MoE layer's router scores, and then asks, per layer, what load balance other fixed
biases would give on the held-out half B of the batches:

    frozen     the checkpoint's bias (what validation's `eval/moe/max_violation_*` measures)
    train_fit  the bias that balances the training batches, pooled (exact quantile
               balancing, iterated from the frozen bias): the best a bias fitted on training
               data can transfer
    cross_fit  the bias that balances the other held-out half A: the best any fixed bias
               fitted on held-out text of the same kind transfers to new batches
    oracle     the bias fitted on B itself (near 0 by construction: the floor)

Load balance as validation logs it: per layer `max load / mean load - 1` over the tokens of
all of B's batches pooled, then the mean and the max over layers; `per_batch` is the same
measured batch by batch and averaged. Only the layer's own selection changes with the bias:
its scores are those of the frozen routing of the layers before it (the bias moves which
experts a token reaches, so later layers' inputs would move a little too).

If `cross_fit` is far above `oracle` and near `frozen`, no fixed bias balances new batches:
their imbalance is set by their content, not by how the bias was learned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from titan_moe.model.moe import LatentMoE, expert_counts, load_metrics, quantile_balance, route  # noqa: E402

CONDITIONS = ("frozen", "train_fit", "cross_fit", "oracle")


def violation(scores: list[torch.Tensor], bias_n: torch.Tensor, top_k: int) -> float:
    """`max load / mean load - 1` of the batches' tokens pooled, routed with `bias_n`."""
    load_n = sum(expert_counts(route(s, bias_n, top_k)[0], bias_n.numel()) for s in scores)
    return float(load_metrics(load_n)[0])


def fit_bias(scores: list[torch.Tensor], bias_n: torch.Tensor, top_k: int, iters: int = 4) -> torch.Tensor:
    """The bias that balances the batches' tokens pooled: `iters` passes of exact quantile
    balancing (each pass re-ranks with the bias of the one before), from `bias_n`."""
    pooled = torch.cat(scores)
    bias = bias_n.float()
    for _ in range(iters):
        bias = quantile_balance(pooled, bias, top_k)
    return bias


def layer_bounds(train: list[torch.Tensor], val: list[torch.Tensor], frozen_n: torch.Tensor,
                 top_k: int) -> dict[str, dict[str, float]]:
    """Per condition, the pooled and the per-batch violation on held-out half B (the second
    half of `val`; with `cross_fit` also the first half A scored on a bias fitted on B, and the
    two averaged)."""
    half = len(val) // 2
    if half < 1:
        raise ValueError(f"need at least 2 held-out batches, got {len(val)}")
    a, b = val[:half], val[half:]
    biases = {"frozen": frozen_n.float(), "train_fit": fit_bias(train, frozen_n, top_k)}
    out: dict[str, dict[str, float]] = {}
    for name in CONDITIONS:
        if name == "cross_fit":
            pairs = [(fit_bias(a, frozen_n, top_k), b), (fit_bias(b, frozen_n, top_k), a)]
        elif name == "oracle":
            pairs = [(fit_bias(b, frozen_n, top_k), b)]
        else:
            pairs = [(biases[name], b)]
        pooled = [violation(held, bias, top_k) for bias, held in pairs]
        per_batch = [violation([s], bias, top_k) for bias, held in pairs for s in held]
        out[name] = {"pooled": sum(pooled) / len(pooled), "per_batch": sum(per_batch) / len(per_batch)}
    return out


@torch.no_grad()
def collect_scores(model, batches, device) -> list[list[torch.Tensor]]:
    """Per MoE layer, the router scores [N, n] (fp32, on the CPU) of each batch, routed in
    eval mode with the frozen bias."""
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    per_layer: list[list[torch.Tensor]] = [[] for _ in moes]
    originals = [m.router.scores for m in moes]

    def keeper(i, scores_fn):
        def scores(x_ND):
            s = scores_fn(x_ND)
            per_layer[i].append(s.float().cpu())
            return s
        return scores

    try:
        for i, m in enumerate(moes):
            m.router.scores = keeper(i, originals[i])
        model.eval()
        for inputs, _ in batches:
            model(inputs["input"].to(device), inputs["doc_ids"].to(device))
    finally:
        for m in moes:
            del m.router.scores  # the instance attribute set above; the method shows again
    return per_layer


def take(loader, n: int) -> list:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def summarize(bounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per condition: the mean and the max over layers of the pooled violation, and the mean
    over layers of the per-batch one."""
    table = {}
    for name in CONDITIONS:
        pooled = [b[name]["pooled"] for b in bounds]
        table[name] = {"mean_over_layers": sum(pooled) / len(pooled), "max_over_layers": max(pooled),
                       "per_batch_mean": sum(b[name]["per_batch"] for b in bounds) / len(bounds)}
    return table


def format_table(table: dict[str, dict[str, float]]) -> str:
    lines = ["| bias | held-out violation, mean over layers | max over layers | per batch, mean |",
             "| --- | --- | --- | --- |"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['mean_over_layers']:.3f} | {row['max_over_layers']:.3f} | "
                     f"{row['per_batch_mean']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from titan_moe.config import ConfigError, load_config
    from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config
    from titan_moe.evaluate import load_for_evaluation

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None,
                        help="a step-N folder of a DCP checkpoint (default: initial weights)")
    parser.add_argument("--val-batches", type=int, default=8, help="held-out batches (split in halves A and B)")
    parser.add_argument("--train-batches", type=int, default=8, help="training batches for train_fit")
    parser.add_argument("--json", default="", help="also write the table and the per-layer numbers here")
    ours, rest = parser.parse_known_args(argv)
    try:
        if ours.val_batches < 2 or ours.train_batches < 1:
            raise ValueError("--val-batches must be >= 2 and --train-batches >= 1")
        config = load_config(rest)
        tokenizer = tokenizer_from_config(config)
        val = take(dataloader_from_config(config, tokenizer=tokenizer, split="val", dp_rank=0, dp_world_size=1),
                   ours.val_batches)
        train = take(dataloader_from_config(config, tokenizer=tokenizer, split="train", dp_rank=0, dp_world_size=1),
                     ours.train_batches)
        if len(val) < 2:
            raise ValueError(f"the held-out split gives {len(val)} batch(es); need 2 "
                             "(lower validation.local_batch_size)")
    except (ConfigError, ValueError) as e:
        print(f"balance_bound: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_for_evaluation(config, ours.checkpoint, device)
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    if not moes:
        print("balance_bound: error: the model has no MoE layer", file=sys.stderr)
        raise SystemExit(2)
    val_scores, train_scores = collect_scores(model, val, device), collect_scores(model, train, device)
    bounds = [layer_bounds(t, v, m.expert_bias.detach().float().cpu(), m.top_k)
              for t, v, m in zip(train_scores, val_scores, moes)]
    table = summarize(bounds)
    tokens = sum(x["input"].numel() for x, _ in val)
    print(f"{len(moes)} MoE layers; {len(val)} held-out batches ({tokens} tokens; halves A and B), "
          f"{len(train)} training batches; checkpoint {ours.checkpoint or '(initial weights)'}")
    print(format_table(table))
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump({"table": table, "layers": bounds, "checkpoint": ours.checkpoint}, f, indent=1)


if __name__ == "__main__":
    main()
