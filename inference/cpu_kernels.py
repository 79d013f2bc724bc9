"""slimlm's own CPU kernels (inference/kernels/): int4 or int8 weights times int8 activations
(with the layer's LoRA adapter, if it has one, in the same call), a mixture of experts' routed
experts in one call, and a decode step's attention over an fp32 or int8 key/value cache.

torch has no CPU kernel that multiplies 4-bit codes by integer activations, and the
ecosystem's ones (torchao's da8w4, IPEX) ship no CPU build for this torch; torch's int8 kernel
multiplies in floating point. The kernels are
compiled on first use with the machine's compiler (torch.utils.cpp_extension, cached per
machine) for the widest instruction set the processor has: AVX512-VNNI (servers, AMD Zen 4),
AVX-VNNI (Intel laptops since Alder Lake) or AVX2 (older laptops). Elsewhere, or where it cannot
be built, the decoder keeps torch's int4 and int8 kernels. SLIMLM_CPU_ISA names a narrower set to build
for instead (to measure or test a laptop's path on a bigger machine).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from slimlm.errors import ConfigError
from slimlm.qlinear import QuantScheme

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "kernels" / name
    for name in ("int8_activations_cpu.cpp", "decode_attention_cpu.cpp")
]
# The ops' namespace names the build (its sources' digest): a compiled graph names the kernels
# it calls, so torch.compile never reuses a graph it cached for another build, whose ops may take
# other arguments (Inductor's cache key does not cover an op's schema; such a graph crashed).
NAMESPACE = (
    "slimlm_"
    + hashlib.sha256(
        b"".join(source.read_bytes() for source in (*SOURCES, SOURCES[0].with_name("ops_namespace.h")))
    ).hexdigest()[:12]
)
ISA_ENV = "SLIMLM_CPU_ISA"
# Widest first: the /proc/cpuinfo flags each needs, and the compiler flags that select its path
# in the source (explicit sets, not -march=native, so a narrower one can be chosen).
ISAS = {
    "avx512_vnni": (
        ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma"),
        ["-march=x86-64-v4", "-mavx512vnni"],
    ),
    "avx_vnni": (("avx2", "fma", "avx_vnni"), ["-march=x86-64-v3", "-mavxvnni"]),
    "avx2": (("avx2", "fma"), ["-march=x86-64-v3"]),
}
BLOCK = 64  # inputs per activation block; the kernels' group sizes are multiples of it, or SEGMENT
SEGMENT = 32  # the one smaller group: llama.cpp's Q4_0 and Q8_0 size
TILE = 16  # output rows per vector: one lane each


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def missing_flags(isa: str) -> list[str]:
    """The processor flags instruction set `isa` (one of ISAS) needs that this processor lacks."""
    flags = cpu_flags()
    return [flag for flag in ISAS[isa][0] if flag not in flags]


def kernel_isa() -> Optional[str]:
    """The instruction set the kernel is built for here: $SLIMLM_CPU_ISA if set (it must be one
    of ISAS and the processor must have it), else the widest one the processor has; None if none."""
    chosen = os.environ.get(ISA_ENV)
    if chosen:
        if chosen not in ISAS:
            raise ConfigError(
                f"{ISA_ENV}={chosen!r} is not an instruction set of the int8-activation kernels: "
                f"use one of {', '.join(ISAS)}, or unset it"
            )
        missing = missing_flags(chosen)
        if missing:
            raise ConfigError(
                f"{ISA_ENV}={chosen}, but this processor lacks {', '.join(missing)}: "
                "choose a narrower set or unset it"
            )
        return chosen
    return next((isa for isa in ISAS if not missing_flags(isa)), None)


OPS = {4: "int4_int8_mm", 8: "int8_int8_mm"}  # the kernel of each weight width (in ops())


def ops():
    """The kernels' namespace in torch.ops (once available() has built them)."""
    return getattr(torch.ops, NAMESPACE)


