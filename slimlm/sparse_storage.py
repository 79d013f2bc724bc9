"""Sparse weight matrices stored compactly: a bitmask of the kept positions and the kept values.

A matrix with a fraction s of zeros and b-bit values costs 1 + (1 - s) * b bits per weight this
way instead of b, so it is used only where that is smaller (s > 1/b): a 50%-sparse (or 2:4)
matrix of int4 codes takes 3 bits per weight, of fp32 values 17 bits. "Zero" is the value that
dequantizes to 0: 0.0 for a float weight, the zero point for quantized codes.

Shared by the artifact format (which writes and reads the encoding) and the size report (which
counts what the artifact would write), so both agree on every byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
from torch import nn

from slimlm.packing import pack_codes, unpack_codes
from slimlm.qlinear import QuantLinear


@dataclass
class SparseCandidate:
    """A weight the artifact may store as a bitmask: its state-dict key and its unpacked values."""

    key: str  # `<module>.weight` or `<module>.qweight`
    values: torch.Tensor  # [out, in]: float weights, or unpacked integer codes
    zero: Union[torch.Tensor, float]  # what a pruned entry holds (broadcasts against values)
    bits: int  # bits per value as stored densely
    codes: bool  # True: quantized codes, packed `bits` each

    @property
    def nonzero(self) -> int:
        return int((self.values != self.zero).sum())

    def dense_bytes(self) -> int:
        return self.values.numel() * self.bits // 8

    def bitmask_bytes(self, nonzero: int) -> int:
        rows, cols = self.values.shape
        kept = (nonzero + 7) // 8 * self.bits if self.codes else nonzero * self.bits // 8
        return rows * ((cols + 7) // 8) + kept

    def stored_bytes(self) -> int:
        return min(self.dense_bytes(), self.bitmask_bytes(self.nonzero))


def zero_codes(layer: QuantLinear, zeros: Optional[torch.Tensor] = None) -> Union[torch.Tensor, int]:
    """The code of 0.0 in each position: the fixed symmetric zero, or each group's zero point
    (from `zeros` when given: the layer's zero points read from a file, not yet loaded into it)."""
    zeros = layer.zeros if zeros is None else zeros
    if zeros is None:
        return layer.scheme.symmetric_zero
    return zeros.repeat_interleave(layer.in_features // zeros.shape[1], dim=1)


def sparse_candidates(model: nn.Module) -> Iterator[SparseCandidate]:
    """Every Linear weight and quantized code matrix of the model, each shared one once."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            pointer, candidate = (
                module.qweight.data_ptr(),
                SparseCandidate(
                    f"{name}.qweight", module.codes(), zero_codes(module), module.scheme.bits, codes=True
                ),
            )
        elif isinstance(module, nn.Linear):
            weight = module.weight.detach()
            pointer, candidate = (
                weight.data_ptr(),
                SparseCandidate(f"{name}.weight", weight, 0.0, weight.element_size() * 8, codes=False),
            )
        else:
            continue
        if pointer not in seen:
            seen.add(pointer)
            yield candidate


def encode_bitmask(candidate: SparseCandidate) -> dict[str, torch.Tensor]:
    """`<key>.bitmask` (uint8 [out, ceil(in/8)], bit j%8 of byte j//8 set where kept) and
    `<key>.nonzeros` (kept values in row-major order; codes packed `bits` each)."""
    values = candidate.values.detach().cpu()
    keep = values != (candidate.zero.cpu() if isinstance(candidate.zero, torch.Tensor) else candidate.zero)
    kept = values[keep]
    if candidate.codes:
        kept = pack_codes(torch.nn.functional.pad(kept, (0, -kept.numel() % 8)), candidate.bits)
    return {f"{candidate.key}.bitmask": pack_bits(keep), f"{candidate.key}.nonzeros": kept.contiguous()}


def decode_bitmask(
    bitmask: torch.Tensor,
    nonzeros: torch.Tensor,
    shape: list[int],
    zero: Union[torch.Tensor, float],
    bits: int,
    codes: bool,
) -> torch.Tensor:
    """The dense [out, in] matrix again (codes come back packed, as QuantLinear stores them)."""
    if tuple(bitmask.shape) != (shape[0], (shape[1] + 7) // 8):
        raise ValueError(
            f"a bitmask of shape {tuple(bitmask.shape)} does not cover a {shape[0]}x{shape[1]} matrix"
        )
    keep = unpack_bits(bitmask, shape[1])
    count = int(keep.sum())
    kept = unpack_codes(nonzeros, bits)[:count] if codes else nonzeros
    if kept.numel() != count:
        raise ValueError(f"the bitmask keeps {count} values but {kept.numel()} are stored")
    dtype = torch.uint8 if codes else nonzeros.dtype
    dense = torch.zeros(shape, dtype=dtype) + (
        zero.to(dtype) if isinstance(zero, torch.Tensor) else torch.tensor(zero, dtype=dtype)
    )
    dense[keep] = kept
    return pack_codes(dense, bits) if codes else dense


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    rows, cols = mask.shape
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, -cols % 8)).view(rows, -1, 8)
    return (padded << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, cols: int) -> torch.Tensor:
    bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :cols].bool()
