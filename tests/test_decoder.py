"""The bundled decoder against transformers, and its kernels against their dequantized reference."""

import os
import re
import time
from dataclasses import replace

import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.inference import cpu_kernels
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.decoder import Decoder
from slimlm.inference.model import ModelArgs, Transformer
from slimlm.inference.sampling import SamplingParams, filter_top_k_top_p, penalize_repetition
from slimlm.pipeline import RunState
from tests.conftest import build_tiny_llama


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(**params))
    return model


def prompt_ids(length, vocab, seed=0):
    return torch.randint(4, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def forced_logits(decoder, prompts, answers):
    """Next-token logits [steps, batch, vocab] of `decoder` fed its (left-padded) prompts and
    then the given answer tokens, whatever it would have chosen: two decoders compared on the
    same inputs, where bf16 rounding would make their greedy choices part at a near-tie."""
    longest, steps = max(map(len, prompts)), len(answers[0])
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts])
    pad = torch.tensor([longest - len(p) for p in prompts])
    pad = pad if pad.any() else None
    decoder.ensure_cache(len(prompts), longest + steps)
    logits = [decoder.prefill(tokens, pad=pad)]
    for step in range(steps - 1):
        logits.append(
            decoder.step(torch.tensor([[answer[step]] for answer in answers]), longest + step, pad)[:, -1]
        )
    return torch.stack(logits).float()


def assert_same_decoding(decoder, reference, prompts, params, share=0.03):
    """`decoder` decodes `prompts` as `reference` does: the same tokens, or where they part, the
    same logits along the reference's tokens within `share` of the largest (a few bf16 steps)."""
    expected = [g.token_ids for g in reference.generate_ids(prompts, params)]
    if [g.token_ids for g in decoder.generate_ids(prompts, params)] != expected:
        wanted = forced_logits(reference, prompts, expected)
        torch.testing.assert_close(
            forced_logits(decoder, prompts, expected), wanted, rtol=0, atol=share * float(wanted.abs().max())
        )


