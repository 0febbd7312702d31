"""`torch.export` programs for inference, their `.pt2` files and AOTInductor packages.

    programs = export_programs(model, capacity=256)     # {"prefill": ep, "prefill_packed": ep, "decode_step": ep}
    torch.export.save(programs["prefill"], "prefill.pt2")
    ep = load_program("prefill.pt2")                     # registers our ops first
    logits, state = ep.module()(tokens)

Dynamic sizes: the batch ``B`` in every program, the prompt length ``T`` in the prefills
(``2 <= T <= capacity``; packed: ``kda_conv_size + 1 <= T``) and the MLA buffer capacity
``L`` in the decode step. Programs are traced under ``torch.no_grad()`` from the model in
eval mode. The MoE layers' training statistics (``LatentMoE.TRAINING_STATS``) are left out, so a
program carries no constant tensors: torch 2.11's AOTInductor crashed loading CUDA packages
with constants (pytorch issue 172739), and inference never reads them.
Our custom ops (``titan_moe::kda_chunk_fwd``, ``titan_moe::grouped_mm``) stay
single nodes of the graphs; a process that loads a program must have them registered
(`load_program` imports ``titan_moe.ops``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.export import Dim, ExportedProgram

import titan_moe.ops  # noqa: F401  (registers the custom ops that the programs call)
from titan_moe.export.state import BATCH, CAPACITY, empty_state, state_specs
from titan_moe.export.wrappers import DecodeStep, PackedPrefill, Prefill
from titan_moe.model.decoder import Decoder
from titan_moe.model.moe import LatentMoE

PROGRAMS = ("prefill", "prefill_packed", "decode_step")
_MAX_BATCH = 1 << 16
_MAX_CAPACITY = 1 << 30


def min_prompt_len(model: Decoder, packed: bool) -> int:
    """Shortest prompt a prefill program accepts.

    2 unpacked (a one-token prompt is a decode step from `state.empty_state`). Packed, the
    short convolution's per-tap document masks make export specialise prompts shorter
    than ``kda_conv_size + 1``.
    """
    return model.args.kda_conv_size + 1 if packed else 2


def _example_tokens(model: Decoder, batch: int, T: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.args.vocab_size, (batch, T), generator=gen).to(device)


def _example_doc_ids(batch: int, T: int, device) -> torch.Tensor:
    """Two documents per row, cut at different places (a trace example, not a constraint)."""
    doc_ids = torch.zeros(batch, T, dtype=torch.int32)
    for row in range(batch):
        doc_ids[row, 1 + row % (T - 1) :] = 1
    return doc_ids.to(device)


def export_programs(
    model: Decoder,
    capacity: int,
    *,
    which: tuple[str, ...] = PROGRAMS,
    example_batch: int = 2,
) -> dict[str, ExportedProgram]:
    """Export the inference programs of `model` (on its device and dtype).

    Args:
        model: the decoder; put in eval mode (left there).
        capacity: slots of the MLA buffers a prefill returns (the longest prompt plus the
            tokens to generate); at least ``kda_conv_size + 2`` so that every program can
            trace a prompt shorter than it.
        which: a subset of `PROGRAMS`.
        example_batch: batch of the trace examples (>= 2, so that B stays symbolic).

    Returns ``{name: ExportedProgram}``; see the module docstring for signatures.
    """
    unknown = set(which) - set(PROGRAMS)
    if unknown:
        raise ValueError(f"unknown programs {sorted(unknown)}; choose from {PROGRAMS}")
    if capacity < model.args.kda_conv_size + 2:
        raise ValueError(f"capacity must be >= kda_conv_size + 2 = {model.args.kda_conv_size + 2}, got {capacity}")
    if example_batch < 2:
        raise ValueError(f"example_batch must be >= 2, got {example_batch}")
    model.eval()
    with _without_training_stats(model):
        return _export_all(model, capacity, which, example_batch)


@contextlib.contextmanager
def _without_training_stats(model: Decoder) -> Iterator[None]:
    """Detach the MoE layers' training-statistics buffers for the duration (put back after)."""
    removed = []
    for module in model.modules():
        if isinstance(module, LatentMoE):
            for name in LatentMoE.TRAINING_STATS:
                if name in module._buffers:
                    removed.append((module, name, module._buffers.pop(name)))
    try:
        yield
    finally:
        for module, name, buf in removed:
            module.register_buffer(name, buf, persistent=False)


def _export_all(model: Decoder, capacity: int, which, example_batch: int) -> dict[str, ExportedProgram]:
    device = model.output.weight.device
    dtype = model.output.weight.dtype
    B = Dim("batch", min=1, max=_MAX_BATCH)
    out: dict[str, ExportedProgram] = {}
    with torch.no_grad():
        for name in which:
            if name == "decode_step":
                out[name] = _export_decode(model, B, example_batch, capacity, device, dtype)
                continue
            packed = name == "prefill_packed"
            T = Dim("prompt_len", min=min_prompt_len(model, packed), max=capacity)
            # An example strictly inside the range, so that no bound is specialised on.
            T_example = max(min_prompt_len(model, packed) + 1, min(capacity - 1, 16))
            tokens = _example_tokens(model, example_batch, T_example, device)
            if packed:
                doc_ids = _example_doc_ids(example_batch, T_example, device)
                out[name] = torch.export.export(
                    PackedPrefill(model, capacity), (tokens, doc_ids),
                    dynamic_shapes={"tokens": {0: B, 1: T}, "doc_ids": {0: B, 1: T}},
                )
            else:
                out[name] = torch.export.export(
                    Prefill(model, capacity), (tokens,), dynamic_shapes={"tokens": {0: B, 1: T}}
                )
    return out


def _export_decode(model: Decoder, B: Dim, batch: int, capacity: int, device, dtype) -> ExportedProgram:
    L = Dim("capacity", min=2, max=_MAX_CAPACITY)
    sizes = {BATCH: B, CAPACITY: L}
    specs = state_specs(model.args, dtype)
    state_dims = tuple(
        {i: sizes[s] for i, s in enumerate(spec.shape) if isinstance(s, str)} or None for spec in specs
    )
    state = empty_state(model.args, batch, capacity, dtype=dtype, device=device)
    tokens = _example_tokens(model, batch, 1, device)
    return torch.export.export(
        DecodeStep(model), (tokens, state), dynamic_shapes={"tokens": {0: B}, "state": state_dims}
    )


def custom_ops_in(ep: ExportedProgram) -> list[str]:
    """Names (``titan_moe.<op>``) of our custom ops called by the program's graph."""
    names = {
        str(node.target).rsplit(".", 1)[0]
        for node in ep.graph_module.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("titan_moe.")
    }
    return sorted(names)


def load_program(path: str | Path) -> ExportedProgram:
    """`torch.export.load` after registering our custom ops (the graph calls them by name)."""
    return torch.export.load(str(path))


def aoti_package(ep: ExportedProgram, path: str | Path) -> Path:
    """Compile `ep` with AOTInductor into a ``.pt2`` package at `path`.

    Our custom ops have Python implementations only, so the generated code calls them back
    through the dispatcher: load the package with `torch._inductor.aoti_load_package` in a
    Python process that imported ``titan_moe.ops``. It is not a standalone C++ artifact.
    """
    out = torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return Path(out)
