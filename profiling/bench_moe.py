"""Benchmark: the grouped expert GEMM and the whole MoE layer, ours against the peers.

    python profiling/bench_moe.py                       # H200: the shapes below, bf16
    python profiling/bench_moe.py --sweep-tiles         # also time Triton tile shapes per product
    python profiling/bench_moe.py --best-tiles OUT.txt  # that sweep's winners, as $TITAN_MOE_GROUPED_MM_TILES
    python profiling/bench_moe.py --skip-gemm --layer-kernels 8   # MoE layer: device kernels per provider
    python profiling/bench_moe.py --device cpu --tiny   # plumbing check only, no speed claim
    python profiling/bench_moe.py --skip-gemm --skip-layer --dispatch   # token dispatch only
    python profiling/bench_moe.py --skip-layer --cuda-graph   # GEMMs timed as CUDA-graph replays

Part 1, grouped GEMM ``out[rows of e] = x[rows of e] @ w[e]``, forward and forward+backward
(dx and dw), three providers on the same inputs:

* ``triton``: ``grouped_mm(..., backend="triton")``, our persistent Triton kernels
  (pointer loads);
* ``triton_tma`` (sm90 only): the same with ``TITAN_MOE_GROUPED_MM_TMA=1``, TMA-descriptor
  loads in the forward and dx kernel (bit-identical to ``torch._grouped_mm`` in every run
  so far; its error columns say so per run);
* ``tma_dw_native`` (sm90 only): per-product backends, the forward and dx on the TMA kernel
  and dw on ``torch._grouped_mm`` (``backend="fwd=triton,dx=triton,dw=native"``);
* ``native``: ``grouped_mm(..., backend="native")``, our op around ``torch._grouped_mm``
  (adds the zeroing of unowned rows / empty groups);
* ``auto``: ``grouped_mm(..., backend="auto")``, the backend chosen per call from the shapes
  (``titan_moe.ops.grouped_gemm.op.auto_backend``);
* ``gluon`` (sm90 only): ``grouped_mm(..., backend="gluon")``, our warp-specialized Gluon
  kernels (ping-pong forward / dx, the default dw tile); ``gluon_dwtriton``: the same forward
  and dx with our Triton dw; ``gluon_<tile>``: each dw tile of
  ``titan_moe.ops.grouped_gemm.gluon_kernel.DW_TILES`` (default forward / dx), each forward / dx
  tile of its ``MM_TILES`` (for both products; the default dw);
* ``torch``:  raw ``torch._grouped_mm`` with its own autograd (what torchtitan calls);
* ``fp8`` (compute capability >= 8.9, bf16 only): :func:`titan_moe.float8.experts.fp8_grouped_mm`,
  the path of the ``titan_float8_experts`` converter: dynamic rowwise e4m3 quantization of
  x and w included, torchao's ``torch._scaled_grouped_mm`` GEMMs, forward and backward,
  plus its 16-row group padding and the per-call weight re-layout; ``fp8_compiled``: the same
  function under ``torch.compile`` (Inductor fuses the quantization passes, as in training
  with ``[compile] enable``); ``fp8_fused`` / ``fp8_fused_dw8``: our quantization kernels
  around ``torch._scaled_grouped_mm`` (weight gradient in bf16 / fp8), weights quantized per
  call; ``fp8_cached_w``: ``fp8_fused`` with the weight quantized once beforehand, as the fp8
  experts do once per optimizer step (``Float8RoutedExperts.refresh_fp8_weights``);
  ``fp8_cached_w_dw8rows``: the same with ``wgrad="fp8_rows"`` (the weight gradient in fp8
  from the forward's and dx's row-quantized codes, re-expressed per group).

Shapes: E=64, M=65536 (8192 tokens x top-8), K=2048, N=1408, group sizes balanced and
Zipf(1.1) (sizes proportional to 1/rank^1.1, shuffled, rounded to multiples of 16), and
balanced at M = 32768 and 16384 (512 and 256 rows per group); the MoE layer benchmark's two
expert GEMMs (K=1024 -> N=2*1408, K=1408 -> N=1024, M=65536, balanced); and the
K3 latent experts on one of 8 expert-parallel ranks: 112 local experts of 896,
M = 8192 tokens x 16 routed x 112/896 = 16384 rows, gate/up 3584 -> 2*3072 and down
3072 -> 3584, balanced and Zipf(1.1). FLOPs: 2*M*K*N forward, 3x that forward+backward.
Each case also reports the relative error ||a - b|| / ||b|| of the triton providers'
out, dx, dw against the torch provider's (both bf16 outputs of fp32 accumulations), and
``--sweep-tiles`` times each Triton product (forward with and without TMA, dx, dw) over a
few tile shapes (``TileConfig``, written BMxBNxBKxWARPSxSTAGES as ``$TITAN_MOE_GROUPED_MM_TILES``
takes them), each beside ``torch._grouped_mm`` on the same product ("peer").

Part 2, one MoE layer forward and forward+backward on [1, tokens, dim] activations:
timed in interleaved rounds like part 1: ours (:class:`titan_moe.model.moe.LatentMoE`,
experts in the latent width ``latent``,
run once with each grouped-GEMM backend and once as ``ours_fp8_experts``, a copy whose
routed experts are converted by ``titan_float8_experts`` (fp8 rowwise grouped GEMMs, on the
CPU their fp32 emulation; on CUDA only with compute capability >= 8.9 and bf16; weights
quantized per call), and as ``ours_fp8_cached``, another such copy whose expert weights
were quantized beforehand (``refresh_fp8_weights``, what training does once per optimizer
step; that refresh is timed on its own, ``fp8_weight_refresh_ms``, as it is paid once per
step however many forwards the step has), and as ``ours_fp8_rows_situ``, a third copy, cached
too, with the fp8 weight gradient from the row codes, SiTU-GLU fused into the down GEMM's
quantization (``FP8_ROWS_SITU_RECIPE``) and the Triton dw widening, plus the
relative error of y and dx of every run against the native one) vs torchtitan 0.2.2's
``torchtitan.models.moe.MoE`` (full-width SwiGLU experts, grouped_mm with its padding kernel
on CUDA), both with the same token count, width, expert count, top-k, expert hidden size and
shared experts, bf16 parameters (fp32 router bias buffers). The two layers do different work, so both FLOP
counts are reported (matmul FLOPs; forward+backward = 3x forward).

Part 3 (only with ``--dispatch``), token dispatch around the experts, forward and
forward+backward, bf16 rows, fp32 router weights and combine output (as in the model):
``permute`` (token rows -> their k expert-sorted copies) and ``unpermute_combine`` (sorted
rows -> weighted fp32 sum per token) of :mod:`titan_moe.ops.dispatch` with each backend
(``ours_triton``, ``ours_torch``) against the plain gathers the model used before
(``gather``: ``x[order // k]``; inverse scatter, gather, fp32 multiply, sum) and the same
gathers under ``torch.compile`` (``gather_compiled``, Inductor fuses gather, multiply and
sum; CUDA only). Shapes: N = 8192 tokens, k = 8, L = 1024; and K3's N = 8192, k = 16,
L = 3584 (896 experts). Reported: ms, GB/s of the least traffic
(:func:`dispatch_min_bytes`) and the relative error of every output and gradient against
``gather``. The report gains a ``"dispatch"`` list only when the flag is given.

Timing: ``triton.testing.do_bench`` medians on CUDA. The grouped GEMM providers and the tile
sweep's candidates are timed in ``ROUNDS`` interleaved rounds (`measure_rounds`: each round
times every provider of the case once, in a seeded random order; the median of the rounds is
reported, and the rounds' spread beside it): on the H200 the same ``torch._grouped_mm`` call
measured 0.584 and 0.674 ms minutes apart in one process, a drift larger than the ratios
these rows decide. With ``--device cpu`` every provider
runs once (the correctness columns are filled) and no time is reported: the JSON has
``"timed": false`` and null times. The last line of stdout is one JSON object with
everything; nothing here writes to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time

K3_ROWS_PER_RANK = 8192 * 16 * 112 // 896  # tokens per rank x routed top-k x local/total experts


def gemm_cases(tiny: bool) -> list[dict]:
    """Grouped GEMM shapes: case name, E, M, K, N and the group-size distribution."""
    if tiny:
        return [
            dict(case="tiny_balanced", E=4, M=96, K=32, N=32, dist="balanced"),
            dict(case="tiny_zipf1.1", E=4, M=96, K=32, N=16, dist="zipf"),
        ]
    m = K3_ROWS_PER_RANK
    return [
        dict(case="e64_balanced", E=64, M=65536, K=2048, N=1408, dist="balanced"),
        dict(case="e64_zipf1.1", E=64, M=65536, K=2048, N=1408, dist="zipf"),
        # fewer rows per group (512 and 256 on average): where "auto" switches backends
        dict(case="e64_m32k_balanced", E=64, M=32768, K=2048, N=1408, dist="balanced"),
        dict(case="e64_m16k_balanced", E=64, M=16384, K=2048, N=1408, dist="balanced"),
        # the MoE layer benchmark's own expert GEMMs (latent 1024, hidden 1408, SiTU-GLU gate+up fused)
        dict(case="layer_gate_up", E=64, M=65536, K=1024, N=2 * 1408, dist="balanced"),
        dict(case="layer_down", E=64, M=65536, K=1408, N=1024, dist="balanced"),
        dict(case="k3_gate_up_balanced", E=112, M=m, K=3584, N=2 * 3072, dist="balanced"),
        dict(case="k3_gate_up_zipf1.1", E=112, M=m, K=3584, N=2 * 3072, dist="zipf"),
        dict(case="k3_down_balanced", E=112, M=m, K=3072, N=3584, dist="balanced"),
        dict(case="k3_down_zipf1.1", E=112, M=m, K=3072, N=3584, dist="zipf"),
    ]


def group_sizes(m: int, n_groups: int, dist: str, align: int = 16, seed: int = 0) -> list[int]:
    """``n_groups`` sizes, multiples of ``align``, summing to ``m`` (a multiple of ``align``).

    "balanced": as equal as the alignment allows. "zipf": proportional to 1/rank^1.1 in a
    seeded random order, rounded down, the remainder added to the largest group.
    """
    import random

    if m % align:
        raise ValueError(f"M={m} must be a multiple of the alignment {align}")
    units = m // align
    if dist == "balanced":
        base, extra = divmod(units, n_groups)
        sizes = [(base + (i < extra)) * align for i in range(n_groups)]
    elif dist == "zipf":
        weights = [1.0 / (rank + 1) ** 1.1 for rank in range(n_groups)]
        random.Random(seed).shuffle(weights)
        total = sum(weights)
        sizes = [math.floor(units * w / total) * align for w in weights]
        sizes[weights.index(max(weights))] += m - sum(sizes)
    else:
        raise ValueError(f"unknown group-size distribution {dist!r}")
    assert sum(sizes) == m and all(s % align == 0 for s in sizes)
    return sizes


def latent_moe_flops(tokens: int, dim: int, n_experts: int, top_k: int, hidden: int, shared: int, latent: int) -> int:
    """Forward matmul FLOPs of :class:`LatentMoE`: router, latent down, k SiTU-GLU experts in the
    latent width, latent up, and the shared experts at full width."""
    per_token = (
        2 * dim * n_experts
        + 2 * dim * latent
        + top_k * 3 * 2 * latent * hidden
        + 2 * latent * dim
        + 3 * 2 * dim * hidden * shared
    )
    return tokens * per_token


def torchtitan_moe_flops(tokens: int, dim: int, n_experts: int, top_k: int, hidden: int, shared: int) -> int:
    """Forward matmul FLOPs of torchtitan's MoE: router, k SwiGLU experts and the shared experts at full width."""
    return tokens * (2 * dim * n_experts + top_k * 3 * 2 * dim * hidden + 3 * 2 * dim * hidden * shared)


