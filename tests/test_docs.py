"""The README and the docs/ pages are true of the code:

- every file they name exists: each relative Markdown link, and each repository path they quote in
  code spans (`bench/results/x.md`, `inference/load.py`);
- every `slimlm` command in their fenced shell blocks parses. A Hydra run (`slimlm recipe=...
  key=value`) runs in-process with `--cfg job` appended and must exit 0 (a sweep: each swept value);
  `--cfg job` only composes the config (Hydra checks group options, key names and types), so the
  config it prints is then put through slimlm's value checks (the schemas' `__post_init__`) and the
  recipe's stages through `plan_stages` (each stage's keys and values). A subcommand (`generate`,
  `chat`, `serve`, `plan`, `compare`, `lm-eval`) runs in-process with its real argparse parser and
  the checks after it, and is stopped where it would first load a model, bind a port, read an
  artifact, compute a plan or start the harness (`slimlm --help` alone is taken as it is);
- every complete recipe or stage list in a fenced YAML block passes `plan_stages`;
- every `python bench/x.py` / `bash bench/x.sh` line names a script that exists and flags it has;
- the import rules in docs/architecture.md's dependency table hold;
- the README starts with `make demo` and `make test`, stays short, and links every docs page.

Placeholders (ARTIFACT, /path/to/checkpoint, runs/my-w4/artifact) are fine: nothing is loaded. A
recipe file that the repository does not hold (`recipe=path/to/mine.yaml`) is stood in for by a
minimal recipe of that name.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Quoted paths under these folders; distill/ is left out: the pages quote a run directory's distill/ too.
QUOTED = re.compile(r"`((?:bench|docs|examples|recipes|conf|eval|inference|compress|slimlm|tests)/[^`\s]+)`")
FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console", "zsh"}
SLIMLM = ("slimlm", ".venv/bin/slimlm")
SUBCOMMANDS = ("compare", "lm-eval", "generate", "chat", "plan", "serve")


def named_files(page) -> list[str]:
    text = page.read_text()
    links = [
        target.split("#")[0]
        for target in LINK.findall(text)
        if "://" not in target and not target.startswith(("#", "mailto:"))
    ]
    quoted = [
        target.split(":")[0]
        for target in QUOTED.findall(text)
        if not any(mark in target for mark in "<*{$") and not target.startswith("bench/runs/")
    ]
    return [name for name in links + quoted if name]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_file_a_page_names_exists(page):
    names = named_files(page)
    missing = [name for name in names if not (page.parent / name).exists() and not (REPO / name).exists()]
    assert names and not missing, f"{page.name} names files that do not exist: {missing}"


# ---- fenced blocks and the commands in them ------------------------------------------------


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of content
    language: str
    text: str


def fenced_blocks(page: Path) -> list[Block]:
    blocks, language, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        match = FENCE.match(line.strip())
        if language is None and match:
            language, start, body = match.group(1).lower(), number + 1, []
        elif language is not None and line.strip() == "```":
            blocks.append(Block(page, start, language, "\n".join(body)))
            language = None
        elif language is not None:
            body.append(line)
    return blocks


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    text: str
    args: tuple[str, ...]  # after `slimlm`

    @property
    def id(self) -> str:
        return f"{self.page.name}:{self.line}"


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """The block's command lines, continuation lines joined, a `$ ` prompt dropped."""
    lines, pending, first = [], "", 0
    for offset, raw in enumerate(block.text.splitlines()):
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not pending:
            first = block.line + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((first, pending + line))
        pending = ""
    return lines


def commands(pages=PAGES) -> list[Command]:
    found = []
    for page in pages:
        for block in fenced_blocks(page):
            if block.language not in SHELL_LANGUAGES:
                continue
            for number, line in shell_lines(block):
                words = shlex.split(line, comments=True)
                if words and words[0] in SLIMLM:
                    found.append(Command(page, number, line, tuple(words[1:])))
    return found


COMMANDS = commands()


