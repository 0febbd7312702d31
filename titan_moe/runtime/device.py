"""Make torchtitan 0.2.2 device-aware, so the same trainer runs on CPU (gloo) and CUDA (nccl).

torchtitan picks its device once, at import time, in `torchtitan.tools.utils`:
`device_type = _get_available_device_type() or "cuda"`. On a CPU-only torch that falls
back to "cuda", so `torch.cuda.set_device` fails, the memory monitor calls CUDA-only
functions and the process group asks for nccl. Several torchtitan modules copy the two
globals with `from torchtitan.tools.utils import device_type, device_module`, so we
rebind the names in each of those modules rather than copying the trainer.

`CPUDeviceModule` adds to `torch.cpu` the few functions torchtitan calls on a device
module (name, capacity, memory stats); memory on CPU is the process's resident set.
On CPU, `torch.profiler.profile` also learns to skip the missing accelerator activity that
torchtitan's profiler setup passes as None, and the peak FLOP/s behind MFU is infinite (MFU
reads 0) instead of an A100's found after a failed `lspci`.
"""

from __future__ import annotations

import importlib
import os
import platform
import resource
import sys
import types

import torch

# torchtitan modules that bind `device_type` / `device_module` at import time.
_TORCHTITAN_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1


class _CPUProperties(types.SimpleNamespace):
    pass


def _make_cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("titan_moe_cpu_device")
    mod.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    mod.set_device = lambda device=None: None
    mod.current_device = lambda: 0
    mod.synchronize = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.get_device_name = lambda device=None: f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    mod.get_device_properties = lambda device=None: _CPUProperties(total_memory=_total_memory_bytes())
    mod.memory_stats = lambda device=None: {
        "allocated_bytes.all.peak": _peak_rss_bytes(),
        "active_bytes.all.peak": _peak_rss_bytes(),
        "reserved_bytes.all.peak": _peak_rss_bytes(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    return mod


CPUDeviceModule = _make_cpu_device_module()


def accelerator_type() -> str:
    """'cuda' (or another accelerator torch sees) when available, else 'cpu'."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        assert acc is not None
        return acc.type
    return "cpu"


class _ProfileSkippingMissingDevice(torch.profiler.profile):
    """torch.profiler.profile that ignores `None` in `activities`.

    torchtitan's `maybe_enable_profiling` lists `[CPU, <accelerator activity or None>]`;
    torch 2.13 rejects the None on a CPU-only machine.
    """

    def __init__(self, *args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        super().__init__(*args, activities=activities, **kwargs)


def configure_torchtitan_device() -> str:
    """Rebind torchtitan's device globals to the device this process will use; return its type.

    Idempotent. With an accelerator present nothing changes (torchtitan's default is right).
    """
    device_type = accelerator_type()
    if device_type != "cpu":
        return device_type
    for name in _TORCHTITAN_DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = CPUDeviceModule
    torch.profiler.profile = _ProfileSkippingMissingDevice
    # torchtitan runs lspci and falls back to an A100's peak (with two warnings) for MFU; a CPU
    # has no peak in its table: MFU reads 0 on the CPU.
    importlib.import_module("torchtitan.tools.utils").get_peak_flops = _no_peak_flops
    return device_type


def _no_peak_flops(device_name: str) -> float:
    return float("inf")
