import json

import pytest
import torch

from slimlm.distill.data import BatchOrder, cut_windows
from slimlm.distill.losses import HiddenProjector, distillation_loss
from slimlm.distill.teacher import OnlineTeacher, check_same_vocabulary, offline_teacher
from slimlm.distill.train import Trainer, TrainSettings
from slimlm.errors import SlimlmError
from tests.conftest import build_tiny_llama

VOCAB = 384
TOKENS = torch.randint(0, VOCAB, (40 * 32,), generator=torch.Generator().manual_seed(0))


def accelerator(accumulation=2):
    from accelerate import Accelerator

    return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)


def setup(
    tmp_path,
    steps=8,
    loss="forward_kl",
    top_k=16,
    lr=3e-3,
    fingerprint=None,
    student_seed=1,
    hidden=False,
    **settings,
):
    windows = cut_windows(TOKENS, seq_len=32, held_out=4, batch_size=2)
    order = BatchOrder(windows=windows.train.shape[0], batch_size=2, accumulation=2, world=1, seed=0)
    teacher = build_tiny_llama(VOCAB, seed=0)
    signal = None
    if loss != "ce":
        signal = (
            offline_teacher(teacher, "tiny-teacher", windows.train, order.used(steps), top_k, 1.0, 4)[0]
            if top_k
            else OnlineTeacher(teacher)
        )
    # with hidden states, a narrower student: its one layer is projected onto the teacher's last
    narrow = dict(hidden_size=32, intermediate_size=64) if hidden else {}
    student = build_tiny_llama(VOCAB, seed=student_seed, num_hidden_layers=1, **narrow)
    projector = HiddenProjector(32, 64, 1, teacher.config.num_hidden_layers) if hidden else None
    settings = TrainSettings(steps=steps, loss=loss, lr=lr, eval_every=4, checkpoint_every=2, **settings)
    return Trainer(
        student,
        signal,
        windows,
        order,
        settings,
        tmp_path,
        fingerprint or {"recipe": "test"},
        accelerator(),
        projector,
    )


def test_batches_are_a_function_of_the_step_alone():
    order = BatchOrder(windows=10, batch_size=3, accumulation=2, world=2, seed=5)
    seen = torch.cat(
        [order.indices(step, micro, rank) for step in range(2) for micro in range(2) for rank in range(2)]
    )
    assert sorted(seen[:10].tolist()) == list(range(10))  # one pass visits every window once
    assert torch.equal(order.indices(1, 1, 0), order.indices(1, 1, 0))
    assert set(order.used(1).tolist()) == set(seen[:12].tolist()[:10]) | set(seen[10:12].tolist())


def test_offline_cache_gives_the_online_loss_up_to_the_top_k_truncation(tmp_path):
    windows = cut_windows(TOKENS, seq_len=32, held_out=4, batch_size=2)
    teacher, student = build_tiny_llama(VOCAB, seed=0), build_tiny_llama(VOCAB, seed=1)
    used = torch.arange(6)
    ids = windows.train[used]
    with torch.no_grad():
        logits = student(input_ids=ids).logits[:, :-1]
    online = distillation_loss(logits, OnlineTeacher(teacher)(ids, used).logits).mean()
    everything, path, reused = offline_teacher(teacher, "tiny", windows.train, used, VOCAB, 1.0, 4)
    assert not reused and path.is_file()
    exact = everything(ids, used)
    path.write_bytes(b"not safetensors")  # a damaged cache is computed again, never trusted
    again, _, reused = offline_teacher(teacher, "tiny", windows.train, used, VOCAB, 1.0, 4)
    assert not reused and torch.equal(again(ids, used).log_probs, exact.log_probs)
    torch.testing.assert_close(
        distillation_loss(logits, exact.log_probs, teacher_indices=exact.indices).mean(),
        online,
        rtol=1e-4,
        atol=1e-5,
    )
    truncated = []
    for k in (16, 128):  # a random tiny teacher is nearly uniform: the truncation shows, and shrinks with k
        top = offline_teacher(teacher, "tiny", windows.train, used, k, 1.0, 4)[0](ids, used)
        truncated.append(float(distillation_loss(logits, top.log_probs, teacher_indices=top.indices).mean()))
    assert 0 < truncated[0] < truncated[1] <= float(online) + 1e-5
    assert offline_teacher(teacher, "tiny", windows.train, used, 16, 1.0, 4)[
        2
    ]  # the second time it is read from disk


def test_distillation_lowers_the_kl_to_the_teacher(tmp_path):
    trainer = setup(tmp_path, steps=12)
    result = trainer.run()
    kd = [record["kd"] for record in result.history]
    assert kd[-1] < 0.7 * kd[0]
    assert [e["step"] for e in result.evals] == [4, 8, 12]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 12
    assert [p.name for p in trainer.checkpoints()] == [
        "step-0000010",
        "step-0000012",
    ]  # only the newest two are kept


