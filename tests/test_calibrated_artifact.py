"""GPTQ and AWQ of a checkpoint, a block at a time, straight into an artifact (compress/calibrated_artifact.py)."""

import json

import pytest
import torch

from slimlm.artifact import load_artifact, save_artifact
from slimlm.compress.calibrated_artifact import SPILL, calibrate_into_artifact, targets_outside_blocks
from slimlm.compress.quantize import QuantizeParams, run as quantize
from slimlm.pipeline import RunState
from slimlm.shards import INDEX
from tests.conftest import build_tiny_llama
from tests.tiny_families import build_tiny

SAMPLES = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))
SOURCE = {"id": "tiny", "kind": "hf-dir", "sha256": None}


def checkpoint(directory, model, tokenizer):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_the_artifact_equals_the_one_the_in_memory_path_saves(tmp_path, tiny_tokenizer, method):
    params = QuantizeParams(method=method, bits=4, group_size=16, samples=4, seq_len=32, awq_grid=4, awq_clip_grid=4)
    source = checkpoint(tmp_path / "checkpoint", build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False), tiny_tokenizer)
    made = calibrate_into_artifact(source, tmp_path / "disk", params, SAMPLES, SOURCE, max_shard_bytes=60_000)

    state = RunState(cfg=None, run_dir=None, model=build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False), tokenizer=None, source=None, source_sha256=None, device=torch.device("cpu"))
    state.memo["calibration_ids"] = SAMPLES.flatten()
    quantize(state, params)
    save_artifact(state.model, tiny_tokenizer, tmp_path / "memory", state.schemes, SOURCE)

    disk, memory = (load_artifact(tmp_path / name) for name in ("disk", "memory"))
    a, b = disk.model.state_dict(), memory.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert disk.manifest["modules"] == memory.manifest["modules"] and len(disk.manifest["modules"]) == 21
    assert disk.manifest["size"]["weights_accounted_bytes"] == memory.manifest["size"]["weights_accounted_bytes"]
    assert (tmp_path / "disk" / INDEX).is_file() and not (tmp_path / "disk" / SPILL).exists()
    assert not any(path.name.startswith(".") for path in tmp_path.iterdir())  # no staging left behind
    assert made.calibration.quantized_layers == 21 and len(made.calibration.weight_rel_error) == 21


def test_experts_no_token_reached_are_rounded_and_say_so(tmp_path, tiny_tokenizer):
    source = checkpoint(tmp_path / "checkpoint", build_tiny("qwen3_moe", 384, split=False), tiny_tokenizer)
    params = QuantizeParams(method="gptq", bits=4, group_size=16, samples=1, seq_len=4)
    made = calibrate_into_artifact(source, tmp_path / "artifact", params, SAMPLES[:1, :4], SOURCE, dtype=torch.bfloat16)
    modules = json.loads((tmp_path / "artifact" / "manifest.json").read_text())["modules"]
    rounded = {name for name, record in modules.items() if record["method"] == "rtn"}
    assert rounded and rounded == set(made.calibration.report["uncalibrated_layers"])
    loaded = load_artifact(tmp_path / "artifact").model
    logits = loaded(input_ids=SAMPLES[:1]).logits
    assert torch.isfinite(logits).all()


def test_layers_outside_the_blocks_are_named(tmp_path, tiny_tokenizer):
    source = checkpoint(tmp_path / "checkpoint", build_tiny_llama(384, tie_word_embeddings=False), tiny_tokenizer)
    assert targets_outside_blocks(source, QuantizeParams(method="gptq")) == []
    assert targets_outside_blocks(source, QuantizeParams(method="gptq", targets=[r"model\.layers\.\d+\..*", "lm_head"])) == ["lm_head"]
