"""Benchmark: parts of the width-4096 training step against their earlier forms or floors.

    python profiling/bench_step_parts.py                  # H200: wide_1gpu's shapes, bf16
    python profiling/bench_step_parts.py --parts requant  # a subset (situ, mix, refresh, dw, requant, situ_quant,
                                                          # linear_cache)
    python profiling/bench_step_parts.py --device cpu --tiny   # plumbing check, no speed claim

Each provider is compiled (Inductor, ``fullgraph=True``) and timed forward+backward in
interleaved rounds (`bench_moe.measure_rounds`):

* SiTU-GLU of the experts' packed gate|up projection ``z [M, 2H]`` -> ``[M, H]``:
  ``packed`` is `titan_moe.model.situ.situ_glu_packed`, the model's compiled path
  (Inductor's forward, the ``titan_moe::situ_glu_bwd`` op's one-pass Triton backward);
  ``halves`` is the earlier form, autograd through ``z[:, :H]`` and ``z[:, H:]``. Shapes: M = 16,384 tokens x top-4 = 65,536 rows, H = 4096
  (configs/wide_1gpu.toml's routed experts).
* The AttnRes mix over ``S`` stacked sources ``[S, B, T, D]``: ``mixer`` is
  `titan_moe.model.attn_res.AttnResMixer`; ``einsum`` is the earlier form, the logits as a
  matmul with the query vector and the weighted sum as ``einsum("sbt,sbtd->btd")``.
  Shapes: S = 3 (wide_1gpu: 8 layers in blocks of 4), B = 4, T = 4096, D = 4096.
* SiTU-GLU also as ``situ_op`` (the ``titan_moe::situ_glu`` op, one Triton kernel per
  direction, opaque to Inductor).
* The fp8 experts' weight refresh (`titan_moe.float8.quantize.quantize_weight_triton`, both
  fp8 layouts of an fp32 ``[E, K, N]`` weight), wide_1gpu's two expert weights (E = 16:
  gate|up 2048 x 8192, down 4096 x 2048), timed once per tile setting in
  ``--weight-tiles`` (``BKxBNxAWxQW``: tile rows, tile columns, warps of the amax and the
  quantization kernel; ``default`` is the launcher's).
* The fp8 experts' bf16 weight gradient for fp32 weights, wide_1gpu's two expert GEMMs
  (E = 16 balanced groups of 4096 rows; x [65,536, 2048], dy [65,536, 8192] and x [65,536,
  4096], dy [65,536, 2048]): ``dw_native_to_fp32`` is ``torch._grouped_mm`` (bf16 out) and
  ATen's conversion to fp32, what the fp8 backward did until ``dw_native_widen_fp32`` (the
  same with `titan_moe.float8.widen.widen_to_fp32`, what it does now); ``dw_triton_fp32`` /
  ``dw_triton_tma_fp32`` (also at the tile 64x256x128, 8 warps, 3 stages): our Triton dw
  kernel storing its fp32 accumulator directly.
* The ``fp8_rows`` weight gradient's requantization
  (`titan_moe.float8.quantize.requantize_group_columns_triton`: row codes with power-of-two
  scales re-expressed per group, column-major out) at wide_1gpu's x and dy of the gate|up
  GEMM (E = 16 balanced; [65,536, 2048] and [65,536, 8192]) and at the MoE-compute issue's
  x (E = 64, [65,536, 2048], balanced and Zipf(1.1)), timed per tile setting in
  ``--requant-tiles`` (``BMxBCxW``: rows, columns, warps); beside it the floor of the same
  traffic, a plain transposed copy of the codes (``transpose``), and the bf16 path's
  per-group column quantization (``group_cols``, ``wgrad="fp8"``).
* The fp8 linears' weight cast once per optimizer step (``linear_cache``): four 4096 x 4096
  linears on 16,384 tokens under bf16 autocast with fp32 weights (the trainer's setting at
  wide_1gpu's width), compiled: ``linears_bf16``, ``linears_fp8_per_call`` (torchao's
  tensorwise `Float8Linear`) and ``linears_fp8_cached`` (`CachedFloat8Linear`, weights cast
  beforehand; the JSON line says whether its output equals the per-call one).
* SiTU-GLU fused into the down GEMM's row quantization (``situ_quant``,
  `titan_moe.float8.quantize.quantize_situ_rows_triton`, the activation never written)
  against SiTU-GLU then the row quantization (``situ_then_rows``: the compiled
  `situ_glu_packed` forward, then `quantize_rows_triton`), forward only, power-of-two scales,
  at wide_1gpu's z [65,536, 8192] bf16.

Printed: one row per provider (median ms over the rounds, spread), then a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import group_sizes, measure_rounds  # noqa: E402

from titan_moe.model.attn_res import AttnResMixer, ResidualStream  # noqa: E402
from titan_moe.model.situ import situ_glu_packed  # noqa: E402
from titan_moe.ops.situ import situ_glu_forward_torch  # noqa: E402


def situ_halves(z_M2H: torch.Tensor) -> torch.Tensor:
    """The earlier compiled form: autograd through the two slices of ``z``."""
    hidden = z_M2H.shape[-1] // 2
    return situ_glu_forward_torch(z_M2H[..., :hidden], z_M2H[..., hidden:], 4.0, 25.0)


def mix_einsum(mixer: AttnResMixer, stream: ResidualStream) -> torch.Tensor:
    """The earlier AttnRes mix: a matmul with the query for the logits, an einsum for the sum."""
    wq_D = mixer.key_norm.weight.float() * mixer.query.float()

    def logits(v_XD):
        return (v_XD @ wq_D) * torch.rsqrt(v_XD.square().mean(-1) + mixer.eps)

    v_SBTD = torch.stack(stream.sources).float()
    S = v_SBTD.shape[0]
    logit_SBT = logits(v_SBTD)
    cur_BTD = stream.partial_BTD.float()
    logit_BT = logits(cur_BTD).masked_fill(~stream.partial_used, float("-inf"))
    p_SBT = torch.softmax(torch.cat([logit_SBT, logit_BT[None]], dim=0), dim=0)
    h_BTD = torch.einsum("sbt,sbtd->btd", p_SBT[:S], v_SBTD) + p_SBT[S, ..., None] * cur_BTD
    return h_BTD.to(stream.partial_BTD.dtype)


def fwd_bwd(fn, inputs, grad):
    def run():
        fn(*inputs).backward(grad)
    return run


def weight_grads(device, dtype, tiny: bool) -> dict:
    """{provider: fn} for the fp32 weight gradient of wide_1gpu's two expert GEMMs."""
    from titan_moe.float8.widen import widen_to_fp32
    from titan_moe.ops.grouped_gemm.triton_kernel import TileConfig, grouped_mm_dw_triton

    E, rows = (2, 32) if tiny else (16, 4096)
    shapes = {"gate_up": (64, 128), "down": (128, 64)} if tiny else {"gate_up": (2048, 8192), "down": (4096, 2048)}
    offs_E = torch.arange(1, E + 1, device=device, dtype=torch.int32) * rows
    fns = {}
    for name, (K, N) in shapes.items():
        x_MK = torch.randn(E * rows, K, device=device).to(dtype)
        dy_MN = torch.randn(E * rows, N, device=device).to(dtype)
        fns[f"dw_{name}_native_to_fp32"] = (
            lambda x=x_MK, dy=dy_MN: torch.ops.titan_moe.grouped_mm_dw(x, dy, offs_E, "native").float())
        if dtype == torch.bfloat16:
            fns[f"dw_{name}_native_widen_fp32"] = (  # the fp8 backward's conversion now (float8.widen)
                lambda x=x_MK, dy=dy_MN: widen_to_fp32(torch.ops.titan_moe.grouped_mm_dw(x, dy, offs_E, "native")))
        fns[f"dw_{name}_triton_fp32"] = (
            lambda x=x_MK, dy=dy_MN: grouped_mm_dw_triton(x, dy, offs_E, out_dtype=torch.float32))
        if device.type == "cuda":
            fns[f"dw_{name}_triton_tma_fp32"] = (
                lambda x=x_MK, dy=dy_MN: grouped_mm_dw_triton(x, dy, offs_E, tma=True, out_dtype=torch.float32))
            fns[f"dw_{name}_triton_tma_64x256x128_fp32"] = (  # the tile the E=64 sweep found for the TMA dw
                lambda x=x_MK, dy=dy_MN: grouped_mm_dw_triton(
                    x, dy, offs_E, config=TileConfig(64, 256, 128, 8, 3), tma=True, out_dtype=torch.float32))
    return fns


