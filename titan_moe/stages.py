"""The trainer's side of the context ladder (`titan_moe.ladder`): one `LadderRun` per run.

`TitanTrainer` calls it at three points:
  * `install()` after torchtitan builds the trainer: the LR schedulers get the ladder's
    per-stage factor (a function of the global step, so a resumed run follows it).
  * `data_iterator(step, iterator)` at each step: entering a stage (the first step of a run
    included, fresh or resumed) points `[training]` at the stage, reshapes the loader (rows,
    batch, data mix) and the gradient accumulation, logs one line, and hands out a new
    iterator that continues the document stream.
  * `after_step(step)` after each step's own save and validation: at a stage's end, a
    checkpoint (when the interval did not already write one) and the stage's evaluations;
    inside a stage, the same evaluations every `ladder.eval_every` steps.
"""

from __future__ import annotations

import os
import time

import torch
from torchtitan.tools.logging import logger

from titan_moe import evaluate
from titan_moe.context_parallel import context_parallel_scores_fn
from titan_moe.data.from_config import corpus_documents
from titan_moe.data.synthetic import Filler
from titan_moe.ladder import enter_stage, lr_lambda, resolve_stages, stage_of_step
from titan_moe.parallelize import reshard


class LadderRun:
    def __init__(self, trainer, job_config):
        self.trainer = trainer
        self.config = job_config
        self.stages = resolve_stages(job_config.ladder, job_config.training, job_config.optimizer,
                                     job_config.lr_scheduler)
        self.current = None
        self._iterator = None
        self._started_at: int | None = None
        self._filler: Filler | None = None
        self._held_out: dict[int, list[list[int]]] = {}  # seq_len -> tokenized held-out documents
        self.saved_step: int | None = None  # the last stage end this process checkpointed

    def install(self) -> None:
        base_lr = self.config.optimizer.lr
        factor = lr_lambda(self.stages, base_lr)
        for scheduler in self.trainer.lr_schedulers.schedulers:
            scheduler.lr_lambdas = [factor] * len(scheduler.optimizer.param_groups)
            for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
                group["lr"] = base * factor(scheduler.last_epoch)
            scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
        if not self.config.checkpoint.enable:
            logger.warning("ladder: checkpoint.enable = false: no checkpoint at the stages' ends, "
                           "a stopped run cannot resume")
        if self.config.ladder.eval_at_stage_end:  # the held-out sources, checked before the first step
            self._filler = Filler(corpus_documents(self.config, "val"), self.trainer.tokenizer)
            evaluate.loss_sources(self.config, self._filler.documents)
        names = ", ".join(f"{s.name} ({s.steps} steps x {s.global_batch_size if s.global_batch_size > 0 else s.local_batch_size} rows)"
                          for s in self.stages)
        logger.info(f"ladder: {len(self.stages)} stages, {self.stages[-1].end} steps: {names}")

    def data_iterator(self, step: int, iterator):
        stage = stage_of_step(self.stages, step)
        if stage is not self.current:
            self._enter(stage)
        return self._iterator

    def _enter(self, stage) -> None:
        trainer, loader = self.trainer, self.trainer.dataloader
        dp = loader.dp_world_size
        local, global_ = stage.local_batch_size, stage.global_batch_size
        if global_ > 0 and local * dp > global_:
            local = global_ // dp  # as titan_moe.train does for [training]
        if global_ <= 0:
            global_ = local * dp
        if global_ % (local * dp):
            raise ValueError(f"ladder.stages.{stage.index + 1}: global_batch_size {global_} is not a multiple of "
                             f"local_batch_size {local} x {dp} data-parallel ranks")
        enter_stage(self.config, stage)
        self.config.training.local_batch_size = local
        trainer.gradient_accumulation_steps = global_ // (local * dp)
        loader.set_stage(stage.index, seq_len=stage.seq_len, local_batch_size=local,
                         long_fraction=stage.long_fraction, synthetic_fraction=stage.synthetic_fraction,
                         synthetic_max_length=stage.synthetic_max_length)
        self._iterator = trainer.batch_generator(loader)
        self.current = stage
        logger.info(f"ladder: stage {stage.index + 1}/{len(self.stages)} '{stage.name}': seq_len {stage.seq_len}, "
                    f"steps {stage.start + 1}-{stage.end}, {global_} rows a step ({local} x {dp} ranks x "
                    f"{trainer.gradient_accumulation_steps} microbatches), lr {stage.lr:g} ({stage.decay_type}, "
                    f"warm-up {stage.warmup_steps}), long {stage.long_fraction:.0%}, synthetic "
                    f"{stage.synthetic_fraction:.0%}"
                    + (f" ({', '.join(self.config.data.synthetic_tasks)}"
                       + (f", up to {stage.synthetic_max_length} tokens" if stage.synthetic_max_length else "") + ")"
                       if stage.synthetic_fraction else ""))

    def after_step(self, step: int) -> None:
        if self._started_at is None:
            self._started_at = step  # the step the run starts from: nothing of it is ours
            self._finish_interrupted_evaluation(step)
            return
        stage = stage_of_step(self.stages, step)
        if step <= self._started_at:
            return
        if step != stage.end:
            every = self.config.ladder.eval_every
            if every and step % every == 0:
                self.evaluate(stage, step)
            return
        checkpointer = self.trainer.checkpointer
        if checkpointer.enable and step % checkpointer.interval and step != self.config.training.steps:
            interval, checkpointer.interval = checkpointer.interval, 1
            try:
                checkpointer.save(step)
            finally:
                checkpointer.interval = interval
            self.saved_step = step
        if self.config.ladder.eval_at_stage_end:
            self.evaluate(stage, step)

    def _finish_interrupted_evaluation(self, step: int) -> None:
        """A run resumed from a stage's last step whose evaluations were never recorded
        (stopped after the stage's checkpoint, before `evaluate.record`) runs them now."""
        if step <= 0 or not self.config.ladder.eval_at_stage_end:
            return
        stage = stage_of_step(self.stages, step)
        if step == stage.end and not evaluate.recorded(self.config.job.dump_folder, step):
            logger.info(f"ladder: the evaluations of stage '{stage.name}' (step {step}) did not finish; "
                        "running them now")
            self.evaluate(stage, step)

    def _scores_fn(self, model):
        """The evaluations' view of the model (`evaluate.ScoresFn`): under context
        parallelism every rank scores its segment of the same rows and the scores are gathered
        (`context_parallel_scores_fn`), so the numbers are the one-device model's."""
        trainer = self.trainer
        if trainer.parallel_dims.cp_enabled:
            return context_parallel_scores_fn(model, trainer.device, trainer.parallel_dims.get_mesh("cp").get_group())
        return evaluate.model_scores_fn(model, trainer.device)

    def evaluate(self, stage, step: int) -> dict[str, float]:
        started = time.perf_counter()
        trainer = self.trainer
        ladder = self.config.ladder
        tokenizer = trainer.tokenizer
        if self._filler is None:
            self._filler = Filler(corpus_documents(self.config, "val"), tokenizer)
        if stage.seq_len not in self._held_out:  # tokenizing long documents takes seconds: once a stage
            self._held_out[stage.seq_len] = evaluate.loss_documents(self.config, self._filler.documents, tokenizer,
                                                                    stage.seq_len)
        held_out = self._held_out[stage.seq_len]
        lengths = sorted({s.seq_len for s in self.stages[: stage.index + 1]}
                         | {n for n in ladder.eval_lengths if n <= stage.seq_len})
        (model,) = trainer.model_parts
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

        def progress(line: str) -> None:
            if rank == 0:
                logger.info(f"ladder: evaluations of stage '{stage.name}': {line}")

        model.eval()
        try:
            # Eager: every (rows, length) of the evaluation is a new shape for compiled layers,
            # each a compile (and a step toward their recompile limit) for a forward or two.
            with trainer.maybe_enable_amp, torch.compiler.set_stance("force_eager"):
                metrics = evaluate.run_evals(
                    self._scores_fn(model), tokenizer, self._filler, held_out,
                    lengths=lengths, seq_len=stage.seq_len, depths=ladder.eval_depths,
                    samples=ladder.eval_samples, mqar_pairs=ladder.eval_mqar_pairs,
                    progress=progress)
        finally:
            model.train()
            reshard(model)
        if rank == 0:
            evaluate.record(self.config.job.dump_folder, step, stage.seq_len, metrics, stage.name)
            where = "at the end of" if step == stage.end else "inside"
            logger.info(f"ladder: evaluations {where} stage '{stage.name}' (step {step}, "
                        f"{time.perf_counter() - started:.1f} s), heatmap "
                        f"{os.path.join(self.config.job.dump_folder, f'passkey_{step}.png')}:\n"
                        + evaluate.format_table(metrics))
        return metrics
