import json
import mmap
import statistics
import time

import pytest
import torch
from torch import nn

from slimlm import memory
from slimlm.compress.rtn import quantize_rtn
from slimlm.errors import SlimlmError
from slimlm.eval.bandwidth import CACHE_FILE, bandwidth_fraction, decode_bytes_per_token, memory_bandwidth
from slimlm.eval.speed import (
    PASSAGE,
    benchmark_prompt,
    bundled_decode,
    generate_decode,
    greedy_decode,
    measure_decoder_speed,
    measure_generate,
    measure_speed,
)
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.memory import peak_memory
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule
from tests.conftest import build_tiny_llama

# The tiny Llama of conftest, by hand: hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, fp32.
LAYER_LINEAR_SHAPES = [
    (64, 64),
    (32, 64),
    (32, 64),
    (64, 64),
    (128, 64),
    (128, 64),
    (64, 128),
]  # q k v o gate up down (out, in)
LAYER_NORMS = 2 * 64
FINAL_NORM = 64
KV_BYTES_PER_CONTEXT_TOKEN = 2 * 2 * 2 * 16 * 4  # keys and values x layers x kv heads x head dim x fp32
FP32 = 4


def decoder_linear_names(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.")
    ]


def static_bytes(model: nn.Module, layer_linear_bytes: int, head_bytes: int) -> int:
    """Weights one decode step reads, by hand: per layer its linears and two norms, the final norm,
    the LM head, and the rotary tables (whatever buffers this transformers keeps)."""
    rotary = sum(b.numel() for name, b in model.named_buffers() if "rotary_emb" in name) * FP32
    return 2 * (layer_linear_bytes + LAYER_NORMS * FP32) + FINAL_NORM * FP32 + head_bytes + rotary


def test_decode_loop_produces_the_greedy_tokens_of_generate(tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)  # larger weights: varied tokens
    input_ids = benchmark_prompt(tiny_tokenizer, 16).repeat(2, 1)
    run = greedy_decode(model, input_ids, 24)
    with torch.no_grad():
        expected = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=0,
        )[:, 16:]
    assert run.tokens.shape == (2, 24)
    assert torch.equal(run.tokens, expected)
    assert len(set(run.tokens[0].tolist())) > 5
    assert torch.equal(generate_decode(model, input_ids, 24, pad_token_id=0).tokens, expected)


@pytest.mark.parametrize("count", [1, 16, 1500])
def test_prompt_has_exactly_the_requested_tokens_of_the_passage(tiny_tokenizer, count):
    ids = benchmark_prompt(tiny_tokenizer, count)
    passage = tiny_tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]
    assert ids.numel() == count
    assert ids.tolist()[: min(count, len(passage) - 1)] == passage[: min(count, len(passage) - 1)]
    assert torch.equal(ids, benchmark_prompt(tiny_tokenizer, count))
    assert benchmark_prompt(tiny_tokenizer, 5, prompt_text="Another text entirely, and long.").numel() == 5


def test_results_are_medians_of_the_timed_runs_after_warmup(tiny_model, tiny_tokenizer):
    steps = []
    tiny_model.register_forward_hook(lambda module, args, output: steps.append(module))
    result = measure_speed(
        tiny_model, tiny_tokenizer, prompt_tokens=8, new_tokens=5, batch_size=3, warmup=2, repeats=3
    )
    assert len(steps) == (2 + 3) * 5  # warm-up runs, then timed runs, each exactly new_tokens forwards
    assert (result.batch_size, result.prompt_tokens, result.new_tokens, result.repeats) == (3, 8, 5, 3)
    assert len(result.runs) == 3
    for metric in ("ttft_s", "prefill_tok_s", "decode_tok_s", "total_s", "peak_memory_bytes"):
        assert getattr(result, metric) == statistics.median(getattr(run, metric) for run in result.runs)
    for run in result.runs:
        assert run.prefill_tok_s * run.ttft_s == pytest.approx(8 * 3)
        assert run.decode_tok_s * (run.total_s - run.ttft_s) == pytest.approx(4 * 3)
    assert result.peak_memory_kind == "rss" and result.peak_memory_bytes > 0
    assert json.loads(json.dumps(result.to_dict()))["runs"][0]["ttft_s"] == result.runs[0].ttft_s


def test_generate_is_timed_by_the_same_protocol(tiny_model, tiny_tokenizer):
    result = measure_generate(
        tiny_model, tiny_tokenizer, prompt_tokens=8, new_tokens=6, batch_size=2, warmup=0, repeats=2
    )
    assert result.method == "generate" and len(result.runs) == 2
    assert result.decode_tok_s == statistics.median(run.decode_tok_s for run in result.runs)
    assert all(0 < run.ttft_s < run.total_s for run in result.runs)


