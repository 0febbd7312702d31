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
