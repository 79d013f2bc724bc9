"""GPTQ and AWQ of a checkpoint larger than memory, one decoder block in memory at a time.

The model is a skeleton on the meta device (slimlm/checkpoint.py). What runs before the first
block (the input embedding, rotary frequencies) is read in full; each block is read from the
checkpoint's safetensors when its turn comes, calibrated in the checkpoint's dtype (bf16 for
most; Hessians in float32), quantized, handed to `on_block` and
released. Memory holds the embedding, one block, its input statistics and the calibration
activations: an 8B model's blocks calibrate within a few GB (bench/scale.py). With a progress
directory, each finished block and the next block's inputs are kept on disk, so a killed run
goes on where it stopped (compress/block_progress.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from slimlm.architecture import decoder_blocks
from slimlm.artifact import quantized_module_record
from slimlm.checkpoint import Checkpoint, open_checkpoint
from slimlm.compress.block_progress import BlockFacts, BlockProgress, calibration_fingerprint
from slimlm.compress.calibration import calibrate_sequentially
from slimlm.compress.quantize import (
    CalibratedQuantizer,
    QuantizeParams,
    check_shapes,
    describe_bits,
    layer_error,
)
from slimlm.compress.rtn import QuantizedWeight
from slimlm.compress.targets import select_linear_modules
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule


@dataclass
class CheckpointBlocks:
    """Loads each decoder block from the checkpoint before its turn and, once it is quantized,
    hands it to `on_block`, keeps its facts (`describe`) and, with `progress`, its tensors and
    the next block's inputs on disk, then frees it; times each block. What ran before the blocks
    (the input embedding, 1 GB in an 8B model) is freed when the first block loads: the blocks'
    inputs are captured by then."""

    checkpoint: Checkpoint
    device: torch.device
    dtype: Optional[torch.dtype]
    on_block: Callable[[str, nn.Module], None]
    describe: Callable[[str, nn.Module, float], BlockFacts]
    progress: Optional[BlockProgress]
    before_blocks: list[nn.Module] = field(default_factory=list)
    facts: list[BlockFacts] = field(default_factory=list)
    _started: float = 0.0

    def resume_point(self) -> tuple[int, Optional[list[torch.Tensor]]]:
        if self.progress is None:
            return 0, None
        start, inputs = self.progress.resume_point()
        self.facts = self.progress.finished(start)
        return start, inputs

    def load(self, name: str, block: nn.Module) -> None:
        self._started = time.perf_counter()
        while self.before_blocks:
            self.checkpoint.release(self.before_blocks.pop())
        self.checkpoint.materialize(block, f"{name}.", self.device, self.dtype)

    def release(self, name: str, block: nn.Module, next_inputs: list[torch.Tensor]) -> None:
        self.on_block(name, block)
        facts = self.describe(name, block, round(time.perf_counter() - self._started, 3))
        if self.progress is not None:
            tensors = {
                f"{name}.{key}": value.detach().cpu().contiguous()
                for key, value in block.state_dict().items()
            }
            self.progress.save(len(self.facts), tensors, facts, next_inputs)
        self.facts.append(facts)
        self.checkpoint.release(block)


@dataclass
class OffloadedCalibration:
    blocks: list[BlockFacts]  # resumed ones included
    peak_memory_bytes: int  # of this process's walk

    @property
    def block_seconds(self) -> dict[str, float]:
        """Load, calibrate, quantize and hand over, per block."""
        return {facts.name: facts.seconds for facts in self.blocks}

    @property
    def quantized_layers(self) -> int:
        return sum(len(facts.records) for facts in self.blocks)

    @property
    def records(self) -> dict[str, dict]:
        """The manifest records of the quantized layers."""
        return {name: record for facts in self.blocks for name, record in facts.records.items()}

    @property
    def weight_rel_error(self) -> dict[str, float]:
        """||W - Q(W)|| / ||W|| of each quantized layer, as reports plot it."""
        return {name: error for facts in self.blocks for name, error in facts.weight_rel_error.items()}

    def report(self) -> dict:
        """What the report states about the layers, as CalibratedQuantizer.report does."""
        result: dict = {}
        unseen = [name for facts in self.blocks for name in facts.uncalibrated]
        if unseen:
            result["uncalibrated_layers"] = unseen
        awq = {name: errors for facts in self.blocks for name, errors in facts.awq_output_error.items()}
        if awq:
            result["awq_output_error"] = awq
        return result


def quantize_checkpoint(
    directory: Path,
    params: QuantizeParams,
    samples: torch.Tensor,
    on_block: Callable[[str, nn.Module], None],
    device: torch.device = torch.device("cpu"),
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Path] = None,
) -> OffloadedCalibration:
    """GPTQ or AWQ (params.method) of the decoder Linear layers of the checkpoint at `directory`
    that match params.targets and not params.ignore, calibrated on `samples` (token ids
    [n, seq_len]); `on_block(name, block)` receives each block with its QuantLinear layers in
    place, before it is freed. dtype None: the checkpoint's own. `progress`: a directory that
    keeps the finished blocks (compress/block_progress.py); a run that finds blocks there
    from an earlier, killed run with the same inputs goes on from the first unfinished one."""
    checkpoint, model = open_checkpoint(directory, dtype)
    prefix, _ = decoder_blocks(model)
    before_blocks = materialize_outside_blocks(
        checkpoint, model, prefix, device, skip=model.get_output_embeddings()
    )
    names = [
        name
        for name in select_linear_modules(model, params.targets, params.ignore)
        if name.startswith(prefix + ".")
    ]
    schemes = {name: params.scheme for name in names}
    check_shapes(model, names, params.scheme)

    errors: dict[str, float] = {}

    def replace(name: str, quantized: QuantizedWeight, scheme: QuantScheme) -> None:
        linear = model.get_submodule(name)
        layer = QuantLinear.from_codes(
            quantized.codes, quantized.scales, quantized.zeros, scheme, linear.bias
        )
        errors[name] = layer_error(linear.weight, layer)
        set_submodule(model, name, layer)

    quantizer = CalibratedQuantizer(model, params, schemes, replace)

    def describe(name: str, block: nn.Module, seconds: float) -> BlockFacts:
        inside = f"{name}."
        records = {
            inside + key: quantized_module_record(inside + key, layer, layer.scheme.to_dict(), {})
            for key, layer in block.named_modules()
            if isinstance(layer, QuantLinear)
        }
        return BlockFacts(
            name=name,
            seconds=seconds,
            records=records,
            weight_rel_error={layer: errors[layer] for layer in records},
            uncalibrated=[layer for layer in quantizer.unseen if layer.startswith(inside)],
            awq_output_error={
                key: value for key, value in quantizer.awq_errors.items() if key.startswith(inside)
            },
        )

    store = (
        BlockProgress(progress, calibration_fingerprint(checkpoint, params, samples, dtype))
        if progress is not None
        else None
    )
    blocks = CheckpointBlocks(checkpoint, device, dtype, on_block, describe, store, before_blocks)
    peak = calibrate_sequentially(
        model,
        samples,
        names,
        quantizer.hessians.observe,
        quantizer,
        desc=f"{params.method} {describe_bits(schemes)} (offloaded)",
        blocks=blocks,
    )
    return OffloadedCalibration(blocks.facts, peak)


def modules_outside_blocks(model: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The modules with tensors of their own outside the decoder blocks: embeddings, rotary
    frequencies, the final norm, the LM head."""
    outside = []
    for name, module in model.named_modules():
        inside = name == prefix or name.startswith(prefix + ".")
        owns = any(True for _ in module.parameters(recurse=False)) or any(
            True for _ in module.buffers(recurse=False)
        )
        if owns and not inside:
            outside.append((name, module))
    return outside


def materialize_outside_blocks(
    checkpoint: Checkpoint, model: nn.Module, prefix: str, device: torch.device, skip: Optional[nn.Module]
) -> list[nn.Module]:
    """Read every module outside the blocks but `skip` (the one the caller's pass never
    reaches: the LM head before the blocks, the embedding after them; None: read them all);
    returns them."""
    read = [(name, module) for name, module in modules_outside_blocks(model, prefix) if module is not skip]
    for name, module in read:
        checkpoint.materialize(module, f"{name}.", device)
    return [module for _, module in read]
