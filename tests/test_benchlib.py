"""bench/benchlib.py: the llama.cpp probe that stops a benchmark with a reason."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from benchlib import check_llama_cpp  # noqa: E402


def test_a_llama_cpp_that_dies_of_a_signal_stops_the_benchmark_with_the_rebuild_command(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(
        subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, -signal.SIGILL, "", "")
    )
    with pytest.raises(SystemExit, match=r"died of SIGILL evaluating model\.gguf.*-mno-amx-int8"):
        check_llama_cpp(tmp_path / "model.gguf", 2)


def test_a_file_llama_cpp_cannot_evaluate_is_named_with_its_error(tmp_path):
    # Not a GGUF file (or, where the bench extra is not installed, no llama_cpp to import): the
    # child process fails, and its error is shown.
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf file")
    with pytest.raises(SystemExit, match=r"could not evaluate model\.gguf \(exit 1\): \w+Error: "):
        check_llama_cpp(bad, 1)
