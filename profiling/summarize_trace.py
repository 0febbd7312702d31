"""Per-range time table from torch.profiler Chrome traces.

    python profiling/summarize_trace.py outputs/run/profile_traces/iteration_10/rank0_trace.json
    python profiling/summarize_trace.py outputs/run/profile_traces --top 40      # every *trace.json* below
    python profiling/summarize_trace.py TRACE.json --category gpu_user_annotation  # GPU-side spans

torchtitan writes these traces with `[profiling] enable_profiling = true` (under
`<dump_folder>/<save_traces_folder>/iteration_N/rank{R}_trace.json`). With `[profiling]
nvtx = true` our NVTX ranges (`titan_moe.ops.nvtx`) are also torch.profiler
`record_function`s, so they appear in the trace as `user_annotation` events, next to
torch.profiler's own `ProfilerStep#N`.

For each range name (events of one category, `user_annotation` by default): number of
calls, total (inclusive) time, self time (minus the ranges nested inside it on the same
thread), mean time, and total as a percentage of the step time. The step time is, in this
order of preference: the events named by `--step-name`; torch.profiler's `ProfilerStep#N`
events; our `train_step` ranges; else the span from the first to the last event. Several
trace files (e.g. all ranks) are pooled. Nested ranges overlap, so the percentages do not
add up to 100.

The table is printed first; the last line is the same summary as JSON.

Nsight Systems reports are not read here: the GPU machine used for development has no
working nsys, so `nsys_launch.py`'s command line is checked by tests and the ranges
themselves are checked through torch.profiler traces like these.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

STEP_MARKER = re.compile(r"^ProfilerStep#\d+$")
STEP_RANGE = "train_step"


def load_events(path: str | Path) -> list[dict]:
    """The `traceEvents` of one Chrome trace (`.json` or `.json.gz`)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    return events


def trace_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; a directory contributes every `*trace.json` / `*trace.json.gz` below it."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*trace.json*") if q.suffix in (".json", ".gz"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such trace file or folder: {p}")
    if not files:
        raise FileNotFoundError(f"no trace files under {', '.join(map(str, paths))}")
    return files


def _complete_events(events: Iterable[dict], category: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == category and "dur" in e]


def _self_times(spans: list[dict]) -> list[float]:
    """Per span, its duration minus that of the spans directly nested in it on the same thread."""
    self_us = [float(e["dur"]) for e in spans]
    by_thread: dict[tuple, list[int]] = {}
    for i, e in enumerate(spans):
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (float(spans[i]["ts"]), -float(spans[i]["dur"])))
        stack: list[tuple[int, float]] = []  # (index, end time)
        for i in indices:
            start = float(spans[i]["ts"])
            end = start + float(spans[i]["dur"])
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack:
                parent, parent_end = stack[-1]
                self_us[parent] -= min(end, parent_end) - start
            stack.append((i, end))
    return self_us


def summarize(events: list[dict], category: str = "user_annotation", step_name: str | None = None,
              top: int = 25) -> dict:
    """Summary of one category of complete ('X') events; times in milliseconds.

    Returns {"category", "step_time_ms", "step_source", "n_steps", "n_ranges", "ranges": [
    {"name", "count", "total_ms", "self_ms", "mean_ms", "pct_of_step"}, ...]} with ranges
    sorted by total time, the `top` largest (all when top <= 0). `ProfilerStep#N` events are
    pooled under the name "ProfilerStep".
    """
    spans = _complete_events(events, category)
    if step_name is not None:
        steps = [e for e in spans if e["name"] == step_name]
        if not steps:
            raise ValueError(f"no {category!r} events named {step_name!r}")
        source = step_name
    else:
        steps = [e for e in spans if STEP_MARKER.match(e["name"])]
        source = "ProfilerStep"
        if not steps:
            steps, source = [e for e in spans if e["name"] == STEP_RANGE], STEP_RANGE
    if steps:
        step_us = sum(float(e["dur"]) for e in steps)
    else:
        timed = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
        step_us = (max(float(e["ts"]) + float(e["dur"]) for e in timed) - min(float(e["ts"]) for e in timed)
                   if timed else 0.0)
        source = "trace span"

    totals: dict[str, list[float]] = {}  # name -> [count, total us, self us]
    for e, self_us in zip(spans, _self_times(spans)):
        name = "ProfilerStep" if STEP_MARKER.match(e["name"]) else e["name"]
        row = totals.setdefault(name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += float(e["dur"])
        row[2] += self_us
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))
    if top > 0:
        ranked = ranked[:top]
    ranges = [
        {
            "name": name,
            "count": int(count),
            "total_ms": total / 1e3,
            "self_ms": self_us / 1e3,
            "mean_ms": total / count / 1e3,
            "pct_of_step": 100.0 * total / step_us if step_us > 0 else None,
        }
        for name, (count, total, self_us) in ranked
    ]
    return {
        "category": category,
        "step_time_ms": step_us / 1e3,
        "step_source": source,
        "n_steps": len(steps),
        "n_ranges": len(totals),
        "ranges": ranges,
    }


