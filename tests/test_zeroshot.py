import copy
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from slimlm.errors import ConfigError, SlimlmError
from slimlm.eval.report import markdown_tables
from slimlm.eval.stage import check_tasks, zeroshot_metrics
from slimlm.eval.zeroshot import BUNDLED_TASKS, Item, evaluate_task, load_task, score_items
from tests.conftest import REPO

DATA_ROOT = os.environ.get("SLIMLM_DATA_DIR", str(REPO.parent / "shared" / "data"))
CONTEXTS = [
    "The old house stood at the end of the ",
    "She opened the door and",
    "Question: what grows in spring?\nAnswer:",
]
ENDINGS = [" road", " lane by the river", " flowers", " nothing at all", " trees"]


def write_task(tmp_path, rows, name="mini", **fields):
    """A multiple-choice task over `rows` (question, options, gold) in tmp_path; `fields` override
    or, as None, remove."""
    (tmp_path / "mini.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    spec = {
        "name": name,
        "kind": "multiple_choice",
        "data": "mini.jsonl",
        "context": "{question}",
        "choices": "options",
        "answer_field": "gold",
        **fields,
    }
    spec = {key: value for key, value in spec.items() if value is not None}  # None: leave the field out
    path = tmp_path / f"{name}.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in spec.items()), encoding="utf-8")
    return path


def mc_rows(n):
    return [
        {
            "question": CONTEXTS[i % 3],
            "options": [ENDINGS[(i + j) % 5].strip() for j in range(2 + i % 3)],
            "gold": i % 2,
        }
        for i in range(n)
    ]


def hand_loglikelihood(model, tokenizer, context, continuation, prefix=()):
    """The harness's recipe, spelled out: split at the stripped context, score from full logits."""
    context_ids = list(prefix) + tokenizer(context.rstrip(), add_special_tokens=False)["input_ids"]
    whole = list(prefix) + tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    targets = whole[len(context_ids) :]
    with torch.no_grad():
        log_probs = model(torch.tensor([context_ids + targets])).logits[0].float().log_softmax(-1)
    rows = log_probs[len(context_ids) - 1 : -1]
    ll = sum(float(rows[j, t]) for j, t in enumerate(targets))
    return ll, all(int(rows[j].argmax()) == t for j, t in enumerate(targets))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_scores_match_a_hand_computation(tiny_model, tiny_tokenizer, attention):
    tiny_model.config._attn_implementation = attention
    items = [Item(c, tuple(e.strip() for e in ENDINGS), tuple(ENDINGS), 0) for c in CONTEXTS]
    scores = score_items(tiny_model, tiny_tokenizer, items, batch_size=2)
    for item, item_scores in zip(items, scores):
        for continuation, (ll, greedy) in zip(item.continuations, item_scores):
            expected_ll, expected_greedy = hand_loglikelihood(
                tiny_model, tiny_tokenizer, item.context, continuation
            )
            assert ll == pytest.approx(expected_ll, abs=1e-4)
            assert greedy == expected_greedy


def test_a_tokenizer_that_adds_bos_keeps_it(tiny_model, tiny_tokenizer):
    from tokenizers.processors import TemplateProcessing

    with_bos = copy.deepcopy(tiny_tokenizer)
    with_bos._tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", with_bos.bos_token_id)]
    )
    assert with_bos("a")["input_ids"][0] == with_bos.bos_token_id
    [[(ll, _)]] = score_items(tiny_model, with_bos, [Item(CONTEXTS[0], ("road",), (" road",), 0)])
    expected, _ = hand_loglikelihood(
        tiny_model, tiny_tokenizer, CONTEXTS[0], " road", prefix=[with_bos.bos_token_id]
    )
    assert ll == pytest.approx(expected, abs=1e-4)


def test_a_model_without_a_separate_head_uses_full_logits(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tiny_tokenizer),
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=3,
        )
    ).eval()
    [[(ll, _)]] = score_items(model, tiny_tokenizer, [Item(CONTEXTS[1], ("lane",), (" lane",), 0)])
    assert ll == pytest.approx(hand_loglikelihood(model, tiny_tokenizer, CONTEXTS[1], " lane")[0], abs=1e-4)


