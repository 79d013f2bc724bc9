"""Batch-1 decode speed on CPU: the bundled decoder against transformers and llama.cpp.

The default model, a 16-token prompt, exactly 128 new tokens (greedy, end-of-sequence ignored),
median over repeats, all with the same number of threads:
  transformers fp32   `model.generate` of the fp32 checkpoint (eval/speed.py)
  slimlm fp32         the bundled decoder on the same fp32 weights
  slimlm int8         w8 RTN per-channel of every decoder Linear and the tied head, int8 kernel
  slimlm int4 g64     w4 g64 RTN of every decoder Linear and the tied head, tinygemm int4 kernel
                      (4.5 bits per weight with its bf16 scales and zeros, as Q4_0); with int8
                      activations, slimlm's int4 x int8 kernel (inference/kernels/)
  llama.cpp Q4_0/Q8_0 llama-cpp-python on GGUF files of the same model (every matrix Q4_0 / Q8_0)
Quantized slimlm rows run with bf16 activations (torch's packed CPU kernels) or with activations
rounded to int8 (integer dot products), eager and with the decode step compiled
(Decoder.compile_decode_step). Each row reports the share of the
measured memory bandwidth its decoding uses (bytes read per token x tokens/s / bandwidth).
Writes bench/results/decode_cpu.{md,json,png}.

    python bench/decode_cpu.py [--repeats 5 --threads 2 --new-tokens 128 --prompt-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from slimlm.compress.quantize import QuantizeParams, run as quantize
from slimlm.eval.bandwidth import decode_bytes_per_token, memory_bandwidth
from slimlm.eval.plots import plt
from slimlm.eval.speed import benchmark_prompt, measure_generate
from slimlm.gguf_export import export_gguf
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.models import load_model, resolve_model
from slimlm.pipeline import RunState
from slimlm.rundir import machine_info

from benchlib import REPO, RESULTS, command_line, default_model_cfg, wikitext_ids, write_result

RUNS = REPO / "bench" / "runs" / "decode_cpu"
SCHEMES = {"int8": dict(bits=8), "int4 g64": dict(bits=4, group_size=64)}


def load_default():
    cfg = default_model_cfg()
    return cfg, load_model(cfg, torch.device("cpu"))


def quantized_copy(cfg, bits_params: dict):
    loaded = load_model(cfg, torch.device("cpu"))
    state = RunState(cfg=None, run_dir=RUNS, model=loaded.model, tokenizer=loaded.tokenizer, source=None, source_sha256=None, device=torch.device("cpu"))
    quantize(state, QuantizeParams(targets=[r"model\.layers\.\d+\..*", "lm_head"], **bits_params))
    return loaded.model


def eval_windows(tokenizer, count: int = 4, window: int = 512) -> torch.Tensor:
    """The first `count` windows of `window` tokens of WikiText-2 test (data=shared)."""
    return wikitext_ids(tokenizer)[: count * window].view(count, window)


@torch.inference_mode()
def decoder_kl(decoder, windows: torch.Tensor, reference: torch.Tensor, cache_dtype=None) -> float:
    """Mean per-token KL(fp32 model || decoder) over the windows, through the decoder's own layers
    (the prefill writes and reads the cache, so an int8 cache's rounding is included)."""
    decoder.setup_cache(1, windows.shape[1], cache_dtype)
    total = 0.0
    for row, ids in enumerate(windows):
        logprobs = torch.log_softmax(decoder(ids[None], 0)[0].float(), dim=-1)
        total += (reference[row].exp() * (reference[row] - logprobs)).sum(-1).mean().item()
    return total / len(windows)


def time_slimlm(model, tokenizer, prompt: list[int], options, dtype: torch.dtype, compiled: bool = False, int8_activations: bool = False, quality=None, cache_dtype=None) -> dict:
    decoder = Decoder(build_decoder(model, dtype=dtype, int8_activations=int8_activations), tokenizer, cache_dtype=cache_dtype)
    kl = None if quality is None else decoder_kl(decoder.model, *quality, cache_dtype=cache_dtype)
    decoder.model.setup_cache(1, len(prompt) + options.new_tokens, cache_dtype)
    if compiled:
        decoder.compile_decode_step()
    params = SamplingParams(max_new_tokens=options.new_tokens, ignore_eos=True)
    warm = time.perf_counter()
    decoder.generate_ids([prompt], params)  # warm-up (allocates the cache once; compiles)
    warm_s = time.perf_counter() - warm
    speeds, prefill = [], []
    for _ in range(options.repeats):
        decoder.generate_ids([prompt], params)
        speeds.append(decoder.last_stats.decode_tok_s)
        prefill.append(decoder.last_stats.prefill_s)
    context = len(prompt) + options.new_tokens // 2
    return {
        "decode_tok_s": statistics.median(speeds),
        "ttft_s": statistics.median(prefill),
        "bytes_per_token": decoder.model.bytes_per_token(context),
        "weight_bytes": decoder.model.weight_bytes(),
        "kernels": describe_kernels(decoder.model),
        "warmup_s": warm_s,
        "kl_mean": kl,
    }


def llama_cpp_file(name: str, gguf_type: str, model, tokenizer, source) -> Path:
    path = RUNS / f"{name}.gguf"
    if not path.exists():
        RUNS.mkdir(parents=True, exist_ok=True)
        export_gguf(model, tokenizer, path, gguf_type, source.path if source.kind == "gguf" else None)
    return path


def time_llama_cpp(path: Path, prompt: list[int], options, config) -> dict:
    """Greedy decoding through llama.cpp's own loop (eval one token, take the argmax)."""
    import numpy as np
    from gguf import GGUFReader
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + options.new_tokens + 8, n_batch=64, n_threads=options.threads, n_threads_batch=options.threads, logits_all=True, verbose=False)
    speeds, prefill = [], []
    for repeat in range(options.repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        first = time.perf_counter()
        for _ in range(options.new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        end = time.perf_counter()
        if repeat:  # the first run warms up
            speeds.append((options.new_tokens - 1) / (end - first))
            prefill.append(first - start)
    llm.close()
    reader = GGUFReader(path)
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (len(prompt) + options.new_tokens // 2) * 2  # f16 cache
    return {"decode_tok_s": statistics.median(speeds), "ttft_s": statistics.median(prefill), "bytes_per_token": weights + kv, "weight_bytes": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--skip-llama-cpp", action="store_true", help="when llama-cpp-python is not installed (pip install '.[bench]')")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_default()
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = benchmark_prompt(tokenizer, options.prompt_tokens).tolist()
    bandwidth = memory_bandwidth("cpu").bytes_per_s
    rows = []

    def add(name: str, result: dict) -> None:
        result["bandwidth_fraction"] = result["decode_tok_s"] * result["bytes_per_token"] / bandwidth
        rows.append({"name": name, **result})
        print(f"{name}: {result['decode_tok_s']:.1f} tok/s, {100 * result['bandwidth_fraction']:.0f}% of bandwidth", flush=True)

    hf = measure_generate(model, tokenizer, prompt_tokens=options.prompt_tokens, new_tokens=options.new_tokens, repeats=options.repeats)
    context = options.prompt_tokens + options.new_tokens // 2
    add("transformers fp32 generate", {"decode_tok_s": hf.decode_tok_s, "ttft_s": hf.ttft_s, "bytes_per_token": decode_bytes_per_token(model, context), "weight_bytes": decode_bytes_per_token(model, 0)})
    add("slimlm fp32", time_slimlm(model, tokenizer, prompt, options, torch.float32))
    if not options.skip_llama_cpp:
        source = resolve_model(cfg)
        for gguf_type in ("Q8_0", "Q4_0"):
            add(f"llama.cpp {gguf_type}", time_llama_cpp(llama_cpp_file(f"default-{gguf_type.lower()}", gguf_type, model, tokenizer, source), prompt, options, model.config))
    windows = eval_windows(tokenizer)
    with torch.inference_mode():
        quality = (windows, torch.stack([torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1) for ids in windows]))
    del model
    for name, scheme in SCHEMES.items():
        quantized = quantized_copy(cfg, scheme)
        add(f"slimlm {name}, bf16 activations, eager", time_slimlm(quantized, tokenizer, prompt, options, torch.bfloat16, quality=quality))
        add(f"slimlm {name}, bf16 activations, compiled", time_slimlm(quantized, tokenizer, prompt, options, torch.bfloat16, compiled=True))
        if scheme["bits"] == 4:
            add(f"slimlm {name}, int8 activations, eager", time_slimlm(quantized, tokenizer, prompt, options, torch.bfloat16, int8_activations=True, quality=quality))
        add(f"slimlm {name}, int8 activations, compiled", time_slimlm(quantized, tokenizer, prompt, options, torch.bfloat16, compiled=True, int8_activations=True, quality=quality if scheme["bits"] == 8 else None))
        if scheme["bits"] == 4:
            add(f"slimlm {name}, int8 activations, int8 KV cache, compiled", time_slimlm(quantized, tokenizer, prompt, options, torch.bfloat16, compiled=True, int8_activations=True, quality=quality, cache_dtype=torch.int8))
        del quantized
    reference = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup_vs_transformers"] = row["decode_tok_s"] / reference
    summary = {"bandwidth_bytes_s": bandwidth, "prompt_tokens": options.prompt_tokens, "new_tokens": options.new_tokens, "repeats": options.repeats, "threads": options.threads, "seconds": time.perf_counter() - started}
    command = command_line("decode_cpu.py", parser, options)
    RESULTS.mkdir(exist_ok=True)
    write_plot(rows)
    write_result("decode_cpu", command, {"summary": summary, "rows": rows}, markdown(rows, summary, command))


def write_plot(rows: list[dict]) -> None:
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = [row["name"] for row in rows][::-1]
    speeds = [row["decode_tok_s"] for row in rows][::-1]
    colours = ["tab:blue" if name.startswith("slimlm") else "tab:gray" for name in names]
    axis.barh(names, speeds, color=colours)
    for y, speed in enumerate(speeds):
        axis.text(speed, y, f" {speed:.0f}", va="center")
    axis.set_xlabel("decode tokens/s (batch 1, 128 new tokens)")
    axis.set_title("Decode speed on CPU, default model")
    figure.tight_layout()
    figure.savefig(RESULTS / "decode_cpu.png", dpi=120)
    plt.close(figure)


def kl_cell(row: dict) -> str:
    return "" if row.get("kl_mean") is None else f"{row['kl_mean']:.4f}"


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    machine = machine_info()
    return [
        "# decode_cpu",
        "",
        f"- command: `{command}`",
        f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs, {summary['threads']} threads for every row; torch {machine['torch']}; {summary['seconds'] / 60:.1f} min",
        f"- batch 1, a {summary['prompt_tokens']}-token prompt, exactly {summary['new_tokens']} new tokens (greedy), median of {summary['repeats']} runs after a warm-up",
        f"- memory bandwidth (eval/bandwidth.py, one-thread-per-core read): {summary['bandwidth_bytes_s'] / 1e9:.1f} GB/s; bytes per token = weights read per step + KV cache at the mean context",
        "- KL to fp32: mean per-token KL from the fp32 model to the bundled decoder's logits on the first 4 windows of 512 tokens of WikiText-2 test (eager; compiling changes no arithmetic)",
        "",
        "| decoder | decode tok/s | vs transformers fp32 | time to first token ms | weights MB | bandwidth used | KL to fp32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['name']} | {r['decode_tok_s']:.1f} | {r['speedup_vs_transformers']:.2f}x | {1000 * r['ttft_s']:.1f} | {r['weight_bytes'] / 1e6:.1f} | {100 * r['bandwidth_fraction']:.0f}% | {kl_cell(r)} |" for r in rows],
        "",
        "![decode_cpu](decode_cpu.png)",
        "",
    ]


if __name__ == "__main__":
    main()
