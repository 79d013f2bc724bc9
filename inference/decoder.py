"""Generation with the bundled decoder: prefill in chunks, then one token per step from a
static cache, for one prompt or a batch of prompts of different lengths. A prompt that starts
with what a cache row already holds (the last conversation turn, a shared system prompt)
prefills only the rest (`Decoder.reusable`).

    decoder = Decoder(build_decoder(model), tokenizer)
    for piece in decoder.stream("Once upon a time", SamplingParams(max_new_tokens=64)): print(piece, end="")
"""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import threading
import time
import types
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from slimlm.errors import SlimlmError
from slimlm.inference.model import RowRecord, Transformer
from slimlm.inference.sampling import SamplingParams, next_tokens, sampling_state

TokenCallback = Callable[[int, int], None]  # (row, token id), called as each token is chosen


@dataclass
class Generation:
    token_ids: list[int]  # new tokens, stop string or token excluded
    text: str
    finish_reason: str  # "stop" (end-of-sequence, stop token or string) or "length"
    prompt_tokens: int
    cached_tokens: int = 0  # of the prompt's, found in the cache and not prefilled again


@dataclass
class GenerationStats:
    prefill_s: float
    decode_s: float
    decode_steps: int
    batch: int

    @property
    def decode_tok_s(self) -> float:
        """New tokens per second over all rows after the first (which the prefill produced)."""
        return (
            self.batch * (self.decode_steps - 1) / self.decode_s
            if self.decode_s > 0 and self.decode_steps > 1
            else float("nan")
        )


def shared_start(held: Sequence[int], ids: Sequence[int]) -> int:
    """How many of the prompt `ids`' first tokens `held` starts with, at most all but the last:
    a prefill of at least one token gives the next token's logits."""
    same, limit = 0, min(len(held), len(ids) - 1)
    while same < limit and held[same] == ids[same]:
        same += 1
    return same


FIRST_LAYER = "_modules['layers']._modules['0']."  # in the guard names of the first block's attributes


def cache_and_input_guards(entries: Sequence) -> list[bool]:
    """Which of Dynamo's guards the compiled step checks before each call. By default it checks
    every parameter, buffer and attribute of the model's modules: about a millisecond per step
    for this model's hundreds of tensors, a sixth of a small model's decode step. A decoder's
    weights never change once built (and each decoder compiles its own copy of the step, so no
    other model can match these guards); its cache is replaced when it grows, every layer's at
    once with one shape and dtype (`Transformer.setup_cache`), so the first layer's cache
    stands for all of them (for a 30-layer model, 116 checks a step fewer). So: the
    inputs' guards and the first layer's cache's, not the weights'."""
    return [
        not entry.orig_guard.source.is_unspecialized_nn_module()
        or ("_cache" in entry.name and FIRST_LAYER in entry.name)
        for entry in entries
    ]


def private_method(model: torch.nn.Module, function: Callable) -> Callable:
    """`function` bound to `model` through a private copy of its code: Dynamo keeps compiled
    graphs (and their pruned guards) per code object, so this decoder's never serve, or are
    evicted by, another model's."""
    private = types.FunctionType(
        function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__
    )
    return types.MethodType(private, model)


# The CPU step's Inductor options. A C++ wrapper calls the kernels (no Python between them).
# 256-bit vectors: see compile_decode_step. No size or alignment asserts: at every step the
# wrapper checked each of its ~500 inputs (weights that never change once built; the cache and
# the tokens, which Dynamo's guards check) and each kernel's output (the fake kernels' shapes,
# which tests check with torch.library.opcheck): 5-9% of the default model's int4 step.
CPU_STEP_OPTIONS = {
    "cpp_wrapper": True,
    "cpp.simdlen": 256,
    "size_asserts": False,
    "alignment_asserts": False,
}

SLOT_SOURCE = re.escape("L['start']")  # entries are matched as regular expressions too


@contextlib.contextmanager
def slot_is_dynamic() -> Iterator[None]:
    """Dynamo traces `Transformer.forward`'s `start` as a symbolic int. Set around each call,
    not for the process: the setting names a local variable, which other compiled code may share."""
    config = torch.compiler.config
    before = config.dynamic_sources
    config.dynamic_sources = ",".join(
        filter(None, (before, SLOT_SOURCE))
    )  # a plain attribute set: a fifth of config.patch's cost a step
    try:
        yield
    finally:
        config.dynamic_sources = before