def test_lambada_metrics_match_a_hand_computation(tmp_path, tiny_model, tiny_tokenizer):
    texts = ["It was a dark and stormy night", "The river ran down to the sea", "nothing"]
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "lambada.yaml").write_text(
        "name: lam\nkind: last_word\ndata: lambada.jsonl\ncontext: '{text}'\n"
    )
    result = evaluate_task(
        tiny_model, tiny_tokenizer, load_task(str(tmp_path / "lambada.yaml"), tmp_path), batch_size=2
    )
    # "nothing" has no space: the harness scores " nothing" after an empty context, i.e. after BOS
    hand = [
        hand_loglikelihood(tiny_model, tiny_tokenizer, context, " " + word)
        for context, word in (t.rsplit(" ", 1) for t in texts[:2])
    ]
    hand.append(
        hand_loglikelihood(tiny_model, tiny_tokenizer, "", " nothing", prefix=[tiny_tokenizer.bos_token_id])
    )
    assert result.n == 3 and result.acc_norm is None
    assert result.acc == pytest.approx(sum(g for _, g in hand) / 3)
    assert result.ppl == pytest.approx(math.exp(-sum(ll for ll, _ in hand) / 3), rel=1e-5)


def test_acc_norm_divides_by_utf8_bytes(tmp_path, tiny_model, tiny_tokenizer):
    tiny_model.lm_head.weight.data.zero_()  # uniform next-token distribution: ll = -tokens * log(vocab)
    accented, plain = "ééé", "zqxj"  # 3 characters in 6 bytes; 4 in 4
    tokens = {
        c: len(tiny_tokenizer(f"Q: {c}")["input_ids"]) - len(tiny_tokenizer("Q:")["input_ids"])
        for c in (accented, plain)
    }
    by_bytes = {c: -tokens[c] / len(c.encode("utf-8")) for c in tokens}
    by_chars = {c: -tokens[c] / len(c) for c in tokens}
    assert (
        by_bytes[accented] > by_bytes[plain] and by_chars[accented] < by_chars[plain]
    )  # the case separates them
    path = write_task(tmp_path, [{"question": "Q:", "options": [plain, accented], "gold": 1}])
    result = evaluate_task(tiny_model, tiny_tokenizer, load_task(str(path), tmp_path))
    assert result.acc_norm == 1.0


def test_batch_size_does_not_change_results(tmp_path, tiny_model, tiny_tokenizer):
    task = load_task(str(write_task(tmp_path, mc_rows(7))), tmp_path)
    runs = [score_items(tiny_model, tiny_tokenizer, task.items, batch_size=size) for size in (1, 3, 16)]
    for other in runs[1:]:
        for item_a, item_b in zip(runs[0], other):
            assert [g for _, g in item_a] == [g for _, g in item_b]
            assert [ll for ll, _ in item_b] == pytest.approx([ll for ll, _ in item_a], abs=1e-4)
    results = [evaluate_task(tiny_model, tiny_tokenizer, task, batch_size=size).to_dict() for size in (1, 16)]
    assert {**results[0], "seconds": 0} == {**results[1], "seconds": 0}


def test_limit_takes_the_first_items(tmp_path, tiny_model, tiny_tokenizer):
    task = load_task(str(write_task(tmp_path, mc_rows(5))), tmp_path)
    assert evaluate_task(tiny_model, tiny_tokenizer, task, limit=2).n == 2
    with pytest.raises(SlimlmError, match="limit"):
        evaluate_task(tiny_model, tiny_tokenizer, task, limit=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"choice": "options"}, "unknown field 'choice'"),
        ({"context": None}, "field 'context' is required"),
        ({"choices": 3}, "field 'choices' must be str or a list of str"),
        ({"kind": "ranking"}, "kind 'ranking' is unknown"),
        ({"answer_file": "labels.lst"}, "exactly one of"),
        ({"preprocess": "nope"}, "preprocess 'nope' is unknown"),
    ],
)
def test_a_bad_task_file_is_refused_naming_file_and_field(tmp_path, fields, message):
    path = write_task(tmp_path, mc_rows(2), **fields)
    with pytest.raises(SlimlmError, match=message) as error:
        load_task(str(path), tmp_path)
    assert str(path) in str(error.value)


