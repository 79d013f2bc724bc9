"""Streaming RTN of a checkpoint (compress/stream_rtn.py) writes the artifact the in-memory path writes."""

import pytest
import torch

from slimlm.artifact import load_artifact, read_manifest, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.compress.stream_rtn import stream_rtn
from slimlm.errors import SlimlmError
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantScheme
from tests.conftest import build_tiny_llama

TARGETS = [r"model\.layers\.\d+\..*", "lm_head"]


def saved_checkpoint(directory, tokenizer, tie: bool, dtype=torch.float32):
    model = build_tiny_llama(len(tokenizer), tie_word_embeddings=tie, initializer_range=0.2).to(dtype)
    model.save_pretrained(directory, max_shard_size="60KB")
    tokenizer.save_pretrained(directory)
    return model


@pytest.mark.parametrize(
    ("tie", "dtype", "params"),
    [
        (True, torch.float32, dict(bits=4, group_size=32)),
        (False, torch.float32, dict(bits=8, symmetric=False)),
        (False, torch.bfloat16, dict(bits=3, group_size=16)),
    ],
    ids=["tied-w4", "untied-w8-asym", "untied-bf16-w3"],
)
def test_streamed_artifact_equals_the_in_memory_one(
    tmp_path, tiny_tokenizer, tie, dtype, params, monkeypatch
):
    import slimlm.compress.stream_rtn

    monkeypatch.setattr(
        slimlm.compress.stream_rtn, "ROUND_CHUNK_BYTES", 4 * 64 * 7
    )  # runs of 7 rows: the last one short
    model = saved_checkpoint(tmp_path / "checkpoint", tiny_tokenizer, tie, dtype)
    streamed = stream_rtn(
        tmp_path / "checkpoint",
        tmp_path / "streamed",
        QuantScheme(**params),
        TARGETS,
        ignore=[r".*\.k_proj"],
        max_shard_bytes=30_000,
    ).path
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(method="rtn", targets=TARGETS, ignore=[r".*\.k_proj"], **params))
    in_memory = save_artifact(
        state.model, tiny_tokenizer, tmp_path / "in-memory", state.schemes, source={"id": "tiny"}
    )
    a, b = read_manifest(streamed), read_manifest(in_memory)
    assert len([name for name in a["files"] if name.startswith("model-")]) > 2
    assert a["modules"] == b["modules"] and a["tied_word_embeddings"] == b["tied_word_embeddings"] == tie
    assert a["size"]["weights_accounted_bytes"] == b["size"]["weights_accounted_bytes"]
    assert a["dtype"] == b["dtype"] and a["tensor_dtypes"] == b["tensor_dtypes"]
    loaded, reference = load_artifact(streamed), load_artifact(in_memory)
    expected = reference.model.state_dict()
    assert loaded.model.state_dict().keys() == expected.keys()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert loaded.tokenizer("hello world")["input_ids"] == tiny_tokenizer("hello world")["input_ids"]


def test_a_scheme_a_layer_cannot_take_is_refused_before_writing(tmp_path, tiny_tokenizer):
    saved_checkpoint(tmp_path / "checkpoint", tiny_tokenizer, tie=True)
    with pytest.raises(SlimlmError, match="cannot quantize model.layers.0.self_attn.q_proj: group size 48"):
        stream_rtn(tmp_path / "checkpoint", tmp_path / "out", QuantScheme(bits=4, group_size=48), TARGETS)
    with pytest.raises(SlimlmError, match="matches no Linear module"):
        stream_rtn(
            tmp_path / "checkpoint",
            tmp_path / "out",
            QuantScheme(bits=4, group_size=32),
            [r"model\.blocks\..*"],
        )
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_a_tensor_its_config_needs_is_refused(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file, save_file

    model = build_tiny_llama(len(tiny_tokenizer))
    directory = tmp_path / "checkpoint"
    model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SlimlmError, match="has no tensor model.layers.1.post_attention_layernorm.weight"):
        stream_rtn(directory, tmp_path / "out", QuantScheme(bits=8), TARGETS)


def test_a_moe_checkpoint_streams_per_expert(tmp_path, tiny_tokenizer):
    from slimlm.experts import split_experts
    from tests.tiny_families import build_tiny

    model = build_tiny("qwen3_moe", len(tiny_tokenizer), split=False)  # as transformers writes it
    model.save_pretrained(tmp_path / "checkpoint")
    tiny_tokenizer.save_pretrained(tmp_path / "checkpoint")
    targets = [r"model\.layers\.\d+\.(self_attn|mlp\.experts)\..*"]
    streamed = load_artifact(
        stream_rtn(
            tmp_path / "checkpoint", tmp_path / "streamed", QuantScheme(bits=4, group_size=16), targets
        ).path
    )
    assert "model.layers.0.mlp.experts.3.down_proj" in streamed.manifest["modules"]
    split_experts(model)
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(method="rtn", bits=4, group_size=16, targets=targets))
    ids = torch.randint(0, len(tiny_tokenizer), (1, 10))
    with torch.no_grad():
        assert torch.equal(streamed.model(ids).logits, state.model(ids).logits)
