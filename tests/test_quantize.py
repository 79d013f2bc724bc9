import pytest
import torch
from torch import nn

from slimlm.compress.quantize import QuantizeParams, relative_error
from slimlm.compress.rtn import quantize_int8_per_channel
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import ConfigError, SlimlmError
from slimlm.pipeline import build_params
from slimlm.qlinear import QuantLinear, QuantScheme


def test_int8_rtn_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(32, 48) * torch.logspace(-2, 1, 32).unsqueeze(1)  # rows of very different scale
    qweight, scales = quantize_int8_per_channel(weight)
    assert qweight.dtype == torch.int8 and scales.dtype == torch.float16
    assert qweight.abs().max() <= 127
    error = (qweight.float() * scales.float() - weight).abs()
    assert torch.all(error <= scales.float() / 2 + 1e-6)
    # the largest entry of every row lands on the end of the grid
    assert torch.all(qweight.abs().amax(dim=1) == 127)


def test_all_zero_rows_quantize_to_zero():
    weight = torch.zeros(4, 8)
    weight[0] = 1.0
    qweight, scales = quantize_int8_per_channel(weight)
    assert torch.isfinite(scales.float()).all()
    assert torch.equal(qweight[1:], torch.zeros_like(qweight[1:]))


def test_quant_linear_matches_dequantized_linear():
    torch.manual_seed(1)
    linear = nn.Linear(40, 24, bias=True)
    qweight, scales = quantize_int8_per_channel(linear.weight)
    layer = QuantLinear.from_quantized(qweight, scales, QuantScheme(), linear.bias)
    x = torch.randn(3, 5, 40)
    expected = torch.nn.functional.linear(x, qweight.float() * scales.float(), linear.bias)
    torch.testing.assert_close(layer(x), expected)
    assert relative_error(linear.weight, layer.dequantize()) < 0.01


def test_quant_linear_refuses_schemes_it_cannot_store():
    with pytest.raises(ValueError):
        QuantLinear(8, 8, QuantScheme(bits=4, group_size=64))


def test_patterns_select_exactly_the_intended_modules(tiny_model):
    names = select_linear_modules(tiny_model, [r"model\.layers\.\d+\.mlp\..*"], [r".*\.down_proj"])
    assert names == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    everything = select_linear_modules(tiny_model, [r".*"], [])
    assert "lm_head" in everything and len(everything) == 2 * 7 + 1


def test_pattern_matching_nothing_is_an_error(tiny_model):
    with pytest.raises(SlimlmError, match="matches no Linear module"):
        select_linear_modules(tiny_model, [r"model\.layer\.\d+\..*"], [])
    with pytest.raises(SlimlmError, match="not a valid regular expression"):
        select_linear_modules(tiny_model, [r"model\.layers\.(\d+"], [])


def test_quantize_params_are_checked():
    assert build_params(QuantizeParams, {"bits": 8}, "stage").bits == 8
    with pytest.raises(ConfigError, match="bits=4"):
        build_params(QuantizeParams, {"bits": 4}, "stage")
    with pytest.raises(ConfigError, match="unknown key"):
        build_params(QuantizeParams, {"bitz": 8}, "stage")
    with pytest.raises(ConfigError, match="method"):
        build_params(QuantizeParams, {"method": "magic"}, "stage")
    with pytest.raises(ConfigError, match="could not be converted"):
        build_params(QuantizeParams, {"bits": "eight"}, "stage")
