"""The compiled training graphs of one step, written as readable Python files.

Training compiles each decoder layer as its own `torch.compile(fullgraph=True)` region
(torchtitan's regional compile); layers of one kind (KDA or MLA attention, dense or MoE
FFN) share a graph. `dump_training_graphs` compiles the layers the same way, with one
recording backend per layer kind, runs one forward and backward step, and writes per kind:

    <out>/<kind>/dynamo_graph_<n>.py     the graph Dynamo captured (torch-level ops, our
                                         custom ops as single calls)
    <out>/<kind>/after_passes_<n>.py     with ``passes``: the same graph after our FX passes
                                         (`titan_moe.compile_passes`), what AOTAutograd gets
    <out>/<kind>/aot_forward_<n>.py      AOTAutograd's forward and backward graphs (ATen
    <out>/<kind>/aot_backward_<n>.py     ops after functionalization and partitioning)
    <out>/<kind>/inductor_forward_<n>.py with ``inductor=True``: the code Inductor generated
    <out>/<kind>/inductor_backward_<n>.py  for each of them (C++ on CPU, Triton on GPU)
    <out>/index.json                     kinds, their layers, files, the custom ops seen and
                                         each pass's rewrites

``<kind>`` is ``kda_dense``, ``kda_moe``, ``mla_moe``, ...; ``<n>`` counts graphs of that
kind (a recompile adds one). Without Inductor the backend is AOTAutograd with graph-keeping
compilers (like ``aot_eager``): fast, the graphs are exactly what Inductor would receive
minus its decompositions. With Inductor the AOT graphs are the ones Inductor compiled
(after its decompositions); its codegen compiles every kind's kernels, which makes it the
slow, opt-in part (``--inductor``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from titan_moe.model.decoder import Decoder
from titan_moe.model.moe import LatentMoE

_OP_PATTERN = re.compile(r"\bops\.titan_moe\.(\w+)")


@dataclass
class RegionDump:
    """What was written for one layer kind."""

    kind: str
    layers: list[int]
    files: list[Path] = field(default_factory=list)
    rewrites: dict[str, int] = field(default_factory=dict)  # compile pass -> sites rewritten

    def custom_ops(self) -> list[str]:
        """``titan_moe.<op>`` names found in this kind's graph files."""
        found: set[str] = set()
        for path in self.files:
            found.update(f"titan_moe.{m}" for m in _OP_PATTERN.findall(path.read_text()))
        return sorted(found)


def layer_kind(model: Decoder, layer_idx: int) -> str:
    """``<attention>_<ffn>`` of a layer, e.g. ``kda_dense`` or ``mla_moe``."""
    layer = model.layers[str(layer_idx)]
    return f"{layer.kind}_{'moe' if layer.is_moe else 'dense'}"


class _GraphRecorder:
    """A `torch.compile` backend that writes every graph it is given into one folder."""

    def __init__(self, region: RegionDump, folder: Path, inductor: bool, passes: tuple[str, ...] = ()):
        self.region, self.folder, self.inductor, self.passes = region, folder, inductor, passes
        self.n_graphs = 0

    def _write(self, name: str, text: str) -> None:
        path = self.folder / name
        path.write_text(text)
        self.region.files.append(path)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        n = self.n_graphs
        self.n_graphs += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write(f"dynamo_graph_{n}.py", gm.print_readable(print_output=False))
        if self.passes:
            from titan_moe.compile_passes import apply_pass

            for name in self.passes:
                self.region.rewrites[name] = self.region.rewrites.get(name, 0) + apply_pass(gm, name)
            self._write(f"after_passes_{n}.py", gm.print_readable(print_output=False))
        if self.inductor:
            return self._inductor(gm, example_inputs, n)
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def keep(which: str):
            def compiler(graph: torch.fx.GraphModule, _inputs: list) -> Callable:
                self._write(f"aot_{which}_{n}.py", graph.print_readable(print_output=False))
                return make_boxed_func(graph.forward)

            return compiler

        backend = aot_autograd(
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            inference_compiler=keep("inference"),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list, n: int) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner(graph: torch.fx.GraphModule, inputs: list, **kwargs):
            which = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
            self._write(f"aot_{which}_{n}.py", graph.print_readable(print_output=False))
            compiled = compile_fx_inner(graph, inputs, **kwargs)
            source = getattr(compiled, "source_code", None)
            self._write(f"inductor_{which}_{n}.py", source or "# this torch version keeps no source for the graph\n")
            return compiled

        return compile_fx(gm, example_inputs, inner_compile=inner)


def _no_compile_caches():
    """Caches that would skip our compilers on a hit (a second run would write nothing)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    return functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(fx_graph_cache=False)


def dump_training_graphs(
    model: Decoder,
    tokens_BT: torch.Tensor,
    out_dir: str | Path,
    *,
    doc_ids_BT: torch.Tensor | None = None,
    inductor: bool = False,
    passes: tuple[str, ...] = (),
) -> list[RegionDump]:
    """Compile every layer as a region, run one training step, and write the graphs.

    Args:
        model: the decoder (eager, unwrapped). Its layers are compiled for the step and
            put back afterwards; gradients and MoE balancing statistics of the step are
            discarded and the train/eval mode restored.
        tokens_BT: int64 [B, T] tokens of the step (next-token loss on them).
        out_dir: folder for the files (created).
        doc_ids_BT: optional int32 [B, T] packed-document ids, as in training.
        inductor: also run Inductor and write its generated code (slow on CPU).
        passes: our FX passes to run on each captured graph, as `[compile] passes` does in
            training; the graph after them is written beside the captured one.

    Returns one `RegionDump` per layer kind. Resets Dynamo's caches first (so that every
    kind compiles here, with this backend).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch._dynamo.reset()
    regions: dict[str, RegionDump] = {}
    backends: dict[str, _GraphRecorder] = {}
    originals: dict[str, nn.Module] = dict(model.layers.named_children())
    was_training = model.training
    try:
        model.train()
        for name, layer in originals.items():
            kind = layer_kind(model, int(name))
            if kind not in regions:
                regions[kind] = RegionDump(kind=kind, layers=[])
                backends[kind] = _GraphRecorder(regions[kind], out / kind, inductor, tuple(passes))
            regions[kind].layers.append(int(name))
            # One backend object per kind: layers of that kind reuse its compiled graph.
            model.layers.register_module(name, torch.compile(layer, backend=backends[kind], fullgraph=True))
        caches = _no_compile_caches() if inductor else ()
        for patch in caches:
            patch.__enter__()
        try:
            logits_BTV = model(tokens_BT, doc_ids_BT)
            loss = F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), tokens_BT[:, 1:].flatten())
            loss.backward()
        finally:
            for patch in reversed(caches):
                patch.__exit__(None, None, None)
    finally:
        for name, layer in originals.items():
            model.layers.register_module(name, layer)
        model.zero_grad(set_to_none=True)
        for module in model.modules():
            if isinstance(module, LatentMoE):
                module.reset_balance_stats()
        model.train(was_training)
        torch._dynamo.reset()
    index = {
        kind: {
            "layers": r.layers,
            "files": [str(p.relative_to(out)) for p in r.files],
            "custom_ops": r.custom_ops(),
            "pass_rewrites": r.rewrites,
        }
        for kind, r in regions.items()
    }
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return list(regions.values())
