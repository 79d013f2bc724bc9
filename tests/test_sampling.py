"""Sampling settings: refused when meaningless, and never NaN at the extremes."""

import math

import pytest
import torch

from slimlm.errors import ConfigError
from slimlm.inference.sampling import (
    SMALLEST_TEMPERATURE,
    SamplingParams,
    next_tokens,
    sampling_probabilities,
    sampling_state,
)


@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 1e-40])
def test_a_temperature_float32_cannot_divide_by_is_greedy(temperature):
    """1e-300 rounds to 0 in float32: dividing the logits by it made the largest 0/0 (NaN) and
    the draw fail. Its limit, greedy decoding, is what it gets."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy and params.temperature == 0.0
    logits = torch.randn(3, 50)
    seen, generator = sampling_state([[1], [2], [3]], params, 50, torch.device("cpu"))
    assert torch.equal(next_tokens(logits, params, seen, generator), logits.argmax(-1))


def test_the_smallest_sampled_temperature_gives_a_distribution():
    params = SamplingParams(temperature=SMALLEST_TEMPERATURE)
    assert not params.greedy
    probabilities = sampling_probabilities(torch.randn(2, 50) * 30, params)
    assert torch.isfinite(probabilities).all() and torch.allclose(probabilities.sum(-1), torch.ones(2))


@pytest.mark.parametrize(
    "setting",
    [
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": -math.inf},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"top_k": 0},
        {"max_new_tokens": 0},
        {"max_new_tokens": -3},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": math.inf},
        {"repetition_penalty": math.nan},
        {"seed": 2**70},
    ],
    ids=str,
)
def test_meaningless_settings_are_refused(setting):
    name = next(iter(setting))
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**setting)


def test_generate_refuses_a_bad_setting_before_loading_the_model(tmp_path):
    """`slimlm generate` builds its settings with the same checks, before the (minutes of) loading."""
    from slimlm.inference.cli import generate_command

    with pytest.raises(ConfigError, match="top_p"):
        generate_command([str(tmp_path / "no-model"), "hello", "--top-p", "2"])