# ------------------------------------------------------------------------------------ timing
def measure(fn, timed: bool, grad_to_none=None) -> float | None:
    """Median milliseconds of ``fn`` (do_bench) after one warm-up call; None when not timed."""
    fn()
    if not timed:
        return None
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))


ROUNDS = 7  # interleaved rounds of `measure_rounds`


GRAPH_TIMING = False
"""``--cuda-graph``: `measure_rounds` replays each fn from a CUDA graph (``do_bench_cudagraph``)
instead of launching it from the host (``do_bench``), so the times are the GPU's alone."""


def _bench_once(fn, grad_to_none) -> float:
    """One median time of ``fn`` in ms: host launches with an L2 flush before each call
    (``do_bench``), or with :data:`GRAPH_TIMING` replays of a graph of back-to-back calls."""
    import triton.testing

    if GRAPH_TIMING:
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=40, grad_to_none=grad_to_none,
                                                           return_mode="median"))
        except RuntimeError as err:  # a call that cannot be captured (a host sync): no time
            print(f"bench_moe: not capturable in a CUDA graph: {str(err).splitlines()[0]}", file=sys.stderr)
            return math.nan
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grad_to_none,
                                         return_mode="median"))


def measure_rounds(fns: dict, timed: bool, grad_to_none=None, rounds: int | None = None) -> tuple[dict, dict]:
    """Median milliseconds of each of ``fns`` ({name: fn}) over ``rounds`` (default `ROUNDS`,
    ``--rounds``) interleaved rounds:
    every round times each fn once (do_bench median) in a fresh seeded random order, so that a
    drift of the GPU's clocks during the run, and the state one fn leaves to the next (a
    rotated fixed order keeps each fn's predecessor: measured on the H200, the same
    ``torch._grouped_mm`` call ran 8-10% slower behind one provider than behind another),
    fall on all of them alike. Returns ({name: median of the rounds}, {name: (max - min) /
    median of the rounds, the spread to read a ratio against}); ({name: None}, {}) when not
    timed (each fn then runs once)."""
    for fn in fns.values():
        fn()  # compile / autotune outside the rounds
    if not timed:
        return dict.fromkeys(fns), {}
    import random
    import statistics

    names = list(fns)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(0)
    for _ in range(rounds or ROUNDS):
        for name in order.sample(names, len(names)):
            per_round[name].append(_bench_once(fns[name], grad_to_none))
    medians = {name: statistics.median(v) for name, v in per_round.items()}
    spread = {name: (max(v) - min(v)) / medians[name] for name, v in per_round.items()}
    return medians, spread


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None else flops / (ms * 1e-3) / 1e12


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()  # fp32 norms: float64 copies of K3's dw would take 10 GB each
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------ part 1
@contextlib.contextmanager
def env_vars(values: dict[str, str]):
    """Run the block under `values`: names of `KernelChoices` fields ("grouped_mm", "situ",
    "dispatch", ...) through `titan_moe.ops.choices.using` (our ops read them at run time), the
    rest as environment variables (launch tuning, `titan_moe.ops.launch_env`)."""
    import dataclasses

    from titan_moe.ops import choices

    fields = {f.name for f in dataclasses.fields(choices.KernelChoices)}
    env = {key: value for key, value in values.items() if key not in fields}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with choices.using(**{key: value for key, value in values.items() if key in fields}):
            yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def tma_available(device: str) -> bool:
    """Whether to add the "triton_tma" rows: the TMA variant exists for sm90 only."""
    import torch

    return device == "cuda" and torch.cuda.get_device_capability()[0] == 9


