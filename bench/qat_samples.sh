#!/usr/bin/env bash
# bench/qat_default.sh's recipes (w3-qat, w4-qat, w2-qat: GPTQ, block-wise reconstruction, end-to-end
# scale training) calibrated and trained on text sampled from the default model itself
# (data=samples: 100k tokens, sampled once and cached) instead of the Gutenberg corpus; evaluated
# on the same 64 windows of WikiText-2 test. Resumable (bench/run_recipes.sh); QAT_RECIPES
# chooses a subset; arguments go to every run.
set -euo pipefail
cd "$(dirname "$0")/.."
recipes=${QAT_RECIPES:-w3-qat w4-qat w2-qat}
BENCH_COMMAND="${QAT_RECIPES:+QAT_RECIPES='$QAT_RECIPES' }bash bench/qat_samples.sh $*" \
  DATA=samples bash bench/run_recipes.sh qat_samples $recipes -- "$@"
