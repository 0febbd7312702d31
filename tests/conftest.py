"""Settings and fixtures shared by the test files (plain helpers live in tiny.py, numerics.py,
triton_mode.py)."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which Triton fixes when it is
# first imported: set it before any test module imports Triton, so that every kernel test
# runs in this process (each file's fresh-interpreter rerun then skips itself).
#
# And one intra-op thread, here and in the processes the tests start (they inherit the
# variable): the tests' tensors are tiny, so a second thread only adds synchronisation, and on
# a busy 2-core machine its spin-waits stall (measured with the other core busy: float64
# reference loops 20x slower, the interpreted kernel tests and the compile tests about 30%
# slower with two threads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def processes_started_early(request, tmp_path_factory):
    """Queue the processes of every selected test file that has them when the session starts
    (tests/tiny.py), in the order of the files: its `start_runs` where a selected test reads
    its `runs` fixture, then its `start_slow_runs` where a selected slow test reads it (only
    those read `slow_runs`, which reads `runs`; some through `request.getfixturevalue`). They
    run on the shared threads beside the in-process tests before them.

    Under pytest-xdist (`-n 2 --dist loadfile`) a worker does not know at the start which
    files it will run: there each file's processes start when its first test reads `runs`."""
    import tiny

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return

    slow_readers: dict = {}  # module whose tests read `runs` -> whether a slow one does (file order)
    for item in request.session.items:
        module = getattr(item, "module", None)
        if module is not None and "runs" in getattr(item, "fixturenames", ()):
            slow_readers[module] = slow_readers.get(module, False) or item.get_closest_marker("slow") is not None
    for module, slow in slow_readers.items():
        if hasattr(module, "start_runs"):
            ci_runs = tiny.started_runs(module.start_runs, tmp_path_factory)
            if slow and hasattr(module, "start_slow_runs"):
                tiny.started_runs(module.start_slow_runs, tmp_path_factory, ci_runs)


def pytest_sessionfinish(session, exitstatus):
    import tiny

    tiny.cancel_queued()
