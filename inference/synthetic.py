"""A decoder of any Llama-family shape with random weights, built one layer at a time on the
device it runs on: speed and memory of shapes (Llama-3-8B, 70B) measured without a checkpoint,
a download, a quantization pass or an fp copy of the model anywhere.

Quantized layers get uniformly random codes and scales sized so activations keep a stable
scale through the layers (random, not meaningful: for timing and memory only). The layers pass
through the same DecoderParts as a loaded artifact's, so they run in the same kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from slimlm.inference.build import DecoderParts
from slimlm.inference.model import Transformer
from slimlm.inference.streaming import Placement
from slimlm.qlinear import QuantLinear, QuantScheme, set_submodule, tie_quantized_head

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def transformers_config(config: dict):
    """The transformers config object of an HF-style config dict."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        config["model_type"], **{key: value for key, value in config.items() if key != "model_type"}
    )


def random_linear(
    in_features: int,
    out_features: int,
    scheme: Optional[QuantScheme],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> nn.Module:
    """A QuantLinear (or, with no scheme, an nn.Linear in `dtype`) with random weights of
    standard deviation about 1/sqrt(in_features), made on `device`."""
    std = in_features**-0.5
    with torch.device(device):
        if scheme is None:
            layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
            nn.init.normal_(layer.weight, std=std, generator=generator)
        else:
            layer = QuantLinear(in_features, out_features, scheme, bias=bias)
            layer.qweight.random_(
                0, 256, generator=generator
            )  # every bit pattern: uniform codes at any width
            code_std = (2**scheme.bits) / 12**0.5  # of codes uniform over 0 .. 2^bits - 1
            layer.scales.uniform_(0.5 * std / code_std, 1.5 * std / code_std, generator=generator)
            if layer.zeros is not None:
                layer.zeros.fill_(scheme.symmetric_zero)
        if bias:
            layer.bias.data.zero_()
    return layer.requires_grad_(False)


def randomize_linears(
    layer: nn.Module,
    scheme: Optional[QuantScheme],
    dtype: torch.dtype,
    device: torch.device,
    generator: torch.Generator,
) -> None:
    """Replace each of a decoder layer's LINEARS (the meta skeleton's) with random_linear's of
    its shape and bias. A layer without one (a mixture of experts') is refused: the builders
    here make dense Llama-family layers only."""
    for name in LINEARS:
        try:
            meta = layer.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"{type(layer).__name__} has no {name}: random models are made of dense Llama-family layers "
                "only"
            ) from None
        set_submodule(
            layer,
            name,
            random_linear(
                meta.in_features, meta.out_features, scheme, meta.bias is not None, dtype, device, generator
            ),
        )


def random_model(
    config: dict,
    scheme: QuantScheme,
    head_scheme: Optional[QuantScheme] = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, dict]]:
    """An HF model of `config` with random weights in its stored form, made one layer at a time on
    the CPU (peak memory: the quantized model, never an fp copy of it): every decoder Linear a
    QuantLinear in `scheme`, the LM head in `head_scheme` (None: float), norms of ones. With the
    quantization schemes by module name, it is what save_artifact and export_gguf take, so a
    benchmark can hand the same weights to slimlm and to llama.cpp at sizes whose fp32 copy would
    not fit in memory."""
    from transformers import AutoModelForCausalLM

    cpu = torch.device("cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(config), dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    schemes: dict[str, dict] = {}
    for index, layer in enumerate(model.model.layers):
        randomize_linears(layer, scheme, dtype, cpu, generator)
        schemes.update({f"model.layers.{index}.{name}": scheme.to_dict() for name in LINEARS})
    head = model.get_output_embeddings()
    model.set_output_embeddings(
        random_linear(head.in_features, head.out_features, head_scheme, False, dtype, cpu, generator)
    )
    if head_scheme is not None:
        schemes["lm_head"] = head_scheme.to_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and head_scheme is not None:
        tie_quantized_head(model)
    elif tied:
        model.get_input_embeddings().weight = model.get_output_embeddings().weight
    else:
        table = model.get_input_embeddings()
        table.weight = nn.Parameter(
            torch.empty(table.weight.shape, dtype=dtype).normal_(generator=generator), requires_grad=False
        )
    materialize_rest(model, dtype)
    return model.eval(), schemes


def materialize_rest(model: nn.Module, dtype: torch.dtype) -> None:
    """What is still on the meta device after the Linears and embeddings were made: 1-D
    parameters (norms of ones, biases of zeros) and rotary embeddings (built again on the CPU,
    which recomputes their frequencies). A matrix left there (a mixture of experts' experts) is
    an error: this builder makes the dense layers of LINEARS only."""
    for module_name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            set_submodule(model, module_name, type(module)(module.config))
            continue
        for name, parameter in list(module.named_parameters(recurse=False)):
            if not parameter.is_meta:
                continue
            if parameter.dim() != 1:
                raise ValueError(
                    f"{module_name}.{name} {tuple(parameter.shape)} is not a layer random_model makes: "
                    "random models are made of dense Llama-family layers only"
                )
            fill = torch.ones if "norm" in type(module).__name__.lower() else torch.zeros
            setattr(module, name, nn.Parameter(fill(parameter.shape, dtype=dtype), requires_grad=False))


def random_decoder(
    config: dict,
    scheme: Optional[QuantScheme],
    head_scheme: Optional[QuantScheme] = None,
    dtype: torch.dtype = torch.bfloat16,
    device: Optional[torch.device] = None,
    kernels: bool = True,
    gpu_int4: str = "tinygemm",
    placement: Placement = Placement(),
    seed: int = 0,
) -> Transformer:
    """The decoder of an HF-style `config` (dict) with random weights: every decoder Linear in
    `scheme` (None: float in `dtype`), the LM head in `head_scheme`; `placement` keeps some of
    it in host memory (inference/streaming.py). Peak memory while
    building is the device-resident decoder plus one layer in its stored form."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device or "cpu")
    with torch.device("meta"):  # the skeleton: shapes and module names, no memory
        skeleton = AutoModelForCausalLM.from_config(transformers_config(config), dtype=dtype)
    parts = DecoderParts(
        skeleton, dtype, device, kernels, int8_activations=False, gpu_int4=gpu_int4, placement=placement
    )
    generator = torch.Generator(device).manual_seed(seed)
    ones = lambda dim: nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)  # noqa: E731
    blocks = []
    for index, layer in enumerate(skeleton.model.layers):
        randomize_linears(layer, scheme, dtype, device, generator)
        layer.input_layernorm.weight = ones(parts.args.dim)
        layer.post_attention_layernorm.weight = ones(parts.args.dim)
        blocks.append(parts.block(index, layer))
        layer.to("meta")  # the block holds its own layout now
    skeleton.model.norm.weight = ones(parts.args.dim)
    args = parts.args
    skeleton.set_output_embeddings(
        random_linear(args.dim, args.vocab_size, head_scheme, False, dtype, device, generator)
    )
    if args.tie_embeddings and head_scheme is not None:
        tie_quantized_head(skeleton)  # the embedding reads the head's codes, as a loaded artifact's does
    elif args.tie_embeddings:
        skeleton.get_input_embeddings().weight = skeleton.get_output_embeddings().weight
    else:
        # drawn on the host wherever it will live: the same values for either placement
        table = torch.empty(args.vocab_size, args.dim, dtype=dtype).normal_(
            generator=torch.Generator().manual_seed(seed)
        )
        skeleton.get_input_embeddings().weight = nn.Parameter(
            table if placement.table_on_host else table.to(device), requires_grad=False
        )
    return parts.assemble(blocks)
