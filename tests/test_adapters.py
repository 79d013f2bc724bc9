"""LoRA adapters trained beside quantized codes: from peft, through the artifact, into the decoder
and the exports, computing the same function at every step."""

import pytest
import torch

from slimlm.artifact import load_artifact, planner_inputs, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.distill.stage import DistillParams, check_lora_targets, finish_lora, with_lora
from slimlm.errors import ConfigError, SlimlmError
from slimlm.inference import cpu_kernels
from slimlm.inference.build import build_decoder, describe_kernels
from slimlm.inference.linear import build_linear, fuse
from slimlm.inference.load import load_decoder
from slimlm.inference.model import ModelArgs
from slimlm.inference.planner import HARDWARE, adapter_bytes, budget
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantLinear, QuantScheme


def adapted(model, tokenizer, tmp_path, rank=2, **quantize_params):
    """The tiny model quantized, given peft adapters with random (not zero) up-projections, and
    finished as distillation finishes it; also the logits peft computed before finishing."""
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(**({"bits": 4, "group_size": 32} | quantize_params)))
    peft_model = with_lora(state.model, DistillParams(lora_rank=rank, lora_alpha=4.0))
    torch.manual_seed(1)
    for name, parameter in peft_model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        expected = peft_model(ids).logits
    state.model = finish_lora(peft_model).eval()
    return state, ids, expected


ADAPTER_BUFFERS = {
    "lora_down",
    "lora_up",
    "lora_tiles",
    "down",
    "up",
}  # inside the int8-activation kernels' call; beside the others (LowRankAdapter)


def test_finishing_hands_the_adapters_to_the_quantized_layers(tiny_model, tiny_tokenizer, tmp_path):
    state, ids, expected = adapted(tiny_model, tiny_tokenizer, tmp_path)
    assert not any(type(m).__module__.startswith("peft.") for m in state.model.modules())
    layers = [m for m in state.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 7 * 2 and all(layer.adapter_rank == 2 for layer in layers)
    with torch.no_grad():
        torch.testing.assert_close(state.model(ids).logits, expected)


def test_the_artifact_keeps_the_adapters_and_the_decoder_runs_them(tiny_model, tiny_tokenizer, tmp_path):
    """Every decoder path: dequantized reference, torch's int4 kernel with the adapter beside it,
    and (groups of 64) slimlm's int8-activation kernel with the adapter inside its call."""
    state, ids, expected = adapted(tiny_model, tiny_tokenizer, tmp_path, group_size=64)
    path = save_artifact(
        state.model, tiny_tokenizer, tmp_path / "artifact", state.schemes, source={"id": "tiny"}
    )
    loaded = load_artifact(path)
    assert loaded.manifest["modules"]["model.layers.0.mlp.down_proj"]["adapter_rank"] == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, expected)
    pad = torch.zeros(2, dtype=torch.long)
    variants = [{"kernels": False}, {"kernels": True}] + (
        [{"kernels": True, "int8_activations": True}] if cpu_kernels.available() else []
    )
    for options in variants:
        decoder, manifest = load_decoder(path, dtype=torch.float32, **options)
        assert all(
            kind.endswith("+lora") for kind in describe_kernels(decoder) if not kind.startswith("head")
        )
        decoder.setup_cache(2, 32)
        with torch.no_grad():
            logits = decoder(ids, 0, pad)
        tolerance = 0.05 if options.get("int8_activations") else 1e-4  # activations rounded to int8
        torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    for int8_activations in (False, True) if cpu_kernels.available() else (False,):
        decoder, manifest = load_decoder(
            path, dtype=torch.bfloat16, int8_activations=int8_activations
        )  # the planner's activation dtype
        schemes, ranks = planner_inputs(manifest)
        args = ModelArgs.from_hf_config(tiny_model.config)
        planned = budget(
            args,
            schemes,
            HARDWARE["cpu"],
            context=32,
            batch=2,
            int8_activations=int8_activations,
            adapter_ranks=ranks,
        )
        assert planned.weight_bytes == pytest.approx(decoder.weight_bytes(), rel=0.02)
        adapters = sum(
            buffer.nbytes
            for name, buffer in decoder.named_buffers()
            if name.rpartition(".")[2] in ADAPTER_BUFFERS
        )
        assert (
            adapters
            and planned.weight_bytes
            - budget(
                args, schemes, HARDWARE["cpu"], context=32, batch=2, int8_activations=int8_activations
            ).weight_bytes
            == adapters
        )


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize(
    "outs, ranks, bits",
    [
        ((128, 32, 32), (4, 0, 2), (4, 4, 4)),
        ((128, 32, 32), (4, 8, 2), (4, 4, 4)),
        ((128, 24, 24), (4, 3, 2), (4, 4, 4)),
        ((128, 32, 32), (4, 0, 2), (4, 8, 8)),
    ],
    ids=["a-part-without", "every-part", "parts-straddle-tiles", "mixed-schemes"],
)
def test_planned_adapter_bytes_are_what_a_fused_layer_holds(outs, ranks, bits, int8_activations):
    """Exactly, also where a tile of 16 rows straddles two parts and keeps both parts' columns."""
    if int8_activations and not cpu_kernels.available():
        pytest.skip("the int8-activation layout needs slimlm's CPU kernels")
    torch.manual_seed(0)
    schemes = [QuantScheme(bits=b, group_size=64 if b == 4 else None, symmetric=b == 8) for b in bits]
    layers = [QuantLinear(128, out, scheme) for out, scheme in zip(outs, schemes)]
    for layer, out, rank in zip(layers, outs, ranks):
        if rank:
            layer.add_adapter(torch.randn(rank, 128), torch.randn(out, rank))
    built = build_linear(fuse(layers), torch.bfloat16, torch.device("cpu"), int8_activations=int8_activations)
    held = sum(
        buffer.nbytes for name, buffer in built.named_buffers() if name.rpartition(".")[2] in ADAPTER_BUFFERS
    )
    assert (
        adapter_bytes([(out, 128) for out in outs], schemes, list(ranks), 4, int8_activations) == held > 0
    )  # beside a kernel on a CPU: fp32 factors


