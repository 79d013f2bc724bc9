"""Prefix reuse on CPU: a chat's next turn prefills only what the cache does not hold yet.

The default model at int4 g64 (RTN, head too; bundled decoder, bf16 activations, eager), with
its chat template: a system prompt, then turns whose user message is a passage of WikiText-2
test (about 150 tokens) and a request, each answered with 64 greedy tokens. Each turn's prompt is
the whole conversation so far, as `slimlm chat` and OpenAI clients send it.
  one at a time   one conversation through Decoder.generate_ids (`slimlm chat`; `slimlm serve`
                  without a batcher)
  batched         four conversations at once through a ContinuousBatcher of 4 rows (`slimlm serve`)
  more conversations than rows
                  eight conversations at once through a ContinuousBatcher decoding four at a
                  time, its cache of four rows (`slimlm serve --max-concurrent 4`) or eight
                  (`--cache-rows 8`): with four, a row is usually given to another conversation
                  before its own next turn arrives
  shared system   eight requests sent at once to a ContinuousBatcher of 8 rows, each a question
                  after the same system prompt of about 500 tokens (a reference passage)
each with prefix reuse (the default) and without (`reuse_prefixes=False`). Reports per turn the
prompt's tokens, those found in the cache, the time to the first token, and whether the answer
is the one decoded without reuse; for the shared system prompt, the times to the first token
and to the last answer; and how far the second turn's first logits are from those of a whole
prefill, with fp32 and with bf16 activations. Writes
bench/results/prefix_reuse_cpu.{md,json,png}; --quick (the tiny test model, a test) only prints.

    python bench/prefix_reuse_cpu.py [--turns 6 --threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch
from benchlib import RESULTS, bench_int4, command_line, eval_ids, machine_line, publish, run_together

from slimlm.eval.plots import plt, save_figure
from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder, Generation
from slimlm.inference.sampling import SamplingParams
from slimlm.rundir import machine_info

SYSTEM = (
    "You are a careful assistant. Answer in plain English, briefly, and say so when a passage does not tell "
    "you something."
)
SHARED_REQUESTS = 8
REFERENCE_TOKENS = 450
PARAMS = SamplingParams(max_new_tokens=64, ignore_eos=True)
PASSAGE_TOKENS = 150
CONVERSATIONS = 4  # batched
CROWD, CROWD_TURNS = (
    8,
    4,
)  # more conversations than rows: conversations, turns each (decoding CONVERSATIONS at a time)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt's token ids for `messages` under the tokenizer's chat template, as `slimlm chat`
    and the server make them."""
    return tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]


class Chat:
    """One conversation: the messages so far, and each turn's measurements."""

    def __init__(self, tokenizer, passages: list[str]):
        self.tokenizer, self.passages = tokenizer, passages
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.turns: list[dict] = []

    def next_prompt(self) -> list[int]:
        passage = self.passages[len(self.turns)]
        self.messages.append(
            {
                "role": "user",
                "content": (
                    f"{passage}\n\nWhat is this passage about, and how does it relate to the earlier ones?"
                ),
            }
        )
        return chat_ids(self.tokenizer, self.messages)

    def answered(self, ids: list[int], generation: Generation, first_s: float) -> None:
        self.messages.append({"role": "assistant", "content": generation.text})
        self.turns.append(
            {
                "prompt_tokens": len(ids),
                "cached_tokens": generation.cached_tokens,
                "first_token_ms": 1000 * first_s,
                "answer": generation.token_ids,
            }
        )


def passages(tokenizer, count: int, quick: bool) -> list[str]:
    ids = eval_ids(tokenizer, quick)
    return [
        tokenizer.decode(ids[PASSAGE_TOKENS * i : PASSAGE_TOKENS * (i + 1)]).strip() for i in range(count)
    ]


def one_at_a_time(model, tokenizer, texts: list[str], reuse: bool) -> list[dict]:
    decoder = Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer, reuse_prefixes=reuse)
    decoder.generate_ids(
        [tokenizer("warm up")["input_ids"]], SamplingParams(max_new_tokens=4)
    )  # shares no start with the chat's prompts
    chat = Chat(tokenizer, texts)
    for _ in texts:
        ids = chat.next_prompt()
        generation = decoder.generate_ids([ids], PARAMS)[0]
        chat.answered(ids, generation, decoder.last_stats.prefill_s)
        print(
            (
                f"one at a time, reuse {reuse}: turn {len(chat.turns)}: {len(ids)} prompt tokens, "
                f"{generation.cached_tokens} cached, first token {chat.turns[-1]['first_token_ms']:.0f} ms"
            ),
            flush=True,
        )
    return chat.turns


