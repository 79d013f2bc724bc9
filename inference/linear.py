"""The decoder's linear layers: each weight runs in the kernel its scheme allows.

  int4 or int8 with int8 activations on x86 CPUs with AVX2 at least (groups or rows a multiple of
      64 inputs) -> slimlm's own kernels (inference/kernels/int8_activations_cpu.cpp): activations
      rounded to int8 per 64 inputs, integer dot products; 1.2-2.5x torch's int4 and int8 kernels
      per layer at decode time (bench/results/decode_cpu.md)
  int4 on a GPU with gpu_int4="triton" (groups of 32/64/128, widths a multiple of 512) ->
      slimlm's Triton kernel (inference/gpu_kernels.py), reading the QuantLinear's own buffers;
      experimental until measured on a GPU (bench/decode_gpu.py times it beside tinygemm)
  int4, symmetric or not, groups of 32/64/128/256 -> torch's tinygemm int4 kernel
      (`_weight_int4pack_mm_for_cpu` on CPU, `_weight_int4pack_mm` on CUDA); it computes
      (q - 8) * scale + zero per group, so slimlm's (code - z) * scale maps to zero = (8 - z) * scale
  int8, one scale per output channel -> `_weight_int8pack_mm` (weight q = code - 128; an
      asymmetric zero point adds a per-row term times the sum of the input)
  anything else quantized (int2/int3, grouped int8, other group sizes) -> dequantize the packed
      codes for each call: memory stays at the scheme's size, speed is that of a dense matmul plus
      the unpacking
  float weights -> an ordinary matmul in the activation dtype

Layers that read the same input (q/k/v, gate/up) are fused into one layer when their schemes
agree: one kernel launch instead of three or two.

A LoRA adapter trained beside a layer's codes runs inside the int8-activation kernels' call;
beside any other kernel as a low-rank branch (LowRankAdapter). Fused layers fuse their adapters
too (stacked_adapters).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from slimlm.inference import cpu_kernels, gpu_kernels
from slimlm.packing import unpack_codes
from slimlm.qlinear import ADAPTER_BUFFERS, QuantLinear

TINYGEMM_GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 2


def tinygemm_fits(scheme, in_features: int) -> bool:
    """Whether torch's int4 kernel can hold a layer of this scheme and width."""
    return (
        scheme is not None
        and scheme.bits == 4
        and scheme.group_size in TINYGEMM_GROUPS
        and in_features % (INNER_K_TILES * 16) == 0
    )


def cuda_inner_k_tiles(in_features: int) -> int:
    """How many 16-input tiles the CUDA int4 kernel loads at once: 8 (16-byte loads, the
    fastest, what gpt-fast and torchao use) when the width allows, fewer otherwise."""
    return next(tiles for tiles in (8, 4, INNER_K_TILES) if in_features % (tiles * 16) == 0)


def tinygemm_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """Stored int4 bytes (code 2j in the low nibble of byte j) -> the CUDA kernel's input (code
    2j in the high nibble): a nibble swap, so converting the largest layer (an 8B model's LM
    head) needs one byte-sized copy rather than a byte per code."""
    return (qweight << 4) | (qweight >> 4)


