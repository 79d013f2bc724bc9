"""Speculative decoding by prompt lookup on CPU: acceptance rate and speedup over plain greedy.

The default model at int8 (bundled decoder, bf16 activations, eager) answers prompts that ask it
to repeat or edit text it was given (where lookup guesses well) and an open question (where it
guesses little). For each: the plain greedy tokens/s, the speculative tokens/s, the acceptance
rate of the guesses, tokens per target pass, and whether the outputs are identical (they must be).
With --temperature above 0 both sample (speculative sampling keeps the distribution, not the
draws): bench/results/speculative_cpu_sampled.{md,json}. Writes bench/results/speculative_cpu.{md,json};
--quick (the tiny test model, a test) only prints.

    python bench/speculative_cpu.py [--new-tokens 96 --lookahead 4 --repeats 3 --temperature 0] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from benchlib import command_line, kernel_and_torch_ms, load_bench_model, machine_line, publish
from decode_cpu import quantized_copy

from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.generate import prompt_ids
from slimlm.inference.model import Transformer
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.speculative import generate_speculative
from slimlm.rundir import machine_info

PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
    "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. "
    "Locally nicknamed the Iron Lady, it was constructed as the centrepiece of the 1889 World's Fair."
)
WEIGHTS = {
    "int8": "int8 (w8 RTN per-channel, head too) with bf16 activations",
    "fp32": "fp32 weights and activations",
}
PROMPTS = {
    "repeat a passage": f"Repeat the following text exactly, word for word.\n\n{PASSAGE}",
    "edit a passage": (
        "Rewrite the following text, replacing 'tower' with 'monument' and changing nothing else.\n\n"
        f"{PASSAGE}"
    ),
    "open question": "Explain in a few sentences why the sky is blue.",
}


def speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this bench shares with speculative_serving_cpu.py."""
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--lookahead", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random-weight model, 16 new tokens, 1 repeat; results only printed (tests)",
    )


