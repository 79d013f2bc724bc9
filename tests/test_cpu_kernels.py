"""slimlm's int4 x int8 and int8 x int8 CPU kernels against an exact emulation of their
arithmetic, and the decoder built on them against the weight-only kernels."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from slimlm.errors import ConfigError
from slimlm.inference import cpu_kernels
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.decoder import Decoder
from slimlm.inference.linear import Int4Linear, Int8Linear, build_linear, tinygemm_bytes
from slimlm.inference.model import Segment, from_cache, to_cache
from slimlm.inference.sampling import SamplingParams
from slimlm.packing import unpack_codes
from slimlm.qlinear import QuantLinear, QuantScheme
from tests.test_decoder import assert_same_decoding, prompt_ids, quantized

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="the processor lacks AVX2 and FMA (or no compiler): the decoder uses torch's kernels",
)


def random_weights(rows, width, group, bits=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, width), generator=generator)
    scales = (torch.rand(rows, width // group, generator=generator) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 2**bits, (rows, width // group), generator=generator).float()
    offsets = (zeros * scales.float()).to(torch.bfloat16)
    return codes, scales, offsets


def emulate(x, codes, scales, offsets, group):
    """The kernel's arithmetic in torch: activations rounded per 64 inputs, integer dots per
    segment of min(group, 64) inputs, the offsets times the sums of the rounded activations."""
    rows, width = codes.shape
    step = min(group, 64)
    blocks = x.float().view(x.shape[0], width // 64, 64)
    block_scale = blocks.abs().amax(-1, keepdim=True) / 127
    block_scale = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
    q = torch.round(blocks * (1 / block_scale))
    dots = torch.einsum(
        "msi,nsi->mns",
        q.double().view(x.shape[0], width // step, step),
        codes.view(rows, width // step, step).double(),
    )
    per_segment = scales.double().repeat_interleave(group // step, dim=1)
    segment_scale = block_scale.squeeze(-1).double().repeat_interleave(64 // step, dim=1)
    y = (dots * per_segment[None] * segment_scale[:, None]).sum(-1)
    rounded = (q * block_scale).double().view(x.shape[0], width // group, group)
    return (y - rounded.sum(-1) @ offsets.double().t()).float()


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_round_trips_and_rows_read_back(bits):
    codes, scales, _ = random_weights(48, 128, 64, bits)
    packed = cpu_kernels.pack(codes, bits)
    assert packed.shape == (3, 16, 16 * bits) and packed.dtype == torch.uint8
    ids = torch.tensor([0, 17, 47, 5])
    assert torch.equal(cpu_kernels.unpack_rows(packed, ids).long(), codes[ids])
    assert torch.equal(cpu_kernels.untile_groups(cpu_kernels.tile_groups(scales), ids), scales[ids])


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 256], ids=["g32", "g64", "row"])
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_the_emulation_of_its_arithmetic(bits, group, tokens, dtype):
    rows, width = 48, 256
    codes, scales, offsets = random_weights(rows, width, group, bits, seed=tokens)
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0, :64] = 0  # an all-zero block must not divide by zero
    codes[0], x[-1, 64:128] = 2**bits - 1, 1.0  # the largest codes times 127s: int16 pair sums would saturate
    op = getattr(cpu_kernels.ops(), cpu_kernels.OPS[bits])
    y = op(
        x,
        cpu_kernels.pack(codes, bits),
        cpu_kernels.tile_groups(scales),
        cpu_kernels.tile_groups(offsets),
        group,
    )
    assert y.dtype == dtype and y.shape == (tokens, rows)
    torch.testing.assert_close(
        y.float(),
        emulate(x, codes, scales, offsets, group),
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-3 if dtype == torch.bfloat16 else 1e-5,
    )
    weight = (
        codes.float().view(rows, -1, group) * scales.float()[..., None] - offsets.float()[..., None]
    ).view(rows, width)
    exact = x.float() @ weight.t()
    assert (y.float() - exact).norm() / exact.norm() < 0.02  # what rounding the activations costs


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_a_symmetric_layer_runs_without_offsets(bits):
    """A symmetric scheme's zero point (8 or 128) is the kernel's constant: no offsets stored,
    the same outputs as with offsets of zero point times scale, and an op check of the fake."""
    codes, scales, _ = random_weights(32, 128, 32, bits)
    offsets = (scales.float() * 2 ** (bits - 1)).to(torch.bfloat16)  # exact: a power of two
    x = torch.randn(3, 128)
    op = getattr(cpu_kernels.ops(), cpu_kernels.OPS[bits])
    packed, tiled = cpu_kernels.pack(codes, bits), cpu_kernels.tile_groups(scales)
    torch.testing.assert_close(
        op(x, packed, tiled, None, 32),
        op(x, packed, tiled, cpu_kernels.tile_groups(offsets), 32),
        rtol=0,
        atol=0,
    )
    torch.library.opcheck(op, (x, packed, tiled, None, 32))


@needs_kernel
def test_kernel_refuses_shapes_it_cannot_run():
    codes, scales, offsets = random_weights(16, 128, 64)
    packed, s, o = (
        cpu_kernels.pack(codes, 4),
        cpu_kernels.tile_groups(scales),
        cpu_kernels.tile_groups(offsets),
    )
    with pytest.raises(RuntimeError, match="multiple of the group size"):
        cpu_kernels.ops().int4_int8_mm(torch.randn(1, 128), packed, s, o, 96)
    with pytest.raises(RuntimeError, match="must match the packed width"):
        cpu_kernels.ops().int4_int8_mm(torch.randn(1, 64), packed, s, o, 64)
    with pytest.raises(RuntimeError, match=r"int8_int8_mm: packed weights \[N/16, K/8, 128\] expected"):
        cpu_kernels.ops().int8_int8_mm(
            torch.randn(1, 128), packed, s, o, 64
        )  # int4 codes given to the int8 kernel


def block_diagonal_adapter(width, parts=((64, 3), (32, 0), (32, 2)), seed=0):
    """A fused layer's adapter: the parts' down-projections stacked, their up-projections on a
    block diagonal (one part without an adapter, as stacked_adapters builds it)."""
    generator = torch.Generator().manual_seed(seed)
    down = torch.randn(sum(rank for _, rank in parts), width, generator=generator) * 0.1
    up = torch.block_diag(
        *[
            torch.randn(rows, rank, generator=generator) if rank else torch.zeros(rows, 0)
            for rows, rank in parts
        ]
    )
    return down, up


def test_adapter_layout_keeps_each_tiles_own_columns():
    down, up = block_diagonal_adapter(128)
    packed_down, columns, spans = cpu_kernels.pack_adapter(down, up)
    assert packed_down.dtype == columns.dtype == torch.bfloat16 and packed_down.shape == (5, 128)
    assert spans.tolist() == [
        [0, 3, 0],
        [0, 3, 48],
        [0, 3, 96],
        [0, 3, 144],
        [0, 0, 192],
        [0, 0, 192],
        [3, 2, 192],
        [3, 2, 224],
    ]
    assert columns.numel() == 64 * 3 + 32 * 2  # the block diagonal's zeros are not stored
    rebuilt = torch.zeros_like(up)
    for tile, (first, count, offset) in enumerate(spans.tolist()):
        rebuilt[tile * 16 : tile * 16 + 16, first : first + count] = (
            columns[offset : offset + count * 16].view(count, 16).t().float()
        )
    torch.testing.assert_close(rebuilt, up.bfloat16().float())
    assert (
        cpu_kernels.pack_adapter(down, torch.zeros_like(up))[2][:, 1].eq(0).all()
    )  # an untrained (zero) B: nothing to read


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_adds_the_lora_adapter_in_the_same_call(bits, tokens, dtype):
    """y = kernel(x) + B (A x) with both factors rounded to bf16, A x from the unrounded input."""
    rows, width, group = 128, 256, 64
    codes, scales, offsets = random_weights(rows, width, group, bits, seed=tokens)
    down, up = block_diagonal_adapter(width, seed=tokens)
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    op = getattr(cpu_kernels.ops(), cpu_kernels.OPS[bits])
    weights = (
        cpu_kernels.pack(codes, bits),
        cpu_kernels.tile_groups(scales),
        cpu_kernels.tile_groups(offsets),
        group,
    )
    y = op(x, *weights, *cpu_kernels.pack_adapter(down, up))
    assert y.dtype == dtype and y.shape == (tokens, rows)
    correction = (x.double() @ down.bfloat16().double().t()) @ up.bfloat16().double().t()
    base = op(x, *weights).double()
    expected = base + correction
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # the base alone was rounded to bf16 once, y once after adding the correction: half a step each
        assert ((y.double() - expected).abs() <= (base.abs() + expected.abs()) * 2**-8 + 1e-5).all()
    assert correction.abs().mean() > 0.1  # the adapter is not negligible beside the layer


@needs_kernel
def test_kernel_refuses_an_adapter_it_cannot_read():
    codes, scales, offsets = random_weights(128, 128, 64)
    weights = (
        cpu_kernels.pack(codes, 4),
        cpu_kernels.tile_groups(scales),
        cpu_kernels.tile_groups(offsets),
        64,
    )
    down, columns, spans = cpu_kernels.pack_adapter(*block_diagonal_adapter(128))
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match="needs lora_down, lora_up and lora_tiles together"):
        cpu_kernels.ops().int4_int8_mm(x, *weights, down, columns, None)
    with pytest.raises(RuntimeError, match=r"lora_down must be contiguous bfloat16 \[rank, K=128\]"):
        cpu_kernels.ops().int4_int8_mm(x, *weights, down.float(), columns, spans)
    # more columns than the rank; then spans whose sums would wrap around an int64
    for span in ([3, 9, 192], [2**63 - 1, 1, 0], [2**63 - 2**59 + 1, 2**59, 0], [0, 1, 2**63 - 10]):
        bad = spans.clone()
        bad[6] = torch.tensor(span)
        with pytest.raises(RuntimeError, match="lora_tiles row 6 reaches outside"):
            cpu_kernels.ops().int4_int8_mm(x, *weights, down, columns, bad)


def cached(batch, kv_heads, slots, dim, seed, dtype=torch.int8):
    """Key or value vectors as a cache of `dtype` stores them (int8: codes and a float32 scale per vector)."""
    return to_cache(
        torch.randn(batch, kv_heads, slots, dim, generator=torch.Generator().manual_seed(seed)) * 3, dtype
    )


@needs_kernel
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(4, 4, 16), (9, 3, 64), (8, 2, 128), (10, 1, 40)],
    ids=["mha-d16", "gqa3-d64", "gqa4-d128", "gqa10-d40"],
)
@pytest.mark.parametrize("slots", [1, 7, 8, 9, 200, 1031])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32], ids=["int8", "fp32"])
def test_decode_attention_matches_attention_over_the_dequantized_cache(
    heads, kv_heads, dim, slots, batch, cache_dtype
):
    """The kernel against softmax attention over the cache's (dequantized) vectors, with rows read
    through a view (a slice of the cache's rows and slots, as the decoder passes them), a mask
    per row with hidden slots (the first half of row 0's: with several threads, a whole chunk of
    a head hidden), and the slot counts that split one sequence's heads between threads."""
    rows, capacity = 3, slots + 5
    (k_codes, k_scales), (v_codes, v_scales) = (
        cached(rows, kv_heads, capacity, dim, 1, cache_dtype),
        cached(rows, kv_heads, capacity, dim, 2, cache_dtype),
    )

    def view(t):
        return None if t is None else t[1 : 1 + batch, :, :slots]

    q = torch.randn(batch, heads, 1, dim, generator=torch.Generator().manual_seed(3))
    visible = torch.rand(batch, 1, 1, slots, generator=torch.Generator().manual_seed(4)) > 0.3
    visible[0, ..., : slots // 2 + 1] = False
    visible[..., -1] = True  # a query always sees its own slot
    keys, values = (
        from_cache(view(k_codes), view(k_scales), torch.float32),
        from_cache(view(v_codes), view(v_scales), torch.float32),
    )
    for mask, scale in (
        (None, dim**-0.5),
        (visible, dim**-0.5),
        (visible[:1], dim**-0.5),
        (visible, 0.5 * dim**-0.5),
    ):  # the last: the scale is the caller's
        expected = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=heads != kv_heads, scale=scale
        )
        got = cpu_kernels.ops().decode_attention(
            q, view(k_codes), view(k_scales), view(v_codes), view(v_scales), mask, scale
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_decode_attention_refuses_what_it_cannot_read():
    codes, scales = cached(1, 2, 10, 16, 0)
    q = torch.randn(1, 4, 1, 16)
    attention = cpu_kernels.ops().decode_attention
    with pytest.raises(RuntimeError, match="does not match the cache"):
        attention(torch.randn(1, 4, 1, 32), codes, scales, codes, scales, None, 0.25)
    with pytest.raises(RuntimeError, match="must be float32 or int8 codes, not BFloat16"):
        attention(q, codes.bfloat16(), None, codes.bfloat16(), None, None, 0.25)
    with pytest.raises(RuntimeError, match="int8 codes need float32 scales"):
        attention(q, codes, None, codes, scales, None, 0.25)
    with pytest.raises(RuntimeError, match="a float cache none"):
        attention(q, codes.float(), scales, codes.float(), scales, None, 0.25)
    with pytest.raises(RuntimeError, match="mask must be bool"):
        attention(q, codes, scales, codes, scales, torch.ones(1, 1, 1, 10), 0.25)
    with pytest.raises(RuntimeError, match=r"one for all heads\), got Bool \[1, 4, 1, 10\]"):
        attention(q, codes, scales, codes, scales, torch.ones(1, 4, 1, 10, dtype=torch.bool), 0.25)
    with pytest.raises(RuntimeError, match=r"got Float \[1, 2, 10, 5\]"):
        attention(q, codes, scales.expand(1, 2, 10, 5), codes, scales, None, 0.25)
    with pytest.raises(
        RuntimeError, match="does not match the cache"
    ):  # no key/value heads: an error, not a division by zero
        attention(q, codes[:, :0], scales[:, :0], codes[:, :0], scales[:, :0], None, 0.25)
    assert attention(q[:0], codes[:0], scales[:0], codes[:0], scales[:0], None, 0.25).shape == (0, 4, 1, 16)


@needs_kernel
def test_the_ops_namespace_names_the_build():
    """A graph torch.compile cached for another build of the kernels (whose ops may take other
    arguments) names other ops, so it is never reused; the namespace is the sources' digest."""
    import hashlib

    sources = [*cpu_kernels.SOURCES, cpu_kernels.SOURCES[0].with_name("ops_namespace.h")]
    assert (
        cpu_kernels.NAMESPACE
        == "slimlm_" + hashlib.sha256(b"".join(source.read_bytes() for source in sources)).hexdigest()[:12]
    )
    assert all(hasattr(cpu_kernels.ops(), name) for name in (*cpu_kernels.OPS.values(), "decode_attention"))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernels_fake_versions_agree_with_them(dtype):
    """torch.compile traces each op through its fake version (cpu_kernels.register_fake), and the
    compiled step does not check the real outputs' shapes and strides at run time
    (decoder.CPU_STEP_OPTIONS): opcheck compares them, with and without the optional tensors."""
    codes, scales, offsets = random_weights(128, 256, 64, bits=4)
    x = torch.randn(3, 256).to(dtype)
    down, up = block_diagonal_adapter(256)
    for bits in (4, 8):
        weights = (
            cpu_kernels.pack(codes, bits),
            cpu_kernels.tile_groups(scales),
            cpu_kernels.tile_groups(offsets),
            64,
        )
        op = getattr(cpu_kernels.ops(), cpu_kernels.OPS[bits])
        torch.library.opcheck(op, (x, *weights))
        torch.library.opcheck(op, (x, *weights, *cpu_kernels.pack_adapter(down, up)))
    for cache_dtype in (torch.int8, torch.float32):
        (k_codes, k_scales), (v_codes, v_scales) = (
            cached(3, 2, 40, 16, 1, cache_dtype),
            cached(3, 2, 40, 16, 2, cache_dtype),
        )
        q = torch.randn(2, 4, 1, 16).to(dtype)
        masks = (
            None,
            torch.rand(2, 1, 1, 33) > 0.3,
            torch.ones(1, 1, 1, 33, dtype=torch.bool),
        )  # none, one per sequence, one for all
        for rows, reader in (
            (slice(0, 2), None),
            (slice(None), torch.tensor([2, 0])),
        ):  # the first rows, or rows by index

            def view(t, rows=rows):
                return None if t is None else t[rows, :, :33]

            for visible in masks:
                torch.library.opcheck(
                    cpu_kernels.ops().decode_attention,
                    (q, view(k_codes), view(k_scales), view(v_codes), view(v_scales), visible, 0.25, reader),
                )


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32], ids=["int8", "fp32"])
def test_decode_attention_reads_each_sequence_from_its_own_cache_row(cache_dtype):
    """Continuous batching: each sequence's row of the whole cache, given by index, attends
    exactly as a gathered copy of those rows; a row outside the cache is refused."""
    (k_codes, k_scales), (v_codes, v_scales) = (
        cached(4, 2, 40, 16, 1, cache_dtype),
        cached(4, 2, 40, 16, 2, cache_dtype),
    )
    rows = torch.tensor([3, 0, 2])
    q = torch.randn(3, 4, 1, 16, generator=torch.Generator().manual_seed(3))
    visible = torch.rand(3, 1, 1, 33, generator=torch.Generator().manual_seed(4)) > 0.3
    visible[..., -1] = True

    def gathered(t):
        return None if t is None else t[rows, :, :33]

    def whole(t):
        return None if t is None else t[:, :, :33]

    expected = cpu_kernels.ops().decode_attention(
        q, gathered(k_codes), gathered(k_scales), gathered(v_codes), gathered(v_scales), visible, 0.25
    )
    got = cpu_kernels.ops().decode_attention(
        q, whole(k_codes), whole(k_scales), whole(v_codes), whole(v_scales), visible, 0.25, rows
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    cache = (whole(k_codes), whole(k_scales), whole(v_codes), whole(v_scales), visible, 0.25)
    with pytest.raises(RuntimeError, match=r"rows\[2\]=4 is not one of the cache's 4 rows"):
        cpu_kernels.ops().decode_attention(q, *cache, torch.tensor([3, 0, 4]))
    with pytest.raises(RuntimeError, match=r"rows\[1\]=-1 is not one"):
        cpu_kernels.ops().decode_attention(q, *cache, torch.tensor([3, -1, 2]))
    for bad in (rows.int(), rows[:2]):
        with pytest.raises(RuntimeError, match=r"rows must be int64 \[batch\]=\[3\]"):
            cpu_kernels.ops().decode_attention(q, *cache, bad)
    with pytest.raises(
        RuntimeError, match="3 sequences but 4 cache rows: without rows, sequence b reads cache row b"
    ):
        cpu_kernels.ops().decode_attention(q, *cache)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32], ids=["int8", "fp32"])
