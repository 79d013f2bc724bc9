import json
import os

import pytest
import torch

from slimlm.artifact import FORMAT_VERSION, WEIGHTS, load_artifact, read_manifest, save_artifact
from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.pipeline import RunState


def quantized_state(model, tokenizer, tmp_path, **params):
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
    return state


def export(state, path):
    return save_artifact(
        state.model, state.tokenizer, path, state.schemes, source={"id": "tiny"}, recipe={"name": "test"}
    )


@pytest.mark.parametrize(
    "params",
    [
        {"bits": 8},
        {"bits": 4, "group_size": 32, "symmetric": False},
        {"bits": 3, "group_size": 32},
        {"bits": 2, "group_size": 16},
    ],
    ids=str,
)
def test_round_trip_gives_identical_tensors_and_logits(tiny_model, tiny_tokenizer, tmp_path, params):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path, **params)
    path = export(state, tmp_path / "artifact")
    loaded = load_artifact(path)
    original = state.model.state_dict()
    reloaded = loaded.model.state_dict()
    assert original.keys() == reloaded.keys()
    for name in original:
        assert torch.equal(original[name], reloaded[name]), name
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(state.model(ids).logits, loaded.model(ids).logits)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert loaded.tokenizer("hello world")["input_ids"] == tiny_tokenizer("hello world")["input_ids"]
    assert loaded.manifest["modules"]["model.layers.0.self_attn.q_proj"]["bits"] == params["bits"]


def test_manifest_records_every_file(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    (path / ".DS_Store").write_bytes(b"a file manager's, read by no loader")
    manifest = read_manifest(path)
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json", ".DS_Store"}
    assert set(manifest["files"]) == on_disk
    assert manifest["format_version"] == FORMAT_VERSION


def test_damaged_weights_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-10] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(SlimlmError, match="checksum mismatch"):
        load_artifact(path)


def test_truncated_or_missing_files_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    (path / WEIGHTS).write_bytes((path / WEIGHTS).read_bytes()[:1000])
    with pytest.raises(SlimlmError, match="damaged"):
        load_artifact(path)
    (path / WEIGHTS).unlink()
    with pytest.raises(SlimlmError, match="missing"):
        load_artifact(path)


def test_newer_format_version_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = FORMAT_VERSION + 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SlimlmError, match="upgrade slimlm"):
        load_artifact(path)


def test_older_format_version_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SlimlmError, match="re-export it"):
        load_artifact(path)


def test_not_an_artifact(tmp_path):
    with pytest.raises(SlimlmError, match="not a slimlm artifact"):
        load_artifact(tmp_path)


def test_existing_artifact_is_never_overwritten(tiny_model, tiny_tokenizer, tmp_path):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path)
    path = export(state, tmp_path / "artifact")
    before = read_manifest(path)
    with pytest.raises(SlimlmError, match="already exists"):
        export(state, path)
    assert read_manifest(path) == before


