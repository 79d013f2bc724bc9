"""Batch-1 decode speed on CPU against context length: fp32 and int8 key/value caches.

At a long context a small model's decode step reads more cache than weights (the default model's
fp32 cache at 4096 tokens: 94 MB a token, its int4 weights: 76 MB), so the cache's bytes and the
attention that reads them decide the speed. Rows, each at every context length:
  slimlm fp32 cache           the default model int4 g64 RTN with int8 activations (decode_cpu's
                              fastest row), decode step compiled, the fp32 cache the CPU decoder
                              keeps by default, attended in slimlm's decode-attention kernel
  slimlm fp32 cache, loop     the same, attention left to torch.compile (one fused loop over the
                              cache: what the decoder did before the kernel)
  slimlm int8 cache           an int8 cache (codes and a scale per head and slot), read as
                              stored by the same kernel
  llama.cpp Q4_0              llama-cpp-python on a Q4_0 GGUF of the same model, f16 cache, and a
                              q8_0 cache (with flash attention, which a quantized cache needs)
For each context length every row is prefilled once with that many WikiText-2 test tokens, then
each decodes exactly `--new-tokens` tokens (greedy) from that context once per round, for
`--repeats` rounds (interleaved; each decode rewinds to the context), medians. Quality: the mean
per-token KL from the fp32-cache decoder to the int8-cache one over the last `--kl-positions`
tokens of the longest context's window, through each one's compiled decode step: what storing
the cache in int8 costs, the weights' rounding aside.
Writes bench/results/kv_cache_cpu.{md,json,png}; --quick (the tiny test model, a test) only prints.

    python bench/kv_cache_cpu.py [--contexts 128 1024 4096 --new-tokens 64 --repeats 3 --threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import (
    QUICK_RUNS,
    RESULTS,
    add_skip_llama_cpp,
    check_llama_cpp,
    command_line,
    eval_ids,
    llama_cpp_bytes,
    load_bench_model,
    machine_line,
    publish,
)
from decode_cpu import cache_cell, llama_cpp_file, quantized_copy, step_logprobs
from tqdm import tqdm

from slimlm.distill.losses import forward_kl
from slimlm.eval.bandwidth import memory_bandwidth
from slimlm.eval.plots import plt, save_figure
from slimlm.gguf_export import export_gguf
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.models import resolve_model
from slimlm.rundir import machine_info

# slimlm rows: the cache's dtype and whether decode steps attend in slimlm's kernel
SLIMLM_ROWS = {
    "fp32 cache": (None, True),
    "fp32 cache, compiled loop": (None, False),
    "int8 cache": (torch.int8, True),
}
# llama.cpp's cache types: f16, and q8_0 (GGML type 8: blocks of 32 int8 codes and an f16 scale)
LLAMA_ROWS = {"f16 cache": (2.0, {}), "q8_0 cache": (34 / 32, {"type_k": 8, "type_v": 8, "flash_attn": True})}


class Row:
    """One decoder: `prefill` a context once (untimed), then `decode` from it as often as asked."""

    name: str
    info: dict  # what the result rows say of it: the decoder and its cache

    def prefill(self, prompt: list[int]) -> None:
        raise NotImplementedError

    def decode(self, new_tokens: int) -> float:
        """Decode `new_tokens` greedily from the prefilled context; tokens/s over all but the first."""
        raise NotImplementedError

    def bytes_per_token(self, context: int) -> int:
        raise NotImplementedError


class SlimlmRow(Row):
    def __init__(self, cache: str, model, tokenizer, cache_dtype, kernel: bool, slots: int):
        self.name, self.info = f"slimlm int4 x int8, {cache}", {"decoder": "slimlm", "cache": cache}
        self.decoder = Decoder(
            build_decoder(model, dtype=torch.bfloat16, int8_activations=True),
            tokenizer,
            cache_dtype=cache_dtype,
        )
        self.decoder.model.setup_cache(
            1, slots, cache_dtype
        )  # once, for the longest context: the compiled step is specialized to its size
        for block in self.decoder.model.layers:
            block.attention.decode_kernel &= kernel
        self.decoder.compile_decode_step()
        self.context, self.first = 0, 0

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        self.context = len(prompt)
        self.first = int(self.decoder.prefill(torch.tensor([prompt])).argmax())

    @torch.inference_mode()
    def decode(self, new_tokens: int) -> float:
        token = self.first
        for position in range(self.context, self.context + new_tokens):
            if position == self.context + 1:
                started = time.perf_counter()
            token = int(self.decoder.step(torch.tensor([[token]]), position)[0, -1].float().argmax())
        return (new_tokens - 1) / (time.perf_counter() - started)

    def bytes_per_token(self, context: int) -> int:
        return self.decoder.model.bytes_per_token(context)


class LlamaCppRow(Row):
    def __init__(
        self,
        cache: str,
        path,
        slots: int,
        threads: int,
        config,
        cache_bytes_per_value: float,
        llama_options: dict,
    ):
        import llama_cpp

        self.name, self.info = f"llama.cpp Q4_0, {cache}", {"decoder": "llama.cpp", "cache": cache}
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=slots,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **llama_options,
        )
        self.logits = lambda: np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.llm.n_vocab(),)
        )
        self.weights, self.cache_per_slot = llama_cpp_bytes(path, config, cache_bytes_per_value)
        self.context, self.first = 0, 0

    def prefill(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)
        self.context, self.first = len(prompt), int(np.argmax(self.logits()))

    def decode(self, new_tokens: int) -> float:
        self.llm.n_tokens = self.context  # the next eval drops the cache after the context
        token = self.first
        for step in range(new_tokens):
            if step == 1:
                started = time.perf_counter()
            self.llm.eval([token])
            token = int(np.argmax(self.logits()))
        return (new_tokens - 1) / (time.perf_counter() - started)

    def bytes_per_token(self, context: int) -> int:
        return int(self.weights + self.cache_per_slot * context)


def q4_0_file(cfg, loaded, quick: bool) -> Path:
    """The Q4_0 GGUF llama.cpp decodes: decode_cpu's of the default model, or a --quick run's of
    the tiny model (made afresh, apart from decode_cpu's)."""
    if not quick:
        return llama_cpp_file("default-q4_0", "Q4_0", loaded.model, loaded.tokenizer, resolve_model(cfg))
    path = QUICK_RUNS / "kv_cache_cpu-q4_0.gguf"
    path.unlink(missing_ok=True)
    export_gguf(loaded.model, loaded.tokenizer, path, "Q4_0")
    return path


def cache_kl(reference: Decoder, rounded: Decoder, window: torch.Tensor, positions: int) -> float:
    """Mean per-token KL from `reference`'s next-token distribution to `rounded`'s over the last
    `positions` tokens of `window`, each through its own decode step."""
    return (
        forward_kl(step_logprobs(reference, window, positions), step_logprobs(rounded, window, positions))
        .mean()
        .item()
    )


def race(
    rows: list[Row], contexts: list[int], text: torch.Tensor, new_tokens: int, repeats: int, bandwidth: float
) -> list[dict]:
    """Per context: every row prefilled once, then `repeats` rounds in which each row decodes once."""
    results = []
    for context in contexts:
        prompt = text[:context].tolist()
        for row in tqdm(rows, desc=f"prefill {context} tokens"):
            row.prefill(prompt)
            row.decode(new_tokens)  # warm-up (the compiled step's first calls at a new length)
        speeds: dict[str, list[float]] = {row.name: [] for row in rows}
        for _ in tqdm(range(repeats), desc=f"rounds at {context} tokens"):
            for row in rows:
                speeds[row.name].append(row.decode(new_tokens))
        for row in rows:
            speed, mean_context = statistics.median(speeds[row.name]), context + new_tokens // 2
            bytes_per_token = row.bytes_per_token(mean_context)
            results.append(
                {
                    "name": f"{row.name}, {context} tokens",
                    **row.info,
                    "context_tokens": context,
                    "decode_tok_s": speed,
                    "bytes_per_token": bytes_per_token,
                    "bandwidth_fraction": speed * bytes_per_token / bandwidth,
                }
            )
            print(f"{results[-1]['name']}: {speed:.1f} tok/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 1024, 4096], help="prompt lengths in tokens"
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kl-positions", type=int, default=64)
    add_skip_llama_cpp(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "a tiny random-weight model, contexts of 16 and 64 tokens, 4 new tokens, 1 round; results only "
            "printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick:
        options.contexts, options.new_tokens, options.repeats, options.kl_positions = [16, 64], 4, 1, 4
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_bench_model(options.quick)
    tokenizer, config = loaded.tokenizer, loaded.model.config
    slots = max(options.contexts) + options.new_tokens
    if slots > config.max_position_embeddings or min(options.contexts) < 2 or options.new_tokens < 2:
        parser.error(
            f"--contexts must be 2 to {config.max_position_embeddings - options.new_tokens} tokens and "
            f"--new-tokens at least 2 (the model has {config.max_position_embeddings} positions)"
        )
    text = eval_ids(tokenizer, options.quick)
    bandwidth = memory_bandwidth("cpu", refresh=True).bytes_per_s
    model = quantized_copy(cfg, dict(bits=4, group_size=64))
    rows: list[Row] = []
    for cache, (dtype, kernel) in SLIMLM_ROWS.items():
        print(f"compiling slimlm, {cache}", flush=True)
        rows.append(SlimlmRow(cache, model, tokenizer, dtype, kernel, slots))
    kl = cache_kl(
        rows[0].decoder,
        rows[2].decoder,
        text[: max(options.contexts)],
        min(options.kl_positions, max(options.contexts) - 1),
    )
    if not options.skip_llama_cpp:
        gguf = q4_0_file(cfg, loaded, options.quick)
        check_llama_cpp(gguf, options.threads)
        rows += [
            LlamaCppRow(cache, gguf, slots, options.threads, config, per_value, llama_options)
            for cache, (per_value, llama_options) in LLAMA_ROWS.items()
        ]
    results = race(rows, options.contexts, text, options.new_tokens, options.repeats, bandwidth)
    summary = {
        "bandwidth_bytes_s": bandwidth,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "threads": options.threads,
        "kl_int8_cache_vs_fp32_cache": kl,
        "kl_positions": options.kl_positions,
        "kl_context_tokens": max(options.contexts),
        "seconds": time.perf_counter() - started,
    }
    command = command_line("kv_cache_cpu.py", parser, options)
    if not options.quick:
        write_plot(results)
    publish(
        "kv_cache_cpu",
        command,
        {"summary": summary, "rows": results},
        markdown(results, summary, command),
        options.quick,
    )


def write_plot(rows: list[dict]) -> None:
    """bench/results/kv_cache_cpu.png: decode tokens/s against context, one line per decoder and cache."""
    figure, axis = plt.subplots(figsize=(7, 4.2))
    series = list(dict.fromkeys((row["decoder"], row["cache"]) for row in rows))
    for decoder, cache in series:
        points = [row for row in rows if (row["decoder"], row["cache"]) == (decoder, cache)]
        axis.plot(
            [row["context_tokens"] for row in points],
            [row["decode_tok_s"] for row in points],
            marker="o",
            linestyle="-" if decoder == "slimlm" else "--",
            label=f"{decoder}, {cache}",
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("context (prompt tokens)")
    axis.set_ylabel("decode tokens/s (batch 1)")
    axis.set_title("Decode speed against context on CPU, default model at int4")
    axis.legend()
    axis.grid(alpha=0.3)
    save_figure(figure, RESULTS / "kv_cache_cpu.png")


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    machine = machine_info()
    return [
        "# kv_cache_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{summary['threads']} threads for every row", summary["seconds"]),
        (
            f"- batch 1, a prompt of the context's length (WikiText-2 test), exactly {summary['new_tokens']} "
            f"new tokens (greedy), median of {summary['repeats']} rounds after a warm-up, every row decoding "
            "once per round (interleaved)"
        ),
        (
            "- memory bandwidth (eval/bandwidth.py, measured at the start of this run): "
            f"{summary['bandwidth_bytes_s'] / 1e9:.1f} GB/s; the processor's largest cache: "
            f"{cache_cell(machine)}"
        ),
        (
            "- bytes per token: weights read per step + the cache up to the mean context (llama.cpp: f16, 2 "
            "bytes a value; q8_0, 34 bytes per 32)"
        ),
        (
            "- int8 cache against fp32 cache: mean per-token KL "
            f"{summary['kl_int8_cache_vs_fp32_cache']:.5f} over the last {summary['kl_positions']} tokens of "
            f"a {summary['kl_context_tokens']}-token window (same int4 weights, each through its compiled "
            "step)"
        ),
        "",
        "| decoder | context tokens | decode tok/s | MB read per token | bandwidth used |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {r['name'].rsplit(', ', 1)[0]} | {r['context_tokens']} | {r['decode_tok_s']:.1f} | "
            f"{r['bytes_per_token'] / 1e6:.1f} | {100 * r['bandwidth_fraction']:.0f}% |"
            for r in rows
        ],
        "",
        "![kv_cache_cpu](kv_cache_cpu.png)",
        "",
    ]


if __name__ == "__main__":
    main()
