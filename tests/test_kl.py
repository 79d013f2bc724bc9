import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from slimlm.eval.kl import ReferenceLogits, reference_path
from slimlm.eval.perplexity import score_text
from slimlm.eval.stage import cached_reference, store_reference
from slimlm.pipeline import RunMemo


def reference_of(model, ids, window, k):
    return score_text(model, ids, window, collect_top_k=k).reference


def perturbed(model, scale, seed=0):
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in noisy.named_parameters():
            if name.endswith("proj.weight"):
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return noisy


@pytest.fixture
def ids(tiny_model):
    return torch.randint(
        0, tiny_model.config.vocab_size, (4 * 24,), generator=torch.Generator().manual_seed(3)
    )


def test_kl_of_a_model_to_itself_is_zero(tiny_model, ids):
    reference = reference_of(tiny_model, ids, 24, k=8)
    distance = score_text(tiny_model, ids, 24, reference=reference).distance
    assert distance["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    assert distance["top1_agreement"] == 1.0


def test_full_vocabulary_top_k_gives_the_exact_kl(tiny_model, ids):
    vocab = tiny_model.config.vocab_size
    reference = reference_of(tiny_model, ids, 24, k=vocab)
    other = perturbed(tiny_model, 0.5)
    distance = score_text(other, ids, 24, reference=reference).distance
    with torch.no_grad():
        windows = ids.view(4, 24)
        log_p = F.log_softmax(tiny_model(windows).logits[:, :-1].float(), -1).flatten(0, 1)
        log_q = F.log_softmax(other(windows).logits[:, :-1].float(), -1).flatten(0, 1)
    exact = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert distance["kl_mean"] == pytest.approx(float(exact.mean()), rel=1e-4)
    agreement = float((log_p.argmax(-1) == log_q.argmax(-1)).float().mean())
    assert distance["top1_agreement"] == pytest.approx(agreement)


def test_truncated_kl_is_a_lower_bound_and_grows_with_the_perturbation(tiny_model, ids):
    full = reference_of(tiny_model, ids, 24, k=tiny_model.config.vocab_size)
    truncated = reference_of(tiny_model, ids, 24, k=16)
    small, large = perturbed(tiny_model, 0.05), perturbed(tiny_model, 0.5)
    kl_small = score_text(small, ids, 24, reference=truncated).distance["kl_mean"]
    kl_large = score_text(large, ids, 24, reference=truncated).distance["kl_mean"]
    kl_large_exact = score_text(large, ids, 24, reference=full).distance["kl_mean"]
    assert 0 < kl_small < kl_large <= kl_large_exact + 1e-9


def test_reference_round_trips_through_disk(tiny_model, ids, tmp_path):
    reference = reference_of(tiny_model, ids, 24, k=8)
    path = tmp_path / "ref.safetensors"
    reference.save(path)
    loaded = ReferenceLogits.load(path)
    assert torch.equal(loaded.log_probs, reference.log_probs) and torch.equal(
        loaded.indices, reference.indices
    )
    assert (loaded.nll, loaded.window, loaded.windows) == (reference.nll, 24, 4)


def test_reference_key_depends_on_model_text_and_windows(ids):
    base = reference_path("a" * 64, ids, 24, 4, 32)
    assert base == reference_path("a" * 64, ids, 24, 4, 32)
    assert base != reference_path("b" * 64, ids, 24, 4, 32)
    assert base != reference_path("a" * 64, ids, 24, 3, 32)
    assert base != reference_path("a" * 64, ids.flip(0), 24, 4, 32)


def run_state(dtype: str, revision=None):
    """What the evaluate stage reads to key a reference: the run's model config and source."""
    cfg = SimpleNamespace(
        model=SimpleNamespace(dtype=dtype, revision=revision),
        eval=SimpleNamespace(
            perplexity=SimpleNamespace(window=24, max_windows=4), kl=SimpleNamespace(top_k=8)
        ),
    )
    return SimpleNamespace(cfg=cfg, source_sha256="c" * 64, source=SimpleNamespace(id="tiny"), memo=RunMemo())


def test_a_bf16_run_does_not_read_an_fp32_runs_reference(tiny_model, ids):
    store_reference(run_state("float32"), ids, reference_of(tiny_model, ids, 24, k=8))
    assert cached_reference(run_state("float32"), ids) is not None  # from disk, in a new run
    assert cached_reference(run_state("bfloat16"), ids) is None
    assert cached_reference(run_state("float32", revision="v2"), ids) is None
