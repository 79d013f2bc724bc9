"""The decoder runs every family it lists (inference/families.py) as transformers does: tiny
random-weight models from transformers' own config classes, three prompts of different lengths
decoded together, token for token and logit for logit; packed kernels within a KL bound."""

import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.inference.build import build_decoder
from slimlm.inference.decoder import Decoder
from slimlm.inference.load import load_decoder
from slimlm.inference.model import ModelArgs
from slimlm.inference.sampling import SamplingParams
from slimlm.pipeline import RunState
from tests.test_artifact import export
from tests.test_decoder import hf_greedy, prompt_ids, quantized
from tests.tiny_families import DENSE_FIRST_LAYER, build_tiny

# gemma3_text: its sliding window of 8 is shorter than two of the prompts; qwen3_moe: a dense
# MLP in its first layer (mlp_only_layers), experts in the second
DECODED = ("llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral", "olmoe")
LENGTHS = (5, 13, 21)


def family_model(family: str, vocab_size: int, **overrides):
    dense_first = DENSE_FIRST_LAYER if family == "qwen3_moe" else {}
    return build_tiny(family, vocab_size, initializer_range=0.2, **dense_first, **overrides)


def prompts_for(model) -> list[list[int]]:
    return [prompt_ids(length, model.config.vocab_size, seed=length) for length in LENGTHS]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", DECODED)
def test_prompts_decoded_together_give_transformers_greedy_tokens(family, compiled, tiny_tokenizer):
    model = family_model(family, len(tiny_tokenizer))
    decoder = Decoder(build_decoder(model), tiny_tokenizer)
    if compiled:
        decoder.compile_decode_step()
    prompts = prompts_for(model)
    ours = decoder.generate_ids(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
    assert [g.token_ids for g in ours] == [hf_greedy(model, p, 64) for p in prompts]


@pytest.mark.parametrize("family", DECODED)
def test_a_left_padded_batch_has_each_prompts_transformers_logits(family, tiny_tokenizer):
    model = family_model(family, len(tiny_tokenizer))
    decoder = build_decoder(model)
    prompts = prompts_for(model)
    longest = max(LENGTHS)
    tokens = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    pad = torch.tensor([longest - len(p) for p in prompts])
    decoder.setup_cache(len(prompts), longest)
    with torch.no_grad():
        logits = decoder(tokens, 0, pad)
        for row, prompt in enumerate(prompts):
            torch.testing.assert_close(
                logits[row, longest - len(prompt) :],
                model(torch.tensor([prompt])).logits[0],
                rtol=1e-4,
                atol=1e-4,
            )


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    log_p, log_q = reference.log_softmax(-1), other.log_softmax(-1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


@pytest.mark.parametrize("params", [dict(bits=8), dict(bits=4, group_size=32)], ids=["int8", "int4-g32"])
@pytest.mark.parametrize("family", DECODED)
def test_packed_kernels_stay_within_a_kl_bound_of_the_dequantized_model(
    family, params, tiny_tokenizer, tmp_path
):
    """The packed int8 / int4 kernels with bf16 activations against the same quantized weights
    dequantized to fp32: the difference is the kernels' and bf16's rounding only (measured: KL
    1e-4 to 5e-4 per token; the bound is 1e-3)."""
    model = quantized(
        family_model(family, len(tiny_tokenizer)),
        tiny_tokenizer,
        tmp_path,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
        **params,
    )
    fast, reference = build_decoder(model, dtype=torch.bfloat16), build_decoder(model, kernels=False)
    ids = torch.tensor([prompt_ids(21, model.config.vocab_size)])
    for decoder in (fast, reference):
        decoder.setup_cache(1, 32)
    with torch.no_grad():
        assert mean_kl(reference(ids, 0), fast(ids, 0).float()) < 1e-3
        torch.testing.assert_close(reference(ids, 0), model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [20, 48], ids=["short-factors", "long-factors"])
def test_phi3_partial_rotary_and_longrope_follow_transformers(length, tiny_tokenizer):
    """Phi-4-mini rotates half of each head (partial_rotary_factor) with longrope; transformers
    takes the long factors for a sequence past the original 32 positions, as the decoder does
    for a cache past them."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "original_max_position_embeddings": 32,
    }
    model = family_model(
        "phi3",
        len(tiny_tokenizer),
        rope_parameters=rope,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
    )
    decoder = build_decoder(model)
    assert decoder.rotaries[0].inv_freq.numel() == 4 and decoder.rotaries[0].rope.attention_scaling > 1
    ids = torch.tensor([prompt_ids(length, model.config.vocab_size)])
    decoder.setup_cache(1, length)
    with torch.no_grad():
        torch.testing.assert_close(decoder(ids, 0), model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config",
    [{"model_type": "mamba", "hidden_size": 64}, {"model_type": "gemma2", "hidden_size": 64}],
    ids=["state-space", "not-yet-decoded"],
)
def test_a_family_the_decoder_does_not_run_is_refused_in_one_line(config):
    with pytest.raises(SlimlmError) as refusal:
        ModelArgs.from_hf_config(config)
    message = str(refusal.value)
    assert "\n" not in message and f"'{config['model_type']}'" in message
    assert (
        "llama, mistral, qwen2, qwen3, gemma3_text, phi3, qwen3_moe, mixtral, olmoe" in message
        and "{format: compressed-tensors}" in message
    )


@pytest.mark.parametrize("family", DECODED[1:])
def test_an_artifact_of_each_family_loads_layer_by_layer_with_its_models_logits(
    family, tiny_tokenizer, tmp_path
):
    """w4 g32 of every Linear (phi3's fused qkv_proj and gate_up_proj as stored), exported and
    read into the decoder a layer at a time: the same logits as the decoder built from the
    quantized model in memory, and as transformers' own forward of it."""
    model = family_model(family, len(tiny_tokenizer))
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32))
    direct, _ = load_decoder(export(state, tmp_path / "artifact"), dtype=torch.float32, kernels=False)
    ids = torch.tensor([prompt_ids(21, model.config.vocab_size)])
    direct.setup_cache(1, 21)
    with torch.no_grad():
        torch.testing.assert_close(direct(ids, 0), model(ids).logits, rtol=1e-4, atol=1e-4)
