"""A bounded reader for a GGUF file's key/value header, and nothing else.

Refusing a model or planning its memory needs only a few keys (general.architecture,
`<arch>.context_length`), but gguf's GGUFReader parses every tensor info and builds a Python
object for each of a vocabulary's entries: minutes for a 262k-token vocabulary. This reader walks
the header in place (a memory map), skips array values by arithmetic (a string array costs one
length read per entry, no objects), bounds every count and length against the file size before
using it, then reads the tensor infos (a few hundred short records) only to check that every
tensor's bytes lie inside the file, so a truncated download is refused here, in one line, rather
than deep inside a loader. Tensor data is never read. Damage is one line (SlimlmError).

Layout (little-endian, versions 2 and 3): magic "GGUF", uint32 version, uint64 tensor count,
uint64 key/value count, then per key: string key, uint32 value type, value. A string is a uint64
length and that many UTF-8 bytes; an array is a uint32 item type, a uint64 count and the items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from slimlm.errors import SlimlmError

Scalar = Union[int, float, bool, str]

# GGUF value types: struct format of the fixed-size ones; 8 is a string, 9 an array.
_FIXED = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_KEY = 65535  # the GGUF specification's limit on a key's length
_MAX_DEPTH = 2  # arrays of arrays, at most this deep (llama.cpp writes none)
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class GGUFHeader:
    """What the header says: scalar values by key, and each array's item count."""

    version: int
    tensor_count: int
    metadata: dict[str, Scalar] = field(default_factory=dict)
    arrays: dict[str, int] = field(default_factory=dict)


class _Damaged(Exception):
    """A reason the header cannot be read; turned into one SlimlmError line by the caller."""


