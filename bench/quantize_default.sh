#!/usr/bin/env bash
# Quantization benchmark: the default model in fp32; w8 RTN (LM head included); w4 and w3 g64
# symmetric RTN / GPTQ / AWQ; GPTQ with per-layer mixed precision at 3.5 bits per weight; and
# bitsandbytes int8 and NF4 as peers. Every row on the same slice: the first 64 windows of 2048
# tokens of WikiText-2 test (eval=slice64). About 75 minutes on 2 CPU cores.
#
# Each recipe runs into bench/runs/quantize_default/<recipe>; a run that finished is kept, so an
# interrupted benchmark resumes where it stopped (delete a run's directory to redo it). Extra
# arguments go to every slimlm run.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
name=quantize_default
root=bench/runs/$name
recipes=(w8-rtn w4-rtn w4-gptq w4-awq w3-rtn w3-gptq w3-awq mixed-3.5bpw eval-peers)
for recipe in "${recipes[@]}"; do
  run_dir=$root/$recipe
  if grep -qs '"complete"' "$run_dir/status.json"; then
    echo "$recipe: finished earlier, kept"
    continue
  fi
  rm -rf "$run_dir"
  .venv/bin/slimlm recipe="$recipe" eval=slice64 data=shared hydra.run.dir="$run_dir" "$@"
done
.venv/bin/python bench/publish.py "$name" "${recipes[@]/#/$root/}" --command "bash bench/quantize_default.sh $*" --notes "bench/$name.notes.md"
