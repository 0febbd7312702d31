"""Eval loss on the held-out split, with torchtitan's Validator loop and our data."""

from __future__ import annotations

from titan_moe.runtime.optional_packages import provide_datasets_placeholder

provide_datasets_placeholder()  # torchtitan imports `datasets` at module level

from torchtitan.components.validate import Validator  # noqa: E402

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
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        return inputs, labels, with_head_labels(self._model_args, extra_inputs, labels), {}

    def validate(self, model_parts, step):
        """torchtitan's loop, plus the held-out load balance of the MoE layers (routed with
        the frozen expert bias, summed over the data-parallel group the bias statistics use)
        logged as ``eval/moe/*`` beside ``eval_loss``."""
        group = self.parallel_dims.get_mesh("loss").get_group() if self.parallel_dims.dp_cp_enabled else None
        with recording_eval_load(model_parts, group) as balance:
            super().validate(model_parts, step)
        if balance:
            self.metrics_processor.log_eval_balance(step, balance)

    @property
    def validation_dataloader(self):
        self._loader.reset()  # every eval reads the split from its start
        return self._loader


def build_titan_validator(**kwargs) -> TitanValidator:
    return TitanValidator(**kwargs)
