"""Throughput of batched decoding on CPU: what serving several requests at once buys.

The default model at int4 g64 (RTN, head too; bundled decoder, bf16 activations, eager):
  static batches    B prompts of 16 tokens decoded together (Decoder.generate_ids), B = 1..16
  continuous        16 requests of 16-token prompts and 32-128 new tokens sent at once to a
                    ContinuousBatcher with 8 rows: they join and leave between steps
  burst             8 requests of 48-token prompts (a chat turn's new message) sent at once,
                    16 new tokens each: their prompts share passes
  long prompts      8 requests of 1,024-token prompts, 64 new tokens each, 8 rows: each step
                    attends over about a thousand cached slots per sequence
  arrivals          4 requests answering 128 tokens; after 1 s four 1,024-token prompts arrive:
                    how long the running answers wait for the new prompts' prefill
  short behind long four 1,024-token prompts; after 1 s four 16-token prompts arrive: how long
                    the short ones wait for their first token behind the long prefills
  pass cost         one forward pass of N prompt tokens (N = 1..256), and eight 30-token prompts
                    prefilled one pass each or packed into one: where sharing a pass pays
Reports total new tokens per second, the per-request rate, the time from a request to its first
text piece, and the time between an answer's text pieces. Writes
bench/results/batching_cpu.{md,json}; --quick (the tiny test model, a test) only prints.

    python bench/batching_cpu.py [--new-tokens 64 --threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchlib import bench_int4, command_line, machine_line, pass_table, publish, run_together

from slimlm.eval.speed import benchmark_prompt
from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.model import Segment
from slimlm.inference.sampling import SamplingParams
from slimlm.rundir import machine_info

BATCHES = (1, 2, 4, 8, 16)


def per_request(row: dict) -> str:
    return "" if row["tok_s_per_request"] is None else f"{row['tok_s_per_request']:.1f}"


def ms(row: dict, key: str) -> str:
    return f"{row[key]:.0f}" if key in row else ""


def continuous(model, tokenizer, name: str, requests: list[tuple[list[int], int, float]]) -> dict:
    """Requests (prompt, new tokens, seconds after the first it is sent) to a ContinuousBatcher
    of 8 rows: new tokens per second from the first request to the last answer, each request's
    time to its first text piece, and the time between a request's consecutive text pieces (how
    steadily each answer streams)."""
    batcher = ContinuousBatcher(
        Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer),
        max_batch=8,
        max_seq=max(len(ids) + new for ids, new, _ in requests),
    )
    produced, gaps, firsts = [], [], [0.0] * len(requests)  # firsts: in the order of `requests`
    begin = time.perf_counter()

    def client(index: int, ids: list[int], new_tokens: int, delay: float) -> None:
        time.sleep(max(0.0, begin + delay - time.perf_counter()))
        sent, times = time.perf_counter(), []
        for item in batcher.submit(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)):
            times.append(time.perf_counter())
            last = item  # the last item is the Generation
        produced.append(len(last.token_ids))
        firsts[index] = times[0] - sent
        gaps.extend(
            later - earlier for earlier, later in zip(times[:-2], times[1:-1])
        )  # pieces only (the last item is the Generation)

    run_together(client, [(index, *request) for index, request in enumerate(requests)])
    seconds = time.perf_counter() - begin
    total = sum(produced) / seconds
    decode = (
        batcher.step_tokens / batcher.step_s if batcher.step_s else float("nan")
    )  # steps with no prompt beside them
    gap_median, gap_max = 1000 * statistics.median(gaps), 1000 * max(gaps)
    first_median, first_max = 1000 * statistics.median(firsts), 1000 * max(firsts)
    batcher.close()
    print(
        f"{name}: {total:.1f} tok/s in all, {decode:.1f} in its {batcher.steps} decode steps; first piece "
        f"{first_median:.0f} ms median, {first_max:.0f} ms longest; between pieces {gap_median:.0f} ms "
        f"median, {gap_max:.0f} ms longest",
        flush=True,
    )
    return {
        "name": name,
        "batch": 8,
        "tok_s": total,
        "tok_s_per_request": None,
        "decode_tok_s": decode,
        "first_piece_median_ms": first_median,
        "first_piece_max_ms": first_max,
        "first_pieces_ms": [1000 * first for first in firsts],
        "gap_median_ms": gap_median,
        "gap_max_ms": gap_max,
        "decode_steps": batcher.steps,
        "new_tokens": sum(produced),
        "seconds": seconds,
    }


@torch.inference_mode()
def pass_costs(decoder: Decoder, ids: list[int]) -> list[dict]:
    """Milliseconds of one packed pass (`Transformer.forward_segments`, the batcher's) of N
    prompt tokens, and of eight 30-token prompts one pass each against all in one pass (best of 3)."""
    model = decoder.model
    model.setup_cache(8, 512)

    def best_ms(work) -> float:
        times = []
        for _ in range(3):
            begin = time.perf_counter()
            work()
            times.append(1000 * (time.perf_counter() - begin))
        return min(times)

    rows = [
        {
            "name": f"one pass of {n} prompt tokens",
            "pass_ms": best_ms(lambda n=n: model.forward_segments([Segment(0, 0, ids[:n])], [1])),
        }
        for n in (1, 4, 16, 32, 64, 128, 256)
    ]
    prompts = [Segment(row, 0, ids[30 * row : 30 * (row + 1)]) for row in range(8)]
    rows.append(
        {
            "name": "8 prompts of 30 tokens, a pass each",
            "pass_ms": best_ms(lambda: [model.forward_segments([segment], [1]) for segment in prompts]),
        }
    )
    rows.append(
        {
            "name": "8 prompts of 30 tokens, one pass",
            "pass_ms": best_ms(lambda: model.forward_segments(prompts, [1] * 8)),
        }
    )
    for row in rows:
        print(f"{row['name']}: {row['pass_ms']:.0f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random-weight model, 8 new tokens a static batch; results only printed (tests)",
    )
    options = parser.parse_args()
    if options.quick:
        options.new_tokens = 8
    started = time.perf_counter()
    model, loaded = bench_int4(options.threads, options.quick)
    tokenizer = loaded.tokenizer
    decoder = Decoder(
        build_decoder(model, dtype=torch.bfloat16), tokenizer, reuse_prefixes=False
    )  # each repeat prefills its prompts
    text_ids = benchmark_prompt(tokenizer, 16 * 16).tolist()
    prompts = [text_ids[16 * i : 16 * (i + 1)] for i in range(16)]
    params = SamplingParams(max_new_tokens=options.new_tokens, ignore_eos=True)
    rows = []
    for batch in BATCHES:
        decoder.generate_ids(prompts[:batch], params)  # warm-up at this batch size
        begin = time.perf_counter()
        decoder.generate_ids(prompts[:batch], params)
        seconds = time.perf_counter() - begin
        total = batch * options.new_tokens / seconds
        rows.append(
            {
                "name": f"static batch {batch}",
                "batch": batch,
                "tok_s": total,
                "tok_s_per_request": total / batch,
                "decode_tok_s": decoder.last_stats.decode_tok_s,
                "seconds": seconds,
            }
        )
        print(f"batch {batch}: {total:.1f} tok/s in all, {total / batch:.1f} per request", flush=True)
    costs = pass_costs(decoder, benchmark_prompt(tokenizer, 256).tolist())
    lengths = [32 + (96 * i) // 15 for i in range(16)]  # 32..128 new tokens
    rows.append(
        continuous(
            model,
            tokenizer,
            "continuous, 16 requests, 8 rows",
            [(ids, new, 0.0) for ids, new in zip(prompts, lengths)],
        )
    )
    burst_ids = benchmark_prompt(tokenizer, 8 * 48).tolist()
    rows.append(
        continuous(
            model,
            tokenizer,
            "8 requests of 48-token prompts at once",
            [(burst_ids[48 * i : 48 * (i + 1)], 16, 0.0) for i in range(8)],
        )
    )
    long_ids = benchmark_prompt(tokenizer, 8 * 1024).tolist()
    long_prompts = [long_ids[1024 * i : 1024 * (i + 1)] for i in range(8)]
    rows.append(
        continuous(
            model,
            tokenizer,
            "continuous, 1,024-token prompts, 8 rows",
            [(ids, 64, 0.0) for ids in long_prompts],
        )
    )
    arriving = [(ids, 128, 0.0) for ids in prompts[:4]] + [(ids, 8, 1.0) for ids in long_prompts[:4]]
    rows.append(continuous(model, tokenizer, "4 answers, then 4 1,024-token prompts arrive", arriving))
    behind = [(ids, 8, 0.0) for ids in long_prompts[:4]] + [(ids, 8, 1.0) for ids in prompts[:4]]
    rows.append(continuous(model, tokenizer, "4 1,024-token prompts, then 4 16-token prompts arrive", behind))
    summary = {
        "new_tokens": options.new_tokens,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("batching_cpu.py", parser, options)
    machine = machine_info()
    single = rows[0]["tok_s"]
    lines = [
        "# batching_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{options.threads} threads", summary["seconds"]),
        (
            "- default model, int4 g64 RTN (head too), bundled decoder, bf16 activations, eager (no "
            f"compiled step); 16-token prompts; static batches decode {options.new_tokens} new tokens each"
        ),
        (
            "- continuous: 16 requests sent at once, 32 to 128 new tokens each, 8 cache rows: a request "
            "takes a row when one frees, prefills, and joins the running batch at the next step; 8 requests "
            "of 48-token prompts sent at once, 16 new tokens each; and 8 requests of 1,024-token prompts, 64 "
            "new tokens each (the time includes their prefills); and 4 answers of 128 tokens that four "
            "1,024-token prompts (8 new tokens each) join after 1 s; and four 1,024-token prompts that four "
            "16-token prompts join after 1 s (8 new tokens each)"
        ),
        "",
        (
            "| run | new tokens/s in all | vs batch 1 | per request tokens/s | tokens/s in decode steps "
            "(prefills aside) | ms to a request's first piece: median | longest | ms between an answer's "
            "pieces: median | longest |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['tok_s']:.1f} | {r['tok_s'] / single:.2f}x | {per_request(r)} | "
            f"{r['decode_tok_s']:.1f} | {ms(r, 'first_piece_median_ms')} | {ms(r, 'first_piece_max_ms')} | "
            f"{ms(r, 'gap_median_ms')} | {ms(r, 'gap_max_ms')} |"
            for r in rows
        ],
        "",
        *pass_table("One forward pass of the batcher (`Transformer.forward_segments`), best of 3:", costs),
    ]
    publish("batching_cpu", command, {"summary": summary, "rows": rows + costs}, lines, options.quick)


if __name__ == "__main__":
    main()
