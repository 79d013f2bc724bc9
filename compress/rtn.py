"""Round-to-nearest weight quantization: the baseline every other method is measured against."""

from __future__ import annotations

import torch


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp16 scale per output channel (row).

    The scale is rounded to fp16 first and the integers are computed against that rounded
    scale, so dequantizing the stored pair gives exactly the weights we evaluated.
    """
    absmax = weight.detach().float().abs().amax(dim=1, keepdim=True)
    scales = (absmax / 127.0).clamp(min=torch.finfo(torch.float16).tiny).to(torch.float16)
    qweight = torch.round(weight.detach().float() / scales.float()).clamp(-127, 127).to(torch.int8)
    return qweight, scales
