"""Batch-1 int4 and int8 decode speed on CPU per instruction set: what a laptop processor without
AVX-512 gets.

slimlm's int4 x int8 and int8 x int8 kernels have three builds (inference/cpu_kernels.py):
AVX512-VNNI, AVX-VNNI (Intel laptops since Alder Lake) and AVX2 (older laptops). This machine has
all three, so each runs here in a process of its own that is limited to that instruction set:
SLIMLM_CPU_ISA picks the kernel's build, and ATEN_CPU_CAPABILITY=avx2 limits torch's own kernels to
256-bit vectors as on such a laptop (the compiled step's generated code is 256-bit in every row:
Decoder.compile_decode_step). Against each, torch's kernel for the same weights (int4 tinygemm or
int8 weight-only) with bf16 activations under the same limit: what these processors ran before.

The default model, every decoder Linear and the tied head int4 g64 RTN or int8 RTN per channel
(decode_cpu.SCHEMES), a 16-token prompt,
exactly 128 new tokens (greedy), decode step compiled; each process prepares its row, decodes
`--repeats` times, and the processes take turns for `--passes` passes (a slow spell of the
machine then falls on every row); medians over all decodes of a row. The memory system is this
machine's, not a laptop's: the ratios between rows are the result, not the tokens/s.
Writes bench/results/decode_cpu_isa.{md,json,png}; --quick (the tiny test model, a test) only prints.

    python bench/decode_cpu_isa.py [--repeats 5 --passes 2 --threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from benchlib import RESULTS, command_line, load_bench_model, machine_line, publish
from decode_cpu import (
    DECODE_OPTIONS,
    SCHEMES,
    add_decode_options,
    quantized_copy,
    slimlm_contender,
    write_plot,
)
from tqdm import tqdm

from slimlm.eval.bandwidth import memory_bandwidth
from slimlm.eval.speed import benchmark_prompt
from slimlm.inference import cpu_kernels
from slimlm.rundir import machine_info

MARK = "decode_cpu_isa result: "
QUICK_SCHEME = "int4 g64"  # --quick runs this scheme's rows only


@dataclass(frozen=True)
class Row:
    name: str
    scheme: str  # a key of decode_cpu.SCHEMES
    isa: str | None  # the kernel's build (SLIMLM_CPU_ISA); None: torch's kernel, bf16 activations
    aten: str | None  # ATEN_CPU_CAPABILITY; None: the widest this processor has


def scheme_rows(scheme: str) -> list[Row]:
    bits = scheme.split()[0]
    return [
        Row(f"torch {bits}, bf16 activations, AVX2", scheme, None, "avx2"),
        Row(f"slimlm {bits} x int8, AVX2", scheme, "avx2", "avx2"),
        Row(f"slimlm {bits} x int8, AVX-VNNI", scheme, "avx_vnni", "avx2"),
        Row(f"torch {bits}, bf16 activations, AVX-512", scheme, None, None),
        Row(f"slimlm {bits} x int8, AVX512-VNNI", scheme, "avx512_vnni", None),
    ]


ROWS = [row for scheme in SCHEMES for row in scheme_rows(scheme)]


def worker(row: Row, options) -> None:
    """One row in this process: prepare, decode `repeats` times, print the result as JSON."""
    torch.set_num_threads(options.threads)
    cfg, loaded = load_bench_model(options.quick)
    model = quantized_copy(cfg, SCHEMES[row.scheme])
    prompt = benchmark_prompt(loaded.tokenizer, options.prompt_tokens).tolist()
    contender = slimlm_contender(
        row.name,
        model,
        loaded.tokenizer,
        prompt,
        options,
        torch.bfloat16,
        compiled=True,
        int8_activations=row.isa is not None,
    )
    speeds = [contender.run()[0] for _ in range(options.repeats)]
    built = cpu_kernels.kernel_isa() if row.isa else None
    print(MARK + json.dumps({"decode_tok_s": speeds, "kernel_isa": built, **contender.info}), flush=True)


def run_row(row: Row, options) -> dict:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in (cpu_kernels.ISA_ENV, "ATEN_CPU_CAPABILITY")
    }
    env.update({cpu_kernels.ISA_ENV: row.isa} if row.isa else {})
    env.update({"ATEN_CPU_CAPABILITY": row.aten} if row.aten else {})
    forwarded = [
        part
        for name in DECODE_OPTIONS
        for part in (f"--{name.replace('_', '-')}", str(getattr(options, name)))
    ]
    args = [
        sys.executable,
        __file__,
        "--worker",
        row.name,
        *forwarded,
        *(["--quick"] if options.quick else []),
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"row '{row.name}' failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len(MARK) :])
    kernel = f"int{SCHEMES[row.scheme]['bits']}-int8act"
    if result["kernel_isa"] != row.isa or (row.isa and not any(kernel in name for name in result["kernels"])):
        raise SystemExit(
            f"row '{row.name}' ran {result['kernel_isa']} with kernels {result['kernels']}, not {row.isa}"
        )
    return result


def available(row: Row) -> bool:
    """Whether this processor has the row's kernel build and, for a row limited to AVX2, AVX2."""
    return not any(
        cpu_kernels.missing_flags(isa) for isa in (row.isa, "avx2" if row.aten == "avx2" else None) if isa
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_decode_options(parser)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--worker", choices=[row.name for row in ROWS], help=argparse.SUPPRESS)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"the tiny test model, {QUICK_SCHEME} rows only, 1 pass of 1 decode of 16 new tokens a row; "
            "results only printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick and not options.worker:
        options.passes, options.repeats, options.new_tokens = 1, 1, 16
    if options.worker:
        return worker(next(row for row in ROWS if row.name == options.worker), options)
    started = time.perf_counter()
    candidates = [row for row in ROWS if not options.quick or row.scheme == QUICK_SCHEME]
    rows = [row for row in candidates if available(row)]
    skipped = [row.name for row in candidates if row not in rows]
    results: dict[str, list[dict]] = {row.name: [] for row in rows}
    for _ in tqdm(range(options.passes), desc="passes"):
        for row in tqdm(rows, desc="rows", leave=False):
            results[row.name].append(run_row(row, options))
    bandwidth = memory_bandwidth("cpu", refresh=True).bytes_per_s
    table = []
    for row in rows:
        first = results[row.name][0]
        speed = statistics.median(s for result in results[row.name] for s in result["decode_tok_s"])
        baseline = (
            next(
                r
                for r in table
                if r["scheme"] == row.scheme
                and r["kernel_isa"] is None
                and r["aten_cpu_capability"] == (row.aten or "default")
            )
            if row.isa
            else None
        )
        table.append(
            {
                "name": row.name,
                "scheme": row.scheme,
                "kernel_isa": row.isa,
                "aten_cpu_capability": row.aten or "default",
                "decode_tok_s": speed,
                "speedup_vs_torch": speed / baseline["decode_tok_s"] if baseline else 1.0,
                "bandwidth_fraction": speed * first["bytes_per_token"] / bandwidth,
                "bytes_per_token": first["bytes_per_token"],
                "weight_bytes": first["weight_bytes"],
                "kernels": first["kernels"],
            }
        )
        print(f"{row.name}: {speed:.1f} tok/s", flush=True)
    summary = {
        "bandwidth_bytes_s": bandwidth,
        "passes": options.passes,
        "repeats": options.repeats,
        "threads": options.threads,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("decode_cpu_isa.py", parser, options)
    if not options.quick:
        RESULTS.mkdir(exist_ok=True)
        write_plot(table, "decode_cpu_isa", "int4 and int8 decode on CPU by instruction set, default model")
    publish(
        "decode_cpu_isa",
        command,
        {"summary": summary, "rows": table},
        markdown(table, summary, command),
        options.quick,
    )


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    machine = machine_info()
    return [
        "# decode_cpu_isa",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{summary['threads']} threads", summary["seconds"]),
        "- default model, int4 g64 RTN or int8 RTN per channel (decoder Linears and tied head), batch 1, a "
        f"{summary['prompt_tokens']}-token prompt, exactly {summary['new_tokens']} new tokens (greedy), "
        f"decode step compiled; median of {summary['passes']} passes x {summary['repeats']} decodes, one "
        "process per row and pass, rows taking turns",
        "- a row limited to AVX2 runs with ATEN_CPU_CAPABILITY=avx2 (torch's own kernels use 256-bit "
        "vectors; the compiled step's generated code does in every row) and, for slimlm's kernel, "
        "SLIMLM_CPU_ISA naming its build; bandwidth used = bytes per token x tokens/s / this machine's "
        f"{summary['bandwidth_bytes_s'] / 1e9:.1f} GB/s (a laptop's memory differs: compare rows, not "
        "tokens/s)",
        *(
            [f"- not run (the processor lacks them): {', '.join(summary['skipped'])}"]
            if summary["skipped"]
            else []
        ),
        "",
        (
            "| decoder | vector width | decode tok/s | vs torch's kernel for those weights at that width | "
            "bandwidth used |"
        ),
        "|---|---|---:|---:|---:|",
        *[
            f"| {r['name']} | {'256-bit' if r['aten_cpu_capability'] == 'avx2' else 'widest'} | "
            f"{r['decode_tok_s']:.1f} | {r['speedup_vs_torch']:.2f}x | {100 * r['bandwidth_fraction']:.0f}% |"
            for r in rows
        ],
        "",
        "![decode_cpu_isa](decode_cpu_isa.png)",
        "",
    ]


if __name__ == "__main__":
    main()
