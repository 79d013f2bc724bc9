"""The `prune` stage: a smaller dense model that transformers loads, Minitron-style.

- Depth: drop whole decoder layers, those that change the hidden state least (block influence,
  Men et al. 2024 "ShortGPT": 1 - mean cosine similarity of a layer's input and output tokens).
- Width, each ranked by activation magnitude on calibration data (Minitron, Muralidharan et al.
  2024): MLP intermediate channels (the input of down_proj), whole key/value groups with the
  query heads that read them (the input of o_proj, per head; GQA stays intact), and hidden
  channels (the outputs of every RMSNorm, summed over layers), which also narrows the
  embedding and the LM head.

Depth goes first (ranked on the full model); width is then ranked on the shallower model. The
weights are sliced into a new model built from a rewritten config (num_hidden_layers,
hidden_size, intermediate_size, attention and key/value heads, an explicit head_dim), so what
the stage hands on is exactly what `from_pretrained` rebuilds from an export.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from tqdm import tqdm

from slimlm.architecture import (
    FAMILIES,
    HIDDEN,
    KV_HEADS,
    MLP,
    QUERY_HEADS,
    PruneSlice,
    decoder_blocks,
    model_type,
    require_family,
)
from slimlm.compress.calibration import CalibrationParams
from slimlm.compress.quantize import calibration_windows
from slimlm.data import check_text_source
from slimlm.errors import ConfigError, SlimlmError
from slimlm.pipeline import RunState, Stage
from slimlm.qlinear import QuantLinear


@dataclass
class PruneParams(CalibrationParams):
    layers: Optional[int] = None  # decoder layers to keep
    hidden_size: Optional[int] = None  # hidden (residual stream) channels to keep
    intermediate_size: Optional[int] = None  # MLP channels to keep in every layer
    kv_heads: Optional[int] = None  # key/value groups to keep in every layer (with their query heads)
    # Calibration: seq_len, seed and samples, here 32 by default (CalibrationParams).
    samples: int = 32

    def __post_init__(self) -> None:
        targets = {
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "kv_heads": self.kv_heads,
        }
        if all(value is None for value in targets.values()):
            raise ConfigError(
                "prune: give at least one of layers, hidden_size, intermediate_size, "
                "kv_heads (the sizes to keep)"
            )
        for key, value in targets.items():
            if value is not None and value < 1:
                raise ConfigError(f"prune.{key}={value} would remove every one of them; keep at least 1")
        self.check_calibration("prune")


@dataclass
class Shape:
    """The sizes pruning changes, read from a transformers config."""

    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> "Shape":
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        )


def check_targets(shape: Shape, params: PruneParams) -> None:
    """Refuse sizes that do not shrink the model before any work."""
    for key, current in (
        ("layers", shape.layers),
        ("hidden_size", shape.hidden_size),
        ("intermediate_size", shape.intermediate_size),
        ("kv_heads", shape.kv_heads),
    ):
        wanted = getattr(params, key)
        if wanted is not None and wanted > current:
            raise SlimlmError(
                f"prune.{key}={wanted} is larger than the model's {current}; pruning only removes"
            )
    heads = (params.kv_heads or shape.kv_heads) * (shape.heads // shape.kv_heads)
    hidden = params.hidden_size or shape.hidden_size
    if hidden % heads:
        raise SlimlmError(
            f"the pruned model would have hidden_size {hidden} and {heads} attention heads; "
            "transformers requires the hidden size to be a multiple of the heads: "
            "choose prune.hidden_size (or kv_heads) to match"
        )


# ---- importance -------------------------------------------------------------------------


@torch.no_grad()
def block_influence(model: nn.Module, samples: torch.Tensor, chunk_size: int = 8) -> list[float]:
    """Per decoder layer: 1 - mean cosine similarity between its input and output hidden states."""
    _, layers = decoder_blocks(model)
    totals = torch.zeros(len(layers), dtype=torch.float64)
    tokens = [0]

    def hook(index):
        def record(module, args, kwargs, output):
            hidden_in = args[0] if args else kwargs["hidden_states"]
            hidden_out = output[0] if isinstance(output, tuple) else output
            cosine = torch.nn.functional.cosine_similarity(hidden_in.float(), hidden_out.float(), dim=-1)
            totals[index] += float(cosine.sum())

        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        run_chunks(model, samples, chunk_size, tokens, "block influence")
    finally:
        for handle in handles:
            handle.remove()
    return [float(1 - total / tokens[0]) for total in totals]


@dataclass
class WidthImportance:
    hidden: torch.Tensor  # [hidden_size]
    intermediate: list[torch.Tensor]  # per layer [intermediate_size]
    kv_groups: list[torch.Tensor]  # per layer [kv_heads]


@torch.no_grad()
def width_importance(
    model: nn.Module, samples: torch.Tensor, shape: Shape, chunk_size: int = 8
) -> WidthImportance:
    """Root-mean-square activations: of each hidden channel after every RMSNorm (summed), of
    each MLP channel entering down_proj, of each attention head entering o_proj (summed over
    the query heads of a key/value group)."""
    _, layers = decoder_blocks(model)
    hidden = torch.zeros(shape.hidden_size, dtype=torch.float64)
    intermediate = [torch.zeros(shape.intermediate_size, dtype=torch.float64) for _ in layers]
    heads = [torch.zeros(shape.heads, dtype=torch.float64) for _ in layers]

    def squares(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float()
        return (x * x).reshape(-1, x.shape[-1]).sum(dim=0).double().cpu()

    def add_hidden(module, inputs, output) -> None:
        hidden.add_(squares(output))

    handles = []
    norms = [
        m
        for name, m in model.named_modules()
        if name.endswith(("input_layernorm", "post_attention_layernorm")) or name == "model.norm"
    ]
    if len(norms) != 2 * len(layers) + 1:
        raise SlimlmError(
            f"{type(model).__name__}: expected input/post-attention RMSNorms in every layer and a final "
            "model.norm; width pruning supports Llama-family models"
        )
    handles += [norm.register_forward_hook(add_hidden) for norm in norms]

    def add_to(totals: torch.Tensor, per_head: bool):
        def hook(module, args) -> None:  # a pre-hook that returned a value would replace the input
            x = squares(args[0])
            totals.add_(x.view(shape.heads, shape.head_dim).sum(dim=1) if per_head else x)

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(add_to(intermediate[i], per_head=False)))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(add_to(heads[i], per_head=True)))
    try:
        run_chunks(model, samples, chunk_size, [0], "width importance")
    finally:
        for handle in handles:
            handle.remove()
    group = shape.heads // shape.kv_heads
    return WidthImportance(
        hidden=hidden.sqrt(),
        intermediate=[x.sqrt() for x in intermediate],
        kv_groups=[h.sqrt().view(shape.kv_heads, group).sum(dim=1) for h in heads],
    )


def run_chunks(
    model: nn.Module, samples: torch.Tensor, chunk_size: int, tokens: list[int], desc: str
) -> None:
    device = next(model.parameters()).device
    for chunk in tqdm(samples.split(chunk_size), desc=desc, unit="chunk"):
        model(input_ids=chunk.to(device), use_cache=False)
        tokens[0] += chunk.numel()


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` highest-scoring positions, in their original order."""
    return scores.topk(count).indices.sort().values


