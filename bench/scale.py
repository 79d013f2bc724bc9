"""Scale: compress and run a model larger than this machine's memory allows to hold twice.

Writes a Llama-3-8B-shaped checkpoint with random bf16 weights to disk (sharded safetensors,
about 16 GB; written one tensor at a time, reused from --workdir when it is there), then runs
each measured step in a process of its own under GNU time, which reports the peak RSS the
kernel kept for it (measured from outside, every page counted, no polling gaps):
  rtn       w4 g128 symmetric RTN of every decoder Linear and the LM head, streamed from the
            checkpoint into a sharded artifact (compress/stream_rtn.py); goal: peak RSS <= 3 GB
  generate  the bundled decoder loads the artifact on the CPU layer by layer and greedily
            generates 8 tokens: load seconds, tokens/s, peak RSS
  plan      `slimlm plan`'s functions on the artifact (config and manifest only): the weight
            bytes it predicts in the artifact's own packing against the artifact's, and in the
            CPU decoder's layouts against what the loaded decoder holds
  gptq      w4 g128 GPTQ of the first 4 blocks ($SCALE_GPTQ_BLOCKS), one block in memory at a
            time (compress/offload.py) on 16 windows of 512 random tokens, in bf16: seconds per
            block, the whole model's projected time, peak RSS; goal: <= 6 GB
  ppl       perplexity of the bf16 checkpoint over 2 windows of 512 random tokens, one block in
            memory at a time (eval/offloaded.py): seconds, peak RSS
  forward   one block's forward pass over 512 tokens in bf16 with torch's bf16 products and as
            calibration and scoring run it (slimlm/half_linear.py): seconds of each
A step is a function of the run's paths returning its metrics, listed in STEPS. `--only gptq`
runs the named steps and merges their rows into the last results. Random weights give honest
memory and speed figures: neither depends on the values.
Writes bench/results/scale.{md,json} (--quick: small shapes, a few seconds a step, results
only in the work directory; for tests).

    python bench/scale.py [--layers 32] [--workdir bench/runs/scale]
                          [--only rtn generate plan gptq ppl forward] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from benchlib import REPO, command_line, machine_line, write_result

from slimlm.rundir import machine_info
from slimlm.shards import DEFAULT_SHARD_BYTES

LLAMA_3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
QUICK = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
)
QUICK_SHARD_BYTES = 2**19  # several shards even for the quick shapes
TARGETS = [r"model\.layers\.\d+\..*", "lm_head"]
NEW_TOKENS = 8
PLAN_CONTEXT = 2048
GB = 1e9
TIME = "/usr/bin/time"


@dataclass(frozen=True)
class Run:
    """Where a run's files are: the random checkpoint, the artifact and each step's metrics."""

    workdir: Path
    max_shard_bytes: int  # the artifact's

    @property
    def checkpoint(self) -> Path:
        return self.workdir / "checkpoint"

    @property
    def artifact(self) -> Path:
        return self.workdir / "artifact-w4g128-rtn"

    def metrics(self, step: str) -> Path:
        return self.workdir / f"{step}.json"


def model_config(options: argparse.Namespace):
    from transformers import LlamaConfig

    shape = {**LLAMA_3_8B, **(QUICK if options.quick else {"num_hidden_layers": options.layers})}
    return LlamaConfig(**shape, dtype="bfloat16")


def write_checkpoint(run: Run, config) -> None:
    """The random checkpoint, one tensor at a time, atomically; an existing one of the same
    config is kept (writing 16 GB takes minutes)."""
    from slimlm.checkpoint import Checkpoint
    from slimlm.rundir import staged_directory
    from slimlm.shards import TensorSpec, write_weights

    wanted = {key: value for key, value in config.to_dict().items() if key in LLAMA_3_8B}
    if (run.checkpoint / "config.json").is_file():
        stored = json.loads((run.checkpoint / "config.json").read_text())
        if all(stored.get(key) == value for key, value in wanted.items()):
            Checkpoint(run.checkpoint)  # complete and readable, or refused
            return
        raise SystemExit(
            f"{run.checkpoint} holds a checkpoint of another shape; remove it or give another --workdir"
        )
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    specs = [TensorSpec.of(name, tensor) for name, tensor in skeleton.state_dict().items()]
    generator = torch.Generator().manual_seed(0)

    def random_tensor(spec: TensorSpec) -> torch.Tensor:
        if spec.name.endswith("norm.weight"):
            return torch.ones(spec.shape, dtype=spec.dtype)
        return torch.empty(spec.shape, dtype=spec.dtype).normal_(0.0, 0.02, generator=generator)

    with staged_directory(run.checkpoint, "checkpoints") as staging:
        print(f"writing a random checkpoint of {sum(s.nbytes for s in specs) / GB:.1f} GB", file=sys.stderr)
        write_weights(staging, specs, random_tensor, metadata={"format": "pt"})
        config.save_pretrained(staging)
        byte_tokenizer().save_pretrained(staging)


def byte_tokenizer():
    """A byte-level tokenizer with no merges (256 tokens and two special ones): random weights
    make any text meaningless, and the decoder only needs prompt ids and a way to print."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<s>": 0,
        "</s>": 1,
        **{char: index + 2 for index, char in enumerate(pre_tokenizers.ByteLevel.alphabet())},
    }
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def step_rtn(run: Run) -> dict:
    import shutil

    from slimlm.artifact import read_manifest
    from slimlm.compress.stream_rtn import stream_rtn
    from slimlm.qlinear import QuantScheme

    shutil.rmtree(run.artifact, ignore_errors=True)
    started = time.perf_counter()
    stream_rtn(
        run.checkpoint,
        run.artifact,
        QuantScheme(bits=4, group_size=128, symmetric=True),
        TARGETS,
        max_shard_bytes=run.max_shard_bytes,
    )
    seconds = time.perf_counter() - started
    manifest = read_manifest(run.artifact)
    shards = [name for name in manifest["files"] if name.endswith(".safetensors")]
    return {
        "seconds": round(seconds, 1),
        "artifact_weight_bytes": manifest["size"]["weights_file_bytes"],
        "shards": len(shards),
    }