def test_the_pages_show_commands_of_every_kind():
    """The extraction itself: a broken fence parser would otherwise check nothing."""
    kinds = {c.args[0] if c.args and c.args[0] in SUBCOMMANDS else "run" for c in COMMANDS}
    assert len(COMMANDS) >= 40 and kinds >= {"run", *SUBCOMMANDS}, sorted(kinds)


# ---- checking one command ----------------------------------------------------------------


class Stopped(Exception):
    """Raised where a subcommand would first load a model, listen, read a model's files or
    start the harness: its arguments have passed the real parser and the checks after it."""


STUB_RECIPE = "description: a stand-in for a recipe file the docs name\nstages:\n  - stage: evaluate\n"


def stand_in_recipes(args: list[str], folder: Path) -> list[str]:
    """`recipe=x.yaml` values the repository does not hold, pointed at minimal recipes of the
    same name (the name is the file's stem); those it holds, at the repository's file."""
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("+") != "recipe" or ".yaml" not in value:
            out.append(arg)
            continue
        parts = []
        for option in value.split(","):
            if option.endswith(".yaml"):
                path = REPO / option
                if not path.is_file():
                    path = folder / Path(option).name
                    path.write_text(STUB_RECIPE)
                option = str(path)
            parts.append(option)
        out.append(f"{key}={','.join(parts)}")
    return out


