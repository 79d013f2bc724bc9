"""Speed and memory of a causal LM: time to first token, prefill and decode throughput, peak memory.

Two paths: slimlm's bundled decoder (measure_decoder_speed), which runs every model family it
knows (float or with slimlm's quantized layers) as `slimlm generate` does, and the model's own
transformers forward (measure_speed; `generate` for the peer comparison) for any other model,
such as bitsandbytes int8/NF4 peers. Rows of one path compare like with like. Protocol: the
same fixed English prompt for every model, `warmup` untimed runs, then `repeats` timed runs;
every reported metric is the median over the timed runs (the per-run values are kept in `runs`
to show the spread).
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from slimlm.errors import SlimlmError
from slimlm.inference.sampling import SamplingParams
from slimlm.memory import peak_memory

# The benchmark prompt: real English (so attention and tokenization behave as on real input), the
# same for every model. Dickens, A Tale of Two Cities (1859), public domain.
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us, we were all going direct to "
    "Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for good "
    "or for evil, in the superlative degree of comparison only."
)


@dataclass(frozen=True)
class DecodeRun:
    """One timed greedy generation: the tokens it produced and how long its two phases took."""

    tokens: torch.Tensor  # (batch_size, new_tokens) generated ids
    ttft_s: float  # prefill forward over the prompt + choosing the first new token
    decode_s: float  # the remaining new_tokens - 1 steps


@dataclass(frozen=True)
class RunMetrics:
    """The metrics of one timed run."""

    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: Optional[float]  # None when new_tokens == 1: there is no decode phase
    total_s: float
    peak_memory_bytes: int


@dataclass(frozen=True)
class SpeedResult:
    # "bundled_decoder" (measure_decoder_speed), "forward_loop" (measure_speed) or "generate"
    # (measure_generate)
    method: str
    device: str
    batch_size: int
    prompt_tokens: int  # per sequence
    new_tokens: int  # per sequence, always exactly this many
    repeats: int  # timed runs the medians are taken over
    ttft_s: float  # time to first token: prefill + first token choice, seconds
    prefill_tok_s: float  # prompt_tokens * batch_size / ttft_s
    decode_tok_s: Optional[float]  # (new_tokens - 1) * batch_size / decode seconds
    total_s: float  # ttft_s + decode seconds: the whole generation
    peak_memory_bytes: int  # weights and everything else the run held, see peak_memory_kind
    peak_memory_kind: str  # "rss" (process resident memory) or "cuda_allocated" (torch's CUDA allocations)
    runs: tuple[RunMetrics, ...]  # per timed run, in order

    def to_dict(self) -> dict:
        return asdict(self)


Decoder = Callable[[nn.Module, torch.Tensor, int], DecodeRun]


def device_clock(device: torch.device) -> float:
    """perf_counter once the device has finished its queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def benchmark_prompt(tokenizer, prompt_tokens: int, prompt_text: Optional[str] = None) -> torch.Tensor:
    """Exactly `prompt_tokens` ids of `prompt_text` (default PASSAGE), repeated paragraph by
    paragraph as needed."""
    from slimlm.data import (
        tokenize_text,
    )  # here: the GPU benchmark imports this module where the data stack is absent

    text = PASSAGE if prompt_text is None else prompt_text
    if tokenize_text(tokenizer, text).numel() == 0:
        raise SlimlmError("the benchmark prompt text tokenizes to no tokens; give a non-empty prompt_text")
    copies = 1
    while (ids := tokenize_text(tokenizer, "\n\n".join([text] * copies))).numel() < prompt_tokens:
        copies += 1
    return ids[:prompt_tokens]


@torch.inference_mode()
def greedy_decode(model: nn.Module, input_ids: torch.Tensor, new_tokens: int) -> DecodeRun:
    """Greedy decoding through the model's forward and a transformers DynamicCache, in a loop we control.

    Exactly `new_tokens` steps, no stopping criteria; the prefill (the whole prompt in one forward)
    is timed apart from the one-token decode steps. The forward fills the cache in place.
    """
    device = input_ids.device
    options = _forward_options(model)
    start = device_clock(device)
    token = _next_token(model(input_ids=input_ids, **options))
    first = device_clock(device)
    tokens = [token]
    for _ in range(new_tokens - 1):
        token = _next_token(model(input_ids=token, **options))
        tokens.append(token)
    end = device_clock(device)
    return DecodeRun(tokens=torch.cat(tokens, dim=1), ttft_s=first - start, decode_s=end - first)


def _forward_options(model: nn.Module) -> dict:
    """A fresh DynamicCache under the name this transformers takes (`past_key_values` became
    `cache` within 5.x), and, as `generate` does, only the last position's logits where allowed."""
    accepted = inspect.signature(model.forward).parameters
    options = {
        "cache" if "cache" in accepted else "past_key_values": DynamicCache(
            config=model.config.get_text_config(decoder=True)
        ),
        "use_cache": True,
    }
    if "logits_to_keep" in accepted:
        options["logits_to_keep"] = 1
    return options


def _next_token(output) -> torch.Tensor:
    return output.logits[:, -1].argmax(dim=-1, keepdim=True)