def fp8_available(device: str, dtype) -> bool:
    """Whether to add the "fp8" rows: torch._scaled_grouped_mm needs sm89+ and bf16 inputs here."""
    import torch

    return device == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 9)


def gemm_providers(with_tma: bool, with_fp8: bool = False) -> dict:
    """name -> (fn(x, w, offs), environment it runs under)."""
    import torch

    from titan_moe.ops.grouped_gemm import grouped_mm
    from titan_moe.ops.grouped_gemm.triton_kernel import DW_TMA_ENV, TILES_ENV, TMA_ENV

    def ours(backend):
        return lambda x, w, offs: grouped_mm(x, w, offs, backend=backend)

    providers = {"triton": (ours("triton"), {TMA_ENV: "0"})}
    if with_tma:
        providers["triton_tma"] = (ours("triton"), {TMA_ENV: "1"})
        # forward and dx on our TMA kernel (where it led), dw on torch._grouped_mm
        providers["tma_dw_native"] = (ours("fwd=triton,dx=triton,dw=native"), {TMA_ENV: "1"})
    providers["native"] = (ours("native"), {})
    providers["auto"] = (ours("auto"), {TMA_ENV: "1"})  # per shape on sm90: Gluon for large groups, Triton midsize
    if with_tma:  # our Gluon kernels (ping-pong forward / dx, dw by tile) on sm90
        from titan_moe.ops.grouped_gemm.gluon_kernel import DW_TILES as GLUON_DW_TILES
        from titan_moe.ops.grouped_gemm.gluon_kernel import MM_TILES as GLUON_MM_TILES
        from titan_moe.ops.grouped_gemm.gluon_kernel import TILES_ENV as GLUON_TILES_ENV

        providers["gluon"] = (ours("gluon"), {})
        providers["gluon_dwtriton"] = (ours("fwd=gluon,dx=gluon,dw=triton"), {TMA_ENV: "1"})
        for tile in GLUON_DW_TILES:
            providers[f"gluon_{tile}"] = (ours("gluon"), {GLUON_TILES_ENV: f",,{tile}"})
        for tile in GLUON_MM_TILES:  # one forward / dx tile for both, the default dw
            providers[f"gluon_{tile}"] = (ours("gluon"), {GLUON_TILES_ENV: f"{tile},{tile},"})
    providers["torch"] = (lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), {})
    for tile in DW_TILES:
        providers[f"dw_{tile}"] = (ours("fwd=triton,dx=triton,dw=triton"), {TMA_ENV: "1", TILES_ENV: f"k={tile}"})
        # the same with the dw kernel's loads through TMA too
        providers[f"dwl_{tile}"] = (ours("fwd=triton,dx=triton,dw=triton"),
                                    {TMA_ENV: "1", DW_TMA_ENV: "1", TILES_ENV: f"k={tile}"})
        # and through per-group descriptors made in the kernel (both operands from shared memory;
        # not for the flat loop, "f", which has no per-group descriptors)
        if not tile.endswith("f"):
            providers[f"dwg_{tile}"] = (ours("fwd=triton,dx=triton,dw=triton"),
                                        {TMA_ENV: "1", DW_TMA_ENV: "group", TILES_ENV: f"k={tile}"})
    for tile in MK_TILES:
        providers[f"mk_{tile}"] = (ours("fwd=triton,dx=triton,dw=native"), {TMA_ENV: "1", TILES_ENV: f"mk={tile}"})
    if with_fp8:
        from titan_moe.float8.experts import fp8_grouped_mm

        from titan_moe.float8.grouped_mm import fp8_grouped_mm as fused_fp8_grouped_mm

        providers["fp8"] = (fp8_grouped_mm, {})
        providers["fp8_compiled"] = (torch.compile(fp8_grouped_mm, fullgraph=True), {})
        # our fused quantization kernels around torch._scaled_grouped_mm (16-aligned groups,
        # as every case here): weight gradient in bf16, or in fp8 too
        providers["fp8_fused"] = (fused_fp8_grouped_mm, {})
        providers["fp8_fused_dw8"] = (lambda x, w, offs: fused_fp8_grouped_mm(x, w, offs, wgrad="fp8"), {})
        # the same with w quantized beforehand (once per optimizer step in training; the
        # first, untimed call of a case quantizes it): activations quantized in the call
        providers["fp8_cached_w"] = (_with_quantized_weight(fused_fp8_grouped_mm), {})
        # and with the fp8 weight gradient from the row-quantized codes, re-expressed per group
        providers["fp8_cached_w_dw8rows"] = (
            _with_quantized_weight(functools.partial(fused_fp8_grouped_mm, wgrad="fp8_rows")), {})
        # and with the weight gradient chosen per call by the mean group size (wgrad "auto")
        providers["fp8_cached_w_auto"] = (
            _with_quantized_weight(functools.partial(fused_fp8_grouped_mm, wgrad="auto")), {})
        # the same with the fp8 GEMMs chosen explicitly (the default "auto" is "triton" on sm90):
        # all on torch's, forward and dx on our Triton kernel (default tile, then one provider
        # per --fp8-tiles entry), our dw kernel too
        def cached(kernels, wgrad="fp8_rows"):
            return _with_quantized_weight(functools.partial(fused_fp8_grouped_mm, wgrad=wgrad, kernels=kernels))

        providers["fp8_rows_torch"] = (cached("torch"), {})  # all on torch._scaled_grouped_mm
        for kernels in ("triton", "triton_dw", "triton_all"):
            providers[f"fp8_rows_{kernels}"] = (cached(kernels), {})
        for tile in FP8_TILES:
            providers[f"fp8t_{tile}"] = (cached("triton"), {TILES_ENV: f"mk8={tile}"})
            # the same forward / dx with the weight gradient in bf16 (wgrad "bf16")
            providers[f"fp8tb_{tile}"] = (cached("triton", "bf16"), {TILES_ENV: f"mk8={tile}"})
        for tile in FP8_DW_TILES:
            providers[f"fp8dw_{tile}"] = (cached("triton_all"), {TILES_ENV: f"k8={tile}"})
            # the same dw loading through per-group descriptors made in the kernel (not for "f")
            if not tile.endswith("f"):
                providers[f"fp8dwg_{tile}"] = (cached("triton_all"), {TILES_ENV: f"k8={tile}", DW_TMA_ENV: "group"})
    return providers


def _with_quantized_weight(fp8_gemm):
    """fn(x, w, offs) calling ``fp8_gemm(x, w, offs, w_fp8=...)`` with ``w`` quantized once
    (both layouts), on the first call with that ``w``."""
    from titan_moe.float8.quantize import quantize_weight

    cache: dict = {}

    def call(x, w, offs):
        if cache.get("w") is not w:
            cache.update(w=w, w_fp8=quantize_weight(w.detach()))
        return fp8_gemm(x, w, offs, w_fp8=cache["w_fp8"])

    return call


ERR_PROVIDERS = ("triton", "triton_tma", "tma_dw_native", "auto", "gluon", "gluon_dwtriton", "fp8", "fp8_compiled", "fp8_fused", "fp8_fused_dw8",
                 "fp8_cached_w", "fp8_cached_w_dw8rows", "fp8_cached_w_auto", "fp8_rows_torch", "fp8_rows_triton",
                 "fp8_rows_triton_dw", "fp8_rows_triton_all")
"""The GEMM providers whose output, dx and dw are compared with ``torch._grouped_mm``'s
(and every ``fp8t_<tile>`` provider, see :data:`FP8_TILES`)."""

