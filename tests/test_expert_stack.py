"""A mixture of experts' routed experts in one kernel call (inference/expert_stack.py) compute
what the experts run one by one compute, for decode steps and prefills."""

import functools

import pytest
import torch

from slimlm.experts import dispatch
from slimlm.inference import cpu_kernels
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.expert_stack import ExpertStack
from slimlm.inference.model import MoE
from tests.test_decoder import prompt_ids, quantized
from tests.tiny_families import DENSE_FIRST_LAYER, MOE_TYPES, build_tiny

needs_kernel = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="the processor lacks AVX2 and FMA (or no compiler): no int8-activation kernels",
)
# Widths the int8-activation kernel takes: experts of 64 inputs and outputs.
WIDE_EXPERTS = {
    "mixtral": dict(intermediate_size=64),
    "olmoe": dict(intermediate_size=64),
    "qwen3_moe": dict(moe_intermediate_size=64, **DENSE_FIRST_LAYER),
}


def moe_layers(decoder):
    return [block.feed_forward for block in decoder.layers if isinstance(block.feed_forward, MoE)]


@needs_kernel
@pytest.mark.parametrize(
    "bits,group,symmetric",
    [(4, 32, True), (4, 64, False), (8, None, True)],
    ids=["int4-g32", "int4-g64-asymmetric", "int8"],
)
@pytest.mark.parametrize("family", MOE_TYPES)
def test_stacked_experts_compute_what_the_experts_compute_one_by_one(
    family, bits, group, symmetric, tiny_tokenizer, tmp_path
):
    """Every MoE layer's stacked call against its experts run one by one, on the inputs the
    layer meets in a prefill of 21 tokens (experts with several tokens, some with none) and in
    decode steps of one token. fp32 activations: both compute the same integer dots on the same
    rounded inputs, only the order of the float sums differs (compared layer by layer: over a
    whole model such a difference can flip a near-tied routing choice)."""
    model = build_tiny(family, len(tiny_tokenizer), initializer_range=0.2, **WIDE_EXPERTS[family])
    model = quantized(
        model,
        tiny_tokenizer,
        tmp_path,
        bits=bits,
        group_size=group,
        symmetric=symmetric,
        targets=[r"model\.layers\.\d+\..*"],
    )
    decoder = build_decoder(model, dtype=torch.float32, int8_activations=True)
    assert all(
        isinstance(moe.compute, ExpertStack) and (moe.compute.down.offsets is None) == symmetric
        for moe in moe_layers(decoder)
    ) and moe_layers(decoder)
    assert set(describe_kernels(decoder)) >= {f"int{bits}-int8act"}
    calls = []

    def checked(moe, flat, chosen, weights):
        stacked = moe_stack[moe](flat, chosen, weights)
        torch.testing.assert_close(
            stacked, dispatch(moe.experts, flat, chosen, weights), rtol=1e-5, atol=1e-5
        )
        calls.append(flat.shape[0])
        return stacked

    moe_stack = {moe: moe.compute for moe in moe_layers(decoder)}
    for moe in moe_layers(decoder):
        moe.compute = functools.partial(checked, moe)
    ids = torch.tensor([prompt_ids(24, model.config.vocab_size)])
    decoder.setup_cache(1, 32)
    with torch.no_grad():
        decoder(ids[:, :21], 0)
        for position in range(21, 24):
            decoder(ids[:, position : position + 1], position)
    assert calls == [21] * len(moe_stack) + [1] * 3 * len(moe_stack)


@needs_kernel
def test_the_stack_shares_the_experts_memory_and_skips_dropped_routes(tiny_tokenizer, tmp_path):
    model = quantized(
        build_tiny("olmoe", len(tiny_tokenizer), **WIDE_EXPERTS["olmoe"]),
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=64,
        targets=[r"model\.layers\.\d+\..*"],
    )
    moe = moe_layers(build_decoder(model, dtype=torch.float32, int8_activations=True))[0]
    stack = moe.compute
    for index, expert in enumerate(moe.experts):
        assert expert.gate_up.weight.data_ptr() == stack.gate_up.packed[index].data_ptr()
        assert expert.down.scales.data_ptr() == stack.down.scales[index].data_ptr()
    x = torch.randn(3, model.config.hidden_size)
    experts = len(moe.experts)
    chosen = torch.tensor([[1, experts], [experts, experts], [2, 1]])  # index E: a route transformers dropped
    weights = torch.rand(3, 2)
    torch.testing.assert_close(
        stack(x, chosen, weights), dispatch(moe.experts, x, chosen, weights), rtol=1e-4, atol=1e-4
    )
    up, down = stack.gate_up, stack.down
    for dtype in (
        torch.float32,
        torch.bfloat16,
    ):  # the op's fake version agrees with it (torch.compile traces that)
        arguments = (
            x.to(dtype),
            chosen,
            weights,
            up.packed,
            up.scales,
            up.offsets,
            up.group,
            down.packed,
            down.scales,
            down.offsets,
            down.group,
            "silu",
        )
        torch.library.opcheck(cpu_kernels.ops().routed_experts, arguments)
    with pytest.raises(RuntimeError, match="expert index -1"):
        stack(x, torch.tensor([[1, -1]] * 3), weights)


@needs_kernel
def test_experts_outside_the_kernel_run_one_by_one(tiny_tokenizer, tmp_path):
    """Experts of 32 inputs (the kernel takes multiples of 64) keep torch's kernels: no stack."""
    model = quantized(
        build_tiny("olmoe", len(tiny_tokenizer)),
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
        targets=[r"model\.layers\.\d+\..*"],
    )
    moe = moe_layers(build_decoder(model, dtype=torch.float32, int8_activations=True))[0]
    assert isinstance(moe.compute, functools.partial)
