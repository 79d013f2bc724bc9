#!/usr/bin/env bash
# Quantization benchmark on a second real model, Qwen2.5-Coder-0.5B-Instruct (model=qwen2.5-coder-0.5b,
# a mostly-Q5_0 GGUF dequantized to fp32; slimlm fetches it on first use): fp32 (each recipe's
# first evaluate stage); w8 RTN (LM head included, and with it this GGUF's untied embedding);
# w4 g64 symmetric GPTQ and AWQ; SparseGPT 50% unstructured; GPTQ with per-layer mixed
# precision at 3.5 bits per weight; then the GPTQ artifact's compressed-tensors export.
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
bash bench/run_recipes.sh "$name" w8-rtn w4-gptq w4-awq sparse-sparsegpt-50 mixed-3.5bpw -- "${args[@]}"
# The w4-gptq artifact's compressed-tensors export reloaded by transformers, scored on the same
# windows (bench/quantize_qwen05_ct.yaml): bench/results/quantize_qwen05_ct.md.
ct_dir=bench/runs/${name}_ct
if ! grep -qs '"complete"' "$ct_dir/status.json"; then
  rm -rf "$ct_dir"
  .venv/bin/slimlm recipe=bench/quantize_qwen05_ct.yaml model=custom model.path="bench/runs/$name/w4-gptq/artifact" eval=quick data=shared hydra.run.dir="$ct_dir" "$@"
fi
.venv/bin/python bench/publish.py "${name}_ct" "$ct_dir" --command "$BENCH_COMMAND" --notes "bench/${name}_ct.notes.md"