FP8_TILES: list[str] = []
"""``--fp8-tiles``: "BMxBNxBKxWARPSxSTAGES" tiles of the Triton fp8 forward / dx kernel, two
providers each: ``fp8t_<tile>`` (``fp8_cached_w_dw8rows`` with ``kernels="triton"``)
and ``fp8tb_<tile>`` (the same with the weight gradient in bf16, ``fp8_cached_w``)."""


FP8_DW_TILES: list[str] = []
"""``--fp8-dw-tiles``: tiles of the Triton fp8 dw kernel, two providers each: ``fp8dw_<tile>``
(``fp8_cached_w_dw8rows`` with ``kernels="triton_all"``: all three products on our
kernels) and ``fp8dwg_<tile>``, the same with the dw loading through per-group descriptors made
in the kernel (``$TITAN_MOE_GROUPED_MM_DW_TMA=group``)."""


DW_TILES: list[str] = []
"""``--dw-tiles``: tiles of the bf16 Triton dw kernel ("BMxBNxBKxWARPSxSTAGES[xPROGRAMS][t]", a
trailing "t" for TMA stores), three providers each: ``dw_<tile>``, ``auto``'s forward and dx (our
TMA kernel) with the weight gradient on our kernel at that tile, ``dwl_<tile>``, the same
with the dw kernel's loads through TMA (``$TITAN_MOE_GROUPED_MM_DW_TMA=1``), and ``dwg_<tile>``,
through per-group descriptors made in the kernel (``$TITAN_MOE_GROUPED_MM_DW_TMA=group``)."""


MK_TILES: list[str] = []
"""``--mk-tiles``: tiles of the bf16 Triton forward / dx kernel ("BMxBNxBKxWARPSxSTAGES[xPROGRAMS][rTAIL]",
rTAIL for tail tiles), one provider ``mk_<tile>`` each: forward and dx on our TMA kernel at that
tile, dw on ``torch._grouped_mm``."""


def err_providers() -> list[str]:
    return [*ERR_PROVIDERS, *(f"fp8t_{tile}" for tile in FP8_TILES), *(f"fp8tb_{tile}" for tile in FP8_TILES),
            *(f"{kind}_{tile}" for kind in ("fp8dw", "fp8dwg") for tile in FP8_DW_TILES
              if kind == "fp8dw" or not tile.endswith("f")),
            *(f"{kind}_{tile}" for kind in ("dw", "dwl", "dwg") for tile in DW_TILES
              if kind != "dwg" or not tile.endswith("f")),
            *(f"mk_{tile}" for tile in MK_TILES)]


def bench_gemm_case(case: dict, device: str, dtype, timed: bool, sweep_tiles: bool,
                    keep_providers: set[str] | None = None) -> dict:
    import torch

    E, M, K, N = case["E"], case["M"], case["K"], case["N"]
    sizes = group_sizes(M, E, case["dist"])
    gen = torch.Generator(device=device).manual_seed(E + K + N)  # generated in place: K3's w is 5 GB
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    x = (torch.randn(M, K, generator=gen, device=device) / math.sqrt(K)).to(dtype).requires_grad_()
    w = torch.randn(E, K, N, generator=gen, device=device).to(dtype).requires_grad_()
    grad = torch.randn(M, N, generator=gen, device=device).to(dtype)
    flops = 2 * M * K * N
    row = dict(case=case["case"], E=E, M=M, K=K, N=N, dist=case["dist"], group_min=min(sizes),
               group_max=max(sizes), flops_fwd=flops, flops_fwd_bwd=3 * flops, ms={}, tflops={}, rel_err={})
    providers = gemm_providers(tma_available(device), fp8_available(device, dtype))
    if keep_providers:  # "torch" stays: the errors are measured against it
        providers = {n: p for n, p in providers.items()
                     if n in keep_providers or n == "torch" or n.startswith(("fp8t_", "fp8tb_", "fp8dw_", "fp8dwg_", "dw_", "dwl_", "dwg_", "mk_"))}

    def under(env, call):
        def run():
            with env_vars(env):
                call()
        return run

    def fwd_bwd(fn):
        fn(x, w, offs).backward(grad)

    timers = {}
    for name, (fn, env) in providers.items():
        timers[f"{name}_fwd"] = under(env, torch.no_grad()(lambda fn=fn: fn(x, w, offs)))
        timers[f"{name}_fwd_bwd"] = under(env, lambda fn=fn: fwd_bwd(fn))
    row["ms"], row["ms_spread"] = measure_rounds(timers, timed, grad_to_none=[x, w])
    results = {}
    for name, (fn, env) in providers.items():
        x.grad = w.grad = None
        with env_vars(env):
            out = fn(x, w, offs)
            out.backward(grad)
        results[name] = (out.detach(), x.grad, w.grad)
        x.grad = w.grad = None
        del out
    for key in list(row["ms"]):
        row["tflops"][key] = tflops(row["flops_fwd_bwd"] if key.endswith("fwd_bwd") else flops, row["ms"][key])
    for name in err_providers():
        if name in results:
            for part, got, ref in zip(("out", "dx", "dw"), results[name], results["torch"]):
                row["rel_err"][f"{name}_vs_torch_{part}"] = rel_err(got, ref)
    if sweep_tiles:
        with torch.no_grad():
            row["tile_sweep"] = tile_sweep(x.detach(), w.detach(), grad, offs, timed,
                                              tma_available(device))
    return row


# (block_m, block_n, block_k, num_warps, num_stages[, programs per SM]); for "k" (dw) block_m is
# the reduction step and block_k x block_n the output tile. The defaults of `default_config`
# come first (sm90's forward / dx default also stores through TMA: `--mk-tiles ...t` times that). Two
# programs per SM only where two fit in its 228 KB of shared memory.
MK_SWEEP = [
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3, 2),
]
K_SWEEP = [
    (64, 128, 128, 8, 4), (64, 256, 128, 8, 3), (32, 128, 128, 4, 4), (64, 128, 256, 8, 3),
    (128, 128, 128, 8, 3), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4),
    (64, 128, 128, 8, 3, 2), (64, 128, 128, 4, 3, 2),
]


def sweep_config(candidate: tuple[int, ...]):
    """A sweep tuple as (TileConfig, its key "BMxBNxBKxWARPSxSTAGES[xPROGRAMS]", the form
    ``$TITAN_MOE_GROUPED_MM_TILES`` takes)."""
    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    bm, bn, bk, warps, stages, *programs = candidate
    cfg = tk.TileConfig(bm, bn, bk, num_warps=warps, num_stages=stages,
                        programs_per_sm=programs[0] if programs else 1)
    return cfg, "x".join(map(str, candidate))
TINY_SWEEP = [(16, 16, 16, 4, 1), (32, 16, 16, 4, 1)]  # CPU plumbing check (interpreter)


