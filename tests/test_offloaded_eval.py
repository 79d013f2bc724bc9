"""Perplexity, KL and reference collection one decoder block at a time (eval/offloaded.py)
equal those of the model in memory (eval/perplexity.py)."""

import pytest
import torch

from slimlm.eval.offloaded import score_checkpoint
from slimlm.eval.perplexity import score_text
from tests.tiny_families import build_tiny

WINDOW = 24


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"tie_word_embeddings": False}),
        ("gemma3_text", {}),
        ("qwen3_moe", {}),
        ("mixtral", {}),
    ],
    ids=["llama-tied", "llama-untied", "gemma3-softcapped", "qwen3-moe", "mixtral"],
)
def test_offloaded_scores_equal_the_in_memory_ones(tmp_path, model_type, overrides):
    model = build_tiny(model_type, 256, split=False, initializer_range=0.2, **overrides)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    ids = torch.randint(4, 256, (7 * WINDOW + 5,), generator=torch.Generator().manual_seed(0))
    other = build_tiny(model_type, 256, seed=1, initializer_range=0.2, **overrides)
    reference = score_text(other, ids, WINDOW, collect_top_k=8).reference
    expected = score_text(model, ids, WINDOW, reference=reference, collect_top_k=8)
    hidden_bytes = 3 * WINDOW * 64 * 4  # groups of three windows: the checkpoint is walked three times
    scores = score_checkpoint(
        tmp_path, ids, WINDOW, reference=reference, collect_top_k=8, hidden_bytes=hidden_bytes
    )
    assert scores.perplexity.tokens_scored == expected.perplexity.tokens_scored == 7 * (WINDOW - 1)
    assert scores.perplexity.ppl == pytest.approx(expected.perplexity.ppl, rel=1e-5)
    assert scores.distance["kl_mean"] == pytest.approx(expected.distance["kl_mean"], rel=1e-4, abs=1e-7)
    assert scores.distance["top1_agreement"] == expected.distance["top1_agreement"]
    torch.testing.assert_close(scores.reference.log_probs, expected.reference.log_probs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_the_offloaded_size_report_equals_the_in_memory_one(tmp_path, tied):
    from slimlm.eval.offloaded import checkpoint_size
    from slimlm.eval.size import model_size

    model = build_tiny("llama", 256, split=False, tie_word_embeddings=tied)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:, :7] = 0.0  # some zeros to count
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert checkpoint_size(tmp_path) == model_size(model)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16
    )  # rotary tables stay float32, as loading keeps them
    assert checkpoint_size(tmp_path, torch.bfloat16) == model_size(loaded)
