"""Half-precision Linear layers multiplied in float32 on CPUs without fast half-precision products."""

import pytest
import torch
import torch.nn.functional as F

from slimlm import half_linear
from slimlm.half_linear import float32_linears, half_matmul_is_slow, linear_in_float32
from tests.conftest import build_tiny_llama


def test_linear_in_float32_rounds_a_float32_product_in_runs_of_rows(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 48, generator=generator).bfloat16()
    weight = torch.randn(37, 48, generator=generator).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16()
    expected = F.linear(x.float(), weight.float(), bias.float()).bfloat16()
    monkeypatch.setattr(half_linear, "CHUNK_BYTES", 10 * 4 * 48)  # 10 rows a run: 4 runs, the last short
    for result in (linear_in_float32(x, weight, bias), linear_in_float32(x, weight, bias=bias)):
        assert result.dtype == torch.bfloat16 and result.shape == (2, 5, 37)
        assert torch.equal(result, expected)
    assert torch.equal(linear_in_float32(x, weight), F.linear(x.float(), weight.float()).bfloat16())


def test_the_mode_takes_half_precision_cpu_linears_only(monkeypatch):
    calls = []
    monkeypatch.setattr(half_linear, "half_matmul_is_slow", lambda dtype: True)
    monkeypatch.setattr(
        half_linear,
        "linear_in_float32",
        lambda *args, **kwargs: calls.append(args) or F.linear(*args, **kwargs),
    )
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with float32_linears(torch.bfloat16, torch.device("cpu")):
        layer(x)  # float32: untouched
        layer.bfloat16()(x.bfloat16())
        with pytest.raises(RuntimeError):  # mixed dtypes: left to torch, which refuses them
            F.linear(x.bfloat16(), layer.weight.half())
    assert len(calls) == 1 and calls[0][0].dtype == torch.bfloat16


def test_nothing_changes_where_half_precision_is_fast_or_not_used(monkeypatch):
    monkeypatch.setattr(
        half_linear, "linear_in_float32", lambda *args, **kwargs: pytest.fail("the mode should be off")
    )
    layer = torch.nn.Linear(16, 8).bfloat16()
    monkeypatch.setattr(half_linear, "half_matmul_is_slow", lambda dtype: False)
    with float32_linears(torch.bfloat16, torch.device("cpu")):
        layer(torch.randn(2, 16).bfloat16())
    monkeypatch.setattr(half_linear, "half_matmul_is_slow", lambda dtype: True)
    with float32_linears(torch.float32, torch.device("cpu")):
        layer(torch.randn(2, 16).bfloat16())


def test_a_bf16_model_scores_the_same_within_the_mode(monkeypatch, tiny_tokenizer):
    model = build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2).bfloat16()
    ids = torch.randint(0, len(tiny_tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = model(input_ids=ids).logits.float()
        monkeypatch.setattr(half_linear, "half_matmul_is_slow", lambda dtype: True)
        with float32_linears(torch.bfloat16, torch.device("cpu")):
            emulated = model(input_ids=ids).logits.float()
    # Both accumulate in float32 and round to bf16; only the order of the sums differs.
    assert torch.allclose(emulated, native, atol=0.05, rtol=0.02)
    assert (emulated.argmax(-1) == native.argmax(-1)).float().mean() > 0.95


def test_the_probe_answers_once_per_dtype():
    assert half_matmul_is_slow(torch.bfloat16) in (True, False)
    assert half_matmul_is_slow.cache_info().currsize >= 1


def test_calibration_multiplies_in_float32_in_its_forward_passes_only(monkeypatch, tiny_tokenizer):
    from slimlm.compress.calibration import calibrate_sequentially

    model = build_tiny_llama(len(tiny_tokenizer)).bfloat16()
    monkeypatch.setattr(half_linear, "half_matmul_is_slow", lambda dtype: True)
    calls = []
    monkeypatch.setattr(
        half_linear, "linear_in_float32", lambda *args, **kwargs: calls.append(1) or F.linear(*args, **kwargs)
    )
    in_finish = []

    def finish_layer(block, names):
        before = len(calls)
        F.linear(
            torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16()
        )  # GPTQ's and AWQ's own work: not in the mode
        in_finish.append(len(calls) - before)

    samples = torch.randint(0, len(tiny_tokenizer), (2, 16), generator=torch.Generator().manual_seed(0))
    calibrate_sequentially(
        model,
        samples,
        ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"],
        lambda name, x: None,
        finish_layer,
    )
    assert in_finish == [0, 0] and len(calls) >= 2 * 2 * 7  # both blocks, both passes, every Linear