def tile_sweep(x, w, grad, offs, timed: bool, with_tma: bool) -> dict[str, dict]:
    """Each Triton product of the op over its tile candidates, beside `torch._grouped_mm` on
    the same product, for the forward ("fwd", and "fwd_tma" on sm90), dx (grad @ w^T per
    group, with TMA when available) and dw (and "dw_tma" on sm90): {product: {"ms": {"peer": ms, tile key: ms or
    "failed: ..."}, "max_rel_err": the worst configuration's result against the op's own
    native path}}.
    Untimed (CPU) it only runs each call, with the tiny candidates."""
    import torch

    from titan_moe.ops.grouped_gemm import triton_kernel as tk

    tiny = x.device.type != "cuda"
    w_t = w.transpose(1, 2)
    ops = torch.ops.titan_moe
    products = {  # name: (kind, fn(cfg), peer, reference: our op's native path, which zeroes
        # what the peer leaves unwritten: empty groups' dw)
        "fwd": ("mk", lambda cfg: tk.grouped_mm_triton(x, w, offs, cfg, tma=False),
                lambda: torch._grouped_mm(x, w, offs=offs), lambda: ops.grouped_mm(x, w, offs, "native")),
        "dx": ("mk", lambda cfg: tk.grouped_mm_triton(grad, w_t, offs, cfg, tma=with_tma),
               lambda: torch._grouped_mm(grad, w_t, offs=offs), lambda: ops.grouped_mm_dx(grad, w, offs, "native")),
        "dw": ("k", lambda cfg: tk.grouped_mm_dw_triton(x, grad, offs, cfg),
               lambda: torch._grouped_mm(x.t(), grad, offs=offs), lambda: ops.grouped_mm_dw(x, grad, offs, "native")),
    }
    if with_tma:
        products["fwd_tma"] = ("mk", lambda cfg: tk.grouped_mm_triton(x, w, offs, cfg, tma=True),
                               *products["fwd"][2:])
        products["dw_tma"] = ("k", lambda cfg: tk.grouped_mm_dw_triton(x, grad, offs, cfg, tma=True),
                              *products["dw"][2:])
    out = {}
    for name, (kind, run, peer, reference) in products.items():
        ref = reference()
        timers = {"peer": peer}
        ms: dict = {}
        worst = 0.0  # every configuration's result against the reference (the same fp32 sums, tiled)
        for candidate in TINY_SWEEP if tiny else (MK_SWEEP if kind == "mk" else K_SWEEP):
            cfg, key = sweep_config(candidate)
            try:
                worst = max(worst, rel_err(run(cfg), ref))
                timers[key] = lambda cfg=cfg: run(cfg)
            except Exception as exc:  # e.g. out of shared memory: record and go on
                ms[key] = f"failed: {type(exc).__name__}"
        medians, spread = measure_rounds(timers, timed)
        ms = {**medians, **ms}
        out[name] = dict(ms=ms, max_rel_err=worst, max_spread=max(spread.values(), default=None))
    return out


def best_tiles(report: dict) -> dict:
    """The tile sweep's winners per kernel kind, over every swept case of ``report`` (a
    ``--sweep-tiles`` run's JSON): "mk" (forward and dx share it) minimizes the sum over cases of
    the forward (its TMA form where swept) plus dx, "k" the sum of dw; a candidate that failed in
    any case is out. Returns {"env": the ``$TITAN_MOE_GROUPED_MM_TILES`` value,
    kind: {"tile": key, "ms": summed ms, "peer_ms": the peer's sum on the same products}}."""
    rows = [r for r in report["gemm"] if "tile_sweep" in r]
    if not rows or not report["timed"]:
        raise ValueError("best_tiles: needs a timed --sweep-tiles report")
    out: dict = {}
    for kind in ("mk", "k"):
        per_key: dict[str, list] = {}  # key: its ms on every (case, product) pair
        pairs = 0
        for r in rows:
            sweep = r["tile_sweep"]
            # the products as the op runs them: on sm90 the forward through TMA, dw not (yet)
            for product in (("fwd_tma" if "fwd_tma" in sweep else "fwd", "dx") if kind == "mk" else ("dw",)):
                pairs += 1
                for key, ms in sweep[product]["ms"].items():
                    per_key.setdefault(key, []).append(ms)
        totals = {key: sum(v) for key, v in per_key.items()
                  if len(v) == pairs and all(isinstance(ms, (int, float)) for ms in v)}
        valid = {key: ms for key, ms in totals.items() if key != "peer"}
        if not valid:
            raise ValueError(f"best_tiles: every {kind} candidate failed somewhere")
        tile = min(valid, key=valid.get)
        out[kind] = dict(tile=tile, ms=valid[tile], peer_ms=totals.get("peer"))
    out["env"] = f"mk={out['mk']['tile']},k={out['k']['tile']}"
    return out


# ------------------------------------------------------------------------------------ part 2
def layer_config(args) -> dict:
    if args.tiny:
        cfg = dict(tokens=64, dim=64, n_experts=4, top_k=2, hidden=32, shared=1)
    else:
        cfg = dict(tokens=args.tokens, dim=args.dim, n_experts=args.experts, top_k=args.top_k,
                   hidden=args.hidden, shared=args.shared)
    cfg["latent"] = args.latent or cfg["dim"] // 2
    return cfg


def _cast_parameters(module, dtype) -> None:
    """Parameters to ``dtype`` (as FSDP's bf16 param_dtype would); fp32 buffers (router bias) stay fp32."""
    import torch

    with torch.no_grad():
        for mod in module.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                setattr(mod, name, torch.nn.Parameter(p.to(dtype)))


def build_layers(cfg: dict, device: str, dtype):
    import torch
    from torchtitan.models.moe import MoE, MoEArgs

    from titan_moe.model.args import ModelArgs
    from titan_moe.model.moe import LatentMoE

    margs = ModelArgs(dim=cfg["dim"], n_routed_experts=cfg["n_experts"], top_k=cfg["top_k"],
                      n_shared_experts=cfg["shared"], moe_latent_dim=cfg["latent"],
                      moe_expert_hidden=cfg["hidden"], moe_shared_hidden=cfg["hidden"], qb_bins=1000)
    ours = LatentMoE(margs).to(device)
    ours.init_weights(0.02)
    # torchtitan's padding kernel (generate_permute_indices) is CUDA-only Triton: the CPU
    # smoke run uses its per-expert loop instead.
    targs = MoEArgs(num_experts=cfg["n_experts"], num_shared_experts=cfg["shared"], score_func="sigmoid",
                    route_norm=True, top_k=cfg["top_k"], use_grouped_mm=device == "cuda", load_balance_coeff=1e-3)
    theirs = MoE(targs, dim=cfg["dim"], hidden_dim=cfg["hidden"]).to(device)
    with torch.no_grad():  # torchtitan calls it under no_grad
        theirs.init_weights(0.02, buffer_device=torch.device(device))
    for layer in (ours, theirs):
        _cast_parameters(layer, dtype)
        layer.train()
    return ours, theirs


FP8_ROWS_SITU_RECIPE = dict(wgrad="fp8_rows", situ_quant=True, widen="triton")
"""The ``ours_fp8_rows_situ`` layer's experts recipe (`titan_moe.float8.experts_recipe`)."""


