"""The planner's command line: options, the layout table and the JSON summary.

Fit: `total <= (1 - headroom) * gpu_mem`; the default 10% headroom stands in for what is not
modelled (CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation); it is a guess.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from titan_moe.config import ConfigError, load_config, model_args_from_config, run_json_cli
from titan_moe.model.args import ModelArgs
from titan_moe.model.decoder import Decoder
from titan_moe.model.flops import count_params

from titan_moe.ops.kda import keep_selected
from titan_moe.context_parallel import BALANCES
from titan_moe.plan.activations import (
    LayerActivations, kept_residual_bytes_per_token, model_activations, with_moe_token_tiles,
)
from titan_moe.plan.context_parallel import CPOptions, cp_buffers
from titan_moe.plan.eager import eager_profiles
from titan_moe.plan.layout import AC_MODES, ACTIVATION_MODELS, GIB, MAX_SEARCH_GPUS, Layout, Precision, enumerate_layouts
from titan_moe.plan.params import OPTIMIZER_IMPLEMENTATIONS, inventory, sharding_checks
from titan_moe.plan.step import (
    LayoutPlan, _head_kept_per_token, _stream_bytes_per_token, min_gpus, plan_gpus, plan_layout,
)
from titan_moe.plan.transient import layer_peaks

# =========================================================================== CLI
@dataclass
class PlanOptions:
    gpus: int | None = None
    gpu_mem_gib: float = 141.0
    ac: str | None = None
    seq_len: int | None = None
    local_batch: int | None = None
    headroom: float = 0.10
    hsdp: bool = False
    top: int = 5
    activations: str | None = None  # None: "compiled" when [compile] covers the model, else "eager"
    cp_rank: int | None = None  # None: the worst rank of a context-parallel group
    max_doc_len: int | None = None  # None: one document fills each row


def _rank_or_worst(value: str) -> int | None:
    return None if value == "worst" else int(value)


_rank_or_worst.__name__ = "an integer or 'worst'"

_OPTIONS = {
    "--gpus": ("gpus", int),
    "--gpu-mem-gib": ("gpu_mem_gib", float),
    "--ac": ("ac", str),
    "--seq-len": ("seq_len", int),
    "--local-batch": ("local_batch", int),
    "--headroom": ("headroom", float),
    "--top": ("top", int),
    "--activations": ("activations", str),
    "--cp-rank": ("cp_rank", _rank_or_worst),
    "--max-doc-len": ("max_doc_len", int),
}


def parse_args(argv: list[str]) -> tuple[PlanOptions, list[str]]:
    """Split our options from the config arguments; raise ConfigError (one line) on a mistake."""
    opts = PlanOptions()
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if key == "--hsdp":
            opts = replace(opts, hsdp=True)
            i += 1
            continue
        if key not in _OPTIONS:
            rest.append(arg)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        name, tp = _OPTIONS[key]
        try:
            parsed = tp(value)
        except ValueError:
            raise ConfigError(f"command line: bad value for {key} {value!r}: expected {tp.__name__}") from None
        opts = replace(opts, **{name: parsed})
    if opts.gpus is None:
        raise ConfigError("command line: --gpus N is required")
    checks = [
        (opts.gpus >= 1, f"--gpus must be >= 1, got {opts.gpus}"),
        (opts.gpu_mem_gib > 0, f"--gpu-mem-gib must be > 0, got {opts.gpu_mem_gib}"),
        (opts.ac is None or opts.ac in AC_MODES, f"--ac must be one of {'|'.join(AC_MODES)}, got {opts.ac!r}"),
        (opts.seq_len is None or opts.seq_len >= 1, f"--seq-len must be >= 1, got {opts.seq_len}"),
        (opts.local_batch is None or opts.local_batch >= 1, f"--local-batch must be >= 1, got {opts.local_batch}"),
        (0 <= opts.headroom < 1, f"--headroom must lie in [0, 1), got {opts.headroom}"),
        (opts.top >= 1, f"--top must be >= 1, got {opts.top}"),
        (opts.activations is None or opts.activations in ACTIVATION_MODELS,
         f"--activations must be one of {'|'.join(ACTIVATION_MODELS)}, got {opts.activations!r}"),
        (opts.cp_rank is None or opts.cp_rank >= 0, f"--cp-rank must be >= 0, got {opts.cp_rank}"),
        (opts.max_doc_len is None or opts.max_doc_len >= 1, f"--max-doc-len must be >= 1, got {opts.max_doc_len}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(f"command line: {message}")
    return opts, rest


def _gib(x: float) -> str:
    return f"{x / GIB:8.1f}"


# Past this many tokens a GPU a compiled plan is below what was measured (docs/planner.md),
# so the plan says its rows are lower bounds there.
COMPILED_CHECKED_TOKENS = 32768


def _print_table(plans: list[LayoutPlan], usable: float, ac: str) -> None:
    print(f"  {'rep':>4} {'shard':>6} {'cp':>3} {'ep':>4} {'tokens':>7} | {'params':>8} {'grads':>8} {'optim':>8} "
          f"{'buffers':>8} {'gathered':>8} | {'act:none':>8} {'sel':>8} {'full':>8} | "
          f"{'tot:none':>8} {'sel':>8} {'full':>8}")
    for p in plans:
        lay, m = p.layout, p.params
        marks = "".join("*" if p.fits(mode, usable) else "." for mode in AC_MODES)
        print(f"  {lay.dp_replicate:>4} {lay.dp_shard:>6} {lay.cp:>3} {lay.ep:>4} {p.activations[ac].tokens:>7} | "
              f"{_gib(m.params)} {_gib(m.grads)} {_gib(m.optimizer)} {_gib(m.buffers)} {_gib(m.fsdp_gathered)} | "
              + " ".join(_gib(p.activations[mode].peak) for mode in AC_MODES) + " | "
              + " ".join(_gib(p.total(mode)) for mode in AC_MODES) + f"  {marks}")


def _print_activation_summary(args: ModelArgs, prec: Precision, layout: Layout, activations: str,
                              cp_options: CPOptions) -> None:
    """Bytes per local token of each layer kind (the layout only matters through its flags and
    its context-parallel degree); a context-parallel layer's `T^2` terms are its score
    blocks (`LayerActivations.seq_sq`)."""
    seen: dict[str, LayerActivations] = {}
    for layer in model_activations(args, prec, layout, activations, cp_options):
        seen.setdefault(layer.kind, layer)
    sq = lambda l: "score blocks" if l.chunk_caps else "T^2"  # noqa: E731
    parts = [
        f"{kind} kept {l.kept / 1024:.0f}" + (f" + {l.per_seq_sq:g} B x T^2" if l.per_seq_sq else "")
        + f" / SAC {l.sac_kept / 1024:.0f} / transient {l.transient / 1024:.0f}"
        + f" / full-AC backward {l.full_ac_backward_at(1.0, 0.0) / 1024:.0f}"
        + (f" + {l.full_ac_backward_sq:g} B x {sq(l)}" if l.full_ac_backward_sq else "")
        for kind, l in seen.items()
    ]
    s = prec.stream(layout.fsdp_enabled)
    stream = _stream_bytes_per_token(args, s, ["none"] * args.n_layers) / 1024
    head = _head_kept_per_token(args, s, prec.compute) / 1024
    print(f"  {activations} activations, KiB per local token (ep={layout.ep}, cp={layout.cp}): " + "; ".join(parts)
          + f"; AttnRes stream {stream:.0f} (all layers); head {head:.0f}")


def _cp_rank_text(cp_options: CPOptions) -> str:
    if cp_options.rank is not None:
        return f"rank {cp_options.rank}"
    mla = "rank 0" if cp_options.balance == "headtail" else "rank cp - 1"
    return f"the worst rank (MLA layers as on {mla}, the longest key span; KDA layers as on rank 1, which continues a document)"


def _print_cp_summary(args: ModelArgs, prec: Precision, cps: list[int], local_batch: int, seq_len: int,
                      cp_options: CPOptions) -> dict[str, dict[str, float]]:
    """One line per context-parallel degree: the per-row buffers of one rank
    (`context_parallel.cp_buffers`, MiB); returns them (JSON-ready, per degree)."""
    docs = "one document fills each row" if cp_options.max_doc_len is None else \
        f"documents of at most {cp_options.max_doc_len} tokens"
    print(f"  context parallelism: {_cp_rank_text(cp_options)}; {docs}; balance "
          f"{cp_options.balance or 'none'} (docs/planner.md, \"Limits\")")
    out = {}
    for cp in cps:
        b = cp_buffers(args, prec.compute, cp, seq_len // cp, cp_options, local_batch)
        out[str(cp)] = {name: v / 2**20 for name, v in b.items()}
        mib = {name: f"{v / 2**20:,.0f}" for name, v in b.items()}
        print(f"    cp {cp}: per MLA layer latents all-gathered {mib['mla.latent_gather']} MiB, key copies "
              f"{mib['mla.key_copies']}, headtail exchange {mib['mla.exchange']}, one score block "
              f"{mib['mla.score_blocks']} (about 4 alive at the attention's peaks); per KDA layer basis "
              f"{mib['kda.basis']} (0 on rank 0), states all-gathered {mib['kda.state_gather']}")
    return out


def _print_tile_note(args: ModelArgs, prec: Precision, plan: LayoutPlan, activations: str,
                     cp_options: CPOptions) -> None:
    """With `model.moe_token_tile`: the MoE layers' counts at the first layout's local tokens."""
    tile, tokens = args.moe_token_tile, plan.activations["none"].tokens
    if not tile:
        return
    if activations == "eager":
        print(f"  model.moe_token_tile = {tile}: not modelled by the eager profiles (they measure the untiled layer)")
        return
    if tokens <= tile:
        print(f"  model.moe_token_tile = {tile}: no effect at {tokens} local tokens (one tile)")
        return
    seen: dict[str, LayerActivations] = {}
    for layer in model_activations(args, prec, plan.layout, activations, cp_options):
        if layer.kind.endswith("+moe"):
            seen.setdefault(layer.kind, with_moe_token_tiles(layer, args, tokens))
    parts = [f"{kind} kept {l.kept / 1024:.0f} / transient {l.transient / 1024:.0f} / full-AC backward "
             f"{l.full_ac_backward_at(tokens, 0.0) / tokens / 1024:.0f}" for kind, l in seen.items()]
    print(f"  model.moe_token_tile = {tile}: at {tokens} local tokens the MoE keeps only its tiles' inputs and its "
          f"backward recomputes one tile at a time, KiB per local token: " + "; ".join(parts))


def _eager_summary(args: ModelArgs, prec: Precision, plans: list[LayoutPlan],
                   cp_options: CPOptions) -> dict[str, dict]:
    """The eager profiles the plans used, per FSDP setting, context-parallel degree ("fsdp_cp8":
    at the plan's rank, `cp_options`) and layer kind (JSON-ready)."""
    out: dict[str, dict] = {}
    for fsdp, cp in sorted({(p.layout.fsdp_enabled, p.layout.cp) for p in plans}):
        profiles = eager_profiles(args, prec, fsdp, cp, cp_options)
        peaks = layer_peaks(args, prec, fsdp, cp, cp_options)
        out[("fsdp" if fsdp else "no_fsdp") + (f"_cp{cp}" if cp > 1 else "")] = {
            p.kind: {"kib_per_token": p.per_token / 1024, "bytes_per_seq_sq": p.per_seq_sq,
                     "measured_on": "fake" if p.fake else "cpu", "experts_built": list(p.experts),
                     # [KiB per token, bytes per sequence per T^2] at each op that can be the peak
                     **{f"{name}_peaks": [[l / 1024, q] for l, q in getattr(peaks[key], name).points]
                        for name in ("forward", "backward", "full_forward", "full_backward")}}
            for key, p in profiles.items()
        }
    return out


def run_plan(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = parse_args(argv)
    config = load_config(rest)
    args = model_args_from_config(config)
    seq_len = opts.seq_len or config.training.seq_len
    local_batch = opts.local_batch or config.training.local_batch_size
    ac = opts.ac or config.activation_checkpoint.mode
    if ac not in AC_MODES:
        raise ConfigError(f"activation_checkpoint.mode {ac!r} is not modelled; pass --ac none|selective|full")
    prec = Precision.from_config(config)
    usable = (1 - opts.headroom) * opts.gpu_mem_gib * GIB

    with torch.device("meta"):
        model = Decoder(args)
    counts = count_params(model, args)
    inv = inventory(model, args)
    sac_option = config.activation_checkpoint.selective_ac_option
    if sac_option != "op" and not sac_option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or an integer, got {sac_option!r}")
    compiled = config.compile.enable and "model" in config.compile.components
    activations = opts.activations or ("compiled" if compiled else "eager")
    optimizer_impl = config.optimizer.implementation
    if optimizer_impl not in OPTIMIZER_IMPLEMENTATIONS:
        raise ConfigError(f"optimizer.implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}, "
                          f"got {optimizer_impl!r}")
    if config.optimizer.name == "Muon":  # titan_moe's Muon runs its own step, whatever the implementation
        optimizer_impl = "muon"
    one_device = config.training.one_device_mixed_precision
    balance = config.parallelism.context_parallel_load_balancer
    if balance not in BALANCES:
        raise ConfigError(f"parallelism.context_parallel_load_balancer = {balance!r} is not modelled (the trainer "
                          "runs 'headtail' or none)")
    cp_options = CPOptions(balance, opts.cp_rank, opts.max_doc_len)
    cps = sorted({lay.cp for lay in enumerate_layouts(opts.gpus, args.n_routed_experts, seq_len, opts.hsdp)} - {1})
    if opts.cp_rank is not None and cps and opts.cp_rank >= cps[0]:
        raise ConfigError(f"command line: --cp-rank {opts.cp_rank} does not exist in the smallest context-parallel "
                          f"group of these layouts ({cps[0]} ranks)")
    plans = plan_gpus(args, inv, prec, opts.gpus, local_batch, seq_len, opts.hsdp, sac_option, activations,
                      optimizer_impl, one_device_fsdp=one_device == "fsdp", cp_options=cp_options)
    assert plans, "dp_shard = N, cp = ep = 1 is always a layout"
    rank0 = {}  # the worst rank's plans beside rank 0's, which never continues a KDA document
    if opts.cp_rank is None:
        first = replace(cp_options, rank=0)
        rank0 = {p.layout: plan_layout(args, inv, prec, p.layout, local_batch, seq_len, sac_option, activations,
                                       optimizer_impl, first) for p in plans if p.layout.cp > 1}
    checks = {"params_match_inspect": counts.total == inv.total and counts.routed_experts == inv.routed_experts}
    shard_ok = all(all(sharding_checks(inv, p.layout).values()) for p in plans)
    checks["shard_sums_match_totals"] = shard_ok

    print(f"titan_moe.plan: {config.job.config_file}  flavor={config.model.flavor}  "
          f"params {inv.total:,} (routed experts {inv.routed_experts:,}, other {inv.non_expert:,}); "
          f"buffers {inv.buffer_bytes / GIB:.2f} GiB")
    training = config.training
    optimizer_bytes = (f"{3 * prec.param} B per sharded param of the matrices Muon updates, {4 * prec.param} B "
                       "per other (AdamW); Muon's step temporaries estimated" if optimizer_impl == "muon"
                       else f"{4 * prec.param} B per sharded param with AdamW, {optimizer_impl} step")
    print(f"  bytes: params/grads/optimizer in {training.dtype} ({optimizer_bytes}), "
          f"compute {training.mixed_precision_param}, "
          f"reduce {training.mixed_precision_reduce}; one GPU: {one_device} (training.one_device_mixed_precision: "
          f"AttnRes stream in {training.mixed_precision_param if one_device == 'fsdp' else training.dtype})")
    print(f"  tokens per GPU = local_batch {local_batch} x seq_len {seq_len} / cp;  fit: total <= "
          f"{1 - opts.headroom:.2f} x {opts.gpu_mem_gib:g} GiB = {usable / GIB:.1f} GiB "
          f"({opts.headroom:.0%} headroom for CUDA context, NCCL, fragmentation: a guess, not measured)")
    if keep_selected():
        print(f"  kernels.kda_keep: each KDA layer's forward keeps {kept_residual_bytes_per_token(args, prec.compute) / 1024:.1f} KiB "
              f"per token for its backward, which skips the recompute "
              f"(counted below; the compiled count keeps the recomputing backward's workspace)")
    sac_text = "op-level SAC" if sac_option == "op" else f"layer SAC, 1 layer in {sac_option} checkpointed"
    print(f"  AC: one checkpoint per decoder layer; selective = {sac_text} "
          f"(activation_checkpoint.selective_ac_option = {sac_option!r})")
    print(f"  sanity: total params == inspect's total: {checks['params_match_inspect']};  "
          f"per-GPU shards x degrees == totals: {checks['shard_sums_match_totals']}")
    _print_activation_summary(args, prec, plans[0].layout, activations, cp_options)
    _print_tile_note(args, prec, plans[0], activations, cp_options)
    cp_buffers_mib = {}
    if cps:
        _print_activation_summary(args, prec, max(plans, key=lambda p: p.layout.cp).layout, activations, cp_options)
        cp_buffers_mib = _print_cp_summary(args, prec, cps, local_batch, seq_len, cp_options)
    if activations == "eager":
        print("  eager activations: measured per layer kind with saved-tensor hooks on CPU (fake tensors for "
              "large layers), SDPA and RMSNorm saving what their CUDA kernels save (see the module docstring); "
              "transients and full-AC backward: live bytes op by op, GPU kernels' allocations included "
              "(titan_moe.plan.transient)")
    elif not compiled:
        print("  note: [compile] is off but --activations compiled: the counts assume fused layers, and eager "
              "PyTorch keeps about twice as much per layer (--activations eager measures it)")
    if activations == "compiled" and max(p.activations["none"].tokens for p in plans) > COMPILED_CHECKED_TOKENS:
        print(f"  note: compiled counts past {COMPILED_CHECKED_TOKENS:,} tokens a GPU are lower bounds: a measured "
              "long-row step needed more than its plan (docs/planner.md)")
    print(f"\n{opts.gpus} GPUs, {len(plans)} layouts (GiB per GPU; act: the activations' high-water mark; tot: the "
          "step's peak over its phases, not the row's sum; marks: fits with AC none/selective/full):")
    _print_table(plans, usable, ac)
    if rank0:
        print("  rank 0 of the context-parallel layouts (no KDA basis call; the rows above are the worst rank), "
              "tot:none/sel/full: " + "; ".join(
                  f"cp {lay.cp} ep {lay.ep}: " + " ".join(f"{p.total(mode) / GIB:.1f}" for mode in AC_MODES)
                  for lay, p in rank0.items()))

    fitting = sorted((p for p in plans if p.fits(ac, usable)), key=lambda p: p.total(ac))
    print(f"\nsmallest fitting layouts, ac={ac}:" if fitting else f"\nno layout fits on {opts.gpus} GPUs with ac={ac}")
    for p in fitting[: opts.top]:
        lay = p.layout
        phase, total = p.peak(ac)
        print(f"  dp_replicate={lay.dp_replicate} dp_shard={lay.dp_shard} cp={lay.cp} ep={lay.ep}: "
              f"{total / GIB:.1f} GiB (peak: {phase})")
    fewest = min_gpus(args, inv, prec, local_batch, seq_len, usable, sac_option, activations, optimizer_impl,
                      one_device_fsdp=one_device == "fsdp", cp_options=cp_options)
    print(f"fewest GPUs (powers of two <= {MAX_SEARCH_GPUS}) with a fitting layout: "
          + ", ".join(f"{mode}={fewest[mode] if fewest[mode] is not None else 'none'}" for mode in AC_MODES))
    return {
        "config": config.job.config_file,
        "flavor": config.model.flavor,
        "gpus": opts.gpus,
        "gpu_mem_gib": opts.gpu_mem_gib,
        "headroom": opts.headroom,
        "usable_gib": usable / GIB,
        "ac": ac,
        "selective_ac_option": sac_option,
        "activations": activations,
        "optimizer": config.optimizer.name,
        "optimizer_implementation": config.optimizer.implementation,  # not used by Muon's own step
        **({"eager_profiles": _eager_summary(args, prec, plans, cp_options)} if activations == "eager" else {}),
        "context_parallel": {"rank": "worst" if opts.cp_rank is None else opts.cp_rank, "balance": balance,
                             "max_doc_len": opts.max_doc_len, "buffers_mib": cp_buffers_mib},
        "seq_len": seq_len,
        "local_batch": local_batch,
        "precision": {"param": config.training.dtype, "compute": config.training.mixed_precision_param,
                      "reduce": config.training.mixed_precision_reduce, "one_device": one_device},
        "total_params": inv.total,
        "routed_expert_params": inv.routed_experts,
        "other_params": inv.non_expert,
        "fits": bool(fitting),
        "best": [p.summary(usable) for p in fitting[: opts.top]],
        "layouts": [p.summary(usable) | ({"rank0_gib": {f"total_{mode}": rank0[p.layout].total(mode) / GIB
                                                        for mode in AC_MODES}} if p.layout in rank0 else {})
                    for p in plans],
        "min_gpus": fewest,
        "sanity": checks,
    }


USAGE = """usage: python -m titan_moe.plan --job.config_file FILE.toml --gpus N [options] [--section.key value ...]

Per-GPU memory of every parallel layout of the configured model on N GPUs (docs/planner.md);
prints a table per layout kind and one JSON summary line.

options:
  --gpus N               number of GPUs (required)
  --gpu-mem-gib G        memory of one GPU in GiB (default 141)
  --ac MODE              activation checkpointing the fit is judged by: none|selective|full
                         (default: the config's activation_checkpoint.mode)
  --seq-len S            tokens per row (default: training.seq_len)
  --local-batch B        rows per GPU (default: training.local_batch_size)
  --headroom F           fraction of the memory kept free, in [0, 1) (default 0.1)
  --hsdp                 also list replicated-shard (HSDP) layouts
  --top K                layouts shown per table (default 5)
  --activations MODEL    compiled|eager activation model (default: compiled when [compile] covers the model)
  --cp-rank R            plan rank R of each context-parallel group instead of the worst rank (default worst)
  --max-doc-len N        the longest document of a row, in tokens (default: one document fills each row);
                         caps the context-parallel attention's key spans
  -h, --help             show this help and exit

Config keys: python -m titan_moe.train --help"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(USAGE)
        raise SystemExit(0)
    run_json_cli("titan_moe.plan", run_plan, argv)

