"""Host-memory checks on the CPU path: refuse up front what would otherwise end in the OOM killer.

On a GPU, KV sizing measures free device memory (kv_cache). On the CPU nothing stops a
too-large weight load or KV cache until the kernel kills the process, taking the app with it.
"""

import os

HEADROOM = 0.9  # leave a tenth of what is available to the rest of the process and the system


def available_host_memory() -> int | None:
    """Bytes the system can still give out (Linux MemAvailable; elsewhere free pages), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(needed: int, what: str, advice: str) -> None:
    available = available_host_memory()
    if available is not None and needed > available * HEADROOM:
        raise MemoryError(
            f"{what} would take {needed / 2**30:.1f} GiB, but only {available / 2**30:.1f} GiB "
            f"of memory is available; {advice}"
        )
