"""`model.moe_token_tile`: LatentMoE in token tiles, each under its own activation checkpoint.

Tiled and untiled forwards route every token alike (routing is per token given the bias), so
outputs, gradients and every balance statistic match. Not bit for bit in the floating-point
values: the CPU grouped GEMM's accumulation order depends on each expert group's row count,
which tiling changes (about 1e-9 absolute on outputs of size 1e-2), and the weight gradients
are sums over the tiles' partial sums; the integer statistics and the biases fitted from them
are equal exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from titan_moe.flavors import FLAVORS
from titan_moe.model.args import ModelArgs
from titan_moe.model.moe import LatentMoE, update_expert_biases

MOE_ARGS = dataclasses.replace(FLAVORS["debug"], dim=64, moe_latent_dim=32, moe_expert_hidden=48,
                               moe_shared_hidden=48)
TILE = 48


def _pair(args: ModelArgs, tile: int = TILE) -> tuple[LatentMoE, LatentMoE]:
    """A seeded LatentMoE with a nonzero bias and a tiled copy of it."""
    torch.manual_seed(0)
    untiled = LatentMoE(args)
    untiled.init_weights()
    if args.balance_rule != "aux_loss":
        with torch.no_grad():
            untiled.expert_bias.normal_(0.0, 0.05)
    tiled = copy.deepcopy(untiled)
    tiled.token_tile = tile
    return untiled, tiled


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _forward_backward(moe: LatentMoE, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _assert_same_step(untiled: LatentMoE, tiled: LatentMoE, x: torch.Tensor, g: torch.Tensor) -> None:
    y_u, dx_u = _forward_backward(untiled, x, g)
    y_t, dx_t = _forward_backward(tiled, x, g)
    assert _rel(y_t, y_u) < 1e-6 and _rel(dx_t, dx_u) < 1e-6  # grouped GEMM order (module docstring)
    for (name, p_u), (_, p_t) in zip(untiled.named_parameters(), tiled.named_parameters(), strict=True):
        assert _rel(p_t.grad, p_u.grad) < 1e-5, name  # sums over tiles' partial sums
    buffers_t = dict(tiled.named_buffers())
    for name, b_u in untiled.named_buffers():
        assert torch.equal(buffers_t[name], b_u), name
    if untiled.step_scores is not None:
        assert torch.equal(tiled.step_scores, untiled.step_scores)


@pytest.mark.parametrize("balance", [
    dict(qb_bins=16),  # histogram QB (the configs' setting)
    dict(qb_bins=0),  # exact lagged QB: the step's scores
    dict(balance_rule="sign"),
    dict(qb_batch_iters=2, qb_bins=16),  # in-batch QB: the bias fitted on the whole batch first
    dict(qb_batch_iters=1, qb_bins=0),
])
def test_tiles_match_untiled(balance):
    """Two microbatches (the second's token count not a multiple of the tile), then the bias
    update: the same outputs, gradients, statistics, logged balance metrics and new bias."""
    untiled, tiled = _pair(dataclasses.replace(MOE_ARGS, **balance))
    gen = torch.Generator().manual_seed(1)
    for shape in [(2, 96, 64), (3, 37, 64)]:  # 192 tokens: 4 tiles; 111: 3 tiles, the last ragged
        x = torch.randn(*shape, generator=gen)
        _assert_same_step(untiled, tiled, x, torch.randn(*shape, generator=gen))
    metrics_u, metrics_t = update_expert_biases(untiled), update_expert_biases(tiled)
    assert metrics_t == metrics_u
    assert torch.equal(tiled.expert_bias, untiled.expert_bias)
    untiled.eval(), tiled.eval()  # inference: tiles without checkpoints
    with torch.no_grad():
        x = torch.randn(2, 96, 64, generator=gen)
        assert _rel(tiled(x), untiled(x)) < 1e-6


def test_tiles_match_untiled_aux_loss():
    """The auxiliary loss's fractions f_e come from the whole batch before the tiles; each tile
    adds its share of E * Σ_e f_e P_e. The router's gradient from the loss term alone (output
    gradient zero) and with the output's gradient, and the logged loss, equal the untiled ones."""
    args = dataclasses.replace(MOE_ARGS, balance_rule="aux_loss", aux_loss_coef=1.0)
    untiled, tiled = _pair(args)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 100, 64, generator=gen)
    _forward_backward(untiled, x, torch.zeros(2, 100, 64))
    _forward_backward(tiled, x, torch.zeros(2, 100, 64))
    router_u, router_t = untiled.router.weight.grad, tiled.router.weight.grad
    assert router_u.norm() > 0 and _rel(router_t, router_u) < 1e-5
    assert torch.equal(tiled.aux_loss_sum, untiled.aux_loss_sum)
    for moe in (untiled, tiled):
        moe.zero_grad()
    _assert_same_step(untiled, tiled, x, torch.randn(2, 100, 64, generator=gen))
    assert update_expert_biases(tiled) == update_expert_biases(untiled)