def test_fused_layers_fuse_their_adapters_even_when_one_has_none():
    torch.manual_seed(0)
    scheme = QuantScheme(bits=4, group_size=32)
    layers = []
    for out_features, rank in ((64, 3), (32, 0), (32, 2)):
        layer = QuantLinear(64, out_features, scheme)
        layer.qweight.random_(0, 256)
        if rank:
            layer.add_adapter(torch.randn(rank, 64), torch.randn(out_features, rank))
        layers.append(layer)
    layers[0].add_adapter(torch.randn(1, 64), torch.randn(64, 1))  # a second LoRA run stacks on the first
    assert layers[0].adapter_rank == 4
    x = torch.randn(5, 64)
    fused = fuse(layers)
    assert fused.adapter_rank == 6
    torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_hf_export_merges_the_adapters(tiny_model, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from slimlm.hf_export import export_hf

    state, ids, expected = adapted(tiny_model, tiny_tokenizer, tmp_path)
    export_hf(state.model, tiny_tokenizer, tmp_path / "hf", "float32")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_packed_exports_without_a_place_for_adapters_refuse_them(tiny_model, tiny_tokenizer, tmp_path):
    from slimlm.ct_export import export_compressed
    from slimlm.gguf_export import export_gguf

    state, *_ = adapted(tiny_model, tiny_tokenizer, tmp_path, group_size=32)
    with pytest.raises(SlimlmError, match="no place for the LoRA adapters.*requantize=true"):
        export_gguf(state.model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    with pytest.raises(SlimlmError, match="no place for the LoRA adapters.*format=slimlm"):
        export_compressed(state.model, tiny_tokenizer, tmp_path / "ct", "float16")
    assert not (tmp_path / "model.gguf").exists() and not (tmp_path / "ct").exists()
    summary = export_gguf(state.model, tiny_tokenizer, tmp_path / "merged.gguf", "Q8_0", requantize=True)
    assert (tmp_path / "merged.gguf").is_file() and summary


def test_an_adapter_on_a_tied_quantized_head_is_refused_before_training(tiny_model, tiny_tokenizer, tmp_path):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=tiny_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"]))
    check_lora_targets(state.model, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="tied to the embedding"):
        check_lora_targets(state.model, ["q_proj", "lm_head"])


def test_decoder_built_in_process_matches_the_adapted_model(tiny_model, tiny_tokenizer, tmp_path):
    state, ids, expected = adapted(tiny_model, tiny_tokenizer, tmp_path, rank=4, bits=8, group_size=None)
    decoder = build_decoder(state.model)
    assert describe_kernels(decoder)["int8-pack+lora"] == 4 * 2
    decoder.setup_cache(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            decoder(ids, 0, torch.zeros(2, dtype=torch.long)), expected, rtol=1e-4, atol=1e-4
        )
