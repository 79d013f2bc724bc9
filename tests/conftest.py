"""Shared fixtures: a tiny random-weight Llama with a real (tiny) BPE tokenizer, built in-process."""

from __future__ import annotations

import os
from pathlib import Path

# Before anything imports huggingface_hub, which reads these once: tests never touch the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# torch.compile in this process and the benchmarks' it starts: compile in-process, not in a pool of
# compile workers, whose start cost about 5 s a process when two test workers already hold the cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "slimlm" / "assets" / "gutenberg" / "calibration.txt"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# The files whose tests take minutes, longest first. pytest-xdist (`--dist loadfile
# --no-loadscope-reorder`, the Makefile's) hands files out in collection order: these start at
# once, and the many short files fill in behind them, instead of a long file with few tests
# starting last while the other worker idles (by test count, the integration tests came last).
LONG_FILES = (
    "test_bench_quick_modes.py",
    "test_cli.py",
    "test_integration.py",
    "test_decoder.py",
    "test_distill_processes.py",
    "test_bench_decode_families.py",
    "test_fuzz.py",
    "test_serve_load.py",
    "test_bench_scale.py",
    "test_bench_gpu.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: files keep their order


@pytest.fixture(autouse=True, scope="session")
def _isolated_environment(tmp_path_factory):
    """A private cache, so tests never depend on the user's machine state."""
    os.environ.setdefault("SLIMLM_CACHE", str(tmp_path_factory.mktemp("slimlm-cache")))
    torch.set_num_threads(min(2, torch.get_num_threads()))


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CALIBRATION.read_text(encoding="utf-8")[:60_000]], trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=3,
        pad_token_id=0,
    )
    settings.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def build_tiny_mistral(vocab_size: int, sliding_window: int = 8):
    """Mistral's sliding window (each query sees its last `sliding_window` positions), narrow
    enough that the tests' prompts and answers outgrow it."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        sliding_window=sliding_window,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=3,
        pad_token_id=0,
    )
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama checkpoint directory (config, safetensors, tokenizer)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_llama(len(tiny_tokenizer))
    model.save_pretrained(directory)
    tiny_tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def tiny_model(tiny_tokenizer):
    return build_tiny_llama(len(tiny_tokenizer))


@pytest.fixture
def context_model(tiny_tokenizer):
    """A tiny model whose next token depends on the whole context: at transformers' default
    initializer_range (0.02) one this small repeats the prompt's last token whatever came
    before it, so two decoding paths giving "the same tokens" would check almost nothing."""
    return build_tiny_llama(len(tiny_tokenizer), initializer_range=0.2)
