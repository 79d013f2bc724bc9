"""Decoder layers streamed from host memory: how a model larger than the GPU still decodes.

The memory planner's "stream" plan (inference/planner.py) keeps some decoder blocks' weights
in pinned host memory. Each such block's tensors are packed into one host buffer; on the device
there are only two buffers the size of the largest streamed block, used in turn, and each
streamed block's tensors are fixed views into its buffer (block k of the streamed ones uses
buffer k % 2). Before block k runs, its bytes are copied in; while it computes, the next
streamed block is copied into the other buffer on a separate CUDA stream, as soon as the block
that last used that buffer has finished. Decoding then runs at about the host link's speed
for the streamed bytes (PCIe) and the device's for the rest.

The key/value caches stay on the device (they are written every step). On a CPU the copies are
plain and synchronous: the same code path, without the overlap (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
from torch import nn

from slimlm.inference.model import CACHE_NAMES

ALIGN = 64  # bytes: every tensor's view starts at a multiple of this in the flat buffers


@dataclass(frozen=True)
class Placement:
    """What of a decoder lives in host memory instead of on the device: the memory planner's
    plan (planner.Plan.placement) or the CLI's --stream-layers / --embedding-on-host."""

    stream_layers: int = 0  # the last N decoder blocks, streamed in as they run
    table_on_host: bool = False  # an untied embedding table: one row per token is copied over
    experts_on_host: bool = (
        False  # a mixture of experts' routed experts, computed by the CPU (MoE in inference/model.py)
    )


class HostEmbedding(nn.Module):
    """An untied embedding table kept in host memory: each step copies only its tokens' rows to
    the device. The table is a plain attribute, not a module tensor, so moving the decoder to
    the GPU leaves it where it is."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.host_table = weight.detach().to("cpu", dtype).contiguous()
        self.device = device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.host_table[tokens.reshape(-1).cpu()].to(self.device).view(*tokens.shape, -1)


@dataclass
class HostBlock:
    """A block's weights packed into one host buffer, and where each tensor sits in it."""

    block: nn.Module
    host: torch.Tensor  # uint8, pinned when the device is a GPU
    entries: list[
        tuple[nn.Module, str, bool, int, torch.dtype, torch.Size]
    ]  # module, name, is a parameter, offset, dtype, shape


def streamed_layers(n_layers: int, count: int) -> list[int]:
    """Which blocks to stream when `count` must be: the last ones (the planner counts these;
    with mixed schemes the blocks differ in size)."""
    return list(range(n_layers - count, n_layers))


def to_host(block: nn.Module, device: torch.device) -> HostBlock:
    """Move `block`'s weights (not its caches) into one host buffer; the block's tensors become
    meta placeholders until a LayerStreamer binds them to its device buffers."""
    tensors = [
        (module, name, True, tensor)
        for module in block.modules()
        for name, tensor in module._parameters.items()
        if tensor is not None
    ]
    tensors += [
        (module, name, False, tensor)
        for module in block.modules()
        for name, tensor in module._buffers.items()
        if tensor is not None and name not in CACHE_NAMES
    ]
    offsets, size = [], 0
    for *_, tensor in tensors:
        offsets.append(size)
        size += -(-tensor.nbytes // ALIGN) * ALIGN
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    entries = []
    for (module, name, is_parameter, tensor), offset in zip(tensors, offsets):
        host[offset : offset + tensor.nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
        _assign(module, name, is_parameter, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))
        entries.append((module, name, is_parameter, offset, tensor.dtype, tensor.shape))
    return HostBlock(block, host, entries)


def _assign(module: nn.Module, name: str, is_parameter: bool, tensor: torch.Tensor) -> None:
    if is_parameter:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


class LayerStreamer:
    """Streams the blocks of `hosts` (in the order they run) through two device buffers."""

    def __init__(self, hosts: list[HostBlock], device: torch.device):
        self.hosts, self.device = hosts, device
        size = max(host.host.numel() for host in hosts)
        self.buffers = [
            torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(hosts)))
        ]
        for index, host in enumerate(hosts):
            flat = self.buffers[index % len(self.buffers)]
            for module, name, is_parameter, offset, dtype, shape in host.entries:
                nbytes = shape.numel() * dtype.itemsize
                _assign(module, name, is_parameter, flat[offset : offset + nbytes].view(dtype).view(shape))
            host.block.register_forward_pre_hook(partial(self._before, index))
            host.block.register_forward_hook(partial(self._after, index))
        self.on_gpu = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.on_gpu else None
        if self.on_gpu:  # the buffers come from the compute stream's pool: copy only after its pending work
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self.copied: list[Optional[torch.cuda.Event]] = [None] * len(hosts)
        self.released: list[Optional[torch.cuda.Event]] = [None] * len(
            self.buffers
        )  # the last use of each buffer ended
        self.holds: list[Optional[int]] = [None] * len(
            self.buffers
        )  # the block whose bytes each buffer holds (or is being copied)
        self.deferred: Optional[int] = None
        self._prefetch(0)

    @property
    def host_bytes(self) -> int:
        return sum(host.host.numel() for host in self.hosts)

    @property
    def device_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.buffers)

    def _buffer(self, index: int) -> int:
        return index % len(self.buffers)

    def _prefetch(self, index: int) -> None:
        """Copy block `index`'s bytes into its buffer once that buffer's last user is done."""
        host, target = self.hosts[index].host, self.buffers[self._buffer(index)]
        self.holds[self._buffer(index)] = index
        if not self.on_gpu:
            target[: host.numel()].copy_(host)
            return
        with torch.cuda.stream(self.copy_stream):
            released = self.released[self._buffer(index)]
            if released is not None:
                self.copy_stream.wait_event(released)
            target[: host.numel()].copy_(host, non_blocking=True)
            self.copied[index] = torch.cuda.Event()
            self.copied[index].record(self.copy_stream)

    def _before(self, index: int, module: nn.Module, args) -> None:
        if (
            self.holds[self._buffer(index)] != index
        ):  # a pass that raised (out of memory, say) left another block there
            self.deferred = None
            self._prefetch(index)
        if self.on_gpu:
            torch.cuda.current_stream(self.device).wait_event(self.copied[index])
        following = (index + 1) % len(self.hosts)
        if following == index or self._buffer(following) == self._buffer(index):
            self.deferred = following  # its buffer is the one this block is reading: after it
        else:
            self._prefetch(following)

    def _after(self, index: int, module: nn.Module, args, output) -> None:
        if self.on_gpu:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.released[self._buffer(index)] = event
        if self.deferred is not None:
            following, self.deferred = self.deferred, None
            self._prefetch(following)