def step_generate(run: Run) -> dict:
    from slimlm.artifact import artifact_tokenizer
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.load import load_decoder
    from slimlm.inference.sampling import SamplingParams

    started = time.perf_counter()
    transformer, _ = load_decoder(
        run.artifact, dtype=None
    )  # build.default_dtype: bf16 activations for a quantized model on a CPU
    load_seconds = time.perf_counter() - started
    tokenizer = artifact_tokenizer(run.artifact)
    decoder = Decoder(transformer, tokenizer)
    prompt = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    started = time.perf_counter()
    (generation,) = decoder.generate_ids([prompt], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    seconds = time.perf_counter() - started
    stats = decoder.last_stats
    return {
        "load_seconds": round(load_seconds, 1),
        "new_tokens": len(generation.token_ids),
        "tokens_per_s": round(len(generation.token_ids) / seconds, 2),  # prefill of the prompt included
        "decode_tokens_per_s": round(stats.decode_tok_s, 2),
        "decoder_weight_bytes": transformer.weight_bytes(),
        "activations": str(transformer.dtype).removeprefix("torch."),
    }


def step_plan(run: Run) -> dict:
    """What `slimlm plan ARTIFACT --context 2048` computes (inference/cli.py plan_command) from
    the config and the manifest alone: with `--hardware cpu`, the decoder's CPU layouts (int4 as
    torch's tinygemm holds it: a bf16 scale and zero per group, twice the artifact's fp16 scale,
    so about 2.4% above the artifact for the 8B); with `--hardware h200 --gpu-int4 triton`, the
    layout that keeps the artifact's packing."""
    from slimlm.artifact import parse_manifest, planner_inputs
    from slimlm.inference.model import ModelArgs
    from slimlm.inference.planner import HARDWARE, make_plan
    from slimlm.resources import read_json_object

    manifest = parse_manifest(run.artifact)
    schemes, ranks = planner_inputs(manifest)
    args = ModelArgs.from_hf_config(read_json_object(run.artifact / "config.json", "re-run the rtn step"))
    cpu = make_plan(args, schemes, HARDWARE["cpu"], PLAN_CONTEXT, 1, adapter_ranks=ranks)
    stored = make_plan(
        args, schemes, HARDWARE["h200"], PLAN_CONTEXT, 1, gpu_int4="triton", adapter_ranks=ranks
    )
    artifact_bytes = manifest["size"]["weights_file_bytes"]
    return {
        "artifact_weight_bytes": artifact_bytes,
        "plan_cpu_weight_bytes": cpu.budget.weight_bytes,
        "plan_stored_layout_weight_bytes": stored.budget.weight_bytes,
        "plan_stored_layout_to_artifact": round(stored.budget.weight_bytes / artifact_bytes, 4),
        "plan_cpu_to_artifact": round(cpu.budget.weight_bytes / artifact_bytes, 4),
    }


GPTQ_BLOCKS = 4
GPTQ_SAMPLES, GPTQ_SEQ_LEN = 16, 512


def step_gptq(run: Run) -> dict:
    """w4 g128 GPTQ of the first GPTQ_BLOCKS blocks (compress/offload.py: one block in memory
    at a time, calibrated in bf16) on 16 windows of 512 random tokens: the seconds per block
    project the whole model's time, the peak bounds what calibrating it needs."""
    from slimlm.compress.offload import quantize_checkpoint
    from slimlm.compress.quantize import QuantizeParams

    config = json.loads((run.checkpoint / "config.json").read_text())
    blocks = min(int(os.environ.get("SCALE_GPTQ_BLOCKS", GPTQ_BLOCKS)), config["num_hidden_layers"])
    targets = [rf"model\.layers\.({'|'.join(map(str, range(blocks)))})\..*"]
    params = QuantizeParams(
        method="gptq", bits=4, group_size=128, samples=GPTQ_SAMPLES, seq_len=GPTQ_SEQ_LEN, targets=targets
    )
    samples = torch.randint(
        0, config["vocab_size"], (GPTQ_SAMPLES, GPTQ_SEQ_LEN), generator=torch.Generator().manual_seed(0)
    )
    started = time.perf_counter()
    result = quantize_checkpoint(
        run.checkpoint, params, samples, lambda name, block: None, dtype=torch.bfloat16
    )
    per_block = sum(result.block_seconds.values()) / len(result.block_seconds)
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "blocks": blocks,
        "block_seconds": round(per_block, 1),
        "projected_blocks_seconds": round(per_block * config["num_hidden_layers"], 0),
        "quantized_layers": result.quantized_layers,
    }


