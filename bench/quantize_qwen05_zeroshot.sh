#!/usr/bin/env bash
# Zero-shot accuracy (eval=quick: the first 100 items of each task) of the Qwen2.5-Coder-0.5B
# rows of bench/quantize_qwen05.sh: fp32, w8 RTN, w4 g64 GPTQ and AWQ, SparseGPT 50% and mixed
# 3.5 bpw. Their perplexity, KL and size are in bench/results/quantize_qwen05.md (one window);
# this adds the tasks in about a third of the full protocol's time: the fp32 model's tasks are
# scored once (the w8-rtn recipe's fp32 row; the other recipes' fp32 rows come from the cached
# reference and are kept once), and the mixed row scores the artifact of
# bench/results/quantize_qwen05_mixed.md's run when it is still there instead of quantizing again.
# Resumable (see bench/run_recipes.sh). Extra arguments go to every slimlm run.
set -euo pipefail
cd "$(dirname "$0")/.."
name=quantize_qwen05_zeroshot
root=bench/runs/$name
export EVAL=quick BENCH_COMMAND="bash bench/$name.sh $*"
common=("eval.metrics=[zeroshot]" "$@")
recipes() {  # recipes FP32_METRICS RECIPE...: each recipe's fp32 row gets those metrics
  local fp32=$1; shift
  bash bench/run_recipes.sh "$name" "$@" -- model=qwen2.5-coder-0.5b "+recipe.stages.0.metrics=$fp32" "${common[@]}"
}
recipes "[perplexity,kl,zeroshot]" w8-rtn
others=(w4-gptq w4-awq sparse-sparsegpt-50)
recipes "[perplexity,kl]" "${others[@]}"
mixed_run=$root/mixed-3.5bpw mixed_artifact=bench/runs/quantize_qwen05_mixed/mixed-3.5bpw/artifact
if [ -d "$mixed_artifact" ]; then
  if ! grep -qs '"complete"' "$mixed_run/status.json"; then  # an interrupted run resumes in place
    .venv/bin/slimlm recipe=evaluate model=custom model.path="$mixed_artifact" eval=quick data=shared \
      "recipe.stages.0.label=mixed-3.5bpw-gptq" hydra.run.dir="$mixed_run" "${common[@]}"
  fi
else
  recipes "[perplexity,kl]" mixed-3.5bpw
fi
.venv/bin/python bench/publish.py "$name" "$root/w8-rtn" "${others[@]/#/$root/}" "$mixed_run" \
  --command "$BENCH_COMMAND" --notes "bench/$name.notes.md"
