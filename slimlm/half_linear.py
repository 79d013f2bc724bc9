"""Half-precision Linear layers computed in float32 on CPUs that multiply half precision slowly.

Most checkpoints are bf16, and calibration and offloaded scoring keep their weights and
activations in the checkpoint's dtype. A CPU without bf16 instructions (AVX2, AVX-512 without
the BF16 extension) multiplies bf16 matrices through an emulated path: on an AVX2 machine a
2048 x 4096 by 4096 x 14336 product took 71 s in bf16, 7 s in float32 and 9 s upcast to
float32 and rounded back. Hardware bf16 matrix units read bf16, accumulate in float32 and
round the result to bf16; doing the same in software gives the same numbers up to summation
order, at float32's speed. Within `float32_linears`, every `F.linear` on half-precision CPU
tensors is computed that way, the weight upcast a bounded run of rows at a time, so an LM
head's float32 copy never exists whole.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HALF = (torch.bfloat16, torch.float16)
SLOW_RATIO = 2.0  # half precision this many times slower than float32 counts as slow
CHUNK_BYTES = 64 * 2**20  # float32 rows of a weight upcast at once (and their products)


@functools.cache
def half_matmul_is_slow(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices much more slowly than float32: measured
    once per process on a small product (a few milliseconds), not guessed from CPU flags."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=generator)
    w = torch.randn(1024, 1024, generator=generator)
    return _best_seconds(x.to(dtype), w.to(dtype)) > SLOW_RATIO * _best_seconds(x, w)


def _best_seconds(x: torch.Tensor, w: torch.Tensor, repeats: int = 3) -> float:
    F.linear(x, w)  # warm-up: first calls pick kernels and allocate
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - started)
    return best


def linear_in_float32(
    input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """F.linear of half-precision CPU tensors, multiplied in float32 and rounded to the input's
    dtype, as hardware half-precision matrix units do."""
    out = torch.empty(*input.shape[:-1], weight.shape[0], dtype=input.dtype)
    x = input.float()
    rows = max(1, CHUNK_BYTES // (4 * weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        part_bias = None if bias is None else bias[start : start + rows].float()
        out[..., start : start + rows] = F.linear(x, weight[start : start + rows].float(), part_bias)
    return out


def _computes_in_float32(args: tuple, kwargs: dict) -> bool:
    tensors = [*args, *kwargs.values()]
    return all(
        not isinstance(t, torch.Tensor)
        or (t.device.type == "cpu" and t.dtype in HALF and t.dtype == args[0].dtype)
        for t in tensors
    )


class _Float32Linears(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _computes_in_float32(args, kwargs):
            return linear_in_float32(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def float32_linears(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Within: Linear layers of a model in `dtype` on `device` multiply in float32 when that
    device is a CPU that multiplies `dtype` slowly; otherwise nothing changes."""
    if torch.device(device).type != "cpu" or dtype not in HALF or not half_matmul_is_slow(dtype):
        yield
        return
    with _Float32Linears():
        yield
