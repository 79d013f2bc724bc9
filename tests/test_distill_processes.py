"""A distillation run over two processes (gloo on the CPU) is one run: one run directory, one
report, one export, and the training of one process with the same global batch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.test_cli import TINY_PRUNE_SHAPE, slimlm, tiny_run_args

PRUNE_DISTILL = [
    "recipe=prune-distill",
    *TINY_PRUNE_SHAPE,
    "recipe.stages.3.tokens=2560",
    "recipe.stages.3.seq_len=40",
    "recipe.stages.3.top_k=16",
    "+recipe.stages.3.eval_every=4",
    "+recipe.stages.3.eval_windows=2",
    "+recipe.stages.3.checkpoint_every=8",
    "recipe.stages.3.lr=3e-3",
    "recipe.stages.3.draft_prompts=0",
    "hardware.threads=1",
]


def launch_two(*args, cwd):
    """`accelerate launch` of two processes; without a GPU they train over gloo on the CPU
    (`--multi_gpu` picks the torchrun launcher, `--cpu` would need mpirun for more than one)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    result = subprocess.run(
        [*command, "-m", "slimlm.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A teacher cache of this test's own: another test's runs of prune-distill on the tiny model
    would otherwise find this one's cache already written (or write it first)."""
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))


def test_two_processes_make_one_run_with_the_training_of_one(tiny_model_dir, tmp_path):
    args = [*tiny_run_args(tiny_model_dir), *PRUNE_DISTILL]
    slimlm(*args, "recipe.stages.3.batch_size=4", "hydra.run.dir=one", cwd=tmp_path)
    launched = tmp_path / "launched"
    launched.mkdir()
    output = launch_two(*args, "recipe.stages.3.batch_size=2", cwd=launched).stdout
    (run_dir,) = (launched / "runs" / "prune-distill").iterdir()  # Hydra's default: one, not one each
    assert output.count("report: ") == 1 and sorted(p.name for p in launched.iterdir()) == ["runs"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "complete"
    one, two = (json.loads((d / "report.json").read_text()) for d in (tmp_path / "one", run_dir))
    single, double = one["distillation"][0], two["distillation"][0]
    assert (single["processes"], double["processes"]) == (1, 2)
    assert single["steps"] == double["steps"] == 16 and single["tokens"] == double["tokens"]
    for a, b in zip(single["history"], double["history"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["lr"] == b["lr"]
    checkpoints = sorted(p.name for p in (run_dir / "distill" / "checkpoints").iterdir())
    assert checkpoints == ["step-0000008", "step-0000016"]
    assert len((run_dir / "distill" / "metrics.jsonl").read_text().splitlines()) == 16
    weights = [load_file(d / "hf" / "model.safetensors") for d in (tmp_path / "one", run_dir)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():  # bf16: another summation order flips a rounding at most
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(weights[1][name], tensor, rtol=2**-7, atol=0)


def test_two_processes_resume_their_shared_run(tiny_model_dir, tmp_path):
    """A run stopped after its checkpoints (its status says failed) goes on in the same directory:
    the main process claims it again, both processes load the newest checkpoint."""
    args = [
        *tiny_run_args(tiny_model_dir),
        *PRUNE_DISTILL,
        "recipe.stages.3.batch_size=2",
        "hydra.run.dir=run",
    ]
    launch_two(*args, cwd=tmp_path)
    first = json.loads((tmp_path / "run" / "report.json").read_text())["distillation"][0]
    (tmp_path / "run" / "status.json").write_text(json.dumps({"status": "failed", "error": "stopped"}))
    launch_two(*args, cwd=tmp_path)
    again = json.loads((tmp_path / "run" / "report.json").read_text())["distillation"][0]
    assert again["resumed_from_step"] == 16 and again["history"] == first["history"]
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "complete"
