"""The `reconstruct` stage: block-wise reconstruction of a quantized or pruned model against its
original (after EfficientQAT's Block-AP, and the layer-wise healing of pruned models). Each decoder
block in turn is trained so that, fed the model's own hidden states, it reproduces the original's
hidden state at the point the block stands for: the original block's output, or, where the prune
stage removed the layers after it, the output of the whole span it now replaces. The mean squared
error of those outputs is the loss. Quantized layers train their scales, and with codes_lr their
codes (distill/qat.py); float layers (a pruned student's) train their weights with weights_lr.
The block is then frozen back into QuantLinears (or put back as it was, if training did not lower
its error) and its outputs become the next block's inputs, so each block also learns to correct
the error the blocks before it left. For a quantized model, start from GPTQ: training starts from
its codes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from slimlm.architecture import decoder_blocks
from slimlm.checkpoint import Checkpoint, open_checkpoint
from slimlm.compress.calibration import (
    CalibrationParams,
    Captured,
    capture_layer_inputs,
    run_layer,
)
from slimlm.compress.offload import materialize_outside_blocks
from slimlm.compress.quantize import calibration_windows
from slimlm.data import check_text_source
from slimlm.distill.qat import (
    ScaleTrainedLinear,
    freeze_quantized,
    replace_quantized,
    replace_quantized_with_rounding,
)
from slimlm.errors import ConfigError, SlimlmError
from slimlm.models import DTYPES, checkpoint_directory, load_model, resolve_model
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear


@dataclass
class ReconstructParams(CalibrationParams):
    """Calibration windows (samples, seq_len, seed) and how each block trains on them."""

    samples: int = 128
    epochs: int = 2  # passes over the windows per block
    batch_size: int = 4  # windows per optimizer step
    lr: float = 3e-3  # the scales' (about their relative change per step: they train as log-ratios)
    codes_lr: float = 0.0  # the codes' latents', in grid steps per optimizer step; 0: codes stay
    weights_lr: float = 0.0  # the float Linear layers' weights and biases (a pruned student's); 0: they stay
    norm_lr: float = 0.0  # the block's other float parameters' (norm gains), absolute; 0: they stay

    def __post_init__(self) -> None:
        self.check_calibration("reconstruct")
        if self.epochs < 1 or self.batch_size < 1:
            raise ConfigError(
                f"reconstruct: epochs ({self.epochs}) and batch_size ({self.batch_size}) must be at least 1"
            )
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"reconstruct: lr={self.lr} must be a positive number")
        for name in ("codes_lr", "weights_lr", "norm_lr"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(
                    f"reconstruct: {name}={getattr(self, name)} must be 0 (not trained) or positive"
                )


@dataclass
class BlockResult:
    block: str
    original_layers: str  # the original's layers whose output the block reproduces: "4", "11-17"
    mse_before: float
    mse_after: float  # of the block as kept
    codes_changed: int  # codes that differ from the quantized model's, in the block as kept
    kept: bool  # False: training did not lower the block's error, and it was put back as it was
    seconds: float


def run(state: RunState, params: ReconstructParams) -> None:
    started = time.perf_counter()
    _, blocks = decoder_blocks(state.model)
    if not any(trainable(block, params) for block in blocks):
        raise SlimlmError(
            "reconstruct trains a quantized model's scales, or a pruned model's weights with "
            "weights_lr, and this model has no quantized decoder layers: put a quantize stage "
            "(gptq) before it, or set reconstruct.weights_lr"
        )
    samples = calibration_windows(state, params.samples, params.seq_len, params.seed)
    teacher, teacher_blocks = original_model(state)
    kept = kept_original_layers(state.sections.get("pruning", []), len(decoder_blocks(teacher)[1]))
    results = reconstruct_blocks(state.model, teacher, samples, params, teacher_blocks, kept)
    del teacher
    state.mark_changed(f"block-wise reconstruction ({len(results)} blocks)")
    state.sections.setdefault("reconstruction", []).append(
        {
            "samples": params.samples,
            "seq_len": params.seq_len,
            "epochs": params.epochs,
            "blocks": [vars(result) for result in results],
            "seconds": round(time.perf_counter() - started, 1),
        }
    )


def kept_original_layers(pruning: list[dict], original_layers: int) -> list[int]:
    """The original layer each of the model's decoder blocks was, after the prune stages'
    removals (their report sections, in order). A narrowed hidden size is refused: the blocks'
    outputs could no longer be compared with the original's."""
    kept = list(range(original_layers))
    for section in pruning:
        before, after = section["shape_before"], section["shape_after"]
        if before["hidden_size"] != after["hidden_size"]:
            raise SlimlmError(
                f"reconstruct compares hidden states with the original's, and the prune stage narrowed "
                f"them ({before['hidden_size']} -> {after['hidden_size']}): drop prune.hidden_size, or "
                "the reconstruct stage"
            )
        removed = set(section.get("removed_layers", []))
        kept = [layer for index, layer in enumerate(kept) if index not in removed]
    return kept


