"""Quantization-aware training (distill/qat.py, distill/reconstruct.py): the trained layers stay
on slimlm's integer grid with their codes, their scales get the exact gradient, block-wise
reconstruction lowers each block's error (a pruned student's too, against the spans of layers
its blocks replace), and a whole recipe exports what it trained."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimlm.artifact import load_artifact
from slimlm.compress.gptq import HessianAccumulator, gptq_quantize
from slimlm.compress.prune import PruneParams, prune_model
from slimlm.distill.qat import RoundingTrainedLinear, ScaleTrainedLinear, freeze_quantized, replace_quantized
from slimlm.distill.reconstruct import (
    ReconstructParams,
    checkpoint_original,
    kept_original_layers,
    reconstruct_blocks,
)
from slimlm.errors import ConfigError, SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme
from tests.conftest import build_tiny_llama
from tests.test_cli import slimlm, tiny_run_args
from tests.test_decoder import quantized as quantize_with_stage

SCHEMES = [QuantScheme(bits=3, group_size=16), QuantScheme(bits=2, group_size=16, symmetric=False)]


def original_and_quantized(scheme: QuantScheme, seed: int = 0) -> tuple[torch.Tensor, QuantLinear]:
    """A random weight [24, 64] and its GPTQ layer."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(24, 64, generator=generator)
    x = torch.randn(256, 64, generator=generator)
    stats = HessianAccumulator(64)
    stats.add(x)
    q = gptq_quantize(weight, stats.hessian, scheme)
    bias = torch.randn(24, generator=generator)
    return weight, QuantLinear.from_codes(q.codes, q.scales, q.zeros, scheme, bias)


def quantized_layer(scheme: QuantScheme, seed: int = 0) -> QuantLinear:
    return original_and_quantized(scheme, seed)[1]


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_a_trainable_layer_starts_as_its_quantized_layer_and_freezes_back_exactly(scheme):
    layer = quantized_layer(scheme)
    x = torch.randn(5, 64)
    trainable = ScaleTrainedLinear(layer)
    assert torch.equal(trainable(x), layer(x))
    frozen = trainable.to_quant_linear()
    assert torch.equal(frozen.qweight, layer.qweight) and torch.equal(frozen.scales, layer.scales)
    assert (frozen.zeros is None) == scheme.symmetric and (
        scheme.symmetric or torch.equal(frozen.zeros, layer.zeros)
    )


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_after_training_the_frozen_layer_computes_what_the_trained_one_did(scheme):
    """Codes and fp16 scales are what the forward pass used: the exported layer is the trained one."""
    layer = quantized_layer(scheme)
    trainable = ScaleTrainedLinear(layer)
    with torch.no_grad():
        trainable.log_scales.add_(0.01 * torch.randn_like(trainable.log_scales))  # no fp16 values any more
    x = torch.randn(7, 64)
    frozen = trainable.to_quant_linear()
    assert torch.equal(frozen(x), trainable(x))
    assert torch.equal(frozen.qweight, layer.qweight) and not torch.equal(frozen.scales, layer.scales)