def batched(
    model,
    tokenizer,
    texts: list[list[str]],
    reuse: bool,
    max_batch: Optional[int] = None,
    cache_rows: Optional[int] = None,
) -> list[list[dict]]:
    """Each conversation in `texts` sends its turns one after the other, all conversations at
    once, through a batcher decoding `max_batch` (default: all) at a time."""
    decoder = Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer, reuse_prefixes=reuse)
    batcher = ContinuousBatcher(
        decoder, max_batch=max_batch or len(texts), max_seq=2048, cache_rows=cache_rows
    )
    chats = [Chat(tokenizer, own) for own in texts]

    def converse(chat: Chat) -> None:
        for _ in chat.passages:
            ids = chat.next_prompt()
            sent = time.perf_counter()
            items = iter(batcher.submit(ids, PARAMS))
            first = next(items)
            first_s = time.perf_counter() - sent
            *_, generation = [first, *items]
            chat.answered(ids, generation, first_s)

    run_together(converse, [(chat,) for chat in chats])
    batcher.close()
    for turn in range(len(texts[0])):
        print(
            (
                f"batched, reuse {reuse}, {batcher.max_batch} at a time, {decoder.model.max_batch} rows: "
                f"turn {turn + 1}: first token "
                f"{statistics.median(c.turns[turn]['first_token_ms'] for c in chats):.0f} ms median"
            ),
            flush=True,
        )
    return [chat.turns for chat in chats]


@torch.inference_mode()
def logit_gap(model, tokenizer, texts: list[str], dtype: torch.dtype) -> dict:
    """The second turn's next-token logits with the first turn's tokens taken from the cache, and
    with the whole prompt prefilled: the largest difference, and the largest logit for scale."""
    reusing = Decoder(build_decoder(model, dtype=dtype), tokenizer)
    whole = Decoder(build_decoder(model, dtype=dtype), tokenizer, reuse_prefixes=False)
    chat = Chat(tokenizer, texts[:2])
    ids = chat.next_prompt()
    chat.answered(ids, reusing.generate_ids([ids], PARAMS)[0], 0.0)
    ids = chat.next_prompt()
    for decoder in (reusing, whole):
        decoder.ensure_cache(1, len(ids))
    cached = reusing.reusable(0, ids)
    reused = reusing.prefill(torch.tensor([ids[cached:]]), cached).float()
    prefilled = whole.prefill(torch.tensor([ids])).float()
    return {
        "activations": str(dtype).removeprefix("torch."),
        "cached_tokens": cached,
        "max_logit_difference": float((reused - prefilled).abs().max()),
        "max_logit": float(prefilled.abs().max()),
        "same_argmax": bool(reused.argmax() == prefilled.argmax()),
    }


def shared_system(model, tokenizer, reference: str, questions: list[str], reuse: bool) -> dict:
    """`questions` sent at once, each after the same system prompt holding `reference`: ms from
    sending to each request's first piece, and to the last answer."""
    system = {"role": "system", "content": f"{SYSTEM}\n\nReference:\n{reference}"}
    prompts = [
        chat_ids(
            tokenizer,
            [system, {"role": "user", "content": f"Does the reference say anything about this? {question}"}],
        )
        for question in questions
    ]
    batcher = ContinuousBatcher(
        Decoder(build_decoder(model, dtype=torch.bfloat16), tokenizer, reuse_prefixes=reuse),
        max_batch=len(prompts),
        max_seq=max(map(len, prompts)) + 32,
    )
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    firsts, cached = [0.0] * len(prompts), [0] * len(prompts)
    begin = time.perf_counter()

    def client(index: int) -> None:
        items = iter(batcher.submit(prompts[index], params))
        next(items)
        firsts[index] = 1000 * (time.perf_counter() - begin)
        *_, generation = items
        cached[index] = generation.cached_tokens

    run_together(client, [(index,) for index in range(len(prompts))])
    seconds = time.perf_counter() - begin
    batcher.close()
    row = {
        "name": f"shared system prompt, {len(prompts)} requests, reuse {'on' if reuse else 'off'}",
        "prompt_tokens": statistics.median(map(len, prompts)),
        "cached_tokens": statistics.median(cached),
        "first_token_ms": statistics.median(firsts),
        "first_token_max_ms": max(firsts),
        "seconds": seconds,
    }
    print(
        (
            f"{row['name']}: first piece {row['first_token_ms']:.0f} ms median, "
            f"{row['first_token_max_ms']:.0f} ms longest, all answers in {seconds:.1f} s"
        ),
        flush=True,
    )
    return row


