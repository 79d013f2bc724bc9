"""Quantization-aware training (distill/qat.py, distill/reconstruct.py): the trained layers stay
on slimlm's integer grid, the straight-through estimator gives gradients, block-wise
reconstruction lowers each block's error, and a whole recipe exports what it trained."""

import json

import pytest
import torch

from slimlm.artifact import load_artifact
from slimlm.compress.gptq import HessianAccumulator, gptq_quantize
from slimlm.distill.qat import (
    LatentWeightLinear,
    ScaleTrainedLinear,
    freeze_quantized,
    replace_quantized,
    round_ste,
)
from slimlm.distill.reconstruct import ReconstructParams, reconstruct_blocks
from slimlm.errors import ConfigError, SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme
from tests.conftest import build_tiny_llama
from tests.test_cli import slimlm, tiny_run_args
from tests.test_decoder import quantized as quantize_with_stage

SCHEMES = [QuantScheme(bits=3, group_size=16), QuantScheme(bits=2, group_size=16, symmetric=False)]


def quantized_layer(scheme: QuantScheme, seed: int = 0) -> QuantLinear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(24, 64, generator=generator)
    x = torch.randn(256, 64, generator=generator)
    stats = HessianAccumulator(64)
    stats.add(x)
    q = gptq_quantize(weight, stats.hessian, scheme)
    return QuantLinear.from_codes(q.codes, q.scales, q.zeros, scheme, torch.randn(24, generator=generator))


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
@pytest.mark.parametrize("kind", [LatentWeightLinear, ScaleTrainedLinear])
def test_a_trainable_layer_starts_as_its_quantized_layer_and_freezes_back_exactly(scheme, kind):
    layer = quantized_layer(scheme)
    x = torch.randn(5, 64)
    trainable = kind(layer)
    assert torch.equal(trainable(x), layer(x))
    frozen = trainable.to_quant_linear()
    assert torch.equal(frozen.qweight, layer.qweight) and torch.equal(frozen.scales, layer.scales)
    assert (frozen.zeros is None) == scheme.symmetric and (
        scheme.symmetric or torch.equal(frozen.zeros, layer.zeros)
    )


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_after_training_the_frozen_layer_computes_what_the_trained_one_did(scheme):
    """Codes and fp16 scales are what the forward pass used: the exported layer is the trained one."""
    trainable = LatentWeightLinear(quantized_layer(scheme))
    with torch.no_grad():
        trainable.weight.add_(0.3 * torch.randn_like(trainable.weight))  # moves codes, some off the grid
        trainable.scales.mul_(1 + 0.01 * torch.randn_like(trainable.scales))  # not fp16 values any more
    x = torch.randn(7, 64)
    frozen = trainable.to_quant_linear()
    assert torch.equal(frozen(x), trainable(x))
    assert int(frozen.codes().max()) <= scheme.max_code


def test_the_straight_through_estimator_reaches_weights_and_scales():
    trainable = LatentWeightLinear(quantized_layer(SCHEMES[0]))
    trainable(torch.randn(9, 64)).square().sum().backward()
    assert trainable.weight.grad.abs().sum() > 0 and trainable.scales.grad.abs().sum() > 0
    x = torch.tensor([0.4, 1.6], requires_grad=True)
    round_ste(x).sum().backward()
    assert torch.equal(round_ste(x.detach()), torch.tensor([0.0, 2.0])) and torch.equal(x.grad, torch.ones(2))


def test_scale_training_keeps_the_codes():
    layer = quantized_layer(SCHEMES[0])
    trainable = ScaleTrainedLinear(layer)
    with torch.no_grad():
        trainable.scales.mul_(1.5)
    assert torch.equal(trainable.to_quant_linear().qweight, layer.qweight)
    trainable(torch.randn(3, 64)).sum().backward()
    assert trainable.scales.grad is not None and not any(b.requires_grad for b in trainable.buffers())


def test_a_layer_with_an_adapter_is_refused():
    layer = quantized_layer(SCHEMES[0])
    layer.add_adapter(torch.zeros(2, 64), torch.zeros(24, 2))
    with pytest.raises(SlimlmError, match="LoRA adapter"):
        LatentWeightLinear(layer)


