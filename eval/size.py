"""Model size in memory: bytes, parameters and average bits per weight."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from torch import nn

from slimlm.qlinear import QuantLinear
from slimlm.sparse_storage import sparse_candidates


@dataclass(frozen=True)
class SizeReport:
    bytes: int  # every parameter and buffer, each shared tensor counted once
    parameters: int  # weights as the original model counts them (a quantized matrix counts its elements)
    bits_per_weight: float  # bytes * 8 / parameters: scales, norms and embeddings included
    stored_bytes: Optional[int] = (
        None  # as a slimlm artifact stores it: sparse matrices as bitmask + kept values
    )
    linear_zeros: Optional[float] = None  # fraction of all Linear weights that are exactly zero

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SizeCounts:
    """A size report's sums, which add up over parts of a model read one at a time."""

    bytes: int = 0
    parameters: int = 0
    stored_bytes: int = 0
    zeros: int = 0
    weights: int = 0

    def __add__(self, other: "SizeCounts") -> "SizeCounts":
        return SizeCounts(
            *(
                getattr(self, key) + getattr(other, key)
                for key in ("bytes", "parameters", "stored_bytes", "zeros", "weights")
            )
        )

    def report(self) -> SizeReport:
        return SizeReport(
            bytes=self.bytes,
            parameters=self.parameters,
            bits_per_weight=round(8 * self.bytes / max(self.parameters, 1), 3),
            stored_bytes=self.stored_bytes,
            linear_zeros=round(self.zeros / max(self.weights, 1), 6),
        )


def model_size(model: nn.Module) -> SizeReport:
    if getattr(model, "hf_quantizer", None) is not None:
        # bitsandbytes keeps part of its quantization state outside parameters and buffers;
        # transformers accounts for it.
        total_bytes, parameters = model.get_memory_footprint(), model.num_parameters()
        return SizeReport(
            bytes=total_bytes, parameters=parameters, bits_per_weight=round(8 * total_bytes / parameters, 3)
        )
    return size_counts(model).report()


def size_counts(model: nn.Module) -> SizeCounts:
    """The sums of `model`'s size report: every tensor it holds counted once."""
    unique = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    total_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    parameters = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    # A quantized matrix is a buffer, but it is the layer's weight: count it as parameters.
    parameters += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    stored, zeros, weights = total_bytes, 0, 0
    for candidate in sparse_candidates(model):
        stored += candidate.stored_bytes() - candidate.dense_bytes()
        zeros += candidate.values.numel() - candidate.nonzero
        weights += candidate.values.numel()
    return SizeCounts(
        bytes=total_bytes, parameters=parameters, stored_bytes=stored, zeros=zeros, weights=weights
    )


def comparable_bytes(row: dict) -> int:
    """The size report rows are compared by: as stored (sparse matrices compact) when known,
    else in memory."""
    return row.get("stored_bytes") or row["bytes"]
