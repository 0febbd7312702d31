"""Long-context evaluations: passkey retrieval, MQAR and held-out loss by position.

    python -m titan_moe.evaluate --job.config_file configs/ladder_cpu.toml \\
        --checkpoint outputs/ladder_cpu/checkpoint/step-125 [--lengths 256,1024,4096] [--samples 4]

  passkey      a 5-digit key hidden in real filler text (the held-out split) at each depth of
               `ladder.eval_depths`, asked for at the end; accuracy by context length and depth.
  mqar         `ladder.eval_mqar_pairs` key-value pairs spread over the context, every key
               asked for at the end; accuracy over all questions, by length.
  copy         random words, then the same words again (the training task "copy"): the share
               of the repeat's tokens after its first that the argmax predicts, by length.
               A token-level measure of copying, which retrieval needs and shows before it.
  loss_by_pos  held-out documents of at least `seq_len + 1` tokens (the corpus's and the long
               documents' val split and the packages at `ladder.eval_packages_path`, longest
               first, `ladder.eval_loss_docs` of them), each
               evaluated from its start: mean loss per position bucket [0, 64), [64, 128),
               [128, 256), ... (doubling). Fewer such documents: the longest ones, shorter.

An answer counts when the model's argmax at every answer token is that token, which is what
greedy decoding would write. Tasks are drawn from fixed seeds, so two checkpoints meet the
same questions. The training run calls `run_evals` at each ladder stage's end; this command
evaluates any checkpoint. Results: one metrics.jsonl record (keys `eval/passkey/<len>/d<depth>`,
`eval/passkey/<len>`, `eval/mqar/<len>`, `eval/copy/<len>`, `eval/loss_by_pos/<lo>-<hi>`, with
`seq_len` and `step`), a table on stdout and `passkey_<step>.png`, a heatmap of accuracy by
length x depth (rows: lengths, columns: depths; black 0 to white 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import zlib
from typing import Callable, Sequence

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from titan_moe.data.packing import IGNORE_INDEX
from titan_moe.data.synthetic import Filler, copy_task, mqar_task, passkey_task, task_rng
from titan_moe.ladder import short_length

LogitsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # tokens [B, T], doc_ids [B, T] -> [B, T, V]
# (tokens [B, T], doc_ids [B, T], targets [B, T]) -> (argmax prediction [B, T] int64, cross-entropy
# of the targets [B, T] fp32, 0 where a target is IGNORE_INDEX), on the CPU: all an evaluation
# reads of the logits, 12 bytes a token where the logits are 4 V.
ScoresFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
EVAL_SEED = 1_000_003  # the evaluation's tasks never coincide with the training stream's
# Tokens of one evaluation forward: a cell's rows go through the model a few at a time, so the
# forward's activations stay bounded at long T (one row at a time from 128K tokens).
EVAL_FORWARD_TOKENS = 131_072


def rows_per_forward(length: int) -> int:
    return max(1, EVAL_FORWARD_TOKENS // length)


def model_scores_fn(model: torch.nn.Module, device: torch.device | str) -> ScoresFn:
    """The model's scores, its head computing the logits a chunk at a time
    (`OutputHead.token_scores`): never `[B, T, V]` logits at once."""
    def scores(tokens_BT: torch.Tensor, doc_ids_BT: torch.Tensor, targets_BT: torch.Tensor):
        pred_BT, loss_BT = model(tokens_BT.to(device), doc_ids_BT.to(device), labels=targets_BT.to(device),
                                 token_scores=True)
        return pred_BT.cpu(), loss_BT.float().cpu()

    return scores


def scores_from_logits(logits_fn: LogitsFn) -> ScoresFn:
    """A `ScoresFn` of a function giving whole logits (test models: oracles, uniform ones)."""
    def scores(tokens_BT: torch.Tensor, doc_ids_BT: torch.Tensor, targets_BT: torch.Tensor):
        logits = logits_fn(tokens_BT, doc_ids_BT).float()
        loss_BT = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets_BT.to(logits.device),
                                                    reduction="none", ignore_index=IGNORE_INDEX)
        return logits.argmax(-1).cpu(), loss_BT.cpu()

    return scores


def _predictions(scores_fn: ScoresFn, tasks) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_BT, argmax_BT) of equal-length tasks, each row one document."""
    tokens_BT = torch.tensor([t.tokens for t in tasks], dtype=torch.int64)
    preds = []
    for rows_bT in tokens_BT.split(rows_per_forward(tokens_BT.shape[1])):
        with torch.no_grad():
            ignored = torch.full_like(rows_bT, IGNORE_INDEX)
            preds.append(scores_fn(rows_bT, torch.zeros_like(rows_bT, dtype=torch.int32), ignored)[0])
    return tokens_BT, torch.cat(preds)


