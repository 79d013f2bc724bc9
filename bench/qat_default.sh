#!/usr/bin/env bash
# Quantization-aware training on the default model, 2 CPU cores, evaluated on the first 64
# windows of 2048 tokens of WikiText-2 test (eval=slice64), trained on the Gutenberg corpus
# (data=shared):
#   w3-qat   int3 g64 GPTQ, then its scales trained with the codes fixed: block by block
#            (reconstruct, 128 windows of 256 tokens, 2 passes), then end to end against the
#            original model (forward KL, offline top-64, 64k tokens)
# Each recipe's report has GPTQ's row before training and the trained row after, and each
# block's error before and after reconstruction. Resumable (bench/run_recipes.sh); QAT_RECIPES
# chooses a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
recipes=${QAT_RECIPES:-w3-qat}
BENCH_COMMAND="${QAT_RECIPES:+QAT_RECIPES='$QAT_RECIPES' }bash bench/qat_default.sh $*" \
  bash bench/run_recipes.sh qat_default $recipes -- "$@"