PPL_WINDOWS, PPL_WINDOW = 2, 512


def step_ppl(run: Run) -> dict:
    """Perplexity of the checkpoint itself, offloaded (eval/offloaded.py), on random tokens: the
    number means nothing for random weights; the seconds and the peak are what is measured."""
    from slimlm.eval.offloaded import score_checkpoint

    config = json.loads((run.checkpoint / "config.json").read_text())
    tokens = torch.randint(
        0, config["vocab_size"], (PPL_WINDOWS * PPL_WINDOW,), generator=torch.Generator().manual_seed(0)
    )
    started = time.perf_counter()
    scores = score_checkpoint(run.checkpoint, tokens, PPL_WINDOW, dtype=torch.bfloat16)
    return {
        "seconds": round(time.perf_counter() - started, 1),
        "windows": scores.perplexity.windows,
        "tokens_scored": scores.perplexity.tokens_scored,
        "ppl": round(scores.perplexity.ppl, 1),
    }


FORWARD_TOKENS = 512


def step_forward(run: Run) -> dict:
    """One decoder block's forward pass over FORWARD_TOKENS hidden states in bf16: with torch's
    bf16 products, and as calibration and offloaded scoring run it (slimlm/half_linear.py:
    float32 products where this CPU multiplies bf16 slowly); seconds of each, the difference."""
    from slimlm.checkpoint import open_checkpoint
    from slimlm.half_linear import float32_linears, half_matmul_is_slow

    checkpoint, model = open_checkpoint(run.checkpoint, torch.bfloat16)
    layer, rotary, cpu = model.model.layers[0], model.model.rotary_emb, torch.device("cpu")
    checkpoint.materialize(layer, "model.layers.0.", cpu)
    checkpoint.materialize(rotary, "model.rotary_emb.", cpu)
    hidden = torch.randn(
        1, FORWARD_TOKENS, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    ).bfloat16()
    rope = rotary(hidden, torch.arange(FORWARD_TOKENS)[None])
    seconds, outputs = {}, {}
    for name, context in (
        ("slimlm_s", float32_linears(torch.bfloat16, cpu)),
        ("torch_bf16_s", contextlib.nullcontext()),
    ):
        started = time.perf_counter()
        with torch.no_grad(), context:
            output = layer(hidden, position_embeddings=rope, attention_mask=None)
        outputs[name] = (output[0] if isinstance(output, tuple) else output).float()
        seconds[name] = round(time.perf_counter() - started, 2)
    difference = float(
        (outputs["torch_bf16_s"] - outputs["slimlm_s"]).abs().max() / outputs["torch_bf16_s"].abs().max()
    )
    return {
        **seconds,
        "seconds": round(sum(seconds.values()), 1),
        "tokens": FORWARD_TOKENS,
        "float32_products": half_matmul_is_slow(torch.bfloat16),
        "speedup": round(seconds["torch_bf16_s"] / max(seconds["slimlm_s"], 0.01), 1),
        "max_rel_difference": round(difference, 5),
    }


