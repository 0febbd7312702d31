"""torchtitan's metrics processor plus expert-balance metrics and a JSON-lines log.

Every logged step (and every eval) is also appended, on rank 0, to
`<dump_folder>/metrics.jsonl` as one JSON object with full-precision floats, so that
scripts and tests can read losses without parsing the console. Each run (a resume included)
first writes `{"step": 0, "kernels": {...}}`: the resolved `[kernels]` choices it ran with.
A resume from step N drops the file's records of later steps (the resumed run logs them
again), so every step has one record.

Each logged step also gets a progress line: step of total, steps/s since the last log, time
left at that rate.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from titan_moe.model.moe import balance_metrics


class TitanMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self._jsonl_path = None
        self._last_progress: tuple[int, float] | None = None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            os.makedirs(job_config.job.dump_folder, exist_ok=True)
            self._jsonl_path = os.path.join(job_config.job.dump_folder, "metrics.jsonl")

    def _append(self, record: dict[str, Any]) -> None:
        if self._jsonl_path is not None:
            with open(self._jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def resumed_at(self, step: int) -> None:
        """Drop the records of steps after `step` (the checkpoint resumed from): the run
        computes and logs them again."""
        if self._jsonl_path is None or not os.path.isfile(self._jsonl_path):
            return
        with open(self._jsonl_path) as f:
            lines = f.readlines()
        kept = [line for line in lines if not line.strip() or json.loads(line).get("step", 0) <= step]
        if len(kept) < len(lines):
            with open(self._jsonl_path, "w") as f:
                f.writelines(kept)
            logger.info(f"metrics.jsonl: dropped {len(lines) - len(kept)} records of steps after {step} "
                        "(this run logs them again)")

    def start_progress(self, step: int) -> None:
        """The rate of the first progress line counts from here (before step `step + 1`)."""
        if self._last_progress is None:
            self._last_progress = (step, time.perf_counter())

    def progress(self, step: int, now: float) -> str | None:
        """`step 10/60 (17%)  1.62 steps/s  left 0:00:31`, the rate since the previous log;
        None at the first log of a run (no rate yet)."""
        last, self._last_progress = self._last_progress, (step, now)
        if last is None or step <= last[0] or now <= last[1]:
            return None
        training = self.job_config.training
        end = training.steps if training.exit_at_step <= 0 else min(training.exit_at_step, training.steps)
        rate = (step - last[0]) / (now - last[1])
        left = int(max(0, end - step) / rate)
        return (f"step {step}/{end} ({100 * step // max(end, 1)}%)  {rate:.2f} steps/s  "
                f"left {left // 3600}:{left % 3600 // 60:02d}:{left % 60:02d}")

    def log_kernels(self, kernels: dict[str, str]) -> None:
        """Record the run's resolved `[kernels]` choices (a record of step 0, no loss)."""
        self._append({"step": 0, "kernels": kernels})

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        balance = balance_metrics(getattr(self.optimizers, "expert_balance_stats", None) or [])
        # Read before the parent's log resets the peaks and the token count.
        memory = self._peak_memory()
        tokens, seconds = self.ntokens_since_last_log, time.perf_counter() - self.time_last_log
        super().log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **balance})
        loss = float(global_avg_loss)
        record = {"step": step, "loss": loss, "grad_norm": float(grad_norm),
                  "seq_len": self.job_config.training.seq_len, **balance, **memory}
        if seconds > 0:
            record["tokens_per_s"] = tokens / (seconds * self.parallel_dims.non_data_parallel_size)
        self._append(record)
        line = self.progress(step, time.perf_counter())
        if line:
            logger.info(line)
        if "moe/max_violation_max" in balance:
            logger.info(
                f"step: {step:2}  experts: max_violation {balance['moe/max_violation_max']:.3f} "
                f"(mean over layers {balance['moe/max_violation_mean']:.3f})  "
                f"dead {int(balance.get('moe/dead_experts_total', 0))}"
                + (f"  aux_loss {balance['moe/aux_loss_mean']:.4f} (mean over layers)"
                   if "moe/aux_loss_mean" in balance else "")
            )

    def _peak_memory(self) -> dict[str, float]:
        """Peak device memory since the last log, in GiB: allocated (`torch.cuda.max_memory_allocated`),
        active (torchtitan's "memory") and reserved (on CPU all three are the process's peak RSS)."""
        monitor = self.device_memory_monitor
        stats = monitor.get_peak_stats()
        allocated = titan_utils.device_module.memory_stats(monitor.device).get("allocated_bytes.all.peak", -1)
        return {"max_allocated_gib": allocated / 2**30, "max_active_gib": stats.max_active_gib,
                "max_reserved_gib": stats.max_reserved_gib}

    def log_validation(self, loss, step, extra_metrics=None):
        super().log_validation(loss, step, extra_metrics)
        self._append({"step": step, "eval_loss": float(loss)})

    def log_eval_balance(self, step: int, balance: dict[str, float]) -> None:
        """The held-out expert load (``eval/moe/*``, see ``recording_eval_load``): one
        metrics.jsonl record, the loggers' metrics and one console line."""
        self.logger.log(balance, step)
        self._append({"step": step, **balance})
        logger.info(
            f"validate step: {step:2}  held-out experts: max_violation {balance['eval/moe/max_violation_max']:.3f} "
            f"(mean over layers {balance['eval/moe/max_violation_mean']:.3f})  "
            f"dead {int(balance['eval/moe/dead_experts_total'])}"
        )


def build_titan_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return TitanMetricsProcessor(job_config, parallel_dims, tag)
