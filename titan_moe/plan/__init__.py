"""Plan per-GPU memory for FSDP2 + expert parallelism (EP) + context parallelism (CP) layouts.

    python -m titan_moe.plan --job.config_file configs/k3.toml --gpus 2048 --gpu-mem-gib 141 \
        [--ac none|selective|full] [--seq-len S] [--local-batch B] [--headroom 0.1] [--hsdp] [--top 5] \
        [--activations eager|compiled] [--cp-rank worst|R] [--max-doc-len N]

Any other `--section.key value` overrides the config, as for training (e.g.
`--training.dtype float32` for fp32 master weights). `--activations` picks the activation
model: "compiled" counts what fused (compiled) layers keep, "eager" measures what eager
PyTorch keeps (below); the default follows the config (`[compile] enable` with "model" in
`components`: compiled, else eager). Prints a table of layouts for the given GPU count
(memory per GPU with each activation-checkpointing mode), the smallest fitting layouts, the
fewest GPUs (powers of two up to 4096) at which any layout fits, and, as the last line, one
JSON object; each layout's entry names the phase of the step where each AC mode peaks
(`peak_phase`, see "The step walk"). Memory is a model, not a measurement. Checked against the
peak allocated memory of `small_1gpu` runs on one or two H200s (`profiling/memory_check.py`
and training logs; tables in BENCHMARKS.md), each run planned on the model code it ran:

* eager, one GPU, max allocated over steps 1-3, the code of commit 9d1e05e: AC none 8K
  37.2 GiB vs 37.34 measured (-0.4%), 32K 103.0 vs 103.12 (-0.1%); full AC 8K 23.1 vs 23.22
  (-0.6%), 32K 34.7 vs 34.80 (-0.4%). Nothing was fitted to these runs: per layer kind the
  planner measures, op by op on the CPU, what eager autograd keeps (`.eager`) and what the
  forward and the backward allocate above their start (`.transient`, the GPU kernels'
  allocations included), and it reproduces `profiling/layer_memory.py`'s H200 numbers for
  single layers to 0.1 KiB per token (2% at one point). Before the transients were measured
  (`2 x largest kept entry + workspace`: 90-108 KiB per token where the layers add 192-270)
  the same runs were planned at 35.5, 96.1, 21.8 and 28.7 GiB (32K full AC -18%).
* earlier eager runs (before four changes made eager layers keep less: SiTU-GLU's and the KDA
  short convolution's autograd keep only their inputs, the AttnRes mixers keep no normalised
  copy of the sources, a sub-layer's input is cast once): AC none 8K 51.2 GiB planned vs
  52.45 measured, full AC 8K 22.8 vs 22.43, 32K 32.8 vs 31.11.
* context parallelism, eager, one H100 (2026-12-06): small_1gpu at T = 128K, rank 0 of CP8
  on the fake backend (FSDP over the 8 ranks), measured 46.92 GiB without AC and 6.78 with
  full AC. Planned, the layers as a CP rank runs them (`context_parallel`), for rank 0 with
  documents of at most a segment (what the fake backend's repeated document ids give): 48.60
  and 7.30 (+4%, +8%); the default row, the worst rank of a one-document row, 60.00 and 13.44.
* compiled, selective AC, 8K: one GPU, plan 25.2 GiB vs 26.2 GiB reserved (allocated not
  recorded); FSDP2 x EP2, 21.3 GiB allocated per GPU against a plan of 15.9 (-25%): under EP
  the routed experts run eagerly, and eager SiTU-GLU then kept 84 KiB per token where the
  fused count says 36 (counting that gave 19.9, -6%). SiTU-GLU's autograd now keeps only its
  pre-activations, so the fused count holds for eager experts (a test pins it). Fused layers'
  transients are still the heuristic (not measured: Inductor's backward graphs are not run).

Modules, in the order the plan is built:

* :mod:`.layout`: layouts (`Layout`, `enumerate_layouts`), byte sizes (`Precision`) and the
  step's phases (`Phase`);
* :mod:`.params`: the parameter inventory and its per-GPU shards, gradients, optimizer states,
  FSDP working memory and, on one device under autocast, the routed experts' compute-dtype
  copies kept through the step (`ParamMemory`; `training.cache_compute_weights`, newer than
  the checks above);
* :mod:`.activations`: the compiled model's kept bytes per token (`layer_activations`,
  `model_activations`);
* :mod:`.eager`: eager activations measured on the CPU (`measure_eager_layer`, `eager_profiles`);
* :mod:`.context_parallel`: layers as one rank of a context-parallel group runs them
  (`CPOptions`: which rank, the balance, the longest document; `RankSetting` and
  `fake_group` to measure them on torch's fake process group; `cp_buffers`, the per-row
  buffers counted from the layer structure);
* :mod:`.transient`: what eager layers' forward and backward allocate, op by op, without AC
  and under full AC (`measure_layer_peaks`, `layer_peaks`; the KDA launchers' tensors,
  `kda_fwd_allocations`, `kda_bwd_allocations`);
* :mod:`.step`: the step walk over the phases (`activation_memory`) and the per-layout plans
  (`plan_layout`, `plan_gpus`, `min_gpus`);
* :mod:`.cli`: the command line (`run_plan`, `main`).
"""