def test_sequences_sharing_a_row_each_attend_under_their_own_mask(cache_dtype):
    """A decode step's guesses: several sequences given one cache row, each with its own mask
    (here 5 on row 2 and 2 on row 0, interleaved), against softmax attention over the gathered
    rows. A NaN key that some of a row's sequences see and the others do not changes only theirs."""
    (k_codes, k_scales), (v_codes, v_scales) = (
        cached(3, 3, 100, 64, 1, cache_dtype),
        cached(3, 3, 100, 64, 2, cache_dtype),
    )
    rows = torch.tensor([2, 0, 2, 2, 0, 2, 2])
    q = torch.randn(len(rows), 9, 1, 64, generator=torch.Generator().manual_seed(3))
    ends = torch.tensor([90, 40, 91, 92, 41, 93, 94])  # each query sees the slots up to its own
    visible = (torch.arange(100) <= ends[:, None])[:, None, None]
    visible[3, ..., :70] = False  # one of row 2's queries with a sliding window

    def gathered(t):
        return None if t is None else t[rows]

    keys, values = (
        from_cache(gathered(k_codes), gathered(k_scales), torch.float32),
        from_cache(gathered(v_codes), gathered(v_scales), torch.float32),
    )
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
    got = cpu_kernels.ops().decode_attention(q, k_codes, k_scales, v_codes, v_scales, visible, 64**-0.5, rows)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    poisoned, poisoned_scales = (k_codes.clone(), None) if k_scales is None else (k_codes, k_scales.clone())
    (poisoned if k_scales is None else poisoned_scales)[2, :, 93] = float(
        "nan"
    )  # seen by the queries of ends 93 and 94 only
    got = cpu_kernels.ops().decode_attention(
        q, poisoned, poisoned_scales, v_codes, v_scales, visible, 64**-0.5, rows
    )
    torch.testing.assert_close(got[:5], expected[:5], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[5:], expected[5:], rtol=1e-3, atol=1e-3)


