"""Compression stages: quantization now; sparsity and structured pruning join later."""
