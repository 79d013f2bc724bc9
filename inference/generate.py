"""A completion of one prompt for the `generate` stage: through the bundled decoder when it can
run the model, else through transformers' `generate` (bitsandbytes peers, other layer types)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from slimlm.qlinear import QuantLinear


@dataclass(frozen=True)
class Completion:
    prompt: str
    text: str
    new_tokens: int
    seconds: float
    engine: str  # "slimlm decoder (kernels...)" or "transformers generate (why)"

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else float("nan")


def prompt_ids(tokenizer, prompt: str, chat_template: bool) -> torch.Tensor:
    """Token ids for a user prompt, wrapped in the chat template when asked and available."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def decoder_obstacle(model: nn.Module) -> Optional[str]:
    """Why the bundled decoder cannot run `model`, or None if it can."""
    from slimlm.inference.model import ARCHITECTURES

    architecture = getattr(model.config, "model_type", None)
    if architecture not in ARCHITECTURES:
        return f"architecture '{architecture}'"
    for name, module in model.model.layers.named_modules():
        if name.endswith("_proj") and not (type(module) is nn.Linear or isinstance(module, QuantLinear)):
            return f"{type(module).__module__.split('.')[0]} layers ({type(module).__name__})"
    return None


@torch.inference_mode()
def greedy_complete(
    model, tokenizer, prompt: str, max_new_tokens: int, chat_template: bool = True
) -> Completion:
    from slimlm.inference.build import build_decoder

    input_ids = prompt_ids(tokenizer, prompt, chat_template)
    device = next(model.parameters()).device
    obstacle = decoder_obstacle(model)
    if obstacle is None:
        # A quantized model in its kernels' activations (build.default_dtype); a float one in its own dtype.
        quantized = any(isinstance(m, QuantLinear) for m in model.modules())
        dtype = None if quantized else next(p.dtype for p in model.parameters() if p.is_floating_point())
        return decoder_completion(
            build_decoder(model, dtype=dtype, device=device), tokenizer, prompt, input_ids, max_new_tokens
        )
    input_ids = input_ids.to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    seconds = time.perf_counter() - start
    new_ids = output[0, input_ids.shape[1] :]
    text = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    return Completion(
        prompt,
        text,
        int(new_ids.numel()),
        seconds,
        f"transformers generate (the bundled decoder does not run {obstacle})",
    )


@torch.inference_mode()
def complete_from_artifact(
    path: Path, prompt: str, max_new_tokens: int, chat_template: bool, device: torch.device
) -> Completion:
    """greedy_complete for an artifact on disk, through the decoder loaded from it a layer at a
    time (inference/load.py): the artifact's model is never built beside the decoder."""
    from slimlm.artifact import artifact_tokenizer, parse_manifest
    from slimlm.inference.load import load_decoder

    manifest = parse_manifest(path)  # load_decoder verifies the checksums
    dtype = None if manifest["modules"] else getattr(torch, manifest.get("dtype", "float32"))
    tokenizer = artifact_tokenizer(path)
    transformer, _ = load_decoder(path, dtype=dtype, device=device)
    return decoder_completion(
        transformer, tokenizer, prompt, prompt_ids(tokenizer, prompt, chat_template), max_new_tokens
    )


def decoder_completion(
    transformer, tokenizer, prompt: str, input_ids: torch.Tensor, max_new_tokens: int
) -> Completion:
    """The greedy completion of `input_ids` [1, n] by the bundled decoder's `transformer`."""
    from slimlm.inference.build import describe_kernels
    from slimlm.inference.decoder import Decoder
    from slimlm.inference.sampling import SamplingParams

    decoder = Decoder(transformer, tokenizer)
    (generation,) = decoder.generate_ids(
        [input_ids[0].tolist()], SamplingParams(max_new_tokens=max_new_tokens)
    )
    # Prefill and decoding only: the first generation also allocates the cache and, on a new
    # machine, compiles the CPU kernels (seconds that would read as a slow decoder).
    seconds = decoder.last_stats.prefill_s + decoder.last_stats.decode_s
    kernels = ", ".join(f"{kind} x{count}" for kind, count in describe_kernels(decoder.model).items())
    activations = str(decoder.model.dtype).removeprefix("torch.")
    return Completion(
        prompt,
        generation.text.strip(),
        len(generation.token_ids),
        seconds,
        f"slimlm decoder ({kernels}; {activations} activations)",
    )
