"""A model's config.json read as untrusted input, and the weightless model built from it.

A config.json decides how much a model costs before any weight is read: 10^9 layers take
minutes to lay out even without memory, and a hidden size of 10^6 asks for terabytes once the
model is filled. So every size it gives is bounded (well above today's largest models) before
anything is built, the model is built on the meta device, and whatever transformers raises on
a value it cannot take (a string for a number, an unknown activation) is one line naming the
file. The weights then decide the memory: loaders assign what the files hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from slimlm.errors import SlimlmError

# The largest value each size may take: several times today's largest models (Llama 3.1 405B:
# 126 layers, hidden 16384, intermediate 53248; Gemma 3: 262k vocabulary; 10M-token contexts).
SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "moe_intermediate_size": 1 << 19,
    "vocab_size": 1 << 22,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 13,
    "num_local_experts": 1 << 12,
    "num_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
    "max_position_embeddings": 1 << 26,
}


def read_model_config(directory: Path, remedy: str):
    """The transformers config in `directory`/config.json, every size in it checked; a file
    transformers cannot read, or a size out of bounds, is refused with `remedy` (what to do)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory)
    except (
        Exception
    ) as error:  # transformers' own validation raises many kinds; each means the file is unusable
        raise SlimlmError(
            f"'{Path(directory) / 'config.json'}' cannot be read ({first_line(error)}); {remedy}"
        ) from None
    for part in (config, getattr(config, "text_config", None)):
        for key, limit in SIZE_LIMITS.items():
            value = getattr(part, key, None)
            if value is not None and not (type(value) is int and 0 < value <= limit):
                raise SlimlmError(
                    f"'{Path(directory) / 'config.json'}' gives {key} = {str(value)[:40]}, "
                    f"not a whole number from 1 to {limit:,}; {remedy}"
                )
    return config


def empty_model(config, dtype: Optional[torch.dtype], directory: Path, remedy: str) -> nn.Module:
    """The model `config` describes with its weights on the meta device (no memory, no
    initialization); only non-persistent buffers (rotary frequencies, embedding scales:
    computed from the config, in no checkpoint, a few KB) are made for real, on the CPU.
    dtype None: the config's own (float32 where it names none)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    chosen: Any = dtype or getattr(config, "dtype", None) or torch.float32
    chosen = getattr(torch, chosen, None) if isinstance(chosen, str) else chosen
    if not isinstance(chosen, torch.dtype):
        raise SlimlmError(
            f"'{Path(directory) / 'config.json'}' gives dtype "
            f"{str(getattr(config, 'dtype', None))[:40]}, not a torch dtype; {remedy}"
        )
    try:
        with no_init_weights(), init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=chosen)
    except Exception as error:  # as above: transformers checks values as it builds
        raise SlimlmError(
            f"'{Path(directory) / 'config.json'}' describes no model "
            f"transformers can build ({first_line(error)}); {remedy}"
        ) from None


def first_line(error: BaseException) -> str:
    """An exception as one line: its type when its message is empty."""
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__