def table_row(name: str, turn: int, reused: list[dict], fresh: list[dict]) -> dict:
    """Turn `turn` of one or more conversations, with and without reuse (medians over conversations)."""

    def median(turns: list[dict], key: str) -> float:
        return statistics.median(t[key] for t in turns)

    return {
        "name": f"{name}, turn {turn}",
        "prompt_tokens": median(reused, "prompt_tokens"),
        "cached_tokens": median(reused, "cached_tokens"),
        "first_token_ms": median(reused, "first_token_ms"),
        "first_token_ms_without_reuse": median(fresh, "first_token_ms"),
        "same_answers": sum(r["answer"] == f["answer"] for r, f in zip(reused, fresh)),
        "conversations": len(reused),
    }


def crowd_row(turn: int, chats: list[list[dict]], rows: int) -> dict:
    """Turn `turn` (1-based) of the more-conversations-than-rows run with `rows` cache rows
    (medians over conversations)."""
    turns = [chat[turn - 1] for chat in chats]
    return {
        "name": f"{len(chats)} conversations, {CONVERSATIONS} at a time, {rows} cache rows, turn {turn}",
        "cache_rows": rows,
        **{
            key: statistics.median(t[key] for t in turns)
            for key in ("prompt_tokens", "cached_tokens", "first_token_ms")
        },
    }


