"""Continuous batching: sequences that join and leave a running batch decode as they would alone."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from slimlm.inference.batching import BatcherClosed, ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder, Generation
from slimlm.inference.model import Segment
from slimlm.inference.sampling import SamplingParams


def prompt(length, seed):
    return torch.randint(4, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float-cache", "int8-cache"])
def test_requests_joining_at_different_times_get_their_solo_output(
    context_model, tiny_tokenizer, cache_dtype
):
    alone = Decoder(build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype)
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer, cache_dtype=cache_dtype),
        max_batch=3,
        max_seq=96,
    )
    requests = [
        (prompt(5, 1), 40),
        (prompt(17, 2), 8),
        (prompt(9, 3), 24),
        (prompt(3, 4), 16),
    ]  # four requests, three rows
    results, order = {}, []
    started = threading.Barrier(len(requests))

    def client(index, ids, new_tokens):
        started.wait()
        *pieces, generation = batcher.submit(ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        assert isinstance(generation, Generation) and "".join(pieces) == generation.text
        results[index] = generation
        order.append(index)

    threads = [threading.Thread(target=client, args=(i, ids, n)) for i, (ids, n) in enumerate(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, (ids, new_tokens) in enumerate(requests):
        expected = alone.generate_ids([ids], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))[0]
        assert results[index].token_ids == expected.token_ids, index
    assert order.index(1) < order.index(0)  # the short answer left while the long one was still decoding
    assert batcher.passes < sum(n for _, n in requests) - len(requests)  # passes were shared
    assert batcher.decoded == sum(n for _, n in requests) - len(
        requests
    )  # each first token comes from its prefill
    assert (
        0 < batcher.step_tokens < batcher.decoded and batcher.step_s > 0
    )  # some decoded beside prompt chunks, some alone
    assert sorted(batcher.free_rows) == [0, 1, 2]  # every row came back


@pytest.mark.parametrize(
    "cache_dtype, source_name, kernel",
    [
        (None, None, True),
        (torch.int8, None, True),
        (None, 8, True),
        (None, "gemma3", True),
        (None, "qwen3_moe", True),
        (None, None, False),
    ],
    ids=[
        "float-cache",
        "int8-cache",
        "sliding-window-8",
        "gemma3-sliding-and-global-layers",
        "qwen3-moe-experts",
        "torch-attention",
    ],
)
def test_a_packed_pass_matches_each_segment_run_on_its_own(
    context_model, tiny_tokenizer, monkeypatch, cache_dtype, source_name, kernel
):
    """Decode steps, a prompt's chunk and a run of guesses in one packed pass (given out of
    order) give the logits and cache contents of the same work done as separate passes; with
    a sliding window narrower than the rows (mistral), each query sees only its last 8 slots;
    Gemma 3's sliding layer does so, its global layer sees every slot; a mixture of experts
    routes each packed token on its own.
    Where slimlm's attention kernel runs, the guesses are queries of the batched decode step
    (and, run on their own, the kernel's queries still); with torch's attention, a call of their
    own. The separate passes attend in torch."""
    from slimlm.inference import cpu_kernels
    from tests.conftest import build_tiny_mistral

    if not kernel:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    from tests.tiny_families import DENSE_FIRST_LAYER, build_tiny

    sources = {
        None: lambda: context_model,
        8: lambda: build_tiny_mistral(len(tiny_tokenizer), 8),
        "gemma3": lambda: build_tiny("gemma3_text", len(tiny_tokenizer), initializer_range=0.2),
        "qwen3_moe": lambda: build_tiny(
            "qwen3_moe", len(tiny_tokenizer), initializer_range=0.2, **DENSE_FIRST_LAYER
        ),
    }
    source = sources[source_name]()
    packed, separate, alone = (build_decoder(source) for _ in range(3))
    for block in separate.layers:  # the reference attends in torch
        block.attention.decode_kernel = False
    for model in (packed, separate, alone):
        model.setup_cache(4, 64, cache_dtype)
        for row, length in ((0, 10), (1, 7), (2, 5)):
            model(torch.tensor([prompt(length, row)]), 0, first_row=row)
    chunk, run = prompt(12, 7), prompt(4, 8)
    with torch.inference_mode():
        got = packed.forward_segments(
            [Segment(0, 10, [9]), Segment(3, 0, chunk), Segment(1, 7, run), Segment(2, 5, [11])], [1, 1, 4, 1]
        )
        expected = [
            separate(torch.tensor([[9]]), 10, first_row=0)[0],
            separate(torch.tensor([chunk]), 0, first_row=3)[0, -1:],
            separate(torch.tensor([run]), 7, first_row=1)[0],
            separate(torch.tensor([[11]]), 5, first_row=2)[0],
        ]
        run_alone = alone(torch.tensor([run]), 7, first_row=1)[
            0
        ]  # with the kernel, a short run of its own: one query per token
    for part, reference in zip([*got, run_alone], [*expected, expected[2]]):
        torch.testing.assert_close(part, reference, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(packed.cache_tensors(), separate.cache_tensors()):
        torch.testing.assert_close(
            mine, theirs, rtol=0, atol=1 if mine.dtype == torch.int8 else 1e-5
        )  # packing changes the matmuls' summation order
    assert packed.layers[0].attention.decode_kernel == (kernel and cpu_kernels.available())
    with pytest.raises(Exception, match="a segment of 4 tokens from slot 62 of row 1 does not fit"):
        packed.forward_segments([Segment(1, 62, run)], [1])
    with pytest.raises(Exception, match="logits of 2 positions asked of a segment of 1 tokens"):
        packed.forward_segments([Segment(1, 5, [3])], [2])


def test_stop_strings_and_end_of_sequence_free_the_row(context_model, tiny_tokenizer):
    decoder = Decoder(build_decoder(context_model), tiny_tokenizer)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=3)
    free = decoder.generate(["the story of"], params)[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=1, max_seq=64
    )
    ids = tiny_tokenizer("the story of", add_special_tokens=False)["input_ids"]
    *_, generation = batcher.submit(
        ids, SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=3, stop=[stop])
    )
    assert generation.finish_reason == "stop" and generation.text == free.text[: free.text.index(stop)]
    assert batcher.free_rows == [0]


def test_a_cancelled_request_leaves_at_the_next_step_and_a_failing_one_fails_alone(
    context_model, tiny_tokenizer, monkeypatch
):
    from slimlm.inference import batching

    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=2, max_seq=512
    )
    abandoned = batcher.submit(prompt(5, 1), SamplingParams(max_new_tokens=480, ignore_eos=True))
    next(abandoned)  # decoding has started
    abandoned.cancel()
    deadline = time.time() + 30
    while batcher.running and time.time() < deadline:
        time.sleep(0.01)
    assert not batcher.running and sorted(batcher.free_rows) == [0, 1] and batcher.steps < 400
    with pytest.raises(Exception, match="cancelled"):
        list(abandoned)
    # a request whose sampling raises gets its error; one decoding beside it is unharmed
    sample = batching.next_tokens
    monkeypatch.setattr(
        batching,
        "next_tokens",
        lambda logits, params, seen, generator: (
            sample(logits, params, seen, generator) if params.seed != 13 else 1 / 0
        ),
    )
    healthy = batcher.submit(prompt(5, 2), SamplingParams(max_new_tokens=40, ignore_eos=True))
    with pytest.raises(ZeroDivisionError):
        list(
            batcher.submit(
                prompt(4, 3), SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=1.0, seed=13)
            )
        )
    *_, generation = healthy
    assert len(generation.token_ids) == 40 and sorted(batcher.free_rows) == [0, 1]


def test_a_long_prompt_goes_in_by_chunks_beside_the_running_answers_steps(context_model, tiny_tokenizer):
    """A 100-token prompt prefilled 8 tokens a pass: the answer already running takes a step
    in each pass with a chunk instead of waiting for the whole prefill, and both decode as alone."""
    alone = Decoder(build_decoder(context_model), tiny_tokenizer)
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=2, max_seq=160, prefill_chunk=8
    )
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    running = batcher.submit(prompt(5, 1), params)
    next(running)  # it is decoding
    passes, forward_segments = [], batcher.model.forward_segments
    batcher.model.forward_segments = lambda segments, logits_of: (
        passes.append([len(s.tokens) for s in segments]) or forward_segments(segments, logits_of)
    )
    *_, long_answer = batcher.submit(prompt(100, 2), SamplingParams(max_new_tokens=1, ignore_eos=True))
    with_chunks = [tokens for tokens in passes if sum(tokens) > 1]
    assert len(with_chunks) == 13 and all(
        tokens[0] == 1 and tokens[1] <= 8 for tokens in with_chunks
    )  # the running answer's step beside each chunk
    *_, running_answer = running
    assert running_answer.token_ids == alone.generate_ids([prompt(5, 1)], params)[0].token_ids
    assert (
        long_answer.token_ids
        == alone.generate_ids([prompt(100, 2)], SamplingParams(max_new_tokens=1, ignore_eos=True))[
            0
        ].token_ids
    )
    with pytest.raises(Exception, match="prefill_chunk=0 must be at least 1"):
        ContinuousBatcher(alone, max_batch=1, max_seq=16, prefill_chunk=0)
    with pytest.raises(Exception, match="the prompt is empty"):
        batcher.submit([], params)


def test_prompts_arriving_together_share_a_pass_unless_one_computes_anothers_start(
    context_model, tiny_tokenizer
):
    """Three short prompts admitted together are prefilled in one pass (the weights read once
    for all) whose room left is not filled with part of a long prompt; of two that start alike,
    the second waits a pass and copies the start the first computed instead of computing it
    too. Every answer is as alone."""
    alone = Decoder(build_decoder(context_model), tiny_tokenizer, reuse_prefixes=False)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    with ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=6, max_seq=128, prefill_chunk=64
    ) as batcher:
        release, passes, forward_segments = threading.Event(), [], batcher.model.forward_segments

        def held_back(segments, logits_of):  # the first pass waits until every request is queued
            release.wait(timeout=60)
            passes.append([(s.row, s.start, len(s.tokens)) for s in segments])
            return forward_segments(segments, logits_of)

        batcher.model.forward_segments = held_back
        first = batcher.submit(prompt(6, 0), params)
        while not batcher.prefilling:
            time.sleep(0.001)
        shared = prompt(30, 1)
        prompts = [prompt(9, 2), prompt(12, 3), shared + prompt(5, 4), shared + prompt(5, 5), prompt(100, 6)]
        submissions = [batcher.submit(ids, params) for ids in prompts]
        release.set()
        answers = [list(submission)[-1] for submission in (first, *submissions)]
    for ids, answer in zip([prompt(6, 0), *prompts], answers):
        assert answer.token_ids == alone.generate_ids([ids], params)[0].token_ids
    assert passes[0] == [(0, 0, 6)]
    assert passes[1][1:] == [
        (1, 0, 9),
        (2, 0, 12),
        (3, 0, 35),
    ]  # the first prompt's step, then three prompts in one pass, not 8 tokens of the long one
    assert (
        passes[2][-1][1:] == (30, 5) and answers[4].cached_tokens == 30
    )  # the fourth copied the shared start, prefilled the rest


@pytest.mark.parametrize("model_name", ["context_model", "tiny_model"])
def test_prompt_lookup_guesses_change_no_answer(model_name, request, tiny_tokenizer):
    """With prompt lookup (`lookahead`), greedy answers decoded together are plain decoding's
    token for token, repetition penalty and stop strings too: on the context-sensitive model
    its guesses are refused, on the default-init one (which repeats its context) kept, several
    tokens a pass."""
    model = request.getfixturevalue(model_name)
    repeated = prompt(6, 1) * 4  # n-grams for lookup to find
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    requests = [
        (repeated, greedy),
        (prompt(9, 2), greedy),
        (repeated, SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3)),
    ]
    alone = Decoder(build_decoder(model), tiny_tokenizer, reuse_prefixes=False)
    plain = [alone.generate_ids([ids], params)[0] for ids, params in requests]
    stop = plain[2].text[len(plain[2].text) // 2 :][:3]
    requests.append(
        (repeated, SamplingParams(max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3, stop=[stop]))
    )
    with ContinuousBatcher(
        Decoder(build_decoder(model), tiny_tokenizer), max_batch=4, max_seq=128, lookahead=4
    ) as batcher:
        submissions = [batcher.submit(ids, params) for ids, params in requests]
        answers = [list(submission)[-1] for submission in submissions]
    for answer, expected in zip(answers, plain):
        assert answer.token_ids == expected.token_ids
    assert (
        answers[3].finish_reason == "stop" and answers[3].text == plain[2].text[: plain[2].text.index(stop)]
    )
    assert batcher.proposed > 0
    if model_name == "tiny_model":
        assert batcher.accepted > 0 and batcher.passes < 40  # several tokens a pass
    assert batcher.decoded == sum(len(answer.token_ids) for answer in answers) - len(
        answers
    )  # every token but the first from a step, several in some
    with pytest.raises(Exception, match="give lookahead >= 0"):
        ContinuousBatcher(alone, max_batch=1, max_seq=16, lookahead=-1)


def test_sampled_answers_with_guesses_are_what_generate_speculative_draws(tiny_model, tiny_tokenizer):
    """Sampled answers with prompt lookup's guesses, three decoded together: each is, token for
    token, the answer `generate_speculative` draws alone from the same seed. Both check guesses by
    speculative sampling with the request's own generator (`judge`, whose tokens follow the
    model's distribution: tests/test_speculative.py). Equal draws need equal logits: both paths
    attend in the same kernel (or both in torch), one query per token."""
    from slimlm.inference.speculative import generate_speculative

    repeated = prompt(6, 1) * 4  # n-grams for lookup to find; top-k 3 keeps the answers repeating too
    requests = [
        SamplingParams(max_new_tokens=30, temperature=1.0, top_k=3, seed=seed, ignore_eos=True)
        for seed in range(6)
    ]
    alone = Decoder(build_decoder(tiny_model), tiny_tokenizer, reuse_prefixes=False)
    expected = [
        generate_speculative(alone, repeated, params, lookahead=4)[0].token_ids for params in requests
    ]
    with ContinuousBatcher(
        Decoder(build_decoder(tiny_model), tiny_tokenizer), max_batch=3, max_seq=64, lookahead=4
    ) as batcher:
        submissions = [batcher.submit(repeated, params) for params in requests]
        answers = [list(submission)[-1].token_ids for submission in submissions]
    assert answers == expected
    assert 0 < batcher.accepted < batcher.proposed  # guesses were made, and sampling refused some


def test_a_short_prompt_arriving_behind_a_long_one_is_prefilled_first(context_model, tiny_tokenizer):
    """A 400-token prompt goes in 4 tokens a chunk (100 chunks); a 5-token prompt arriving after
    its first chunk is due sooner, so it gets its answer while the long prompt is still going in
    (prefilled oldest first, it waited for all 100 chunks); both answers are as alone."""
    alone = Decoder(build_decoder(context_model), tiny_tokenizer)
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=2, max_seq=512, prefill_chunk=4
    )
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    long_request = batcher.submit(prompt(400, 1), params)
    while batcher.chunks < 1:
        time.sleep(0.001)
    *_, short_answer = batcher.submit(prompt(5, 2), params)
    assert batcher.prefilling and batcher.chunks < 100  # the long prompt is not all in yet
    *_, long_answer = long_request
    for ids, answer in ((prompt(400, 1), long_answer), (prompt(5, 2), short_answer)):
        assert answer.token_ids == alone.generate_ids([ids], params)[0].token_ids
    batcher.close()


def test_closing_fails_unfinished_requests_and_refuses_new_ones(context_model, tiny_tokenizer):
    batcher = ContinuousBatcher(
        Decoder(build_decoder(context_model), tiny_tokenizer), max_batch=1, max_seq=512
    )
    decoding = batcher.submit(prompt(5, 1), SamplingParams(max_new_tokens=480, ignore_eos=True))
    queued = batcher.submit(
        prompt(5, 2), SamplingParams(max_new_tokens=8, ignore_eos=True)
    )  # waits for the one row
    next(decoding)
    with batcher:
        pass  # leaving the block closes it
    assert not batcher.worker.is_alive() and batcher.free_rows == [0]
    for submission in (decoding, queued):
        with pytest.raises(BatcherClosed, match="closed before this request finished"):
            list(submission)
    with pytest.raises(BatcherClosed, match="takes no more requests"):
        batcher.submit(prompt(5, 3), SamplingParams(max_new_tokens=8))
    batcher.close()  # again: nothing left to do


EXITING_MID_ANSWER = """
import sys
sys.path.insert(0, sys.argv[1])
from conftest import build_tiny_llama, build_tokenizer
from slimlm.inference.batching import BatcherClosed, ContinuousBatcher
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.sampling import SamplingParams

tokenizer = build_tokenizer()
batcher = ContinuousBatcher(Decoder(build_decoder(build_tiny_llama(len(tokenizer))), tokenizer), \
max_batch=2, max_seq=512)
answers = [batcher.submit(tokenizer("hello there")["input_ids"], \
SamplingParams(max_new_tokens=480, ignore_eos=True)) for _ in range(2)]
next(answers[0])
print("exiting while the worker decodes")
"""


def test_the_process_exits_cleanly_while_the_worker_is_decoding(tmp_path):
    """Python exiting while the batcher's thread was inside a torch op aborted the process
    ("terminate called without an active exception", exit 134): the worker stops at exit."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_MID_ANSWER)
    finished = subprocess.run(
        [sys.executable, str(script), str(Path(__file__).parent)], capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0 and "terminate called" not in finished.stderr, finished.stderr[-2000:]
    assert "exiting while the worker decodes" in finished.stdout
