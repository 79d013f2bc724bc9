"""Calibration and training text sampled from the original model itself (`data.calibration.format:
model`), after LLM-QAT's data-free distillation (Liu et al., 2023).

A quantized or pruned model is trained and calibrated to behave like its original where the
original puts its probability, and the original's own samples are the text that covers that:
for the default model, trained on web and educational text, they are much nearer WikiText than
a corpus of 19th-century novels. Each sample starts at a token drawn uniformly from the
vocabulary's ordinary tokens and continues by sampling the model's full distribution at the
given temperature (no top-k or top-p), special tokens excluded, as calibration text is
tokenized without them. Samples are joined into one token stream, like a text's tokens, and
cached on disk under the original model's hash and the sampling settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from slimlm.config import SamplingConfig
from slimlm.resources import cache_dir
from slimlm.rundir import load_cached_tensors, save_tensors_atomic

if TYPE_CHECKING:
    from slimlm.pipeline import RunState

log = logging.getLogger(__name__)


def original_model_samples(state: RunState) -> torch.Tensor:
    """The run's original model's samples as data.sampling sets them: from the cache, else
    sampled by the current model while it is still the original, else by the original loaded
    for the purpose (and freed after). The report's `calibration_samples` section says which,
    and how long sampling took."""
    from omegaconf import OmegaConf

    from slimlm.models import load_model, resolve_model, source_sha256

    started = time.perf_counter()
    sampling = OmegaConf.to_object(state.cfg.data.sampling)
    original_cfg = state.original_model_cfg()
    unchanged = state.memo.original_model_cfg is None
    source = state.source if unchanged else resolve_model(original_cfg)
    sha256 = state.source_sha256 if unchanged else source_sha256(source)
    key = sha256 or f"id:{source.id}"
    ids = cached_samples(key, sampling)
    reused = ids is not None
    if not reused:
        log.info("sampling %s tokens of calibration text from the original model", f"{sampling.tokens:,}")
        sampler = (
            state
            if state.model is not None and state.is_original()
            else load_model(original_cfg, state.device, sha256)
        )
        ids = sample_stream(sampler.model, ordinary_ids(sampler.tokenizer), key, sampling)
    state.sections["calibration_samples"] = {
        "tokens": ids.numel(),
        "reused": reused,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return ids


def ordinary_ids(tokenizer) -> torch.Tensor:
    """The ids of the tokenizer's ordinary tokens: every token but its special ones."""
    special = set(tokenizer.all_special_ids)
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special])


def samples_path(model_key: str, sampling: SamplingConfig) -> Path:
    digest = hashlib.sha256(model_key.encode())
    digest.update(json.dumps(asdict(sampling), sort_keys=True).encode())
    return cache_dir() / "samples" / f"samples-{digest.hexdigest()[:32]}.safetensors"


def cached_samples(model_key: str, sampling: SamplingConfig) -> torch.Tensor | None:
    """The cached token stream of these settings, or None (absent or unreadable)."""
    path = samples_path(model_key, sampling)
    tensors = load_cached_tensors(path, "sample cache", ("ids",))
    if tensors is None:
        return None
    ids = tensors["ids"]
    if ids.dtype != torch.int64 or ids.shape != (sample_count(sampling) * sampling.length,):
        log.warning("ignoring the sample cache '%s': it does not hold the stream its settings make", path)
        return None
    return ids


def sample_count(sampling: SamplingConfig) -> int:
    """Whole samples of sampling.length that make at least sampling.tokens tokens."""
    return -(-sampling.tokens // sampling.length)


def sample_stream(
    model: nn.Module, ordinary: torch.Tensor, model_key: str, sampling: SamplingConfig
) -> torch.Tensor:
    """`sampling.tokens` tokens (rounded up to whole samples) of the model's own text, drawn
    from the `ordinary` token ids only, as one 1-D stream; cached under `model_key`."""
    count = sample_count(sampling)
    generator = torch.Generator().manual_seed(sampling.seed)
    ordinary = ordinary[ordinary < model.config.vocab_size]
    blocked = torch.full((model.config.vocab_size,), float("-inf"))
    blocked[ordinary] = 0.0
    batches = [min(sampling.batch_size, count - start) for start in range(0, count, sampling.batch_size)]
    progress = tqdm(total=count * sampling.length, desc="sampling calibration text", unit="tok")
    samples = [
        sample_batch(model, ordinary, blocked, rows, sampling, generator, progress) for rows in batches
    ]
    progress.close()
    ids = torch.cat(samples).flatten()
    save_tensors_atomic(samples_path(model_key, sampling), {"ids": ids})
    return ids


@torch.no_grad()
def sample_batch(
    model: nn.Module,
    ordinary: torch.Tensor,
    blocked: torch.Tensor,
    rows: int,
    sampling: SamplingConfig,
    generator: torch.Generator,
    progress: tqdm,
) -> torch.Tensor:
    """`rows` samples of `sampling.length` tokens, [rows, length], each started at a random one of
    the `ordinary` ids, `blocked` (-inf at every other id) added to the logits; with the model's KV
    cache (whose size `rows` sets)."""
    device = next(model.parameters()).device
    tokens = ordinary[torch.randint(ordinary.numel(), (rows, 1), generator=generator)]
    blocked = blocked.to(device)
    cache, step_input = None, tokens
    for _ in range(sampling.length - 1):
        output = model(input_ids=step_input.to(device), cache=cache, use_cache=True)
        cache = output.cache
        logits = output.logits[:, -1].float() / sampling.temperature + blocked
        probabilities = torch.softmax(logits, dim=-1).cpu()
        step_input = torch.multinomial(probabilities, 1, generator=generator)
        tokens = torch.cat([tokens, step_input], dim=1)
        progress.update(rows)
    progress.update(rows)
    return tokens
