"""Static resources of our Triton kernels on the H200, compiled on the CPU: registers, spill
stack and shared memory per launch configuration, without a GPU.

    python profiling/kernel_resources.py [--cases kda_fwd,kda_bwd,...] [--kernels NAME,...] [--json OUT]
        [--sass DIR]

Each case runs one of our launchers on CPU tensors of the model's shapes (KDA: bf16, H = 16,
dk = dv = 128, T = 256; the KDA input maps; SiTU-GLU at hidden 768) with every `@triton.jit`
kernel of its modules replaced by a recorder: the launcher's own code decides the grid, the constexprs, `num_warps` and
`num_stages` as on the GPU, and nothing runs. Every recorded launch is then compiled by
Triton for sm_90 (`GPUTarget("cuda", 90, 32)`: ptxas ships with Triton, no driver needed)
and `cuobjdump -res-usage` reads its registers and stack from the cubin. Pointers are
assumed 16-byte aligned and integers that are multiples of 16 marked so, as Triton does at
a real launch for such values.

What it tells: `loop loads` counts the plain loads that a loop waits for in the same iteration
(`loads_waited_in_loops`: loads Triton's software pipeliner did not turn into asynchronous
copies, and that no hand-written prefetch hands to the next iteration); a kernel with a
stack (at 255 registers, or at a `maxnreg` cap) is spilling registers to local memory (each spilled value is a round trip through L1/L2 inside the
loop); shared memory above 227 KiB per block does not launch on an H200; and how many
blocks of the kernel fit on one SM at once (`blocks_per_sm`: registers, shared memory and
warps against sm_90's limits), which is what hides memory latency in a kernel that moves
little data per block.
`--sass DIR` writes each launch's SASS (instructions only): run it on two trees and diff the
folders, and a refactor that leaves the GPU code unchanged is shown to, without a GPU.
What it does not tell: time. Speed is measured on the device (profiling/bench_kda.py), this
only explains it.

Needs Triton (no interpreter: run without `TRITON_INTERPRET`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H200_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90
# per SM on sm_90: registers, shared memory (each block also takes 1 KiB reserved for the
# system), resident warps and blocks
SM90_REGISTERS, SM90_SHARED_BYTES, SM90_RESERVED_PER_BLOCK, SM90_WARPS, SM90_BLOCKS = 65536, 228 * 1024, 1024, 64, 32
_TORCH_TO_TRITON = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                    torch.int32: "i32", torch.int64: "i64"}


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, args, kwargs))


@contextlib.contextmanager
def recording(modules) -> Iterator[list]:
    """Replace every `*_kernel` JIT function of `modules` by a `_Recorder`; yield the list
    the launches go to; restore the kernels on exit."""
    from triton.runtime.jit import JITFunction

    launches: list = []
    saved = []
    for module in modules:
        for name, obj in list(vars(module).items()):
            if name.endswith("_kernel") and isinstance(obj, JITFunction):
                saved.append((module, name, obj))
                setattr(module, name, _Recorder(obj, launches))
    try:
        yield launches
    finally:
        for module, name, obj in saved:
            setattr(module, name, obj)


def compile_source(fn, args: tuple, kwargs: dict):
    """(ASTSource, options) for one recorded launch of JIT function `fn`."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}
    constexpr_params = set(fn.constexprs)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values[name]
        if i in constexpr_params or value is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif type(value).__name__ == "TensorDescriptor":  # a host TMA descriptor: its block type
            from triton.runtime.jit import mangle_type

            signature[name] = mangle_type(value)
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__} is not handled")
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def resources(fn, args: tuple, kwargs: dict, sass_dir: Path | None = None, case: str = "") -> dict:
    """Compile one launch for sm_90; its registers, stack (spill) bytes and shared memory.
    With `sass_dir`, also write its SASS there as `CASE.KERNEL.sass` (`sass_text`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    source, options = compile_source(fn, args, kwargs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        if sass_dir is not None:
            dump = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
            (sass_dir / f"{case}.{fn.__name__}.sass").write_text(sass_text(dump))
    fields = {}
    for line in usage.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":") for item in line.split() if ":" in item)
    return {
        "kernel": fn.__name__,
        "num_warps": options.get("num_warps", 4),
        "num_stages": options.get("num_stages", 3),
        "registers": int(fields.get("REG", -1)),
        "stack_bytes": int(fields.get("STACK", -1)),
        "shared_bytes": int(compiled.metadata.shared),
        "loop_loads_waited": loads_waited_in_loops(compiled.asm["ttgir"]),
    }


def sass_text(dump: str) -> str:
    """The instructions of `cuobjdump -sass` output, one per line, without their addresses
    and encodings: two builds of the same kernel compare equal when their code is the same."""
    lines = []
    for line in dump.splitlines():
        if re.search(r"/\*[0-9a-f]{4}\*/", line):
            lines.append(re.sub(r"/\*\s*[0-9a-fx]+\s*\*/", "", line).strip().rstrip(";").strip())
    return "\n".join(lines) + "\n"


def loads_waited_in_loops(ttgir: str) -> int:
    """Plain `tt.load`s inside `scf.for` bodies whose result the same iteration consumes.

    Triton's software pipeliner turns the loads it pipelines into asynchronous copies into
    shared memory issued iterations ahead; a `tt.load` it leaves in a loop body is waited for
    in that iteration, unless the loop hands its result to the next iteration (the load's
    value is an operand of the loop's `scf.yield`: a prefetch written by hand). A loop whose
    iterations form a dependent chain (the KDA state walks) pays that latency every iteration.
    Reads the TTGIR text: regions open on lines ending in '{' and close on lines starting
    with '}'; a load inside an `scf.if` within a loop counts as waited."""
    regions: list[dict] = []  # innermost last: {"for": bool, "loads": set, "yielded": set}
    waited = 0
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}") and regions:
            region = regions.pop()
            if region["for"]:
                waited += len(region["loads"] - region["yielded"])
        if " = tt.load " in text:
            loop = next((r for r in reversed(regions) if r["for"]), None)
            if loop is not None:
                loop["loads"].add(text.split(" = ", 1)[0])
        elif text.startswith("scf.yield") and regions and regions[-1]["for"]:
            regions[-1]["yielded"].update(word.rstrip(",") for word in text.split() if word.startswith("%"))
        if text.endswith("{"):
            regions.append({"for": "scf.for" in text, "loads": set(), "yielded": set()})
    return waited


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int) -> int:
    """Blocks of one kernel resident on an sm_90 SM at once (0: it cannot launch): the least
    of what its registers (allocated per warp in units of 256: per-thread counts rounded up
    to a multiple of 8), its shared memory plus the reserved 1 KiB, and its warps allow."""
    if registers <= 0 or num_warps <= 0 or shared_bytes > H200_SHARED_BYTES:
        return 0
    registers_per_block = -(-registers // 8) * 8 * 32 * num_warps
    return min(SM90_REGISTERS // registers_per_block,
               SM90_SHARED_BYTES // (shared_bytes + SM90_RESERVED_PER_BLOCK),
               SM90_WARPS // num_warps, SM90_BLOCKS)


# --------------------------------------------------------------------------------- cases
def _kda_inputs(dtype=torch.bfloat16, T: int = 256, H: int = 16, K: int = 128):
    q, k, v, do = (torch.zeros(1, T, H, K, dtype=dtype) for _ in range(4))
    return dict(q=q, k=k, v=v, g=torch.zeros(1, T, H, K), beta=torch.zeros(1, T, H)), do


def _kda_case(direction: str) -> Callable[[], list]:
    def run() -> list:
        from titan_moe.ops.kda import triton_bwd, triton_fwd, triton_scan

        inp, do = _kda_inputs()
        with recording((triton_fwd, triton_bwd, triton_scan)) as launches:
            if direction == "fwd":
                triton_fwd.chunk_kda_fwd_triton(**inp, scale=0.088)
            else:
                triton_bwd.chunk_kda_bwd_triton(**inp, scale=0.088, do=do)
        return launches

    return run


def _kda_prepare_case() -> list:
    """`titan_moe::kda_prepare{,_bwd}` (q/k L2 norm and the bounded gate), both directions,
    plain and with the chunk-local cumsums."""
    from titan_moe.ops.kda import triton_prepare

    inp, _ = _kda_inputs()
    q, k = inp["q"], inp["k"]
    z = torch.zeros_like(q)
    H, K = q.shape[-2:]
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    with recording((triton_prepare,)) as launches:
        for chunked in (False, True):  # token blocks, then KDA chunks with the cumsums (chunk_kda's)
            triton_prepare.kda_prepare_triton(q, k, z, A_log, dt_bias, -5.0, None, chunked)
            triton_prepare.kda_prepare_bwd_triton(q, k, z, A_log, dt_bias, -5.0, q, k, torch.zeros(q.shape),
                                                  None, chunked)
    return launches


def _situ_case() -> list:
    """`titan_moe::situ_glu{,_bwd}` at small_1gpu's expert width (bf16, hidden 768)."""
    from titan_moe.ops.situ import triton_kernel

    z = torch.zeros(256, 2 * 768, dtype=torch.bfloat16)
    out = torch.zeros(256, 768, dtype=torch.bfloat16)
    with recording((triton_kernel,)) as launches:
        triton_kernel.situ_glu_triton(z, 4.0, 25.0, out)
        triton_kernel.situ_glu_bwd_triton(z, out, 4.0, 25.0, torch.zeros_like(z))
    return launches


CASES: dict[str, Callable[[], list]] = {
    "kda_fwd": _kda_case("fwd"),
    "kda_bwd": _kda_case("bwd"),
    "kda_prepare": _kda_prepare_case,
    "situ": _situ_case,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="kda_fwd,kda_bwd", help=f"comma-separated, of {','.join(CASES)}")
    parser.add_argument("--kernels", default="", help="comma-separated kernel names to compile (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--sass", metavar="DIR", help="also write each launch's SASS to DIR/CASE.KERNEL.sass "
                        "(addresses stripped): diff two trees' folders to see whether a refactor changed the code")
    opts = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    cases = [c for c in opts.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {','.join(CASES)}")
    wanted = {k for k in opts.kernels.split(",") if k}
    sass_dir = Path(opts.sass) if opts.sass else None
    if sass_dir is not None:
        sass_dir.mkdir(parents=True, exist_ok=True)
    rows, seen = [], set()
    print(f"{'case':<16} {'kernel':<28} {'warps':>5} {'stages':>6} {'regs':>5} {'stack B':>8} {'shared KiB':>10} "
          f"{'blocks/SM':>9} {'loop loads':>10}")
    for case in cases:
        for fn, args, kwargs in CASES[case]():
            if wanted and fn.__name__ not in wanted:
                continue
            row = {"case": case, **resources(fn, args, kwargs, sass_dir, case)}
            row["blocks_per_sm"] = blocks_per_sm(row["registers"], row["num_warps"], row["shared_bytes"])
            key = tuple(v for k, v in row.items() if k != "case")
            if key in seen:
                continue
            seen.add(key)
            rows.append(row)
            flags = ("  SPILLS" if row["stack_bytes"] > 0 else "") + (
                "  TOO MUCH SHARED" if row["shared_bytes"] > H200_SHARED_BYTES else "")
            print(f"{case:<16} {row['kernel']:<28} {row['num_warps']:>5} {row['num_stages']:>6} {row['registers']:>5} "
                  f"{row['stack_bytes']:>8} {row['shared_bytes'] / 1024:>10.1f} {row['blocks_per_sm']:>9} "
                  f"{row['loop_loads_waited']:>10}{flags}",
                  flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
