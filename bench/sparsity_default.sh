#!/usr/bin/env bash
# Sparsity benchmark: the default model dense; magnitude, Wanda and SparseGPT at 50%
# unstructured and at 2:4; Wanda with OWL per-layer ratios at 50%; SparseGPT 50% followed by
# w4 g64 GPTQ (LM head int8), exported with bitmask storage. Every row on the same slice: the
# first 64 windows of 2048 tokens of WikiText-2 test (eval=slice64). About 80 minutes on 2 CPU
# cores; resumable (see bench/run_recipes.sh). Extra arguments go to every slimlm run.
set -euo pipefail
exec bash "$(dirname "$0")/run_recipes.sh" sparsity_default sparse-magnitude-50 sparse-wanda-50 sparse-sparsegpt-50 sparse-magnitude-2of4 sparse-wanda-2of4 sparse-sparsegpt-2of4 sparse-wanda-owl-50 sparse-sparsegpt-50-w4 -- "$@"