# ---- slicing ----------------------------------------------------------------------------


@dataclass
class Keep:
    """What survives: layer indices (old numbering), hidden channels, and per kept layer its MLP
    channels and key/value groups (None: all)."""

    layers: list[int]
    hidden: Optional[torch.Tensor] = None
    intermediate: Optional[list[torch.Tensor]] = None
    kv_groups: Optional[list[torch.Tensor]] = None


BLOCKS = "model.layers."  # the decoder blocks' tensors, numbered after this prefix


def sliced_state_dict(model: nn.Module, keep: Keep, shape: Shape) -> dict[str, torch.Tensor]:
    """The pruned model's tensors under its new names (layers renumbered from 0), each block's
    sliced as its family's pruning table says (slimlm/architecture.py)."""
    table = {entry.module: entry for entry in require_prunable(model_type(model))}
    # slicing indices live on the CPU
    state = {key: tensor.detach().cpu() for key, tensor in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not key.startswith(BLOCKS):
            # embed_tokens, lm_head: [vocab, hidden]; the final norm: [hidden]
            out[key] = take(tensor, tensor.dim() - 1, keep.hidden).clone()
    for new, old in enumerate(keep.layers):
        prefix = f"{BLOCKS}{old}."
        widths = block_widths(keep, shape, new)
        for key, tensor in state.items():
            if key.startswith(prefix):
                local = key[len(prefix) :]
                entry = table_entry(table, key, local)
                out[f"{BLOCKS}{new}.{local}"] = sliced(tensor, entry, widths).clone()
    return out


def take(tensor: torch.Tensor, dim: int, index: Optional[torch.Tensor]) -> torch.Tensor:
    return tensor if index is None else tensor.index_select(dim, index)


Widths = dict[str, Optional[torch.Tensor]]  # what a block keeps along each width (None: all of it)


def block_widths(keep: Keep, shape: Shape, block: int) -> Widths:
    """The indices kept block `block` (new numbering) keeps along each width the tables name."""
    query_rows = kv_rows = None
    if keep.kv_groups is not None:
        group = shape.heads // shape.kv_heads
        groups = keep.kv_groups[block]
        query_heads = (groups.unsqueeze(1) * group + torch.arange(group)).flatten()
        query_rows, kv_rows = head_rows(query_heads, shape.head_dim), head_rows(groups, shape.head_dim)
    return {
        HIDDEN: keep.hidden,
        QUERY_HEADS: query_rows,
        KV_HEADS: kv_rows,
        MLP: None if keep.intermediate is None else keep.intermediate[block],
    }


def head_rows(heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    return (heads.unsqueeze(1) * head_dim + torch.arange(head_dim)).flatten()


def table_entry(table: dict[str, PruneSlice], key: str, local: str) -> PruneSlice:
    """The entry for a block tensor, `local` its name in the block (`self_attn.q_proj.weight`:
    the entry for `self_attn.q_proj`)."""
    module = local.rpartition(".")[0]
    if module not in table:
        raise SlimlmError(
            f"cannot prune {key}: slimlm prunes Llama-family layers "
            "(q/k/v/o_proj, gate/up/down_proj, two RMSNorms)"
        )
    return table[module]


def sliced(tensor: torch.Tensor, entry: PruneSlice, widths: Widths) -> torch.Tensor:
    """One table entry applied to a tensor of its module: the rows (of a weight, a bias or a
    norm), then a weight's columns."""
    tensor = take(tensor, 0, widths.get(entry.rows))
    return take(tensor, 1, widths.get(entry.columns)) if tensor.dim() == 2 else tensor


def pruned_config(config, keep: Keep, shape: Shape):
    config = copy.deepcopy(config)
    config.num_hidden_layers = len(keep.layers)
    config.head_dim = shape.head_dim  # explicit: hidden_size / heads no longer gives it
    if keep.hidden is not None:
        config.hidden_size = int(keep.hidden.numel())
    if keep.intermediate is not None:
        config.intermediate_size = int(keep.intermediate[0].numel())
    if keep.kv_groups is not None:
        kv = int(keep.kv_groups[0].numel())
        config.num_attention_heads = kv * (shape.heads // shape.kv_heads)
        config.num_key_value_heads = kv
    # per-layer settings (layer_types, ...) follow the kept layers
    for key, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == shape.layers and key != "architectures":
            setattr(config, key, [value[i] for i in keep.layers])
    return config


def rebuild(model: nn.Module, keep: Keep, shape: Shape) -> nn.Module:
    """A new model of the pruned config holding the sliced weights."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    tensors = sliced_state_dict(model, keep, shape)
    config = pruned_config(model.config, keep, shape)
    dtype = next(model.parameters()).dtype
    with no_init_weights():
        pruned = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    result = pruned.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if tied else set())
    if missing or result.unexpected_keys:
        raise SlimlmError(
            f"the pruned weights do not fit the pruned config: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]}"
        )
    if tied:
        pruned.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        pruned.generation_config = model.generation_config
    return pruned.to(next(model.parameters()).device).eval()


# ---- the stage --------------------------------------------------------------------------


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def prune_model(model: nn.Module, samples: torch.Tensor, params: PruneParams) -> tuple[nn.Module, dict]:
    """The pruned model and what the report says about it (scores, what was removed, sizes)."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise SlimlmError(
            "the model is already quantized: put the prune stage before any quantize stage (prune, distill, "
            "then quantize)"
        )
    shape = Shape.of(model.config)
    check_targets(shape, params)
    section: dict = {"parameters_before": parameter_count(model), "shape_before": vars(shape).copy()}
    if params.layers is not None and params.layers < shape.layers:
        influence = block_influence(model, samples)
        kept = top_indices(torch.tensor(influence), params.layers).tolist()
        section["block_influence"] = [round(x, 6) for x in influence]
        section["removed_layers"] = [i for i in range(shape.layers) if i not in kept]
        model = rebuild(model, Keep(layers=kept), shape)
        shape = Shape.of(model.config)
    widths = {
        "hidden_size": params.hidden_size,
        "intermediate_size": params.intermediate_size,
        "kv_heads": params.kv_heads,
    }
    if any(value is not None and value < getattr(shape, key) for key, value in widths.items()):
        importance = width_importance(model, samples, shape)
        keep = Keep(layers=list(range(shape.layers)))
        if params.hidden_size is not None and params.hidden_size < shape.hidden_size:
            keep.hidden = top_indices(importance.hidden, params.hidden_size)
        if params.intermediate_size is not None and params.intermediate_size < shape.intermediate_size:
            keep.intermediate = [
                top_indices(scores, params.intermediate_size) for scores in importance.intermediate
            ]
        if params.kv_heads is not None and params.kv_heads < shape.kv_heads:
            keep.kv_groups = [top_indices(scores, params.kv_heads) for scores in importance.kv_groups]
            section["kept_kv_groups"] = [g.tolist() for g in keep.kv_groups]
        model = rebuild(model, keep, shape)
    section["shape_after"] = vars(Shape.of(model.config)).copy()
    section["parameters_after"] = parameter_count(model)
    return model, section


def run(state: RunState, params: PruneParams) -> None:
    started = time.perf_counter()
    require_prunable(model_type(state.model))
    samples = calibration_windows(state, params.samples, params.seq_len, params.seed)
    state.model, section = prune_model(state.model, samples, params)
    after = section["shape_after"]
    state.mark_changed(
        f"pruned to {after['layers']} layers, hidden {after['hidden_size']}, "
        f"MLP {after['intermediate_size']}, {after['kv_heads']} kv heads"
    )
    section["seconds"] = round(time.perf_counter() - started, 2)
    state.sections.setdefault("pruning", []).append(section)


def check(cfg, params: PruneParams, source) -> None:
    check_text_source(cfg.data.calibration, "calibration")
    if source.architecture is not None:
        require_prunable(source.architecture)


def require_prunable(architecture: Optional[str]) -> tuple[PruneSlice, ...]:
    """The family's pruning table, or one line saying that it has none."""
    table = require_family(architecture, "prune").pruning
    if not table:
        prunable = sorted(name for name, family in FAMILIES.items() if family.pruning)
        raise SlimlmError(
            f"prune slices Llama-style blocks ({', '.join(prunable)}); '{architecture}' has other "
            "width-dependent tensors, so it cannot be pruned yet"
        )
    return table


PRUNE = Stage(name="prune", params=PruneParams, run=run, check=check)
