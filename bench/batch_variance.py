"""Batch variance: does a greedy answer depend on the requests decoded beside it?

The server decodes every admitted request together (continuous batching): a request's rows
go through the same matrix products as its neighbours', and a product over more rows may add
in another order (other kernel blocking, a decode step beside another request's prompt
chunk). Floating-point sums in another order differ in their last bits, so where the top two
next tokens are nearly tied a greedy answer can change. This measures how often, on real
prompts (WikiText-2 test), for the default model served two ways: its fp32 weights (float32
activations) and int4 g64 RTN (bfloat16 activations, what a quantized model decodes with on a
CPU by default).

For each, every prompt is answered greedily three ways by a ContinuousBatcher of 8 rows:
  alone        one request at a time (the reference)
  together     all prompts sent at once: they share passes, join and leave between steps
  beside sampled  all prompts sent at once with as many sampled requests (temperature 1)
Reports the prompts answered differently from alone, where the first difference came (token
index) and how close the alone answer's top two tokens were there (the log-probability lead
of its choice); and, more sensitive, over every step both runs took from the same tokens, how
many gave bitwise the same logits and the largest logit difference, and how many of the alone
run's steps had their two best logits closer than twice that (where a flip was possible). Writes
bench/results/batch_variance.{md,json} (--quick: the tiny test model, results in --workdir).

    python bench/batch_variance.py [--prompts 32 --prompt-tokens 32 --new-tokens 64 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from benchlib import REPO, command_line, machine_line, run_together, wikitext_ids, write_result
from decode_cpu import default_int4

from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.rundir import machine_info

ROWS = 8


@dataclass
class Difference:
    """One prompt whose batched answer is not its alone answer."""

    prompt: int
    token: int  # index of the first answer token that differs
    # the alone answer's log-probability lead over the runner-up at that token (NaN: the alone
    # answer had ended)
    margin: float


@dataclass
class Run:
    """Each prompt's greedy answer, and the logits each of its tokens was chosen from."""

    answers: list[list[int]]
    logits: dict[tuple[int, int], torch.Tensor]  # (prompt, answer token index) -> [vocab] float32


class RecordingBatcher(ContinuousBatcher):
    """A ContinuousBatcher that keeps the logits every greedy choice is made from (the
    measurement needs them; serving does not), keyed by prompt and answer position."""

    def __init__(self, decoder: Decoder, prompts: list[list[int]], max_seq: int):
        super().__init__(decoder, max_batch=ROWS, max_seq=max_seq)
        self.prompt_index = {tuple(ids): index for index, ids in enumerate(prompts)}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def _take(self, sequence, logits: torch.Tensor, guesses: list[int]) -> int:
        if sequence.params.temperature == 0:
            self.logits[self.prompt_index[tuple(sequence.ids)], len(sequence.tokens)] = (
                logits[0].float().clone()
            )
        return super()._take(sequence, logits, guesses)


def answers_alone(decoder: Decoder, prompts: list[list[int]], params: SamplingParams) -> Run:
    with RecordingBatcher(decoder, prompts, max(map(len, prompts)) + params.max_new_tokens) as batcher:
        answers = [list(consume(batcher.submit(ids, params)).token_ids) for ids in prompts]
    return Run(answers, batcher.logits)


def answers_together(decoder: Decoder, prompts: list[list[int]], params: SamplingParams, sampled: int) -> Run:
    """Every prompt sent at once, with `sampled` temperature-1 requests (on the same prompts,
    so they share cached prompt starts too) interleaved among them."""
    answers: dict[int, list[int]] = {}
    requests = [(index, ids, params) for index, ids in enumerate(prompts)]
    for extra in range(sampled):
        noisy = SamplingParams(
            max_new_tokens=params.max_new_tokens, temperature=1.0, seed=extra, ignore_eos=True
        )
        requests.insert(2 * extra + 1, (-1 - extra, prompts[extra % len(prompts)], noisy))
    with RecordingBatcher(decoder, prompts, max(map(len, prompts)) + params.max_new_tokens) as batcher:

        def client(index: int, ids: list[int], request: SamplingParams) -> None:
            answers[index] = list(consume(batcher.submit(ids, request)).token_ids)

        run_together(client, requests)
    return Run([answers[index] for index in range(len(prompts))], batcher.logits)


def consume(submission):
    """The Generation a submission ends with (the text pieces before it are skipped)."""
    for item in submission:
        last = item
    return last


def margin(logits: torch.Tensor, chosen: int) -> float:
    """log p(chosen) minus the best other token's log-probability."""
    logprobs = torch.log_softmax(logits, dim=-1)
    others = logprobs.clone()
    others[chosen] = -float("inf")
    return (logprobs[chosen] - others.max()).item()


def differences(alone: Run, batched: Run) -> list[Difference]:
    found = []
    for index, (reference, answer) in enumerate(zip(alone.answers, batched.answers)):
        if reference == answer:
            continue
        token = next(
            (i for i, (a, b) in enumerate(zip(reference, answer)) if a != b), min(len(reference), len(answer))
        )
        lead = (
            margin(alone.logits[index, token], reference[token]) if token < len(reference) else float("nan")
        )
        found.append(Difference(index, token, lead))
    return found


def logit_gaps(alone: Run, batched: Run) -> tuple[int, int, float]:
    """Over the steps both runs took from the same tokens (up to each answer's first
    difference): how many, how many gave bitwise the same logits, the largest |difference|."""
    compared = identical = 0
    largest = 0.0
    for index, (reference, answer) in enumerate(zip(alone.answers, batched.answers)):
        agree = next(
            (i for i, (a, b) in enumerate(zip(reference, answer)) if a != b), min(len(reference), len(answer))
        )
        for token in range(agree + 1):
            if (index, token) in alone.logits and (index, token) in batched.logits:
                gap = (alone.logits[index, token] - batched.logits[index, token]).abs().max().item()
                compared, identical, largest = compared + 1, identical + (gap == 0), max(largest, gap)
    return compared, identical, largest


