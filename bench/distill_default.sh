#!/usr/bin/env bash
# Distillation benchmark on the default model, 2 CPU cores, evaluated on the first 64 windows of
# 2048 tokens of WikiText-2 test (eval=slice64), trained on the Gutenberg corpus (data=shared):
#   prune-distill    the depth-and-width student (6 layers, hidden 384, MLP 1024, 2 kv groups),
#                    distilled with forward KL from the teacher's cached top-64 on 300k tokens;
#                    also measured as the teacher's speculative draft before and after
#   prune-finetune   the same student and tokens, plain cross-entropy (the baseline)
#   w4-lora-recover  w4 g64 GPTQ, then rank-16 LoRA adapters distilled on the frozen codes (64k tokens)
#   draft            a 4-layer student distilled to serve as the teacher's draft
# then bench/distill_summary.py adds the share of the perplexity gap each training closed. About
# 75 minutes; resumable (finished runs are kept; see bench/run_recipes.sh). DISTILL_RECIPES
# chooses a subset.
set -euo pipefail
cd "$(dirname "$0")/.."
recipes=${DISTILL_RECIPES:-prune-distill prune-finetune w4-lora-recover draft}
BENCH_COMMAND="${DISTILL_RECIPES:+DISTILL_RECIPES='$DISTILL_RECIPES' }bash bench/distill_default.sh $*" \
  bash bench/run_recipes.sh distill_default $recipes -- "$@"
.venv/bin/python bench/distill_summary.py
