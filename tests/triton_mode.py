"""Whether Triton kernels can run under the interpreter in this test process."""

from __future__ import annotations


def interpreter_ready() -> bool:
    """True when Triton itself was imported with TRITON_INTERPRET=1.

    Triton reads the variable when it is first imported: its own @jit library functions
    (tl.sum, tl.cumsum, ...) are then interpreted too. If another test module imported Triton
    earlier without it, kernels that call them cannot run interpreted in this process.
    """
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)


def rerun_under_interpreter(test_file: str, also_deselect: str = "") -> None:
    """Run `test_file`'s tests (all but this rerun, and `also_deselect`, a -k expression) in a
    fresh process with TRITON_INTERPRET=1.

    Fails if the run fails or if no test actually ran there (all skipped would be vacuous).
    """
    import os
    import re
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file,
         "-k", "not fresh_interpreter_process" + (f" and not ({also_deselect})" if also_deselect else "")],
        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, proc.stdout[-2000:]


def interpret_without_gpu() -> bool:
    """Whether CUDA is present; without it, set TRITON_INTERPRET=1 (call before importing the
    kernel modules, so that a Triton imported first by this module is interpreted)."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return cuda


def skip_unless_kernels_run(kernels_run_here: bool, rerun_test: str):
    """Skip marker for tests that launch Triton kernels, when they cannot run in this process;
    `rerun_test` (the file's `rerun_under_interpreter` test) runs them in a fresh one."""
    import pytest

    return pytest.mark.skipif(
        not kernels_run_here,
        reason=f"Triton was imported before TRITON_INTERPRET=1 was set and there is no GPU; "
        f"{rerun_test} runs these tests in a subprocess",
    )


def spy_on(monkeypatch, module, names) -> list[str]:
    """Wrap `module.<name>` for each of `names` so that every call appends the function's
    name to the returned list (which backend a switch really selected)."""
    calls: list[str] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    for name in names:
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    return calls


def kernel_test_setup(cuda: bool, kernels_interpreted: bool, rerun_test: str):
    """`(KERNELS_RUN_HERE, DEVICE, needs_kernels)` of a Triton test file: whether its kernels
    run in this process (on CUDA, or interpreted with an interpreted Triton), the device of
    its tensors, and the skip marker naming the file's fresh-process re-run test."""
    run_here = cuda or (kernels_interpreted and interpreter_ready())
    return run_here, "cuda" if cuda else "cpu", skip_unless_kernels_run(run_here, rerun_test)


def compiled_script_results(script: str) -> dict:
    """Run `script` in a fresh process without TRITON_INTERPRET (so Triton compiles for the GPU
    target, no GPU needed) and return the dict it prints on its `RESULT <repr>` line. Skips the
    calling test when Triton's NVIDIA backend is not installed."""
    import ast
    import os
    import subprocess
    import sys

    import pytest
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's NVIDIA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return ast.literal_eval(line[len("RESULT "):])
