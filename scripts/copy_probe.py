"""How much training does a model need to copy from its context? A CPU probe for retrieval.

    python scripts/copy_probe.py --model debug                       # our flavor, as configured
    python scripts/copy_probe.py --model debug --model.mla_every 1    # any [model] key, as in training
    python scripts/copy_probe.py --model transformer                  # baselines of the same width:
    python scripts/copy_probe.py --model transformer_nope             #   learned positions / none

Each row of a batch is `half` random tokens (ids drawn uniformly from `symbols` ids) followed
by the same tokens again; the model trains on every next token (AdamW). The first half is
unpredictable (loss ln(symbols) at best); the second half is predictable only by looking back
`half` positions, the induction-style lookup that passkey retrieval and MQAR need. Every
`every` steps the probe prints both halves' loss on the training batch; the run's answer is the
first logged step at which the second half's loss falls below half of ln(symbols) ("copies
from step N"), or "does not copy in S steps".

Passkey retrieval in a ladder can only appear once the model copies; this measures, in minutes
on the CPU, after how many steps (at `batch` rows a step: the number of rows seen matters, not
the steps alone) that happens for a flavor and an override, against two plain causal
transformers of the flavor's width, depth and MLA head count (`transformer`: learned absolute
positions; `transformer_nope`: no positional signal at all, like NoPE attention without
anything before it). The probe calls the model directly (no trainer, one process).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from titan_moe.config import ConfigError, load_config, model_args_from_config  # noqa: E402
from titan_moe.flavors import FLAVORS  # noqa: E402
from titan_moe.model.args import ModelArgs  # noqa: E402
from titan_moe.model.decoder import Decoder  # noqa: E402
from titan_moe.optim.muon import Muon  # noqa: E402
from titan_moe.optim.param_groups import muon_param_groups  # noqa: E402

BASELINES = ("transformer", "transformer_nope")


class PlainTransformer(nn.Module):
    """Pre-norm causal transformer (PyTorch's encoder layers, 4x MLP, no dropout) over `args`'
    vocabulary, width, depth and MLA head count; `positions`: learned absolute positions for up
    to `max_len` tokens, added to the embeddings, or none."""

    def __init__(self, args: ModelArgs, positions: bool, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(max_len, args.dim) if positions else None
        layer = nn.TransformerEncoderLayer(args.dim, args.mla_n_heads, 4 * args.dim, 0.0, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, args.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size)

    def forward(self, tokens_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens_BT.shape[1]
        h_BTD = self.embed(tokens_BT)
        if self.positions is not None:
            h_BTD = h_BTD + self.positions(torch.arange(T, device=tokens_BT.device))
        mask_TT = nn.Transformer.generate_square_subsequent_mask(T, device=tokens_BT.device)
        return self.output(self.norm(self.layers(h_BTD, mask=mask_TT, is_causal=True)))


def build_model(name: str, model_keys: list[str], max_len: int, seed: int) -> nn.Module:
    """Flavor `name` or a baseline at the debug flavor's shape, with `[model]` keys from the
    command line applied as the trainer applies them (`["--model.attn_res", "none"]`; for a
    baseline they set its shape: dim, n_layers, mla_n_heads, vocab_size)."""
    flavor = "debug" if name in BASELINES else name
    config = load_config(["--job.config_file", os.path.join(REPO, "configs", "debug_cpu.toml"),
                          "--model.flavor", flavor, *model_keys])
    args = model_args_from_config(config)
    torch.manual_seed(seed)
    if name in BASELINES:
        return PlainTransformer(args, positions=name == "transformer", max_len=max_len)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def copy_batch(generator: torch.Generator, batch: int, half: int, symbols: int, vocab: int) -> torch.Tensor:
    """[batch, 2 * half] rows: `half` random ids then the same ids again; the ids are drawn
    from 2 .. symbols + 1 (0 and 1 are the tokenizer's special tokens)."""
    if symbols + 2 > vocab:
        raise ValueError(f"--symbols {symbols} needs a vocabulary over {symbols + 2}, the model has {vocab}")
    x_BH = torch.randint(2, 2 + symbols, (batch, half), generator=generator)
    return torch.cat([x_BH, x_BH], dim=1)


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW over every parameter, or the trainer's per-block Muon (AdamW for embeddings,
    norms, vectors and the head), both with weight decay 0.1 as in the configs."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    if name == "muon":
        return Muon(muon_param_groups(model, weight_decay=0.1), lr=lr)
    raise ValueError(f"--optimizer {name!r}: use adamw or muon")


def probe(model: nn.Module, *, steps: int, batch: int, half: int, symbols: int, lr: float, seed: int, every: int,
          optimizer: str = "adamw", log=print) -> list[tuple[int, float, float]]:
    """Train `model` on copy batches; [(step, first-half loss, second-half loss)] every `every`
    steps (and at the last). The first half's targets are tokens 1..half-1, the second's the
    repeated tokens half+1..2*half-1 (the repeat's first token is not predictable either)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.output.weight.shape[0]
    optimizer = make_optimizer(model, optimizer, lr)
    rows = []
    start = time.time()
    for step in range(1, steps + 1):
        tokens_BT = copy_batch(generator, batch, half, symbols, vocab)
        logits_BTV = model(tokens_BT, torch.zeros_like(tokens_BT, dtype=torch.int32)).float()
        nll_BT = nn.functional.cross_entropy(logits_BTV[:, :-1].transpose(1, 2), tokens_BT[:, 1:], reduction="none")
        optimizer.zero_grad(set_to_none=True)
        nll_BT.mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % every == 0 or step == steps:
            first, second = nll_BT[:, : half - 1].mean().item(), nll_BT[:, half:].mean().item()
            rows.append((step, first, second))
            log(f"step {step:5d}  first half {first:.3f}  second half {second:.3f}  ({time.time() - start:.0f} s)")
    return rows


def copies_from(rows: list[tuple[int, float, float]], symbols: int) -> int | None:
    """The first logged step whose second-half loss is below half of ln(symbols) (None: none)."""
    return next((step for step, _, second in rows if second < 0.5 * math.log(symbols)), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Further --model.KEY VALUE arguments set [model] keys, as for the trainer.")
    parser.add_argument("--model", default="debug", help=f"a flavor ({', '.join(FLAVORS)}) or {' / '.join(BASELINES)}")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--half", type=int, default=32, help="tokens before the repeat")
    parser.add_argument("--symbols", type=int, default=128, help="how many distinct ids the rows draw from")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                        help="AdamW, or the trainer's per-block Muon (AdamW for vectors, embeddings, head)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=50, help="log every N steps")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a, model_keys = parser.parse_known_args(argv)
    if any(not key.startswith("--model.") for key in model_keys[::2]):
        parser.error(f"unrecognized arguments: {' '.join(model_keys)} (only --model.KEY VALUE pass through)")
    if a.model not in FLAVORS and a.model not in BASELINES:
        parser.error(f"--model {a.model!r}: not a flavor ({', '.join(FLAVORS)}) nor {' / '.join(BASELINES)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model = build_model(a.model, model_keys, 2 * a.half, a.seed)
        rows = probe(model, steps=a.steps, batch=a.batch, half=a.half, symbols=a.symbols, lr=a.lr, seed=a.seed,
                     every=a.every, optimizer=a.optimizer)
    except (ConfigError, ValueError) as e:
        print(f"copy_probe: error: {e}", file=sys.stderr)
        return 2
    step = copies_from(rows, a.symbols)
    label = " ".join([a.model, *model_keys] + ([f"--optimizer {a.optimizer}"] if a.optimizer != "adamw" else []))
    print(f"{label}: copies from step {step}" if step else f"{label}: does not copy in {a.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
