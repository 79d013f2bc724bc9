"""The lm-evaluation-harness bridge (eval/harness.py): the harness's tasks on the data root's
files build the very requests slimlm's bundled tasks score, and harness tasks run in an
evaluate stage on the model in memory give slimlm's own accuracy."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimlm.eval.stage import zeroshot_metrics
from slimlm.eval.zeroshot import load_task
from tests.test_zeroshot import DATA_ROOT

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[harness]')"
)
needs_data = pytest.mark.skipif(not os.path.isdir(DATA_ROOT), reason="the shared data root is absent")

from slimlm.eval.harness import LOCAL_TASKS, local_tasks  # noqa: E402

PAIRS = {
    "arc_easy": "local_arc_easy",
    "piqa": "local_piqa",
    "hellaswag": "local_hellaswag",
    "lambada": "local_lambada_openai",
}


@needs_data
@pytest.mark.parametrize("ours", PAIRS)
def test_local_harness_tasks_ask_what_the_bundled_tasks_ask(ours, tmp_path):
    """The first documents' context, choices and answer as the harness builds them from the
    harness's own task file, against slimlm's items from the same file."""
    from lm_eval.tasks import TaskManager, get_task_dict

    folder = local_tasks(Path(DATA_ROOT), tmp_path)
    assert sorted(p.stem for p in folder.glob("*.yaml")) == sorted(LOCAL_TASKS)
    task = get_task_dict([PAIRS[ours]], TaskManager(include_path=str(folder)))[PAIRS[ours]]
    docs = list(task.eval_docs)
    items = load_task(ours, DATA_ROOT).items
    assert len(docs) == len(items)
    for doc, item in zip(docs[:5], items[:5]):
        if ours == "lambada":
            assert task.doc_to_text(doc) == item.context and task.doc_to_target(doc) == item.continuations[0]
            continue
        assert task.doc_to_text(doc) == item.context
        assert list(task.doc_to_choice(doc)) == list(item.choices) and task.doc_to_target(doc) == item.answer


@needs_data
def test_harness_tasks_in_an_evaluate_stage_score_as_slimlm_does(tiny_model, tiny_tokenizer, tmp_path):
    """eval.zeroshot.harness_tasks: the harness on the run's model in memory, its rows keyed as
    slimlm's own (acc, acc_norm and their standard errors equal to slimlm's on the same items)."""
    zeroshot = SimpleNamespace(tasks=["arc_easy"], harness_tasks=["local_arc_easy"], limit=12, batch_size=4)
    cfg = SimpleNamespace(
        eval=SimpleNamespace(zeroshot=zeroshot), data=SimpleNamespace(benchmarks_root=DATA_ROOT)
    )
    metrics = zeroshot_metrics(
        SimpleNamespace(cfg=cfg, model=tiny_model, tokenizer=tiny_tokenizer, run_dir=tmp_path)
    )
    assert metrics["local_arc_easy_n"] == metrics["arc_easy_n"] == 12
    for key in ("acc", "acc_norm"):
        assert metrics[f"local_arc_easy_{key}"] == metrics[f"arc_easy_{key}"]
        assert metrics[f"local_arc_easy_{key}_stderr"] == pytest.approx(metrics[f"arc_easy_{key}_stderr"])
