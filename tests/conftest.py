"""Fixtures shared by the test files (plain helpers live in tiny.py, numerics.py, triton_mode.py)."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which Triton fixes when it is
# first imported: set it before any test module imports Triton, so that every kernel test
# runs in this process (each file's fresh-interpreter rerun then skips itself).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for modules of tiny tensors: fastest, and no thread
    oversubscription stalls on a busy 2-core machine. Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