def test_the_scales_gradient_is_exact_and_nothing_else_trains():
    """With the codes fixed the layer is linear in each scale: the gradient of a group's
    log-scale is its share of the output's derivative, checked against a finite difference."""
    trainable = ScaleTrainedLinear(quantized_layer(SCHEMES[0]))
    x = torch.randn(9, 64, dtype=torch.float64)

    def loss(log_scales):
        scales = (trainable.initial_scales.double() * log_scales.exp()).unsqueeze(-1)
        weight = ((trainable.codes.double() - trainable.offsets.double().unsqueeze(-1)) * scales).view(24, 64)
        return (x @ weight.T).square().sum()

    point = torch.zeros_like(trainable.log_scales, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(loss, (point,))
    trainable(x.float()).square().sum().backward()
    assert trainable.log_scales.grad.abs().sum() > 0
    assert [name for name, _ in trainable.named_parameters()] == [
        "log_scales",
        "bias",
    ]  # the bias: the caller's
    assert not any(b.requires_grad for b in trainable.buffers())


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_rounding_latents_start_at_the_quantized_codes(scheme):
    weight, layer = original_and_quantized(scheme)
    trainable = RoundingTrainedLinear(layer, weight)
    x = torch.randn(5, 64)
    assert torch.equal(trainable(x), layer(x))
    assert torch.equal(trainable.latents.detach(), trainable.codes)
    assert [name for name, _ in trainable.named_parameters()] == ["log_scales", "bias", "latents"]


def test_trained_rounding_flips_codes_and_freezes_to_what_it_computes():
    """A gradient that pushes latents over their cell's edge changes those codes (straight
    through the rounding); the frozen layer has the new codes; pruned weights keep theirs."""
    weight, layer = original_and_quantized(SCHEMES[0])
    weight[0, :8] = 0.0  # pruned
    trainable = RoundingTrainedLinear(layer, weight)
    optimizer = torch.optim.SGD([trainable.latents], lr=0.5)
    x = torch.randn(32, 64)
    for _ in range(3):
        trainable(x).sum().backward()  # every latent's gradient: the sum of its input column
        optimizer.step()
        optimizer.zero_grad()
    codes = trainable.grid_codes().view(24, 64)
    start = layer.codes().float()
    assert (codes != start).float().mean() > 0.1
    assert torch.equal(codes[0, :8], start[0, :8])
    frozen = trainable.to_quant_linear()
    assert torch.equal(frozen(x), trainable(x))
    assert torch.equal(frozen.codes().float(), codes)


def test_rounding_from_a_weight_of_another_shape_is_refused():
    weight, layer = original_and_quantized(SCHEMES[0])
    with pytest.raises(SlimlmError, match="not the model it was quantized from"):
        RoundingTrainedLinear(layer, weight.T)


def test_a_layer_with_an_adapter_is_refused():
    layer = quantized_layer(SCHEMES[0])
    layer.add_adapter(torch.zeros(2, 64), torch.zeros(24, 2))
    with pytest.raises(SlimlmError, match="LoRA adapter"):
        ScaleTrainedLinear(layer)


@pytest.mark.parametrize(
    "codes", [{}, {"codes_lr": 0.05, "batch_size": 1, "epochs": 4}], ids=["scales", "scales-and-codes"]
)
def test_block_reconstruction_lowers_every_blocks_error_and_stays_quantized(codes, tiny_tokenizer, tmp_path):
    teacher = build_tiny_llama(len(tiny_tokenizer), seed=3).eval()
    student = build_tiny_llama(len(tiny_tokenizer), seed=3).eval()
    quantize_with_stage(
        student, tiny_tokenizer, tmp_path, bits=2, group_size=16
    )  # RTN of every decoder layer
    samples = torch.randint(0, len(tiny_tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = (student(samples).logits - teacher(samples).logits).square().mean()
    results = reconstruct_blocks(student, teacher, samples, ReconstructParams(samples=8, lr=1e-2, **codes))
    assert len(results) == len(student.model.layers)
    assert all(result.mse_after < result.mse_before and result.kept for result in results)
    assert (sum(result.codes_changed for result in results) > 0) == bool(codes)
    with torch.no_grad():
        after = (student(samples).logits - teacher(samples).logits).square().mean()
    assert after < before
    quantized = [m for m in student.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 7 * len(student.model.layers) and all(m.scheme.bits == 2 for m in quantized)
    assert all(p.requires_grad for p in student.parameters())  # as it was before training


def test_the_original_read_block_by_block_from_its_checkpoint_trains_exactly_as_loaded(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    """The original model's blocks read from its checkpoint one at a time (the rest never
    leaves the meta device) give the same targets, so the same trained student, as the whole
    original in memory."""
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    students = []
    for _ in range(2):
        student = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
        quantize_with_stage(student, tiny_tokenizer, tmp_path, bits=3, group_size=16)
        students.append(student)
    samples = torch.randint(0, len(tiny_tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
    params = ReconstructParams(samples=8, lr=1e-2, codes_lr=0.05)
    expected = reconstruct_blocks(students[0], loaded, samples, params)
    skeleton, blocks = checkpoint_original(tiny_model_dir, torch.float32, torch.device("cpu"))
    assert all(p.is_meta for p in skeleton.model.layers.parameters())
    reads, read = [], blocks.load
    blocks.load = lambda name, block: (reads.append(name), read(name, block))
    got = reconstruct_blocks(students[1], skeleton, samples, params, blocks)
    assert reads == [f"model.layers.{i}" for i in range(len(skeleton.model.layers))]  # each read once
    assert [(r.mse_before, r.mse_after, r.codes_changed) for r in got] == [
        (r.mse_before, r.mse_after, r.codes_changed) for r in expected
    ]
    assert all(p.is_meta for p in skeleton.model.layers.parameters())  # each block released


def test_a_pruned_students_blocks_learn_the_spans_of_layers_they_replace(tiny_tokenizer):
    """After depth and MLP pruning, each student block is trained (weights and norms) to give
    the teacher's hidden state after the span of teacher layers it now stands for."""
    teacher = build_tiny_llama(len(tiny_tokenizer), seed=3, num_hidden_layers=5).eval()
    samples = torch.randint(0, len(tiny_tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
    student, section = prune_model(teacher, samples, PruneParams(layers=3, intermediate_size=96))
    kept = kept_original_layers([section], 5)
    assert kept == [i for i in range(5) if i not in section["removed_layers"]]
    with torch.no_grad():
        before = (student(samples).logits - teacher(samples).logits).square().mean()
    params = ReconstructParams(samples=8, epochs=4, batch_size=2, weights_lr=1e-3, norm_lr=1e-3)
    results = reconstruct_blocks(student, teacher, samples, params, kept=kept)
    spans = [[int(x) for x in r.original_layers.split("-")] for r in results]
    assert spans[0][0] == 0 and spans[-1][-1] == 4 and [s[0] for s in spans[1:]] == kept[1:]
    assert all(r.kept and r.mse_after < r.mse_before and r.codes_changed == 0 for r in results)
    with torch.no_grad():
        after = (student(samples).logits - teacher(samples).logits).square().mean()
    assert after < before
    assert all(p.requires_grad for p in student.parameters())  # as it was before training


def test_reconstruct_refuses_a_student_that_does_not_map_onto_its_original(tiny_tokenizer):
    teacher = build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=3).eval()
    student = build_tiny_llama(len(tiny_tokenizer), num_hidden_layers=2).eval()
    samples = torch.randint(0, len(tiny_tokenizer), (2, 16))
    with pytest.raises(SlimlmError, match="do not map onto the original's 3 layers"):
        reconstruct_blocks(student, teacher, samples, ReconstructParams(samples=2, weights_lr=1e-3))
    narrowed = {"shape_before": {"hidden_size": 64}, "shape_after": {"hidden_size": 48}}
    with pytest.raises(SlimlmError, match="narrowed them \\(64 -> 48\\)"):
        kept_original_layers([narrowed], 3)
    twice = [
        {"shape_before": {"hidden_size": 64}, "shape_after": {"hidden_size": 64}, "removed_layers": [1]},
        {"shape_before": {"hidden_size": 64}, "shape_after": {"hidden_size": 64}, "removed_layers": [0, 2]},
    ]
    assert kept_original_layers(twice, 5) == [2, 4]  # the second prune's indices are the first's student's


def test_replace_and_freeze_round_trip_a_whole_model(tiny_tokenizer, tmp_path):
    model = build_tiny_llama(len(tiny_tokenizer)).eval()
    quantize_with_stage(model, tiny_tokenizer, tmp_path, bits=3, group_size=16)
    ids = torch.randint(0, len(tiny_tokenizer), (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
        trainable = replace_quantized(model)
        assert trainable and torch.equal(model(ids).logits, expected)
        freeze_quantized(model)
        assert torch.equal(model(ids).logits, expected)


def test_reconstruct_settings_that_would_train_nothing_are_refused():
    with pytest.raises(ConfigError, match="epochs"):
        ReconstructParams(epochs=0)
    with pytest.raises(ConfigError, match="lr"):
        ReconstructParams(lr=0.0)
    with pytest.raises(ConfigError, match="codes_lr"):
        ReconstructParams(codes_lr=-1.0)
    with pytest.raises(ConfigError, match="weights_lr"):
        ReconstructParams(weights_lr=-1.0)


# The w3-qat recipe shrunk to the tiny model: GPTQ, reconstruct and distill on a few short windows.
TINY_QAT = [
    "recipe.stages.1.group_size=16",
    "+recipe.stages.1.samples=8",
    "+recipe.stages.1.seq_len=32",
    "recipe.stages.3.samples=8",
    "recipe.stages.3.seq_len=32",
    "recipe.stages.3.lr=0.01",
    "recipe.stages.5.tokens=1024",
    "recipe.stages.5.seq_len=32",
    "recipe.stages.5.batch_size=4",
    "recipe.stages.5.top_k=8",
    "recipe.stages.5.lr=0.003",
    "+recipe.stages.5.eval_every=100",
]


def test_qat_recipe_reconstructs_then_trains_scales_and_exports_what_it_trained(tiny_model_dir, tmp_path):
    """The bundled w3-qat recipe, shrunk: GPTQ, block-wise reconstruction, end-to-end scale
    training, export. Each block's error and the distillation loss fall, and the exported
    artifact has GPTQ's bytes and scores exactly as the trained model did. (A random-weight model's
    near-uniform outputs make its KL too small to rank the steps; bench/ measures that on the
    real model.)"""
    slimlm("recipe=w3-qat", *tiny_run_args(tiny_model_dir), *TINY_QAT, "hydra.run.dir=qat", cwd=tmp_path)
    report = json.loads((tmp_path / "qat" / "report.json").read_text())
    blocks = report["reconstruction"][0]["blocks"]
    assert len(blocks) == 2 and all(block["mse_after"] < block["mse_before"] for block in blocks)
    assert all(block["kept"] for block in blocks)
    assert "## Block-wise reconstruction" in (tmp_path / "qat" / "report.md").read_text()
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
    trained = next(row for row in report["rows"] if row["name"] == "w3-g64-qat")
    gptq = next(row for row in report["rows"] if row["name"] == "w3-g64-gptq")
    assert reloaded["ppl"] == pytest.approx(trained["ppl"], rel=1e-5) and trained["bytes"] == gptq["bytes"]
    layers = load_artifact(tmp_path / "qat" / "artifact").model.model.layers
    assert all(m.scheme.bits == 3 for m in layers.modules() if isinstance(m, QuantLinear))