def _answer_hits(scores_fn: ScoresFn, tasks) -> list[list[bool]]:
    """Per task, per answer span: whether the argmax predicts every answer token."""
    tokens_BT, pred_BT = _predictions(scores_fn, tasks)
    out = []
    for b, task in enumerate(tasks):
        # the token at position i is predicted at position i - 1
        out.append([bool((pred_BT[b, s - 1 : e - 1] == tokens_BT[b, s:e]).all()) for s, e in task.answers])
    return out


def passkey_accuracy(scores_fn: ScoresFn, tokenizer, filler: Filler, lengths: Sequence[int],
                     depths: Sequence[float], samples: int, seed: int = EVAL_SEED) -> dict[tuple[int, float], float]:
    """(length, depth) -> fraction of `samples` passkeys retrieved."""
    out = {}
    for length in lengths:
        for depth in depths:
            tasks = [passkey_task(tokenizer, filler, length, task_rng(seed, i, f"passkey:{length}:{depth}"), depth)
                     for i in range(samples)]
            out[(length, depth)] = sum(h[0] for h in _answer_hits(scores_fn, tasks)) / samples
    return out


def mqar_accuracy(scores_fn: ScoresFn, tokenizer, filler: Filler, lengths: Sequence[int], samples: int,
                  n_pairs: int, seed: int = EVAL_SEED) -> dict[int, float]:
    """length -> fraction of all MQAR questions answered (`samples` tasks of `n_pairs` keys)."""
    out = {}
    for length in lengths:
        tasks = [mqar_task(tokenizer, filler, length, task_rng(seed, i, f"mqar:{length}"), n_pairs)
                 for i in range(samples)]
        hits = [h for task_hits in _answer_hits(scores_fn, tasks) for h in task_hits]
        out[length] = sum(hits) / len(hits)
    return out


def copy_accuracy(scores_fn: ScoresFn, tokenizer, filler: Filler, lengths: Sequence[int], samples: int,
                  seed: int = EVAL_SEED) -> dict[int, float]:
    """length -> share of the repeated tokens (all but each repeat's first, which nothing before
    it announces) whose argmax prediction is right, over `samples` copy tasks."""
    out = {}
    for length in lengths:
        tasks = [copy_task(tokenizer, filler, length, task_rng(seed, i, f"copy:{length}")) for i in range(samples)]
        tokens_BT, pred_BT = _predictions(scores_fn, tasks)
        hits = total = 0
        for b, task in enumerate(tasks):
            (start, end), = task.answers
            hits += int((pred_BT[b, start : end - 1] == tokens_BT[b, start + 1 : end]).sum())
            total += end - start - 1
        out[length] = hits / max(total, 1)
    return out


