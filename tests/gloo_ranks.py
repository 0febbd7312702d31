"""Shared by the test files: run a function in several CPU processes that share one gloo group.

`spawn_gloo(fn, world, folder, *args)` calls ``fn(rank, world, *args)`` in ``world`` spawned
processes. A process that finishes ``fn`` passes a barrier, destroys its group and then leaves
with ``os._exit(0)``, skipping the interpreter's finalization, where objects that still hold
the group (a DeviceMesh, DTensor parameters) would be destroyed. A spawned rank was once
aborted by gloo on a loaded two-core machine ("terminate called without an active
exception", SIGABRT; not reproduced in 40 loaded runs since), and finalization is the likeliest
place: the early exit takes it out of the picture. An exception in ``fn``
still propagates (``mp.spawn`` re-raises it in the parent). Each rank writes a marker after
its checks, and the parent asserts that every rank wrote it, so the early exit cannot hide a
rank that never ran to the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import torch


def _entry(rank: int, world: int, folder: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/gloo_store", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank past its last collective before any tears gloo down
    finally:
        dist.destroy_process_group()
    Path(folder, f"gloo_rank{rank}.done").touch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(fn: Callable, world: int, folder: Path, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any rank failed.

    ``fn`` must be a module-level function (the processes are spawned, so it is pickled by
    name); ``folder`` is an empty scratch folder for the rendezvous file and the markers.
    """
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(world, str(folder), fn, args), nprocs=world, join=True)
    missing = [rank for rank in range(world) if not (folder / f"gloo_rank{rank}.done").exists()]
    assert not missing, f"ranks {missing} exited without finishing their checks"