KERNEL_CATEGORIES = [  # first match wins; names as CUDA kernels appear in Kineto traces
    ("attention", re.compile(r"fmha|flash|cudnn|sdpa|attention|doc_attention", re.I)),
    ("kda", re.compile(r"kda|^_(bwd_(chunk_keys|chunk_values|intra|reverse_cumsum|state_scan|walk_prep)|chunk_cumsum"
                       r"|diag_inverse|gate_cumsum_fwd|intra_columns|output|prepare_(fwd|bwd)|state_scan|wy|segment_"
                       r"(combine|transition|walk))_kernel")),
    ("grouped_gemm", re.compile(r"grouped|gmm|^_(dw|ragged_[a-z_]+|zero_empty_groups)_kernel", re.I)),
    ("moe_glue", re.compile(r"^_(situ_(fwd|bwd)|permute|combine_bwd|gather_sum|router_topk_fwd|zero_rows_past)_kernel")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("triton", re.compile(r"^triton", re.I)),
]
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_category(event: dict) -> str:
    """The table row of one GPU event: memcpy/memset by its trace category, else by name."""
    if event.get("cat") != "kernel":
        return event.get("cat", "other")
    return next((cat for cat, pattern in KERNEL_CATEGORIES if pattern.search(event["name"])), "other")


INDUCTOR_KERNEL = re.compile(r"^triton_(poi|red|per|tem)_")


def inductor_family(name: str) -> str:
    """An Inductor kernel's name without its per-graph index (`triton_poi_fused_add_mul_12` ->
    `triton_poi_fused_add_mul`): the same fusion in every layer graph is one row."""
    return re.sub(r"_\d+$", "", name)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_summary(events: list[dict]) -> dict:
    """GPU time by kernel category and the share of the step the GPU is busy; times in ms per step.

    The step is torch.profiler's `ProfilerStep#N` (else our `train_step` range) on the host;
    busy is the union of every kernel, memcpy and memset interval (overlapping streams
    counted once), divided by the number of steps. Returns {"step_ms", "n_steps",
    "busy_ms", "busy_pct", "idle_pct", "categories": [{"name", "count", "ms", "pct_of_step"}],
    "top_kernels": [...], "inductor_families": [...]} (Inductor's kernels pooled by
    `inductor_family`)."""
    host = _complete_events(events, "user_annotation")
    steps = [e for e in host if STEP_MARKER.match(e["name"])] or [e for e in host if e["name"] == STEP_RANGE]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES and "dur" in e]
    if not gpu:
        raise ValueError("no GPU kernel events in the trace (a CPU run, or CUDA activity not recorded)")
    n_steps = max(len(steps), 1)
    if steps:
        step_us = sum(float(e["dur"]) for e in steps) / n_steps
    else:
        step_us = max(float(e["ts"]) + float(e["dur"]) for e in gpu) - min(float(e["ts"]) for e in gpu)
    busy_us = _union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]) / n_steps
    by_cat: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    by_family: dict[str, list[float]] = {}
    for e in gpu:
        keys = [(by_cat, kernel_category(e)), (by_name, e["name"])]
        if INDUCTOR_KERNEL.match(e["name"]):
            keys.append((by_family, inductor_family(e["name"])))
        for table, key in keys:
            row = table.setdefault(key, [0, 0.0])
            row[0] += 1
            row[1] += float(e["dur"])

    def rows(table: dict, top: int) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": name, "count": int(c) // n_steps, "ms": us / n_steps / 1e3,
                 "pct_of_step": 100.0 * us / n_steps / step_us} for name, (c, us) in ranked]

    return {"step_ms": step_us / 1e3, "n_steps": len(steps), "busy_ms": busy_us / 1e3,
            "busy_pct": 100.0 * busy_us / step_us, "idle_pct": 100.0 - 100.0 * busy_us / step_us,
            "categories": rows(by_cat, len(by_cat)), "top_kernels": rows(by_name, 40),
            "inductor_families": rows(by_family, 30)}


