"""Training entry point: torchtitan's Trainer, made device-aware, with our train spec.

    torchrun --nproc_per_node=N -m titan_moe.train --job.config_file configs/NAME.toml [--section.key value ...]
    python -m titan_moe.train --job.config_file configs/debug_cpu.toml      # one process, no torchrun

What we change in torchtitan 0.2.2's Trainer, and why (everything else is theirs):
  * device: torchtitan decides "cuda" at import time even on a CPU-only torch; we rebind
    its device globals to CPU first (`runtime.device`) and pick gloo for the process group.
  * gloo has no PREMUL_SUM, which FSDP2 uses to pre-divide gradients; on CPU we make FSDP
    reduce with a plain sum (the trainer already scales the loss by the global token count).
  * RNG state joins the checkpointed train state, so a resumed run draws the same numbers.
  * a run started without torchrun gets the single-process rendezvous variables.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import torch

from titan_moe.runtime.device import accelerator_type, configure_torchtitan_device

configure_torchtitan_device()

from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

from titan_moe import train_spec  # noqa: E402
from titan_moe.config import ConfigError, load_config  # noqa: E402

# Test hook: SIGKILL this process while it writes the checkpoint of this step, after the
# data files and before the metadata that makes a checkpoint loadable.
KILL_DURING_SAVE_ENV = "TITAN_MOE_KILL_DURING_SAVE_STEP"


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


def _fit_local_batch_to_global(config) -> None:
    """Treat `training.local_batch_size` as a cap: when local x data-parallel degree exceeds
    `training.global_batch_size`, shrink the local batch so one config serves any rank count."""
    p = config.parallelism
    non_dp = max(1, p.tensor_parallel_degree) * max(1, p.context_parallel_degree) * max(1, p.pipeline_parallel_degree)
    dp = max(1, int(os.environ.get("WORLD_SIZE", "1")) // non_dp)
    for section in (config.training, config.validation):
        global_batch = getattr(section, "global_batch_size", -1)
        if section is config.validation:
            global_batch = section.local_batch_size
        if global_batch > 0 and section.local_batch_size * dp > global_batch:
            if global_batch % dp:
                raise ConfigError(f"batch size {global_batch} is not divisible by the {dp} data-parallel ranks")
            section.local_batch_size = global_batch // dp


class TitanTrainer(Trainer):
    def __init__(self, job_config):
        train_spec.register()
        super().__init__(job_config)
        if self.device.type == "cpu":
            _use_plain_sum_for_gloo(self.model_parts)
        if job_config.training.mixed_precision_param == "float32":
            # torchtitan would wrap an unsharded fp32 run in autocast(float32), which CPU
            # autocast rejects with a warning; there is nothing to cast.
            self.maybe_enable_amp = contextlib.nullcontext()
        if job_config.debug.seed is not None:
            _init_independent_of_layout(self.model_parts, self.model_args, job_config.debug.seed)
        kill_step = os.environ.get(KILL_DURING_SAVE_ENV)
        if kill_step:
            _install_kill_during_save(self, int(kill_step))

    def should_continue_training(self) -> bool:
        exit_at = self.job_config.training.exit_at_step
        if 0 < exit_at <= self.step < self.job_config.training.steps:
            if self.step % self.checkpointer.interval:
                # The regular save after this step only fires on the interval; force one.
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
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])
        if "rng_cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["rng_cuda"])


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


def main(argv: list[str] | None = None) -> None:
    init_logger()
    try:
        config = load_config(argv)
        if "RANK" not in os.environ:
            _set_single_process_env()
        _fit_local_batch_to_global(config)
    except ConfigError as e:
        print(f"titan_moe.train: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if accelerator_type() == "cpu" and config.training.mixed_precision_param == "bfloat16":
        # FSDP's bf16 compute is very slow on CPUs and gains nothing there.
        config.training.mixed_precision_param = "float32"
    trainer = None
    try:
        try:
            trainer = TitanTrainer(config)
        except (FileNotFoundError, ValueError) as e:
            # bad data path, tokenizer or model settings found while building: one line, exit 2
            print(f"titan_moe.train: error: {config.job.config_file or 'command line'}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
