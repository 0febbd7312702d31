"""The context-length ladder: one run trains through stages of growing `seq_len`.

    [[ladder.stages]]                 # in the TOML, one table per stage, in order
    seq_len = 256
    steps = 60
    [[ladder.stages]]
    seq_len = 1024
    steps = 40
    long_fraction = 0.3               # tokens drawn from long documents
    synthetic_fraction = 0.05         # tokens of passkey / MQAR tasks (loss on the answers only)
    synthetic_max_length = 1024       # short tasks, many to a row (0: each fills its row)

    python -m titan_moe.train --job.config_file configs/ladder_cpu.toml --ladder.stages.2.steps 10

A stage's key is overridden from the command line as `--ladder.stages.N.KEY VALUE`, N counting
stages from 1 (`Stage` lists the keys). With stages, the run's `training.steps` is the ladder's
total and `training.seq_len` / `local_batch_size` / `global_batch_size` are the longest (last)
stage's, which is what `python -m titan_moe.plan` reads; the trainer switches them stage by
stage (`titan_moe.train`). Setting `training.steps` or `training.seq_len` beside stages is an
error: the stages own them.

Stage i covers the global steps (S_i, S_i + steps_i], S_i the steps of the stages before it.
Entering a stage changes the rows' length, the batch, the data mix and the learning rate; the
weights, the optimizer state, the step count and the document stream carry on (a stage resumes
the stream where the previous one stopped: documents consumed, not rows). The run checkpoints
at each stage's end and evaluates there (`[ladder] eval_*`, `titan_moe.evaluate`). A run
stopped anywhere resumes from its newest checkpoint, inside a stage or at its end.

Learning rate, per stage: a linear warm-up over the stage's `warmup_steps` to its `lr`, then
`decay_type` ("cosine", "linear" or "constant") down to `min_lr_factor * lr` at the stage's
end. Unset keys take `[optimizer] lr` and `[lr_scheduler]` warmup_steps / decay_type /
min_lr_factor (the warm-up only for the first stage: later stages start at their `lr`, since
NoPE needs no re-warming at a new length). The factor depends on the global step alone, so a
resumed run follows the same schedule.
"""

# No `from __future__ import annotations`: the config machinery reads field types as objects.

import math
import os
from dataclasses import dataclass, field
from typing import Any

DECAY_TYPES = ("cosine", "linear", "constant")
SYNTHETIC_TASKS = ("passkey", "mqar", "copy")


@dataclass
class Stage:
    name: str = ""
    """A label for logs and metrics; empty: the seq_len ("1K" for 1024, "256", "1M")."""

    seq_len: int = 0
    """Tokens per row in this stage (required)."""

    steps: int = 0
    """Optimizer steps in this stage (required)."""

    local_batch_size: int | None = None
    """Rows per data-parallel rank and microbatch; unset: training.local_batch_size."""

    global_batch_size: int | None = None
    """Rows per optimizer step over all ranks (a multiple of local_batch_size x ranks gives
    gradient accumulation); unset: training.global_batch_size (-1: no accumulation)."""

    lr: float | None = None
    """Peak learning rate of the stage; unset: optimizer.lr."""

    warmup_steps: int | None = None
    """Linear warm-up steps at the stage's start; unset: lr_scheduler.warmup_steps for the
    first stage, 0 for the others."""

    decay_type: str | None = None
    """cosine, linear or constant decay after the warm-up; unset: lr_scheduler.decay_type."""

    min_lr_factor: float | None = None
    """The LR at the stage's end, as a fraction of its lr; unset: lr_scheduler.min_lr_factor."""

    long_fraction: float = 0.0
    """Fraction of the stage's tokens drawn from long documents (data.long_documents): the
    upsampling of long documents. 0: the corpus alone."""

    synthetic_fraction: float = 0.0
    """Fraction of the stage's tokens from synthetic whole-context tasks (data.synthetic_tasks);
    each task fills the rest of a row, loss only on its answer tokens. Keep it <= 0.1."""

    synthetic_max_length: int = 0
    """0: each synthetic task fills the rest of its row (at least a quarter of it). > 0: tasks
    are short documents, their lengths log-uniform between the shortest task (64 tokens) and
    this bound, several to a row: for the same share of tokens many times more retrieval
    examples, the skill the evaluations then ask for at the stage's full length."""


