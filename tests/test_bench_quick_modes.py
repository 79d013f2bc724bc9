"""Every benchmark script's --quick mode runs end to end on the tiny test model and prints its
tables, rows measured: the project's rule that no benchmark can rot unnoticed. llama.cpp's rows
run where llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from slimlm.inference import cpu_kernels
from tests.conftest import REPO

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAS_HARNESS = importlib.util.find_spec("lm_eval") is not None
HAS_AVX2 = not cpu_kernels.missing_flags("avx2")


def llama_cpp_rows(*rows: str) -> tuple[str, ...]:
    """`rows`, where llama.cpp runs here."""
    return rows if HAS_LLAMA_CPP else ()


# script -> (extra arguments, lines its quick run must print: table headers and measured rows)
SCRIPTS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "batching_cpu": (
        [],
        (
            "| run | new tokens/s in all |",
            "| static batch 16 |",
            "| continuous, 16 requests, 8 rows |",
            "| 4 1,024-token prompts, then 4 16-token prompts arrive |",
            "| 8 prompts of 30 tokens, one pass |",
        ),
    ),
    "decode_cpu": (
        [] if HAS_LLAMA_CPP else ["--skip-llama-cpp"],
        (
            "| decoder | decode tok/s | vs transformers fp32 |",
            "| transformers fp32 generate |",
            "| slimlm fp32 |",
            *llama_cpp_rows("| llama.cpp Q8_0 |", "| llama.cpp Q4_0 |"),
            "| slimlm int8, bf16 activations, compiled |",
            "| slimlm int4 g64, int8 activations, int8 KV cache, compiled |",
            "| int4 g64 tied head (",
        ),
    ),
    "decode_sizes_cpu": (
        [] if HAS_LLAMA_CPP else ["--skip-llama-cpp"],
        (
            "| size | scheme | prompt | decoder | decode tok/s | vs llama.cpp |",
            "| tiny-tied | int4-g32 | 16 | slimlm, eager |",
            "| tiny-untied | int8-g32 | 64 | slimlm, compiled |",
            *llama_cpp_rows(
                "| tiny-untied | int8-g32 | 64 | llama.cpp Q8_0 |",
                "| tiny-tied | int4-g32 | 16 | llama.cpp Q4_0 |",
            ),
        ),
    ),
    "decode_cpu_isa": (
        [],
        (
            "| decoder | vector width | decode tok/s |",
            "| torch int4, bf16 activations, AVX-512 | widest |",
            *(("| slimlm int4 x int8, AVX2 | 256-bit |",) if HAS_AVX2 else ()),
        ),
    ),
    "distill_summary": (
        [],
        (
            "| trained student | ppl | KL to teacher |",
            "| distilled (forward KL) |",
            "LoRA recovery of w4 g64 GPTQ",
            "| model | ppl | KL to teacher | gap closed | decode tok/s (b1) | speed-up |",
            "| distilled student, w4-g64-gptq |",
        ),
    ),
    "eval_quick_sizes": (
        [],
        (
            "| metric | tokens | wall s | tokens/s | GFLOP/s (2 x params x tokens) |",
            "| perplexity | 8188 |",
            "| zeroshot |",
            "| speed |",
            "| the whole command (load included) |",
        ),
    ),
    "eval_speed_path": (
        [],
        ("| speed metric through | whole metric s |", "| bundled decoder |", "| transformers forward |"),
    ),
    "fill_blank_harness": (
        [],
        (
            "| scorer | items | acc % |",
            "| slimlm fill_blank | 40 |",
            "| lm-evaluation-harness (winogrande functions) | 40 |",
            "Accuracies identical.",
        ),
    ),
    "harness_bridge": (
        [],
        (
            "| task | items | metric | slimlm | lm-eval --model slimlm | same |",
            "| arc_easy | 8 | acc |",
            "| lambada | 8 | ppl |",
            "8 of 8 numbers identical",
        ),
    ),
    "gguf_llamacpp": (
        [],
        (
            "| file | ppl | KL to F32 |",
            "| F32 (reference) |",
            "| slimlm w4 g32 GPTQ → Q4_0 (written exactly) |",
            "| llama.cpp quantize MOSTLY_Q4_0, default mix (its LM head Q8_0) |",
        ),
    ),
    "kv_cache_cpu": (
        [] if HAS_LLAMA_CPP else ["--skip-llama-cpp"],
        (
            "| decoder | context tokens | decode tok/s |",
            "| slimlm int4 x int8, fp32 cache | 16 |",
            "| slimlm int4 x int8, int8 cache | 64 |",
            *llama_cpp_rows("| llama.cpp Q4_0, q8_0 cache | 64 |"),
        ),
    ),
    "lora_decode_cpu": (
        [],
        (
            "| decoder | decode tok/s | vs adapters dropped |",
            "| slimlm w4 g64 GPTQ + LoRA r2, int8 activations, compiled |",
            "| slimlm w4 g64 GPTQ, adapters dropped, int8 activations, compiled |",
            "| gate/up | 512 x 128 |",
        ),
    ),
    "mixed_sensitivity": (
        [],
        (
            "| statistic | value |",
            "| Spearman rank correlation, all |",
            "| layer kind | predicted | measured |",
            "| mlp.down_proj |",
        ),
    ),
    "prefix_reuse_cpu": (
        [],
        (
            "| run | prompt tokens | found in the cache |",
            "| one at a time, turn 2 |",
            "| batched, turn 2 |",
            "| shared system prompt, 8 requests, reuse on |",
            "| 8 conversations, 4 at a time, 8 cache rows, turn 4 |",
            "| float32 | ",
        ),
    ),
    "prune_default": (
        [],
        (
            "| model | layers | hidden |",
            "| unpruned (2 layers) |",
            "| depth-1 | 1 |",
            "| student (depth 1 + width half) |",
        ),
    ),
    "speculative_cpu": (
        [],
        (
            "| prompt | prompt tokens | new tokens |",
            "| repeat a passage |",
            "| open question |",
            "| 5 tokens after 4000 cached, int8 cache |",
        ),
    ),
    "speculative_serving_cpu": (
        [],
        (
            "| request | new tokens |",
            "| edit a passage, all three at once |",
            "| 3 answers x 5 tokens after 1500 cached, an attention call per answer |",
        ),
    ),
    "student_speed_cpu": (
        [],
        (
            "| model | layers | MLP | parameters | weight bytes | decode tok/s |",
            "| teacher, fp32 | 2 | 256 |",
            "| student, fp32 | 1 | 128 |",
            "| student, w4 g64 | 1 | 128 |",
        ),
    ),
}
NEEDS_LLAMA_CPP = {"gguf_llamacpp"}  # llama.cpp is the whole comparison
RESULT_NAMES = {"distill_summary": "distill_default"}  # what a full run writes, where not the script's name


def results_of(script: str) -> dict:
    """The bytes of the bench/results/ files a full run of `script` writes."""
    return {
        path: path.read_bytes()
        for path in (REPO / "bench" / "results").glob(f"{RESULT_NAMES.get(script, script)}*")
    }


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_quick_mode_measures_every_row(script: str):
    if script in NEEDS_LLAMA_CPP and not HAS_LLAMA_CPP:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[bench]')")
    if script in ("fill_blank_harness", "harness_bridge") and not HAS_HARNESS:
        pytest.skip("lm-evaluation-harness is not installed (pip install -e '.[harness]')")
    extra, expected = SCRIPTS[script]
    results = results_of(script)
    result = subprocess.run(
        [sys.executable, f"{script}.py", "--quick", *extra],
        cwd=REPO / "bench",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for line in expected:
        assert line in result.stdout, f"{script} --quick printed no '{line}'"
    assert "| NO |" not in result.stdout  # answers that must equal plain decoding's did not
    assert results_of(script) == results, "a quick run wrote bench/results/"
