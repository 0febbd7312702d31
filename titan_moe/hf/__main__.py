"""`python -m titan_moe.hf import-k3 SRC OUT`: a Kimi K3-layout checkpoint into our HF layout.

The output folder loads with

    python -m titan_moe.train --job.config_file CONFIG --checkpoint.enable \\
        --checkpoint.initial_load_in_hf --checkpoint.initial_load_path OUT

for a config whose model matches (`OUT/config.json` records the model arguments).
"""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m titan_moe.hf", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    k3 = sub.add_parser("import-k3", help="convert a moonshotai/Kimi-K3-layout folder (MXFP4 experts) into ours",
                        description="Convert a Kimi K3-layout safetensors folder (config.json, index json, "
                                    "MXFP4-packed or plain routed experts) into our HF layout. The vision tower "
                                    "and projector are skipped. See docs/hf.md for the name map and what it assumes.")
    k3.add_argument("src", help="folder of the K3 checkpoint (config.json and safetensors)")
    k3.add_argument("out", help="output folder (created)")
    k3.add_argument("--flavor", default=None,
                    help="take the model arguments from this titan_moe flavor instead of SRC/config.json")
    k3.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the written weights")
    k3.add_argument("--max-shard-gib", type=float, default=4.0, help="largest output shard, GiB (default 4)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    from titan_moe.hf.kimi_k3 import import_k3

    model_args = None
    if args.flavor is not None:
        from titan_moe.flavors import FLAVORS

        if args.flavor not in FLAVORS:
            _error(f"--flavor {args.flavor!r} is not one of {', '.join(FLAVORS)}")
        model_args = FLAVORS[args.flavor]
    try:
        model_args, skipped = import_k3(args.src, args.out, args=model_args, dtype=DTYPES[args.dtype],
                                        max_shard_bytes=int(args.max_shard_gib * (1 << 30)))
    except (KeyError, ValueError, FileNotFoundError) as e:
        _error(f"{args.src}: {e.args[0] if isinstance(e, KeyError) else e}")
    print(f"wrote {args.out} ({model_args.n_layers} layers, {model_args.n_routed_experts} experts; "
          f"{skipped} vision tensors skipped)")


def _error(message: str) -> None:
    print(f"titan_moe.hf: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
