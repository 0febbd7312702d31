"""Expert balance rules replayed on the router scores of one recorded training run.

    # 1. train as usual, recording every step's router scores per MoE layer, and every 5 steps
    #    those of 4 held-out batches in eval mode (routed with the frozen bias) and their loss
    python profiling/balance_replay.py record OUT/scores.pt --job.config_file configs/debug_cpu.toml \\
        --metrics.log_freq 5 --validation.no_enable --checkpoint.no_enable
    # 2. replay the balance rules on those scores
    python profiling/balance_replay.py replay OUT/scores.pt [--from-step 30] [--batch-tokens 2048]

The replay gives, per rule, the per-layer-mean max violation (max load / mean load - 1) of
each training batch routed with the bias that rule would have had (averaged over the steps
recorded with held-out scores from `--from-step`), and of the held-out batches (cut into
`--batch-tokens` pieces) routed with the rule's frozen bias; then two floors: one bias fitted
in hindsight to all training batches from `--from-step`, judged per batch, and one fitted to
the held-out batches together. The router does not feel the replayed bias (no feedback), so
the replay of the rule that was recorded reproduces the run and the others approximate theirs.
Single process, one microbatch a step (the recorded scores of all microbatches are joined).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # the checkout's titan_moe, as `python -m` would use

from titan_moe.model.moe import LatentMoE, expert_counts, quantile_balance  # noqa: E402

VAL_EVERY, VAL_BATCHES = 5, 4


def record(out: str, argv: list[str]) -> None:
    import titan_moe.train as train
    from titan_moe.data.from_config import dataloader_from_config

    rec: dict = {"train": [], "val": {}, "val_loss": {}, "bias": {}, "top_k": None}
    step_scores: dict[int, list[torch.Tensor]] = {}
    accumulate, train_step = LatentMoE._accumulate, train.TitanTrainer.train_step

    def recording_accumulate(self, scores_Nn, counts_E):
        step_scores.setdefault(id(self), []).append(scores_Nn.clone())
        accumulate(self, scores_Nn, counts_E)

    def recording_train_step(self, data_iterator):
        step_scores.clear()
        train_step(self, data_iterator)
        model = self.model_parts[0]
        moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        rec["top_k"] = moes[0].top_k
        rec["train"].append([torch.cat(step_scores[id(m)]) for m in moes])
        if self.step % VAL_EVERY == 0:
            _record_held_out(self, model, moes, rec, dataloader_from_config)
        if self.step == self.job_config.training.steps:
            torch.save(rec, out)

    LatentMoE._accumulate = recording_accumulate
    train.TitanTrainer.train_step = recording_train_step
    train.main(argv)


def _record_held_out(trainer, model, moes, rec, dataloader_from_config) -> None:
    if not hasattr(trainer, "_replay_batches"):
        loader = dataloader_from_config(trainer.job_config, tokenizer=trainer.tokenizer, split="val",
                                        dp_rank=0, dp_world_size=1)
        trainer._replay_batches = [b for _, b in zip(range(VAL_BATCHES), loader)]
    caught: dict[int, list[torch.Tensor]] = {}
    hooks = [m.router.register_forward_hook(
        lambda mod, args, out, i=i: caught.setdefault(i, []).append(out[0].detach().clone()))
        for i, m in enumerate(moes)]
    model.eval()
    losses = []
    with torch.no_grad():
        for input_dict, labels in trainer._replay_batches:
            extra = {k: v for k, v in input_dict.items() if k != "input"}
            logits = model(input_dict["input"], **extra)
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item())
    model.train()
    for hook in hooks:
        hook.remove()
    rec["val"][trainer.step] = [torch.cat(caught[i]) for i in range(len(moes))]
    rec["val_loss"][trainer.step] = sum(losses) / len(losses)
    rec["bias"][trainer.step] = [m.expert_bias.clone() for m in moes]


def _violation(scores_mn: torch.Tensor, bias_n: torch.Tensor, k: int) -> float:
    load = expert_counts(torch.topk(scores_mn + bias_n, k, -1).indices, scores_mn.shape[1]).double()
    return (load.max() / load.mean() - 1).item()


def _held_out(scores_mn, bias_n, k, batch_tokens) -> float:
    pieces = scores_mn.split(batch_tokens)
    return sum(_violation(p, bias_n, k) for p in pieces) / len(pieces)


def replay_rule(rec, rule: str, ema: float, passes: int, gamma: float, from_step: int, batch_tokens: int):
    """(training-batch, held-out) violation of one rule, averaged over layers and the held-out steps."""
    k, layers = rec["top_k"], len(rec["train"][0])
    steps = [s for s in sorted(rec["val"]) if s >= from_step]
    train_v, held_v = [], []
    for layer in range(layers):
        n = rec["train"][0][layer].shape[1]
        bias = torch.zeros(n)
        for t, scores in enumerate(rec["train"]):
            step, s = t + 1, scores[layer]
            if rule == "in-batch":
                routed = bias
                for _ in range(passes):
                    routed = quantile_balance(s, routed, k)
                new = routed
            else:
                routed = bias
                if rule == "sign":
                    load = expert_counts(torch.topk(s + bias, k, -1).indices, n).double()
                    new = bias + gamma * torch.sign(load.mean() - load).float()
                    new = new - new.mean()
                else:
                    new = bias
                    for _ in range(passes):
                        new = quantile_balance(s, new, k)
            if step in steps:
                train_v.append(_violation(s, routed, k))
            bias = new if rule == "sign" else ema * bias + (1 - ema) * new
            if step in steps:
                held_v.append(_held_out(rec["val"][step][layer], bias, k, batch_tokens))
    return sum(train_v) / len(train_v), sum(held_v) / len(held_v)


def replay(path: str, from_step: int, batch_tokens: int) -> None:
    rec = torch.load(path)
    k, layers = rec["top_k"], len(rec["train"][0])
    rules = [("sign, gamma 1e-3", "sign", 0, 0, 1e-3), ("sign, gamma 1e-2", "sign", 0, 0, 1e-2)]
    for ema in (0.0, 0.5, 0.9):
        rules += [(f"QB lag, EMA {ema}", "lag", ema, 1, 0), (f"QB lag, EMA {ema}, 3 passes", "lag", ema, 3, 0)]
    for ema in (0.5, 0.9):
        rules += [(f"QB in-batch, {p} pass(es), EMA {ema}", "in-batch", ema, p, 0) for p in (1, 2, 3)]
    print(f"| rule | training batches, steps >= {from_step} | held-out, frozen bias |\n| --- | --- | --- |")
    for name, rule, ema, passes, gamma in rules:
        tr, ho = replay_rule(rec, rule, ema, passes, gamma, from_step, batch_tokens)
        print(f"| {name} | {tr:.3f} | {ho:.3f} |")
    steps = [s for s in sorted(rec["val"]) if s >= from_step]
    train_floor, held_floor = [], []
    for layer in range(layers):
        union = torch.cat([rec["train"][s - 1][layer] for s in range(from_step, len(rec["train"]) + 1)])
        bias = torch.zeros(union.shape[1])
        for _ in range(5):
            bias = quantile_balance(union, bias, k)
        train_floor += [_violation(rec["train"][s - 1][layer], bias, k) for s in steps]
        for s in steps:
            bias = torch.zeros(union.shape[1])
            for _ in range(5):
                bias = quantile_balance(rec["val"][s][layer], bias, k)
            held_floor.append(_held_out(rec["val"][s][layer], bias, k, batch_tokens))
    print(f"\nfloor, training: one bias fitted to all batches from step {from_step}, per batch: "
          f"{sum(train_floor) / len(train_floor):.3f}")
    print(f"floor, held-out: one bias fitted to the held-out batches of a step, per batch: "
          f"{sum(held_floor) / len(held_floor):.3f}")
    print("held-out loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in sorted(rec["val_loss"].items())))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "record":
        if len(sys.argv) < 3:
            sys.exit("usage: balance_replay.py record OUT.pt TRAINER_ARGS...")
        record(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["replay"])
    parser.add_argument("path")
    parser.add_argument("--from-step", type=int, default=30)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    args = parser.parse_args()
    replay(args.path, args.from_step, args.batch_tokens)


if __name__ == "__main__":
    main()
