import pytest
import torch

from slimlm.compress.gptq import (
    GPTQOptions,
    HessianAccumulator,
    LayerInputStatistics,
    SquareSums,
    gptq_quantize,
    precise_hessian,
)
from slimlm.compress.rtn import quantize_rtn
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme


def correlated_inputs(rows=2048, features=64, seed=0):
    """Inputs whose features are strongly correlated and of very different energy, like activations."""
    generator = torch.Generator().manual_seed(seed)
    energy = torch.logspace(-1, 1, features)[torch.randperm(features, generator=generator)]
    mixing = torch.randn(features, features, generator=generator) * energy
    return torch.randn(rows, features, generator=generator) @ mixing


def output_error(x, weight, quantized, scheme):
    restored = QuantLinear.from_codes(
        quantized.codes, quantized.scales, quantized.zeros, scheme, None
    ).dequantize()
    return float(((x @ weight.T - x @ restored.T) ** 2).mean())


def hessian_of(x):
    accumulator = HessianAccumulator(x.shape[1])
    for chunk in x.split(300):  # the running average must equal the one-shot 2/n X^T X
        accumulator.add(chunk)
    return accumulator.hessian


@pytest.mark.parametrize("band", [HessianAccumulator.BAND, 24], ids=["one-band", "bands-of-24-rows"])
def test_running_hessian_equals_the_closed_form(band, monkeypatch):
    monkeypatch.setattr(HessianAccumulator, "BAND", band)
    x = correlated_inputs(rows=1000)
    hessian = hessian_of(x)
    torch.testing.assert_close(
        hessian, (2.0 / 1000 * (x.double().T @ x.double())).float(), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(hessian, hessian.T)  # the mirrored half is exactly the computed one


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(bits=4, group_size=16),
        QuantScheme(bits=3, group_size=32, symmetric=False),
        QuantScheme(bits=4),
    ],
    ids=str,
)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output_error(scheme, act_order):
    x = correlated_inputs()
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    rtn = output_error(x, weight, quantize_rtn(weight, scheme), scheme)
    gptq = output_error(
        x,
        weight,
        gptq_quantize(weight, hessian_of(x), scheme, GPTQOptions(act_order=act_order, block_size=32)),
        scheme,
    )
    assert gptq < 0.8 * rtn


def test_lazy_block_updates_are_exact():
    x = correlated_inputs()
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    scheme = QuantScheme(bits=4, group_size=16)
    for act_order in (False, True):
        results = [
            gptq_quantize(weight, hessian_of(x), scheme, GPTQOptions(act_order=act_order, block_size=b)).codes
            for b in (16, 32, 64)
        ]
        assert all(torch.equal(results[0], other) for other in results[1:])


def test_gptq_codes_lie_on_the_stored_grid():
    x = correlated_inputs()
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    scheme = QuantScheme(bits=4, group_size=16, symmetric=False)
    q = gptq_quantize(weight, hessian_of(x), scheme)
    assert q.codes.max() <= 15 and q.scales.shape == (16, 4) and q.zeros.shape == (16, 4)


def test_dead_inputs_are_handled_and_singular_hessians_damped():
    x = correlated_inputs()
    x[:, 5] = 0.0  # an input that never fires
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    q = gptq_quantize(weight, hessian_of(x), QuantScheme(bits=4, group_size=16))
    assert torch.isfinite(q.scales.float()).all()


@pytest.mark.parametrize("kind", [HessianAccumulator, SquareSums])
def test_non_finite_activations_are_refused(kind):
    accumulator = kind(4)
    with pytest.raises(SlimlmError, match="NaN or Inf"):
        accumulator.add(torch.tensor([[1.0, float("nan"), 0.0, 1.0]]))


def test_square_sums_are_the_hessian_diagonal_without_the_hessian():
    """Wanda's statistic: sum_t x_tj^2 = n/2 diag(H), with in_features numbers kept, not in_features^2."""
    x = correlated_inputs()
    sums = SquareSums(x.shape[1])
    for chunk in x.split(300):
        sums.add(chunk)
    torch.testing.assert_close(sums.sums, hessian_of(x).diagonal().double() * len(x) / 2, rtol=1e-5, atol=0)


