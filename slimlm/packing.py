"""Bit-exact packing of b-bit integer codes (b in 2, 3, 4, 8): 8 codes fill exactly b bytes.

Codes are unsigned, 0 <= code < 2**b, packed along the last dimension (which must be a
multiple of 8). Code i of a group of eight occupies bits [i*b, (i+1)*b) of that group's
little-endian integer, so any b up to 8 packs with no wasted bit (3-bit included).
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 3, 4, 8)


def _check(bits: int, length: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported: {PACKABLE_BITS}")
    if length % 8:
        raise ValueError(f"the packed dimension ({length}) must be a multiple of 8")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8/int codes [..., n] -> uint8 [..., n * bits / 8]."""
    _check(bits, codes.shape[-1])
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    groups = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (groups << shifts).sum(dim=-1)  # one integer of 8*bits bits per group of eight codes
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    packed = (words.unsqueeze(-1) >> byte_shifts) & 0xFF
    return packed.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n * bits / 8] -> uint8 codes [..., n]."""
    if bits == 8:
        return packed
    _check(bits, packed.shape[-1] * 8 // bits)
    if 8 % bits == 0:  # whole codes per byte: byte-wise operations are several times faster
        mask = (1 << bits) - 1
        parts = [(packed >> (i * bits)) & mask for i in range(8 // bits)]
        return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
    chunks = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int32) * 8
    words = (chunks << byte_shifts).sum(dim=-1, dtype=torch.int32)  # 8 * bits <= 24 bits here
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1).to(torch.uint8)