class ResidentOriginal:
    """The original model loaded whole: its blocks are in memory already."""

    def load(self, name: str, block: nn.Module) -> None:
        pass

    def release(self, name: str, block: nn.Module) -> None:
        pass


@dataclass
class OriginalFromCheckpoint:
    """The original model's decoder blocks read from its checkpoint when their turn comes and
    freed after: one block of the original in memory at a time, as GPTQ's walk holds."""

    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype

    def load(self, name: str, block: nn.Module) -> None:
        self.checkpoint.materialize(block, f"{name}.", self.device, self.dtype)

    def release(self, name: str, block: nn.Module) -> None:
        self.checkpoint.release(block)


OriginalBlocks = ResidentOriginal | OriginalFromCheckpoint
RESIDENT = ResidentOriginal()


def original_model(state: RunState) -> tuple[nn.Module, OriginalBlocks]:
    """The model the current one was quantized from, and how its blocks come into memory: a
    local checkpoint (an HF directory, a GGUF file's converted cache) as a skeleton whose
    embedding alone is read up front, its blocks one at a time; a hub model loaded whole."""
    cfg = state.original_model_cfg()
    source = resolve_model(cfg)
    same = state.source is not None and source.path == state.source.path
    directory = checkpoint_directory(source, state.source_sha256 if same else None)
    if directory is None:
        return load_model(cfg, state.device).model, RESIDENT
    return checkpoint_original(directory, DTYPES[cfg.dtype], state.device)


def checkpoint_original(
    directory: Path, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, OriginalFromCheckpoint]:
    """The checkpoint's model as a skeleton with what runs before its blocks read (the
    embedding), and the reader of its blocks."""
    checkpoint, skeleton = open_checkpoint(directory, dtype)
    prefix, _ = decoder_blocks(skeleton.eval())
    materialize_outside_blocks(checkpoint, skeleton, prefix, device, skip=skeleton.get_output_embeddings())
    return skeleton, OriginalFromCheckpoint(checkpoint, device, dtype)


def reconstruct_blocks(
    student: nn.Module,
    teacher: nn.Module,
    samples: torch.Tensor,
    params: ReconstructParams,
    teacher_blocks: OriginalBlocks = RESIDENT,
    kept: Optional[list[int]] = None,
) -> list[BlockResult]:
    """Every decoder block of `student` with something to train, trained against `teacher`'s
    hidden state at the point it stands for; `kept`: the original layer each student block was
    (None: the student has the original's layers). The original's blocks come into memory as
    `teacher_blocks` loads them: each read once, and at most two at a time (a block's
    counterpart and the next layer of the span it stands for)."""
    prefix, student_blocks = decoder_blocks(student)
    _, original_blocks = decoder_blocks(teacher)
    kept = list(range(len(original_blocks))) if kept is None else kept
    if len(kept) != len(student_blocks) or kept != sorted(set(kept)) or kept[-1] >= len(original_blocks):
        raise SlimlmError(
            f"reconstruct: the student's {len(student_blocks)} decoder blocks do not map onto the "
            f"original's {len(original_blocks)} layers; reconstruct a model against the one it was "
            "pruned or quantized from"
        )
    ends = [*kept[1:], len(original_blocks)]  # block j stands for the original's layers up to ends[j]
    with torch.no_grad():
        student_inputs = capture_layer_inputs(student, samples, params.batch_size)
        teacher_inputs = capture_layer_inputs(teacher, samples, params.batch_size)
    student_hidden, teacher_hidden = student_inputs.hidden, teacher_inputs.hidden
    results = []
    for index in tqdm(range(len(student_blocks)), desc="reconstruct", unit="block"):
        block, name, start = student_blocks[index], f"{prefix}.{index}", ends[index - 1] if index else 0
        counterpart = original_blocks[kept[index]]  # what quantized codes round against
        for layer in range(start, ends[index]):
            teacher_blocks.load(f"{prefix}.{layer}", original_blocks[layer])
            with torch.no_grad():
                teacher_hidden = run_layer(
                    original_blocks[layer], teacher_inputs.of_layer(layer, teacher_hidden)
                )
            if layer != kept[index]:  # the counterpart stays in memory until its student block has trained
                teacher_blocks.release(f"{prefix}.{layer}", original_blocks[layer])
        captured = student_inputs.of_layer(index, student_hidden)
        if trainable(block, params):
            span = str(start) if ends[index] - start == 1 else f"{start}-{ends[index] - 1}"
            results.append(train_block(name, span, block, counterpart, captured, teacher_hidden, params))
        teacher_blocks.release(f"{prefix}.{kept[index]}", counterpart)
        with torch.no_grad():
            student_hidden = run_layer(block, captured)
    return results


