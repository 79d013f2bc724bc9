"""Reading a checkpoint one tensor at a time (slimlm/checkpoint.py) and writing shards (slimlm/shards.py)."""

import json
import shutil

import pytest
import torch

from slimlm.checkpoint import Checkpoint, open_checkpoint
from slimlm.errors import SlimlmError
from slimlm.shards import INDEX, TensorSpec, plan_shards, write_weights
from tests.conftest import build_tiny_llama


@pytest.fixture
def sharded_dir(tmp_path, tiny_tokenizer):
    """An untied tiny Llama saved by transformers in shards of about 40 kB."""
    model = build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=False)
    directory = tmp_path / "sharded"
    model.save_pretrained(directory, max_shard_size="40KB")
    tiny_tokenizer.save_pretrained(directory)
    assert (directory / INDEX).is_file()
    return directory, model


def test_reads_every_tensor_of_a_sharded_checkpoint(sharded_dir):
    directory, model = sharded_dir
    checkpoint = Checkpoint(directory)
    state = model.state_dict()
    assert sorted(checkpoint.names()) == sorted(state)
    for name, tensor in state.items():
        assert checkpoint.shape(name) == tuple(tensor.shape)
        assert torch.equal(checkpoint.tensor(name), tensor), name
    assert checkpoint.weight_bytes() == sum(t.numel() * t.element_size() for t in state.values())
    assert checkpoint.tensor("model.norm.weight", torch.bfloat16).dtype == torch.bfloat16


def test_a_tensor_is_a_copy_of_its_own_not_a_view_of_the_mapped_file(sharded_dir, monkeypatch):
    import slimlm.checkpoint

    directory, model = sharded_dir
    monkeypatch.setattr(slimlm.checkpoint, "READ_CHUNK_BYTES", 1000)  # several runs of rows
    tensor = Checkpoint(directory).tensor("model.embed_tokens.weight")
    assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert torch.equal(tensor, model.model.embed_tokens.weight)


def test_materialize_block_by_block_gives_the_models_logits(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    checkpoint, skeleton = open_checkpoint(tiny_model_dir, torch.float32)
    assert "lm_head.weight" in checkpoint.ties  # tied: not stored, read as the embedding
    checkpoint.materialize(skeleton, "", torch.device("cpu"))
    assert (
        skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    )  # a tie inside the module stays one tensor
    assert not skeleton.model.rotary_emb.inv_freq.is_meta
    ids = torch.randint(0, len(tiny_tokenizer), (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(skeleton(ids).logits, reference(ids).logits, rtol=0, atol=0)
    block = skeleton.model.layers[1]
    checkpoint.release(block)
    assert all(p.is_meta for p in block.parameters())
    checkpoint.materialize(block, "model.layers.1.", torch.device("cpu"), torch.bfloat16)
    assert block.self_attn.q_proj.weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        block.mlp.up_proj.weight, reference.model.layers[1].mlp.up_proj.weight.bfloat16()
    )
    checkpoint.materialize(
        skeleton.lm_head, "lm_head.", torch.device("cpu")
    )  # alone: a copy of the embedding
    assert torch.equal(skeleton.lm_head.weight, reference.model.embed_tokens.weight)


def test_materialize_refuses_a_missing_tensor_by_name(sharded_dir):
    directory, _ = sharded_dir
    _, skeleton = open_checkpoint(directory)
    with pytest.raises(
        SlimlmError, match="lacks 1 tensors of model.layers.0. .e.g. model.layers.0.extra.weight"
    ):
        skeleton.model.layers[0].extra = torch.nn.Linear(2, 2, bias=False, device="meta")
        Checkpoint(directory).materialize(skeleton.model.layers[0], "model.layers.0.", torch.device("cpu"))


def rewrite_index(directory, edit):
    index = json.loads((directory / INDEX).read_text())
    edit(index["weight_map"])
    (directory / INDEX).write_text(json.dumps(index))


INDEX_DAMAGES = {
    "a file outside": (
        lambda d: rewrite_index(d, lambda m: m.update({"model.norm.weight": "../model.safetensors"})),
        "not a safetensors file of its directory",
    ),
    "a missing file": (
        lambda d: rewrite_index(
            d, lambda m: m.update({"model.norm.weight": "model-00099-of-00099.safetensors"})
        ),
        "does not hold; the checkpoint is incomplete",
    ),
    "a tensor moved": (
        lambda d: rewrite_index(d, lambda m: m.update({"model.norm.weight": m["model.embed_tokens.weight"]})),
        "the index puts",
    ),
    "no weight map": (lambda d: (d / INDEX).write_text('{"metadata": {}}'), "no weight_map"),
    "both layouts": (
        lambda d: shutil.copy(next(d.glob("model-*.safetensors")), d / "model.safetensors"),
        "holds both",
    ),
    "no weights": (
        lambda d: [f.unlink() for f in [*d.glob("*.safetensors"), d / INDEX]],
        "holds no model.safetensors",
    ),
    "a truncated shard": (
        lambda d: (lambda f: f.write_bytes(f.read_bytes()[:100]))(next(d.glob("model-*.safetensors"))),
        "not a readable safetensors file",
    ),
}


@pytest.mark.parametrize("damage", INDEX_DAMAGES, ids=str)
def test_a_damaged_index_or_shard_is_refused_in_one_line(sharded_dir, damage):
    directory, _ = sharded_dir
    make, message = INDEX_DAMAGES[damage]
    make(directory)
    with pytest.raises(SlimlmError, match=message) as error:
        Checkpoint(directory)
    assert "\n" not in str(error.value)


def test_a_tensor_in_two_shards_is_refused(sharded_dir):
    from safetensors.torch import load_file, save_file

    directory, _ = sharded_dir
    first, second = sorted(directory.glob("model-*.safetensors"))[:2]
    tensors = load_file(second)
    tensors.update(load_file(first))
    save_file(tensors, second, metadata={"format": "pt"})
    with pytest.raises(SlimlmError, match="is in both|the index puts"):
        Checkpoint(directory)


def test_shards_are_bounded_and_transformers_reads_their_index(tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(len(tiny_tokenizer), tie_word_embeddings=False)
    state = model.state_dict()
    specs = [TensorSpec.of(name, tensor) for name, tensor in state.items()]
    limit = 40_000
    assert all(
        sum(s.nbytes for s in shard) <= limit or len(shard) == 1 for shard in plan_shards(specs, limit)
    )
    directory = tmp_path / "written"
    directory.mkdir()
    files = write_weights(directory, specs, lambda spec: state[spec.name], limit, {"format": "pt"})
    assert files[-1] == INDEX and len(files) > 3
    model.config.save_pretrained(directory)
    reloaded = AutoModelForCausalLM.from_pretrained(directory)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    norms = [spec for spec in specs if "norm" in spec.name]
    assert write_weights(tmp_path, norms, lambda spec: state[spec.name], limit) == [
        "model.safetensors"
    ]  # one shard: the single-file name
