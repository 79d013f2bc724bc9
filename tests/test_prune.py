import pytest
import torch

from slimlm.compress.prune import PruneParams, block_influence, prune_model
from slimlm.compress.rtn import quantize_rtn
from slimlm.errors import ConfigError, SlimlmError
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule
from tests.conftest import build_tiny_llama

SAMPLES = torch.randint(0, 384, (8, 32), generator=torch.Generator().manual_seed(0))


def tiny(**overrides):
    settings = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    settings.update(overrides)
    return build_tiny_llama(384, **settings)


def qwen2_tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize(
    "params",
    [
        PruneParams(layers=2),
        PruneParams(hidden_size=40),
        PruneParams(intermediate_size=50),
        PruneParams(kv_heads=1),
        PruneParams(layers=3, hidden_size=48, intermediate_size=96, kv_heads=3),
    ],
    ids=lambda p: ",".join(
        f"{k}={v}"
        for k, v in vars(p).items()
        if v is not None and k in ("layers", "hidden_size", "intermediate_size", "kv_heads")
    ),
)
def test_pruned_model_reloads_in_transformers_with_the_same_logits(params, tmp_path):
    from transformers import AutoModelForCausalLM

    pruned, section = prune_model(tiny(), SAMPLES, params)
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(SAMPLES[:2]).logits, pruned(SAMPLES[:2]).logits, rtol=1e-5, atol=1e-5
        )
    after = section["shape_after"]
    for key in ("layers", "hidden_size", "intermediate_size", "kv_heads"):
        if getattr(params, key) is not None:
            assert after[key] == getattr(params, key)
    assert after["heads"] == 2 * after["kv_heads"] and after["head_dim"] == 8  # GQA groups stay whole
    assert section["parameters_after"] == sum(
        p.numel() for p in {p.data_ptr(): p for p in reloaded.parameters()}.values()
    )
    assert section["parameters_after"] < section["parameters_before"]


def test_qwen2_with_biases_and_untied_head_prunes_in_width_and_depth(tmp_path):
    from transformers import AutoModelForCausalLM

    pruned, _ = prune_model(qwen2_tiny(), SAMPLES, PruneParams(layers=2, hidden_size=48, kv_heads=1))
    pruned.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.model.layers[0].self_attn.k_proj.bias.shape == (16,)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(SAMPLES[:2]).logits, pruned(SAMPLES[:2]).logits, rtol=1e-5, atol=1e-5
        )


def test_depth_pruning_keeps_the_layers_that_change_the_hidden_state_most():
    model = tiny()
    influence = block_influence(model, SAMPLES)
    pruned, section = prune_model(model, SAMPLES, PruneParams(layers=2))
    kept = [i for i in range(4) if i not in section["removed_layers"]]
    assert sorted(influence, reverse=True)[:2] == sorted((influence[i] for i in kept), reverse=True)
    # the kept layers' weights moved to the new numbering unchanged
    torch.testing.assert_close(
        pruned.model.layers[1].mlp.down_proj.weight, model.model.layers[kept[1]].mlp.down_proj.weight
    )


def test_an_identity_layer_has_no_influence_and_goes_first():
    model = tiny()
    with torch.no_grad():  # zero output projections: the layer adds nothing to the residual stream
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    influence = block_influence(model, SAMPLES)
    assert influence[2] == pytest.approx(0.0, abs=1e-6)
    _, section = prune_model(model, SAMPLES, PruneParams(layers=3))
    assert section["removed_layers"] == [2]


def test_width_pruning_keeps_the_channels_that_carry_activation():
    model = tiny()
    with torch.no_grad():  # MLP channel 5 of every layer never fires: it must be the one removed
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[5] = 0.0
    pruned, _ = prune_model(model, SAMPLES, PruneParams(intermediate_size=127))
    for old, new in zip(model.model.layers, pruned.model.layers):
        expected = torch.cat([old.mlp.gate_proj.weight[:5], old.mlp.gate_proj.weight[6:]])
        torch.testing.assert_close(new.mlp.gate_proj.weight, expected)


def test_bad_pruning_targets_are_refused():
    with pytest.raises(ConfigError, match="keep at least 1"):
        PruneParams(layers=0)
    with pytest.raises(ConfigError, match="keep at least 1"):
        PruneParams(kv_heads=0)
    with pytest.raises(ConfigError, match="give at least one"):
        PruneParams()
    with pytest.raises(SlimlmError, match="larger than the model's 4"):
        prune_model(tiny(), SAMPLES, PruneParams(layers=5))
    with pytest.raises(SlimlmError, match="multiple of the heads"):
        prune_model(tiny(), SAMPLES, PruneParams(hidden_size=60))
    model = tiny()
    head = model.model.layers[0].mlp.down_proj
    set_submodule(
        model,
        "model.layers.0.mlp.down_proj",
        QuantLinear.from_codes(
            *vars(quantize_rtn(head.weight, QuantScheme(bits=8))).values(), QuantScheme(bits=8), None
        ),
    )
    with pytest.raises(SlimlmError, match="before any quantize stage"):
        prune_model(model, SAMPLES, PruneParams(layers=2))
