"""Peak memory of a block of work: torch's CUDA allocations on a GPU, the process's resident
set on a CPU. Shared by speed measurements and by calibration, which states its peak."""

from __future__ import annotations

import ctypes
import gc
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from slimlm.errors import SlimlmError

PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass
class PeakMemory:
    kind: str  # "rss" or "cuda_allocated"
    bytes: int = 0  # filled in when the measured block ends


def peak_memory(device: torch.device):
    """A context manager yielding a PeakMemory that holds the block's peak memory when it ends.

    CUDA: the peak of torch's allocations (`max_memory_allocated` after resetting the peak).
    Elsewhere, the process's peak resident set size. On Linux we reset the kernel's own peak
    (VmHWM, via /proc/self/clear_refs) and read it afterwards: exact, free, and it misses no
    short-lived allocation. Where that is not possible a thread samples RSS every millisecond,
    which costs a little CPU and can miss peaks shorter than that.
    """
    if device.type == "cuda":
        return _cuda_peak(device)
    return _kernel_peak_rss() if _reset_kernel_peak_rss() else _sampled_peak_rss()


@contextmanager
def _cuda_peak(device: torch.device) -> Iterator[PeakMemory]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    peak = PeakMemory("cuda_allocated")
    yield peak
    torch.cuda.synchronize(device)
    peak.bytes = torch.cuda.max_memory_allocated(device)


def _reset_kernel_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS; False where the kernel does not allow it (not Linux)."""
    try:
        PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@contextmanager
def _kernel_peak_rss() -> Iterator[PeakMemory]:
    peak = PeakMemory("rss")
    yield peak
    line = next(line for line in PROC_STATUS.read_text().splitlines() if line.startswith("VmHWM:"))
    peak.bytes = int(line.split()[1]) * 1024  # reported in kB


@contextmanager
def _sampled_peak_rss(interval_s: float = 0.001) -> Iterator[PeakMemory]:
    try:
        import psutil
    except ImportError:
        raise SlimlmError(
            "measuring peak memory on this system needs psutil: run `pip install psutil`"
        ) from None
    process = psutil.Process()
    peak = PeakMemory("rss", process.memory_info().rss)
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            peak.bytes = max(peak.bytes, process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()
    peak.bytes = max(peak.bytes, process.memory_info().rss)


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the operating system (glibc's malloc_trim).

    torch frees a stage's CPU tensors into the heap, where glibc keeps most of them: a stage
    that read an artifact a part at a time would leave its whole size counted in the process's
    resident set while the next stage allocates its own. Elsewhere than glibc, nothing to do."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)