from titan_moe.plan.activations import (
    Entry,
    LayerActivations,
    kda_bwd_workspace_per_token,
    layer_activations,
    model_activations,
)
from titan_moe.plan.cli import PlanOptions, main, parse_args, run_plan
from titan_moe.plan.context_parallel import CPOptions, RankSetting, chunk_seq_sq, cp_buffers, fake_group
from titan_moe.plan.eager import (
    EagerProfile,
    GpuKernelSaves,
    eager_profiles,
    eager_saved_bytes,
    measure_eager_layer,
    zero_layer,
)
from titan_moe.plan.layout import (
    AC_MODES,
    ACTIVATION_MODELS,
    CP_DEGREES,
    GIB,
    KDA_CHUNK,
    MAX_SEARCH_GPUS,
    Layout,
    Phase,
    Precision,
    enumerate_layouts,
)
from titan_moe.plan.params import (
    OPTIMIZER_IMPLEMENTATIONS,
    ParamInventory,
    ParamMemory,
    expert_shard_numel,
    fsdp_shard_numel,
    gathered_numel,
    inventory,
    is_routed_expert,
    param_memory,
    sharded_numel,
    sharding_checks,
)
from titan_moe.plan.transient import (
    LayerPeaks,
    LiveBytes,
    PeakProfile,
    backward_peak,
    kda_bwd_allocations,
    kda_fwd_allocations,
    layer_counter,
    layer_peaks,
    measure_layer_peaks,
    peak_profiles,
)
from titan_moe.plan.step import (
    ActivationMemory,
    LayoutPlan,
    _stream_bytes_per_token,
    activation_memory,
    autocast_weight_copies,
    layer_policies,
    min_gpus,
    plan_gpus,
    plan_layout,
)

__all__ = [
    "AC_MODES", "ACTIVATION_MODELS", "CP_DEGREES", "CPOptions", "GIB", "KDA_CHUNK", "MAX_SEARCH_GPUS", "RankSetting",
    "chunk_seq_sq", "cp_buffers", "fake_group",
    "OPTIMIZER_IMPLEMENTATIONS", "ActivationMemory", "EagerProfile", "Entry", "GpuKernelSaves",
    "LayerActivations", "LayerPeaks", "Layout", "LayoutPlan", "LiveBytes", "ParamInventory", "ParamMemory",
    "PeakProfile", "Phase", "PlanOptions", "Precision", "_stream_bytes_per_token", "activation_memory",
    "autocast_weight_copies", "backward_peak", "eager_profiles", "eager_saved_bytes", "enumerate_layouts",
    "expert_shard_numel", "fsdp_shard_numel", "gathered_numel", "inventory", "is_routed_expert",
    "kda_bwd_allocations", "kda_bwd_workspace_per_token", "kda_fwd_allocations", "layer_activations",
    "layer_counter", "layer_peaks", "layer_policies", "main", "measure_eager_layer", "measure_layer_peaks",
    "min_gpus", "model_activations", "param_memory", "parse_args", "peak_profiles", "plan_gpus", "plan_layout",
    "run_plan", "sharded_numel", "sharding_checks", "zero_layer",
]