def position_buckets(seq_len: int, first: int = 64) -> list[tuple[int, int]]:
    """[0, first), [first, 2 first), [2 first, 4 first), ... up to seq_len."""
    edges = [0, first]
    while edges[-1] < seq_len:
        edges.append(edges[-1] * 2)
    edges = [e for e in edges if e < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def loss_by_position(scores_fn: ScoresFn, documents: Sequence[Sequence[int]], seq_len: int,
                     batch: int = 4) -> dict[tuple[int, int], tuple[float, int]]:
    """bucket -> (mean loss, tokens) over the first seq_len predictions of each document
    (`batch` documents a forward at most, fewer past `EVAL_FORWARD_TOKENS`)."""
    buckets = position_buckets(seq_len)
    sums = [0.0] * len(buckets)
    counts = [0] * len(buckets)
    docs = [list(d[: seq_len + 1]) for d in documents if len(d) >= 2]
    for length in sorted({len(d) for d in docs}, reverse=True):
        same = [d for d in docs if len(d) == length]
        rows = min(batch, rows_per_forward(length - 1))
        for i in range(0, len(same), rows):
            rows_BR = torch.tensor(same[i : i + rows], dtype=torch.int64)
            x_BT, y_BT = rows_BR[:, :-1], rows_BR[:, 1:]
            with torch.no_grad():
                loss_BT = scores_fn(x_BT, torch.zeros_like(x_BT, dtype=torch.int32), y_BT)[1]
            for j, (lo, hi) in enumerate(buckets):
                part = loss_BT[:, lo:hi]
                sums[j] += float(part.sum())
                counts[j] += part.numel()
    return {b: (sums[j] / counts[j] if counts[j] else math.nan, counts[j]) for j, b in enumerate(buckets)}


# Characters read per wanted token when only a document's start is needed: a token of the
# byte-level BPE covers at least one byte, and code averages about three characters a token.
PREFIX_CHARS_PER_TOKEN = 16


def held_out_documents(documents, tokenizer, min_tokens: int, n: int, scan: int = 400) -> list[list[int]]:
    """Up to n held-out documents, tokenized with [bos]: those of at least `min_tokens`
    tokens, longest first; when fewer reach it, the longest ones (among the first `scan`
    by character length, to bound the tokenizing). Only what the loss by position reads is
    tokenized: a document much longer than `min_tokens` is cut to its first
    `PREFIX_CHARS_PER_TOKEN * min_tokens` characters (whole when that prefix falls short)."""
    if n <= 0:
        return []
    by_chars = sorted(range(len(documents)), key=lambda i: -len(documents[i]))[:scan]
    encoded = []
    for i in by_chars:
        text = documents[i]
        cut = len(text) > PREFIX_CHARS_PER_TOKEN * min_tokens  # no [eos] where the text goes on
        tokens = tokenizer.encode(text[: PREFIX_CHARS_PER_TOKEN * min_tokens], add_bos=True, add_eos=not cut)
        if cut and len(tokens) < min_tokens:
            tokens = tokenizer.encode(text, add_bos=True, add_eos=True)
        encoded.append(tokens)
        if sum(len(t) >= min_tokens for t in encoded) >= n:
            break
    encoded.sort(key=len, reverse=True)
    return encoded[:n]


def loss_sources(config, val_documents) -> list:
    """The document sources the loss by position reads: the corpus's val split, the long
    documents' val split (data.long_documents) and the unseen packages
    (ladder.eval_packages_path). Cheap (documents are read when indexed): the ladder builds
    them when it starts, so a bad path fails before the first step, not at a stage's end."""
    from titan_moe.data.long_documents import long_source, unseen_package_documents

    sources = [val_documents]
    if config.data.long_documents:
        sources.append(long_source(config.data.long_documents, config.data.long_documents_path, "val",
                                   config.data.val_fraction))
    if config.ladder.eval_packages_path:
        sources.append(unseen_package_documents(os.path.expanduser(config.ladder.eval_packages_path)))
    if not any(len(source) for source in sources):
        raise ValueError("held-out evaluation: no held-out documents (the val splits are empty and "
                         "ladder.eval_packages_path is unset)")
    return sources


def loss_documents(config, val_documents, tokenizer, seq_len: int) -> list[list[int]]:
    """The held-out documents of the loss by position, tokenized: `held_out_documents` of
    each of `loss_sources`, pooled, longest first, `ladder.eval_loss_docs` of them."""
    n = config.ladder.eval_loss_docs
    sources = loss_sources(config, val_documents)
    pooled = [doc for source in sources for doc in held_out_documents(source, tokenizer, seq_len + 1, n)]
    return sorted(pooled, key=len, reverse=True)[:n]


def run_evals(scores_fn: ScoresFn, tokenizer, filler: Filler, held_out: list[list[int]], *, lengths: Sequence[int],
              seq_len: int, depths: Sequence[float], samples: int, mqar_pairs: int,
              progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Every evaluation, as flat metrics (the keys in the module docstring). `progress` gets a
    line after each of the four (long contexts take minutes)."""
    metrics: dict[str, float] = {}
    started = time.perf_counter()

    def done(what: str) -> None:
        if progress is not None:
            progress(f"{what} done ({time.perf_counter() - started:.1f} s)")

    passkey = passkey_accuracy(scores_fn, tokenizer, filler, lengths, depths, samples)
    for length in lengths:
        cells = [passkey[(length, d)] for d in depths]
        for d, acc in zip(depths, cells):
            metrics[f"eval/passkey/{short_length(length)}/d{d:.2f}"] = acc
        metrics[f"eval/passkey/{short_length(length)}"] = sum(cells) / len(cells)
    done(f"passkey at {', '.join(short_length(n) for n in lengths)}")
    mqar_lengths = [L for L in lengths if _mqar_fits(tokenizer, L, mqar_pairs)]
    for length, acc in mqar_accuracy(scores_fn, tokenizer, filler, mqar_lengths, samples, mqar_pairs).items():
        metrics[f"eval/mqar/{short_length(length)}"] = acc
    done("mqar")
    for length, acc in copy_accuracy(scores_fn, tokenizer, filler, lengths, samples).items():
        metrics[f"eval/copy/{short_length(length)}"] = acc
    done("copy")
    if held_out:
        for (lo, hi), (loss, count) in loss_by_position(scores_fn, held_out, seq_len).items():
            if count:
                metrics[f"eval/loss_by_pos/{lo}-{hi}"] = loss
        done(f"held-out loss by position over {len(held_out)} documents")
    return metrics


def _mqar_fits(tokenizer, length: int, pairs: int) -> bool:
    # about 8 tokens per pair line and per question (4 letters, " = ", 3 digits)
    return length >= 24 * pairs + 16


def format_table(metrics: dict[str, float]) -> str:
    """The metrics of `run_evals` as text tables."""
    lines = []
    lengths, depths, grid = passkey_grid(metrics)
    if grid:
        lines.append("passkey accuracy by depth " + " ".join(f"{d:>6}" for d in depths) + "    mean   mqar   copy")
        for L, row in zip(lengths, grid):
            other = [metrics.get(f"eval/{kind}/{L}") for kind in ("mqar", "copy")]
            lines.append(f"  length {L:>8}          " + " ".join(f"{v:6.2f}" for v in row)
                         + f"  {metrics[f'eval/passkey/{L}']:6.2f}"
                         + "".join(f" {v:6.2f}" if v is not None else "      -" for v in other))
    buckets = [(k.split("/")[2], v) for k, v in metrics.items() if k.startswith("eval/loss_by_pos/")]
    if buckets:
        lines.append("held-out loss by position: " + "  ".join(f"[{b}) {v:.3f}" for b, v in buckets))
    return "\n".join(lines)


def passkey_grid(metrics: dict[str, float]) -> tuple[list[str], list[str], list[list[float]]]:
    cells = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if parts[:2] == ["eval", "passkey"] and len(parts) == 4:
            cells[(parts[2], parts[3])] = value
    lengths = list(dict.fromkeys(L for L, _ in cells))
    depths = list(dict.fromkeys(d for _, d in cells))
    return lengths, depths, [[cells[(L, d)] for d in depths] for L in lengths]


def write_heatmap(path: str, metrics: dict[str, float], cell: int = 24) -> bool:
    """A grey-scale PNG of passkey accuracy (rows: lengths, short first; columns: depths),
    black 0 to white 1, a one-pixel grid. Written without plotting packages; False when
    there is nothing to draw."""
    lengths, depths, grid = passkey_grid(metrics)
    if not grid:
        return False
    h, w = len(lengths) * cell + 1, len(depths) * cell + 1
    raw = bytearray()
    for y in range(h):
        raw.append(0)  # filter: none
        for x in range(w):
            if y % cell == 0 or x % cell == 0:
                raw.append(128)
            else:
                raw.append(round(255 * grid[y // cell][x // cell]))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)
    return True


def recorded(dump_folder: str, step: int) -> bool:
    """Whether `record` already wrote evaluations of `step` into the folder's metrics.jsonl
    (a line cut short by a stopped process does not count)."""
    path = os.path.join(dump_folder, "metrics.jsonl")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        for line in f:
            if '"eval/' not in line:
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("step") == step and any(key.startswith("eval/") for key in entry):
                return True
    return False


def record(dump_folder: str, step: int, seq_len: int, metrics: dict[str, float], stage: str | None = None) -> None:
    """Append the metrics to metrics.jsonl and write the heatmap beside it."""
    os.makedirs(dump_folder, exist_ok=True)
    entry = {"step": step, "seq_len": seq_len, **({"stage": stage} if stage else {}), **metrics}
    with open(os.path.join(dump_folder, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")
    write_heatmap(os.path.join(dump_folder, f"passkey_{step}.png"), metrics)


# ---------------------------------------------------------------------------- command line
def evaluation_dtype(config, device: str) -> torch.dtype:
    """The dtype a checkpoint is evaluated in on `device`: fp32 on the CPU; on CUDA the
    training's compute dtype (`training.mixed_precision_param`, what FSDP2 casts the parameters
    to in the forward), since the varlen MLA attention (FlashAttention-2) takes only bf16 or
    fp16. With an fp32 compute dtype on CUDA, `model.mla_attention` "auto" (or unset) becomes
    "chunked" in `config`, so the model runs without FlashAttention."""
    if device != "cuda":
        return torch.float32
    dtype = TORCH_DTYPE_MAP[config.training.mixed_precision_param]
    if dtype == torch.float32 and config.model.mla_attention in (None, "auto"):
        config.model.mla_attention = "chunked"
    return dtype


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its parameters in `dtype` and its buffers as they were (the expert bias stays
    fp32), as FSDP2's mixed precision computes in training."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model


def load_for_evaluation(config, checkpoint: str | None, device: str):
    """`titan_moe.generate.load_model` in eval mode with its parameters in `evaluation_dtype`
    (the expert bias and other buffers keep theirs): what evaluations of a checkpoint run. The
    dtype is resolved before the model is built, since it may set the MLA attention path."""
    from titan_moe.generate import load_model

    dtype = evaluation_dtype(config, device)
    return cast_parameters(load_model(config, checkpoint, device), dtype).eval()


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m titan_moe.evaluate",
        usage="%(prog)s --job.config_file FILE.toml [--checkpoint DIR] [options] [--section.key value ...]",
        description="Passkey, MQAR and loss-by-position evaluations of a checkpoint (module docstring).")
    parser.add_argument("--checkpoint", default=None, help="a step-N folder of a DCP checkpoint "
                        "(default: the newest intact one under the config's dump folder)")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated context lengths (default: every ladder stage's seq_len, or "
                        "training.seq_len, and ladder.eval_lengths)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="length of the loss-by-position rows (default: the longest of --lengths)")
    parser.add_argument("--samples", type=int, default=None, help="samples per cell (default: ladder.eval_samples)")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to metrics.jsonl")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    from titan_moe.config import ConfigError, load_config
    from titan_moe.data.from_config import corpus_documents, tokenizer_from_config
    from titan_moe.runtime import checkpoint as intact

    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = _parse(argv)
    try:
        config = load_config(rest)
        stages = config.ladder.stages
        lengths = ([int(x) for x in ours.lengths.split(",")] if ours.lengths
                   else sorted(({s.seq_len for s in stages} or {config.training.seq_len})
                               | set(config.ladder.eval_lengths)))
        seq_len = ours.seq_len or max(lengths)
        checkpoint = ours.checkpoint
        if checkpoint is None:
            folder = os.path.join(config.job.dump_folder, config.checkpoint.folder)
            step = intact.newest_intact_step(folder, print) if os.path.isdir(folder) else -1
            if step < 0:
                raise ConfigError(f"no intact checkpoint under {folder}; pass --checkpoint DIR")
            checkpoint = os.path.join(folder, f"step-{step}")
        step = int(os.path.basename(os.path.normpath(checkpoint)).rpartition("-")[2] or 0)
        tokenizer = tokenizer_from_config(config)
        val = corpus_documents(config, "val")
        filler = Filler(val, tokenizer)
        held_out = loss_documents(config, val, tokenizer, seq_len)
    except (ConfigError, ValueError) as e:
        print(f"titan_moe.evaluate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_for_evaluation(config, checkpoint, device)
    metrics = run_evals(model_scores_fn(model, device), tokenizer, filler, held_out, lengths=lengths, seq_len=seq_len,
                        depths=config.ladder.eval_depths, samples=ours.samples or config.ladder.eval_samples,
                        mqar_pairs=config.ladder.eval_mqar_pairs,
                        progress=lambda line: print(f"titan_moe.evaluate: {line}", file=sys.stderr, flush=True))
    print(f"titan_moe.evaluate: {checkpoint}")
    print(format_table(metrics))
    if not ours.no_record:
        record(config.job.dump_folder, step, seq_len, metrics)
        print(f"recorded in {os.path.join(config.job.dump_folder, 'metrics.jsonl')} and passkey_{step}.png")


if __name__ == "__main__":
    main()