def int8pack_fits(scheme) -> bool:
    """Whether torch's int8 kernel can hold a layer of this scheme (one scale per row)."""
    return scheme is not None and scheme.bits == 8 and scheme.group_size is None


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Int4Linear(nn.Module):
    def __init__(self, layer: QuantLinear, dtype: torch.dtype, device: torch.device):
        super().__init__()
        scheme = layer.scheme
        self.in_features, self.out_features, self.group_size = (
            layer.in_features,
            layer.out_features,
            scheme.group_size,
        )
        scales = layer.scales.to(device=device, dtype=torch.float32)
        zeros = (
            (8 - layer.zeros.to(device=device, dtype=torch.float32)) * scales
            if layer.zeros is not None
            else torch.zeros_like(scales)
        )
        if device.type == "cuda":
            packed = torch._convert_weight_to_int4pack(
                tinygemm_bytes(layer.qweight.to(device)), cuda_inner_k_tiles(self.in_features)
            )
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(
                unpack_codes(layer.qweight, 4).to(torch.int32), INNER_K_TILES
            )
        self.register_buffer("weight", packed)
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        )
        self.register_buffer(
            "bias", None if layer.bias is None else layer.bias.detach().to(device=device, dtype=dtype)
        )

    @staticmethod
    def supports(layer: QuantLinear, dtype: torch.dtype, device: torch.device) -> bool:
        """The scheme fits; on a GPU also bf16 activations, rows a multiple of 8 and an Ampere or
        newer chip (what the CUDA kernel reads, tiles and is built for)."""
        if not tinygemm_fits(layer.scheme, layer.in_features):
            return False
        if device.type != "cuda":
            return True
        return (
            dtype == torch.bfloat16
            and layer.out_features % 8 == 0
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = torch._weight_int4pack_mm if x.is_cuda else torch._weight_int4pack_mm_for_cpu
        y = matmul(
            _as_2d(x).to(self.scales_and_zeros.dtype), self.weight, self.group_size, self.scales_and_zeros
        )
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8ActivationLinear(nn.Module):
    """int4 or int8 weights (groups of 32 or multiples of 64) times activations rounded to int8
    per block of 64 inputs (x86 CPUs with AVX512-VNNI, AVX-VNNI or AVX2; inference/cpu_kernels.py),
    and the layer's LoRA adapter in the same call. Its layout can be read row by row, so a tied
    head also serves as the embedding table without a second copy."""

    def __init__(self, layer: QuantLinear, dtype: torch.dtype, device: torch.device):
        super().__init__()
        scheme = layer.scheme
        self.in_features, self.out_features, self.dtype, self.bits = (
            layer.in_features,
            layer.out_features,
            dtype,
            scheme.bits,
        )
        self.group_size = cpu_kernels.group_size(scheme, layer.in_features)
        scales = layer.scales.to(device=device, dtype=torch.bfloat16).view(layer.out_features, -1)
        self.register_buffer("weight", cpu_kernels.pack(layer.codes().to(device), self.bits))
        self.register_buffer("scales", cpu_kernels.tile_groups(scales))
        # Offsets (zero point times scale) only where the zero points vary: a symmetric scheme's
        # zero point is the kernel's constant, which saves 2 bytes a group.
        offsets = (
            None
            if layer.zeros is None
            else cpu_kernels.tile_groups(
                (layer.zeros.to(device=device, dtype=torch.float32).view_as(scales) * scales.float()).to(
                    torch.bfloat16
                )
            )
        )
        self.register_buffer("offsets", offsets)
        self.zero_point = scheme.symmetric_zero
        self.register_buffer(
            "bias", None if layer.bias is None else layer.bias.detach().to(device=device, dtype=dtype)
        )
        adapter = (
            cpu_kernels.pack_adapter(layer.lora_a, layer.lora_b) if layer.adapter_rank else (None, None, None)
        )
        for name, value in zip(("lora_down", "lora_up", "lora_tiles"), adapter):
            self.register_buffer(name, None if value is None else value.to(device))

    @staticmethod
    def supports(layer: QuantLinear, dtype: torch.dtype, device: torch.device) -> bool:
        """CPU, fp32 or bf16 activations (what the kernel reads), a layout that fits, and a
        processor and compiler that can run the kernel."""
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return False
        return (
            cpu_kernels.fits(layer.scheme, layer.out_features, layer.in_features) and cpu_kernels.available()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        matmul = getattr(cpu_kernels.ops(), cpu_kernels.OPS[self.bits])
        y = matmul(
            _as_2d(x).to(self.dtype),
            self.weight,
            self.scales,
            self.offsets,
            self.group_size,
            self.lora_down,
            self.lora_up,
            self.lora_tiles,
        )
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows `ids` dequantized (the embedding of a model whose head this is)."""
        codes = cpu_kernels.unpack_rows(self.weight, ids).to(dtype).view(len(ids), -1, self.group_size)
        scales = cpu_kernels.untile_groups(self.scales, ids).to(dtype).unsqueeze(-1)
        offsets = (
            scales * self.zero_point
            if self.offsets is None
            else cpu_kernels.untile_groups(self.offsets, ids).to(dtype).unsqueeze(-1)
        )
        return (codes * scales - offsets).view(len(ids), self.in_features)


class Int8Linear(nn.Module):
    """int8 weights, one scale per output channel, bf16/fp32 activations (torch's kernel)."""

    def __init__(self, layer: QuantLinear, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.register_buffer(
            "weight", (layer.codes().to(device) ^ 0x80).view(torch.int8)
        )  # code - 128 as int8: flip the top bit
        scales = layer.scales.to(device=device, dtype=torch.float32).view(-1)
        self.register_buffer("scales", scales.to(dtype))
        offset = (
            None
            if layer.zeros is None
            else ((128 - layer.zeros.to(device=device, dtype=torch.float32).view(-1)) * scales).to(dtype)
        )
        self.register_buffer("offset", offset)
        self.register_buffer(
            "bias", None if layer.bias is None else layer.bias.detach().to(device=device, dtype=dtype)
        )

    @staticmethod
    def supports(layer: QuantLinear) -> bool:
        return int8pack_fits(layer.scheme)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _as_2d(x).to(self.scales.dtype)
        y = torch._weight_int8pack_mm(x2, self.weight, self.scales)
        if self.offset is not None:
            y = y + x2.sum(-1, keepdim=True) * self.offset
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows `ids` dequantized (the embedding of a model whose head this is)."""
        rows = self.weight[ids].to(dtype) * self.scales[ids, None].to(dtype)
        return rows if self.offset is None else rows + self.offset[ids, None].to(dtype)


class DequantLinear(nn.Module):
    """Any QuantLinear scheme: keep the packed codes, dequantize them on each call."""

    def __init__(self, layer: QuantLinear, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer = QuantLinear(
            layer.in_features, layer.out_features, layer.scheme, bias=layer.bias is not None
        ).to(device)
        self.layer.load_state_dict(
            {key: value for key, value in layer.state_dict().items() if key not in ADAPTER_BUFFERS}
        )  # an adapter runs beside: LowRankAdapter
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.to(self.dtype))

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.layer.dequantize(dtype, rows=ids)


class Int4MatvecLinear(DequantLinear):
    """int4 on a GPU through slimlm's Triton kernel (inference/gpu_kernels.py) at decode time
    (up to MAX_ROWS input rows); a prefill chunk dequantizes the weight and calls cuBLAS. The
    packed codes are kept as stored, so a tied head is read by rows as the embedding too."""

    @staticmethod
    def supports(layer: QuantLinear, dtype: torch.dtype, device: torch.device) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and gpu_kernels.fits(layer.scheme.bits, layer.scheme.group_size, layer.in_features)
            and gpu_kernels.available()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer, x2 = self.layer, _as_2d(x).to(self.dtype)
        if x2.shape[0] > gpu_kernels.MAX_ROWS:
            return super().forward(x)
        y = torch.ops.slimlm.int4_matvec(
            x2, layer.qweight, layer.scales, layer.zeros, layer.scheme.group_size, layer.scheme.symmetric_zero
        )
        y = y.view(*x.shape[:-1], layer.out_features)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)


class DenseLinear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.register_buffer("weight", weight.detach().to(device=device, dtype=dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[ids].to(dtype)


def is_two_four(weight: torch.Tensor) -> bool:
    """True when every run of four consecutive inputs of every row holds at most two nonzeros."""
    return weight.shape[-1] % 4 == 0 and bool(
        ((weight.reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 2).all()
    )


def semi_sparse_fits(weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    """torch's semi-structured (2:4) kernels: CUDA GPUs with sparse tensor cores (compute
    capability 8.0 or newer), fp16/bf16, both dimensions multiples of 64."""
    if (
        device.type != "cuda"
        or dtype not in (torch.float16, torch.bfloat16)
        or any(size % 64 for size in weight.shape)
    ):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0) and is_two_four(weight)


class SemiSparseLinear(nn.Module):
    """A 2:4-sparse float weight compressed for the GPU's sparse tensor cores (half the multiply
    work and about 56% of the dense weight's bytes; cuSPARSELt or CUTLASS through torch)."""

    def __init__(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        from torch.sparse import to_sparse_semi_structured

        self.weight = nn.Parameter(
            to_sparse_semi_structured(weight.detach().to(device=device, dtype=dtype).contiguous()),
            requires_grad=False,
        )
        self.register_buffer("bias", None if bias is None else bias.detach().to(device=device, dtype=dtype))
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.weight.dtype)
        return F.linear(flat, self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def fuse(layers: Sequence[nn.Module]) -> nn.Module:
    """One layer computing the concatenated outputs of `layers` (same input), when possible:
    quantized layers of one scheme are stacked row-wise (packing runs along the inputs, so rows
    concatenate); float layers likewise. Mixed schemes come back as a concatenating wrapper."""
    if len(layers) == 1:
        return layers[0]
    first = layers[0]
    if (
        all(isinstance(layer, QuantLinear) for layer in layers)
        and len({layer.scheme for layer in layers}) == 1
    ):
        biases = [layer.bias for layer in layers]
        fused = QuantLinear(
            first.in_features,
            sum(layer.out_features for layer in layers),
            first.scheme,
            bias=biases[0] is not None,
        )
        fused.qweight = torch.cat([layer.qweight for layer in layers])
        fused.scales = torch.cat([layer.scales for layer in layers])
        fused.zeros = None if first.zeros is None else torch.cat([layer.zeros for layer in layers])
        if biases[0] is not None:
            fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]))
        if any(layer.adapter_rank for layer in layers):
            fused.add_adapter(*stacked_adapters(layers))
        return fused
    if all(isinstance(layer, nn.Linear) for layer in layers):
        fused = nn.Linear(
            first.in_features,
            sum(layer.out_features for layer in layers),
            bias=first.bias is not None,
            device="meta",
        )
        fused.weight = nn.Parameter(
            torch.cat([layer.weight.detach() for layer in layers]), requires_grad=False
        )
        if first.bias is not None:
            fused.bias = nn.Parameter(
                torch.cat([layer.bias.detach() for layer in layers]), requires_grad=False
            )
        return fused
    return Concat(layers)


def stacked_adapters(layers: Sequence[QuantLinear]) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapters of layers that read one input as one adapter of their fused layer: the
    down-projections stacked, the up-projections on a block diagonal (a layer without an
    adapter takes rank 0)."""
    dtype = next(layer.lora_a.dtype for layer in layers if layer.adapter_rank)
    downs = [
        layer.lora_a.to(dtype) if layer.adapter_rank else torch.zeros(0, layer.in_features, dtype=dtype)
        for layer in layers
    ]
    ups = [
        layer.lora_b.to(dtype) if layer.adapter_rank else torch.zeros(layer.out_features, 0, dtype=dtype)
        for layer in layers
    ]
    return torch.cat(downs), torch.block_diag(*ups)


class LowRankAdapter(nn.Module):
    """A quantized layer's kernel plus the LoRA adapter trained beside its frozen codes:
    y = base(x) + (x A^T) B^T, two thin matmuls. On a CPU they run in float32: a one-row bf16
    matmul this thin takes oneDNN about 6x as long as float32 (75-95 us against 13-23 us for the
    default model's shapes), which at 120 adapted layers would more than halve the decode speed."""

    def __init__(
        self, base: nn.Module, down: torch.Tensor, up: torch.Tensor, dtype: torch.dtype, device: torch.device
    ):
        super().__init__()
        self.base = base
        adapter_dtype = torch.float32 if device.type == "cpu" else dtype
        self.register_buffer("down", down.detach().to(device=device, dtype=adapter_dtype))
        self.register_buffer("up", up.detach().to(device=device, dtype=adapter_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        low = F.linear(x.to(self.down.dtype), self.down)
        return y + F.linear(low, self.up).to(y.dtype)


class Concat(nn.Module):
    """Layers of different schemes that read one input: run each, concatenate the outputs."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


GPU_INT4_KERNELS = ("tinygemm", "triton")


def build_linear(
    layer: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    kernels: bool = True,
    int8_activations: bool = False,
    gpu_int4: str = "tinygemm",
    semi_sparse: bool = True,
) -> nn.Module:
    """The fastest decoder layer for a transformers Linear, QuantLinear or a `Concat` of them;
    `kernels=False` forces the dequantizing path (the reference the kernels are tested against);
    `gpu_int4` picks the int4 kernel on a GPU (GPU_INT4_KERNELS); `semi_sparse=False` keeps a
    2:4-sparse float weight dense (a layer streamed from host memory is copied as plain bytes,
    which torch's compressed sparse tensor is not)."""
    if isinstance(layer, Concat):
        return Concat(
            [
                build_linear(part, dtype, device, kernels, int8_activations, gpu_int4, semi_sparse)
                for part in layer.parts
            ]
        )
    if isinstance(layer, QuantLinear):
        base = quantized_kernel(layer, dtype, device, kernels, int8_activations, gpu_int4)
        if not layer.adapter_rank or isinstance(
            base, Int8ActivationLinear
        ):  # that kernel runs the adapter itself
            return base
        return LowRankAdapter(base, layer.lora_a, layer.lora_b, dtype, device)
    if kernels and semi_sparse and semi_sparse_fits(layer.weight, dtype, device):
        return SemiSparseLinear(layer.weight, layer.bias, dtype, device)
    return DenseLinear(layer.weight, layer.bias, dtype, device)


def quantized_kernel(
    layer: QuantLinear,
    dtype: torch.dtype,
    device: torch.device,
    kernels: bool,
    int8_activations: bool,
    gpu_int4: str,
) -> nn.Module:
    """The kernel layer for a QuantLinear's codes (the caller adds an adapter beside the ones
    that do not run it themselves)."""
    if kernels and gpu_int4 == "triton" and Int4MatvecLinear.supports(layer, dtype, device):
        return Int4MatvecLinear(layer, dtype, device)
    if kernels and int8_activations and Int8ActivationLinear.supports(layer, dtype, device):
        return Int8ActivationLinear(layer, dtype, device)
    if kernels and Int4Linear.supports(layer, dtype, device):
        return Int4Linear(layer, dtype, device)
    if kernels and Int8Linear.supports(layer):
        return Int8Linear(layer, dtype, device)
    return DequantLinear(layer, dtype, device)


def kernel_name(layer: nn.Module) -> str:
    if isinstance(layer, Concat):
        return "+".join(kernel_name(part) for part in layer.parts)
    if isinstance(layer, LowRankAdapter):
        return f"{kernel_name(layer.base)}+lora"
    if isinstance(layer, Int8ActivationLinear):
        return f"int{layer.bits}-int8act" + ("" if layer.lora_down is None else "+lora")
    return {
        Int4Linear: "int4-tinygemm",
        Int4MatvecLinear: "int4-triton",
        Int8Linear: "int8-pack",
        DequantLinear: "dequant",
        DenseLinear: "dense",
        SemiSparseLinear: "2:4-sparse",
    }[type(layer)]