@dataclass
class Ladder:
    stages: list[Stage] = field(default_factory=list)
    """The stages, in order (TOML: one [[ladder.stages]] table each; command line:
    --ladder.stages.N.KEY VALUE, N from 1). Empty: no ladder, one stage of training.seq_len."""

    eval_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Depths of the passkey in the context (0: at the start, 1: just before the question)."""

    eval_samples: int = 4
    """Passkey samples per (length, depth) cell and MQAR samples per length."""

    eval_lengths: list[int] = field(default_factory=list)
    """Context lengths evaluated at every stage's end besides the stages' own seq_len (those up
    to the stage's seq_len): a short one, e.g. 1024, tells a model that has not learned to
    retrieve at all from one that has but not at length."""

    eval_mqar_pairs: int = 8
    """Key-value pairs per MQAR sample (each is asked for once)."""

    eval_loss_docs: int = 4
    """Held-out documents (of at least the stage's seq_len + 1 tokens) for the loss by position."""

    eval_packages_path: str = ""
    """A folder of Python packages the run never trains on (an installed library's source,
    e.g. .../site-packages/torch): each package under it, whole and in import order, is one
    more held-out document for the loss by position. The val splits hold few documents much
    longer than 32K tokens; these reach hundreds of thousands. Empty: the val splits only."""

    eval_at_stage_end: bool = True
    """Evaluate at each stage's end (passkey at every stage's seq_len so far, MQAR, loss by
    position at the stage's seq_len); results go to metrics.jsonl and a table in the log."""

    eval_every: int = 0
    """Also evaluate every N steps inside a stage (the same evaluations as at its end, at the
    lengths up to the current stage's seq_len), to follow when retrieval appears. 0: only at
    stage ends. A resumed run does not repeat the ones before its checkpoint."""


def short_length(n: int) -> str:
    """1024 -> "1K", 262144 -> "256K", 1048576 -> "1M", 300 -> "300"."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


@dataclass
class ResolvedStage:
    """A stage with every inherited key filled in, and its place in the run."""

    index: int  # 0-based
    name: str
    seq_len: int
    steps: int
    local_batch_size: int
    global_batch_size: int
    lr: float
    warmup_steps: int
    decay_type: str
    min_lr_factor: float
    long_fraction: float
    synthetic_fraction: float
    synthetic_max_length: int
    start: int  # global steps done before the stage
    end: int  # the global step that ends it

    def lr_factor(self, step: int, base_lr: float) -> float:
        """Multiplier of base_lr for global step `step` (1-based) of this stage."""
        local = step - self.start  # 1 .. steps
        scale = self.lr / base_lr
        if local <= self.warmup_steps:
            return scale * local / (self.warmup_steps + 1)
        if self.decay_type == "constant" or self.steps == self.warmup_steps:
            return scale
        progress = (local - self.warmup_steps) / (self.steps - self.warmup_steps)
        if self.decay_type == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return scale * (self.min_lr_factor + (1.0 - self.min_lr_factor) * shape)


def resolve_stages(ladder: Ladder, training: Any, optimizer: Any, lr_scheduler: Any) -> list[ResolvedStage]:
    """The ladder's stages with inherited values; ValueError naming the key for a bad one."""
    out: list[ResolvedStage] = []
    start = 0
    for i, s in enumerate(ladder.stages):
        key = f"ladder.stages.{i + 1}"
        if s.seq_len < 1:
            raise ValueError(f"{key}.seq_len must be set (>= 1), got {s.seq_len}")
        if s.steps < 1:
            raise ValueError(f"{key}.steps must be set (>= 1), got {s.steps}")
        local = training.local_batch_size if s.local_batch_size is None else s.local_batch_size
        global_ = training.global_batch_size if s.global_batch_size is None else s.global_batch_size
        if local < 1:
            raise ValueError(f"{key}.local_batch_size must be >= 1, got {local}")
        decay = lr_scheduler.decay_type if s.decay_type is None else s.decay_type
        if decay not in DECAY_TYPES:
            raise ValueError(f"{key}.decay_type must be one of {DECAY_TYPES}, got {decay!r}")
        warmup = (lr_scheduler.warmup_steps if i == 0 else 0) if s.warmup_steps is None else s.warmup_steps
        warmup = min(max(0, warmup), s.steps)
        min_lr = lr_scheduler.min_lr_factor if s.min_lr_factor is None else s.min_lr_factor
        lr = optimizer.lr if s.lr is None else s.lr
        if lr <= 0:
            raise ValueError(f"{key}.lr must be > 0, got {lr}")
        if not 0.0 <= min_lr <= 1.0:
            raise ValueError(f"{key}.min_lr_factor must be in [0, 1], got {min_lr}")
        for name in ("long_fraction", "synthetic_fraction"):
            if not 0.0 <= getattr(s, name) < 1.0:
                raise ValueError(f"{key}.{name} must be in [0, 1), got {getattr(s, name)}")
        if s.synthetic_max_length:
            from titan_moe.data.synthetic import MIN_LENGTH

            shortest = max(MIN_LENGTH.values())
            if s.synthetic_max_length < shortest:
                raise ValueError(f"{key}.synthetic_max_length must be 0 (whole-row tasks) or >= {shortest} "
                                 f"(the shortest task), got {s.synthetic_max_length}")
        if s.long_fraction + s.synthetic_fraction >= 1.0:
            raise ValueError(f"{key}: long_fraction + synthetic_fraction must stay below 1 (the corpus needs a share)")
        if out and s.seq_len < out[-1].seq_len:
            raise ValueError(f"{key}.seq_len = {s.seq_len} is shorter than the stage before ({out[-1].seq_len})")
        out.append(ResolvedStage(
            index=i, name=s.name or short_length(s.seq_len), seq_len=s.seq_len, steps=s.steps,
            local_batch_size=local, global_batch_size=global_, lr=lr, warmup_steps=warmup, decay_type=decay,
            min_lr_factor=min_lr, long_fraction=s.long_fraction, synthetic_fraction=s.synthetic_fraction,
            synthetic_max_length=s.synthetic_max_length, start=start, end=start + s.steps))
        start += s.steps
    return out


def stage_of_step(stages: list[ResolvedStage], step: int) -> ResolvedStage:
    """The stage that global step `step` (1-based) belongs to; the last one past the end."""
    for s in stages:
        if step <= s.end:
            return s
    return stages[-1]


def lr_lambda(stages: list[ResolvedStage], base_lr: float):
    """LambdaLR's function: `last_epoch` k (k optimizer steps done) -> LR factor of step k + 1."""

    def factor(k: int) -> float:
        step = k + 1
        return stage_of_step(stages, step).lr_factor(step, base_lr)

    return factor


def check_eval_packages_path(config: Any) -> None:
    """ValueError unless ladder.eval_packages_path is empty or a folder that the run does not
    also train on (data.long_documents_path inside it, or it inside that)."""
    path = config.ladder.eval_packages_path
    if not path:
        return
    if not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"ladder.eval_packages_path {path!r} is not a directory")
    trained = config.data.long_documents_path
    if trained and "text" in config.data.long_documents:
        a, b = (os.path.realpath(os.path.expanduser(x)) for x in (path, trained))
        if os.path.commonpath([a, b]) in (a, b):
            raise ValueError(f"ladder.eval_packages_path {path!r} overlaps data.long_documents_path {trained!r}, "
                             "which the run trains on; held-out documents must be unseen")


def apply_to_config(config: Any, set_keys: set[str]) -> None:
    """With stages, make `[training]` describe the ladder: steps = the total, seq_len and the
    batch sizes = the last (longest) stage's. ValueError when the config also sets
    training.steps or training.seq_len (the stages own them)."""
    ladder = config.ladder
    check_eval_packages_path(config)  # also without stages: `titan_moe.evaluate` reads it
    if not ladder.stages:
        return
    for key in ("training.steps", "training.seq_len"):
        if key in set_keys:
            raise ValueError(f"{key} is set by [[ladder.stages]] (each stage's steps and seq_len); remove {key}")
    if ladder.eval_every < 0:
        raise ValueError(f"ladder.eval_every must be >= 0 (0: only at stage ends), got {ladder.eval_every}")
    if ladder.eval_samples < 1 or ladder.eval_mqar_pairs < 1 or ladder.eval_loss_docs < 0:
        raise ValueError("ladder.eval_samples and ladder.eval_mqar_pairs must be >= 1, ladder.eval_loss_docs >= 0")
    if any(n < 1 for n in ladder.eval_lengths):
        raise ValueError(f"ladder.eval_lengths must be lengths >= 1, got {ladder.eval_lengths}")
    if any(not 0.0 <= d <= 1.0 for d in ladder.eval_depths) or not ladder.eval_depths:
        raise ValueError(f"ladder.eval_depths must be values in [0, 1], got {ladder.eval_depths}")
    stages = resolve_stages(ladder, config.training, config.optimizer, config.lr_scheduler)
    last = stages[-1]
    config.training.steps = last.end
    config.training.seq_len = last.seq_len
    config.training.local_batch_size = last.local_batch_size
    config.training.global_batch_size = last.global_batch_size


def enter_stage(config: Any, stage: ResolvedStage) -> None:
    """Point `[training]`'s per-stage keys at `stage` (what torchtitan and the loader read)."""
    config.training.seq_len = stage.seq_len
    config.training.local_batch_size = stage.local_batch_size
    config.training.global_batch_size = stage.global_batch_size
