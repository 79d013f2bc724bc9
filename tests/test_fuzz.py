"""Hostile input: bench/fuzz.py --quick (seeded mutations of every surface) ends every case
accepted or refused in one line, and the crafted files that once got through are refused."""

import json
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from slimlm.artifact import artifact_tokenizer, load_artifact, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.config import ModelConfig
from slimlm.errors import SlimlmError
from slimlm.inference.load import load_decoder
from slimlm.models import checkpoint_directory, resolve_model, source_sha256
from slimlm.pipeline import RunState
from slimlm.resources import sha256_file
from tests.conftest import REPO


def test_quick_fuzz_run_ends_every_case_accepted_or_refused_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fuzz.py"), "--quick", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "fuzz.json").read_text())
    rows = {row["name"]: row for row in record["rows"]}
    assert set(rows) == {"manifest", "config", "tokenizer", "safetensors", "gguf", "request"}
    assert not record["outcomes"], "\n".join(
        f"{o['surface']} #{o['case']}: {o['mutation']}: {o['detail']}" for o in record["outcomes"]
    )
    for row in rows.values():
        assert (
            row["cases"] == 40 and row["refused"] > 0 and row["failed"] == 0
        )  # every surface's mutations reach a refusal


@pytest.fixture
def artifact(tiny_model, tiny_tokenizer, tmp_path):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=tiny_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=8))
    return save_artifact(
        state.model, state.tokenizer, tmp_path / "artifact", state.schemes, source={"id": "tiny"}
    )


def craft(path, name, edit) -> None:
    """Edit one JSON file of the artifact and re-sign it in the manifest, as a crafted artifact would."""
    document = json.loads((path / name).read_text())
    edit(document)
    (path / name).write_text(json.dumps(document))
    if name == "manifest.json":  # nothing records the manifest's own checksum
        return
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_file(path / name), "bytes": (path / name).stat().st_size}
    (path / "manifest.json").write_text(json.dumps(manifest))


CRAFTED = {
    "a billion layers": (
        "config.json",
        lambda c: c.update(num_hidden_layers=10**9),
        "num_hidden_layers = 1000000000, not a whole number",
    ),
    "a hidden size of a million": (
        "config.json",
        lambda c: c.update(hidden_size=10**6),
        "hidden_size = 1000000",
    ),
    "a boolean head count": (
        "config.json",
        lambda c: c.update(num_attention_heads=False),
        "cannot be read \\(Validation error for field 'num_attention_heads'",
    ),
    "text for a size": ("config.json", lambda c: c.update(vocab_size="384"), "config.json' cannot be read"),
    "an unknown activation": (
        "config.json",
        lambda c: c.update(hidden_act="float64x"),
        "describes no model transformers can build",
    ),
    "a vocabulary entry of the wrong type": (
        "tokenizer.json",
        lambda t: t["model"]["vocab"].update({"the": "x"}),
        "tokenizer files cannot be read",
    ),
    "a special token that is a list": (
        "tokenizer_config.json",
        lambda t: t.update(eos_token=[1, 2]),
        "tokenizer files cannot be read",
    ),
    "the whole model as a quantized module": (
        "manifest.json",
        lambda m: m["modules"].update({"": {"bits": 8, "symmetric": True}}),
        "names module '', which is not a Linear layer",
    ),
    "a scheme's method that is an object": (
        "manifest.json",
        lambda m: next(iter(m["modules"].values())).update(method={}),
        "which slimlm does not write for its shape",
    ),
    "a norm as a quantized module": (
        "manifest.json",
        lambda m: m["modules"].update({"model.norm": {"bits": 8, "symmetric": True}}),
        "names module 'model.norm', which is not a Linear layer",
    ),
}


@pytest.mark.parametrize("case", CRAFTED, ids=str)
def test_a_crafted_artifact_is_refused_in_one_line_by_both_loaders(artifact, case):
    name, edit, message = CRAFTED[case]
    craft(artifact, name, edit)
    for load in (
        load_artifact,
        artifact_tokenizer if name.startswith("tokenizer") else load_decoder,
    ):  # the decoder's caller reads the tokenizer
        started = time.perf_counter()
        with pytest.raises(SlimlmError, match=message):
            load(artifact)
        assert time.perf_counter() - started < 20


def test_a_string_length_past_any_offset_in_a_gguf_header_is_one_line(tmp_path):
    from slimlm.gguf_header import read_gguf_header
    from tests.test_gguf_header import _write_vocab_file

    path = _write_vocab_file(tmp_path / "vocab.gguf", 16)
    data = bytearray(path.read_bytes())
    fourth = data.index(b"t3") - 8  # the length field of the fourth vocabulary string
    data[fourth : fourth + 8] = struct.pack("<Q", 2**64 - 1)
    path.write_bytes(bytes(data))
    with pytest.raises(SlimlmError, match="not a readable GGUF file"):
        read_gguf_header(path)


def test_a_llama_gguf_without_tokenizer_metadata_is_refused_in_one_line(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "bare.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = resolve_model(ModelConfig(name="x", path=str(path)))
    with pytest.raises(SlimlmError, match="GGUF file 'bare.gguf' cannot be converted"):
        checkpoint_directory(source, source_sha256(source))
