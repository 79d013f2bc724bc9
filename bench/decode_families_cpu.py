"""Decode speed of the bundled decoder's newer families on CPU, against llama.cpp on the same weights.

Random-weight models built from transformers' own config classes, shaped as published checkpoints:
  qwen3-0.6b      Qwen3-0.6B (28 layers, q/k head norms, tied head)
  gemma-3-270m    Gemma-3-270M (18 layers, five sliding-window layers to one global, GELU-tanh,
                  a 262k vocabulary, tied head)
  olmoe-4-layers  OLMoE-1B-7B with 4 of its 16 layers (64 experts, 8 per token, 1024 wide)
  dense-active    a dense Llama with OLMoE's active shape: the same 4 layers, hidden size and
                  heads, and one MLP as wide as the 8 experts a token uses (8 x 1024): what
                  the mixture of experts decodes against, parameter for parameter read
Each tool decodes its own 4-bit integer form of the same float weights: slimlm int4 RTN of every
Linear (the LM head too; a bf16 scale and offset per group, groups of 32 as Q4_0's by default,
`--group-size 64` for the same bytes per weight as Q4_0) with int8 activations and the decode
step compiled, its fastest CPU path; llama.cpp (llama-cpp-python) the float weights rounded to
GGUF Q4_0 (an fp16 scale per 32 weights) as its converter rounds them.
Batch 1, a 16-token random prompt, exactly 128 greedy new tokens, the same threads for both;
every row decodes once per round for `--repeats` rounds (interleaved) and the median is kept.

The planner's CPU plan of the MoE model is checked against a measured run: the artifact loaded
by `slimlm generate` in a fresh process, its peak resident memory (GNU time) against the plan's
peak for the same context.

    python bench/decode_families_cpu.py [--repeats 5 --threads 2 --group-size 32] [--quick]

Writes bench/results/decode_families_cpu.{md,json,png}; --quick (tiny shapes, a test) only prints.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchlib import REPO, add_skip_llama_cpp, check_llama_cpp, command_line, publish_table
from decode_cpu import add_decode_options, llama_cpp_contender, race, slimlm_contender, write_plot

from slimlm.artifact import parse_manifest, planner_inputs, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.experts import split_experts
from slimlm.gguf_export import export_gguf
from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import HARDWARE, make_plan
from slimlm.pipeline import RunState
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "decode_families_cpu"
TIME = "/usr/bin/time"
TARGETS = [r"model\.layers\.\d+\..*", "lm_head"]
OLMOE = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_hidden_layers=4,
    vocab_size=50304,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "gemma-3-270m": (
        "gemma3_text",
        dict(
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            vocab_size=262144,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "olmoe-4-layers": (
        "olmoe",
        dict(OLMOE, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False),
    ),
    "dense-active": ("llama", dict(OLMOE, intermediate_size=8 * 1024)),
}
# --quick: the same families at a size that runs in seconds (a test runs it)
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512, max_position_embeddings=512
)
QUICK_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-tiny": ("qwen3", dict(TINY, intermediate_size=128, num_key_value_heads=2, head_dim=32)),
    "gemma-3-tiny": (
        "gemma3_text",
        dict(
            TINY,
            intermediate_size=128,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
        ),
    ),
    "olmoe-tiny": (
        "olmoe",
        dict(TINY, intermediate_size=64, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2),
    ),
    "dense-active-tiny": ("llama", dict(TINY, intermediate_size=2 * 64, num_key_value_heads=4)),
}
MOE, DENSE = 2, 3  # indices of the mixture of experts and its dense counterpart in the shapes


def random_model(model_type: str, settings: dict):
    """A random-weight float model of `model_type` from transformers' own config class, experts
    split into one Linear per projection as slimlm's loaders hold them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **settings), dtype=torch.float32
    ).eval()
    split_experts(model)
    return model


def quantized(model, workdir: Path, group_size: int) -> dict:
    """`model` quantized in place to int4 RTN in groups of `group_size`; returns the schemes."""
    state = RunState(
        cfg=None,
        run_dir=workdir,
        model=model,
        tokenizer=None,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=group_size, targets=TARGETS))
    return state.schemes


def measured_plan(name: str, model, tokenizer, schemes: dict, options, workdir: Path) -> dict:
    """Peak resident memory of `slimlm generate` on the model's artifact (a fresh process) against
    the planner's CPU plan for the context that generation allocates."""
    from slimlm.inference.generate import prompt_ids

    artifact = workdir / f"{name}-artifact"
    shutil.rmtree(artifact, ignore_errors=True)
    save_artifact(model, tokenizer, artifact, schemes, source={"id": f"random {name}"})
    text, new_tokens = "the quick brown fox jumps over the lazy dog", 32
    context = len(prompt_ids(tokenizer, text, False)[0]) + new_tokens
    peak_file = workdir / f"{name}.maxrss"
    argv = [
        TIME,
        "-f",
        "%M",
        "-o",
        str(peak_file),
        sys.executable,
        "-m",
        "slimlm.cli",
        "generate",
        str(artifact),
        text,
        "--no-chat-template",
        "--max-new-tokens",
        str(new_tokens),
        "--int8-activations",
        "--threads",
        str(options.threads),
    ]
    if subprocess.run(argv, cwd=REPO, capture_output=True).returncode != 0:
        raise SystemExit(f"slimlm generate failed on {artifact}")
    measured = int(peak_file.read_text().split()[-1]) * 1024
    schemes_of, ranks = planner_inputs(parse_manifest(artifact))
    desktop = HARDWARE["cpu"]
    plan = make_plan(
        ModelArgs.from_hf_config(model.config),
        schemes_of,
        desktop,
        context,
        int8_activations=True,
        adapter_ranks=ranks,
    )
    predicted = plan.device_bytes()
    return {
        "name": f"{name}: planned against measured peak",
        "context": context,
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": measured,
        "predicted_to_measured": round(predicted / measured, 3),
        "expert_bytes": plan.budget.all_expert_bytes,
    }