def weight_refresh(tiles: list[str], device, tiny: bool) -> dict:
    """{"<tiles> <weight>": fn} timing quantize_weight_triton per tile setting and weight."""
    from titan_moe.float8.quantize import quantize_weight_triton

    shapes = {"gate_up": (2, 32, 64), "down": (2, 64, 32)} if tiny else {"gate_up": (16, 2048, 8192), "down": (16, 4096, 2048)}
    fns = {}
    for name, shape in shapes.items():
        w = torch.randn(*shape, device=device)
        for setting in tiles:
            kwargs = {}
            if setting != "default":
                bk, bn, aw, qw = (int(v) for v in setting.split("x"))
                kwargs = dict(block_k=bk, block_n=bn, amax_warps=aw, quant_warps=qw)
            fns[f"refresh_{name}_{setting}"] = (lambda w=w, kw=kwargs: quantize_weight_triton(w, **kw))
    return fns


def requant_parts(tiles: list[str], device, tiny: bool) -> dict:
    """{"<part> <case>": fn}: the group requantization per tile setting, a transposed copy
    of the codes, and the per-group column quantization of the bf16 tensor."""
    from titan_moe.float8.quantize import (quantize_group_columns_triton, quantize_rows_triton,
                                           requantize_group_columns_triton)

    cases = ({"tiny": (64, 32, 4, "zipf")} if tiny else
             {"wide_x": (65_536, 2048, 16, "balanced"), "wide_dy": (65_536, 8192, 16, "balanced"),
              "e64_x": (65_536, 2048, 64, "balanced"), "e64_zipf_x": (65_536, 2048, 64, "zipf")})
    fns = {}
    for name, (M, C, E, dist) in cases.items():
        offs_E = torch.tensor(group_sizes(M, E, dist), device=device).cumsum(0).to(torch.int32)
        t_MC = torch.randn(M, C, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        q_MC, s_M = quantize_rows_triton(t_MC, pow2=True)
        for setting in tiles:
            kwargs = {}
            if setting != "default":
                bm, bc, warps = (int(v) for v in setting.split("x"))
                kwargs = dict(block_m=bm, block_c=bc, num_warps=warps)
            fns[f"requant_{name}_{setting}"] = (
                lambda q=q_MC, s=s_M, o=offs_E, kw=kwargs: requantize_group_columns_triton(q, s, o, **kw))
        fns[f"transpose_{name}"] = lambda q=q_MC: q.view(torch.uint8).t().contiguous()
        fns[f"group_cols_{name}"] = (
            lambda t=t_MC, o=offs_E: quantize_group_columns_triton(t, o, offs_aligned=True))
    return fns


def situ_parts(device, dtype, tiny: bool, gen, results: dict) -> tuple[dict, list]:
    """{provider: fwd+bwd fn} of the SiTU-GLU forms, and the tensors whose grads to reset;
    records the adopted form's difference from the earlier one in ``results``."""
    M, H = (64, 32) if tiny else (65_536, 4096)
    z = (3 * torch.randn(M, 2 * H, device=device, generator=gen)).to(dtype).requires_grad_()
    g_MH = torch.randn(M, H, device=device, generator=gen).to(dtype)
    situ = {
        "situ_packed": fwd_bwd(compiled(situ_glu_packed), (z,), g_MH),
        "situ_halves": fwd_bwd(compiled(situ_halves), (z,), g_MH),
        "situ_op": fwd_bwd(compiled(lambda t: torch.ops.titan_moe.situ_glu(t, 4.0, 25.0)), (z,), g_MH),
    }
    outs = [compiled(f)(z) for f in (situ_glu_packed, situ_halves)]
    results["situ_max_abs_diff"] = float((outs[0].detach().float() - outs[1].detach().float()).abs().max())
    return situ, [z]


def mix_parts(device, dtype, tiny: bool, gen, results: dict) -> tuple[dict, list]:
    """As :func:`situ_parts`, for the AttnRes mix."""
    S, B, T, D = (3, 1, 8, 32) if tiny else (3, 4, 4096, 4096)
    mixer = AttnResMixer(D).to(device)
    with torch.no_grad():
        mixer.query.normal_(generator=gen)
    srcs = [torch.randn(B, T, D, device=device, generator=gen).to(dtype) for _ in range(S)]
    with torch.no_grad():  # the stream's tensors as leaves, no graph behind them
        stream = ResidualStream.start(srcs[0], "block", n_layers=2 * (S - 1), block_size=2)
        for s in srcs[1:]:
            stream = stream.add(s).add(s).close_block()
        stream = stream.add(srcs[-1])
    for t in (*stream.sources, stream.partial_BTD):
        t.requires_grad_()
    g_BTD = torch.randn(B, T, D, device=device, generator=gen).to(dtype)
    mix = {
        "attn_res_mixer": fwd_bwd(compiled(mixer), (stream,), g_BTD),
        "attn_res_einsum": fwd_bwd(compiled(lambda st: mix_einsum(mixer, st)), (stream,), g_BTD),
    }
    with torch.no_grad():
        results["attn_res_max_abs_diff"] = float((mixer(stream).float() - mix_einsum(mixer, stream).float()).abs().max())
    return mix, [mixer.query, mixer.key_norm.weight, *stream.sources, stream.partial_BTD]


def compiled(fn):
    return torch.compile(fn, fullgraph=True)


PARTS = ("situ", "mix", "refresh", "dw", "requant", "situ_quant", "linear_cache")


def linear_cache_parts(device, dtype, tiny: bool, gen, results: dict) -> tuple[dict, list]:
    """{provider: fwd+bwd fn} of four square linears under autocast (fp32 weights, as the
    trainer's), and the tensors whose grads to reset: bf16, tensorwise fp8 casting the weights
    per call (torchao's `Float8Linear`), and fp8 with the weights cast once beforehand
    (`CachedFloat8Linear`, what `cache_weights` does once per optimizer step). Records whether
    the two fp8 forms gave the same output (they must: the same codes)."""
    import copy
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from titan_moe.float8.cached_linear import refresh_fp8_linear_weights, use_cached_weights

    T, D = (64, 64) if tiny else (16_384, 4096)
    bf16 = torch.nn.Sequential(*[torch.nn.Linear(D, D, bias=False) for _ in range(4)]).to(device)
    per_call = copy.deepcopy(bf16)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=device.type != "cuda")
    convert_to_float8_training(per_call, config=config)
    cached = copy.deepcopy(per_call)
    use_cached_weights(cached)
    refresh_fp8_linear_weights(cached)
    x_TD = torch.randn(T, D, device=device, generator=gen).to(dtype).requires_grad_()
    g_TD = torch.randn(T, D, device=device, generator=gen).to(dtype)

    def under_autocast(module):
        step = compiled(module)

        def run(x):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                return step(x)
        return run

    fns = {f"linears_{name}": fwd_bwd(under_autocast(m), (x_TD,), g_TD)
           for name, m in (("bf16", bf16), ("fp8_per_call", per_call), ("fp8_cached", cached))}
    with torch.no_grad():
        results["linear_cache_same_output"] = bool(torch.equal(under_autocast(per_call)(x_TD),
                                                               under_autocast(cached)(x_TD)))
    tensors = [x_TD] + [p for m in (bf16, per_call, cached) for p in m.parameters()]
    return fns, tensors