class _Cursor:
    """Reads little-endian values from a buffer, never past its end."""

    def __init__(self, buffer, size: int) -> None:
        self.buffer, self.size, self.offset = buffer, size, 0

    def take(self, length: int, what: str) -> int:
        """Advance over `length` bytes (after checking they exist); returns where they start."""
        if length < 0 or length > self.size - self.offset:
            raise _Damaged(
                f"{what} at byte {self.offset} runs {length} bytes "
                f"past the end of the file ({self.size} bytes)"
            )
        start = self.offset
        self.offset += length
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        length = self.unpack("<Q", f"{what} length")
        if limit is not None and length > limit:
            raise _Damaged(f"{what} of {length} bytes is longer than {limit}")
        start = self.take(length, what)
        try:
            return bytes(self.buffer[start : start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} at byte {start} is not UTF-8") from None

    def skip_array(self, item_type: int, count: int, what: str, depth: int) -> None:
        """Move past `count` items without building them: fixed sizes by arithmetic, strings
        by their lengths."""
        if item_type in _FIXED:
            self.take(count * struct.calcsize(_FIXED[item_type]), what)
        elif item_type == _STRING:
            if count * 8 > self.size - self.offset:
                raise _Damaged(f"{what} claims {count} strings, more than the file can hold")
            self.offset = _skip_strings(self.buffer, self.offset, self.size, count, what)
        elif item_type == _ARRAY and depth < _MAX_DEPTH:
            if count * 12 > self.size - self.offset:
                raise _Damaged(f"{what} claims {count} arrays, more than the file can hold")
            for _ in range(count):
                inner = self.unpack("<I", what)
                self.skip_array(inner, self.unpack("<Q", what), what, depth + 1)
        else:
            raise _Damaged(f"{what} has unknown item type {item_type}")


_LENGTH = struct.Struct("<Q")


def _skip_strings(buffer, offset: int, size: int, count: int, what: str) -> int:
    """The offset after `count` length-prefixed strings: the hot loop of a 262k-entry vocabulary, one
    unpack per entry. A length that jumps past the end makes the next unpack fail (struct.error), and
    the last one is checked after the loop, so nothing is ever read beyond the file."""
    unpack = _LENGTH.unpack_from
    try:
        for _ in range(count):
            offset += 8 + unpack(buffer, offset)[0]
    except (
        struct.error,
        OverflowError,
    ):  # OverflowError: a huge length took the offset past what unpack takes
        offset = size + 1
    if offset > size:
        raise _Damaged(f"{what} of {count} strings runs past the end of the file ({size} bytes)")
    return offset


def read_gguf_header(path: Path) -> GGUFHeader:
    """The key/value header of the GGUF file at `path`; tensor infos and data are never read."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = path.stat().st_size
            if size < 24:
                raise _Damaged(f"only {size} bytes, too short for a GGUF header")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
                return _parse(_Cursor(buffer, size))
    except _Damaged as damage:
        raise SlimlmError(
            f"'{path.name}' is not a readable GGUF file ({damage}); re-download or re-export it"
        ) from None
    except OSError as error:
        raise SlimlmError(f"cannot read GGUF file '{path}': {error.strerror or error}") from None


def _parse(cursor: _Cursor) -> GGUFHeader:
    if bytes(cursor.buffer[cursor.take(4, "magic") : 4]) != b"GGUF":
        raise _Damaged("no GGUF magic at its start")
    version = cursor.unpack("<I", "version")
    if version not in (2, 3):
        raise _Damaged(f"GGUF version {version}; versions 2 and 3 (little-endian) are read")
    tensor_count = cursor.unpack("<Q", "tensor count")
    kv_count = cursor.unpack("<Q", "key/value count")
    if (
        kv_count * 13 > cursor.size or tensor_count * 32 > cursor.size
    ):  # the smallest key/value and tensor info
        raise _Damaged(
            f"it claims {kv_count} keys and {tensor_count} tensors, "
            f"more than its {cursor.size} bytes can hold"
        )
    header = GGUFHeader(version, tensor_count)
    for index in range(kv_count):
        key = cursor.string(f"key {index}", _MAX_KEY)
        value_type = cursor.unpack("<I", f"type of '{key}'")
        if value_type in _FIXED:
            header.metadata[key] = cursor.unpack(_FIXED[value_type], f"value of '{key}'")
        elif value_type == _STRING:
            header.metadata[key] = cursor.string(f"value of '{key}'")
        elif value_type == _ARRAY:
            item_type = cursor.unpack("<I", f"item type of '{key}'")
            count = cursor.unpack("<Q", f"length of '{key}'")
            cursor.skip_array(item_type, count, f"array '{key}'", 1)
            header.arrays[key] = count
        else:
            raise _Damaged(f"key '{key}' has unknown value type {value_type}")
    _check_tensor_extents(cursor, tensor_count, header.metadata.get("general.alignment", 32))
    return header


def _check_tensor_extents(cursor: _Cursor, tensor_count: int, alignment) -> None:
    """Every tensor's bytes (its offset and ggml type's size) end inside the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if not isinstance(alignment, int) or alignment < 1 or alignment > 1 << 20:
        raise _Damaged(f"general.alignment {alignment!r} is not a sensible alignment")
    extents = []
    for index in range(tensor_count):
        name = cursor.string(f"name of tensor {index}", _MAX_KEY)
        dims = cursor.unpack("<I", f"dimensions of '{name}'")
        if dims > _MAX_DIMS:
            raise _Damaged(f"tensor '{name}' claims {dims} dimensions")
        shape = [cursor.unpack("<Q", f"shape of '{name}'") for _ in range(dims)]
        kind = cursor.unpack("<I", f"type of '{name}'")
        offset = cursor.unpack("<Q", f"offset of '{name}'")
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except ValueError:
            raise _Damaged(f"tensor '{name}' has unknown ggml type {kind}") from None
        elements = 1
        for extent in shape:
            elements *= extent
        extents.append((name, offset + elements // block * size))
    data_start = -(-cursor.offset // alignment) * alignment
    for name, end in extents:
        if data_start + end > cursor.size:
            raise _Damaged(
                f"tensor '{name}' ends at byte {data_start + end}, "
                f"past the end of the file ({cursor.size} bytes): it was cut short"
            )
