import pytest
import torch

from slimlm.artifact import load_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.compress.sparsify import SparsifyParams
from slimlm.compress.sparsify import run as sparsify
from slimlm.inference.build import build_decoder
from slimlm.inference.load import load_decoder
from slimlm.pipeline import RunState
from tests.test_artifact import export


@pytest.mark.parametrize(
    "stages",
    [
        [("quantize", {"bits": 8, "targets": [r"model\.layers\.\d+\..*", "lm_head"]})],
        [("quantize", {"bits": 4, "group_size": 32})],
        [("sparsify", {"method": "magnitude", "pattern": "2:4"})],
        [
            ("sparsify", {"method": "magnitude"}),
            ("quantize", {"bits": 4, "group_size": 32, "symmetric": False}),
        ],
    ],
    ids=["w8-tied-head", "w4", "fp32-2:4-bitmask", "50%-w4-asym-bitmask"],
)
def test_layer_by_layer_loading_equals_building_from_the_loaded_model(
    context_model, tiny_tokenizer, tmp_path, stages
):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=context_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    for stage, params in stages:
        if stage == "quantize":
            quantize(state, QuantizeParams(**params))
        else:
            sparsify(state, SparsifyParams(**params))
    path = export(state, tmp_path / "artifact")
    direct, manifest = load_decoder(path, dtype=torch.float32)
    reference = build_decoder(load_artifact(path).model, dtype=torch.float32)
    tokens = torch.randint(0, context_model.config.vocab_size, (2, 12))
    for decoder in (direct, reference):
        decoder.setup_cache(2, 32)
    with torch.inference_mode():
        torch.testing.assert_close(direct(tokens, 0), reference(tokens, 0), rtol=0, atol=0)
    assert manifest["format"] == "slimlm"
    assert direct.weight_bytes() == reference.weight_bytes()


def test_generate_command_reads_an_artifact_layer_by_layer(context_model, tiny_tokenizer, tmp_path):
    import subprocess
    import sys

    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=context_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32))
    path = export(state, tmp_path / "artifact")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimlm.cli",
            "generate",
            str(path),
            "the story of",
            "--max-new-tokens",
            "6",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    direct, _ = load_decoder(path, dtype=torch.float32)
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.generate import prompt_ids
    from slimlm.inference.sampling import SamplingParams

    (expected,) = Decoder(direct, tiny_tokenizer).generate_ids(
        [prompt_ids(tiny_tokenizer, "the story of", chat_template=True)[0].tolist()],
        SamplingParams(max_new_tokens=6),
    )
    assert expected.text.strip() in result.stdout


def test_the_commands_decode_quantized_models_in_bf16_by_default(
    context_model, tiny_tokenizer, tiny_model_dir, tmp_path
):
    """torch's packed CPU kernels decode several times faster with bf16 activations than fp32: the
    commands' default for a quantized artifact; a float checkpoint keeps fp32, --dtype wins."""
    import argparse

    from slimlm.inference.cli import decoder_arguments, open_decoder

    parser = argparse.ArgumentParser()
    decoder_arguments(parser)
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=context_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32))
    artifact = export(state, tmp_path / "artifact")
    assert open_decoder(str(artifact), parser.parse_args([])).model.dtype == torch.bfloat16
    assert open_decoder(str(artifact), parser.parse_args(["--dtype", "float32"])).model.dtype == torch.float32
    assert open_decoder(str(tiny_model_dir), parser.parse_args([])).model.dtype == torch.float32