def write_plot(rows: list[dict]) -> None:
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for axis, name in zip(axes, ("one at a time", "batched")):
        mine = [row for row in rows if row["name"].startswith(name)]
        turns = range(1, len(mine) + 1)
        axis.plot(
            turns,
            [row["first_token_ms_without_reuse"] for row in mine],
            "o-",
            color="tab:gray",
            label="whole prompt prefilled",
        )
        axis.plot(
            turns, [row["first_token_ms"] for row in mine], "o-", color="tab:blue", label="prefix reused"
        )
        axis.set_title(
            f"{name} ({mine[0]['conversations']} conversation{'s' if mine[0]['conversations'] > 1 else ''})"
        )
        axis.set_xlabel("turn")
        axis.set_xticks(list(turns))
    axes[0].set_ylabel("ms to the first token (median)")
    axes[0].legend()
    figure.suptitle("A chat's next turn, default model int4 on 2 CPU cores")
    save_figure(figure, RESULTS / "prefix_reuse_cpu.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny random-weight model, 2 turns; results only printed (tests)",
    )
    options = parser.parse_args()
    if options.quick:
        options.turns = 2
    started = time.perf_counter()
    model, loaded = bench_int4(options.threads, options.quick)
    tokenizer = loaded.tokenizer
    texts = passages(
        tokenizer,
        options.turns * (CONVERSATIONS + 1) + SHARED_REQUESTS + REFERENCE_TOKENS // PASSAGE_TOKENS + 1,
        options.quick,
    )
    own = [texts[options.turns * i : options.turns * (i + 1)] for i in range(CONVERSATIONS + 1)]
    gaps = [
        logit_gap(loaded.model, tokenizer, own[0], torch.float32),
        logit_gap(model, tokenizer, own[0], torch.bfloat16),
    ]
    alone = {reuse: one_at_a_time(model, tokenizer, own[0], reuse) for reuse in (False, True)}
    together = {reuse: batched(model, tokenizer, own[1:], reuse) for reuse in (False, True)}
    rows = [
        table_row("one at a time", turn + 1, [alone[True][turn]], [alone[False][turn]])
        for turn in range(options.turns)
    ]
    rows += [
        table_row("batched", turn + 1, [c[turn] for c in together[True]], [c[turn] for c in together[False]])
        for turn in range(options.turns)
    ]
    spare = texts[options.turns * (CONVERSATIONS + 1) :]
    reference = " ".join(spare[SHARED_REQUESTS:])
    reference = tokenizer.decode(
        tokenizer(reference, add_special_tokens=False)["input_ids"][:REFERENCE_TOKENS]
    )
    questions = [
        tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:24])
        for text in spare[:SHARED_REQUESTS]
    ]
    shared = [shared_system(model, tokenizer, reference, questions, reuse) for reuse in (False, True)]
    crowd_texts = passages(tokenizer, len(texts) + CROWD * CROWD_TURNS, options.quick)[len(texts) :]
    crowd_texts = [crowd_texts[CROWD_TURNS * i : CROWD_TURNS * (i + 1)] for i in range(CROWD)]
    crowd, crowd_s = [], {}
    for cache_rows in (CONVERSATIONS, CROWD):
        begin = time.perf_counter()
        chats = batched(model, tokenizer, crowd_texts, True, max_batch=CONVERSATIONS, cache_rows=cache_rows)
        crowd_s[cache_rows] = time.perf_counter() - begin
        crowd += [crowd_row(turn + 1, chats, cache_rows) for turn in range(CROWD_TURNS)]
    summary = {
        "crowd_seconds": {f"{count}_rows": seconds for count, seconds in crowd_s.items()},
        "turns": options.turns,
        "conversations_batched": CONVERSATIONS,
        "shared_system_requests": SHARED_REQUESTS,
        "new_tokens": PARAMS.max_new_tokens,
        "threads": options.threads,
        "seconds": time.perf_counter() - started,
    }
    command = command_line("prefix_reuse_cpu.py", parser, options)
    machine = machine_info()
    lines = [
        "# prefix_reuse_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{options.threads} threads", summary["seconds"]),
        "- default model, int4 g64 RTN (head too), bundled decoder, bf16 activations, eager; its chat "
        f"template with a system prompt; each turn adds a user message ({PASSAGE_TOKENS} tokens of "
        f"WikiText-2 test and a request) and a {PARAMS.max_new_tokens}-token greedy answer; the prompt is "
        "the whole conversation so far",
        "- one at a time: one conversation through `Decoder.generate_ids` (`slimlm chat`); batched: "
        f"{CONVERSATIONS} conversations at once through a `ContinuousBatcher` of {CONVERSATIONS} rows "
        "(`slimlm serve`), medians over the conversations",
        (
            "- time to the first token: the prefill (one at a time); from submitting to the first text piece "
            "(batched: the other conversations' work included)"
        ),
        "",
        (
            "| run | prompt tokens | found in the cache | ms to the first token: reused | whole prompt | "
            "speed-up | same answer as without reuse |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
            f"{r['first_token_ms']:.0f} | {r['first_token_ms_without_reuse']:.0f} | "
            f"{r['first_token_ms_without_reuse'] / r['first_token_ms']:.1f}x | {r['same_answers']} of "
            f"{r['conversations']} |"
            for r in rows
        ],
        "",
        "![prefix_reuse_cpu](prefix_reuse_cpu.png)",
        "",
    ]
    if not options.quick:
        write_plot(rows)
    lines[-2:-2] = [  # before the plot
        (
            f"{SHARED_REQUESTS} requests sent at once, each a question after the same system prompt (a "
            f"reference passage of {REFERENCE_TOKENS} tokens), 32 new tokens each, {SHARED_REQUESTS} rows:"
        ),
        "",
        (
            "| run | prompt tokens | found in the cache or copied | ms to the first piece: median | longest "
            "| s to the last answer |"
        ),
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
            f"{r['first_token_ms']:.0f} | {r['first_token_max_ms']:.0f} | {r['seconds']:.1f} |"
            for r in shared
        ],
        "",
        f"{CROWD} conversations at once, {CROWD_TURNS} turns each (as above), through a batcher decoding "
        f"{CONVERSATIONS} at a time (`slimlm serve --max-concurrent {CONVERSATIONS}`), its cache of "
        f"{CONVERSATIONS} rows (the default) or {CROWD} (`--cache-rows {CROWD}`); all {CROWD * CROWD_TURNS} "
        f"answers took {crowd_s[CONVERSATIONS]:.0f} s and {crowd_s[CROWD]:.0f} s:",
        "",
        (
            "| run | prompt tokens | found in the cache or copied | ms from sending to the first piece "
            "(waiting for a free row included) |"
        ),
        "|---|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
            f"{r['first_token_ms']:.0f} |"
            for r in crowd
        ],
        "",
        (
            "The second turn's first next-token logits, the first turn taken from the cache against the "
            "whole prompt prefilled (unquantized model in fp32; int4 in bf16):"
        ),
        "",
        "| activations | tokens from the cache | largest logit difference | largest logit | same top token |",
        "|---|---:|---:|---:|---|",
        *[
            f"| {g['activations']} | {g['cached_tokens']} | {g['max_logit_difference']:.2g} | "
            f"{g['max_logit']:.1f} | {'yes' if g['same_argmax'] else 'no'} |"
            for g in gaps
        ],
        "",
    ]
    publish(
        "prefix_reuse_cpu",
        command,
        {"summary": summary, "rows": rows + shared + crowd, "logit_gaps": gaps},
        lines,
        options.quick,
    )


if __name__ == "__main__":
    main()
