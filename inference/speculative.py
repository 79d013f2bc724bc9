"""Speculative decoding: cheap guesses of the next few tokens, checked by the model in one pass.

A proposer guesses up to `lookahead` tokens; the target model scores the last kept token and
the guesses together (one forward of length 1 + lookahead) and keeps a prefix of the guesses,
then adds one token of its own after them. What changes is how many forward passes the answer
takes, not the answer:
  greedy (temperature 0)  a guess is kept while it is the target's own choice there: the output
                          is plain greedy decoding's, token for token (repetition penalty too)
  sampling                a guess x is kept with probability min(1, p(x) / q(x)), p the target's
                          sampling distribution there and q the proposer's; at the first one
                          refused, the target's token is drawn from max(0, p - q), renormalized
                          (Leviathan et al. 2023, Chen et al. 2023): every token is distributed
                          as plain sampling's, though a seed gives other draws than plain sampling

Proposers:
  prompt lookup  the tokens that followed the most recent earlier occurrence of the sequence's
                 last n-gram (n from `ngram` down to 2): free, and strong when the answer copies
                 from the prompt (summaries, code edits, retrieval); q puts all its mass on them
  draft model    a small model (e.g. a distilled student) decoding from its own cache, greedily
                 or sampling at the same temperature, top-k and top-p (without the repetition
                 penalty); it must share the target's tokenizer

Like plain decoding, a prompt that starts with what the target's (and the draft's) cache row
holds prefills only the rest, and the row's contents are recorded when the generation ends: a
conversation's next turn, or the same prompt decoded plainly first, is not computed again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch

from slimlm.errors import SlimlmError
from slimlm.inference.decoder import Decoder, Generation, TokenCallback
from slimlm.inference.model import RowRecord
from slimlm.inference.sampling import (
    SamplingParams,
    greedy_tokens,
    next_tokens,
    penalize_repetition,
    sampling_probabilities,
    sampling_state,
)


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


class PromptLookup:
    """Prompt lookup's guesses for a growing sequence: the tokens after the latest earlier match
    of its last n-gram (n from `ngram` down to `min_ngram`), or [] (then the step checks no guess
    and costs what a plain step costs). Single tokens recur everywhere, so by default a guess
    needs two matching tokens. Each n-gram's latest start is indexed as tokens arrive, so a
    guess costs a few dictionary reads, not a scan of the whole context (about 2 ms in Python
    at 4k tokens, each pass, for each sequence)."""

    def __init__(self, tokens: Sequence[int], ngram: int = 3, min_ngram: int = 2):
        self.ngram, self.min_ngram = ngram, min_ngram
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # an n-gram's latest start with a token after it
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending before this token now have one after them
            self.tokens.append(token)
            for n in range(self.min_ngram, min(self.ngram, end) + 1):
                self.latest[tuple(self.tokens[end - n : end])] = end - n

    def propose(self, lookahead: int) -> list[int]:
        for n in range(min(self.ngram, len(self.tokens) - 1), self.min_ngram - 1, -1):
            start = self.latest.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n : start + n + lookahead]
        return []


class DraftProposer:
    """Guesses from a draft model, greedy or sampled; its cache is kept in step with the kept tokens."""

    def __init__(self, draft: Decoder, target_vocab: int):
        if draft.model.args.vocab_size != target_vocab:
            raise SlimlmError(
                f"the draft model's vocabulary ({draft.model.args.vocab_size}) differs from the target's "
                f"({target_vocab}); a draft must share the target's tokenizer"
            )
        self.draft = draft
        self.consumed = 0  # tokens of the sequence the draft's cache holds correctly

    def start(self, max_seq: int, prompt: Sequence[int]) -> None:
        self.draft.ensure_cache(1, max_seq)
        self.consumed = self.draft.reusable(0, prompt)

    def remember(self, tokens: Sequence[int], prompt_length: int) -> None:
        """Record the draft's row: the tokens it has consumed (their slots hold them; its own
        guesses beyond were never judged)."""
        self.draft.model.held[0] = RowRecord(list(tokens[: self.consumed]), min(prompt_length, self.consumed))

    def propose(
        self,
        tokens: Sequence[int],
        lookahead: int,
        params: SamplingParams,
        generator: Optional[torch.Generator],
    ) -> tuple[list[int], Optional[torch.Tensor]]:
        """Up to `lookahead` guesses after `tokens`, and when sampling the distributions they
        were drawn from [guesses, vocab]."""
        model = self.draft.model
        logits = self.draft.prefill(
            torch.tensor([list(tokens[self.consumed :])], device=self.draft.device), start=self.consumed
        )
        position = len(tokens)
        guesses, drawn_from = [], []
        for _ in range(min(lookahead, model.max_seq - position)):
            if params.greedy:
                guess = int(greedy_tokens(logits))
            else:
                drawn_from.append(sampling_probabilities(logits, params)[0])
                guess = int(torch.multinomial(drawn_from[-1], 1, generator=generator))
            guesses.append(guess)
            if len(guesses) == lookahead or position + 1 > model.max_seq - 1:
                break
            logits = model(torch.tensor([[guess]], device=self.draft.device), position)[:, -1]
            position += 1
        self.consumed = len(tokens)  # the guesses' slots are rewritten once the target has judged them
        return guesses, torch.stack(drawn_from) if drawn_from else None


def judge(
    target_p: torch.Tensor,
    guesses: Sequence[int],
    draft_q: Optional[torch.Tensor],
    generator: Optional[torch.Generator],
) -> tuple[int, int]:
    """Speculative sampling's test of `guesses` against the target's distributions `target_p`
    [guesses + 1, vocab] at each of their positions and after the last: how many are kept, and
    the target's token after them. Guess i is kept with probability min(1, p(x) / q(x)), q the
    distribution it was drawn from (`draft_q` [guesses, vocab]; None: all mass on the guess, as
    prompt lookup proposes); at the first refused, the token is drawn from max(0, p - q)
    renormalized, and after all kept from the last p: every token then follows p exactly."""
    count, device = len(guesses), target_p.device
    rows, index = (
        torch.arange(count, device=device),
        torch.tensor(list(guesses), dtype=torch.long, device=device),
    )
    p_at = target_p[rows, index]
    q_at = draft_q[rows, index] if draft_q is not None else torch.ones_like(p_at)
    kept_each = (
        torch.rand(count, generator=generator, device=device) * q_at < p_at
    ).tolist()  # one synchronization for all guesses
    kept = kept_each.index(False) if False in kept_each else count
    if kept == count:
        return count, int(torch.multinomial(target_p[count], 1, generator=generator))
    if draft_q is not None:
        rest = (target_p[kept] - draft_q[kept]).clamp(min=0)
    else:  # max(0, p - one-hot): p without the guess
        rest = target_p[kept].clone()
        rest[guesses[kept]] = 0
    rest = (
        rest if float(rest.sum()) > 0 else target_p[kept]
    )  # p <= q everywhere: a refusal had probability 0 (rounding)
    return kept, int(torch.multinomial(rest, 1, generator=generator))


def verify(
    logits: torch.Tensor,
    guesses: Sequence[int],
    params: SamplingParams,
    seen: Optional[torch.Tensor],
    generator: Optional[torch.Generator],
    draft_q: Optional[torch.Tensor] = None,
) -> tuple[int, int]:
    """How many of `guesses` the target keeps, and its own token after them, from its next-token
    `logits` [guesses + 1, vocab] after the last kept token and after each guess: greedy, a
    guess is kept while it is the target's choice; sampling, by `judge`. The repetition penalty
    sees at each position the tokens before it (`seen` [1, vocab]: those up to the last kept)."""
    if params.repetition_penalty != 1.0:
        seen_before = seen.repeat(len(guesses) + 1, 1)
        for i, guess in enumerate(guesses):
            seen_before[i + 1 :, guess] = True
        logits = penalize_repetition(logits.float(), seen_before, params.repetition_penalty)
    if not params.greedy:
        return judge(sampling_probabilities(logits, params), guesses, draft_q, generator)
    choices = greedy_tokens(logits).tolist()
    kept = 0
    while kept < len(guesses) and guesses[kept] == choices[kept]:
        kept += 1
    return kept, choices[kept]


@dataclass
class Answer:
    """A speculative generation's sequence as it grows: each kept token joins `tokens` and
    `new`, the prompt lookup's index, the repetition penalty's tokens `seen`, and is shown to
    `on_token`."""

    target: Decoder
    params: SamplingParams
    tokens: list[int]  # the prompt, then the kept tokens
    seen: torch.Tensor  # [1, vocab]
    generator: Optional[torch.Generator]
    lookup: Optional[PromptLookup]  # None: a draft model guesses
    on_token: Optional[TokenCallback]
    end_ids: set[int]
    new: list[int] = field(default_factory=list)  # the kept tokens

    def keep(self, token: int) -> bool:
        """Add a kept token; whether the answer ends with it (a stop string)."""
        self.new.append(token)
        self.tokens.append(token)
        if self.lookup is not None:
            self.lookup.extend((token,))
        if self.params.repetition_penalty != 1.0:
            self.seen[0, token] = True
        if self.on_token is not None:
            self.on_token(0, token)
        return bool(self.params.stop) and self.target._hits_stop_string(self.new, self.params.stop)

    def take(self, token: int) -> bool:
        """Keep `token` unless it is an end token; whether the answer is over (an end token, a
        stop string, or max_new_tokens)."""
        return token in self.end_ids or self.keep(token) or len(self.new) >= self.params.max_new_tokens

    def take_all(self, tokens: Sequence[int]) -> bool:
        """`take` each of `tokens` in turn until one ends the answer; whether one did."""
        for token in tokens:
            if self.take(token):
                return True
        return False


def check_request(
    target: Decoder,
    prompt: Sequence[int],
    params: SamplingParams,
    draft: Optional[Decoder],
    lookahead: int,
    ngram: int,
    min_ngram: int,
) -> int:
    """Refuse settings generate_speculative cannot honour; the cache slots it needs."""
    if lookahead < 1 or not 1 <= min_ngram <= ngram:
        raise SlimlmError(
            f"lookahead ({lookahead}) must be at least 1 and 1 <= min_ngram ({min_ngram}) <= ngram ({ngram})"
        )
    model, device = target.model, target.device
    max_seq = len(prompt) + params.max_new_tokens + lookahead + 1
    if max_seq > model.args.max_position_embeddings:
        raise SlimlmError(
            f"a prompt of {len(prompt)} tokens plus {params.max_new_tokens} new tokens exceeds the model's "
            f"context of {model.args.max_position_embeddings}"
        )
    if draft is not None and not params.greedy and draft.device != device:
        raise SlimlmError(
            "speculative sampling draws the draft's guesses with the target's generator: put the draft on "
            f"the target's device ({device}, not {draft.device})"
        )
    return max_seq


def start_answer(
    target: Decoder,
    prompt: Sequence[int],
    params: SamplingParams,
    lookup: Optional[PromptLookup],
    on_token: Optional[TokenCallback],
) -> tuple[Answer, int, int]:
    """Prefill what target's row 0 does not hold of `prompt`: the answer (its prompt alone so
    far), how many of the prompt's tokens the row held, and the target's first token."""
    model, device = target.model, target.device
    seen, generator = sampling_state([prompt], params, model.args.vocab_size, device)
    answer = Answer(target, params, list(prompt), seen, generator, lookup, on_token, target.end_ids(params))
    cached = target.reusable(0, prompt)
    logits = target.prefill(torch.tensor([answer.tokens[cached:]], device=device), cached)
    return answer, cached, int(next_tokens(logits, params, seen, generator))


def guess(
    answer: Answer, proposer: Optional[DraftProposer], room: int, draft_params: SamplingParams
) -> tuple[list[int], Optional[torch.Tensor]]:
    """Up to `room` guesses after the answer so far, from the draft model or else by prompt
    lookup, and the distributions a draft sampled them from (None for greedy or lookup)."""
    if proposer is not None:
        return proposer.propose(answer.tokens, room, draft_params, answer.generator)
    return answer.lookup.propose(room), None


def check_guesses(answer: Answer, guesses: list[int], draft_q: Optional[torch.Tensor]) -> tuple[int, int]:
    """One target pass over the last kept token and `guesses`: how many guesses it keeps, and
    its own token after them."""
    target = answer.target
    step = torch.tensor([[answer.tokens[-1], *guesses]], device=target.device)
    logits = target.model(step, len(answer.tokens) - 1)[0]
    return verify(logits, guesses, answer.params, answer.seen, answer.generator, draft_q)


def decode_with_guesses(
    answer: Answer,
    first: int,
    proposer: Optional[DraftProposer],
    lookahead: int,
    stats: SpeculativeStats,
) -> None:
    """Take `first` (the prefill's token), then until the answer is over, a pass a step: the
    target checks up to `lookahead` guesses and its kept guesses and own token are taken."""
    params = answer.params
    draft_params = dataclasses.replace(
        params, repetition_penalty=1.0
    )  # the draft's guesses need not follow it: the target judges them
    finished = answer.take(first)
    while not finished:
        room = min(lookahead, params.max_new_tokens - len(answer.new))
        guesses, draft_q = guess(answer, proposer, room, draft_params)
        kept, token = check_guesses(answer, guesses, draft_q)
        stats.target_passes += 1
        stats.proposed += len(guesses)
        stats.accepted += kept
        finished = answer.take_all(guesses[:kept]) or answer.take(token)


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
    """Generation of `prompt` by `target` under `params` (greedy or sampled), with guesses from
    `draft` or prompt lookup; `on_token` sees each token (row 0) as it is kept, a pass's
    accepted guesses one by one."""
    max_seq = check_request(target, prompt, params, draft, lookahead, ngram, min_ngram)
    proposer = DraftProposer(draft, target.model.args.vocab_size) if draft is not None else None
    lookup = PromptLookup(prompt, ngram, min_ngram) if draft is None else None
    stats = SpeculativeStats()
    with target.lock:
        target.ensure_cache(1, max_seq)
        if proposer is not None:
            proposer.start(max_seq, prompt)
        started = time.perf_counter()
        answer, cached, first = start_answer(target, prompt, params, lookup, on_token)
        try:
            decode_with_guesses(answer, first, proposer, lookahead, stats)
        finally:
            # every token of `new` but the last has been fed to the target (as a checked guess or
            # its own choice)
            target.remember(0, prompt, answer.new)
            if proposer is not None:
                proposer.remember(answer.tokens, len(prompt))
        stats.new_tokens = len(answer.new)
        stats.seconds = time.perf_counter() - started
    reason = "length" if len(answer.new) >= params.max_new_tokens else "stop"
    return target._finish(answer.new, params, reason, len(prompt), cached), stats
