"""Recipes of the user's own, beside the bundled ones: a file anywhere, or directories of them.

`recipe=path/to/mine.yaml`, each *.yaml of the directories in $SLIMLM_RECIPES, and each
`<dir>/recipe/*.yaml` of a `hydra.searchpath=[file://<dir>]` become options of Hydra's `recipe`
group named by the file's stem, so they compose, sweep and are validated exactly like the
bundled recipes. One name means one file: a user's recipe named like a bundled one, or two
files with one name, is refused (Hydra would silently merge two options of one name).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Sequence

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slimlm.errors import SlimlmError

RECIPES_ENV = "SLIMLM_RECIPES"
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few dozen lines; anything this large is the wrong file
OPTION_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")  # what a Hydra override takes unquoted


def bundled_recipes() -> dict[str, DictConfig]:
    """The recipes installed with slimlm (the package `slimlm.recipe`), by name."""
    return {
        e.name.removesuffix(".yaml"): OmegaConf.create(e.read_text())
        for e in resources.files("slimlm.recipe").iterdir()
        if e.name.endswith(".yaml")
    }


@dataclass
class UserRecipes:
    """The user's recipes to register by name, those Hydra finds itself on hydra.searchpath,
    and the command line with each recipe path replaced by its name."""

    recipes: dict[str, tuple[Path, DictConfig]] = field(default_factory=dict)
    searched: dict[str, Path] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)

    def add(self, path: Path, bundled: Sequence[str]) -> str:
        """Read the recipe at `path` to register it (once); refuses a second file of its name."""
        name = path.name.removesuffix(".yaml")
        if not self.claimed(name, path):
            self.recipes[name] = (path, read_recipe(path, bundled))
        return name

    def check(self, path: Path, bundled: Sequence[str]) -> None:
        """Check a recipe Hydra loads itself (hydra.searchpath): its name and its YAML."""
        name = path.name.removesuffix(".yaml")
        if not self.claimed(name, path):
            read_recipe(path, bundled)
            self.searched[name] = path

    def claimed(self, name: str, path: Path) -> bool:
        """Whether `path` is known already under `name`; another file of that name is refused."""
        known = self.recipes[name][0] if name in self.recipes else self.searched.get(name)
        if known is not None and known.resolve() != path.resolve():
            raise SlimlmError(
                f"two recipe files are named '{name}': '{known}' and '{path}'; rename one of them"
            )
        return known is not None


def user_recipes(args: Sequence[str], bundled: Sequence[str]) -> UserRecipes:
    """The recipes of $SLIMLM_RECIPES, of `hydra.searchpath` and those `args` name by path."""
    found = UserRecipes()
    for directory in env_directories():
        for path in sorted(directory.glob("*.yaml")):
            found.add(path, bundled)
    for directory in searchpath_directories(args):
        for path in sorted(directory.glob("*.yaml")):
            found.check(path, bundled)
    found.args = [named_recipes(arg, found, bundled) for arg in args]
    return found


def env_directories() -> list[Path]:
    """Each directory of $SLIMLM_RECIPES (os.pathsep between them)."""
    directories = []
    for entry in filter(None, os.environ.get(RECIPES_ENV, "").split(os.pathsep)):
        directory = Path(entry).expanduser()
        if not directory.is_dir():
            raise SlimlmError(
                f"{RECIPES_ENV} names '{entry}', which is not a directory; "
                f"list directories of recipe .yaml files, separated by '{os.pathsep}'"
            )
        directories.append(directory)
    return directories


def searchpath_directories(args: Sequence[str]) -> list[Path]:
    """`<dir>/recipe` of each `file://<dir>` in a hydra.searchpath override: where Hydra looks
    for options of the `recipe` group (it loads them as they are: they must set `name`)."""
    entries = [
        entry[len("file://") :]
        for entry in override_values(args, "hydra.searchpath")
        if isinstance(entry, str) and entry.startswith("file://")
    ]
    return [Path(entry) / "recipe" for entry in entries if (Path(entry) / "recipe").is_dir()]


def override_values(args: Sequence[str], key: str) -> list:
    """The values (swept or listed) that `key=...` overrides in `args` give; [] when none parse."""
    values = []
    for arg in args:
        if not arg.startswith(f"{key}="):
            continue
        try:
            override = OverridesParser.create().parse_override(arg)
        except HydraException:  # left to Hydra, which reports it
            continue
        value = list(override.sweep_string_iterator()) if override.is_sweep_override() else override.value()
        values.extend(value if isinstance(value, list) else [value])
    return values


def named_recipes(arg: str, found: UserRecipes, bundled: Sequence[str]) -> str:
    """`arg` with each recipe given as a .yaml path replaced by the name it is registered under."""
    values = override_values([arg], "recipe")
    if not any(isinstance(value, str) and value.endswith(".yaml") for value in values):
        return arg
    names = [
        found.add(Path(value).expanduser(), bundled) if str(value).endswith(".yaml") else str(value)
        for value in values
    ]
    return "recipe=" + ",".join(names)


def read_recipe(path: Path, bundled: Sequence[str]) -> DictConfig:
    """The recipe in `path`, checked as far as a file can be before composition; its `name` is
    the file's stem unless it sets one, and `file` says where it came from."""
    shown = f"recipe file '{path}'"
    if not path.exists():
        raise SlimlmError(
            f"{shown} does not exist; give the path of a recipe .yaml file (relative "
            f"to the working directory) or a recipe name: {', '.join(sorted(bundled))}"
        )
    if not path.is_file():
        raise SlimlmError(
            f"{shown} is not a file; give one .yaml file, or put the directory holding them in ${RECIPES_ENV}"
        )
    stem = path.name.removesuffix(".yaml")
    if not OPTION_NAME.match(stem):
        raise SlimlmError(
            f"{shown}: rename the file to letters, digits and '_', "
            "'.', '+', '-' (its name becomes the recipe's option name)"
        )
    if stem in bundled:
        raise SlimlmError(
            f"{shown} is named like the bundled recipe '{stem}'; rename the file (e.g. my-{stem}.yaml)"
        )
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise SlimlmError(
            f"{shown} is {path.stat().st_size} bytes, larger than "
            f"any recipe ({MAX_RECIPE_BYTES} at most); check the path"
        )
    node = parse_mapping(path, shown)
    name = node.get("name")
    if name is None:
        node.name = stem
    elif name in bundled:
        raise SlimlmError(
            f"{shown} sets name: {name}, a bundled recipe's name, so its runs "
            f"would pass for that recipe's; set name: {stem} (or remove the line)"
        )
    node.file = str(path)
    return node