def test_a_killed_run_resumes_with_the_same_loss_curve(tmp_path, monkeypatch):
    whole = setup(tmp_path / "whole").run().history
    interrupted = setup(tmp_path / "killed")
    save = Trainer.save

    def save_then_die(self, step, result):
        path = save(self, step, result)
        if step == 4:
            raise KeyboardInterrupt  # killed right after the step-4 checkpoint
        return path

    monkeypatch.setattr(Trainer, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    monkeypatch.setattr(Trainer, "save", save)
    (
        tmp_path / "killed" / "checkpoints" / ".step-0000006-partial-x"
    ).mkdir()  # a checkpoint cut off while being written
    resumed = setup(tmp_path / "killed")
    result = resumed.run()
    assert result.resumed_from == 4
    assert [r["loss"] for r in result.history] == [r["loss"] for r in whole]
    assert len((tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()) == 8


def test_on_policy_distillation_trains_through_the_trainer_without_fitting_its_own_samples(
    tmp_path, monkeypatch
):
    """GKD: half the micro-batches are the student's own continuations, scored by the online
    teacher; those get the divergence only, never cross-entropy on the student's own tokens."""
    trainer = setup(tmp_path, steps=10, top_k=None, on_policy_fraction=0.5, ce_weight=0.3)
    seen = []
    micro_loss = trainer.micro_loss

    def recording(step, micro):
        terms = micro_loss(step, micro)
        seen.append(("ce" in terms, terms["loss"].detach(), terms["kd"].detach()))
        return terms

    trainer.micro_loss = recording
    before = held_out_kl(trainer)
    history = trainer.run().history
    after = held_out_kl(trainer)
    on_policy = [(loss, kd) for has_ce, loss, kd in seen if not has_ce]
    assert 0 < len(on_policy) < len(seen)  # both kinds of micro-batch ran
    for loss, kd in on_policy:
        torch.testing.assert_close(loss, 0.7 * kd)
    assert any("ce" not in record for record in history)  # steps of on-policy batches alone log no ce
    assert after < 0.9 * before


@torch.no_grad()
def held_out_kl(trainer) -> float:
    """Forward KL from the online teacher to the student on the held-out windows."""
    ids = trainer.windows.held_out
    student = trainer.student(input_ids=ids).logits[:, :-1]
    return float(distillation_loss(student, trainer.teacher(ids, None).logits).mean())


def test_hidden_state_distillation_trains_through_the_trainer(tmp_path):
    trainer = setup(tmp_path, steps=10, top_k=None, hidden=True, hidden_weight=1.0, lr=1e-2)
    projection = trainer.projector.projections[0].weight.detach().clone()
    history = trainer.run().history
    assert history[-1]["hidden"] < 0.7 * history[0]["hidden"]
    assert history[-1]["kd"] < history[0]["kd"]
    assert not torch.equal(projection, trainer.projector.projections[0].weight)  # the projector learned


def test_plain_cross_entropy_needs_no_teacher(tmp_path):
    result = setup(tmp_path, steps=6, loss="ce").run()
    assert "kd" not in result.history[0] and result.history[-1]["ce"] < result.history[0]["ce"]


def test_nan_loss_stops_and_names_the_last_good_checkpoint(tmp_path):
    trainer = setup(tmp_path, steps=8)
    original = trainer.save

    def save_and_poison(step, result):  # poison the weights after step 2's checkpoint: the next loss is NaN
        path = original(step, result)
        if step == 2:
            with torch.no_grad():
                next(trainer.student.parameters()).fill_(float("nan"))
        return path

    trainer.save = save_and_poison
    with pytest.raises(SlimlmError, match=r"became nan .*at step 3.*step-0000002.*fresh run directory"):
        trainer.run()
    assert [p.name for p in trainer.checkpoints()] == ["step-0000002"]


def test_a_checkpoint_of_another_recipe_is_refused(tmp_path):
    setup(tmp_path, steps=2).run()
    with pytest.raises(SlimlmError, match="different distillation"):
        setup(tmp_path, steps=2, fingerprint={"recipe": "other"}).run()


def test_mismatched_vocabularies_and_short_data_are_refused(tiny_tokenizer):
    from transformers import AutoTokenizer  # noqa: F401

    teacher, student = build_tiny_llama(VOCAB), build_tiny_llama(VOCAB + 8)
    with pytest.raises(SlimlmError, match="vocabulary has 392 entries"):
        check_same_vocabulary(tiny_tokenizer, tiny_tokenizer, student, teacher)
    other = build_tokenizer_with_extra_token(tiny_tokenizer)
    with pytest.raises(SlimlmError, match="tokenizer .* differs"):
        check_same_vocabulary(other, tiny_tokenizer, teacher, teacher)
    with pytest.raises(SlimlmError, match="fewer than the 4 held out plus one batch of 8"):
        cut_windows(TOKENS[:300], seq_len=32, held_out=4, batch_size=8)


def build_tokenizer_with_extra_token(tokenizer):
    import copy

    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<|extra|>"])
    return other


def test_result_file_is_written(tmp_path):
    setup(tmp_path, steps=2).run()
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["settings"]["steps"] == 2 and len(saved["history"]) == 2


def test_distill_settings_that_would_train_nothing_are_refused():
    from slimlm.distill.stage import DistillParams, loss_beta
    from slimlm.errors import ConfigError

    for bad in (
        dict(loss="jsd", beta=0.0),
        dict(loss="jsd", beta=1.0),
        dict(loss="skew_kl", beta=1.0),
        dict(loss="ce", ce_weight=0.5),
        dict(top_k=8, on_policy_fraction=0.5),
        dict(tokens=100),
        dict(lr=float("nan")),
        dict(lr=float("inf")),
    ):
        with pytest.raises(ConfigError):
            DistillParams(**bad)
    assert loss_beta(DistillParams(loss="skew_kl")) == 0.1 and loss_beta(DistillParams(loss="jsd")) == 0.5
