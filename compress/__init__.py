"""Compression stages and the methods behind them.

- quantize.py: the `quantize` stage; rtn.py, gptq.py and awq.py its methods (clipping.py their
  range search), mixed.py per-layer bit widths under a bits-per-weight budget.
- sparsify.py: the `sparsify` stage; sparsity.py its magnitude, Wanda and SparseGPT masks
  (unstructured or N:M).
- prune.py: the `prune` stage, structured depth and width pruning to a smaller dense model.
- calibration.py: calibration windows and sequential, layer-by-layer calibration; targets.py
  which layers a stage compresses (name patterns).
- offload.py, block_progress.py, calibrated_artifact.py, stream_rtn.py: checkpoints larger than
  memory, one decoder block at a time (resumable), straight into an artifact.
"""
