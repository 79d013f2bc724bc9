"""GPTQ and AWQ of a checkpoint larger than memory, one decoder block in memory at a time.

The model is a skeleton on the meta device (slimlm/checkpoint.py). What runs before the first
block (the input embedding, rotary frequencies) is read in full; each block is read from the
checkpoint's safetensors when its turn comes, calibrated in the checkpoint's dtype (bf16 for
most; Hessian products in float32, summed in float64), quantized, handed to `on_block` and
released. Memory holds the embedding, one block, its input statistics and the calibration
activations: an 8B model's blocks calibrate within a few GB (bench/scale.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from slimlm.architecture import decoder_blocks
from slimlm.checkpoint import Checkpoint, open_checkpoint
from slimlm.compress.calibration import calibrate_sequentially
from slimlm.compress.quantize import CalibratedQuantizer, QuantizeParams, check_shapes, describe_bits, layer_error
from slimlm.compress.rtn import QuantizedWeight
from slimlm.compress.targets import select_linear_modules
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule


@dataclass
class CheckpointBlocks:
    """Loads each decoder block from the checkpoint before its turn and, once it is quantized,
    hands it to `on_block` and frees it; times each block. What ran before the blocks (the
    input embedding, 1 GB in an 8B model) is freed when the first block loads: the blocks'
    inputs are captured by then."""

    checkpoint: Checkpoint
    device: torch.device
    dtype: Optional[torch.dtype]
    on_block: Callable[[str, nn.Module], None]
    before_blocks: list[nn.Module] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    _started: float = 0.0

    def load(self, name: str, block: nn.Module) -> None:
        self._started = time.perf_counter()
        while self.before_blocks:
            self.checkpoint.release(self.before_blocks.pop())
        self.checkpoint.materialize(block, f"{name}.", self.device, self.dtype)

    def release(self, name: str, block: nn.Module) -> None:
        self.on_block(name, block)
        self.checkpoint.release(block)
        self.seconds[name] = round(time.perf_counter() - self._started, 3)


@dataclass
class OffloadedCalibration:
    block_seconds: dict[str, float]  # load, calibrate, quantize and hand over, per block
    peak_memory_bytes: int
    quantized_layers: int
    report: dict
    weight_rel_error: dict[str, float]  # ||W - Q(W)|| / ||W|| of each quantized layer, as reports plot it


def quantize_checkpoint(
    directory: Path,
    params: QuantizeParams,
    samples: torch.Tensor,
    on_block: Callable[[str, nn.Module], None],
    device: torch.device = torch.device("cpu"),
    dtype: Optional[torch.dtype] = None,
) -> OffloadedCalibration:
    """GPTQ or AWQ (params.method) of the decoder Linear layers of the checkpoint at `directory`
    that match params.targets and not params.ignore, calibrated on `samples` (token ids
    [n, seq_len]); `on_block(name, block)` receives each block with its QuantLinear layers in
    place, before it is freed. dtype None: the checkpoint's own."""
    checkpoint, model = open_checkpoint(directory, dtype)
    prefix, _ = decoder_blocks(model)
    before_blocks = materialize_outside_blocks(checkpoint, model, prefix, device, skip=model.get_output_embeddings())
    names = [name for name in select_linear_modules(model, params.targets, params.ignore) if name.startswith(prefix + ".")]
    schemes = {name: params.scheme for name in names}
    check_shapes(model, names, params.scheme)

    errors: dict[str, float] = {}

    def replace(name: str, quantized: QuantizedWeight, scheme: QuantScheme) -> None:
        linear = model.get_submodule(name)
        layer = QuantLinear.from_codes(quantized.codes, quantized.scales, quantized.zeros, scheme, linear.bias)
        errors[name] = layer_error(linear.weight, layer)
        set_submodule(model, name, layer)

    quantizer = CalibratedQuantizer(model, params, schemes, replace)
    blocks = CheckpointBlocks(checkpoint, device, dtype, on_block, before_blocks)
    peak = calibrate_sequentially(model, samples, names, quantizer.hessians.observe, quantizer, desc=f"{params.method} {describe_bits(schemes)} (offloaded)", blocks=blocks)
    return OffloadedCalibration(block_seconds=blocks.seconds, peak_memory_bytes=peak, quantized_layers=len(names), report=quantizer.report(), weight_rel_error=errors)


def modules_outside_blocks(model: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """The modules with tensors of their own outside the decoder blocks: embeddings, rotary
    frequencies, the final norm, the LM head."""
    outside = []
    for name, module in model.named_modules():
        inside = name == prefix or name.startswith(prefix + ".")
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if owns and not inside:
            outside.append((name, module))
    return outside


def materialize_outside_blocks(checkpoint: Checkpoint, model: nn.Module, prefix: str, device: torch.device, skip: Optional[nn.Module]) -> list[nn.Module]:
    """Read every module outside the blocks but `skip` (the one the caller's pass never
    reaches: the LM head before the blocks, the embedding after them; None: read them all);
    returns them."""
    read = [(name, module) for name, module in modules_outside_blocks(model, prefix) if module is not skip]
    for name, module in read:
        checkpoint.materialize(module, f"{name}.", device)
    return [module for _, module in read]
