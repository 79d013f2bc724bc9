"""slimlm's own CPU kernel: int4 weights times int8 activations (inference/kernels/).

torch has no CPU kernel that multiplies 4-bit codes by integer activations, and the
ecosystem's ones (torchao's da8w4, IPEX) ship no CPU build for this torch. The kernel is
compiled on first use with the machine's compiler (torch.utils.cpp_extension, cached per
machine) and used only where the processor has AVX512-VNNI; elsewhere the decoder keeps
torch's int4 kernel.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from slimlm.qlinear import QuantScheme

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "int4_int8_cpu.cpp"
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
BLOCK = 64  # inputs per activation block; the kernel's group sizes are multiples of it
TILE = 16  # output rows per vector: one lane each


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def int4_int8_available() -> bool:
    """Whether the int4 x int8 kernel runs here: a processor with AVX512-VNNI, and the kernel
    compiles (a C++ compiler and ninja). Compiling takes 10-20 s, once per machine."""
    missing = [flag for flag in REQUIRED_FLAGS if flag not in cpu_flags()]
    if missing:
        log.info("int4 x int8 CPU kernel not used: the processor lacks %s", ", ".join(missing))
        return False
    try:
        from torch.utils.cpp_extension import load

        load(name="slimlm_int4_int8_cpu", sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a failed build: torch's kernel still works
        log.warning("int4 x int8 CPU kernel not built (%s); int4 layers use torch's kernel", str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False
    torch.library.register_fake("slimlm::int4_int8_mm")(_output_shape)
    return True


def group_size(scheme: QuantScheme, in_features: int) -> int:
    return in_features // scheme.groups(in_features)


def int4_int8_fits(scheme: Optional[QuantScheme], out_features: int, in_features: int) -> bool:
    """Whether the kernel's layout can hold a layer of this scheme and shape (the planner asks
    too, so it needs no processor)."""
    if scheme is None or scheme.bits != 4:
        return False
    group = group_size(scheme, in_features)
    return group % BLOCK == 0 and in_features % group == 0 and out_features % TILE == 0


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N/16, K/8, 64] uint8 in the kernel's layout: for inputs 8c..8c+7
    of a tile of 16 rows, byte 4r + j holds row r's input 8c + j (low nibble) and 8c + 4 + j."""
    rows, width = codes.shape
    split = codes.to(torch.uint8).view(rows // TILE, TILE, width // 8, 2, 4).permute(0, 2, 3, 1, 4)
    return (split[:, :, 0] | split[:, :, 1] << 4).reshape(rows // TILE, width // 8, 64).contiguous()


def unpack_int4_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the codes packed by pack_int4: [len(ids), K] uint8."""
    tiles, chunks = packed.shape[:2]
    bytes_ = packed.view(tiles, chunks, TILE, 4)[ids // TILE, :, ids % TILE]  # [n, K/8, 4]
    return torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=2).reshape(len(ids), chunks * 8)


def tile_groups(values: torch.Tensor) -> torch.Tensor:
    """[N, groups] per-group values -> [N/16, groups, 16]: one vector load per tile and group."""
    rows, groups = values.shape
    return values.view(rows // TILE, TILE, groups).transpose(1, 2).contiguous()


def untile_groups(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the values tiled by tile_groups: [len(ids), groups]."""
    return tiled[ids // TILE, :, ids % TILE]


def _output_shape(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int) -> torch.Tensor:
    """What torch.compile traces in place of the kernel."""
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)
