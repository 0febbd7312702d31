"""Command line: export a configured model's inference programs and training graphs.

    python -m titan_moe.export --job.config_file configs/debug_cpu.toml \
        [--checkpoint outputs/debug_cpu/checkpoint/step-60] --out exported [--what pt2,aoti,graphs]

Writes under ``--out``:

    prefill.pt2, prefill_packed.pt2, decode_step.pt2   torch.export programs   (--what pt2)
    aoti/<program>.pt2                                   AOTInductor packages    (--what aoti)
    graphs/<layer kind>/*.py, graphs/index.json          one training step's     (--what graphs)
                                                         compiled graphs
    manifest.json                                        what was written, the decode state layout

Default ``--what pt2,graphs``; AOTInductor is opt-in (a C++ build per program, which needs
a C++ compiler and is the slow part). Without ``--checkpoint`` the weights are the
model's initialisation. Any ``--section.key value`` override of the config applies.
Mistakes (bad arguments, config errors, a missing checkpoint) stop with one line and exit
code 2; a requested artifact that could not be produced gives exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from titan_moe.runtime.checkpoint import check_loadable

PROG = "titan_moe.export"
WHATS = ("pt2", "aoti", "graphs")
DEFAULT_WHAT = "pt2,graphs"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise _UsageError(message)


def _parser() -> _Parser:
    p = _Parser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--out", help="output folder (created)")
    p.add_argument("--checkpoint", default=None, help="a step-N folder of a DCP checkpoint")
    p.add_argument("--what", default=DEFAULT_WHAT, help=f"comma-separated subset of {','.join(WHATS)}")
    p.add_argument("--inductor", action="store_true", help="graphs: also run Inductor and keep its generated code")
    p.add_argument("--capacity", type=int, default=None,
                   help="MLA buffer slots of the prefill state (default: training.seq_len)")
    p.add_argument("--batch", type=int, default=2, help="batch of the training step whose graphs are dumped")
    p.add_argument("--seq_len", type=int, default=None, help="length of that step (default: training.seq_len)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device of the exported programs")
    return p


def _fail(message: str, code: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    try:
        ours, rest = _parser().parse_known_args(argv)
    except _UsageError as e:
        _fail(str(e))
    if ours.out is None:
        _fail("--out DIR is required")
    what = [w.strip() for w in ours.what.split(",") if w.strip()]
    bad = [w for w in what if w not in WHATS]
    if bad or not what:
        _fail(f"--what takes a comma-separated subset of {','.join(WHATS)}, got {ours.what!r}")
    for name in ("capacity", "batch", "seq_len"):
        value = getattr(ours, name)
        if value is not None and value <= 0:
            _fail(f"--{name} must be > 0, got {value}")
    if ours.inductor and "graphs" not in what:
        _fail("--inductor applies to --what graphs")
    if ours.checkpoint is not None:
        try:
            check_loadable(ours.checkpoint)
        except ValueError as e:
            _fail(str(e))
    if ours.device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda: no CUDA device here")
    return ours, what, rest


def _packed_batch(vocab: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens with two documents per row, as the training data packs them."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    doc_ids = torch.zeros(batch, seq_len, dtype=torch.int32)
    if seq_len > 1:
        doc_ids[:, torch.randint(1, seq_len, (1,), generator=gen).item() :] = 1
    return tokens, doc_ids


def main(argv: list[str] | None = None) -> None:
    from titan_moe.config import ConfigError, load_config
    from titan_moe.export.graphs import dump_training_graphs
    from titan_moe.export.programs import PROGRAMS, aoti_package, custom_ops_in, export_programs
    from titan_moe.export.state import state_specs
    from titan_moe.generate import load_model

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        _parser().print_help()
        print("\nConfig keys: python -m titan_moe.train --help")
        raise SystemExit(0)
    ours, what, rest = _parse(argv)
    try:
        config = load_config(rest)
    except ConfigError as e:
        _fail(str(e))
    capacity = ours.capacity or config.training.seq_len
    seq_len = ours.seq_len or config.training.seq_len
    try:
        model = load_model(config, ours.checkpoint, ours.device)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(f"could not load the model: {str(e).splitlines()[0]}")
    if capacity < model.args.kda_conv_size + 2:
        _fail(f"--capacity must be >= kda_conv_size + 2 = {model.args.kda_conv_size + 2}, got {capacity}")

    out = Path(ours.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = model.output.weight.dtype
    manifest: dict = {
        "model_args": dataclasses.asdict(model.args),
        "checkpoint": ours.checkpoint,
        "device": ours.device,
        "dtype": str(dtype).removeprefix("torch."),
        "capacity": capacity,
        "state": [s.to_json() for s in state_specs(model.args, dtype)],
        "programs": {},
        "aoti": {},
    }
    written: list[Path] = []
    failed: list[str] = []

    if "pt2" in what or "aoti" in what:
        t0 = time.perf_counter()
        programs = export_programs(model, capacity)
        print(f"exported {', '.join(programs)} in {time.perf_counter() - t0:.1f}s")
        for name, ep in programs.items():
            manifest["programs"][name] = {"custom_ops": custom_ops_in(ep)}
            if "pt2" in what:
                path = out / f"{name}.pt2"
                torch.export.save(ep, str(path))
                manifest["programs"][name]["file"] = path.name
                written.append(path)
        if "aoti" in what:
            (out / "aoti").mkdir(exist_ok=True)
            for name in PROGRAMS:
                t0 = time.perf_counter()
                try:
                    path = aoti_package(programs[name], out / "aoti" / f"{name}.pt2")
                except Exception as e:  # report and go on with the other programs
                    reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    print(f"AOTInductor: {name}: FAILED ({reason})", file=sys.stderr)
                    manifest["aoti"][name] = {"error": reason}
                    failed.append(f"aoti/{name}")
                    continue
                print(f"AOTInductor: {name}: compiled in {time.perf_counter() - t0:.1f}s")
                manifest["aoti"][name] = {"file": str(path.relative_to(out))}
                written.append(path)
            print("AOTInductor: the packages call our Python custom ops (titan_moe::kda_chunk_fwd, "
                  "titan_moe::grouped_mm) back through the dispatcher: load them in a Python process "
                  "that imported titan_moe.ops; they do not run from C++ alone.")

    if "graphs" in what:
        t0 = time.perf_counter()
        tokens, doc_ids = _packed_batch(model.args.vocab_size, ours.batch, seq_len)
        device = model.output.weight.device
        regions = dump_training_graphs(
            model, tokens.to(device), out / "graphs", doc_ids_BT=doc_ids.to(device), inductor=ours.inductor,
            passes=tuple(config.compile.passes),
        )
        print(f"graphs of one training step ({ours.batch}x{seq_len} tokens) in {time.perf_counter() - t0:.1f}s:")
        for r in regions:
            print(f"  {r.kind} (layers {','.join(map(str, r.layers))}): {len(r.files)} files, ops {', '.join(r.custom_ops())}")
        manifest["graphs"] = "graphs/index.json"
        written += [p for r in regions for p in r.files] + [out / "graphs" / "index.json"]

    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    written.append(out / "manifest.json")
    print("outputs:")
    for path in written:
        print(f"  {path}")
    if failed:
        _fail(f"not produced: {', '.join(failed)}", code=1)
