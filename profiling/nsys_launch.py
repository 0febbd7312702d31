"""Profile training with Nsight Systems: one report per rank, a window of steps, NVTX ranges.

    python profiling/nsys_launch.py --config configs/small_1gpu.toml --nproc-per-node 1 \\
        --output-dir outputs/nsys --start-step 3 --stop-step 5 [-- --training.steps 5 ...]
    python profiling/nsys_launch.py ... --dry-run        # print the command, run nothing

runs

    python -m torch.distributed.run --nproc-per-node=N [TORCHRUN ARGS] --no-python \\
        nsys profile -t cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=stop \\
            --force-overwrite=true -o OUT/rank%q{RANK} \\
        PYTHON -m titan_moe.train --job.config_file CONFIG --profiling.nvtx \\
            --profiling.nvtx_start_step S --profiling.nvtx_stop_step E [TRAINER ARGS]

nsys runs inside torchrun, once per rank, so that `%q{RANK}` (the rank torchrun gives each
worker) names one report per rank: `OUT/rank0.nsys-rep`, `OUT/rank1.nsys-rep`, ... (an
nsys wrapped around torchrun would write one report for all ranks and see no RANK). The
trainer calls cudaProfilerStart before step S and cudaProfilerStop after step E, so
the reports hold steps S..E only (start after the compile warm-up steps); the run itself
continues to `training.steps`, which must be >= E for the stop to happen. For several nodes,
pass the usual rendezvous options through `--torchrun-args` on every node; ranks are
global, so report names do not collide.

Open the reports with `nsys-ui`, or `nsys stats --report nvtx_sum OUT/rank0.nsys-rep` for a
per-range table. The ranges are listed in `titan_moe/ops/nvtx.py`.

Not run by the tests: the GPU machine used for development has no working nsys, so the
tests check the command line built here, and the ranges through torch.profiler traces
(`summarize_trace.py`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

NSYS_TRACE = "cuda,nvtx,osrt"


def build_command(
    config_file: str,
    *,
    output_dir: str,
    nproc_per_node: int = 1,
    start_step: int = 3,
    stop_step: int = 5,
    train_args: Sequence[str] = (),
    torchrun_args: Sequence[str] = (),
    nsys: str = "nsys",
    trace: str = NSYS_TRACE,
    python: str = sys.executable,
) -> list[str]:
    """The argument list that launches `nproc_per_node` ranks, each under its own `nsys profile`.

    Raises ValueError for a step window that is not 1 <= start_step <= stop_step or a
    process count below 1.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if not 1 <= start_step <= stop_step:
        raise ValueError(f"need 1 <= start_step <= stop_step, got {start_step} and {stop_step}")
    torchrun = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", *torchrun_args,
                "--no-python"]
    profile = [nsys, "profile", "-t", trace, "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
               "--force-overwrite=true", "-o", os.path.join(output_dir, "rank%q{RANK}")]
    train = [python, "-m", "titan_moe.train", "--job.config_file", config_file, "--profiling.nvtx",
             "--profiling.nvtx_start_step", str(start_step), "--profiling.nvtx_stop_step", str(stop_step),
             *train_args]
    return [*torchrun, *profile, *train]


def report_paths(output_dir: str, world_size: int) -> list[str]:
    """Where nsys writes the reports of ranks 0 .. world_size-1."""
    return [os.path.join(output_dir, f"rank{r}.nsys-rep") for r in range(world_size)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, train_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after `--` go to titan_moe.train.")
    parser.add_argument("--config", required=True, help="training TOML (--job.config_file)")
    parser.add_argument("--output-dir", default="outputs/nsys", help="folder of the rank*.nsys-rep reports")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--start-step", type=int, default=3, help="first profiled step")
    parser.add_argument("--stop-step", type=int, default=5, help="last profiled step")
    parser.add_argument("--torchrun-args", default="", help="extra torchrun options, one shell-quoted string")
    parser.add_argument("--nnodes", type=int, default=1, help="only to list the expected report names")
    parser.add_argument("--nsys", default="nsys", help="nsys executable")
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    args = parser.parse_args(argv)
    try:
        cmd = build_command(args.config, output_dir=args.output_dir, nproc_per_node=args.nproc_per_node,
                            start_step=args.start_step, stop_step=args.stop_step, train_args=train_args,
                            torchrun_args=shlex.split(args.torchrun_args), nsys=args.nsys)
    except ValueError as e:
        parser.error(str(e))
    reports = report_paths(args.output_dir, args.nnodes * args.nproc_per_node)
    print(shlex.join(cmd))
    print(f"reports (one per rank, steps {args.start_step}..{args.stop_step}): "
          + (", ".join(reports) if len(reports) <= 4 else f"{reports[0]} .. {reports[-1]}"))
    if args.dry_run:
        return 0
    if shutil.which(args.nsys) is None:
        print(f"nsys_launch: error: {args.nsys!r} not found on PATH", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    raise SystemExit(main())
