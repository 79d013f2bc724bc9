import pytest
import torch
from torch import nn

from slimlm.compress.quantize import QuantizeParams, check_shapes, layer_error
from slimlm.compress.rtn import dequantize_codes, quantize_rtn
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import ConfigError, SlimlmError
from slimlm.pipeline import build_params
from slimlm.qlinear import QuantLinear, QuantScheme

SCHEMES = [
    QuantScheme(bits=8),
    QuantScheme(bits=4, group_size=16),
    QuantScheme(bits=4, group_size=16, symmetric=False),
    QuantScheme(bits=3, group_size=32),
    QuantScheme(bits=3, group_size=32, symmetric=False),
    QuantScheme(bits=2, group_size=8, symmetric=False),
]


def scaled_weight(rows=32, cols=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator) * torch.logspace(-2, 1, rows).unsqueeze(1)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rtn_error_is_at_most_half_a_step(scheme):
    weight = scaled_weight()
    q = quantize_rtn(weight, scheme)
    assert q.codes.dtype == torch.uint8 and q.codes.max() <= scheme.max_code
    assert q.scales.dtype == torch.float16 and q.scales.shape == (32, scheme.groups(64))
    group = 64 // scheme.groups(64)
    scale = q.scales.float().repeat_interleave(group, dim=1)
    zero = scheme.symmetric_zero if q.zeros is None else q.zeros.float().repeat_interleave(group, dim=1)
    error = ((q.codes.float() - zero) * scale - weight).abs()
    assert torch.all(error <= scale / 2 + 1e-6)


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_quant_linear_matches_its_dequantized_weight(scheme):
    torch.manual_seed(1)
    linear = nn.Linear(64, 24, bias=True)
    q = quantize_rtn(linear.weight, scheme)
    layer = QuantLinear.from_codes(q.codes, q.scales, q.zeros, scheme, linear.bias)
    assert torch.equal(layer.codes(), q.codes)  # packing is bit-exact
    assert layer.qweight.numel() == 24 * 64 * scheme.bits // 8
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.dequantize(), linear.bias))
    assert layer_error(linear.weight, layer) < {8: 0.01, 4: 0.15, 3: 0.3, 2: 0.7}[scheme.bits]


def test_all_zero_rows_quantize_to_zero():
    weight = torch.zeros(4, 8)
    weight[0] = 1.0
    for scheme in (QuantScheme(bits=8), QuantScheme(bits=4, symmetric=False)):
        q = quantize_rtn(weight, scheme)
        restored = dequantize_codes(
            q.codes, q.scales[:, 0], None if q.zeros is None else q.zeros[:, 0], scheme
        )
        assert torch.isfinite(q.scales.float()).all()
        assert torch.equal(restored[1:], torch.zeros(3, 8))


def rounded(weight, scheme):
    q = quantize_rtn(weight, scheme)
    return QuantLinear.from_codes(q.codes, q.scales, q.zeros, scheme, None)


def test_more_bits_and_smaller_groups_mean_less_error():
    weight = scaled_weight(64, 128)
    error = {
        s: layer_error(weight, rounded(weight, s))
        for s in [
            QuantScheme(bits=8),
            QuantScheme(bits=4, group_size=128),
            QuantScheme(bits=4, group_size=16),
            QuantScheme(bits=3, group_size=16),
        ]
    }
    assert (
        error[QuantScheme(bits=8)]
        < error[QuantScheme(bits=4, group_size=16)]
        < error[QuantScheme(bits=4, group_size=128)]
    )
    assert error[QuantScheme(bits=4, group_size=16)] < error[QuantScheme(bits=3, group_size=16)]


def test_the_layer_error_is_the_same_in_runs_of_rows(monkeypatch):
    from slimlm.compress import quantize

    weight = scaled_weight(64, 128)
    layer = rounded(weight, QuantScheme(bits=4, group_size=16))
    whole = float(torch.linalg.norm(weight - layer.dequantize()) / torch.linalg.norm(weight))
    monkeypatch.setattr(quantize, "ERROR_CHUNK_BYTES", 5 * 4 * 128)  # 5 rows a run, the last short
    assert layer_error(weight, layer) == pytest.approx(whole, rel=1e-5)


def test_shapes_a_scheme_cannot_take_are_refused(tiny_model):
    with pytest.raises(ValueError, match="does not divide"):
        QuantLinear(100, 8, QuantScheme(bits=4, group_size=64))
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantLinear(20, 8, QuantScheme(bits=4))
    names = select_linear_modules(tiny_model, [r".*mlp\.down_proj"], [])
    with pytest.raises(SlimlmError, match="cannot quantize model.layers.0.mlp.down_proj: group size 96"):
        check_shapes(tiny_model, names, QuantScheme(bits=4, group_size=96))


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
    assert build_params(QuantizeParams, {"bits": 4, "group_size": 64}, "stage").scheme == QuantScheme(
        bits=4, group_size=64
    )
    with pytest.raises(ConfigError, match="5-bit weights are not supported"):
        build_params(QuantizeParams, {"bits": 5}, "stage")
    with pytest.raises(ConfigError, match="group_size=4"):
        build_params(QuantizeParams, {"bits": 4, "group_size": 4}, "stage")
    with pytest.raises(ConfigError, match="unknown key"):
        build_params(QuantizeParams, {"bitz": 8}, "stage")
    with pytest.raises(ConfigError, match="method"):
        build_params(QuantizeParams, {"method": "magic"}, "stage")
    with pytest.raises(ConfigError, match="could not be converted"):
        build_params(QuantizeParams, {"bits": "eight"}, "stage")


def test_bits_and_a_mixed_budget_are_exclusive():
    with pytest.raises(ConfigError, match="give bits .* or bpw"):
        build_params(QuantizeParams, {"bits": 4, "bpw": 3.5}, "stage")
    with pytest.raises(ConfigError, match="at least two bit widths"):
        build_params(QuantizeParams, {"bpw": 3.5, "candidate_bits": [4]}, "stage")
    with pytest.raises(ConfigError, match="5-bit weights"):
        build_params(QuantizeParams, {"bpw": 3.5, "candidate_bits": [3, 5]}, "stage")
    assert build_params(QuantizeParams, {}, "stage").scheme == QuantScheme(bits=8)


def test_quantizing_a_tied_lm_head_quantizes_the_embedding_with_it(tiny_model, tiny_tokenizer, tmp_path):
    from slimlm.compress.quantize import run as quantize
    from slimlm.eval.size import model_size
    from slimlm.pipeline import RunState
    from slimlm.qlinear import QuantEmbedding

    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = tiny_model(ids).logits
    fp32_bytes = model_size(tiny_model).bytes
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=tiny_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"]))
    embedding, head = tiny_model.get_input_embeddings(), tiny_model.get_output_embeddings()
    assert isinstance(head, QuantLinear) and isinstance(embedding, QuantEmbedding) and embedding.head is head
    torch.testing.assert_close(embedding(ids), head.dequantize()[ids])
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(ids).logits, before, rtol=0.05, atol=0.05)
    # Every matrix is int8 now: about a quarter of fp32, scales and norms on top.
    assert model_size(tiny_model).bytes < 0.3 * fp32_bytes
    assert state.schemes["lm_head"]["bits"] == 8