def llama_cpp_row(name: str, model, tokenizer, prompt: list[int], options, workdir: Path):
    """llama.cpp on the float model rounded to Q4_0 (before slimlm quantizes it in place)."""
    path = workdir / f"{name}-q4_0.gguf"
    path.unlink(missing_ok=True)
    export_gguf(model, tokenizer, path, "Q4_0")
    check_llama_cpp(path, options.threads)
    return llama_cpp_contender(f"{name}: llama.cpp Q4_0", path, prompt, options, model.config)


def slimlm_row(name: str, model, tokenizer, prompt: list[int], options):
    row = slimlm_contender(
        f"{name}: slimlm int4 g{options.group_size}, int8 activations, compiled",
        model,
        tokenizer,
        prompt,
        options,
        torch.bfloat16,
        compiled=True,
        int8_activations=True,
    )
    kernels = row.info.pop("kernels")
    row.info["kernels"] = ", ".join(f"{kernel} x{count}" for kernel, count in kernels.items())
    return row


def ratio_cell(ratio) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser)
    add_skip_llama_cpp(parser)
    parser.add_argument(
        "--group-size",
        type=int,
        default=32,
        help="slimlm's int4 group size (32: llama.cpp Q4_0's; 64: the same bytes per weight as Q4_0)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, 2 rounds of 16 tokens; results only printed (tests)",
    )
    options = parser.parse_args()
    if options.quick:
        options.repeats, options.new_tokens = 2, 16
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    sys.path.insert(0, str(REPO))
    from tests.conftest import (
        build_tokenizer,
    )  # a small BPE tokenizer: the prompts are random ids, GGUF files need one

    tokenizer = build_tokenizer()
    shapes = QUICK_SHAPES if options.quick else SHAPES
    workdir = RUNS / "quick" if options.quick else RUNS
    workdir.mkdir(parents=True, exist_ok=True)
    prompt = torch.randint(
        0, len(tokenizer), (options.prompt_tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    contenders, planned = [], None
    for index, (name, (model_type, settings)) in enumerate(shapes.items()):
        print(f"preparing {name}", flush=True)
        model = random_model(model_type, settings)
        theirs = (
            []
            if options.skip_llama_cpp
            else [llama_cpp_row(name, model, tokenizer, prompt, options, workdir)]
        )
        schemes = quantized(model, workdir, options.group_size)
        contenders += [slimlm_row(name, model, tokenizer, prompt, options), *theirs]
        if index == MOE:
            planned = measured_plan(name, model, tokenizer, schemes, options, workdir)
        del model
    rows = race(contenders, options.repeats)
    names = list(shapes)
    for name in names:
        ours = next(r for r in rows if r["name"].startswith(f"{name}: slimlm"))
        theirs = next((r for r in rows if r["name"].startswith(f"{name}: llama.cpp")), None)
        ours["vs_llama_cpp"] = (
            None if theirs is None else round(ours["decode_tok_s"] / theirs["decode_tok_s"], 3)
        )
    moe = next(r for r in rows if r["name"].startswith(f"{names[MOE]}: slimlm"))
    moe["vs_dense_active"] = round(
        moe["decode_tok_s"]
        / next(r for r in rows if r["name"].startswith(f"{names[DENSE]}: slimlm"))["decode_tok_s"],
        3,
    )
    command = command_line("decode_families_cpu.py", parser, options)
    if not options.quick:
        write_plot(
            rows,
            "decode_families_cpu",
            f"Decode speed on CPU by family (random weights, int4 g{options.group_size} against Q4_0)",
        )
    table = [
        (
            "| model and decoder | decode tok/s | vs llama.cpp | time to first token ms | weights MB | "
            "warm-up s | kernels |"
        ),
        "|---|---:|---:|---:|---:|---:|---|",
        *[
            f"| {r['name']} | {r['decode_tok_s']:.1f} | {ratio_cell(r.get('vs_llama_cpp'))} | "
            f"{1000 * r['ttft_s']:.1f} | {r['weight_bytes'] / 1e6:.1f} | {r.get('warmup_s', 0):.0f} | "
            f"{r.get('kernels', '')} |"
            for r in rows
        ],
        "",
        (
            "The mixture of experts against the dense model of its active shape: "
            f"**{moe['vs_dense_active']:.2f}x** its tokens/s (goal 0.7x)."
        ),
        "",
        "| planner check | context | planned peak MB | measured peak MB | planned / measured |",
        "|---|---:|---:|---:|---:|",
        (
            f"| {planned['name']} | {planned['context']} | {planned['predicted_peak_bytes'] / 1e6:.0f} | "
            f"{planned['measured_peak_bytes'] / 1e6:.0f} | {planned['predicted_to_measured']:.3f} |"
        ),
        "",
        "![decode_families_cpu](decode_families_cpu.png)",
    ]
    details = [
        f"- batch 1, a {options.prompt_tokens}-token random prompt, exactly {options.new_tokens} greedy new "
        f"tokens, median of {options.repeats} interleaved rounds after a warm-up; random weights: slimlm "
        f"int4 g{options.group_size} RTN of every Linear and the head, llama.cpp the float weights rounded "
        "to Q4_0"
    ]
    publish_table(
        "decode_families_cpu",
        "decode_families_cpu",
        command,
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        [*rows, planned],
        options.quick,
    )


if __name__ == "__main__":
    main()
