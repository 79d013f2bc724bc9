#!/usr/bin/env bash
# Quantization benchmark on a second real model, Qwen2.5-Coder-0.5B-Instruct (model=qwen2.5-coder-0.5b,
# a mostly-Q5_0 GGUF dequantized to fp32; slimlm fetches it on first use): fp32 (each recipe's
# first evaluate stage); w8 RTN (LM head included; this GGUF's embedding is untied and stays
# fp32); w4 g64 symmetric GPTQ and AWQ; GPTQ with per-layer mixed precision at 3.5 bits per
# weight; SparseGPT 50% unstructured.
# Every row on eval=quick (the first 4 windows of 2048 tokens of WikiText-2 test, the first 100
# items of each zero-shot task) without its speed runs, which shared CPU cores make meaningless.
# The w8-rtn run goes first under /usr/bin/time -v: its peak RSS lands in
# bench/runs/quantize_qwen05/w8-rtn.time (see bench/quantize_qwen05.notes.md).
# Resumable (see bench/run_recipes.sh). Extra arguments go to every slimlm run; METRICS replaces
# the metric list, e.g. for a shorter run on a busy machine:
#     METRICS='[perplexity,kl,size]' bash bench/quantize_qwen05.sh eval.perplexity.max_windows=1
set -euo pipefail
cd "$(dirname "$0")/.."
name=quantize_qwen05
metrics=${METRICS:-[perplexity,kl,size,zeroshot]}
args=(model=qwen2.5-coder-0.5b "eval.metrics=$metrics" "$@")
export EVAL=quick
export BENCH_COMMAND="${METRICS:+METRICS='$METRICS' }bash bench/$name.sh $*"
w8_dir=bench/runs/$name/w8-rtn
if ! grep -qs '"complete"' "$w8_dir/status.json" && [ -x /usr/bin/time ]; then
  make setup
  rm -rf "$w8_dir"
  mkdir -p "bench/runs/$name"
  /usr/bin/time -v -o "bench/runs/$name/w8-rtn.time" \
    .venv/bin/slimlm recipe=w8-rtn eval=quick data=shared hydra.run.dir="$w8_dir" "${args[@]}"
fi
exec bash bench/run_recipes.sh "$name" w8-rtn w4-gptq w4-awq mixed-3.5bpw sparse-sparsegpt-50 -- "${args[@]}"
