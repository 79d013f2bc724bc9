"""The bundled decoder's model: a decoder-only transformer in plain PyTorch, top to bottom.

One module covers the families in inference/families.py (llama, mistral, qwen2, qwen3, gemma3
text, phi3, and the mixtures of experts qwen3_moe, mixtral, olmoe): what differs between them
(norms, q/k norms, activation, scales, each layer's window and RoPE table, routed experts) is
read from the HF config once. Its linear layers are whatever
`inference.linear` built for each weight's scheme; this file only decides the order of operations.

Decoding state lives in a static cache allocated once by `setup_cache`: keys and values for
`batch` sequences of at most `max_seq` slots; attention reads each row up to its current slot
only. An int8 cache stores each head's key or value vector as int8 codes with one absmax scale
(a quarter of an fp32 cache's bytes, about half of an fp16 one's). A CPU's decode steps attend
over an fp32 or int8 cache in slimlm's own kernel (the codes read as stored); other steps
dequantize what they read.
Sequences of different lengths decoded together are left-padded: row b's tokens start at slot
`pad[b]`, its RoPE positions count from there, and its queries never see the slots before it.
For continuous batching (`forward_segments`) every sequence owns a row and advances on its own.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.errors import SlimlmError
from slimlm.experts import dispatch
from slimlm.inference import cpu_kernels
from slimlm.inference.families import (
    FAMILIES,
    Family,
    LayerKind,
    Rope,
    Routing,
    activation_of,
    attention_scale,
    embedding_scale,
    expert_layers,
    family_of,
    hf_config,
    layer_kinds,
    routing_of,
)

ARCHITECTURES = tuple(FAMILIES)


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    family: Family
    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool
    activation: str
    attention_scale: float
    embed_scale: Optional[float]
    final_softcap: Optional[float]
    kinds: tuple[LayerKind, ...]  # the kinds of attention layer (window, RoPE table)
    layer_kind: tuple[int, ...]  # each layer's kind: an index into `kinds`
    routing: Optional[Routing] = None  # a mixture of experts' router; None: dense MLPs only
    expert_layers: tuple[bool, ...] = ()  # whether each layer's MLP is a mixture of experts
    clip_qkv: Optional[float] = None  # OLMoE: queries, keys and values clamped to +-clip_qkv

    def is_expert_layer(self, index: int) -> bool:
        """Whether layer `index`'s MLP is a mixture of experts."""
        return bool(self.expert_layers) and self.expert_layers[index]

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelArgs":
        """Read a transformers config (object or dict); refuse families the decoder does not run."""
        c = config if isinstance(config, dict) else config.to_dict()
        family = family_of(c)
        hf = hf_config(config)
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        kinds, layer_kind = layer_kinds(hf, head_dim)
        routing = routing_of(hf, family)
        return cls(
            architecture=c["model_type"],
            family=family,
            vocab_size=c["vocab_size"],
            dim=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(c.get("attention_bias", False)),
            activation=activation_of(hf, family),
            attention_scale=attention_scale(hf, head_dim),
            embed_scale=embedding_scale(hf, family),
            final_softcap=c.get("final_logit_softcapping"),
            kinds=kinds,
            layer_kind=layer_kind,
            routing=routing,
            expert_layers=expert_layers(hf, routing),
            clip_qkv=c.get("clip_qkv"),
        )


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Vectors [..., head_dim] as the cache stores them: in `dtype`, or for int8 as codes plus
    one scale per vector (absmax / 127)."""
    if dtype != torch.int8:
        return x.to(dtype), None
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x.float() / scale).to(torch.int8), scale


def from_cache(codes: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype) if scale is None else codes.to(dtype) * scale.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the HF (half-split) layout over a head's first 2 * cos.shape[-1] channels: pairs
    are (i, i + half); with partial rotary (Phi-4-mini) the channels after them pass unchanged."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class ProjectionRMSNorm(RMSNorm):
    """OLMoE's query and key norm: one RMSNorm over all heads of the projection, [..., heads, head_dim]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(-2)).view_as(x)


CACHE_NAMES = ("k_cache", "v_cache", "k_cache_scale", "v_cache_scale")  # each Attention's cache buffers