def test_bad_data_is_refused_naming_the_file(tmp_path):
    path = write_task(tmp_path, mc_rows(2))
    (tmp_path / "mini.jsonl").unlink()
    with pytest.raises(SlimlmError, match=r"mini\.jsonl' not found.*beside the task file.*SLIMLM_DATA_DIR"):
        load_task(str(path), tmp_path / "elsewhere")
    (tmp_path / "mini.jsonl").write_text("\n")
    with pytest.raises(SlimlmError, match="has no rows"):
        load_task(str(path), tmp_path)
    (tmp_path / "mini.jsonl").write_text('{"question": "x"\n')
    with pytest.raises(SlimlmError, match="line 1 is not JSON"):
        load_task(str(path), tmp_path)
    (tmp_path / "mini.jsonl").write_text('{"question": "x", "gold": 0}\n')
    with pytest.raises(SlimlmError, match="row 1 of mini.jsonl: no field 'options'"):
        load_task(str(path), tmp_path)


def test_unknown_task_name_lists_the_bundled_ones():
    with pytest.raises(SlimlmError, match="arc_easy"):
        load_task("arc_hard")


def test_hellaswag_preprocessing_matches_the_harness(tmp_path):
    row = {
        "activity_label": "Making a cake",
        "ctx_a": "Mix the flour. [title] Bake it.",
        "ctx_b": "then YOU",
        "endings": [" wait [step] an hour.", "eat it."],
        "label": "1",
    }
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_random1000_subset.raw.jsonl").write_text(json.dumps(row) + "\n")
    item = load_task("hellaswag", tmp_path).items[0]
    assert item.context == "Making a cake: Mix the flour.. Bake it. Then you"
    assert item.continuations == (" wait an hour.", " eat it.") and item.answer == 1


FIRST_ROWS = {
    "lambada": (5153, "signs", 0),
    "arc_easy": (2376, "Sunlight is the source of energy for nearly all ecosystems.", 0),
    "piqa": (
        1838,
        (
            "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, "
            "you will also need to supply it with a water bottle and a food dish."
        ),
        0,
    ),
    "hellaswag": (1000, "are in the gym practicing to do this pole vault, trying to do their best.", 3),
}


@pytest.mark.skipif(not os.path.isdir(DATA_ROOT), reason="the shared data root is absent")
@pytest.mark.parametrize("name", BUNDLED_TASKS)
def test_bundled_tasks_load_the_real_data(name):
    task = load_task(name, DATA_ROOT)
    count, answer_text, answer = FIRST_ROWS[name]
    assert len(task.items) == count
    first = task.items[0]
    assert first.answer == answer and first.choices[first.answer] == answer_text


def test_a_task_file_is_reported_by_its_name(tmp_path, tiny_model, tiny_tokenizer):
    path = write_task(tmp_path, mc_rows(4), name="my_task")
    zeroshot = SimpleNamespace(tasks=[str(path)], harness_tasks=[], limit=None, batch_size=2)
    state = SimpleNamespace(
        cfg=SimpleNamespace(
            eval=SimpleNamespace(zeroshot=zeroshot), data=SimpleNamespace(benchmarks_root=tmp_path)
        ),
        model=tiny_model,
        tokenizer=tiny_tokenizer,
    )
    metrics = zeroshot_metrics(state)
    assert {"my_task_acc", "my_task_acc_stderr", "my_task_acc_norm", "my_task_n"} <= set(metrics) and not any(
        str(tmp_path) in key for key in metrics
    )
    assert "| model | my_task acc | ± | my_task acc_norm | ± |" in markdown_tables(
        [{"name": "fp32", **metrics}]
    )


