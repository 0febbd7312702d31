"""NVTX ranges for Nsight Systems, off by default and free when off.

    from titan_moe.ops.nvtx import nvtx_range, nvtx_wrap

    with nvtx_range("moe.router"):      # a context manager
        ...

    @nvtx_wrap("mla.attend")            # or a decorator, checked at call time
    def _attend(self, ...): ...

The trainer switches ranges on with `enable(True)` when `[profiling] nvtx = true`. While
off, `nvtx_range` is one module-flag check that returns the shared `NULL_RANGE`
(a `contextlib.nullcontext`): no allocation, no call into NVTX. The `nvtx` package is a
no-op itself when no profiler is attached, so ranges cost little even when on.

Ranges and where they exist (names are fixed strings, so nsys and the trace summary
aggregate them across steps and layers):

    name                                 emitted by                       eager  compiled layers
    train_step, forward, backward,       TitanTrainer (titan_moe.train)     yes   yes
      optimizer
    layer{i}.{kda|mla}, head             Decoder.forward, between layers    yes   yes
    attn_res.mix                         AttnResMixer.forward               yes   final mix only
    kda, mla, moe, ffn                   DecoderLayer sub-layers            yes   no
    kda.inputs, kda.output               KimiDeltaAttention                 yes   no
    mla.attend                           GatedMLA (SDPA path)               yes   no
    moe.router, moe.dispatch,            LatentMoE.forward                  yes   no
      moe.experts, moe.combine, moe.shared
    op.kda_chunk_fwd, op.kda_chunk_bwd   custom op implementations          yes   yes
    op.grouped_mm, op.grouped_mm_dx,     custom op implementations          yes   yes
      op.grouped_mm_dw, op.router_topk,
      op.moe_permute, op.moe_unpermute_combine(_backward),
      op.doc_attention_fwd/_bwd

"compiled layers" is torchtitan's regional compile (one `torch.compile(fullgraph=True)`
region per decoder layer). A Python-side range inside a compiled region would break the
graph, so `nvtx_range` returns `NULL_RANGE` while `torch.compiler.is_compiling()` is true:
the range simply vanishes from the traced graph. What remains are the ranges outside the
regions (trainer, per-layer calls in `Decoder.forward`) and those inside our custom ops,
whose implementations run as opaque calls at run time in both modes. The op ranges are the
only ranges in the backward pass (`*_bwd`, `*_dx`, `*_dw`) apart from `backward` itself;
an activation-checkpointing recompute repeats the in-layer ranges inside `backward` (eager).
The `forward` range ends after the loss and `backward` covers `loss.backward()`.

Recording without a GPU profiler: `record_ranges()` collects the names of the ranges
entered while it is active (tests use it), and when a `torch.profiler` session is recording,
every range is also opened as a `torch.profiler.record_function` of the same name, so
torch.profiler Chrome traces (torchtitan's `[profiling] enable_profiling`) carry the same
ranges as `user_annotation` events (see `profiling/summarize_trace.py`).

`push` / `pop` are the unconditional primitives behind the context manager, for ranges
that cannot be a `with` block (the trainer's forward/backward split); they must pair up on
one thread.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import nvtx
import torch

__all__ = [
    "NULL_RANGE",
    "enable",
    "innermost",
    "is_enabled",
    "nvtx_range",
    "nvtx_wrap",
    "pop",
    "push",
    "record_ranges",
]

NULL_RANGE = contextlib.nullcontext()
"""What `nvtx_range` returns while ranges are off or the code is being compiled."""

_enabled = False
_recorders: list[list[str]] = []
_local = threading.local()  # .stack: per-thread list of (name, record_function or None)

F = TypeVar("F", bound=Callable[..., Any])


def enable(on: bool = True) -> None:
    """Switch NVTX ranges on or off for the whole process."""
    global _enabled
    _enabled = bool(on)


def is_enabled() -> bool:
    return _enabled


def _stack() -> list[tuple[str, Any]]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def push(name: str) -> None:
    """Open range `name` on this thread (NVTX, plus torch.profiler and recorders when active)."""
    nvtx.push_range(name)
    record = None
    if torch._C._autograd._profiler_enabled():
        record = torch.autograd.profiler.record_function(name)
        record.__enter__()
    _stack().append((name, record))
    for names in _recorders:
        names.append(name)


def pop() -> None:
    """Close the innermost range opened by `push` on this thread."""
    _, record = _stack().pop()
    if record is not None:
        record.__exit__(None, None, None)
    nvtx.pop_range()


def innermost() -> str | None:
    """Name of the innermost open range on this thread, or None."""
    stack = _stack()
    return stack[-1][0] if stack else None


class _Range:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        push(self.name)

    def __exit__(self, *exc_info) -> bool:
        pop()
        return False


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    """A context manager that marks `name` as an NVTX range.

    Returns the shared `NULL_RANGE` while ranges are off and while torch.compile traces
    the caller (no graph break: Dynamo sees a null context).
    """
    if not _enabled or torch.compiler.is_compiling():
        return NULL_RANGE
    return _Range(name)


def nvtx_wrap(name: str) -> Callable[[F], F]:
    """Decorator: run the function inside `nvtx_range(name)`, decided at each call."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with nvtx_range(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


@contextlib.contextmanager
def record_ranges() -> Iterator[list[str]]:
    """Collect the names of the ranges entered (on any thread) while the block runs.

    Only ranges that are actually emitted are recorded: with ranges off (see `enable`)
    the list stays empty. Yields the list, in the order the ranges were opened.
    """
    names: list[str] = []
    _recorders.append(names)
    try:
        yield names
    finally:
        _recorders.remove(names)