@pytest.mark.parametrize("square_sums", [False, True])
def test_layers_reading_the_same_inputs_share_their_statistics(square_sums):
    statistics = LayerInputStatistics(SquareSums if square_sums else HessianAccumulator)
    x, y = correlated_inputs(rows=64), correlated_inputs(rows=64, seed=1)
    for batch in (x, y):
        for name in ("q", "k"):  # one input tensor, two layers: accumulated once
            statistics.observe(name, batch)
        statistics.observe("o", batch * 2)
    assert statistics["q"] is statistics["k"] and statistics["o"] is not statistics["q"]
    assert isinstance(statistics["q"], SquareSums if square_sums else HessianAccumulator)
    if square_sums:
        torch.testing.assert_close(
            statistics["q"].sums, (torch.cat([x, y]) ** 2).sum(dim=0).double(), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(statistics["o"].sums, 4 * statistics["q"].sums, rtol=1e-5, atol=0)


def test_a_hessian_that_stays_singular_is_a_clear_error_after_warnings(caplog):
    hessian = torch.ones(16, 16)  # rank one: X had one direction only
    hessian[0, 1] = hessian[1, 0] = 4.0  # and not even positive semi-definite
    with pytest.raises(SlimlmError, match="layer.x: the Hessian stayed singular"):
        gptq_quantize(
            torch.randn(4, 16),
            hessian,
            QuantScheme(bits=4, group_size=8),
            GPTQOptions(damp=1e-6),
            name="layer.x",
        )
    assert sum("raising it" in record.message for record in caplog.records) == 4


def test_clip_search_lowers_gptq_error_on_heavy_tailed_weights():
    x = correlated_inputs()
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(6))
    weight[torch.rand(weight.shape, generator=torch.Generator().manual_seed(7)) < 0.02] *= 8.0
    scheme = QuantScheme(bits=4, group_size=16)
    plain = output_error(
        x, weight, gptq_quantize(weight, hessian_of(x), scheme, GPTQOptions(clip_search=False)), scheme
    )
    clipped = output_error(
        x, weight, gptq_quantize(weight, hessian_of(x), scheme, GPTQOptions(clip_search=True)), scheme
    )
    assert clipped < plain


def test_layers_sharing_a_hessian_each_see_it_whole():
    """Layers reading the same inputs share one Hessian (q/k/v): GPTQ overwrites the Hessian it is
    given, so quantizing one must not change what the next one sees, dead inputs included."""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
    x[:, 3] = 0
    stats = LayerInputStatistics()
    for name in ("q", "k"):
        stats.observe(name, x)
    before = stats["q"].hessian.clone()
    weight = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    first = gptq_quantize(weight, stats.take_hessian("q"), QuantScheme(bits=4, group_size=16))
    assert torch.equal(stats["k"].hessian, before)
    own = stats["k"].hessian
    last = stats.take_hessian("k")
    assert (
        last is own and torch.equal(last, before) and not stats
    )  # the last user gets the accumulator's own tensor, no copy
    assert torch.equal(gptq_quantize(weight, last, QuantScheme(bits=4, group_size=16)).codes, first.codes)


def test_awq_statistics_are_float64_where_the_solve_is(monkeypatch):
    """precise_hessian computes its products in the layer's solve dtype: AWQ's grid searches
    compare errors that float32 statistics blur."""
    x = correlated_inputs(rows=500)
    precise = precise_hessian(x.shape[1])
    precise.add(x)
    assert precise.hessian.dtype == torch.float64
    torch.testing.assert_close(
        precise.hessian, 2.0 / 500 * (x.double().T @ x.double()), rtol=1e-12, atol=1e-12
    )
    monkeypatch.setattr("slimlm.compress.gptq.SOLVE_FLOAT64_BYTES", 8 * 63 * 63)
    assert precise_hessian(64).hessian.dtype == torch.float32
