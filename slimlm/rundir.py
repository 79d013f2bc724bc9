"""Run directories: the status file, atomic writes, and the machine a run happened on.

`status.json` says whether a run directory holds a finished result: it is written as
"running" before any work and becomes "complete" only after the report is in place, so an
interrupted or failed run never looks complete.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

STATUS = "status.json"


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temp, path)


@contextmanager
def staged_directory(path: Path, what: str = "exports") -> Iterator[Path]:
    """A hidden staging directory beside `path`, renamed to `path` when the block succeeds and
    removed when it fails: a directory at `path` is always complete. An existing `path` is
    refused, never overwritten."""
    from slimlm.errors import SlimlmError

    path = Path(path)
    if path.exists():
        raise SlimlmError(f"'{path}' already exists; {what} are never overwritten: choose another name or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-partial-", dir=path.parent))
    try:
        yield staging
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def directory_bytes(path: Path) -> int:
    """Bytes of the files directly in `path` (an export directory)."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def write_status(run_dir: Path, status: str, error: Optional[str] = None) -> None:
    record = {"status": status, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if error:
        record["error"] = error
    write_atomic(run_dir / STATUS, json.dumps(record, indent=2) + "\n")


def last_level_cache_bytes() -> Optional[int]:
    """The size of the processor's largest cache (Linux), None where unknown. A quantized small
    model can fit in it, and then decodes faster than memory bandwidth alone allows."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
    return max(sizes, default=None)


def machine_info(query_gpu: bool = True) -> dict[str, Any]:
    """The machine a result came from. query_gpu=False leaves out the GPU's name: asking creates
    a CUDA context, whose memory a benchmark's child processes would then count as theirs."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "last_level_cache_bytes": last_level_cache_bytes(),
    }
    if query_gpu:
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info