@functools.cache
def available() -> bool:
    """Whether slimlm's CPU kernels (int8 activations, decode attention) run here: an x86
    processor with AVX2 and FMA at least, and the kernels compile (a C++ compiler and ninja).
    Compiling takes 15-30 s, once per machine and instruction set."""
    isa = kernel_isa()
    if isa is None:
        log.info("slimlm's CPU kernels not used: the processor has none of %s", ", ".join(ISAS))
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"slimlm_cpu_kernels_{isa}"
        if not (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists():
            log.warning(
                "compiling slimlm's CPU kernels for %s (once per machine, about 15-30 s)", isa
            )  # else a silent pause
        cflags = ["-O3", "-mtune=native", "-fopenmp", f"-DSLIMLM_OPS={NAMESPACE}", *ISAS[isa][1]]
        load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, no ninja, a failed build: torch's kernels still work
        log.warning(
            "slimlm's CPU kernels not built (%s); int4 and int8 layers use torch's kernels, "
            "attention torch.compile's loop",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return False
    for op in OPS.values():
        torch.library.register_fake(f"{NAMESPACE}::{op}")(_output_shape)
    torch.library.register_fake(f"{NAMESPACE}::decode_attention")(_attention_shape)
    torch.library.register_fake(f"{NAMESPACE}::routed_experts")(_experts_shape)
    log.info("slimlm's CPU kernels built for %s", isa)
    return True


def group_size(scheme: QuantScheme, in_features: int) -> int:
    return in_features // scheme.groups(in_features)


def fits(scheme: Optional[QuantScheme], out_features: int, in_features: int) -> bool:
    """Whether a kernel's layout can hold a layer of this scheme and shape: int4 or int8, groups
    (or whole rows) of 32 inputs or a multiple of 64, inputs a multiple of 64, rows a multiple
    of 16 (the planner asks too, so it needs no processor)."""
    if scheme is None or scheme.bits not in OPS:
        return False
    group = group_size(scheme, in_features)
    return (
        (group == SEGMENT or group % BLOCK == 0)
        and in_features % group == 0
        and in_features % BLOCK == 0
        and out_features % TILE == 0
    )


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes -> the kernel's layout for `bits`: for inputs 8c..8c+7 of a tile of 16 rows,
    two dot-product operands, the first holding in byte 4r + j row r's input 8c + j, the second
    its input 8c + 4 + j. int4: [N/16, K/8, 64] uint8, the first operand in the low nibbles and
    the second in the high ones; int8: [N/16, K/8, 128] uint8, the two operands one after the other."""
    rows, width = codes.shape
    halves = (
        codes.to(torch.uint8).view(rows // TILE, TILE, width // 8, 2, 4).permute(0, 2, 3, 1, 4)
    )  # [tiles, K/8, 2, 16, 4]
    if bits == 4:
        return (halves[:, :, 0] | halves[:, :, 1] << 4).reshape(rows // TILE, width // 8, 64).contiguous()
    return halves.reshape(rows // TILE, width // 8, 128).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the codes `pack` laid out (int4 or int8, told apart by the chunk size):
    [len(ids), K] uint8."""
    tiles, chunks, chunk = packed.shape
    if chunk == 64:
        bytes_ = packed.view(tiles, chunks, TILE, 4)[ids // TILE, :, ids % TILE]  # [n, K/8, 4]
        halves = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=2)
    else:
        halves = packed.view(tiles, chunks, 2, TILE, 4)[ids // TILE, :, :, ids % TILE]  # [n, K/8, 2, 4]
    return halves.reshape(len(ids), chunks * 8)


def tile_groups(values: torch.Tensor) -> torch.Tensor:
    """[N, groups] per-group values -> [N/16, groups, 16]: one vector load per tile and group."""
    rows, groups = values.shape
    return values.view(rows // TILE, TILE, groups).transpose(1, 2).contiguous()


def untile_groups(tiled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the values tiled by tile_groups: [len(ids), groups]."""
    return tiled[ids // TILE, :, ids % TILE]


def pack_adapter(down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A LoRA adapter y += B A x (down A [r, K], up B [N, r]) in the kernels' layout: A in
    bf16; for each tile of 16 rows only the span of B's columns its rows use (a fused layer's
    B is block-diagonal, one block per part), stored [count, 16] in bf16; and per tile (first
    column, count, offset into the stored columns). bf16 halves the bytes each token reads; its
    rounding (3 significant digits) is small beside the int4 codes' the adapter corrects."""
    rows, rank = up.shape
    spans, columns, offset = [], [], 0
    for tile in up.detach().view(rows // TILE, TILE, rank):
        used = tile.ne(0).any(0).nonzero().flatten().tolist()
        first, count = (used[0], used[-1] + 1 - used[0]) if used else (0, 0)
        columns.append(tile[:, first : first + count].t().reshape(-1))
        spans.append((first, count, offset))
        offset += count * TILE
    return (
        down.detach().to(torch.bfloat16).contiguous(),
        torch.cat(columns).to(torch.bfloat16),
        torch.tensor(spans, dtype=torch.int64),
    )


def _output_shape(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: Optional[torch.Tensor],
    group_size: int,
    lora_down: Optional[torch.Tensor] = None,
    lora_up: Optional[torch.Tensor] = None,
    lora_tiles: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What torch.compile traces in place of the kernel."""
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)


def _attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scales: Optional[torch.Tensor],
    v: torch.Tensor,
    v_scales: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    softmax_scale: float,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


def _experts_shape(
    x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, *stacks_and_activation
) -> torch.Tensor:
    return torch.empty_like(x)
