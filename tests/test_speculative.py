"""Speculative decoding gives exactly the plain greedy output, whatever the proposer guesses."""

import pytest
import torch

from slimlm.errors import SlimlmError
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.speculative import PromptLookup, generate_speculative, judge
from tests.conftest import build_tiny_llama


def prompt(length, seed=0):
    return torch.randint(4, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def scanned_proposal(tokens, lookahead, ngram, min_ngram):
    """Prompt lookup by its definition: a scan back from the end for each n-gram length."""
    for n in range(min(ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + lookahead]
    return []


def test_prompt_lookup_finds_the_latest_match_of_the_longest_ngram():
    def guess(tokens, lookahead, ngram, min_ngram=2):
        return PromptLookup(tokens, ngram, min_ngram).propose(lookahead)

    assert guess([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 3) == [7, 8]
    assert guess([5, 6, 7, 5, 6], 3, 3) == [7, 5, 6]
    assert guess([1, 2, 3], 2, 3) == []
    assert guess([4, 1, 9, 1], 2, 3) == []  # a single matching token is not enough by default
    assert guess([4, 1, 9, 1], 2, 3, min_ngram=1) == [9, 1]
    generator = torch.Generator().manual_seed(0)
    for ngram, min_ngram in (
        (3, 2),
        (4, 1),
        (2, 2),
    ):  # grown a token at a time, its index gives what a scan finds
        tokens = torch.randint(0, 4, (300,), generator=generator).tolist()
        lookup = PromptLookup(tokens[:5], ngram, min_ngram)
        for length in range(5, len(tokens)):
            assert lookup.propose(3) == scanned_proposal(tokens[:length], 3, ngram, min_ngram), (
                length,
                ngram,
            )
            lookup.extend(tokens[length : length + 1])


@pytest.mark.parametrize(
    "draft_seed", [None, 0, 5], ids=["prompt-lookup", "draft-is-target", "unrelated-draft"]
)
def test_speculative_output_is_the_plain_greedy_output(context_model, tiny_tokenizer, draft_seed):
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    target = Decoder(
        build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False
    )  # each prompt prefilled whole, after its plain decoding too
    draft = (
        None
        if draft_seed is None
        else Decoder(
            build_decoder(build_tiny_llama(len(tiny_tokenizer), seed=draft_seed, initializer_range=0.2)),
            tiny_tokenizer,
        )
    )  # seed 0: the target itself
    for seed in range(3):
        ids = prompt(10, seed)
        plain = target.generate_ids([ids], params)[0]
        fast, stats = generate_speculative(target, ids, params, draft=draft, lookahead=4)
        assert fast.token_ids == plain.token_ids
        assert stats.new_tokens == 48 and stats.target_passes <= 48
    if draft_seed == 0:
        assert stats.acceptance_rate == 1.0 and stats.tokens_per_pass > 4
    if draft_seed is None:
        assert stats.accepted > 0  # a random model repeats itself: the lookup guesses it


@pytest.mark.parametrize("draft_seed", [None, 5], ids=["prompt-lookup", "draft"])
def test_speculative_decoding_prefills_only_what_the_caches_do_not_hold(
    context_model, tiny_tokenizer, draft_seed
):
    """A conversation's next turn, decoded speculatively, finds the previous turn in the target's
    cache and in the draft's, and still gives the plain greedy output."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    target = Decoder(build_decoder(context_model), tiny_tokenizer)
    draft = (
        None
        if draft_seed is None
        else Decoder(
            build_decoder(build_tiny_llama(len(tiny_tokenizer), seed=draft_seed, initializer_range=0.2)),
            tiny_tokenizer,
        )
    )
    prefills = []  # the draft's: (first slot, tokens)
    if draft is not None:
        prefill = draft.prefill
        draft.prefill = lambda tokens, start=0, *rest, **kw: (
            prefills.append((start, tokens.shape[1])) or prefill(tokens, start, *rest, **kw)
        )
    ids = prompt(20, 1)
    first, _ = generate_speculative(target, ids, params, draft=draft)
    following = ids + first.token_ids + prompt(6, 2)
    # the draft's row holds what it prefilled, up to its last prefill's end (its guesses beyond
    # were never judged)
    if draft is not None:
        held = draft.model.held[0].tokens
        assert len(ids) < len(held) == sum(prefills[-1]) and held == following[: len(held)]
        prefills.clear()
    reply, _ = generate_speculative(target, following, params, draft=draft)
    assert (first.cached_tokens, reply.cached_tokens) == (0, len(ids) + len(first.token_ids) - 1)
    assert reply.token_ids == fresh.generate_ids([following], params)[0].token_ids
    if draft is not None:
        assert prefills[0][0] == len(held)
    plain = target.generate_ids([following], params)[
        0
    ]  # and plain decoding finds what speculative decoding left
    assert plain.cached_tokens == len(following) - 1 and plain.token_ids == reply.token_ids


def test_a_speculative_answer_stopped_midway_can_be_continued(context_model, tiny_tokenizer):
    """An answer interrupted between two passes (a client gone) leaves its row's record: the
    next turn finds the tokens fed so far and decodes what a whole prefill would."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    target = Decoder(build_decoder(context_model), tiny_tokenizer)
    ids = prompt(20, 1)
    answer = fresh.generate_ids([ids], params)[0].token_ids
    forward, calls = target.model.forward, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prefill, two passes, then the client goes
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    target.model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        generate_speculative(target, ids, params)
    target.model.forward = forward
    held = target.model.held[0].tokens
    assert len(ids) < len(held) and held == (ids + answer)[: len(held)]
    following = ids + answer + prompt(6, 2)
    reply, _ = generate_speculative(target, following, params)
    assert (
        reply.cached_tokens == len(held)
        and reply.token_ids == fresh.generate_ids([following], params)[0].token_ids
    )


def test_speculative_decoding_streams_the_plain_text(context_model, tiny_tokenizer):
    """Each kept token reaches `on_token` in order (a pass's accepted guesses one by one), so
    `Decoder.stream_ids` streams a speculative answer as it streams a plain one."""
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    target, draft = (
        Decoder(build_decoder(context_model), tiny_tokenizer) for _ in range(2)
    )  # the target as its own draft: every guess kept
    ids = prompt(10, 1)
    seen = []
    generation, stats = generate_speculative(
        target, ids, params, draft=draft, on_token=lambda row, token: seen.append(token)
    )
    assert seen == generation.token_ids and stats.tokens_per_pass > 4
    plain = list(target.stream_ids(ids, params))
    results = []
    pieces = list(
        target.stream_ids(
            ids,
            params,
            results,
            decode=lambda on_token: generate_speculative(target, ids, params, draft=draft, on_token=on_token)[
                0
            ],
        )
    )
    assert (
        "".join(pieces) == "".join(plain) and len(pieces) > 1 and results[0].token_ids == generation.token_ids
    )


@pytest.mark.parametrize("proposal", ["draft", "lookup"])
def test_speculative_sampling_draws_each_token_from_the_target_distribution(proposal):
    """`judge` over many draws of two guesses: the first token emitted (a kept guess, or its own
    draw after a refused one) follows the target's p at its position, and so do the second
    (when the first guess was kept) and the one after both guesses, whatever q proposed them."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5], [0.1, 0.5, 0.1, 0.1, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.2, 0.1, 0.1]])
    counts = torch.zeros(3, 5)
    draws = 20000
    for _ in range(draws):
        guesses = (
            [int(torch.multinomial(row, 1, generator=generator)) for row in q]
            if proposal == "draft"
            else [0, 4]
        )
        kept, token = judge(p, guesses, q if proposal == "draft" else None, generator)
        emitted = [*guesses[:kept], token]
        for position, emitted_token in enumerate(emitted):
            counts[position, emitted_token] += 1
    frequencies = counts / counts.sum(-1, keepdim=True)
    assert (frequencies - p).abs().max() < 0.02, (
        frequencies
    )  # a guess always kept would follow q; a redraw from p, 0.09-0.15 off
    assert counts[2].sum() > 2000  # both guesses kept often enough to see the third position's distribution


def test_speculative_greedy_decoding_keeps_the_repetition_penalty_and_stop_strings(
    context_model, tiny_tokenizer
):
    target = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    draft = Decoder(
        build_decoder(build_tiny_llama(len(tiny_tokenizer), seed=5, initializer_range=0.2)), tiny_tokenizer
    )
    ids = prompt(10, 3)
    penalized = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.5)
    plain = target.generate_ids([ids], penalized)[0]
    assert (
        plain.token_ids
        != target.generate_ids([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
    )  # the penalty matters here
    for proposer in (None, draft):
        assert generate_speculative(target, ids, penalized, draft=proposer)[0].token_ids == plain.token_ids
    itself = Decoder(
        build_decoder(context_model), tiny_tokenizer
    )  # its guesses are kept until the penalty changes the target's choice within a pass
    for seed in (0, 1, 3):
        ids = prompt(10, seed)
        expected = target.generate_ids([ids], penalized)[0].token_ids
        generation, stats = generate_speculative(target, ids, penalized, draft=itself)
        assert generation.token_ids == expected and stats.accepted > 0
    ids = prompt(10, 3)
    stop = tiny_tokenizer.decode(plain.token_ids[20:22])
    stopped = SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.5, stop=[stop])
    expected = target.generate_ids([ids], stopped)[0]
    for proposer in (None, draft):
        generation, stats = generate_speculative(target, ids, stopped, draft=proposer)
        assert (generation.text, generation.finish_reason) == (
            expected.text,
            "stop",
        ) and stats.new_tokens < 40


def test_speculative_sampling_keeps_a_matching_drafts_guesses_and_repeats_with_a_seed(
    context_model, tiny_tokenizer
):
    target, draft = (
        Decoder(build_decoder(context_model), tiny_tokenizer) for _ in range(2)
    )  # the target as its own draft: p = q up to rounding
    params = SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, top_k=50, seed=7)
    ids = prompt(10, 4)
    first, stats = generate_speculative(target, ids, params, draft=draft)
    again, _ = generate_speculative(target, ids, params, draft=draft)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 32
    assert stats.acceptance_rate > 0.9 and stats.tokens_per_pass > 3
    other, _ = generate_speculative(
        target,
        ids,
        SamplingParams(max_new_tokens=32, ignore_eos=True, temperature=0.8, top_k=50, seed=8),
        draft=draft,
    )
    assert other.token_ids != first.token_ids


def test_speculative_bad_input_is_refused(context_model, tiny_tokenizer):
    target = Decoder(build_decoder(context_model), tiny_tokenizer)
    other = Decoder(build_decoder(build_tiny_llama(128)), tiny_tokenizer)
    with pytest.raises(SlimlmError, match="share the target's tokenizer"):
        generate_speculative(target, prompt(5), SamplingParams(), draft=other)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3", "qwen3_moe", "olmoe"])
def test_speculative_output_is_the_plain_greedy_output_in_every_family(family, tiny_tokenizer):
    """A draft of the same family guesses; Gemma 3's guesses are checked by sliding and global
    layers (its window of 8 is outgrown by the prompt); a mixture of experts routes each guess."""
    from tests.tiny_families import build_tiny

    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    target = Decoder(
        build_decoder(build_tiny(family, len(tiny_tokenizer), initializer_range=0.2)),
        tiny_tokenizer,
        reuse_prefixes=False,
    )
    draft = Decoder(
        build_decoder(build_tiny(family, len(tiny_tokenizer), seed=5, initializer_range=0.2)), tiny_tokenizer
    )
    ids = prompt(12, 1)
    fast, stats = generate_speculative(target, ids, params, draft=draft, lookahead=4)
    assert fast.token_ids == target.generate_ids([ids], params)[0].token_ids and stats.new_tokens == 32
