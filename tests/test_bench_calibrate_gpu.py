"""bench/calibrate_gpu.py --quick: the GPU calibration check dry-runs on the CPU, so it cannot
first fail on the device, whose time is short."""

import subprocess
import sys

from tests.conftest import REPO


def test_quick_gpu_calibration_bench_runs_on_the_cpu():
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "calibrate_gpu.py"), "--quick", "--device", "cpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| w4 gptq, cpu |" in result.stdout
