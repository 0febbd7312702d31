"""Training entry point: torchtitan's Trainer, made device-aware, with our train spec.

    torchrun --nproc_per_node=N -m titan_moe.train --job.config_file configs/NAME.toml [--section.key value ...]
    python -m titan_moe.train --job.config_file configs/debug_cpu.toml      # one process, no torchrun

What we change in torchtitan 0.2.2's Trainer, and why (everything else is theirs):
  * device: torchtitan decides "cuda" at import time even on a CPU-only torch; we rebind
    its device globals to CPU first (`runtime.device`) and pick gloo for the process group.
  * gloo has no PREMUL_SUM, which FSDP2 uses to pre-divide gradients; on CPU we make FSDP
    reduce with a plain sum (the trainer already scales the loss by the global token count).
  * RNG state joins the checkpointed train state, so a resumed run draws the same numbers.
  * one process: `training.one_device_mixed_precision = "fsdp"` wraps the model in FSDP2 on
    its device (`parallelize.apply_one_device_fsdp`) and turns autocast off, for the numerics
    of a run on several GPUs; "autocast" (default) keeps torchtitan's autocast.
  * a run started without torchrun gets the single-process rendezvous variables.
  * `[kernels]`: resolved for the device and made current before the model is built, logged
    in one line, written to metrics.jsonl and kept in the checkpoint's train state (a resume
    with other choices keeps the new run's and warns).
  * `[ladder]` stages (`titan_moe.ladder`, `titan_moe.stages.LadderRun`): per-stage rows,
    batch, data mix and LR; a checkpoint and evaluations at each stage's end.
  * context parallelism: each cp rank keeps its contiguous segment of every row
    (`post_dataloading_process`; the layers are made context-parallel by `parallelize`).
  * `--comm.mode fake_backend` (torchtitan's; `NGPU` = the world size to simulate): one
    process plays rank 0 of that layout on torch's fake process group, which moves no
    data. Shapes and memory are rank 0's; losses, gradient norms and balance metrics are
    meaningless (said in one start-up line); checkpoints are off (a save would hold rank
    0's shards only). Where collective outputs would decide host-side layouts or index
    tensors, the layers take every rank to hold this rank's data (`context_parallel`,
    `parallelize.LatentExpertParallel`).
  * `[profiling] nvtx`: NVTX ranges around the step, forward, backward and optimizer step
    (`ops.nvtx`), and a cudaProfilerStart/Stop window (`nvtx_start_step`/`nvtx_stop_step`)
    for `nsys --capture-range=cudaProfilerApi` (see profiling/nsys_launch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys

import torch

from titan_moe.runtime.device import accelerator_type, configure_torchtitan_device
from titan_moe.runtime.optional_packages import provide_datasets_placeholder

configure_torchtitan_device()
_DATASETS_PLACEHOLDER = provide_datasets_placeholder()  # torchtitan.train imports `datasets` at module level

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

from titan_moe import train_spec  # noqa: E402
from titan_moe.config import ConfigError, error_source, load_config, model_args_from_config  # noqa: E402
from titan_moe.context_parallel import check_context_parallel, shard_batch  # noqa: E402
from titan_moe.data.corpus import CorpusError  # noqa: E402
from titan_moe.hf import adapter as hf_adapter  # noqa: E402
from titan_moe.model.head import with_head_labels  # noqa: E402
from titan_moe.model.mla import resolve_attention  # noqa: E402
from titan_moe.model.moe import refresh_compute_weights, set_aux_loss_weight  # noqa: E402
from titan_moe.ops import choices, launch_env, nvtx  # noqa: E402
from titan_moe.parallelize import fsdp_on_one_device  # noqa: E402
from titan_moe.runtime import checkpoint as intact  # noqa: E402
from titan_moe.stages import LadderRun  # noqa: E402

# Test hook: SIGKILL this process while it writes the checkpoint of this step, after the
# data files and before the metadata that makes a checkpoint loadable.
KILL_DURING_SAVE_ENV = "TITAN_MOE_KILL_DURING_SAVE_STEP"
LOG_TRITON_COMPILES_ENV = "TITAN_MOE_LOG_TRITON_COMPILES"
KERNELS_STATE_KEY = "kernels"  # the train state's entry: the resolved `[kernels]` choices as JSON


def _set_single_process_env() -> None:
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def _use_plain_sum_for_gloo(model_parts) -> None:
    """FSDP2 reduces gradients with PREMUL_SUM when given a divide factor; gloo rejects it."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