def situ_quant_parts(device, dtype, tiny: bool, gen) -> dict:
    """{provider: fn}: the experts' activation quantized for the down GEMM, fused or not."""
    from titan_moe.float8.quantize import quantize_rows_triton, quantize_situ_rows_triton

    M, H = (64, 32) if tiny else (65_536, 4096)
    z = (3 * torch.randn(M, 2 * H, device=device, generator=gen)).to(dtype)
    situ = compiled(lambda t: situ_glu_packed(t, 4.0, 25.0))
    return {
        "situ_quant": lambda: quantize_situ_rows_triton(z, 4.0, 25.0, pow2=True),
        "situ_then_rows": lambda: quantize_rows_triton(situ(z), pow2=True),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes (plumbing check)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--weight-tiles", default="default",
                        help="comma-separated BKxBNxAWxQW settings of the weight refresh ('default': the launcher's)")
    parser.add_argument("--requant-tiles", default="default,64x128x4,128x64x4,128x128x4,256x128x8,128x256x8",
                        help="comma-separated BMxBCxW settings of the group requantization ('default': the launcher's)")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    device = torch.device(args.device)
    timed = device.type == "cuda"
    dtype = torch.bfloat16 if timed else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    results: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}

    fwd_bwd_fns, grads = {}, []
    for name, make in (("situ", situ_parts), ("mix", mix_parts), ("linear_cache", linear_cache_parts)):
        if name in parts:
            fns, tensors = make(device, dtype, args.tiny, gen, results)
            fwd_bwd_fns.update(fns)
            grads += tensors
    medians, spread = measure_rounds(fwd_bwd_fns, timed, grad_to_none=grads, rounds=args.rounds)
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # where the Triton kernels run
        kernels = {}
        if "refresh" in parts:
            kernels |= weight_refresh(args.weight_tiles.split(","), device, args.tiny)
        if "dw" in parts:
            kernels |= weight_grads(device, dtype, args.tiny)
        if "requant" in parts:
            kernels |= requant_parts(args.requant_tiles.split(","), device, args.tiny)
        if "situ_quant" in parts:
            with torch.no_grad():
                kernels |= situ_quant_parts(device, dtype, args.tiny, gen)
        more, more_spread = measure_rounds(kernels, timed, rounds=max(1, args.rounds // 2))
        medians.update(more)
        spread.update(more_spread)
    results["ms"] = medians
    results["spread"] = spread
    for name, ms in medians.items():
        shown = "not timed" if ms is None else f"{ms:8.3f} ms (spread {spread[name]:.0%})"
        kernel_only = name.startswith(("refresh", "dw_", "requant", "transpose", "group_cols", "situ_quant",
                                        "situ_then"))
        print(f"{name:32s} {'' if kernel_only else 'fwd+bwd '}{shown}")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
