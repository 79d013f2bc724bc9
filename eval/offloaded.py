"""Perplexity, KL and reference collection for a checkpoint larger than memory.

The windows go through the model one decoder block at a time, as calibration does
(compress/offload.py): the model is a skeleton on the meta device; the input embedding is read
to embed a group of windows, then each block is read from the checkpoint's safetensors, run
over the group's hidden states and released; last, the model's own forward turns the final
hidden states into logits (fed as input embeddings, its layers stood in for by
pass-throughs), so the final norm, the head and any logit soft-capping are the model's.
Memory holds one block, the head and the group's hidden states; the windows are split into
groups that keep those under `hidden_bytes`, and each group reads the checkpoint once more.

The scores are those of eval/perplexity.score_text for the same windows (WindowScorer).
`checkpoint_size` gives eval/size.model_size's report the same way, a block at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn
from tqdm import tqdm

from slimlm.architecture import decoder_blocks
from slimlm.checkpoint import Checkpoint, open_checkpoint
from slimlm.compress.calibration import capture_layer_inputs, layers_replaced, run_layer
from slimlm.compress.offload import materialize_outside_blocks
from slimlm.eval.kl import ReferenceLogits
from slimlm.eval.perplexity import TextScores, WindowScorer, text_windows
from slimlm.eval.size import SizeReport, size_counts
from slimlm.half_linear import float32_linears

HIDDEN_BYTES = 2**30  # hidden states of one group of windows, in the model's dtype


class _PassThrough(nn.Module):
    """A decoder layer's stand-in that returns its hidden states unchanged."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


@torch.inference_mode()
def score_checkpoint(
    directory: Path,
    token_ids: torch.Tensor,
    window: int,
    max_windows: Optional[int] = None,
    reference: Optional[ReferenceLogits] = None,
    collect_top_k: int = 0,
    dtype: Optional[torch.dtype] = None,
    device: torch.device = torch.device("cpu"),
    hidden_bytes: int = HIDDEN_BYTES,
) -> TextScores:
    """score_text for the checkpoint at `directory`, one block in memory at a time. dtype None:
    the checkpoint's own."""
    checkpoint, model = open_checkpoint(directory, dtype)
    prefix, layers = decoder_blocks(model)
    model_dtype = next(model.parameters()).dtype
    windows = text_windows(token_ids, window, max_windows)
    scorer = WindowScorer(windows.shape[0], window, reference, collect_top_k)
    per_window = window * model.config.get_text_config().hidden_size * model_dtype.itemsize
    with float32_linears(model_dtype, device):
        for group in tqdm(
            windows.split(max(1, hidden_bytes // per_window)), desc="perplexity (offloaded)", unit="group"
        ):
            hidden = _final_hidden_states(checkpoint, model, prefix, layers, group, device, model_dtype)
            materialize_outside_blocks(
                checkpoint, model, prefix, device, skip=model.get_input_embeddings()
            )  # the final norm, the head, rotary tables
            with layers_replaced(layers, [_PassThrough() for _ in layers]):
                for ids, states in zip(group.split(1), hidden):
                    scorer.add(ids, model(inputs_embeds=states, use_cache=False).logits)
            checkpoint.release(model)
    return scorer.result()


def _final_hidden_states(
    checkpoint: Checkpoint,
    model: nn.Module,
    prefix: str,
    layers: nn.ModuleList,
    windows: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The outputs of the last of `layers` (the blocks under `prefix`) for `windows`, one window per chunk."""
    outside = materialize_outside_blocks(
        checkpoint, model, prefix, device, skip=model.get_output_embeddings()
    )
    inputs = capture_layer_inputs(model, windows, chunk_size=1)
    for module in outside:
        checkpoint.release(module)
    hidden = inputs.hidden
    for index, layer in enumerate(layers):
        checkpoint.materialize(layer, f"{prefix}.{index}.", device, dtype)
        hidden = run_layer(layer, inputs.of_layer(index, hidden))
        checkpoint.release(layer)
    return hidden


def checkpoint_size(directory: Path, dtype: Optional[torch.dtype] = None) -> SizeReport:
    """model_size of the checkpoint's model in `dtype` (None: the checkpoint's own), summed over
    its parts read one at a time: what lies outside the decoder blocks, then each block."""
    checkpoint, model = open_checkpoint(directory, dtype)
    prefix, layers = decoder_blocks(model)
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    outside = materialize_outside_blocks(
        checkpoint, model, prefix, torch.device("cpu"), skip=head if tied else None
    )
    if tied:  # the head holds the embedding's table, as in the loaded model: counted once
        head.weight = model.get_input_embeddings().weight
        outside.append(head)
    counts = size_counts(nn.ModuleList(outside))
    checkpoint.release(model)
    for index, layer in enumerate(tqdm(layers, desc="size (offloaded)", unit="layer")):
        checkpoint.materialize(layer, f"{prefix}.{index}.", torch.device("cpu"))
        counts += size_counts(layer)
        checkpoint.release(layer)
    return counts.report()
