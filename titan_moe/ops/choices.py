"""Which implementation each op runs: the `[kernels]` config section, resolved once.

Every behaviour choice of the ops lives in `KernelChoices`: the trainer fills it from the
TOML `[kernels]` table (`titan_moe.config`), reconciles it with the hardware once with
`resolve` when the model is built, logs it in one start-up line (`summary`), records it with
the run, and makes it current with `activate`. Ops read `current()` where they pick a path;
they never read the environment for a choice (launch tuning lives in `launch_env`).

Values per field are listed in each field's docstring; "auto" means: the fastest measured
path for the device (docs/kernels.md).

Tests and tools that want one path for a block use `using(KernelChoices(...))`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Literal

from titan_moe.ops.backend import triton_runs_on

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")
GROUPED_MM_BACKENDS = ("auto", "native", "triton", "gluon", "loop")
GROUPED_MM_PRODUCTS = ("fwd", "dx", "dw")


@dataclass(frozen=True)
class KernelChoices:
    situ: Backend = "auto"
    """SiTU-GLU of experts and FFNs in eager layers: auto (Triton on CUDA, PyTorch elsewhere),
    torch, triton."""

    dispatch: Backend = "auto"
    """MoE permute / unpermute-combine: auto (Triton on CUDA, PyTorch elsewhere), torch, triton."""

    router_topk: Backend = "auto"
    """The fused sigmoid router top-k (with compile.passes = ["router_fusion"]): auto, torch, triton."""

    grouped_mm: str = "auto"
    """The routed experts' grouped GEMM (`titan_moe.ops.grouped_gemm`), one backend for the
    forward, dx and dw products or one per product ("fwd=triton,dx=triton,dw=native"; a product
    not named takes native). Backends: native (torch._grouped_mm where it supports the dtype and
    alignment, else a per-group loop), triton (our persistent Triton kernels), gluon (our
    warp-specialized sm90 kernels where their scope covers the call, else triton), loop (the
    per-group reference loop), auto (per call from the shapes on sm90 with 16-bit operands:
    gluon for large groups, triton for midsize ones, native otherwise; native on other devices)."""

    kda: Backend = "auto"
    """KDA chunked attention and its eager input maps (`titan_moe::kda_chunk_fwd/bwd`, their
    `_kept` pair, `kda_prepare`): auto (Triton on CUDA, PyTorch elsewhere), torch, triton.
    Shapes the kernels do not cover (float64, head dims outside 16-128) take PyTorch. A model
    with unbounded decay gates (`model.kda_gate = "unbounded"`) runs PyTorch: "auto" resolves to
    torch for it, "triton" is refused (the kernels' tiles assume gates bounded below by -5)."""

    kda_keep: bool = True
    """KDA under autograd keeps the forward's intermediates for the backward (the
    `kda_chunk_fwd_kept` op; with the Triton kernels about 2.25 KiB per token and head at
    dk = dv = 128 in bf16, counted by `titan_moe.plan`); false: the backward recomputes them
    (less memory, slower)."""


_current = KernelChoices()


def current() -> KernelChoices:
    """The choices in force in this process (defaults until `activate`)."""
    return _current


def activate(choices: KernelChoices) -> KernelChoices:
    """Make `choices` current for this process (checked first: `check`); returns the previous ones."""
    global _current
    check(choices)
    previous, _current = _current, choices
    return previous


@contextlib.contextmanager
def using(choices: KernelChoices | None = None, **fields) -> Iterator[KernelChoices]:
    """Run a block under `choices` (or the current ones with `fields` replaced)."""
    chosen = dataclasses.replace(choices or current(), **fields)
    previous = activate(chosen)
    try:
        yield chosen
    finally:
        activate(previous)


def grouped_mm_backends(spec: str, source: str = "kernels.grouped_mm") -> dict[str, str]:
    """{product: backend} of a grouped-GEMM spec: one name of GROUPED_MM_BACKENDS for the three
    products, or PRODUCT=NAME pairs joined by commas (products not named: native). A ValueError
    naming `source` for anything else."""
    if "=" not in spec:
        names = dict.fromkeys(GROUPED_MM_PRODUCTS, spec)
    else:
        names = dict.fromkeys(GROUPED_MM_PRODUCTS, "native")
        for item in spec.split(","):
            key, _, name = item.partition("=")
            if key not in GROUPED_MM_PRODUCTS:
                raise ValueError(f"{source}: products are {GROUPED_MM_PRODUCTS}, got {item!r} in {spec!r}")
            names[key] = name
    if any(name not in GROUPED_MM_BACKENDS for name in names.values()):
        raise ValueError(f"{source} must name backends of {GROUPED_MM_BACKENDS}, got {spec!r}")
    return names


def _is_backend_field(f: dataclasses.Field) -> bool:
    return f.type == "Backend" or f.type is Backend


def check(choices: KernelChoices) -> None:
    """A ValueError naming the key for a value no device runs (device-independent checks)."""
    for f in dataclasses.fields(choices):
        value = getattr(choices, f.name)
        if _is_backend_field(f) and value not in BACKENDS:
            raise ValueError(f"kernels.{f.name} must be one of {BACKENDS}, got {value!r}")
    grouped_mm_backends(choices.grouped_mm)


def pick_backend(value: str, device_type: str) -> str:
    """"torch" or "triton" for a Backend value on `device_type` ("auto": Triton on CUDA)."""
    if value == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return value


def _resolve_grouped_mm(spec: str, device_type: str) -> str:
    names = grouped_mm_backends(spec)
    if device_type != "cuda":
        names = {p: "native" if name == "auto" else name for p, name in names.items()}
        if "gluon" in names.values():
            raise ValueError(f"kernels.grouped_mm = {spec!r}: the gluon kernels run on CUDA (sm90) only, "
                             f"not on {device_type}")
    if len(set(names.values())) == 1:
        return names["fwd"]
    return ",".join(f"{p}={name}" for p, name in names.items())


def resolve(choices: KernelChoices, device_type: str, kda_gate_bounded: bool = True) -> KernelChoices:
    """`choices` with every "auto" replaced by the path it stands for on `device_type` (the
    grouped GEMM's "auto" stays on CUDA: it picks per call from the shapes), and a ValueError
    naming the key for a value the device cannot run (Triton off CUDA without the interpreter,
    TRITON_INTERPRET=1; Gluon off CUDA) or the model cannot (`kda_gate_bounded` False: the
    model's KDA gates have no lower bound, which only the PyTorch KDA path computes; "auto"
    then resolves to torch)."""
    check(choices)
    if not kda_gate_bounded and choices.kda == "triton":
        raise ValueError("kernels.kda = 'triton' cannot run model.kda_gate = 'unbounded' (the Triton KDA "
                         "kernels need gates bounded below by -5); set kernels.kda = 'torch' or 'auto'")
    out = {}
    for f in dataclasses.fields(choices):
        value = getattr(choices, f.name)
        if f.name == "kda" and not kda_gate_bounded:
            value = "torch"
        elif _is_backend_field(f):
            value = pick_backend(value, device_type)
        elif f.name == "grouped_mm":
            value = _resolve_grouped_mm(value, device_type)
        else:
            out[f.name] = value
            continue
        if "triton" in str(value) and not triton_runs_on(device_type):
            raise ValueError(f"kernels.{f.name} = {getattr(choices, f.name)!r}: the Triton kernels run on CUDA "
                             f"(or on CPU under TRITON_INTERPRET=1), not on {device_type}")
        out[f.name] = value
    return KernelChoices(**out)


def summary(choices: KernelChoices) -> str:
    """One line: `kernels: situ=triton dispatch=triton ...`."""
    return "kernels: " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(choices).items())
