"""Calibration of a checkpoint one block at a time (compress/offload.py) against the in-memory path."""

import pytest
import torch

from slimlm.compress.offload import quantize_checkpoint
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantLinear
from tests.conftest import build_tiny_llama
from tests.tiny_families import build_tiny

SAMPLES = torch.randint(0, 384, (4, 32), generator=torch.Generator().manual_seed(0))


def in_memory(model, params):
    state = RunState(
        cfg=None,
        run_dir=None,
        model=model,
        tokenizer=None,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    state.memo.calibration_ids = SAMPLES.flatten()
    quantize(state, params)
    return model


def offloaded(directory, params, dtype=None):
    blocks = {}

    def keep(name, block):
        blocks[name] = {key: value.clone() for key, value in block.state_dict().items()}

    result = quantize_checkpoint(directory, params, SAMPLES, keep, dtype=dtype)
    return result, blocks


def test_offloaded_gptq_and_awq_equal_the_in_memory_path(tmp_path):
    for method in ("gptq", "awq"):
        params = QuantizeParams(
            method=method, bits=4, group_size=16, samples=4, seq_len=32, awq_grid=4, awq_clip_grid=4
        )
        build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False).save_pretrained(
            tmp_path / method
        )
        result, blocks = offloaded(tmp_path / method, params)
        reference = in_memory(build_tiny_llama(384, num_hidden_layers=3, tie_word_embeddings=False), params)
        assert sorted(blocks) == [f"model.layers.{i}" for i in range(3)] and result.quantized_layers == 21
        for name, tensors in blocks.items():
            for key, value in tensors.items():
                assert torch.equal(value, reference.state_dict()[f"{name}.{key}"]), (method, name, key)
        assert set(result.block_seconds) == set(blocks) and result.peak_memory_bytes > 0


@pytest.mark.parametrize(
    "model_type", ["qwen3_moe", "mixtral"]
)  # Mixtral's checkpoints name its MoE block block_sparse_moe, its module mlp
def test_a_moe_checkpoint_calibrates_block_by_block_in_bf16(tmp_path, model_type):
    model = build_tiny(model_type, 384, split=False)  # a checkpoint as transformers writes it
    model.save_pretrained(tmp_path)
    seen = []

    def check_then_release(name, block):
        seen.append(name)
        assert all(
            isinstance(layer, QuantLinear) for layer in (block.self_attn.q_proj, block.self_attn.o_proj)
        )

    params = QuantizeParams(
        method="gptq",
        bits=8,
        group_size=16,
        samples=4,
        seq_len=32,
        targets=[r"model\.layers\.\d+\.self_attn\..*"],
    )
    result = quantize_checkpoint(tmp_path, params, SAMPLES, check_then_release, dtype=torch.bfloat16)
    assert seen == ["model.layers.0", "model.layers.1"] and result.quantized_layers == 8


def test_calibration_stops_after_the_last_block_with_targets(tmp_path):
    build_tiny_llama(384, num_hidden_layers=4).save_pretrained(tmp_path)
    seen = []
    params = QuantizeParams(
        method="gptq", bits=4, group_size=16, samples=4, seq_len=32, targets=[r"model\.layers\.[01]\..*"]
    )
    result = quantize_checkpoint(tmp_path, params, SAMPLES, lambda name, block: seen.append(name))
    assert (
        seen == ["model.layers.0", "model.layers.1"] and result.quantized_layers == 14
    )  # blocks 2 and 3 never load
