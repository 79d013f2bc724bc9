#!/usr/bin/env bash
# A student that keeps its teacher's quality (recipe prune-distill-keep) on the default model,
# 2 CPU cores: 8 of 30 layers removed and the MLP narrowed to 1152, each block trained to give the
# teacher's hidden state after the layers it stands for (reconstruct), distilled with forward KL
# from the teacher's cached top-64 on 300k tokens of the Gutenberg corpus (data=shared), then
# w4 g64 GPTQ. Every model is evaluated on the first 64 windows of 2048 tokens of WikiText-2
# test (eval=slice64), the zero-shot tasks' first 100 items, and decode speed at batch 1 (bundled
# decoder, 16-token prompt, 128 new tokens, median of 5). bench/distill_summary.py then adds the
# share of the log-perplexity gap closed and the speed-up over the teacher. About 75 minutes;
# resumable (bench/run_recipes.sh); arguments go to the run.
#
# DATA=samples trains (and calibrates the GPTQ) on 100k tokens sampled from the teacher itself,
# three passes over them, into bench/results/distill_keep_samples.
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA:-shared}
name=distill_keep$( [ "$data" = shared ] || echo "_$data" )
BENCH_COMMAND="${DATA:+DATA=$DATA }bash bench/distill_keep.sh $*" DATA=$data bash bench/run_recipes.sh "$name" \
  prune-distill-keep -- eval.speed.new_tokens=128 eval.speed.repeats=5 "$@"
.venv/bin/python bench/distill_summary.py "$name"
