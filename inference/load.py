"""Load a slimlm artifact straight into the decoder, one decoder layer at a time.

The model is laid out on the meta device (no memory); each layer's tensors are then read from
the weights file or its shards (slimlm/checkpoint.py, one tensor at a time), turned into the
decoder's kernel layouts and the layer's source copy dropped before the next is read. Memory
then holds the decoder's weights plus one layer in transit, which is what the memory planner
predicts (inference/planner.py), instead of the artifact's model and the decoder side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from slimlm.artifact import ArtifactParts
from slimlm.errors import SlimlmError
from slimlm.inference.build import DecoderParts
from slimlm.inference.model import Transformer
from slimlm.inference.streaming import Placement
from slimlm.memory import return_freed_memory
from slimlm.qlinear import QuantTable


def load_decoder(
    path: Path,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    device: Optional[torch.device] = None,
    kernels: bool = True,
    int8_activations: bool = False,
    gpu_int4: str = "tinygemm",
    placement: Placement = Placement(),
) -> tuple[Transformer, dict]:
    """The decoder for an artifact and its manifest (checksums verified first); `placement`
    keeps some of it in host memory (inference/streaming.py); dtype None: build.default_dtype."""
    artifact = ArtifactParts(path)
    skeleton, manifest, fill = artifact.skeleton, artifact.manifest, artifact.fill
    parts = DecoderParts(skeleton, dtype, device, kernels, int8_activations, gpu_int4, placement)
    blocks = []
    for index, layer in enumerate(skeleton.model.layers):
        fill(layer, f"model.layers.{index}.")
        blocks.append(parts.block(index, layer))
        layer.to("meta")  # the block holds its own layout now: drop the source copy
        # and hand its pages back: glibc keeps freed tensors of a few MB in its heap, so a model of
        # many experts would peak near twice its size
        return_freed_memory()
    fill(skeleton.model.norm, "model.norm.")
    head, embedding = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
    head_stored = artifact.stores("lm_head.")
    if head_stored:
        fill(head, "lm_head.")
    if isinstance(embedding, (nn.Embedding, QuantTable)):  # not a tied quantized head's view (QuantEmbedding)
        fill(embedding, "model.embed_tokens.")
        if not head_stored:  # tied float head: the embedding's table
            head.weight = embedding.weight
    if artifact.unread:
        raise SlimlmError(
            f"artifact '{path}' holds tensors its config.json has no place for "
            f"(e.g. {sorted(artifact.unread)[0]}); re-export it"
        )
    return parts.assemble(blocks), manifest
