"""Quantized linear layers as the compression stages produce them and artifacts store them.

Shared by `compress` (which fills them), the artifact format (which saves and loads them) and
`inference` (which runs them), so that none of those needs to import another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class QuantScheme:
    """How one weight matrix is quantized."""

    bits: int = 8
    group_size: Optional[int] = None  # None: one scale per output channel
    symmetric: bool = True
    method: str = "rtn"

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def to_dict(self) -> dict:
        return asdict(self)


class QuantLinear(nn.Module):
    """y = x W^T + b with W = qweight * scale (int8, one fp16 scale per output channel).

    The forward pass dequantizes into the activation dtype and calls an ordinary matmul:
    correct everywhere and exact to the stored integers; the decoder swaps in packed kernels.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False):
        super().__init__()
        if scheme.bits != 8 or scheme.group_size is not None or not scheme.symmetric:
            raise ValueError(f"QuantLinear stores int8 per-channel symmetric weights, not {scheme}")
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, 1, dtype=torch.float16))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_quantized(cls, qweight: torch.Tensor, scales: torch.Tensor, scheme: QuantScheme, bias: Optional[torch.Tensor]) -> "QuantLinear":
        layer = cls(qweight.shape[1], qweight.shape[0], scheme, bias=bias is not None)
        layer.qweight.copy_(qweight)
        layer.scales.copy_(scales.reshape(-1, 1))
        if bias is not None:
            layer.bias.data = bias.detach().clone()
        return layer.to(qweight.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.scheme.bits}, method={self.scheme.method}"


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)