def hf_greedy(model, ids, new_tokens):
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def test_logits_match_transformers(context_model, tiny_tokenizer):
    decoder = build_decoder(context_model)
    decoder.setup_cache(1, 64)
    ids = torch.tensor([prompt_ids(40, context_model.config.vocab_size)])
    with torch.no_grad():
        ours = decoder(ids, 0, torch.zeros(1, dtype=torch.long))
        torch.testing.assert_close(ours, context_model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": False}, {"model_type": "qwen2"}, {"model_type": "mistral"}],
    ids=["llama", "untied", "qwen2-bias", "mistral-window-8"],
)
def test_greedy_decoding_is_token_identical_to_transformers(tiny_tokenizer, overrides):
    """The mistral model's 8-position sliding window is outgrown by its prompt alone."""
    from tests.conftest import build_tiny_llama, build_tiny_mistral

    if overrides.get("model_type") == "mistral":
        model = build_tiny_mistral(len(tiny_tokenizer))
    elif overrides.get("model_type") == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=len(tiny_tokenizer),
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                max_position_embeddings=512,
                initializer_range=0.2,
            )
        ).eval()
    else:
        model = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2, **overrides)
    ids = prompt_ids(12, model.config.vocab_size)
    decoder = Decoder(build_decoder(model), tiny_tokenizer)
    (ours,) = decoder.generate_ids([ids], SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert ours.token_ids == hf_greedy(model, ids, 64)


@pytest.mark.parametrize(
    "params",
    [
        dict(bits=4, group_size=32),
        dict(bits=4, group_size=64, symmetric=False),
        dict(bits=8),
        dict(bits=8, symmetric=False),
        dict(bits=3, group_size=32),
    ],
    ids=["int4-g32", "int4-g64-asym", "int8", "int8-asym", "int3-dequant"],
)
def test_packed_kernels_match_the_dequantized_reference(context_model, tiny_tokenizer, tmp_path, params):
    model = quantized(
        context_model, tiny_tokenizer, tmp_path, targets=[r"model\.layers\.\d+\..*", "lm_head"], **params
    )
    fast, reference = build_decoder(model), build_decoder(model, kernels=False)
    kernels = describe_kernels(fast)
    expected = {4: "int4-tinygemm", 8: "int8-pack", 3: "dequant"}[params["bits"]]
    assert kernels[expected] == 4 * model.config.num_hidden_layers and kernels[f"head: {expected}"] == 1
    ids = torch.tensor([prompt_ids(20, model.config.vocab_size)])
    pad = torch.zeros(1, dtype=torch.long)
    for decoder in (fast, reference):
        decoder.setup_cache(1, 32)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, 0, pad), reference(ids, 0, pad), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(reference(ids, 0, pad), model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "cache_dtype, slot_bytes", [(None, 16 * 4), (torch.int8, 16 + 4)], ids=["fp32", "int8"]
)
def test_the_cache_is_allocated_once(tiny_model, tiny_tokenizer, cache_dtype, slot_bytes):
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer, cache_dtype=cache_dtype)
    decoder.generate_ids([prompt_ids(10, 300)], SamplingParams(max_new_tokens=40, ignore_eos=True))
    pointers = [t.data_ptr() for t in decoder.model.cache_tensors()]
    decoder.generate_ids([prompt_ids(5, 300, seed=1)], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert [t.data_ptr() for t in decoder.model.cache_tensors()] == pointers
    # k and v, 2 layers, batch 1, 2 kv heads, 50 slots; a slot of head dim 16 in fp32, or 16 int8
    # codes and a float32 scale
    assert decoder.model.cache_bytes() == 2 * 2 * 1 * 2 * 50 * slot_bytes


def test_a_cache_that_fails_to_grow_leaves_none_behind(tiny_model, tiny_tokenizer, monkeypatch):
    """An allocation that fails halfway (out of memory) must not leave layers of two shapes:
    a compiled step checks only the first layer's. The whole cache goes; the next generation
    allocates a new one and decodes as a fresh decoder does."""
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    decoder.generate_ids([prompt_ids(6, 300)], params)
    decoder.remember(0, prompt_ids(6, 300), [1, 2])
    zeros, calls = torch.zeros, []

    def out_of_memory_at_the_third(*args, **kwargs):
        if args[0][2:3] == (64,):  # the new cache's tensors: keys, then values, per layer
            calls.append(args)
        if len(calls) == 3:  # the second layer's keys
            raise RuntimeError("out of memory")
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", out_of_memory_at_the_third)
    with pytest.raises(RuntimeError, match="out of memory"):
        decoder.model.setup_cache(1, 64, keep=True)
    monkeypatch.undo()
    assert decoder.model.cache_tensors() == [] and (
        decoder.model.max_batch,
        decoder.model.max_seq,
        decoder.model.held,
    ) == (0, 0, {})
    for step in (
        lambda: decoder.model.step_static(torch.tensor([[1]]), torch.tensor(0)),
        lambda: decoder.model.copy_slots(0, 0, 0, 4),
    ):
        with pytest.raises(SlimlmError, match="the cache holds 0 sequences of 0 slots"):
            step()
    prompt = prompt_ids(30, 300, seed=2)
    fresh = Decoder(build_decoder(tiny_model), tiny_tokenizer).generate_ids([prompt], params)
    assert decoder.generate_ids([prompt], params) == fresh


def test_an_int8_cache_stays_close_to_the_float_cache(context_model, tiny_tokenizer):
    """Prefill and then decode token by token with each cache: the int8 cache's logits stay
    within a small KL of the fp32 cache's at every step. Measured: at most 0.00095; codes
    truncated instead of rounded give 0.0074, a 7-bit cache 0.0070 (on the default-init tiny
    model even a 4-bit cache stayed under 1e-5: its layers barely move its logits)."""
    decoders = {dtype: build_decoder(context_model) for dtype in (None, torch.int8)}
    ids = prompt_ids(40, context_model.config.vocab_size)
    logits = {}
    with torch.no_grad():
        for dtype, decoder in decoders.items():
            decoder.setup_cache(1, 48, dtype)
            steps = [decoder(torch.tensor([ids[:24]]), 0)[:, -1]]
            steps += [decoder(torch.tensor([[token]]), 24 + i)[:, -1] for i, token in enumerate(ids[24:])]
            logits[dtype] = torch.cat(steps).log_softmax(-1)
    reference, rounded = logits[None], logits[torch.int8]
    kl = (reference.exp() * (reference - rounded)).sum(-1)
    assert 0 < kl.max() < 3e-3
    assert decoders[torch.int8].layers[0].attention.k_cache.dtype == torch.int8


def test_a_batch_of_different_lengths_decodes_like_each_prompt_alone(context_model, tiny_tokenizer):
    decoder = Decoder(build_decoder(context_model), tiny_tokenizer)
    prompts = [prompt_ids(n, 300, seed=n) for n in (3, 17, 9)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    together = decoder.generate_ids(prompts, params)
    alone = [
        decoder.generate_ids([p], params)[0] for p in prompts
    ]  # the same decoder: its cache holds 3 rows, one is used
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert decoder.model.max_batch == 3


def test_sampling_is_reproducible_with_a_seed_and_varies_without(tiny_model, tiny_tokenizer):
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    params = SamplingParams(
        max_new_tokens=24,
        temperature=1.5,
        top_k=50,
        top_p=0.95,
        repetition_penalty=1.2,
        seed=7,
        ignore_eos=True,
    )
    first, second = (decoder.generate_ids([prompt_ids(8, 300)], params)[0].token_ids for _ in range(2))
    assert first == second
    other = decoder.generate_ids([prompt_ids(8, 300)], SamplingParams(**{**params.__dict__, "seed": 8}))[
        0
    ].token_ids
    assert other != first


def test_top_k_top_p_and_repetition_penalty_follow_their_definitions():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_top_k_top_p(logits, 2, None)).tolist() == [[False, False, True, True]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, 0.03
    kept = ~torch.isinf(filter_top_k_top_p(logits, None, 0.8))
    assert kept.tolist() == [[True, True, False, False]] and probs[0] < 0.8 <= probs[:2].sum()
    assert (
        ~torch.isinf(filter_top_k_top_p(logits, None, 0.5))
    ).sum() == 1  # the top token alone already reaches 0.5
    seen = torch.tensor([[True, False, True, True]])
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, 1.0, 0.0, -2.0]]