def test_failed_write_leaves_nothing_behind(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path / "run")

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tiny_tokenizer), "save_pretrained", broken_save)
    with pytest.raises(OSError, match="disk full"):
        export(state, tmp_path / "out" / "artifact")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_killed_writers_staging_is_swept_by_the_next_write_and_a_live_ones_kept(tmp_path, caplog):
    import os
    import subprocess
    import sys

    from slimlm.rundir import staged_directory

    killed = (
        "import os, pathlib, signal, sys\n"
        "from slimlm.rundir import staged_directory\n"
        "with staged_directory(pathlib.Path(sys.argv[1])) as staging:\n"
        "    (staging / 'half').write_text('x')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path / "artifact")]).returncode == -9
    (abandoned,) = tmp_path.glob(".artifact-partial-*")
    live = tmp_path / f".artifact-partial-{os.getpid()}-writing"  # this process's: still running
    live.mkdir()
    with caplog.at_level("WARNING", logger="slimlm"), staged_directory(tmp_path / "artifact") as staging:
        (staging / "whole").write_text("x")
    assert not abandoned.exists() and live.exists() and (tmp_path / "artifact" / "whole").is_file()
    assert f"removed '{abandoned}', the unfinished output of an interrupted run" in caplog.text


def test_two_exports_of_one_model_are_byte_identical(tiny_model, tiny_tokenizer, tmp_path):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    first, second = export(state, tmp_path / "first"), export(state, tmp_path / "second")
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for file in first.iterdir():
        assert file.read_bytes() == (second / file.name).read_bytes(), file.name


def test_round_trip_of_a_quantized_tied_head(tiny_model, tiny_tokenizer, tmp_path):
    from slimlm.qlinear import QuantEmbedding

    state = quantized_state(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
    )
    loaded = load_artifact(export(state, tmp_path / "artifact")).model
    assert (
        isinstance(loaded.get_input_embeddings(), QuantEmbedding)
        and loaded.get_input_embeddings().head is loaded.lm_head
    )
    assert not any(
        "embed_tokens" in key for key in loaded.state_dict()
    )  # the table is stored once, as the head
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(state.model(ids).logits, loaded(ids).logits)


def test_manifest_accounts_for_the_size_and_records_shapes_and_sparsity(tiny_model, tiny_tokenizer, tmp_path):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    manifest = read_manifest(export(state, tmp_path / "artifact"))
    size = manifest["size"]
    assert size["weights_file_bytes"] == manifest["files"][WEIGHTS]["bytes"]
    assert abs(size["weights_file_bytes"] / size["weights_accounted_bytes"] - 1) < 0.03
    record = manifest["modules"]["model.layers.0.mlp.up_proj"]
    layer = state.model.get_submodule("model.layers.0.mlp.up_proj")
    assert record["shape"] == [layer.out_features, layer.in_features] and record["packing"] == "lsb-8"
    assert record["sparsity"] == pytest.approx((layer.dequantize() == 0).float().mean().item(), abs=1e-6)


def edit_manifest(path, edit) -> None:
    """Change the manifest as a hand edit would (its own checksum is not recorded anywhere)."""
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_manifest_shapes_that_disagree_with_config_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    edit_manifest(path, lambda m: m["modules"]["model.layers.0.mlp.up_proj"].update(shape=[7, 64]))
    with pytest.raises(SlimlmError, match=r"shape \[7, 64\], config.json gives"):
        load_artifact(path)


def test_a_missing_tensor_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    from slimlm.resources import sha256_file

    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path), tmp_path / "artifact")
    tensors = load_file(path / WEIGHTS)
    del tensors["model.layers.1.self_attn.o_proj.scales"]
    save_file(tensors, path / WEIGHTS)
    edit_manifest(
        path,
        lambda m: m["files"][WEIGHTS].update(
            sha256=sha256_file(path / WEIGHTS), bytes=(path / WEIGHTS).stat().st_size
        ),
    )
    with pytest.raises(SlimlmError, match=r"missing \['model.layers.1.self_attn.o_proj.scales'\]"):
        load_artifact(path)


def unlist_weights(path):
    """The weights file's checksum dropped from the manifest, and a byte of it flipped."""
    edit_manifest(path, lambda m: m["files"].pop(WEIGHTS))
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-10] ^= 0xFF
    (path / WEIGHTS).write_bytes(bytes(data))


