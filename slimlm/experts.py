"""Mixture-of-experts blocks with one nn.Linear per expert projection.

transformers 5 keeps a block's experts as two 3-D parameters (`gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I]). Quantization works per Linear layer: every stage hooks, replaces and
stores nn.Linear modules by name. So the experts are split into ExpertList, which computes the
same function with `<experts>.<e>.<gate|up|down>` Linear layers, named as the family's own
checkpoints name them (Qwen3-MoE and OLMoE: gate_proj/up_proj/down_proj; Mixtral: w1/w3/w2).
transformers' loader merges such per-expert tensors back into its fused layout, so a checkpoint
written from the split model (plain or compressed-tensors) loads in transformers as it is.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from slimlm.architecture import QWEN_MOE_EXPERTS, ExpertNames, family_of, model_type
from slimlm.errors import SlimlmError

FUSED_PARAMETERS = {"gate_up_proj", "down_proj"}


class Expert(nn.Module):
    """One expert: down(act(gate(x)) * up(x))."""

    def __init__(
        self,
        names: ExpertNames,
        hidden: int,
        intermediate: int,
        act_fn: Callable,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.names = names
        self.act_fn = act_fn
        for name, (rows, columns) in (
            (names.gate, (intermediate, hidden)),
            (names.up, (intermediate, hidden)),
            (names.down, (hidden, intermediate)),
        ):
            self.add_module(name, nn.Linear(columns, rows, bias=False, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in (self.names.gate, self.names.up, self.names.down))
        return down(self.act_fn(gate(x)) * up(x))


class ExpertList(nn.ModuleList):
    """The experts of one block, called as transformers calls its fused experts module:
    (hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return dispatch(self, hidden_states, top_k_index, top_k_weights)


def dispatch(
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Each token's routed experts' outputs, weighted and summed: [T, H] from hidden_states [T, H]
    and each token's top_k expert indices and weights [T, k]. Only experts some token chose
    run, each once on all its tokens (a decode step reads k experts' weights; a prefill groups
    its tokens by expert)."""
    output = torch.zeros_like(hidden_states)
    if (
        hidden_states.shape[0] == 1
    ):  # one token (a decode step): its experts in turn, nothing to group (a third of the time)
        for index, weight in zip(top_k_index[0].tolist(), top_k_weights[0]):
            if index < len(experts):
                output += (experts[index](hidden_states) * weight).to(output.dtype)
        return output
    for index in top_k_index.unique().tolist():
        if index >= len(experts):  # transformers marks dropped routes with index E
            continue
        token, slot = torch.where(top_k_index == index)
        contribution = experts[index](hidden_states[token]) * top_k_weights[token, slot, None]
        output.index_add_(0, token, contribution.to(output.dtype))
    return output


def is_fused_experts(module: nn.Module) -> bool:
    parameters = {name for name, _ in module.named_parameters(recurse=False)}
    return parameters == FUSED_PARAMETERS and module.gate_up_proj.dim() == 3 and hasattr(module, "act_fn")


def split_experts(model: nn.Module) -> int:
    """Replace every fused experts module of `model` by an ExpertList holding the same weights
    (on the meta device too: a skeleton stays a skeleton). Returns how many were split."""
    names = _expert_names(model)
    fused = [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]
    for name, module in fused:
        parent_name, _, child = name.rpartition(".")
        model.get_submodule(parent_name).register_module(child, _split(module, names))
    _refuse_other_experts(model)
    return len(fused)


def _split(module: nn.Module, names: ExpertNames) -> ExpertList:
    gate_up, down = module.gate_up_proj.data, module.down_proj.data
    count, double, hidden = gate_up.shape
    intermediate = double // 2
    experts = ExpertList(
        Expert(names, hidden, intermediate, module.act_fn, gate_up.device, gate_up.dtype)
        for _ in range(count)
    )
    if gate_up.device.type != "meta":
        for index, expert in enumerate(experts):
            getattr(expert, names.gate).weight.data.copy_(gate_up[index, :intermediate])
            getattr(expert, names.up).weight.data.copy_(gate_up[index, intermediate:])
            getattr(expert, names.down).weight.data.copy_(down[index])
    return experts


def _expert_names(model: nn.Module) -> ExpertNames:
    family = family_of(model_type(model))
    return family.experts if family is not None and family.experts is not None else QWEN_MOE_EXPERTS


def _refuse_other_experts(model: nn.Module) -> None:
    """Experts kept in another layout (biases, interleaved gate/up) would be left out of every
    stage silently: refuse them by name."""
    for name, module in model.named_modules():
        if name.endswith("experts") and not isinstance(module, ExpertList):
            three_d = [p for p, tensor in module.named_parameters(recurse=False) if tensor.dim() == 3]
            if three_d:
                raise SlimlmError(
                    f"{name} keeps its experts as {', '.join(three_d)}, a layout slimlm does not "
                    f"split into per-expert layers; {model_type(model)} models are not supported yet"
                )
