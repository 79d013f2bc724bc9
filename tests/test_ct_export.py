import json

import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.ct_export import export_compressed
from slimlm.errors import SlimlmError
from slimlm.pipeline import RunState

pytest.importorskip("compressed_tensors")


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


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


SCHEMES = {
    "w4-g32-sym": dict(bits=4, group_size=32),
    "w4-g16-with-head": dict(bits=4, group_size=16, targets=[r"model\.layers\.\d+\..*", "lm_head"]),
    "w8-channel": dict(bits=8),
    "w3-g32": dict(bits=3, group_size=32),
}


@pytest.mark.parametrize("params", SCHEMES.values(), ids=SCHEMES.keys())
def test_transformers_loads_the_packed_export_with_our_logits(tiny_model, tiny_tokenizer, tmp_path, params):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, **params)
    summary = export_compressed(model, tiny_tokenizer, tmp_path / "ct", "float32")
    loaded = load(tmp_path / "ct")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and summary["quantized_layers"] == sum(
        len(g["targets"]) for g in config["config_groups"].values()
    )


def test_mixed_widths_become_one_config_group_each(tiny_model, tiny_tokenizer, tmp_path):
    quantized(tiny_model, tiny_tokenizer, tmp_path, bits=8, targets=[r"model\.layers\.\d+\.mlp\..*"])
    model = quantized(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
        targets=[r"model\.layers\.\d+\.self_attn\..*"],
    )
    export_compressed(model, tiny_tokenizer, tmp_path / "ct", "bfloat16")
    groups = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["config_groups"]
    widths = {group["weights"]["num_bits"]: group["targets"] for group in groups.values()}
    assert (
        set(widths) == {4, 8}
        and all("mlp" in name for name in widths[8])
        and all("self_attn" in name for name in widths[4])
    )
    loaded = load(tmp_path / "ct")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (
            torch.nn.functional.kl_div(
                loaded(ids).logits.log_softmax(-1),
                model(ids).logits.log_softmax(-1),
                log_target=True,
                reduction="batchmean",
            )
            < 1e-3
        )


def test_asymmetric_and_unquantized_models_are_refused_before_writing(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(SlimlmError, match="needs a quantized model"):
        export_compressed(tiny_model, tiny_tokenizer, tmp_path / "ct", "float32")
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32, symmetric=False)
    with pytest.raises(SlimlmError, match="symmetric schemes only"):
        export_compressed(model, tiny_tokenizer, tmp_path / "ct", "float32")
    assert not (tmp_path / "ct").exists()