class _FirstTokenClock(BaseStreamer):
    """Notes when `generate` hands over its first new token (its first `put` is the prompt)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.puts = 0
        self.first_token_at: Optional[float] = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = device_clock(self.device)

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_decode(
    model: nn.Module, input_ids: torch.Tensor, new_tokens: int, pad_token_id: Optional[int] = None
) -> DecodeRun:
    """Greedy `model.generate` forced to exactly `new_tokens` (min = max), split at the first
    token by a streamer."""
    device = input_ids.device
    clock = _FirstTokenClock(device)
    start = device_clock(device)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        num_beams=1,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_token_id,
        streamer=clock,
    )
    end = device_clock(device)
    return DecodeRun(
        tokens=output[:, input_ids.shape[1] :],
        ttft_s=clock.first_token_at - start,
        decode_s=end - clock.first_token_at,
    )


def bundled_decode(decoder: Any, model: nn.Module, input_ids: torch.Tensor, new_tokens: int) -> DecodeRun:
    """Greedy decoding of the prompts through slimlm's bundled decoder, exactly `new_tokens`
    each; its own clock splits the prefill (which gives the first token) from the steps."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generations = decoder.generate_ids(input_ids.tolist(), params)
    stats = decoder.last_stats
    return DecodeRun(
        tokens=torch.tensor([g.token_ids for g in generations]),
        ttft_s=stats.prefill_s,
        decode_s=stats.decode_s,
    )


def measure_decoder_speed(
    model: nn.Module,
    tokenizer,
    prompt_tokens: int = 16,
    new_tokens: int = 128,
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    prompt_text: Optional[str] = None,
) -> SpeedResult:
    """The same measurement through slimlm's bundled decoder built from `model` (its packed
    kernels, static cache and chunked prefill, as `slimlm generate` runs it), which is how a
    compressed model is deployed: the transformers forward dequantizes each quantized layer's
    whole weight on every call. The decoder holds the weights in its own layouts beside `model`."""
    from slimlm.inference.build import build_decoder
    from slimlm.inference.decoder import Decoder

    decoder = Decoder(build_decoder(model, dtype=None), tokenizer)
    return _measure(
        "bundled_decoder",
        functools.partial(bundled_decode, decoder),
        model,
        tokenizer,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        prompt_text=prompt_text,
    )


def measure_speed(
    model: nn.Module,
    tokenizer,
    prompt_tokens: int = 16,
    new_tokens: int = 128,
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    prompt_text: Optional[str] = None,
) -> SpeedResult:
    """Speed and peak memory of greedy decoding through the model's own forward and KV cache."""
    return _measure(
        "forward_loop",
        greedy_decode,
        model,
        tokenizer,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        prompt_text=prompt_text,
    )


def measure_generate(
    model: nn.Module,
    tokenizer,
    prompt_tokens: int = 16,
    new_tokens: int = 128,
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    prompt_text: Optional[str] = None,
) -> SpeedResult:
    """The same measurement through HF `model.generate`, to compare with peers that use it."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    decoder = functools.partial(generate_decode, pad_token_id=pad_id)
    return _measure(
        "generate",
        decoder,
        model,
        tokenizer,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
        prompt_text=prompt_text,
    )


def _measure(
    method: str,
    decoder: Decoder,
    model: nn.Module,
    tokenizer,
    *,
    prompt_tokens: int,
    new_tokens: int,
    batch_size: int,
    warmup: int,
    repeats: int,
    prompt_text: Optional[str],
) -> SpeedResult:
    _check_counts(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        batch_size=batch_size,
        warmup=warmup,
        repeats=repeats,
    )
    device = next(model.parameters()).device
    input_ids = benchmark_prompt(tokenizer, prompt_tokens, prompt_text).repeat(batch_size, 1).to(device)
    for _ in range(warmup):
        decoder(model, input_ids, new_tokens)
    runs = []
    for _ in range(repeats):
        with peak_memory(device) as peak:
            run = decoder(model, input_ids, new_tokens)
        if tuple(run.tokens.shape) != (batch_size, new_tokens):
            raise SlimlmError(
                f"{method} produced tokens of shape {tuple(run.tokens.shape)}, "
                f"expected ({batch_size}, {new_tokens}); something in the model's "
                "generation_config (stop_strings, max_length) ends it early"
            )
        runs.append(_run_metrics(run, peak.bytes, batch_size, prompt_tokens, new_tokens))
    return SpeedResult(
        method=method,
        device=str(device),
        batch_size=batch_size,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        repeats=repeats,
        ttft_s=_median([r.ttft_s for r in runs]),
        prefill_tok_s=_median([r.prefill_tok_s for r in runs]),
        decode_tok_s=_median([r.decode_tok_s for r in runs]),
        total_s=_median([r.total_s for r in runs]),
        peak_memory_bytes=int(_median([r.peak_memory_bytes for r in runs])),
        peak_memory_kind=peak.kind,
        runs=tuple(runs),
    )


def _check_counts(**counts: int) -> None:
    minimum = {"warmup": 0}
    for name, value in counts.items():
        least = minimum.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SlimlmError(f"{name}={value!r} is invalid: it must be a whole number of at least {least}")


def _run_metrics(
    run: DecodeRun, peak_bytes: int, batch_size: int, prompt_tokens: int, new_tokens: int
) -> RunMetrics:
    return RunMetrics(
        ttft_s=run.ttft_s,
        prefill_tok_s=prompt_tokens * batch_size / run.ttft_s,
        decode_tok_s=(new_tokens - 1) * batch_size / run.decode_s if new_tokens > 1 else None,
        total_s=run.ttft_s + run.decode_s,
        peak_memory_bytes=peak_bytes,
    )


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    return None if None in values else statistics.median(values)
