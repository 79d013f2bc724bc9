"""Batch-1 decode on a GPU: the bundled decoder's int4 against the memory-bandwidth bound and
against transformers' bf16 `generate`, and an 8k context of a Llama-3-8B shape under an 8 GiB
cap against the memory planner's prediction.

Every model has random weights of a preset shape (slimlm/assets/configs, built on the device by
inference/synthetic.py): speed and memory do not depend on the values. Sections:
  bandwidth              a device-to-device copy of 1 GiB: (bytes read + written) / s
  slimlm <shape>         every decoder Linear and the LM head int4 g64, bf16 activations and
                         embedding table, in torch's tinygemm kernel and in slimlm's Triton
                         kernel (inference/gpu_kernels.py); eager (tinygemm only), then the
                         decode step compiled into a CUDA graph (Decoder.compile_decode_step)
  transformers <shape>   the same config as a transformers model in bf16, `generate` with a static
                         cache, which transformers compiles (torch.compile, CUDA graphs)
  cap                    llama-3-8b int4 g64 with torch.cuda.set_per_process_memory_fraction set
                         so that the CUDA context plus the allocator stay within 8 GiB: fill an 8k
                         context, decode, and compare the peak with the planner's laptop-8gb plan;
                         then within 4 GiB, where the plan streams layers from pinned host memory
                         (inference/streaming.py): decode speed against the plan's bound at the
                         measured device and host-link bandwidths
The prompt is 16 random token ids, then exactly 128 new tokens (greedy), median of 5 runs after
warm-ups. Each section runs in a process of its own (a fresh allocator and its own peak), in
order of importance, and the results are rewritten after each: a section that fails or runs
past `--budget-s` leaves the others. Writes bench/results/decode_gpu.{md,json}, or under --out.

    bash bench/gpu.sh          (python bench/decode_gpu.py [--shapes llama-3-8b llama-3.2-1b])
    python bench/decode_gpu.py --tiny --device cpu --out DIR     (a dry run of every path: tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from benchlib import RESULTS, command_line, write_result

from slimlm.eval.speed import device_clock, generate_decode
from slimlm.inference.build import describe_kernels
from slimlm.inference.decoder import Decoder
from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import HARDWARE, GiB, make_plan, preset_config, uniform_schemes
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.synthetic import random_decoder, transformers_config
from slimlm.qlinear import QuantScheme
from slimlm.rundir import machine_info

SCHEME = QuantScheme(bits=4, group_size=64)
# A Llama-shaped model small enough for a CPU dry run of every section (tests/test_bench_gpu.py).
TINY = {
    "model_type": "llama",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
}


class IdsOnly:
    """The decoder's tokenizer for random weights: ids only, no end-of-sequence, no text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def shape_config(shape: str) -> dict:
    return TINY if shape == "tiny" else preset_config(shape)


def random_prompt(length: int, vocab: int, device: torch.device) -> torch.Tensor:
    return torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(0)).to(device)


def median_runs(run: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float, list[float]]:
    """Median decode tok/s and time to first token (s) of `repeats` runs, and every run's tok/s."""
    results = [run() for _ in range(repeats)]
    speeds = [speed for speed, _ in results]
    return statistics.median(speeds), statistics.median(ttft for _, ttft in results), speeds


def copy_bandwidth(device: torch.device, options) -> list[dict]:
    """Bytes read plus written per second by a large device-to-device copy (random bytes)."""
    size = 2**30 if device.type == "cuda" else 2**26
    source = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    times = []
    for _ in range(20):
        start = device_clock(device)
        target.copy_(source)
        times.append(device_clock(device) - start)
    return [{"name": "device copy", "bandwidth_bytes_s": 2 * size / statistics.median(times)}]


