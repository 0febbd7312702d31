"""FX graph passes for ``torch.compile``, applied to the graph before autograd.

Passes (name -> function of an ``fx.Graph`` returning its number of rewrites):

* ``"router_fusion"``: :func:`.router_fusion.fuse_router_topk`, sigmoid router top-k ->
  ``titan_moe::router_topk`` (why before autograd: see that module).

Three ways to run them:

* :func:`make_backend` wraps any Dynamo backend (``"inductor"``, ``"aot_eager"``, ...): the
  passes run on each captured graph (nested subgraphs such as activation-checkpoint bodies
  included), then the inner backend compiles it. No global state, and Inductor's caches key
  on the rewritten graph::

      backend = compile_passes.make_backend("inductor", ("router_fusion",))
      block = torch.compile(block, backend=backend, fullgraph=True)

* :func:`install` puts them into Inductor's ``pre_grad_custom_pass`` for every later
  Inductor compilation in the process (Inductor recurses into subgraphs itself). Inductor
  compiles lazily, at the first call and at every recompile, so the passes must stay
  installed while the model runs, not only around ``torch.compile``. The returned handle
  restores the previous setting via ``uninstall()`` or as a context manager. The caches
  include the passes' identity (:meth:`PreGradPasses.uuid`, a hash of this package's and
  the op's source files); on a cache hit the stored, already rewritten code is used and the
  pass itself does not run.
* :func:`apply_pass` rewrites a given ``GraphModule`` (and its nested subgraphs) and returns
  the number of rewrites: tests and graph dumps.

Every rewrite also counts into ``torch._dynamo.utils.counters["titan_moe"][name]``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import fx
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from titan_moe.compile_passes.router_fusion import fuse_router_topk

logger = logging.getLogger(__name__)

PASSES: dict[str, Callable[[fx.Graph], int]] = {"router_fusion": fuse_router_topk}

_HERE = os.path.dirname(os.path.abspath(__file__))
_OPS_ROUTER = os.path.join(os.path.dirname(_HERE), "ops", "router")
_SOURCE_FILES = tuple(
    os.path.join(folder, name)
    for folder, names in ((_HERE, ("__init__.py", "router_fusion.py")),
                          (_OPS_ROUTER, ("op.py", "reference.py", "triton_kernel.py")))
    for name in names
)


def _check_names(passes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(passes, str):
        passes = (passes,)
    unknown = [p for p in passes if p not in PASSES]
    if unknown:
        raise ValueError(f"unknown compile pass(es) {unknown}; known: {sorted(PASSES)}")
    return tuple(passes)


def run_on_graph(graph: fx.Graph, name: str) -> int:
    """Run pass ``name`` on one graph (no recursion, no recompile); count and return its rewrites."""
    count = PASSES[name](graph)
    if count:
        counters["titan_moe"][name] += count
    return count


def apply_pass(
    gm: fx.GraphModule, name: str = "router_fusion", example_inputs: Sequence[torch.Tensor] | None = None
) -> int:
    """Apply pass ``name`` to ``gm`` and every nested ``GraphModule`` in place, then recompile.

    The pass needs tensor metadata on the nodes (``meta["val"]`` or ``meta["example_value"]``,
    as Dynamo, ``make_fx`` and ``torch.export`` graphs carry). For a graph without it (e.g.
    ``torch.fx.symbolic_trace``), give ``example_inputs`` and it is computed with fake tensors
    first.

    Returns:
        The number of rewrites in ``gm`` and its subgraphs.
    """
    _check_names((name,))
    if example_inputs is not None:
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(gm).propagate(*example_inputs)
    count = 0
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            changed = run_on_graph(module.graph, name)
            if changed:
                module.graph.lint()
                module.recompile()
            count += changed
    return count


class PreGradPasses(CustomGraphPass):
    """Our passes as one Inductor ``pre_grad_custom_pass`` (runs ``previous`` first, if any)."""

    def __init__(self, passes: Sequence[str], previous: Callable[[fx.Graph], object] | None = None):
        self.passes = _check_names(passes)
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        for name in self.passes:
            run_on_graph(graph, name)

    def uuid(self) -> bytes | None:
        previous = None
        if self.previous is not None:
            previous = self.previous.uuid() if isinstance(self.previous, CustomGraphPass) else None
            if previous is None:  # an unidentifiable pass before ours: no caching
                return None
        return get_hash_for_files(_SOURCE_FILES, extra=f"{self.passes}|{previous!r}")


class Installation:
    """Handle returned by :func:`install`; ``uninstall()`` (or leaving the ``with``) restores
    the ``pre_grad_custom_pass`` that was set before."""

    def __init__(self, installed: PreGradPasses, previous):
        self.installed, self.previous = installed, previous

    def uninstall(self) -> None:
        if inductor_config.pre_grad_custom_pass is self.installed:
            inductor_config.pre_grad_custom_pass = self.previous

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def install(passes: Sequence[str] = ("router_fusion",)) -> Installation:
    """Register ``passes`` as Inductor's ``pre_grad_custom_pass`` for this process.

    Keeps a pass that someone else installed (it runs first); installing again replaces our
    earlier installation instead of stacking on it. Returns a handle (also a context
    manager) that restores the previous setting.
    """
    previous = inductor_config.pre_grad_custom_pass
    inner = previous.previous if isinstance(previous, PreGradPasses) else previous
    installed = PreGradPasses(passes, previous=inner)
    inductor_config.pre_grad_custom_pass = installed
    return Installation(installed, previous)


_BACKENDS: dict[tuple, Callable] = {}


def make_backend(inner: str | Callable = "inductor", passes: Sequence[str] = ("router_fusion",)) -> Callable:
    """A Dynamo backend that applies ``passes`` to the captured graph, then compiles it with
    ``inner`` (a backend name such as ``"aot_eager"`` / ``"inductor"``, or a backend callable)::

        torch.compile(model, backend=make_backend("aot_eager"), fullgraph=True)

    The same arguments return the same backend object. That matters: Dynamo keeps compiled
    code per backend object, so regional compile with a fresh backend per layer would
    recompile the shared ``forward`` once per layer and hit the recompile limit.
    """
    names = _check_names(passes)
    key = (inner, names)
    if key not in _BACKENDS:
        inner_fn = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

        def backend(gm: fx.GraphModule, example_inputs):
            for name in names:
                rewrites = apply_pass(gm, name)
                logger.info(f"compile pass {name}: {rewrites} rewrite(s) in a graph of {len(gm.graph.nodes)} nodes")
            return inner_fn(gm, example_inputs)

        _BACKENDS[key] = backend
    return _BACKENDS[key]


__all__ = ["PASSES", "Installation", "PreGradPasses", "apply_pass", "install", "make_backend", "run_on_graph"]
