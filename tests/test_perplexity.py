import math

import pytest
import torch

from slimlm.errors import SlimlmError
from slimlm.eval.perplexity import perplexity, window_count
from slimlm.eval.size import model_size


def test_perplexity_matches_transformers_loss(tiny_model):
    torch.manual_seed(0)
    ids = torch.randint(0, tiny_model.config.vocab_size, (3 * 32 + 5,))
    result = perplexity(tiny_model, ids, window=32)
    assert result.windows == 3 and result.tokens_scored == 3 * 31
    with torch.no_grad():
        windows = ids[: 3 * 32].view(3, 32)
        # transformers' own causal-LM loss: mean over the shifted labels of each window
        losses = [tiny_model(input_ids=w[None], labels=w[None]).loss for w in windows]
    expected = math.exp(float(torch.stack(losses).mean()))
    assert result.ppl == pytest.approx(expected, rel=1e-4)


def test_batching_does_not_change_perplexity(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (4 * 16,))
    one = perplexity(tiny_model, ids, window=16, batch_size=1)
    four = perplexity(tiny_model, ids, window=16, batch_size=4)
    assert four.ppl == pytest.approx(one.ppl, rel=1e-5)


def test_max_windows_limits_the_slice(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (10 * 16,))
    assert perplexity(tiny_model, ids, window=16, max_windows=2).tokens_scored == 2 * 15


def test_text_shorter_than_a_window_is_an_error():
    with pytest.raises(SlimlmError, match="fewer than one window"):
        window_count(100, 2048, None)


def test_size_counts_tied_weights_once(tiny_model):
    size = model_size(tiny_model)
    unique = {p.data_ptr(): p for p in tiny_model.parameters()}
    assert size.parameters == sum(p.numel() for p in unique.values())
    assert size.bits_per_weight == pytest.approx(32.0, rel=1e-3)  # fp32; the rotary buffer is tiny
