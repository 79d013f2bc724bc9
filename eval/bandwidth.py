"""Memory bandwidth, and how much of it batch-1 decoding uses.

Batch-1 decoding is bound by memory bandwidth: every step reads all the weights (and the KV
cache) to produce one token per sequence. So decode tok/s x bytes read per token / bandwidth
says how close a model runs to the machine's limit, independently of how fast the machine is.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import torch
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.eval.speed import device_clock
from slimlm.qlinear import QuantTable
from slimlm.resources import cache_dir

log = logging.getLogger(__name__)

CACHE_FILE = "bandwidth.json"
DEFAULT_BUFFER_BYTES = 512 * 2**20  # many times any CPU's last-level cache or GPU's L2
GPU_COPIES_PER_TIMING = 20  # one copy takes well under a millisecond on a data-centre GPU


@dataclass(frozen=True)
class BandwidthResult:
    bytes_per_s: float  # sustained bandwidth, median over the timed repeats
    method: str  # "cpu_sum_read" or "cuda_copy_read_write"
    device: str  # "cpu" or the GPU's name
    buffer_bytes: int
    repeats: int
    machine_key: str  # what the cached value is keyed by
    measured_at: str  # UTC, ISO 8601

    def to_dict(self) -> dict:
        return asdict(self)


def memory_bandwidth(
    device: Union[str, torch.device] = "cpu",
    refresh: bool = False,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    repeats: int = 15,
) -> BandwidthResult:
    """The machine's sustained memory bandwidth on `device`, measured once and cached.

    The cache is cache_dir()/bandwidth.json, keyed by machine_key(): a different CPU, GPU, thread
    count or buffer size is measured afresh; `refresh=True` re-measures and overwrites.
    """
    device = torch.device(device)
    if buffer_bytes < 4 or repeats < 1:
        raise SlimlmError(
            "memory_bandwidth needs buffer_bytes >= 4 (the default measures memory, "
            f"not caches) and repeats >= 1, got {buffer_bytes} and {repeats}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SlimlmError(
            f"cannot measure the bandwidth of '{device}': torch sees "
            "no CUDA GPU here; measure 'cpu' or run on the GPU machine"
        )
    key = machine_key(device, buffer_bytes)
    path = cache_dir() / CACHE_FILE
    entries = _read_cache(path)
    if not refresh and key in entries:
        try:
            return BandwidthResult(**entries[key])
        except TypeError:
            log.warning("ignoring a bandwidth entry of an older format in %s; re-measuring", path)
    result = _measure(device, buffer_bytes, repeats, key)
    entries[key] = result.to_dict()
    _write_cache(path, entries)
    return result


def machine_key(device: torch.device, buffer_bytes: int) -> str:
    """CPU model, CPU counts, torch threads, device name and buffer size: what the result depends on."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{_cpu_model()} | {os.cpu_count()} cpus, {usable} usable | torch threads "
        f"{torch.get_num_threads()} | {_device_name(device)} | buffer {buffer_bytes}"
    )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _cpu_model() -> str:
    """/proc/cpuinfo's model name on Linux (platform.processor() is empty there), else platform's."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _measure(device: torch.device, buffer_bytes: int, repeats: int, key: str) -> BandwidthResult:
    """Median bandwidth over `repeats` timings, after one untimed pass that warms the buffers.

    CPU: torch.sum over a float32 buffer, using all of torch's threads: a pure read, and summing
    is far cheaper than fetching, so the memory is the bottleneck. GPU: device-to-device copies;
    each reads and writes the buffer, so 2 x buffer_bytes move per copy (as CUDA's bandwidthTest
    and STREAM count it). GPU DRAM serves reads and writes at about the same rate, so copy
    bandwidth stands for read bandwidth.
    """
    source = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)  # written, so paged in
    if device.type == "cuda":
        target = torch.empty_like(source)
        method, moved = "cuda_copy_read_write", 2 * source.nbytes * GPU_COPIES_PER_TIMING

        def once() -> None:
            for _ in range(GPU_COPIES_PER_TIMING):
                target.copy_(source)

    else:
        method, moved = "cpu_sum_read", source.nbytes

        def once() -> None:
            source.sum()

    once()
    seconds = statistics.median(_timed(once, device) for _ in range(repeats))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return BandwidthResult(
        bytes_per_s=moved / seconds,
        method=method,
        device=_device_name(device),
        buffer_bytes=source.nbytes,
        repeats=repeats,
        machine_key=key,
        measured_at=when,
    )


def _timed(operation, device: torch.device) -> float:
    start = device_clock(device)
    operation()
    return device_clock(device) - start


def _read_cache(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entries = None
    if not isinstance(entries, dict):
        log.warning("%s is unreadable; re-measuring bandwidth and rewriting it", path)
        return {}
    return entries


def _write_cache(path: Path, entries: dict) -> None:
    """Write through a temporary file and rename, so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(entries, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(partial, path)


def decode_bytes_per_token(model: nn.Module, context_tokens: int, batch_size: int = 1) -> int:
    """Bytes read from memory per generated token by one decode step at `context_tokens` of context.

    A step of `batch_size` sequences reads the weights once and, per sequence, one row of each
    embedding table and the KV cache; divided by batch_size (rounded up) this is per token, so at
    batch 1 it is the whole step. Weights are the stored bytes of every parameter and buffer
    (each shared tensor once), plus bitsandbytes' quantization state (int8 row scales; 4-bit
    block absmax, code book, nested statistics), which it keeps outside parameters and buffers.
    An embedding table (float, or quantized: QuantTable) counts as one row, except when it is
    also the LM head (tied weights): then the LM head reads all of it, counted once. Norms and
    biases are parameters, counted.
    The KV cache assumes every layer attends to the whole context (no sliding window) and is
    stored in the model's floating-point dtype (the activation dtype). This is the minimum a
    step must read; layers that dequantize into a temporary (QuantLinear) move more.
    """
    if context_tokens < 0 or batch_size < 1:
        raise SlimlmError(
            "decode_bytes_per_token needs context_tokens >= 0 and "
            f"batch_size >= 1, got {context_tokens} and {batch_size}"
        )
    stored = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers(), *_quantization_state(model))}
    head = model.get_output_embeddings()
    head_ptr = head.weight.data_ptr() if isinstance(getattr(head, "weight", None), torch.Tensor) else None
    lookups = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for table in lookups:
        if table.weight.data_ptr() != head_ptr:
            stored.pop(table.weight.data_ptr(), None)
    quantized_lookups = [
        m for m in model.modules() if isinstance(m, QuantTable)
    ]  # codes and scales read a row per token too
    for table in quantized_lookups:
        for buffer in table.buffers():
            stored.pop(buffer.data_ptr(), None)
    weights = sum(t.numel() * t.element_size() for t in stored.values())
    rows = sum(t.weight.shape[1] * t.weight.element_size() for t in lookups)
    rows += sum(
        buffer[0].numel() * buffer.element_size() for table in quantized_lookups for buffer in table.buffers()
    )
    kv_cache = kv_cache_bytes(model, context_tokens)
    return math.ceil((weights + batch_size * (rows + kv_cache)) / batch_size)


