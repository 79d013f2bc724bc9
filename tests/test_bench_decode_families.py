"""bench/decode_families_cpu.py --quick: every family's row, the MoE-to-dense ratio and the
planner check run end to end on tiny random models (llama.cpp's rows where it is installed)."""

import importlib.util
import subprocess
import sys

from tests.conftest import REPO


def test_quick_decode_families_bench_runs_every_row():
    skip = [] if importlib.util.find_spec("llama_cpp") else ["--skip-llama-cpp"]
    result = subprocess.run(
        [sys.executable, "decode_families_cpu.py", "--quick", *skip],
        capture_output=True,
        text=True,
        cwd=REPO / "bench",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("qwen3-tiny", "gemma-3-tiny", "olmoe-tiny", "dense-active-tiny"):
        assert f"| {name}: slimlm int4 g32, int8 activations, compiled |" in result.stdout
        assert not skip or f"| {name}: llama.cpp Q4_0 |" not in result.stdout
    assert "The mixture of experts against the dense model of its active shape" in result.stdout
    assert "| olmoe-tiny: planned against measured peak |" in result.stdout