def test_stop_strings_end_the_text_and_streaming_gives_the_same_text(tiny_model, tiny_tokenizer):
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    sampled = dict(
        max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=3
    )  # a random model repeats itself when greedy
    free = decoder.generate(["the story of"], SamplingParams(**sampled))[0]
    assert free.finish_reason == "length" and len(free.text) > 20
    stop = next(
        free.text[i : i + 4]
        for i in range(len(free.text) // 2, len(free.text))
        if free.text.index(free.text[i : i + 4]) > len(free.text) // 3
    )
    stopped = decoder.generate(["the story of"], SamplingParams(**sampled, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(stop)]
    streamed = list(decoder.stream("the story of", SamplingParams(**sampled, stop=[stop])))
    assert "".join(streamed) == stopped.text and len(streamed) > 1
    results = []  # each stream's own Generation, whatever other requests the decoder served since
    assert "".join(decoder.stream("the story of", SamplingParams(**sampled), results=results)) == free.text
    assert (
        len(results) == 1 and replace(results[0], cached_tokens=0) == free
    )  # the same prompt again: all but its last token were in the cache
    ids = prompt_ids_of(tiny_tokenizer, "the story of")
    written, results = [], []
    decoder.write_ids(ids, SamplingParams(**sampled, stop=[stop]), written.append, results)
    assert written == streamed and results[0].finish_reason == "stop"  # decoded here, written by a helper


def prompt_ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_failing_writer_stops_the_decoding_and_its_error_is_raised(tiny_model, tiny_tokenizer):
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    steps = []
    decode_step = decoder.step
    decoder.step = lambda *args: steps.append(1) or decode_step(*args)

    def write(piece: str) -> None:
        raise BrokenPipeError("the reader went away")

    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    with pytest.raises(BrokenPipeError, match="the reader went away"):
        decoder.write_ids(prompt_ids_of(tiny_tokenizer, "the story of"), params, write)
    assert len(steps) < 100  # stopped soon after the first piece, not after 200 tokens


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's kind): words start with '▁', decoding drops the
    first one's space, and a character outside the vocabulary is spelt as its UTF-8 bytes, each
    an ordinary token <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<s>", *(f"<0x{b:02X}>" for b in range(256)), *"▁abcdefghijklmnopqrstuvwxyz,"]
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a"), ("▁", "d"), ("▁d", "o"), ("▁do", "g")]
    vocab = {piece: index for index, piece in enumerate([*pieces, *(a + b for a, b in merges)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tokenizer.add_special_tokens(["<s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>")


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_incremental_text_pieces_join_to_the_decoded_text_decoding_a_bounded_window(tiny_tokenizer, kind):
    """Streamed pieces, token by token, are the text the whole list decodes to; a character split
    over several tokens comes out whole; each token decodes a few tokens, not the whole list."""
    from slimlm.inference.decoder import IncrementalText, silent_tokens

    tokenizer = tiny_tokenizer if kind == "byte-level" else metaspace_tokenizer()
    text = "the story of a café — naïve 猫 and 🐕 dogs, " * 12
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if kind == "metaspace":  # special tokens, decoded as nothing: one first, a run of them midway
        ids = [tokenizer.bos_token_id, *ids[:150], *[tokenizer.bos_token_id] * 40, *ids[150:]]
        tokenizer.pad_token = "▁"  # a special id that the tokenizer decodes as an ordinary piece (a space)
        assert (
            silent_tokens(tokenizer) == {tokenizer.bos_token_id}
            and tokenizer.pad_token_id in tokenizer.all_special_ids
        )
        word = next(
            i for i in range(200, len(ids)) if tokenizer.convert_ids_to_tokens(ids[i]).startswith("▁")
        )
        ids[word:word] = [tokenizer.pad_token_id]  # before a word: one more space in the text
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert text != tokenizer.decode(
            [i for i in ids if i != tokenizer.pad_token_id], skip_special_tokens=True
        )
    longest = []
    decode = tokenizer.decode
    silent = silent_tokens(tokenizer)
    tokenizer.decode = lambda window, **kw: longest.append(len(window)) or decode(window, **kw)
    incremental = IncrementalText(tokenizer, silent)
    pieces = [incremental.add(token) for token in ids] + [incremental.flush()]
    tokenizer.decode = decode
    assert "".join(pieces) == incremental.text == decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in piece for piece in pieces) and sum(1 for p in pieces if p) > len(ids) // 2
    assert len(ids) > 300 and max(longest) <= 12


def test_bad_input_is_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(SlimlmError, match="'gpt2'.*format: hf} or {format: compressed-tensors}"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})
    qwen2 = {
        "model_type": "qwen2",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "sliding_window": 16,
    }

    def windows(config):
        args = ModelArgs.from_hf_config(config)
        return [args.kinds[kind].window for kind in args.layer_kind]

    assert windows(qwen2) == [None] * 3  # use_sliding_window is off by default
    assert windows({**qwen2, "use_sliding_window": True, "max_window_layers": 0}) == [16] * 3
    assert (
        windows({**qwen2, "use_sliding_window": True}) == [None] * 3
    )  # transformers' default max_window_layers: 28
    assert windows({**qwen2, "use_sliding_window": True, "max_window_layers": 1}) == [None, 16, 16]
    with pytest.raises(SlimlmError, match="RoPE type 'dynamic'"):
        ModelArgs.from_hf_config({**qwen2, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    with pytest.raises(SlimlmError, match="exceeds the model's context of 512"):
        decoder.generate_ids([prompt_ids(500, 300)], SamplingParams(max_new_tokens=20))


def test_generate_and_chat_commands_stream_from_a_checkpoint(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    def run(*args, **kw):
        return subprocess.run(
            [sys.executable, "-m", "slimlm.cli", *args], capture_output=True, text=True, cwd=tmp_path, **kw
        )

    result = run(
        "generate",
        str(tiny_model_dir),
        "the story of",
        "--max-new-tokens",
        "8",
        "--temperature",
        "1",
        "--seed",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "8 tokens" in result.stderr
    compact = run(
        "generate",
        str(tiny_model_dir),
        "the story of",
        "--max-new-tokens",
        "8",
        "--kv-cache",
        "int8",
        "--int8-activations",
        "--dtype",
        "bfloat16",
    )
    assert compact.returncode == 0 and "8 tokens" in compact.stderr, compact.stderr
    streamed = run(
        "generate", str(tiny_model_dir), "the story of", "--max-new-tokens", "8", "--stream-layers", "1"
    )
    assert streamed.returncode == 0 and "8 tokens" in streamed.stderr, streamed.stderr
    uncompilable = run("generate", str(tiny_model_dir), "hi", "--stream-layers", "1", "--compile")
    assert uncompilable.returncode == 2 and "streams layers" in uncompilable.stderr, uncompilable.stderr
    chat = run(
        "chat",
        str(tiny_model_dir),
        "--max-new-tokens",
        "4",
        "--compile",
        input="hello\nagain\n/exit\n",
        env={**os.environ, "TORCH_LOGS": "recompiles"},
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.count("> ") >= 3
    assert (
        "Recompiling" not in chat.stderr
    )  # the conversation's cache was set aside once: the second turn reuses the compiled step
    assert chat.stderr.count("[decode step compiled for") == 1  # before the first answer, not inside it
    speculating = run("generate", str(tiny_model_dir), "hi", "--prompt-lookup", "--compile")
    assert (
        speculating.returncode == 2 and "--compile speeds up one-token decode steps" in speculating.stderr
    ), speculating.stderr
    first_turn, second_turn = (
        int(n) for n in re.findall(r"(\d+) of \d+ prompt tokens from the cache", chat.stderr)
    )
    assert first_turn == 0 and second_turn > 0  # the second turn's prompt starts with the first turn's
    missing = run("generate", str(tmp_path / "nowhere"), "hi")
    assert missing.returncode == 2 and missing.stderr.startswith("slimlm: error:")


def test_a_compiled_chat_sizes_its_cache_ahead_and_doubles_it(tiny_model, tiny_tokenizer, capsys):
    """A compiled step compiles again for each new cache size: a CPU chat sets --context slots
    aside at its first turn, a GPU one (whose static step reads every slot) its first turn's;
    a turn that outgrows them doubles the cache, up to the model's 512 positions."""
    from slimlm.inference.cli import chat_command, conversation_cache

    decoder = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    sizes = []
    for needed in (20, 60, 70, 300, 301, 600):
        conversation_cache(decoder, needed, 64)
        sizes.append(decoder.model.max_seq)
    assert sizes == [64, 64, 128, 300, 512, 512]  # 600: beyond the model, left to generation's refusal
    assert "this turn needs 70 cache slots, more than the 64 set aside: 128 now" in capsys.readouterr().err
    on_gpu = Decoder(build_decoder(tiny_model), tiny_tokenizer)
    on_gpu.device = torch.device("cuda")  # only the sizing policy looks at it here
    conversation_cache(on_gpu, 20, 64)
    assert on_gpu.model.max_seq == 20
    with pytest.raises(SystemExit) as refused:
        chat_command(["nowhere", "--context", "64"])
    assert (
        refused.value.code == 2
        and "--context sets aside cache slots for a compiled step: add --compile" in capsys.readouterr().err
    )


def test_chat_and_generate_decode_speculatively(tiny_model_dir, tmp_path):
    import subprocess
    import sys

    def run(*args, **kw):
        return subprocess.run(
            [sys.executable, "-m", "slimlm.cli", *args], capture_output=True, text=True, cwd=tmp_path, **kw
        )

    chat = run(
        "chat",
        str(tiny_model_dir),
        "--max-new-tokens",
        "12",
        "--prompt-lookup",
        input="hello hello hello\nagain\n/exit\n",
    )
    assert chat.returncode == 0, chat.stderr
    assert chat.stderr.count("passes of the model") == 2, chat.stderr
    first_turn, second_turn = (
        int(n) for n in re.findall(r"(\d+) of \d+ prompt tokens from the cache", chat.stderr)
    )
    assert first_turn == 0 and second_turn > 0
    sampling = run(
        "generate",
        str(tiny_model_dir),
        "hi hi hi",
        "--prompt-lookup",
        "--temperature",
        "0.7",
        "--seed",
        "1",
        "--max-new-tokens",
        "8",
    )
    assert sampling.returncode == 0 and "passes of the model" in sampling.stderr, sampling.stderr


@pytest.mark.parametrize(
    "static, cache_dtype, attention_kernel",
    [
        (False, None, True),
        (True, None, True),
        (False, torch.int8, True),
        (False, None, False),
        (False, torch.int8, False),
    ],
    ids=[
        "cpu-step",
        "static-step",
        "cpu-step-int8-cache",
        "cpu-step-fused-loop",
        "cpu-step-int8-cache-fused-loop",
    ],
)
def test_the_compiled_decode_step_gives_the_same_tokens(
    context_model, tiny_tokenizer, tmp_path, monkeypatch, static, cache_dtype, attention_kernel
):
    """One prompt, then two of different lengths (left padding: the attention mask's path); the
    first prompt's eleven steps compile once. The static step is the one a GPU captures in a CUDA
    graph; here it is compiled for the CPU.
    On x86 the compiled step calls slimlm's attention kernel; without it (other processors, or
    no compiler) Inductor fuses attention, and an int8 cache's dequantization, into one loop.
    With an int8 cache, Inductor's fused quantization can round a code the other way than
    eager torch's: where the greedy tokens part at a near-tie, the logits are compared."""
    if not attention_kernel:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    model = quantized(
        context_model,
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
    )
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    eager = Decoder(build_decoder(model, dtype=torch.bfloat16), tiny_tokenizer, cache_dtype=cache_dtype)
    compiled = Decoder(build_decoder(model, dtype=torch.bfloat16), tiny_tokenizer, cache_dtype=cache_dtype)
    compiled.compile_decode_step(static=static)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompts in ([prompt_ids(6, 300)], [prompt_ids(6, 300), prompt_ids(9, 300, seed=1)]):
        if cache_dtype is None:
            expected = [g.token_ids for g in eager.generate_ids(prompts, params)]
            assert [g.token_ids for g in compiled.generate_ids(prompts, params)] == expected, len(prompts)
        else:
            assert_same_decoding(compiled, eager, prompts, params)
        if len(prompts) == 1:  # one compile serves every slot
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    assert compiled.model.layers[0].attention.decode_kernel == (attention_kernel and cpu_kernels.available())


@pytest.mark.parametrize("cache_dtype", [None, torch.int8], ids=["float-cache", "int8-cache"])
def test_the_static_step_reads_the_whole_cache_as_the_growing_one_does(context_model, cache_dtype):
    """step_static (fixed shapes, slot as a tensor, every slot read under a mask) gives the
    logits of the ordinary step, for one row and for left-padded rows."""
    decoder = build_decoder(context_model)
    decoder.setup_cache(2, 48, cache_dtype)
    ids = torch.tensor(
        [
            prompt_ids(20, context_model.config.vocab_size),
            prompt_ids(20, context_model.config.vocab_size, seed=1),
        ]
    )
    pad = torch.tensor([0, 5])
    with torch.no_grad():
        for rows in (ids[:1], ids):
            row_pad = None if len(rows) == 1 else pad
            decoder(rows[:, :16], 0, row_pad)
            for slot in range(16, 20):
                grown = decoder(rows[:, slot : slot + 1], slot, row_pad)
                static = decoder.step_static(rows[:, slot : slot + 1], torch.tensor([slot]), row_pad)
                torch.testing.assert_close(static, grown, rtol=1e-5, atol=1e-5)


def test_decoders_compiled_in_one_process_keep_their_own_steps(tiny_model, tiny_tokenizer, tmp_path):
    """Each compiled step skips Dynamo's guards on its weights, so two models must never share
    one: an int8 model compiled first, then an int4 one of the same shapes and module names."""
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompt = prompt_ids(6, 300)
    for bits in (8, 4):
        model = build_tiny_llama(
            tiny_model.config.vocab_size, initializer_range=0.2
        )  # its tokens depend on the context
        model = quantized(
            model,
            tiny_tokenizer,
            tmp_path,
            bits=bits,
            group_size=None if bits == 8 else 32,
            targets=[r"model\.layers\.\d+\..*", "lm_head"],
        )
        eager = Decoder(build_decoder(model, dtype=torch.bfloat16), tiny_tokenizer)
        compiled = Decoder(build_decoder(model, dtype=torch.bfloat16), tiny_tokenizer)
        compiled.compile_decode_step()
        assert_same_decoding(compiled, eager, [prompt], params)


def test_the_generate_stage_times_decoding_not_the_decoders_setup(tiny_model, tiny_tokenizer, monkeypatch):
    """The report's tokens/s for its completion: allocating the cache (and, on a new machine,
    compiling the CPU kernels) happens once and is not decoding."""
    from slimlm.inference.generate import greedy_complete

    allocate = Transformer.setup_cache

    def slow_setup(self, *args, **kwargs):
        time.sleep(1.0)
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "setup_cache", slow_setup)
    completion = greedy_complete(tiny_model, tiny_tokenizer, "hello", max_new_tokens=4, chat_template=False)
    assert completion.engine.startswith("slimlm decoder") and completion.new_tokens >= 1
    assert completion.seconds < 1.0


def test_the_generate_stage_decodes_a_float_model_in_its_own_dtype(tiny_model, tiny_tokenizer):
    from slimlm.inference.generate import greedy_complete

    completion = greedy_complete(
        tiny_model.to(torch.bfloat16), tiny_tokenizer, "hello", max_new_tokens=2, chat_template=False
    )
    assert completion.engine.endswith("bfloat16 activations)")
