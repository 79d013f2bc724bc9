"""The evaluate stage's speed metric through the bundled decoder against transformers' forward, on a w8 model.

A model slimlm quantized is deployed through the bundled decoder (`slimlm generate`), whose
packed kernels read the codes; transformers' forward dequantizes each quantized layer's whole
weight on every call. The speed metric now takes the decoder wherever it runs the family. This
script measures both paths with `eval=quick`'s settings (16 prompt tokens, 32 new tokens, one
warm-up, three timed runs) on Qwen2.5-Coder-0.5B (qwen2 family) after int8 RTN of every decoder
Linear and the head, and reports each path's wall time for the whole metric.

    python bench/eval_speed_path.py [--threads 2] [--quick]

Writes bench/results/eval_speed_path.{md,json}; --quick (the tiny test model) only prints.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from benchlib import REPO, command_line, publish_table, quick_model_cfg
from omegaconf import OmegaConf

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.config import ModelConfig
from slimlm.eval.speed import measure_decoder_speed, measure_speed
from slimlm.models import load_model
from slimlm.pipeline import RunState
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "eval_speed_path"
QUICK_SPEED = dict(
    prompt_tokens=16, new_tokens=32, batch_size=1, warmup=1, repeats=3
)  # conf/eval/quick.yaml's speed


def w8_model(quick: bool, workdir: Path):
    """The model, int8 RTN of every decoder Linear and the LM head, in memory."""
    cfg = (
        quick_model_cfg()
        if quick
        else OmegaConf.merge(
            OmegaConf.structured(ModelConfig),
            OmegaConf.load(REPO / "conf" / "model" / "qwen2.5-coder-0.5b.yaml"),
        )
    )
    loaded = load_model(cfg, torch.device("cpu"))
    workdir.mkdir(parents=True, exist_ok=True)
    state = RunState(
        cfg=None,
        run_dir=workdir,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"]))
    return cfg.name, loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="the tiny test model; results only printed (tests)"
    )
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    name, loaded = w8_model(options.quick, RUNS / "quick" if options.quick else RUNS)
    rows = []
    for label, measure in (
        ("bundled decoder", measure_decoder_speed),
        ("transformers forward", measure_speed),
    ):
        began = time.perf_counter()
        result = measure(loaded.model, loaded.tokenizer, **QUICK_SPEED)
        rows.append(
            {
                "name": label,
                "metric_wall_s": round(time.perf_counter() - began, 1),
                "decode_tok_s": result.decode_tok_s,
                "ttft_s": result.ttft_s,
                "prefill_tok_s": result.prefill_tok_s,
                "peak_memory_bytes": result.peak_memory_bytes,
            }
        )
    table = [
        (
            "| speed metric through | whole metric s | decode tok/s | time to first token s | prefill tok/s "
            "| peak memory MiB |"
        ),
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['metric_wall_s']:.1f} | {r['decode_tok_s']:.1f} | {r['ttft_s']:.3f} | "
            f"{r['prefill_tok_s']:.0f} | {r['peak_memory_bytes'] / 2**20:,.0f} |"
            for r in rows
        ],
        "",
        (
            f"The decoder decodes {rows[0]['decode_tok_s'] / rows[1]['decode_tok_s']:.1f}x as fast; the "
            f"metric takes {rows[1]['metric_wall_s'] / rows[0]['metric_wall_s']:.1f}x less time."
        ),
    ]
    details = [
        f"- {name}, int8 RTN of every decoder Linear and the LM head, in memory; `eval=quick`'s speed "
        f"settings: {QUICK_SPEED['prompt_tokens']} prompt tokens, {QUICK_SPEED['new_tokens']} new, 1 "
        "warm-up, 3 timed runs (medians); the decoder's time includes building it"
    ]
    publish_table(
        "eval_speed_path",
        "eval_speed_path",
        command_line("eval_speed_path.py", parser, options),
        machine_info(),
        time.perf_counter() - started,
        details,
        table,
        rows,
        options.quick,
    )


if __name__ == "__main__":
    main()
