import pytest
import torch

from slimlm.architecture import LLAMA
from slimlm.compress import clipping
from slimlm.compress.awq import AWQOptions, awq_quantize_layer, search_scale
from slimlm.compress.clipping import output_error, search_clip
from slimlm.compress.gptq import HessianAccumulator
from slimlm.compress.rtn import fake_quantize
from slimlm.qlinear import QuantScheme
from tests.conftest import build_tiny_llama

SCHEME = QuantScheme(bits=3, group_size=16)


def outlier_inputs(rows=2048, features=64, seed=0):
    """Activations with a few channels 30x larger than the rest, as LLM activations have."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    x[:, torch.randperm(features, generator=generator)[:4]] *= 30.0
    return x


def stats_of(x):
    accumulator = HessianAccumulator(x.shape[1])
    for chunk in x.split(500):
        accumulator.add(chunk)
    return accumulator


def measured_error(x, weight, approximation):
    return float(((x @ weight.T - x @ approximation.T) ** 2).sum(dim=1).mean())


def test_output_error_through_the_hessian_equals_the_direct_one():
    x = outlier_inputs(rows=500)
    delta = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    via_hessian = float(output_error(delta, stats_of(x).hessian.float()))
    assert via_hessian == pytest.approx(measured_error(x, delta, torch.zeros_like(delta)), rel=1e-4)


def test_mean_absolute_activation_is_tracked():
    x = outlier_inputs(rows=700)
    torch.testing.assert_close(stats_of(x).abs_mean, x.abs().mean(dim=0), rtol=1e-6, atol=1e-6)


def test_scale_search_beats_rtn_on_outlier_channels():
    x = outlier_inputs()
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(2))
    stats = stats_of(x)
    scale, error, rtn_error = search_scale([weight], [SCHEME], stats, AWQOptions())
    assert error < 0.9 * rtn_error
    awq = fake_quantize(weight * scale, SCHEME) / scale
    assert measured_error(x, weight, awq) < 0.9 * measured_error(x, weight, fake_quantize(weight, SCHEME))
    assert error == pytest.approx(
        measured_error(x, weight, awq), rel=1e-3
    )  # the summed squared output error per row


def test_clipping_never_increases_a_groups_error_and_helps_on_outlier_weights():
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    weight[torch.rand(weight.shape, generator=torch.Generator().manual_seed(5)) < 0.02] *= 6.0  # heavy tails
    hessian = stats_of(x).hessian.float()
    clipped = search_clip(weight, SCHEME, hessian)
    assert measured_error(x, weight, fake_quantize(clipped, SCHEME)) < measured_error(
        x, weight, fake_quantize(weight, SCHEME)
    )
    assert (clipped.abs() <= weight.abs() + 1e-6).all()


def test_clipping_searched_in_bands_of_rows_equals_one_search(monkeypatch):
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    hessian = stats_of(x).hessian.float()
    whole = search_clip(weight, SCHEME, hessian)
    monkeypatch.setattr(clipping, "ROWS", 16)  # bands of 16, 16 and 8 rows
    torch.testing.assert_close(search_clip(weight, SCHEME, hessian), whole, rtol=0, atol=1e-6)


def test_awq_layer_quantizes_every_layer_and_reports_scaled_mappings():
    model = build_tiny_llama(384, num_key_value_heads=4)
    layer = model.model.layers[0]
    names = [f"model.layers.0.{n}" for mapping in LLAMA.mappings for n in mapping.linears]
    stats = {}
    for group_names, features in ((names[:3], 64), (names[3:4], 64), (names[4:6], 64), (names[6:], 128)):
        shared = stats_of(outlier_inputs(rows=256, features=features))
        stats.update({n: shared for n in group_names})
    heard = {}
    quantized = awq_quantize_layer(
        layer,
        "model.layers.0",
        {n: SCHEME for n in names},
        stats,
        LLAMA.mappings,
        on_scaled=lambda n, e, r: heard.__setitem__(n, (e, r)),
    )
    assert sorted(quantized) == sorted(names)
    assert sorted(heard) == sorted(f"model.layers.0.{mapping.previous}" for mapping in LLAMA.mappings)
    assert all(error <= rtn for error, rtn in heard.values())
