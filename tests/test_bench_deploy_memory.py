"""bench/deploy_memory.py --quick: the deploy recipe from disk and in memory on a tiny model."""

import json
import subprocess
import sys

from tests.conftest import REPO


def test_quick_deploy_memory_bench_measures_both_paths(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "deploy_memory.py"), "--quick", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(result.stdout.strip().splitlines()[-1])["rows"]}
    disk, memory = rows["from disk"], rows["in memory"]
    assert (
        list(disk["stage_seconds"]) == ["1. quantize", "2. export", "3. generate", "4. export"]
        and "1. load" in memory["stage_seconds"]
    )
    assert (
        disk["artifact_weight_bytes"] == memory["artifact_weight_bytes"]
        and disk["completion"] == memory["completion"]
    )
    assert 8 <= disk["bits_per_weight"] < 8.5 and disk["peak_rss_bytes"] > 0
    assert "| from disk |" in result.stdout
