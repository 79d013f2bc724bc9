"""Run directories: the status file, atomic writes, and the machine a run happened on.

`status.json` says whether a run directory holds a finished result: it is written as
"running" before any work and becomes "complete" only after the report is in place, so an
interrupted or failed run never looks complete. A "running" status names its process (`pid`):
one whose process is gone was killed where no handler could run (kill -9, a power loss).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from slimlm.errors import SlimlmError

STATUS = "status.json"


@functools.cache
def _umask() -> int:
    """The process's file-creation mask, read once (reading it means setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_created(path: str | Path, directory: bool = False) -> None:
    """Give a file or directory made by tempfile (private: 0600 / 0700) the permissions that
    open() or mkdir() would have given it, so that exports are readable as other outputs are
    (a llama.cpp server or Ollama running as another user)."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


@contextmanager
def _replaced_on_success(path: Path) -> Iterator[str]:
    """A temporary file beside `path` to write; renamed to `path` when the block succeeds,
    removed when it fails, so a reader sees the whole file or none."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    as_created(temp)
    try:
        yield temp
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    with _replaced_on_success(path) as temp, open(temp, "w") as handle:
        handle.write(text)


def save_tensors_atomic(path: Path, tensors: dict, metadata: Optional[dict[str, str]] = None) -> None:
    """A safetensors file written via a temporary file and a rename: whole or not at all."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with _replaced_on_success(path) as temp:
        save_file(tensors, temp, metadata=metadata)


def load_cached_tensors(path: Path, what: str, names: tuple[str, ...]) -> Optional[dict[str, torch.Tensor]]:
    """The tensors of the cache file `path`, or None where it is absent, unreadable or lacks one of
    `names` (a warning naming `what`): a damaged cache entry is computed again, never trusted."""
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        tensors = load_file(path)
    except Exception as error:
        logging.getLogger("slimlm").warning("ignoring the damaged %s '%s' (%s)", what, path, error)
        return None
    missing = [name for name in names if name not in tensors]
    if missing:
        logging.getLogger("slimlm").warning(
            "ignoring the damaged %s '%s' (no %s)", what, path, ", ".join(missing)
        )
        return None
    return tensors


@contextmanager
def staged_directory(path: Path, what: str = "exports") -> Iterator[Path]:
    """A hidden staging directory beside `path`, renamed to `path` when the block succeeds and
    removed when it fails: a directory at `path` is always complete. An existing `path` is
    refused, never overwritten."""
    path = Path(path)
    if path.exists():
        raise SlimlmError(
            f"'{path}' already exists; {what} are never overwritten: choose another name or remove it"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_abandoned_staging(path)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-partial-{os.getpid()}-", dir=path.parent))
    as_created(staging, directory=True)
    try:
        yield staging
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def sweep_abandoned_staging(path: Path) -> None:
    """Remove the staging directories for `path` that a killed process left behind (their name
    holds the writer's process id, and no such process runs), saying so."""
    for staging in path.parent.glob(f".{glob.escape(path.name)}-partial-*"):
        owner = staging.name[len(path.name) + len(".-partial-") :].split("-", 1)[0]
        if owner.isdigit() and not process_alive(int(owner)) and staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
            logging.getLogger("slimlm").warning(
                "removed '%s', the unfinished output of an interrupted run (process %s)", staging, owner
            )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def directory_bytes(path: Path) -> int:
    """Bytes of the files directly in `path` (an export directory)."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def claim_run_dir(run_dir: Path) -> bool:
    """Mark `run_dir` as this process's running run. Refused while another live process's run
    is "running" there (two runs would mix their outputs); an earlier run whose process is gone
    was killed before it could say so, which is logged, and this run takes the directory over.
    Returns True when the directory held an unfinished run (killed, or failed): this run
    resumes it, replacing its outputs and going on from what it kept to resume from."""
    previous = read_status(run_dir)
    pid = previous.get("pid")
    unfinished = previous.get("status") == "failed"
    if previous.get("status") == "running" and type(pid) is int and pid > 0 and pid != os.getpid():
        if process_alive(pid):
            raise SlimlmError(
                f"'{run_dir}' is in use by a run still going (process {pid}); "
                "wait for it to end, or give this run another hydra.run.dir"
            )
        logging.getLogger("slimlm").warning(
            "'%s' held a run that was killed before it could "
            "end (process %s, started %s); this run replaces it",
            run_dir,
            pid,
            previous.get("time_utc"),
        )
        unfinished = True
    write_status(run_dir, "running")
    return unfinished


def read_status(run_dir: Path) -> dict[str, Any]:
    """`run_dir`'s status record; empty when there is none or it cannot be read."""
    try:
        record = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_status(run_dir: Path, status: str, error: Optional[str] = None) -> None:
    record: dict[str, Any] = {
        "status": status,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if status == "running":
        record["pid"] = os.getpid()
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
