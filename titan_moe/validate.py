"""Eval loss on the held-out split, with torchtitan's Validator loop and our data."""

from __future__ import annotations

from titan_moe.runtime.optional_packages import provide_datasets_placeholder

provide_datasets_placeholder()  # torchtitan imports `datasets` at module level

import torch  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.tools import utils  # noqa: E402

from titan_moe.context_parallel import shard_batch  # noqa: E402
from titan_moe.parallelize import reshard  # noqa: E402

from titan_moe.data.from_config import dataloader_from_config  # noqa: E402
from titan_moe.config import model_args_from_config  # noqa: E402
from titan_moe.model.head import with_head_labels  # noqa: E402
from titan_moe.model.moe import recording_eval_load  # noqa: E402


class TitanValidator(Validator):
    """torchtitan's Validator, reading our held-out split from the start at every eval.

    torchtitan's constructor builds its own C4 loader, so we set the same attributes
    ourselves and keep its `validate` loop unchanged.
    """

    def __init__(self, *, job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor, **pp_kwargs):
        self.job_config = job_config
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_kwargs.get("pp_schedule")
        self.pp_has_first_stage = pp_kwargs.get("pp_has_first_stage")
        self.pp_has_last_stage = pp_kwargs.get("pp_has_last_stage")
        self._model_args = model_args_from_config(job_config)
        self._dp_world_size = dp_world_size
        self._dp_rank = dp_rank
        # Built once, here: a held-out split that is missing or too small stops the start-up.
        self._loader = dataloader_from_config(job_config, tokenizer=tokenizer, split="val", dp_rank=dp_rank,
                                              dp_world_size=dp_world_size)

    def post_dataloading_process(self, input_dict, labels, model_parts):
        # Document boundaries travel as `doc_ids` in input_dict; no attention-mask objects.
        # Under context parallelism each rank keeps its segment of every row, as in training.
        if self.parallel_dims.cp_enabled:
            input_dict, labels = shard_batch(input_dict, labels, self.parallel_dims.get_mesh("cp").get_group())
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, with_head_labels(self._model_args, extra_inputs, labels), {}

    def validate(self, model_parts, step):
        """torchtitan's loop, plus the held-out load balance of the MoE layers (routed with
        the frozen expert bias, summed over the data-parallel group the bias statistics use)
        logged as ``eval/moe/*`` beside ``eval_loss``."""
        group = self.parallel_dims.get_mesh("loss").get_group() if self.parallel_dims.dp_cp_enabled else None
        with recording_eval_load(model_parts, group) as balance:
            try:
                if self.parallel_dims.cp_enabled:
                    self._validate_context_parallel(model_parts, step)
                else:
                    super().validate(model_parts, step)
            finally:
                for model in model_parts:
                    reshard(model)
        if balance:
            self.metrics_processor.log_eval_balance(step, balance)

    @torch.no_grad()
    def _validate_context_parallel(self, model_parts, step: int) -> None:
        """torchtitan's loop for one model part under context parallelism: each rank runs its
        segment of the rows (`post_dataloading_process`) with our context-parallel layers
        (torchtitan's own CP context, which rotates RoPE buffers, is not used), and the
        token count that normalises the loss is taken on the whole rows before slicing, as
        the trainer does, so the loss summed over dp x cp is the one-device mean."""
        (model,) = model_parts
        model.eval()
        pd, device = self.parallel_dims, utils.device_type
        losses = []
        for input_dict, labels in self.validation_dataloader:
            if 0 <= self.job_config.validation.steps <= len(losses):
                break
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            valid = (labels != IGNORE_INDEX).sum()
            n_tokens = dist_utils.dist_sum(valid, pd.get_mesh("batch"), None) if pd.dp_enabled else valid.float()
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels, model_parts)
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            with self.validation_context(), self.maybe_enable_amp:
                loss_sum = self.loss_fn(model(inputs, **extra_inputs, **extra_kwargs), labels)
            losses.append(loss_sum.detach() / n_tokens)
        if not losses:
            raise ValueError("validation read no batch: the held-out split is empty")
        loss = torch.stack(losses).sum() / len(losses)
        self.metrics_processor.log_validation(loss=dist_utils.dist_sum(loss, pd.get_optional_mesh("loss")), step=step)
        model.train()

    @property
    def validation_dataloader(self):
        self._loader.reset()  # every eval reads the split from its start
        return self._loader


def build_titan_validator(**kwargs) -> TitanValidator:
    return TitanValidator(**kwargs)