def kv_cache_bytes(model: nn.Module, context_tokens: int) -> int:
    """One sequence's keys and values at `context_tokens`:
    2 x layers x kv_heads x head_dim x context x dtype bytes."""
    config = model.config.get_text_config()
    try:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
    except AttributeError as error:
        raise SlimlmError(
            f"cannot size the KV cache: the model's config has no {error.name}; "
            "decode_bytes_per_token needs a decoder-only transformer config"
        ) from None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype_bytes = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    return 2 * layers * kv_heads * head_dim * context_tokens * dtype_bytes


def _quantization_state(model: nn.Module) -> Iterable[torch.Tensor]:
    """The tensors bitsandbytes layers keep beside their weight (found by attribute, so bitsandbytes
    need not be importable): Linear8bitLt's row scales `SCB`, Linear4bit's `quant_state`."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(module, "state", None)
        yield from _tensors(getattr(weight, "SCB", None), getattr(state, "SCB", None))
        quant = getattr(weight, "quant_state", None)
        if quant is not None:
            yield from _tensors(quant.absmax, quant.code, quant.offset)
            if quant.state2 is not None:
                yield from _tensors(quant.state2.absmax, quant.state2.code)


def _tensors(*values: Optional[object]) -> Iterable[torch.Tensor]:
    return (v for v in values if isinstance(v, torch.Tensor))


def bandwidth_fraction(decode_tok_s: float, bytes_per_token: int, bandwidth_bytes_s: float) -> float:
    """The share of the memory bandwidth decoding uses: tok/s x bytes per token / bytes per s."""
    if decode_tok_s <= 0 or bytes_per_token <= 0 or bandwidth_bytes_s <= 0:
        raise SlimlmError(
            f"bandwidth_fraction needs positive numbers, got decode_tok_s={decode_tok_s}, "
            f"bytes_per_token={bytes_per_token}, bandwidth_bytes_s={bandwidth_bytes_s}"
        )
    return decode_tok_s * bytes_per_token / bandwidth_bytes_s
