"""Apply parallelism, activation checkpointing and compile to the decoder, from outside.

The torchtitan way: the model is built on the meta device, then wrapped here, then
materialised. In order (as torchtitan's DeepSeek-V3 does it):

1. expert parallelism (`parallelism.expert_parallel_degree` > 1): the routed experts of
   every MoE layer are sharded on the expert dim over the "ep" mesh by
   :class:`LatentExpertParallel`, whose hooks exchange the token copies by all-to-all;
   context parallelism (`parallelism.context_parallel_degree` > 1): the KDA and MLA layers
   become their context-parallel forms over the "cp" mesh
   (`titan_moe.context_parallel.apply_context_parallel`); the trainer gives each cp rank
   its contiguous segment of every row;
2. activation checkpointing per block (torchtitan's `apply_ac`, full or selective);
3. regional compile (:func:`apply_compile`): one `torch.compile(fullgraph=True)` region per
   block, except around expert-parallel experts and, under context parallelism, around
   every block's attention, which runs eagerly (see there);
4. FSDP2 (:func:`apply_fsdp`): per block plus the root, HSDP via the replicate degree; with
   EP the routed experts get their own FSDP unit over the "efsdp" mesh (the data-parallel
   ranks left once EP has taken its share), FSDP's own gradient division is off because
   the trainer scales by the global token count. DDP when only replicating. On one device,
   FSDP2 over a one-rank mesh when `training.one_device_mixed_precision = "fsdp"`
   (:func:`apply_one_device_fsdp`: its mixed precision instead of autocast).

The meshes are torchtitan 0.2.2's (`ParallelDims`): the dense parameters are sharded over
"fsdp" (every data-parallel rank); EP borrows its ranks from "fsdp", so "ep" x "efsdp" =
"fsdp" for the experts. Every rank still reads its own tokens ("batch" mesh; its cp ranks hold segments of the
same rows), which is why the expert-balance counts are summed over "loss" (= "batch" x
"cp", every rank routing distinct tokens; `train_spec`). FSDP's "fsdp" dim spans dp x cp,
so gradients are summed over the cp ranks too. Tensor and pipeline parallelism are not
wired: asking for them stops with an error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_ddp, disable_fsdp_gradient_division
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from titan_moe.context_parallel import apply_context_parallel, check_context_parallel
from titan_moe.model.attn_res import sources_before_layer
from titan_moe.model.moe import LatentMoE, RoutedExperts


def _check_supported(parallel_dims: ParallelDims, job_config) -> None:
    unsupported = {
        "tensor_parallel_degree": parallel_dims.tp,
        "pipeline_parallel_degree": parallel_dims.pp,
        "expert_tensor_parallel_degree": parallel_dims.etp,
    }
    for name, degree in unsupported.items():
        if degree > 1:
            raise ValueError(f"parallelism.{name} = {degree} is not supported yet (only FSDP/HSDP/DDP, CP and EP)")
    check_context_parallel(job_config)
    if not parallel_dims.ep_enabled:
        return
    backend = job_config.parallelism.expert_parallel_comm_backend
    if backend != "standard":
        raise ValueError(f"parallelism.expert_parallel_comm_backend = {backend!r} is not supported (use 'standard')")
    ac = job_config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        # The experts' own FSDP unit sits inside the checkpointed layer and runs a different
        # number of profiler/all-gather ops in the recompute than in the forward, which
        # op-level SAC replays by count (torchtitan issue 3427; open in torch <= 2.13).
        raise ValueError(
            "activation_checkpoint.selective_ac_option = 'op' does not work with expert parallelism yet; "
            "use mode = 'full' or a layer-wise selective option"
        )


# =========================================================================== expert parallelism
class LatentExpertParallel(ParallelStyle):
    """Expert parallelism for :class:`RoutedExperts` over a 1-D EP mesh of ``P`` ranks.

    Partition: ``w_gate_up`` and ``w_down`` become DTensors ``Shard(0)``; rank ``r`` holds
    experts ``[r*E/P, (r+1)*E/P)``.

    Dispatch (forward pre-hook on the experts), from ``(x_ML, offs_E)``, this rank's token
    copies sorted by global expert with ``E`` cumulative ends:

    1. all-to-all of the per-expert counts, so each rank learns how many rows every other
       rank sends to each of its local experts; one host sync for the split sizes;
    2. all-to-all (autograd) of the rows, variable splits: the rows for experts of rank
       ``r`` are one contiguous block of ``x_ML`` because it is sorted by expert;
    3. the received rows come grouped (source rank, local expert); a stable sort regroups
       them (local expert, source rank) for the grouped GEMM, with ``E/P`` local offsets.

    Combine (forward hook) undoes 3 by a gather with the inverse permutation and 2 by the
    reverse all-to-all, so :class:`LatentMoE` gets its own rows back in its own order.

    One instance per experts module: the split sizes and the permutation are kept between
    the two hooks of one forward (an activation-checkpoint recompute redoes both).

    On torch's fake backend (`--comm.mode fake_backend`: one process plays one rank, no
    collective moves data) the counts of step 1 are not exchanged: every rank is taken to
    route as this one, so rank ``r`` sends local expert ``j`` what this rank sends it. The
    counts become host-side split sizes, which the fake group's output (unspecified,
    uninitialised on some torch versions) must not decide; the rows' values are meaningless
    either way. When this rank's experts then receive no rows while it sends some, the fake
    group refuses the reverse all-to-all of an empty input: combine gives zeros instead.
    """

    def __init__(self):
        super().__init__()
        self._fake_backend = False
        self._send_splits: list[int] | None = None
        self._recv_splits: list[int] | None = None
        self._order_R: Tensor | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, RoutedExperts):
            raise ValueError(f"LatentExpertParallel applies to RoutedExperts, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(f"LatentExpertParallel needs a 1-D mesh, got {device_mesh.ndim}-D")
        if module.n_experts % device_mesh.size():
            raise ValueError(
                f"n_routed_experts = {module.n_experts} is not divisible by expert_parallel_degree = "
                f"{device_mesh.size()}"
            )
        module.expert_parallel = True  # LatentMoE then sends packed groups (the exchange regroups them)
        self._fake_backend = dist.get_backend(device_mesh.get_group()) == "fake"
        return distribute_module(
            module, device_mesh, partition_fn=self._partition, input_fn=self._dispatch, output_fn=self._combine
        )

    @staticmethod
    def _partition(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            module.register_parameter(param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)])))

    def _dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], device_mesh: DeviceMesh):
        x_ML, offs_E = inputs
        ranks, group = device_mesh.size(), device_mesh.get_group()
        n_local = offs_E.shape[0] // ranks
        with torch.no_grad():
            counts_E = torch.diff(offs_E.to(torch.int64), prepend=offs_E.new_zeros(1, dtype=torch.int64))
            # recv_RE[r, j]: rows that rank r sends to this rank's local expert j.
            if self._fake_backend:
                recv_RE = counts_E.view(ranks, n_local)[dist.get_rank(group)].expand(ranks, n_local)
            else:
                recv_RE = funcol.wait_tensor(funcol.all_to_all_single(counts_E, None, None, group)).view(ranks, n_local)
            splits = torch.stack([counts_E.view(ranks, n_local).sum(1), recv_RE.sum(1)]).tolist()  # host sync
            self._send_splits, self._recv_splits = splits
            n_recv = sum(self._recv_splits)
            # Regroup (source rank, local expert) -> (local expert, source rank), stably.
            segment_R = torch.repeat_interleave(
                torch.arange(ranks * n_local, device=x_ML.device), recv_RE.reshape(-1), output_size=n_recv
            )
            self._order_R = torch.argsort((segment_R % n_local) * ranks + segment_R // n_local, stable=True)
            offs_local = torch.cumsum(recv_RE.sum(0), 0).to(torch.int32)
        x_recv_RL = funcol.all_to_all_single_autograd(x_ML, self._recv_splits, self._send_splits, group)
        return x_recv_RL[self._order_R], offs_local

    def _combine(self, module: nn.Module, out_RL: Tensor, device_mesh: DeviceMesh) -> Tensor:
        order_R = self._order_R
        if self._fake_backend and out_RL.shape[0] == 0:
            self._order_R = None
            return out_RL.new_zeros(sum(self._send_splits), *out_RL.shape[1:])
        inverse_R = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(order_R.numel(), device=order_R.device))
        out_ML = funcol.all_to_all_single_autograd(
            out_RL[inverse_R], self._send_splits, self._recv_splits, device_mesh.get_group()
        )
        self._order_R = None
        return out_ML


def _moe_layers(model: nn.Module) -> list[tuple[nn.Module, LatentMoE]]:
    """(layer as registered in `model.layers`, its LatentMoE) for every MoE layer."""
    out = []
    for layer in model.layers.values():
        moe = [m for m in layer.modules() if isinstance(m, LatentMoE)]
        if moe:
            out.append((layer, moe[0]))
    return out


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the routed experts of every MoE layer over ``ep_mesh`` (one style per layer)."""
    for _, moe in _moe_layers(model):
        parallelize_module(moe.experts, ep_mesh, LatentExpertParallel())
    logger.info(f"Applied expert parallelism over {ep_mesh.size()} ranks to the routed experts")