def format_gpu_table(summary: dict) -> str:
    lines = [f"GPU per step: step {summary['step_ms']:.1f} ms over {summary['n_steps']} step(s); busy "
             f"{summary['busy_ms']:.1f} ms ({summary['busy_pct']:.1f}%), idle {summary['idle_pct']:.1f}%",
             f"{'category':<14}  {'calls':>7}  {'ms':>9}  {'% step':>7}"]
    lines += [f"{r['name']:<14}  {r['count']:>7}  {r['ms']:>9.2f}  {r['pct_of_step']:>7.1f}"
              for r in summary["categories"]]
    lines.append("top kernels:")
    lines += [f"  {r['ms']:>8.2f} ms {r['pct_of_step']:>5.1f}%  x{r['count']:<5} {r['name'][:110]}"
              for r in summary["top_kernels"]]
    lines.append("Inductor kernels by fusion (ops in the name, per-graph index dropped):")
    lines += [f"  {r['ms']:>8.2f} ms {r['pct_of_step']:>5.1f}%  x{r['count']:<5} {r['name'][:140]}"
              for r in summary["inductor_families"]]
    return "\n".join(lines)


def format_table(summary: dict) -> str:
    width = max([len("range")] + [len(r["name"]) for r in summary["ranges"]])
    lines = [
        f"{summary['category']} ranges; step time {summary['step_time_ms']:.3f} ms over "
        f"{summary['n_steps']} step(s) (from {summary['step_source']})",
        f"{'range':<{width}}  {'count':>7}  {'total ms':>11}  {'self ms':>11}  {'mean ms':>10}  {'% step':>7}",
    ]
    for r in summary["ranges"]:
        pct = "-" if r["pct_of_step"] is None else f"{r['pct_of_step']:.1f}"
        lines.append(f"{r['name']:<{width}}  {r['count']:>7}  {r['total_ms']:>11.3f}  {r['self_ms']:>11.3f}  "
                     f"{r['mean_ms']:>10.3f}  {pct:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome trace files (.json / .json.gz) or folders holding them")
    parser.add_argument("--category", default="user_annotation",
                        help="event category to summarise (user_annotation, gpu_user_annotation, cpu_op, kernel)")
    parser.add_argument("--step-name", default=None, help="range whose total is the step time")
    parser.add_argument("--top", type=int, default=25, help="rows to show (0: all)")
    parser.add_argument("--gpu", action="store_true",
                        help="instead: GPU time per step by kernel category, busy and idle %% (gpu_summary)")
    args = parser.parse_args(argv)
    try:
        files = trace_files(args.traces)
        events = [e for f in files for e in load_events(f)]
        if args.gpu:
            summary = gpu_summary(events)
            summary["files"] = [str(f) for f in files]
            print(format_gpu_table(summary))
            print(json.dumps(summary))
            return 0
        summary = summarize(events, args.category, args.step_name, args.top)
    except (OSError, ValueError, KeyError) as e:
        print(f"summarize_trace: error: {e}", file=sys.stderr)
        return 2
    summary["files"] = [str(f) for f in files]
    print(format_table(summary))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
