import numpy as np
import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.experts import split_experts
from slimlm.gguf_export import _permute_rows, _rotary_heads, export_gguf
from slimlm.inference.build import build_decoder
from slimlm.pipeline import RunState
from tests.conftest import build_tiny_llama

gguf = pytest.importorskip("gguf")
EVERYTHING = [r"model\.layers\.\d+\..*", "lm_head"]


def quantized(model, tokenizer, tmp_path, **params):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(**params))
    return model


def read_back(path):
    """Every tensor of the GGUF file dequantized by the gguf package, by llama.cpp name."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(
            *reversed([int(n) for n in t.shape])
        )
        for t in reader.tensors
    }


@pytest.mark.parametrize(
    ("gguf_type", "params"),
    [
        ("Q4_0", {"bits": 4, "group_size": 32}),
        ("Q8_0", {"bits": 8, "group_size": 32}),
        ("Q4_1", {"bits": 4, "group_size": 32, "symmetric": False}),
    ],
)
def test_weights_on_the_gguf_grid_are_written_exactly(
    tiny_model, tiny_tokenizer, tmp_path, gguf_type, params
):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, targets=EVERYTHING, **params)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", gguf_type)
    assert not summary["requantized"] and "model.layers.1.self_attn.k_proj.weight" in summary["exact"]
    tensors = read_back(tmp_path / "model.gguf")
    config = model.config
    for layer in range(config.num_hidden_layers):
        for ours, theirs in (
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("mlp.down_proj", "ffn_down"),
        ):
            name = f"model.layers.{layer}.{ours}"
            expected = _permute_rows(
                model.get_submodule(name).dequantize(), _rotary_heads(name + ".weight", config)
            )
            if gguf_type == "Q4_1":  # the minimum d * zero is stored in fp16: exact codes, a rounded offset
                torch.testing.assert_close(
                    tensors[f"blk.{layer}.{theirs}.weight"],
                    expected,
                    rtol=0,
                    atol=2e-3 * expected.abs().max().item(),
                )
            else:
                assert torch.equal(tensors[f"blk.{layer}.{theirs}.weight"], expected), name
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    assert torch.equal(tensors["output_norm.weight"], model.model.norm.weight.detach())


def test_transformers_loads_the_export_with_the_same_logits_and_tokenizer(
    tiny_model, tiny_tokenizer, tmp_path
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = quantized(tiny_model, tiny_tokenizer, tmp_path, targets=EVERYTHING, bits=4, group_size=32)
    export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="model.gguf")
    text = "It was the best of times, it was the worst of times."
    assert (
        tokenizer(text, add_special_tokens=False)["input_ids"]
        == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


def test_quantized_experts_are_stacked_exactly_and_llama_cpp_loads_them(tiny_tokenizer, tmp_path):
    """int4 g32 experts of Qwen3-MoE written as Q4_0 3-D tensors, expert by expert, each as GPTQ's
    codes, in a file llama.cpp loads and runs. (Its logits are compared in F32 above: llama.cpp
    rounds activations to Q8_0 for Q4_0 matmuls, which on these tiny random models moves the
    logits 16% on average for the dense qwen3 as for the MoE.)"""
    model = quantized(
        build_family("qwen3_moe", len(tiny_tokenizer), 0, 3), tiny_tokenizer, tmp_path, bits=4, group_size=32
    )
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "moe.gguf", "Q4_0")
    assert not summary["requantized"] and "model.layers.1.mlp.experts.7.down_proj.weight" in summary["exact"]
    tensors = read_back(tmp_path / "moe.gguf")
    for ours, theirs in (("gate_proj", "ffn_gate_exps"), ("down_proj", "ffn_down_exps")):
        experts = model.model.layers[1].mlp.experts
        assert torch.equal(
            tensors[f"blk.1.{theirs}.weight"],
            torch.stack([getattr(expert, ours).dequantize() for expert in experts]),
        )
    ids = tiny_tokenizer(SPM_TEXT, add_special_tokens=False).input_ids[:24]
    theirs, _ = llama_cpp_logits(tmp_path / "moe.gguf", ids)
    assert theirs.shape == (len(ids), model.config.vocab_size) and np.isfinite(theirs).all()


def test_fewer_bits_on_the_same_grid_are_exact(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=3, group_size=32)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert "model.layers.0.mlp.up_proj.weight" in summary["exact"] and not summary["requantized"]
    assert summary["rounded"] == [
        "model.embed_tokens.weight"
    ]  # the float embedding, as llama.cpp's converter rounds it
    assert torch.equal(
        read_back(tmp_path / "model.gguf")["blk.0.ffn_up.weight"],
        model.model.layers[0].mlp.up_proj.dequantize(),
    )


def test_layers_off_the_grid_are_refused_unless_requantizing_is_allowed(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=16)
    with pytest.raises(
        SlimlmError,
        match=(
            r"GGUF Q4_0 cannot hold 14 quantized layer\(s\) "
            r".*int4, groups of 16, symmetric.*requantize=true"
        ),
    ):
        export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert not any(tmp_path.iterdir())
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0", requantize=True)
    assert not summary["exact"] and len(summary["requantized"]) == 14


def test_existing_files_and_unknown_types_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    (tmp_path / "model.gguf").write_text("keep me")
    with pytest.raises(SlimlmError, match="never overwritten"):
        export_gguf(tiny_model, tiny_tokenizer, tmp_path / "model.gguf", "Q4_0")
    assert (tmp_path / "model.gguf").read_text() == "keep me"
    with pytest.raises(SlimlmError, match="unknown GGUF type 'Q3_X'"):
        export_gguf(tiny_model, tiny_tokenizer, tmp_path / "other.gguf", "Q3_X")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # nothing half-written


def test_float_files_hold_dequantized_layers(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=3, group_size=16)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "model.gguf", "F32")
    assert len(summary["dequantized"]) == 14 and not summary["exact"] and not summary["rounded"]
    assert torch.equal(
        read_back(tmp_path / "model.gguf")["blk.1.ffn_down.weight"],
        model.model.layers[1].mlp.down_proj.dequantize(),
    )


def test_a_tied_embedding_takes_the_head_type_as_the_head_it_is(tiny_model, tiny_tokenizer, tmp_path):
    model = quantized(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    summary = export_gguf(model, tiny_tokenizer, tmp_path / "mixed.gguf", "Q4_0", head_type="Q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "mixed.gguf").tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q.weight"] == "Q4_0"
    assert summary["head_type"] == "Q8_0" and len(summary["exact"]) == 14
    table = read_back(tmp_path / "mixed.gguf")["token_embd.weight"]
    assert torch.allclose(table, model.model.embed_tokens.weight, atol=2e-2)
    with pytest.raises(SlimlmError, match="unknown GGUF type 'Q5_K'"):
        export_gguf(model, tiny_tokenizer, tmp_path / "other.gguf", "Q4_0", head_type="Q5_K")


def test_an_untied_head_takes_the_head_type_and_the_embedding_the_files_as_in_llama_cpps_mix(
    tiny_tokenizer, tmp_path
):
    model = quantized(
        build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=False),
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
    )
    export_gguf(model, tiny_tokenizer, tmp_path / "mixed.gguf", "Q4_0", head_type="Q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "mixed.gguf").tensors}
    assert (
        types["output.weight"] == "Q8_0"
        and types["token_embd.weight"] == "Q4_0"
        and types["blk.0.ffn_up.weight"] == "Q4_0"
    )


# ---- families: tiny random-weight models of each ----
# read back by gguf and, where installed, scored by llama.cpp

SPM_TEXT = "It was the best of times, it was the worst of times.\nHello world 12345 \u00e9t\u00e9 caf\u00e9"


def sentencepiece_tokenizer(tmp_path_factory, style: str):
    """A SentencePiece BPE trained on the calibration text, wrapped as transformers does for Gemma
    (no space prefix) or Llama 2 / Mistral / Phi-3 (a space prefix). transformers 5 needs protobuf to
    read a .model file, so the pieces and merges are taken with sentencepiece's own API."""
    import sentencepiece
    from transformers import GemmaTokenizer, LlamaTokenizer

    from tests.conftest import CALIBRATION

    directory = tmp_path_factory.mktemp(f"spm-{style}")
    gemma = style == "gemma"
    specials = (
        dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>")
        if gemma
        else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    )
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CALIBRATION.read_text(encoding="utf-8")[:60_000].splitlines()),
        model_prefix=str(directory / "spm"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        add_dummy_prefix=not gemma,
        minloglevel=2,
        **specials,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "spm.model"))
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    plain = [
        piece
        for piece, i in vocab.items()
        if not (processor.is_control(i) or processor.is_unknown(i) or processor.is_byte(i))
    ]
    merges = sorted(
        (
            (piece[:cut], piece[cut:])
            for piece in plain
            for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ),
        key=lambda pair: (vocab[pair[0] + pair[1]], vocab[pair[0]], vocab[pair[1]]),
    )
    if gemma:
        return GemmaTokenizer(vocab=vocab, merges=merges, chat_template=CHAT_TEMPLATE)
    return LlamaTokenizer(vocab=vocab, merges=merges, chat_template=CHAT_TEMPLATE)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _randomize(model, names: tuple[str, ...], scale: float):
    """Random values where transformers initializes constants (biases, norms), so the export's
    handling of them shows."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in names):
                parameter.add_(torch.randn_like(parameter) * scale)
    return model


def build_family(name: str, vocab_size: int, bos: int, eos: int):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=bos,
        initializer_range=0.1,
    )
    if name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
        return _randomize(model, ("bias",), 0.5)
    if name == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
        )
        return _randomize(model, ("norm",), 0.3)
    if name == "gemma3":
        config = transformers.Gemma3TextConfig(
            **{**common, "num_hidden_layers": 7}, head_dim=16, query_pre_attn_scalar=16, sliding_window=4
        )
        return _randomize(transformers.Gemma3ForCausalLM(config), ("norm",), 0.3)
    if name == "phi3":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [1.0 + i / 4 for i in range(8)],
            "short_factor": [1.0 + i / 8 for i in range(8)],
        }
        # llama.cpp takes the long factors when its context (padded to 256) exceeds the original 512;
        # here it does not
        config = transformers.Phi3Config(
            **{**common, "max_position_embeddings": 2048},
            original_max_position_embeddings=512,
            rope_parameters=rope,
            sliding_window=None,
            tie_word_embeddings=False,
        )
        return transformers.Phi3ForCausalLM(config)
    if name == "mistral":
        return transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        )
    if name in MOE_CASES:
        moe = dict(num_experts_per_tok=2, tie_word_embeddings=name != "mixtral")
        config = {
            "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
                **common, moe_intermediate_size=32, num_experts=8, head_dim=16, norm_topk_prob=True, **moe
            ),
            "olmoe": lambda: transformers.OlmoeConfig(
                **{**common, "intermediate_size": 32, "num_key_value_heads": 4}, num_experts=8, **moe
            ),
            "mixtral": lambda: transformers.MixtralConfig(
                **{**common, "intermediate_size": 32}, num_local_experts=8, sliding_window=None, **moe
            ),
        }[name]()
        model = transformers.AutoModelForCausalLM.from_config(config)
        split_experts(model)
        return _randomize(model, ("norm",), 0.3)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
    )


# family: (llama.cpp architecture, tokenizer kind, tensors only that family has)
FAMILY_CASES = {
    "qwen2": ("qwen2", "bpe", ("blk.0.attn_q.bias", "blk.0.attn_v.bias")),
    "qwen3": ("qwen3", "bpe", ("blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight")),
    "gemma3": (
        "gemma3",
        "gemma",
        ("blk.0.post_attention_norm.weight", "blk.6.post_ffw_norm.weight", "blk.6.attn_q_norm.weight"),
    ),
    "phi3": (
        "phi3",
        "llama",
        ("blk.0.attn_qkv.weight", "rope_factors_long.weight", "rope_factors_short.weight", "output.weight"),
    ),
    "mistral": ("llama", "llama", ("output.weight",)),
    "llama3": ("llama", "bpe", ("rope_freqs.weight",)),
    "qwen3_moe": (
        "qwen3moe",
        "bpe",
        ("blk.0.ffn_gate_inp.weight", "blk.1.ffn_down_exps.weight", "blk.0.attn_q_norm.weight"),
    ),
    "olmoe": (
        "olmoe",
        "bpe",
        ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight", "blk.0.attn_k_norm.weight"),
    ),
    "mixtral": (
        "llama",
        "llama",
        ("blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_exps.weight", "output.weight"),
    ),
}
MOE_CASES = ("qwen3_moe", "olmoe", "mixtral")


@pytest.fixture(scope="module")
def spm_tokenizers(tmp_path_factory):
    return {style: sentencepiece_tokenizer(tmp_path_factory, style) for style in ("gemma", "llama")}


def family_export(name, tiny_tokenizer, spm_tokenizers, tmp_path, gguf_type="F32"):
    arch, kind, _ = FAMILY_CASES[name]
    tokenizer = tiny_tokenizer if kind == "bpe" else spm_tokenizers[kind]
    model = build_family(name, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id).eval()
    path = tmp_path / f"{name}.gguf"
    export_gguf(model, tokenizer, path, gguf_type)
    return model, tokenizer, path


def _field(reader, key):
    field = reader.get_field(key)
    return None if field is None else field.contents()


@pytest.mark.parametrize("name", sorted(FAMILY_CASES))
def test_each_family_is_written_with_llama_cpp_names_and_keys(name, tiny_tokenizer, spm_tokenizers, tmp_path):
    arch, kind, own_tensors = FAMILY_CASES[name]
    model, tokenizer, path = family_export(name, tiny_tokenizer, spm_tokenizers, tmp_path)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    assert _field(reader, "general.architecture") == arch
    assert set(own_tensors) <= set(tensors)
    assert tensors["token_embd.weight"].shape.tolist() == [config.hidden_size, config.vocab_size]
    assert _field(reader, f"{arch}.block_count") == config.num_hidden_layers
    assert _field(reader, f"{arch}.attention.key_length") == (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert (
        len(tokens) == config.vocab_size
        and _field(reader, "tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
    )
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    if kind == "bpe":
        assert (
            _field(reader, "tokenizer.ggml.model") == "gpt2"
            and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
        )
        assert len(_field(reader, "tokenizer.ggml.merges")) > 0
    else:
        assert _field(reader, "tokenizer.ggml.model") == "llama" and _field(
            reader, "tokenizer.ggml.add_space_prefix"
        ) == (kind == "llama")
        types = _field(reader, "tokenizer.ggml.token_type")
        assert (
            types[tokens.index("<0x0A>")] == gguf.TokenType.BYTE
            and types[tokenizer.bos_token_id] == gguf.TokenType.CONTROL
        )
        assert types[tokenizer.unk_token_id] == gguf.TokenType.UNKNOWN
        assert len(_field(reader, "tokenizer.ggml.scores")) == len(tokens)


def test_family_specific_values(tiny_tokenizer, spm_tokenizers, tmp_path):
    """Gemma's norms as 1 + w; Phi-3's LongRoPE factors and keys; Llama 3's frequency divisors;
    qwen2's rows unpermuted."""
    from slimlm.gguf_families import llama3_divisors

    gemma, _, path = family_export("gemma3", tiny_tokenizer, spm_tokenizers, tmp_path)
    tensors = read_back(path)
    reader = gguf.GGUFReader(path)
    assert torch.allclose(
        tensors["blk.0.attn_norm.weight"], 1 + gemma.model.layers[0].input_layernorm.weight.detach()
    )
    assert torch.allclose(
        tensors["blk.0.attn_k_norm.weight"], 1 + gemma.model.layers[0].self_attn.k_norm.weight.detach()
    )
    assert (
        _field(reader, "gemma3.attention.sliding_window") == 4
        and _field(reader, "gemma3.rope.freq_base_swa") == 10000.0
    )
    assert _field(reader, "gemma3.attention.sliding_window_pattern") == [True] * 5 + [False, True]
    phi, _, path = family_export("phi3", tiny_tokenizer, spm_tokenizers, tmp_path)
    reader, tensors = gguf.GGUFReader(path), read_back(path)
    assert tensors["rope_factors_long.weight"].tolist() == phi.config.rope_parameters["long_factor"]
    assert _field(reader, "phi3.rope.scaling.original_context_length") == 512
    assert abs(_field(reader, "phi3.rope.scaling.attn_factor") - (1 + np.log(4) / np.log(512)) ** 0.5) < 1e-6
    assert tensors["blk.1.ffn_up.weight"].shape == (256, 64)  # gate and up, fused as llama.cpp reads them
    llama, _, path = family_export("llama3", tiny_tokenizer, spm_tokenizers, tmp_path)
    inverse = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    divisors = read_back(path)["rope_freqs.weight"].numpy()
    expected = (
        inverse / llama.model.rotary_emb.inv_freq.double().numpy()
    )  # what transformers computes for llama3
    assert np.allclose(divisors, expected, rtol=1e-5) and np.allclose(
        llama3_divisors(inverse, llama.config.rope_parameters), expected, rtol=1e-5
    )
    qwen, _, path = family_export("qwen2", tiny_tokenizer, spm_tokenizers, tmp_path)
    assert torch.equal(
        read_back(path)["blk.0.attn_q.weight"], qwen.model.layers[0].self_attn.q_proj.weight.detach()
    )


