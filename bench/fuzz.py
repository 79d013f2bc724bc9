"""Fuzzing slimlm's trust boundary: seeded mutations of what users and clients hand it.

Each case mutates one thing of a valid seed, then runs the code that reads it:
  manifest     an artifact's manifest.json (JSON type swaps, huge numbers, deleted keys, bytes)
  config       its config.json, the manifest's checksum recomputed: a crafted artifact carries a
               manifest that matches it, so checksums cannot be what stops it
  tokenizer    tokenizer.json or tokenizer_config.json, re-signed likewise
  safetensors  the weights file's header length, header JSON (offsets, shapes, dtypes) and body,
               re-signed likewise
  gguf         a GGUF file (counts, length fields, value types, truncation, bit flips)
  request      bodies for /v1/completions and /v1/chat/completions of a live server
Artifact cases are loaded both ways (load_artifact, the evaluate path; load_decoder, the
decoder's), GGUF cases are read as a model source and converted. A case passes when it ends
accepted (it loads; HTTP 200) or refused in one line (SlimlmError, which the CLI prints as one
line with exit 2; HTTP 4xx with a JSON error body), within --timeout seconds and --memory-gb of
address space. It fails on any other exception (a traceback), HTTP 5xx, a hang or memory
exhaustion. File cases run each in a forked child that the parent kills at the time bound.

Writes bench/results/fuzz.{md,json} (--quick: 40 cases per surface, results in --workdir only;
tests/test_fuzz.py runs it).

    python bench/fuzz.py [--cases 400] [--seed 0] [--timeout 30] [--memory-gb 4] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import resource
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib import REPO, command_line, local_request, machine_line, write_result

from slimlm.rundir import machine_info

FILE_SURFACES = ("manifest", "config", "tokenizer", "safetensors", "gguf")
SURFACES = (*FILE_SURFACES, "request")
QUICK_CASES = 40


@dataclass(frozen=True)
class Outcome:
    surface: str
    case: int
    mutation: str
    result: str  # accepted | refused | failed
    detail: str  # the refusal's line, or what failed (exception type and message, status, hang)
    seconds: float


# --- mutations ------------------------------------------------------------------------------

ODD_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    10**9,
    10**30,
    -(10**9),
    1e308,
    -1e-300,
    0.5,
    "",
    "x",
    "A" * 4096,
    [],
    [1, 2, 3],
    {},
    {"a": 1},
    [[[]]],
    "float64x",
    "../../etc/passwd",
)


def json_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path (a tuple of keys and indices) into a JSON value, the root included."""
    paths = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += json_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:50]):  # a vocabulary's thousands of entries add nothing new
            paths += json_paths(item, (*path, index))
    return paths


def mutate_json(document: Any, rng: random.Random) -> tuple[Any, str]:
    """One structural change at a random place: a value swapped for one of another type or size,
    a number scaled or negated, a key deleted or added."""
    path = rng.choice(json_paths(document))
    if not path:
        return rng.choice(ODD_VALUES), "root replaced"
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    key, old = path[-1], parent[path[-1]]
    kind = rng.choice(("swap", "number", "delete", "add"))
    where = ".".join(map(str, path))
    if kind == "number" and isinstance(old, (int, float)) and not isinstance(old, bool):
        parent[key] = rng.choice((old * 10**6, -old - 1, old + 1, old - 1, 2**62, 0))
        return document, f"{where}: {old!r} -> {parent[key]!r}"
    if kind == "delete" and isinstance(parent, dict):
        del parent[key]
        return document, f"{where} deleted"
    if kind == "add" and isinstance(old, dict):
        old[rng.choice(("extra", "__class__", "num_hidden_layers", "dtype"))] = rng.choice(ODD_VALUES)
        return document, f"{where}: key added"
    parent[key] = rng.choice(ODD_VALUES)
    return document, f"{where}: {type(old).__name__} -> {str(parent[key])[:40]!r}"


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Bit flips, a truncation, inserted garbage or a duplicated slice."""
    data = bytearray(data)
    kind = rng.choice(("flip", "truncate", "insert", "duplicate"))
    at = rng.randrange(max(1, len(data)))
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data), "bits flipped"
    if kind == "truncate":
        return bytes(data[:at]), f"truncated at {at}"
    if kind == "insert":
        return bytes(data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]), f"bytes inserted at {at}"
    length = rng.randint(1, 256)
    return bytes(data[:at] + data[at : at + length] * 2 + data[at + length :]), f"slice duplicated at {at}"


def mutate_json_file(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A JSON file: mostly structural changes, sometimes raw bytes."""
    if rng.random() < 0.25:
        return mutate_bytes(data, rng)
    document, what = mutate_json(json.loads(data), rng)
    return json.dumps(document).encode(), what


