"""Quantized linear layers as the compression stages produce them and artifacts store them.

Shared by `compress` (which fills them), the artifact format (which saves and loads them) and
`inference` (which runs them), so that none of those needs to import another.

A weight row is cut into groups of `group_size` input features (or one group per row); each
group has an fp16 scale and, when asymmetric, an integer zero point. Codes are unsigned b-bit
integers, W = (code - zero) * scale, with zero = 2**(b-1) for symmetric schemes.

A layer may also carry a low-rank adapter trained on top of its frozen codes (LoRA, see
distill/stage.py): y = x W^T + (x A^T) B^T + b. The adapter stays beside the codes because
folding it into them would mean rounding the weight again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.packing import PACKABLE_BITS, pack_codes, unpack_codes

ADAPTER_BUFFERS = ("lora_a", "lora_b")  # a QuantLinear's adapter tensors, beside its codes
MERGE_CHUNK_VALUES = (
    2**23
)  # weights dequantized at once by merged_weight (its temporaries: a few times 32 MB)


@dataclass(frozen=True)
class QuantScheme:
    """How one weight matrix is quantized."""

    bits: int = 8
    group_size: Optional[int] = None  # None: one group (one scale) per output channel
    symmetric: bool = True
    method: str = "rtn"

    @property
    def max_code(self) -> int:
        return 2**self.bits - 1

    @property
    def symmetric_zero(self) -> int:
        return 2 ** (self.bits - 1)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def shape_problem(self, in_features: int) -> Optional[str]:
        """Why a layer with `in_features` inputs cannot take this scheme, or None if it can."""
        if self.bits not in PACKABLE_BITS:
            return f"{self.bits}-bit weights are not supported (choose one of {PACKABLE_BITS})"
        if self.group_size is not None and (self.group_size < 8 or in_features % self.group_size):
            return (
                f"group size {self.group_size} does not divide its "
                f"{in_features} input features into groups of at least 8"
            )
        if in_features % 8:
            return f"its {in_features} input features are not a multiple of 8 (needed to pack codes)"
        return None

    def to_dict(self) -> dict:
        return asdict(self)


class QuantLinear(nn.Module):
    """y = x W^T + b with W = (code - zero) * scale per group; codes packed b bits each.

    The forward pass dequantizes into the activation dtype and calls an ordinary matmul:
    correct everywhere and exact to the stored integers; the decoder swaps in packed kernels.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        bias: bool = False,
        adapter_rank: int = 0,
    ):
        super().__init__()
        problem = scheme.shape_problem(in_features)
        if problem:
            raise ValueError(f"cannot build a {scheme} layer: {problem}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        groups = scheme.groups(in_features)
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features * scheme.bits // 8, dtype=torch.uint8)
        )
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16))
        self.register_buffer(
            "zeros", None if scheme.symmetric else torch.zeros(out_features, groups, dtype=torch.uint8)
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.register_buffer(
            "lora_a", torch.zeros(adapter_rank, in_features) if adapter_rank else None
        )  # ADAPTER_BUFFERS
        self.register_buffer("lora_b", torch.zeros(out_features, adapter_rank) if adapter_rank else None)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: Optional[torch.Tensor],
        scheme: QuantScheme,
        bias: Optional[torch.Tensor],
    ) -> "QuantLinear":
        """Build from unpacked codes [out, in] (uint8), scales [out, groups] and zeros (asymmetric)."""
        layer = cls(codes.shape[1], codes.shape[0], scheme, bias=bias is not None).to(codes.device)
        layer.qweight.copy_(pack_codes(codes, scheme.bits))
        layer.scales.copy_(scales.reshape(layer.scales.shape))
        if zeros is not None:
            layer.zeros.copy_(zeros.reshape(layer.zeros.shape))
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer

    @property
    def adapter_rank(self) -> int:
        return 0 if self.lora_a is None else self.lora_a.shape[0]

    def add_adapter(self, down: torch.Tensor, up: torch.Tensor) -> None:
        """Add the adapter y += (x down^T) up^T: down [rank, in], up [out, rank], LoRA's alpha /
        rank scale already in `up`. A second adapter (a second LoRA run) stacks on the first:
        their ranks add."""
        if (
            down.shape[1] != self.in_features
            or up.shape[0] != self.out_features
            or down.shape[0] != up.shape[1]
        ):
            raise ValueError(
                f"an adapter of shapes {tuple(down.shape)} and {tuple(up.shape)} "
                f"does not fit a {self.out_features}x{self.in_features} layer"
            )
        down, up = down.detach(), up.detach()
        if self.lora_a is not None:
            down, up = (
                torch.cat([self.lora_a, down.to(self.lora_a.dtype)]),
                torch.cat([self.lora_b, up.to(self.lora_b.dtype)], dim=1),
            )
        self.lora_a, self.lora_b = down.clone(), up.clone()

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.qweight, self.scheme.bits)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, rows: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The weight [out, in] in `dtype`, or only the output rows indexed by `rows`."""
        qweight, scales, zeros = self.qweight, self.scales, self.zeros
        if rows is not None:
            qweight, scales = qweight[rows], scales[rows]
            zeros = None if zeros is None else zeros[rows]
        codes = unpack_codes(qweight, self.scheme.bits).to(dtype).view(qweight.shape[0], scales.shape[1], -1)
        offset = self.scheme.symmetric_zero if zeros is None else zeros.to(dtype).unsqueeze(-1)
        weight = (codes - offset) * scales.to(dtype).unsqueeze(-1)
        return weight.view(qweight.shape[0], self.in_features)

    def merged_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with: the codes' and, if any, the adapter's B A; made a
        run of rows at a time, so that the unpacking temporaries of a large LM head (several
        times its size in `dtype`) never exist for all its rows at once."""
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.qweight.device)
        step = max(1, MERGE_CHUNK_VALUES // self.in_features)
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            weight[start:end] = self.dequantize(dtype, torch.arange(start, end, device=self.qweight.device))
            if self.lora_a is not None:
                weight[start:end] += self.lora_b[start:end].to(dtype) @ self.lora_a.to(dtype)
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = F.linear(x, self.dequantize(x.dtype), bias)
        if self.lora_a is not None:
            y = y + F.linear(F.linear(x, self.lora_a.to(x.dtype)), self.lora_b.to(x.dtype))
        return y

    def extra_repr(self) -> str:
        s = self.scheme
        adapter = f", adapter_rank={self.adapter_rank}" if self.lora_a is not None else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={s.bits}, "
            f"group_size={s.group_size}, symmetric={s.symmetric}, method={s.method}{adapter}"
        )


