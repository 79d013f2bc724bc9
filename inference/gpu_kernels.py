"""slimlm's own GPU kernel: int4 weights times bf16/fp16 activations for decoding (Triton).

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
weights. This kernel reads a QuantLinear's own buffers, exactly as the artifact stores them
(two 4-bit codes a byte, fp16 scales, uint8 zero points for asymmetric schemes): 4.25-4.4 bits
a weight at groups of 64, against 4.5 for tinygemm's bf16 (scale, zero) pairs, and nothing to
repack. Each program takes `BLOCK_N` output rows and every `SPLIT_K`-th block of `BLOCK_K`
inputs, sums code x input within each group, applies the group's scale and zero point once
per group, and adds its share into an fp32 output (atomic adds): splitting the inputs keeps
every multiprocessor busy on layers with few outputs. Block sizes are autotuned per shape on
first use (before a CUDA graph captures the step: its warm-up runs eagerly).

Larger inputs (a prefill chunk) dequantize the weight and call cuBLAS: compute-bound there.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

GROUPS = (32, 64, 128)  # group sizes the kernel takes (a block of inputs holds whole groups)
MAX_ROWS = 8  # inputs (batch x positions) up to which the kernel runs; more: dequantize + cuBLAS


@functools.cache
def available() -> bool:
    """Triton is importable (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fits(bits: int, group_size: Optional[int], in_features: int) -> bool:
    return bits == 4 and group_size in GROUPS and in_features % 512 == 0


# Autotuned over: (output rows per program, inputs per block, warps) x input splits. Twelve
# configurations: each is compiled once per layer width (the width is a compile-time constant),
# so a longer list costs minutes of first-run compilation on an 8B model.
TILES = ((8, 512, 4), (16, 256, 4), (32, 256, 4), (64, 128, 8))
SPLITS = (1, 2, 4)


def config_fits(block_k: int, split_k: int, in_features: int, group_size: int) -> bool:
    """Blocks of whole groups that tile the inputs, shared evenly between the splits."""
    return (
        in_features % block_k == 0 and block_k % group_size == 0 and (in_features // block_k) % split_k == 0
    )


@functools.cache
def _kernels():
    """The kernel and its autotuned launcher, defined on first use (Triton is imported only
    where a GPU layer is built, or by the tests' interpreter run)."""
    import triton
    import triton.language as tl

    @triton.jit
    def int4_matvec_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        y_ptr,
        N,
        K: tl.constexpr,
        GROUP: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        ZERO: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        groups = K // GROUP
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for step in range(0, K // BLOCK_K // SPLIT_K):  # blocks pid_k, pid_k + SPLIT_K, ...
            block = pid_k + step * SPLIT_K
            byte = block * (BLOCK_K // 2) + tl.arange(
                0, BLOCK_K // 2
            )  # byte j holds codes 2j (low nibble) and 2j+1
            packed = tl.load(w_ptr + n[:, None] * (K // 2) + byte[None, :], mask=n_ok[:, None], other=0)
            x_even = tl.load(x_ptr + row * K + 2 * byte).to(tl.float32)
            x_odd = tl.load(x_ptr + row * K + 2 * byte + 1).to(tl.float32)
            dots = (packed & 0xF).to(tl.float32) * x_even[None, :] + (packed >> 4).to(tl.float32) * x_odd[
                None, :
            ]
            group_dots = tl.sum(
                tl.reshape(dots, [BLOCK_N, BLOCK_K // GROUP, GROUP // 2]), axis=2
            )  # sum of code x input per group
            group_x = tl.sum(
                tl.reshape(x_even + x_odd, [BLOCK_K // GROUP, GROUP // 2]), axis=1
            )  # sum of inputs per group
            g = block * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
            scales = tl.load(s_ptr + n[:, None] * groups + g[None, :], mask=n_ok[:, None], other=0).to(
                tl.float32
            )
            if HAS_ZEROS:
                zeros = tl.load(z_ptr + n[:, None] * groups + g[None, :], mask=n_ok[:, None], other=0).to(
                    tl.float32
                )
            else:
                zeros = ZERO
            acc += tl.sum(
                scales * (group_dots - zeros * group_x[None, :]), axis=1
            )  # (code - zero) * scale, summed
        tl.atomic_add(y_ptr + row * N + n, acc, mask=n_ok)

    def prune(configs, named_args, **kwargs):
        return [
            c
            for c in configs
            if config_fits(c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"], named_args["K"], kwargs["GROUP"])
        ]

    configs = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split}, num_warps=warps)
        for n, k, warps in TILES
        for split in SPLITS
    ]
    tuned = triton.autotune(
        configs=configs,
        key=["N", "K", "GROUP"],
        prune_configs_by={"early_config_prune": prune},
        reset_to_zero=["y_ptr"],
    )(int4_matvec_kernel)
    return int4_matvec_kernel, tuned


def launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    symmetric_zero: int,
    tile: Optional[tuple[int, int, int, int]] = None,
) -> torch.Tensor:
    """The product in fp32 [rows, N]; `tile` (BLOCK_N, BLOCK_K, warps, SPLIT_K) skips the
    autotuner (the tests check every tile in Triton's interpreter, which cannot time)."""
    import triton

    rows, k = x.shape
    n = qweight.shape[0]
    y = torch.zeros(rows, n, dtype=torch.float32, device=x.device)
    kernel, tuned = _kernels()
    arguments = (x.contiguous(), qweight, scales, zeros if zeros is not None else scales, y, n, k)
    constants = dict(GROUP=group_size, HAS_ZEROS=zeros is not None, ZERO=symmetric_zero)
    if tile is None:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"], rows)](*arguments, **constants)
    else:
        block_n, block_k, warps, split_k = tile
        kernel[(triton.cdiv(n, block_n), split_k, rows)](
            *arguments, **constants, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps
        )
    return y


@torch.library.custom_op("slimlm::int4_matvec", mutates_args=())
def int4_matvec(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: Optional[torch.Tensor],
    group_size: int,
    symmetric_zero: int,
) -> torch.Tensor:
    """x [rows, K] (rows <= MAX_ROWS) times the int4 weight [N, K] of a QuantLinear's buffers
    (qweight [N, K/2], scales [N, groups], zeros [N, groups] or None) -> [rows, N] in x's dtype;
    an operator of its own so torch.compile and CUDA graphs take it whole."""
    return launch(x, qweight, scales, zeros, group_size, symmetric_zero).to(x.dtype)


@int4_matvec.register_fake
def _(x, qweight, scales, zeros, group_size, symmetric_zero):
    return x.new_empty(x.shape[0], qweight.shape[0])