def test_unsupported_families_and_configs_are_refused_in_one_line(tiny_tokenizer, tmp_path):
    import transformers

    config = transformers.GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(
        SlimlmError,
        match=(
            r"GGUF export supports llama, mistral, qwen2, qwen3, gemma3_text, phi3, qwen3_moe, olmoe, "
            r"mixtral models; this one is gpt2"
        ),
    ):
        export_gguf(transformers.GPT2LMHeadModel(config), tiny_tokenizer, tmp_path / "gpt2.gguf", "F32")
    gemma = transformers.Gemma3TextConfig(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
    )
    with pytest.raises(SlimlmError, match=r"scales Gemma 3's attention by 1/sqrt\(16\)"):
        export_gguf(transformers.Gemma3ForCausalLM(gemma), tiny_tokenizer, tmp_path / "gemma.gguf", "F32")
    yarn = transformers.Qwen2Config(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    with pytest.raises(SlimlmError, match="qwen2 takes RoPE scaling default, linear; this model uses 'yarn'"):
        export_gguf(transformers.Qwen2ForCausalLM(yarn), tiny_tokenizer, tmp_path / "yarn.gguf", "F32")
    assert not any(tmp_path.iterdir())


def test_a_pre_tokenizer_llama_cpp_does_not_know_is_refused(tiny_model, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={chr(i): i - 97 for i in range(97, 123)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    with pytest.raises(SlimlmError, match="does not know this tokenizer's pre-tokenizer"):
        export_gguf(tiny_model, tokenizer, tmp_path / "model.gguf", "F32")


def test_known_pre_tokenizers_are_named_as_llama_cpp_names_them(tiny_tokenizer):
    """The check text is llama.cpp's, character for character (its ids from the SmolLM2 and
    Qwen2.5-Coder tokenizers hash to llama.cpp's "smollm" and "qwen2": checked once by hand, too slow
    for a unit test, since transformers reads a GGUF's vocabulary slowly); a plain GPT-2 ByteLevel
    tokenizer that llama.cpp has no hash for is its "gpt-2"."""
    from hashlib import sha256

    from slimlm.gguf_tokenizer import CHECK_TEXT, PRE_TOKENIZERS, _pre_tokenizer

    assert (
        sha256(CHECK_TEXT.encode()).hexdigest()
        == "a36179c1e2b1cfcfbfad1dc779addad2ffc778201e4cf0d538bddeafa2c526da"
    )
    assert {"llama-bpe", "qwen2", "smollm"} <= set(PRE_TOKENIZERS.values())
    assert _pre_tokenizer(tiny_tokenizer, {"pre_tokenizer": {"type": "ByteLevel"}}) == "gpt-2"


# ---- llama.cpp reads and scores each family (skipped where llama-cpp-python is not installed) ----


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=2, seed=0
    )
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32), llm


@pytest.mark.parametrize("name", sorted(FAMILY_CASES))
def test_llama_cpp_scores_each_family_as_transformers_does(name, tiny_tokenizer, spm_tokenizers, tmp_path):
    pytest.importorskip("llama_cpp")
    model, tokenizer, path = family_export(name, tiny_tokenizer, spm_tokenizers, tmp_path)
    ids = tokenizer(SPM_TEXT, add_special_tokens=False).input_ids[:24]
    theirs, llm = llama_cpp_logits(path, ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs - ours).max() < 1e-2 * max(1.0, np.abs(ours).max()), np.abs(theirs - ours).max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).mean() >= 0.95
    assert (
        llm.tokenize(SPM_TEXT.encode(), add_bos=False, special=False)
        == tokenizer(SPM_TEXT, add_special_tokens=False).input_ids
    )


