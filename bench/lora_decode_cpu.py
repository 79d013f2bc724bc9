"""What a LoRA adapter beside quantized codes costs and buys at decode time, on CPU.

A slimlm artifact whose quantized layers carry adapters (`recipe=w4-lora-recover`, exported by
bench/lora_deploy.sh) is loaded twice: as it is, each adapter running inside its layer's
int4 x int8 kernel call (inference/kernels/int8_activations_cpu.cpp), and with the adapters
dropped (the same codes alone, i.e. the GPTQ model before LoRA). Both run as decode_cpu's fastest
rows: int8 activations (slimlm's int4 x int8 kernel), the decode step compiled (each new decoder
shape compiles three graphs of about eight minutes each on 2 cores; Inductor's cache keeps them).
Batch 1, a 16-token prompt, exactly 128 new tokens, median of interleaved rounds (as
bench/decode_cpu.py), and the KL from the fp32 model to each row through its own decode step.
A second table times the first block's layers one call at a time: the codes alone, the adapter
inside the kernel's call, and the adapter beside it as two float32 matmuls (LowRankAdapter, how
the decoder runs adapters beside torch's kernels, and how it ran them beside this one before).
Writes bench/results/lora_decode_cpu.{md,json,png}; --quick (a test) decodes the tiny test model
with random rank-2 adapters, built afresh in place of --artifact, and only prints.

    python bench/lora_decode_cpu.py --artifact bench/runs/lora_deploy/w4-lora-recover/artifact
    python bench/lora_decode_cpu.py --quick
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from benchlib import QUICK_RUNS, call_us, command_line, load_bench_model, machine_line, publish
from decode_cpu import add_decode_options, eval_windows, race, reference_quality, slimlm_contender, write_plot

from slimlm.artifact import load_artifact, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.distill.stage import DistillParams, finish_lora, with_lora
from slimlm.eval.bandwidth import memory_bandwidth
from slimlm.eval.speed import benchmark_prompt
from slimlm.inference.build import build_decoder
from slimlm.inference.linear import LowRankAdapter, stacked_adapters
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantLinear
from slimlm.rundir import machine_info


def without_adapters(model):
    """`model` with every quantized layer's adapter dropped (in place): its codes alone."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.lora_a = module.lora_b = None
    return model


def quick_artifact() -> Path:
    """A --quick run's artifact: the tiny test model int4 g64 RTN with rank-2 adapters whose
    up-projections are random (not zero, so they change the output), saved afresh."""
    _, loaded = load_bench_model(True)
    state = RunState(
        cfg=None,
        run_dir=QUICK_RUNS,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=64))
    peft_model = with_lora(state.model, DistillParams(lora_rank=2, lora_alpha=4.0))
    torch.manual_seed(1)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.05)
    path = QUICK_RUNS / "lora_decode_cpu-artifact"
    shutil.rmtree(path, ignore_errors=True)
    return save_artifact(
        finish_lora(peft_model).eval(),
        loaded.tokenizer,
        path,
        state.schemes,
        source={"id": "tiny test model"},
    )