def test_tiled_layers_compile_without_breaks_or_recompiles():
    """Regional compile over activation checkpointing, as training applies them: the MoE
    layers' tile loop (3 tiles, the last ragged) traces into each layer's fullgraph region
    (aot_eager, as tests/test_compile.py) with no graph break, one graph per layer kind over
    steps with different document counts, and the same loss, gradients and balance counts as
    the untiled eager model."""
    from titan_moe.model.decoder import Decoder

    # one MLA+MoE layer: the tiles' region is what is checked, and each layer kind costs a compile
    args = dataclasses.replace(FLAVORS["debug"], dim=64, n_layers=1, n_dense_layers=0, mla_q_lora_rank=32,
                               moe_latent_dim=32, qb_bins=16)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Decoder(args)
    eager.init_weights()
    compiled = Decoder(dataclasses.replace(args, moe_token_tile=TILE))
    compiled.load_state_dict(eager.state_dict())
    for name, layer in compiled.layers.named_children():
        wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
        compiled.layers.register_module(name, torch.compile(wrapped, backend="aot_eager", fullgraph=True))
    gen = torch.Generator().manual_seed(0)
    graphs = []
    for step in range(2):
        tokens = torch.randint(0, args.vocab_size, (2, 64), generator=gen)  # 128 tokens: tiles 48, 48, 32
        doc_ids = torch.zeros(2, 64, dtype=torch.int32)
        doc_ids[:, 20 + 10 * step:] += 1
        doc_ids[1, 50:] += step + 1
        out_c, out_e = compiled(tokens, doc_ids), eager(tokens, doc_ids)
        out_c.logsumexp(-1).mean().backward()
        out_e.logsumexp(-1).mean().backward()
        assert _rel(out_c, out_e) < 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    kinds = {(layer.kind, layer.is_moe) for layer in eager.layers.values()}
    assert graphs == [len(kinds)] * 2
    for (name, p_c), (_, p_e) in zip(compiled.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-6, msg=name)
    unwrapped = re.compile(r"(_orig_mod|_checkpoint_wrapped_module)\.")
    stats_c = {unwrapped.sub("", n): b for n, b in compiled.named_buffers()}
    for n, b in eager.named_buffers():
        if n.endswith(("tokens_per_expert", "qb_counts")):
            assert torch.equal(stats_c[n], b), n


# =========================================================================== memory
MEM_ARGS = dataclasses.replace(MOE_ARGS, moe_expert_hidden=128, moe_shared_hidden=128, qb_bins=16)
MEM_TILE = 64


def _saved_bytes(moe: LatentMoE, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward of `moe`."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return sum(storages.values())


def _checkpointed_backward_peak(moe: LatentMoE, x: torch.Tensor) -> int:
    """High-water mark of the bytes allocated in the backward of `moe` under a non-reentrant
    checkpoint (a layer under full AC: its recompute included), op by op
    (`titan_moe.plan.transient.LiveBytes`)."""
    from titan_moe.plan.transient import LiveBytes

    y = checkpoint(moe, x, use_reentrant=False, preserve_rng_state=False)
    g = torch.ones_like(y)
    mode = LiveBytes()
    with mode:
        y.backward(g)
    return mode.peak


def test_tiles_keep_only_their_inputs_and_recompute_one_tile_at_a_time():
    """Memory evidence on the CPU (fp32, eager). Untiled, the MoE's forward saves
    O(T x top_k x expert hidden) bytes for the backward; tiled, only the tiles' inputs (the
    views of x, T x dim x 4 bytes) and the bias. In a checkpointed layer's backward the
    untiled MoE holds all T tokens' recomputed activations, so its peak grows with T at the
    full per-token rate; tiled, the peak is one tile's activations plus O(T x dim) tensors
    (input, output and their gradients), so doubling T adds only those."""
    untiled, tiled = _pair(MEM_ARGS, MEM_TILE)
    D = MEM_ARGS.dim
    saved, peaks = {}, {}
    for T in (4 * MEM_TILE, 8 * MEM_TILE):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(T), requires_grad=True)
        for name, moe in (("untiled", untiled), ("tiled", tiled)):
            saved[name, T] = _saved_bytes(moe, x)
            peaks[name, T] = _checkpointed_backward_peak(moe, x)
    T = 4 * MEM_TILE
    # tiled: x itself (one storage, T*D fp32) and the bias; nothing that grows with k or the hidden width
    assert saved["tiled", T] <= T * D * 4 + 1024
    L, h, k = MEM_ARGS.moe_latent_dim, MEM_ARGS.moe_expert_hidden, MEM_ARGS.top_k
    assert saved["untiled", T] >= T * k * (2 * h + h + 2 * L) * 4  # gate|up, hidden, dispatched and expert output
    per_token = {name: (peaks[name, 2 * T] - peaks[name, T]) / T for name in ("untiled", "tiled")}
    # untiled: every recomputed activation per token; tiled: input, output, their gradients, the
    # gradient split per tile and the output's concatenation: under 8 fp32 rows of width D
    assert per_token["tiled"] <= 8 * D * 4
    assert per_token["untiled"] >= 4 * per_token["tiled"]
    # at 8 tiles the per-token terms outweigh what does not grow with T (the weights' gradients:
    # about 1 MiB here, since SiTU-GLU is counted as CUDA runs it, by its outputs)
    assert peaks["tiled", 2 * T] <= peaks["untiled", 2 * T] / 2