def test_a_head_equal_to_the_embedding_is_written_once(tiny_tokenizer, tmp_path):
    """transformers unties the head when it reads a GGUF without an output tensor; the export ties it back."""
    model = build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    export_gguf(model, tiny_tokenizer, tmp_path / "tied.gguf", "F32")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "tied.gguf").tensors}
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    export_gguf(model, tiny_tokenizer, tmp_path / "untied.gguf", "F32")
    assert "output.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "untied.gguf").tensors}


# ---- slimlm reads each family's GGUF back (transformers' GGUF reader plus slimlm/gguf_config.py) ----


@pytest.mark.parametrize("name", sorted(set(FAMILY_CASES) - {"olmoe", "mixtral"}))
def test_each_familys_gguf_converts_back_to_the_model_it_holds(
    name, tiny_tokenizer, spm_tokenizers, tmp_path
):
    """What transformers' GGUF reader leaves out (qwen3's head width, Gemma 3's attention scale,
    Phi-3's LongRoPE, Llama 3's rope_freqs, Qwen3-MoE's expert width and rescaled routing) is
    read back: the converted model and the decoder built from it give the exported model's logits."""
    from transformers import AutoModelForCausalLM

    from slimlm.models import gguf_config

    model, _, path = family_export(name, tiny_tokenizer, spm_tokenizers, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, config=gguf_config(path)
    )
    decoder = build_decoder(loaded)
    decoder.setup_cache(1, 24)
    ids = torch.randint(4, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(decoder(ids, 0), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["olmoe", "mixtral"])
def test_a_moe_gguf_transformers_cannot_read_is_refused_in_one_line(
    name, tiny_tokenizer, spm_tokenizers, tmp_path
):
    from slimlm.models import gguf_config

    _, _, path = family_export(name, tiny_tokenizer, spm_tokenizers, tmp_path)
    with pytest.raises(SlimlmError, match="convert the original checkpoint instead") as refusal:
        gguf_config(path)
    assert "\n" not in str(refusal.value)


def test_rope_freqs_that_are_not_llama3_scaling_are_refused():
    from slimlm.gguf_config import llama3_parameters

    inverse = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    with pytest.raises(SlimlmError, match="not Llama 3's RoPE scaling"):
        llama3_parameters(
            inverse, np.linspace(1.0, 8.0, 32)
        )  # a ramp over every frequency, not 1 ... blend ... factor
