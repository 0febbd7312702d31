"""The work each context-parallel rank does under contiguous segments: FLOPs per rank by
the one formula of `step_flops`, with MLA's attention counted as the latent path runs it.

    python profiling/cp_balance.py                       # the tables of docs/parallelism.md
    python profiling/cp_balance.py --flavor k3 --seq 1048576 --cp 8 --corpus-rows 0

Rank r of cp holds tokens [r L, (r + 1) L). Everything but MLA's attention costs the same
per token on every rank (matmuls, KDA, the MoE). MLA's attention costs per attended (query,
key) pair; a rank's queries see the keys of their document up to themselves, so its pairs
are sum over its tokens t of (t - start(t) + 1): a rank late in a long document attends
over everything before it. In latent space (`titan_moe.context_parallel`) a pair costs
H * (2 R + S) multiply-adds (score against [c_kv, k_s], mix of c_kv) instead of the
layer's H * (d_qk + d_v); the per-token absorption (W_uk^T q, W_uv o_lat: H * R * (N + V)
multiply-adds) is balanced and counted with the matmuls. Backward counted as twice the
forward (x 6 per MAC), recompute not counted, as in `step_flops`.

Rows: one document filling the row, and rows of the built-in corpus as the loader packs
them (the first `--corpus-rows` rows). Printed per (flavor, T, cp, rows): MLA's share of the
mean rank's FLOPs, and max / mean rank FLOPs (the step waits for the slowest rank at every
layer's collectives, so this is the slowdown against a perfect balance), with MLA's
queries on their own rank (contiguous) and balanced ("headtail": each rank its own first
half-segment and its mirror rank cp - 1 - r's second one). The headtail column counts
FLOPs only, not the exchange that moves the second halves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_flops import flop_model_ours  # noqa: E402


def rank_pairs(doc_ids_T: torch.Tensor, cp: int, balance: str | None) -> list[int]:
    """Attended (query, key) pairs of each rank's MLA queries under the causal document
    mask: its own segment's queries (balance None) or its first half-segment and its mirror
    rank's second one ("headtail", `titan_moe.context_parallel.headtail_blocks`)."""
    from titan_moe.context_parallel import headtail_blocks
    from titan_moe.ops.attention import doc_starts

    T = doc_ids_T.shape[0]
    pos = torch.arange(T)
    seen = pos - doc_starts(doc_ids_T[None])[0].long() + 1
    if balance is None:
        return seen.view(cp, T // cp).sum(1).tolist()
    blocks = seen.view(2 * cp, T // (2 * cp)).sum(1)
    return [int(sum(blocks[j] for j in headtail_blocks(r, cp))) for r in range(cp)]


def rank_flops(args, T: int, cp: int, doc_ids_BT: torch.Tensor, balance: str | None) -> tuple[list[float], float]:
    """FLOPs per rank for the rows `doc_ids_BT`, and MLA attention's share of the mean."""
    fm = flop_model_ours(args)
    L = T // cp
    n_mla = args.layer_kinds().count("mla")
    H, R, S = args.mla_n_heads, args.mla_kv_lora_rank, args.mla_qk_shared_dim
    absorb = 6 * H * R * (args.mla_qk_nope_head_dim + args.mla_v_head_dim) * n_mla
    per_row_balanced = fm.matmul_flops(L) + fm.linear_attention_flops(L) + absorb * L
    per_pair = 6 * H * (2 * R + S) * n_mla
    ranks = [0.0] * cp
    mla = 0.0
    for row in doc_ids_BT:
        for r, pairs in enumerate(rank_pairs(row, cp, balance)):
            ranks[r] += per_row_balanced + per_pair * pairs
            mla += per_pair * pairs
    return ranks, mla / sum(ranks)


def corpus_rows(T: int, n: int) -> torch.Tensor:
    from titan_moe.config import load_config
    from titan_moe.data.from_config import dataloader_from_config, tokenizer_from_config

    repo = Path(__file__).resolve().parents[1]
    config = load_config(["--job.config_file", str(repo / "configs" / "debug_cpu.toml"),
                          "--training.seq_len", str(T), "--training.local_batch_size", "1",
                          "--training.global_batch_size", "1"])
    loader = dataloader_from_config(config, tokenizer=tokenizer_from_config(config), split="train", dp_rank=0,
                                    dp_world_size=1)
    return torch.cat([batch["doc_ids"] for (batch, _), _ in zip(loader, range(n))])


def main(argv: list[str] | None = None) -> None:
    from titan_moe.flavors import FLAVORS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="small_1gpu", choices=sorted(FLAVORS))
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--corpus-rows", type=int, default=4, help="built-in corpus rows per length (0: none)")
    opts = parser.parse_args(argv)
    args = FLAVORS[opts.flavor]
    print("| flavor | T | rows | cp | MLA attention share | max / mean, contiguous | per rank (/ mean) "
          "| max / mean, headtail |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for T in opts.seq:
        mixes = {"one document": torch.zeros(1, T, dtype=torch.int32)}
        if opts.corpus_rows:
            mixes[f"corpus x {opts.corpus_rows}"] = corpus_rows(T, opts.corpus_rows)
        for label, ids in mixes.items():
            for cp in opts.cp:
                ranks, share = rank_flops(args, T, cp, ids, None)
                balanced, _ = rank_flops(args, T, cp, ids, "headtail")
                mean = sum(ranks) / cp
                per = " ".join(f"{r / mean:.2f}" for r in ranks)
                print(f"| {opts.flavor} | {T} | {label} | {cp} | {share:.1%} | {max(ranks) / mean:.3f} | {per} "
                      f"| {max(balanced) / mean:.3f} |")


if __name__ == "__main__":
    main()
