"""Compression beyond the Llama family: tiny random-weight Qwen3, Gemma 3, Phi-3, Mixtral,
Qwen3-MoE and OLMoE models through every calibrated method, evaluation and the
compressed-tensors export, and the family table's AWQ mappings checked for exactness."""

import json

import pytest
import torch

from slimlm.architecture import check_compressible, decoder_blocks, family_of, model_type
from slimlm.compress.awq import apply_scale, expand_experts, feeding_rows
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.compress.sparsify import SparsifyParams
from slimlm.compress.sparsify import run as sparsify
from slimlm.errors import SlimlmError
from slimlm.eval.perplexity import score_text
from slimlm.experts import ExpertList
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantLinear
from tests.conftest import CALIBRATION
from tests.tiny_families import FAMILY_TYPES, MOE_TYPES, build_tiny

VOCAB = 384


@pytest.fixture(scope="module")
def calibration_ids(tiny_tokenizer) -> torch.Tensor:
    return torch.tensor(tiny_tokenizer(CALIBRATION.read_text(encoding="utf-8")[:40_000])["input_ids"])


def state_for(model, tokenizer, ids, tmp_path) -> RunState:
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    state.memo.calibration_ids = ids  # what calibration_windows reads; no config needed
    return state


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_awq_mappings_fold_scales_without_changing_the_function(family):
    """Every mapping of the family's table, scaled by random factors, leaves the logits as they
    were: the table names the operation that really feeds each group of layers, with the right
    norm convention (Gemma's 1 + w) and the right rows of fused projections (Phi-3)."""
    model = build_tiny(family, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    folded = 0
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in decoder_blocks(model)[1]:
            for mapping in expand_experts(family_of(family).mappings, block):
                linears = [block.get_submodule(name) for name in mapping.linears]
                previous = block.get_submodule(mapping.previous)
                rows = feeding_rows(previous, linears[0].in_features, mapping)
                if rows is not None:
                    apply_scale(
                        previous,
                        rows,
                        linears,
                        torch.rand(linears[0].in_features, generator=generator) * 4 + 0.25,
                        mapping.norm_offset,
                    )
                    folded += 1
    expected = {"llama": 6, "qwen3": 6, "gemma3_text": 6, "phi3": 8}.get(
        family, 2 * (1 + 8)
    )  # GQA skips v -> o; MoE: norm -> q/k/v and up -> down of each of 8 experts
    assert folded == expected
    torch.testing.assert_close(logits(model, ids), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_every_family_quantizes_and_stays_close(family, method, tiny_tokenizer, calibration_ids, tmp_path):
    model = build_tiny(family, VOCAB)
    reference = build_tiny(family, VOCAB)
    state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
    quantize(
        state,
        QuantizeParams(
            method=method, bits=8, group_size=16, samples=4, seq_len=64, awq_grid=4, awq_clip_grid=4
        ),
    )
    quantized = [name for name, module in model.named_modules() if isinstance(module, QuantLinear)]
    linear_count = sum(
        1
        for name, module in reference.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    )
    assert len(quantized) == linear_count and len(state.schemes) == linear_count
    ids = calibration_ids[:256]
    original = score_text(reference, ids, window=128, collect_top_k=16)
    scores = score_text(model, ids, window=128, reference=original.reference)
    assert torch.isfinite(torch.tensor(scores.perplexity.ppl))
    assert scores.distance["kl_mean"] < 0.01  # 8-bit groups of 16: nearly the original
    section = state.sections["quantization"][0]
    if method == "awq":
        assert section["awq_output_error"]  # the family's table scaled something


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_sparsegpt_prunes_every_family(family, tiny_tokenizer, calibration_ids, tmp_path):
    model = build_tiny(family, VOCAB)
    state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
    sparsify(state, SparsifyParams(method="sparsegpt", sparsity=0.5, samples=4, seq_len=64))
    section = state.sections["sparsity"][0]
    assert section["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert torch.isfinite(logits(model, calibration_ids[None, :64])).all()


@pytest.mark.parametrize("family", MOE_TYPES)
def test_experts_are_quantized_one_by_one_and_routers_stay_float(
    family, tiny_tokenizer, calibration_ids, tmp_path
):
    model = build_tiny(family, VOCAB)
    state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
    quantize(state, QuantizeParams(method="gptq", bits=4, group_size=16, samples=4, seq_len=64))
    experts = [module for module in model.modules() if isinstance(module, ExpertList)]
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    assert len(experts) == 2 and all(
        isinstance(getattr(expert[e], name), QuantLinear)
        for expert in experts
        for e in range(8)
        for name in names
    )
    routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    assert routers and not any(isinstance(router, QuantLinear) for router in routers)
    assert all(router.weight.dtype == torch.float32 for router in routers)


class AvoidingRouter(torch.nn.Module):
    """Qwen3-MoE's top-k routing (softmax, top k, renormalised) with one expert never chosen."""

    def __init__(self, router: torch.nn.Module, avoided: int):
        super().__init__()
        self.router, self.avoided = router, avoided

    def forward(self, hidden: torch.Tensor):
        logits = torch.nn.functional.linear(hidden.reshape(-1, self.router.hidden_dim), self.router.weight)
        probabilities = (
            logits.float()
            .masked_fill(torch.arange(logits.shape[1]) == self.avoided, float("-inf"))
            .softmax(-1)
        )
        top, index = probabilities.topk(self.router.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), index


def test_an_expert_no_token_reaches_is_rounded_not_broken(tiny_tokenizer, calibration_ids, tmp_path):
    """Expert 3 of every layer sees no calibration token: it gets RTN (its scheme says so),
    never NaN or a crash, while the others are calibrated."""
    for method in ("gptq", "awq"):
        model = build_tiny("qwen3_moe", VOCAB)
        for block in decoder_blocks(model)[1]:
            block.mlp.gate = AvoidingRouter(block.mlp.gate, avoided=3)
        state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
        quantize(
            state,
            QuantizeParams(
                method=method, bits=4, group_size=16, samples=4, seq_len=64, awq_grid=4, awq_clip_grid=4
            ),
        )
        unseen = state.sections["quantization"][0]["uncalibrated_layers"]
        assert sorted(unseen) == sorted(
            f"model.layers.{i}.mlp.experts.3.{p}"
            for i in range(2)
            for p in ("gate_proj", "up_proj", "down_proj")
        )
        assert all(state.schemes[name]["method"] == "rtn" for name in unseen)
        assert state.schemes["model.layers.0.mlp.experts.0.down_proj"]["method"] == method
        assert all(torch.isfinite(model.get_submodule(name).dequantize()).all() for name in unseen)


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_compressed_tensors_export_of_every_family_reloads_with_the_same_logits(
    family, tiny_tokenizer, calibration_ids, tmp_path
):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from slimlm.ct_export import export_compressed

    model = build_tiny(family, VOCAB)
    state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
    quantize(state, QuantizeParams(method="gptq", bits=4, group_size=16, samples=4, seq_len=64))
    export_compressed(model, tiny_tokenizer, tmp_path / "ct", "float32")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    if family in MOE_TYPES:
        # transformers decompresses experts into its fused layout in the scales' dtype (fp16):
        # each expert weight must be ours rounded once to fp16, exactly
        names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        fused, ours = loaded.model.layers[1].mlp.experts, model.model.layers[1].mlp.experts[2]
        gate_up = torch.cat([getattr(ours, names[0]).dequantize(), getattr(ours, names[1]).dequantize()])
        assert torch.equal(fused.gate_up_proj[2], gate_up.half()) and torch.equal(
            fused.down_proj[2], getattr(ours, names[2]).dequantize().half()
        )
        torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=5e-3, atol=5e-3)
    else:
        torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["model_type"] == model.config.model_type


def test_a_model_without_attention_blocks_is_refused_before_loading(tmp_path):
    from transformers import MambaConfig

    from slimlm.config import ModelConfig
    from slimlm.models import resolve_model

    MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB).save_pretrained(
        tmp_path
    )  # a config and no weights at all
    with pytest.raises(SlimlmError, match="'mamba', a model without attention blocks"):
        resolve_model(ModelConfig(name="m", path=str(tmp_path)))
    with pytest.raises(SlimlmError, match="does not build as a causal language model"):
        check_compressible("x", "t5")


def test_gemma3_is_found_inside_its_multimodal_config():
    assert model_type(build_tiny("gemma3_text", VOCAB)) == "gemma3_text"
    assert family_of("gemma3") is family_of("gemma3_text") is not None
    check_compressible("gemma", "gemma3")  # the multimodal wrapper has a text decoder with attention


def test_awq_and_prune_refuse_a_family_without_a_table_before_loading(tmp_path):
    from transformers import GPT2Config

    from slimlm.compress.prune import PruneParams
    from slimlm.compress.prune import check as check_prune
    from slimlm.compress.quantize import check as check_quantize
    from slimlm.models import ModelSource

    GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB).save_pretrained(tmp_path)
    source = ModelSource(str(tmp_path), "hf-dir", tmp_path, "gpt2")
    with pytest.raises(SlimlmError, match="AWQ needs a table .* 'gpt2' has none"):
        check_quantize(None, QuantizeParams(method="awq", bits=4, group_size=16), source)
    check_quantize(
        None, QuantizeParams(method="rtn", bits=4, group_size=16), source
    )  # RTN works on any family
    qwen3 = ModelSource(str(tmp_path), "hf-dir", tmp_path, "qwen3")
    with pytest.raises(SlimlmError, match="cannot be pruned yet"):
        check_prune(_calibration_cfg(), PruneParams(layers=1), qwen3)


def _calibration_cfg():
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {"data": {"calibration": {"path": str(CALIBRATION), "format": "text", "field": "text"}}}
    )


@pytest.mark.parametrize("family", FAMILY_TYPES)
def test_slimlm_artifact_of_every_family_loads_with_the_same_logits(
    family, tiny_tokenizer, calibration_ids, tmp_path
):
    from slimlm.artifact import load_artifact, save_artifact

    model = build_tiny(family, VOCAB)
    state = state_for(model, tiny_tokenizer, calibration_ids, tmp_path)
    quantize(state, QuantizeParams(method="rtn", bits=4, group_size=16))
    save_artifact(model, tiny_tokenizer, tmp_path / "artifact", state.schemes, {"id": family})
    loaded = load_artifact(tmp_path / "artifact").model
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(loaded, ids), logits(model, ids))
