"""KDA's bf16 errors at long context: outputs and every gradient against a reference.

The reference is our chunked PyTorch path (`chunk_kda_torch`) run in fp32 on the same bf16
inputs, with the same input maps (q / k L2 norm, the bounded gate of a raw gate input z).
Beside ours (the public `chunk_kda`, Triton on CUDA) it runs fla's `chunk_kda` on the same
inputs, called as `bench_kda.py` calls it, and, with ``--variants``, ours again under other
kernel choices or tuning variables (`bench_kda.variant`), all in one process:

    python profiling/kda_grad_errors.py --T 32768 \\
        --variants torch:kernels.kda=torch,c32:TITAN_MOE_KDA_BWD_CHUNK=32x64x8x8

Inputs are the benchmark's (B 1, H 16, dk = dv = 128 by default: raw q, k, v and z ~ N(0, 1),
beta ~ U(0, 1), A_log = 0, dt_bias ~ N(0, 0.25)), so fla's stored autotuning results
apply. ``--gate-min`` sets g = g_min = -5 on every token instead (no gate map). Errors are
||x - ref|| / ||ref|| over the whole tensor, in float64 on the device. `dg` is the gradient
of the raw gate input (of g itself with ``--gate-min``). The GPU test
`tests/test_kda_long_context.py` uses these functions.
"""

from __future__ import annotations

import argparse

import torch
from bench_kda import parse_variants, variant  # profiling/ is on the path when this runs as a script

LOWER_BOUND = -5.0
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
LEAVES = ("q", "k", "v", "g", "beta")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 on the tensors' device (too large for a CPU copy
    at 128K tokens)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def random_inputs(B: int, T: int, H: int, dk: int, seed: int, device: str = "cuda",
                  gate_min: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The benchmark's inputs (raw gate input as "g", plus A_log and dt_bias), or with
    `gate_min` g = -5 everywhere in fp32 and no gate map; and an output gradient `do`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

    inputs = dict(
        q=randn(B, T, H, dk), k=randn(B, T, H, dk), v=randn(B, T, H, dk), g=randn(B, T, H, dk),
        beta=torch.rand(B, T, H, generator=gen).to(device, torch.bfloat16),
        A_log=torch.zeros(H, device=device),
        dt_bias=(torch.randn(H * dk, generator=gen) * 0.5).to(device),
    )
    if gate_min:
        inputs["g"] = torch.full((B, T, H, dk), LOWER_BOUND, device=device)
        del inputs["A_log"], inputs["dt_bias"]
    return inputs, randn(B, T, H, dk)


def _leaves(inputs: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {n: inputs[n].detach().to(dtype or inputs[n].dtype).requires_grad_() for n in LEAVES}


def _outputs_and_grads(o: torch.Tensor, leaves: dict[str, torch.Tensor], do: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = torch.autograd.grad(o, [leaves[n] for n in LEAVES], do.to(o.dtype))
    return {"o": o.detach(), **{f"d{n}": x for n, x in zip(LEAVES, grads)}}


def _gate_kwargs(inputs: dict[str, torch.Tensor]) -> dict:
    gated = "A_log" in inputs
    return dict(gate_in_kernel=gated, A_log=inputs.get("A_log"), dt_bias=inputs.get("dt_bias"))


def chunked_reference(inputs: dict[str, torch.Tensor], do: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our chunked PyTorch path in fp32 on the (bf16) inputs, the same input maps."""
    from titan_moe.ops.kda.chunk_torch import chunk_kda_torch, prepare_qkg

    leaves = _leaves(inputs, torch.float32)
    q, k, g = prepare_qkg(leaves["q"], leaves["k"], leaves["g"], use_qk_l2norm=True,
                          lower_bound=LOWER_BOUND, **_gate_kwargs(inputs))
    o, _ = chunk_kda_torch(q, k, leaves["v"], g, leaves["beta"])
    return _outputs_and_grads(o, leaves, do)


def ours(inputs: dict[str, torch.Tensor], do: torch.Tensor) -> dict[str, torch.Tensor]:
    from titan_moe.ops.kda import chunk_kda

    leaves = _leaves(inputs)
    o, _ = chunk_kda(*(leaves[n] for n in LEAVES), use_qk_l2norm=True, lower_bound=LOWER_BOUND,
                     **_gate_kwargs(inputs))
    return _outputs_and_grads(o, leaves, do)


def fla(inputs: dict[str, torch.Tensor], do: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """fla's `chunk_kda` on the same inputs (norm and, if gated, the bounded gate fused), or
    None without fla."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return None
    leaves = _leaves(inputs)
    gate = dict(A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], use_gate_in_kernel=True) if "A_log" in inputs else {}
    o, _ = fla_chunk_kda(*(leaves[n] for n in LEAVES), use_qk_l2norm_in_kernel=True, safe_gate=True,
                         lower_bound=LOWER_BOUND, **gate)
    return _outputs_and_grads(o, leaves, do)


def errors(got: dict[str, torch.Tensor] | None, ref: dict[str, torch.Tensor]) -> dict[str, float] | None:
    return None if got is None else {n: rel_err(got[n], ref[n]) for n in NAMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=32768)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate-min", action="store_true", help="g = g_min = -5 on every token")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--variants", default="", metavar="NAME:VAR=VALUE[+VAR=VALUE],...")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    inputs, do = random_inputs(args.B, args.T, args.H, args.dk, args.seed, args.device, args.gate_min)
    ref = chunked_reference(inputs, do)
    rows = [("ours", errors(ours(inputs, do), ref))]
    if not args.no_fla and args.device == "cuda":
        rows.append(("fla", errors(fla(inputs, do), ref)))
    for name, env in parse_variants(args.variants).items():
        try:
            with variant(env):
                rows.append((name, errors(ours(inputs, do), ref)))
        except Exception as exc:  # one broken setting must not cost the others' rows
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            rows.append((name, None))
    print(f"B {args.B} T {args.T} H {args.H} dk {args.dk} seed {args.seed}"
          f"{' g = g_min' if args.gate_min else ''}: relative error against the chunked fp32 path")
    print(f"{'impl':<12}" + "".join(f"{n:>10}" for n in NAMES))
    for name, errs in rows:
        cells = "".join(f"{'-':>10}" for _ in NAMES) if errs is None else "".join(f"{errs[n]:>10.2e}" for n in NAMES)
        print(f"{name:<12}{cells}", flush=True)


if __name__ == "__main__":
    main()