def near_ties(alone: Run, within: float) -> int:
    """Steps of the alone run whose two best logits lie within `within` of each other: where a
    batched run's logits, off by up to `within / 2` each, could choose the other token."""
    return sum(
        int((top[0] - top[1]).item() <= within)
        for top in (logits.topk(2).values for logits in alone.logits.values())
    )


def scenario_row(model_name: str, scenario: str, alone: Run, batched: Run, new_tokens: int) -> dict:
    found = differences(alone, batched)
    margins = [d.margin for d in found if d.margin == d.margin]
    compared, identical, largest = logit_gaps(alone, batched)
    return {
        "name": f"{model_name} {scenario}",
        "prompts": len(alone.answers),
        "new_tokens": new_tokens,
        "answered_differently": len(found),
        "first_difference_tokens": sorted(d.token for d in found),
        "max_margin_at_difference": round(max(margins), 4) if margins else None,
        "margins_at_difference": [round(m, 4) for m in margins],
        "steps_compared": compared,
        "steps_bitwise_identical": identical,
        "max_abs_logit_difference": largest,
        "alone_steps": len(alone.logits),
        "alone_steps_within_twice_that": near_ties(alone, 2 * largest) if largest > 0 else 0,
    }


def measure(model_name: str, decoder: Decoder, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    params = SamplingParams(max_new_tokens=new_tokens)
    alone = answers_alone(decoder, prompts, params)
    rows = []
    for scenario, sampled in (("together", 0), ("beside sampled", len(prompts))):
        rows.append(
            scenario_row(
                model_name, scenario, alone, answers_together(decoder, prompts, params, sampled), new_tokens
            )
        )
        row = rows[-1]
        print(
            (
                f"{row['name']}: {row['answered_differently']} of {len(prompts)} answered differently; "
                f"{row['steps_bitwise_identical']} of {row['steps_compared']} steps' logits bitwise "
                f"identical, largest difference {row['max_abs_logit_difference']:.3g}"
            ),
            flush=True,
        )
    return rows


def real_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` WikiText-2 test tokens, spread over the text."""
    ids = wikitext_ids(tokenizer)
    stride = len(ids) // count
    return [ids[i * stride : i * stride + length].tolist() for i in range(count)]


def decoders(quick_dir: Path | None, threads: int) -> list[tuple[str, Decoder]]:
    """(name, decoder) for each way the model is served."""
    if quick_dir is not None:
        sys.path.insert(0, str(REPO))
        from tests.conftest import build_tiny_llama, build_tokenizer

        torch.manual_seed(0)
        tokenizer = build_tokenizer()
        model = build_tiny_llama(len(tokenizer), initializer_range=0.2).eval()
        return [("tiny fp32", Decoder(build_decoder(model, dtype=torch.float32), tokenizer))]
    int4, loaded = default_int4(threads)
    return [
        ("fp32", Decoder(build_decoder(loaded.model, dtype=torch.float32), loaded.tokenizer)),
        ("int4 g64 bf16", Decoder(build_decoder(int4, dtype=torch.bfloat16), loaded.tokenizer)),
    ]


def markdown(rows: list[dict], model: str, command: str, seconds: float, threads: int) -> list[str]:
    def firsts(row: dict) -> str:
        return ", ".join(map(str, row["first_difference_tokens"])) or "-"

    def lead(row: dict) -> str:
        return "-" if row["max_margin_at_difference"] is None else f"{row['max_margin_at_difference']:.4f}"

    return [
        "# Batch variance: greedy answers alone and batched",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), f"{threads} threads", seconds),
        (
            f"- {model}; {rows[0]['prompts']} WikiText-2 test prompts, {rows[0]['new_tokens']} greedy tokens "
            f"each; a ContinuousBatcher of {ROWS} rows"
        ),
        "",
        (
            "| model, batch | prompts answered differently | first differing token of each | largest margin "
            "there (log-prob) | steps with bitwise the same logits | largest logit difference | alone steps "
            "whose top two logits are closer than twice that |"
        ),
        "|---|---:|---|---:|---:|---:|---:|",
        *(
            f"| {r['name']} | {r['answered_differently']} of {r['prompts']} | {firsts(r)} | {lead(r)} | "
            f"{r['steps_bitwise_identical']} of {r['steps_compared']} | {r['max_abs_logit_difference']:.3g} "
            f"| {r['alone_steps_within_twice_that']} of {r['alone_steps']} |"
            for r in rows
        ),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO / "bench" / "runs" / "batch_variance")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, 4 prompts of 8 tokens; results in --workdir only",
    )
    options = parser.parse_args()
    if options.quick:
        options.prompts, options.prompt_tokens, options.new_tokens = 4, 8, 8
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    rows = []
    for name, decoder in decoders(options.workdir if options.quick else None, options.threads):
        prompts = real_prompts(decoder.tokenizer, options.prompts, options.prompt_tokens)
        rows.extend(measure(name, decoder, prompts, options.new_tokens))
    command = command_line("batch_variance.py", parser, options).replace(str(options.workdir), "<workdir>")
    lines = markdown(
        rows,
        "the tiny test model" if options.quick else "the default model",
        command,
        time.perf_counter() - started,
        options.threads,
    )
    if options.quick:
        options.workdir.mkdir(parents=True, exist_ok=True)
        (options.workdir / "batch_variance.json").write_text(json.dumps({"rows": rows}, indent=2))
        print("\n".join(lines))
    else:
        write_result("batch_variance", command, {"rows": rows}, lines)


if __name__ == "__main__":
    main()
