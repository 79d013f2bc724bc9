"""An untied input embedding is quantized with its LM head (a QuantTable), and every consumer of
an artifact reads it: the artifact, the bundled decoder, the planner, the HF, compressed-tensors
and GGUF exports. Gemma's scaled embedding keeps its scale whether tied or not."""

import pytest
import torch

from slimlm.artifact import load_artifact, read_manifest
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.eval.size import model_size
from slimlm.inference.load import load_decoder
from slimlm.inference.planner import packed_bytes
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantEmbedding, QuantLinear, QuantScheme, QuantTable
from tests.conftest import build_tiny_llama
from tests.test_artifact import export
from tests.tiny_families import build_tiny

WITH_HEAD = [r"model\.layers\.\d+\..*", "lm_head"]


def quantized(model, tokenizer, tmp_path, **params) -> RunState:
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(targets=WITH_HEAD, **params))
    return state


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def untied(tiny_tokenizer):
    return build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=False, initializer_range=0.2)


def test_an_untied_table_is_rounded_with_its_head(untied, tiny_tokenizer, tmp_path):
    ids = torch.randint(0, untied.config.vocab_size, (2, 12))
    table, before, fp32 = (
        untied.get_input_embeddings().weight.detach().clone(),
        logits(untied, ids),
        model_size(untied),
    )
    state = quantized(untied, tiny_tokenizer, tmp_path, bits=8)
    embedding = untied.get_input_embeddings()
    assert isinstance(embedding, QuantTable) and embedding.scheme == QuantScheme(bits=8)
    assert state.schemes["model.embed_tokens"] == QuantScheme(bits=8).to_dict()
    assert (
        embedding(ids) - table[ids]
    ).abs().max() <= embedding.scales.float().max() / 2 + 1e-6  # within half a step
    assert (
        logits(untied, ids) - before
    ).norm() < 0.05 * before.norm()  # int8 everywhere: a few percent on this chaotic random model
    size = model_size(untied)
    assert (
        size.parameters == fp32.parameters and size.bits_per_weight < 8.6
    )  # every matrix int8, the table too


def test_the_artifact_stores_the_table_once_as_codes_and_reads_it_back(untied, tiny_tokenizer, tmp_path):
    state = quantized(untied, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    path = export(state, tmp_path / "artifact")
    manifest = read_manifest(path)
    assert manifest["modules"]["model.embed_tokens"]["shape"] == [untied.config.vocab_size, 64]
    loaded = load_artifact(path).model
    assert isinstance(loaded.get_input_embeddings(), QuantTable)
    assert "model.embed_tokens.weight" not in loaded.state_dict()
    ids = torch.randint(0, untied.config.vocab_size, (2, 12))
    assert torch.equal(logits(loaded, ids), logits(state.model, ids))


def test_the_decoder_reads_the_table_by_rows_as_planned(untied, tiny_tokenizer, tmp_path):
    state = quantized(untied, tiny_tokenizer, tmp_path, bits=8)
    path = export(state, tmp_path / "artifact")
    decoder, _ = load_decoder(path, dtype=torch.float32)
    ids = torch.randint(0, untied.config.vocab_size, (1, 10))
    decoder.setup_cache(1, 16)
    with torch.inference_mode():
        torch.testing.assert_close(
            decoder(ids, 0)[:, -1], logits(state.model, ids)[:, -1], rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(decoder.embedding(ids), untied.get_input_embeddings()(ids))
    table = untied.get_input_embeddings()
    stored = sum(buffer.numel() * buffer.element_size() for buffer in table.buffers())
    assert stored == packed_bytes(
        table.out_features, table.in_features, table.scheme
    )  # what the planner counts for it


def test_hf_and_compressed_tensors_exports_carry_the_table_dequantized(untied, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from slimlm.ct_export import export_compressed
    from slimlm.hf_export import export_hf

    state = quantized(untied, tiny_tokenizer, tmp_path, bits=8)
    ids = torch.randint(0, untied.config.vocab_size, (2, 12))
    expected = logits(state.model, ids)
    export_hf(state.model, tiny_tokenizer, tmp_path / "hf", "float32")
    export_compressed(state.model, tiny_tokenizer, tmp_path / "ct", "float32")
    for directory in ("hf", "ct"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / directory, dtype=torch.float32).eval()
        assert isinstance(reloaded.get_input_embeddings(), torch.nn.Embedding)
        torch.testing.assert_close(logits(reloaded, ids), expected, rtol=1e-4, atol=1e-4)


def test_the_gguf_export_writes_the_table_as_its_own_tensor(untied, tiny_tokenizer, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from slimlm.gguf_export import export_gguf

    state = quantized(
        untied, tiny_tokenizer, tmp_path, bits=8, group_size=32
    )  # Q8_0's grid: the codes go over as they are
    export_gguf(state.model, tiny_tokenizer, tmp_path / "model.gguf", "Q8_0")
    tensors = {tensor.name: tensor for tensor in GGUFReader(tmp_path / "model.gguf").tensors}
    stored = tensors["token_embd.weight"]
    assert stored.tensor_type.name == "Q8_0" and "output.weight" in tensors
    values = torch.from_numpy(dequantize(stored.data, stored.tensor_type).copy()).reshape(
        untied.config.vocab_size, 64
    )
    torch.testing.assert_close(
        values, untied.get_input_embeddings().dequantize(), rtol=1e-3, atol=1e-6
    )  # the codes as they are (fp16 scales)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gemmas_scaled_embedding_keeps_its_scale(tiny_tokenizer, tmp_path, tie):
    """Gemma multiplies its embedding rows by sqrt(hidden): a quantized table must too. The
    reference is the float model with the very weights the codes stand for."""
    model = build_tiny("gemma3_text", len(tiny_tokenizer), tie_word_embeddings=tie)
    reference = build_tiny("gemma3_text", len(tiny_tokenizer), tie_word_embeddings=tie)
    quantized(model, tiny_tokenizer, tmp_path, bits=8)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, QuantEmbedding if tie else QuantTable) and embedding.scale == 8.0
    head = model.get_output_embeddings()
    assert isinstance(head, QuantLinear)
    with torch.no_grad():
        reference.get_output_embeddings().weight.copy_(head.dequantize())
        table = head if tie else embedding
        reference.get_input_embeddings().weight.copy_(table.dequantize())
        for name, module in model.named_modules():
            if isinstance(module, QuantLinear) and module is not head and module is not embedding:
                reference.get_submodule(name).weight.copy_(module.dequantize())
    ids = torch.randint(4, len(tiny_tokenizer), (2, 12))
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=1e-4, atol=1e-4)
