"""A prompt that starts with what a cache row holds (the conversation so far) prefills only the
rest, and decodes the same tokens as when prefilled whole."""

import pytest
import torch

from slimlm.errors import SlimlmError
from slimlm.inference.batching import ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.speculative import generate_speculative


def prompt(length, seed):
    return torch.randint(4, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float-cache", "int8-cache"])
def test_a_conversation_prefills_only_its_new_turn(context_model, tiny_tokenizer, cache_dtype):
    reusing = Decoder(build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype)
    fresh = Decoder(
        build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype, reuse_prefixes=False
    )

    def check(ids, cached):
        """`ids` decoded by `reusing` with `cached` of its tokens found in the cache, as `fresh`
        decodes them whole."""
        answer, whole = reusing.generate_ids([ids], PARAMS)[0], fresh.generate_ids([ids], PARAMS)[0]
        assert (answer.cached_tokens, whole.cached_tokens) == (cached, 0)
        assert answer.token_ids == whole.token_ids
        return answer

    first = prompt(30, 1)
    answer = check(first, 0)
    second = first + answer.token_ids + prompt(9, 2)  # the next turn: the conversation so far and a question
    check(
        second, len(first) + len(answer.token_ids) - 1
    )  # all but the answer's last token (chosen, never fed back)
    check(first[:20] + prompt(5, 3), 20)  # a prompt that leaves the conversation midway reuses what it shares
    check(first[:20] + prompt(5, 3), 24)  # the same prompt again: all but its last token
    # a batch and a new cache write row 0 without recording it: nothing is reused after them
    reusing.generate_ids([first, second], PARAMS)
    check(first, 0)
    reusing.model.setup_cache(1, 128, cache_dtype)
    check(first, 0)
    generate_speculative(reusing, second, PARAMS)  # records what it fed to the row, as plain decoding does
    check(second, len(second) - 1)


def test_the_batcher_gives_a_request_the_row_holding_the_start_of_its_prompt(context_model, tiny_tokenizer):
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=3, max_seq=128, prefill_chunk=8
    )
    first, other = prompt(30, 1), prompt(30, 4)
    *_, answer = batcher.submit(first, PARAMS)  # into row 0
    *_, unrelated = batcher.submit(other, PARAMS)  # shares nothing with row 0: the row freed longest ago, 1
    assert (answer.cached_tokens, unrelated.cached_tokens) == (0, 0)
    second = first + answer.token_ids + prompt(9, 2)
    chunks = batcher.chunks
    *_, reply = batcher.submit(second, PARAMS)
    assert reply.cached_tokens == len(first) + len(answer.token_ids) - 1
    assert batcher.chunks - chunks == 2  # the 10 tokens not in row 0, 8 a chunk
    for ids, generation in ((second, reply), (other, unrelated)):
        assert generation.token_ids == fresh.generate_ids([ids], PARAMS)[0].token_ids
    batcher.close()


@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float-cache", "int8-cache"])
def test_requests_sharing_a_system_prompt_copy_it_from_the_row_that_prefilled_it(
    context_model, tiny_tokenizer, cache_dtype
):
    fresh = Decoder(
        build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype, reuse_prefixes=False
    )
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype),
        max_batch=2,
        max_seq=128,
        prefill_chunk=8,
    )
    system = prompt(40, 7)
    first, second = system + prompt(8, 8), system + prompt(8, 9)
    submissions = [
        batcher.submit(first, PARAMS),
        batcher.submit(second, PARAMS),
    ]  # both at once: the first is due first
    (*_, one), (*_, other) = submissions
    assert (one.cached_tokens, other.cached_tokens) == (
        0,
        40,
    )  # the system prompt copied from the first's row
    assert batcher.chunks == 6 + 1
    for ids, generation in ((first, one), (second, other)):
        assert generation.token_ids == fresh.generate_ids([ids], PARAMS)[0].token_ids
    batcher.close()
    with ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype, reuse_prefixes=False),
        max_batch=2,
        max_seq=128,
        prefill_chunk=8,
    ) as plain:
        submissions = [plain.submit(first, PARAMS), plain.submit(second, PARAMS)]
        assert [list(s)[-1].cached_tokens for s in submissions] == [0, 0] and plain.chunks == 12


def test_a_conversation_keeps_its_row_when_another_shares_its_system_prompt(context_model, tiny_tokenizer):
    """Another conversation starting with the same system prompt takes an empty row and copies
    the shared start, rather than overwriting the row that holds the first conversation."""
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=3, max_seq=128
    )
    system = prompt(10, 7)
    *_, first = batcher.submit(system + prompt(20, 1), PARAMS)
    *_, other = batcher.submit(system + prompt(20, 2), PARAMS)
    following = system + prompt(20, 1) + first.token_ids + prompt(9, 3)
    *_, reply = batcher.submit(following, PARAMS)
    assert (first.cached_tokens, other.cached_tokens, reply.cached_tokens) == (
        0,
        10,
        30 + len(first.token_ids) - 1,
    )
    assert reply.token_ids == fresh.generate_ids([following], PARAMS)[0].token_ids
    batcher.close()


