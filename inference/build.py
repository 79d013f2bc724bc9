"""Build the decoder's Transformer from a loaded model: an HF checkpoint, a GGUF file's
conversion, or a slimlm artifact whose layers are QuantLinear.

The source model's tensors are moved into decoder layers one module at a time, each in the
kernel its scheme allows (inference.linear); q/k/v and gate/up are fused.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from slimlm.inference.linear import DequantLinear, DenseLinear, build_linear, fuse
from slimlm.inference.model import Attention, Block, FeedForward, ModelArgs, Transformer
from slimlm.qlinear import QuantEmbedding


class RowEmbedding(nn.Module):
    """Token embedding read as rows of a weight matrix (a tied head's, or its own table)."""

    def __init__(self, table: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens.reshape(-1), self.dtype).view(*tokens.shape, -1)


def build_decoder(model: nn.Module, dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None, kernels: bool = True, int8_activations: bool = False) -> Transformer:
    """A decoder Transformer holding `model`'s weights (HF Llama-family layout). With
    `int8_activations`, int8 layers also round their inputs to int8 (CPU; see Int8Linear)."""
    device = torch.device(device or "cpu")

    def linear(layer: nn.Module) -> nn.Module:
        return build_linear(layer, dtype, device, kernels, int8_activations)

    args = ModelArgs.from_hf_config(model.config)
    blocks = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attention = Attention(args, linear(fuse([attn.q_proj, attn.k_proj, attn.v_proj])), linear(attn.o_proj))
        feed_forward = FeedForward(linear(fuse([mlp.gate_proj, mlp.up_proj])), linear(mlp.down_proj))
        block = Block(args, attention, feed_forward)
        block.attention_norm.weight.data = layer.input_layernorm.weight.detach().to(device=device, dtype=dtype)
        block.ffn_norm.weight.data = layer.post_attention_layernorm.weight.detach().to(device=device, dtype=dtype)
        blocks.append(block)
    head = model.get_output_embeddings()
    output = linear(head)
    source_embedding = model.get_input_embeddings()
    if isinstance(source_embedding, QuantEmbedding):  # tied to the quantized head
        table = output if hasattr(output, "rows") else DequantLinear(source_embedding.head, dtype, device)
    elif args.tie_embeddings and isinstance(output, DenseLinear):
        table = output
    else:
        table = DenseLinear(source_embedding.weight, None, dtype, device)
    decoder = Transformer(args, RowEmbedding(table, dtype), blocks, output, dtype).to(device)
    decoder.norm.weight.data = model.model.norm.weight.detach().to(device=device, dtype=dtype)
    return decoder.eval()


def describe_kernels(decoder: Transformer) -> dict[str, int]:
    """How many decoder layers run in each kernel (for reports)."""
    from slimlm.inference.linear import kernel_name

    counts: dict[str, int] = {}
    for block in decoder.layers:
        for layer in (block.attention.qkv, block.attention.o_proj, block.feed_forward.gate_up, block.feed_forward.down):
            counts[kernel_name(layer)] = counts.get(kernel_name(layer), 0) + 1
    head = kernel_name(decoder.output)
    counts[f"head: {head}"] = 1
    return counts

