"""Decode speed of a pruning recipe's student shape against its teacher, at the same precision.

The recipe's prune stage (by default prune-distill-keep's) fixes the student's shape; decode speed
does not depend on which layers or channels were kept, so the student here keeps the teacher's
first ones, rebuilt by the prune stage's own code (compress/prune.py). Rows, raced round by round
(decode_cpu.race, so a slow spell of the machine slows every row alike): teacher and student in
fp32, then both with their decoder layers at int4 g64 (RTN here; the recipe's GPTQ stores the same
layout, decoded by the same kernels) and the LM head left fp32, as the recipe quantizes. Bundled
decoder, eager, batch 1, 16-token prompt, 128 new tokens, median of the rounds.
Writes bench/results/student_speed_cpu.{md,json}.

    python bench/student_speed_cpu.py [--recipe prune-distill-keep] [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from benchlib import REPO, command_line, load_bench_model, machine_line, publish
from decode_cpu import add_decode_options, quantize_in_place, race, slimlm_contender
from omegaconf import OmegaConf

from slimlm.compress.prune import Keep, PruneParams, Shape, parameter_count, rebuild
from slimlm.compress.quantize import QuantizeParams
from slimlm.errors import SlimlmError
from slimlm.eval.speed import benchmark_prompt
from slimlm.rundir import machine_info

# --quick: the tiny test model (2 layers, hidden 128, MLP 256, 2 key/value groups) pruned alike
QUICK_SHAPE = PruneParams(layers=1, intermediate_size=128)
SIZES = ("layers", "hidden_size", "intermediate_size", "kv_heads")
W4_LAYERS = QuantizeParams(targets=[r"model\.layers\.\d+\..*"], bits=4, group_size=64)


def recipe_shape(name: str) -> PruneParams:
    """The sizes the recipe's (first) prune stage keeps."""
    path = REPO / "recipes" / f"{name}.yaml"
    if not path.is_file():
        raise SlimlmError(f"no bundled recipe {name} (recipes/{name}.yaml); name one that prunes")
    recipe = OmegaConf.load(path)
    stage = next((dict(s) for s in recipe.stages if s.stage == "prune"), None)
    if stage is None:
        raise SlimlmError(f"recipe {name} has no prune stage: name a recipe that prunes")
    return PruneParams(**{key: stage[key] for key in SIZES if key in stage})


def first_kept(model, params: PruneParams) -> torch.nn.Module:
    """The student's shape holding the teacher's first layers, channels and key/value groups."""
    shape = Shape.of(model.config)
    layers = params.layers or shape.layers

    def first(count, total):
        return None if count is None or count >= total else torch.arange(count)

    intermediate = first(params.intermediate_size, shape.intermediate_size)
    kv_groups = first(params.kv_heads, shape.kv_heads)
    keep = Keep(
        layers=list(range(layers)),
        hidden=first(params.hidden_size, shape.hidden_size),
        intermediate=None if intermediate is None else [intermediate] * layers,
        kv_groups=None if kv_groups is None else [kv_groups] * layers,
    )
    return rebuild(model, keep, shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="prune-distill-keep", help="a bundled recipe with a prune stage")
    add_decode_options(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model pruned to 1 layer, MLP 128; 8 new tokens, 1 round; only printed (tests)",
    )
    options = parser.parse_args()
    params = QUICK_SHAPE if options.quick else recipe_shape(options.recipe)
    if options.quick:
        options.new_tokens, options.repeats = 8, 1
    torch.set_num_threads(options.threads)
    started = time.perf_counter()
    _, loaded = load_bench_model(options.quick)
    teacher, tokenizer = loaded.model, loaded.tokenizer
    student = first_kept(teacher, params)
    prompt = benchmark_prompt(tokenizer, options.prompt_tokens).tolist()
    models = {"teacher": teacher, "student": student}
    parameters = {name: parameter_count(model) for name, model in models.items()}  # before quantizing
    contenders = [
        slimlm_contender(f"{name}, fp32", model, tokenizer, prompt, options, torch.float32)
        for name, model in models.items()
    ]
    for name, model in models.items():
        quantize_in_place(model, tokenizer, W4_LAYERS)
        contenders.append(slimlm_contender(f"{name}, w4 g64", model, tokenizer, prompt, options, None))
    rows = race(contenders, options.repeats)
    for row, model in zip(rows, [teacher, student, teacher, student]):
        row["layers"], row["intermediate_size"] = (
            model.config.num_hidden_layers,
            model.config.intermediate_size,
        )
        row["parameters"] = parameters[row["name"].split(",")[0]]
        reference = rows[0] if row["name"].endswith("fp32") else rows[2]
        row["speedup_vs_teacher"] = row["decode_tok_s"] / reference["decode_tok_s"]
        del row["kernels"], row["kl_mean"]
    command = command_line("student_speed_cpu.py", parser, options)
    shape = {key: getattr(params, key) for key in SIZES if getattr(params, key) is not None}
    source = "the tiny test model's, --quick" if options.quick else f"recipe {options.recipe}'s prune stage"
    summary = {
        **vars(options),
        "shape": shape,
        "shape_from": source,
        "seconds": time.perf_counter() - started,
    }
    publish(
        "student_speed_cpu",
        command,
        {"summary": summary, "rows": rows},
        markdown(rows, summary, command),
        options.quick,
    )


def markdown(rows: list[dict], summary: dict, command: str) -> list[str]:
    return [
        "# student_speed_cpu",
        "",
        f"- command: `{command}`",
        machine_line(machine_info(), f"{summary['threads']} threads", summary["seconds"]),
        (
            f"- the student: {', '.join(f'{k}={v}' for k, v in summary['shape'].items())} "
            f"({summary['shape_from']}); bundled decoder, eager, batch 1, a {summary['prompt_tokens']}-token "
            f"prompt, {summary['new_tokens']} new tokens, median of {summary['repeats']} interleaved rounds"
        ),
        "",
        "| model | layers | MLP | parameters | weight bytes | decode tok/s | speed-up (same precision) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['name']} | {r['layers']} | {r['intermediate_size']} | {r['parameters'] / 1e6:.1f}M | "
            f"{r['weight_bytes']:,} | {r['decode_tok_s']:.1f} | {r['speedup_vs_teacher']:.2f}x |"
            for r in rows
        ],
        "",
    ]


if __name__ == "__main__":
    main()
