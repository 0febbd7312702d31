"""Apply parallelism, activation checkpointing and compile to the decoder, from outside.

The torchtitan way: the model is built on the meta device, then wrapped here, then
materialised. We reuse torchtitan 0.2.2's llama3 helpers, which fit our module tree
(`tok_embeddings`, `layers` as a ModuleDict of blocks, `norm`, `output`):
  - activation checkpointing per block (`apply_ac`, full or selective),
  - regional compile, one `torch.compile(fullgraph=True)` per block (`apply_compile`),
  - FSDP2 per block plus the root (`apply_fsdp`; HSDP via the replicate degree), with
    FSDP's own gradient division off because the trainer scales by the global token count.
Tensor, pipeline, context and expert parallelism are not wired yet: asking for them
stops with an error instead of silently training unsharded.
"""

from __future__ import annotations

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile, apply_ddp, apply_fsdp
from torchtitan.tools.logging import logger


def _check_supported(parallel_dims: ParallelDims) -> None:
    unsupported = {
        "tensor_parallel_degree": parallel_dims.tp,
        "pipeline_parallel_degree": parallel_dims.pp,
        "context_parallel_degree": parallel_dims.cp,
        "expert_parallel_degree": parallel_dims.ep,
    }
    for name, degree in unsupported.items():
        if degree > 1:
            raise ValueError(f"parallelism.{name} = {degree} is not supported yet (only FSDP/HSDP/DDP)")


def parallelize_decoder(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    _check_supported(parallel_dims)
    compile_enabled = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_enabled,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_enabled:
        apply_compile(model, job_config.compile)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=False,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_enabled)
    return model