@needs_kernel
def test_decode_attention_never_reads_the_keys_of_hidden_slots():
    """Garbage (NaN) in a hidden slot's key, here the cache's tail beyond the current position,
    leaves the output as if the slot were not there."""
    codes, _ = cached(1, 2, 24, 16, 0, torch.float32)
    values, _ = cached(1, 2, 24, 16, 1, torch.float32)
    q = torch.randn(1, 4, 1, 16)
    visible = torch.ones(1, 1, 1, 24, dtype=torch.bool)
    visible[..., 8:] = False
    expected = cpu_kernels.ops().decode_attention(q, codes, None, values, None, visible, 0.25)
    for slot in range(8, 24):
        poisoned = codes.clone()
        poisoned[:, :, slot] = float("nan")
        torch.testing.assert_close(
            cpu_kernels.ops().decode_attention(q, poisoned, None, values, None, visible, 0.25), expected
        )


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32], ids=["int8", "fp32"])
def test_decode_steps_attend_in_the_kernel_as_in_torch(context_model, cache_dtype, monkeypatch):
    """The decoder's steps with the kernel against the same steps in torch's attention over the
    (dequantized) cache: left-padded rows (a mask per row), continuous batching's rows at their
    own slots, and runs of up to 8 tokens (guesses being checked) as queries of the kernel."""
    kernel, dequantized = build_decoder(context_model), build_decoder(context_model)
    for decoder in (kernel, dequantized):
        decoder.setup_cache(2, 48, cache_dtype)
    assert all(block.attention.decode_kernel for block in kernel.layers)
    for block in dequantized.layers:
        block.attention.decode_kernel = False
    vocab = context_model.config.vocab_size
    ids = torch.tensor([prompt_ids(34, vocab), prompt_ids(34, vocab, seed=1)])
    pad = torch.tensor([0, 5])
    with torch.no_grad():
        for decoder in (kernel, dequantized):
            decoder(ids[:, :16], 0, pad)
        for slot in range(16, 24):
            torch.testing.assert_close(
                kernel(ids[:, slot : slot + 1], slot, pad),
                dequantized(ids[:, slot : slot + 1], slot, pad),
                rtol=1e-4,
                atol=1e-4,
            )
        segments = [Segment(1, 24, [int(ids[1, 24])]), Segment(0, 20, [int(ids[0, 24])])]
        for mine, theirs in zip(
            kernel.forward_segments(segments, [1, 1]), dequantized.forward_segments(segments, [1, 1])
        ):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        ops, queries = cpu_kernels.ops(), []  # the kernel's calls: the queries each took

        def counted(q, *rest):
            queries.append(q.shape[0])
            return ops.decode_attention(q, *rest)

        monkeypatch.setattr(cpu_kernels, "ops", lambda: SimpleNamespace(decode_attention=counted))
        for length in (2, 8):  # short runs (speculative guesses): one call a layer, one query per token
            queries.clear()
            torch.testing.assert_close(
                kernel(ids[:, 25 : 25 + length], 25, pad),
                dequantized(ids[:, 25 : 25 + length], 25, pad),
                rtol=1e-4,
                atol=1e-4,
            )
            assert queries == [2 * length] * len(kernel.layers)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_decoder_with_int8_activations_runs_every_layer_in_the_kernel(
    context_model, tiny_tokenizer, tmp_path, bits
):
    """Every layer in slimlm's kernel, within a small KL of the weight-only decoder: measured
    0.0016 (int4) and 0.0013 (int8); one layer's MLP output scaled by 0.9 gives 0.0053 and
    0.0042 (on the default-init tiny model 3.5e-6: its layers barely move its logits)."""
    model = quantized(
        context_model,
        tiny_tokenizer,
        tmp_path,
        bits=bits,
        group_size=64 if bits == 4 else None,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
    )
    weight_only, w8a8 = (
        build_decoder(model, dtype=torch.bfloat16),
        build_decoder(model, dtype=torch.bfloat16, int8_activations=True),
    )
    assert describe_kernels(w8a8) == {
        f"int{bits}-int8act": 4 * model.config.num_hidden_layers,
        f"head: int{bits}-int8act": 1,
    }
    assert w8a8.embedding.table is w8a8.output  # the tied head's codes serve the embedding: no second table
    if bits == 4:  # torch's int4 head cannot be read by rows: it keeps a second table
        assert w8a8.weight_bytes() < weight_only.weight_bytes()
    ids = torch.tensor([prompt_ids(24, model.config.vocab_size)])
    torch.testing.assert_close(
        w8a8.embedding(ids), weight_only.embedding(ids), rtol=0.02, atol=4e-3
    )  # bf16 arithmetic in both: a step is 0.004 at 0.5-1
    for decoder in (weight_only, w8a8):
        decoder.setup_cache(1, 32)
    with torch.no_grad():
        reference, rounded = weight_only(ids, 0).float().log_softmax(-1), w8a8(ids, 0).float().log_softmax(-1)
    kl = (reference.exp() * (reference - rounded)).sum(-1).mean()
    assert 0 < kl < 3e-3