FAKE_WORLD_SIZE_VAR = "NGPU"  # torchtitan's: the world size that `--comm.mode fake_backend` simulates


def _fake_world_size(config) -> int | None:
    """The simulated world size under `--comm.mode fake_backend` (torchtitan reads `NGPU`),
    None otherwise; a `ConfigError` for a missing or bad `NGPU` and for the "local_tensor"
    mode, which our trainer does not run."""
    mode = config.comm.mode
    if mode == "local_tensor":
        raise ConfigError("comm.mode = 'local_tensor' is not supported (use 'fake_backend' for one rank's "
                          "shapes and memory)")
    if mode != "fake_backend":
        return None
    value = os.environ.get(FAKE_WORLD_SIZE_VAR, "")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"comm.mode = 'fake_backend' needs {FAKE_WORLD_SIZE_VAR}=N in the environment, the number "
                          f"of ranks to simulate (got {value!r})")
    return int(value)


def _world_size(config) -> int:
    return _fake_world_size(config) or int(os.environ.get("WORLD_SIZE", "1"))


def _fit_local_batch_to_global(config) -> None:
    """Let one config give the same global batch on any number of data-parallel ranks.

    Training: when `local_batch_size x ranks` exceeds `training.global_batch_size`, the local
    batch shrinks to `global / ranks`. Validation has no global size in torchtitan; we read
    `validation.local_batch_size` as the eval batch over all ranks, split the same way.
    """
    p = config.parallelism
    non_dp = max(1, p.tensor_parallel_degree) * max(1, p.context_parallel_degree) * max(1, p.pipeline_parallel_degree)
    dp = max(1, _world_size(config) // non_dp)
    if dp == 1:
        return
    for key, section, global_batch in (
        ("training.global_batch_size", config.training, config.training.global_batch_size),
        ("validation.local_batch_size (the eval batch over all ranks)", config.validation,
         config.validation.local_batch_size),
    ):
        if global_batch > 0 and section.local_batch_size * dp > global_batch:
            if global_batch % dp:
                raise ConfigError(f"{key} = {global_batch} is not divisible by the {dp} data-parallel ranks")
            section.local_batch_size = global_batch // dp


class TitanTrainer(Trainer):
    def __init__(self, job_config):
        _check_capture_window(job_config.profiling)
        self._cuda_capturing = False
        if job_config.profiling.nvtx:
            nvtx.enable(True)
        train_spec.register()
        self.kernels = _activate_kernel_choices(job_config)
        if launch_env.read(LOG_TRITON_COMPILES_ENV) == "1":
            from titan_moe.ops.triton_runtime import log_jit_compiles

            log_jit_compiles(step_of=lambda: getattr(self, "step", None))
        super().__init__(job_config)
        self.checkpointer.__class__ = IntactCheckpointManager
        self.metrics_processor.log_kernels(self.kernels)
        if job_config.profiling.nvtx:
            # "forward" ends once the loss is computed, "backward" covers loss.backward().
            self.loss_fn = _loss_ends_forward_range(self.loss_fn)
            self.optimizers.step = nvtx.nvtx_wrap("optimizer")(self.optimizers.step)
        if self.device.type == "cpu":
            _use_plain_sum_for_gloo(self.model_parts)
        if fsdp_on_one_device(job_config, self.parallel_dims.world_size):
            # FSDP's parameter casts do the mixed precision, as in runs on several GPUs.
            self._without_autocast()
            logger.info("training.one_device_mixed_precision = 'fsdp': no autocast, FSDP casts the parameters "
                        f"to {job_config.training.mixed_precision_param}")
        elif job_config.training.mixed_precision_param == "float32":
            # torchtitan would wrap an unsharded fp32 run in autocast(float32), which CPU
            # autocast rejects with a warning; there is nothing to cast.
            self._without_autocast()
        if job_config.debug.seed is not None:
            _init_independent_of_layout(self.model_parts, self.model_args, job_config.debug.seed)
        if job_config.training.cache_compute_weights and isinstance(self.maybe_enable_amp, torch.autocast):
            self._cache_compute_weights(self.maybe_enable_amp.fast_dtype)
        kill_step = launch_env.read(KILL_DURING_SAVE_ENV)
        if kill_step:
            _install_kill_during_save(self, int(kill_step))
        # The context ladder, when [[ladder.stages]] are configured.
        self.ladder_run = LadderRun(self, job_config) if job_config.ladder.stages else None
        if self.ladder_run is not None:
            self.ladder_run.install()

    def _without_autocast(self) -> None:
        """No autocast around the forward, in training and in evaluation."""
        self.maybe_enable_amp = contextlib.nullcontext()
        if getattr(self, "validator", None) is not None:
            self.validator.maybe_enable_amp = self.maybe_enable_amp

    def _cache_compute_weights(self, dtype: torch.dtype) -> None:
        """After every optimizer step, the routed experts' weights cast to autocast's dtype
        (`[training] cache_compute_weights`), and once more before the first step
        (`_prime_compute_weight_cache`): compiled layers then see the cache from their first
        call, instead of compiling again when it appears after step 1."""
        reported = []

        def refresh(*_args, **_kwargs):
            cached = refresh_compute_weights(self.model_parts, dtype)
            if not reported:
                logger.info(f"training.cache_compute_weights: {cached} routed-expert modules cast to {dtype} "
                            "once per optimizer step")
                reported.append(True)

        self.optimizers.register_step_post_hook(refresh)
        self._unprimed_compute_weight_cache = refresh

    def _prime_compute_weight_cache(self) -> None:
        """Make the compute-weight cache before the first training forward: after any
        checkpoint load (the weights it copies), before the compiled layers first run."""
        refresh = getattr(self, "_unprimed_compute_weight_cache", None)
        if refresh is not None:
            self._unprimed_compute_weight_cache = None
            refresh()

    def train(self):
        # torchtitan's loop ends with a 2 s sleep on rank 0 "for other ranks to complete";
        # `main` holds every rank at a barrier after `close` instead, so the sleep would only
        # delay the end of every run.
        with _without_final_sleep():
            return super().train()

    def train_step(self, data_iterator):
        if self.ladder_run is not None:  # this step's stage: its rows, batch and data mix
            data_iterator = self.ladder_run.data_iterator(self.step, data_iterator)
        self.metrics_processor.start_progress(self.step - 1)
        self._prime_compute_weight_cache()
        self._cuda_profiler_window(before_step=True)
        self._set_aux_loss_weight()
        with nvtx.nvtx_range("train_step"):
            super().train_step(data_iterator)
        self._cuda_profiler_window(before_step=False)

    def _set_aux_loss_weight(self) -> None:
        """`model.balance_rule = "aux_loss"`: each forward's share of the step's objective,
        1 / (microbatches x ranks routing distinct tokens), as the loss's token normalisation
        gives the cross-entropy (`set_aux_loss_weight`); set again when a ladder stage changes
        the number of microbatches."""
        if getattr(self.model_args, "balance_rule", None) != "aux_loss":
            return
        pd = self.parallel_dims
        weight = 1.0 / (self.gradient_accumulation_steps * pd.dp_replicate * pd.dp_shard * pd.cp)
        if weight != getattr(self, "_aux_loss_weight", None):
            set_aux_loss_weight(self.model_parts, weight)
            self._aux_loss_weight = weight

    def post_dataloading_process(self, input_dict, labels):
        """torchtitan's, except under context parallelism: each cp rank keeps its contiguous
        segment of every row (`titan_moe.context_parallel`). The global token count that
        normalises the loss was taken on the whole rows before this; the tokens counted for
        the throughput metrics become this rank's own (summed over dp x cp when logged).
        With `model.head_chunk_tokens` the labels go to the model too (`with_head_labels`)."""
        if not self.parallel_dims.cp_enabled:
            inputs, labels, extra_inputs, extra_kwargs = super().post_dataloading_process(input_dict, labels)
            return inputs, labels, with_head_labels(self.model_args, extra_inputs, labels), extra_kwargs
        n_row_tokens = labels.numel()
        input_dict, labels = shard_batch(input_dict, labels, self.parallel_dims.get_mesh("cp").get_group())
        self.ntokens_seen -= n_row_tokens - labels.numel()
        self.metrics_processor.ntokens_since_last_log -= n_row_tokens - labels.numel()
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return input_dict["input"], labels, with_head_labels(self.model_args, extra_inputs, labels), {}

    def forward_backward_step(self, **kwargs):
        if not nvtx.is_enabled():
            return super().forward_backward_step(**kwargs)
        nvtx.push("forward")  # the wrapped loss function switches it to "backward"
        try:
            return super().forward_backward_step(**kwargs)
        finally:
            nvtx.pop()

    def _cuda_profiler_window(self, before_step: bool) -> None:
        """cudaProfilerStart before step `nvtx_start_step`, cudaProfilerStop after `nvtx_stop_step`."""
        start, stop = self.job_config.profiling.nvtx_start_step, self.job_config.profiling.nvtx_stop_step
        if self.device.type != "cuda" or start <= 0:
            return
        if before_step and not self._cuda_capturing and start <= self.step and (stop == 0 or self.step <= stop):
            logger.info(f"cudaProfilerStart before step {self.step}")
            torch.cuda.profiler.start()
            self._cuda_capturing = True
        elif not before_step and self._cuda_capturing and self.step == stop:
            self._stop_cuda_profiler()

    def _stop_cuda_profiler(self) -> None:
        torch.cuda.synchronize()  # let the last step's kernels land inside the capture
        torch.cuda.profiler.stop()
        self._cuda_capturing = False
        logger.info(f"cudaProfilerStop after step {self.step}")

    def close(self) -> None:
        if self._cuda_capturing:
            self._stop_cuda_profiler()
        super().close()
        if self.job_config.profiling.nvtx:
            nvtx.enable(False)

    def should_continue_training(self) -> bool:
        if self.ladder_run is not None:  # a stage's end: its checkpoint and evaluations
            self.ladder_run.after_step(self.step)
        exit_at = self.job_config.training.exit_at_step
        if 0 < exit_at <= self.step < self.job_config.training.steps:
            saved = self.ladder_run is not None and self.ladder_run.saved_step == self.step
            if self.checkpointer.enable and self.step % self.checkpointer.interval and not saved:
                # The regular save after this step only fires on the interval; force one
                # (not again where a ladder stage's end already saved this step).
                interval, self.checkpointer.interval = self.checkpointer.interval, 1
                try:
                    self.checkpointer.save(self.step)
                finally:
                    self.checkpointer.interval = interval
            logger.info(f"training.exit_at_step = {exit_at}: stopping after step {self.step}")
            return False
        return super().should_continue_training()

    def state_dict(self):
        state = super().state_dict()
        state["rng_cpu"] = torch.get_rng_state()
        state[KERNELS_STATE_KEY] = json.dumps(self.kernels, sort_keys=True)
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.metrics_processor.resumed_at(self.step)
        if self.step >= self.job_config.training.steps:
            logger.warning(f"the checkpoint of step {self.step} already reached training.steps = "
                           f"{self.job_config.training.steps}: nothing to train (raise --training.steps, or "
                           "start afresh with another --job.dump_folder)")
        _compare_kernel_choices(state_dict.get(KERNELS_STATE_KEY), self.kernels)
        if "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


class IntactCheckpointManager(CheckpointManager):
    """torchtitan's checkpointer that writes a manifest after each save and resumes from the
    newest intact checkpoint (`titan_moe.runtime.checkpoint`)."""

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):
        result = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return result
        if to_hf:
            hf_adapter.finish_save(checkpoint_id, self.sd_adapter.model_args)  # config.json, index
            return result
        if async_mode == AsyncMode.DISABLED:
            intact.write_manifest(checkpoint_id)
        else:
            future = getattr(result, "upload_completion", result)
            future.add_done_callback(lambda f: f.exception() is None and intact.write_manifest(checkpoint_id))
        return result

    def _find_load_step(self, folder: str = "") -> int:
        if folder:  # torchft's per-replica folder: torchtitan's rule
            return super()._find_load_step(folder)
        step = intact.newest_intact_step(self.folder, logger.warning)
        if step == -1 and intact.saved_steps(self.folder):
            raise ConfigError(f"every checkpoint in {self.folder} is damaged; move them away to start afresh "
                              "(nothing was deleted)")
        return step

    def load(self, step: int = -1) -> bool:
        if step != -1 and self.enable and os.path.isdir(self.folder):
            checkpoint = self._create_checkpoint_id(step)
            try:
                intact.check_loadable(checkpoint)
            except ValueError as e:
                raise ConfigError(f"checkpoint.load_step = {step}: {e}") from None
        return super().load(step)


