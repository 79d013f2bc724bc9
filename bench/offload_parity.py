"""Offloaded calibration against the in-memory path on the default model.

compress/offload.py calibrates a checkpoint one decoder block at a time in the checkpoint's own
dtype. This measures what that changes on the default model, w4 g64 symmetric GPTQ (the
w4-gptq recipe: 64 calibration windows of 256 tokens of data=shared, act-order, clipping):
  in-memory fp32      the quantize stage as recipes run it (bench/quantize_default.sh's row)
  offloaded fp32      the same checkpoint, one block in memory at a time: must equal the above
  offloaded bf16      the checkpoint in bf16, calibrated in bf16 (float32 Hessian products)
Perplexity, KL and top-1 agreement on the quantize table's slice (the first 64 windows of 2048
tokens of WikiText-2 test; KL over the reference's top 32), quantize seconds and the walk's
peak memory. Goal: KL within 1% of the in-memory path, and no slower.
Writes bench/results/offload_parity.{md,json}; --quick runs a tiny checkpoint (--model) for tests.

    python bench/offload_parity.py [--windows 64] [--samples 64] [--quick --model DIR]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from benchlib import command_line, default_model_cfg, publish_table, shared_data_cfg

from slimlm.architecture import decoder_blocks
from slimlm.compress.calibration import calibration_samples
from slimlm.compress.offload import quantize_checkpoint
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.data import load_text, tokenize_text
from slimlm.eval.perplexity import score_text
from slimlm.models import load_model
from slimlm.pipeline import RunState
from slimlm.rundir import machine_info

WINDOW = 2048
TOP_K = 32


def parse() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=64, help="evaluation windows of 2048 tokens")
    parser.add_argument("--samples", type=int, default=64, help="calibration windows of 256 tokens")
    parser.add_argument(
        "--quick", action="store_true", help="tiny settings for a test; results printed, not written"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a checkpoint directory (default: the default model, converted once)",
    )
    return parser, parser.parse_args()


def in_memory(model, params: QuantizeParams, samples: torch.Tensor) -> tuple[torch.nn.Module, float, int]:
    state = RunState(
        cfg=None,
        run_dir=None,
        model=model,
        tokenizer=None,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    state.memo.calibration_ids = (
        samples.flatten()
    )  # the windows themselves, in order: the same ones the offloaded runs see
    started = time.perf_counter()
    quantize(state, params)
    return (
        model,
        time.perf_counter() - started,
        state.sections["quantization"][0]["calibration_peak_memory_bytes"],
    )


def offloaded(
    checkpoint: Path, template, params: QuantizeParams, samples: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.nn.Module, float, int]:
    """The offloaded run's blocks put into a float copy of the model, to evaluate it whole."""
    model = copy.deepcopy(template)
    _, layers = decoder_blocks(model)

    def keep(name: str, block: torch.nn.Module) -> None:
        layers[int(name.rpartition(".")[2])] = copy.deepcopy(block).float()

    started = time.perf_counter()
    result = quantize_checkpoint(checkpoint, params, samples, keep, dtype=dtype)
    return model, time.perf_counter() - started, result.peak_memory_bytes


def main() -> None:
    parser, options = parse()
    started = time.perf_counter()
    torch.manual_seed(0)
    cfg = default_model_cfg()
    if options.model is not None:
        cfg.path = str(options.model)
    loaded = load_model(cfg, torch.device("cpu"))
    tokenizer, original = loaded.tokenizer, loaded.model.float().eval()
    window = 64 if options.quick else WINDOW
    characters = 100_000 if options.quick else None  # a test tokenizes a little of each text
    data = shared_data_cfg()
    eval_ids = tokenize_text(tokenizer, load_text(data.eval_text, "eval_text")[:characters])[
        : options.windows * window
    ]
    calibration = tokenize_text(tokenizer, load_text(data.calibration, "calibration")[:characters])
    samples = calibration_samples(calibration, options.samples, 32 if options.quick else 256, seed=0)
    params = QuantizeParams(
        method="gptq",
        bits=4,
        group_size=16 if options.quick else 64,
        samples=options.samples,
        seq_len=samples.shape[1],
    )
    reference = score_text(original, eval_ids, window, collect_top_k=TOP_K, desc="reference").reference
    rows = []
    with tempfile.TemporaryDirectory() as work:
        checkpoints = {}
        for dtype in (torch.float32, torch.bfloat16):
            checkpoints[dtype] = Path(work) / str(dtype).removeprefix("torch.")
            copy.deepcopy(original).to(dtype).save_pretrained(checkpoints[dtype])
        runs = {
            "in-memory fp32": lambda: in_memory(copy.deepcopy(original), params, samples),
            "offloaded fp32": lambda: offloaded(
                checkpoints[torch.float32], original, params, samples, torch.float32
            ),
            "offloaded bf16": lambda: offloaded(
                checkpoints[torch.bfloat16], original, params, samples, torch.bfloat16
            ),
        }
        for name, run in runs.items():
            model, seconds, peak = run()
            scores = score_text(model, eval_ids, window, reference=reference, desc=name)
            rows.append(
                {
                    "name": name,
                    "ppl": round(scores.perplexity.ppl, 4),
                    "kl": round(scores.distance["kl_mean"], 5),
                    "top1_agreement": round(scores.distance["top1_agreement"], 4),
                    "quantize_s": round(seconds, 1),
                    "calibration_peak_bytes": peak,
                }
            )
    base = rows[0]
    for row in rows:
        row["kl_vs_in_memory"] = round(row["kl"] / base["kl"], 4)
    report(parser, options, rows, time.perf_counter() - started)


def report(
    parser: argparse.ArgumentParser, options: argparse.Namespace, rows: list[dict], seconds: float
) -> None:
    command = command_line("offload_parity.py", parser, options)
    machine = machine_info(query_gpu=False)
    details = [
        f"- {options.samples} calibration windows of 256 tokens of data=shared; evaluation: the first "
        f"{options.windows} windows of 2048 tokens of WikiText-2 test, KL over the original's top {TOP_K}"
    ]
    table = [
        "| path | ppl | KL | KL / in-memory | top-1 % | quantize s | calibration peak MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['ppl']:.4f} | {r['kl']:.5f} | {r['kl_vs_in_memory']:.4f} | "
            f"{100 * r['top1_agreement']:.2f} | {r['quantize_s']:.1f} | "
            f"{r['calibration_peak_bytes'] / 2**20:,.0f} |"
            for r in rows
        ),
    ]
    publish_table(
        "offload_parity",
        "Offloaded calibration against the in-memory path (default model, w4 g64 GPTQ)",
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