@needs_kernel
def test_compiled_step_matches_eager_also_after_the_cache_changes(context_model, tiny_tokenizer, tmp_path):
    """The compiled step skips Dynamo's guards on the weights but keeps the cache's: a cache
    allocated anew between requests (longer, or of another dtype) must be seen. The first
    layer's linear layers carry LoRA adapters, which the kernel calls take as optional tensors.
    bf16 throughout: where eager and compiled tokens part at a near-tie, the logits are compared,
    within 10% of the largest: with int8 activations a bf16 step in a layer's input can move an
    activation's code by one, and over 30 steps the two caches drift apart (7% measured). With
    the cache's guards dropped, the compiled step would read the new tensors with the old
    cache's shapes and dtype baked in, and fail here; each change of the cache compiles anew."""
    model = quantized(
        context_model,
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=64,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
    )
    torch.manual_seed(0)
    for layer in model.model.layers[0].modules():
        if isinstance(layer, QuantLinear):
            layer.add_adapter(
                torch.randn(2, layer.in_features) * 0.1, torch.randn(layer.out_features, 2) * 0.1
            )
    eager = Decoder(build_decoder(model, dtype=torch.bfloat16, int8_activations=True), tiny_tokenizer)
    compiled = Decoder(build_decoder(model, dtype=torch.bfloat16, int8_activations=True), tiny_tokenizer)
    compiled.compile_decode_step()
    graphs, before = [], counters["stats"]["unique_graphs"]
    for length, new_tokens, cache_dtype in ((6, 8, None), (40, 30, None), (40, 30, torch.bfloat16)):
        if cache_dtype is not None:
            for decoder in (eager, compiled):
                decoder.model.setup_cache(1, 80, cache_dtype)
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        assert_same_decoding(compiled, eager, [prompt_ids(length, 300, seed=length)], params, share=0.1)
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs == [1, 2, 3]  # one graph for each cache: the first, the longer one, the bf16 one
    assert compiled.model.layers[0].attention.k_cache.dtype == torch.bfloat16
    assert describe_kernels(compiled.model)["int4-int8act+lora"] == 4


