"""Build the tokenizer and the train / held-out loaders from a job config."""

from __future__ import annotations

from titan_moe.data.corpus import CorpusError, build_source
from titan_moe.data.loader import build_dataloader
from titan_moe.data.long_documents import long_source
from titan_moe.data.synthetic import Filler, SyntheticTasks
from titan_moe.data.tokenizer import load_tokenizer


def tokenizer_from_config(job_config):
    return load_tokenizer(job_config.data.tokenizer or None)


def dataloader_from_config(job_config, *, tokenizer, split: str, dp_rank: int, dp_world_size: int):
    """The training stream (`split="train"`, endless) or the held-out split (`"val"`, one pass).

    The held-out split reads `validation.dataset`/`dataset_path` when set, else the training
    source's own held-out documents. A split that cannot fill one batch, or holds no
    documents, raises ValueError (CorpusError) saying which keys to change.
    """
    train = split == "train"
    section = job_config.training if train else job_config.validation
    advice = ("add text, or lower training.local_batch_size or training.seq_len" if train else
              "validation needs more held-out text: set validation.dataset_path, raise data.val_fraction, "
              "lower validation.local_batch_size or validation.seq_len, or set validation.enable = false")
    try:
        loader = _build(job_config, section, tokenizer, split, dp_rank, dp_world_size)
    except CorpusError:
        raise
    except ValueError as e:
        if train:
            raise
        raise CorpusError(f"{e}; {advice}") from None
    loader.check_fills_a_batch(advice)
    return loader


def _uses_mix(job_config, key: str) -> bool:
    return any(getattr(s, key) > 0 for s in job_config.ladder.stages)


def mix_sources(job_config, tokenizer, split: str):
    """(long documents, synthetic tasks) of one split, each None when no ladder stage uses it.
    Synthetic tasks take their filler text from the same split of the training corpus."""
    data = job_config.data
    long_docs = None
    if _uses_mix(job_config, "long_fraction"):
        if not data.long_documents:
            raise ValueError("a ladder stage sets long_fraction > 0 but data.long_documents is empty "
                             "(e.g. [\"packages\"])")
        long_docs = long_source(data.long_documents, data.long_documents_path, split, data.val_fraction)
    synthetic = None
    if _uses_mix(job_config, "synthetic_fraction"):
        if not data.synthetic_tasks:
            raise ValueError("a ladder stage sets synthetic_fraction > 0 but data.synthetic_tasks is empty")
        filler = Filler(corpus_documents(job_config, split), tokenizer)
        synthetic = SyntheticTasks(tokenizer, filler, data.synthetic_tasks, data.seed)
    return long_docs, synthetic


def corpus_documents(job_config, split: str):
    """The training source's documents of one split."""
    return build_source(job_config.training.dataset, job_config.training.dataset_path, split,
                        val_fraction=job_config.data.val_fraction, hf_text_column=job_config.data.hf_text_column)


def _build(job_config, section, tokenizer, split, dp_rank, dp_world_size):
    train = split == "train"
    long_docs, synthetic = mix_sources(job_config, tokenizer, split) if train else (None, None)
    return build_dataloader(
        tokenizer=tokenizer,
        source=job_config.training.dataset if train else (section.dataset or job_config.training.dataset),
        path=job_config.training.dataset_path if train else (section.dataset_path or job_config.training.dataset_path),
        split=split,
        seq_len=section.seq_len,
        local_batch_size=section.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=job_config.data.seed,
        val_fraction=job_config.data.val_fraction,
        infinite=train,
        hf_text_column=job_config.data.hf_text_column,
        long_documents=long_docs,
        synthetic=synthetic,
    )