def parse_speculation(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options, a --quick run's shrunk."""
    options = parser.parse_args()
    if options.quick:
        options.new_tokens, options.repeats = 16, 1
    return options


def random_ids(model: Transformer, count: int, generator: torch.Generator) -> torch.Tensor:
    """[1, count] random token ids of the model's vocabulary above its first 100 (below 5,000)."""
    return torch.randint(100, min(5000, model.args.vocab_size), (1, count), generator=generator)


def verification_pass_costs(model: Transformer, lookahead: int, repeats: int = 9) -> list[dict]:
    """Milliseconds of one verification pass (the last token and `lookahead` guesses) of one
    sequence after 150, 1,500 and 4,000 cached tokens, with a float and an int8 cache: attending
    in slimlm's CPU kernel (a query per token, each reading the row as stored) against torch's
    attention (over a view of the row; for int8, a dequantized copy); median of `repeats`, alternating."""
    generator, rows = torch.Generator().manual_seed(0), []
    for cache_dtype in (None, torch.int8):
        for context in (150, 1500, 4000):
            model.setup_cache(1, context + 1 + lookahead, cache_dtype)
            with torch.inference_mode():
                model(random_ids(model, context, generator), 0)
                checked = random_ids(model, 1 + lookahead, generator)
                kernel_ms, torch_ms = kernel_and_torch_ms(partial(model, checked, context), repeats)
            rows.append(
                {
                    "name": (
                        f"{1 + lookahead} tokens after {context} cached, "
                        f"{'int8' if cache_dtype else 'float'} cache"
                    ),
                    "kernel_pass_ms": kernel_ms,
                    "torch_pass_ms": torch_ms,
                }
            )
            print(f"{rows[-1]['name']}: kernel {kernel_ms:.1f} ms, torch {torch_ms:.1f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speculation_arguments(parser)
    parser.add_argument(
        "--weights",
        choices=["int8", "fp32"],
        default="int8",
        help="int8 (bf16 activations, fast) or fp32 (fp32 activations, exact arithmetic)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above 0: both sample (seeded)"
    )
    options = parse_speculation(parser)
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_bench_model(options.quick)
    tokenizer = loaded.tokenizer
    if options.weights == "int8":
        decoder = Decoder(
            build_decoder(quantized_copy(cfg, dict(bits=8)), dtype=torch.bfloat16),
            tokenizer,
            reuse_prefixes=False,
        )  # both ways prefill the whole prompt
    else:
        decoder = Decoder(build_decoder(loaded.model, dtype=torch.float32), tokenizer, reuse_prefixes=False)
    params = SamplingParams(
        max_new_tokens=options.new_tokens,
        temperature=options.temperature,
        seed=0 if options.temperature > 0 else None,
    )
    sampled = not params.greedy
    rows = []
    for name, text in PROMPTS.items():
        ids = prompt_ids(tokenizer, text, chat_template=True)[0].tolist()
        decoder.generate_ids([ids], params)  # warm-up
        plain_s, fast_s = [], []
        for _ in range(options.repeats):
            start = time.perf_counter()
            (plain,) = decoder.generate_ids([ids], params)
            plain_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            fast, stats = generate_speculative(decoder, ids, params, lookahead=options.lookahead)
            fast_s.append(time.perf_counter() - start)
        plain_tok_s = len(plain.token_ids) / statistics.median(
            plain_s
        )  # sampled: each its own draws, so its own length
        fast_tok_s = stats.new_tokens / statistics.median(fast_s)
        rows.append(
            {
                "name": name,
                "prompt_tokens": len(ids),
                "new_tokens": stats.new_tokens,
                "plain_tok_s": plain_tok_s,
                "speculative_tok_s": fast_tok_s,
                "speedup": fast_tok_s / plain_tok_s,
                "acceptance_rate": stats.acceptance_rate,
                "tokens_per_pass": stats.tokens_per_pass,
                "identical": None if sampled else fast.token_ids == plain.token_ids,
                "completion": plain.text[:160],
            }
        )
        print(
            (
                f"{name}: {plain_tok_s:.1f} -> {fast_tok_s:.1f} tok/s, acceptance "
                f"{stats.acceptance_rate:.2f}, identical {rows[-1]['identical']}"
            ),
            flush=True,
        )
    costs = verification_pass_costs(decoder.model, options.lookahead)
    summary = {
        "lookahead": options.lookahead,
        "repeats": options.repeats,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("speculative_cpu.py", parser, options)
    name = (
        "speculative_cpu"
        + ("" if options.weights == "int8" else f"_{options.weights}")
        + ("_sampled" if sampled else "")
    )
    machine = machine_info()
    lines = [
        f"# {name}",
        "",
        f"- command: `{command}`",
        (
            "- the same prompts decoded greedily: `speculative_cpu.md`"
            if sampled
            else (
                "- the same prompts with the other weights: "
                f"`{'speculative_cpu_fp32.md' if options.weights == 'int8' else 'speculative_cpu.md'}` "
                f"(`--weights {'fp32' if options.weights == 'int8' else 'int8'}`)"
            )
        ),
        machine_line(machine, f"{options.threads} threads", summary["seconds"]),
        f"- default model, {WEIGHTS[options.weights]} in the bundled decoder, eager; "
        f"{f'sampled at temperature {options.temperature:g} (seed 0)' if sampled else 'greedy'}, up to "
        f"{options.new_tokens} new tokens, chat template; prompt lookup with n-grams of 3 down to 2 tokens "
        f"and {options.lookahead} guesses per pass; median of {options.repeats} runs",
        "",
        (
            "| prompt | prompt tokens | new tokens | plain tok/s | speculative tok/s | speedup | acceptance "
            "| tokens per pass | identical output |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *[
            f"| {r['name']} | {r['prompt_tokens']} | {r['new_tokens']} | {r['plain_tok_s']:.1f} | "
            f"{r['speculative_tok_s']:.1f} | {r['speedup']:.2f}x | {100 * r['acceptance_rate']:.0f}% | "
            f"{r['tokens_per_pass']:.2f} | "
            f"{'sampled' if r['identical'] is None else 'yes' if r['identical'] else 'NO'} |"
            for r in rows
        ],
        "",
        f"Completions (plain {'sampling' if sampled else 'greedy'}, first 160 characters):",
        "",
        *[f"- {r['name']}: {r['completion']!r}" for r in rows],
        "",
        "One verification pass of one sequence (`Transformer.forward`), median of 9 alternating:",
        "",
        "| pass | slimlm's kernel ms | torch's attention ms | kernel speedup |",
        "|---|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['kernel_pass_ms']:.1f} | {r['torch_pass_ms']:.1f} | "
            f"{r['torch_pass_ms'] / r['kernel_pass_ms']:.2f}x |"
            for r in costs
        ],
        "",
    ]
    publish(
        name,
        command,
        {"summary": summary, "rows": rows + costs},
        lines,
        options.quick,
        notes="speculative_cpu",
    )


if __name__ == "__main__":
    main()