def test_the_bundled_decoder_is_timed_by_the_same_protocol_and_decodes_the_same_tokens(
    tiny_model, tiny_tokenizer
):
    """A family the decoder runs is measured as `slimlm generate` runs it; on the fp32 tiny
    model it chooses the same greedy tokens as the transformers forward loop."""
    result = measure_decoder_speed(
        tiny_model, tiny_tokenizer, prompt_tokens=8, new_tokens=6, batch_size=2, warmup=1, repeats=2
    )
    assert result.method == "bundled_decoder" and len(result.runs) == 2
    assert result.decode_tok_s == statistics.median(run.decode_tok_s for run in result.runs)
    assert all(0 < run.ttft_s < run.total_s for run in result.runs)
    prompt = benchmark_prompt(tiny_tokenizer, 8).repeat(2, 1)
    ours = bundled_decode(Decoder(build_decoder(tiny_model), tiny_tokenizer), tiny_model, prompt, 6)
    assert torch.equal(ours.tokens, greedy_decode(tiny_model, prompt, 6).tokens)


def test_a_single_new_token_has_no_decode_rate(tiny_model, tiny_tokenizer):
    result = measure_speed(tiny_model, tiny_tokenizer, prompt_tokens=4, new_tokens=1, warmup=0, repeats=1)
    assert result.decode_tok_s is None and result.total_s == pytest.approx(result.ttft_s, abs=1e-3)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"new_tokens": 0}, "new_tokens=0 is invalid"),
        ({"batch_size": 0}, "batch_size=0 is invalid"),
        ({"repeats": 0}, "repeats=0 is invalid"),
        ({"prompt_tokens": 2.5}, "prompt_tokens=2.5 is invalid"),
    ],
)
def test_bad_arguments_are_errors(tiny_model, tiny_tokenizer, arguments, message):
    with pytest.raises(SlimlmError, match=message):
        measure_speed(tiny_model, tiny_tokenizer, **arguments)
    with pytest.raises(SlimlmError, match="tokenizes to no tokens"):
        benchmark_prompt(tiny_tokenizer, 4, prompt_text="")


@pytest.mark.parametrize("kernel_peak", [True, False], ids=["vmhwm", "sampled"])
def test_peak_rss_sees_a_short_lived_allocation(monkeypatch, kernel_peak):
    if not kernel_peak:
        monkeypatch.setattr(memory, "_reset_kernel_peak_rss", lambda: False)
    with peak_memory(torch.device("cpu")) as baseline:
        pass
    with peak_memory(torch.device("cpu")) as peak:
        # 64 MiB of fresh pages, freed before the block ends. Mapped directly: a malloc'd block
        # may reuse memory an earlier test freed but the C library kept resident.
        block = mmap.mmap(-1, 64 * 2**20)
        torch.frombuffer(block, dtype=torch.uint8).fill_(1)
        time.sleep(0.02)
        block.close()
    assert peak.kind == "rss"
    assert peak.bytes >= baseline.bytes + 60 * 2**20


def test_bytes_per_token_counts_a_tied_head_once(tiny_model, tiny_tokenizer):
    assert tiny_model.get_output_embeddings().weight is tiny_model.get_input_embeddings().weight
    vocab, context = len(tiny_tokenizer), 80
    linears = sum(out * inp for out, inp in LAYER_LINEAR_SHAPES) * FP32
    weights = static_bytes(tiny_model, linears, vocab * 64 * FP32)
    per_sequence = 64 * FP32 + KV_BYTES_PER_CONTEXT_TOKEN * context  # one embedding row + the KV cache
    assert decode_bytes_per_token(tiny_model, context) == weights + per_sequence
    assert decode_bytes_per_token(tiny_model, context, batch_size=2) == (weights + 2 * per_sequence) // 2
    untied = build_tiny_llama(vocab, tie_word_embeddings=False)
    assert decode_bytes_per_token(untied, context) == weights + per_sequence  # the same reads


def quantize_linears(model: nn.Module, names: list[str]) -> None:
    for name in names:
        linear = model.get_submodule(name)
        q = quantize_rtn(linear.weight, QuantScheme())
        set_submodule(
            model, name, QuantLinear.from_codes(q.codes, q.scales, q.zeros, QuantScheme(), linear.bias)
        )