def trainable(block: nn.Module, params: ReconstructParams) -> bool:
    """Whether the settings train anything in `block`: quantized layers, or float ones with weights_lr."""
    return any(
        isinstance(module, QuantLinear) or (params.weights_lr > 0 and isinstance(module, nn.Linear))
        for module in block.modules()
    )


def train_block(
    name: str,
    original_layers: str,
    block: nn.Module,
    original: nn.Module,
    captured: Captured,
    targets: list[torch.Tensor],
    params: ReconstructParams,
) -> BlockResult:
    """The block's quantized layers (float ones with weights_lr, norms with norm_lr) trained to
    map `captured` onto `targets`, then frozen; put back as it was if that did not lower its
    error. `original`: the original's block of the same index, whose weights a quantized layer's
    codes round against."""
    started = time.perf_counter()
    before = block_mse(block, captured, targets)
    saved = {key: value.clone() for key, value in block.state_dict().items()}
    previously = {p: p.requires_grad for p in block.parameters()}
    for parameter in block.parameters():
        parameter.requires_grad_(False)
    layers, groups = trainable_groups(block, original, params)
    fit_block(block, groups, captured, targets, params)
    with torch.no_grad():
        changed = sum(int((layer.grid_codes() != layer.codes).sum()) for layer in layers)
    freeze_quantized(block)
    for parameter, wanted in previously.items():
        parameter.requires_grad_(wanted)
    after = block_mse(block, captured, targets)
    kept = after < before
    if not kept:
        block.load_state_dict(saved)
    seconds = round(time.perf_counter() - started, 1)
    changed = changed if kept else 0
    return BlockResult(name, original_layers, before, min(before, after), changed, kept, seconds)


def fit_block(
    block: nn.Module,
    groups: list[dict],
    captured: Captured,
    targets: list[torch.Tensor],
    params: ReconstructParams,
) -> None:
    """`params.epochs` passes of Adam over the windows in random order, cosine-decayed."""
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, params.epochs * len(captured))
    order = torch.Generator().manual_seed(params.seed)
    with torch.enable_grad():
        for _ in range(params.epochs):
            for chunk in torch.randperm(len(captured), generator=order).tolist():
                hidden, kwargs = captured[chunk]
                loss = F.mse_loss(layer_output(block, hidden, kwargs), targets[chunk])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                schedule.step()


def trainable_groups(
    block: nn.Module, original: nn.Module, params: ReconstructParams
) -> tuple[list[ScaleTrainedLinear], list[dict]]:
    """The block's quantized layers made trainable (codes too with codes_lr), and the block's
    parameters to train by learning rate: scales, codes' latents, float Linear layers' weights
    and biases with weights_lr, the other float parameters (norm gains) with norm_lr. The rest
    stays frozen."""
    groups = []
    if params.codes_lr:
        layers = replace_quantized_with_rounding(block, original)
        groups.append({"params": [layer.latents for layer in layers], "lr": params.codes_lr})
    else:
        layers = replace_quantized(block)
    groups.append({"params": [layer.log_scales for layer in layers], "lr": params.lr})
    inside = {id(p) for layer in layers for p in layer.parameters()}
    linears = {id(p) for m in block.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    floats = [p for p in block.parameters() if id(p) not in inside]
    for lr, chosen in (
        (params.weights_lr, [p for p in floats if id(p) in linears]),
        (params.norm_lr, [p for p in floats if id(p) not in linears]),
    ):
        if lr:
            groups.append({"params": [p.requires_grad_(True) for p in chosen], "lr": lr})
    return layers, [group for group in groups if group["params"]]


def layer_output(block: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    output = block(hidden, **kwargs)
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def block_mse(block: nn.Module, captured: Captured, targets: list[torch.Tensor]) -> float:
    errors = [F.mse_loss(layer_output(block, h, kw), t).item() for (h, kw), t in zip(captured, targets)]
    return sum(errors) / len(errors)


def check(cfg, params: ReconstructParams, source) -> None:
    check_text_source(cfg.data.calibration, "calibration")


RECONSTRUCT = Stage(name="reconstruct", params=ReconstructParams, run=run, check=check)
