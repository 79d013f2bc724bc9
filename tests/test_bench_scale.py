"""bench/scale.py --quick: the scale benchmark's steps run end to end on small shapes."""

import json
import subprocess
import sys

from tests.conftest import REPO


def test_quick_scale_bench_measures_every_step(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale.py"), "--quick", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {
        row["name"].split(":")[0].split(",")[0]: row
        for row in json.loads((tmp_path / "scale.json").read_text())["rows"]
    }
    rtn, generate, plan = rows["w4 g128 RTN"], rows["decoder"], rows["slimlm plan on the artifact"]
    assert (
        rtn["shards"] > 1
        and 0 < rtn["peak_rss_gb"] < 3
        and rtn["artifact_weight_bytes"] < rtn["checkpoint_weight_bytes"] / 2
    )
    assert generate["new_tokens"] == 8 and generate["tokens_per_s"] > 0 and generate["peak_rss_gb"] > 0
    assert (
        abs(plan["plan_stored_layout_to_artifact"] - 1) < 0.02 and abs(plan["plan_cpu_to_decoder"] - 1) < 0.02
    )
    gptq = rows["w4 g128 GPTQ of the first blocks"]
    assert (
        gptq["blocks"] == 2
        and gptq["quantized_layers"] == 14
        and gptq["block_seconds"] > 0
        and 0 < gptq["peak_rss_gb"] < 6
    )
    ppl = rows["perplexity"]
    assert ppl["tokens_scored"] == 2 * 511 and ppl["ppl"] > 1 and 0 < ppl["peak_rss_gb"] < 3
    forward = rows["one block's bf16 forward (512 tokens)"]
    assert forward["torch_bf16_s"] > 0 and forward["slimlm_s"] > 0 and forward["max_rel_difference"] < 0.05
    assert (tmp_path / "artifact-w4g128-rtn" / "model.safetensors.index.json").is_file()
    assert "| w4 g128 RTN" in result.stdout
