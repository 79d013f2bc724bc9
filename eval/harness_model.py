"""The `slimlm` model type of lm-evaluation-harness, registered when this module is imported
(`slimlm lm-eval` does): --model slimlm --model_args path=PATH[,dtype=bfloat16]."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from slimlm.config import ModelConfig
from slimlm.eval.harness import without_retying
from slimlm.models import load_model

log = logging.getLogger(__name__)


@register_model("slimlm")
class SlimlmLM(HFLM):
    """The harness's Hugging Face model class over a model slimlm loads: a slimlm artifact
    (checksums verified, weights kept packed), an HF checkpoint or a GGUF file."""

    def __init__(
        self, path: str, dtype: str = "float32", device: Optional[str] = None, batch_size: int = 1, **kwargs
    ):
        target = torch.device(device or "cuda")
        if (
            target.type == "cuda" and not torch.cuda.is_available()
        ):  # the harness's default device, on a machine without one
            log.warning("no CUDA device here: the model runs on the CPU")
            target = torch.device("cpu")
        loaded = load_model(ModelConfig(name=Path(path).name, path=path, dtype=dtype), target)
        super().__init__(
            pretrained=without_retying(loaded.model),
            tokenizer=loaded.tokenizer,
            batch_size=batch_size,
            device=str(target),
            **kwargs,
        )