def bench_layer(cfg: dict, device: str, dtype, timed: bool, compile_layers: bool, kernels: int = 0,
                keep: frozenset = frozenset()) -> dict:
    import torch

    from titan_moe.ops.grouped_gemm.triton_kernel import TMA_ENV

    ours, theirs = build_layers(cfg, device, dtype)
    ours_fp8 = ours_fp8_cached = ours_fp8_rows_situ = None
    if device == "cpu" or fp8_available(device, dtype):
        from titan_moe.float8.experts import refresh_fp8_expert_weights

        ours_fp8, ours_fp8_cached = (fp8_experts_copy(ours) for _ in range(2))
        ours_fp8_rows_situ = fp8_experts_copy(ours, **FP8_ROWS_SITU_RECIPE)
        refresh = functools.partial(refresh_fp8_expert_weights, ours_fp8_cached)
        if not (refresh() and refresh_fp8_expert_weights(ours_fp8_rows_situ)):
            raise RuntimeError("bench_moe: the fp8 experts made no weight cache (cache_weights off?)")
    if compile_layers:
        ours, theirs = torch.compile(ours), torch.compile(theirs)
        if ours_fp8 is not None:  # one compiled copy per fp8 arrangement: the experts read theirs at trace time
            ours_fp8, ours_fp8_cached, ours_fp8_rows_situ = (
                torch.compile(layer) for layer in (ours_fp8, ours_fp8_cached, ours_fp8_rows_situ))
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, cfg["tokens"], cfg["dim"], generator=gen, device=device).to(dtype).requires_grad_()
    grad = torch.randn(1, cfg["tokens"], cfg["dim"], generator=gen, device=device).to(dtype)
    flops = {
        "ours": latent_moe_flops(cfg["tokens"], cfg["dim"], cfg["n_experts"], cfg["top_k"], cfg["hidden"],
                                 cfg["shared"], cfg["latent"]),
        "torchtitan": torchtitan_moe_flops(cfg["tokens"], cfg["dim"], cfg["n_experts"], cfg["top_k"],
                                           cfg["hidden"], cfg["shared"]),
    }
    runs = {
        "ours_native": (ours, {"grouped_mm": "native"}),
        # the same with the experts' SiTU-GLU as one Triton pass per direction
        "ours_native_situ_triton": (ours, {"grouped_mm": "native", "situ": "triton"}),
        "ours_triton": (ours, {"grouped_mm": "triton", TMA_ENV: "0"}),
        "ours_auto": (ours, {"grouped_mm": "auto", TMA_ENV: "1"}),
    }
    if tma_available(device):
        runs["ours_triton_tma"] = (ours, {"grouped_mm": "triton", TMA_ENV: "1"})
        runs["ours_gluon"] = (ours, {"grouped_mm": "gluon"})
        runs["ours_gluon_dwtriton"] = (ours, {"grouped_mm": "fwd=gluon,dx=gluon,dw=triton", TMA_ENV: "1"})
    if ours_fp8 is not None:
        runs["ours_fp8_experts"] = (ours_fp8, {"grouped_mm": "native"})
        runs["ours_fp8_cached"] = (ours_fp8_cached, {"grouped_mm": "native"})
        # the same with the fp8 weight gradient from the row codes, SiTU-GLU fused into the down
        # GEMM's quantization and the Triton widening of the weight gradients
        runs["ours_fp8_rows_situ"] = (ours_fp8_rows_situ, {"grouped_mm": "native"})
    runs["torchtitan"] = (theirs, {})
    if keep:  # --layer-providers: those named, with ours_native and torchtitan always
        unknown = keep - set(runs)
        if unknown:
            raise SystemExit(f"bench_moe: --layer-providers: unknown {sorted(unknown)}; known {sorted(runs)}")
        runs = {name: run for name, run in runs.items() if name in keep | {"ours_native", "torchtitan"}}
    out = dict(config=cfg, compiled=compile_layers, providers={})
    timers = {}
    for name, (layer, env) in runs.items():
        f = flops["torchtitan" if name == "torchtitan" else "ours"]
        out["providers"][name] = dict(flops_fwd=f, flops_fwd_bwd=3 * f)
        if name == "torchtitan" and device != "cuda":
            # its router counts tokens with torch.histc on int64, which has no CPU kernel
            out["providers"][name]["skipped"] = "torch.histc(int64) in its router is CUDA-only"
            continue

        def fwd(layer=layer, env=env):
            with env_vars(env), torch.no_grad():  # our op reads the backend switches at run time
                layer(x)

        def fwd_bwd(layer=layer, env=env):
            with env_vars(env):
                layer(x).backward(grad)

        timers[f"{name}_fwd"], timers[f"{name}_fwd_bwd"] = fwd, fwd_bwd
    params = [x, *ours.parameters(), *theirs.parameters(),
              *(p for layer in (ours_fp8, ours_fp8_cached, ours_fp8_rows_situ) if layer is not None
                for p in layer.parameters())]
    ms, out["ms_spread"] = measure_rounds(timers, timed, grad_to_none=params)
    if ours_fp8 is not None:  # the once-per-step cost of the cached layer (the gradients leave the weights be)
        out["fp8_weight_refresh_ms"] = measure_rounds({"refresh": refresh}, timed)[0]["refresh"]
    if kernels:  # each provider's device kernels per forward+backward: immune to the host's noise
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_kda import kernel_times

        for name, fn in timers.items():
            if name.endswith("_fwd_bwd"):
                times = kernel_times(fn, device)
                out["providers"][name[:-len("_fwd_bwd")]]["kernels_fwd_bwd"] = dict(
                    sum_ms=sum(times.values()), top=dict(list(times.items())[:kernels]))
    for p in params:
        p.grad = None
    for name, p in out["providers"].items():
        f = p["flops_fwd"]
        p.update(ms_fwd=ms.get(f"{name}_fwd"), ms_fwd_bwd=ms.get(f"{name}_fwd_bwd"))
        p.update(tflops_fwd=tflops(f, p["ms_fwd"]), tflops_fwd_bwd=tflops(3 * f, p["ms_fwd_bwd"]))
    out["rel_err_ours_vs_native"] = {
        name: _layer_agreement(layer, ours, x, grad, env, runs["ours_native"][1])
        for name, (layer, env) in runs.items() if name.startswith("ours_") and name != "ours_native"
    }
    return out


def fp8_experts_copy(ours, **recipe):
    """A copy of our layer (same parameter values) whose routed experts run in fp8, by the
    default recipe with ``recipe``'s fields (`ExpertsFp8Recipe`) replaced."""
    import copy

    from titan_moe.float8.experts import convert_routed_experts
    from titan_moe.float8.experts_recipe import ExpertsFp8Recipe

    layer = copy.deepcopy(ours)
    convert_routed_experts(layer, recipe=ExpertsFp8Recipe(**recipe))
    return layer


def _layer_agreement(layer, ref_layer, x, grad, env: dict, ref_env: dict) -> dict[str, float]:
    """Relative error of y and dx of ``layer`` run under ``env`` against ``ref_layer`` under
    ``ref_env``."""
    got = []
    for module, values in ((layer, env), (ref_layer, ref_env)):
        with env_vars(values):
            x.grad = None
            y = module(x)
            y.backward(grad)
        got.append((y.detach(), x.grad))
    x.grad = None
    for p in (*layer.parameters(), *ref_layer.parameters()):
        p.grad = None
    return {part: rel_err(a, b) for part, a, b in zip(("y", "dx"), got[0], got[1])}


# ------------------------------------------------------------------------------------ part 3
def dispatch_cases(tiny: bool) -> list[dict]:
    """Token dispatch shapes (``--dispatch``): tokens N, copies per token k, latent width L, experts E."""
    if tiny:
        return [dict(case="tiny_k2", N=50, k=2, L=40, E=6), dict(case="tiny_k8", N=37, k=8, L=24, E=12)]
    return [dict(case="n8192_k8_l1024", N=8192, k=8, L=1024, E=64),
            dict(case="k3_n8192_k16_l3584", N=8192, k=16, L=3584, E=896)]


def dispatch_min_bytes(n: int, k: int, latent: int, elem: int) -> dict[str, int]:
    """Least memory traffic of each direction (activations only; indices and weights add
    ``< 20 N k`` bytes). The combine output and its gradient are fp32, as in the model."""
    m = n * k
    fwd = {"permute": (n + m) * latent * elem, "combine": m * latent * elem + n * latent * 4}
    bwd = {"permute": (m + n) * latent * elem, "combine": n * latent * 4 + 2 * m * latent * elem}
    return {"permute_fwd": fwd["permute"], "permute_fwd_bwd": fwd["permute"] + bwd["permute"],
            "combine_fwd": fwd["combine"], "combine_fwd_bwd": fwd["combine"] + bwd["combine"]}


