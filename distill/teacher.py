"""The teacher's signal: run live in the training loop (online), or its top-k next-token
log-probs computed once and cached on disk (offline), so the teacher never runs again while the
student trains; on small hardware the teacher's forward passes are most of the cost.

The cache holds, per training window and position, the teacher's k most likely tokens and their
log-probs at the distillation temperature plus the log of the remaining mass (losses.bucketed),
keyed by everything it depends on (teacher weights, windows, k, temperature).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from slimlm.distill.losses import bucketed
from slimlm.errors import SlimlmError
from slimlm.resources import cache_dir
from slimlm.rundir import load_cached_tensors, save_tensors_atomic


@dataclass
class TeacherOutput:
    logits: Optional[torch.Tensor] = None  # online: [B, L - 1, V]
    log_probs: Optional[torch.Tensor] = None  # offline: bucketed [B, L - 1, k + 1]
    indices: Optional[torch.Tensor] = None  # offline: [B, L - 1, k]
    hidden_states: Optional[tuple[torch.Tensor, ...]] = None  # online, when asked for


def check_same_vocabulary(
    student_tokenizer, teacher_tokenizer, student: nn.Module, teacher: nn.Module
) -> None:
    """Refuse a teacher whose tokens are not the student's: distributions over different
    vocabularies cannot be compared position by position."""
    student_vocab, teacher_vocab = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student_vocab != teacher_vocab:
        differing = sorted(set(student_vocab.items()) ^ set(teacher_vocab.items()))[:1]
        raise SlimlmError(
            f"the teacher's tokenizer ({len(teacher_vocab):,} tokens) differs from the "
            f"student's ({len(student_vocab):,} tokens; first difference: {differing}); "
            "distillation needs a student that shares the teacher's tokenizer"
        )
    rows = [m.config.vocab_size for m in (student, teacher)]
    if rows[0] != rows[1]:
        raise SlimlmError(
            f"the student's vocabulary has {rows[0]:,} entries "
            f"and the teacher's {rows[1]:,}; they must share one"
        )


class OnlineTeacher:
    def __init__(self, model: nn.Module):
        self.model = model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(
        self, ids: torch.Tensor, window_indices: torch.Tensor, hidden: bool = False
    ) -> TeacherOutput:
        output = self.model(
            input_ids=ids.to(next(self.model.parameters()).device),
            output_hidden_states=hidden,
            use_cache=False,
        )
        return TeacherOutput(
            logits=output.logits[:, :-1], hidden_states=output.hidden_states if hidden else None
        )


class OfflineTeacher:
    """Top-k log-probs of the windows a run visits, looked up by window index."""

    def __init__(self, log_probs: torch.Tensor, indices: torch.Tensor, windows: torch.Tensor):
        self.log_probs, self.indices = log_probs, indices
        self.row_of = {int(w): row for row, w in enumerate(windows)}

    def __call__(
        self, ids: torch.Tensor, window_indices: torch.Tensor, hidden: bool = False
    ) -> TeacherOutput:
        rows = torch.tensor([self.row_of[int(w)] for w in window_indices])
        return TeacherOutput(log_probs=self.log_probs[rows].float(), indices=self.indices[rows].long())


def cache_path(teacher_key: str, windows: torch.Tensor, top_k: int, temperature: float) -> Path:
    digest = hashlib.sha256()
    digest.update(teacher_key.encode())
    digest.update(windows.to(torch.int64).numpy().tobytes())
    digest.update(json.dumps({"top_k": top_k, "temperature": temperature}).encode())
    return cache_dir() / "distill" / f"topk-{digest.hexdigest()[:32]}.safetensors"


@torch.no_grad()
def offline_teacher(
    teacher: nn.Module,
    teacher_key: str,
    train: torch.Tensor,
    used: torch.Tensor,
    top_k: int,
    temperature: float,
    batch_size: int,
) -> tuple[OfflineTeacher, Path, bool]:
    """The cached signal for the windows `used`, computing and storing it if absent.
    Returns the teacher signal, the cache file and whether it was already there."""
    windows = train[used]
    path = cache_path(teacher_key, windows, top_k, temperature)
    cached = load_cached_tensors(path, "teacher cache", ("log_probs", "indices"))
    if cached is not None:
        return OfflineTeacher(cached["log_probs"], cached["indices"], used), path, True
    device = next(teacher.parameters()).device
    log_probs, indices = [], []
    for chunk in tqdm(windows.split(batch_size), desc=f"teacher top-{top_k} cache", unit="batch"):
        logp = F.log_softmax(
            teacher(input_ids=chunk.to(device), use_cache=False).logits[:, :-1].float() / temperature, dim=-1
        )
        top = logp.topk(top_k, dim=-1).indices
        log_probs.append(bucketed(logp, top).cpu())
        indices.append(top.to(torch.int32).cpu())
    tensors = {"log_probs": torch.cat(log_probs), "indices": torch.cat(indices)}
    save_tensors_atomic(path, tensors)
    return OfflineTeacher(tensors["log_probs"], tensors["indices"], used), path, False
