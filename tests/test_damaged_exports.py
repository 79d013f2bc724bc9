"""Damaged GGUF, HF and compressed-tensors exports: one clear error each, never a half-loaded model."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.config import ModelConfig
from slimlm.errors import SlimlmError
from slimlm.gguf_export import export_gguf
from slimlm.hf_export import export_hf
from slimlm.models import load_model
from slimlm.pipeline import RunState


def quantized(model, tokenizer, tmp_path):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32))
    return model


def load(path):
    return load_model(ModelConfig(name="exported", path=str(path)), torch.device("cpu"))


def export_compressed_or_skip(model, tokenizer, path):
    pytest.importorskip("compressed_tensors")
    from slimlm.ct_export import export_compressed

    export_compressed(model, tokenizer, path, "float32")


@pytest.mark.parametrize(
    "export",
    [lambda m, t, p: export_hf(m, t, p, "float32"), export_compressed_or_skip],
    ids=["hf", "compressed-tensors"],
)
def test_truncated_or_incomplete_checkpoints_are_refused(tiny_model, tiny_tokenizer, tmp_path, export):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path)
    export(model, tiny_tokenizer, tmp_path / "out")
    assert load(tmp_path / "out").model is not None
    weights = tmp_path / "out" / "model.safetensors"
    tensors = load_file(weights)
    missing = next(key for key in tensors if "layers.1.mlp.down_proj" in key)
    del tensors[missing]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SlimlmError, match="lacks 1 tensors"):
        load(tmp_path / "out")
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(SlimlmError, match="could not load the model"):
        load(tmp_path / "out")


def test_truncated_gguf_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path)
    path = tmp_path / "model.gguf"
    export_gguf(model, tiny_tokenizer, path, "Q4_0")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(SlimlmError, match="not a readable GGUF file"):
        load(path)
