"""slimlm's Triton int4 kernel, checked on the CPU in Triton's interpreter (TRITON_INTERPRET=1,
in a child process: the variable must be set before the kernel is defined) for every tile the
autotuner may pick, against the QuantLinear's dequantized weight in float64. Speed is a GPU's
question (bench/decode_gpu.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from slimlm.inference import gpu_kernels
    from slimlm.qlinear import QuantLinear, QuantScheme

    torch.manual_seed(0)
    checked = 0
    for symmetric, group, rows, out_features, in_features in \
((True, 64, 1, 40, 1024), (False, 32, 3, 24, 1536), (False, 128, 2, 72, 2048)):
        scheme = QuantScheme(bits=4, group_size=group, symmetric=symmetric)
        layer = QuantLinear(in_features, out_features, scheme)
        layer.qweight.random_(0, 256)
        layer.scales.uniform_(0.01, 0.02)
        if layer.zeros is not None:
            layer.zeros.random_(0, 16)
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        reference = x.double() @ layer.dequantize(torch.float64).t()
        for block_n, block_k, warps in gpu_kernels.TILES:
            for split in gpu_kernels.SPLITS:
                if not gpu_kernels.config_fits(block_k, split, in_features, group):
                    continue
                y = gpu_kernels.launch(x, layer.qweight, layer.scales, layer.zeros, \
group, scheme.symmetric_zero, (block_n, block_k, warps, split))
                error = ((y.double() - reference).norm() / reference.norm()).item()
                assert y.shape == (rows, out_features) and error < 1e-5, \
(symmetric, group, block_n, block_k, split, error)
                checked += 1
    print("checked", checked)
    """
)


def test_every_tile_computes_the_dequantized_product():
    result = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) >= 30
