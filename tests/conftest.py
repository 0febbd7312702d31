"""Fixtures shared by the test files (plain helpers live in tiny.py, numerics.py, triton_mode.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for modules of tiny tensors: fastest, and no thread
    oversubscription stalls on a busy 2-core machine. Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
