"""The `reconstruct` stage: block-wise reconstruction of a quantized model against its original
(after EfficientQAT's Block-AP). Each decoder block in turn gets its quantized layers' scales
trained, codes fixed (distill/qat.py), so that, fed the quantized model's own hidden states, it
reproduces the original block's outputs on the original's hidden states; the mean squared error
of those outputs is the loss. The block is then frozen back into QuantLinears and its outputs
become the next block's inputs, so each block also learns to correct the error the blocks before
it left. Start from GPTQ: its codes are the ones kept.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from slimlm.architecture import decoder_blocks
from slimlm.compress.calibration import CalibrationParams, Captured, capture_layer_inputs, run_layer
from slimlm.compress.quantize import calibration_windows
from slimlm.data import check_text_source
from slimlm.distill.qat import freeze_quantized, replace_quantized
from slimlm.errors import ConfigError, SlimlmError
from slimlm.models import load_model
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear


@dataclass
class ReconstructParams(CalibrationParams):
    """Calibration windows (samples, seq_len, seed) and how each block trains on them."""

    samples: int = 128
    epochs: int = 2  # passes over the windows per block
    batch_size: int = 4  # windows per optimizer step
    lr: float = 3e-3  # the scales' (about their relative change per step: they train as log-ratios)

    def __post_init__(self) -> None:
        self.check_calibration("reconstruct")
        if self.epochs < 1 or self.batch_size < 1:
            raise ConfigError(
                f"reconstruct: epochs ({self.epochs}) and batch_size ({self.batch_size}) must be at least 1"
            )
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"reconstruct: lr={self.lr} must be a positive number")


@dataclass
class BlockResult:
    block: str
    mse_before: float
    mse_after: float
    seconds: float


def run(state: RunState, params: ReconstructParams) -> None:
    started = time.perf_counter()
    _, blocks = decoder_blocks(state.model)
    if not any(isinstance(module, QuantLinear) for module in blocks.modules()):
        raise SlimlmError(
            "reconstruct trains a quantized model's decoder layers, and this model has none: "
            "put a quantize stage (gptq) before it"
        )
    samples = calibration_windows(state, params.samples, params.seq_len, params.seed)
    teacher = load_model(state.original_model_cfg(), state.device).model
    results = reconstruct_blocks(state.model, teacher, samples, params)
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


def reconstruct_blocks(
    student: nn.Module, teacher: nn.Module, samples: torch.Tensor, params: ReconstructParams
) -> list[BlockResult]:
    """Every decoder block of `student` holding quantized layers trained against `teacher`'s."""
    prefix, student_blocks = decoder_blocks(student)
    _, teacher_blocks = decoder_blocks(teacher)
    with torch.no_grad():
        student_inputs = capture_layer_inputs(student, samples, params.batch_size)
        teacher_inputs = capture_layer_inputs(teacher, samples, params.batch_size)
    student_hidden, teacher_hidden = student_inputs.hidden, teacher_inputs.hidden
    results = []
    for index in tqdm(range(len(student_blocks)), desc="reconstruct", unit="block"):
        block = student_blocks[index]
        with torch.no_grad():
            targets = run_layer(teacher_blocks[index], teacher_inputs.of_layer(index, teacher_hidden))
        captured = student_inputs.of_layer(index, student_hidden)
        if any(isinstance(module, QuantLinear) for module in block.modules()):
            results.append(train_block(f"{prefix}.{index}", block, captured, targets, params))
        with torch.no_grad():
            student_hidden = run_layer(block, captured)
        teacher_hidden = targets
    return results


def train_block(
    name: str, block: nn.Module, captured: Captured, targets: list[torch.Tensor], params: ReconstructParams
) -> BlockResult:
    """The block's quantized layers trained to map `captured` onto `targets`, then frozen."""
    started = time.perf_counter()
    before = block_mse(block, captured, targets)
    previously = {p: p.requires_grad for p in block.parameters()}
    for parameter in block.parameters():
        parameter.requires_grad_(False)
    scales = [layer.log_scales for layer in replace_quantized(block)]  # trainable, the rest frozen
    optimizer = torch.optim.AdamW(scales, lr=params.lr, weight_decay=0.0)
    steps = params.epochs * len(captured)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
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
    freeze_quantized(block)
    for parameter, wanted in previously.items():
        parameter.requires_grad_(wanted)
    return BlockResult(
        name, before, block_mse(block, captured, targets), round(time.perf_counter() - started, 1)
    )


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
