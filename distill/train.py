"""The distillation training loop, on `accelerate`: the same code on a CPU, one GPU, or several
GPUs and nodes under `accelerate launch` (DDP, FSDP or DeepSpeed as its config says).

Each optimizer step takes `accumulation` micro-batches per process (distill/data.py says which
windows), computes the loss against the teacher's signal (distill/teacher.py) and, with
`ce_weight`, the plain next-token cross-entropy; `loss: ce` is plain fine-tuning, the baseline.
With `on_policy_fraction`, that share of micro-batches are the student's own continuations of
the window's first half, scored by the (online) teacher: GKD's on-policy data. Those get no
cross-entropy term (fitting the student's own samples would only reinforce them): their loss is
the `(1 - ce_weight)` share of the divergence (plus the hidden-state term), and the logged `ce`
of a step averages over its data micro-batches alone.

Checkpoints (`accelerator.save_state`: weights, optimizer, schedule, random states, plus the
loss history) are written into a staging directory and renamed into place, so a kill leaves
only whole checkpoints; a rerun with the same recipe resumes from the newest and reproduces the
uninterrupted loss curve. A NaN or infinite loss stops the run and names the last good one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from slimlm.distill.data import BatchOrder, Windows
from slimlm.distill.losses import HiddenProjector, distillation_loss, token_mean
from slimlm.distill.teacher import TeacherOutput
from slimlm.errors import SlimlmError
from slimlm.rundir import write_atomic


@dataclass
class TrainSettings:
    steps: int
    loss: str = "forward_kl"  # a divergence of distill/losses.py, or "ce" (no teacher)
    temperature: float = 1.0
    beta: float = 0.5
    ce_weight: float = 0.0
    hidden_weight: float = 0.0
    on_policy_fraction: float = 0.0
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    max_grad_norm: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    seed: int = 0


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)  # per optimizer step
    evals: list[dict] = field(default_factory=list)  # held-out perplexity every eval_every steps
    resumed_from: Optional[int] = None
    seconds: float = 0.0


Teacher = Callable[..., TeacherOutput]


class Trainer:
    def __init__(
        self,
        student: nn.Module,
        teacher: Optional[Teacher],
        windows: Windows,
        order: BatchOrder,
        settings: TrainSettings,
        out_dir: Path,
        fingerprint: dict,
        accelerator,
        projector: Optional[HiddenProjector] = None,
    ):
        self.teacher, self.windows, self.order, self.settings = teacher, windows, order, settings
        self.out_dir, self.fingerprint, self.accelerator = Path(out_dir), fingerprint, accelerator
        if accelerator.gradient_accumulation_steps != order.accumulation:
            raise SlimlmError(
                f"the accelerator accumulates {accelerator.gradient_accumulation_steps} micro-batches "
                f"per step but the batch order {order.accumulation}; build both from one setting"
            )
        trainable = [p for p in student.parameters() if p.requires_grad] + (
            [] if projector is None else list(projector.parameters())
        )
        if settings.keep_checkpoints < 1:
            raise SlimlmError("keep_checkpoints must be at least 1: resuming needs the newest checkpoint")
        if not trainable:
            raise SlimlmError(
                "the student has no trainable parameters (everything is frozen); check distill.lora targets"
            )
        from transformers import get_cosine_schedule_with_warmup

        optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)
        # Not prepared by accelerate, which would step it once per process and optimizer step
        # (its schedules count per-process batches); checkpointed all the same.
        self.schedule = get_cosine_schedule_with_warmup(
            optimizer, int(settings.warmup_fraction * settings.steps), settings.steps
        )
        accelerator.register_for_checkpointing(self.schedule)
        learns = projector is not None and any(
            True for _ in projector.parameters()
        )  # an identity projector has nothing to train or wrap
        prepared = accelerator.prepare(student, optimizer, *([projector] if learns else []))
        self.student, self.optimizer = prepared[:2]
        self.projector = prepared[2] if learns else projector
        self.models = [self.student, *([self.projector] if learns else [])]

    # ---- checkpoints ----------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        return self.out_dir / "checkpoints"

    def checkpoints(self) -> list[Path]:
        if not self.checkpoint_root.is_dir():
            return []
        return sorted(
            p
            for p in self.checkpoint_root.iterdir()
            if p.name.startswith("step-") and (p / "meta.json").is_file()
        )

    def save(self, step: int, result: TrainResult) -> Path:
        """Every process writes its part (accelerate shards and random states) into a staging
        directory; the main process then adds the history and renames it into place."""
        path = self.checkpoint_root / f"step-{step:07d}"
        staging = self.checkpoint_root / f".{path.name}-partial"
        acc = self.accelerator
        if acc.is_main_process:
            if path.exists():
                raise SlimlmError(f"checkpoint {path} already exists; checkpoints are never overwritten")
            shutil.rmtree(staging, ignore_errors=True)  # left by a process killed while saving
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(staging))
        acc.wait_for_everyone()
        if acc.is_main_process:
            meta = {
                "step": step,
                "fingerprint": self.fingerprint,
                "history": result.history,
                "evals": result.evals,
            }
            (staging / "meta.json").write_text(json.dumps(meta))
            os.replace(staging, path)
            for old in self.checkpoints()[: max(len(self.checkpoints()) - self.settings.keep_checkpoints, 0)]:
                shutil.rmtree(old)
        acc.wait_for_everyone()
        return path

    def resume(self, result: TrainResult) -> int:
        """Load the newest checkpoint of this run; returns the step to continue from."""
        found = self.checkpoints()
        if not found:
            return 0
        meta = json.loads((found[-1] / "meta.json").read_text())
        if meta["fingerprint"] != self.fingerprint:
            changed = sorted(
                k
                for k in set(meta["fingerprint"]) | set(self.fingerprint)
                if meta["fingerprint"].get(k) != self.fingerprint.get(k)
            )
            raise SlimlmError(
                f"checkpoint {found[-1]} was written by a different distillation (differs in {changed}); "
                "resume with the recipe that wrote it, or run in a fresh directory"
            )
        self.accelerator.load_state(str(found[-1]))
        result.history, result.evals, result.resumed_from = meta["history"], meta["evals"], meta["step"]
        return meta["step"]

    # ---- one step ---------------------------------------------------------------------

    def micro_loss(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        s = self.settings
        indices = self.order.indices(step, micro, self.accelerator.process_index)
        ids = self.windows.train[indices].to(self.accelerator.device)
        mask = None
        on_policy = s.on_policy_fraction > 0 and _uniform(s.seed, step, micro) < s.on_policy_fraction
        if on_policy:
            ids, mask = self.student_continuations(ids, seed=s.seed * 7919 + step * 31 + micro)
        hidden = self.projector is not None
        output = self.student(input_ids=ids, output_hidden_states=hidden, use_cache=False)
        logits = output.logits[:, :-1]
        terms: dict[str, torch.Tensor] = {}
        if s.loss == "ce" or (s.ce_weight > 0 and not on_policy):  # never fit the student's own samples
            ce = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="none"
            ).view(ids.shape[0], -1)
            terms["ce"] = token_mean(ce, mask)
        if s.loss != "ce":
            teacher = self.teacher(ids, indices, hidden=hidden)
            target = teacher.logits if teacher.logits is not None else teacher.log_probs
            per_token = distillation_loss(
                logits,
                target.to(logits.device),
                s.loss,
                s.temperature,
                s.beta,
                None if teacher.indices is None else teacher.indices.to(logits.device),
            )
            terms["kd"] = token_mean(per_token, mask)
            if hidden:
                terms["hidden"] = token_mean(
                    self.projector(output.hidden_states, teacher.hidden_states)[:, :-1], mask
                )
        if s.loss == "ce":
            terms["loss"] = terms["ce"]
        else:
            terms["loss"] = (
                (1 - s.ce_weight) * terms["kd"]
                + s.ce_weight * terms.get("ce", 0.0)
                + s.hidden_weight * terms.get("hidden", 0.0)
            )
        return terms

    @torch.no_grad()
    def student_continuations(self, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's sampled continuation of each window's first half; the mask marks the
        positions whose next token the student chose (the only ones scored)."""
        half = ids.shape[1] // 2
        model = self.accelerator.unwrap_model(self.student)
        torch.manual_seed(seed)
        generated = model.generate(
            input_ids=ids[:, :half],
            attention_mask=torch.ones_like(ids[:, :half]),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=ids.shape[1] - half,
            min_new_tokens=ids.shape[1] - half,
            pad_token_id=0,
        )
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
        mask[:, half - 1 :] = True
        return generated[:, : ids.shape[1]], mask

    @torch.no_grad()
    def held_out_perplexity(self, batch_size: int) -> float:
        self.student.eval()
        total, count = 0.0, 0
        for chunk in self.windows.held_out.split(batch_size):
            chunk = chunk.to(self.accelerator.device)
            logits = self.student(input_ids=chunk, use_cache=False).logits[:, :-1].float()
            total += float(
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
                )
            )
            count += chunk[:, 1:].numel()
        self.student.train()
        return math.exp(total / count)

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over `accumulation` micro-batches per process; returns each loss
        term's mean over the micro-batches that have it, averaged over the processes (so the
        logged curve of N processes is that of one process with the same global batch)."""
        s, acc = self.settings, self.accelerator
        values: dict[str, list[float]] = {}
        for micro in range(self.order.accumulation):
            with acc.accumulate(*self.models):
                terms = self.micro_loss(step, micro)
                finite = acc.gather(
                    torch.isfinite(terms["loss"].detach()).float().reshape(1)
                ).min()  # every process stops together
                if not finite:
                    last = self.checkpoints()
                    raise SlimlmError(
                        f"the distillation loss became {float(terms['loss'].detach())} (on this "
                        f"or another process) at step {step + 1}: training stopped; the last good "
                        f"checkpoint is {last[-1] if last else 'none (none was written yet)'}; "
                        "rerunning unchanged would meet the same batches: lower distill.lr "
                        "(or raise distill.temperature) and run in a fresh run directory"
                    )
                acc.backward(terms["loss"])
                if acc.sync_gradients and s.max_grad_norm > 0:
                    acc.clip_grad_norm_(self.student.parameters(), s.max_grad_norm)
                    if self.projector is not None:
                        torch.nn.utils.clip_grad_norm_(self.projector.parameters(), s.max_grad_norm)
                self.optimizer.step()
                if acc.sync_gradients:  # once per optimizer step, on every process alike
                    self.schedule.step()
                self.optimizer.zero_grad()
            for key, value in terms.items():
                values.setdefault(key, []).append(float(value.detach()))
        local = torch.tensor([sum(v) / len(v) for v in values.values()], dtype=torch.float64)
        averaged = acc.reduce(local.to(acc.device), reduction="mean").cpu()
        return dict(zip(values, averaged.tolist()))

    # ---- the loop ---------------------------------------------------------------------

    def run(self) -> TrainResult:
        s, acc = self.settings, self.accelerator
        result = TrainResult()
        start = self.resume(result)
        started = time.perf_counter()
        metrics = self.out_dir / "metrics.jsonl"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if acc.is_main_process:  # the log holds exactly the steps of the checkpoint resumed from
            write_atomic(metrics, "".join(json.dumps(record) + "\n" for record in result.history))
        self.student.train()
        tokens_per_step = (
            self.order.batch_size * self.order.accumulation * self.order.world * self.windows.train.shape[1]
        )
        progress = tqdm(
            range(start, s.steps),
            desc=f"distill ({s.loss})",
            unit="step",
            initial=start,
            total=s.steps,
            disable=not acc.is_main_process,
        )
        for step in progress:
            means = self.train_step(step)
            record = {
                "step": step + 1,
                "tokens": (step + 1) * tokens_per_step,
                "lr": self.schedule.get_last_lr()[0],
                **{k: round(v, 6) for k, v in means.items()},
            }
            if s.eval_every and ((step + 1) % s.eval_every == 0 or step + 1 == s.steps):
                record["held_out_ppl"] = self.held_out_perplexity(self.order.batch_size)
                result.evals.append({"step": step + 1, "held_out_ppl": record["held_out_ppl"]})
            result.history.append(record)
            progress.set_postfix(loss=f"{means['loss']:.4f}")
            if acc.is_main_process:
                with metrics.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
                acc.log({k: v for k, v in record.items() if k != "step"}, step=step + 1)
            if (step + 1) % s.checkpoint_every == 0 or step + 1 == s.steps:
                self.save(step + 1, result)
        result.seconds = time.perf_counter() - started
        if acc.is_main_process:
            write_atomic(
                self.out_dir / "result.json",
                json.dumps({"settings": asdict(s), **asdict(result)}, indent=1),
            )
        return result


def _uniform(seed: int, step: int, micro: int) -> float:
    """A number in [0, 1) fixed by (seed, step, micro): which micro-batches are on-policy."""
    return float(
        torch.rand(1, generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + micro))
    )
