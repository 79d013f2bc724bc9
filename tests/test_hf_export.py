import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.hf_export import export_hf
from slimlm.pipeline import RunState


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(**params))
    return model


@pytest.mark.parametrize(
    "targets",
    [[r"model\.layers\.\d+\..*"], [r"model\.layers\.\d+\..*", "lm_head"]],
    ids=["decoder", "with-tied-head"],
)
def test_transformers_loads_the_dequantized_export_with_our_logits(
    tiny_model, tiny_tokenizer, tmp_path, targets
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32, targets=targets)
    summary = export_hf(model, tiny_tokenizer, tmp_path / "hf", "float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "hf")("hello world")["input_ids"]
        == tiny_tokenizer("hello world")["input_ids"]
    )
    assert summary["bytes_on_disk"] > 0


def test_half_precision_export_is_half_the_size(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=8)
    full = export_hf(model, tiny_tokenizer, tmp_path / "fp32", "float32")["bytes_on_disk"]
    half = export_hf(model, tiny_tokenizer, tmp_path / "bf16", "bfloat16")["bytes_on_disk"]
    assert half < 0.6 * full
    with pytest.raises(SlimlmError, match="never overwritten"):
        export_hf(model, tiny_tokenizer, tmp_path / "bf16", "bfloat16")


@pytest.mark.parametrize(
    ("tie", "targets", "params"),
    [
        (True, ["model.layers.*", "lm_head"], dict(bits=4, group_size=32)),
        (False, ["model.layers.*", "lm_head"], dict(bits=8)),
        (True, ["model.layers.*"], dict(bits=8)),
    ],
    ids=["tied-w4", "untied-w8-table", "tied-float-head"],
)
def test_the_export_of_an_artifact_on_disk_equals_the_in_memory_one(
    tmp_path, tiny_tokenizer, tie, targets, params
):
    import json

    from safetensors.torch import load_file

    from slimlm.artifact import save_artifact
    from slimlm.hf_export import export_hf_from_artifact
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=tie, initializer_range=0.2)
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(targets=targets, **params))
    artifact = save_artifact(
        state.model, tiny_tokenizer, tmp_path / "artifact", state.schemes, source={"id": "tiny"}
    )
    export_hf(state.model, tiny_tokenizer, tmp_path / "from-memory", "bfloat16")
    export_hf_from_artifact(artifact, tmp_path / "from-disk", "bfloat16")
    a, b = (
        load_file(tmp_path / "from-memory" / "model.safetensors"),
        load_file(tmp_path / "from-disk" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and ("lm_head.weight" in a) == (not tie)
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
    assert json.loads((tmp_path / "from-disk" / "config.json").read_text()) == json.loads(
        (tmp_path / "from-memory" / "config.json").read_text()
    )


def test_a_moe_export_keeps_the_split_experts_and_loads_in_transformers(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.tiny_families import build_tiny

    model = build_tiny("qwen3_moe", len(tiny_tokenizer), initializer_range=0.2)
    quantized(model, tiny_tokenizer, tmp_path, bits=8)
    export_hf(model, tiny_tokenizer, tmp_path / "hf", "float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_merged_weight_made_in_runs_of_rows_equals_the_whole_one(monkeypatch):
    import slimlm.qlinear
    from slimlm.compress.rtn import quantize_rtn
    from slimlm.qlinear import QuantLinear, QuantScheme

    scheme = QuantScheme(bits=4, group_size=16)
    weight = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    quantized = quantize_rtn(weight, scheme)
    layer = QuantLinear.from_codes(quantized.codes, quantized.scales, quantized.zeros, scheme, None)
    expected = layer.dequantize(torch.bfloat16)
    monkeypatch.setattr(slimlm.qlinear, "MERGE_CHUNK_VALUES", 64 * 5)  # runs of 5 rows: the last one short
    assert torch.equal(layer.merged_weight(torch.bfloat16), expected)
