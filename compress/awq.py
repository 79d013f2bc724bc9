"""AWQ (Lin et al., 2023): activation-aware weight quantization.

A few input channels carry much larger activations than the rest, and the rounding error of
their weights costs the most. AWQ multiplies those weight columns by s > 1 before rounding
(their relative error shrinks) and divides the previous operation's output by s, so the
full-precision function is unchanged:

    y = W (x) = (W diag(s)) (x / s),   with x / s folded into an RMSNorm weight or the rows of
                                        the Linear layer that produces x.

The scale of each group of Linear layers that read the same input is searched on a grid,
s = mean|x|^a / mean_w^(1-a) (the released AutoAWQ's "duo" scaling; a in [0, 1), plus s = 1,
which is plain RTN), and the best s minimises the layers' output error on the calibration
data. Then each layer's clipping range is searched per group: shrinking the range a little
rounds most weights more finely at the cost of clipping a few outliers.

Both searches (clipping lives in compress/clipping.py) measure the output error
||X (W - Q(W))^T||^2 exactly through the input Hessian
H = 2/n X^T X that GPTQ also collects: the error is tr(D H D^T) / 2 for D = W - Q(W), so every
calibration token counts while a candidate costs one [out, in] x [in, in] product.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from slimlm.architecture import ScaleMapping
from slimlm.compress.clipping import output_error, search_clip
from slimlm.compress.gptq import HessianAccumulator
from slimlm.compress.rtn import QuantizedWeight, fake_quantize, quantize_rtn
from slimlm.qlinear import QuantScheme

# Queries and keys meet in a softmax, where a per-output error says little: no clipping there.
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.qkv_proj")


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20  # scale exponents a = 0, 1/grid, ..., (grid-1)/grid
    clip_grid: int = 20  # clipping ratios 1, 1 - 1/clip_grid, ... down to 1 - max_shrink
    max_shrink: float = 0.5
    clip: bool = True  # run the clipping search after scaling


def search_scale(
    weights: list[torch.Tensor], schemes: list[QuantScheme], stats: HessianAccumulator, options: AWQOptions
) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale s for Linear layers reading the same input; returns s, the
    output error with it, and the output error of plain RTN (s = 1)."""
    weights = [weight.detach().float() for weight in weights]
    hessian = stats.hessian.to(weights[0].device, torch.float32)
    x_mean = stats.abs_mean.to(weights[0].device, torch.float32)
    w_mean = torch.cat([_normalised_magnitude(w, scheme) for w, scheme in zip(weights, schemes)]).mean(dim=0)

    def error(scale: torch.Tensor) -> float:
        return sum(
            float(output_error(w - fake_quantize(w * scale, scheme) / scale, hessian))
            for w, scheme in zip(weights, schemes)
        )

    best_scale = torch.ones_like(x_mean)
    rtn_error = best_error = error(best_scale)
    for step in range(options.grid):
        ratio = step / options.grid
        scale = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        scale = scale / (scale.max() * scale.min()).sqrt()  # centre the scales around 1
        candidate = error(scale)
        if candidate < best_error:
            best_scale, best_error = scale, candidate
    return best_scale, best_error, rtn_error


def _normalised_magnitude(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """|w| relative to the largest |w| of its quantization group, shaped like the weight."""
    group = scheme.group_size or weight.shape[1]
    grouped = weight.abs().reshape(-1, group)
    return (grouped / (grouped.amax(dim=1, keepdim=True) + 1e-6)).reshape(weight.shape)


def apply_scale(
    previous: nn.Module, rows: slice, linears: list[nn.Linear], scale: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """Divide `previous`'s output `rows` by `scale` and multiply the Linear layers' input columns by it."""
    scale = scale.to(previous.weight.device)
    if isinstance(previous, nn.Linear):
        previous.weight.data[rows].div_(scale[:, None].to(previous.weight.dtype))
        if previous.bias is not None:
            previous.bias.data[rows].div_(scale.to(previous.bias.dtype))
    else:  # an RMSNorm: y = (norm_offset + weight) * x / rms(x)
        weight = previous.weight.data
        weight.copy_(((norm_offset + weight.double()) / scale.double() - norm_offset).to(weight.dtype))
    for linear in linears:
        linear.weight.data.mul_(scale[None, :].to(linear.weight.dtype))


def feeding_rows(previous: nn.Module, in_features: int, mapping: ScaleMapping) -> Optional[slice]:
    """The rows of `previous`'s output that the mapping's Linear layers read, or None where they
    do not line up (v_proj -> o_proj under grouped-query attention: fewer outputs than inputs)."""
    outputs = previous.weight.shape[0]
    return slice(outputs - in_features, outputs) if outputs == mapping.fused_parts * in_features else None


def expand_experts(mappings: tuple[ScaleMapping, ...], layer: nn.Module) -> Iterator[ScaleMapping]:
    """The mappings whose modules this layer has (a MoE layer has no dense MLP), with `{e}`
    written out for each expert."""
    present = {name for name, _ in layer.named_modules()}
    for mapping in mappings:
        experts = range(len(present)) if "{e}" in mapping.previous else [None]
        for expert in experts:
            written = dataclasses.replace(
                mapping,
                previous=mapping.previous.format(e=expert),
                linears=tuple(n.format(e=expert) for n in mapping.linears),
            )
            if not {written.previous, *written.linears} <= present:
                break
            yield written


def awq_quantize_layer(
    layer: nn.Module,
    prefix: str,
    schemes: dict[str, QuantScheme],
    stats: dict[str, HessianAccumulator],
    mappings: tuple[ScaleMapping, ...],
    options: AWQOptions = AWQOptions(),
    on_scaled: Optional[Callable[[str, float, float], None]] = None,
) -> dict[str, QuantizedWeight]:
    """AWQ for the Linear layers of one decoder layer named in `schemes` (full names under
    `prefix`, each with its input statistics in `stats`): scale search and folding for each of
    the family's `mappings` whose layers are all quantized here, then clipping search and rounding
    of every layer. `on_scaled(name, error, rtn_error)` hears each mapping's output error with
    its scale and with plain RTN."""
    for mapping in expand_experts(mappings, layer):
        names = [f"{prefix}.{name}" for name in mapping.linears]
        if not all(name in schemes for name in names):
            continue
        previous = layer.get_submodule(mapping.previous)
        linears = [layer.get_submodule(name) for name in mapping.linears]
        rows = feeding_rows(previous, linears[0].in_features, mapping)
        if rows is None:
            continue
        scale, error, rtn_error = search_scale(
            [linear.weight for linear in linears], [schemes[n] for n in names], stats[names[0]], options
        )
        apply_scale(previous, rows, linears, scale, mapping.norm_offset)
        for accumulator in {id(stats[n]): stats[n] for n in names}.values():  # q/k/v share one
            accumulator.divide_inputs(scale)
        if on_scaled is not None:
            on_scaled(f"{prefix}.{mapping.previous}", error, rtn_error)
    quantized = {}
    for name, scheme in schemes.items():
        weight = layer.get_submodule(name.removeprefix(prefix + ".")).weight
        if options.clip and not name.endswith(NO_CLIP):
            weight = search_clip(weight, scheme, stats[name].hessian, options.clip_grid, options.max_shrink)
        quantized[name] = quantize_rtn(weight, scheme)
    return quantized