@dataclass(frozen=True)
class Step:
    name: str  # the row's name
    key: str  # --step KEY runs it in a child process
    run: Callable[[Run], dict]


STEPS = [
    Step("w4 g128 RTN, streamed into a sharded artifact", "rtn", step_rtn),
    Step(f"decoder: load the artifact (CPU), generate {NEW_TOKENS} tokens", "generate", step_generate),
    Step("slimlm plan on the artifact", "plan", step_plan),
    Step("w4 g128 GPTQ of the first blocks, offloaded", "gptq", step_gptq),
    Step(f"perplexity, offloaded ({PPL_WINDOWS} x {PPL_WINDOW} tokens)", "ppl", step_ppl),
    Step(
        f"one block's bf16 forward ({FORWARD_TOKENS} tokens): torch's bf16 products, slimlm's",
        "forward",
        step_forward,
    ),
]


def measure(step: Step, options: argparse.Namespace, run: Run) -> dict:
    """Run `step` in a child process under GNU time, which reports the child's peak RSS as the
    kernel kept it. (This process's own os.wait4 would not do: a child started by vfork and exec
    inherits this process's high-water mark.)"""
    if not Path(TIME).is_file():
        raise SystemExit(
            f"{TIME} (GNU time) is needed to measure each step's peak memory from outside: install the "
            "'time' package"
        )
    peak_file = run.workdir / f"{step.key}.maxrss"
    argv = [
        TIME,
        "-f",
        "%M",
        "-o",
        str(peak_file),
        sys.executable,
        str(Path(__file__).resolve()),
        "--step",
        step.key,
        "--workdir",
        str(run.workdir),
    ]
    argv += ["--quick"] if options.quick else ["--layers", str(options.layers)]
    print(f"step {step.key} ...", file=sys.stderr, flush=True)
    if subprocess.run(argv, cwd=REPO).returncode != 0:
        raise SystemExit(f"step {step.key} failed")
    metrics = json.loads(run.metrics(step.key).read_text())
    peak_kib = int(peak_file.read_text().split()[-1])  # %M: the maximum resident set size in KiB
    return {"name": step.name, **metrics, "peak_rss_gb": round(peak_kib * 1024 / GB, 2)}


def markdown(
    rows: list[dict], options: argparse.Namespace, command: str, machine: dict, seconds: float, config
) -> list[str]:
    rtn, generate, plan = (next(row for row in rows if row["name"] == step.name) for step in STEPS[:3])
    shape = (
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, vocab {config.vocab_size}"
    )
    return [
        "# Scale: a Llama-3-8B-shaped checkpoint (random bf16 weights) on a CPU machine",
        "",
        f"- command: `{command}`",
        machine_line(machine, f"{torch.get_num_threads()} torch threads", seconds),
        (
            f"- model: {shape}; checkpoint {rtn['checkpoint_weight_bytes'] / GB:.2f} GB of bf16 safetensors; "
            "each step in its own process, peak RSS by /usr/bin/time (the kernel's maximum resident set "
            "size)"
        ),
        "",
        "| step | seconds | peak RSS GB | result |",
        "|---|---:|---:|---|",
        (
            f"| {rtn['name']} | {rtn['seconds']:.1f} | {rtn['peak_rss_gb']:.2f} | "
            f"{rtn['artifact_weight_bytes'] / GB:.2f} GB in {rtn['shards']} shards |"
        ),
        (
            f"| {generate['name']} | {generate['load_seconds']:.1f} (load) | {generate['peak_rss_gb']:.2f} | "
            f"{generate['tokens_per_s']:.2f} tokens/s ({generate['decode_tokens_per_s']:.2f} decoding), "
            f"{generate['activations']} activations, decoder weights "
            f"{generate['decoder_weight_bytes'] / GB:.2f} GB |"
        ),
        f"| {plan['name']} | | {plan['peak_rss_gb']:.2f} | weights in the artifact's packing (h200, triton) "
        f"{plan['plan_stored_layout_weight_bytes'] / GB:.3f} GB: "
        f"{plan['plan_stored_layout_to_artifact']:.4f}x the artifact's "
        f"{plan['artifact_weight_bytes'] / GB:.3f} GB; in the CPU layouts "
        f"{plan['plan_cpu_weight_bytes'] / GB:.3f} GB: {plan['plan_cpu_to_decoder']:.4f}x the loaded "
        f"decoder's, {plan['plan_cpu_to_artifact']:.4f}x the artifact's |",
        *(gptq_line(row) for row in rows if row["name"] == STEPS[3].name),
        *(
            f"| {row['name']} | {row['seconds']:.1f} | {row['peak_rss_gb']:.2f} | {row['tokens_scored']} "
            f"tokens scored, one block in memory at a time (random weights: ppl {row['ppl']:,.0f}) |"
            for row in rows
            if row["name"] == STEPS[4].name
        ),
        *(forward_line(row) for row in rows if row["name"] == STEPS[5].name),
        "",
    ]


