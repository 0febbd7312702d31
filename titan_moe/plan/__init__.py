"""Plan per-GPU memory for FSDP2 + expert parallelism (EP) + context parallelism (CP) layouts.

    python -m titan_moe.plan --job.config_file configs/k3.toml --gpus 2048 --gpu-mem-gib 141 \
        [--ac none|selective|full] [--seq-len S] [--local-batch B] [--headroom 0.1] [--hsdp] [--top 5] \
        [--activations eager|compiled]

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

* eager, one GPU, steps 1-3: AC none 8K 51.2 GiB vs 52.45 measured (-2%), 32K 159 GiB where
  the run ran out of memory (> 138 GiB allocated); full AC 8K 22.8 vs 22.43 (+2%), 32K 32.8
  vs 31.11 (+5%). The constants were not fitted to these runs. Before the step walk the
  planner added all gradients, the whole AttnRes stream and the largest transient at once:
  +9% (8K) and +23% (32K) over the full-AC runs.
* compiled, selective AC, 8K: one GPU, plan 25.2 GiB vs 26.2 GiB reserved (allocated not
  recorded); FSDP2 x EP2, 21.3 GiB allocated per GPU against a plan of 15.9 (-25%): under EP
  the routed experts run eagerly, and eager SiTU-GLU then kept 84 KiB per token where the
  fused count says 36 (counting that gave 19.9, -6%). SiTU-GLU's autograd now keeps only its
  pre-activations, so the fused count holds for eager experts (a test pins it).

All of these runs predate four changes that make eager layers keep less (SiTU-GLU's and the
KDA short convolution's autograd keep only their inputs; the AttnRes mixers keep no
normalised copy of the sources; a sub-layer's input is cast to the autocast dtype once, not
per projection). The plans for the current code, not yet measured: eager 8K none 35.5, full
21.8 GiB; 32K none 96.1 (now fits one H200), full 28.7; FSDP2 x EP2 compiled 15.9.

Modules, in the order the plan is built:

* :mod:`.layout`: layouts (`Layout`, `enumerate_layouts`), byte sizes (`Precision`) and the
  step's phases (`Phase`);
* :mod:`.params`: the parameter inventory and its per-GPU shards, gradients, optimizer states
  and FSDP working memory (`ParamMemory`);
* :mod:`.activations`: the compiled model's kept bytes per token (`layer_activations`,
  `model_activations`);
* :mod:`.eager`: eager activations measured on the CPU (`measure_eager_layer`, `eager_profiles`);
* :mod:`.step`: the step walk over the phases (`activation_memory`) and the per-layout plans
  (`plan_layout`, `plan_gpus`, `min_gpus`);
* :mod:`.cli`: the command line (`run_plan`, `main`).
"""

from titan_moe.plan.activations import Entry, LayerActivations, layer_activations, model_activations
from titan_moe.plan.cli import PlanOptions, main, parse_args, run_plan
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
    "AC_MODES", "ACTIVATION_MODELS", "CP_DEGREES", "GIB", "KDA_CHUNK", "MAX_SEARCH_GPUS",
    "OPTIMIZER_IMPLEMENTATIONS", "ActivationMemory", "EagerProfile", "Entry", "GpuKernelSaves",
    "LayerActivations", "Layout", "LayoutPlan", "ParamInventory", "ParamMemory", "Phase",
    "PlanOptions", "Precision", "_stream_bytes_per_token", "activation_memory",
    "autocast_weight_copies", "eager_profiles", "eager_saved_bytes", "enumerate_layouts",
    "expert_shard_numel", "fsdp_shard_numel", "gathered_numel", "inventory", "is_routed_expert",
    "layer_activations", "layer_policies", "main", "measure_eager_layer", "min_gpus",
    "model_activations", "param_memory", "parse_args", "plan_gpus", "plan_layout", "run_plan",
    "sharded_numel", "sharding_checks", "zero_layer",
]
