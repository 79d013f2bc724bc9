"""Batch-1 decode speed on CPU: the bundled decoder against transformers and llama.cpp.

The default model, a 16-token prompt, exactly 128 new tokens (greedy, end-of-sequence ignored),
all with the same number of threads; every row is prepared (and compiled) first, then each
decodes once per round for `--repeats` rounds and the median is kept:
  transformers fp32   `model.generate` of the fp32 checkpoint (eval/speed.py)
  slimlm fp32         the bundled decoder on the same fp32 weights
  slimlm int8         w8 RTN per-channel of every decoder Linear and the tied head, torch's int8
                      kernel; with int8 activations, slimlm's int8 x int8 kernel (inference/kernels/)
  slimlm int4 g64     w4 g64 RTN of every decoder Linear and the tied head, tinygemm int4 kernel
                      (4.5 bits per weight with its bf16 scales and zeros, as Q4_0); with int8
                      activations, slimlm's int4 x int8 kernel
  llama.cpp Q4_0/Q8_0 llama-cpp-python on GGUF files of the same model (every matrix Q4_0 / Q8_0)
Quantized slimlm rows run with bf16 activations (torch's packed CPU kernels) or with activations
rounded to int8 (integer dot products), eager and with the decode step compiled
(Decoder.compile_decode_step). Each row reports the share of the
measured memory bandwidth its decoding uses (bytes read per token x tokens/s / bandwidth).
Writes bench/results/decode_cpu.{md,json,png}; --quick (the tiny test model, a test) only prints.

    python bench/decode_cpu.py [--repeats 5 --threads 2 --new-tokens 128 --prompt-tokens 16] [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from benchlib import (
    QUICK_RUNS,
    REPO,
    RESULTS,
    add_skip_llama_cpp,
    call_us,
    check_llama_cpp,
    command_line,
    default_model_cfg,
    eval_ids,
    llama_cpp_bytes,
    load_bench_model,
    machine_line,
    publish,
    wikitext_ids,
)
from tqdm import tqdm

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.distill.losses import forward_kl
from slimlm.eval.bandwidth import decode_bytes_per_token, memory_bandwidth
from slimlm.eval.plots import plt, save_figure
from slimlm.eval.speed import benchmark_prompt, measure_generate
from slimlm.gguf_export import export_gguf
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.models import load_model, resolve_model
from slimlm.pipeline import RunState
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "decode_cpu"
SCHEMES = {"int8": dict(bits=8), "int4 g64": dict(bits=4, group_size=64)}
# What a slimlm row's decoding needs (slimlm_contender reads them), shared with decode_cpu_isa.py.
DECODE_OPTIONS = {"repeats": 5, "threads": 2, "new_tokens": 128, "prompt_tokens": 16}


def add_decode_options(parser: argparse.ArgumentParser) -> None:
    for name, default in DECODE_OPTIONS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def load_default():
    cfg = default_model_cfg()
    return cfg, load_model(cfg, torch.device("cpu"))


def quantize_in_place(model, tokenizer, params: QuantizeParams) -> None:
    """The quantize stage (data-free methods) run on `model` outside a recipe."""
    state = RunState(
        cfg=None,
        run_dir=RUNS,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, params)


def quantized_copy(cfg, bits_params: dict):
    """A fresh load of `cfg`'s model with every decoder Linear and the LM head RTN-quantized."""
    loaded = load_model(cfg, torch.device("cpu"))
    targets = [r"model\.layers\.\d+\..*", "lm_head"]
    quantize_in_place(loaded.model, loaded.tokenizer, QuantizeParams(targets=targets, **bits_params))
    return loaded.model


def default_int4(threads: int):
    """The default model at int4 g64 RTN (head too), what the serving benches decode, with
    `threads` torch threads; and the loaded original (its tokenizer, its fp32 model)."""
    torch.set_num_threads(threads)
    cfg, loaded = load_default()
    return quantized_copy(cfg, dict(bits=4, group_size=64)), loaded


