"""Calibration data and sequential, layer-by-layer calibration.

Only one decoder layer and its inputs are worked on at a time: the inputs of layer i+1 are
the outputs of layer i after it was quantized, so each layer is calibrated on the activations
it will really see, and memory holds one layer's activations, not the whole model's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from slimlm.architecture import block_index, decoder_blocks
from slimlm.errors import ConfigError, SlimlmError
from slimlm.half_linear import float32_linears
from slimlm.memory import peak_memory

Captured = list[
    tuple[torch.Tensor, dict[str, Any]]
]  # per chunk: one layer's hidden states and its other arguments
# Tokens a calibration pass runs at once (8 windows of 256; fewer windows when they are longer):
# the pass's temporaries sit beside the block's Hessians, an 8B down projection's alone 1.6 GB.
CHUNK_TOKENS = 2048


@dataclass
class CalibrationParams:
    """The calibration settings a stage's parameters share: `samples` windows of `seq_len` tokens
    of data.calibration, chosen at random with `seed` (calibration_samples)."""

    samples: int = 64
    seq_len: int = 256
    seed: int = 0

    def check_calibration(self, stage: str) -> None:
        if self.samples < 1 or self.seq_len < 2:
            raise ConfigError(
                f"{stage}: samples ({self.samples}) must be at least 1 and seq_len ({self.seq_len}) "
                "at least 2"
            )


def calibration_samples(token_ids: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` distinct non-overlapping windows of `seq_len` tokens, chosen at random (seeded)."""
    available = token_ids.numel() // seq_len
    if available < samples:
        raise SlimlmError(
            f"the calibration text has {token_ids.numel():,} tokens: {available} windows of {seq_len}, "
            f"fewer than the {samples} samples asked for; lower the stage's samples or seq_len, "
            "or use a longer data.calibration"
        )
    chosen = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:samples].sort().values
    return token_ids[: available * seq_len].view(available, seq_len)[chosen]


class ResidentBlocks:
    """Decoder blocks that are in memory already: nothing to load or release, no earlier run to
    resume."""

    def resume_point(self) -> tuple[int, None]:
        return 0, None

    def load(self, name: str, block: nn.Module) -> None:
        pass

    def release(self, name: str, block: nn.Module, next_inputs: list[torch.Tensor]) -> None:
        pass


class _Stop(Exception):
    """Raised by the last layer's stand-in: nothing after the decoder layers needs to run."""


@dataclass
class LayerInputs:
    """What the model gives its decoder layers, chunk by chunk: the first layer's hidden states,
    and each layer's other arguments. Those differ between layers of different kinds: Gemma 3's
    sliding-window layers get a banded mask and local rotary tables, its global layers others."""

    hidden: list[torch.Tensor]  # per chunk
    arguments: list[list[dict[str, Any]]]  # [layer][chunk]

    def of_layer(self, index: int, hidden: list[torch.Tensor]) -> Captured:
        """Layer `index`'s inputs: `hidden` (per chunk) with that layer's own arguments."""
        return list(zip(hidden, self.arguments[index]))


