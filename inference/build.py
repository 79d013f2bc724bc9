"""Build the decoder's Transformer from a loaded model: an HF checkpoint, a GGUF file's
conversion, or a slimlm artifact whose layers are QuantLinear.

The source model's tensors are moved into decoder layers one module at a time, each in the
kernel its scheme allows (inference.linear); q/k/v and gate/up are fused (phi3 stores them so),
each expert's gate/up too; a mixture of experts' router stays fp32.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from torch import nn

from slimlm.architecture import family_of as compression_family
from slimlm.errors import SlimlmError
from slimlm.experts import split_experts
from slimlm.inference.expert_stack import ExpertStack
from slimlm.inference.linear import GPU_INT4_KERNELS, DenseLinear, DequantLinear, build_linear, fuse
from slimlm.inference.model import (
    Attention,
    Block,
    FeedForward,
    ModelArgs,
    MoE,
    ProjectionRMSNorm,
    RMSNorm,
    Transformer,
)
from slimlm.inference.streaming import (
    HostBlock,
    HostEmbedding,
    LayerStreamer,
    Placement,
    streamed_layers,
    to_host,
)
from slimlm.qlinear import QuantEmbedding, QuantLinear, QuantTable


class RowEmbedding(nn.Module):
    """Token embedding read as rows of a weight matrix (a tied head's, or its own table)."""

    def __init__(self, table: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens.reshape(-1), self.dtype).view(*tokens.shape, -1)


def default_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The activations' dtype when none is asked for: bf16 on a GPU (what its int4 kernels
    read), and on a CPU for a model with quantized layers (torch's packed CPU kernels decode
    several times faster with bf16 activations than with fp32); a float model on a CPU keeps fp32."""
    if device.type == "cuda" or any(isinstance(module, QuantLinear) for module in model.modules()):
        return torch.bfloat16
    return torch.float32


def build_decoder(
    model: nn.Module,
    dtype: Optional[torch.dtype] = torch.float32,
    device: Optional[torch.device] = None,
    kernels: bool = True,
    int8_activations: bool = False,
    gpu_int4: str = "tinygemm",
    placement: Placement = Placement(),
) -> Transformer:
    """A decoder Transformer holding `model`'s weights (HF Llama-family layout). With
    `int8_activations`, int4 and int8 layers also round their inputs to int8 (CPU; see
    Int8ActivationLinear); `gpu_int4` picks the GPU's int4 kernel (inference/linear.py);
    `placement` keeps some of it in host memory (inference/streaming.py); dtype None: default_dtype."""
    parts = DecoderParts(model, dtype, device, kernels, int8_activations, gpu_int4, placement)
    return parts.assemble([parts.block(index, layer) for index, layer in enumerate(model.model.layers)])


class DecoderParts:
    """Turns an HF model's modules into decoder modules one at a time, so a loader can hand
    them over layer by layer (inference/load.py) instead of holding two copies of the model."""

    def __init__(
        self,
        model: nn.Module,
        dtype: Optional[torch.dtype],
        device: Optional[torch.device],
        kernels: bool,
        int8_activations: bool,
        gpu_int4: str = "tinygemm",
        placement: Placement = Placement(),
    ):
        if gpu_int4 not in GPU_INT4_KERNELS:
            raise SlimlmError(
                f"unknown GPU int4 kernel '{gpu_int4}'; choose one of {', '.join(GPU_INT4_KERNELS)}"
            )
        # transformers' fused experts as one Linear per projection, as slimlm's loaders hold them
        # (the same function)
        split_experts(model)
        self.model, self.device = model, torch.device(device or "cpu")
        self.dtype = dtype or default_dtype(model, self.device)
        self.kernels, self.int8_activations, self.gpu_int4 = kernels, int8_activations, gpu_int4
        self.args = ModelArgs.from_hf_config(model.config)
        if not 0 <= placement.stream_layers <= self.args.n_layers:
            raise SlimlmError(
                f"{placement.stream_layers} streamed layers asked for; the model has {self.args.n_layers} "
                "decoder layers"
            )
        if placement.table_on_host and self.args.tie_embeddings:
            raise SlimlmError(
                "this model's embedding is tied to its LM head, which the device reads every step: "
                "it cannot stay in host memory"
            )
        if placement.experts_on_host and self.args.routing is None:
            raise SlimlmError(
                "experts in host memory asked for, but this model has no mixture-of-experts layers; "
                "drop --experts-on-host"
            )
        self.placement = placement
        self.streamed = set(streamed_layers(self.args.n_layers, placement.stream_layers))
        self.hosts: list[HostBlock] = []  # the streamed blocks' weights, in host memory

    def linear(
        self, layer: nn.Module, streamed: bool = False, device: Optional[torch.device] = None
    ) -> nn.Module:
        """`layer` in its kernel, on the decoder's device unless `device` says otherwise (host experts)."""
        return build_linear(
            layer,
            self.dtype,
            device or self.device,
            self.kernels,
            self.int8_activations,
            self.gpu_int4,
            semi_sparse=not streamed,
        )

    def norm_weight(self, norm: nn.Module) -> torch.Tensor:
        """The scale an RMSNorm multiplies by: its weight, plus 1 for Gemma's `(1 + w)` norms."""
        return (norm.weight.detach().float() + self.args.family.norm_offset).to(
            device=self.device, dtype=self.dtype
        )

    def qk_norm(self, norm: nn.Module) -> RMSNorm:
        """A query or key norm: over each head's head_dim channels (Qwen3, Gemma 3), or over the
        whole projection (OLMoE)."""
        kind = ProjectionRMSNorm if self.args.family.qk_norm == "projection" else RMSNorm
        ours = kind(norm.weight.numel(), self.args.norm_eps)
        ours.weight.data = self.norm_weight(norm)
        return ours

    def block(self, index: int, layer: nn.Module) -> Block:
        """Decoder block `index` from its HF layer; a streamed one's weights go to host memory."""
        streamed = index in self.streamed
        block = self._block(index, layer, streamed)
        if streamed:
            self.hosts.append(to_host(block, self.device))
        return block

    def _block(self, index: int, layer: nn.Module, streamed: bool) -> Block:
        attn, mlp = layer.self_attn, layer.mlp
        linear = partial(self.linear, streamed=streamed)
        stored_fused = self.args.family.stored_fused  # phi3
        qkv = attn.qkv_proj if stored_fused else fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        head_norms = (
            (self.qk_norm(attn.q_norm), self.qk_norm(attn.k_norm)) if self.args.family.qk_norm else ()
        )
        attention = Attention(self.args, linear(qkv), linear(attn.o_proj), *head_norms)
        if self.args.is_expert_layer(index):
            feed_forward = self.experts(mlp, streamed)
        else:
            gate_up = mlp.gate_up_proj if stored_fused else fuse([mlp.gate_proj, mlp.up_proj])
            feed_forward = FeedForward(linear(gate_up), linear(mlp.down_proj), self.args.activation)
        block = Block(self.args, attention, feed_forward)
        for ours, theirs in self.args.family.norms.items():
            getattr(block, ours).weight.data = self.norm_weight(getattr(layer, theirs))
        return block

    def experts(self, mlp: nn.Module, streamed: bool) -> MoE:
        """A mixture-of-experts MLP from transformers' block (router `gate`, experts split into
        Linear layers by slimlm/experts.py). With the placement's `experts_on_host` and a GPU,
        the experts are built for and run by the CPU (inference/streaming.py's Placement)."""
        names = compression_family(self.args.architecture).experts
        on_host = self.placement.experts_on_host and self.device.type != "cpu"
        device = torch.device("cpu") if on_host else self.device
        experts = []
        for expert in mlp.experts:
            gate_up = fuse([getattr(expert, names.gate), getattr(expert, names.up)])
            experts.append(
                FeedForward(
                    self.linear(gate_up, streamed, device),
                    self.linear(getattr(expert, names.down), streamed, device),
                    self.args.activation,
                )
            )
        stack = (
            ExpertStack.of(experts, self.args.activation) if device.type == "cpu" and not streamed else None
        )  # streaming moves each tensor on its own
        return MoE(mlp.gate.weight.to(self.device), experts, self.args.routing, on_host, stack)

    def assemble(self, blocks: list[Block]) -> Transformer:
        """The Transformer from its blocks plus the model's head, embedding and final norm."""
        model, dtype, device = self.model, self.dtype, self.device
        output = self.linear(
            model.get_output_embeddings()
        )  # before the streaming buffers: its conversion has the most room
        source_embedding = model.get_input_embeddings()
        if isinstance(source_embedding, QuantEmbedding):  # tied to the quantized head
            table = output if hasattr(output, "rows") else DequantLinear(source_embedding.head, dtype, device)
        elif isinstance(source_embedding, QuantTable):  # untied, quantized: its codes, read by rows
            table = DequantLinear(source_embedding, dtype, device)
        elif self.args.tie_embeddings and isinstance(output, DenseLinear):
            table = output
        elif self.placement.table_on_host:
            table = None
        else:
            table = DenseLinear(source_embedding.weight, None, dtype, device)
        embedding = (
            HostEmbedding(source_embedding.weight, dtype, device)
            if table is None
            else RowEmbedding(table, dtype)
        )
        streamer = (
            LayerStreamer(self.hosts, device) if self.hosts else None
        )  # binds the streamed blocks' device views before .to(device)
        decoder = Transformer(self.args, embedding, blocks, output, dtype).to(device)
        decoder.norm.weight.data = self.norm_weight(model.model.norm)
        decoder.streamer = streamer
        return decoder.eval()


def describe_kernels(decoder: Transformer) -> dict[str, int]:
    """How many decoder layers run in each kernel (for reports)."""
    from slimlm.inference.linear import kernel_name

    counts: dict[str, int] = {}
    for block in decoder.layers:
        mlps = block.feed_forward.experts if isinstance(block.feed_forward, MoE) else (block.feed_forward,)
        for layer in (
            block.attention.qkv,
            block.attention.o_proj,
            *(part for mlp in mlps for part in (mlp.gate_up, mlp.down)),
        ):
            counts[kernel_name(layer)] = counts.get(kernel_name(layer), 0) + 1
    head = kernel_name(decoder.output)
    counts[f"head: {head}"] = 1
    return counts
