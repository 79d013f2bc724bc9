"""What the benchmark scripts in bench/ share: the default model and data configs, the
reproducing command line, and writing bench/results/<name>.{json,md} (notes appended)."""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from slimlm.rundir import machine_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
QUICK_RUNS = (
    REPO / "bench" / "runs" / "quick"
)  # --quick runs' files, apart from the full runs' (bench/runs/<bench>/)


def default_model_cfg():
    from omegaconf import (
        OmegaConf,
    )  # here, not above: bench/decode_gpu.py runs where the config stack is absent

    from slimlm.config import ModelConfig

    return OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf" / "model" / "smollm2-135m.yaml")
    )


def shared_data_cfg():
    """The full data sets (data=shared: WikiText-2 test, the Gutenberg calibration corpus)."""
    from omegaconf import OmegaConf

    from slimlm.config import DataConfig

    return OmegaConf.merge(
        OmegaConf.structured(DataConfig), OmegaConf.load(REPO / "conf" / "data" / "shared.yaml")
    )


def quick_model_cfg():
    """The model config a --quick run (a test) loads instead of the default model: a tiny
    random-weight Llama with the tests' tokenizer, heads of 32 (llama.cpp's q8_0 cache needs
    blocks of 32) and 4,096 positions (room for the full runs' contexts), its next token
    depending on the context; saved once under bench/runs/quick/."""
    from omegaconf import OmegaConf

    from slimlm.config import ModelConfig

    directory = QUICK_RUNS / "tiny-llama-128"
    if not directory.is_dir():
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_llama, build_tokenizer

        QUICK_RUNS.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(dir=QUICK_RUNS)
        )  # renamed whole: another quick run may be building it too
        tokenizer = build_tokenizer()
        build_tiny_llama(
            len(tokenizer),
            initializer_range=0.2,
            hidden_size=128,
            intermediate_size=256,
            max_position_embeddings=4096,
        ).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(directory)
        except OSError:
            shutil.rmtree(staging)
    return OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        OmegaConf.load(REPO / "conf" / "model" / "custom.yaml"),
        {"path": str(directory)},
    )


def bench_model_cfg(quick: bool):
    """The default model's config, or a --quick run's tiny model's."""
    return quick_model_cfg() if quick else default_model_cfg()


def bench_data_cfg(quick: bool):
    """The full data sets, or for a --quick run the excerpts bundled with slimlm (data=demo)."""
    if not quick:
        return shared_data_cfg()
    from omegaconf import OmegaConf

    from slimlm.config import DataConfig

    return OmegaConf.merge(
        OmegaConf.structured(DataConfig), OmegaConf.load(REPO / "conf" / "data" / "demo.yaml")
    )


def load_bench_model(quick: bool):
    """decode_cpu.load_default, or for a --quick run the tiny model: the config and the loaded model."""
    from slimlm.models import load_model

    cfg = bench_model_cfg(quick)
    return cfg, load_model(cfg, torch.device("cpu"))


def bench_int4(threads: int, quick: bool):
    """decode_cpu.default_int4 (the int4 g64 model the serving benches decode, and the loaded
    original), or for a --quick run the same of the tiny model."""
    from decode_cpu import quantized_copy  # here: decode_cpu imports this module

    torch.set_num_threads(threads)
    cfg, loaded = load_bench_model(quick)
    return quantized_copy(cfg, dict(bits=4, group_size=64)), loaded


def eval_ids(tokenizer, quick: bool) -> torch.Tensor:
    """wikitext_ids, or for a --quick run the WikiText-2 test excerpt bundled with slimlm."""
    if not quick:
        return wikitext_ids(tokenizer)
    from slimlm.data import load_text, tokenize_text

    return tokenize_text(tokenizer, load_text(bench_data_cfg(True).eval_text, "eval_text"))


def wikitext_ids(tokenizer) -> torch.Tensor:
    """WikiText-2 test as one 1-D tensor of token ids (windows are cut by the caller)."""
    from slimlm.data import load_text, tokenize_text

    return tokenize_text(tokenizer, load_text(shared_data_cfg().eval_text, "eval_text"))


def command_line(script: str, parser: argparse.ArgumentParser, options: argparse.Namespace) -> str:
    """`python bench/<script>` with the options that differ from their defaults."""
    parts = [f"python bench/{script}"]
    for key, value in vars(options).items():
        if value == parser.get_default(key):
            continue
        flag = f"--{key.replace('_', '-')}"
        parts.append(
            flag
            if value is True
            else f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"
        )
    return " ".join(parts)


def write_result(
    name: str,
    command: str,
    record: dict,
    lines: list[str],
    notes: Optional[str] = None,
    machine: Optional[dict] = None,
) -> None:
    """bench/results/<name>.json (`machine`, by default this one's machine_info(), the command and
    `record`) and <name>.md (`lines`, then bench/<notes or name>.notes.md when it exists)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"machine": machine or machine_info(), "command": command, **record}, indent=2) + "\n"
    )
    notes_file = REPO / "bench" / f"{notes or name}.notes.md"
    if notes_file.is_file():
        lines = [*lines, notes_file.read_text().strip(), ""]
    (RESULTS / f"{name}.md").write_text("\n".join(lines))


def publish(
    name: str, command: str, record: dict, lines: list[str], quick: bool, notes: Optional[str] = None
) -> None:
    """write_result, or for a --quick run (a test) only print the Markdown lines."""
    if quick:
        print("\n".join(lines))
    else:
        write_result(name, command, record, lines, notes)


def call_us(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int = 100, blocks: int = 6
) -> float:
    """Median microseconds of one call of `layer` on `x` over `blocks` blocks of `calls` calls
    (the first block a warm-up): a layer's time with its weights warm in cache."""
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            layer(x)
        times.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(times[1:])