def _activate_kernel_choices(job_config) -> dict[str, object]:
    """`[kernels]` resolved for this process's device and made current, before the model is
    built, with the MLA attention path the model resolves on this device (`model.mla_attention`),
    the model's other path choices (`balance_rule`, with `qb_batch_iters` for QB (its form: lag or
    in-batch) and `aux_loss_coef` for the auxiliary loss, `expert_activation`, `kda_gate`: an
    unbounded gate resolves `kernels.kda` to torch, `moe_token_tile`, `head_chunk_tokens`), in a
    one-rank run `training.one_device_mixed_precision` and, with the fp8 experts converter, its
    recipe (`[quantize.grouped_mm.float8]`); logged in
    one line and returned as the run's record of its choices. A ValueError naming the key for a
    value the device or the model cannot run."""
    device_type = accelerator_type()
    args = model_args_from_config(job_config)
    # Other train specs' model args (e.g. profiling's peer) define only some of these choices.
    model_choices = {key: getattr(args, key) for key in ("balance_rule", "expert_activation", "kda_gate",
                                                         "moe_token_tile", "head_chunk_tokens") if hasattr(args, key)}
    resolved = choices.resolve(job_config.kernels, device_type,
                               kda_gate_bounded=model_choices.get("kda_gate", "bounded") == "bounded")
    choices.activate(resolved)
    record: dict[str, object] = dict(dataclasses.asdict(resolved))
    record["mla_attention"] = resolve_attention(args.mla_attention, torch.device(device_type),
                                                job_config.training.mixed_precision_param)
    record.update(model_choices)
    if model_choices.get("balance_rule") == "aux_loss":
        record["aux_loss_coef"] = args.aux_loss_coef
    if model_choices.get("balance_rule") == "qb" and hasattr(args, "qb_batch_iters"):
        record["qb_batch_iters"] = args.qb_batch_iters
    if _world_size(job_config) == 1:  # FSDP or autocast (several ranks: FSDP or DDP)
        record["one_device_mixed_precision"] = job_config.training.one_device_mixed_precision
    line = choices.summary(resolved) + "".join(
        f" {key}={record[key]}" for key in ("mla_attention", "balance_rule", "qb_batch_iters", "aux_loss_coef",
                                           "expert_activation", "kda_gate", "moe_token_tile", "head_chunk_tokens",
                                           "one_device_mixed_precision")
        if key in record)
    if "titan_float8_experts" in (job_config.model.converters or []):
        recipe = dataclasses.asdict(job_config.quantize.grouped_mm.float8)
        record["float8_experts"] = recipe
        line += " float8_experts=" + ",".join(f"{k}:{v}" for k, v in recipe.items())
    logger.info(line)
    return record


