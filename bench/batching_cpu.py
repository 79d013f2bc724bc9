"""Throughput of batched decoding on CPU: what serving several requests at once buys.

The default model at int4 g64 (RTN, head too; bundled decoder, bf16 activations, eager):
  static batches    B prompts of 16 tokens decoded together (Decoder.generate_ids), B = 1..16
  continuous        16 requests of 16-token prompts and 32-128 new tokens sent at once to a
                    ContinuousBatcher with 8 rows: they join and leave between steps
Reports total new tokens per second and the per-request rate. Writes
bench/results/batching_cpu.{md,json}.

    python bench/batching_cpu.py [--new-tokens 64 --threads 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from slimlm.eval.speed import benchmark_prompt
from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.rundir import machine_info

from benchlib import command_line, machine_line, write_result
from decode_cpu import load_default, quantized_copy

BATCHES = (1, 2, 4, 8, 16)


def per_request(row: dict) -> str:
    return "" if row["tok_s_per_request"] is None else f"{row['tok_s_per_request']:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_default()
    model = quantized_copy(cfg, dict(bits=4, group_size=64))
    tokenizer = loaded.tokenizer
    decoder = Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer)
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
        rows.append({"name": f"static batch {batch}", "batch": batch, "tok_s": total, "tok_s_per_request": total / batch, "decode_tok_s": decoder.last_stats.decode_tok_s, "seconds": seconds})
        print(f"batch {batch}: {total:.1f} tok/s in all, {total / batch:.1f} per request", flush=True)
    batcher = ContinuousBatcher(Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer), max_batch=8, max_seq=16 + 128)
    lengths = [32 + (96 * i) // 15 for i in range(16)]  # 32..128 new tokens
    produced = []

    def client(ids: list[int], new_tokens: int) -> None:
        *_, generation = batcher.submit(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        produced.append(len(generation.token_ids))

    begin = time.perf_counter()
    threads = [threading.Thread(target=client, args=(prompts[i], lengths[i])) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - begin
    total = sum(produced) / seconds
    rows.append({"name": "continuous, 16 requests, 8 rows", "batch": 8, "tok_s": total, "tok_s_per_request": None, "decode_steps": batcher.steps, "new_tokens": sum(produced), "seconds": seconds})
    print(f"continuous: {total:.1f} tok/s in all over {batcher.steps} steps", flush=True)
    summary = {"new_tokens": options.new_tokens, "threads": options.threads, "seconds": time.perf_counter() - started}
    command = command_line("batching_cpu.py", parser, options)
    machine = machine_info()
    single = rows[0]["tok_s"]
    lines = [
        "# batching_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{options.threads} threads", summary["seconds"]),
        f"- default model, int4 g64 RTN (head too), bundled decoder, bf16 activations, eager (no compiled step); 16-token prompts; static batches decode {options.new_tokens} new tokens each",
        "- continuous: 16 requests sent at once, 32 to 128 new tokens each, 8 cache rows: a request takes a row when one frees, prefills, and joins the running batch at the next step",
        "",
        "| run | new tokens/s in all | vs batch 1 | per request tokens/s |",
        "|---|---:|---:|---:|",
        *[f"| {r['name']} | {r['tok_s']:.1f} | {r['tok_s'] / single:.2f}x | {per_request(r)} |" for r in rows],
        "",
    ]
    write_result("batching_cpu", command, {"summary": summary, "rows": rows}, lines)


if __name__ == "__main__":
    main()