# =========================================================================== compile
def compile_backend(compile_config):
    """`[compile] backend`, wrapped with our FX passes when `[compile] passes` names any.

    Built once per model: one backend object for every region, so that the layers' shared
    `forward` code is not recompiled once per distinct backend.
    """
    passes = tuple(getattr(compile_config, "passes", ()) or ())
    if not passes:
        return compile_config.backend
    from titan_moe import compile_passes

    return compile_passes.make_backend(compile_config.backend, passes)


REGION_RECOMPILE_LIMIT = 64


def layer_graph_variants(args) -> int:
    """Distinct decoder-layer graphs in one training forward: (attention kind, MoE or dense
    FFN, AttnRes source count) over the layers."""
    kinds = args.layer_kinds()
    return len({
        (kinds[i], args.is_moe_layer(i), sources_before_layer(args.attn_res, i, args.attn_res_block_size))
        for i in range(args.n_layers)
    })


def apply_compile(model: nn.Module, compile_config, ep_enabled: bool, cp_enabled: bool = False) -> None:
    """Regional compile: each layer is one `torch.compile(fullgraph=True)` region.

    Under EP, a MoE layer's experts call holds the all-to-all (with its host sync) and the
    experts' own FSDP hooks, which a fullgraph region cannot contain. Such a layer is
    compiled piecewise instead, as torchtitan does for DeepSeek-V3: each child module
    (mixers, norms, attention) is a region, and the MoE's :meth:`LatentMoE.route_and_sort`
    and :meth:`LatentMoE.combine` are two more; the experts and their exchange run eagerly.
    `[compile] moe_regions = "piecewise"` compiles MoE layers that way without EP too (for
    measuring the whole-layer region's gain). `[compile] passes` run inside every region
    (:func:`compile_backend`).

    Under CP every layer is compiled piecewise: its context-parallel attention
    (`titan_moe.context_parallel`) reads the batch's document layout, Python facts that a
    compiled region would guard on and recompile for at every new batch, and runs the
    cross-rank collectives. The attention module itself runs eagerly; only its
    `compile_regions` methods (the projections before the first collective, the
    convolution after KDA's halo, the output projections) are regions, so every collective
    and every layout read sits between regions. The other children are regions as above
    (the whole MoE without EP, its two pieces with EP). The layer stays the module that
    activation checkpointing wrapped: a recompute runs the same regions and eager code.
    """
    backend = compile_backend(compile_config)
    # Every layer region runs one code object (DecoderLayer.forward, or each child's forward),
    # so Dynamo's recompile limit per code object (8) is shared by all variants: layer kinds
    # (KDA / MLA / dense mixers, MoE / dense FFN) x training and evaluation (no grad) x each
    # new sequence length until it turns dynamic (ladder stages, evaluation lengths) x the
    # AttnRes source count (one per block: `titan_moe.model.attn_res`). Each layer graph may
    # come as training and evaluation, each static and then dynamic in the length: 4 entries,
    # doubled for margin. Under fullgraph=True reaching the limit stops the run.
    torch._dynamo.config.recompile_limit = max(
        torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT, 8 * layer_graph_variants(model.args)
    )
    moe_pieces = ep_enabled or getattr(compile_config, "moe_regions", "auto") == "piecewise"
    regions: dict[str, None] = {}  # ordered set of region names, for the start-up line

    def compile_methods(module: nn.Module, label: str, methods) -> None:
        for method in methods:
            setattr(module, method, torch.compile(getattr(module, method), backend=backend, fullgraph=True))
            regions[f"{label}.{method}"] = None

    for name, layer in model.layers.named_children():
        block = layer._checkpoint_wrapped_module if isinstance(layer, CheckpointWrapper) else layer
        if not (cp_enabled or (moe_pieces and getattr(block, "is_moe", False))):
            model.layers.register_module(name, torch.compile(layer, backend=backend, fullgraph=True))
            continue
        for child_name, child in block.named_children():
            if isinstance(child, LatentMoE) and moe_pieces:
                compile_methods(child, "moe", ("route_and_sort", "combine"))
            elif hasattr(child, "compile_regions"):  # a context-parallel attention
                compile_methods(child, block.kind, child.compile_regions)
            else:
                block.register_module(child_name, torch.compile(child, backend=backend, fullgraph=True))
                regions[child_name] = None
    passes = f" with passes {list(compile_config.passes)}" if getattr(compile_config, "passes", None) else ""
    if cp_enabled:
        logger.info(f"Compiled each layer piecewise under context parallelism{passes}: regions "
                    f"{', '.join(regions)}; the context-parallel attention runs eagerly between them (KDA's halo "
                    "and state all-gathers and state scan, MLA's latent all-gather, headtail exchange and latent "
                    "attention, the batch's document layouts)"
                    + ("; the routed experts and their exchange run eagerly" if moe_pieces else ""))
        return
    logger.info("Compiled each layer with torch.compile" + passes
                + (" (MoE layers piecewise around the experts)" if moe_pieces else ""))


