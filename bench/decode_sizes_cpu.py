"""Decode speed on CPU at the sizes people run, 135M to 8B: the bundled decoder against llama.cpp.

Random-weight models in published shapes (`--sizes`), made in their stored form one layer at a
time (inference/synthetic.random_model: no fp copy anywhere, so an 8B model fits in memory).
Every decoder Linear and the LM head in one scheme, on the grid of a llama.cpp block type, so
both tools decode exactly the same weights:
  int4 g32   4-bit codes around 8, an fp16 scale per 32 weights: GGUF Q4_0, written exactly
  int8 g32   8-bit codes around 128, an fp16 scale per 32 weights: GGUF Q8_0, written exactly
slimlm reads an artifact and llama.cpp (llama-cpp-python) a GGUF file, both written by slimlm.
Each runs in its own process (bench/decode_worker.py), so its peak memory is its own and the
one waiting does not share the cores: slimlm loads as `slimlm generate` does (one layer at a
time, int8 activations) and decodes eager and with its decode step compiled; llama.cpp
evaluates prompts in batches of 512. For a 16-token and a 512-token random prompt, every row
decodes exactly 128 greedy tokens once per round for `--repeats` rounds (interleaved), medians
kept: decode tokens/s, time to first token (the prompt's prefill), prefill tokens/s, the share of
the measured memory bandwidth a decoded token uses, and each process's peak resident memory.
A size's files are deleted once it is measured (`--keep-files` keeps them).

    python bench/decode_sizes_cpu.py [--sizes smollm2-135m ... llama-3-8b] [--schemes int4-g32 int8-g32]
                                     [--repeats 3 --threads 2 --new-tokens 128] [--add] [--quick]

Writes bench/results/decode_sizes_cpu.{md,json,png}; --add keeps the published rows of the sizes
and schemes this run does not measure (an 8B run need not repeat the small ones; each row names
the command and the bandwidth of its run); --quick (two tiny shapes, one scheme each, a test)
only prints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import (
    QUICK_RUNS,
    REPO,
    add_skip_llama_cpp,
    check_llama_cpp,
    command_line,
    llama_cpp_bytes,
    publish_table,
)
from tqdm import tqdm

from slimlm.artifact import save_artifact
from slimlm.eval.bandwidth import memory_bandwidth
from slimlm.eval.plots import plt, save_figure
from slimlm.gguf_export import export_gguf
from slimlm.inference.synthetic import random_model, transformers_config
from slimlm.qlinear import QuantScheme
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "decode_sizes_cpu"
WORKER = REPO / "bench" / "decode_worker.py"
LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=4096)
QWEN2 = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096)
SIZES: dict[str, dict] = {
    "smollm2-135m": dict(
        LLAMA,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=1e5,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        QWEN2,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        LLAMA,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=5e5,
        tie_word_embeddings=True,
    ),
    "llama-3-8b": dict(
        LLAMA,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=5e5,
        tie_word_embeddings=False,
    ),
}
TINY = dict(LLAMA, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=1e4)
QUICK_SIZES: dict[str, dict] = {
    "tiny-tied": dict(
        TINY, hidden_size=128, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True
    ),
    "tiny-untied": dict(
        TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=False
    ),
}
QUICK_SCHEMES = {"tiny-tied": ["int4-g32"], "tiny-untied": ["int8-g32"]}  # one each: the test's time
# scheme -> (slimlm's scheme, the GGUF block type whose grid it is)
SCHEMES: dict[str, tuple[QuantScheme, str]] = {
    "int4-g32": (QuantScheme(bits=4, group_size=32), "Q4_0"),
    "int8-g32": (QuantScheme(bits=8, group_size=32), "Q8_0"),
}
PROMPTS = (16, 512)
WARM_UP_TOKENS = 8  # a warm-up decode's new tokens: its prompt is the measured one, its decode short
RESULTS = REPO / "bench" / "results" / "decode_sizes_cpu.json"


@dataclass
class Files:
    """One size in one scheme, written for both tools."""

    artifact: Path
    gguf: Path
    config: object  # the transformers config
    parameters: int
    prompt_vocab: int  # prompts are drawn from the tokenizer's ids, which both files hold


def prepare(size: str, config: dict, scheme: str, directory: Path) -> Files:
    """The random model of `config` in `scheme`, saved as a slimlm artifact and a GGUF file of
    exactly the same matrices (the tokenizer: the tests' small BPE one; prompts are random ids)."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tokenizer

    quant, gguf_type = SCHEMES[scheme]
    model, schemes = random_model(config, quant, quant)
    parameters = sum(
        layer.in_features * layer.out_features for name, layer in model.named_modules() if name in schemes
    )
    tokenizer = build_tokenizer()
    files = Files(
        directory / f"{size}-{scheme}",
        directory / f"{size}-{scheme}.gguf",
        model.config,
        parameters,
        len(tokenizer),
    )
    shutil.rmtree(files.artifact, ignore_errors=True)  # an interrupted run's
    files.gguf.unlink(missing_ok=True)
    save_artifact(model, tokenizer, files.artifact, schemes, source={"id": f"random {size}"})
    written = export_gguf(model, tokenizer, files.gguf, gguf_type)
    # an untied input table stays float in slimlm and is rounded in the GGUF file, as llama.cpp's
    # converter rounds it: a step reads one row of it, so neither tool's speed depends on it
    if (
        set(written["rounded"]) - {"model.embed_tokens.weight"}
        or written["requantized"]
        or written["dequantized"]
    ):
        raise SystemExit(f"{size} {scheme}: the GGUF file is not the artifact's weights exactly: {written}")
    return files


class Worker:
    """A decode_worker.py process: requests and answers as JSON lines."""

    def __init__(self, name: str, tool: str, path: Path, threads: int, slots: int):
        self.name = name
        argv = [
            sys.executable,
            str(WORKER),
            tool,
            str(path),
            "--threads",
            str(threads),
            "--slots",
            str(slots),
        ]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self.read()

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(
                f"{self.name}: the decode worker exited ({self.process.wait()}); see its messages above"
            )
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


@dataclass
class Contender:
    """A row: a worker, and whether it decodes with its compiled step."""

    name: str
    worker: Worker
    compiled: bool = False


def race(contenders: list[Contender], prompt: list[int], new_tokens: int, repeats: int) -> dict[str, dict]:
    """A warm-up each, then `repeats` rounds in which every contender decodes once; the median of
    each measure per contender, the last answer's other fields."""
    ask = lambda c, tokens: c.worker.ask(prompt=prompt, new_tokens=tokens, compiled=c.compiled)  # noqa: E731
    for contender in contenders:
        ask(contender, min(new_tokens, WARM_UP_TOKENS))
    answers: dict[str, list[dict]] = {c.name: [] for c in contenders}
    for _ in tqdm(range(repeats), desc=f"rounds, {len(prompt)}-token prompt"):
        for contender in contenders:
            answers[contender.name].append(ask(contender, new_tokens))
    return {
        name: {
            **runs[-1],
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        }
        for name, runs in answers.items()
    }


def measure(size: str, scheme: str, files: Files, options, bandwidth: float, command: str) -> list[dict]:
    """Every row of one size in one scheme: both prompts, then each worker's peak memory."""
    slots = max(options.prompts) + options.new_tokens
    ours = Worker(f"{size} {scheme} slimlm", "slimlm", files.artifact, options.threads, slots)
    contenders = [Contender("slimlm, eager", ours), Contender("slimlm, compiled", ours, compiled=True)]
    theirs = None
    if not options.skip_llama_cpp:
        check_llama_cpp(files.gguf, options.threads)
        theirs = Worker(f"{size} {scheme} llama.cpp", "llama.cpp", files.gguf, options.threads, slots)
        contenders.append(Contender(f"llama.cpp {SCHEMES[scheme][1]}", theirs))
    compile_s = ours.ask(compile=True)["compile_s"]
    # what llama.cpp reads per token: its tensors once, its f16 cache per slot (the GGUF read once)
    llama_weights, llama_per_slot = (
        (0, 0.0) if theirs is None else llama_cpp_bytes(files.gguf, files.config, 2)
    )
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in options.prompts:
        prompt = torch.randint(0, files.prompt_vocab, (length,), generator=generator).tolist()
        results = race(contenders, prompt, options.new_tokens, options.repeats)
        context = length + options.new_tokens // 2
        for contender in contenders:
            result = results[contender.name]
            if contender.worker is theirs:
                result["weight_bytes"] = llama_weights
                result["bytes_per_token"] = int(llama_weights + llama_per_slot * context)
            rows.append(
                {
                    "name": f"{size} {scheme}, {length}-token prompt, {contender.name}",
                    "size": size,
                    "parameters": files.parameters,
                    "scheme": scheme,
                    "prompt_tokens": length,
                    "decoder": contender.name,
                    "decode_tok_s": result["decode_tok_s"],
                    "ttft_s": result["ttft_s"],
                    "prefill_tok_s": length / result["ttft_s"],
                    "weight_bytes": result["weight_bytes"],
                    "bandwidth_fraction": result["decode_tok_s"] * result["bytes_per_token"] / bandwidth,
                    "compile_s": compile_s if contender.compiled else None,
                    "memory_bandwidth_bytes_s": bandwidth,
                    "command": command,
                }
            )
    peaks = {id(w): w.ask(memory=True)["peak_rss_bytes"] for w in (ours, theirs) if w is not None}
    for row, contender in zip(rows, contenders * len(options.prompts)):
        row["peak_rss_bytes"] = peaks[id(contender.worker)]
    for worker in (ours, theirs):
        if worker is not None:
            worker.close()
    return rows


def with_published(rows: list[dict], published: list[dict]) -> list[dict]:
    """`rows` and the `published` rows of the sizes and schemes they do not measure, in SIZES'
    order (--add)."""
    measured = {(r["size"], r["scheme"]) for r in rows}
    kept = [r for r in published if (r["size"], r["scheme"]) not in measured]
    order = [*SIZES, *QUICK_SIZES]
    return sorted(kept + rows, key=lambda r: (order.index(r["size"]), r["scheme"]))


def published_rows() -> list[dict]:
    """The rows of bench/results/decode_sizes_cpu.json, each with its run's command and bandwidth."""
    if not RESULTS.exists():
        return []
    rows = json.loads(RESULTS.read_text())["rows"]
    missing = [r["name"] for r in rows if "command" not in r or "memory_bandwidth_bytes_s" not in r]
    if missing:
        raise SystemExit(
            f"{RESULTS}: rows without their run's command or bandwidth, cannot --add: {missing[:3]}"
        )
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each slimlm row's decode and prefill speed as a multiple of llama.cpp's in the same setting."""
    for row in rows:
        peer = next(
            (
                r
                for r in rows
                if r["decoder"].startswith("llama.cpp")
                and (r["size"], r["scheme"], r["prompt_tokens"])
                == (row["size"], row["scheme"], row["prompt_tokens"])
            ),
            None,
        )
        mine = peer is not None and row["decoder"].startswith("slimlm")
        row["decode_vs_llama_cpp"] = row["decode_tok_s"] / peer["decode_tok_s"] if mine else None
        row["prefill_vs_llama_cpp"] = row["prefill_tok_s"] / peer["prefill_tok_s"] if mine else None


def runs_lines(rows: list[dict]) -> list[str]:
    """A line per run the rows come from: its schemes and sizes, its command and its measured
    bandwidth."""
    lines = []
    for command, bandwidth in dict.fromkeys((r["command"], r["memory_bandwidth_bytes_s"]) for r in rows):
        mine = [r for r in rows if r["command"] == command]
        schemes = ", ".join(dict.fromkeys(r["scheme"] for r in mine))
        sizes = ", ".join(dict.fromkeys(r["size"] for r in mine))
        lines.append(f"- {schemes} at {sizes}: `{command}`, memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    return lines


def ratio_cell(ratio) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def seconds_cell(seconds) -> str:
    return "" if seconds is None else f"{seconds:.0f}"


def table(rows: list[dict]) -> list[str]:
    return [
        (
            "| size | scheme | prompt | decoder | decode tok/s | vs llama.cpp | TTFT ms | prefill tok/s | "
            "prefill vs llama.cpp | bandwidth used | weights MB | peak RSS MB | compile s |"
        ),
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['size']} | {r['scheme']} | {r['prompt_tokens']} | {r['decoder']} | "
            f"{r['decode_tok_s']:.1f} | "
            f"{ratio_cell(r['decode_vs_llama_cpp'])} | {1000 * r['ttft_s']:.0f} | {r['prefill_tok_s']:.0f} | "
            f"{ratio_cell(r['prefill_vs_llama_cpp'])} | {100 * r['bandwidth_fraction']:.0f}% | "
            f"{r['weight_bytes'] / 1e6:.0f} | {r['peak_rss_bytes'] / 1e6:.0f} | "
            f"{seconds_cell(r['compile_s'])} |"
            for r in rows
        ],
    ]


def write_plot(rows: list[dict], prompt_tokens: int) -> None:
    """bench/results/decode_sizes_cpu.png: decode tokens/s against parameters, a panel per scheme."""
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    figure, axes = plt.subplots(1, len(schemes), figsize=(6 * len(schemes), 4.2), squeeze=False)
    for axis, scheme in zip(axes[0], schemes):
        chosen = [r for r in rows if r["scheme"] == scheme and r["prompt_tokens"] == prompt_tokens]
        for decoder in dict.fromkeys(r["decoder"] for r in chosen):
            points = [r for r in chosen if r["decoder"] == decoder]
            axis.plot(
                [r["parameters"] / 1e9 for r in points],
                [r["decode_tok_s"] for r in points],
                "o-",
                label=decoder,
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("quantized parameters (billions)")
        axis.set_ylabel(f"decode tokens/s ({prompt_tokens}-token prompt)")
        axis.set_title(scheme)
        axis.legend()
    save_figure(figure, REPO / "bench" / "results" / "decode_sizes_cpu.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--keep-files", action="store_true", help="keep each size's artifact and GGUF file")
    parser.add_argument(
        "--add", action="store_true", help="keep the published rows of sizes and schemes not measured now"
    )
    add_skip_llama_cpp(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two tiny shapes, one scheme each, 8 new tokens, 1 round; results only printed (tests)",
    )
    options = parser.parse_args()
    command = command_line("decode_sizes_cpu.py", parser, options)
    sizes = QUICK_SIZES if options.quick else {name: SIZES[name] for name in options.sizes}
    options.prompts = (16, 64) if options.quick else PROMPTS
    if options.quick:
        options.repeats, options.new_tokens = 1, 8
    directory = QUICK_RUNS / "decode_sizes_cpu" if options.quick else RUNS
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    published = published_rows() if options.add and not options.quick else []
    # measured afresh for a published run; a quick run takes the cached figure (not its own cores' load)
    bandwidth = memory_bandwidth("cpu", refresh=not options.quick).bytes_per_s
    rows = []
    for size, config in sizes.items():
        transformers_config(config)  # a shape transformers rejects fails here, before any work
        for scheme in QUICK_SCHEMES[size] if options.quick else options.schemes:
            print(f"preparing {size} {scheme}", flush=True)
            files = prepare(size, config, scheme, directory)
            rows += measure(size, scheme, files, options, bandwidth, command)
            if not options.keep_files:
                shutil.rmtree(files.artifact)
                files.gguf.unlink()
    rows = with_published(rows, published)
    add_ratios(rows)
    if not options.quick:
        write_plot(rows, PROMPTS[0])
    details = [
        f"- batch 1, prompts of {' and '.join(map(str, options.prompts))} random tokens, exactly "
        f"{options.new_tokens} greedy new tokens, the median of interleaved rounds after a warm-up (3 "
        "rounds or the row's command's --repeats), 2 threads for each tool (or its --threads), one "
        "process per tool",
        *runs_lines(rows),
        "- bandwidth used = bytes a decoded token reads (weights but the untied embedding table, the cache "
        "at the mean context) x tokens/s / the memory bandwidth (eval/bandwidth.py) measured at the start "
        "of the row's run",
    ]
    publish_table(
        "decode_sizes_cpu",
        "decode_sizes_cpu",
        command,
        machine_info(),
        time.perf_counter() - started,
        details,
        [*table(rows), "", "![decode_sizes_cpu](decode_sizes_cpu.png)"],
        rows,
        options.quick,
    )


if __name__ == "__main__":
    main()
