#!/usr/bin/env bash
# Quantization-aware training on the default model, 2 CPU cores, evaluated on the first 64
# windows of 2048 tokens of WikiText-2 test (eval=slice64), trained on the Gutenberg corpus
# (data=shared):
#   w3-qat   int3 g64 GPTQ, then its scales trained with the codes fixed: block by block
#            (reconstruct, 128 windows of 256 tokens, 2 passes), then end to end against the
#            original model (forward KL, offline top-64, 64k tokens)
#   w4-qat   the same for int4 g64
#   w2-qat   the same for int2 g64, asymmetric
# Each recipe's report has GPTQ's row, the row after the block-wise phase and the trained row,
# and each block's error before and after reconstruction. Resumable (bench/run_recipes.sh);
# QAT_RECIPES chooses a subset; arguments go to every run (the codes experiment of the notes:
# recipe.stages.3.codes_lr=0.03 recipe.stages.3.norm_lr=1e-3).
set -euo pipefail
cd "$(dirname "$0")/.."
recipes=${QAT_RECIPES:-w3-qat w4-qat w2-qat}
BENCH_COMMAND="${QAT_RECIPES:+QAT_RECIPES='$QAT_RECIPES' }bash bench/qat_default.sh $*" \
  bash bench/run_recipes.sh qat_default $recipes -- "$@"