def mutate_safetensors(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """The 8-byte header length, the header's JSON (offsets, shapes, dtypes, keys), or the body."""
    length = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    kind = rng.choice(("length", "header", "header", "tensor", "body"))
    if kind == "length":
        value = rng.choice((0, 1, length - 1, length + 1, len(data), 2**62, 2**64 - 1, 100 * 2**20))
        return struct.pack("<Q", value) + data[8:], f"header length {length} -> {value}"
    if kind == "body":
        mutated, what = mutate_bytes(body, rng)
        return data[: 8 + length] + mutated, f"body: {what}"
    if kind == "tensor":
        name = rng.choice([key for key in header if key != "__metadata__"])
        entry = header[name]
        field = rng.choice(("data_offsets", "shape", "dtype"))
        entry[field] = rng.choice(
            {
                "data_offsets": (
                    [0, 0],
                    [entry["data_offsets"][1], entry["data_offsets"][0]],
                    [0, len(body) + 4096],
                    [2**62, 2**62 + 8],
                    [-8, 0],
                    [0, 2**64],
                ),
                "shape": ([], [0], [2**31, 2**31], [-1, 4], [10**12], [1] * 64, "4"),
                "dtype": ("F64", "I64", "BOOL", "F8_E4M3", "Q4", "", 4),
            }[field]
        )
        what = f"{name}.{field} -> {str(entry[field])[:40]}"
    else:
        header, what = mutate_json(header, rng)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body, f"header: {what}"


def mutate_gguf(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Counts and length fields (any 8-byte word of the header region set to a large number),
    value types (4-byte words), truncation and bit flips."""
    data = bytearray(data)
    region = min(len(data), 64 * 1024)  # the key/value header and tensor infos of a tiny model
    kind = rng.choice(("count", "word", "type", "truncate", "flip"))
    if kind == "count":
        at = rng.choice((8, 16))  # tensor count, key/value count
        data[at : at + 8] = struct.pack("<Q", rng.choice((0, 2**62, 2**64 - 1, 10**6)))
        return bytes(data), f"{'tensor' if at == 8 else 'key/value'} count changed"
    if kind == "word":
        at = rng.randrange(24, region - 8)
        data[at : at + 8] = struct.pack("<Q", rng.choice((2**32, 2**62, 2**64 - 1, 10**9, len(data))))
        return bytes(data), f"8 bytes at {at} set large"
    if kind == "type":
        at = rng.randrange(24, region - 4)
        data[at : at + 4] = struct.pack("<I", rng.choice((8, 9, 13, 255, 2**31)))
        return bytes(data), f"4 bytes at {at} set to a value type"
    return mutate_bytes(bytes(data[:region]) + bytes(data[region:]), rng)


# --- seeds ----------------------------------------------------------------------------------


def seed_files(workdir: Path) -> tuple[Path, Path]:
    """A tiny w4 artifact (2 layers, a real BPE tokenizer, a chat template) and a tiny F32 GGUF."""
    import torch

    sys.path.insert(0, str(REPO))
    from slimlm.artifact import save_artifact
    from slimlm.compress.quantize import QuantizeParams
    from slimlm.compress.quantize import run as quantize
    from slimlm.gguf_export import export_gguf
    from slimlm.pipeline import RunState
    from tests.conftest import build_tiny_llama, build_tokenizer

    artifact, gguf = workdir / "seed-artifact", workdir / "seed" / "tiny.gguf"
    if artifact.is_dir() and gguf.is_file():
        return artifact, gguf
    shutil.rmtree(artifact, ignore_errors=True)
    tokenizer = build_tokenizer()
    model = build_tiny_llama(len(tokenizer), initializer_range=0.2)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    export_gguf(model, tokenizer, gguf, "F32")
    state = RunState(
        cfg=None,
        run_dir=workdir,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32))
    save_artifact(state.model, state.tokenizer, artifact, state.schemes, source={"id": "fuzz seed"})
    return artifact, gguf


# --- running file cases ---------------------------------------------------------------------

ARTIFACT_TARGETS = {
    "manifest": ("manifest.json",),
    "config": ("config.json",),
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "safetensors": ("model.safetensors",),
}


def artifact_case(surface: str, seed: Path, rng: random.Random, workdir: Path) -> tuple[Path, str]:
    """A copy of the seed artifact with one file mutated (re-signed in the manifest, unless it
    is the manifest)."""
    from slimlm.resources import sha256_file

    target = workdir / "artifact"
    shutil.copytree(seed, target)
    name = rng.choice(ARTIFACT_TARGETS[surface])
    mutate = mutate_safetensors if surface == "safetensors" else mutate_json_file
    data, what = mutate((target / name).read_bytes(), rng)
    (target / name).write_bytes(data)
    if surface != "manifest":
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["files"][name] = {"sha256": sha256_file(target / name), "bytes": len(data)}
        (target / "manifest.json").write_text(json.dumps(manifest))
    return target, f"{name}: {what}"


def load_artifact_both_ways(path: Path) -> None:
    from slimlm.artifact import load_artifact
    from slimlm.inference.load import load_decoder

    load_artifact(path)
    load_decoder(path)


def load_gguf(path: Path) -> None:
    """As `model.path=<gguf>` does: the header (resolve_model), then the conversion."""
    from slimlm.config import ModelConfig
    from slimlm.models import checkpoint_directory, resolve_model, source_sha256

    source = resolve_model(ModelConfig(path=str(path)))
    checkpoint_directory(source, source_sha256(source))


def run_file_case(
    surface: str, index: int, seed_artifact: Path, seed_gguf: Path, seed: int, memory_bytes: int, send
) -> None:
    """In a forked child: build the case, load it, send (mutation, result, detail) back."""
    from slimlm.errors import SlimlmError

    rng = random.Random(f"{seed}:{surface}:{index}")
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1), os.dup2(quiet, 2)  # the loaders' progress bars and warnings, for thousands of cases
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-case-"))
    os.environ["SLIMLM_CACHE"] = str(workdir / "cache")  # GGUF conversions land in the case's own cache
    mutation = "?"
    try:
        if surface == "gguf":
            data, mutation = mutate_gguf(seed_gguf.read_bytes(), rng)
            (workdir / "case.gguf").write_bytes(data)

            def load() -> None:
                load_gguf(workdir / "case.gguf")

        else:
            path, mutation = artifact_case(surface, seed_artifact, rng, workdir)

            def load() -> None:
                load_artifact_both_ways(path)

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        try:
            load()
            send.send((mutation, "accepted", ""))
        except SlimlmError as error:
            line = str(error).replace(str(workdir), "<case>")
            send.send(
                (mutation, "refused", line)
                if "\n" not in line
                else (mutation, "failed", f"a refusal of several lines: {line!r}")
            )
        except BaseException as error:  # a traceback in the CLI: exactly what the fuzzer looks for
            where = traceback.extract_tb(error.__traceback__)[-1]
            message = str(error).replace(str(workdir), "<case>").strip()
            send.send(
                (
                    mutation,
                    "failed",
                    (
                        f"{type(error).__name__}: {message.splitlines()[0][:200] if message else ''} "
                        f"({Path(where.filename).name}:{where.lineno})"
                    ),
                )
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def file_outcome(surface: str, index: int, seeds: tuple[Path, Path], options: argparse.Namespace) -> Outcome:
    """One file case in a forked child, killed at the time bound."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    memory = current_address_space() + int(options.memory_gb * 2**30)
    started = time.perf_counter()
    child = context.Process(target=run_file_case, args=(surface, index, *seeds, options.seed, memory, send))
    child.start()
    send.close()
    if receive.poll(options.timeout):
        try:
            mutation, result, detail = receive.recv()
        except EOFError:
            mutation, result, detail = "?", "failed", "the loader died without an answer"
    else:
        mutation, result, detail = "?", "failed", f"no answer in {options.timeout} s (a hang)"
    child.kill()
    child.join()
    if result == "failed" and mutation == "?" and child.exitcode not in (0, None, -9):
        detail = f"{detail} (exit {child.exitcode})"
    return Outcome(surface, index, mutation, result, detail, time.perf_counter() - started)


def current_address_space() -> int:
    """This process's virtual size: a forked child starts with it, so its limit is this plus the bound."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def warm_up(seeds: tuple[Path, Path], workdir: Path) -> None:
    """Load both seeds once here, so each forked child finds every module imported."""
    os.environ["SLIMLM_CACHE"] = str(workdir / "cache")
    load_artifact_both_ways(seeds[0])
    load_gguf(seeds[1])


# --- request cases --------------------------------------------------------------------------

VALID_REQUESTS = (
    ("/v1/completions", {"prompt": "the story of", "max_tokens": 4, "temperature": 0}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4, "stream": True, "stop": ["x"]}),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello <|user|> there"},
            ],
            "max_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 1,
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
    ),
)


def request_case(index: int, seed: int) -> tuple[str, bytes, str]:
    """A valid body with one mutation: structural (mostly), raw bytes, or an oversized body."""
    rng = random.Random(f"{seed}:request:{index}")
    route, body = rng.choice(VALID_REQUESTS)
    body = json.loads(json.dumps(body))
    roll = rng.random()
    if roll < 0.05:
        return route, b'{"prompt": "' + b"a" * (3 << 20) + b'"}', "a 3 MB body"
    if roll < 0.3:
        data, what = mutate_bytes(json.dumps(body).encode(), rng)
        return route, data, what
    mutated, what = mutate_json(body, rng)
    return route, json.dumps(mutated).encode(), what


def request_outcome(port: int, index: int, options: argparse.Namespace) -> Outcome:
    route, body, mutation = request_case(index, options.seed)
    started = time.perf_counter()
    try:
        status, answer = local_request(port, "POST", route, body, options.timeout)
    except (OSError, http.client.HTTPException) as error:
        return Outcome(
            "request",
            index,
            f"{route} {mutation}",
            "failed",
            f"{type(error).__name__}: {error}",
            time.perf_counter() - started,
        )
    seconds = time.perf_counter() - started
    if status == 200:
        return Outcome("request", index, f"{route} {mutation}", "accepted", "", seconds)
    try:
        message = json.loads(answer)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if 400 <= status < 500 and isinstance(message, str):
        return Outcome(
            "request", index, f"{route} {mutation}", "refused", f"{status} {message[:200]}", seconds
        )
    return Outcome(
        "request", index, f"{route} {mutation}", "failed", f"HTTP {status}: {answer[:200]!r}", seconds
    )


def serve(artifact: Path):
    """A live server on 127.0.0.1 (a port of its own) for the seed artifact: (port, stop)."""
    import uvicorn

    from slimlm.artifact import artifact_tokenizer
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.load import load_decoder
    from slimlm.inference.server import ServerLimits, create_app

    decoder = Decoder(load_decoder(artifact)[0], artifact_tokenizer(artifact))
    limits = ServerLimits(max_prompt_tokens=128, max_new_tokens=16, max_concurrent=4)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(create_app(decoder, "fuzz", limits), host="127.0.0.1", log_level="critical")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        listening.close()

    return listening.getsockname()[1], stop


def healthy(port: int) -> bool:
    try:
        return local_request(port, "GET", "/health", timeout=10)[0] == 200
    except OSError:
        return False


# --- the run --------------------------------------------------------------------------------


def summary_rows(outcomes: list[Outcome]) -> list[dict]:
    rows = []
    for surface in SURFACES:
        mine = [outcome for outcome in outcomes if outcome.surface == surface]
        if mine:
            counts = {
                result: sum(outcome.result == result for outcome in mine)
                for result in ("accepted", "refused", "failed")
            }
            rows.append(
                {
                    "name": surface,
                    "cases": len(mine),
                    **counts,
                    "max_case_s": round(max(outcome.seconds for outcome in mine), 2),
                }
            )
    return rows


def markdown(
    rows: list[dict], outcomes: list[Outcome], command: str, seconds: float, options: argparse.Namespace
) -> list[str]:
    lines = [
        "# Fuzz: seeded mutations of artifacts, GGUF files and server requests",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), "1 process per file case", seconds),
        (
            f"- seed {options.seed}; a case fails on a traceback, HTTP 5xx, no answer within "
            f"{options.timeout:g} s, or memory beyond {options.memory_gb:g} GB of address space"
        ),
        "",
        "| surface | cases | accepted | refused in one line | failed | slowest case s |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {row['name']} | {row['cases']} | {row['accepted']} | {row['refused']} | {row['failed']} | "
            f"{row['max_case_s']:.2f} |"
            for row in rows
        ),
        "",
    ]
    failures = [outcome for outcome in outcomes if outcome.result == "failed"]
    if failures:
        lines += [
            "## Failures",
            "",
            *(
                f"- {outcome.surface} #{outcome.case}: {outcome.mutation}: {outcome.detail}"
                for outcome in failures[:100]
            ),
            "",
        ]
    refusals: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.result == "refused":
            key = f"{outcome.surface}: {outcome.detail.split(':')[0][:80]}"
            refusals[key] = refusals.get(key, 0) + 1
    lines += [
        "## Most frequent refusals",
        "",
        *(f"- {count} x {key}" for key, count in sorted(refusals.items(), key=lambda item: -item[1])[:15]),
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=400, help="cases per surface")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take")
    parser.add_argument("--memory-gb", type=float, default=4.0, help="address space a file case may add")
    parser.add_argument("--surfaces", nargs="+", default=list(SURFACES), choices=SURFACES)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "runs" / "fuzz")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_CASES} cases per surface; results in --workdir only"
    )
    options = parser.parse_args()
    import torch

    torch.set_num_threads(
        1
    )  # before any parallel region: a forked child of a process with an OpenMP pool can hang in its first one
    cases = QUICK_CASES if options.quick else options.cases
    options.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    seeds = seed_files(options.workdir)
    warm_up(seeds, options.workdir)
    outcomes = []
    from tqdm import tqdm

    for surface in [s for s in options.surfaces if s in FILE_SURFACES]:
        outcomes += [
            file_outcome(surface, index, seeds, options)
            for index in tqdm(range(cases), desc=surface, unit="case")
        ]
    if "request" in options.surfaces:
        port, stop = serve(seeds[0])
        try:
            outcomes += [
                request_outcome(port, index, options)
                for index in tqdm(range(cases), desc="request", unit="case")
            ]
            if not healthy(port):
                outcomes.append(
                    Outcome(
                        "request",
                        cases,
                        "after every case",
                        "failed",
                        "the server no longer answers /health",
                        0.0,
                    )
                )
        finally:
            stop()
    rows = summary_rows(outcomes)
    command = command_line("fuzz.py", parser, options).replace(str(options.workdir), "<workdir>")
    lines = markdown(rows, outcomes, command, time.perf_counter() - started, options)
    record = {
        "rows": rows,
        "outcomes": [asdict(outcome) for outcome in outcomes if outcome.result == "failed"],
    }
    if options.quick:
        (options.workdir / "fuzz.json").write_text(json.dumps(record, indent=2))
        print("\n".join(lines))
    else:
        write_result("fuzz", command, record, lines)


if __name__ == "__main__":
    main()