def eval_windows(tokenizer, quick: bool) -> torch.Tensor:
    """The windows a row's KL to fp32 is measured on: the first 4 windows of 512 tokens of
    WikiText-2 test (data=shared), or for a --quick run 2 windows of 256 tokens of its excerpt."""
    if quick:
        return eval_ids(tokenizer, True)[: 2 * 256].view(2, 256)
    return wikitext_ids(tokenizer)[: 4 * 512].view(4, 512)


@torch.inference_mode()
def reference_quality(model, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows, the fp32 `model`'s next-token log-probabilities at every position of each): what
    slimlm_contender's `quality` measures a row's KL against."""
    return windows, torch.stack(
        [torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1) for ids in windows]
    )


@torch.inference_mode()
def step_logprobs(decoder: Decoder, ids: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, vocab]: the next-token log-probabilities of `decoder`'s own decode step at the
    last `positions` tokens of `ids` (teacher-forced: fed one at a time after a prefill of the
    ones before)."""
    start = len(ids) - positions
    decoder.prefill(ids[None, :start])
    # Each token a tensor made in inference mode, as generation passes them: a view of `ids` is an
    # ordinary tensor, for which the compiled step would be compiled again.
    return torch.stack(
        [
            torch.log_softmax(decoder.step(torch.tensor([[int(ids[p])]]), p)[0, -1].float(), dim=-1)
            for p in range(start, len(ids))
        ]
    )


def decode_kl(
    decoder: Decoder, windows: torch.Tensor, reference: torch.Tensor, positions: int = 128
) -> float:
    """Mean per-token KL(fp32 model || decoder) over the last `positions` tokens of each window,
    each from the row's own decode step (compiled where the row compiles it). The decode step's
    arithmetic is what the row's speed is measured with: compiled kernels fuse the norms
    differently, and with int8 activations a last-bit change can move a rounded code."""
    start = windows.shape[1] - positions
    return (
        torch.cat(
            [
                forward_kl(reference[row, start:], step_logprobs(decoder, ids, positions))
                for row, ids in enumerate(windows)
            ]
        )
        .mean()
        .item()
    )


@dataclass
class Contender:
    """One row of the table: `run` decodes once and returns (decode tok/s, time to first token s);
    `info` holds what does not change between runs."""

    name: str
    run: Callable[[], tuple[float, float]]
    info: dict


def slimlm_contender(
    name: str,
    model,
    tokenizer,
    prompt: list[int],
    options,
    dtype: torch.dtype,
    compiled: bool = False,
    int8_activations: bool = False,
    quality=None,
    cache_dtype=None,
) -> Contender:
    decoder = Decoder(
        build_decoder(model, dtype=dtype, int8_activations=int8_activations),
        tokenizer,
        cache_dtype=cache_dtype,
        reuse_prefixes=False,
    )  # each repeat prefills its prompt
    slots = (
        len(prompt) + options.new_tokens
        if quality is None
        else max(len(prompt) + options.new_tokens, quality[0].shape[1])
    )
    decoder.model.setup_cache(1, slots, cache_dtype)  # once: the compiled step is specialized to its size
    if compiled:
        decoder.compile_decode_step()
    kl = None if quality is None else decode_kl(decoder, *quality)
    params = SamplingParams(max_new_tokens=options.new_tokens, ignore_eos=True)
    warm = time.perf_counter()
    decoder.generate_ids([prompt], params)  # warm-up (allocates the cache once; compiles)
    warm_s = time.perf_counter() - warm

    def run() -> tuple[float, float]:
        decoder.generate_ids([prompt], params)
        return decoder.last_stats.decode_tok_s, decoder.last_stats.prefill_s

    context = len(prompt) + options.new_tokens // 2
    info = {
        "bytes_per_token": decoder.model.bytes_per_token(context),
        "weight_bytes": decoder.model.weight_bytes(),
        "kernels": describe_kernels(decoder.model),
        "warmup_s": warm_s,
        "kl_mean": kl,
    }
    return Contender(name, run, info)


def llama_cpp_file(name: str, gguf_type: str, model, tokenizer, source, directory: Path = RUNS) -> Path:
    """`directory`/<name>.gguf, written from `model` unless it is there already."""
    path = directory / f"{name}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        export_gguf(model, tokenizer, path, gguf_type, source.path if source.kind == "gguf" else None)
    return path


@torch.inference_mode()
def kernel_table(model, scheme: str) -> list[dict]:
    """Batch-1 time of each layer shape of the quantized model in torch's kernel (bf16
    activations) and in slimlm's kernel for int8 activations, weights warm in cache: the matmuls alone."""
    decoders = {
        "torch": build_decoder(model, dtype=torch.bfloat16),
        "slimlm": build_decoder(model, dtype=torch.bfloat16, int8_activations=True),
    }
    shapes = {
        "q/k/v": lambda d: d.layers[0].attention.qkv,
        "o": lambda d: d.layers[0].attention.o_proj,
        "gate/up": lambda d: d.layers[0].feed_forward.gate_up,
        "down": lambda d: d.layers[0].feed_forward.down,
        "tied head": lambda d: d.output,
    }
    table = []
    for shape, pick in shapes.items():
        row = {"name": f"{scheme} {shape}"}
        for kernel, decoder in decoders.items():
            layer = pick(decoder)
            row["out_features"], row["in_features"] = layer.out_features, layer.in_features
            row[f"{kernel}_us"] = call_us(layer, torch.randn(1, layer.in_features, dtype=torch.bfloat16))
        table.append(row)
    return table


def llama_cpp_contender(name: str, path: Path, prompt: list[int], options, config) -> Contender:
    """Greedy decoding through llama.cpp's own loop (eval one token, take the argmax)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(prompt) + options.new_tokens + 8,
        n_batch=64,
        n_threads=options.threads,
        n_threads_batch=options.threads,
        logits_all=True,
        verbose=False,
    )

    def run() -> tuple[float, float]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        first = time.perf_counter()
        for _ in range(options.new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return (options.new_tokens - 1) / (time.perf_counter() - first), first - start

    run()  # warm-up
    weights, cache_per_slot = llama_cpp_bytes(path, config, 2)  # f16 cache
    return Contender(
        name,
        run,
        {
            "bytes_per_token": int(weights + cache_per_slot * (len(prompt) + options.new_tokens // 2)),
            "weight_bytes": weights,
        },
    )


def transformers_contender(model, tokenizer, options) -> Contender:
    def run() -> tuple[float, float]:
        result = measure_generate(
            model,
            tokenizer,
            prompt_tokens=options.prompt_tokens,
            new_tokens=options.new_tokens,
            warmup=0,
            repeats=1,
        )
        return result.decode_tok_s, result.ttft_s

    run()  # warm-up
    context = options.prompt_tokens + options.new_tokens // 2
    return Contender(
        "transformers fp32 generate",
        run,
        {
            "bytes_per_token": decode_bytes_per_token(model, context),
            "weight_bytes": decode_bytes_per_token(model, 0),
        },
    )


def race(contenders: list[Contender], repeats: int) -> list[dict]:
    """Every contender decodes once per round, `repeats` rounds: a slow spell of the machine
    (shared memory bandwidth on a virtual machine) then slows every row alike instead of
    whichever row it happened to fall on, so the ratios between rows hold. Medians per row."""
    runs: dict[str, list[tuple[float, float]]] = {c.name: [] for c in contenders}
    for _ in tqdm(range(repeats), desc="rounds"):
        for contender in contenders:
            runs[contender.name].append(contender.run())
    return [
        {
            "name": c.name,
            "decode_tok_s": statistics.median(r[0] for r in runs[c.name]),
            "ttft_s": statistics.median(r[1] for r in runs[c.name]),
            **c.info,
        }
        for c in contenders
    ]


def llama_cpp_contenders(
    cfg, model, tokenizer, prompt: list[int], options, directory: Path
) -> list[Contender]:
    """llama.cpp's Q8_0 and Q4_0 rows, on GGUF files of `model` written by slimlm's GGUF writer."""
    source = resolve_model(cfg)
    contenders = []
    for gguf_type in ("Q8_0", "Q4_0"):
        path = llama_cpp_file(f"default-{gguf_type.lower()}", gguf_type, model, tokenizer, source, directory)
        check_llama_cpp(path, options.threads)
        contenders.append(llama_cpp_contender(f"llama.cpp {gguf_type}", path, prompt, options, model.config))
    return contenders


# --quick keeps each scheme's rows of one activation type (int8 weights: bf16 activations, int4:
# int8 ones): every kernel still runs, in three compiled rows instead of five (the test's time).
QUICK_INT8_ACTIVATIONS = {8: False, 4: True}


def quantized_contenders(
    cfg, tokenizer, prompt: list[int], options, quality
) -> tuple[list[Contender], list[dict]]:
    """slimlm's rows of each of SCHEMES (bf16 or int8 activations, eager or compiled; an int8 KV
    cache at int4), each scheme's model quantized afresh; and the layer-by-layer kernel table."""
    contenders: list[Contender] = []
    kernels: list[dict] = []
    for name, scheme in SCHEMES.items():
        quantized = quantized_copy(cfg, scheme)
        kernels += kernel_table(quantized, name)
        rows_of = [
            (f"slimlm {name}, bf16 activations, eager", dict()),
            (f"slimlm {name}, bf16 activations, compiled", dict(compiled=True)),
            (f"slimlm {name}, int8 activations, eager", dict(int8_activations=True)),
            (f"slimlm {name}, int8 activations, compiled", dict(compiled=True, int8_activations=True)),
        ]
        if scheme["bits"] == 4:
            rows_of.append(
                (
                    f"slimlm {name}, int8 activations, int8 KV cache, compiled",
                    dict(compiled=True, int8_activations=True, cache_dtype=torch.int8),
                )
            )
        if options.quick:
            wanted = QUICK_INT8_ACTIVATIONS[scheme["bits"]]
            rows_of = [
                (n, settings) for n, settings in rows_of if settings.get("int8_activations", False) == wanted
            ]
        for row_name, settings in rows_of:
            print(f"preparing {row_name}", flush=True)
            contenders.append(
                slimlm_contender(
                    row_name,
                    quantized,
                    tokenizer,
                    prompt,
                    options,
                    torch.bfloat16,
                    quality=quality,
                    **settings,
                )
            )
    return contenders, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_options(parser)
    add_skip_llama_cpp(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random-weight model, 8 new tokens, 1 round; results only printed (tests)",
    )
    options = parser.parse_args()
    command = command_line("decode_cpu.py", parser, options)
    if options.quick:
        options.repeats, options.new_tokens = 1, 8
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    cfg, loaded = load_bench_model(options.quick)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = benchmark_prompt(tokenizer, options.prompt_tokens).tolist()
    bandwidth = memory_bandwidth(
        "cpu", refresh=True
    ).bytes_per_s  # afresh: a shared machine's bandwidth drifts between runs
    contenders = [
        transformers_contender(model, tokenizer, options),
        slimlm_contender("slimlm fp32", model, tokenizer, prompt, options, torch.float32),
    ]
    if not options.skip_llama_cpp:
        directory = QUICK_RUNS / "decode_cpu" if options.quick else RUNS
        if options.quick:
            shutil.rmtree(directory, ignore_errors=True)  # the tiny model's files, made afresh
        contenders += llama_cpp_contenders(cfg, model, tokenizer, prompt, options, directory)
    quality = reference_quality(model, eval_windows(tokenizer, options.quick))
    quantized, kernels = quantized_contenders(cfg, tokenizer, prompt, options, quality)
    rows = race(contenders + quantized, options.repeats)
    for row in rows:
        row["bandwidth_fraction"] = row["decode_tok_s"] * row["bytes_per_token"] / bandwidth
        print(
            (
                f"{row['name']}: {row['decode_tok_s']:.1f} tok/s, {100 * row['bandwidth_fraction']:.0f}% of "
                "bandwidth"
            ),
            flush=True,
        )
    reference = rows[0]["decode_tok_s"]
    for row in rows:
        row["speedup_vs_transformers"] = row["decode_tok_s"] / reference
    summary = {
        "bandwidth_bytes_s": bandwidth,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    if not options.quick:
        write_plot(rows)
    publish(
        "decode_cpu",
        command,
        {"summary": summary, "rows": rows, "kernels": kernels},
        markdown(rows, summary, command, kernels),
        options.quick,
    )


def write_plot(
    rows: list[dict], name: str = "decode_cpu", title: str = "Decode speed on CPU, default model"
) -> None:
    """bench/results/<name>.png: decode tokens/s per row, slimlm's rows in blue."""
    figure, axis = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    names = [row["name"] for row in rows][::-1]
    speeds = [row["decode_tok_s"] for row in rows][::-1]
    colours = ["tab:blue" if name.startswith("slimlm") else "tab:gray" for name in names]
    axis.barh(names, speeds, color=colours)
    for y, speed in enumerate(speeds):
        axis.text(speed, y, f" {speed:.0f}", va="center")
    axis.set_xlim(0, 1.12 * max(speeds))  # room for the longest bar's label
    axis.set_xlabel("decode tokens/s (batch 1, 128 new tokens)")
    axis.set_title(title)
    save_figure(figure, RESULTS / f"{name}.png")


def cache_cell(machine: dict) -> str:
    size = machine.get("last_level_cache_bytes")
    return "unknown" if size is None else f"{size / 2**20:.0f} MiB"


def kl_cell(row: dict) -> str:
    return "" if row.get("kl_mean") is None else f"{row['kl_mean']:.4f}"


def markdown(rows: list[dict], summary: dict, command: str, kernels: list[dict]) -> list[str]:
    machine = machine_info()
    return [
        "# decode_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{summary['threads']} threads for every row", summary["seconds"]),
        (
            f"- batch 1, a {summary['prompt_tokens']}-token prompt, exactly {summary['new_tokens']} new "
            f"tokens (greedy), median of {summary['repeats']} rounds after a warm-up, every row decoding "
            "once per round (interleaved)"
        ),
        (
            "- memory bandwidth (eval/bandwidth.py, one-thread-per-core read, measured at the start of this "
            f"run): {summary['bandwidth_bytes_s'] / 1e9:.1f} GB/s; bytes per token = weights read per step + "
            "KV cache at the mean context"
        ),
        (
            f"- the processor's largest cache: {cache_cell(machine)}; weights that fit in it partly come "
            "from it, so a row can read faster than memory (bandwidth used above 100%)"
        ),
        (
            "- KL to fp32: mean per-token KL from the fp32 model to the bundled decoder's logits over the "
            "last 128 tokens of each of the first 4 windows of 512 tokens of WikiText-2 test, fed one at a "
            "time through the row's own decode step (compiled or eager) after a prefill of the tokens before"
        ),
        "",
        (
            "| decoder | decode tok/s | vs transformers fp32 | time to first token ms | weights MB | "
            "bandwidth used | KL to fp32 |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['decode_tok_s']:.1f} | {r['speedup_vs_transformers']:.2f}x | "
            f"{1000 * r['ttft_s']:.1f} | {r['weight_bytes'] / 1e6:.1f} | "
            f"{100 * r['bandwidth_fraction']:.0f}% | {kl_cell(r)} |"
            for r in rows
        ],
        "",
        "![decode_cpu](decode_cpu.png)",
        "",
        (
            "Quantized layers of the same model at batch 1, one layer alone (weights warm in cache), median "
            "over 5 blocks of 100 calls:"
        ),
        "",
        (
            "| layer (out x in) | torch's kernel, bf16 activations (us) | slimlm's kernel, int8 activations "
            "(us) | speedup |"
        ),
        "|---|---:|---:|---:|",
        *[
            f"| {k['name']} ({k['out_features']} x {k['in_features']}) | {k['torch_us']:.1f} | "
            f"{k['slimlm_us']:.1f} | {k['torch_us'] / k['slimlm_us']:.2f}x |"
            for k in kernels
        ],
        "",
    ]


if __name__ == "__main__":
    main()
