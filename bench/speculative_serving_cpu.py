"""Prompt lookup in the server's batcher on CPU: what `slimlm serve --prompt-lookup` buys.

The prompts of bench/speculative_cpu.py (repeat a passage, edit it, an open question) through a
ContinuousBatcher as `slimlm serve` runs it (default model at int8, bf16 activations, eager),
greedy, without guesses and with prompt lookup (`lookahead` guesses a step): each request alone,
then all three sent at once, the two batchers alternating. For each: tokens/s of the request
(from sending to its last token, the prefill included; median of the repeats), the speedup, and
whether every answer is the one without guesses (it must be); the share of guesses kept. Then
the cost of one pass of three answers checking their guesses, the guesses attended as queries of
the batched decode step (slimlm's CPU kernel) against an attention call per answer. Writes
bench/results/speculative_serving_cpu.{md,json}; --quick (the tiny test model, a test) only prints.

    python bench/speculative_serving_cpu.py [--new-tokens 96 --lookahead 4 --repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from benchlib import (
    command_line,
    kernel_and_torch_ms,
    load_bench_model,
    machine_line,
    pass_table,
    publish,
    run_together,
)
from decode_cpu import quantized_copy
from speculative_cpu import PROMPTS, parse_speculation, random_ids, speculation_arguments

from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.generate import prompt_ids
from slimlm.inference.model import Segment, Transformer
from slimlm.inference.sampling import SamplingParams
from slimlm.rundir import machine_info


def serve(
    batcher: ContinuousBatcher, requests: list[list[int]], params: SamplingParams, together: bool
) -> list[tuple[list[int], float]]:
    """Each request's answer and seconds from sending to its end: one after another, or all at once."""
    results: list = [None] * len(requests)

    def client(index: int) -> None:
        begin = time.perf_counter()
        *_, generation = batcher.submit(requests[index], params)
        results[index] = (generation.token_ids, time.perf_counter() - begin)

    if together:
        run_together(client, [(index,) for index in range(len(requests))])
    else:
        for index in range(len(requests)):
            client(index)
    return results


def guess_pass_costs(model: Transformer, lookahead: int, repeats: int = 7) -> list[dict]:
    """Milliseconds of one packed pass of three answers, each its last token and `lookahead`
    guesses, after 150 and 1,500 cached tokens: the guesses as one-token queries of the batched
    decode step (slimlm's CPU kernel reads each query's cache row in place) against an attention
    call per answer (what runs without the kernel); median of `repeats` passes, the two alternating."""
    generator, rows = torch.Generator().manual_seed(0), []
    for context in (150, 1500):
        model.setup_cache(3, context + 1 + lookahead)
        with torch.inference_mode():
            for row in range(3):
                model(random_ids(model, context, generator), 0, first_row=row)
            segments = [
                Segment(row, context, random_ids(model, 1 + lookahead, generator)[0].tolist())
                for row in range(3)
            ]
            costs = kernel_and_torch_ms(
                partial(model.forward_segments, segments, [1 + lookahead] * 3), repeats
            )
        for pass_ms, how in zip(
            costs, ("guesses as queries of the batched step", "an attention call per answer")
        ):
            rows.append(
                {
                    "name": f"3 answers x {1 + lookahead} tokens after {context} cached, {how}",
                    "pass_ms": pass_ms,
                }
            )
            print(f"{rows[-1]['name']}: {pass_ms:.0f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    speculation_arguments(parser)
    options = parse_speculation(parser)
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_bench_model(options.quick)
    tokenizer = loaded.tokenizer
    model = quantized_copy(cfg, dict(bits=8))
    requests = [prompt_ids(tokenizer, text, chat_template=True)[0].tolist() for text in PROMPTS.values()]
    params = SamplingParams(max_new_tokens=options.new_tokens)
    max_seq = max(map(len, requests)) + options.new_tokens
    batchers = {}
    for lookahead in (0, options.lookahead):  # each prefills every prompt whole
        batchers[lookahead] = ContinuousBatcher(
            Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer, reuse_prefixes=False),
            max_batch=len(requests),
            max_seq=max_seq,
            lookahead=lookahead,
        )
        serve(batchers[lookahead], requests[:1], SamplingParams(max_new_tokens=4), together=False)  # warm-up
    # (together, lookahead) -> each repeat's answers and seconds; repeats alternate the two, the
    # machine's drift shared
    runs: dict = {}
    for _ in range(options.repeats):
        for together in (False, True):
            for lookahead, batcher in batchers.items():
                runs.setdefault((together, lookahead), []).append(serve(batcher, requests, params, together))
    kept = batchers[options.lookahead].accepted / max(batchers[options.lookahead].proposed, 1)
    for batcher in batchers.values():
        batcher.close()
    rows = []
    for together in (False, True):
        for index, name in enumerate(PROMPTS):
            plain, fast = (
                [run[index] for run in runs[(together, lookahead)]] for lookahead in (0, options.lookahead)
            )
            row = {
                "name": f"{name}, {'all three at once' if together else 'alone'}",
                "new_tokens": len(plain[0][0]),
                "plain_tok_s": statistics.median(len(ids) / seconds for ids, seconds in plain),
                "lookup_tok_s": statistics.median(len(ids) / seconds for ids, seconds in fast),
                "identical": all(ids == plain[0][0] for ids, _ in plain + fast),
            }
            row["speedup"] = row["lookup_tok_s"] / row["plain_tok_s"]
            rows.append(row)
            print(
                (
                    f"{row['name']}: {row['plain_tok_s']:.1f} -> {row['lookup_tok_s']:.1f} tok/s "
                    f"({row['speedup']:.2f}x), identical {row['identical']}"
                ),
                flush=True,
            )
    summary = {
        "lookahead": options.lookahead,
        "repeats": options.repeats,
        "guesses_kept": kept,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    costs = guess_pass_costs(build_decoder(model, dtype=torch.bfloat16), options.lookahead)
    summary["seconds"] = time.perf_counter() - started
    command = command_line("speculative_serving_cpu.py", parser, options)
    lines = [
        "# speculative_serving_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), f"{options.threads} threads", summary["seconds"]),
        "- default model, int8 (w8 RTN per-channel, head too) with bf16 activations in the bundled decoder, "
        f"eager; a ContinuousBatcher of 3 rows as `slimlm serve` runs it, greedy, up to {options.new_tokens} "
        "new tokens, chat template; without guesses and with prompt lookup (`--prompt-lookup --lookahead "
        f"{options.lookahead}`: n-grams of 3 down to 2 tokens); tokens/s of each request from sending to its "
        f"last token (prefill included), median of {options.repeats} runs alternating the two",
        f"- guesses kept over all runs: {100 * kept:.0f}%",
        "",
        (
            "| request | new tokens | tok/s without guesses | tok/s with prompt lookup | speedup | identical "
            "output (every run) |"
        ),
        "|---|---:|---:|---:|---:|---|",
        *[
            f"| {r['name']} | {r['new_tokens']} | {r['plain_tok_s']:.1f} | {r['lookup_tok_s']:.1f} | "
            f"{r['speedup']:.2f}x | {'yes' if r['identical'] else 'NO'} |"
            for r in rows
        ],
        "",
        *pass_table(
            "One packed pass checking guesses (`Transformer.forward_segments`), median of 7 alternating:",
            costs,
        ),
    ]
    publish(
        "speculative_serving_cpu", command, {"summary": summary, "rows": rows + costs}, lines, options.quick
    )


if __name__ == "__main__":
    main()
