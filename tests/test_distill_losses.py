import math

import pytest
import torch
import torch.nn.functional as F

from slimlm.distill.losses import (
    LOSSES,
    HiddenProjector,
    bucketed,
    distillation_loss,
    divergence,
    forward_kl,
    jsd,
    reverse_kl,
    skew_kl,
    token_mean,
    tvd,
)
from slimlm.errors import ConfigError


def log_probs(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def random_logp(seed, shape=(3, 5, 11)):
    return F.log_softmax(
        torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2, dim=-1
    )


@pytest.mark.parametrize("name", LOSSES)
def test_every_divergence_of_equal_distributions_is_zero(name):
    p = random_logp(0)
    torch.testing.assert_close(
        divergence(name, p, p), torch.zeros(3, 5, dtype=torch.float64), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("name", LOSSES)
def test_every_divergence_is_positive_and_its_gradient_finite(name):
    student_logits = torch.randn(3, 5, 11, requires_grad=True)
    teacher_logits = torch.randn(3, 5, 11) * 8  # sharp: some teacher probabilities are tiny
    loss = distillation_loss(student_logits, teacher_logits, name, temperature=2.0).mean()
    loss.backward()
    assert loss > 0 and torch.isfinite(student_logits.grad).all()


def test_forward_and_reverse_kl_closed_forms():
    p, q = log_probs([0.5, 0.5]), log_probs([0.9, 0.1])
    assert float(forward_kl(p, q)) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))
    assert float(reverse_kl(p, q)) == pytest.approx(0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5))
    a, b = random_logp(1), random_logp(2)
    torch.testing.assert_close(forward_kl(a, b), F.kl_div(b, a, log_target=True, reduction="none").sum(-1))


def test_jsd_limits_symmetry_and_bound():
    p, q = random_logp(3), random_logp(4)
    torch.testing.assert_close(jsd(p, q, 0.5), jsd(q, p, 0.5))  # symmetric at beta = 1/2
    assert torch.all(jsd(p, q, 0.5) <= math.log(2) + 1e-12)
    disjoint_p, disjoint_q = log_probs([1.0, 1e-300]), log_probs([1e-300, 1.0])
    assert float(jsd(disjoint_p, disjoint_q, 0.5)) == pytest.approx(
        math.log(2)
    )  # the maximum, reached by disjoint supports
    for beta in (0.0, 1.0):  # the mixture is one of the two: nothing to compare
        assert torch.all(jsd(p, q, beta) == 0)
    small = jsd(p, q, 1e-4) / 1e-4  # small beta: beta * KL(p || q)-like, scaled by beta
    assert torch.all(small > 0) and torch.all(torch.isfinite(small))


def test_tvd_bounds_and_skew_kl_ends():
    p, q = random_logp(5), random_logp(6)
    assert torch.all((tvd(p, q) >= 0) & (tvd(p, q) <= 1))
    assert float(tvd(log_probs([1.0, 1e-300]), log_probs([1e-300, 1.0]))) == pytest.approx(1.0)
    torch.testing.assert_close(skew_kl(p, q, 0.0), forward_kl(p, q))  # alpha = 0 is forward KL
    assert torch.all(skew_kl(p, q, 1.0) == 0)
    assert torch.all(skew_kl(p, q, 0.1) < forward_kl(p, q))


def test_temperature_softens_and_scales_by_t_squared():
    student, teacher = torch.randn(4, 7), torch.randn(4, 7)
    for t in (0.5, 1.0, 3.0):
        expected = forward_kl(F.log_softmax(teacher / t, -1), F.log_softmax(student / t, -1)) * t * t
        torch.testing.assert_close(distillation_loss(student, teacher, "forward_kl", temperature=t), expected)


@pytest.mark.parametrize("name", LOSSES)
def test_top_k_buckets_are_exact_with_the_whole_vocabulary_and_a_lower_bound_otherwise(name):
    student, teacher = (
        torch.randn(2, 6, 50, dtype=torch.float64),
        torch.randn(2, 6, 50, dtype=torch.float64) * 3,
    )
    full = distillation_loss(student, teacher, name)
    teacher_logp = F.log_softmax(teacher, -1)
    everything = teacher_logp.topk(50, dim=-1).indices
    torch.testing.assert_close(
        distillation_loss(student, bucketed(teacher_logp, everything), name, teacher_indices=everything), full
    )
    top = teacher_logp.topk(8, dim=-1).indices
    truncated = distillation_loss(student, bucketed(teacher_logp, top), name, teacher_indices=top)
    assert torch.all(truncated <= full + 1e-5)  # computed in float32


def test_token_mean_counts_only_masked_positions_and_projector_matches_depths():
    values = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    assert float(token_mean(values, torch.tensor([[True, True], [True, False]]))) == pytest.approx(3.0)
    projector = HiddenProjector(student_width=8, teacher_width=16, student_layers=2, teacher_layers=6)
    assert projector.pairs == [(1, 3), (2, 6)]
    student = tuple(torch.randn(2, 5, 8) for _ in range(3))
    teacher = tuple(torch.randn(2, 5, 16) for _ in range(7))
    assert projector(student, teacher).shape == (2, 5)
    with pytest.raises(ConfigError):
        divergence("kl", random_logp(0), random_logp(1))