def embedding_scale(embedding: nn.Module) -> float:
    """The factor an input embedding multiplies its rows by (Gemma's sqrt(hidden)); 1 for most."""
    if isinstance(embedding, (QuantEmbedding, QuantTable)):
        return embedding.scale
    return float(getattr(embedding, "scalar_embed_scale", 1.0))


def lookup_rows(
    table: QuantLinear, input_ids: torch.Tensor, dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """Token vectors from a quantized [vocab, hidden] table: only the rows asked for are
    dequantized, then scaled as the embedding they replace did (in `dtype`, as transformers does)."""
    vectors = table.dequantize(dtype, rows=input_ids.reshape(-1))
    if scale != 1.0:
        vectors = vectors * torch.tensor(scale, dtype=dtype)
    return vectors.view(*input_ids.shape, table.in_features)


class QuantEmbedding(nn.Module):
    """The token embedding of a model whose embedding is tied to its quantized LM head.

    Row i of the head's weight is token i's vector, so the lookup dequantizes just the rows it
    needs from the head's codes. The head is held outside the module tree (not a submodule):
    its tensors stay stored, saved and moved to a device once, under the head's name.
    """

    def __init__(self, head: QuantLinear, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self._head = (head,)
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        self.scale = scale

    @property
    def head(self) -> QuantLinear:
        return self._head[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return lookup_rows(self.head, input_ids, self.dtype, self.scale)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"tied to the quantized LM head ({self.head.scheme.bits}-bit)"
        )


class QuantTable(QuantLinear):
    """An untied token embedding, quantized: its [vocab, hidden] table stored as a QuantLinear's
    codes and scales (a row per token, a scale per row or group), so the artifact, the size
    report and the exports treat it as one more quantized matrix. Called by transformers as the
    model's input embedding, it dequantizes just the rows of the tokens it is given."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: QuantScheme,
        dtype: torch.dtype = torch.float32,
        scale: float = 1.0,
    ):
        super().__init__(in_features, out_features, scheme)
        self.num_embeddings, self.embedding_dim = out_features, in_features
        self.dtype = dtype
        self.scale = scale

    @classmethod
    def holding(cls, layer: QuantLinear, dtype: torch.dtype, scale: float) -> "QuantTable":
        """A table holding `layer`'s codes and scales (not copied)."""
        table = cls(layer.in_features, layer.out_features, layer.scheme, dtype, scale).to(
            layer.qweight.device
        )
        table.qweight, table.scales, table.zeros = layer.qweight, layer.scales, layer.zeros
        return table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return lookup_rows(self, input_ids, self.dtype, self.scale)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, quantized embedding "
            f"({self.scheme.bits}-bit, group_size={self.scheme.group_size})"
        )


def tie_quantized_head(model: nn.Module) -> None:
    """Point a tied model's input embedding at its quantized LM head (see QuantEmbedding)."""
    head = model.get_output_embeddings()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    model.set_input_embeddings(QuantEmbedding(head, dtype, embedding_scale(model.get_input_embeddings())))


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)
