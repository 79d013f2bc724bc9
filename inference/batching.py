"""Continuous batching: requests join and leave the running batch between passes of the model.

One worker thread owns the decoder's cache, one row per sequence, up to `max_batch` of them
at once. Each loop: admit waiting requests into free rows, then one forward pass
(`Transformer.forward_segments`) that takes a decode step of every running sequence (each at
its own position) together with up to `prefill_chunk` tokens of the admitted prompts (the
earliest due first, see `_admit`; several short ones share a pass), then hand each sequence's
new token to its reader and free the rows that finished. The weights are read once for the
step and the prompts' chunks (Sarathi-Serve's stall-free batching, vLLM's chunked prefill): a
long answer never holds a short one back, a new request starts once its prompt is in, and a
long prompt slows the running answers by its chunk's share of a pass rather than stopping them
for its whole prefill. A request takes the free row holding its conversation's previous turn
(`_choose_row`, `Decoder.reusable`); before each chunk it copies from any other row a longer
start of its prompt that row holds (a system prompt another request has prefilled), and
prefills only the rest; a prompt whose next tokens another prompt in the same pass is
computing waits for them to be copied. A cache of more rows than `max_batch` (`cache_rows`)
keeps that many conversations' turns for their next ones, while no more than `max_batch`
decode at once. With a `lookahead`, each running sequence's part of a pass carries prompt
lookup's guesses of its next tokens after its last one, checked in that pass
(`speculative.verify`): the same answers, several tokens a pass where an answer copies its
prompt. A request whose reader goes away (`Submission.cancel`) leaves at the next
step; one whose sampling fails gets the error alone, and the loop goes on serving the others.
`close()` (or leaving a `with` block, or the interpreter's exit) stops the worker between two
steps: a worker still inside a torch op when Python exits aborts the whole process.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from slimlm.errors import SlimlmError
from slimlm.inference.decoder import Decoder, Generation, IncrementalText, shared_start
from slimlm.inference.model import Segment
from slimlm.inference.sampling import SamplingParams, next_tokens, sampling_state
from slimlm.inference.speculative import PromptLookup, verify


@dataclass
class _Sequence:
    ids: list[int]
    params: SamplingParams
    out: "queue.Queue[object]"
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    seen: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    prefilled: int = 0  # prompt tokens in the cache so far
    cached: int = 0  # of them, found in its row at admission or copied from another (not prefilled again)
    due: int = 0  # the prefill chunk count by which its prompt would be in, had it started alone at admission
    finish: Optional[str] = None
    text: Optional[IncrementalText] = None
    cancelled: bool = False  # set by the reader's thread, read by the worker's
    lookup: Optional[PromptLookup] = None  # its prompt and answer so far, for guesses (with a lookahead)


class BatcherClosed(RuntimeError):
    """The batcher was closed (e.g. the server is shutting down) before the request finished."""


class Submission:
    """A request in the batcher: iterating it gives the completion's text pieces as they are
    decoded, then the final Generation (an error in its decoding is raised here). `cancel()`
    (e.g. when the client went away) frees its row at the next step."""

    def __init__(self, sequence: _Sequence):
        self._sequence = sequence
        self._done = False

    def __iter__(self) -> "Submission":
        return self

    def __next__(self) -> object:
        if self._done:
            raise StopIteration
        item = self._sequence.out.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = isinstance(item, Generation)
        return item

    def cancel(self) -> None:
        self._sequence.cancelled = True


class ContinuousBatcher:
    """`max_batch` sequences of up to `max_seq` tokens at once; `prefill_chunk`: prompt tokens
    prefilled in a pass beside the running sequences' step (smaller: steadier answers while prompts arrive, a
    slower prefill; about 0.4 s of the default model on two laptop cores at 128), at most the
    decoder's own `prefill_chunk`. `cache_rows` (default `max_batch`): rows of the cache, each
    `max_seq` slots; the rows no sequence is using keep what their last one left, for a next
    turn that starts with it (with reuse_prefixes on), the one freed longest ago given up first.
    `lookahead` > 0: each running sequence's step also checks up to that many guesses from prompt
    lookup (`speculative.PromptLookup`, n-grams of `ngram` tokens down to 2) and keeps those
    the model agrees with (`speculative.verify`): the same tokens greedy, the same distribution
    sampled, several tokens a pass where the answer copies its prompt."""

    def __init__(
        self,
        decoder: Decoder,
        max_batch: int,
        max_seq: int,
        prefill_chunk: int = 128,
        cache_rows: Optional[int] = None,
        lookahead: int = 0,
        ngram: int = 3,
    ):
        cache_rows = max_batch if cache_rows is None else cache_rows
        if prefill_chunk < 1:
            raise SlimlmError(f"prefill_chunk={prefill_chunk} must be at least 1")
        if lookahead < 0 or ngram < 2:
            raise SlimlmError(
                f"lookahead={lookahead} and ngram={ngram}: give lookahead >= 0 (0: no guesses) and ngram >= 2"
            )
        if not 1 <= max_batch <= cache_rows:
            raise SlimlmError(
                f"max_batch={max_batch} and cache_rows={cache_rows}: a sequence needs a row of its own, "
                "so give 1 <= max_batch <= cache_rows"
            )
        self.decoder = decoder
        self.model = decoder.model
        self.max_batch = max_batch
        self.max_seq, self.prefill_chunk = (
            max_seq,
            min(prefill_chunk, decoder.prefill_chunk),
        )  # a pass holds at most the decoder's (activation memory)
        self.lookahead, self.ngram = lookahead, ngram
        with decoder.lock:
            self.model.setup_cache(cache_rows, max_seq, decoder.cache_dtype)
        self.free_rows = list(range(cache_rows))  # the one freed longest ago first
        self.waiting: "queue.Queue[Optional[_Sequence]]" = queue.Queue()
        self.prefilling: list[
            _Sequence
        ] = []  # admitted, prompt not yet all in the cache; in order of admission
        self.running: list[_Sequence] = []
        self.passes = 0  # forward passes taken
        self.decoded = (
            0  # tokens their decode steps chose (each sequence's first token aside: its prefill gives it)
        )
        self.chunks = 0  # passes that prefilled prompt tokens
        self.steps = 0  # passes that only decoded (all running sequences at once, no prompt beside them)
        self.step_s = 0.0  # seconds in them
        self.step_tokens = 0  # tokens they decoded
        self.proposed = self.accepted = 0  # prompt-lookup guesses checked, and kept
        self.closed = False
        self._submitting = (
            threading.Lock()
        )  # a request is queued before close() or refused after it, never lost between
        self.worker = threading.Thread(target=self._loop, daemon=True, name="slimlm-batcher")
        self.worker.start()
        atexit.register(self.close)

    def __enter__(self) -> "ContinuousBatcher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker after its current step; every request not yet answered gets
        BatcherClosed, and so does any later submit. Safe to call more than once."""
        with self._submitting:
            self.closed = True
            self.waiting.put(None)  # wakes an idle worker
        self.worker.join()
        atexit.unregister(self.close)

    def submit(self, ids: list[int], params: SamplingParams) -> Submission:
        """Queue a request (refused at once, before anything is queued, if it cannot fit a row)."""
        if not ids:
            raise SlimlmError("the prompt is empty: a request needs at least one token")
        if len(ids) + params.max_new_tokens > self.max_seq:
            raise SlimlmError(
                f"a prompt of {len(ids)} tokens plus {params.max_new_tokens} new tokens exceeds the "
                f"{self.max_seq} slots a sequence has here"
            )
        sequence = _Sequence(
            list(ids), params, queue.Queue(), lookup=PromptLookup(ids, self.ngram) if self.lookahead else None
        )
        with self._submitting:
            if self.closed:
                raise BatcherClosed("the batcher is closed: it takes no more requests")
            self.waiting.put(sequence)
        return Submission(sequence)

    def _loop(self) -> None:
        while True:
            try:
                if not self.running and not self.prefilling:
                    self._admit(
                        self.waiting.get()
                    )  # idle: sleep until a request arrives (or close() wakes it)
                while len(self.prefilling) + len(self.running) < self.max_batch and not self.waiting.empty():
                    self._admit(self.waiting.get_nowait())
                if self.closed:
                    break
                for sequence in [s for s in (*self.prefilling, *self.running) if s.cancelled]:
                    self._fail(sequence, SlimlmError("the request was cancelled"))
                if self.prefilling or self.running:
                    self._pass()
            except (
                Exception
            ) as error:  # the pass itself failed: every reader in it learns of it; the loop goes on
                for sequence in [*self.running, *self.prefilling]:
                    self._fail(sequence, error)
        closing = BatcherClosed("the batcher was closed before this request finished")
        for sequence in [*self.prefilling, *self.running]:
            self._fail(sequence, closing)
        while not self.waiting.empty():  # none can be added now: submit refuses once closed
            sequence = self.waiting.get_nowait()
            if sequence is not None:
                sequence.out.put(closing)

    def _fail(self, sequence: _Sequence, error: BaseException) -> None:
        """End one sequence with `error` for its reader and free its row, recording what the
        row holds (an answer stopped by its client may be continued in the next turn; a failed
        step or chunk wrote only beyond the record)."""
        for group in (self.prefilling, self.running):
            if sequence in group:
                group.remove(sequence)
        if sequence.row >= 0:
            if (
                sequence.row not in self.model.held and sequence.prefilled > 0
            ):  # else its record from before is intact
                self.decoder.remember(sequence.row, sequence.ids[: sequence.prefilled], sequence.tokens)
            self.free_rows.append(sequence.row)
            sequence.row = -1
        sequence.out.put(error)

    def _admit(self, sequence: Optional[_Sequence]) -> None:
        """Give a waiting request a free row; its prompt goes in a chunk at a time from now on
        (one cancelled while it waited leaves at the loop's sweep, before its first chunk). None
        is close()'s wake-up call.

        Prompts are prefilled earliest due first, due when their prefill would end had it
        started alone at admission: a short prompt arriving behind long ones is due soon and
        gets its first token after about its own chunks rather than after all of theirs, while
        a long prompt that has waited keeps its place before every later prompt due after it,
        so none waits indefinitely."""
        if sequence is None:
            return
        try:
            sequence.row = self._choose_row(sequence.ids)
            self.free_rows.remove(sequence.row)
            sequence.prefilled = sequence.cached = self.decoder.reusable(sequence.row, sequence.ids)
            sequence.due = (
                self.chunks - (self._known_start(sequence)[1] - len(sequence.ids)) // self.prefill_chunk
            )  # ceil: the chunks it will compute
            sequence.seen, sequence.generator = sampling_state(
                [sequence.ids], sequence.params, self.model.args.vocab_size, self.decoder.device
            )
            sequence.text = IncrementalText(self.decoder.tokenizer, self.decoder.silent_ids)
            self.prefilling.append(sequence)
        except Exception as error:
            self._fail(sequence, error)

    def _choose_row(self, ids: list[int]) -> int:
        """A free row for the prompt `ids`: the one holding the most of it among those whose
        previous prompt it starts with (its conversation's earlier turn, whatever became of the
        answer's tokens in this prompt); else an empty row; else the one freed longest ago. While
        there are empty rows, a row holding another conversation that merely starts the same
        way (a system prompt) is left to it: the shared start is copied from it before the
        first chunk."""

        def value(row: int) -> tuple[int, bool]:
            record, same = self.model.held.get(row), self.decoder.reusable(row, ids)
            continued = record is not None and same >= min(
                record.prompt, len(ids) - 1
            )  # the cap: a prompt sent again
            return (same if continued else 0, record is None)

        return max(self.free_rows, key=value)  # ties: the first, freed longest ago

    @staticmethod
    def _contents(sequence: _Sequence) -> list[int]:
        """The tokens in a sequence's row from slot 0: its prompt so far, then (once running)
        its answer but the newest token (not fed back yet); what `Decoder.remember` records."""
        return [*sequence.ids[: sequence.prefilled], *sequence.tokens[:-1]]

    def _known_rows(self) -> dict[int, list[int]]:
        """Each row's tokens in its slots from 0, as far as known: a free row's record, a busy
        row's sequence's contents."""
        known = {row: self.model.held[row].tokens for row in self.free_rows if row in self.model.held}
        known.update({s.row: self._contents(s) for s in (*self.prefilling, *self.running)})
        return known

    def _known_start(self, sequence: _Sequence) -> tuple[int, int]:
        """The other row holding the longest start of the sequence's prompt beyond what its own
        row has, and that start's length (-1 and what it has when none does)."""
        source, end = -1, sequence.prefilled
        for row, tokens in self._known_rows().items() if self.decoder.reuse_prefixes else ():
            if row != sequence.row and (same := shared_start(tokens, sequence.ids)) > end:
                source, end = row, same
        return source, end

    def _copy_known_start(self, sequence: _Sequence) -> None:
        """Copy into the sequence's row the longest start of its prompt that another row holds
        beyond what it has: copying slots costs a tiny fraction of computing them."""
        source, end = self._known_start(sequence)
        if source >= 0:
            self.model.copy_slots(source, sequence.row, sequence.prefilled, end)
            sequence.cached += end - sequence.prefilled
            sequence.prefilled = end

    def _chunks(self, budget: int) -> list[tuple[_Sequence, list[int]]]:
        """The prompt tokens this pass prefills: up to `budget` of them, from the admitted
        prompts earliest due first (ties: the earliest admitted), each after copying what another
        row holds of it; a prompt that does not fit whole goes only first. A prompt waits a pass
        when another one in it is computing its next tokens (a shared start, then copied rather
        than computed twice)."""
        chunks: list[tuple[_Sequence, list[int]]] = []
        for sequence in sorted(self.prefilling, key=lambda s: s.due):
            if budget == 0:
                break
            try:
                self._copy_known_start(sequence)
            except Exception as error:
                self._fail(sequence, error)
                continue
            if any(
                shared_start(other.ids[: other.prefilled + len(ids)], sequence.ids) > sequence.prefilled
                for other, ids in chunks
            ):
                continue
            # A part of a prompt only opens a pass: filling one up with it would make the prompts
            # already in it wait longer for their first tokens.
            if chunks and len(sequence.ids) - sequence.prefilled > budget:
                continue
            ids = sequence.ids[sequence.prefilled : sequence.prefilled + budget]
            chunks.append((sequence, ids))
            budget -= len(ids)
        return chunks

    @torch.inference_mode()
    def _pass(self) -> None:
        """One forward pass: a decode step of every running sequence and the prompt chunks
        `_chunks` picks; a prompt all in takes its first token and joins the running batch."""
        decoding = list(self.running)
        guesses = [self._guesses(s) for s in decoding]
        chunks = self._chunks(
            min(self.prefill_chunk, max(1, self.decoder.prefill_chunk - sum(1 + len(g) for g in guesses)))
        )
        segments = [
            Segment(s.row, len(s.ids) + len(s.tokens) - 1, [s.tokens[-1], *g])
            for s, g in zip(decoding, guesses)
        ]
        segments += [Segment(s.row, s.prefilled, ids) for s, ids in chunks]
        if not segments:  # every prompt waiting for this pass failed its copy
            return
        members, checks = (
            [*decoding, *(s for s, _ in chunks)],
            [*guesses, *([] for _ in chunks)],
        )  # in the segments' order
        begin = time.perf_counter()
        try:
            logits = self.model.forward_segments(segments, [1 + len(g) for g in checks])
            if logits[0].is_cuda:
                torch.cuda.synchronize(logits[0].device)  # the pass's time, not its launches'
        except (
            Exception
        ) as error:  # what it wrote lies beyond every record: the rows' contents stay as recorded
            for sequence in members:
                self._fail(sequence, error)
            return
        seconds = time.perf_counter() - begin
        for sequence, ids in chunks:
            sequence.prefilled += len(ids)
        decoded = 0  # tokens chosen by the running sequences' steps (a prompt's first token aside)
        for sequence, logit, checked in zip(members, logits, checks):
            if sequence.prefilled < len(sequence.ids):  # a prompt not all in yet
                continue
            first = sequence in self.prefilling
            if first:  # all in now: its first token, and it joins the running batch
                self.prefilling.remove(sequence)
                self.running.append(sequence)
            try:
                chosen = self._take(sequence, logit, checked)
                decoded += 0 if first else chosen
            except Exception as error:  # this request's sampling failed: the others go on
                self._fail(sequence, error)
        self.passes, self.decoded, self.chunks = (
            self.passes + 1,
            self.decoded + decoded,
            self.chunks + bool(chunks),
        )
        if not chunks:
            self.steps, self.step_tokens, self.step_s = (
                self.steps + 1,
                self.step_tokens + decoded,
                self.step_s + seconds,
            )

    def _guesses(self, sequence: _Sequence) -> list[int]:
        """Prompt lookup's guesses of the sequence's next tokens (none without a lookahead),
        no more than its answer has room for."""
        room = min(self.lookahead, sequence.params.max_new_tokens - len(sequence.tokens))
        return sequence.lookup.propose(room) if room > 0 and sequence.lookup is not None else []

    def _take(self, sequence: _Sequence, logits: torch.Tensor, guesses: list[int]) -> int:
        """Choose the sequence's next tokens from its logits [1 + guesses, vocab] (after its last
        token and after each guess): the guesses kept and the model's own token after them, up to
        the one that finishes it. Returns how many it chose."""
        if not guesses:
            self._emit(
                sequence, int(next_tokens(logits, sequence.params, sequence.seen, sequence.generator)[0])
            )
            return 1
        kept, token = verify(logits, guesses, sequence.params, sequence.seen, sequence.generator)
        self.proposed, self.accepted = self.proposed + len(guesses), self.accepted + kept
        count = 0  # tokens given out
        for chosen in [*guesses[:kept], token]:
            self._emit(sequence, chosen)
            count += 1
            if sequence.finish is not None:
                break
        self.accepted -= kept - min(
            kept, count
        )  # guesses kept after the token that finished it were never given out
        return count

    def _emit(self, sequence: _Sequence, token: int) -> None:
        """Give the sequence's reader its next token's text, or finish it."""
        sequence.seen[0, token] = True
        if token in self.decoder.end_ids(sequence.params):
            sequence.finish = "stop"
        else:
            sequence.tokens.append(token)
            if sequence.lookup is not None:
                sequence.lookup.extend((token,))
            piece = sequence.text.add(token)
            if piece:
                sequence.out.put(piece)
            if piece and self.stop_ends_in(sequence, piece):
                sequence.finish = "stop"
            elif len(sequence.tokens) >= sequence.params.max_new_tokens:
                sequence.finish = "length"
        if sequence.finish is not None:
            rest = sequence.text.flush()
            if rest:
                sequence.out.put(rest)
            self.running.remove(sequence)
            self.decoder.remember(sequence.row, sequence.ids, sequence.tokens)
            self.free_rows.append(sequence.row)
            sequence.row = -1
            generation = self.decoder._finish(
                sequence.tokens, sequence.params, sequence.finish, len(sequence.ids), sequence.cached
            )
            sequence.out.put(generation)

    @staticmethod
    def stop_ends_in(sequence: _Sequence, piece: str) -> bool:
        """Whether a stop string ends within the newest `piece` of the text (the only place a new
        one can end: the text before it was searched when it came)."""
        stops = sequence.params.stop
        tail = sequence.text.text[-(len(piece) + max(map(len, stops), default=1) - 1) :]
        return any(stop in tail for stop in stops)
