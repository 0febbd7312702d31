"""Which part of the model makes an AOTInductor package fail to load or run: one case per process.

    python profiling/aoti_isolate.py [--device cuda] [--cases kda_dense,mla_dense,...]

Each case exports the prefill program (`titan_moe.export.export_programs`) of a one-layer
debug-width decoder of one kind, compiles it with `aoti_package`, loads it with
`torch._inductor.aoti_load_package` and runs it against eager, in a fresh subprocess (a crash
ends that case only). Cases:

    kda_dense   one KDA layer, dense FFN      (custom ops: kda_chunk_fwd)
    mla_dense   one MLA layer, dense FFN      (no custom op)
    kda_moe     one KDA layer, MoE            (kda_chunk_fwd, grouped_mm, dispatch)
    mla_moe     one MLA layer, MoE            (grouped_mm, dispatch)
    linear      a bare nn.Linear, compiled through our `aoti_package` (titan_moe imported)
    torch_only  a bare nn.Linear in a process that never imports titan_moe (AOTInductor alone)

Prints one line per case (`ok`, the relative error, or the exit status and the last stderr
line) and, last, one JSON object. Written for torch 2.11 on the H200, where the four-layer
model's CUDA package segfaults in `aoti_load_package`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = ("torch_only", "linear", "mla_dense", "kda_dense", "mla_moe", "kda_moe")

_TORCH_ONLY_SCRIPT = """
import sys, tempfile, torch
device = {device!r}
torch.manual_seed(0)
model = torch.nn.Linear(64, 32).to(device).eval()
x = torch.randn(4, 64, device=device)
ep = torch.export.export(model, (x,))
path = torch._inductor.aoti_compile_and_package(ep, package_path=tempfile.mkdtemp() + "/linear.pt2")
print("compiled", file=sys.stderr, flush=True)
runner = torch._inductor.aoti_load_package(path)
print("loaded", file=sys.stderr, flush=True)
got, want = runner(x), model(x)
print(float((got - want).norm() / want.norm()))
"""

_CASE_SCRIPT = """
import dataclasses, sys, tempfile, torch
from titan_moe.export import aoti_package, export_programs
from titan_moe.flavors import FLAVORS
from titan_moe.model.decoder import Decoder
case, device = {case!r}, {device!r}
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
folder = tempfile.mkdtemp()
if case == "linear":
    model = torch.nn.Linear(64, 32).to(device).eval()
    x = torch.randn(4, 64, device=device)
    ep = torch.export.export(model, (x,))
    path = aoti_package(ep, folder + "/linear.pt2")
    print("compiled", file=sys.stderr, flush=True)
    runner = torch._inductor.aoti_load_package(str(path))
    print("loaded", file=sys.stderr, flush=True)
    got, want = runner(x), model(x)
else:
    kind, ffn = case.split("_")
    args = dataclasses.replace(
        FLAVORS["debug"], n_layers=1, mla_layers=[0] if kind == "mla" else [],
        n_dense_layers=1 if ffn == "dense" else 0, vocab_size=256,
    )
    model = Decoder(args)
    model.init_weights()
    model = model.to(device).eval()
    ep = export_programs(model, 80, which=("prefill",))["prefill"]
    path = aoti_package(ep, folder + "/prefill.pt2")
    print("compiled", file=sys.stderr, flush=True)
    runner = torch._inductor.aoti_load_package(str(path))
    print("loaded", file=sys.stderr, flush=True)
    tokens = torch.randint(0, args.vocab_size, (2, 12), device=device)
    got = runner(tokens)[0]
    with torch.no_grad():
        want = model(tokens)
print(float((got - want).norm() / want.norm()))
"""


def run_case(case: str, device: str, timeout: float) -> dict:
    started = time.perf_counter()
    try:
        script = (_TORCH_ONLY_SCRIPT if case == "torch_only" else _CASE_SCRIPT).format(case=case, device=device)
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        partial = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        stage = "after load" if "loaded" in partial else "after compile" if "compiled" in partial else "while compiling"
        return {"case": case, "ok": False, "reason": f"timeout after {timeout:.0f} s ({stage})"}
    seconds = time.perf_counter() - started
    stderr = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode != 0:
        return {"case": case, "ok": False, "exit": proc.returncode, "seconds": seconds,
                "loaded": "loaded" in stderr, "compiled": "compiled" in stderr, "reason": " | ".join(stderr[-6:])}
    return {"case": case, "ok": True, "seconds": seconds, "rel_err": float(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    opts = parser.parse_args(argv)
    cases = [c for c in opts.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    rows = []
    for case in cases:
        rows.append(run_case(case, opts.device, opts.timeout))
        r = rows[-1]
        status = f"ok, rel err {r['rel_err']:.1e}" if r["ok"] else (
            f"FAILED (exit {r.get('exit')}, {'after load' if r.get('loaded') else 'after compile' if r.get('compiled') else 'while compiling'}): {r['reason'][:800]}"
            if "exit" in r else f"FAILED: {r['reason']}")
        print(f"aoti_isolate: {case}: {status}", flush=True)
    print(json.dumps({"device": opts.device, "rows": rows}))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