# =========================================================================== configuration
def test_token_tile_config_checks():
    from titan_moe.config import ConfigError, load_config, model_args_from_config

    base = ["--job.config_file", "configs/debug_cpu.toml"]
    assert model_args_from_config(load_config(base + ["--model.moe_token_tile", "64"])).moe_token_tile == 64
    assert model_args_from_config(load_config(base)).moe_token_tile == 0
    with pytest.raises(ConfigError, match=r"model\.moe_token_tile must be >= 0") as err:
        load_config(base + ["--model.moe_token_tile", "-1"])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"model\.moe_token_tile must be >= 0"):
        ModelArgs(moe_token_tile=-8)
    with pytest.raises(ConfigError, match=r"moe_token_tile = 64 does not work with expert parallelism"):
        load_config(base + ["--model.moe_token_tile", "64", "--parallelism.expert_parallel_degree", "2"])
    with pytest.raises(ConfigError, match=r"moe_token_tile = 64 needs whole-layer compile regions"):
        load_config(base + ["--model.moe_token_tile", "64", "--compile.moe_regions", "piecewise"])


def test_token_tile_refuses_expert_parallel_experts():
    _, tiled = _pair(MOE_ARGS)
    tiled.experts.expert_parallel = True  # as parallelize's LatentExpertParallel sets it
    with pytest.raises(ValueError, match="moe_token_tile > 0 does not work with expert parallelism"):
        tiled(torch.randn(2, 64, 64))


def test_start_up_line_names_the_tile(caplog):
    from torchtitan.tools.logging import logger

    from titan_moe.config import load_config
    from titan_moe.ops import choices
    from titan_moe.train import _activate_kernel_choices

    previous = choices.current()
    logger.propagate, propagate = True, logger.propagate
    try:
        with caplog.at_level("INFO"):
            record = _activate_kernel_choices(load_config(
                ["--job.config_file", "configs/debug_cpu.toml", "--model.moe_token_tile", "4096"]))
    finally:
        logger.propagate = propagate
        choices.activate(previous)
    assert record["moe_token_tile"] == 4096
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    assert "moe_token_tile=4096" in line


# =========================================================================== planner
def test_planner_counts_one_tile_of_moe_activations():
    """`titan_moe.plan`: with the tile, a MoE layer's full-AC backward at T tokens drops by the
    MoE's kept bytes of the T - tile tokens outside the recomputed tile; at T <= tile nothing
    changes; the step's full-AC peak at 1M tokens drops."""
    from titan_moe.plan.activations import model_activations, with_moe_token_tiles
    from titan_moe.plan.layout import Layout, Precision
    from titan_moe.plan.step import activation_memory

    tile, T = 65536, 1 << 20
    args = dataclasses.replace(FLAVORS["small_1gpu"], moe_token_tile=tile)
    prec, layout = Precision(param=4, compute=2, reduce=4), Layout(1, 1, 1, 1)
    layers = model_activations(args, prec, layout)
    moe_layer = next(layer for layer in layers if layer.kind == "kda+moe")
    dense_layer = next(layer for layer in layers if layer.kind == "kda+dense")
    assert with_moe_token_tiles(dense_layer, args, T) is dense_layer
    assert with_moe_token_tiles(moe_layer, args, tile) is moe_layer
    tiled = with_moe_token_tiles(moe_layer, args, T)
    moe_kept = sum(e.bytes for e in moe_layer.entries if e.name.startswith("moe.") and e.kept)
    assert tiled.kept == pytest.approx(moe_layer.kept - moe_kept)
    saved = moe_layer.full_ac_backward_at(T, 0.0) - tiled.full_ac_backward_at(T, 0.0)
    assert moe_kept * (T - tile) * 0.9 < saved < (moe_kept * T + 2 * max(e.bytes for e in moe_layer.entries) * T)
    untiled_args = dataclasses.replace(args, moe_token_tile=0)
    peak = {name: activation_memory(a, prec, layout, "full", 1, T).peak for name, a in
            (("tiled", args), ("untiled", untiled_args))}
    assert peak["tiled"] < 0.8 * peak["untiled"]
