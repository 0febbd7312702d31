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
