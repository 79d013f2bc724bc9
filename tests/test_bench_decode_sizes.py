"""bench/decode_sizes_cpu.py --add: a run of some sizes keeps the published rows of the others,
and the page names the run each row comes from; bench/decode_worker.py's protocol, driven
directly (the quick run drives it only through the whole benchmark)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import decode_sizes_cpu  # noqa: E402


def row(size: str, scheme: str, decoder: str, command: str, tok_s: float) -> dict:
    return {
        "name": f"{size} {scheme} {decoder}",
        "size": size,
        "scheme": scheme,
        "prompt_tokens": 16,
        "decoder": decoder,
        "decode_tok_s": tok_s,
        "command": command,
        "memory_bandwidth_bytes_s": 30e9 if command == "old" else 25e9,
    }


def test_a_new_run_replaces_its_sizes_and_keeps_the_others_in_size_order():
    published = [
        row("smollm2-135m", "int4-g32", "slimlm, eager", "old", 50.0),
        row("llama-3-8b", "int4-g32", "slimlm, eager", "old", 1.0),
        row("llama-3-8b", "int8-g32", "slimlm, eager", "old", 0.5),
    ]
    new = [row("llama-3-8b", "int4-g32", "slimlm, eager", "new", 5.0)]
    rows = decode_sizes_cpu.with_published(new, published)
    assert [(r["size"], r["scheme"], r["decode_tok_s"]) for r in rows] == [
        ("smollm2-135m", "int4-g32", 50.0),
        ("llama-3-8b", "int4-g32", 5.0),
        ("llama-3-8b", "int8-g32", 0.5),
    ]
    assert decode_sizes_cpu.runs_lines(rows) == [
        "- int4-g32, int8-g32 at smollm2-135m, llama-3-8b: `old`, memory bandwidth 30.0 GB/s",
        "- int4-g32 at llama-3-8b: `new`, memory bandwidth 25.0 GB/s",
    ]


def test_published_rows_without_their_run_are_refused(monkeypatch, tmp_path):
    results = tmp_path / "decode_sizes_cpu.json"
    old = row("smollm2-135m", "int4-g32", "slimlm, eager", "old", 50.0)
    del old["command"]
    results.write_text(json.dumps({"rows": [old]}))
    monkeypatch.setattr(decode_sizes_cpu, "RESULTS", results)
    with pytest.raises(SystemExit, match="without their run's command or bandwidth"):
        decode_sizes_cpu.published_rows()


def test_the_slimlm_decode_worker_answers_each_request_and_exits_on_a_malformed_one(tmp_path):
    files = decode_sizes_cpu.prepare(
        "tiny-tied", decode_sizes_cpu.QUICK_SIZES["tiny-tied"], "int4-g32", tmp_path
    )
    worker = decode_sizes_cpu.Worker("tiny slimlm", "slimlm", files.artifact, threads=1, slots=32)
    assert worker.ready["ready"] is True
    answer = worker.ask(prompt=[1, 2, 3, 4], new_tokens=4, compiled=False)
    assert answer["decode_tok_s"] > 0 and answer["ttft_s"] > 0 and answer["weight_bytes"] > 0
    memory = worker.ask(memory=True)
    assert memory["peak_rss_bytes"] >= memory["rss_bytes"] > 0
    with pytest.raises(SystemExit, match="the decode worker exited"):
        worker.ask(prompt=[], new_tokens=4)
    assert worker.process.wait() != 0