@dataclass(frozen=True)
class RowRecord:
    """What a cache row holds, as the generation that ended there recorded it."""

    tokens: list[int]  # in its slots from 0
    prompt: int  # how many of them were that generation's prompt (the rest, its answer)


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a packed pass: `tokens` written to cache row `row` from slot `start`."""

    row: int
    start: int
    tokens: list[int]


# Runs of a row up to this long (guesses being checked) attend as one-token queries where the
# CPU kernel runs.
SHORT_RUN = 8


@dataclass(frozen=True)
class Segments:
    """Where each token of a packed pass goes (`Transformer.forward_segments`): the first
    `singles` are one query each at its own row and slot (decode steps, and where slimlm's CPU
    kernel runs, the tokens of short segments: guesses), attended together as one decode step;
    the rest runs of several tokens, each prefilled into its row."""

    singles: int
    single_rows: torch.Tensor  # [singles]
    single_slots: torch.Tensor  # [singles]
    single_mask: torch.Tensor  # [singles, 1, 1, single_end]
    single_end: int
    offsets: list[int]  # each run's first token in the pass
    runs: list[
        tuple[int, torch.Tensor, torch.Tensor, int]
    ]  # each run's row, slots, mask [1, 1, length, end] and end


# An Attention layer's cache slots as stored: key codes, key scales, value codes, value scales
Stored = tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor]]


class Attention(nn.Module):
    """Grouped-query attention; q, k and v come from one fused projection. `q_norm` and `k_norm`
    (Qwen3, Gemma 3, OLMoE) norm the queries and keys before RoPE. How it reads its cache
    (`paths`, a `TorchPaths` or `KernelPaths`) is chosen when `decode_kernel` is set."""

    def __init__(
        self,
        args: ModelArgs,
        qkv: nn.Module,
        o_proj: nn.Module,
        q_norm: Optional[nn.Module] = None,
        k_norm: Optional[nn.Module] = None,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.attention_scale
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.clip = args.clip_qkv
        for name in CACHE_NAMES:  # scales: int8 caches only
            self.register_buffer(name, None, persistent=False)
        self.attention_dtype = torch.float32  # what cached keys and values are read as
        self.decode_kernel = False

    @property
    def decode_kernel(self) -> bool:
        """Whether decode steps and short runs attend in slimlm's CPU kernel (`KernelPaths`)."""
        return isinstance(self.paths, KernelPaths)

    @decode_kernel.setter
    def decode_kernel(self, kernel: bool) -> None:
        self.paths = KERNEL_PATHS if kernel else TORCH_PATHS  # chosen here, not at each step

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: Union[torch.Tensor, "Segments"],
        mask: Optional[torch.Tensor] = None,
        end: int = 0,
        first_row: int = 0,
    ) -> torch.Tensor:
        """x [batch, length] written at `slots` of cache rows first_row..first_row+batch-1; or,
        `slots` a `Segments`, x [1, tokens] packing several sequences' tokens, each written to
        its own row at its own slots (`Transformer.forward_segments`)."""
        batch, length, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = (
            self.attend_segments(q, k, v, slots)
            if isinstance(slots, Segments)
            else self.paths.rows(self, q, k, v, slots, mask, end, first_row)
        )
        return self.o_proj(
            out.transpose(1, 2).reshape(batch, length, self.n_heads * self.head_dim).to(x.dtype)
        )

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [batch, heads, length, head_dim], keys and values [batch, kv_heads, length,
        head_dim] of x [batch, length, dim]: clamped, normed and rotated as the family does."""
        batch, length, _ = x.shape
        heads, kv_heads = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        qk = qkv[:, :, : heads + kv_heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])), dim=2)
        qk = rotate(qk, cos, sin)  # q and k heads rotated in one go
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
        return q, k, qkv[:, :, heads + kv_heads :].transpose(1, 2)

    def attend_segments(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: "Segments"
    ) -> torch.Tensor:
        """Attention of a packed pass [1, heads, tokens, head_dim]: the single queries (packed
        first) together as one decode step of their rows, each longer segment as a prefill of
        its row."""
        n, parts = segments.singles, []
        if n:
            as_batch = [
                t[0, :, :n].transpose(0, 1)[:, :, None].contiguous() for t in (q, k, v)
            ]  # [n, heads, 1, head_dim]
            parts.append(
                self.paths.each_row(
                    self,
                    *as_batch,
                    segments.single_slots,
                    segments.single_mask,
                    segments.single_end,
                    segments.single_rows,
                )[:, :, 0].transpose(0, 1)[None]
            )
        for offset, (row, slots, mask, end) in zip(segments.offsets, segments.runs):
            span = slice(offset, offset + len(slots))
            parts.append(
                self.paths.rows(self, q[:, :, span], k[:, :, span], v[:, :, span], slots, mask, end, row)
            )
        return torch.cat([p.to(parts[0].dtype) for p in parts], dim=2) if len(parts) > 1 else parts[0]

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, first: int) -> None:
        """Write k and v [batch, kv_heads, length, head_dim] at `slots` of the consecutive cache
        rows first..first+batch-1 (codes and scales for an int8 cache)."""
        rows = slice(first, first + k.shape[0])
        for cache, scale, new in (
            (self.k_cache, self.k_cache_scale, k),
            (self.v_cache, self.v_cache_scale, v),
        ):
            codes, new_scale = to_cache(new, cache.dtype)
            cache[rows].index_copy_(2, slots, codes)
            if scale is not None:
                scale[rows].index_copy_(2, slots, new_scale)

    def write_each_row(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Write k and v [batch, kv_heads, 1, head_dim], one token per sequence: sequence b's at
        slot slots[b] of cache row rows[b]."""
        for cache, scale, new in (
            (self.k_cache, self.k_cache_scale, k),
            (self.v_cache, self.v_cache_scale, v),
        ):
            codes, new_scale = to_cache(new, cache.dtype)
            cache[rows, :, slots] = codes[:, :, 0]
            if scale is not None:
                scale[rows, :, slots] = new_scale[:, :, 0]

    def stored(self, rows: Union[slice, torch.Tensor], end: int) -> Stored:
        """The cache's slots up to `end` of `rows` (an index of the rows dimension: a slice
        gives views, a tensor of rows a gathered copy) as stored: key codes, key scales, value
        codes, value scales (scales None but for an int8 cache)."""
        k_scale, v_scale = self.k_cache_scale, self.v_cache_scale
        return (
            self.k_cache[rows, :, :end],
            None if k_scale is None else k_scale[rows, :, :end],
            self.v_cache[rows, :, :end],
            None if v_scale is None else v_scale[rows, :, :end],
        )

    def attend_stored(self, q: torch.Tensor, stored: Stored, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Torch's attention of q [batch, heads, length, head_dim] over keys and values read
        from `stored` (dequantized for an int8 cache) under `mask`."""
        k_codes, k_scale, v_codes, v_scale = stored
        keys = from_cache(k_codes, k_scale, self.attention_dtype)
        values = from_cache(v_codes, v_scale, self.attention_dtype)
        q = q.to(keys.dtype)  # fp32 on CPU (bf16 matmuls are slow there), the activations' dtype on GPUs
        if q.shape[2] == 1:
            return self.attend_one(q, keys, values, mask)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.n_heads != self.n_kv_heads
        )

    def attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """One query per sequence (a decode step): the query heads of each key/value head are
        stacked as rows of one small matmul, the way grouped-query attention shares keys.

        Compiled for a CPU without slimlm's kernel (not x86, no compiler, a bf16 cache), the
        same sums are written as products and reductions: Inductor
        fuses them with the softmax into one loop over the cache, where the matmul form is
        matched to its flash-attention kernel (about 30 us per layer at one query, a tenth of
        a small model's decode step)."""
        batch, group = q.shape[0], self.n_heads // self.n_kv_heads
        grouped = q.reshape(batch, self.n_kv_heads, group, self.head_dim)
        fused_loops = torch.compiler.is_compiling() and q.device.type == "cpu"
        if fused_loops:
            scores = (grouped[:, :, :, None] * keys[:, :, None]).sum(-1)
        else:
            scores = torch.matmul(grouped, keys.transpose(-1, -2))
        scores = scores * self.scale  # [batch, kv_heads, group, keys]
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(-1)
        out = (
            (weights[..., None] * values[:, :, None]).sum(-2)
            if fused_loops
            else torch.matmul(weights, values)
        )
        return out.reshape(batch, self.n_heads, 1, self.head_dim)


class TorchPaths:
    """How an `Attention` layer writes its cache and attends over it in torch's attention: a
    view of consecutive rows, or a gathered copy of scattered ones, dequantized for an int8
    cache. `rows` and `each_row` take q [batch, heads, length, head_dim], k and v [batch,
    kv_heads, length, head_dim], and return the attention's output shaped as q."""

    def rows(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        mask: Optional[torch.Tensor],
        end: int,
        first: int,
    ) -> torch.Tensor:
        """Sequences in the consecutive rows first..first+batch-1, all written at `slots`; each
        query attends over its row's slots up to `end` under `mask`."""
        layer.write_rows(k, v, slots, first)
        return layer.attend_stored(q, layer.stored(slice(first, first + q.shape[0]), end), mask)

    def each_row(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        mask: Optional[torch.Tensor],
        end: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence, each in its own row: sequence b's written at slot slots[b]
        of row rows[b]."""
        layer.write_each_row(k, v, slots, rows)
        return layer.attend_stored(q, layer.stored(rows, end), mask)


class KernelPaths(TorchPaths):
    """Decode steps attend in slimlm's CPU kernel (inference/kernels/), which reads each
    sequence's own row where it lies, an int8 one as stored. A short run of a row (speculative
    guesses being checked, a prompt's last few tokens) goes to the kernel as one query per
    token, each a sequence of that row with its own row of the mask; longer runs, torch's."""

    def rows(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        mask: Optional[torch.Tensor],
        end: int,
        first: int,
    ) -> torch.Tensor:
        """As `TorchPaths.rows`: a decode step or a short run in the kernel, a longer run in torch."""
        length = q.shape[2]
        if length != 1 and (length > SHORT_RUN or mask is None):
            return super().rows(layer, q, k, v, slots, mask, end, first)
        layer.write_rows(k, v, slots, first)
        stored = layer.stored(slice(first, first + q.shape[0]), end)
        if length == 1:
            return cpu_kernels.ops().decode_attention(q, *stored, mask, layer.scale, None)
        return self.short_run(layer, q, stored, mask, end)

    def short_run(
        self, layer: Attention, q: torch.Tensor, stored: Stored, mask: torch.Tensor, end: int
    ) -> torch.Tensor:
        """Query j of row b as sequence b * length + j of the kernel, with its own row of the mask."""
        batch, heads, length, head_dim = q.shape
        queries = q.transpose(1, 2).reshape(batch * length, heads, 1, head_dim)
        masks = mask.expand(batch, 1, length, end).reshape(batch * length, 1, 1, end)
        readers = torch.arange(batch, device=q.device).repeat_interleave(length)
        out = cpu_kernels.ops().decode_attention(queries, *stored, masks, layer.scale, readers)
        return out.view(batch, length, heads, head_dim).transpose(1, 2)

    def each_row(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        mask: Optional[torch.Tensor],
        end: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """The kernel reads the whole cache (a view), each sequence's row by its index in `rows`."""
        layer.write_each_row(k, v, slots, rows)
        return cpu_kernels.ops().decode_attention(q, *layer.stored(slice(None), end), mask, layer.scale, rows)


TORCH_PATHS, KERNEL_PATHS = TorchPaths(), KernelPaths()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATION_FUNCTIONS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


class FeedForward(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one projection; act is SiLU
    (SwiGLU) or GELU-tanh (Gemma's GeGLU)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, activation: str = "silu"):
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.activation = ACTIVATION_FUNCTIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activation(gate) * up)


class MoE(nn.Module):
    """A mixture of experts: the router scores every expert for each token; the token's `top_k`
    experts (gated MLPs) run on it and their outputs add up, weighted by the router's softmax
    probabilities (rescaled to sum to 1 where the model says so), as transformers computes them.
    The router runs in fp32, so bf16 activations choose the experts an fp32 model would.
    Experts on another device than the activations (host memory, with the rest on a GPU) get the
    tokens routed to them there and send their sum back."""

    def __init__(
        self,
        router: torch.Tensor,
        experts: list[FeedForward],
        routing: Routing,
        on_host: bool = False,
        stack: Optional[Callable] = None,
    ):
        super().__init__()
        self.register_buffer("router", router.detach().float())
        # A tuple is no submodule: moving the decoder to a GPU leaves host experts where they are.
        self.experts = tuple(experts) if on_host else nn.ModuleList(experts)
        self.home = torch.device("cpu") if on_host else None
        # The experts stacked for one kernel call (inference/expert_stack.py), else one by one.
        self.compute = stack or functools.partial(dispatch, self.experts)
        self.top_k, self.normalized = routing.top_k, routing.normalized
        self.key = next(_MOE_KEYS)
        _MOE_LAYERS[self.key] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = F.linear(flat.float(), self.router).softmax(-1).topk(self.top_k, dim=-1)
        if self.normalized:
            weights = weights / weights.sum(-1, keepdim=True)
        return routed_experts(flat, chosen, weights.to(flat.dtype), self.key).view_as(x)

    def run_experts(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        home = self.home or flat.device
        return self.compute(flat.to(home), chosen.to(home), weights.to(home)).to(flat.device)


_MOE_KEYS = itertools.count()
_MOE_LAYERS: "weakref.WeakValueDictionary[int, MoE]" = weakref.WeakValueDictionary()


# Which experts run depends on the tokens: a compiled step calls this op as one opaque node
# (one graph, no break), and CUDA graphs leave it out (its kernels differ from step to step).
@torch.library.custom_op("slimlm::routed_experts", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def routed_experts(
    flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, layer: int
) -> torch.Tensor:
    """MoE layer `layer`'s experts on the tokens routed to them, weighted and summed."""
    return _MOE_LAYERS[layer].run_experts(flat, chosen, weights)


@routed_experts.register_fake
def _routed_experts_shape(
    flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, layer: int
) -> torch.Tensor:
    return torch.empty_like(flat)


class Block(nn.Module):
    """Norm, attention, residual add; norm, MLP, residual add. Families with Gemma's sandwich
    norms also norm the attention's and the MLP's outputs (`after_attention`, `after_ffn`);
    for the others those are identities."""

    def __init__(self, args: ModelArgs, attention: Attention, feed_forward: Union[FeedForward, MoE]):
        super().__init__()
        sandwich = "after_attention" in args.family.norms
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention
        self.after_attention = RMSNorm(args.dim, args.norm_eps) if sandwich else nn.Identity()
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward
        self.after_ffn = RMSNorm(args.dim, args.norm_eps) if sandwich else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: Union[torch.Tensor, "Segments"],
        mask: Optional[torch.Tensor] = None,
        end: int = 0,
        first_row: int = 0,
    ) -> torch.Tensor:
        h = x + self.after_attention(
            self.attention(self.attention_norm(x), cos, sin, slots, mask, end, first_row)
        )
        return h + self.after_ffn(self.feed_forward(self.ffn_norm(h)))


class Rotary(nn.Module):
    """One kind of layer's RoPE: cos and sin [batch or 1, length, 1, rotary_dim/2] for positions
    [batch or 1, length], in the activations' dtype."""

    def __init__(self, rope: Rope, dtype: torch.dtype):
        super().__init__()
        self.rope, self.dtype = rope, dtype
        self.register_buffer("inv_freq", rope.frequencies(0), persistent=False)

    def fit(self, context: int) -> None:
        """The frequencies for a cache of `context` slots (longrope's long ones past its original context)."""
        self.inv_freq.copy_(self.rope.frequencies(context))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None, None].float() * self.inv_freq
        scaling = self.rope.attention_scaling
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)


class Transformer(nn.Module):
    """Token ids in, next-token logits out; the layers' kernels were chosen when it was built."""

    def __init__(
        self,
        args: ModelArgs,
        embedding: nn.Module,
        blocks: list[Block],
        output: nn.Module,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.args = args
        self.dtype = dtype  # of activations
        self.embedding = embedding
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = output
        self.rotaries = nn.ModuleList(
            Rotary(kind.rope, dtype) for kind in args.kinds
        )  # one per kind of layer
        # Gemma scales embeddings by sqrt(hidden_size) rounded to the model's dtype, as transformers does
        self.embed_scale = (
            None if args.embed_scale is None else float(torch.tensor(args.embed_scale, dtype=dtype))
        )
        self.max_batch = self.max_seq = 0
        self.held: dict[int, RowRecord] = {}  # cache row -> what it holds (Decoder.remember)
        self.streamer = None  # a LayerStreamer when some blocks live in host memory (inference/streaming.py)

    def setup_cache(
        self, batch: int, max_seq: int, cache_dtype: Optional[torch.dtype] = None, keep: bool = False
    ) -> None:
        """Allocate the key/value cache once; decoding never allocates it again. Its dtype
        defaults to the activations' on GPUs and to fp32 on CPUs (where bf16 attention is slow);
        torch.int8 stores codes and a float32 scale per head and slot. A CPU's decode steps attend
        over an fp32 or int8 cache in slimlm's own kernel where it builds (inference/cpu_kernels.py).
        `keep`: the rows' recorded contents (`held`) are copied into the new cache, as far as
        it holds them (a conversation's next turn needs a longer cache, not a new prefill)."""
        if max_seq > self.args.max_position_embeddings:
            raise SlimlmError(
                f"a context of {max_seq} tokens is longer than the model's "
                f"{self.args.max_position_embeddings}; ask for fewer new tokens or a shorter prompt"
            )
        device = self.device
        float_dtype = self.dtype if device.type == "cuda" else torch.float32
        cache_dtype = cache_dtype or float_dtype
        shape = (batch, self.args.n_kv_heads, max_seq, self.args.head_dim)
        scaled = cache_dtype == torch.int8
        kernel = (
            cache_dtype in (torch.float32, torch.int8)
            and device.type == "cpu"
            and self.args.head_dim % 8 == 0
            and cpu_kernels.available()
        )
        same_kind = self.max_seq > 0 and self.layers[0].attention.k_cache.dtype == cache_dtype
        kept = (
            {
                row: RowRecord(r.tokens[:max_seq], min(r.prompt, max_seq))
                for row, r in self.held.items()
                if row < batch
            }
            if keep and same_kind
            else {}
        )
        try:
            for block in self.layers:  # layer by layer: the old cache's layers are freed as the new one grows
                attention = block.attention
                before = [getattr(attention, name) for name in CACHE_NAMES]
                attention.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
                attention.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
                attention.k_cache_scale = torch.zeros(*shape[:-1], 1, device=device) if scaled else None
                attention.v_cache_scale = torch.zeros(*shape[:-1], 1, device=device) if scaled else None
                attention.attention_dtype = float_dtype if scaled else cache_dtype
                attention.decode_kernel = kernel
                for old, new in zip(before, (getattr(attention, name) for name in CACHE_NAMES)):
                    if old is None:  # no scales: not an int8 cache
                        continue
                    for row, record in kept.items():
                        new[row, :, : len(record.tokens)] = old[row, :, : len(record.tokens)]
        except BaseException:
            self.drop_cache()  # never layers of two shapes: a compiled step checks only the first layer's
            raise
        self.max_batch, self.max_seq = batch, max_seq
        self.held = kept
        for rotary in self.rotaries:
            rotary.fit(max_seq)

    def drop_cache(self) -> None:
        """No cache at all (freed): the next generation allocates a whole new one."""
        for block in self.layers:
            for name in CACHE_NAMES:
                setattr(block.attention, name, None)
        self.max_batch = self.max_seq = 0
        self.held = {}

    def copy_slots(self, source: int, target: int, start: int, end: int) -> None:
        """Copy cache slots start..end-1 of row `source` into row `target` (every layer's keys,
        values and int8 scales): the same tokens at the same positions need not be computed
        again. Drops the target's record in `held` (first: a copy that fails leaves none stale)."""
        self.held.pop(target, None)
        self.check_cache(max(source, target) + 1, end)
        for tensor in self.cache_tensors():
            tensor[target, :, start:end] = tensor[source, :, start:end]

    def cache_tensors(self) -> list[torch.Tensor]:
        return [
            t
            for b in self.layers
            for t in (getattr(b.attention, name) for name in CACHE_NAMES)
            if t is not None
        ]

    def cache_bytes(self) -> int:
        return sum(t.nbytes for t in self.cache_tensors())

    def weight_bytes(self) -> int:
        """Bytes of every stored weight (parameters and buffers, the cache and RoPE table aside)."""
        skip = {id(t) for t in self.rotaries.buffers()} | {id(t) for t in self.cache_tensors()}
        seen = {id(t): t for t in (*self.parameters(), *self.buffers()) if id(t) not in skip}
        return sum(t.nbytes for t in seen.values())

    def bytes_per_token(self, context: int) -> int:
        """The least a batch-1 decode step at `context` tokens reads: every weight except the
        embedding table (one row of it), and the cache up to `context`."""
        table = getattr(
            self.embedding, "table", None
        )  # None: a table in host memory (streaming.HostEmbedding), not in weight_bytes
        tensors = [self.embedding.host_table] if table is None else [*table.parameters(), *table.buffers()]
        table_bytes = 0 if table is None or table is self.output else sum(t.nbytes for t in tensors)
        row = self.args.dim * tensors[0].element_size()
        kv = (
            self.cache_bytes() * context // (self.max_seq * self.max_batch)
            if self.max_seq
            else 2 * self.args.n_layers * self.args.n_kv_heads * self.args.head_dim * context * 4
        )  # an fp32 cache
        return self.weight_bytes() - table_bytes + row + kv

    def forward(
        self,
        tokens: torch.Tensor,
        start: int,
        pad: Optional[torch.Tensor] = None,
        last_only: bool = False,
        first_row: int = 0,
    ) -> torch.Tensor:
        """Logits [batch, length, vocab] for `tokens` [batch, length] written at cache slots
        start..start+length; `pad` [batch] is each row's left padding (its first real slot),
        None when every row starts at slot 0. `last_only`: logits of the last position only
        (a prefill needs no more, and a chunk's logits over a large vocabulary are big).
        `first_row`: the cache rows used are first_row..first_row+batch-1."""
        batch, length = tokens.shape
        self.check_cache(first_row + batch, start + length)
        end = start + length
        slots = torch.arange(start, end, device=tokens.device)
        # A plain decode step of a global layer needs no mask; a sliding-window layer always takes
        # one, so the compiled step (whose slot is symbolic) has no branch at the window's edge.
        plain = length == 1 and pad is None
        masks = [
            None if plain and kind.window is None else self.attention_mask(slots, pad, end, kind.window)
            for kind in self.args.kinds
        ]
        return self.run_layers(tokens, slots, pad, masks, end, first_row, last_only)

    def step_static(
        self, tokens: torch.Tensor, slot: torch.Tensor, pad: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """A decode step whose shapes never change, what a CUDA graph replays at every position:
        `tokens` [batch, 1] go to cache slot `slot` (a one-element tensor, not a Python int), and
        attention reads the whole cache with the slots after `slot` masked. Logits [batch, 1, vocab]."""
        self.check_cache(tokens.shape[0], 1)  # the slot is a tensor: the graph's caller keeps it in the cache
        slots = slot.reshape(1)
        masks = [self.attention_mask(slots, pad, self.max_seq, kind.window) for kind in self.args.kinds]
        return self.run_layers(tokens, slots, pad, masks, self.max_seq, 0, False)

    def check_cache(self, rows: int, slots: int) -> None:
        """Refuse a step whose rows or slots the cache does not have (none when none was allocated)."""
        if slots > self.max_seq or rows > self.max_batch:
            raise SlimlmError(
                f"the cache holds {self.max_batch} sequences of {self.max_seq} slots; "
                f"this step needs {rows} of {slots}"
            )

    def run_layers(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        pad: Optional[torch.Tensor],
        masks: list[Optional[torch.Tensor]],
        end: int,
        first_row: int,
        last_only: bool,
    ) -> torch.Tensor:
        """Embedding, blocks and head for `tokens` written at cache `slots`; attention reads
        slots up to `end` under each layer kind's mask in `masks`."""
        positions = (
            slots[None, :] if pad is None else (slots[None, :] - pad[:, None]).clamp(min=0)
        )  # [batch or 1, length]
        tables = [rotary(positions) for rotary in self.rotaries]
        x = self.embed(tokens)
        for block, kind in zip(self.layers, self.args.layer_kind):
            x = block(x, *tables[kind], slots, masks[kind], end, first_row)
        if last_only:
            x = x[:, -1:]
        return self.head(x)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens).to(self.dtype)
        return x if self.embed_scale is None else x * self.embed_scale

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the final hidden states, soft-capped (cap * tanh(logits / cap)) where the
        model's config asks."""
        logits = self.output(self.norm(x))
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward_segments(self, segments: list[Segment], logits_of: list[int]) -> list[torch.Tensor]:
        """One pass over several sequences' tokens at once, each segment written to its own row at
        its own slots: decode steps, prompts' prefill chunks and speculative guesses together,
        so the weights are read once for all (continuous batching's mixed steps). The linear
        layers see the tokens packed in one row, without padding; attention takes the one-token
        segments (and short ones, `Segments`) as one batched decode step and each longer one on
        its own. `logits_of[i]`: how many of segment i's last positions need next-token logits
        (1 for a prefill chunk or a decode step, 1 + guesses to check guesses); returns them
        [logits_of[i], vocab] per segment."""
        for segment, wanted in zip(segments, logits_of, strict=True):
            if (
                not 0 <= segment.row < self.max_batch
                or not segment.tokens
                or segment.start + len(segment.tokens) > self.max_seq
            ):
                raise SlimlmError(
                    f"the cache holds {self.max_batch} sequences of {self.max_seq} slots; a segment of "
                    f"{len(segment.tokens)} tokens from slot {segment.start} of row {segment.row} "
                    "does not fit"
                )
            if not 1 <= wanted <= len(segment.tokens):
                raise SlimlmError(
                    f"logits of {wanted} positions asked of a segment of {len(segment.tokens)} tokens"
                )
        for segment in segments:
            self.held.pop(
                segment.row, None
            )  # rewritten from its start: known again when its generation ends (Decoder.remember)
        # slimlm's CPU kernel reads each query's row in place: a short run (a decode step's guesses)
        # joins the batched step's one-token queries: one kernel call in all instead of one per run.
        longest_single = SHORT_RUN if self.layers[0].attention.decode_kernel else 1
        order = sorted(
            range(len(segments)), key=lambda i: len(segments[i].tokens) > longest_single
        )  # the single queries first
        packed = [segments[i] for i in order]
        short = sum(len(s.tokens) <= longest_single for s in packed)
        where = [self.packed_layout(packed, short, kind.window) for kind in self.args.kinds]
        positions = torch.cat([where[0].single_slots, *(slots for _, slots, _, _ in where[0].runs)])
        tables = [rotary(positions[None, :]) for rotary in self.rotaries]
        wanted, end = [], 0  # the positions whose logits are asked for
        for i in order:
            end += len(segments[i].tokens)
            wanted.extend(range(end - logits_of[i], end))
        wanted_at = torch.tensor(
            wanted, device=self.device
        )  # before the layers: a copy to a GPU after them would wait for them all
        x = self.embed(torch.tensor([[t for s in packed for t in s.tokens]], device=self.device))
        for block, kind in zip(self.layers, self.args.layer_kind):
            x = block(x, *tables[kind], where[kind])
        logits = self.head(x[0, wanted_at]).split([logits_of[i] for i in order])
        by_segment: list[torch.Tensor] = [torch.empty(0)] * len(segments)
        for i, part in zip(order, logits):
            by_segment[i] = part
        return by_segment

    def packed_layout(self, packed: list[Segment], short: int, window: Optional[int]) -> Segments:
        """Where a packed pass's tokens go, and what each sees in layers of `window`: the first
        `short` segments' tokens as single queries, each later segment as a run of its row."""
        device = self.device
        single_rows = [s.row for s in packed[:short] for _ in s.tokens]
        single_slots = torch.tensor(
            [s.start + j for s in packed[:short] for j in range(len(s.tokens))], device=device
        )
        single_end = max((s.start + len(s.tokens) for s in packed[:short]), default=0)
        offsets, runs, offset = [], [], len(single_rows)
        for segment in packed[short:]:
            slots = torch.arange(segment.start, segment.start + len(segment.tokens), device=device)
            end = segment.start + len(segment.tokens)
            offsets.append(offset)
            runs.append((segment.row, slots, self.attention_mask(slots, None, end, window), end))
            offset += len(segment.tokens)
        single_mask = self.attention_mask(single_slots, None, single_end, window).transpose(
            0, 2
        )  # [singles, 1, 1, end]: each its own row's query
        return Segments(
            len(single_rows),
            torch.tensor(single_rows, device=device),
            single_slots,
            single_mask,
            single_end,
            offsets,
            runs,
        )

    @property
    def device(self) -> torch.device:
        return self.rotaries[0].inv_freq.device

    def attention_mask(
        self, slots: torch.Tensor, pad: Optional[torch.Tensor], end: int, window: Optional[int]
    ) -> torch.Tensor:
        """[batch or 1, 1, length, end] booleans: a query sees its own row's slots up to itself
        (after the row's padding, within the sliding window)."""
        keys = torch.arange(end, device=slots.device)
        visible = (keys[None, :] <= slots[:, None])[None]
        if pad is not None:
            visible = visible & (keys[None, None, :] >= pad[:, None, None])
        if window is not None:
            visible = visible & (keys[None, None, :] > slots[None, :, None] - window)
        # A padding query sees itself: its output is never used, but a row with nothing visible
        # would be NaN, and NaN values in the cache poison the real rows' attention sums.
        visible = visible | (keys[None, :] == slots[:, None])[None]
        return visible[:, None]