def _compare_kernel_choices(saved: str | None, current: dict[str, object]) -> None:
    """On resume: warn, key by key, where the checkpoint's resolved `[kernels]` choices differ
    from this run's (this run's stay in force)."""
    if not saved:
        return
    before, now = json.loads(saved), current
    # a key the checkpoint's run did not record (an older run) is not compared
    changed = [f"{key}: {before.get(key)!r} -> {now.get(key)!r}" for key in sorted(set(before) | set(now))
               if key in before and before.get(key) != now.get(key)]
    if changed:
        logger.warning("kernels differ from the checkpoint's run (this run's choices apply): " + ", ".join(changed))


def _check_capture_window(profiling) -> None:
    start, stop = profiling.nvtx_start_step, profiling.nvtx_stop_step
    if start < 0 or stop < 0 or (stop > 0 and not 0 < start <= stop):
        raise ValueError(
            f"profiling.nvtx_start_step = {start}, nvtx_stop_step = {stop}: need 1 <= start <= stop, "
            "stop = 0 (capture to the end) or both 0 (no capture window)"
        )


@contextlib.contextmanager
def _without_final_sleep():
    """`torchtitan.train`'s `time` module, with a `sleep` that returns at once (the only
    sleep there is the one after the last step), for the duration of the block."""
    import time

    import torchtitan.train as titan_train

    class _TimeWithoutSleep:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(_seconds: float) -> None:
            return None

    titan_train.time = _TimeWithoutSleep()
    try:
        yield
    finally:
        titan_train.time = time