def slimlm_rows(shape: str, kernel: str, device: torch.device, options) -> list[dict]:
    """Decoding of one shape at int4 g64 in one GPU int4 kernel: eager (tinygemm only: the
    CUDA graph's gain) and compiled."""
    config = shape_config(shape)
    started = time.perf_counter()
    model = random_decoder(config, SCHEME, SCHEME, torch.bfloat16, device, gpu_int4=kernel)
    build_s = time.perf_counter() - started
    if f"int4-{kernel}" not in describe_kernels(model):
        raise SystemExit(
            f"the {kernel} kernel took no layer here ({describe_kernels(model)}); it needs a CUDA GPU (and "
            "Triton for triton)"
        )
    decoder = Decoder(model, IdsOnly(), reuse_prefixes=False)  # each repeat prefills its prompt
    slots = options.prompt_tokens + options.new_tokens
    model.setup_cache(1, slots)
    prompt = random_prompt(options.prompt_tokens, config["vocab_size"], device)[0].tolist()
    params = SamplingParams(max_new_tokens=options.new_tokens, ignore_eos=True)

    def run() -> tuple[float, float]:
        decoder.generate_ids([prompt], params)
        return decoder.last_stats.decode_tok_s, decoder.last_stats.prefill_s

    info = {
        "shape": shape,
        "weight_bytes": model.weight_bytes(),
        "bytes_per_token": model.bytes_per_token(options.prompt_tokens + options.new_tokens // 2),
        "kernels": describe_kernels(model),
        "build_s": build_s,
    }
    rows = []
    for compiled in (False, True) if kernel == "tinygemm" else (True,):
        started = time.perf_counter()
        if compiled:
            decoder.compile_decode_step()
        for _ in range(2):  # warm-up: compilation and CUDA graph capture, then one replayed run
            run()
        warm_s = time.perf_counter() - started
        speed, ttft, speeds = median_runs(run, options.repeats)
        if not compiled:
            mode = "eager"
        elif device.type == "cuda":
            mode = "compiled (CUDA graph)"
        else:
            mode = "compiled"
        name = f"slimlm int4 g64 {shape}, {kernel}, {mode}"
        rows.append(
            {
                "name": name,
                **info,
                "decode_tok_s": speed,
                "ttft_ms": 1000 * ttft,
                "runs_tok_s": speeds,
                "warmup_s": warm_s,
            }
        )
        print(f"{name}: {speed:.1f} tok/s", flush=True)
    return rows


def transformers_rows(shape: str, device: torch.device, options) -> list[dict]:
    """transformers' bf16 `generate` with a static cache (compiled by transformers on a GPU)."""
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(transformers_config(config), dtype=torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    build_s = time.perf_counter() - started
    prompt = random_prompt(options.prompt_tokens, config["vocab_size"], device)

    def run() -> tuple[float, float]:
        result = generate_decode(model, prompt, options.new_tokens, pad_token_id=0)
        return (options.new_tokens - 1) / result.decode_s, result.ttft_s

    started = time.perf_counter()
    for _ in range(2):  # the first compiles the step and captures its graphs
        run()
    warm_s = time.perf_counter() - started
    speed, ttft, speeds = median_runs(run, options.repeats)
    weights = sum(p.nbytes for p in model.parameters())
    args = ModelArgs.from_hf_config(config)
    table = 0 if args.tie_embeddings else args.vocab_size * args.dim * 2
    kv = (
        2
        * args.n_layers
        * args.n_kv_heads
        * args.head_dim
        * 2
        * (options.prompt_tokens + options.new_tokens // 2)
    )
    name = f"transformers bf16 {shape}, static cache, generate"
    print(f"{name}: {speed:.1f} tok/s", flush=True)
    return [
        {
            "name": name,
            "shape": shape,
            "weight_bytes": weights,
            "bytes_per_token": weights - table + args.dim * 2 + kv,
            "decode_tok_s": speed,
            "ttft_ms": 1000 * ttft,
            "runs_tok_s": speeds,
            "warmup_s": warm_s,
            "build_s": build_s,
        }
    ]


def host_link_bandwidth(device: torch.device) -> float:
    """Bytes per second of a pinned host-to-device copy of 256 MiB (what streamed layers cross)."""
    host = torch.randint(0, 256, (2**28,), dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    target.copy_(host)
    times = []
    for _ in range(5):
        start = device_clock(device)
        target.copy_(host, non_blocking=True)
        times.append(device_clock(device) - start)
    return host.numel() / statistics.median(times)


def capped_rows(shape: str, cap_gib: str, context: str, device: torch.device, options) -> list[dict]:
    """Load and decode a context under a memory cap, in the planner's plan for that cap (all
    layers on the device, or some streamed from pinned host memory); the planner's peak against
    the measured one (CUDA: the context's bytes, measured before any tensor, plus the
    allocator's peak reservation; a CPU dry run: the process's peak resident set) and, for a
    streaming plan, the decode speed against the plan's bound at the measured bandwidths."""
    from slimlm.memory import peak_memory

    config = shape_config(shape)
    args = ModelArgs.from_hf_config(config)
    context = min(int(context), args.max_position_embeddings)
    on_gpu = device.type == "cuda"
    hardware = (
        dataclasses.replace(HARDWARE["laptop-8gb"], memory_bytes=int(float(cap_gib) * GiB))
        if on_gpu
        else HARDWARE["cpu"]
    )
    schemes = uniform_schemes(args, SCHEME, SCHEME)
    plan = make_plan(args, schemes, hardware, context)
    runtime_bytes, bound = 0, None
    if on_gpu:
        torch.ones(64, 64, device=device) @ torch.ones(
            64, 64, device=device
        )  # the context and cuBLAS's workspace
        free, total = torch.cuda.mem_get_info(device)
        runtime_bytes = total - free
        if plan.kind == "stream":  # the plan's speed bound at this machine's measured bandwidths
            measured = dataclasses.replace(
                hardware,
                bandwidth_bytes_s=copy_bandwidth(device, options)[0]["bandwidth_bytes_s"],
                host_link_bytes_s=host_link_bandwidth(device),
            )
            bound = dataclasses.replace(plan, hardware=measured).decode_tok_s_bound()
            torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(
            (plan.hardware.memory_bytes - runtime_bytes) / total, device
        )
        torch.cuda.reset_peak_memory_stats(device)
    new_tokens = 32
    with peak_memory(device) as peak:
        model = random_decoder(config, SCHEME, SCHEME, torch.bfloat16, device, placement=plan.placement)
        decoder = Decoder(model, IdsOnly())
        model.setup_cache(1, context)
        prompt = random_prompt(context - new_tokens, args.vocab_size, device)[0].tolist()
        decoder.generate_ids([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    measured_peak = runtime_bytes + torch.cuda.max_memory_reserved(device) if on_gpu else peak.bytes
    predicted = plan.device_bytes()
    where = (
        f"{plan.streamed_layers} of {args.n_layers} layers streamed" if plan.kind == "stream" else plan.kind
    )
    name = (
        f"slimlm int4 g64 {shape}, {context} context, {float(cap_gib):g} GiB cap, {where}"
        if on_gpu
        else f"slimlm int4 g64 {shape}, {context} context (CPU: no cap)"
    )
    stats = decoder.last_stats
    print(
        (
            f"{name}: predicted {predicted / GiB:.2f} GiB, measured {measured_peak / GiB:.2f} GiB, "
            f"{stats.decode_tok_s:.1f} tok/s"
        ),
        flush=True,
    )
    return [
        {
            "name": name,
            "shape": shape,
            "context": context,
            "plan": plan.kind,
            "streamed_layers": plan.streamed_layers,
            "predicted_peak_bytes": predicted,
            "measured_peak_bytes": measured_peak,
            "runtime_bytes": runtime_bytes,
            "allocated_peak_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
            "prediction_error": predicted / measured_peak - 1,
            "prefill_s": stats.prefill_s,
            "decode_tok_s": stats.decode_tok_s,
            "stream_bound_tok_s": bound,
        }
    ]


def sections(options) -> list[tuple[str, list[str]]]:
    """(label, arguments of this script's --section run), most important first."""
    order = [("bandwidth", ["bandwidth"])]
    for index, shape in enumerate(options.shapes):
        kernels = [(f"slimlm {shape} {kernel}", ["slimlm", shape, kernel]) for kernel in options.kernels]
        order.append(kernels[0])
        if (
            index == 0
        ):  # the acceptance's sections before the slower comparisons (transformers compiles for minutes)
            order.append(
                (
                    f"cap {options.cap_shape} {options.cap_gib:g} GiB",
                    ["cap", options.cap_shape, str(options.cap_gib), str(options.cap_context)],
                )
            )
            order.append(
                (
                    f"cap {options.cap_shape} {options.stream_cap_gib:g} GiB (streaming)",
                    ["cap", options.cap_shape, str(options.stream_cap_gib), str(options.stream_context)],
                )
            )
        order += [(f"transformers {shape}", ["transformers", shape]), *kernels[1:]]
    return order


SECTIONS: dict[str, Callable[..., list[dict]]] = {
    "bandwidth": copy_bandwidth,
    "slimlm": slimlm_rows,
    "transformers": transformers_rows,
    "cap": capped_rows,
}


def run_section(kind: str, arguments: list[str], options) -> None:
    """One section in this process: its rows as JSON on the last line of stdout."""
    device = torch.device(options.device)
    rows = SECTIONS[kind](*arguments, device, options)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU (dry run)"
    print(json.dumps([{**row, "gpu": gpu} for row in rows]))


def report(rows: list[dict], failures: list[str], options, command: str, elapsed_s: float) -> None:
    """Ratios (bandwidth share, speedup over transformers) from the measured rows, then the files."""
    bandwidth = next((row["bandwidth_bytes_s"] for row in rows if "bandwidth_bytes_s" in row), None)
    peers = {row["shape"]: row["decode_tok_s"] for row in rows if row["name"].startswith("transformers")}
    for row in rows:
        if "bytes_per_token" in row and bandwidth:
            row["bound_tok_s"] = bandwidth / row["bytes_per_token"]
            row["bandwidth_fraction"] = row["decode_tok_s"] / row["bound_tok_s"]
        if row["name"].startswith("slimlm") and row.get("shape") in peers and "context" not in row:
            row["vs_transformers"] = row["decode_tok_s"] / peers[row["shape"]]
    gpu = next(
        (row["gpu"] for row in rows if "gpu" in row), "no GPU (dry run)"
    )  # from a section: this process makes no CUDA context
    lines = [
        "# decode_gpu",
        "",
        f"- command: `{command}`",
        f"- machine: {gpu}; torch {torch.__version__}; {elapsed_s / 60:.1f} min",
        (
            f"- batch 1, {options.prompt_tokens}-token random prompt, exactly {options.new_tokens} new "
            f"tokens (greedy), median of {options.repeats} runs after warm-ups; random weights of each "
            "preset shape"
        ),
        f"- bandwidth: a device-to-device copy, {bandwidth / 1e9:.0f} GB/s (bytes read + written); bound = "
        "bandwidth / (weights read per token + KV cache at the mean context)"
        if bandwidth
        else "- bandwidth: not measured",
        "",
        (
            "| row | decode tok/s | vs transformers bf16 | time to first token ms | weights GB | bound tok/s "
            "| bandwidth used |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "decode_tok_s" not in row or "context" in row:
            continue
        ratio = f"{row['vs_transformers']:.2f}x" if "vs_transformers" in row else ""
        bound = f"{row['bound_tok_s']:.0f}" if "bound_tok_s" in row else ""
        used = f"{row['bandwidth_fraction']:.0%}" if "bandwidth_fraction" in row else ""
        lines.append(
            f"| {row['name']} | {row['decode_tok_s']:.1f} | {ratio} | {row['ttft_ms']:.1f} | "
            f"{row['weight_bytes'] / 1e9:.2f} | {bound} | {used} |"
        )
    capped = [row for row in rows if "context" in row]
    if capped:
        lines += [
            "",
            (
                "| memory cap row | plan | predicted peak GiB | measured peak GiB | prediction error | CUDA "
                "context GiB | prefill s | decode tok/s | streaming bound tok/s |"
            ),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in capped:
            bound = f"{row['stream_bound_tok_s']:.1f}" if row.get("stream_bound_tok_s") else ""
            lines.append(
                f"| {row['name']} | {row['plan']} | {row['predicted_peak_bytes'] / GiB:.2f} | "
                f"{row['measured_peak_bytes'] / GiB:.2f} | {row['prediction_error']:+.1%} | "
                f"{row['runtime_bytes'] / GiB:.2f} | {row['prefill_s']:.1f} | {row['decode_tok_s']:.1f} | "
                f"{bound} |"
            )
    if failures:
        lines += ["", "Sections that did not finish:", "", *[f"- {failure}" for failure in failures]]
    lines.append("")
    record = {"rows": rows, "failures": failures}
    machine = {**machine_info(query_gpu=False), "cuda": gpu}
    if options.out == RESULTS:
        write_result("decode_gpu", command, record, lines, machine=machine)
    else:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "decode_gpu.json").write_text(
            json.dumps({"machine": machine, "command": command, **record}, indent=2) + "\n"
        )
        (options.out / "decode_gpu.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["llama-3-8b", "llama-3.2-1b"],
        help="preset shapes, most important first (the memory cap section follows the first)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=("tinygemm", "triton"),
        default=["tinygemm", "triton"],
        help="GPU int4 kernels to time",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cap-shape", default="llama-3-8b")
    parser.add_argument("--cap-context", type=int, default=8192)
    parser.add_argument("--cap-gib", type=float, default=8.0)
    parser.add_argument(
        "--stream-cap-gib",
        type=float,
        default=4.0,
        help="a cap the model does not fit: the planner streams layers from host memory",
    )
    parser.add_argument("--stream-context", type=int, default=1024)
    parser.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="no section starts after this many seconds; a running one is stopped at it",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where decode_gpu.{md,json} go")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every shape is a tiny Llama (a dry run of every path, e.g. on a CPU)",
    )
    parser.add_argument(
        "--section", nargs="+", help=argparse.SUPPRESS
    )  # internal: run one section in this process
    options = parser.parse_args()
    command = command_line("decode_gpu.py", parser, options)
    if options.tiny:
        options.shapes, options.cap_shape = ["tiny"], "tiny"
    if options.device == "cpu":
        options.kernels = ["tinygemm"]  # the only int4 kernel of these on a CPU (a dry run)
    if options.section:
        run_section(options.section[0], options.section[1:], options)
        return
    if options.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "decode_gpu: no CUDA device here; run it on a GPU machine (bash bench/gpu.sh), or --tiny "
            "--device cpu for a dry run"
        )
    started = time.perf_counter()
    rows: list[dict] = []
    failures: list[str] = []
    for label, section in sections(options):
        left = options.budget_s - (time.perf_counter() - started)
        if left <= 0:
            failures.append(f"{label}: not started, the time budget of {options.budget_s:.0f} s was spent")
            continue
        argv = [sys.executable, __file__, *sys.argv[1:], "--section", *section]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            failures.append(f"{label}: stopped at the time budget of {options.budget_s:.0f} s")
            continue
        sys.stderr.write(result.stderr[-4000:] if result.returncode else "")
        lines = result.stdout.strip().splitlines()
        if result.returncode or not lines:
            failures.append(
                f"{label}: exit {result.returncode}: "
                f"{(result.stderr.strip().splitlines() or ['no output'])[-1][:300]}"
            )
        else:
            rows += json.loads(lines[-1])
            print("\n".join(lines[:-1]), flush=True)
        report(rows, failures, options, command, time.perf_counter() - started)
    print((options.out / "decode_gpu.md").read_text())


if __name__ == "__main__":
    main()
