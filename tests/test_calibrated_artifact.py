"""GPTQ and AWQ of a checkpoint, a block at a time, straight into an artifact
(compress/calibrated_artifact.py)."""

import json

import pytest
import torch

from slimlm.artifact import load_artifact, save_artifact
from slimlm.compress.calibrated_artifact import calibrate_into_artifact, targets_outside_blocks
from slimlm.compress.quantize import CalibratedQuantizer, QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
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
    params = QuantizeParams(
        method=method, bits=4, group_size=16, samples=4, seq_len=32, awq_grid=4, awq_clip_grid=4
    )
    source = checkpoint(
        tmp_path / "checkpoint",
        build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False),
        tiny_tokenizer,
    )
    made = calibrate_into_artifact(
        source, tmp_path / "disk", tmp_path / "disk-blocks", params, SAMPLES, SOURCE, max_shard_bytes=60_000
    )

    state = RunState(
        cfg=None,
        run_dir=None,
        model=build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False),
        tokenizer=None,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    state.memo.calibration_ids = SAMPLES.flatten()
    quantize(state, params)
    save_artifact(state.model, tiny_tokenizer, tmp_path / "memory", state.schemes, SOURCE)

    disk, memory = (load_artifact(tmp_path / name) for name in ("disk", "memory"))
    a, b = disk.model.state_dict(), memory.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert disk.manifest["modules"] == memory.manifest["modules"] and len(disk.manifest["modules"]) == 21
    assert (
        disk.manifest["size"]["weights_accounted_bytes"] == memory.manifest["size"]["weights_accounted_bytes"]
    )
    assert (tmp_path / "disk" / INDEX).is_file() and (
        tmp_path / "disk-blocks" / "block-2.json"
    ).is_file()  # kept: the caller removes it
    assert not any(path.name.startswith(".") for path in tmp_path.iterdir())  # no staging left behind
    assert made.calibration.quantized_layers == 21 and len(made.calibration.weight_rel_error) == 21


def test_experts_no_token_reached_are_rounded_and_say_so(tmp_path, tiny_tokenizer):
    source = checkpoint(tmp_path / "checkpoint", build_tiny("qwen3_moe", 384, split=False), tiny_tokenizer)
    params = QuantizeParams(method="gptq", bits=4, group_size=16, samples=1, seq_len=4)
    made = calibrate_into_artifact(
        source,
        tmp_path / "artifact",
        tmp_path / "blocks",
        params,
        SAMPLES[:1, :4],
        SOURCE,
        dtype=torch.bfloat16,
    )
    modules = json.loads((tmp_path / "artifact" / "manifest.json").read_text())["modules"]
    rounded = {name for name, record in modules.items() if record["method"] == "rtn"}
    assert rounded and rounded == set(made.calibration.report()["uncalibrated_layers"])
    loaded = load_artifact(tmp_path / "artifact").model
    logits = loaded(input_ids=SAMPLES[:1]).logits
    assert torch.isfinite(logits).all()


def test_layers_outside_the_blocks_are_named(tmp_path, tiny_tokenizer):
    source = checkpoint(
        tmp_path / "checkpoint", build_tiny_llama(384, tie_word_embeddings=False), tiny_tokenizer
    )
    assert targets_outside_blocks(source, QuantizeParams(method="gptq")) == []
    assert targets_outside_blocks(
        source, QuantizeParams(method="gptq", targets=[r"model\.layers\.\d+\..*", "lm_head"])
    ) == ["lm_head"]


class Killed(Exception):
    pass


def test_a_killed_calibration_resumes_at_its_first_unfinished_block_and_ends_the_same(
    tmp_path, tiny_tokenizer, monkeypatch
):
    params = QuantizeParams(method="gptq", bits=4, group_size=16, samples=4, seq_len=32)
    source = checkpoint(
        tmp_path / "checkpoint",
        build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False),
        tiny_tokenizer,
    )
    whole = calibrate_into_artifact(
        source, tmp_path / "whole", tmp_path / "whole-blocks", params, SAMPLES, SOURCE
    )

    finish = CalibratedQuantizer.__call__
    calibrated = []

    def killed_at_the_last_block(self, block, names):
        calibrated.append(block)
        if block == "model.layers.2" and len(calibrated) == 3:
            raise Killed
        finish(self, block, names)

    monkeypatch.setattr(CalibratedQuantizer, "__call__", killed_at_the_last_block)
    with pytest.raises(Killed):
        calibrate_into_artifact(source, tmp_path / "resumed", tmp_path / "blocks", params, SAMPLES, SOURCE)
    progress = tmp_path / "blocks"
    assert not (tmp_path / "resumed").exists() and sorted(
        path.name for path in progress.glob("block-*.json")
    ) == ["block-0.json", "block-1.json"]

    with pytest.raises(
        SlimlmError, match="another calibration .*settings"
    ):  # other settings never mix with these blocks
        calibrate_into_artifact(
            source,
            tmp_path / "resumed",
            progress,
            QuantizeParams(method="gptq", bits=4, group_size=32, samples=4, seq_len=32),
            SAMPLES,
            SOURCE,
        )

    resumed = calibrate_into_artifact(source, tmp_path / "resumed", progress, params, SAMPLES, SOURCE)
    assert calibrated == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "model.layers.2",
    ]  # the rerun calibrated the last block only
    a, b = (load_artifact(tmp_path / name).model.state_dict() for name in ("whole", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    manifests = [
        json.loads((tmp_path / name / "manifest.json").read_text())["modules"]
        for name in ("whole", "resumed")
    ]
    assert manifests[0] == manifests[1] and len(manifests[0]) == 21
    assert resumed.calibration.weight_rel_error == whole.calibration.weight_rel_error and list(
        resumed.calibration.block_seconds
    ) == [f"model.layers.{i}" for i in range(3)]