# =========================================================================== FSDP
def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    edp_mesh: DeviceMesh | None = None,
    ep_degree: int = 1,
) -> None:
    """FSDP2 per layer, [norm, output] together, and the root, over ``dp_mesh``.

    With ``edp_mesh`` (EP on), each MoE layer's routed experts are one more FSDP unit over
    ``edp_mesh``, sharding the expert-parallel DTensors further: on dim 0 while
    ``efsdp x ep <= E`` (each rank keeps whole experts), else on dim 1. Explicit
    prefetching then replaces FSDP's implicit one, which the EP host sync would stall.
    """
    fsdp_config: dict = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype, reduce_dtype)}
    if cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()
    if reshard_after_forward_policy not in ("default", "always", "never"):
        raise ValueError(f"invalid fsdp_reshard_after_forward policy {reshard_after_forward_policy!r}")
    reshard = reshard_after_forward_policy != "never"  # "default" without PP means resharding

    fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard)
    experts_of: dict[nn.Module, nn.Module] = {}
    if edp_mesh is not None:
        for layer, moe in _moe_layers(model):
            placement_fn = None
            if edp_mesh.size(-1) * ep_degree > moe.n_experts:
                placement_fn = lambda param: Shard(1)  # noqa: E731
            experts_config = {**fsdp_config, "mesh": edp_mesh}
            fully_shard(moe.experts, **experts_config, reshard_after_forward=reshard, shard_placement_fn=placement_fn)
            experts_of[layer] = moe.experts
    for layer in model.layers.values():
        fully_shard(layer, **fsdp_config, reshard_after_forward=reshard)
    # The head is gathered right after the last layer anyway: keep it unsharded unless asked.
    fully_shard([model.norm, model.output], **fsdp_config,
                reshard_after_forward=reshard_after_forward_policy == "always")
    fully_shard(model, **fsdp_config)
    disable_fsdp_gradient_division(model)
    if edp_mesh is None:
        return

    layers = list(model.layers.values())

    def with_experts(layer):
        return [layer, experts_of[layer]] if layer in experts_of else [layer]

    model.tok_embeddings.set_modules_to_forward_prefetch(with_experts(layers[0]))
    for layer, nxt in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch(with_experts(nxt))
    layers[-1].set_modules_to_forward_prefetch([model.norm, model.output])
    model.output.set_modules_to_backward_prefetch(with_experts(layers[-1]))
    for layer, prev in zip(layers[::-1], layers[-2::-1]):
        layer.set_modules_to_backward_prefetch(with_experts(prev))
    layers[0].set_modules_to_backward_prefetch([model.tok_embeddings])


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 gathered for forwards without a backward (evaluations): a
    module that keeps them after its forward (the root, by FSDP2's default) would otherwise
    stay unsharded, holding its whole parameters, and a checkpoint saved then (the one
    `training.exit_at_step` forces) reads parameters the optimizer does not hold."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


# =========================================================================== one device
def fsdp_on_one_device(job_config, world_size: int) -> bool:
    """Whether this run wraps the model in FSDP2 on its one device for the numerics of a run
    on several GPUs (`training.one_device_mixed_precision = "fsdp"` and one rank)."""
    return world_size == 1 and job_config.training.one_device_mixed_precision == "fsdp"


def apply_one_device_fsdp(model: nn.Module, job_config) -> None:
    """:func:`apply_fsdp` over a one-rank "fsdp" mesh: FSDP2's mixed precision without the
    sharding (parameters cast to `mixed_precision_param` when each unit is gathered, fp32
    master weights, gradients reduced in `mixed_precision_reduce`). With one rank FSDP2 copies
    instead of communicating; the trainer turns autocast off (`TitanTrainer`)."""
    training = job_config.training
    mesh = init_device_mesh(titan_utils.device_type, (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(
        model,
        mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
    )
    logger.info(f"Applied FSDP on one device (training.one_device_mixed_precision = 'fsdp'): parameters in "
                f"{training.mixed_precision_param} for compute, gradients reduced in "
                f"{training.mixed_precision_reduce}, no autocast")


# =========================================================================== entry point
def parallelize_decoder(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    _check_supported(parallel_dims, job_config)
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.cp_enabled:
        balance = job_config.parallelism.context_parallel_load_balancer
        apply_context_parallel(model, parallel_dims.get_mesh("cp").get_group(), balance)
        seq_len, cp = job_config.training.seq_len, parallel_dims.cp
        queries = ("an early and a late half-segment of queries per rank" if balance == "headtail"
                   else "each rank its own queries")
        logger.info(f"Applied context parallelism over {cp} ranks: each row's {seq_len} tokens in contiguous "
                    f"segments of {seq_len // cp} (KDA: state scan across ranks and conv halo; MLA: latent "
                    f"all-gather, {queries}: context_parallel_load_balancer = {balance!r})")
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
        apply_compile(model, job_config.compile, parallel_dims.ep_enabled, parallel_dims.cp_enabled)
    if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:
        replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
        edp_mesh = parallel_dims.get_mesh([*replicate, "efsdp"]) if parallel_dims.ep_enabled else None
        apply_fsdp(
            model,
            parallel_dims.get_mesh([*replicate, "fsdp"]),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            edp_mesh=edp_mesh,
            ep_degree=parallel_dims.ep,
        )
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP")
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_enabled)
    elif fsdp_on_one_device(job_config, parallel_dims.world_size):
        apply_one_device_fsdp(model, job_config)
    return model
