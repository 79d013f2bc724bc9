"""inference/synthetic.random_model: random weights in their stored form, which an artifact and a
GGUF file of the same matrices are written from (bench/decode_sizes_cpu.py)."""

import pytest
import torch

from slimlm.artifact import save_artifact
from slimlm.gguf_export import export_gguf
from slimlm.inference.build import build_decoder
from slimlm.inference.load import load_decoder
from slimlm.inference.synthetic import LINEARS, random_model
from slimlm.qlinear import QuantLinear, QuantScheme

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,  # the tests' tokenizer has 384 ids
    max_position_embeddings=128,
)
INT4_G32 = QuantScheme(bits=4, group_size=32)


@pytest.mark.parametrize(
    "config",
    [dict(SHAPE, model_type="qwen2", tie_word_embeddings=True), dict(SHAPE, model_type="llama")],
    ids=["qwen2-tied-biases", "llama-untied"],
)
def test_random_model_is_stored_form_that_artifact_and_gguf_hold_exactly(config, tiny_tokenizer, tmp_path):
    model, schemes = random_model(config, INT4_G32, INT4_G32)
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)
    assert not any(t.dtype == torch.float32 and t.dim() == 2 for t in tensors)  # no fp32 matrix anywhere
    layers = [f"model.layers.{i}.{name}" for i in range(2) for name in LINEARS]
    assert sorted(schemes) == sorted([*layers, "lm_head"])
    assert all(isinstance(model.get_submodule(name), QuantLinear) for name in schemes)
    save_artifact(model, tiny_tokenizer, tmp_path / "artifact", schemes, source={"id": "random"})
    written = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert written["requantized"] == written["dequantized"] == []
    assert written["rounded"] == ([] if config.get("tie_word_embeddings") else ["model.embed_tokens.weight"])
    loaded, _ = load_decoder(tmp_path / "artifact", dtype=torch.float32)
    built = build_decoder(model, dtype=torch.float32)
    tokens = torch.randint(0, 384, (1, 10), generator=torch.Generator().manual_seed(0))
    for decoder in (loaded, built):
        decoder.setup_cache(1, 16)
    with torch.inference_mode():
        logits = loaded(tokens, 0)
        torch.testing.assert_close(logits, built(tokens, 0), rtol=0, atol=0)
        assert 0.3 < logits.std() < 3  # activations keep their scale through the layers


def test_random_model_refuses_layers_it_does_not_make():
    experts = dict(SHAPE, model_type="olmoe", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="made of dense Llama-family layers only"):
        random_model(experts, INT4_G32)
