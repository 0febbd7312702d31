"""Sampling from a trained model with constant-size KDA state and the MLA latent cache.

    python -m titan_moe.generate --job.config_file configs/debug_cpu.toml \
        --checkpoint outputs/debug_cpu/checkpoint/step-60 --prompt "def main(" --max_new_tokens 64

Decode keeps only: per KDA layer the short-conv tail and the [H, dk, dv] recurrent state
(constant in the length), per MLA layer the normalised c_kv and the shared key
(kv_lora_rank + qk_shared_dim values per token). The prompt is prefilled in one call; each
new token is one decode step through every layer.
"""

from __future__ import annotations

import argparse
import sys

import torch

from titan_moe.model.decoder import Decoder


@torch.no_grad()
def generate(
    model: Decoder,
    prompt_BT: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return [B, T + n] tokens: the prompt followed by up to `max_new_tokens` samples.

    temperature 0 picks the most likely token. Rows that emit `eos_id` keep emitting it.
    """
    if prompt_BT.dim() != 2 or prompt_BT.shape[1] == 0:
        raise ValueError(f"prompt must be [B, T] with T >= 1, got {tuple(prompt_BT.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    was_training = model.training
    model.eval()
    B, T = prompt_BT.shape
    caches = model.new_caches(B, T + max_new_tokens)
    logits_BV = model(prompt_BT, caches=caches)[:, -1]
    tokens_BT = prompt_BT
    done_B = torch.zeros(B, dtype=torch.bool, device=prompt_BT.device)
    for _ in range(max_new_tokens):
        next_B = _sample(logits_BV, temperature, top_k, generator)
        if eos_id is not None:
            next_B = torch.where(done_B, torch.full_like(next_B, eos_id), next_B)
            done_B |= next_B == eos_id
        tokens_BT = torch.cat([tokens_BT, next_B[:, None]], dim=1)
        if eos_id is not None and bool(done_B.all()):
            break
        logits_BV = model(next_B[:, None], caches=caches)[:, -1]
    model.train(was_training)
    return tokens_BT


def _sample(logits_BV: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]


def load_model(job_config, checkpoint: str | None, device: str) -> Decoder:
    """Build the configured model and load its weights from a DCP checkpoint folder; a
    missing or damaged folder raises ValueError naming it."""
    import torch.distributed.checkpoint as dcp

    from titan_moe.config import model_args_from_config
    from titan_moe.runtime.checkpoint import check_loadable

    args = model_args_from_config(job_config)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device=device)
    model.init_weights()
    if checkpoint:
        check_loadable(checkpoint)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state)
    return model


def main(argv: list[str] | None = None) -> None:
    from titan_moe.config import ConfigError, load_config
    from titan_moe.data import load_tokenizer

    parser = argparse.ArgumentParser(
        prog="python -m titan_moe.generate", description=__doc__.split("\n")[0],
        usage="%(prog)s --job.config_file FILE.toml [--checkpoint DIR] [options] [--section.key value ...]",
        epilog="Config keys (--section.key value): python -m titan_moe.train --help")
    parser.add_argument("--checkpoint", default=None,
                        help="a step-N folder of a DCP checkpoint (default: the model's initial weights)")
    parser.add_argument("--prompt", default="def ", help="text the sample continues (default %(default)r)")
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens to sample (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 takes the most likely token (default %(default)s)")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k most likely (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    ours, rest = parser.parse_known_args(argv)
    try:
        config = load_config(rest)
    except ConfigError as e:
        print(f"titan_moe.generate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        tokenizer = load_tokenizer(config.data.tokenizer or None)
        model = load_model(config, ours.checkpoint, device)
    except (FileNotFoundError, ValueError) as e:
        print(f"titan_moe.generate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    prompt = torch.tensor([tokenizer.encode(ours.prompt, add_bos=True)], device=device)
    gen = torch.Generator(device=device).manual_seed(ours.seed)
    out = generate(model, prompt, ours.max_new_tokens, temperature=ours.temperature, top_k=ours.top_k,
                   eos_id=tokenizer.eos_id, generator=gen)
    print(tokenizer.decode(out[0, 1:].tolist()))


if __name__ == "__main__":
    main()
