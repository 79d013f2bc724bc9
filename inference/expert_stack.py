"""A mixture of experts' routed experts run by one kernel call (llama.cpp's mul_mat_id).

Run one by one, a decode step's k experts cost 2k matmul calls per layer and the Python around
them, more time than reading their weights (OLMoE at 0.78x llama.cpp and 0.67x a dense model of
its active size). When every expert of a layer runs in slimlm's int8-activation CPU kernel with
the same width and groups, their packed weights are stacked [E, ...] and
`routed_experts` (inference/kernels/int8_activations_cpu.cpp) computes the whole layer: routes
sorted by expert, each input rounded to int8 once per route, one parallel pass over every chosen
expert's gate/up tiles and one over their down tiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from slimlm.inference import cpu_kernels
from slimlm.inference.linear import Int8ActivationLinear


@dataclass(frozen=True)
class StackedProjection:
    """One projection of every expert: packed codes, scales and offsets (none where the scheme is
    symmetric), each [E, ...] in the int8-activation kernel's layout, and the group size."""

    packed: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    group: int

    @staticmethod
    def of(layers: Sequence[Int8ActivationLinear]) -> StackedProjection:
        """Stack `layers`' tensors; each layer's buffers become views into the stack, so the
        stack takes no memory of its own once the layers' former tensors are freed."""
        stacks = []
        for name in ("weight", "scales", "offsets"):
            if getattr(layers[0], name) is None:
                stacks.append(None)
                continue
            stack = torch.stack([getattr(layer, name) for layer in layers])
            for layer, view in zip(layers, stack):
                setattr(layer, name, view)
            stacks.append(stack)
        return StackedProjection(*stacks, layers[0].group_size)


@dataclass(frozen=True)
class ExpertStack:
    """A layer's experts stacked for `routed_experts`. A plain object, not a module: moving the
    decoder to a GPU leaves it in host memory with the experts it serves."""

    gate_up: StackedProjection
    down: StackedProjection
    activation: str

    @staticmethod
    def of(experts: Sequence[nn.Module], activation: str) -> Optional[ExpertStack]:
        """The stack of `experts` (FeedForward modules), or None where they cannot share one
        call: a layer outside the int8-activation kernel, widths or groups that differ, a LoRA
        adapter or a bias (the stacked call runs neither)."""
        projections = [[expert.gate_up for expert in experts], [expert.down for expert in experts]]
        if not all(_plain(layer) for layers in projections for layer in layers):
            return None
        if any(
            len(
                {
                    (layer.bits, layer.group_size, layer.weight.shape, layer.offsets is None)
                    for layer in layers
                }
            )
            > 1
            for layers in projections
        ):
            return None
        if projections[0][0].bits != projections[1][0].bits:
            return None
        return ExpertStack(
            StackedProjection.of(projections[0]), StackedProjection.of(projections[1]), activation
        )

    def __call__(self, flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's routed experts' outputs, weighted and summed ([T, H], as dispatch in
        slimlm/experts.py computes them); routes to index E (dropped) are left out."""
        up, down = self.gate_up, self.down
        return cpu_kernels.ops().routed_experts(
            flat,
            chosen,
            weights.float(),
            up.packed,
            up.scales,
            up.offsets,
            up.group,
            down.packed,
            down.scales,
            down.offsets,
            down.group,
            self.activation,
        )


def _plain(layer: nn.Module) -> bool:
    return isinstance(layer, Int8ActivationLinear) and layer.bias is None and layer.lora_down is None
