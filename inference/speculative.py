"""Speculative decoding: cheap guesses of the next few tokens, checked by the model in one pass.

A proposer guesses up to `lookahead` tokens; the target model scores the last accepted token
and the guesses together (one forward of length 1 + lookahead), keeps the guesses up to the
first one its own greedy choice disagrees with, and adds its own token after them. The output
is the target's greedy output, token for token; what changes is how many forward passes it takes.

Proposers:
  prompt lookup  the tokens that followed the most recent earlier occurrence of the sequence's
                 last n-gram (n from `ngram` down to 2): free, and strong when the answer copies
                 from the prompt (summaries, code edits, retrieval)
  draft model    a small model (e.g. a distilled student) decoding greedily from its own cache;
                 it must share the target's tokenizer

Like plain decoding, a prompt that starts with what the target's (and the draft's) cache row
holds prefills only the rest, and the row's contents are recorded when the generation ends: a
conversation's next turn, or the same prompt decoded plainly first, is not computed again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from slimlm.errors import SlimlmError
from slimlm.inference.decoder import Decoder, Generation, TokenCallback
from slimlm.inference.model import RowRecord
from slimlm.inference.sampling import SamplingParams, greedy_tokens


@dataclass
class SpeculativeStats:
    proposed: int = 0  # guessed tokens checked by the target
    accepted: int = 0  # of those, kept
    target_passes: int = 0  # target forwards after the prefill
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0


def lookup_proposal(tokens: Sequence[int], lookahead: int, ngram: int, min_ngram: int = 2) -> list[int]:
    """The tokens after the latest earlier match of the last n-gram (n from `ngram` down to
    `min_ngram`), or [] (then the step checks no guess and costs what a plain step costs).
    Single tokens recur everywhere, so by default a guess needs two matching tokens."""
    for n in range(min(ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = list(tokens[-n:])
        for start in range(len(tokens) - n - 1, -1, -1):
            if list(tokens[start : start + n]) == tail:
                return list(tokens[start + n : start + n + lookahead])
    return []


class DraftProposer:
    """Greedy guesses from a draft model; its cache is kept in step with the accepted tokens."""

    def __init__(self, draft: Decoder, target_vocab: int):
        if draft.model.args.vocab_size != target_vocab:
            raise SlimlmError(f"the draft model's vocabulary ({draft.model.args.vocab_size}) differs from the target's ({target_vocab}); a draft must share the target's tokenizer")
        self.draft = draft
        self.consumed = 0  # tokens of the sequence the draft's cache holds correctly

    def start(self, max_seq: int, prompt: Sequence[int]) -> None:
        self.draft.ensure_cache(1, max_seq)
        self.consumed = self.draft.reusable(0, prompt)

    def remember(self, tokens: Sequence[int], prompt_length: int) -> None:
        """Record the draft's row: the tokens it has consumed (their slots hold them; its own
        guesses beyond were never judged)."""
        self.draft.model.held[0] = RowRecord(list(tokens[: self.consumed]), min(prompt_length, self.consumed))

    def propose(self, tokens: Sequence[int], lookahead: int) -> list[int]:
        model = self.draft.model
        logits = self.draft.prefill(torch.tensor([list(tokens[self.consumed :])], device=self.draft.device), start=self.consumed)
        position = len(tokens)
        guesses = []
        for _ in range(min(lookahead, model.max_seq - position)):
            guess = int(greedy_tokens(logits))
            guesses.append(guess)
            if len(guesses) == lookahead or position + 1 > model.max_seq - 1:
                break
            logits = model(torch.tensor([[guess]], device=self.draft.device), position)[:, -1]
            position += 1
        self.consumed = len(tokens)  # the guesses' slots are rewritten once the target has judged them
        return guesses


@torch.inference_mode()
def generate_speculative(
    target: Decoder,
    prompt: Sequence[int],
    params: SamplingParams,
    draft: Optional[Decoder] = None,
    lookahead: int = 4,
    ngram: int = 3,
    min_ngram: int = 2,
    on_token: Optional[TokenCallback] = None,
) -> tuple[Generation, SpeculativeStats]:
    """Greedy generation of `prompt` by `target`, with guesses from `draft` or prompt lookup;
    `on_token` sees each token (row 0) as it is kept, a pass's accepted guesses one by one."""
    if not params.greedy:
        raise SlimlmError("speculative decoding here keeps the output identical to greedy decoding: use temperature 0")
    if lookahead < 1 or not 1 <= min_ngram <= ngram:
        raise SlimlmError(f"lookahead ({lookahead}) must be at least 1 and 1 <= min_ngram ({min_ngram}) <= ngram ({ngram})")
    model, device = target.model, target.device
    max_seq = len(prompt) + params.max_new_tokens + lookahead + 1
    if max_seq > model.args.max_position_embeddings:
        raise SlimlmError(f"a prompt of {len(prompt)} tokens plus {params.max_new_tokens} new tokens exceeds the model's context of {model.args.max_position_embeddings}")
    proposer = DraftProposer(draft, model.args.vocab_size) if draft is not None else None
    stats = SpeculativeStats()
    with target.lock:
        target.ensure_cache(1, max_seq)
        if proposer is not None:
            proposer.start(max_seq, prompt)
        started = time.perf_counter()
        tokens = list(prompt)
        cached = target.reusable(0, prompt)
        logits = target.prefill(torch.tensor([tokens[cached:]], device=device), cached)
        next_token = int(greedy_tokens(logits))
        end_ids = target.end_ids(params)
        new: list[int] = []

        def keep(token: int) -> None:
            new.append(token)
            tokens.append(token)
            if on_token is not None:
                on_token(0, token)

        finished = False
        try:
            while not finished:
                if next_token in end_ids or len(new) >= params.max_new_tokens:
                    break
                keep(next_token)
                if len(new) >= params.max_new_tokens:
                    break
                room = min(lookahead, params.max_new_tokens - len(new))
                guesses = proposer.propose(tokens, room) if proposer is not None else lookup_proposal(tokens, room, ngram, min_ngram)
                step = torch.tensor([[tokens[-1], *guesses]], device=device)
                choices = greedy_tokens(model(step, len(tokens) - 1)[0]).tolist()  # target's choice after each position
                stats.target_passes += 1
                stats.proposed += len(guesses)
                kept = 0
                while kept < len(guesses) and guesses[kept] == choices[kept]:
                    kept += 1
                stats.accepted += kept
                for token in guesses[:kept]:
                    if token in end_ids or len(new) >= params.max_new_tokens:
                        finished = True
                        break
                    keep(token)
                next_token = choices[kept]
        finally:  # every token of `new` but the last has been fed to the target (as a checked guess or its own choice)
            target.remember(0, prompt, new)
            if proposer is not None:
                proposer.remember(tokens, len(prompt))
        stats.new_tokens = len(new)
        stats.seconds = time.perf_counter() - started
    text = target.tokenizer.decode(new, skip_special_tokens=True)
    reason = "length" if len(new) >= params.max_new_tokens else "stop"
    return Generation(token_ids=new, text=text, finish_reason=reason, prompt_tokens=len(prompt), cached_tokens=cached), stats
