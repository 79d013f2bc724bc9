import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from slimlm.config import SamplingConfig, TextSourceConfig
from slimlm.data import check_text_source
from slimlm.errors import ConfigError, SlimlmError
from slimlm.model_samples import cached_samples, ordinary_ids, sample_stream, samples_path
from tests.conftest import build_tiny_llama
from tests.test_cli import slimlm, tiny_run_args
from tests.test_qat import TINY_QAT


def test_samples_are_whole_ordinary_and_cached(tiny_tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))
    model = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    sampling = SamplingConfig(tokens=100, length=16, batch_size=3)
    ids = sample_stream(model, ordinary_ids(tiny_tokenizer), "key", sampling)
    assert ids.shape == (7 * 16,)  # 100 tokens rounded up to 7 samples of 16
    assert not set(ids.tolist()) & set(tiny_tokenizer.all_special_ids)
    assert len(set(ids.tolist())) > 20  # sampled, not one token repeated
    assert torch.equal(cached_samples("key", sampling), ids)
    assert cached_samples("other model", sampling) is None
    assert torch.equal(sample_stream(model, ordinary_ids(tiny_tokenizer), "key", sampling), ids)  # seeded


def test_samples_follow_the_models_distribution(tiny_tokenizer, monkeypatch, tmp_path):
    """Each token after the first is drawn from the model's next-token distribution at the given
    temperature: a model sharpened tenfold (temperature 0.1) puts most tokens on its top choice."""
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))
    model = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
    ordinary = ordinary_ids(tiny_tokenizer)
    ids = sample_stream(model, ordinary, "key", SamplingConfig(tokens=512, length=32, temperature=0.1))
    windows = ids.view(-1, 32)
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    logits[..., [i for i in tiny_tokenizer.all_special_ids]] = float("-inf")
    top_choice = (logits.argmax(-1) == windows[:, 1:]).float().mean()
    mean_probability = F.softmax(logits, -1).max(-1).values.mean()
    assert top_choice > 0.8 and mean_probability < 0.5  # sharpened sampling, a flat-ish model


def test_a_damaged_or_mismatched_sample_cache_is_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))
    sampling = SamplingConfig(tokens=100, length=10)
    path = samples_path("key", sampling)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not safetensors")
    assert cached_samples("key", sampling) is None
    save_file({"tokens": torch.zeros(100, dtype=torch.int64)}, path)  # readable, but not the stream
    assert cached_samples("key", sampling) is None
    save_file({"ids": torch.zeros(90, dtype=torch.int64)}, path)  # 9 samples where 10 were asked for
    assert cached_samples("key", sampling) is None
    save_file({"ids": torch.zeros(100, dtype=torch.int64)}, path)
    assert cached_samples("key", sampling).shape == (100,)


def test_sampling_settings_are_checked_and_model_text_is_calibration_only():
    with pytest.raises(ConfigError, match="length"):
        SamplingConfig(length=1)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=0.0)
    assert check_text_source(TextSourceConfig(path="model", format="model"), "calibration") is None
    with pytest.raises(SlimlmError, match="eval_text.format='model' is unknown"):
        check_text_source(TextSourceConfig(path="model", format="model"), "eval_text")


def test_a_recipe_calibrates_and_distills_on_the_original_models_samples(tiny_model_dir, tmp_path):
    """GPTQ and the distillation of a shrunk w3-qat run read the original model's samples
    instead of a text: the run samples once and its report names the samples as the data."""
    sampling = ["data.calibration.format=model", "data.sampling.tokens=1024", "data.sampling.length=32"]
    slimlm(
        "recipe=w3-qat",
        *tiny_run_args(tiny_model_dir),
        *TINY_QAT,
        *sampling,
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    data = "samples of the original model (1,024 tokens, 32 a sample, temperature 1, seed 0)"
    assert report["distillation"][0]["data"] == data
    assert f"on {data}" in (tmp_path / "run" / "report.md").read_text()
    assert report["calibration_samples"]["tokens"] == 1024 and not report["calibration_samples"]["reused"]
    assert "1,024 tokens sampled from the original model in" in (tmp_path / "run" / "report.md").read_text()
    log = (tmp_path / "run" / "slimlm.log").read_text()
    assert log.count("sampling 1,024 tokens of calibration text from the original model") == 1


def test_bad_sampling_settings_stop_the_run_before_it_starts(tiny_model_dir, tmp_path):
    result = slimlm(
        *tiny_run_args(tiny_model_dir),
        "data=samples",
        "data.sampling.length=1",
        "hydra.run.dir=run",
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode != 0 and "length (1) at least 2" in result.stderr
    assert not (tmp_path / "run").exists()