@torch.inference_mode()
def layer_table(adapted, plain, calls: int = 100) -> list[dict]:
    """Batch-1 time of each of the first block's layers (bf16 activations, weights warm in cache,
    blocks of `calls` calls): the codes alone, the adapter inside the int8-activation kernel's
    call, the adapter beside it."""
    inside, alone = (
        build_decoder(model, dtype=torch.bfloat16, int8_activations=True) for model in (adapted, plain)
    )
    attention, mlp = adapted.model.layers[0].self_attn, adapted.model.layers[0].mlp
    layers = {
        "q/k/v": (
            (attention.q_proj, attention.k_proj, attention.v_proj),
            lambda d: d.layers[0].attention.qkv,
        ),
        "o": ((attention.o_proj,), lambda d: d.layers[0].attention.o_proj),
        "gate/up": ((mlp.gate_proj, mlp.up_proj), lambda d: d.layers[0].feed_forward.gate_up),
        "down": ((mlp.down_proj,), lambda d: d.layers[0].feed_forward.down),
    }
    rows = []
    for name, (parts, pick) in layers.items():
        down, up = stacked_adapters(parts)
        beside = LowRankAdapter(pick(alone), down, up, torch.bfloat16, torch.device("cpu"))
        x = torch.randn(1, down.shape[1], dtype=torch.bfloat16)
        rows.append(
            {
                "name": name,
                "out_features": up.shape[0],
                "in_features": down.shape[1],
                "rank": down.shape[0],
                "alone_us": call_us(pick(alone), x, calls),
                "inside_us": call_us(pick(inside), x, calls),
                "beside_us": call_us(beside, x, calls),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--artifact",
        type=Path,
        help="a slimlm artifact whose quantized layers carry LoRA adapters (required but with --quick)",
    )
    add_decode_options(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "the tiny test model with random adapters, 16 new tokens, 1 round, 2 windows of 256 tokens for "
            "the KL, blocks of 10 layer calls; results only printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick:
        options.new_tokens, options.repeats = 16, 1
    elif options.artifact is None:
        parser.error("--artifact is required (or --quick)")
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    artifact = quick_artifact() if options.quick else options.artifact
    adapted = load_artifact(artifact)
    ranks = sorted(
        {
            record["adapter_rank"]
            for record in adapted.manifest["modules"].values()
            if record.get("adapter_rank")
        }
    )
    if not ranks:
        parser.error(
            f"{artifact} holds no adapters: export a run of recipe=w4-lora-recover (bench/lora_deploy.sh)"
        )
    plain = without_adapters(load_artifact(artifact).model)
    _, reference = load_bench_model(options.quick)
    tokenizer = adapted.tokenizer
    prompt = benchmark_prompt(tokenizer, options.prompt_tokens).tolist()
    quality = reference_quality(reference.model, eval_windows(tokenizer, options.quick))
    del reference
    rank = "/".join(str(r) for r in ranks)
    contenders = []
    for name, model in (
        (f"slimlm w4 g64 GPTQ + LoRA r{rank}, int8 activations, compiled", adapted.model),
        ("slimlm w4 g64 GPTQ, adapters dropped, int8 activations, compiled", plain),
    ):
        print(f"preparing {name}", flush=True)
        contenders.append(
            slimlm_contender(
                name,
                model,
                tokenizer,
                prompt,
                options,
                torch.bfloat16,
                compiled=True,
                int8_activations=True,
                quality=quality,
            )
        )
    rows = race(contenders, options.repeats)
    bandwidth = memory_bandwidth(
        "cpu", refresh=True
    ).bytes_per_s  # beside the timed rounds, not before the long compiles
    layers = layer_table(adapted.model, plain, 10 if options.quick else 100)
    for row in rows:
        row["bandwidth_fraction"] = row["decode_tok_s"] * row["bytes_per_token"] / bandwidth
    rows[0]["speed_vs_without_adapters"] = rows[0]["decode_tok_s"] / rows[1]["decode_tok_s"]
    summary = {
        "artifact": artifact.name,
        "adapter_ranks": ranks,
        "bandwidth_bytes_s": bandwidth,
        "prompt_tokens": options.prompt_tokens,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("lora_decode_cpu.py", parser, options)
    if not options.quick:
        write_plot(rows, "lora_decode_cpu", "w4 + LoRA decode, CPU")
    publish(
        "lora_decode_cpu",
        command,
        {"summary": summary, "rows": rows, "layers": layers},
        markdown(rows, summary, command, layers),
        options.quick,
    )


def markdown(rows: list[dict], summary: dict, command: str, layers: list[dict]) -> list[str]:
    def ratio(row: dict) -> str:
        return f"{row['speed_vs_without_adapters']:.2f}x" if "speed_vs_without_adapters" in row else ""

    return [
        "# lora_decode_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), f"{summary['threads']} threads", summary["seconds"]),
        (
            f"- batch 1, a {summary['prompt_tokens']}-token prompt, exactly {summary['new_tokens']} new "
            f"tokens (greedy), median of {summary['repeats']} interleaved rounds after a warm-up"
        ),
        (
            "- memory bandwidth (eval/bandwidth.py, measured right after the timed rounds): "
            f"{summary['bandwidth_bytes_s'] / 1e9:.1f} GB/s; bytes per token = weights (adapters included) + "
            "KV cache at the mean context"
        ),
        (
            "- KL to fp32: mean per-token KL from the fp32 model to the row's logits over the last 128 "
            "tokens of each of the first 4 windows of 512 tokens of WikiText-2 test, through the row's own "
            "compiled decode step"
        ),
        "",
        (
            "| decoder | decode tok/s | vs adapters dropped | weights MB | bandwidth used | KL to fp32 | "
            "kernels |"
        ),
        "|---|---:|---:|---:|---:|---:|---|",
        *[
            f"| {r['name']} | {r['decode_tok_s']:.1f} | {ratio(r)} | {r['weight_bytes'] / 1e6:.1f} | "
            f"{100 * r['bandwidth_fraction']:.0f}% | {r['kl_mean']:.4f} | "
            f"{', '.join(f'{k} x{v}' for k, v in r['kernels'].items())} |"
            for r in rows
        ],
        "",
        "![lora_decode_cpu](lora_decode_cpu.png)",
        "",
        (
            "### One call per layer (the first block; bf16 activations, batch 1, weights warm in cache, "
            "median of 5 blocks of 100 calls)"
        ),
        "",
        (
            "| layer | out x in | adapter rank | codes alone us | adapter inside the call us | adapter "
            "beside (2 fp32 matmuls) us | inside: extra us | beside: extra us |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['out_features']} x {r['in_features']} | {r['rank']} | {r['alone_us']:.1f} | "
            f"{r['inside_us']:.1f} | {r['beside_us']:.1f} | {r['inside_us'] - r['alone_us']:.1f} | "
            f"{r['beside_us'] - r['alone_us']:.1f} |"
            for r in layers
        ],
        "",
    ]


if __name__ == "__main__":
    main()