@pytest.mark.parametrize(
    "flags, isa",
    [
        (
            {
                "avx2",
                "fma",
                "avx_vnni",
                "avx512f",
                "avx512bw",
                "avx512cd",
                "avx512dq",
                "avx512vl",
                "avx512_vnni",
            },
            "avx512_vnni",
        ),
        ({"avx2", "fma", "avx_vnni", "avx512f"}, "avx_vnni"),  # AVX-512 without VNNI: the 256-bit VNNI path
        ({"avx2", "fma"}, "avx2"),
        ({"avx", "sse4_2"}, None),
    ],
)
def test_the_widest_instruction_set_the_processor_has_is_chosen(monkeypatch, flags, isa):
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    assert cpu_kernels.kernel_isa() == isa


def test_a_chosen_instruction_set_must_exist_and_be_there(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx2")
    assert cpu_kernels.kernel_isa() == "avx2"
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "avx512_vnni")
    with pytest.raises(ConfigError, match="lacks avx512f, .*avx512_vnni: choose a narrower set"):
        cpu_kernels.kernel_isa()
    monkeypatch.setenv(cpu_kernels.ISA_ENV, "neon")
    with pytest.raises(
        ConfigError, match="'neon' is not an instruction set .* use one of avx512_vnni, avx_vnni, avx2"
    ):
        cpu_kernels.kernel_isa()


