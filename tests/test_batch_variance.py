"""bench/batch_variance.py: greedy answers alone and batched, and where they part."""

import json
import math
import subprocess
import sys

import torch

from tests.conftest import REPO, build_tiny_llama, build_tokenizer

sys.path.insert(0, str(REPO / "bench"))
from batch_variance import Run, answers_alone, differences, logit_gaps, near_ties  # noqa: E402

from slimlm.inference.build import build_decoder  # noqa: E402
from slimlm.inference.decoder import Decoder  # noqa: E402
from slimlm.inference.sampling import SamplingParams  # noqa: E402


def test_quick_batch_variance_compares_every_prompt_in_both_batches(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "batch_variance.py"), "--quick", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "batch_variance.json").read_text())["rows"]
    assert [row["name"] for row in rows] == ["tiny fp32 together", "tiny fp32 beside sampled"]
    for row in rows:
        assert row["prompts"] == 4 and 0 <= row["answered_differently"] <= 4
        assert len(row["first_difference_tokens"]) == row["answered_differently"]
        assert (
            0 < row["steps_compared"] <= 4 * 8
            and 0 <= row["steps_bitwise_identical"] <= row["steps_compared"]
        )
        assert 0 <= row["alone_steps_within_twice_that"] <= row["alone_steps"] == 4 * 8


def test_a_difference_is_found_at_its_first_token_with_the_alone_answers_margin_there():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    decoder = Decoder(
        build_decoder(build_tiny_llama(len(tokenizer), initializer_range=0.2).eval(), dtype=torch.float32),
        tokenizer,
    )
    prompts = [
        tokenizer.encode("the cat sat on", add_special_tokens=False),
        tokenizer.encode("a dog ran", add_special_tokens=False),
    ]
    alone = answers_alone(decoder, prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert sorted(alone.logits) == [(p, t) for p in range(2) for t in range(6)]
    assert all(
        int(alone.logits[0, t].argmax()) == alone.answers[0][t] for t in range(6)
    )  # greedy: each token its step's best
    changed = [*alone.answers[0][:3], (alone.answers[0][3] + 1) % len(tokenizer), *alone.answers[0][4:]]
    batched = Run(
        [changed, alone.answers[1]],
        {key: value + (1e-3 if key == (1, 2) else 0) for key, value in alone.logits.items()},
    )
    (found,) = differences(alone, batched)
    assert found.prompt == 0 and found.token == 3 and found.margin >= 0
    compared, identical, largest = logit_gaps(alone, batched)
    assert (
        compared == 4 + 6 and identical == compared - 1 and abs(largest - 1e-3) < 1e-6
    )  # prompt 0 up to its difference; prompt 1 all
    assert near_ties(alone, 0.0) == 0 and near_ties(alone, float("inf")) == 12
    ended = differences(Run([alone.answers[0][:2], alone.answers[1]], alone.logits), alone)
    assert ended[0].token == 2 and math.isnan(ended[0].margin)  # the alone answer had ended there
