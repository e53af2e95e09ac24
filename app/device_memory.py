"""How much memory a device has free for a model, measured without loading anything: CUDA through torch (only
imported when a GPU is asked about), Apple's MPS, or the CPU's RAM through psutil, /proc/meminfo or sysconf."""

from __future__ import annotations

import os

__all__ = ["GiB", "MiB", "available_memory"]

GiB = 1024**3
MiB = 1024**2


def available_memory(device: str = "auto") -> tuple[str, int]:
    """(description, free bytes) of a device: "auto" (CUDA when present, else CPU), "cuda[:i]", "mps" or "cpu".

    On CUDA the free bytes come from torch.cuda.mem_get_info, plus what this process holds (its model
    is unloaded before another loads there); on CPU from psutil when installed, else
    /proc/meminfo MemAvailable, else os.sysconf. Asking for CUDA without a usable GPU falls back to the CPU with a
    note in the description.
    """
    dev = (device or "auto").strip().lower()
    note = ""
    if dev == "auto" or dev.startswith("cuda"):
        torch = _torch()
        if torch is not None and torch.cuda.is_available():
            index = torch.device(dev).index if dev.startswith("cuda:") else torch.cuda.current_device()
            from engine.runner.kv_cache import process_memory_info

            free, total = process_memory_info(torch.device("cuda", index))
            # What this process holds there is the model serving now, which goes before another loads
            # on the GPU (app/model_host.py): for the next model, it counts as free.
            free += torch.cuda.memory_reserved(index)
            return f"{torch.cuda.get_device_name(index)} ({total / GiB:.1f} GiB)", int(free)
        if dev != "auto":
            note = "; no CUDA GPU found"
    if dev == "mps":
        torch = _torch()
        total, free = _system_memory()
        if torch is not None and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return f"Apple GPU (MPS, {total / GiB:.1f} GiB unified memory)", free
        note = "; MPS is not available"
    elif dev not in ("auto", "cpu") and not dev.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    total, free = _system_memory()
    return f"CPU ({total / GiB:.1f} GiB RAM{note})", free


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _system_memory() -> tuple[int, int]:
    """(total, available) bytes of RAM."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024  # values are in kB
        if "MemAvailable" in info:
            return info.get("MemTotal", info["MemAvailable"]), info["MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return 0, 0