@pytest.mark.skipif(
    bool(os.environ.get(cpu_kernels.ISA_ENV)), reason="this run is already one instruction set's"
)
@pytest.mark.parametrize("isa", ["avx_vnni", "avx2"])
def test_the_laptop_instruction_sets_pass_the_kernel_tests(isa):
    """The 256-bit paths (laptop processors without AVX-512), built and checked on a processor
    that also has them, in a process of their own: one process loads one build of the op."""
    if isa == cpu_kernels.kernel_isa() or cpu_kernels.missing_flags(isa):
        pytest.skip(f"{isa} is this run's own instruction set, or the processor lacks it")
    pytest_command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "-k",
        "emulation or lora or refuses or every_layer or decode_attention or attend",
        __file__,
    ]

    def run(*extra):
        return subprocess.run(
            [*pytest_command, *extra],
            cwd=Path(__file__).parent.parent,
            env={**os.environ, cpu_kernels.ISA_ENV: isa},
            capture_output=True,
            text=True,
            timeout=900,
        )

    selected = int(
        re.match(r"\d+", run("--collect-only").stdout.strip().splitlines()[-1]).group()
    )  # "N/M tests collected"
    result = run()
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and "skipped" not in summary, result.stdout[-4000:] + result.stderr[-2000:]
    assert selected > 100 and summary.startswith(f"{selected} passed"), (
        summary
    )  # every selected test ran on this build


