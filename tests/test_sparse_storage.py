import pytest
import torch

from slimlm.artifact import WEIGHTS, load_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.compress.sparsify import SparsifyParams
from slimlm.compress.sparsify import run as sparsify
from slimlm.errors import SlimlmError
from slimlm.eval.size import model_size
from slimlm.pipeline import RunState
from slimlm.sparse_storage import SparseCandidate, decode_bitmask, encode_bitmask, pack_bits, unpack_bits
from tests.test_artifact import export


def sparse_state(model, tokenizer, tmp_path, pattern: str, quantize_params: dict | None):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=model,
        tokenizer=tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    sparsify(state, SparsifyParams(method="magnitude", sparsity=0.5, pattern=pattern))
    if quantize_params is not None:
        quantize(state, QuantizeParams(**quantize_params))
    return state


def test_bits_pack_and_unpack():
    mask = torch.rand(5, 21, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(mask)
    assert packed.shape == (5, 3) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, 21), mask)


@pytest.mark.parametrize("codes", [False, True])
def test_bitmask_encoding_round_trips(codes):
    values = (
        torch.randint(0, 16, (6, 24), dtype=torch.uint8)
        if codes
        else torch.randn(6, 24) * (torch.rand(6, 24) > 0.6)
    )
    zero = 8 if codes else 0.0
    candidate = SparseCandidate("w.qweight" if codes else "w.weight", values, zero, 4 if codes else 32, codes)
    encoded = encode_bitmask(candidate)
    rebuilt = decode_bitmask(
        encoded[f"{candidate.key}.bitmask"],
        encoded[f"{candidate.key}.nonzeros"],
        [6, 24],
        zero,
        candidate.bits,
        codes,
    )
    if codes:
        from slimlm.packing import unpack_codes

        rebuilt = unpack_codes(rebuilt, 4)
    assert torch.equal(rebuilt, values)
    stored = sum(t.numel() * t.element_size() for t in encoded.values())
    assert stored == candidate.bitmask_bytes(candidate.nonzero)


@pytest.mark.parametrize(
    "pattern, quantize_params",
    [
        ("2:4", None),
        ("unstructured", {"bits": 4, "group_size": 32}),
        ("2:4", {"bits": 4, "group_size": 32, "symmetric": False}),
        ("unstructured", {"bits": 8}),
    ],
    ids=["fp32-2:4", "int4-50%", "int4-asym-2:4", "int8-50%"],
)
def test_sparse_artifact_round_trips_and_shrinks(
    tiny_model, tiny_tokenizer, tmp_path, pattern, quantize_params
):
    dense = export(
        RunState(
            cfg=None,
            run_dir=tmp_path,
            model=tiny_model,
            tokenizer=tiny_tokenizer,
            source=None,
            source_sha256=None,
            device=torch.device("cpu"),
        ),
        tmp_path / "dense",
    )
    state = sparse_state(tiny_model, tiny_tokenizer, tmp_path, pattern, quantize_params)
    path = export(state, tmp_path / "sparse")
    loaded = load_artifact(path)
    original, reloaded = state.model.state_dict(), loaded.model.state_dict()
    assert original.keys() == reloaded.keys()
    for name in original:
        assert torch.equal(original[name], reloaded[name]), name
    layer_keys = [key for key in loaded.manifest["sparse_tensors"] if key.startswith("model.layers.")]
    assert len(layer_keys) == 2 * 7  # every decoder Linear of both layers
    size = model_size(state.model)
    assert (
        size.stored_bytes < size.bytes and 0.3 < size.linear_zeros < 0.55
    )  # half the decoder weights; the head is dense
    dense_file, sparse_file = (dense / WEIGHTS).stat().st_size, (path / WEIGHTS).stat().st_size
    assert sparse_file < dense_file


def test_a_damaged_bitmask_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    import json

    path = export(sparse_state(tiny_model, tiny_tokenizer, tmp_path, "2:4", None), tmp_path / "sparse")
    manifest = json.loads((path / "manifest.json").read_text())
    key = next(iter(manifest["sparse_tensors"]))
    manifest["sparse_tensors"][key]["shape"][1] += 8  # the mask now claims more columns than the values fill
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SlimlmError, match=f"sparse tensor {key} cannot be rebuilt"):
        load_artifact(path)
