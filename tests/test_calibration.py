import copy

import pytest
import torch

from slimlm.compress.calibration import calibrate_sequentially, calibration_samples
from slimlm.compress.gptq import HessianAccumulator, gptq_quantize
from slimlm.compress.targets import select_linear_modules
from slimlm.errors import SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule
from tests.conftest import build_tiny_llama

SCHEME = QuantScheme(bits=4, group_size=16)


def replace_with_gptq(model, name, hessian):
    linear = model.get_submodule(name)
    q = gptq_quantize(linear.weight, hessian, SCHEME)
    set_submodule(model, name, QuantLinear.from_codes(q.codes, q.scales, q.zeros, SCHEME, linear.bias))


def sequential(model, samples, names):
    hessians = {}

    def observe(name, inputs):
        hessians.setdefault(name, HessianAccumulator(inputs.shape[-1])).add(inputs)

    def finish(block, layer_names):
        for name in layer_names:
            replace_with_gptq(model, name, hessians.pop(name).hessian)

    return calibrate_sequentially(model, samples, names, observe, finish, chunk_tokens=4 * samples.shape[1])


@torch.no_grad()
def whole_model(model, samples, names):
    """The reference: for each layer in turn, run the whole (partly quantized) model to collect it."""
    for index in range(model.config.num_hidden_layers):
        layer_names = [n for n in names if n.startswith(f"model.layers.{index}.")]
        hessians = {name: HessianAccumulator(model.get_submodule(name).in_features) for name in layer_names}
        handles = [
            model.get_submodule(n).register_forward_hook(
                lambda m, i, o, n=n, hessians=hessians: hessians[n].add(i[0])
            )
            for n in layer_names
        ]
        for chunk in samples.split(4):
            model(input_ids=chunk, use_cache=False)
        for handle in handles:
            handle.remove()
        for name in layer_names:
            replace_with_gptq(model, name, hessians[name].hessian)


def test_sequential_calibration_equals_whole_model_calibration():
    model = build_tiny_llama(384, num_hidden_layers=3)
    samples = torch.randint(0, 384, (10, 32), generator=torch.Generator().manual_seed(0))
    names = select_linear_modules(model, [r"model\.layers\.\d+\..*"], [])
    reference = copy.deepcopy(model)
    peak = sequential(model, samples, names)
    whole_model(reference, samples, names)
    assert peak > 0
    for name in names:
        assert torch.equal(model.get_submodule(name).qweight, reference.get_submodule(name).qweight), name
    ids = samples[:2]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_targets_outside_decoder_layers_are_refused():
    model = build_tiny_llama(384)
    with pytest.raises(SlimlmError, match="lm_head is outside them"):
        sequential(model, torch.zeros(2, 8, dtype=torch.long), ["lm_head"])


def test_calibration_windows_are_distinct_seeded_and_checked():
    tokens = torch.arange(1000)
    first = calibration_samples(tokens, 5, 100, seed=1)
    assert first.shape == (5, 100) and len({int(row[0]) for row in first}) == 5
    assert torch.equal(first, calibration_samples(tokens, 5, 100, seed=1))
    assert not torch.equal(first, calibration_samples(tokens, 5, 100, seed=2))
    with pytest.raises(SlimlmError, match="fewer than the 11 samples"):
        calibration_samples(tokens, 11, 100, seed=0)


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe", "llama"])
def test_the_layer_by_layer_walk_gives_each_layer_its_own_arguments(model_type):
    """Gemma 3's global layers get another mask and other rotary tables than its sliding-window
    layers: walking the layers one at a time must reproduce the model's own hidden states."""
    from slimlm.compress.calibration import capture_layer_inputs, run_layer
    from tests.tiny_families import build_tiny

    kinds = ["sliding_attention", "full_attention"] * 2
    model = build_tiny(
        model_type,
        256,
        num_hidden_layers=4,
        **({"layer_types": kinds} if model_type == "gemma3_text" else {}),
    )
    ids = torch.randint(
        4, 256, (3, 20), generator=torch.Generator().manual_seed(0)
    )  # longer than the sliding window (8)
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        inputs = capture_layer_inputs(model, ids, chunk_size=2)
        hidden = inputs.hidden
        for index, layer in enumerate(
            model.model.layers[:-1]
        ):  # the last hidden state is after the final norm
            hidden = run_layer(layer, inputs.of_layer(index, hidden))
            torch.testing.assert_close(torch.cat(hidden), expected[index + 1], rtol=1e-5, atol=1e-5)