DAMAGES = {
    "unlisted weights": (unlist_weights, "has no checksum"),
    "no files": (lambda path: edit_manifest(path, lambda m: m.pop("files")), "'files' must map"),
    "a path outside": (
        lambda path: edit_manifest(
            path, lambda m: m["files"].update({"../elsewhere.txt": {"sha256": "0" * 64, "bytes": 1}})
        ),
        "not a file of the artifact",
    ),
    "a list": (lambda path: (path / "manifest.json").write_text("[1, 2]"), "JSON list, not an object"),
    "no modules": (lambda path: edit_manifest(path, lambda m: m.update(modules=None)), "'modules' must map"),
    "5-bit codes": (
        lambda path: edit_manifest(path, lambda m: m["modules"]["model.layers.0.mlp.up_proj"].update(bits=5)),
        "does not write",
    ),
    "version as text": (
        lambda path: edit_manifest(path, lambda m: m.update(format_version=str(FORMAT_VERSION))),
        "not a whole number",
    ),
    "an unknown dtype": (
        lambda path: edit_manifest(path, lambda m: m.update(dtype="float64x")),
        "not a torch dtype",
    ),
    "codes of another width": (
        lambda path: edit_manifest(
            path, lambda m: m["modules"]["model.layers.0.mlp.up_proj"].update(bits=4, group_size=32)
        ),
        "weights do not match its manifest",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=str)
def test_a_damaged_or_incomplete_manifest_is_refused_in_one_line(
    tiny_model, tiny_tokenizer, tmp_path, damage
):
    from slimlm.inference.load import load_decoder

    path = export(quantized_state(tiny_model, tiny_tokenizer, tmp_path, bits=8), tmp_path / "artifact")
    make, message = DAMAGES[damage]
    make(path)
    for load in (load_artifact, load_decoder):
        with pytest.raises(SlimlmError, match=message):
            load(path)


def sharded_export(state, path, max_shard_bytes=20_000):
    return save_artifact(
        state.model,
        state.tokenizer,
        path,
        state.schemes,
        source={"id": "tiny"},
        max_shard_bytes=max_shard_bytes,
    )


def test_a_sharded_artifact_loads_as_the_single_file_one(tiny_model, tiny_tokenizer, tmp_path):
    from safetensors import safe_open

    from slimlm.inference.load import load_decoder

    state = quantized_state(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        bits=4,
        group_size=32,
        targets=[r"model\.layers\.\d+\..*", "lm_head"],
    )
    single, sharded = export(state, tmp_path / "single"), sharded_export(state, tmp_path / "sharded")
    manifest = read_manifest(sharded)
    shards = sorted(name for name in manifest["files"] if name.startswith("model-"))
    assert (
        len(shards) > 2
        and "model.safetensors.index.json" in manifest["files"]
        and not (sharded / WEIGHTS).exists()
    )
    for shard in shards:
        with safe_open(sharded / shard, "pt") as handle:
            assert (
                sum(handle.get_tensor(key).nbytes for key in handle.keys()) <= 20_000
                or len(handle.keys()) == 1
            )
    assert manifest["size"]["weights_file_bytes"] == sum(
        manifest["files"][shard]["bytes"] for shard in shards
    )
    assert (
        manifest["size"]["weights_accounted_bytes"]
        == read_manifest(single)["size"]["weights_accounted_bytes"]
    )
    a, b = load_artifact(single).model.state_dict(), load_artifact(sharded).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tokens = torch.randint(0, tiny_model.config.vocab_size, (1, 8))
    decoders = [load_decoder(path, dtype=torch.float32)[0] for path in (single, sharded)]
    for decoder in decoders:
        decoder.setup_cache(1, 16)
    with torch.inference_mode():
        assert torch.equal(decoders[0](tokens, 0), decoders[1](tokens, 0))


def rewrite_index(path, edit) -> None:
    """The index edited and its checksum updated, so that only the index checks can find it."""
    from slimlm.resources import sha256_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))
    edit_manifest(
        path,
        lambda m: m["files"]["model.safetensors.index.json"].update(
            sha256=sha256_file(index_file), bytes=index_file.stat().st_size
        ),
    )


INDEX_DAMAGES = {
    "a file outside": (
        lambda m: m.update({"model.norm.weight": "../x.safetensors"}),
        "not a safetensors file of its directory",
    ),
    "a tensor moved": (lambda m: m.update({"model.norm.weight": m["lm_head.qweight"]}), "the index puts"),
    "a tensor dropped": (
        lambda m: m.pop("model.norm.weight"),
        "the index puts there|holds model.norm.weight",
    ),
}


@pytest.mark.parametrize("damage", INDEX_DAMAGES, ids=str)
def test_a_damaged_shard_index_is_refused_in_one_line(tiny_model, tiny_tokenizer, tmp_path, damage):
    from slimlm.inference.load import load_decoder

    state = quantized_state(
        tiny_model, tiny_tokenizer, tmp_path, bits=8, targets=[r"model\.layers\.\d+\..*", "lm_head"]
    )
    path = sharded_export(state, tmp_path / "artifact")
    rewrite_index(path, INDEX_DAMAGES[damage][0])
    for load in (load_artifact, load_decoder):
        with pytest.raises(SlimlmError, match=INDEX_DAMAGES[damage][1]):
            load(path)


def test_a_format_5_artifact_still_loads(tiny_model, tiny_tokenizer, tmp_path):
    state = quantized_state(tiny_model, tiny_tokenizer, tmp_path, bits=4, group_size=32)
    path = export(state, tmp_path / "artifact")
    edit_manifest(path, lambda m: m.update(format_version=5))
    reloaded = load_artifact(path).model.state_dict()
    assert all(torch.equal(tensor, reloaded[name]) for name, tensor in state.model.state_dict().items())


def test_exports_get_the_permissions_open_and_mkdir_give(tmp_path):
    """Staged outputs come from tempfile, which makes them private (0700 / 0600); renamed into
    place they must be readable by others as any file the process writes (umask 022 here)."""
    from slimlm.rundir import staged_directory, write_atomic

    old = os.umask(0o022)
    try:
        with staged_directory(tmp_path / "artifact") as staging:
            write_atomic(staging / "manifest.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "artifact").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "artifact" / "manifest.json").stat().st_mode & 0o777 == 0o644