def test_block_reconstruction_lowers_every_blocks_error_and_stays_quantized(tiny_tokenizer, tmp_path):
    teacher = build_tiny_llama(len(tiny_tokenizer), seed=3).eval()
    student = build_tiny_llama(len(tiny_tokenizer), seed=3).eval()
    quantize_with_stage(
        student, tiny_tokenizer, tmp_path, bits=2, group_size=16
    )  # RTN of every decoder layer
    samples = torch.randint(0, len(tiny_tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = (student(samples).logits - teacher(samples).logits).square().mean()
    results = reconstruct_blocks(
        student, teacher, samples, ReconstructParams(samples=8, lr=3e-3, weight_lr=1e-3)
    )
    assert len(results) == len(student.model.layers)
    assert all(result.mse_after < result.mse_before for result in results)
    with torch.no_grad():
        after = (student(samples).logits - teacher(samples).logits).square().mean()
    assert after < before
    quantized = [m for m in student.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 7 * len(student.model.layers) and all(m.scheme.bits == 2 for m in quantized)
    assert all(p.requires_grad for p in student.parameters())  # as it was before training


def test_replace_and_freeze_round_trip_a_whole_model(tiny_tokenizer, tmp_path):
    model = build_tiny_llama(len(tiny_tokenizer)).eval()
    quantize_with_stage(model, tiny_tokenizer, tmp_path, bits=3, group_size=16)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
        names = replace_quantized(model, ScaleTrainedLinear)
        assert names and torch.equal(model(ids).logits, expected)
        freeze_quantized(model)
        assert torch.equal(model(ids).logits, expected)


def test_reconstruct_settings_that_would_train_nothing_are_refused():
    with pytest.raises(ConfigError, match="epochs"):
        ReconstructParams(epochs=0)
    with pytest.raises(ConfigError, match="lr"):
        ReconstructParams(lr=0.0)


def test_w2_recipe_reconstructs_then_trains_scales_and_exports_what_it_trained(tiny_model_dir, tmp_path):
    """GPTQ, block-wise reconstruction, end-to-end scale training, export: each block's error
    and the distillation loss fall, and the exported artifact scores exactly as the trained
    model did. (A random-weight model's near-uniform outputs make its KL too small to rank the
    steps; bench/ measures that on the real model.)"""
    stages = (
        "{stage:evaluate,label:fp32},"
        "{stage:quantize,method:gptq,bits:2,group_size:16,samples:8,seq_len:32},"
        "{stage:evaluate,label:gptq},"
        "{stage:reconstruct,samples:8,seq_len:32,epochs:2,lr:0.003,weight_lr:0.001},"
        "{stage:evaluate,label:reconstructed},"
        "{stage:distill,quant_scales:true,tokens:1024,seq_len:32,batch_size:4,top_k:8,lr:0.003,eval_every:100},"
        "{stage:evaluate,label:qat},{stage:export}"
    )
    slimlm(*tiny_run_args(tiny_model_dir), f"recipe.stages=[{stages}]", "hydra.run.dir=qat", cwd=tmp_path)
    report = json.loads((tmp_path / "qat" / "report.json").read_text())
    blocks = report["reconstruction"][0]["blocks"]
    assert len(blocks) == 2 and all(block["mse_after"] < block["mse_before"] for block in blocks)
    losses = [step["loss"] for step in report["distillation"][0]["history"]]
    assert sum(losses[-3:]) < sum(losses[:3])
    slimlm(
        *tiny_run_args(tiny_model_dir)[2:],
        "model=custom",
        f"model.path={tmp_path / 'qat' / 'artifact'}",
        "recipe=evaluate",
        "hydra.run.dir=reload",
        cwd=tmp_path,
    )
    reloaded = json.loads((tmp_path / "reload" / "report.json").read_text())["rows"][0]
    trained = next(row for row in report["rows"] if row["name"] == "qat")
    assert reloaded["ppl"] == pytest.approx(trained["ppl"], rel=1e-5)
    layers = load_artifact(tmp_path / "qat" / "artifact").model.model.layers
    assert all(m.scheme.bits == 2 for m in layers.modules() if isinstance(m, QuantLinear))