def parse_mapping(path: Path, shown: str) -> DictConfig:
    """The YAML mapping in `path` (duplicate keys refused, as for bundled recipes)."""
    try:
        text = path.read_text(encoding="utf-8")
        value = yaml.safe_load(text)
        node = OmegaConf.create(text) if isinstance(value, dict) else None
    except UnicodeDecodeError:
        raise SlimlmError(f"{shown} is not UTF-8 text; save the recipe as UTF-8 YAML") from None
    except yaml.MarkedYAMLError as error:
        raise SlimlmError(
            f"{shown} is not valid YAML ({error.problem} at line {error.problem_mark.line + 1}); fix it"
        ) from None
    except (yaml.YAMLError, OmegaConfBaseException) as error:
        raise SlimlmError(f"{shown} is not valid YAML ({' '.join(str(error).split())}); fix it") from None
    except OSError as error:
        raise SlimlmError(f"cannot read {shown} ({error.strerror}); check its permissions") from None
    if node is None:
        kind = "an empty file" if value is None else f"a YAML {type(value).__name__}"
        raise SlimlmError(
            f"{shown} holds {kind}, not a mapping; a recipe is a mapping with name, "
            "description and stages (see the bundled ones with `slimlm --cfg job recipe=demo`)"
        )
    return node
