import pytest
import torch

from slimlm.compress.quantize import QuantizeParams, run as quantize
from slimlm.errors import SlimlmError
from slimlm.gguf_export import _permute_rows, _rotary_heads, export_gguf
from slimlm.pipeline import RunState

gguf = pytest.importorskip("gguf")
EVERYTHING = [r"model\.layers\.\d+\..*", "lm_head"]


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(cfg=None, run_dir=tmp_path, model=model, tokenizer=tokenizer, source=None, source_sha256=None, device=torch.device("cpu"))
    quantize(state, QuantizeParams(**params))
    return model


def read_back(path):
    """Every tensor of the GGUF file dequantized by the gguf package, by llama.cpp name."""
    reader = gguf.GGUFReader(path)
    return {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(*reversed([int(n) for n in t.shape])) for t in reader.tensors}


@pytest.mark.parametrize(("gguf_type", "params"), [
    ("Q4_0", {"bits": 4, "group_size": 32}),
    ("Q8_0", {"bits": 8, "group_size": 32}),
    ("Q4_1", {"bits": 4, "group_size": 32, "symmetric": False}),
])
def test_weights_on_the_gguf_grid_are_written_exactly(tiny_model, tiny_tokenizer, tmp_path, gguf_type, params):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, targets=EVERYTHING, **params)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", gguf_type)
    assert not summary["requantized"] and "model.layers.1.self_attn.k_proj.weight" in summary["exact"]
    tensors = read_back(tmp_path / "model.gguf")
    config = model.config
    for layer in range(config.num_hidden_layers):
        for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("mlp.down_proj", "ffn_down")):
            name = f"model.layers.{layer}.{ours}"
            expected = _permute_rows(model.get_submodule(name).dequantize(), _rotary_heads(name + ".weight", config))
            if gguf_type == "Q4_1":  # the minimum d * zero is stored in fp16: exact codes, a rounded offset
                torch.testing.assert_close(tensors[f"blk.{layer}.{theirs}.weight"], expected, rtol=0, atol=2e-3 * expected.abs().max().item())
            else:
                assert torch.equal(tensors[f"blk.{layer}.{theirs}.weight"], expected), name
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    assert torch.equal(tensors["output_norm.weight"], model.model.norm.weight.detach())


def test_transformers_loads_the_export_with_the_same_logits_and_tokenizer(tiny_model, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = quantized(tiny_model, tiny_tokenizer, tmp_path, targets=EVERYTHING, bits=4, group_size=32)
    export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    text = "It was the best of times, it was the worst of times."
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_fewer_bits_on_the_same_grid_are_exact(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=3, group_size=32)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert "model.layers.0.mlp.up_proj.weight" in summary["exact"] and not summary["requantized"]
    assert summary["rounded"] == ["model.embed_tokens.weight"]  # the float embedding, as llama.cpp's converter rounds it
    assert torch.equal(read_back(tmp_path / "model.gguf")["blk.0.ffn_up.weight"], model.model.layers[0].mlp.up_proj.dequantize())


def test_layers_off_the_grid_are_refused_unless_requantizing_is_allowed(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=16)
    with pytest.raises(SlimlmError, match=r"GGUF Q4_0 cannot hold 14 quantized layer\(s\) .*int4, groups of 16, symmetric.*requantize=true"):
        export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert not any(tmp_path.iterdir())
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0", requantize=True)
    assert not summary["exact"] and len(summary["requantized"]) == 14


def test_existing_files_and_unknown_types_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    (tmp_path / "model.gguf").write_text("keep me")
    with pytest.raises(SlimlmError, match="never overwritten"):
        export_gguf(tiny_model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert (tmp_path / "model.gguf").read_text() == "keep me"
    with pytest.raises(SlimlmError, match="unknown GGUF type 'Q3_X'"):
        export_gguf(tiny_model, tiny_tokenizer, tmp_path / "other.gguf", "Q3_X")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # nothing half-written


def test_float_files_hold_dequantized_layers(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=3, group_size=16)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "F32")
    assert len(summary["dequantized"]) == 14 and not summary["exact"] and not summary["rounded"]
    assert torch.equal(read_back(tmp_path / "model.gguf")["blk.1.ffn_down.weight"], model.model.layers[1].mlp.down_proj.dequantize())


def test_the_embedding_and_head_can_take_their_own_type(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "mixed.gguf", "Q4_0", head_type="Q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "mixed.gguf").tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q4_0"
    assert summary["head_type"] == "Q8_0" and len(summary["exact"]) == 14
    table = read_back(tmp_path / "mixed.gguf")["token_embd.weight"]
    assert torch.allclose(table, model.model.embed_tokens.weight, atol=2e-2)
    with pytest.raises(SlimlmError, match="unknown GGUF type 'Q5_K'"):
        export_gguf(model, tiny_tokenizer, tmp_path / "other.gguf", "Q4_0", head_type="Q5_K")
