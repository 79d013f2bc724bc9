"""GPTQ on a GPU, one block at a time from a checkpoint, against the same run on the CPU.

A Llama-3.2-1B-shaped checkpoint with random bf16 weights (its first --layers blocks) is written
to a temporary directory; compress/offload.py quantizes it with w4 g128 GPTQ (16 windows of 512
random tokens, calibrated in bf16, statistics and every GPTQ tensor on the block's device) on
--device and on the CPU. Reported per device: seconds per block, peak memory (the GPU's
allocator, or the CPU's resident set), and how many codes the two runs share; the outputs of
each quantized layer are compared on a random input. bench/gpu.sh runs it
first (a minute on an H200), so a lent device checks the calibration path before the decoder.
Writes bench/results/calibrate_gpu.{md,json}; --quick: a tiny shape on the CPU, for tests.

    python bench/calibrate_gpu.py [--device cuda] [--layers 2] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import command_line, publish_table  # noqa: E402

from slimlm.compress.offload import quantize_checkpoint  # noqa: E402
from slimlm.compress.quantize import QuantizeParams  # noqa: E402
from slimlm.qlinear import QuantLinear  # noqa: E402
from slimlm.rundir import machine_info  # noqa: E402

LLAMA_3_2_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
QUICK = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    head_dim=32,
    tie_word_embeddings=True,
)


def write_random_checkpoint(directory: Path, shape: dict, layers: int) -> None:
    """Random bf16 weights (std 0.02, norms 1) in the shape's layout, one safetensors file."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=4096, dtype="bfloat16")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, meta in skeleton.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        tensors[name] = (
            torch.ones(meta.shape, dtype=torch.bfloat16)
            if name.endswith("norm.weight")
            else (torch.randn(meta.shape, generator=generator) * 0.02).to(torch.bfloat16)
        )
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(directory)


def calibrate(checkpoint: Path, device: torch.device, samples: torch.Tensor) -> dict:
    params = QuantizeParams(
        method="gptq",
        bits=4,
        group_size=128 if samples.shape[1] >= 128 else 32,
        samples=samples.shape[0],
        seq_len=samples.shape[1],
    )
    layers: dict[str, QuantLinear] = {}

    def keep(name: str, block: torch.nn.Module) -> None:
        layers.update(
            {
                f"{name}.{key}": copy.deepcopy(module).to("cpu")
                for key, module in block.named_modules()
                if isinstance(module, QuantLinear)
            }
        )  # a copy: the block is freed next

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    result = quantize_checkpoint(checkpoint, params, samples, keep, device=device, dtype=torch.bfloat16)
    return {
        "seconds": time.perf_counter() - started,
        "block_seconds": result.block_seconds,
        "peak_bytes": result.peak_memory_bytes,
        "layers": layers,
    }


def compare(a: dict[str, QuantLinear], b: dict[str, QuantLinear]) -> dict:
    """Share of identical codes, and the largest relative difference of the layers' outputs."""
    same = sum(int((a[name].codes() == b[name].codes()).sum()) for name in a)
    total = sum(a[name].codes().numel() for name in a)
    worst = 0.0
    for name in a:
        inputs = torch.randn(8, a[name].in_features, generator=torch.Generator().manual_seed(1))
        ya, yb = a[name](inputs), b[name](inputs)
        worst = max(worst, float((ya - yb).norm() / ya.norm().clamp(min=1e-12)))
    return {"codes_identical": round(same / total, 6), "max_output_rel_difference": round(worst, 6)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks of the 1B shape")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, results printed: for tests")
    options = parser.parse_args()
    started = time.perf_counter()
    shape = QUICK if options.quick else LLAMA_3_2_1B
    samples = torch.randint(
        0,
        shape["vocab_size"],
        (4, 64) if options.quick else (16, 512),
        generator=torch.Generator().manual_seed(0),
    )
    with tempfile.TemporaryDirectory() as work:
        write_random_checkpoint(Path(work), shape, options.layers)
        runs = {
            name: calibrate(Path(work), torch.device(name), samples)
            for name in dict.fromkeys([options.device, "cpu"])
        }
    agreement = compare(runs["cpu"]["layers"], runs[options.device]["layers"])
    rows = [
        {
            "name": f"w4 gptq, {name}",
            "seconds": round(run["seconds"], 2),
            "block_s": round(sum(run["block_seconds"].values()) / len(run["block_seconds"]), 2),
            "peak_bytes": run["peak_bytes"],
            **(agreement if name != "cpu" else {}),
        }
        for name, run in runs.items()
    ]
    report(parser, options, rows, shape, time.perf_counter() - started)


def report(
    parser: argparse.ArgumentParser,
    options: argparse.Namespace,
    rows: list[dict],
    shape: dict,
    seconds: float,
) -> None:
    command = command_line("calibrate_gpu.py", parser, options)
    machine = machine_info(query_gpu=not options.quick)
    details = [
        f"- shape: Llama-3.2-1B (hidden {shape['hidden_size']}, intermediate {shape['intermediate_size']}, "
        f"vocab {shape['vocab_size']}), first {options.layers} blocks, random bf16 weights, 16 x 512 random "
        "tokens"
    ]
    table = [
        "| run | seconds | s / block | peak MiB | codes identical to the CPU's | max output difference |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['seconds']:.2f} | {r['block_s']:.2f} | {r['peak_bytes'] / 2**20:,.0f} | "
            f"{r.get('codes_identical', 1.0):.4f} | {r.get('max_output_rel_difference', 0.0):.2e} |"
            for r in rows
        ),
    ]
    publish_table(
        "calibrate_gpu",
        "GPTQ calibration on a GPU against the CPU (offloaded, one block at a time)",
        command,
        machine,
        seconds,
        details,
        table,
        rows,
        options.quick,
    )


if __name__ == "__main__":
    main()
