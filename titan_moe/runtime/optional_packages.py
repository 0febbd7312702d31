"""Run with the built-in corpus where the Hugging Face `datasets` package is absent.

torchtitan 0.2.2 imports `datasets` at module level (`torchtitan.components.validate` ->
`torchtitan.hf_datasets.text_datasets`), so without it no trainer starts, even though the
built-in corpus and our loaders never call it. `datasets` pulls in pyarrow and pandas,
which GPU images built around torch alone often lack.

`provide_datasets_placeholder()` installs, only when `import datasets` fails, a placeholder
module with the names torchtitan imports. Using any of them (loading a dataset) raises an
ImportError that says what to install. Where `datasets` is installed nothing changes.
"""

from __future__ import annotations

import sys
import types

PLACEHOLDER_FLAG = "__titan_moe_placeholder__"
_MESSAGE = ("the Hugging Face `datasets` package is not installed: the built-in corpus needs none, "
            "Hugging Face datasets need `pip install datasets`")


def _unavailable(*args, **kwargs):
    raise ImportError(_MESSAGE)


class _Unavailable:
    """Stands for `datasets.Dataset` and kin: importable, and raises when made."""

    def __init__(self, *args, **kwargs):
        raise ImportError(_MESSAGE)


def is_placeholder(module) -> bool:
    """Whether ``module`` is the placeholder this module installs."""
    return bool(getattr(module, PLACEHOLDER_FLAG, False))


def provide_datasets_placeholder() -> bool:
    """Install the `datasets` placeholder if the real package cannot be imported.

    Returns True when the placeholder is (now or already) what `import datasets` gives.
    """
    try:
        import datasets
    except ImportError:
        pass
    else:
        return is_placeholder(datasets)
    module = types.ModuleType("datasets", "Placeholder: " + _MESSAGE)
    distributed = types.ModuleType("datasets.distributed", "Placeholder: " + _MESSAGE)
    for name in ("Dataset", "DatasetDict", "IterableDataset", "IterableDatasetDict"):
        setattr(module, name, type(name, (_Unavailable,), {"__module__": "datasets"}))
    module.load_dataset = module.load_from_disk = _unavailable
    distributed.split_dataset_by_node = _unavailable
    module.distributed = distributed
    setattr(module, PLACEHOLDER_FLAG, True)
    sys.modules["datasets"] = module
    sys.modules["datasets.distributed"] = distributed
    return True