def test_bytes_per_token_of_quant_linear_layers(tiny_model, tiny_tokenizer):
    vocab, context = len(tiny_tokenizer), 32
    per_sequence = 64 * FP32 + KV_BYTES_PER_CONTEXT_TOKEN * context
    int8_linears = sum(
        out * inp + 2 * out for out, inp in LAYER_LINEAR_SHAPES
    )  # int8 weights + fp16 row scales
    quantize_linears(tiny_model, decoder_linear_names(tiny_model))
    assert (
        decode_bytes_per_token(tiny_model, context)
        == static_bytes(tiny_model, int8_linears, vocab * 64 * FP32) + per_sequence
    )
    quantize_linears(tiny_model, ["lm_head"])  # unties: the fp32 embedding is now read one row at a time
    assert (
        decode_bytes_per_token(tiny_model, context)
        == static_bytes(tiny_model, int8_linears, vocab * 64 + 2 * vocab) + per_sequence
    )
    result = measure_speed(tiny_model, tiny_tokenizer, prompt_tokens=4, new_tokens=3, warmup=0, repeats=1)
    assert result.decode_tok_s > 0


def test_a_quantized_table_is_read_one_row_per_token(tiny_tokenizer, tmp_path):
    from slimlm.compress.quantize import QuantizeParams
    from slimlm.compress.quantize import run as quantize
    from slimlm.pipeline import RunState

    vocab, context = len(tiny_tokenizer), 32
    untied = build_tiny_llama(vocab, tie_word_embeddings=False)
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=untied,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(
        state, QuantizeParams(bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"])
    )  # the table is rounded with the head
    int8_linears = sum(out * inp + 2 * out for out, inp in LAYER_LINEAR_SHAPES)
    per_sequence = (
        64 + 2
    ) + KV_BYTES_PER_CONTEXT_TOKEN * context  # one int8 row of the table and its fp16 scale, the KV cache
    assert (
        decode_bytes_per_token(untied, context)
        == static_bytes(untied, int8_linears, vocab * 64 + 2 * vocab) + per_sequence
    )


def test_bytes_per_token_of_bitsandbytes_layers(tiny_model, tiny_tokenizer):
    bnb = pytest.importorskip("bitsandbytes")
    context = 16
    for name in decoder_linear_names(tiny_model):
        linear = tiny_model.get_submodule(name)
        layer = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=False,
            compute_dtype=torch.float32,
            quant_type="nf4",
            compress_statistics=True,
        )
        layer.weight = bnb.nn.Params4bit(
            linear.weight.data.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True
        )
        set_submodule(tiny_model, name, layer.to("cpu"))  # quantizes
    # Per matrix of n weights: packed 4-bit n/2, uint8 absmax per 64-block, its fp32 offset, fp32 code of
    # 16, and the nested statistics: one fp32 absmax per 256 blocks (one here) and an fp32 code of 256.
    nf4_linears = sum(
        out * inp // 2 + out * inp // 64 + 4 + 16 * 4 + 4 + 256 * 4 for out, inp in LAYER_LINEAR_SHAPES
    )
    expected = (
        static_bytes(tiny_model, nf4_linears, len(tiny_tokenizer) * 64 * FP32)
        + 64 * FP32
        + KV_BYTES_PER_CONTEXT_TOKEN * context
    )
    assert decode_bytes_per_token(tiny_model, context) == expected
    assert (
        measure_speed(
            tiny_model, tiny_tokenizer, prompt_tokens=4, new_tokens=3, warmup=0, repeats=1
        ).decode_tok_s
        > 0
    )


def test_bandwidth_is_measured_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path))
    first = memory_bandwidth("cpu", buffer_bytes=2**20, repeats=3)
    path = tmp_path / CACHE_FILE
    entries = json.loads(path.read_text())
    assert list(entries) == [first.machine_key] and first.bytes_per_s > 0 and first.method == "cpu_sum_read"
    entries[first.machine_key]["bytes_per_s"] = 123.0  # a value no measurement gives: its return proves reuse
    path.write_text(json.dumps(entries))
    assert memory_bandwidth("cpu", buffer_bytes=2**20, repeats=3).bytes_per_s == 123.0
    assert memory_bandwidth("cpu", buffer_bytes=2**20, repeats=3, refresh=True).bytes_per_s != 123.0
    assert json.loads(path.read_text())[first.machine_key]["bytes_per_s"] != 123.0
    memory_bandwidth("cpu", buffer_bytes=2**21, repeats=3)
    assert len(json.loads(path.read_text())) == 2  # another buffer size is another measurement


def test_bandwidth_fraction():
    assert bandwidth_fraction(50.0, 200_000_000, 20e9) == pytest.approx(0.5)
    with pytest.raises(SlimlmError, match="positive"):
        bandwidth_fraction(0.0, 200_000_000, 20e9)
    with pytest.raises(SlimlmError, match="buffer_bytes"):
        memory_bandwidth("cpu", buffer_bytes=0)