def _loss_ends_forward_range(loss_fn):
    """Wrap the training loss: once it is computed, close the "forward" NVTX range and open
    "backward" (closed by `TitanTrainer.forward_backward_step` after `loss.backward()`)."""

    def loss_then_backward(pred, labels):
        loss = loss_fn(pred, labels)
        if nvtx.innermost() == "forward":
            nvtx.pop()
            nvtx.push("backward")
        return loss

    return loss_then_backward


def _init_independent_of_layout(model_parts, model_args, seed: int) -> None:
    """Give every layout (1 process, FSDP over N, ...) the same initial weights.

    torchtitan initialises each rank's shard with that rank's random stream, so the weights
    depend on the layout. With `debug.seed` set we instead initialise the full model on the
    CPU from the seed, on every rank alike, and load it into the (possibly sharded) model.
    This costs one full CPU copy of the model: meant for debugging and parity checks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from titan_moe.model.decoder import Decoder

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("cpu"):
            full = Decoder(model_args)
        full.init_weights()
    (model,) = model_parts
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
    logger.info(f"Initialised weights on CPU from debug.seed = {seed} (identical across layouts)")


def _install_kill_during_save(trainer: TitanTrainer, step: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    original_finish = FileSystemWriter.finish

    def finish(self, metadata, results):
        if trainer.step == step:
            logger.warning(f"{KILL_DURING_SAVE_ENV}: killing the process during the save of step {step}")
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original_finish(self, metadata, results)

    FileSystemWriter.finish = finish


def _reconcile(config, device_type: str) -> list[str]:
    """Settings adjusted before the trainer is built, each with the warning that says so."""
    notes = []
    training, warmup = config.training, config.lr_scheduler.warmup_steps
    if device_type == "cpu" and training.mixed_precision_param == "bfloat16":
        # FSDP's bf16 compute is very slow on CPUs and gains nothing there.
        training.mixed_precision_param = "float32"
        notes.append("training.mixed_precision_param = 'bfloat16' on the CPU: training in float32 "
                     "(bf16 matmuls are slow on CPUs); set it to 'float32' to silence this")
    if config.comm.mode == "fake_backend" and config.checkpoint.enable:
        config.checkpoint.enable = False
        notes.append("checkpoint.enable with comm.mode = 'fake_backend': checkpoints off (a save would hold "
                     "rank 0's shards only); pass --checkpoint.no_enable to silence this")
    if warmup > training.steps:
        # torchtitan's schedule caps the warm-up at the run's length; say so, and log the value used
        config.lr_scheduler.warmup_steps = training.steps
        notes.append(f"lr_scheduler.warmup_steps = {warmup} exceeds training.steps = {training.steps}: "
                     f"warming up over {training.steps} steps")
    return notes


def _outputs_line(config) -> str:
    """One start-up line: where this run writes what."""
    dump = config.job.dump_folder
    ckpt = config.checkpoint
    parts = [f"metrics {os.path.join(dump, 'metrics.jsonl')}"]
    if ckpt.enable:
        where = os.path.join(dump, ckpt.folder)
        parts.append(f"checkpoints {where}/step-N (every {ckpt.interval} steps and at the end)")
    else:
        parts.append("checkpoints off (--checkpoint.enable)")
    if config.metrics.enable_tensorboard:
        parts.append(f"TensorBoard {os.path.join(dump, config.metrics.save_tb_folder)}")
    if config.profiling.enable_profiling:
        parts.append(f"profiler traces {os.path.join(dump, config.profiling.save_traces_folder)}")
    return "outputs: " + ", ".join(parts)


def _fake_backend_line(config) -> str:
    """One start-up line for `--comm.mode fake_backend`."""
    return (f"comm.mode = 'fake_backend': this process plays rank 0 of {_fake_world_size(config)} ranks on torch's "
            "fake process group, which moves no data: losses, gradient norms and balance metrics are meaningless; "
            "tensor shapes and memory are rank 0's")


def _quiet_other_ranks(config) -> None:
    """Under torchrun only rank 0 logs info lines (warnings and errors come from every rank),
    unless `metrics.log_all_ranks`."""
    if int(os.environ.get("RANK", "0")) != 0 and not config.metrics.log_all_ranks:
        logger.setLevel(logging.WARNING)


def _user_error(message: str) -> None:
    print(f"titan_moe.train: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    init_logger()
    try:
        config = load_config(argv)
        if "RANK" not in os.environ:
            _set_single_process_env()
        _fake_world_size(config)
        _fit_local_batch_to_global(config)
        check_context_parallel(config)
    except ConfigError as e:
        _user_error(str(e))
    _quiet_other_ranks(config)
    if _DATASETS_PLACEHOLDER:
        logger.info("the `datasets` package is not installed: the built-in and text corpora work, "
                    "Hugging Face datasets do not")
    if config.comm.mode == "fake_backend":
        logger.warning(_fake_backend_line(config))
    for note in _reconcile(config, accelerator_type()):
        logger.warning(note)
    logger.info(_outputs_line(config))
    trainer = None
    normal_end = False
    try:
        try:
            trainer = TitanTrainer(config)
        except (FileNotFoundError, ValueError) as e:
            # bad data path, tokenizer or model settings found while building: one line, exit 2
            _user_error(f"{error_source(config, str(e))}: {e}")
        try:
            if config.checkpoint.create_seed_checkpoint:
                trainer.checkpointer.save(curr_step=0, last_step=True)
                logger.info("Created seed checkpoint")
            else:
                trainer.train()
        except (ConfigError, CorpusError) as e:  # a damaged checkpoint or corpus met while training
            _user_error(str(e))
        normal_end = True
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            if normal_end and torch.distributed.get_world_size() > 1:
                # Every rank done, its trainer closed too (checkpoint and metrics threads),
                # before any tears its process group down: torchtitan's rank 0 sleeps 2 s
                # after the last step while the others go on, and a gloo rank whose peer had
                # already destroyed the group sometimes aborted ("terminate called without
                # an active exception"), also with this barrier before `close`. Only after a
                # normal end: after a failure a peer may never arrive.
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