class Decoder:
    def __init__(
        self,
        model: Transformer,
        tokenizer,
        prefill_chunk: int = 512,
        cache_dtype: Optional[torch.dtype] = None,
        reuse_prefixes: bool = True,
    ):
        """`reuse_prefixes=False`: every prompt prefilled whole (e.g. to time prefills)."""
        self.model = model
        self.tokenizer = tokenizer
        self.prefill_chunk = prefill_chunk
        self.cache_dtype = cache_dtype
        self.reuse_prefixes = reuse_prefixes
        self.device = model.device
        self.last_stats: Optional[GenerationStats] = None
        self.step = model  # the decode step; compile_decode_step swaps in a compiled one
        self.lock = threading.Lock()  # one generation at a time owns the cache

    @functools.cached_property
    def silent_ids(self) -> frozenset[int]:
        """What streamed text leaves out (IncrementalText); computed when text is first streamed."""
        return silent_tokens(self.tokenizer)

    def compile_decode_step(self, static: Optional[bool] = None) -> None:
        """torch.compile the one-token decode step: the norms, RoPE and attention of each layer
        become a few fused kernels, run without Python in between (the overhead that dominates a
        small model's step). The first steps compile (a minute or two); the prefill stays eager.

        On a GPU the step is `Transformer.step_static` (every shape fixed, the slot a tensor)
        captured in a CUDA graph (mode "reduce-overhead"): one launch replays all of a step's
        kernels. On a CPU a C++ wrapper calls the kernels, compiled once for any slot: the slot
        argument alone is marked dynamic (`dynamic_sources`). Left to Dynamo's automatic dynamic
        shapes, the first step compiled for its own slot and the second for any slot, the same
        graph compiled twice (the default model: 330-351 s against 217 s for one compile, the same
        ms a step); `dynamic=True` would also turn every float attribute (the norms' epsilons)
        into a tensor argument of the graph, 8% slower per step. `static` picks the fixed-shape
        step on a CPU too (tests).

        The CPU kernels are generated for 256-bit vectors: on AVX-512 processors torch 2.13's
        Inductor tiled the attention's loops by 8 but stored full 16-float vectors, writing past
        the end of the scores and output buffers and corrupting the heap (the process aborted on
        the first compiled step of the default model). The matmuls are torch's or slimlm's own
        kernels, whatever their width, so little is lost."""
        if self.model.streamer is not None:
            raise SlimlmError(
                "this decoder streams layers from host memory, which runs eagerly (its copies and waits "
                "are not a compilable graph); compile one that fits the device"
            )
        options = {"guard_filter_fn": cache_and_input_guards}
        on_gpu = self.device.type == "cuda"
        if not (on_gpu if static is None else static):
            compiled_cpu = torch.compile(
                private_method(self.model, Transformer.forward),
                fullgraph=True,
                options={**options, **CPU_STEP_OPTIONS},
            )

            def cpu_step(
                tokens: torch.Tensor, start: int, pad: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
                with slot_is_dynamic():  # read when Dynamo (re)compiles, which happens inside a call
                    return compiled_cpu(tokens, start, pad)

            self.step = cpu_step
            return
        # triton.cudagraphs is what mode="reduce-overhead" sets (torch.compile takes a mode or options,
        # not both)
        compiled = torch.compile(
            private_method(self.model, Transformer.step_static),
            fullgraph=True,
            options={**options, "triton.cudagraphs": on_gpu},
        )
        slot = torch.zeros(1, dtype=torch.long, device=self.device)

        def step(tokens: torch.Tensor, start: int, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
            slot.fill_(start)  # a kernel argument: no host-to-device copy, no synchronization
            return compiled(tokens, slot, pad)

        self.step = step

    def warm_up_step(self) -> float:
        """Run the decode step on the cache as it is sized now and return the seconds it took: a
        compiled step compiles in its first calls (or loads Inductor's cached kernels), which
        would otherwise count as the first answer's decoding time. It writes the last slot but
        one of row 0, past what the row holds (a generation writes a slot before it reads it), so
        a held conversation stays reusable. Not the last slot: there the cache's one-slot slice
        ends at the end of its dimension, a case Dynamo specializes, and the next step at any
        other slot would compile again. Two calls: a GPU step's CUDA graph is recorded on the
        call after its warm-up."""
        if self.model.max_seq == 0:
            raise SlimlmError("the decode step runs on the cache: size it first (ensure_cache)")
        slot = max(self.model.max_seq - 2, 0)
        record = self.model.held.get(0)
        if record is not None and len(record.tokens) > slot:
            self.model.held.pop(0)
        started = time.perf_counter()
        with self.lock, torch.inference_mode():
            # made in inference mode, as generation's tokens are: another kind would compile again
            token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            for _ in range(2):
                self.step(token, slot)
        return time.perf_counter() - started

    def end_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if eos is not None and not params.ignore_eos:
            ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
        return ids

    def ensure_cache(self, batch: int, length: int) -> None:
        """Allocate the static cache when none is big enough; otherwise reuse it as it is."""
        if batch > self.model.max_batch or length > self.model.max_seq:
            self.model.setup_cache(batch, length, self.cache_dtype, keep=self.reuse_prefixes)

    def reusable(self, row: int, ids: Sequence[int]) -> int:
        """How many of the prompt `ids`' first tokens cache row `row` holds already, in their
        slots: their keys and values need not be computed again (`shared_start`).

        What a row holds (`Transformer.held`) is recorded when a generation ends in it (its
        prompt and the tokens fed back while decoding) and forgotten when a prefill writes it
        or a new cache replaces it (one that grows carries the records over). Every writer of
        the cache forgets the rows it writes first (`prefill`, before a generation's decode
        steps and speculative decoding's verification; the batcher's `forward_segments` and
        `copy_slots`), so a record is never stale."""
        record = self.model.held.get(row)
        return shared_start(record.tokens, ids) if self.reuse_prefixes and record is not None else 0

    def remember(self, row: int, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Record a finished generation's tokens as row `row`'s contents: the prompt, and the
        answer but its last token (chosen and never fed back when the answer ran to its length
        or a stop string; fed back before an end token was chosen, and left out all the same)."""
        self.model.held[row] = RowRecord([*prompt, *answer[:-1]], len(prompt))

    def prefill(
        self, tokens: torch.Tensor, start: int = 0, pad: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Write `tokens` [batch, length] into the cache rows from 0, from slot `start`,
        `prefill_chunk` tokens at a time to bound activation memory; the logits [batch, vocab]
        after the last token."""
        for row in range(tokens.shape[0]):
            self.model.held.pop(
                row, None
            )  # overwritten from `start` on: known again when its generation ends
        for offset in range(0, tokens.shape[1], self.prefill_chunk):
            logits = self.model(
                tokens[:, offset : offset + self.prefill_chunk], start + offset, pad, last_only=True
            )[:, -1]
        return logits

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        on_token: Optional[TokenCallback] = None,
    ) -> list[Generation]:
        """Complete each prompt (token ids); `on_token` sees each token as it is chosen."""
        with self.lock, torch.inference_mode():
            return self._generate(prompts, params, on_token)

    def check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Refuse prompts this decoder cannot complete (before any work, e.g. before a stream starts)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise SlimlmError("every prompt needs at least one token")
        longest, limit = max(len(p) for p in prompts), self.model.args.max_position_embeddings
        if longest + params.max_new_tokens > limit:
            raise SlimlmError(
                f"a prompt of {longest} tokens plus {params.max_new_tokens} new tokens exceeds the model's "
                f"context of {limit}; shorten the prompt or ask for fewer tokens"
            )

    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, on_token: Optional[TokenCallback]
    ) -> list[Generation]:
        self.check_prompts(prompts, params)
        batch, longest = len(prompts), max(len(p) for p in prompts)
        self.ensure_cache(batch, longest + params.max_new_tokens)
        cached = self.reusable(0, prompts[0]) if batch == 1 else 0
        pads = [longest - len(p) for p in prompts]
        pad = torch.tensor(pads, device=self.device) if any(pads) else None
        tokens = torch.zeros(batch, longest, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            tokens[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        seen, generator = sampling_state(prompts, params, self.model.args.vocab_size, self.device)
        started = time.perf_counter()
        logits = self.prefill(tokens[:, cached:], cached, pad)
        prefilled = time.perf_counter()
        end_ids = self.end_ids(params)
        outputs: list[list[int]] = [[] for _ in prompts]
        finished = [None] * batch
        steps = 0
        try:
            for step in range(params.max_new_tokens):
                chosen = next_tokens(logits, params, seen, generator)
                if params.repetition_penalty != 1.0:  # the only reader of `seen`
                    seen[torch.arange(batch), chosen] = True
                for row, token in enumerate(chosen.tolist()):
                    if finished[row] is not None:
                        continue
                    if token in end_ids:
                        finished[row] = "stop"
                        continue
                    outputs[row].append(token)
                    if on_token is not None:
                        on_token(row, token)
                    if params.stop and self._hits_stop_string(outputs[row], params.stop):
                        finished[row] = "stop"
                steps = step + 1
                if all(f is not None for f in finished) or step + 1 == params.max_new_tokens:
                    break
                logits = self.step(chosen[:, None], longest + step, pad)[:, -1]
        finally:
            # stopped early too (its client gone): the row keeps what was fed back, for a next turn
            # that continues it
            if batch == 1:
                self.remember(0, prompts[0], outputs[0])
        self.last_stats = GenerationStats(
            prefill_s=prefilled - started,
            decode_s=time.perf_counter() - prefilled,
            decode_steps=steps,
            batch=batch,
        )
        return [
            self._finish(ids, params, finished[row], len(prompts[row]), cached)
            for row, ids in enumerate(outputs)
        ]

    def _hits_stop_string(self, ids: list[int], stops: Sequence[str]) -> bool:
        tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=True)
        return any(stop in tail for stop in stops)

    def _finish(
        self,
        ids: list[int],
        params: SamplingParams,
        reason: Optional[str],
        prompt_tokens: int,
        cached_tokens: int = 0,
    ) -> Generation:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in params.stop:
            if stop in text:
                text = text[: text.index(stop)]
                reason = "stop"
        return Generation(
            token_ids=ids,
            text=text,
            finish_reason=reason or "length",
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )

    def generate(
        self, prompts: Sequence[str], params: SamplingParams, chat_template: bool = False
    ) -> list[Generation]:
        from slimlm.inference.generate import prompt_ids

        return self.generate_ids(
            [prompt_ids(self.tokenizer, p, chat_template)[0].tolist() for p in prompts], params
        )

    def stream(
        self,
        prompt: str,
        params: SamplingParams,
        chat_template: bool = False,
        results: Optional[list[Generation]] = None,
    ) -> Iterator[str]:
        """Text pieces of one prompt's completion as they are decoded (see stream_ids)."""
        from slimlm.inference.generate import prompt_ids

        return self.stream_ids(prompt_ids(self.tokenizer, prompt, chat_template)[0].tolist(), params, results)

    def stream_ids(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        results: Optional[list[Generation]] = None,
        cancel: Optional[threading.Event] = None,
        decode: Optional[Callable[[TokenCallback], Generation]] = None,
    ) -> Iterator[str]:
        """Text pieces of the completion of prompt `ids`, handed out as they are decoded; its
        Generation (why it ended, its tokens) goes to `results` when given, before the last piece
        is handed out (none when the reader stops early, or sees a stop string before the
        decoding does). Setting
        `cancel` (from any thread: the reader may be blocked waiting for a piece) stops the
        decoding at its next token and ends the pieces. `decode`: the generation of `ids` to
        run, handed the token callback (default: this decoder's own; e.g. speculative decoding).

        Runs the decode loop in a worker thread and passes each piece over a queue, so the caller
        gets text while later tokens are still being computed; text that could be the start of
        a stop string is held back until it is clear. On a CPU a worker thread decodes slower
        than the thread that loaded the model (see write_ids), which callers that only print
        should use instead."""
        pieces: "queue.Queue[Optional[object]]" = queue.Queue()
        cancel = cancel or threading.Event()
        worker = threading.Thread(
            target=self._decode_pieces, args=(ids, params, pieces, results, cancel, decode), daemon=True
        )
        worker.start()
        try:
            yield from until_stop(_raising(pieces), params.stop)
        finally:  # the reader stopped (done, stop string, or abandoned): end the worker before returning
            cancel.set()
            worker.join()

    def write_ids(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        write: Callable[[str], None],
        results: Optional[list[Generation]] = None,
        decode: Optional[Callable[[TokenCallback], Generation]] = None,
    ) -> None:
        """stream_ids' pieces handed to `write` (e.g. printed), the decoding in the calling thread
        and the writing in a helper thread. Decoding in a thread other than the one whose
        parallel regions started torch's OpenMP threads is about half as fast on a 2-core CPU
        (1.5B model, int4, int8 activations: 13-15 tokens/s against 24-26 compiled, 12-13 against
        16-18 eager): libgomp counts both threads' teams against the cores and then stops
        spinning between parallel regions, so every region wakes its threads from sleep. An error
        of the decoding or of `write` is raised here; a failed `write` stops the decoding."""
        pieces: "queue.Queue[Optional[object]]" = queue.Queue()
        cancel = threading.Event()
        failed: list[BaseException] = []

        def writer() -> None:
            try:
                for piece in until_stop(_raising(pieces), params.stop):
                    write(piece)
            except BaseException as error:  # raised in the calling thread below
                failed.append(error)
            finally:  # a stop string seen, or `write` failed: the decoding stops at its next token
                cancel.set()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        self._decode_pieces(ids, params, pieces, results, cancel, decode)
        thread.join()
        if failed:
            raise failed[0]

    def _decode_pieces(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        pieces: "queue.Queue[Optional[object]]",
        results: Optional[list[Generation]],
        cancel: threading.Event,
        decode: Optional[Callable[[TokenCallback], Generation]],
    ) -> None:
        """The decoding behind stream_ids and write_ids: the text pieces into `pieces`, then None
        (or the error, for the reading thread to raise); stops at its next token once `cancel` is set."""
        detok = IncrementalText(self.tokenizer, self.silent_ids)

        def on_token(row: int, token: int) -> None:
            if cancel.is_set():
                raise _Cancelled
            piece = detok.add(token)
            if piece:
                pieces.put(piece)

        try:
            generations = (
                [decode(on_token)] if decode is not None else self.generate_ids([ids], params, on_token)
            )
            if results is not None:
                results.extend(generations)
            rest = detok.flush()
            if rest:
                pieces.put(rest)
            pieces.put(None)
        except _Cancelled:
            pieces.put(None)
        except BaseException as error:  # handed to the reading thread
            pieces.put(error)


def _raising(pieces: "queue.Queue[Optional[object]]") -> Iterator[str]:
    """The worker's pieces until its end marker; an exception it sent is raised here."""
    while (item := pieces.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def until_stop(pieces: Iterator[str], stops: Sequence[str]) -> Iterator[str]:
    """Text pieces up to the first stop string (excluded); text that could be the start of a
    stop string is held back until the next pieces settle it."""
    text, emitted = "", 0  # everything decoded so far; how much of it was handed out
    for piece in pieces:
        text += piece
        hits = [text.index(stop) for stop in stops if stop in text]
        if hits:
            if text[emitted : min(hits)]:
                yield text[emitted : min(hits)]
            return
        safe = len(text) - _held_back(text, stops)
        if safe > emitted:
            yield text[emitted:safe]
            emitted = safe
    if text[emitted:]:
        yield text[emitted:]


class _Cancelled(Exception):
    """Raised inside the decode loop when a stream's reader has gone."""


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters could begin a stop string (kept back until it resolves)."""
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def silent_tokens(tokenizer) -> frozenset[int]:
    """The special tokens that decoding with skip_special_tokens drops whatever surrounds them:
    a fast tokenizer drops its added tokens marked special, a slow one its special ids; a
    special id that is an ordinary piece to the tokenizer (a pad token set to "▁") is kept."""
    candidates = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special
    }
    plain = next(i for i in range(len(tokenizer)) if i not in candidates)
    around = tokenizer.decode([plain, plain], skip_special_tokens=True)
    return frozenset(
        i for i in candidates if tokenizer.decode([plain, i, plain], skip_special_tokens=True) == around
    )


class IncrementalText:
    """Text of a growing token list, handed out as the new characters only; pieces that end in
    an incomplete UTF-8 character wait for the next token.

    Each token decodes a window, not the whole list: the tokens since the last piece and the
    ones before it back to the piece before (the text of the same tokens without the new ones
    is cut off the front). The window keeps what a tokenizer's decoder needs (a SentencePiece
    decoder drops the first token's leading space, a byte-level one needs a character's first
    bytes), and a long answer costs the same per token as a short one (decoding the whole list
    each time grows with its length: 0.3 ms a token at 1,000 tokens). `silent` tokens
    (`silent_tokens`) never enter the window: a run of them would widen it token by token."""

    def __init__(self, tokenizer, silent: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.silent = silent
        self.ids: list[int] = []
        self.text = ""  # every piece handed out, joined
        self.start = 0  # the window's first token
        self.shown = 0  # tokens whose text has been handed out

    def add(self, token: int) -> str:
        if token in self.silent:
            return ""
        self.ids.append(token)
        return self.piece(final=False)

    def flush(self) -> str:
        """What is still held back when the tokens end (a character that never completed)."""
        return self.piece(final=True)

    def piece(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.start : self.shown], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self.start :], skip_special_tokens=True)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        piece = now[len(before) :]
        self.text += piece
        self.start, self.shown = self.shown, len(self.ids)
        return piece
