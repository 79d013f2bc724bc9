"""Continuous batching: requests join and leave the running batch between decode steps.

One worker thread owns the decoder's cache, `max_batch` rows of it, one per running sequence.
Each loop: admit waiting requests into free rows (each prefilled alone into its row), then one
decode step for every running sequence together (`Transformer.step_rows`: each at its own
position), then hand each sequence's new token to its reader and free the rows that finished.
A long answer never holds a short one back, and a new request starts at the next step.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from slimlm.errors import SlimlmError
from slimlm.inference.decoder import Decoder, Generation, IncrementalText
from slimlm.inference.sampling import SamplingParams, next_tokens, sampling_state


@dataclass
class _Sequence:
    ids: list[int]
    params: SamplingParams
    out: "queue.Queue[object]"
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    seen: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None
    finish: Optional[str] = None
    text: Optional[IncrementalText] = None


class ContinuousBatcher:
    def __init__(self, decoder: Decoder, max_batch: int, max_seq: int):
        self.decoder = decoder
        self.model = decoder.model
        self.max_seq = max_seq
        with decoder.lock:
            self.model.setup_cache(max_batch, max_seq, decoder.cache_dtype)
        self.free_rows = list(range(max_batch))
        self.waiting: "queue.Queue[_Sequence]" = queue.Queue()
        self.running: list[_Sequence] = []
        self.steps = 0  # decode steps taken (all running sequences at once)
        self.worker = threading.Thread(target=self._loop, daemon=True)
        self.worker.start()

    def submit(self, ids: list[int], params: SamplingParams) -> Iterator[object]:
        """Text pieces of the completion as they are decoded, then the final Generation."""
        if len(ids) + params.max_new_tokens > self.max_seq:
            raise SlimlmError(f"a prompt of {len(ids)} tokens plus {params.max_new_tokens} new tokens exceeds the {self.max_seq} slots a sequence has here")
        sequence = _Sequence(list(ids), params, queue.Queue())
        self.waiting.put(sequence)
        while True:
            item = sequence.out.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Generation):
                return

    def _loop(self) -> None:
        while True:
            if not self.running:
                self._admit(self.waiting.get())  # idle: sleep until a request arrives
            while self.free_rows and not self.waiting.empty():
                self._admit(self.waiting.get_nowait())
            if self.running:
                try:
                    self._step()
                except BaseException as error:  # every running reader learns of it; the loop goes on
                    for sequence in self.running:
                        sequence.out.put(error)
                        self.free_rows.append(sequence.row)
                    self.running = []

    @torch.inference_mode()
    def _admit(self, sequence: _Sequence) -> None:
        device = self.decoder.device
        try:
            sequence.row = self.free_rows.pop()
            sequence.seen, sequence.generator = sampling_state([sequence.ids], sequence.params, self.model.args.vocab_size, device)
            sequence.text = IncrementalText(self.decoder.tokenizer)
            logits = self.decoder.prefill(torch.tensor([sequence.ids], device=device), first_row=sequence.row)
        except BaseException as error:
            if sequence.row >= 0:
                self.free_rows.append(sequence.row)
            sequence.out.put(error)
            return
        self.running.append(sequence)
        self._take(sequence, logits)

    def _take(self, sequence: _Sequence, logits: torch.Tensor) -> None:
        """Choose the sequence's next token from its logits [1, vocab]; emit it or finish."""
        token = int(next_tokens(logits, sequence.params, sequence.seen, sequence.generator)[0])
        sequence.seen[0, token] = True
        if token in self.decoder.end_ids(sequence.params):
            sequence.finish = "stop"
        else:
            sequence.tokens.append(token)
            piece = sequence.text.add(token)
            if piece:
                sequence.out.put(piece)
            if sequence.params.stop and any(stop in sequence.text.text for stop in sequence.params.stop):
                sequence.finish = "stop"
            elif len(sequence.tokens) >= sequence.params.max_new_tokens:
                sequence.finish = "length"
        if sequence.finish is not None:
            rest = sequence.text.flush()
            if rest:
                sequence.out.put(rest)
            self.running.remove(sequence)
            self.free_rows.append(sequence.row)
            generation = self.decoder._finish(sequence.tokens, sequence.params, sequence.finish, len(sequence.ids))
            sequence.out.put(generation)

    @torch.inference_mode()
    def _step(self) -> None:
        device = self.decoder.device
        running = list(self.running)
        tokens = torch.tensor([s.tokens[-1] for s in running], device=device)
        rows = torch.tensor([s.row for s in running], device=device)
        positions = torch.tensor([len(s.ids) + len(s.tokens) - 1 for s in running], device=device)
        logits = self.model.step_rows(tokens, rows, positions)
        self.steps += 1
        for index, sequence in enumerate(running):
            self._take(sequence, logits[index : index + 1])
