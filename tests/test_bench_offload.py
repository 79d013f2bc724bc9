"""bench/offload_parity.py --quick: the three calibration paths run end to end on a tiny checkpoint."""

import subprocess
import sys

from tests.conftest import REPO


def test_quick_offload_parity_bench_compares_the_three_paths(tiny_model_dir):
    command = [
        sys.executable,
        str(REPO / "bench" / "offload_parity.py"),
        "--quick",
        "--model",
        str(tiny_model_dir),
        "--windows",
        "2",
        "--samples",
        "4",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in result.stdout.splitlines()
        if line.startswith("| in-memory") or line.startswith("| offloaded")
    }
    assert sorted(rows) == ["in-memory fp32", "offloaded bf16", "offloaded fp32"]
    assert rows["offloaded fp32"][:3] == rows["in-memory fp32"][:3]  # ppl, KL, KL ratio: the same codes