def test_task_names_that_collide_are_refused(tmp_path):
    with pytest.raises(SlimlmError, match="named 'piqa', as a bundled task is"):
        load_task(str(write_task(tmp_path, mc_rows(3), name="piqa")), tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = write_task(tmp_path / "a", mc_rows(3)), write_task(tmp_path / "b", mc_rows(3))
    check_tasks([str(first)], tmp_path / "a")
    with pytest.raises(ConfigError, match="both named 'mini'"):
        check_tasks([str(first), str(second)], tmp_path / "a")


def write_fill_blank(tmp_path, rows, **fields):
    (tmp_path / "blank.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    spec = {
        "name": "blank",
        "kind": "fill_blank",
        "data": "blank.jsonl",
        "context": "{sentence}",
        "choices": ["{option1}", "{option2}"],
        "answer_field": "answer",
        "answer_style": "number",
        **fields,
    }
    path = tmp_path / "blank.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in spec.items()), encoding="utf-8")
    return path


SENTENCES = [
    {
        "sentence": "The jar would not go on the shelf because the _ was too tall.",
        "option1": "jar",
        "option2": "shelf",
        "answer": "1",
    },
    {
        "sentence": "Ada thanked Ben because _ had carried the bags home.",
        "option1": "Ada",
        "option2": "Ben",
        "answer": "2",
    },
    {
        "sentence": "The sun dried the shirt because the _ was hot.",
        "option1": "sun",
        "option2": "shirt",
        "answer": 1,
    },
]


def test_fill_blank_scores_each_choices_context_with_the_shared_rest(tmp_path, tiny_model, tiny_tokenizer):
    """The harness's partial evaluation (WinoGrande): the context is the text up to the blank
    with the choice in it, the continuation a space and the rest after the blank; the choice
    under which the rest is most likely wins. Answers given as 1-based numbers."""
    task = load_task(str(write_fill_blank(tmp_path, SENTENCES)), tmp_path)
    first = task.items[0]
    assert first.choice_contexts == (
        "The jar would not go on the shelf because the jar",
        "The jar would not go on the shelf because the shelf",
    )
    assert first.continuations == (" was too tall.", " was too tall.") and [
        item.answer for item in task.items
    ] == [0, 1, 0]
    scores = score_items(tiny_model, tiny_tokenizer, task.items, batch_size=2)
    hand = [
        [
            hand_loglikelihood(tiny_model, tiny_tokenizer, context, item.continuations[0])[0]
            for context in item.choice_contexts
        ]
        for item in task.items
    ]
    assert [[ll for ll, _ in item_scores] for item_scores in scores] == [
        pytest.approx(lls, abs=1e-4) for lls in hand
    ]
    result = evaluate_task(tiny_model, tiny_tokenizer, task, batch_size=2)
    expected = [max(range(2), key=lambda j: lls[j]) == item.answer for lls, item in zip(hand, task.items)]
    assert result.acc == pytest.approx(sum(expected) / 3) and result.acc_norm is None and result.n == 3


def test_fill_blank_answers_as_letters_and_bad_files_are_refused(tmp_path):
    lettered = [{**row, "answer": "AB"[int(row["answer"]) - 1]} for row in SENTENCES]
    assert [
        item.answer
        for item in load_task(
            str(write_fill_blank(tmp_path, lettered, answer_style="letter")), tmp_path
        ).items
    ] == [0, 1, 0]
    with pytest.raises(SlimlmError, match="no blank marker '#'"):
        load_task(str(write_fill_blank(tmp_path, SENTENCES, blank="#")), tmp_path)
    with pytest.raises(SlimlmError, match="drop the field 'continuation'"):
        load_task(str(write_fill_blank(tmp_path, SENTENCES, continuation=" {choice}")), tmp_path)
    with pytest.raises(SlimlmError, match="answer 'A' is not a choice number"):
        load_task(str(write_fill_blank(tmp_path, lettered)), tmp_path)
    with pytest.raises(SlimlmError, match="answer_style 'roman' is unknown"):
        load_task(str(write_fill_blank(tmp_path, SENTENCES, answer_style="roman")), tmp_path)


def test_the_example_fill_blank_task_loads_its_data_from_beside_it():
    task = load_task(str(REPO / "examples" / "tasks" / "fill_blank_example.yaml"), "/nonexistent")
    assert len(task.items) == 40 and all(len(item.choice_contexts) == 2 for item in task.items)
