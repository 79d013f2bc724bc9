import pytest
import torch

from slimlm.compress.quantize import QuantizeParams, run as quantize
from slimlm.errors import SlimlmError
from slimlm.hf_export import export_hf
from slimlm.pipeline import RunState


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(cfg=None, run_dir=tmp_path, model=model, tokenizer=tokenizer, source=None, source_sha256=None, device=torch.device("cpu"))
    quantize(state, QuantizeParams(**params))
    return model


@pytest.mark.parametrize("targets", [[r"model\.layers\.\d+\..*"], [r"model\.layers\.\d+\..*", "lm_head"]], ids=["decoder", "with-tied-head"])
def test_transformers_loads_the_dequantized_export_with_our_logits(tiny_model, tiny_tokenizer, tmp_path, targets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32, targets=targets)
    summary = export_hf(model, tiny_tokenizer, tmp_path / "hf", "float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("hello world")["input_ids"] == tiny_tokenizer("hello world")["input_ids"]
    assert summary["bytes_on_disk"] > 0


def test_half_precision_export_is_half_the_size(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=8)
    full = export_hf(model, tiny_tokenizer, tmp_path / "fp32", "float32")["bytes_on_disk"]
    half = export_hf(model, tiny_tokenizer, tmp_path / "bf16", "bfloat16")["bytes_on_disk"]
    assert half < 0.6 * full
    with pytest.raises(SlimlmError, match="never overwritten"):
        export_hf(model, tiny_tokenizer, tmp_path / "bf16", "bfloat16")