def test_a_next_turn_that_drops_answer_tokens_still_takes_its_own_row(context_model, tiny_tokenizer):
    """A next turn whose prompt has the previous answer only in part (a stop string cut it, the
    template re-tokenized it) still continues its previous prompt: it takes that row, not
    another conversation's."""
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=2, max_seq=128
    )
    *_, b_answer = batcher.submit(prompt(20, 1), PARAMS)  # row 0
    *_, a_answer = batcher.submit(prompt(20, 2), PARAMS)  # row 1
    *_, a_next = batcher.submit(prompt(20, 2) + a_answer.token_ids[:-3] + prompt(5, 3), PARAMS)
    *_, b_next = batcher.submit(prompt(20, 1) + b_answer.token_ids + prompt(5, 4), PARAMS)
    assert a_next.cached_tokens == 20 + len(a_answer.token_ids) - 3
    assert b_next.cached_tokens == 20 + len(b_answer.token_ids) - 1  # its row was left to it
    batcher.close()


def test_an_answer_stopped_by_its_client_can_be_continued(context_model, tiny_tokenizer):
    """A client that stops an answer and sends the next turn with the part it got finds that
    part in the cache, one at a time and batched."""
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    ids = prompt(20, 1)
    answer = fresh.generate_ids([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids

    def check(reply, following, cached):
        assert (
            reply.cached_tokens == cached
            and reply.token_ids == fresh.generate_ids([following], PARAMS)[0].token_ids
        )

    seen = []

    def stop_after_11(row, token):
        seen.append(token)
        if len(seen) == 11:
            raise KeyboardInterrupt  # as a client going away stops the decoder's loop

    decoder = Decoder(build_decoder(context_model), tiny_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        decoder.generate_ids([ids], SamplingParams(max_new_tokens=40, ignore_eos=True), stop_after_11)
    following = ids + answer[:12] + prompt(5, 9)
    check(
        decoder.generate_ids([following], PARAMS)[0], following, len(ids) + 10
    )  # 11 tokens chosen, the first 10 fed back: no more

    with ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=1, max_seq=512
    ) as batcher:
        stopped = batcher.submit(ids, SamplingParams(max_new_tokens=480, ignore_eos=True))
        for _ in range(11):
            next(stopped)  # at least 11 tokens decoded
        stopped.cancel()
        with pytest.raises(SlimlmError, match="cancelled"):
            list(stopped)  # it was stopped, not finished
        following = ids + answer[:10] + prompt(5, 9)
        check(list(batcher.submit(following, PARAMS))[-1], following, len(ids) + 10)


@pytest.mark.parametrize("cache_rows", [1, 3])
def test_cache_rows_beyond_the_batch_keep_more_conversations_for_their_next_turn(
    context_model, tiny_tokenizer, cache_rows
):
    """Three conversations take turns through a batcher decoding one at a time: with three cache
    rows each next turn finds its own, with one the others have overwritten it."""
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    with ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer),
        max_batch=1,
        max_seq=128,
        prefill_chunk=8,
        cache_rows=cache_rows,
    ) as batcher:
        firsts = [prompt(20, seed) for seed in (1, 2, 3)]
        answers = [list(batcher.submit(ids, PARAMS))[-1] for ids in firsts]
        for seed, (ids, answer) in enumerate(zip(firsts, answers)):
            following = ids + answer.token_ids + prompt(5, 10 + seed)
            *_, reply = batcher.submit(following, PARAMS)
            assert reply.cached_tokens == (20 + len(answer.token_ids) - 1 if cache_rows == 3 else 0)
            assert reply.token_ids == fresh.generate_ids([following], PARAMS)[0].token_ids


def test_no_more_than_max_batch_sequences_decode_however_many_cache_rows(context_model, tiny_tokenizer):
    fresh = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    with ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer),
        max_batch=2,
        max_seq=128,
        prefill_chunk=8,
        cache_rows=5,
    ) as batcher:
        busy, forward_segments = [], batcher.model.forward_segments

        def counting(segments, logits_of):
            busy.append((len(batcher.prefilling) + len(batcher.running), len({s.row for s in segments})))
            return forward_segments(segments, logits_of)

        batcher.model.forward_segments = counting
        submissions = [batcher.submit(prompt(20, seed), PARAMS) for seed in range(5)]
        for seed, submission in enumerate(submissions):
            assert (
                list(submission)[-1].token_ids == fresh.generate_ids([prompt(20, seed)], PARAMS)[0].token_ids
            )
    assert max(admitted for admitted, _ in busy) == 2 and max(rows for _, rows in busy) == 2
    with pytest.raises(SlimlmError, match="max_batch <= cache_rows"):
        ContinuousBatcher(
            Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=3, max_seq=128, cache_rows=2
        )
