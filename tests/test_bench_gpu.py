"""bench/decode_gpu.py runs where no GPU is (a dry run of every section on a tiny shape), with
only what the GPU machine's image has: no omegaconf, hydra, datasets or gguf. Device time is
short; the script must not first fail there on an import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import HARDWARE, budget, uniform_schemes
from slimlm.inference.synthetic import random_decoder
from slimlm.qlinear import QuantScheme

REPO = Path(__file__).resolve().parents[1]
ABSENT_ON_THE_GPU_IMAGE = ("omegaconf", "hydra", "datasets", "gguf", "evaluate", "bitsandbytes")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("bits", [None, 4, 8], ids=["float", "int4", "int8"])
def test_random_decoders_hold_the_bytes_the_planner_predicts(bits, tied):
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tied,
    }
    scheme = None if bits is None else QuantScheme(bits=bits, group_size=32 if bits == 4 else None)
    decoder = random_decoder(config, scheme, scheme)
    args = ModelArgs.from_hf_config(config)
    assert (
        decoder.weight_bytes()
        == budget(args, uniform_schemes(args, scheme, scheme), HARDWARE["cpu"], 64, 1).weight_bytes
    )
    decoder.setup_cache(1, 16)
    logits = decoder(torch.ones(1, 4, dtype=torch.long), 0)
    assert (
        logits.isfinite().all() and 0.3 < logits.float().std() < 3
    )  # scaled so activations neither vanish nor blow up


def test_the_gpu_benchmark_dry_runs_with_only_the_gpu_images_packages(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    # sys.modules[name] = None: `import name` fails and find_spec reports it absent, as on that image
    (blocker / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in ABSENT_ON_THE_GPU_IMAGE)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "results"
    command = [
        sys.executable,
        "bench/decode_gpu.py",
        "--tiny",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--repeats",
        "1",
        "--new-tokens",
        "8",
        "--cap-context",
        "256",
        "--stream-context",
        "128",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((out / "decode_gpu.json").read_text())
    assert record["failures"] == [], record["failures"]
    names = [row["name"] for row in record["rows"]]
    assert names == [
        "device copy",
        "slimlm int4 g64 tiny, tinygemm, eager",
        "slimlm int4 g64 tiny, tinygemm, compiled",
        "slimlm int4 g64 tiny, 256 context (CPU: no cap)",
        "slimlm int4 g64 tiny, 128 context (CPU: no cap)",
        "transformers bf16 tiny, static cache, generate",
    ]
    speeds = [row for row in record["rows"] if "vs_transformers" in row]
    assert len(speeds) == 2 and all(
        row["decode_tok_s"] > 0 and 0 < row["bandwidth_fraction"] for row in speeds
    )
    assert "| slimlm int4 g64 tiny, tinygemm, compiled |" in (out / "decode_gpu.md").read_text()
    assert record["machine"]["cuda"] == "no GPU (dry run)" and all(
        row["gpu"] == "no GPU (dry run)" for row in record["rows"]
    )
