"""Where our Triton kernels can run: compiled on CUDA, or on CPU under the interpreter.

Triton decides at import whether `@triton.jit` builds interpreted functions
(`TRITON_INTERPRET=1`, used by the CPU tests) or compiled kernels; a kernel built one way
cannot run the other way. Each kernel module answers through its own kernel object.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch
from triton.runtime.errors import OutOfResources
from triton.runtime.interpreter import InterpretedFunction

logger = logging.getLogger(__name__)


DEFAULT_SMS = 132  # an H200's SM count: what launch rules assume without a CUDA device


@functools.cache
def _device_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device_index: int | None = None) -> int:
    """SMs of CUDA device `device_index` (default: the current one); `DEFAULT_SMS` when torch
    sees no CUDA device (the interpreter)."""
    if not torch.cuda.is_available():
        return DEFAULT_SMS
    return _device_sm_count(torch.cuda.current_device() if device_index is None else device_index)


@functools.cache
def cuda_capability(device_index: int) -> tuple[int, int]:
    """Compute capability of CUDA device `device_index`, asked once per device (a host query
    that launch rules would otherwise repeat on every call)."""
    return torch.cuda.get_device_capability(device_index)


_thread_has_context = threading.local()


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def ensure_cuda_context(device_index: int) -> None:
    """Make a CUDA context current in this thread (the primary context of `device_index`
    when none is), once per thread, before host-side TMA descriptors are encoded.

    Triton 3.6 binds a context before each launch, but encodes host tensor descriptors
    (`fill_tma_descriptor`, `cuTensorMapEncodeTiled`) before that, without one: in a thread
    where no CUDA call has run yet, e.g. autograd's device thread at its first backward, it
    fails with "invalid device context" (seen on the H200). PyTorch's device threads only
    call `cudaSetDevice` when the device changes, which leaves device 0's thread unbound.
    """
    if getattr(_thread_has_context, "done", False):
        return
    lib = _libcuda()

    def check(result: int, call: str) -> None:
        if result != 0:
            raise RuntimeError(f"ensure_cuda_context: {call} returned CUDA error {result}")

    ctx = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        device = ctypes.c_int()
        check(lib.cuDeviceGet(ctypes.byref(device), int(device_index)), "cuDeviceGet")
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _thread_has_context.done = True


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for launchers: plain integer math. Triton 3.6's is a constexpr
    function, about 2.7 us per host call (`python -m timeit -s "import triton"
    "triton.cdiv(65536, 64)"` on an x86 host), paid for every grid of every launch."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for launchers (0 for 0), without its per-call overhead."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def is_interpreted(kernel) -> bool:
    """Whether `kernel` (a `@triton.jit` function) was built for the Triton interpreter."""
    return isinstance(kernel, InterpretedFunction)


def kernel_runs_on(kernel, device: torch.device) -> bool:
    """Whether `kernel` can run on tensors of `device`: CUDA when compiled; CPU when it and
    Triton's own library functions (tl.max, tl.sum, ...) are interpreted. The library is
    built once, when Triton is first imported: a kernel module imported after
    TRITON_INTERPRET=1 was set, in a process that imported Triton before, has interpreted
    kernels that cannot call it (the callers then take their PyTorch paths)."""
    if device.type == "cuda":
        return not is_interpreted(kernel)
    return device.type == "cpu" and is_interpreted(kernel) and _library_interpreted()


def _library_interpreted() -> bool:
    import triton.language.standard as standard

    return isinstance(standard.max, InterpretedFunction)


def check_runs_on(kernel, device: torch.device, caller: str, module: str) -> None:
    """Raise a ValueError naming `caller` when `kernel` (from kernel module `module`) cannot
    run on `device`."""
    if not kernel_runs_on(kernel, device):
        raise ValueError(
            f"{caller}: the Triton kernels run on CUDA, or on CPU when TRITON_INTERPRET=1 was set before "
            f"{module} was imported; got device {device} "
            f"(interpreter {'on' if is_interpreted(kernel) else 'off'})"
        )


def launch_with_fewer_stages_if_needed(kernel, grid, *args, num_stages: int, **kwargs) -> None:
    """`kernel[grid](*args, num_stages=num_stages, **kwargs)`; if the compiled kernel needs more
    shared memory than the GPU has (`OutOfResources`, raised while compiling, before anything
    runs), launch again with one stage fewer, down to 1, with one warning per kernel and
    stage count. For launch configurations chosen from estimates rather than compiled."""
    while True:
        try:
            kernel[grid](*args, num_stages=num_stages, **kwargs)
            return
        except OutOfResources as e:
            if num_stages <= 1:
                raise
            name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")
            _warn_once(name, num_stages, e)
            num_stages -= 1


_WARNED: set[tuple[str, int]] = set()


def _warn_once(name: str, num_stages: int, error: Exception) -> None:
    if (name, num_stages) not in _WARNED:
        _WARNED.add((name, num_stages))
        logger.warning("%s: %d pipeline stages do not fit (%s); using %d", name, num_stages, error, num_stages - 1)


def _cuda_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # the current device: the one Triton launches on (PyTorch's allocator aligns to 512 bytes)
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _cpu_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8)


def ensure_scratch_allocator(device: torch.device) -> None:
    """Give Triton an allocator for kernels' global scratch (device-side tensor descriptors,
    `tl.make_tensor_descriptor`, write theirs there) where none is set: Triton keeps it in a
    context variable, so a thread that never set one (autograd's device threads) has none.
    An allocator set by the caller is left as it is. ``device``: the kernel's tensors' device
    type picks CUDA memory (on the current device, where Triton launches) or CPU memory (the
    interpreter)."""
    import triton
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_cuda_scratch if device.type == "cuda" else _cpu_scratch)


def tma_describable(t_MK: torch.Tensor, column_major: bool = False) -> bool:
    """Whether TMA can describe the 2-D ``t_MK`` (row-major, or with ``column_major`` its
    transpose) and its slices of whole rows: no empty side, a unit contiguous stride, a
    16-byte aligned other stride and base pointer. (A column-major slice starting at row r
    is 16-byte aligned only where r * element size is: the fp8 groups' 16-row starts.)"""
    unit, other = (0, 1) if column_major else (1, 0)
    return (min(t_MK.shape) > 0 and t_MK.stride(unit) == 1 and (t_MK.stride(other) * t_MK.element_size()) % 16 == 0
            and t_MK.data_ptr() % 16 == 0)


def row_major_descriptor(t_MK: torch.Tensor, block: list[int]):
    """A host TMA descriptor of the 2-D ``t_MK`` with boxes of ``block``, or None where TMA
    cannot describe it (`tma_describable`, or a box row under TMA's 16 bytes); on CUDA after
    `ensure_cuda_context`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_describable(t_MK) or block[-1] * t_MK.element_size() < 16:
        return None
    if t_MK.is_cuda:
        ensure_cuda_context(t_MK.device.index if t_MK.device.index is not None else torch.cuda.current_device())
    return TensorDescriptor(t_MK, list(t_MK.shape), [t_MK.stride(0), 1], block)


def log_jit_compiles(step_of=lambda: None) -> None:
    """Log each compile of a `@triton.jit` kernel (ours; Inductor compiles its kernels its own
    way): the kernel, its launch options and how each argument was specialized (Triton
    specializes integers on == 1 and on divisibility by 16, pointers on alignment), with the
    trainer step `step_of()` when given. A compile in the middle of training (a new document
    count choosing another launch configuration, an integer argument that first turns
    divisible by 16) costs the host a second or more; this finds which kernel and why."""
    from triton import knobs

    def hook(*, repr, **_kwargs):
        step = step_of()
        logger.warning(f"triton: compiling {repr}" + (f" (step {step})" if step is not None else ""))
        return None  # go on compiling

    knobs.runtime.jit_cache_hook = hook