def local_request(
    port: int, method: str, route: str, body: Optional[bytes] = None, timeout: float = 120
) -> tuple[int, bytes]:
    """One HTTP request to a server on 127.0.0.1:`port` (a JSON body, when given): its status
    and body. Connection errors are the caller's to name."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, route, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def run_together(client: Callable[..., None], arguments: list[tuple]) -> None:
    """`client(*each)` for each of `arguments`, all at once in threads (a server's clients);
    returns when all have."""
    threads = [threading.Thread(target=client, args=each) for each in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def kernel_and_torch_ms(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median milliseconds of `run` with short runs of a row (guesses being checked) attending in
    slimlm's CPU kernel (`SHORT_RUN` as it is), and in torch's attention (`SHORT_RUN` = 1);
    the two alternate, so the machine's drift is shared."""
    from slimlm.inference import model as model_module

    default, times = model_module.SHORT_RUN, {True: [], False: []}
    try:
        for _ in range(repeats):
            for kernel, spent in times.items():
                model_module.SHORT_RUN = default if kernel else 1
                begin = time.perf_counter()
                run()
                spent.append(1000 * (time.perf_counter() - begin))
    finally:
        model_module.SHORT_RUN = default
    return statistics.median(times[True]), statistics.median(times[False])


def pass_table(heading: str, costs: list[dict]) -> list[str]:
    """Markdown lines of a table of one-pass costs (rows with a name and pass_ms)."""
    return [
        heading,
        "",
        "| pass | ms |",
        "|---|---:|",
        *[f"| {r['name']} | {r['pass_ms']:.0f} |" for r in costs],
        "",
    ]


def machine_line(machine: dict, threads: str, seconds: float) -> str:
    """The `- machine:` line of a CPU benchmark's markdown: processor, CPUs, `threads` as the
    benchmark words them, torch, and how long the run took."""
    return (
        f"- machine: {machine['processor']}, {machine['cpu_count']} CPUs, {threads}; torch "
        f"{machine['torch']}; {seconds / 60:.1f} min"
    )


def llama_cpp_bytes(path: Path, config, cache_bytes_per_value: float) -> tuple[int, float]:
    """What llama.cpp reads per decoded token of the GGUF at `path`: the bytes of its tensors (the
    token embedding's only where it is also the output matrix: otherwise a step reads one row of
    it), and its key/value cache's bytes per slot (`cache_bytes_per_value`: 2 for f16, 34/32 for
    q8_0)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    weights = sum(tensors.values())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (
        weights,
        2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * cache_bytes_per_value,
    )


def add_skip_llama_cpp(parser: argparse.ArgumentParser) -> None:
    """The --skip-llama-cpp option of the benchmarks that race llama.cpp."""
    parser.add_argument(
        "--skip-llama-cpp",
        action="store_true",
        help="when llama-cpp-python is not installed (pip install -e '.[bench]')",
    )


def check_llama_cpp(gguf: Path, threads: int) -> None:
    """Evaluate three tokens of `gguf` with llama-cpp-python in a child process, so that a build
    that dies on this processor stops the benchmark with a reason instead of killing it silently.
    Seen: llama.cpp's AMX matmul dies of SIGILL (`tilezero`) on AMX processors under some kernels
    and hypervisors; a build without AMX runs."""
    probe = (
        f"from llama_cpp import Llama; Llama(model_path={str(gguf)!r}, n_ctx=16, n_threads={threads}, "
        "verbose=False).eval([1, 2, 3])"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if result.returncode == 0:
        return
    if result.returncode > 0:
        error = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no message"
        raise SystemExit(
            f"llama-cpp-python could not evaluate {gguf.name} (exit {result.returncode}): {error}"
        )
    raise SystemExit(
        f"llama-cpp-python died of {signal.Signals(-result.returncode).name} evaluating {gguf.name} on this "
        "processor. If the processor has AMX, rebuild llama-cpp-python without it: "
        "CMAKE_ARGS=\"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
        "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" .venv/bin/pip install "
        "--force-reinstall --no-deps --no-cache-dir llama-cpp-python; or leave the llama.cpp rows out."
    )


def publish_table(
    name: str,
    title: str,
    command: str,
    machine: dict,
    seconds: float,
    details: list[str],
    table: list[str],
    rows: list[dict],
    quick: bool,
) -> None:
    """A benchmark's Markdown page (title, command, machine, `details` lines, `table`) and its
    rows: written to bench/results/<name>.* , or only printed by a --quick run (tests)."""
    lines = [
        f"# {title}",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{torch.get_num_threads()} torch threads", seconds),
        *details,
        "",
        *table,
        "",
    ]
    if quick:
        print("\n".join(lines))
    else:
        write_result(name, command, {"rows": rows}, lines, machine=machine)