def _gather_permute(x, order, k):
    """The plain-PyTorch dispatch the model used before the ops: an index gather."""
    return x[order // k]


def _gather_combine(y, order, weights):
    """The plain-PyTorch combine the model used before the ops: inverse scatter, gather,
    fp32 multiply, sum over k."""
    import torch

    n, k = weights.shape
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (y[inverse].view(n, k, y.shape[1]).float() * weights.unsqueeze(-1)).sum(1)


def dispatch_providers(device: str) -> dict:
    """name -> (permute fn, combine fn, environment, skip reason or None)."""
    import torch

    from titan_moe.ops.dispatch import permute, unpermute_combine

    def combine(y, order, w):
        return unpermute_combine(y, order, w, out_dtype=torch.float32)

    compiled = None if device == "cuda" else "Inductor on CPU: minutes per shape, no speed claim here"
    return {
        "ours_triton": (permute, combine, {"dispatch": "triton"}, None),
        "ours_torch": (permute, combine, {"dispatch": "torch"}, None),
        "gather": (_gather_permute, _gather_combine, {}, None),
        "gather_compiled": (torch.compile(_gather_permute), torch.compile(_gather_combine), {}, compiled),
    }


def bench_dispatch_case(case: dict, device: str, dtype, timed: bool) -> dict:
    """Times permute and unpermute+combine (forward, forward+backward) of every provider on one
    routing; relative errors of every provider's outputs and gradients against ``gather``.

    ``ms[provider][direction]`` and ``gbps[provider][direction]`` (least traffic / time), with
    directions ``permute_fwd``, ``permute_fwd_bwd``, ``combine_fwd``, ``combine_fwd_bwd``.
    """
    import torch

    n, k, latent, n_experts = case["N"], case["k"], case["L"], case["E"]
    gen = torch.Generator(device=device).manual_seed(n + k + latent)
    scores = torch.rand(n, n_experts, generator=gen, device=device)
    order = torch.argsort(scores.topk(k, dim=-1).indices.reshape(-1), stable=True)  # as LatentMoE builds it
    weights = torch.rand(n, k, generator=gen, device=device).requires_grad_()
    x = torch.randn(n, latent, generator=gen, device=device).to(dtype).requires_grad_()
    y = torch.randn(n * k, latent, generator=gen, device=device).to(dtype).requires_grad_()
    grad_sorted = torch.randn(n * k, latent, generator=gen, device=device).to(dtype)
    grad_out = torch.randn(n, latent, generator=gen, device=device)  # fp32, as the model's norm gives it
    min_bytes = dispatch_min_bytes(n, k, latent, x.element_size())
    row = dict(case, min_bytes=min_bytes, ms={}, gbps={}, rel_err={}, skipped={})
    results = {}
    for name, (perm, comb, env, skip) in dispatch_providers(device).items():
        if skip:
            row["skipped"][name] = skip
            continue
        ms = {}
        with env_vars(env):  # our ops read the backend switch at run time
            with torch.no_grad():
                ms["permute_fwd"] = measure(lambda: perm(x, order, k), timed)
                ms["combine_fwd"] = measure(lambda: comb(y, order, weights), timed)
            ms["permute_fwd_bwd"] = measure(lambda: perm(x, order, k).backward(grad_sorted), timed, grad_to_none=[x])
            ms["combine_fwd_bwd"] = measure(lambda: comb(y, order, weights).backward(grad_out), timed,
                                            grad_to_none=[y, weights])
            x.grad = y.grad = weights.grad = None
            x_sorted = perm(x, order, k)
            x_sorted.backward(grad_sorted)
            out = comb(y, order, weights)
            out.backward(grad_out)
        results[name] = dict(permute=x_sorted.detach(), dx=x.grad, combine=out.detach(), dy=y.grad, dw=weights.grad)
        x.grad = y.grad = weights.grad = None
        del x_sorted, out
        row["ms"][name] = {d: ms[d] for d in min_bytes}
        row["gbps"][name] = {d: None if t is None else min_bytes[d] / (t * 1e-3) / 1e9
                             for d, t in row["ms"][name].items()}
    for name, res in results.items():
        if name != "gather":
            for part, got in res.items():
                row["rel_err"][f"{name}_vs_gather_{part}"] = rel_err(got, results["gather"][part])
    return row


# ------------------------------------------------------------------------------------ report
def _fmt(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_gemm_table(rows: list[dict]) -> None:
    print("\n## grouped GEMM (ms median; TFLOP/s)")
    head = f"{'case':<22}{'E':>5}{'M':>7}{'K':>6}{'N':>6}{'grp min/max':>14}"
    names = list(rows[0]["ms"])
    cols = [c for c in names if c.endswith("_fwd")] + [c for c in names if c.endswith("_fwd_bwd")]
    width = {c: max(18, len(c) + 2) for c in cols}
    print(head + "".join(f"{c:>{width[c]}}" for c in cols) + "  err out/dx/dw vs torch")
    for r in rows:
        line = f"{r['case']:<22}{r['E']:>5}{r['M']:>7}{r['K']:>6}{r['N']:>6}{r['group_min']:>7}/{r['group_max']:<6}"
        for c in cols:
            line += f"{_fmt(r['ms'][c]) + ' (' + _fmt(r['tflops'][c], '.0f') + ')':>{width[c]}}"
        errs = [name + " " + "/".join(f"{r['rel_err'][f'{name}_vs_torch_{p}']:.1e}" for p in ("out", "dx", "dw"))
                for name in err_providers() if f"{name}_vs_torch_out" in r["rel_err"]]
        spread = max(r.get("ms_spread", {}).values(), default=None)
        print(line + "  " + "  ".join(errs) + ("" if spread is None else f"  rounds spread <= {spread:.1%}"))
        for product, sweep in r.get("tile_sweep", {}).items():
            print(f"    tile sweep {product:<7} " + ", ".join(
                f"{k} {v if isinstance(v, str) else _fmt(v)}" for k, v in sweep["ms"].items())
                + f"  (max rel err vs native {sweep['max_rel_err']:.1e}"
                + ("" if sweep.get("max_spread") is None else f", rounds spread <= {sweep['max_spread']:.1%}") + ")")


def speedups(row: dict, bases=("native", "auto")) -> dict[str, dict[str, float]]:
    """{provider: {base: base's forward+backward ms / provider's}} for every provider of a
    GEMM row, against each base provider the row has (the issue goals' ratios)."""
    ms = row["ms"]
    present = [b for b in bases if ms.get(f"{b}_fwd_bwd")]
    return {key[: -len("_fwd_bwd")]: {b: ms[f"{b}_fwd_bwd"] / t for b in present}
            for key, t in ms.items() if key.endswith("_fwd_bwd") and t}


def print_speedup_table(rows: list[dict]) -> None:
    print("\n## forward+backward speed-up against native / auto (ratio of medians)")
    for r in rows:
        ratios = speedups(r)
        print(f"{r['case']:<22}" + "  ".join(
            f"{name} " + "/".join(f"{v:.3f}x" for v in by_base.values()) for name, by_base in ratios.items()))


def print_dispatch_table(rows: list[dict]) -> None:
    print("\n## token dispatch (ms median; GB/s of the least traffic, see dispatch_min_bytes)")
    for r in rows:
        print(f"{r['case']}  N={r['N']} k={r['k']} L={r['L']} E={r['E']}"
              + "".join(f"  ({name} skipped: {why})" for name, why in r["skipped"].items()))
        print(f"  {'provider':<14}" + "".join(f"{d:>22}" for d in r["min_bytes"]))
        for name, ms in r["ms"].items():
            print(f"  {name:<14}" + "".join(f"{_fmt(t) + ' (' + _fmt(r['gbps'][name][d], '.0f') + ')':>22}"
                                            for d, t in ms.items()))
        worst = max(r["rel_err"].values(), default=0.0)
        print(f"  max rel err vs gather (outputs and grads): {worst:.1e}")

def print_tables(report: dict) -> None:
    timed = report["timed"]
    print(f"# bench_moe  {report['date']}  device={report['device_name']}  dtype={report['dtype']}  "
          f"torch={report['torch']}  triton={report['triton']}  timing={report.get('timing')}"
          + ("" if timed else "  (CPU smoke run: NOT timed)"))
    if report["gemm"]:
        print_gemm_table(report["gemm"])
        if timed:
            print_speedup_table(report["gemm"])
    layer = report["moe_layer"]
    if layer is None:
        return
    errs = "; ".join(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in e.items())
                     for name, e in layer["rel_err_ours_vs_native"].items())
    print(f"\n## MoE layer {layer['config']} compiled={layer['compiled']}  (vs ours_native: {errs})")
    print(f"{'provider':<14}{'GFLOP fwd':>12}{'ms fwd':>10}{'TFLOP/s':>9}{'GFLOP f+b':>12}{'ms f+b':>10}{'TFLOP/s':>9}")
    for name, p in layer["providers"].items():
        print(f"{name:<14}{p['flops_fwd'] / 1e9:>12.3f}{_fmt(p['ms_fwd']):>10}{_fmt(p['tflops_fwd'], '.0f'):>9}"
              f"{p['flops_fwd_bwd'] / 1e9:>12.3f}{_fmt(p['ms_fwd_bwd']):>10}{_fmt(p['tflops_fwd_bwd'], '.0f'):>9}"
              + (f"  skipped: {p['skipped']}" if "skipped" in p else ""))
        if "kernels_fwd_bwd" in p:
            k = p["kernels_fwd_bwd"]
            print(f"    kernels f+b {k['sum_ms']:.3f} ms: " + ", ".join(f"{n[:40]} {t:.3f}" for n, t in k["top"].items()))
    if "fp8_weight_refresh_ms" in layer:
        print(f"ours_fp8_cached: weights quantized once per optimizer step, {_fmt(layer['fp8_weight_refresh_ms'])} ms "
              "(not in its rows)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                        help="default bf16 on CUDA; fp32 on CPU (the Triton interpreter gets bf16 dots wrong)")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--gemm-cases", default="", help="comma-separated GEMM case names to keep, e.g. e64_balanced")
    parser.add_argument("--gemm-providers", default="",
                        help="comma-separated GEMM providers to keep (default all; torch._grouped_mm always runs)")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--layer-providers", default="",
                        help="comma-separated MoE layer runs to keep, e.g. ours_gluon (default all; ours_native and "
                             "torchtitan always run)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"interleaved rounds per timed case (default {ROUNDS}; the median is reported)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time the interleaved rounds as CUDA-graph replays (GPU time without host "
                             "launch gaps) instead of host launches with an L2 flush per call")
    # tile lists, each entry "BMxBNxBKxWARPSxSTAGES[xPROGRAMS][rTAIL][t]" (triton_kernel.parse_tile:
    # rTAIL tail tiles of the forward / dx kernel, t TMA stores), one or two providers per entry
    for flag, kernel, providers in (
            ("--fp8-tiles", "Triton fp8 forward / dx kernel", "fp8t_<tile> (fp8_rows dw) and fp8tb_<tile> (bf16 dw)"),
            ("--fp8-dw-tiles", "Triton fp8 dw kernel (BM the reduction step)",
             "fp8dw_<tile> and fp8dwg_<tile> (all products ours; per-group TMA descriptors)"),
            ("--dw-tiles", "bf16 Triton dw kernel",
             "dw_<tile>, dwl_<tile> (TMA loads) and dwg_<tile> (per-group TMA descriptors); auto's forward and dx"),
            ("--mk-tiles", "bf16 Triton forward / dx kernel", "mk_<tile> (dw on torch)")):
        parser.add_argument(flag, default="", help=f"comma-separated tiles of the {kernel}, "
                                                   f"BMxBNxBKxWARPSxSTAGES[xPROGRAMS][rTAIL][t]; providers {providers}")
    parser.add_argument("--sweep-tiles", action="store_true",
                        help="also time each Triton product (fwd, dx, dw) over a few tile shapes")
    parser.add_argument("--best-tiles", metavar="FILE", default=None,
                        help="print the winners of a saved --sweep-tiles run's output (its last line, the JSON) "
                             "as a $TITAN_MOE_GROUPED_MM_TILES value, then exit")
    parser.add_argument("--compile", action="store_true", help="torch.compile both MoE layers")
    parser.add_argument("--layer-kernels", type=int, default=0, metavar="N",
                        help="also profile each MoE layer provider's forward+backward: the sum of its device "
                             "kernels and its N most expensive ones")
    parser.add_argument("--dispatch", action="store_true",
                        help="also time the token dispatch ops (permute, unpermute+combine) against plain gathers")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1408, help="routed (and each shared) expert hidden size")
    parser.add_argument("--shared", type=int, default=1, help="shared experts")
    parser.add_argument("--latent", type=int, default=0, help="our latent width (default dim/2)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.best_tiles:
        with open(args.best_tiles) as f:
            best = best_tiles(json.loads(f.read().strip().splitlines()[-1]))
        for kind in ("mk", "k"):
            b = best[kind]
            print(f"# {kind}: {b['tile']} {b['ms']:.3f} ms summed, peer {_fmt(b['peer_ms'])} ms", file=sys.stderr)
        print(best["env"])
        return best
    if args.device == "cpu":
        # Must precede the first import of our Triton kernel module (it decides at import).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --device cpu --tiny for a smoke run")
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    timed = args.device == "cuda"
    report = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"), command=" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        device=args.device, device_name=torch.cuda.get_device_name() if timed else "cpu",
        torch=torch.__version__, triton=triton.__version__, dtype=dtype_name, timed=timed, gemm=[], moe_layer=None,
    )
    from titan_moe.ops.grouped_gemm.triton_kernel import default_config

    global GRAPH_TIMING, ROUNDS
    GRAPH_TIMING = args.cuda_graph
    ROUNDS = args.rounds
    FP8_TILES[:] = [t for t in args.fp8_tiles.split(",") if t]
    FP8_DW_TILES[:] = [t for t in args.fp8_dw_tiles.split(",") if t]
    DW_TILES[:] = [t for t in args.dw_tiles.split(",") if t]
    MK_TILES[:] = [t for t in args.mk_tiles.split(",") if t]
    report["timing"] = "cuda_graph_replay" if args.cuda_graph else "do_bench_host_launch"
    device = torch.device(args.device)
    report["triton_tiles"] = {kind: dataclasses.asdict(default_config(dtype, device, kind)) for kind in ("mk", "k")}
    # the forward / dx tile at output widths that are multiples of 256 (128x256 on sm90)
    report["triton_tiles"]["mk_width_256"] = dataclasses.asdict(default_config(dtype, device, "mk", n_cols=256))
    if not args.skip_gemm:
        keep = {c for c in args.gemm_cases.split(",") if c}
        cases = [c for c in gemm_cases(args.tiny) if not keep or c["case"] in keep]
        if keep - {c["case"] for c in cases}:
            raise SystemExit(f"bench_moe: --gemm-cases: unknown {sorted(keep - {c['case'] for c in cases})}")
        for case in cases:
            report["gemm"].append(bench_gemm_case(case, args.device, dtype, timed, args.sweep_tiles,
                                                  {p for p in args.gemm_providers.split(",") if p}))
            if timed:
                torch.cuda.empty_cache()
    if not args.skip_layer:
        report["moe_layer"] = bench_layer(layer_config(args), args.device, dtype, timed, args.compile,
                                          args.layer_kernels, frozenset(p for p in args.layer_providers.split(",") if p))
    if args.dispatch:
        report["dispatch"] = [bench_dispatch_case(case, args.device, dtype, timed)
                              for case in dispatch_cases(args.tiny)]
    print_tables(report)
    if args.dispatch:
        print_dispatch_table(report["dispatch"])
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