def sweep_combinations(overrides: list[str]) -> list[list[str]]:
    """Each swept value with the other overrides at their first value (as slimlm's own
    pre-validation checks a sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    combinations = [[c[0] for c in choices]]
    for position, values in enumerate(choices):
        for value in values[1:]:
            combinations.append([value if i == position else c[0] for i, c in enumerate(choices)])
    return combinations


@functools.lru_cache(maxsize=1)
def bundled_recipes_once() -> dict:
    from slimlm.user_recipes import bundled_recipes

    return bundled_recipes()


def run_main(args: list[str]) -> tuple[int, str, str]:
    """slimlm's main in this process: (exit code, stdout, stderr); Stopped counts as 0. The
    bundled recipes are read once for all commands (main reads them on every call)."""
    from slimlm import cli

    out, err = io.StringIO(), io.StringIO()
    argv, handler = list(sys.argv), signal.getsignal(signal.SIGTERM)
    reader = cli.bundled_recipes
    code = 0
    try:
        cli.bundled_recipes = lambda: dict(bundled_recipes_once())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(args)
    except Stopped:
        pass
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
    except Exception as error:  # noqa: BLE001 - any other exception is a failure to report
        code, err = 1, io.StringIO(f"{err.getvalue()}{type(error).__name__}: {error}")
    finally:
        cli.bundled_recipes = reader
        sys.argv[:] = argv
        signal.signal(signal.SIGTERM, handler)
    return code, out.getvalue(), err.getvalue()


def check_composed(printed: str) -> None:
    """What `--cfg job` leaves out: the schemas' value checks and each stage's parameters."""
    from omegaconf import OmegaConf

    from slimlm.cli import STAGES
    from slimlm.config import SlimlmConfig
    from slimlm.pipeline import plan_stages

    cfg = OmegaConf.merge(OmegaConf.structured(SlimlmConfig), OmegaConf.create(printed))
    OmegaConf.to_object(cfg)
    plan_stages(cfg.recipe.stages, STAGES)


def check_hydra_run(args: list[str], folder: Path) -> str | None:
    args = stand_in_recipes(args, folder)
    if args in (["--help"], ["-h"]):
        return None  # Hydra's help takes nothing to parse (and lists every group option: seconds)
    if {"--help", "-h", "--hydra-help", "--info"} & set(args):
        code, _, err = run_main(args)
        return None if code == 0 else f"exit {code}: {err.strip()[-800:]}"
    if "--cfg" in args:
        runs = [args]
    else:
        overrides = [a for a in args if a not in ("-m", "--multirun")]
        runs = [[*combination, "--cfg", "job"] for combination in sweep_combinations(overrides)]
    for run in runs:
        code, out, err = run_main(run)
        if code != 0:
            return f"`slimlm {' '.join(run)}` exited {code}: {err.strip()[-800:]}"
        if run[run.index("--cfg") + 1] == "job":
            try:
                check_composed(out)
            except Exception as error:  # noqa: BLE001 - slimlm's ConfigError, OmegaConf's errors
                return f"`slimlm {' '.join(run)}` composes a config slimlm refuses: {error}"
    return None


@contextlib.contextmanager
def stopped_before_work():
    """Subcommands run their real parsers and checks, and stop where the work would start."""
    from slimlm.eval import compare
    from slimlm.inference import cli, planner
    from slimlm.inference.planner import preset_names

    def stop(*args, **kwargs):
        raise Stopped

    planner_config = cli.planner_config

    def plan_presets_only(model, path, presets):
        if model in preset_names():
            return planner_config(model, path, presets)
        raise Stopped

    patches = [
        (cli, "open_decoder", stop),  # generate, chat, serve: loading the model
        (cli, "listen", stop),  # serve: binding the port (before the model loads)
        (cli, "planner_config", plan_presets_only),  # plan: reading a model's config and manifest
        (planner, "make_plan", stop),  # plan of a preset: after its flags are checked against its shapes
        (compare, "compare", stop),  # compare: reading the runs' reports
    ]
    try:
        from lm_eval._cli import HarnessCLI

        patches.append((HarnessCLI, "execute", stop))  # lm-eval: the harness's run, after its parser
    except ImportError:
        pass
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def check_subcommand(args: list[str]) -> str | None:
    if args[0] == "lm-eval":
        pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed")
    with stopped_before_work():
        code, _, err = run_main(args)
    return None if code == 0 else f"exit {code}: {err.strip()[-800:]}"


def check(args: tuple[str, ...], folder: Path) -> str | None:
    """None when the command parses, else why not."""
    if args and args[0] in SUBCOMMANDS:
        return check_subcommand(list(args))
    return check_hydra_run(list(args), folder)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_every_command_shown_parses(command, tmp_path):
    problem = check(command.args, tmp_path)
    assert problem is None, f"{command.id}: `{command.text}`\n{problem}"


@pytest.mark.parametrize(
    "args",
    [
        "recipe=nope",  # Hydra: no such recipe
        "eval.bogus=1",  # Hydra: no such key
        "eval.perplexity.window=1",  # the schema's value check, which --cfg job skips
        "recipe=w4-gptq recipe.stages.1.bits=5",  # the stage's check, which --cfg job skips
        "recipe=w4-gptq +recipe.stages.1.bitz=3",
        "-m recipe=w4-rtn,nope",
        "generate ARTIFACT hello --no-such-flag",
        "generate ARTIFACT hello --compile --prompt-lookup",
        "chat ARTIFACT --context 4096",
        "serve ARTIFACT --cache-rows 2",
        "serve ARTIFACT --port 70000",
        "plan llama-3-8b --bits 5",
        "plan llama-3-8b --hardware laptop-4gb",
        "plan llama-3-8b --bits 4 --group-size 100",  # refused against the preset's shapes
        "compare",
        "lm-eval run --model slimlm --no-such-flag",
    ],
)
def test_the_check_refuses_a_broken_command(args, tmp_path):
    assert check(tuple(shlex.split(args)), tmp_path) is not None


# ---- YAML recipes and bench scripts ---------------------------------------------------------


def yaml_recipes() -> list[tuple[str, list]]:
    """The stage lists of fenced YAML blocks that hold a recipe or a list of stages."""
    found = []
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.language not in ("yaml", "yml"):
                continue
            data = yaml.safe_load(block.text)
            stages = data.get("stages") if isinstance(data, dict) else data
            if isinstance(stages, list) and all(isinstance(s, dict) and "stage" in s for s in stages):
                found.append((f"{page.name}:{block.line}", stages))
    return found


@pytest.mark.parametrize("where, stages", yaml_recipes(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_recipe_shown_passes_the_stage_checks(where, stages):
    from slimlm.cli import STAGES
    from slimlm.pipeline import plan_stages

    plan_stages(stages, STAGES)


def bench_lines() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in fenced_blocks(page):
            if block.language in SHELL_LANGUAGES:
                for number, line in shell_lines(block):
                    words = shlex.split(line, comments=True)
                    if len(words) > 1 and Path(words[0]).name in ("python", "python3", "bash"):
                        if words[1].startswith("bench/"):
                            found.append((f"{page.name}:{number}", words[1:]))
    for page in PAGES:  # and those quoted inline: `python bench/x.py --flag`
        for quoted in re.findall(r"`((?:\.venv/bin/)?(?:python|bash) bench/[^`]+)`", page.read_text()):
            found.append((page.name, shlex.split(quoted)[1:]))
    return found


@pytest.mark.parametrize("where, words", bench_lines(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_benchmark_command_names_a_script_and_its_flags(where, words):
    script = REPO / words[0]
    assert script.is_file(), f"{where}: {words[0]} does not exist"
    source = script.read_text()
    flags = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
    missing = [flag for flag in flags if flag not in source]
    assert not missing, f"{where}: {words[0]} has no {missing}"


# ---- the dependency rules of docs/architecture.md ------------------------------------------

PACKAGE_FILES = {
    "core": [p for p in (REPO / "slimlm").rglob("*.py") if p != REPO / "slimlm" / "cli.py"],
    "cli": [REPO / "slimlm" / "cli.py"],
    "compress": sorted((REPO / "compress").rglob("*.py")),
    "distill": sorted((REPO / "distill").rglob("*.py")),
    "eval": sorted((REPO / "eval").rglob("*.py")),
    "inference": sorted((REPO / "inference").rglob("*.py")),
}


def package_of(module: str) -> str | None:
    """Which package of the table a `slimlm...` module belongs to (None: not slimlm's)."""
    parts = module.split(".")
    if parts[0] != "slimlm":
        return None
    if len(parts) > 1 and parts[1] in ("compress", "distill", "eval", "inference"):
        return parts[1]
    if len(parts) > 1 and parts[1] == "cli":
        return "cli"
    return "core"


def type_checking_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:`: imports for annotations only, which never run."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def runtime_nodes(tree: ast.AST):
    """ast.walk without the bodies of `if TYPE_CHECKING:` blocks."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        children = list(ast.iter_child_nodes(node))
        if type_checking_only(node):
            children = [*node.orelse]
        pending.extend(children)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every slimlm module `path` imports when it runs, at module level or inside functions, and
    those it names to importlib.import_module."""
    found = []
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def dependency_rules() -> dict[str, set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    rules = {}
    for package, allowed in re.findall(r"^\| (\w+) \| ([^|]*) \|$", text, flags=re.M):
        if package in PACKAGE_FILES:
            rules[package] = {
                name.strip() for name in allowed.split(",") if name.strip() not in ("", "–", "-")
            }
    return rules


def test_imports_follow_the_dependency_rules_of_the_architecture_page():
    rules = dependency_rules()
    assert set(rules) == set(PACKAGE_FILES), f"docs/architecture.md's table covers {sorted(rules)}"
    broken = []
    for package, files in PACKAGE_FILES.items():
        for path in files:
            for line, module in imported_modules(path):
                target = package_of(module)
                if target is None or target == package or target in rules[package]:
                    continue
                broken.append(f"{path.relative_to(REPO)}:{line} imports {module} ({package} -> {target})")
    assert not broken, "imports docs/architecture.md does not allow:\n" + "\n".join(sorted(set(broken)))


# ---- the README ------------------------------------------------------------------------------

README = REPO / "README.md"


def test_the_readme_starts_with_make_demo_and_make_test():
    first = next(b for b in fenced_blocks(README) if b.language in SHELL_LANGUAGES)
    words = [shlex.split(line, comments=True) for _, line in shell_lines(first)]
    assert [w for w in words if w][:2] == [["make", "demo"], ["make", "test"]]
    assert README.read_text().index("make demo") < README.read_text().index("slimlm ")


def test_the_readme_is_short_and_maps_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 210, "the README is a front page: details belong in docs/"
    linked = {target.split("#")[0] for target in LINK.findall(text)}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in linked]
    assert not unlinked, f"the README's map of the docs leaves out {unlinked}"