class _ArgumentRecorder(nn.Module):
    """Stands in for a decoder layer while inputs are captured: records what the model passes
    it and hands the hidden states on unchanged; the last one stops the forward pass."""

    def __init__(self, layer: nn.Module, record: list, last: bool):
        super().__init__()
        self.record, self.last = record, last
        self._layer = (layer,)  # not a submodule

    def __getattr__(self, name: str):
        """What the model's loop reads from its layers besides calling them (a layer's kind, say)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"][0], name)

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        self.record.append((hidden, kwargs))
        if self.last:
            raise _Stop
        return hidden


@contextmanager
def layers_replaced(layers: nn.ModuleList, stand_ins: list[nn.Module]) -> Iterator[None]:
    """The decoder layers replaced by `stand_ins` while the block runs, put back after."""
    originals = list(layers)
    for index, stand_in in enumerate(stand_ins):
        layers[index] = stand_in
    try:
        yield
    finally:
        for index, layer in enumerate(originals):
            layers[index] = layer


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, samples: torch.Tensor, chunk_size: int) -> LayerInputs:
    """The decoder layers' inputs for `samples`, chunk by chunk, from the model's own forward
    pass with every layer replaced by a recorder (no layer runs: an offloaded model's blocks
    may not even be in memory yet)."""
    _, layers = decoder_blocks(model)
    records: list[list] = [[] for _ in layers]
    recorders = [
        _ArgumentRecorder(layer, record, last=index == len(layers) - 1)
        for index, (layer, record) in enumerate(zip(layers, records))
    ]
    with layers_replaced(layers, recorders):
        device = next(model.parameters()).device
        for chunk in samples.split(chunk_size):
            try:
                model(input_ids=chunk.to(device), use_cache=False)
            except _Stop:
                pass
    return LayerInputs(
        hidden=[hidden for hidden, _ in records[0]],
        arguments=[[kwargs for _, kwargs in record] for record in records],
    )


@torch.no_grad()
def calibrate_sequentially(
    model: nn.Module,
    samples: torch.Tensor,
    targets: list[str],
    observe: Callable[[str, torch.Tensor], None],
    finish_layer: Callable[[str, list[str]], None],
    chunk_tokens: int = CHUNK_TOKENS,
    desc: str = "calibrate",
    blocks: Any = ResidentBlocks(),
) -> int:
    """Walk the decoder layer by layer: show each target Linear its inputs (`observe`), let
    `finish_layer(block name, target names)` replace that layer's targets (a mixture-of-experts
    layer's targets include experts that no calibration token was routed to, which `observe`
    never heard of), then run the changed layer to make the next layer's inputs. `blocks` loads
    each block before its turn and releases it after, with the next block's inputs
    (compress/offload.py reads them from a checkpoint larger than memory and can keep them for
    a resumed run, whose `resume_point` is the first unfinished block and its inputs). Returns
    the peak memory of the walk in bytes (resident set on a CPU, torch's allocations on a GPU)."""
    prefix, layers = decoder_blocks(model)
    outside = [name for name in targets if not name.startswith(prefix + ".")]
    if outside:
        raise SlimlmError(
            f"calibration handles Linear layers inside decoder layers; {outside[0]} is outside them: "
            "leave it out of this stage's targets (quantize it in a separate rtn stage)"
        )
    first = next(model.parameters())

    def forward():  # the passes only: the mode would slow the many small operations of GPTQ and AWQ
        return float32_linears(first.dtype, first.device)

    chunk_size = max(1, min(8, chunk_tokens // samples.shape[1]))
    with peak_memory(first.device) as peak:
        with forward():
            inputs = capture_layer_inputs(model, samples, chunk_size)
        start, saved = blocks.resume_point()
        hidden = inputs.hidden if saved is None else [chunk.to(first.device) for chunk in saved]
        last = max((block_index(name, prefix) for name in targets), default=-1)
        with tqdm(total=last + 1, initial=start, desc=desc, unit="layer") as progress:
            for index in range(start, last + 1):  # no block after the last target's needs to run
                name, layer = f"{prefix}.{index}", layers[index]
                blocks.load(name, layer)
                names = [target for target in targets if target.startswith(name + ".")]
                if names:
                    with forward():
                        observe_layer(model, layer, names, inputs.of_layer(index, hidden), observe)
                    finish_layer(name, names)
                with forward():
                    hidden = run_layer(layer, inputs.of_layer(index, hidden))
                blocks.release(name, layer, hidden)
                progress.update()
    return peak.bytes


def observe_layer(
    model: nn.Module,
    layer: nn.Module,
    names: list[str],
    captured: Captured,
    observe: Callable[[str, torch.Tensor], None],
) -> None:
    """Run the layer on its inputs with each target Linear's inputs shown to `observe`."""
    handles = [_observer(model.get_submodule(name), name, observe) for name in names]
    try:
        run_layer(layer, captured)
    finally:
        for handle in handles:
            handle.remove()


def _observer(module: nn.Module, name: str, observe: Callable[[str, torch.Tensor], None]):
    return module.register_forward_hook(lambda _module, inputs, _output: observe(name, inputs[0]))


def run_layer(layer: nn.Module, captured: Captured) -> list[torch.Tensor]:
    """The layer's output hidden states, chunk by chunk."""
    outputs = []
    for hidden, kwargs in captured:
        output = layer(hidden, **kwargs)
        outputs.append(output[0] if isinstance(output, tuple) else output)
    return outputs