def test_without_the_kernels_int4_and_int8_layers_use_torchs(monkeypatch):
    monkeypatch.delenv(cpu_kernels.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx", "sse4_2"})
    cpu_kernels.available.cache_clear()
    try:
        int4, int8 = (
            QuantLinear(64, 32, QuantScheme(bits=4, group_size=64)),
            QuantLinear(64, 32, QuantScheme(bits=8)),
        )
        assert isinstance(
            build_linear(int4, torch.bfloat16, torch.device("cpu"), int8_activations=True), Int4Linear
        )
        assert isinstance(
            build_linear(int8, torch.bfloat16, torch.device("cpu"), int8_activations=True), Int8Linear
        )
    finally:
        cpu_kernels.available.cache_clear()


def test_activations_the_kernel_cannot_read_keep_torchs_kernel():
    """fp16 activations on a CPU: the kernel reads fp32 or bf16 only, so the layer stays in tinygemm."""
    layer = QuantLinear(64, 32, QuantScheme(bits=4, group_size=64))
    assert isinstance(
        build_linear(layer, torch.float16, torch.device("cpu"), int8_activations=True), Int4Linear
    )


def test_cuda_tinygemm_bytes_are_the_stored_bytes_with_nibbles_swapped():
    """The CUDA int4 kernel reads code 2j in the high nibble of byte j; the swap of the stored
    bytes must equal packing the unpacked codes that way (checked on the CPU, where it runs the same)."""
    layer = QuantLinear(256, 24, QuantScheme(bits=4, group_size=64))
    layer.qweight.random_(0, 256)
    codes = unpack_codes(layer.qweight, 4)
    assert torch.equal(tinygemm_bytes(layer.qweight), (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8))
