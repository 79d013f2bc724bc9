import itertools

import pytest
import torch

from slimlm.compress.mixed import (
    bits_per_weight,
    choose_bits,
    fisher_diagonal,
    measure_kl_sensitivity,
    predicted_loss,
)
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantScheme
from tests.conftest import build_tiny_llama


def test_bits_per_weight_counts_scales_and_zero_points():
    assert bits_per_weight(QuantScheme(bits=4, group_size=64), 576) == 4.25
    assert bits_per_weight(QuantScheme(bits=4, group_size=64, symmetric=False), 576) == 4.375
    assert bits_per_weight(QuantScheme(bits=8), 576) == pytest.approx(8 + 16 / 576)


def brute_force(costs, sizes, budget_bpw):
    names = list(costs)
    total = sum(sizes[n][0] for n in names)
    best = None
    for choice in itertools.product(*(sorted(costs[n]) for n in names)):
        used = sum(sizes[n][0] * sizes[n][1][b] for n, b in zip(names, choice))
        loss = sum(costs[n][b] for n, b in zip(names, choice))
        if used <= budget_bpw * total + 1e-9 and (best is None or loss < best[0]):
            best = (loss, dict(zip(names, choice)))
    return best


def convex_costs(seed, layers=5):
    """Loss falling by a constant factor per extra bit (convex in bits), scaled per layer."""
    generator = torch.Generator().manual_seed(seed)
    sensitivity = torch.rand(layers, generator=generator) * 10
    costs = {f"l{i}": {b: float(sensitivity[i]) * 4.0 ** (-b) for b in (2, 3, 4, 8)} for i in range(layers)}
    sizes = {f"l{i}": (1000 * (1 + i % 3), {b: b + 0.25 for b in (2, 3, 4, 8)}) for i in range(layers)}
    return costs, sizes


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [2.25, 3.0, 3.5, 4.25, 6.0])
def test_allocation_meets_the_budget_and_is_near_the_optimum(seed, budget):
    costs, sizes = convex_costs(seed)
    allocation = choose_bits(costs, sizes, budget)
    assert allocation.bpw <= budget + 1e-9
    optimum, _ = brute_force(costs, sizes, budget)
    uniform_low = sum(c[2] for c in costs.values())
    assert allocation.predicted_loss <= uniform_low
    # Greedy on convex hulls is optimal up to the last partly fitting upgrade.
    assert allocation.predicted_loss <= optimum + max(c[2] - c[3] for c in costs.values()) + 1e-12


def test_sensitive_layers_get_more_bits():
    costs = {"robust": {3: 0.01, 4: 0.005}, "sensitive": {3: 1.0, 4: 0.2}}
    sizes = {name: (100, {3: 3.25, 4: 4.25}) for name in costs}
    assert choose_bits(costs, sizes, 3.75).bits == {"robust": 3, "sensitive": 4}


def test_budget_below_the_smallest_candidate_is_refused():
    costs, sizes = convex_costs(0)
    with pytest.raises(SlimlmError, match="below what the smallest candidate needs"):
        choose_bits(costs, sizes, 2.0)


def test_fisher_is_the_mean_squared_per_window_gradient():
    model = build_tiny_llama(384)
    windows = torch.randint(0, 384, (3, 16), generator=torch.Generator().manual_seed(0))
    name = "model.layers.1.mlp.down_proj"
    fisher = fisher_diagonal(model, windows, [name])[name]
    expected = torch.zeros_like(fisher)
    for window in windows:
        model.zero_grad()
        model(input_ids=window[None], labels=window[None]).loss.backward()
        expected += model.get_submodule(name).weight.grad ** 2 / len(windows)
    torch.testing.assert_close(fisher, expected)
    assert all(p.requires_grad for p in model.parameters())  # the model is left as it was


def test_fisher_proxy_ranks_layers_like_their_measured_kl():
    """The proxy the bit allocation relies on, against the quantity it stands for."""
    model = build_tiny_llama(384, num_hidden_layers=3)
    windows = torch.randint(0, 384, (16, 32), generator=torch.Generator().manual_seed(1))
    names = select_linear_modules(model, [r"model\.layers\.\d+\..*"], [])
    fisher = fisher_diagonal(model, windows, names)
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=windows).logits.float(), dim=-1)
    predicted, measured = [], []
    for name in names:
        for bits in (2, 4):
            scheme = QuantScheme(bits=bits, group_size=16)
            predicted.append(
                predicted_loss(model.get_submodule(name).weight, fisher[name], scheme, windows.shape[1])
            )
            measured.append(measure_kl_sensitivity(model, windows, name, scheme, reference))

    def rank(values):
        return torch.tensor(values).argsort().argsort().float()

    spearman = float(torch.corrcoef(torch.stack([rank(predicted), rank(measured)]))[0, 1])
    assert spearman > 0.8
