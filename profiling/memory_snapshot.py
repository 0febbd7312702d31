"""What held the GPU's memory when a training run's memory snapshot was taken (e.g. at an OOM).

    python profiling/memory_snapshot.py DUMP/memory_snapshot/iteration_1_exit/rank0_memory_snapshot.pickle [--top 25]

The trainer writes the snapshot with `--profiling.enable_memory_snapshot` (torchtitan's
profiler: every `profiling.profile_freq` steps, and once more when a step runs out of
memory, as `iteration_<step>_exit`). This reads it and prints:

* the segments' totals: reserved, allocated (blocks in use) and reserved but free (what
  fragmentation costs; `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` reclaims most);
* the blocks in use grouped by the code that allocated them: the innermost Python frames
  outside torch's own modules (a project file, or Inductor's generated code for a compiled
  region), with bytes and count per site, largest first;
* the largest single blocks;
* the peak inside the recorded trace (`device_traces`: every alloc and free since recording
  began, up to torch's entry limit): walked back from the snapshot's blocks, the moment the
  most bytes were allocated, and the blocks live then grouped the same way (a block freed in
  the window is named by its alloc event when that is in the window too, else "(allocated
  before the trace)"). That is what a step's peak holds, which the end-of-step blocks do not
  show.

A snapshot recorded without stacks (`_record_memory_history(stacks=None)`) groups every
block under "(no frames)". The last line is one JSON object with the totals and the sites.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections import defaultdict
from pathlib import Path

GIB = float(1 << 30)
# Frames from these parts of torch say how, not where: skipped when naming a site.
_TORCH_INTERNAL = ("/torch/nn/modules/", "/torch/autograd/", "/torch/utils/checkpoint",
                   "/torch/_ops.py", "/torch/_dynamo/", "/torch/_functorch/", "/torch/_tensor.py",
                   "/torch/_compile.py", "/torch/distributed/", "/torch/_library/", "/torch/amp/",
                   "/torch/_inductor/runtime/", "/torch/_inductor/utils.py", "/torch/_prims_common/")
_IN_USE = ("active_allocated", "active_pending_free", "active_awaiting_free")


def _is_python_frame(frame: dict) -> bool:
    name = frame.get("filename", "")
    return name.endswith(".py")


def site_of(frames: list[dict], depth: int = 2) -> str:
    """The `depth` innermost Python frames that are not torch internals, innermost first:
    "file.py:line function < caller.py:line function". Inductor's generated modules count as
    sites (their path names the compiled graph)."""
    picked = []
    for frame in frames:
        name = frame.get("filename", "")
        if not _is_python_frame(frame) or any(part in name for part in _TORCH_INTERNAL):
            continue
        short = "/".join(Path(name).parts[-2:])
        picked.append(f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}")
        if len(picked) == depth:
            break
    return " < ".join(picked) if picked else "(no frames)"


def summarize(snapshot: dict, top: int = 25, depth: int = 2) -> dict:
    """Totals (GiB) and the in-use blocks grouped by site, largest first."""
    reserved = sum(segment["total_size"] for segment in snapshot.get("segments", []))
    blocks = [(block["size"], site_of(block.get("frames", []), depth))
              for segment in snapshot.get("segments", []) for block in segment.get("blocks", [])
              if block.get("state") in _IN_USE]
    allocated = sum(size for size, _ in blocks)
    return {
        "reserved_gib": reserved / GIB,
        "allocated_gib": allocated / GIB,
        "free_in_segments_gib": (reserved - allocated) / GIB,
        "segments": len(snapshot.get("segments", [])),
        "sites": by_site(blocks, top),
        "largest_blocks": [{"gib": size / GIB, "site": site} for size, site in sorted(blocks, reverse=True)[:top]],
    }


def by_site(blocks: list[tuple[int, str]], top: int) -> list[dict]:
    """(bytes, site) blocks summed per site, largest first: [{"site", "gib", "blocks"}]."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in blocks:
        sums[site][0] += size
        sums[site][1] += 1
    ranked = sorted(sums.items(), key=lambda item: -item[1][0])
    return [{"site": site, "gib": size / GIB, "blocks": count} for site, (size, count) in ranked[:top]]


def trace_peak(snapshot: dict, top: int = 25, depth: int = 2) -> dict | None:
    """The largest allocated total inside device 0's trace and what was live then, or None
    without a trace. Reconstructed backwards from the blocks in use at the snapshot: undoing
    an "alloc" removes its block, undoing a "free_completed" puts it back."""
    traces = snapshot.get("device_traces") or []
    events = traces[0] if traces else []
    if not events:
        return None
    live = {block["address"]: (block["size"], block.get("frames", []))
            for segment in snapshot.get("segments", []) for block in segment.get("blocks", [])
            if block.get("state") in _IN_USE and "address" in block}
    # the allocating frames of each block freed in the window: its last alloc event before the free
    alloc_frames: dict[int, list] = {}
    freed_frames: list[list | None] = [None] * len(events)
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            alloc_frames[event["addr"]] = event.get("frames", [])
        elif event["action"] == "free_completed":
            freed_frames[i] = alloc_frames.get(event["addr"])
    total = sum(size for size, _ in live.values())
    peak_total, peak_index = total, len(events)  # "before event i" for i in [0, len]
    for i in range(len(events) - 1, -1, -1):
        event = events[i]
        if event["action"] == "alloc":
            total -= event["size"]
        elif event["action"] == "free_completed":
            total += event["size"]
        if total > peak_total:
            peak_total, peak_index = total, i
    for i in range(len(events) - 1, peak_index - 1, -1):  # the live set before event peak_index
        event = events[i]
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            frames = freed_frames[i]
            live[event["addr"]] = (event["size"], frames)
    blocks = [(size, "(allocated before the trace)" if frames is None else site_of(frames, depth))
              for size, frames in live.values()]
    return {"peak_allocated_gib": peak_total / GIB, "event_index": peak_index, "events": len(events),
            "sites": by_site(blocks, top)}


def render(summary: dict) -> str:
    lines = [f"reserved {summary['reserved_gib']:.2f} GiB in {summary['segments']} segments; "
             f"in use {summary['allocated_gib']:.2f}; reserved but free {summary['free_in_segments_gib']:.2f}",
             "", "in use by site (GiB, blocks):"]
    lines += [f"  {row['gib']:8.3f} {row['blocks']:6d}  {row['site']}" for row in summary["sites"]]
    lines += ["", "largest blocks (GiB):"]
    lines += [f"  {row['gib']:8.3f}  {row['site']}" for row in summary["largest_blocks"]]
    peak = summary.get("trace_peak")
    if peak:
        lines += ["", f"trace peak: {peak['peak_allocated_gib']:.2f} GiB allocated before event "
                      f"{peak['event_index']} of {peak['events']}; live then by site (GiB, blocks):"]
        lines += [f"  {row['gib']:8.3f} {row['blocks']:6d}  {row['site']}" for row in peak["sites"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", type=Path, help="a *_memory_snapshot.pickle")
    p.add_argument("--top", type=int, default=25, help="sites and blocks listed (default 25)")
    p.add_argument("--depth", type=int, default=2, help="frames naming a site (default 2)")
    args = p.parse_args(argv)
    if not args.snapshot.is_file():
        sys.exit(f"memory_snapshot: no file {args.snapshot}")
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    summary = summarize(snapshot, args.top, args.depth)
    summary["trace_peak"] = trace_peak(snapshot, args.top, args.depth)
    print(render(summary))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