def forward_line(row: dict) -> str:
    how = (
        "float32 products (this CPU multiplies bf16 slowly)"
        if row["float32_products"]
        else "bf16 products (this CPU multiplies bf16 fast)"
    )
    return (
        f"| {row['name']} | {row['seconds']:.1f} | {row['peak_rss_gb']:.2f} | torch "
        f"{row['torch_bf16_s']:.2f} s, slimlm {row['slimlm_s']:.2f} s with {how}: {row['speedup']:.1f}x; "
        f"outputs differ by {row['max_rel_difference']:.1e} of their largest value |"
    )


def gptq_line(row: dict) -> str:
    return (
        f"| {row['name']} | {row['seconds']:.1f} | {row['peak_rss_gb']:.2f} | {row['quantized_layers']} "
        f"layers in {row['blocks']} blocks, {row['block_seconds']:.1f} s per block; every block projected at "
        f"{row['projected_blocks_seconds'] / 3600:.1f} h (16 x 512 tokens, bf16) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layers", type=int, default=32, help="decoder layers (32: the real 8B; fewer for a quicker run)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=REPO / "bench" / "runs" / "scale",
        help="where the checkpoint (reused) and the artifact go",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small shapes (2 layers, hidden 256, vocab 1024): results stay in --workdir",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[step.key for step in STEPS],
        default=None,
        help="run these steps and merge their rows into the last results (the others are kept)",
    )
    parser.add_argument(
        "--step", choices=[step.key for step in STEPS], help=argparse.SUPPRESS
    )  # a child process's one step
    options = parser.parse_args()
    run = Run(options.workdir, QUICK_SHARD_BYTES if options.quick else DEFAULT_SHARD_BYTES)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if options.step:
        metrics = next(step for step in STEPS if step.key == options.step).run(run)
        run.metrics(options.step).write_text(json.dumps(metrics) + "\n")
        return
    started = time.perf_counter()
    config = model_config(options)
    run.workdir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(run, config)
    from slimlm.checkpoint import Checkpoint

    results = run.workdir / "scale.json" if options.quick else REPO / "bench" / "results" / "scale.json"
    kept = (
        {row["name"]: row for row in json.loads(results.read_text())["rows"]}
        if options.only and results.is_file()
        else {}
    )
    rows = []
    for step in STEPS:
        if options.only is None or step.key in options.only:
            rows.append(measure(step, options, run))
        elif step.name in kept:
            rows.append(kept[step.name])
    rows[0]["checkpoint_weight_bytes"] = Checkpoint(run.checkpoint).weight_bytes()
    generate, plan = rows[1], rows[2]
    plan["decoder_weight_bytes"] = generate["decoder_weight_bytes"]
    plan["plan_cpu_to_decoder"] = round(plan["plan_cpu_weight_bytes"] / generate["decoder_weight_bytes"], 4)
    command = command_line("scale.py", parser, options).replace(str(REPO) + "/", "")
    machine = machine_info(query_gpu=False)
    record = {"rows": rows}
    lines = markdown(rows, options, command, machine, time.perf_counter() - started, config)
    if options.quick:
        (run.workdir / "scale.json").write_text(
            json.dumps({"machine": machine, "command": command, **record}, indent=2) + "\n"
        )
        print("\n".join(lines))
    else:
        write_result("scale", command, record, lines, machine=machine)


if __name__ == "__main__":
    main()
